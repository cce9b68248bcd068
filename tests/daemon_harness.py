"""Helpers for the daemon's tests and benchmarks (benchmarks/daemon_faults.py, benchmarks/sensor_bench.py):
a real mosquitto on 127.0.0.1, a daemon subprocess, a QoS 1 publisher with a persistent session.
Not part of the installed package."""
from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mosquitto_bin():
    return shutil.which("mosquitto") or next((p for p in ("/usr/sbin/mosquitto", "/usr/bin/mosquitto")
                                              if os.path.exists(p)), None)


def make_pki(out: Path, host: str = "127.0.0.1") -> dict:
    """A test CA, a server certificate for `host` (IP SAN), a client certificate, and a second CA
    that signed nothing (for "wrong CA" tests). Returns {name: path}; keys are 0600."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject, key, issuer, issuer_key, ca=False, san=None, usage=None):
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        if usage:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if ca:
            b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                              content_commitment=False, key_encipherment=False,
                                              data_encipherment=False, key_agreement=False,
                                              encipher_only=False, decipher_only=False), critical=True)
        return b.sign(issuer_key, hashes.SHA256())

    def save(stem, key, crt):
        kp, cp = out / f"{stem}.key", out / f"{stem}.pem"
        kp.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))
        kp.chmod(0o600)
        cp.write_bytes(crt.public_bytes(serialization.Encoding.PEM))
        return cp, kp

    paths = {}
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert("zeroedge test CA", ca_key, "zeroedge test CA", ca_key, ca=True)
    paths["ca"], _ = save("ca", ca_key, ca)
    other_key = ec.generate_private_key(ec.SECP256R1())
    paths["other_ca"], _ = save("other-ca", other_key, cert("another CA", other_key, "another CA", other_key, ca=True))
    for stem, san, usage in (("server", [x509.IPAddress(ipaddress.ip_address(host))], ExtendedKeyUsageOID.SERVER_AUTH),
                             ("client", None, ExtendedKeyUsageOID.CLIENT_AUTH)):
        k = ec.generate_private_key(ec.SECP256R1())
        paths[stem], paths[stem + "_key"] = save(stem, k, cert(f"zeroedge {stem}", k, "zeroedge test CA", ca_key,
                                                               san=san, usage=usage))
    return paths


class Broker:
    """mosquitto with persistence (queued QoS 1 messages survive a restart). With `pki`
    (make_pki's dict) the listener speaks TLS only and requires a client certificate; with
    `users` ({name: password}) anonymous clients are refused."""

    def __init__(self, workdir: Path, port: int = None, pki: dict = None, users: dict = None):
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.conf = self.dir / "mosquitto.conf"
        # as root, mosquitto drops to user "mosquitto", which cannot write this folder: keep the current user
        conf = (f"user {getpass.getuser()}\n"
                f"listener {self.port} 127.0.0.1\nallow_anonymous {'false' if users else 'true'}\n"
                f"persistence true\npersistence_location {self.dir}/\nautosave_interval 1\n"
                f"max_queued_messages 1000000\nmax_inflight_messages 1000\n"
                f"log_dest file {self.dir}/mosquitto.log\n")
        if pki:
            conf += (f"cafile {pki['ca']}\ncertfile {pki['server']}\nkeyfile {pki['server_key']}\n"
                     "require_certificate true\n")
        if users:
            pw = self.dir / "passwd"
            pw.write_text("")
            for user, password in users.items():
                subprocess.run([shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd", "-b", str(pw),
                                user, password], check=True, capture_output=True)
            pw.chmod(0o600)
            conf += f"password_file {pw}\n"
        self.conf.write_text(conf)
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen([mosquitto_bin(), "-c", str(self.conf)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t = time.time()
        while time.time() - t < 10:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"mosquitto exited: {(self.dir / 'mosquitto.log').read_text()[-500:]}")
                time.sleep(0.05)
        raise RuntimeError("mosquitto did not start")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def write_config(path: Path, bundle, source: dict, metrics_port: int, output: dict = None, **daemon) -> Path:
    def val(v):
        return json.dumps(str(v) if isinstance(v, Path) else v)

    d = {"bundle": str(bundle), "state_dir": "state", **daemon}
    lines = ["[daemon]"] + [f"{k} = {val(v)}" for k, v in d.items()]
    lines += ["[source]"] + [f"{k} = {val(v)}" for k, v in source.items()]
    out = {"jsonl": "results.jsonl", **(output or {})}
    lines += ["[output]"] + [f"{k} = {val(v)}" for k, v in out.items()]
    lines += ["[metrics]", f"port = {metrics_port}"]
    path.write_text("\n".join(lines) + "\n")
    return path


class DaemonProc:
    """`zeroedge daemon --config FILE` as a subprocess; logs to daemon.log beside the config."""

    def __init__(self, config: Path, metrics_port: int, env=None, args=()):
        self.config = Path(config)
        self.port = metrics_port
        self.env = dict(os.environ, **(env or {}))
        self.args = list(args)
        self.proc = None
        self.log = self.config.parent / "daemon.log"

    def start(self, wait_healthy: bool = True, timeout: float = 60):
        """Start; with wait_healthy, return once /healthz says "ok" (for MQTT: subscribed)."""
        f = open(self.log, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "zeroedge.cli", "daemon", "--config",
                                      str(self.config), *self.args], stdout=f, stderr=f, env=self.env,
                                     cwd=self.config.parent)
        f.close()
        if wait_healthy:
            t = time.time()
            while time.time() - t < timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited rc={self.proc.returncode}: {self.log.read_text()[-2000:]}")
                try:
                    if self.get("/healthz")[0] == 200:
                        return self
                except OSError:
                    pass
                time.sleep(0.1)
            raise RuntimeError("daemon did not come up: " + self.log.read_text()[-2000:])
        return self

    def get(self, path: str):
        """(status, body) of GET http://127.0.0.1:port/path."""
        import urllib.error

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def health(self) -> dict:
        return json.loads(self.get("/healthz")[1])

    def kill9(self):
        self.proc.kill()
        self.proc.wait()

    def terminate(self, timeout=60) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout)


class Publisher:
    """QoS 1 publisher with a persistent session; keeps every publish until the broker acks it."""

    def __init__(self, port: int, client_id: str = "zeroedge-test-pub", pki: dict = None, user=None):
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        if pki:
            self.c.tls_set(ca_certs=str(pki["ca"]), certfile=str(pki["client"]), keyfile=str(pki["client_key"]))
        if user:
            self.c.username_pw_set(*user)
        self.c.reconnect_delay_set(0.1, 1)
        self.c.max_queued_messages_set(0)
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 3600
        self.c.connect("127.0.0.1", port, clean_start=False, properties=props)
        self.c.loop_start()
        self.infos = []

    def wait_connected(self, timeout: float = 30):
        t = time.time()
        while not self.c.is_connected():
            if time.time() - t > timeout:
                raise TimeoutError("publisher did not reconnect")
            time.sleep(0.05)

    def publish(self, topic: str, payload, qos: int = 1):
        if not isinstance(payload, (bytes, str)):
            payload = json.dumps(payload)
        self.infos.append(self.c.publish(topic, payload, qos=qos))

    def wait_all(self, timeout: float = 60):
        t = time.time()
        for i in self.infos:
            # not is_published(): it raises for a message queued while the broker was away (rc
            # NO_CONN), which paho still sends after the reconnect and marks published on its PUBACK
            while not i._published:
                if time.time() - t > timeout:
                    raise TimeoutError("publishes not acknowledged by the broker")
                time.sleep(0.01)

    def close(self):
        self.c.disconnect()
        self.c.loop_stop()


def reading(sensor: str, seq: int, values) -> dict:
    return {"sensor": sensor, "seq": seq, "values": [float(v) for v in values]}


def read_results(path: Path):
    out = []
    if Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:          # a line being written right now
                pass
    return out


def wait_results(path: Path, n: int, timeout: float = 60, proc=None):
    t = time.time()
    while time.time() - t < timeout:
        r = read_results(path)
        if len(r) >= n:
            return r
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.1)
    return read_results(path)


def fault_run(workdir: Path, bundle, frames, sensors=4, per_sensor=600, rate=200.0, kills=6, broker_restarts=2,
              env=None, seed=None) -> dict:
    """Publish per_sensor readings for each sensor at `rate` readings/s in total while the daemon is
    killed with SIGKILL `kills` times and the broker restarted `broker_restarts` times: evenly spread,
    or with `seed` at random points with random pauses, a kill sometimes while the broker is down
    (`env`: the daemon's environment, e.g. PYTHONPATH of another zeroedge). Returns the
    figures: lost, duplicated, late arrivals, redeliveries absorbed, whether each sensor's results
    follow its arrival order in the spool."""
    import random

    workdir = Path(workdir)
    broker = Broker(workdir / "broker").start()
    mport = free_port()
    cfg = write_config(workdir / "daemon.toml", bundle, {"kind": "mqtt", "port": broker.port,
                                                         "client_id": "zd-fault"}, mport)
    d = DaemonProc(cfg, mport, env=env).start()
    pub = Publisher(broker.port, client_id="zd-fault-pub")
    names = [f"line{i}" for i in range(sensors)]
    total = sensors * per_sensor
    rng = random.Random(seed)
    events = _fault_schedule(total, kills, broker_restarts, rng if seed is not None else None)
    pause = (lambda lo, hi: rng.uniform(lo, hi)) if seed is not None else (lambda lo, hi: lo)
    t0 = time.monotonic()
    done = {"kill": 0, "broker": 0}
    try:
        for i in range(total):
            while events and events[0][1] == i:
                what = events.pop(0)[0]
                if what == "kill":
                    d.kill9()
                    time.sleep(pause(0.0, 1.0))
                    d.start(wait_healthy=False)
                else:
                    broker.stop()
                    if seed is not None and rng.random() < 0.5:     # the daemon dies during the outage
                        d.kill9()
                        d.start(wait_healthy=False)
                    time.sleep(pause(0.5, 3.0))
                    broker.start()
                done[what] += 1
            sensor, seq = names[i % sensors], i // sensors
            pub.publish(f"zeroedge/readings/{sensor}", reading(sensor, seq, frames[seq % len(frames)]))
            delay = t0 + (i + 1) / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        publish_s = time.monotonic() - t0
        pub.wait_connected()
        pub.wait_all(timeout=120)
        res = wait_results(workdir / "results.jsonl", total, timeout=180, proc=d.proc)
        fig = {"readings": total, "sensors": sensors, "rate": rate, "kills": done["kill"],
               "broker_restarts": done["broker"], "publish_s": round(publish_s, 1),
               **_fault_figures(workdir / "state" / "spool.sqlite", res, names, per_sensor)}
        fig["exit_status"] = d.terminate()
        return fig
    finally:
        pub.close()
        if d.proc.poll() is None:
            d.kill9()
        broker.stop()


def _fault_schedule(total: int, kills: int, broker_restarts: int, rng=None) -> list:
    """[(what, reading index)] in order: evenly spread, or at random points with `rng`."""
    if rng is None:
        at = [("kill", int(total * (k + 0.5) / kills)) for k in range(kills)] + \
             [("broker", int(total * (b + 0.7) / (broker_restarts + 0.4))) for b in range(broker_restarts)]
    else:
        at = [("kill", rng.randrange(total)) for _ in range(kills)] + \
             [("broker", rng.randrange(total)) for _ in range(broker_restarts)]
    return sorted(at, key=lambda e: e[1])


def _fault_figures(spool: Path, res: list, names: list, per_sensor: int) -> dict:
    """What the results file and the spool say after a fault run: lost, duplicated, late arrivals,
    redeliveries absorbed, other dead letters, and whether results follow each sensor's arrivals."""
    import sqlite3

    keys = [(r["sensor"], r["seq"]) for r in res]
    db = sqlite3.connect(spool)
    try:
        arrival = {}
        for sensor, seq in db.execute("SELECT sensor, seq FROM readings ORDER BY id"):
            arrival.setdefault(sensor, []).append(seq)
        dead = dict(db.execute("SELECT reason, COUNT(*) FROM dead_letters GROUP BY reason").fetchall())
    finally:
        db.close()
    got = {}
    for r in res:
        got.setdefault(r["sensor"], []).append(r["seq"])
    return {"results": len(res), "unique": len(set(keys)),
            "lost": len(names) * per_sensor - len(set(keys) & {(n, s) for n in names for s in range(per_sensor)}),
            "duplicated": len(keys) - len(set(keys)),
            "late_arrivals": sum(sum(1 for a, b in zip(v, v[1:]) if b < a) for v in arrival.values()),
            "redeliveries_absorbed": dead.get("duplicate-seq", 0),
            "other_dead_letters": sum(v for k, v in dead.items() if k != "duplicate-seq"),
            "order_kept": all(got.get(n) == arrival.get(n) for n in names)}
