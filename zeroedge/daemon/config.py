"""The daemon's TOML configuration.

```toml
[daemon]
bundle = "/opt/zeroedge/sensor-bundle"   # required: a sensor bundle (zeroedge.bundle, kind=sensor)
state_dir = "/var/lib/zeroedge"          # spool.sqlite (WAL, synchronous=FULL) lives here
backend = "onnxruntime"                  # or "torch" (development; imports torch)
threads = 1                              # onnxruntime intra-op threads
infer_every = 1                          # run inference every N readings of a stream ...
infer_interval_s = 0.0                   # ... or every T seconds (0 = off)
max_payload_bytes = 65536                # larger MQTT/stdin/file payloads go to dead letters
batch_max = 512                          # readings per spool transaction / inference batch
keep_per_stream = 2048                   # processed readings kept per stream in the spool (>= window)
log_level = "info"                       # debug | info | warning | error

[source]
kind = "mqtt"                            # mqtt | file | stdin | simulator
# kind = "mqtt"
host = "127.0.0.1"
port = 1883
topic = "zeroedge/readings/#"            # payload: {"sensor": "s1", "seq": 17, "values": [52 floats], "ts": 1.7e9}
client_id = "zeroedge-daemon"            # persistent MQTT v5 session (clean_start=False) under this id
qos = 1
session_expiry_s = 604800
keepalive_s = 30
# username = "..." ; password = "..."
# kind = "file": path = "run.dat" (52-column text, one reading per row) or "readings.jsonl";
#                sensor = "file"; rate = 0.0 (readings/s, 0 = as fast as possible)
# kind = "stdin": JSON lines in the MQTT payload format
# kind = "simulator": tep-studio closed loop; fault = 0, seed = 0, onset_h = 8.0, hours = 48.0,
#                     sensor = "tep-sim", rate = 0.0

[output]
jsonl = "/var/lib/zeroedge/results.jsonl" # every result appended here (exactly once, in order)
mqtt_results_topic = ""                   # publish each result here ("" = off; needs an mqtt source
mqtt_alerts_topic = "zeroedge/alerts"     #  or [output] host/port to reach a broker)
# host = "127.0.0.1"; port = 1883        # broker for publishing when the source is not mqtt

[metrics]
port = 9108                              # /metrics (Prometheus text) and /healthz on 127.0.0.1
host = "127.0.0.1"
```

Relative paths are resolved against the config file's folder.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from zeroedge.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SOURCE_KINDS = ("mqtt", "file", "stdin", "simulator")

DEFAULTS = {
    "daemon": {"bundle": None, "state_dir": "state", "backend": "onnxruntime", "threads": 1,
               "infer_every": 1, "infer_interval_s": 0.0, "max_payload_bytes": 65536,
               "batch_max": 512, "keep_per_stream": 2048, "log_level": "info"},
    "source": {"kind": "mqtt", "host": "127.0.0.1", "port": 1883, "topic": "zeroedge/readings/#",
               "client_id": "zeroedge-daemon", "qos": 1, "session_expiry_s": 604800,
               "keepalive_s": 30, "username": None, "password": None,
               "path": None, "sensor": None, "rate": 0.0,
               "fault": 0, "seed": 0, "onset_h": 8.0, "hours": 48.0},
    "output": {"jsonl": "results.jsonl", "mqtt_results_topic": "", "mqtt_alerts_topic": "zeroedge/alerts",
               "host": None, "port": None},
    "metrics": {"port": 9108, "host": "127.0.0.1"},
}


@dataclass
class Config:
    daemon: dict
    source: dict
    output: dict
    metrics: dict
    path: Path = field(default=None)

    @property
    def bundle(self) -> Path:
        return Path(self.daemon["bundle"])

    @property
    def state_dir(self) -> Path:
        return Path(self.daemon["state_dir"])


def _resolve(base: Path, p):
    if p is None or p == "":
        return p
    p = Path(p).expanduser()
    return p if p.is_absolute() else (base / p)


def from_dict(raw: dict, base: Path = Path("."), path: Path = None) -> Config:
    where = str(path or "config")
    unknown = set(raw) - set(DEFAULTS)
    if unknown:
        raise UserError(f"{where}: unknown section(s) {sorted(unknown)} (known: {sorted(DEFAULTS)})")
    sec = {}
    for name, defaults in DEFAULTS.items():
        got = raw.get(name, {})
        if not isinstance(got, dict):
            raise UserError(f"{where}: [{name}] must be a table")
        bad = set(got) - set(defaults)
        if bad:
            raise UserError(f"{where}: unknown key(s) in [{name}]: {sorted(bad)}")
        merged = dict(defaults)
        merged.update(got)
        sec[name] = merged
    d, s = sec["daemon"], sec["source"]
    if not d["bundle"]:
        raise UserError(f"{where}: [daemon] bundle is required (a sensor bundle folder)")
    if s["kind"] not in SOURCE_KINDS:
        raise UserError(f"{where}: [source] kind must be one of {SOURCE_KINDS}, got {s['kind']!r}")
    if s["kind"] == "file" and not s["path"]:
        raise UserError(f"{where}: [source] kind = \"file\" needs path")
    if d["backend"] not in ("onnxruntime", "torch"):
        raise UserError(f"{where}: [daemon] backend must be onnxruntime or torch")
    for key in ("infer_every", "batch_max", "max_payload_bytes", "keep_per_stream", "threads"):
        if not isinstance(d[key], int) or d[key] < 1:
            raise UserError(f"{where}: [daemon] {key} must be a positive integer")
    if not isinstance(sec["metrics"]["port"], int) or not 0 <= sec["metrics"]["port"] < 65536:
        raise UserError(f"{where}: [metrics] port must be an integer port number")
    d["bundle"] = _resolve(base, d["bundle"])
    d["state_dir"] = _resolve(base, d["state_dir"])
    s["path"] = _resolve(base, s["path"])
    sec["output"]["jsonl"] = _resolve(base, sec["output"]["jsonl"])
    return Config(path=path, **sec)


def load(path) -> Config:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: invalid TOML ({e})") from None
    return from_dict(raw, base=path.resolve().parent, path=path)
