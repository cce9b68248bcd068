"""Bundle manifest: what `zeroedge export` writes and what every consumer (runner, check, plan,
deploy, daemon) verifies before trusting a bundle. Torch-free.

manifest.json = {
  "format": "zeroedge-bundle", "format_version": 1,
  "zeroedge_version": "...", "opset": 18, "target": "jetpack-6.2", "plugin_abi": 1,
  "model": {...config...}, "calibration": {...summary...}, "plan": {...optional...},
  "files": {"relative/path": {"sha256": "...", "bytes": N}, ...}
}

A bundle holds regular files only: every files{} key is a plain relative path (no absolute path,
no '..', '.' or empty component, no backslash or control character: zeroedge.trust), and
links are refused (every path component is checked with lstat; files are opened with O_NOFOLLOW).

manifest.sig (optional, `zeroedge sign`): an Ed25519 signature over the exact bytes of
manifest.json, so an edit anywhere in the manifest is detected (format: zeroedge.trust).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from pathlib import Path

from zeroedge.trust import HEX64, SIG_FORMAT, key_id, path_problem, signature_problem
from zeroedge.errors import UserError, require

MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
FORMAT_VERSION = 1


# the prefill chunk a bundle's runners use unless told (manifest "prefill": {"chunk", "one_pass", "why",
# "multiple": the SIH block rule's block, when a layer has one: every chunk is a multiple of it});
# 512: the chunk's scores are [h, 512, past+512], a 16th of one pass at 8K, and on a 2-thread x86 CPU a chunk
# of 512 prefills as fast as one pass or faster (benchmarks/prefill.md)
DEFAULT_PREFILL_CHUNK = 512


def prefill_plan(manifest: dict, prefix_inputs: bool = True, chunk: int | None = None):
    """(chunk, why) for a bundle's prefill graph; chunk None means one pass: a graph without prefix
    inputs (exported before chunked prefill) or a manifest that says one_pass (SIH/PAD layers exported
    before their chunked form). `chunk` (a runner's or the planner's argument) overrides the manifest's,
    rounded up to the manifest's "multiple"."""
    pm = manifest.get("prefill") if isinstance(manifest.get("prefill"), dict) else None
    if not prefix_inputs or pm is None:
        return None, "one pass: the prefill graph has no prefix inputs (exported before chunked prefill)"
    if pm.get("one_pass"):
        return None, f"one pass: {pm.get('why') or 'the bundle says so'}"
    c = int(chunk if chunk is not None else (pm.get("chunk") or DEFAULT_PREFILL_CHUNK))
    if c < 1:
        raise UserError(f"prefill chunk must be >= 1 (got {c})")
    multiple = int(pm.get("multiple") or 1)
    if c % multiple:
        c = -(-c // multiple) * multiple
        return c, f"chunks of {c} tokens (a multiple of the SIH block rule's {multiple}-token blocks)"
    return c, f"chunks of {c} tokens"


def read_regular(path: Path) -> bytes:
    """The bytes of `path`, never through a link at its last component (OSError for a link)."""
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        return f.read()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def _link_problem(bundle: Path, rel: str) -> str | None:
    """None if every component of bundle/rel is a real directory and the last a regular file
    (lstat, so a link anywhere on the way is refused, not followed); else what is wrong."""
    p, parts = bundle, rel.split("/")
    for i, part in enumerate(parts):
        p = p / part
        here = "/".join(parts[:i + 1])
        try:
            mode = p.lstat().st_mode
        except FileNotFoundError:
            return f"missing {rel}"
        except OSError as e:
            return f"{here}: {e.strerror}"
        if stat.S_ISLNK(mode):
            return f"{here} is a link (a bundle holds regular files only)"
        if i < len(parts) - 1 and not stat.S_ISDIR(mode):
            return f"missing {rel}"
        if i == len(parts) - 1 and not stat.S_ISREG(mode):
            return f"{here} is not a regular file"
    return None


def write_manifest(bundle: Path, meta: dict) -> dict:
    """Hash every file under `bundle` (except manifest.json, manifest.sig and *.tmp) and write
    manifest.json atomically. A link or any other non-regular file is refused. A manifest.sig left
    from an earlier manifest is removed: it signed other bytes."""
    from zeroedge import __version__

    bundle = Path(bundle)
    files = {}
    for dirpath, dirnames, filenames in os.walk(bundle):   # does not descend into linked dirs
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            rel = p.relative_to(bundle).as_posix()
            mode = p.lstat().st_mode
            if stat.S_ISDIR(mode) or rel in (MANIFEST, SIGNATURE) or name.endswith(".tmp"):
                continue
            if not stat.S_ISREG(mode):
                kind = "a link" if stat.S_ISLNK(mode) else "not a regular file"
                raise UserError(f"{bundle}: {rel} is {kind}; a bundle holds regular files only")
            why = path_problem(rel)
            if why:
                raise UserError(f"{bundle}: cannot list {rel!r} in a manifest ({why})")
            files[rel] = {"sha256": sha256_file(p), "bytes": p.lstat().st_size}
    manifest = {"format": "zeroedge-bundle", "format_version": FORMAT_VERSION,
                "zeroedge_version": __version__, **meta, "files": files}
    tmp = bundle / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    tmp.replace(bundle / MANIFEST)
    (bundle / SIGNATURE).unlink(missing_ok=True)
    return manifest


def read_manifest(bundle: Path) -> dict:
    bundle = Path(bundle)
    if not bundle.is_dir():
        raise UserError(f"bundle not found: {bundle}")
    path = bundle / MANIFEST
    if not os.path.lexists(path):
        raise UserError(f"{bundle}: not a zeroedge bundle (no {MANIFEST})")
    why = _link_problem(bundle, MANIFEST)
    if why:
        raise UserError(f"{bundle}: {why}")
    try:
        m = json.loads(read_regular(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: corrupt manifest ({e})") from None
    if not isinstance(m, dict) or m.get("format") != "zeroedge-bundle" or not isinstance(m.get("files"), dict):
        raise UserError(f"{path}: not a zeroedge bundle manifest")
    if m.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: bundle format {m.get('format_version')} is not supported "
                        f"(this zeroedge reads format {FORMAT_VERSION})")
    for rel, info in m["files"].items():
        why = path_problem(rel) or ("a reserved name" if rel in (MANIFEST, SIGNATURE) else None)
        if why:
            raise UserError(f"{path}: unsafe file name {rel!r} in files ({why}); refusing the bundle")
        if not (isinstance(info, dict) and isinstance(info.get("sha256"), str) and HEX64.fullmatch(info["sha256"])
                and type(info.get("bytes")) is int and info["bytes"] >= 0):
            raise UserError(f"{path}: bad entry for {rel!r} in files (needs a lowercase hex sha256 and a byte count)")
    return m


def verify(bundle: Path) -> dict:
    """Return the manifest if every listed file is present, a regular file (no link on the way) and
    has its hash; UserError otherwise."""
    bundle = Path(bundle)
    m = read_manifest(bundle)
    problems = []
    for rel, info in m["files"].items():
        why = _link_problem(bundle, rel)
        if why:
            problems.append(why)
        elif (bundle / rel).lstat().st_size != info["bytes"] or sha256_file(bundle / rel) != info["sha256"]:
            problems.append(f"modified {rel}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise UserError(f"{bundle}: bundle verification failed ({shown}); re-export it")
    return m


# ---------------------------------------------------------------- signatures (cryptography on the workstation)

def load_signing_key(key_path: Path):
    """The Ed25519 private key at key_path (unencrypted PKCS8 PEM, as `zeroedge keygen` writes)."""
    require("cryptography", "deploy")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
    except OSError as e:
        raise UserError(f"signing key {key_path}: {e.strerror}") from None
    except (ValueError, TypeError) as e:
        raise UserError(f"{key_path}: not an unencrypted PEM private key ({e})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise UserError(f"{key_path}: not an Ed25519 key (make one with: zeroedge keygen -o KEY)")
    return key


def sign(bundle: Path, key_path: Path) -> str:
    """Write BUNDLE/manifest.sig: the Ed25519 signature of manifest.json's exact bytes by the private
    key at key_path. Returns the key id."""
    from cryptography.hazmat.primitives import serialization

    bundle = Path(bundle)
    key = load_signing_key(key_path)
    verify(bundle)                                  # sign only a bundle that matches its manifest
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    doc = {"format": SIG_FORMAT, "alg": "ed25519", "key_id": key_id(raw),
           "public_key": base64.b64encode(raw).decode(),
           "signature": base64.b64encode(key.sign(read_regular(bundle / MANIFEST))).decode()}
    tmp = bundle / (SIGNATURE + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(bundle / SIGNATURE)
    return doc["key_id"]


def signer(bundle: Path) -> str | None:
    """Key id of the bundle's signer, after checking manifest.sig against the public key it carries
    (so a manifest edited after signing is refused here); None for an unsigned bundle. Whether that
    key is trusted is the device's decision (its pinned keys)."""
    bundle = Path(bundle)
    if not os.path.lexists(bundle / SIGNATURE):
        return None
    why = _link_problem(bundle, SIGNATURE)
    if why:
        raise UserError(f"{bundle}: {why}")
    require("cryptography", "deploy")
    data = read_regular(bundle / SIGNATURE)
    try:
        raw = base64.b64decode(json.loads(data)["public_key"], validate=True)
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{bundle / SIGNATURE}: not a zeroedge manifest signature") from None
    why = signature_problem(read_regular(bundle / MANIFEST), data, {key_id(raw): raw})
    if why:
        raise UserError(f"{bundle}: {why}; re-sign it: zeroedge sign {bundle} --key KEY")
    return key_id(raw)
