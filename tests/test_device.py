"""Device probes on fake device trees, preflight verdicts, inventories and release content: no SSH.
(The SSH end-to-end tests are in test_deploy.py.)"""
import json
import shutil
import subprocess
import sys

import pytest

from zeroedge.deploy import preflight as pf
from zeroedge.deploy.inventory import parse_inventory, parse_target
from zeroedge.device import probe as P
from zeroedge.errors import UserError

REL_362 = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: Wed Jan  8 01:49:37 UTC 2025\n"


def fake_root(tmp, release=REL_362, soc="tegra234", chip_id=None, trt_soname=None):
    r = tmp / "root"
    (r / "etc").mkdir(parents=True)
    if release:
        (r / "etc/nv_tegra_release").write_text(release)
    (r / "proc/device-tree").mkdir(parents=True)
    if soc:
        (r / "proc/device-tree/compatible").write_bytes(f"nvidia,p3768-0000+p3767-0005\0nvidia,{soc}\0".encode())
        (r / "proc/device-tree/model").write_bytes(b"NVIDIA Jetson Orin Nano Developer Kit\0")
    if chip_id is not None:
        d = r / "sys/module/tegra_fuse/parameters"
        d.mkdir(parents=True)
        (d / "tegra_chip_id").write_text(f"{chip_id}\n")
    (r / "proc/meminfo").write_text("MemTotal:        7990000 kB\nMemFree:  100 kB\nMemAvailable:    6000000 kB\n")
    if trt_soname:
        lib = r / "usr/lib/aarch64-linux-gnu"
        lib.mkdir(parents=True)
        (lib / trt_soname).write_bytes(b"not an ELF for this machine")
    return r


@pytest.mark.parametrize("text,l4t,jp,trt", [
    (REL_362, "36.4.3", "6.2", "10.3"),
    ("# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic, EABI: aarch64", "36.4.0", "6.1", "10.3"),
    ("# R36 (release), REVISION: 4.4, GCID: 1, BOARD: generic", "36.4.4", "6.2.1", "10.3"),
    ("# R36 (release), REVISION: 3.0, GCID: 36191598, BOARD: generic", "36.3.0", "6.0", "8.6"),
    ("# R35 (release), REVISION: 5.0, GCID: 35550185, BOARD: t186ref", "35.5.0", "5.1.3", "8.5"),
])
def test_l4t_release_to_jetpack(text, l4t, jp, trt):
    rel = P.parse_nv_tegra_release(text)
    assert rel["l4t"] == l4t
    m = P.jetpack_for(l4t)
    assert (m["jetpack"], m["tensorrt"]) == (jp, trt)
    assert P.parse_nv_tegra_release("garbage") is None and P.parse_nv_tegra_release(None) is None


def test_trt_version_encodings():
    assert P.decode_trt_version(100300) == "10.3.0"   # TensorRT 10: major*10000 + minor*100 + patch
    assert P.decode_trt_version(8602) == "8.6.2"      # TensorRT 8: major*1000 + minor*100 + patch


def test_probe_reads_the_fake_tree(tmp_path):
    r = fake_root(tmp_path, trt_soname="libnvinfer.so.10.3.0")
    f = P.probe(root=str(r), base="/opt/zeroedge", want_modules=["json", "no_such_module_xyz"])
    assert f["jetson"] and f["l4t"] == "36.4.3" and f["jetpack"] == "6.2"
    assert f["gpu"] == {"soc": "tegra234", "family": "Orin", "arch": "sm_87",
                        "model": "NVIDIA Jetson Orin Nano Developer Kit"}
    assert f["memory"]["available"] == 6000000 * 1024 and f["memory"]["total"] == 7990000 * 1024
    # the library does not load here (not an ELF): version from its soname
    assert f["tensorrt_lib"] == {"path": "/usr/lib/aarch64-linux-gnu/libnvinfer.so.10.3.0", "version": "10.3.0",
                                 "source": "soname"}
    assert f["modules"] == {"json": True, "no_such_module_xyz": False, "tensorrt": False}
    assert f["disk"]["measured_at"] == str(r) and f["disk"]["free"] > 0 and f["base"] == f"{r}/opt/zeroedge"
    json.dumps(f)


def test_gpu_from_chip_id_and_non_jetson(tmp_path):
    r = fake_root(tmp_path, soc=None, chip_id=0x19)
    assert P.gpu(str(r))["arch"] == "sm_72"
    r2 = fake_root(tmp_path / "pc", release=None, soc=None)
    f = P.probe(root=str(r2))
    assert not f["jetson"] and f["jetpack"] is None and f["gpu"]["arch"] is None


@pytest.mark.skipif(not shutil.which("cc"), reason="no C compiler to build a stand-in libnvinfer")
def test_trt_version_via_ctypes(tmp_path):
    """A stand-in libnvinfer exporting getInferLibVersion (the hardware boundary) is loaded with
    ctypes and its version decoded, and wins over the file name."""
    r = fake_root(tmp_path)
    lib = r / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (tmp_path / "nvinfer.c").write_text("int getInferLibVersion(void) { return 100302; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib / "libnvinfer.so.10"), str(tmp_path / "nvinfer.c")],
                   check=True)
    t = P.tensorrt_library(str(r))
    assert t["version"] == "10.3.2" and t["source"] == "ctypes"


def test_probe_module_runs_standalone_with_injected_root(tmp_path):
    """`python -m zeroedge.device` and the env var ZEROEDGE_DEVICE_ROOT (how the agent gets it)."""
    r = fake_root(tmp_path)
    out = subprocess.run([sys.executable, "-m", "zeroedge.device"], capture_output=True, text=True, check=True,
                         env={"ZEROEDGE_DEVICE_ROOT": str(r), "PATH": "/usr/bin:/bin"})
    assert json.loads(out.stdout)["l4t"] == "36.4.3"


# ------------------------------------------------------------------ preflight verdicts

def facts(tmp_path, **over):
    f = P.probe(root=str(fake_root(tmp_path)), want_modules=list(pf.DAEMON_MODULES) + ["tomli"])
    f["modules"].update({m: True for m in pf.DAEMON_MODULES}, tomli=True)   # not the host's python3
    f["python"]["version"] = "3.10.12"
    f.update(over)
    return f


MANIFEST = {"files": {"model.onnx": {"bytes": 1000, "sha256": "0" * 64}}, "target": "jetpack-6.2"}


def test_preflight_ok_falls_back_to_onnxruntime(tmp_path):
    v = pf.evaluate(facts(tmp_path), MANIFEST, upload_bytes=10_000, min_free=0)
    assert v.ok and v.backend == "onnxruntime"
    assert any("TensorRT not found on the device: using the portable onnxruntime backend" in n for n in v.notes)
    assert [s["name"] for s in v.steps] == ["plugins", "engine"] and all("why" in s for s in v.steps)


@pytest.mark.parametrize("over,needle", [
    ({"jetson": False}, "not a Jetson: no /etc/nv_tegra_release"),
    ({"l4t": "36.3.0", "jetpack": "6.0"}, "JetPack 6.0 (L4T 36.3.0) ships TensorRT 8.6, which has no IPluginV3"),
    ({"l4t": "35.5.0", "jetpack": "5.1.3"}, "JetPack 5.1.3 (L4T 35.5.0) is not supported"),
    ({"gpu": {"arch": "sm_72", "family": "Xavier"}}, "GPU is sm_72 (Xavier); zeroedge targets Jetson Orin (sm_87)"),
    ({"python": {"version": "3.8.10", "executable": "/usr/bin/python3"}}, "zeroedge needs Python >= 3.10"),
    ({"tensorrt_lib": {"version": "8.6.2", "path": "/usr/lib/aarch64-linux-gnu/libnvinfer.so.8"}},
     "TensorRT 8.6.2 found"),
    ({"memory": {"available": 10 << 20}}, "not enough memory: the bundle's plan needs 67.1 MB"),
    ({"disk": {"free": 5000, "path": "/opt/zeroedge"}}, "disk full: 5.0 KB free at /opt/zeroedge"),
])
def test_preflight_refusals(tmp_path, over, needle):
    m = dict(MANIFEST, plan={"memory_mb": 64})
    v = pf.evaluate(facts(tmp_path, **over), m, upload_bytes=10_000, min_free=0)
    assert not v.ok and any(needle in p for p in v.problems), v.problems


def test_preflight_missing_modules_says_how_to_fix(tmp_path):
    f = facts(tmp_path)
    f["modules"]["onnxruntime"] = False
    f["modules"]["paho"] = False
    f["modules"]["tomli"] = False          # Python 3.10 has no tomllib
    v = pf.evaluate(f, MANIFEST, 0, 0)
    assert v.problems == ["device python3 lacks onnxruntime, paho-mqtt, tomli; install with: "
                          "python3 -m pip install onnxruntime paho-mqtt tomli"]


def test_plan_memory_units():
    assert pf.plan_memory_bytes({"memory_mb": 64}) == 64 << 20
    assert pf.plan_memory_bytes({"memory": {"peak_bytes": 123}}) == 123
    assert pf.plan_memory_bytes({"devices": []}) is None and pf.plan_memory_bytes(None) is None


# ------------------------------------------------------------------ inventory

def test_inventory_parsing(tmp_path):
    inv = tmp_path / "hosts"
    inv.write_text("# fleet\norin-1  root@10.0.0.21:2222  metrics_port=9100 keep=5\nlab-orin   # alias only\n"
                   "[::1]\n")
    a, b, c = parse_inventory(inv)
    assert (a.name, a.host, a.user, a.port, a.settings) == ("orin-1", "10.0.0.21", "root", 2222,
                                                           {"metrics_port": 9100, "keep": 5})
    assert (b.name, b.host, b.user, b.port) == ("lab-orin", "lab-orin", None, None)
    assert c.host == "::1"
    assert parse_target("jetson").host == "jetson"


@pytest.mark.parametrize("text,needle", [
    ("a b c\n", ":1: bad inventory line"),
    ("orin-1 host metrics_port=x\n", ":1: metrics_port='x' is not a valid int"),
    ("orin-1 host colour=blue\n", ":1: unknown setting 'colour'"),
    ("orin-1 ho$t\n", ":1: bad host 'ho$t'"),
    ("x h1\nx h2\n", ":2: duplicate name 'x'"),
    ("# nothing\n", "inventory lists no hosts"),
    ("h:99999\n", ":1: bad port"),
])
def test_inventory_bad_lines(tmp_path, text, needle):
    inv = tmp_path / "hosts"
    inv.write_text(text)
    with pytest.raises(UserError, match=None) as e:
        parse_inventory(inv)
    assert needle in str(e.value)


# ------------------------------------------------------------------ release content

def test_daemon_config_and_toml_roundtrip():
    from zeroedge.deploy.release import _load_toml, daemon_config, dump_toml

    tpl = {"daemon": {"bundle": "/x", "state_dir": "/var/lib/zeroedge", "backend": "torch"},
           "source": {"kind": "mqtt", "topic": "a/#", "qos": 1}, "metrics": {"port": 9108}}
    cfg = daemon_config(tpl, 9200, "onnxruntime", root="/fake", base="/opt/zeroedge", name="orin-1")
    assert cfg["daemon"] == {"bundle": "bundle", "state_dir": "/fake/var/lib/zeroedge", "backend": "onnxruntime"}
    assert cfg["output"]["jsonl"] == "/fake/var/lib/zeroedge/results.jsonl"
    assert cfg["metrics"] == {"port": 9200, "host": "127.0.0.1"}
    assert cfg["source"]["client_id"] == "zeroedge-daemon-orin-1"
    assert _load_toml(dump_toml(cfg)) == cfg
    assert daemon_config({}, 9108, "onnxruntime")["daemon"]["state_dir"] == "/opt/zeroedge/state"


def test_release_id_is_content_hash(tmp_path):
    from zeroedge.bundle import write_manifest
    from zeroedge.deploy.release import build_release

    b = tmp_path / "b"
    b.mkdir()
    (b / "model.onnx").write_bytes(b"abc")
    m = write_manifest(b, {"kind": "sensor"})
    r1 = build_release(b, m, {}, 9108, "onnxruntime", tmp_path / "w1", name="x")
    r2 = build_release(b, m, {}, 9108, "onnxruntime", tmp_path / "w2", name="x")
    r3 = build_release(b, m, {}, 9109, "onnxruntime", tmp_path / "w3", name="x")
    assert r1.id == r2.id != r3.id
    assert {"bundle/model.onnx", "bundle/manifest.json", "daemon.toml", "release.json",
            "app/zeroedge/cli.py", "app/zeroedge/deploy/remote.py"} <= set(r1.entries)
    assert not any("__pycache__" in k for k in r1.entries)


def test_preflight_bundle_target(tmp_path):
    f = facts(tmp_path)
    assert pf.evaluate(f, dict(MANIFEST, target="jetpack-6.1"), 0, 0).ok
    v = pf.evaluate(f, dict(MANIFEST, target="jetpack-5.1"), 0, 0)
    assert v.problems == ["the bundle targets jetpack-5.1 but the device runs JetPack 6.2 (L4T 36.4.3); "
                          "re-export for it"]


def test_agent_build_steps(tmp_path, monkeypatch):
    """The device agent's build: {release} substituted, build.json written once, a failing step is a
    one-line failure naming the step."""
    from zeroedge.deploy import remote

    monkeypatch.setenv("ZEROEDGE_DEVICE_ROOT", str(tmp_path))
    rel = tmp_path / "opt/zeroedge/releases/r1"
    (rel / "app").mkdir(parents=True)
    steps = [{"name": "plugins", "argv": ["sh", "-c", "echo built > {release}/build/lib.so"]},
             {"name": "engine", "why": "TensorRT not found on the device"}]
    dev = remote.Device({"build": {"backend": "onnxruntime", "steps": steps}})
    out = dev.build("r1")
    assert (rel / "build/lib.so").read_text() == "built\n"
    assert out["steps"][0]["name"] == "plugins" and out["steps"][1]["skipped"].startswith("TensorRT not found")
    (rel / "build/lib.so").unlink()
    assert dev.build("r1") == json.loads((rel / "build.json").read_text())   # done once per release
    assert not (rel / "build/lib.so").exists()
    (tmp_path / "opt/zeroedge/releases/r2/app").mkdir(parents=True)
    bad = remote.Device({"build": {"backend": "tensorrt", "steps": [{"name": "plugins", "argv": [
        "sh", "-c", "echo 'build_plugins: nvcc not found'; exit 2"]}]}})
    with pytest.raises(remote.Fail, match=r"on-device plugins failed \(exit 2\): build_plugins: nvcc not found"):
        bad.build("r2")
    assert not (tmp_path / "opt/zeroedge/releases/r2/build.json").exists()


def test_cli_refuses_bad_input_before_connecting(tmp_path):
    from conftest import run_cli

    p = run_cli("deploy", tmp_path, "--host", "h", "--hosts", tmp_path / "x")
    assert p.returncode == 2 and "give exactly one of --host HOST or --hosts FILE" in p.stderr
    p = run_cli("deploy", tmp_path / "nope", "--host", "127.0.0.1:1")
    assert p.returncode == 2 and "bundle not found" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("status", "--hosts", tmp_path / "missing-inventory")
    assert p.returncode == 2 and "inventory not found" in p.stderr
