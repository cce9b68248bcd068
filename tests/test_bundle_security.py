"""Hostile bundles and payloads, without SSH: the workstation's checks (zeroedge.bundle) and the
device agent run exactly as ssh runs it (`python3 -` reading agent_source() + the payload, with
ZEROEDGE_DEVICE_ROOT set to a fake Jetson root). The SSH end-to-end refusals are in test_deploy.py."""
import hashlib
import json
import os
import sys

import pytest

from conftest import run_cli
from test_deploy import add_entry, make_jetson, run_agent, tree
from zeroedge.bundle import read_manifest, signer, verify, write_manifest
from zeroedge.errors import UserError

PASSWD = b"root:x:0:0:root:/root:/bin/bash\n"


def small_bundle(path):
    path.mkdir(parents=True)
    (path / "model.onnx").write_bytes(b"onnx bytes")
    (path / "sub").mkdir()
    (path / "sub/x.bin").write_bytes(b"x")
    write_manifest(path, {"kind": "sensor"})
    return path


# ------------------------------------------------------------------ workstation: manifest paths and links

@pytest.mark.parametrize("rel,why", [
    ("../../../../../etc/passwd", "'..'"), ("/etc/passwd", "absolute path"), ("sub/../../x", "'..'"),
    ("sub//x", "empty path component"), ("./x", "'.'"), ("sub\\..\\x", "backslash"), ("a\x00b", "control character"),
    ("a\nb", "control character"), ("manifest.json", "reserved name"), ("manifest.sig", "reserved name")])
def test_unsafe_manifest_paths_refused(tmp_path, rel, why):
    b = small_bundle(tmp_path / "b")
    add_entry(b, rel)
    with pytest.raises(UserError, match="unsafe file name") as e:
        read_manifest(b)
    assert why in str(e.value) and "\n" not in str(e.value).replace(repr(rel), "")


def test_bad_manifest_entry_refused(tmp_path):
    b = small_bundle(tmp_path / "b")
    m = json.loads((b / "manifest.json").read_text())
    m["files"]["model.onnx"]["sha256"] = "../x"
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="bad entry for 'model.onnx'"):
        read_manifest(b)


def test_links_in_a_bundle_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.bin").write_bytes(b"x")
    (outside / "model.onnx").write_bytes(b"onnx bytes")
    # write_manifest: a linked file, a linked directory, a FIFO
    for name, make in [("link.onnx", lambda p: p.symlink_to(outside / "model.onnx")),
                       ("linkdir", lambda p: p.symlink_to(outside, target_is_directory=True)),
                       ("fifo", os.mkfifo)]:
        b = small_bundle(tmp_path / f"w-{name}")
        make(b / name)
        with pytest.raises(UserError, match="a bundle holds regular files only") as e:
            write_manifest(b, {})
        assert f"{name} is {'not a regular file' if name == 'fifo' else 'a link'}" in str(e.value)
    # verify: a file swapped for a link to the same bytes, and a directory swapped for a link
    b = small_bundle(tmp_path / "v1")
    (b / "model.onnx").unlink()
    (b / "model.onnx").symlink_to(outside / "model.onnx")
    with pytest.raises(UserError, match=r"model.onnx is a link \(a bundle holds regular files only\)"):
        verify(b)
    b = small_bundle(tmp_path / "v2")
    (b / "sub/x.bin").unlink()
    (b / "sub").rmdir()
    (b / "sub").symlink_to(outside, target_is_directory=True)
    with pytest.raises(UserError, match="sub is a link"):
        verify(b)
    # the manifest itself as a link
    b = small_bundle(tmp_path / "v3")
    (outside / "manifest.json").write_bytes((b / "manifest.json").read_bytes())
    (b / "manifest.json").unlink()
    (b / "manifest.json").symlink_to(outside / "manifest.json")
    with pytest.raises(UserError, match="manifest.json is a link"):
        read_manifest(b)


def test_keygen_sign_and_signer(tmp_path):
    key = tmp_path / "keys/k"
    key.parent.mkdir()
    p = run_cli("keygen", "-o", key, check_rc=0)
    kid = p.stdout.split("key id ")[1].split(")")[0]
    assert len(kid) == 16 and (key.stat().st_mode & 0o777) == 0o600 and "PRIVATE KEY" in key.read_text()
    assert "BEGIN PUBLIC KEY" in (tmp_path / "keys/k.pub").read_text()
    p = run_cli("keygen", "-o", key, check_rc=2)
    assert "exists; not overwriting" in p.stderr and "Traceback" not in p.stderr
    b = small_bundle(tmp_path / "b")
    assert signer(b) is None
    p = run_cli("sign", b, "--key", key, check_rc=0)
    assert kid in p.stdout and signer(b) == kid
    # any edit of manifest.json after signing (here outside files{}) is caught on the workstation
    m = json.loads((b / "manifest.json").read_text())
    m["target"] = "jetpack-5.1"
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="does not verify against manifest.json"):
        signer(b)
    # a new manifest drops the stale signature
    write_manifest(b, {})
    assert not (b / "manifest.sig").exists() and signer(b) is None
    p = run_cli("sign", b, "--key", tmp_path / "keys/k.pub", check_rc=2)
    assert "not an unencrypted PEM private key" in p.stderr and len(p.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------ the device agent, sent a crafted payload

@pytest.fixture
def device_root(tmp_path):
    root = make_jetson(tmp_path / "root")
    (root / "etc/passwd").write_bytes(PASSWD)
    return root


def put_object(root, data, mode=0o444):
    h = hashlib.sha256(data).hexdigest()
    objects = root / "opt/zeroedge/objects"
    objects.mkdir(parents=True, exist_ok=True)
    (objects / h).write_bytes(data)
    (objects / h).chmod(mode)
    return h


def activate(root, files, hashes=(), **kw):
    payload = dict(op="activate", base="/opt/zeroedge", release_id="0123456789ab", hashes=list(hashes), files=files,
                   unit="[Service]\n", python=sys.executable, build={"backend": "onnxruntime", "steps": []},
                   health_timeout=1)
    return run_agent(root, dict(payload, **kw))


@pytest.mark.parametrize("rel", ["bundle/../../../../../etc/passwd", "../../../../etc/passwd", "/etc/passwd",
                                 "bundle//etc/passwd", "bundle/sub/../../x", "bundle\\..\\..\\x", "build.json",
                                 ".service.json", "bundle/a\nb"])
def test_agent_refuses_unsafe_release_paths(device_root, rel):
    h = put_object(device_root, b"evil::0:0::/:/bin/sh\n")
    before = tree(device_root)
    res = activate(device_root, {rel: {"sha256": h, "bytes": 21, "mode": 0o644}})
    assert not res["ok"] and "refusing release file" in res["error"], res
    assert tree(device_root) == before and (device_root / "etc/passwd").read_bytes() == PASSWD


@pytest.mark.parametrize("over,needle", [
    ({"release_id": "../../etc"}, "bad release id"), ({"base": "/opt/../etc"}, "bad base"),
    ({"base": "opt/zeroedge"}, "bad base"), ({"incoming": "/tmp/../etc"}, "bad incoming"),
    ({"hashes": ["../../etc/passwd"]}, "bad sha256"), ({"mode": 0o4755}, "mode 644, 755 or 600"),
    ({"sha256": "A" * 64}, "lowercase hex sha256")])
def test_agent_refuses_bad_payload_fields(device_root, over, needle):
    h = put_object(device_root, b"model")
    entry = {"sha256": over.pop("sha256", h), "bytes": 5, "mode": over.pop("mode", 0o644)}
    before = tree(device_root)
    res = activate(device_root, {"bundle/model.onnx": entry}, **over)
    assert not res["ok"] and needle in res["error"], res
    assert tree(device_root) == before


def test_agent_never_follows_a_link_in_incoming(device_root):
    """A link planted in the uploads dir, pointing at a file outside whose bytes match the expected
    hash: refused, and the target's mode is unchanged (the old agent chmodded it to 0444)."""
    outside = device_root / "etc/outside.conf"
    outside.write_bytes(b"not yours")
    outside.chmod(0o640)
    h = hashlib.sha256(b"not yours").hexdigest()
    incoming = device_root / "opt/zeroedge/.incoming"
    incoming.mkdir(parents=True, mode=0o700)
    (incoming / h).symlink_to(outside)
    res = activate(device_root, {"bundle/model.onnx": {"sha256": h, "bytes": 9, "mode": 0o644}}, hashes=[h])
    assert not res["ok"] and "is not a regular file" in res["error"], res
    assert (outside.stat().st_mode & 0o7777) == 0o640 and outside.read_bytes() == b"not yours"
    assert not (device_root / "opt/zeroedge/objects" / h).exists()


@pytest.mark.parametrize("make,needle", [
    (lambda d, root: d.mkdir(parents=True, mode=0o777) or d.chmod(0o777), "not private to the deploying user"),
    (lambda d, root: (root / "elsewhere").mkdir(mode=0o700) or d.symlink_to(root / "elsewhere"),
     "zeroedge-incoming-0 is a link; refused")])
def test_agent_refuses_an_unsafe_upload_dir(device_root, make, needle):
    """--sudo uploads land in <root>/tmp/zeroedge-incoming-<uid>: a dir others can write, or a link, is refused."""
    inc = device_root / "tmp/zeroedge-incoming-0"
    inc.parent.mkdir(exist_ok=True)
    make(inc, device_root)
    h = hashlib.sha256(b"model").hexdigest()
    (inc.resolve() / h).write_bytes(b"model")
    res = activate(device_root, {"bundle/model.onnx": {"sha256": h, "bytes": 5, "mode": 0o644}}, hashes=[h],
                   incoming=str(inc))
    assert not res["ok"] and needle in res["error"], res
    assert not (device_root / "opt/zeroedge/objects" / h).exists()


def test_only_staged_names_count_as_releases(device_root):
    rel = device_root / "opt/zeroedge/releases"
    (rel / "etc").mkdir(parents=True)
    (rel / "etc/passwd").write_bytes(PASSWD)               # where the old agent put `../../etc/passwd`
    (device_root / "elsewhere").mkdir()
    (rel / "20250101T000000000000Z-0123456789ab").symlink_to(device_root / "elsewhere")
    (rel / "20250102T000000000000Z-0123456789ab").mkdir()
    res = run_agent(device_root, {"op": "status", "base": "/opt/zeroedge"})
    assert res["ok"] and res["result"]["releases"] == ["20250102T000000000000Z-0123456789ab"]


def test_agent_refuses_unknown_operations(device_root):
    res = run_agent(device_root, {"op": "commit", "base": "/opt/zeroedge", "hashes": []})
    assert not res["ok"] and "unknown operation 'commit'" in res["error"]


def test_export_refuses_a_bad_signing_key_before_exporting(tmp_path):
    p = run_cli("export", "no-such-model", "-o", tmp_path / "out", "--sign", tmp_path / "missing.key", check_rc=2)
    assert "signing key" in p.stderr and "No such file" in p.stderr and not (tmp_path / "out").exists()
