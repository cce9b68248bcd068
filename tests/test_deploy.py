"""`zeroedge deploy / rollback / status` against a real OpenSSH sshd on 127.0.0.1.

Each fake device is a real sshd (Debian openssh-server, temporary host key, authorized_keys) whose
sessions get ZEROEDGE_DEVICE_ROOT=<fake root> and a PATH starting with the root's stub bin/ (the
hardware/OS boundary; set by a ForceCommand, after the login shell's rc files, so a host whose
~/.bashrc puts its own python3 first, e.g. pyenv's shims, does not leak into the device): `systemctl` and `journalctl` stubs that record calls and run the unit's
ExecStart (from the installed unit + drop-in) as a background process, and `python3` = this Python
(which has onnxruntime, paho and prometheus-client, as a prepared Jetson would). The one process
faked beyond that boundary is the model server of zeroedge-serve.service (deploy --serve): the
release's bundle is the daemon's sensor bundle, which no `zeroedge serve` loads, so the stub runs
its ExecStart's `zeroedge serve` arguments through stub-bin/fake-serve, a real HTTP server on the
given --host/--port answering /health as zeroedge serve does; the unit's exact command line is
then run once more as the real `zeroedge serve` on an exported model bundle. The fake root has
/etc/nv_tegra_release, /proc/device-tree and /proc/meminfo. The client side is a temporary HOME
with ~/.ssh/config (aliases), known_hosts and a key: deploy reads them exactly as it would for a user.

The daemon that answers /healthz is the real `zeroedge daemon` (zeroedge/daemon), on onnxruntime,
reading MQTT from a real mosquitto started here. The bundle is a real sensor bundle built from an
ONNX graph (onnx helper API) run by onnxruntime.

Full disk: the fake device's /opt is a 2 MB tmpfs filled to the brim when the tests may mount (root
on Linux); otherwise the same preflight check is driven by --min-free larger than the free space.
"""
import hashlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
SFTP_SERVER = "/usr/lib/openssh/sftp-server"     # Debian's openssh-server depends on it
NV_RELEASE = "# R36 (release), REVISION: {rev}, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: Wed Jan  8 01:49:37 UTC 2025\n"
STUB_SYSTEMCTL = r'''#!{python}
"""Stub systemctl at the device boundary: records calls; start/restart runs the unit's ExecStart
(unit + drop-ins, last ExecStart wins, Environment=, WorkingDirectory=) in the background."""
import json, os, shlex, signal, subprocess, sys, time
root = os.environ["ZEROEDGE_DEVICE_ROOT"]
state = os.path.join(root, "var/lib/stub-systemd"); os.makedirs(state, exist_ok=True)
args = sys.argv[1:]
with open(os.path.join(state, "calls.jsonl"), "a") as f:
    f.write(json.dumps(args) + "\n")
unit = args[-1] if args else ""
if unit and not unit.endswith(".service"):
    unit += ".service"
pidf = os.path.join(state, unit + ".pid")

def pid():
    try:
        p = int(open(pidf).read())
        os.kill(p, 0)
        with open("/proc/%d/stat" % p) as f:
            if f.read().split()[2] == "Z":
                return None
        return p
    except (OSError, ValueError):
        return None

def stop():
    p = pid()
    if p:
        try:
            os.killpg(p, signal.SIGTERM)
        except OSError:
            pass
        for _ in range(100):
            if pid() is None:
                break
            time.sleep(0.05)
        else:
            os.killpg(p, signal.SIGKILL)

def start():
    d = os.path.join(root, "etc/systemd/system")
    files = [os.path.join(d, unit)]
    dd = os.path.join(d, unit + ".d")
    if os.path.isdir(dd):
        files += [os.path.join(dd, x) for x in sorted(os.listdir(dd)) if x.endswith(".conf")]
    execs, env, wd = [], {}, "/"
    for path in files:
        for line in open(path):
            line = line.strip()
            if line.startswith("ExecStart="):
                v = line[len("ExecStart="):]
                execs = [v] if v else []
            elif line.startswith("Environment="):
                k, _, v = line[len("Environment="):].partition("=")
                env[k] = v
            elif line.startswith("WorkingDirectory="):
                wd = line[len("WorkingDirectory="):]
    if not execs:
        sys.exit("stub systemctl: %s has no ExecStart" % unit)
    log = open(os.path.join(root, "var/log", unit + ".log"), "ab")
    argv = shlex.split(execs[-1])
    fake = os.path.join(root, "stub-bin", "fake-serve")
    if "zeroedge.cli" in argv and argv[argv.index("zeroedge.cli") + 1:][:1] == ["serve"] and os.path.exists(fake):
        argv = [argv[0], fake] + argv[argv.index("zeroedge.cli") + 1:]
    p = subprocess.Popen(argv, cwd=wd, env=dict(os.environ, **env), stdout=log,
                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    open(pidf, "w").write(str(p.pid))

cmd = args[0] if args else ""
if cmd in ("daemon-reload", "enable", "disable"):
    pass
elif cmd in ("start", "restart"):
    if cmd == "restart" or pid() is None:
        stop(); start()
elif cmd == "stop":
    stop()
elif cmd == "is-active":
    print("active" if pid() else "inactive"); sys.exit(0 if pid() else 3)
elif cmd == "show":
    print(pid() or 0)
else:
    sys.exit("stub systemctl: unsupported %r" % args)
'''
STUB_JOURNALCTL = r'''#!/bin/sh
# journalctl -u UNIT -n 15 --no-pager
tail -n 15 "$ZEROEDGE_DEVICE_ROOT/var/log/$2.log" 2>/dev/null
'''
FAKE_SERVE = r'''#!{python}
"""Fake `zeroedge serve` (the model server; the release's sensor bundle is no model it loads): takes
its command line, records it, and answers GET /health on --host:--port as zeroedge serve does: 200
{"status": "ok", ...}, or 503 {"status": "error", ...} when the sha256 of the bundle's manifest is
listed in <root>/etc/fake-serve-unhealthy (an engine that stopped)."""
import argparse, hashlib, json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
root = os.environ["ZEROEDGE_DEVICE_ROOT"]
ap = argparse.ArgumentParser()
ap.add_argument("command", choices=["serve"])
for opt in ("--backend", "--bundle", "--engines", "--plugins", "--host"):
    ap.add_argument(opt)
ap.add_argument("--port", type=int)
a = ap.parse_args()
with open(os.path.join(root, "var/lib/stub-systemd/serve-argv.json"), "w") as f:
    json.dump(sys.argv[1:], f)
with open(os.path.join(a.bundle, "manifest.json"), "rb") as f:
    sha = hashlib.sha256(f.read()).hexdigest()
try:
    with open(os.path.join(root, "etc/fake-serve-unhealthy")) as f:
        sick = sha in f.read()
except OSError:
    sick = False
body = json.dumps({"status": "error", "waiting": 0, "running": 0, "mode": "sequential",
                   "error": "the engine is not running"} if sick else
                  {"status": "ok", "waiting": 0, "running": 0, "mode": "sequential"}).encode()


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response((503 if sick else 200) if self.path == "/health" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


srv = HTTPServer((a.host, a.port), Health)
print("fake zeroedge serve: engine %s, http://%s:%d" % ("stopped" if sick else "running", a.host, a.port), flush=True)
srv.serve_forever()
'''


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc, what, timeout=10.0):
    t = time.time()
    while time.time() - t < timeout:
        if proc.poll() is not None:
            return False
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


def make_jetson(root: Path, rev="4.3", soc="tegra234", nv_release=True, mem_avail_kb=50_000_000):
    """A fake Jetson AGX Orin root (JetPack 6.2 = L4T 36.4.3 by default)."""
    (root / "etc").mkdir(parents=True, exist_ok=True)
    if nv_release:
        (root / "etc/nv_tegra_release").write_text(NV_RELEASE.format(rev=rev))
    dt = root / "proc/device-tree"
    dt.mkdir(parents=True, exist_ok=True)
    (dt / "compatible").write_bytes(f"nvidia,p3737-0000+p3701-0005\0nvidia,p3701-0005\0nvidia,{soc}\0".encode())
    (dt / "model").write_bytes(b"NVIDIA Jetson AGX Orin Developer Kit\0")
    (root / "proc/meminfo").write_text(f"MemTotal:       64335836 kB\nMemFree:        {mem_avail_kb} kB\n"
                                       f"MemAvailable:   {mem_avail_kb} kB\nSwapFree:              0 kB\n")
    for d in ("opt", "var/log", "var/lib", "etc/systemd/system"):
        (root / d).mkdir(parents=True, exist_ok=True)
    b = root / "stub-bin"
    b.mkdir(exist_ok=True)
    (b / "systemctl").write_text(STUB_SYSTEMCTL.replace("{python}", sys.executable))
    (b / "journalctl").write_text(STUB_JOURNALCTL)
    (b / "python3").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (b / "fake-serve").write_text(FAKE_SERVE.replace("{python}", sys.executable))
    for n in ("systemctl", "journalctl", "python3", "fake-serve"):
        (b / n).chmod(0o755)
    return root


def tree(root: Path) -> dict:
    """Every path under a fake device root with its size, mtime and mode (to prove nothing changed)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_relative_to(root / "var/lib/stub-systemd"):
            continue
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, st.st_mode)
    return out


class FakeDevice:
    """One sshd on 127.0.0.1 serving one fake Jetson root."""

    def __init__(self, tmp: Path, name: str, client_pub: str, **jetson):
        self.name, self.dir = name, tmp / name
        self.root = make_jetson(self.dir / "root", **jetson)
        self.port = free_port()
        hk = self.dir / "ssh_host_ed25519_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hk)], check=True)
        self.host_pub = (self.dir / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        (self.dir / "authorized_keys").write_text(client_pub)
        path = f"{self.root}/stub-bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
        (self.dir / "sshd_config").write_text(textwrap.dedent(f"""\
            Port {self.port}
            ListenAddress 127.0.0.1
            HostKey {hk}
            PidFile {self.dir}/sshd.pid
            AuthorizedKeysFile {self.dir}/authorized_keys
            StrictModes no
            UsePAM no
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            PermitRootLogin prohibit-password
            Subsystem sftp {SFTP_SERVER}
            SetEnv ZEROEDGE_DEVICE_ROOT={self.root}
            ForceCommand PATH={path} exec /bin/sh -c "$SSH_ORIGINAL_COMMAND"
            LogLevel ERROR
            """))
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.dir / "sshd_config")],
                                     stdout=subprocess.DEVNULL, stderr=open(self.dir / "sshd.log", "wb"))
        if not wait_port(self.port, self.proc, "sshd"):
            self.stop()
            raise RuntimeError((self.dir / "sshd.log").read_text()[-500:] or "sshd did not start")

    def calls(self):
        p = self.root / "var/lib/stub-systemd/calls.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []

    def daemon_pid(self, unit="zeroedge.service"):
        p = self.root / f"var/lib/stub-systemd/{unit}.pid"
        return int(p.read_text()) if p.exists() else None

    def serve_pid(self):
        """The serve unit's process while it runs, else None."""
        pid = self.daemon_pid("zeroedge-serve.service")
        try:
            os.kill(pid, 0)
            return pid if Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z" else None
        except (OSError, TypeError):
            return None

    def tree(self):
        return tree(self.root)

    def stop(self):
        for pid in (self.daemon_pid(), self.daemon_pid("zeroedge-serve.service")):
            if pid:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)


# ------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """Client HOME (~/.ssh), a mosquitto broker, a sensor bundle, and a factory for fake devices."""
    if not os.access(SSHD, os.X_OK):
        pytest.skip(f"sshd not found at {SSHD}: apt-get install openssh-server (scripts/setup does)")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)     # privilege separation dir
    tmp = tmp_path_factory.mktemp("deploy")
    home = tmp / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    key = home / ".ssh" / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    client_pub = (home / ".ssh" / "id_ed25519.pub").read_text()
    user = os.environ.get("USER") or __import__("getpass").getuser()
    broker_port = free_port()
    (tmp / "mosquitto.conf").write_text(f"listener {broker_port} 127.0.0.1\nallow_anonymous true\n"
                                        "persistence false\n")
    mosq = subprocess.Popen([shutil.which("mosquitto") or "/usr/sbin/mosquitto", "-c", str(tmp / "mosquitto.conf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert wait_port(broker_port, mosq, "mosquitto"), "mosquitto did not start (scripts/setup installs it)"
    devices = []

    class Lab:
        pass

    lab = Lab()
    lab.tmp, lab.home, lab.user, lab.broker_port = tmp, home, user, broker_port
    # the CLI (and the device code it ships) runs from a snapshot of the package taken now, so the
    # release content is fixed for the whole module even while the working tree changes
    snap = tmp / "snap"
    shutil.copytree(REPO / "zeroedge", snap / "zeroedge", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    lab.env = {"HOME": str(home), "COLUMNS": "200", "PYTHONPATH": str(snap)}
    lab.cwd = snap

    def device(name, **jetson):
        try:
            d = FakeDevice(tmp, name, client_pub, **jetson)
        except RuntimeError as e:
            pytest.skip(f"sshd cannot start here: {e}")
        devices.append(d)
        with open(home / ".ssh" / "known_hosts", "a") as f:
            f.write(f"[127.0.0.1]:{d.port} {' '.join(d.host_pub)}\n")
        with open(home / ".ssh" / "config", "a") as f:
            f.write(f"Host {name}\n  HostName 127.0.0.1\n  Port {d.port}\n  User {user}\n\n")
        return d

    lab.device = device
    lab.bundle = make_sensor_bundle(tmp / "bundle")
    lab.config = tmp / "daemon.toml"
    lab.config.write_text(textwrap.dedent(f"""\
        [daemon]
        bundle = "unused: deploy points it at the release"
        state_dir = "/var/lib/zeroedge"
        [source]
        kind = "mqtt"
        host = "127.0.0.1"
        port = {broker_port}
        topic = "zeroedge/readings/#"
        [metrics]
        port = 9108
        """))
    try:
        yield lab
    finally:
        for d in devices:
            d.stop()
        mosq.terminate()


def make_sensor_bundle(out: Path, seed=0) -> Path:
    """A real sensor bundle (the daemon's format): frames (B, T, 52) -> mean over time -> linear ->
    softmax over 22 classes, built with onnx.helper and checked with onnxruntime."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from zeroedge.bundle import write_manifest

    rng = np.random.default_rng(seed)
    C, K = 52, 22
    w = numpy_helper.from_array(rng.normal(0, 0.1, (C, K)).astype(np.float32), "w")
    b = numpy_helper.from_array(np.zeros(K, np.float32), "b")
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    g = helper.make_graph(
        [helper.make_node("ReduceMean", ["frames", "axes"], ["m"], keepdims=0),
         helper.make_node("MatMul", ["m", "w"], ["z0"]), helper.make_node("Add", ["z0", "b"], ["z"]),
         helper.make_node("Softmax", ["z"], ["probs"], axis=-1)],
        "sensor", [helper.make_tensor_value_info("frames", TensorProto.FLOAT, ["batch", "time", C])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", K])], [w, b, axes])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out / "model.onnx"))
    classes = ["normal"] + [f"fault_{i:02d}" for i in range(1, K)]
    sensor = {"window": 16, "channels": C, "class_names": classes,
              "normalisation": {"mean": [0.0] * C, "std": [1.0] * C},
              "alarm": {"threshold": 0.9, "ema_alpha": 0.2}, "hard_faults": [3, 9, 15], "config": {},
              "onnx": "model.onnx", "weights": "weights.npz", "input": "frames", "output": "probs", "opset": 18}
    np.savez(out / "weights.npz", w=np.zeros(1))
    write_manifest(out, {"kind": "sensor", "opset": 18, "target": "jetpack-6.2", "sensor": sensor,
                         "plan": {"memory_mb": 64}})
    return out


def zcli(lab, *args, rc=None, timeout=180, env=None):
    p = subprocess.run([sys.executable, "-m", "zeroedge.cli", *map(str, args)], capture_output=True, text=True,
                       env={**os.environ, **lab.env, **(env or {})}, cwd=lab.cwd, timeout=timeout)
    if rc is not None:
        assert p.returncode == rc, f"rc={p.returncode}\nstdout:{p.stdout[-3000:]}\nstderr:{p.stderr[-3000:]}"
    return p


def deploy(lab, *args, rc=None):
    return zcli(lab, "deploy", *args, rc=rc)


def last_json(p):
    return json.loads(p.stdout)


def add_entry(bundle: Path, rel: str, data: bytes = b"evil"):
    """Add a files{} entry to a bundle's manifest.json by hand, as an attacker would."""
    m = json.loads((bundle / "manifest.json").read_text())
    m["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (bundle / "manifest.json").write_text(json.dumps(m))


def run_agent(root: Path, payload: dict) -> dict:
    """One device-agent operation on a fake root, run exactly as ssh runs it (`python3 -` reading
    agent_source() + the payload), for payloads the workstation would never send."""
    from zeroedge.deploy.ssh import agent_result, agent_script

    env = dict(os.environ, ZEROEDGE_DEVICE_ROOT=str(root), PATH=f"{root}/stub-bin:{os.environ['PATH']}")
    p = subprocess.run([sys.executable, "-"], input=agent_script(payload), capture_output=True, text=True, env=env,
                       timeout=60)
    assert "Traceback" not in p.stderr, p.stderr
    return agent_result(p.stdout)


@pytest.fixture(scope="module")
def jetson_a(lab):
    return lab.device("jetson-a")


def test_deploy_status_redeploy_rollback(lab, jetson_a, tmp_path):
    d = jetson_a
    port = free_port()
    common = ["--host", "jetson-a", "--config", lab.config, "--metrics-port", port, "--health-timeout", 30]
    # 1. first deploy: real bundle, real daemon on onnxruntime, health through /healthz over SSH
    p = deploy(lab, lab.bundle, *common, "--json", rc=0)
    r1 = last_json(p)["hosts"][0]
    assert r1["ok"] and r1["backend"] == "onnxruntime" and r1["changed"]
    assert r1["bytes_uploaded"] > 100_000 and r1["bytes_uploaded"] == r1["bytes_total"]
    assert r1["health"]["code"] == 200 and r1["health"]["body"]["status"] == "ok"
    assert r1["device"]["jetpack"] == "6.2" and r1["device"]["gpu"] == "sm_87"
    assert any("onnxruntime" in n for n in r1["notes"])
    rel1 = r1["release"]
    base = d.root / "opt/zeroedge"
    assert os.readlink(base / "current") == f"releases/{rel1}"
    cfg = (base / "current/daemon.toml").read_text()
    assert 'bundle = "bundle"' in cfg and f"port = {port}" in cfg and str(d.root / "var/lib/zeroedge") in cfg
    assert ["restart", "zeroedge.service"] in d.calls() and ["enable", "zeroedge.service"] in d.calls()
    assert not [c for c in d.calls() if "zeroedge-serve.service" in c] and "serve" not in r1
    assert not list((d.root / "etc/systemd/system").glob("zeroedge-serve*"))
    unit = d.root / "etc/systemd/system/zeroedge.service.d/zeroedge-deploy.conf"
    assert f"{base}/current/daemon.toml" in unit.read_text()
    pid1 = d.daemon_pid()

    # 2. status: version, release, health, memory
    p = zcli(lab, "status", "--host", "jetson-a", rc=0)
    assert rel1 in p.stdout and "health ok" in p.stdout and "service active" in p.stdout
    assert "memory 51.2 GB available" in p.stdout

    # 3. idempotent: the same bundle again moves 0 bytes, restarts nothing
    n_calls = len(d.calls())
    p = deploy(lab, lab.bundle, *common, "--json", rc=0)
    r2 = last_json(p)["hosts"][0]
    assert r2["bytes_uploaded"] == 0, r2.get("uploaded")
    assert r2["files_uploaded"] == 0 and not r2["changed"]
    assert r2["release"] == rel1 and r2["health"]["ok"]
    assert d.daemon_pid() == pid1 and ["restart", "zeroedge.service"] not in d.calls()[n_calls:]

    # 4. a new bundle: --dry-run first changes nothing, then only the changed files move
    b2 = make_sensor_bundle(tmp_path / "bundle2", seed=1)
    before = d.tree()
    p = deploy(lab, b2, *common, "--dry-run", rc=0)
    assert "would upload 3 of" in p.stdout and "dry run: nothing changed" in p.stdout, p.stdout
    assert d.tree() == before
    p = deploy(lab, b2, *common, rc=0)
    assert "uploaded 3 files" in p.stdout and "health ok" in p.stdout, p.stdout
    rel2 = os.readlink(base / "current").split("/")[-1]
    assert rel2 != rel1 and d.daemon_pid() != pid1

    # 5. rollback: back to the first release, restarted and healthy
    p = zcli(lab, "rollback", "--host", "jetson-a", rc=0)
    assert f"rolled back {rel2} -> {rel1}" in p.stdout and "health ok" in p.stdout
    assert os.readlink(base / "current") == f"releases/{rel1}"
    h = last_json(zcli(lab, "status", "--host", "jetson-a", "--json", rc=0))["hosts"][0]
    assert h["release"] == rel1 and h["health"]["body"]["status"] == "ok"
    # nothing older than rel1: a clear refusal
    p = zcli(lab, "rollback", "--host", "jetson-a", rc=2)
    assert "no release older than" in p.stderr and "Traceback" not in p.stderr
    # re-deploying b2 re-activates its release without uploading anything
    r = last_json(deploy(lab, b2, *common, "--json", rc=0))["hosts"][0]
    assert r["bytes_uploaded"] == 0 and r["changed"] and r["release"].endswith(rel2.split("-")[-1])

    # 6. a release whose daemon is not healthy (its broker is unreachable) is rolled back on the spot
    broken = tmp_path / "broken.toml"
    broken.write_text(lab.config.read_text().replace(f"port = {lab.broker_port}", f"port = {free_port()}"))
    p = deploy(lab, b2, "--host", "jetson-a", "--config", broken, "--metrics-port", port, "--health-timeout", 6)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "is not healthy" in p.stderr and f"rolled back to {r['release']}" in p.stderr, p.stderr
    assert os.readlink(base / "current") == f"releases/{r['release']}"
    h = last_json(zcli(lab, "status", "--host", "jetson-a", "--json", rc=0))["hosts"][0]
    assert h["health"]["ok"] and len(h["result"]["releases"]) == 3

    # 7. --keep 1: old releases and the objects only they used leave the device's store
    r = last_json(deploy(lab, b2, *common, "--keep", 1, "--json", rc=0))["hosts"][0]
    assert r["bytes_uploaded"] == 0 and not r["changed"] and len(r["gc"]["removed_releases"]) == 2
    assert os.listdir(base / "releases") == [r["release"]]
    used = {f["sha256"] for f in json.loads((base / "current/.files.json").read_text()).values()}
    assert set(os.listdir(base / "objects")) == used


def _one_line_error(p, *needles):
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    err = p.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


def test_refusals_change_nothing(lab, jetson_a, tmp_path):
    d = jetson_a
    before = d.tree()
    # wrong host key: never silently accepted
    kh = tmp_path / "known_hosts"
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    kh.write_text(f"[127.0.0.1]:{d.port} {' '.join(Path(str(other) + '.pub').read_text().split()[:2])}\n")
    _one_line_error(deploy(lab, lab.bundle, "--host", "jetson-a", "--known-hosts", kh),
                    "jetson-a: host key verification failed", "ssh-keygen -R")
    # a host not in known_hosts at all
    kh.write_text("")
    _one_line_error(deploy(lab, lab.bundle, "--host", "jetson-a", "--known-hosts", kh), "host key verification failed")
    # unreachable
    _one_line_error(deploy(lab, lab.bundle, "--host", f"127.0.0.1:{free_port()}"), "unreachable", "connection refused")
    # a bundle that fails verification: refused before connecting anywhere
    bad = tmp_path / "bad"
    shutil.copytree(lab.bundle, bad)
    with open(bad / "model.onnx", "ab") as f:
        f.write(b"x")
    _one_line_error(deploy(lab, bad, "--host", "jetson-a"), "bundle verification failed", "modified model.onnx")
    assert d.tree() == before


def test_full_disk_refused(lab, tmp_path):
    d = lab.device("jetson-full")
    opt = d.root / "opt"
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(opt)],
                             capture_output=True).returncode == 0 if os.geteuid() == 0 else False
    try:
        if mounted:   # a real full disk: fill the tmpfs to 64 KB free
            st = os.statvfs(opt)
            (opt / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 64 * 1024))
            args = ["--min-free", "0"]
        else:         # no mount allowed: the same check, driven by the reserve
            args = ["--min-free", "1000T"]
        before = d.tree()
        err = _one_line_error(deploy(lab, lab.bundle, "--host", "jetson-full", *args), "jetson-full: disk full:")
        assert "free at /opt/zeroedge" in err
        assert d.tree() == before and d.calls() == []
    finally:
        if mounted:
            subprocess.run(["umount", str(opt)])


def test_not_a_jetson_and_jetpack_60_refused(lab):
    pc = lab.device("not-jetson", nv_release=False)
    old = lab.device("jetpack60", rev="3.0")
    b1, b2 = pc.tree(), old.tree()
    _one_line_error(deploy(lab, lab.bundle, "--host", "not-jetson"), "not-jetson: not a Jetson",
                    "/etc/nv_tegra_release")
    _one_line_error(deploy(lab, lab.bundle, "--host", "jetpack60"), "JetPack 6.0 (L4T 36.3.0) ships TensorRT 8.6",
                    "IPluginV3")
    assert pc.tree() == b1 and old.tree() == b2


def test_fleet_parallel_and_refusals(lab, tmp_path):
    a, b = lab.device("fleet-a"), lab.device("fleet-b")
    inv = tmp_path / "hosts"
    pa, pb = free_port(), free_port()
    inv.write_text(f"# two Orins\nfleet-a metrics_port={pa}\nfleet-b  {lab.user}@127.0.0.1:{b.port}  metrics_port={pb}\n")
    # a bad line refuses the whole inventory before anything connects
    bad = tmp_path / "bad-hosts"
    bad.write_text(inv.read_text() + "fleet-c metrics_port=notanumber\n")
    _one_line_error(deploy(lab, lab.bundle, "--hosts", bad, "--config", lab.config), f"{bad}:4:", "metrics_port")
    # one host that is not a Jetson: refused before anything changes on any device
    pc = lab.device("fleet-pc", nv_release=False)
    mixed = tmp_path / "mixed-hosts"
    mixed.write_text(inv.read_text() + "fleet-pc\n")
    ta, tb, tc = a.tree(), b.tree(), pc.tree()
    p = deploy(lab, lab.bundle, "--hosts", mixed, "--config", lab.config)
    assert p.returncode == 2, p.stderr
    assert "deploy: 0/3 hosts ok" in p.stdout and "fleet-pc: not a Jetson" in p.stderr
    assert "fleet-a: not deployed, nothing changed (another host failed preflight)" in p.stdout
    assert (a.tree(), b.tree(), pc.tree()) == (ta, tb, tc)
    assert a.calls() == b.calls() == []
    # both good devices in parallel
    t = time.perf_counter()
    p = deploy(lab, lab.bundle, "--hosts", inv, "--config", lab.config, "--json", rc=0)
    wall = time.perf_counter() - t
    doc = last_json(p)
    assert doc["ok"] and [h["name"] for h in doc["hosts"]] == ["fleet-a", "fleet-b"]
    for h, port in zip(doc["hosts"], (pa, pb)):
        assert h["ok"] and h["health"]["body"]["status"] == "ok" and h["health"]["url"].endswith(f":{port}/healthz")
    assert wall < sum(h["seconds"] for h in doc["hosts"]) + 5
    p = zcli(lab, "status", "--hosts", inv, rc=0)
    assert "status: 2/2 hosts ok" in p.stdout and p.stdout.count("health ok") == 2
    # ~/.ssh/config's ProxyJump is honoured: fleet-b reached through fleet-a's sshd
    with open(lab.home / ".ssh" / "config", "a") as f:
        f.write(f"Host b-via-a\n  HostName 127.0.0.1\n  Port {b.port}\n  User {lab.user}\n  ProxyJump fleet-a\n\n")
    h = last_json(zcli(lab, "status", "--host", "b-via-a", "--json", rc=0))["hosts"][0]
    assert h["release"] == doc["hosts"][1]["release"] and h["health"]["ok"]
    # an unreachable fleet member: per-host summary and a non-zero exit
    down = tmp_path / "down-hosts"
    down.write_text(mixed.read_text() + f"fleet-down 127.0.0.1:{free_port()}\n")
    p = zcli(lab, "status", "--hosts", down)
    assert p.returncode != 0 and "status: 3/4 hosts ok, 1 failed: fleet-down" in p.stdout, p.stdout
    assert "fleet-pc: nothing deployed" in p.stdout and "fleet-down: unreachable" in p.stderr


# ------------------------------------------------------------------ hardening

def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_hostile_bundles_refused_by_deploy(lab, jetson_a, tmp_path):
    """Manifest entries that would write outside the release, and links in the bundle: refused on
    the workstation (exit 2, one line) before anything connects; the device is unchanged."""
    d = jetson_a
    ws = tmp_path / "ws"                       # the old code resolved these paths on the workstation too
    (ws / "etc").mkdir(parents=True)
    (ws / "etc/passwd").write_bytes(b"evil")
    (ws / "outside/deep").mkdir(parents=True)
    (ws / "outside/deep/x").write_bytes(b"x")
    (ws / "outside/x").write_bytes(b"x")
    before = d.tree()
    n = iter(range(100))

    def hostile(setup, *needles):
        b = ws / "a/b/c/d" / f"bundle{next(n)}"
        shutil.copytree(lab.bundle, b)
        setup(b)
        _one_line_error(deploy(lab, b, "--host", "jetson-a"), *needles)

    hostile(lambda b: add_entry(b, "../../../../../etc/passwd"), "unsafe file name '../../../../../etc/passwd'",
            "'..', '.' or empty path component")
    hostile(lambda b: add_entry(b, str(ws / "etc/passwd")), "(absolute path)")
    hostile(lambda b: ((b / "sub").symlink_to(ws / "outside/deep"), add_entry(b, "sub/../../x", b"x")),
            "unsafe file name 'sub/../../x'")
    hostile(lambda b: ((b / "sub").symlink_to(ws / "outside"), add_entry(b, "sub/x", b"x")),
            "bundle verification failed (sub is a link (a bundle holds regular files only))")
    hostile(lambda b: ((b / "model2.onnx").symlink_to(ws / "outside/x"), add_entry(b, "model2.onnx", b"x")),
            "model2.onnx is a link")
    assert d.tree() == before and (ws / "etc/passwd").read_bytes() == b"evil"


def test_host_keys_checked_whatever_the_ssh_config_says(lab, jetson_a, tmp_path):
    """`UserKnownHostsFile none` + `StrictHostKeyChecking no` in ~/.ssh/config does not turn host-key
    checking off, and a ProxyJump hop is checked against the same known_hosts as the target."""
    d = jetson_a
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    wrong = " ".join((tmp_path / "other.pub").read_text().split()[:2])
    right = " ".join(d.host_pub)
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    for f in ("id_ed25519", "id_ed25519.pub"):
        shutil.copy2(lab.home / ".ssh" / f, home / ".ssh" / f)
    (home / ".ssh/known_hosts").write_text(f"[127.0.0.1]:{d.port} {wrong}\n")
    cfg = f"Host dev\n  HostName 127.0.0.1\n  Port {d.port}\n  User {lab.user}\n  StrictHostKeyChecking no\n"
    (home / ".ssh/config").write_text(cfg + "  UserKnownHostsFile none\n")
    env = {"HOME": str(home)}
    before = d.tree()
    _one_line_error(zcli(lab, "status", "--host", "dev", env=env), "dev: host key verification failed for")
    _one_line_error(zcli(lab, "deploy", lab.bundle, "--host", "dev", "--dry-run", env=env),
                    "dev: host key verification failed for")
    # no known_hosts at all: refused, never "nothing to check against"
    (home / ".ssh/known_hosts").unlink()
    _one_line_error(zcli(lab, "status", "--host", "dev", env=env), "host key verification failed", "no known_hosts file")
    # the config's own UserKnownHostsFile is honoured
    good = tmp_path / "good_known_hosts"
    good.write_text(f"[127.0.0.1]:{d.port} {right}\n")
    (home / ".ssh/config").write_text(cfg + f"  UserKnownHostsFile {good}\n")
    zcli(lab, "status", "--host", "dev", env=env, rc=0)
    # a jump host whose key does not match --known-hosts: refused, though the target's key is right
    jump = lab.device("jump")
    with open(lab.home / ".ssh" / "config", "a") as f:
        f.write(f"Host a-via-jump\n  HostName 127.0.0.1\n  Port {d.port}\n  User {lab.user}\n  ProxyJump jump\n\n")
    kh = tmp_path / "kh"
    kh.write_text(f"[127.0.0.1]:{d.port} {right}\n[127.0.0.1]:{jump.port} {wrong}\n")
    _one_line_error(zcli(lab, "status", "--host", "a-via-jump", "--known-hosts", kh),
                    f"a-via-jump: host key verification failed for jump host jump (on the way to a-via-jump)")
    _one_line_error(zcli(lab, "deploy", lab.bundle, "--host", "a-via-jump", "--known-hosts", kh, "--dry-run"),
                    "host key verification failed for jump host jump")
    kh.write_text(f"[127.0.0.1]:{d.port} {right}\n[127.0.0.1]:{jump.port} {' '.join(jump.host_pub)}\n")
    zcli(lab, "status", "--host", "a-via-jump", "--known-hosts", kh, rc=0)
    assert d.tree() == before


def test_signed_bundles_pinned_keys_and_a_private_config(lab, tmp_path):
    """A device that pins a signing key takes only bundles that key signed (refusals: before
    anything changes, on the workstation and again in the device agent), and the deployed
    daemon.toml holding the MQTT password is 0600, never a link into the store."""
    from zeroedge.bundle import signer

    d = lab.device("jetson-signed")
    key, other = tmp_path / "key", tmp_path / "other"
    zcli(lab, "keygen", "-o", key, rc=0)
    zcli(lab, "keygen", "-o", other, rc=0)
    signed = tmp_path / "signed"
    shutil.copytree(lab.bundle, signed)
    zcli(lab, "sign", signed, "--key", key, rc=0)
    kid = signer(signed)
    secret = tmp_path / "secret.toml"
    secret.write_text(lab.config.read_text().replace('topic = "zeroedge/readings/#"\n',
                                                     'topic = "zeroedge/readings/#"\nusername = "plant"\n'
                                                     'password = "hunter2"\n'))
    common = ["--host", "jetson-signed", "--config", secret, "--metrics-port", free_port(), "--health-timeout", 30]
    # an unsigned bundle with --pin-key: refused in preflight, nothing pinned
    before = d.tree()
    _one_line_error(deploy(lab, lab.bundle, *common, "--pin-key", f"{key}.pub"),
                    f"jetson-signed: the bundle is unsigned and the device pins signing keys ({kid})")
    assert d.tree() == before
    # a link planted in the uploads dir is replaced, never written through
    outside = d.root / "etc/outside.conf"
    outside.write_bytes(b"keep")
    outside.chmod(0o640)
    inc = d.root / "opt/zeroedge/.incoming"
    inc.mkdir(parents=True, mode=0o700)
    (inc / hashlib.sha256((signed / "manifest.json").read_bytes()).hexdigest()).symlink_to(outside)
    # signed, with --pin-key: deployed; the key pinned; the signature checked on the device
    p = deploy(lab, signed, *common, "--pin-key", f"{key}.pub", rc=0)
    assert f"pinned signing key {kid}" in p.stdout and f"signature checked by the device (key {kid})" in p.stdout
    assert outside.read_bytes() == b"keep" and _mode(outside) == 0o640
    tk = d.root / "etc/zeroedge/trusted-keys"
    assert _mode(tk) == 0o755 and _mode(tk / f"{kid}.pub") == 0o644
    assert (tk / f"{kid}.pub").read_text() == Path(f"{key}.pub").read_text()
    base = d.root / "opt/zeroedge"
    cfg = base / "current/daemon.toml"
    assert 'password = "hunter2"' in cfg.read_text()
    assert _mode(cfg) == 0o600 and cfg.stat().st_nlink == 1 and cfg.stat().st_uid == 0
    files = json.loads((base / "current/.files.json").read_text())
    assert _mode(base / "objects" / files["daemon.toml"]["sha256"]) == 0o400
    assert _mode(base / "objects") == 0o700 and not inc.exists()
    assert os.readlink(d.root / "etc/zeroedge/daemon.toml") == str(base / "current/daemon.toml")
    assert (base / "current/bundle/manifest.sig").read_bytes() == (signed / "manifest.sig").read_bytes()
    # now pinned: unsigned, signed by another key, or edited after signing: refused, nothing changes
    before = d.tree()
    _one_line_error(deploy(lab, lab.bundle, *common), "the bundle is unsigned and the device pins signing keys")
    wrong = tmp_path / "wrong"
    shutil.copytree(lab.bundle, wrong)
    zcli(lab, "sign", wrong, "--key", other, rc=0)
    _one_line_error(deploy(lab, wrong, *common),
                    f"the bundle is signed by key {signer(wrong)}, which the device does not pin (it pins {kid})")
    tampered = tmp_path / "tampered"
    shutil.copytree(signed, tampered)
    m = json.loads((tampered / "manifest.json").read_text())
    m["sensor"]["alarm"]["threshold"] = 0.01           # outside files{}: the hashes still match
    (tampered / "manifest.json").write_text(json.dumps(m))
    _one_line_error(deploy(lab, tampered, *common), "manifest.sig does not verify against manifest.json")
    assert d.tree() == before
    # the device decides for itself: the same kinds of release sent straight to its agent are refused
    good = {"op": "activate", "base": "/opt/zeroedge", "release_id": "0123456789ab", "hashes": [],
            "unit": "[Service]\n", "python": sys.executable, "build": {"backend": "onnxruntime", "steps": []}}
    unsigned = {k: v for k, v in files.items() if k != "bundle/manifest.sig"}
    edited = dict(files, **{"bundle/manifest.json": files["bundle/model.onnx"]})
    extra = dict(files, **{"bundle/extra.onnx": files["bundle/model.onnx"]})
    for f, needle in [(unsigned, "the bundle is unsigned"), (edited, "manifest.sig does not verify"),
                      (extra, "bundle files are not the ones its signed manifest lists")]:
        res = run_agent(d.root, dict(good, files=f))
        assert not res["ok"] and needle in res["error"] and "nothing was changed" in res["error"], res
    assert d.tree() == before


def test_uploads_are_private(lab, jetson_a, tmp_path, monkeypatch):
    """SFTP uploads go to a 0700 dir of the login's, each file created 0600 (never SFTP's default
    0644), and a dir that is a link, open to others or someone else's is refused."""
    import asyncio

    from zeroedge.deploy.inventory import parse_target
    from zeroedge.deploy.ssh import HostError, connect, upload

    monkeypatch.setenv("HOME", str(lab.home))
    d = jetson_a
    src = tmp_path / "daemon.toml"
    src.write_text('password = "hunter2"\n')
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    t = parse_target(f"{lab.user}@127.0.0.1:{d.port}", name="jetson-a")

    async def up(incoming, uid=os.getuid()):
        conn = await connect(t, known_hosts=str(lab.home / ".ssh/known_hosts"))
        try:
            return await upload(conn, t, [(src, sha, src.stat().st_size)], str(incoming), uid)
        finally:
            conn.close()

    inc = d.root / "tmp/zeroedge-incoming-test"
    assert asyncio.run(up(inc)) == src.stat().st_size
    assert _mode(inc) == 0o700 and _mode(inc / sha) == 0o600 and (inc / sha).read_bytes() == src.read_bytes()
    with pytest.raises(HostError, match=f"owned by uid {os.getuid()}, not 4242"):
        asyncio.run(up(inc, uid=4242))
    inc.chmod(0o755)
    with pytest.raises(HostError, match="mode 755, open to other users; refused"):
        asyncio.run(up(inc))
    shutil.rmtree(inc)
    (d.root / "elsewhere").mkdir(mode=0o700, exist_ok=True)
    inc.symlink_to(d.root / "elsewhere")
    with pytest.raises(HostError, match="zeroedge-incoming-test is a link; refused"):
        asyncio.run(up(inc))
    assert os.listdir(d.root / "elsewhere") == []
    inc.unlink()


# ------------------------------------------------------------------ deploy --serve

SERVE_IMPORTS = ("torch", "fastapi", "uvicorn", "sse_starlette")   # zeroedge serve's, asked of the device's python3


def test_deploy_serve_status_rollback(lab, tmp_path):
    """--serve: zeroedge-serve.service beside the daemon (Type=notify, watchdog, restarted on
    failure), its ExecStart `zeroedge serve` on the current release's bundle bound to 127.0.0.1,
    checked through its /health after every (re)start. An unhealthy server rolls the release back
    as an unhealthy daemon does; status shows the unit; rollback restarts, reinstalls or removes it
    with the release; a deploy without --serve stops and removes it. The unit's command line is
    also run as the real `zeroedge serve` (READY=1, WATCHDOG=1, /health on 127.0.0.1)."""
    for mod in SERVE_IMPORTS:
        pytest.importorskip(mod)
    d = lab.device("jetson-serve")
    port, sport = free_port(), free_port()
    common = ["--host", "jetson-serve", "--config", lab.config, "--metrics-port", port, "--health-timeout", 30]
    serve = ["--serve", "--serve-port", sport]
    base, units = d.root / "opt/zeroedge", d.root / "etc/systemd/system"
    unit, dropin = units / "zeroedge-serve.service", units / "zeroedge-serve.service.d/zeroedge-deploy.conf"

    # 0. refused before anything changes: --serve-port alone, the daemon's port; --dry-run says what it would do
    before = d.tree()
    _one_line_error(deploy(lab, lab.bundle, *common, "--serve-port", sport), "--serve-port", "with --serve")
    _one_line_error(deploy(lab, lab.bundle, *common, "--serve", "--serve-port", port),
                    f"jetson-serve: --serve-port {port} is the daemon's metrics port")
    p = deploy(lab, lab.bundle, *common, *serve, "--dry-run", rc=0)
    assert f"restart zeroedge.service and zeroedge-serve.service (zeroedge serve on 127.0.0.1:{sport})" in p.stdout
    assert d.tree() == before and d.calls() == []

    # 1. both units installed, (re)started and healthy
    r1 = last_json(deploy(lab, lab.bundle, *common, *serve, "--json", rc=0))["hosts"][0]
    rel1 = r1["release"]
    sh = r1["serve"]["health"]
    assert r1["ok"] and r1["health"]["ok"] and r1["serve"]["unit"] == "zeroedge-serve.service"
    assert sh["ok"] and sh["code"] == 200 and sh["body"]["status"] == "ok"
    assert sh["url"] == f"http://127.0.0.1:{sport}/health"
    text = unit.read_text()
    assert text == (lab.cwd / "zeroedge/systemd/zeroedge-serve.service").read_text()
    for line in ("Type=notify", "NotifyAccess=main", "WatchdogSec=30", "Restart=on-failure"):
        assert line in text.splitlines(), line
    cmd = [sys.executable, "-m", "zeroedge.cli", "serve", "--backend", "onnxruntime", "--bundle",
           f"{base}/current/bundle", "--host", "127.0.0.1", "--port", str(sport)]
    lines = dropin.read_text().splitlines()
    assert lines[-2:] == ["ExecStart=", "ExecStart=" + " ".join(cmd)], lines
    assert f"Environment=PYTHONPATH={base}/current/app" in lines
    assert json.loads((d.root / "var/lib/stub-systemd/serve-argv.json").read_text()) == cmd[3:]
    assert _mode(unit) == _mode(dropin) == 0o644
    calls = d.calls()
    assert ["enable", "zeroedge-serve.service"] in calls
    assert ["restart", "--no-block", "zeroedge-serve.service"] in calls    # the health check decides, not systemctl
    spid = d.serve_pid()
    assert spid

    # 2. status shows the serve unit
    p = zcli(lab, "status", "--host", "jetson-serve", rc=0)
    assert f"jetson-serve: zeroedge-serve.service active on 127.0.0.1:{sport}; health ok" in p.stdout, p.stdout

    # 3. the same deploy again: unchanged, both checked, nothing restarted
    n = len(d.calls())
    p = deploy(lab, lab.bundle, *common, *serve, rc=0)
    assert f"release {rel1} already current, unchanged; health ok" in p.stdout, p.stdout
    assert f"jetson-serve: zeroedge-serve.service serving on 127.0.0.1:{sport}; health ok (sequential)" in p.stdout
    assert d.serve_pid() == spid and not [c for c in d.calls()[n:] if c[0] == "restart"]

    # 4. the installed command line is a working zeroedge serve (a model bundle in place of the sensor one)
    _run_serve_unit_command(dropin, tmp_path)

    # 5. a release whose server is unhealthy (503 from /health) is rolled back on the spot
    b2 = make_sensor_bundle(tmp_path / "bundle2", seed=1)
    sick = d.root / "etc/fake-serve-unhealthy"
    sick.write_text(hashlib.sha256((b2 / "manifest.json").read_bytes()).hexdigest())
    p = deploy(lab, b2, "--host", "jetson-serve", "--config", lab.config, "--metrics-port", port, *serve,
               "--health-timeout", 8)      # the daemon must still be healthy in time, the server never is
    assert p.returncode == 1, (p.stdout, p.stderr)
    err = p.stderr.strip().splitlines()[-1]     # after the upload's progress bar
    assert "Traceback" not in p.stderr and err.startswith("zeroedge: error: jetson-serve: release "), p.stderr
    assert (f"zeroedge-serve.service is not healthy (HTTP 503 status=error (the engine is not running) from "
            f"http://127.0.0.1:{sport}/health); rolled back to {rel1}; serve log: fake zeroedge serve: engine "
            "stopped") in err, err
    assert os.readlink(base / "current") == f"releases/{rel1}"
    h = last_json(zcli(lab, "status", "--host", "jetson-serve", "--json", rc=0))["hosts"][0]
    assert h["release"] == rel1 and h["health"]["ok"]
    assert h["result"]["serve"]["service"] == "active" and h["result"]["serve"]["health"]["ok"]
    assert d.serve_pid() not in (None, spid)

    # 6. a deploy without --serve stops and removes the serve unit
    rel2 = sorted(os.listdir(base / "releases"))[-1]        # the release rolled back in 5
    n = len(d.calls())
    p = deploy(lab, b2, *common, rc=0)
    assert "zeroedge-serve.service stopped and removed (this deploy has no --serve)" in p.stdout, p.stdout
    rel3 = os.readlink(base / "current").split("/")[-1]
    assert rel3 not in (rel1, rel2) and rel3 > rel2
    assert [c for c in d.calls()[n:] if "zeroedge-serve.service" in c] == [
        ["stop", "zeroedge-serve.service"], ["disable", "zeroedge-serve.service"]]
    assert not list(units.glob("zeroedge-serve*")) and d.serve_pid() is None
    p = zcli(lab, "status", "--host", "jetson-serve", rc=0)
    assert "service active; health ok" in p.stdout and "zeroedge-serve" not in p.stdout, p.stdout

    # 7. rollback to a release deployed with --serve (its server healthy now): the unit is back,
    # started and checked; and back to the one without: stopped and removed again
    sick.unlink()
    p = zcli(lab, "rollback", "--host", "jetson-serve", rc=0)
    assert f"rolled back {rel3} -> {rel2}; health ok; zeroedge-serve.service health ok" in p.stdout, p.stdout
    assert unit.read_text() == text and dropin.read_text().splitlines() == lines and d.serve_pid()
    p = zcli(lab, "rollback", "--host", "jetson-serve", "--to", rel3, rc=0)
    assert f"zeroedge-serve.service stopped and removed ({rel3} has no serve unit)" in p.stdout, p.stdout
    assert not list(units.glob("zeroedge-serve*")) and d.serve_pid() is None


def _run_serve_unit_command(dropin: Path, tmp: Path):
    """The serve unit's command line run as systemd runs it (the drop-in's WorkingDirectory,
    Environment= and ExecStart, with NOTIFY_SOCKET and WATCHDOG_USEC), on an exported tiny model
    bundle and a free port in place of the release's sensor bundle and the port the fake holds: it
    says READY=1 and WATCHDOG=1, and answers /health with 200 on 127.0.0.1."""
    import shlex
    import urllib.request

    from zeroedge.export.bundle_writer import export_bundle
    from zeroedge.model import build

    model = tmp / "model-bundle"
    export_bundle(build("tiny", seed=0), model, window=64)
    env, wd, argv = dict(os.environ), "/", None
    for line in dropin.read_text().splitlines():
        key, _, value = line.partition("=")
        if key == "Environment":
            k, _, v = value.partition("=")
            env[k] = v
        elif key == "WorkingDirectory":
            wd = value
        elif key == "ExecStart" and value:
            argv = shlex.split(value)
    port = free_port()
    argv[argv.index("--bundle") + 1], argv[argv.index("--port") + 1] = str(model), str(port)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    sock_path = tmp / "notify"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(sock_path))
    notify.settimeout(60)
    env.update(NOTIFY_SOCKET=str(sock_path), WATCHDOG_USEC="1000000")
    proc = subprocess.Popen(argv, cwd=wd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        got = []
        while not {"READY=1", "WATCHDOG=1"} <= set(got):
            try:
                got += notify.recv(4096).decode().splitlines()
            except socket.timeout:
                break
        assert {"READY=1", "WATCHDOG=1"} <= set(got), (got, proc.poll())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            assert r.status == 200 and json.loads(r.read())["status"] == "ok"
        if shutil.which("ss"):
            ss = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout
            assert [c for c in ss.split() if c.endswith(f":{port}")] == [f"127.0.0.1:{port}"], ss
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out = proc.communicate(timeout=30)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0].decode(errors="replace")
        notify.close()
    # exit 0, or death by the SIGTERM it was sent (uvicorn raises the signal it handled again once it
    # has shut down): both a clean stop to systemd, so Restart=on-failure leaves it stopped
    assert proc.returncode in (0, -signal.SIGTERM), out[-2000:]


def test_serve_unit_files_command_and_preflight(tmp_path, monkeypatch):
    """The device agent's side of --serve, on a fake root without SSH: the unit and drop-in are
    written through directory fds, never through a link (a link where either goes is refused, a
    planted temp-file link replaced); the ExecStart serves the TensorRT engines when the release's
    build made them, always on 127.0.0.1; removal touches nothing when the deploy never installed
    the unit; a bad serve spec is refused by the agent; preflight asks the device's python3 for
    zeroedge serve's imports only with --serve."""
    from zeroedge.deploy import preflight as pf
    from zeroedge.deploy.remote import Device, Fail
    from zeroedge.device.probe import probe

    root = make_jetson(tmp_path / "root")
    monkeypatch.setenv("ZEROEDGE_DEVICE_ROOT", str(root))
    monkeypatch.setenv("PATH", f"{root}/stub-bin:{os.environ['PATH']}")
    name = "20260101T000000000000Z-0123456789ab"
    rel = root / "opt/zeroedge/releases" / name
    rel.mkdir(parents=True)
    serve_unit = "[Unit]\nDescription=test\n"
    (rel / ".service.json").write_text(json.dumps({"unit": "[Service]\n", "python": "/usr/bin/python3",
                                                   "serve": {"unit": serve_unit, "port": 8123}}))
    (rel / "build.json").write_text(json.dumps({"backend": "tensorrt", "steps": [
        {"name": "plugins", "seconds": 1.0}, {"name": "engine", "seconds": 2.0}]}))
    units = root / "etc/systemd/system"
    unit, dd = units / "zeroedge-serve.service", units / "zeroedge-serve.service.d"
    outside, elsewhere = tmp_path / "outside", tmp_path / "elsewhere"
    outside.write_text("keep")
    elsewhere.mkdir()
    dev = Device({"base": "/opt/zeroedge"})
    assert dev.remove_serve() is False and not (root / "var/lib/stub-systemd/calls.jsonl").exists()
    unit.symlink_to(outside)
    with pytest.raises(Fail, match="zeroedge-serve.service is not a regular file"):
        dev.install_serve(name)
    unit.unlink()
    dd.symlink_to(elsewhere)
    with pytest.raises(Fail, match=r"zeroedge-serve.service.d is not a directory"):
        dev.install_serve(name)
    dd.unlink()
    (units / f".zeroedge-serve.service.tmp-{os.getpid()}").symlink_to(outside)
    assert dev.install_serve(name) is True and dev.install_serve(name) is False
    assert outside.read_text() == "keep" and os.listdir(elsewhere) == []
    assert unit.read_text() == serve_unit and not unit.is_symlink() and _mode(unit) == 0o644
    cur = root / "opt/zeroedge/current"
    assert (dd / "zeroedge-deploy.conf").read_text().splitlines()[-1] == (
        f"ExecStart=/usr/bin/python3 -m zeroedge.cli serve --backend tensorrt --bundle {cur}/bundle "
        f"--engines {cur}/build --plugins {cur}/build/plugins/libzeroedge_plugins.so --host 127.0.0.1 --port 8123")
    calls = (root / "var/lib/stub-systemd/calls.jsonl").read_text().splitlines()
    assert [json.loads(c) for c in calls] == [["daemon-reload"], ["enable", "zeroedge-serve.service"]]
    assert dev.remove_serve() is True and not list(units.glob("zeroedge-serve*"))
    # the agent refuses a serve spec it cannot use, before anything is done
    for bad in ({"unit": "[Unit]\n", "port": 0}, {"unit": "", "port": 8000}, {"port": 8000},
                {"unit": "[Unit]\n", "port": True}, {"unit": "[Unit]\n", "port": 8000, "host": "0.0.0.0"}):
        res = run_agent(root, {"op": "activate", "base": "/opt/zeroedge", "serve": bad})
        assert not res["ok"] and res["error"].startswith("bad serve spec"), (bad, res)
    # preflight: zeroedge serve's imports are asked for with --serve only
    facts = probe(root=str(root), want_modules=list(pf.DAEMON_MODULES) + list(pf.SERVE_MODULES))
    facts["modules"].update(fastapi=False, sse_starlette=False)
    manifest = {"target": "jetpack-6.2", "files": {}}
    assert not [p for p in pf.evaluate(facts, manifest, 0, 0).problems if "fastapi" in p]
    problems = pf.evaluate(facts, manifest, 0, 0, serve=True).problems
    assert problems == ["device python3 lacks fastapi, sse-starlette, which zeroedge serve needs (--serve); "
                        "install with: python3 -m pip install fastapi sse-starlette"], problems
