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
keep_per_stream = 4096                   # readings kept per sensor in the spool: the dedup memory (a
                                         #  redelivery is recognised while its original is among its
                                         #  sensor's last N arrivals) and the restore window (>= window)
sensors = []                             # allowed sensor ids (fnmatch patterns, e.g. "line1-*"); [] = any
max_sensors = 1000                       # distinct sensors accepted; readings of more are dead-lettered
spool_give_up_s = 300.0                  # spool unwritable (locked, disk full) this long -> exit 1 (systemd
                                         #  restarts it; unacked MQTT readings are redelivered)
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
# username = "..." ; password = "..." or password_file = "mqtt.pass" (first line; keep both 0600)
# tls_ca = "ca.pem"                      # TLS to the broker (server certificate checked against this CA)
# tls_cert = "client.pem"; tls_key = "client.key"   # client certificate, when the broker asks for one
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
# username, password, password_file, tls_ca, tls_cert, tls_key: as in [source], for that broker

[metrics]
port = 9108                              # /metrics (Prometheus text) and /healthz on 127.0.0.1
host = "127.0.0.1"                       # "::1" for IPv6; a non-loopback address gets a warning
```

Relative paths are resolved against the config file's folder. A config (or password file) that
holds a password and is readable by other users gets a warning at start: keep it 0600.
"""
from __future__ import annotations

import ipaddress
import os
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
               "batch_max": 512, "keep_per_stream": 4096, "sensors": [], "max_sensors": 1000,
               "spool_give_up_s": 300.0, "log_level": "info"},
    "source": {"kind": "mqtt", "host": "127.0.0.1", "port": 1883, "topic": "zeroedge/readings/#",
               "client_id": "zeroedge-daemon", "qos": 1, "session_expiry_s": 604800,
               "keepalive_s": 30, "username": None, "password": None, "password_file": None,
               "tls_ca": None, "tls_cert": None, "tls_key": None,
               "path": None, "sensor": None, "rate": 0.0,
               "fault": 0, "seed": 0, "onset_h": 8.0, "hours": 48.0},
    "output": {"jsonl": "results.jsonl", "mqtt_results_topic": "", "mqtt_alerts_topic": "zeroedge/alerts",
               "host": None, "port": None, "username": None, "password": None, "password_file": None,
               "tls_ca": None, "tls_cert": None, "tls_key": None},
    "metrics": {"port": 9108, "host": "127.0.0.1"},
}


@dataclass
class Config:
    daemon: dict
    source: dict
    output: dict
    metrics: dict
    path: Path = field(default=None)
    warnings: list = field(default_factory=list)     # logged by the daemon at start

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
    for key in ("infer_every", "batch_max", "max_payload_bytes", "keep_per_stream", "threads", "max_sensors"):
        if not _is_int(d[key]) or d[key] < 1:
            raise UserError(f"{where}: [daemon] {key} must be a positive integer")
    if not _is_number(d["spool_give_up_s"]) or d["spool_give_up_s"] <= 0:
        raise UserError(f"{where}: [daemon] spool_give_up_s must be a positive number of seconds")
    if not isinstance(d["sensors"], list) or not all(isinstance(x, str) and x for x in d["sensors"]):
        raise UserError(f"{where}: [daemon] sensors must be a list of sensor ids or patterns")
    m = sec["metrics"]
    if not _is_int(m["port"]) or not 0 <= m["port"] < 65536:
        raise UserError(f"{where}: [metrics] port must be an integer port number")
    if not isinstance(m["host"], str) or not m["host"]:
        raise UserError(f"{where}: [metrics] host must be an address such as \"127.0.0.1\" or \"::1\"")
    warnings = []
    if not _is_loopback(m["host"]):
        warnings.append(f"[metrics] host = {m['host']!r} serves /metrics and /healthz beyond this host; "
                        "they carry plant data (sensor ids, alarm counts): prefer 127.0.0.1 behind a proxy")
    d["bundle"] = _resolve(base, d["bundle"])
    d["state_dir"] = _resolve(base, d["state_dir"])
    s["path"] = _resolve(base, s["path"])
    sec["output"]["jsonl"] = _resolve(base, sec["output"]["jsonl"])
    for name in ("source", "output"):
        _broker_auth(sec[name], name, base, where, path, warnings)
    return Config(path=path, warnings=warnings, **sec)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _exposed(path: Path) -> bool:
    """Readable or writable by users other than the owner and its group's readers (beyond 0640)."""
    try:
        return bool(os.stat(path).st_mode & 0o037)
    except OSError:
        return False


def _broker_auth(sec: dict, name: str, base: Path, where: str, path, warnings: list):
    """Credentials and TLS files of [source] / [output]: paths resolved and checked, the password
    read from password_file, a warning for a secret other users can read."""
    for key in ("username", "password", "password_file", "tls_ca", "tls_cert", "tls_key"):
        if sec[key] is not None and not isinstance(sec[key], str):
            raise UserError(f"{where}: [{name}] {key} must be a string")
    if sec["password"] and sec["password_file"]:
        raise UserError(f"{where}: [{name}] has both password and password_file; keep one")
    for key in ("password_file", "tls_ca", "tls_cert", "tls_key"):
        sec[key] = _resolve(base, sec[key]) or None
        if sec[key] is not None and not Path(sec[key]).is_file():
            raise UserError(f"{where}: [{name}] {key} not found: {sec[key]}")
    if sec["tls_key"] and not sec["tls_cert"]:
        raise UserError(f"{where}: [{name}] tls_key needs tls_cert (the client certificate)")
    if sec["password_file"]:
        pf = Path(sec["password_file"])
        try:
            lines = pf.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{where}: [{name}] password_file {pf}: {e}") from None
        if not lines or not lines[0]:
            raise UserError(f"{where}: [{name}] password_file {pf} is empty")
        sec["password"] = lines[0]
        if _exposed(pf):
            warnings.append(f"{pf} holds the MQTT password and other users can read it "
                            f"(mode {os.stat(pf).st_mode & 0o777:04o}); chmod 600 {pf}")
    elif sec["password"] and path is not None and _exposed(path):
        warnings.append(f"{path} holds the MQTT password ([{name}] password) and other users can read it "
                        f"(mode {os.stat(path).st_mode & 0o777:04o}); chmod 600 {path}, or use password_file")
    if sec["tls_key"] and _exposed(sec["tls_key"]):
        warnings.append(f"{sec['tls_key']} (the TLS client key) is readable by other users; chmod 600 {sec['tls_key']}")


def load(path) -> Config:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: invalid TOML ({e})") from None
    return from_dict(raw, base=path.resolve().parent, path=path)
