"""What the workstation and the device both check before trusting a bundle: safe relative paths,
Ed25519 manifest signatures against pinned public keys, and which service runs it (its role).

Standard library only (the `cryptography` package is imported lazily, only to check a signature),
because the device agent ships this file's source over SSH (zeroedge.deploy.ssh.agent_source). It
sits beside bundle.py, below deploy/, since bundle verification (workstation, daemon) uses it too.

manifest.sig = {"format": "zeroedge-manifest-signature", "alg": "ed25519", "key_id": "<16 hex>",
                "public_key": "<base64 raw key>", "signature": "<base64 over manifest.json's bytes>"}
A key id is the first 16 hex digits of the sha256 of the raw 32-byte public key.
"""
import base64
import hashlib
import json
import re

SIG_FORMAT = "zeroedge-manifest-signature"
# DER prefix of an Ed25519 SubjectPublicKeyInfo (RFC 8410); the raw key is the 32 bytes after it
ED25519_SPKI = bytes.fromhex("302a300506032b6570032100")
HEX64 = re.compile(r"[0-9a-f]{64}")


def path_problem(rel):
    """Why `rel` is not a safe relative path inside a bundle or release; None when it is."""
    if not isinstance(rel, str) or not rel:
        return "empty path"
    if rel.startswith("/"):
        return "absolute path"
    if "\\" in rel:
        return "backslash in path"
    if any(ord(c) < 32 or ord(c) == 127 for c in rel):
        return "control character in path"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "'..', '.' or empty path component"
    return None


def public_key_raw(pem):
    """The raw 32-byte key of an Ed25519 public key in PEM (SubjectPublicKeyInfo); ValueError if not."""
    m = re.search(r"-----BEGIN PUBLIC KEY-----(.*?)-----END PUBLIC KEY-----", pem, re.S)
    try:
        der = base64.b64decode(re.sub(r"\s", "", m.group(1)), validate=True) if m else b""
    except ValueError:  # binascii.Error
        der = b""
    if len(der) != len(ED25519_SPKI) + 32 or not der.startswith(ED25519_SPKI):
        raise ValueError("not an Ed25519 public key in PEM")
    return der[len(ED25519_SPKI):]


def public_pem(raw):
    return ("-----BEGIN PUBLIC KEY-----\n" + base64.b64encode(ED25519_SPKI + raw).decode()
            + "\n-----END PUBLIC KEY-----\n")


def key_id(raw):
    return hashlib.sha256(raw).hexdigest()[:16]


def signature_problem(manifest_bytes, sig_bytes, pinned):
    """Why manifest.sig (bytes, or None when absent) is not a valid signature of manifest_bytes by
    one of the `pinned` keys ({key id: raw key}); None when it is."""
    if sig_bytes is None:
        return "the bundle is unsigned"
    try:
        sig = json.loads(sig_bytes.decode("utf-8"))
        ok = sig.get("format") == SIG_FORMAT and sig.get("alg") == "ed25519"
        kid, signature = str(sig["key_id"]), base64.b64decode(sig["signature"], validate=True)
    except (ValueError, KeyError, TypeError, AttributeError):  # binascii.Error is a ValueError
        ok = False
    if not ok:
        return "manifest.sig is not a zeroedge manifest signature"
    if kid not in pinned:
        return "the bundle is signed by key %s, which is not pinned (pinned: %s)" % (
            kid, ", ".join(sorted(pinned)) or "none")
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    except ImportError:
        return "python3 lacks the 'cryptography' package, needed to check bundle signatures"
    try:
        Ed25519PublicKey.from_public_bytes(pinned[kid]).verify(signature, manifest_bytes)
    except (InvalidSignature, ValueError):
        return "manifest.sig does not verify against manifest.json with key %s (edited after signing?)" % kid
    return None


def bundle_role(manifest):
    """What runs a bundle, read from its manifest: "daemon" for a sensor bundle ("kind": "sensor",
    the only kind the sensor daemon loads), "serve" for a model bundle whose graph_files list a
    decode graph (what `zeroedge serve` loads), None for anything else (a rewritten foreign graph
    has no decode graph)."""
    if not isinstance(manifest, dict):
        return None
    if manifest.get("kind") == "sensor":
        return "daemon"
    graphs = manifest.get("graph_files")
    decode = isinstance(graphs, dict) and any(isinstance(g, dict) and g.get("graph") == "decode"
                                              for g in graphs.values())
    if decode and isinstance(manifest.get("model"), dict):
        return "serve"
    return None


def role_problem(manifest, serve):
    """Why a release of this bundle cannot run as the deploy asks (serve: `zeroedge deploy --serve`,
    zeroedge-serve.service; else the sensor daemon, zeroedge.service), as words that follow the
    bundle's name ("<bundle> is ..."); None when it can. A release runs one of the two, and which
    one follows the bundle."""
    role = bundle_role(manifest)
    if role == ("serve" if serve else "daemon"):
        return None
    if role == "daemon":
        return ('is a sensor bundle ("kind": "sensor"): the sensor daemon (zeroedge.service) runs it, '
                "not zeroedge serve; deploy it without --serve")
    if role == "serve":
        return ("is a model bundle (it has a decode graph): zeroedge serve runs it (zeroedge-serve.service), "
                "not the sensor daemon; deploy it with --serve")
    if serve:
        return "is not a model bundle zeroedge serve can run (its manifest lists no decode graph)"
    return ("is not a sensor bundle (kind=%r), the only kind the sensor daemon runs"
            % ((manifest.get("kind") if isinstance(manifest, dict) else None),))
