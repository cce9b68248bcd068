"""`zeroedge deploy / rollback / status` against a real OpenSSH sshd on 127.0.0.1.

Each fake device is a real sshd (Debian openssh-server, temporary host key, authorized_keys) whose
sessions get ZEROEDGE_DEVICE_ROOT=<fake root> and a PATH starting with the root's stub bin/ (the
hardware/OS boundary; set by a ForceCommand, after the login shell's rc files, so a host whose
~/.bashrc puts its own python3 first, e.g. pyenv's shims, does not leak into the device): `systemctl` and `journalctl` stubs that record calls and run the unit's
ExecStart (from the installed unit + drop-in) as a background process, and `python3` = this Python
(which has onnxruntime, paho and prometheus-client, as a prepared Jetson would). Where a test listens
for a unit's sd_notify messages, the stub hands the unit NOTIFY_SOCKET and WATCHDOG_USEC as systemd
would. The fake root has /etc/nv_tegra_release, /proc/device-tree and /proc/meminfo. The client side
is a temporary HOME with ~/.ssh/config (aliases), known_hosts and a key: deploy reads them exactly as
it would for a user.

The daemon that answers /healthz is the real `zeroedge daemon` (zeroedge/daemon), on onnxruntime,
reading MQTT from a real mosquitto started here. The bundle is a real sensor bundle built from an
ONNX graph (onnx helper API) run by onnxruntime. The server that answers /health (deploy --serve) is
the real `zeroedge serve` on a tiny exported model bundle (zeroedge.export), on onnxruntime.

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
(unit + drop-ins, last ExecStart wins, Environment=, WorkingDirectory=) in the background, with
NOTIFY_SOCKET (and WATCHDOG_USEC from WatchdogSec=) when <state>/<unit>.notify-socket names a socket
a test listens on."""
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
    execs, env, wd, watchdog = [], {}, "/", None
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
            elif line.startswith("WatchdogSec="):
                watchdog = float(line[len("WatchdogSec="):])
    if not execs:
        sys.exit("stub systemctl: %s has no ExecStart" % unit)
    try:
        env["NOTIFY_SOCKET"] = open(os.path.join(state, unit + ".notify-socket")).read().strip()
        if watchdog:
            env["WATCHDOG_USEC"] = str(int(watchdog * 1e6))
    except OSError:
        pass
    log = open(os.path.join(root, "var/log", unit + ".log"), "ab")
    argv = shlex.split(execs[-1])
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
def alive(pid) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, TypeError):
        return False


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
    for n in ("systemctl", "journalctl", "python3"):
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
        return pid if alive(pid) else None

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
    ws = tmp_path / "ws"                       # the same paths on the workstation: never resolved
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


class Notifications:
    """A datagram socket in place of systemd's notify socket for one unit of a fake device: the stub
    systemctl hands its path to the unit's process as NOTIFY_SOCKET; a thread keeps what arrives."""

    def __init__(self, device, unit):
        import tempfile
        import threading

        self.dir = tempfile.mkdtemp(prefix="zn-")      # short: a socket's path holds 107 bytes at most
        self.path = os.path.join(self.dir, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.got, self.done = [], False
        state = device.root / "var/lib/stub-systemd"
        state.mkdir(parents=True, exist_ok=True)
        (state / f"{unit}.notify-socket").write_text(self.path)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        while not self.done:
            try:
                self.got += self.sock.recv(4096).decode().splitlines()
            except socket.timeout:
                continue
            except OSError:
                return

    def wait_for(self, since: int, *states, timeout=30.0):
        """The messages from index `since` on, once they hold every one of `states` (or at timeout)."""
        t = time.time()
        while not set(states) <= set(self.got[since:]) and time.time() - t < timeout:
            time.sleep(0.05)
        return self.got[since:]

    def close(self):
        self.done = True
        self.thread.join(2)
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def complete(port: int) -> dict:
    """A real completion from zeroedge serve on 127.0.0.1:port: the model id from /v1/models, then
    POST /v1/completions of 3 tokens after the token ids [5, 6, 7]."""
    import urllib.request

    url = f"http://127.0.0.1:{port}/v1"
    with urllib.request.urlopen(url + "/models", timeout=10) as r:
        model = json.loads(r.read())["data"][0]["id"]
    req = urllib.request.Request(url + "/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": model, "prompt": [5, 6, 7], "max_tokens": 3}).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        body = json.loads(r.read())
    c, u = body["choices"][0], body["usage"]
    assert body["object"] == "text_completion" and body["model"] == model == "tiny", body
    assert u["prompt_tokens"] == 3 and 1 <= u["completion_tokens"] <= 3 and isinstance(c["text"], str), body
    assert c["finish_reason"] == "length" if u["completion_tokens"] == 3 else c["finish_reason"] == "stop", body
    return body


def test_deploy_serve_role_follows_the_bundle(lab, tmp_path):
    """A release runs one service and its bundle decides which: a model bundle deployed with --serve
    runs zeroedge-serve.service (the real `zeroedge serve` on the release's bundle, 127.0.0.1 only,
    READY=1 and WATCHDOG=1 to systemd, health through /health, completions over HTTP) and no daemon;
    a sensor bundle runs zeroedge.service as ever. Every deploy and rollback stops and removes the
    other unit where a deploy installed it, so the device goes daemon -> serve -> daemon and back;
    status shows the current release's service; a server that never gets healthy is rolled back on
    the spot, to a daemon release. The mismatches (--serve with a sensor bundle, a model bundle
    without --serve) are refused with one line before anything changes."""
    for mod in SERVE_IMPORTS:
        pytest.importorskip(mod)
    from zeroedge import __version__
    from zeroedge.export.bundle_writer import export_bundle
    from zeroedge.model import build

    d = lab.device("jetson-serve")
    model = tmp_path / "model-bundle"
    export_bundle(build("tiny", seed=0), model, window=64, flavours=("portable",))
    port, sport = free_port(), free_port()
    host = ["--host", "jetson-serve"]
    daemon = [*host, "--config", lab.config, "--metrics-port", port, "--health-timeout", 30]
    serve = [*host, "--serve", "--serve-port", sport, "--health-timeout", 60]
    base, units = d.root / "opt/zeroedge", d.root / "etc/systemd/system"
    unit, dropin = units / "zeroedge-serve.service", units / "zeroedge-serve.service.d/zeroedge-deploy.conf"
    daemon_dropin, etc_cfg = units / "zeroedge.service.d/zeroedge-deploy.conf", d.root / "etc/zeroedge/daemon.toml"
    notes = Notifications(d, "zeroedge-serve.service")
    try:
        # 0. refused before anything changes: the two mismatches, --serve-port alone, --config with --serve;
        # --dry-run says what it would do
        before = d.tree()
        _one_line_error(deploy(lab, lab.bundle, *serve), f"{lab.bundle} is a sensor bundle",
                        "the sensor daemon (zeroedge.service) runs it, not zeroedge serve; deploy it without --serve")
        _one_line_error(deploy(lab, model, *daemon), f"{model} is a model bundle (it has a decode graph)",
                        "zeroedge serve runs it", "deploy it with --serve")
        _one_line_error(deploy(lab, model, *host, "--serve-port", sport), "--serve-port", "with --serve")
        _one_line_error(deploy(lab, model, *serve, "--config", lab.config), "--config is the sensor daemon's")
        p = deploy(lab, model, *serve, "--dry-run", rc=0)
        assert f"restart zeroedge-serve.service (zeroedge serve on 127.0.0.1:{sport}; no daemon" in p.stdout, p.stdout
        assert d.tree() == before and d.calls() == []

        # 1. a sensor bundle: the daemon, as ever
        r1 = last_json(deploy(lab, lab.bundle, *daemon, "--json", rc=0))["hosts"][0]
        rel1, dpid = r1["release"], d.daemon_pid()
        assert r1["role"] == "daemon" and r1["health"]["url"].endswith(f":{port}/healthz") and "removed" not in r1
        assert daemon_dropin.is_file() and os.path.islink(etc_cfg) and not unit.exists() and alive(dpid)

        # 2. the model bundle with --serve: zeroedge serve on it; the daemon stopped and removed
        n = len(d.calls())
        r2 = last_json(deploy(lab, model, *serve, "--json", rc=0))["hosts"][0]
        rel2, h = r2["release"], r2["health"]
        assert r2["ok"] and r2["role"] == "serve" and r2["removed"] == "zeroedge.service" and r2["previous"] == rel1
        assert h["ok"] and h["code"] == 200 and h["body"]["status"] == "ok" and h["body"]["mode"] == "sequential"
        assert h["url"] == f"http://127.0.0.1:{sport}/health" and r2["serve"]["port"] == sport
        calls = d.calls()[n:]
        assert [c for c in calls if "zeroedge.service" in c] == [["stop", "zeroedge.service"],
                                                                  ["disable", "zeroedge.service"]], calls
        assert ["enable", "zeroedge-serve.service"] in calls
        assert ["restart", "--no-block", "zeroedge-serve.service"] in calls  # the health check decides, not systemctl
        assert not list(units.glob("zeroedge.service*")) and not os.path.lexists(etc_cfg) and not alive(dpid)
        cur = base / "current"
        assert os.readlink(cur) == f"releases/{rel2}" and not (cur / "daemon.toml").exists()
        info = json.loads((cur / "release.json").read_text())
        assert info["role"] == "serve" and info["serve_port"] == sport and "metrics_port" not in info
        text = unit.read_text()
        assert text == (lab.cwd / "zeroedge/systemd/zeroedge-serve.service").read_text()
        for line in ("Type=notify", "NotifyAccess=main", "WatchdogSec=30", "Restart=on-failure"):
            assert line in text.splitlines(), line
        cmd = [sys.executable, "-m", "zeroedge.cli", "serve", "--backend", "onnxruntime", "--bundle",
               f"{base}/current/bundle", "--host", "127.0.0.1", "--port", str(sport)]
        lines = dropin.read_text().splitlines()
        assert lines[-2:] == ["ExecStart=", "ExecStart=" + " ".join(cmd)], lines
        assert f"Environment=PYTHONPATH={base}/current/app" in lines and _mode(unit) == _mode(dropin) == 0o644
        spid = d.serve_pid()
        assert Path(f"/proc/{spid}/cmdline").read_bytes().split(b"\0")[:-1] == [c.encode() for c in cmd]
        got = notes.wait_for(0, "READY=1", "WATCHDOG=1")
        assert {"READY=1", "WATCHDOG=1"} <= set(got), got
        complete(sport)
        if shutil.which("ss"):
            ss = subprocess.run(["ss", "-Hltn", f"sport = :{sport}"], capture_output=True, text=True).stdout
            assert [c for c in ss.split() if c.endswith(f":{sport}")] == [f"127.0.0.1:{sport}"], ss

        # 3. status shows the server as the release's service
        p = zcli(lab, "status", *host, rc=0)
        assert f"jetson-serve: release {rel2} (bundle model-bundle, backend onnxruntime, 2 kept)" in p.stdout, p.stdout
        assert (f"jetson-serve: zeroedge {__version__}; zeroedge-serve.service active on 127.0.0.1:{sport}; "
                "health ok (sequential)") in p.stdout, p.stdout
        assert "; server RSS " in p.stdout and "daemon" not in p.stdout, p.stdout

        # 4. the same deploy again: unchanged, checked, nothing restarted
        n = len(d.calls())
        p = deploy(lab, model, *serve, rc=0)
        assert (f"release {rel2} already current, unchanged; zeroedge-serve.service serving on 127.0.0.1:{sport}; "
                "health ok (sequential)") in p.stdout, p.stdout
        assert d.serve_pid() == spid and not [c for c in d.calls()[n:] if c[0] in ("restart", "stop")]

        # 5. rollback to the sensor release: the daemon back, the server stopped and removed
        p = zcli(lab, "rollback", *host, rc=0)
        assert (f"rolled back {rel2} -> {rel1}; health ok; zeroedge-serve.service stopped and removed "
                f"({rel1} has no serve unit)") in p.stdout, p.stdout
        assert not list(units.glob("zeroedge-serve*")) and d.serve_pid() is None and not alive(spid)
        assert daemon_dropin.is_file() and os.readlink(etc_cfg) == str(base / "current/daemon.toml")
        h = last_json(zcli(lab, "status", *host, "--json", rc=0))["hosts"][0]
        assert h["release"] == rel1 and h["result"]["role"] == "daemon" and h["health"]["body"]["status"] == "ok"

        # 6. a server that never gets healthy (its port is taken) is rolled back on the spot, to the daemon
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        try:
            tport = taken.getsockname()[1]
            p = deploy(lab, model, *host, "--serve", "--serve-port", tport, "--health-timeout", 4)
        finally:
            taken.close()
        assert p.returncode == 1, (p.stdout, p.stderr)
        err = p.stderr.strip().splitlines()[-1]     # after the upload's progress bar
        assert "Traceback" not in p.stderr and err.startswith("zeroedge: error: jetson-serve: release "), p.stderr
        assert "zeroedge-serve.service is not healthy (" in err, err
        assert f"from http://127.0.0.1:{tport}/health); rolled back to {rel1}" in err, err
        assert os.readlink(base / "current") == f"releases/{rel1}" and d.serve_pid() is None
        assert not list(units.glob("zeroedge-serve*")) and daemon_dropin.is_file() and alive(d.daemon_pid())
        h = last_json(zcli(lab, "status", *host, "--json", rc=0))["hosts"][0]
        assert h["result"]["role"] == "daemon" and h["health"]["ok"]

        # 7. rollback to the serve release: the server back on its bundle, the daemon stopped and removed
        since = len(notes.got)
        p = zcli(lab, "rollback", *host, "--to", rel2, rc=0)
        assert (f"rolled back {rel1} -> {rel2}; zeroedge-serve.service health ok; zeroedge.service stopped and "
                f"removed ({rel2} runs zeroedge serve, no daemon)") in p.stdout, p.stdout
        assert unit.read_text() == text and dropin.read_text().splitlines() == lines
        assert not list(units.glob("zeroedge.service*")) and not os.path.lexists(etc_cfg)
        assert "READY=1" in notes.wait_for(since, "READY=1")
        complete(sport)

        # 8. a deploy of the sensor bundle (no --serve): the daemon again, the server stopped and removed
        n = len(d.calls())
        p = deploy(lab, lab.bundle, *daemon, rc=0)
        assert "zeroedge-serve.service stopped and removed (this deploy has no --serve)" in p.stdout, p.stdout
        assert [c for c in d.calls()[n:] if "zeroedge-serve.service" in c] == [
            ["stop", "zeroedge-serve.service"], ["disable", "zeroedge-serve.service"]]
        assert not list(units.glob("zeroedge-serve*")) and d.serve_pid() is None and alive(d.daemon_pid())
        p = zcli(lab, "status", *host, rc=0)
        assert "service active; health ok" in p.stdout and "zeroedge-serve" not in p.stdout, p.stdout
    finally:
        notes.close()


def test_serve_unit_files_command_and_preflight(tmp_path, monkeypatch):
    """The device agent's side of --serve, on a fake root without SSH: the unit and drop-in are
    written through directory fds, never through a link (a link where either goes is refused, a
    planted temp-file link replaced); the ExecStart serves the TensorRT engines when the release's
    build made them, always on 127.0.0.1; removal (of either unit) touches nothing when the deploy
    never installed the unit, and the daemon's goes with the /etc/zeroedge/daemon.toml link deploy
    made, never an admin's file; a release runs one service: a payload with both units, or a
    bundle that is not the kind its service runs, is refused by the agent before anything changes,
    as is a bad serve spec; preflight asks the device's python3 for zeroedge serve's imports, and
    not the daemon's, only with --serve."""
    from zeroedge.deploy import preflight as pf
    from zeroedge.deploy.remote import UNIT, Device, Fail
    from zeroedge.device.probe import probe
    from zeroedge.trust import bundle_role, role_problem

    root = make_jetson(tmp_path / "root")
    monkeypatch.setenv("ZEROEDGE_DEVICE_ROOT", str(root))
    monkeypatch.setenv("PATH", f"{root}/stub-bin:{os.environ['PATH']}")
    name = "20260101T000000000000Z-0123456789ab"
    rel = root / "opt/zeroedge/releases" / name
    rel.mkdir(parents=True)
    serve_unit = "[Unit]\nDescription=test\n"
    (rel / ".service.json").write_text(json.dumps({"python": "/usr/bin/python3",
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
    # the daemon's unit: removed only where a deploy installed it; the daemon.toml link with it
    daemon_rel = "20260101T000000000001Z-ba9876543210"
    (root / "opt/zeroedge/releases" / daemon_rel).mkdir()
    (root / "opt/zeroedge/releases" / daemon_rel / ".service.json").write_text(
        json.dumps({"unit": "[Service]\n", "python": "/usr/bin/python3"}))
    assert dev.serve_of(daemon_rel) is None and dev.serve_of(name)["port"] == 8123
    legacy = root / "opt/zeroedge/releases/20260101T000000000002Z-aaaaaaaaaaaa"   # both units: a sensor bundle's
    legacy.mkdir()
    (legacy / ".service.json").write_text(json.dumps({"unit": "[Service]\n", "python": "/usr/bin/python3",
                                                      "serve": {"unit": serve_unit, "port": 8123}}))
    assert dev.serve_of(legacy.name) is None
    n_calls = len((root / "var/lib/stub-systemd/calls.jsonl").read_text().splitlines())
    assert dev.remove_unit(UNIT) is False
    assert len((root / "var/lib/stub-systemd/calls.jsonl").read_text().splitlines()) == n_calls
    etc = root / "etc/zeroedge/daemon.toml"
    assert dev.install_services(daemon_rel) == (True, None) and os.path.islink(etc)
    assert (units / UNIT).is_file() and (units / f"{UNIT}.d/zeroedge-deploy.conf").is_file()
    assert dev.install_services(name) == (True, UNIT)
    assert not list(units.glob("zeroedge.service*")) and not os.path.lexists(etc) and unit.is_file()
    assert dev.install_services(daemon_rel) == (True, "zeroedge-serve.service")
    assert not list(units.glob("zeroedge-serve*")) and os.path.islink(etc)
    etc.unlink()
    etc.write_text("# the admin's own\n")
    assert dev.remove_unit(UNIT) is True and etc.read_text() == "# the admin's own\n"
    # one service a release, the kind its bundle is: refused by the agent before anything changes
    sensor = json.dumps({"format": "zeroedge-bundle", "kind": "sensor", "files": {}}).encode()
    llm = json.dumps({"format": "zeroedge-bundle", "model": {"dim": 8}, "files": {},
                      "graph_files": {"prefill.portable.onnx": {"graph": "prefill"},
                                      "decode.portable.onnx": {"graph": "decode"}}}).encode()
    objects = root / "opt/zeroedge/objects"
    objects.mkdir(parents=True, exist_ok=True)
    sha = {}
    for data in (sensor, llm):
        sha[data] = hashlib.sha256(data).hexdigest()
        (objects / sha[data]).write_bytes(data)
    assert bundle_role(json.loads(sensor)) == "daemon" and bundle_role(json.loads(llm)) == "serve"
    foreign = dict(json.loads(llm), graph_files={"prefill.portable.onnx": {"graph": "prefill"}})
    assert bundle_role(foreign) is None and "lists no decode graph" in role_problem(foreign, True)
    assert "is not a sensor bundle (kind=None)" in role_problem(foreign, False)
    before = tree(root)
    good = {"op": "activate", "base": "/opt/zeroedge", "release_id": "0123456789ab", "hashes": [],
            "python": sys.executable, "build": {"backend": "onnxruntime", "steps": []}}
    spec = {"unit": "[Unit]\n", "port": 8000}
    for payload, needle in [
            (dict(good, unit="[Service]\n", serve=spec, files={}), "bad payload: a release runs the daemon's unit or"),
            (dict(good, serve=spec, files={"bundle/manifest.json": {"sha256": sha[sensor]}}),
             "the release's bundle is a sensor bundle"),
            (dict(good, unit="[Service]\n", files={"bundle/manifest.json": {"sha256": sha[llm]}}),
             "the release's bundle is a model bundle (it has a decode graph)")]:
        res = run_agent(root, payload)
        assert not res["ok"] and res["error"].startswith(needle), (needle, res)
        assert "nothing was changed" in res["error"] or needle.startswith("bad payload"), res
    assert tree(root) == before
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
    # a --serve release runs no daemon: the daemon's own imports are not asked for
    facts["modules"].update(fastapi=True, sse_starlette=True, paho=False)
    assert pf.evaluate(facts, manifest, 0, 0, serve=True).problems == []
    assert pf.evaluate(facts, manifest, 0, 0).problems == [
        "device python3 lacks paho-mqtt; install with: python3 -m pip install paho-mqtt"]
