"""What goes into a release, decided on the workstation: the verified bundle, the device-side
zeroedge code (so the daemon that runs is the one that was tested with the bundle, and a rollback
restores both), the plugin sources for the on-device build, and the daemon's config (none in a
release of a model bundle, deployed with --serve: zeroedge serve runs it, not the daemon). Every file is
named by its sha256, so uploading moves only what the device's store lacks, and the release id is a
hash of the whole content: the same bundle + code + config is the same release."""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from zeroedge.bundle import MANIFEST, SIGNATURE, sha256_file
from zeroedge.errors import UserError

PKG = Path(__file__).resolve().parents[1]        # .../zeroedge
REPO = PKG.parent                                 # source checkout (plugins/, scripts/) when present
SERVE_UNIT_FILE = PKG / "systemd" / "zeroedge-serve.service"
DEFAULT_SERVE_PORT = 8000
DEFAULT_UNIT = """[Unit]
Description=zeroedge inference daemon
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
ExecStart=/usr/bin/env zeroedge daemon --config /etc/zeroedge/daemon.toml
Restart=on-failure
RestartSec=2

[Install]
WantedBy=multi-user.target
"""


@dataclass
class Entry:
    rel: str
    src: Path
    sha256: str
    bytes: int
    mode: int = 0o644


@dataclass
class Release:
    id: str
    entries: dict = field(default_factory=dict)      # rel -> Entry
    info: dict = field(default_factory=dict)          # release.json
    unit: str | None = DEFAULT_UNIT                   # the daemon's unit; None for a --serve release
    serve: dict | None = None                         # --serve: {"unit": text, "port": N}

    def files_payload(self) -> dict:
        return {e.rel: {"sha256": e.sha256, "bytes": e.bytes, "mode": e.mode} for e in self.entries.values()}

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.entries.values())


def _add(entries: dict, rel: str, src: Path, sha: str | None = None, mode: int | None = None):
    st = src.stat()
    entries[rel] = Entry(rel, src, sha or sha256_file(src), st.st_size,
                         mode or (0o755 if st.st_mode & 0o111 else 0o644))


def _walk(root: Path, skip=("__pycache__", "build", ".pytest_cache")):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        for fn in sorted(filenames):
            if fn.endswith((".pyc", ".tmp", ".onnx", ".engine", ".so")) or fn.startswith("."):
                continue
            yield Path(dirpath) / fn


def app_entries(entries: dict):
    for p in _walk(PKG):
        _add(entries, "app/zeroedge/" + p.relative_to(PKG).as_posix(), p)
    bp = REPO / "scripts" / "build_plugins"
    if bp.is_file() and (REPO / "plugins").is_dir():
        _add(entries, "app/scripts/build_plugins", bp)
        for p in _walk(REPO / "plugins"):
            _add(entries, "app/plugins/" + p.relative_to(REPO / "plugins").as_posix(), p)


def has_plugins() -> bool:
    return (REPO / "scripts" / "build_plugins").is_file() and (REPO / "plugins").is_dir()


def has_trt_backend() -> bool:
    """A TensorRT engine is built on the device only if this zeroedge has a TensorRT backend and its
    daemon accepts `backend = "tensorrt"` (checked with the daemon's own config validator)."""
    if not ((PKG / "backends" / "tensorrt.py").is_file() or (PKG / "backends" / "tensorrt").is_dir()):
        return False
    return validate_daemon_config({"daemon": {"bundle": "bundle", "backend": "tensorrt"}}) is None


def validate_daemon_config(cfg: dict) -> str | None:
    """None if the daemon's own validator (zeroedge.daemon.config.from_dict) accepts cfg, else why."""
    try:
        from zeroedge.daemon.config import from_dict
    except ImportError:
        return None
    try:
        from_dict(json.loads(json.dumps(cfg)), base=Path("/nonexistent-release"), path=Path("daemon.toml"))
    except UserError as e:
        return str(e)
    return None


# ---------------------------------------------------------------- daemon config (TOML)

def _load_toml(text: str) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def dump_toml(d: dict, prefix: str = "") -> str:
    """Small TOML writer (scalars, arrays, inline tables, nested tables)."""
    lines, tables = [], []
    for k, v in d.items():
        if isinstance(v, dict):
            tables.append((k, v))
        else:
            lines.append(f"{_key(k)} = {_toml_value(v)}")
    out = "\n".join(lines) + ("\n" if lines else "")
    for k, v in tables:
        name = f"{prefix}.{_key(k)}" if prefix else _key(k)
        out += f"\n[{name}]\n" + dump_toml(v, name)
    return out


def daemon_template(config: Path | None) -> dict:
    """The user's daemon TOML (--config), else the daemon's own example, else a minimal one."""
    path = config or (PKG / "daemon" / "example.toml")
    if config is not None and not Path(config).is_file():
        raise UserError(f"daemon config not found: {config}")
    if Path(path).is_file():
        try:
            return _load_toml(Path(path).read_text())
        except Exception as e:
            raise UserError(f"{path}: not valid TOML ({e})") from None
    return {}


def _on_device(root: str, path: str) -> str:
    return root.rstrip("/") + "/" + path.lstrip("/") if root not in ("", "/") else path


def daemon_config(template: dict, port: int, backend: str, root: str = "/", base: str = "/opt/zeroedge",
                  name: str | None = None) -> dict:
    """The release's daemon.toml (schema: zeroedge/daemon/config.py) from the template:
    - [daemon] bundle = "bundle": the release's own bundle (relative paths resolve against the
      config's folder, i.e. the release), backend = the one preflight chose;
    - [daemon] state_dir and [output] jsonl live outside releases, so the spool survives deploys and
      rollbacks (absolute paths are taken under the device root; default BASE/state);
    - [metrics] port from --metrics-port / the inventory;
    - an MQTT client_id left at its default gets the device name appended: two devices with one
      persistent-session id would throw each other off the broker."""
    cfg = json.loads(json.dumps(template))
    d = cfg.setdefault("daemon", {})
    d["bundle"] = "bundle"
    d["backend"] = backend
    sd = d.get("state_dir")
    d["state_dir"] = _on_device(root, sd) if isinstance(sd, str) and sd.startswith("/") else \
        _on_device(root, base.rstrip("/") + "/state")
    out = cfg.setdefault("output", {})
    js = out.get("jsonl")
    out["jsonl"] = _on_device(root, js) if isinstance(js, str) and js.startswith("/") else \
        d["state_dir"] + "/" + (js or "results.jsonl")
    cfg.setdefault("metrics", {})["port"] = int(port)
    cfg["metrics"].setdefault("host", "127.0.0.1")
    src = cfg.get("source")
    if name and isinstance(src, dict) and src.get("kind", "mqtt") == "mqtt" and \
            src.get("client_id", "zeroedge-daemon") == "zeroedge-daemon":
        src["client_id"] = f"zeroedge-daemon-{name}"
    return cfg


def metrics_port(template: dict, override: int | None) -> int:
    if override:
        return int(override)
    try:
        return int(template["metrics"]["port"])  # the daemon's default is 9108
    except (KeyError, TypeError, ValueError):
        return 9108


# ---------------------------------------------------------------- the release

def check_role(bundle: Path, manifest: dict, serve: bool) -> str:
    """The service a release of this bundle runs: "serve" (zeroedge serve, a model bundle, deploy
    --serve) or "daemon" (the sensor daemon, a sensor bundle); a UserError, before anything
    connects, when the bundle is not the kind that service runs (zeroedge.trust.role_problem)."""
    from zeroedge.trust import role_problem

    why = role_problem(manifest, serve)
    if why:
        raise UserError(f"{bundle} {why}")
    return "serve" if serve else "daemon"


def serve_spec(port: int) -> dict:
    """--serve: the zeroedge-serve.service template shipped with zeroedge and the port its server
    binds on the device's 127.0.0.1 (the device writes the ExecStart: zeroedge.deploy.remote)."""
    if not SERVE_UNIT_FILE.is_file():
        raise UserError(f"{SERVE_UNIT_FILE} is missing from this zeroedge install; reinstall zeroedge")
    return {"unit": SERVE_UNIT_FILE.read_text(), "port": int(port)}


def build_release(bundle: Path, manifest: dict, template: dict, port: int, backend: str, workdir: Path,
                  unit_file: Path | None = None, root: str = "/", base: str = "/opt/zeroedge",
                  name: str | None = None, serve: dict | None = None) -> Release:
    """A release of a sensor bundle runs the daemon: its daemon.toml (from `template`, metrics on
    `port`) and zeroedge.service. serve: serve_spec(...) for a release of a model bundle, which
    runs zeroedge-serve.service instead (no daemon, no daemon.toml); the spec is part of the
    release's identity, as the daemon's unit is."""
    bundle = Path(bundle)
    entries: dict = {}
    for rel, info in sorted(manifest["files"].items()):
        _add(entries, f"bundle/{rel}", bundle / rel, info["sha256"])
    _add(entries, f"bundle/{MANIFEST}", bundle / MANIFEST)
    if (bundle / SIGNATURE).is_file():
        _add(entries, f"bundle/{SIGNATURE}", bundle / SIGNATURE)
    app_entries(entries)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    unit = None
    if not serve:
        cfg = workdir / "daemon.toml"
        dc = daemon_config(template, port, backend, root, base, name)
        why = validate_daemon_config(dc)
        if why:
            raise UserError(f"the daemon config deploy would write is invalid: {why}")
        text = "# written by zeroedge deploy (schema: zeroedge/daemon/config.py)\n" + dump_toml(dc)
        if _load_toml(text) != dc:
            raise UserError("internal error: daemon.toml does not round-trip")
        cfg.unlink(missing_ok=True)
        with open(os.open(cfg, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(text)
        _add(entries, "daemon.toml", cfg, mode=0o600)   # a secret (the MQTT password): 0600 on the device
        unit_path = unit_file or PKG / "systemd" / "zeroedge.service"
        unit = unit_path.read_text() if unit_path.is_file() else DEFAULT_UNIT
    h = hashlib.sha256()
    for e in sorted(entries.values(), key=lambda e: e.rel):
        h.update(f"{e.rel}\0{e.sha256}\0{e.mode:o}\n".encode())
    if unit is not None:
        h.update(unit.encode())
    else:
        h.update(b"\0serve\0" + json.dumps(serve, sort_keys=True).encode())
    rid = h.hexdigest()[:12]
    from zeroedge import __version__

    info = {"id": rid, "bundle": bundle.resolve().name, "bundle_manifest_sha256": entries[f"bundle/{MANIFEST}"].sha256,
            "target": manifest.get("target"), "zeroedge_version": __version__,
            "backend": backend, "files": len(entries), "bytes": sum(e.bytes for e in entries.values())}
    info.update({"role": "serve", "serve_port": serve["port"]} if serve else {"metrics_port": port})
    rj = workdir / "release.json"
    rj.write_text(json.dumps(info, indent=2, sort_keys=True))
    _add(entries, "release.json", rj)
    return Release(rid, entries, info, unit, serve)
