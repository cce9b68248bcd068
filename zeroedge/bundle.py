"""Bundle manifest: what `zeroedge export` writes and what every consumer (runner, check, plan,
deploy, daemon) verifies before trusting a bundle. Torch-free.

manifest.json = {
  "format": "zeroedge-bundle", "format_version": 1,
  "zeroedge_version": "...", "opset": 18, "target": "jetpack-6.2", "plugin_abi": 1,
  "model": {...config...}, "calibration": {...summary...}, "plan": {...optional...},
  "files": {"relative/path": {"sha256": "...", "bytes": N}, ...}
}
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from zeroedge.errors import UserError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def write_manifest(bundle: Path, meta: dict) -> dict:
    """Hash every file under `bundle` (except the manifest) and write manifest.json atomically."""
    from zeroedge import __version__

    bundle = Path(bundle)
    files = {}
    for p in sorted(bundle.rglob("*")):
        if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp"):
            files[p.relative_to(bundle).as_posix()] = {"sha256": sha256_file(p),
                                                       "bytes": p.stat().st_size}
    manifest = {"format": "zeroedge-bundle", "format_version": FORMAT_VERSION,
                "zeroedge_version": __version__, **meta, "files": files}
    tmp = bundle / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    tmp.replace(bundle / MANIFEST)
    return manifest


def read_manifest(bundle: Path) -> dict:
    bundle = Path(bundle)
    if not bundle.is_dir():
        raise UserError(f"bundle not found: {bundle}")
    path = bundle / MANIFEST
    if not path.is_file():
        raise UserError(f"{bundle}: not a zeroedge bundle (no {MANIFEST})")
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: corrupt manifest ({e})") from None
    if m.get("format") != "zeroedge-bundle" or not isinstance(m.get("files"), dict):
        raise UserError(f"{path}: not a zeroedge bundle manifest")
    if m.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: bundle format {m.get('format_version')} is not supported "
                        f"(this zeroedge reads format {FORMAT_VERSION})")
    return m


def verify(bundle: Path) -> dict:
    """Return the manifest if every listed file is present with its hash; UserError otherwise."""
    bundle = Path(bundle)
    m = read_manifest(bundle)
    problems = []
    for rel, info in m["files"].items():
        p = bundle / rel
        if not p.is_file():
            problems.append(f"missing {rel}")
        elif p.stat().st_size != info.get("bytes") or sha256_file(p) != info.get("sha256"):
            problems.append(f"modified {rel}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise UserError(f"{bundle}: bundle verification failed ({shown}); re-export it")
    return m
