"""The daemon under hostile input and failing infrastructure, with a real mosquitto: dedup and late
readings in the spool, a spool locked by another process, TLS and passwords, the metrics listener,
and many kill -9s plus broker restarts mid-stream (nothing lost, nothing duplicated, order kept)."""
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import run_cli
import daemon_harness as T
from zeroedge.daemon.spool import DeadLetter, Reading, Spool, parse

CH = 52


def vals(i=0.0):
    return np.full(CH, float(i), np.float32)


def reading(sensor, seq):
    return Reading(sensor, seq, vals(seq), None, json.dumps({"sensor": sensor, "seq": seq}).encode())


# ------------------------------------------------------------------ the spool, torch- and broker-free

def test_dedup_late_readings_and_the_dedup_window(tmp_path):
    sp = Spool(tmp_path, keep=4)
    acc, dead, late = sp.commit([reading("a", s) for s in (0, 1, 5, 3, 3, 2, 5)])
    assert [r.seq for r in acc] == [0, 1, 5, 3, 2] and late == 2          # late ones kept, arrival order
    assert [(d.reason, d.seq) for d in dead] == [("duplicate-seq", 3), ("duplicate-seq", 5)]
    assert dead[0].payload == reading("a", 3).payload                       # the payload is kept
    acc, dead, _ = sp.commit([reading("a", 1), reading("a", 4)])            # across batches too
    assert [r.seq for r in acc] == [4] and [d.seq for d in dead] == [1]
    # the memory is the last `keep` arrivals of the sensor: older redeliveries cannot be recognised
    db = sp.reader()
    ids = [r[0] for r in Spool.pending(db, 100)]
    sp.mark_processed(ids, [], 0)
    db.execute("INSERT INTO streams VALUES ('a', 4, 6, 0, 0, 0)")
    sp.prune()
    kept = [s for (s,) in db.execute("SELECT seq FROM readings WHERE sensor='a' ORDER BY id")]
    assert kept == [5, 3, 2, 4]
    acc, dead, _ = sp.commit([reading("a", 0), reading("a", 2)])
    assert [r.seq for r in acc] == [0] and [d.seq for d in dead] == [2]
    # a restart keeps what the spool knows
    sp2 = Spool(tmp_path, keep=4)
    assert sp2.last_seq_of("a") == 5 and sp2.commit([reading("a", 5)])[0] == []


def test_sensor_allow_list_and_cap(tmp_path):
    sp = Spool(tmp_path, sensors=["line1-*", "boiler"], max_sensors=2)
    acc, dead, _ = sp.commit([reading("line1-a", 0), reading("boiler", 0), reading("line1-b", 0),
                              reading("intruder", 0), reading("line1-a", 1)])
    assert [r.sensor for r in acc] == ["line1-a", "boiler", "line1-a"]
    assert [(d.reason, d.sensor) for d in dead] == [("too-many-sensors", "line1-b"), ("unknown-sensor", "intruder")]
    assert all(d.payload for d in dead)


def test_a_row_sqlite_refuses_is_dead_lettered_alone(tmp_path):
    sp = Spool(tmp_path)
    poison = Reading("a", 2 ** 64, vals(), None, b'{"poison": 1}')   # past the schema check (not via parse)
    acc, dead, _ = sp.commit([reading("a", 0), poison, reading("a", 1)])
    assert [r.seq for r in acc] == [0, 1]
    assert [(d.reason, d.payload) for d in dead] == [("spool-refused", b'{"poison": 1}')]
    db = sp.reader()
    assert db.execute("SELECT COUNT(*) FROM readings").fetchone()[0] == 2
    assert db.execute("SELECT reason FROM dead_letters").fetchall() == [("spool-refused",)]


def test_parse_bounds():
    ok = parse(json.dumps({"sensor": "s", "seq": 2 ** 63 - 1, "values": [1] * CH, "ts": 10 ** 400}).encode(),
               CH, 65536)
    assert isinstance(ok, Reading) and ok.ts is None
    for payload, reason in [({"sensor": "s", "seq": 2 ** 63, "values": [1] * CH}, "bad-schema"),
                            ({"sensor": "s", "seq": True, "values": [1] * CH}, "bad-schema"),
                            ({"sensor": "\x1b[2J", "seq": 1, "values": [1] * CH}, "bad-schema"),
                            ({"sensor": "s", "seq": 1, "values": [3.5e38] * CH}, "non-finite"),
                            ({"sensor": "s", "seq": 1, "values": [-1e39] + [1] * (CH - 1)}, "non-finite")]:
        got = parse(json.dumps(payload).encode(), CH, 65536)
        assert isinstance(got, DeadLetter) and got.reason == reason, (payload, got)
    big = b"x" * (3 << 20)
    got = parse(big, CH, 65536)
    assert got.reason == "oversized" and got.payload == big[:1 << 20] and "first 1048576 bytes kept" in got.detail


# ------------------------------------------------------------------ the daemon

def mqtt_cfg(tmp_path, bundle, port, mport, source=None, **daemon):
    src = {"kind": "mqtt", "host": "127.0.0.1", "port": port, "topic": "zeroedge/readings/#",
           "client_id": f"zd-{tmp_path.name[-12:]}", **(source or {})}
    return T.write_config(tmp_path / "daemon.toml", bundle, src, mport, **daemon)


class WriteLock:
    """Another process holding a write transaction on the spool for `seconds` (someone inspecting it
    with sqlite3, a backup tool)."""

    def __init__(self, db_path, seconds):
        code = ("import sqlite3, sys, time\nc = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
                "c.execute('BEGIN IMMEDIATE')\nprint('locked', flush=True)\ntime.sleep(float(sys.argv[2]))\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(db_path), str(seconds)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "locked"

    def join(self):
        self.proc.wait(120)

    def release(self):
        """Ends the transaction now (the holder killed: SQLite drops its lock)."""
        self.proc.kill()
        self.proc.wait(120)


def test_spool_locked_is_retried_in_place_then_gives_up_cleanly(tmp_path, sensor_bundle, mqtt_broker, tep_frames):
    mport = T.free_port()
    cfg = mqtt_cfg(tmp_path, sensor_bundle, mqtt_broker.port, mport, spool_give_up_s=12.0)
    d = T.DaemonProc(cfg, mport).start()
    pub = T.Publisher(mqtt_broker.port, client_id="zd-lock-pub")
    out = tmp_path / "results.jsonl"
    try:
        for i in range(100):
            pub.publish("zeroedge/readings/s1", T.reading("s1", i, tep_frames[i]))
        pub.wait_all()
        assert len(T.wait_results(out, 100, timeout=30)) == 100
        # 1. a lock longer than SQLite's busy timeout: retried in place, health says why, nothing lost
        lock = WriteLock(tmp_path / "state" / "spool.sqlite", 8.0)
        for i in range(100, 200):
            pub.publish("zeroedge/readings/s1", T.reading("s1", i, tep_frames[i]))
        pub.wait_all()
        time.sleep(6.5)
        code, body = d.get("/healthz")
        h = json.loads(body)
        assert code == 503 and not h["spool"]["writable"] and "locked" in h["spool"]["error"], h
        m = d.get("/metrics")[1].decode()
        assert "zeroedge_spool_writable 0.0" in m
        lock.join()
        res = T.wait_results(out, 200, timeout=60, proc=d.proc)
        assert [r["seq"] for r in res] == list(range(200))
        assert d.health()["spool"]["writable"]
        m = d.get("/metrics")[1].decode()
        assert "zeroedge_spool_writable 1.0" in m and "zeroedge_spool_write_failures_total 0.0" not in m
        # 2. a lock past spool_give_up_s: one error line, exit 1 (systemd restarts it), nothing lost
        lock = WriteLock(tmp_path / "state" / "spool.sqlite", 25.0)
        for i in range(200, 300):
            pub.publish("zeroedge/readings/s1", T.reading("s1", i, tep_frames[i]))
        pub.wait_all()
        assert d.proc.wait(60) == 1
        log = d.log.read_text()
        assert "Traceback" not in log and "the spool has not been writable for" in log
        lock.release()                  # held past the give-up: no need to wait out its 25 s
        d.start()
        res = T.wait_results(out, 300, timeout=60, proc=d.proc)
        assert [r["seq"] for r in res] == list(range(300))       # redelivered, each processed once
        assert d.terminate() == 0
    finally:
        pub.close()
        if d.proc.poll() is None:
            d.kill9()


def test_tls_password_file_and_secret_warnings(tmp_path, sensor_bundle, tep_frames):
    pki = T.make_pki(tmp_path / "pki")
    broker = T.Broker(tmp_path / "broker", pki=pki, users={"plant": "s3cret"}).start()
    pw = tmp_path / "mqtt.pass"
    pw.write_text("s3cret\n")
    pw.chmod(0o644)                                                  # too open: a warning, not a refusal
    mport = T.free_port()
    tls = {"tls_ca": str(pki["ca"]), "tls_cert": str(pki["client"]), "tls_key": str(pki["client_key"]),
           "username": "plant", "password_file": str(pw)}
    cfg = mqtt_cfg(tmp_path, sensor_bundle, broker.port, mport, source=tls)
    d = T.DaemonProc(cfg, mport).start()
    pub = T.Publisher(broker.port, client_id="zd-tls-pub", pki=pki, user=("plant", "s3cret"))
    try:
        for i in range(20):
            pub.publish("zeroedge/readings/t1", T.reading("t1", i, tep_frames[i]))
        pub.wait_all()
        assert [r["seq"] for r in T.wait_results(tmp_path / "results.jsonl", 20, timeout=30)] == list(range(20))
        assert f"{pw} holds the MQTT password and other users can read it (mode 0644)" in d.log.read_text()
        assert d.terminate() == 0
        # a broker whose certificate does not chain to tls_ca: never connected, degraded, says TLS
        bad = dict(tls, tls_ca=str(pki["other_ca"]))
        (tmp_path / "b").mkdir()
        cfg2 = mqtt_cfg(tmp_path / "b", sensor_bundle, broker.port, T.free_port(), source=bad)
        d2 = T.DaemonProc(cfg2, int(cfg2.read_text().split("port = ")[-1])).start(wait_healthy=False)
        time.sleep(4)
        assert d2.proc.poll() is None
        h = d2.health()
        assert h["status"] == "degraded" and not h["source_connected"]
        assert "check tls_ca" in d2.log.read_text()
        assert d2.terminate() == 0
        # a password inline in a config others can read: a warning at start and from --check
        cfg3 = mqtt_cfg(tmp_path / "b", sensor_bundle, broker.port, 0, source={"username": "u", "password": "p"})
        cfg3.chmod(0o644)
        p = run_cli("daemon", "--config", cfg3, "--check")
        assert p.returncode == 0 and "holds the MQTT password ([source] password)" in p.stderr, p.stderr
        cfg3.chmod(0o600)
        assert "password" not in run_cli("daemon", "--config", cfg3, "--check").stderr
        # bad TLS / password settings: one line, exit 2
        for src, needle in [({"tls_ca": str(tmp_path / "nope.pem")}, "tls_ca not found"),
                            ({"password": "x", "password_file": str(pw)}, "both password and password_file"),
                            ({"tls_key": str(pki["client_key"])}, "tls_key needs tls_cert")]:
            c = mqtt_cfg(tmp_path / "b", sensor_bundle, broker.port, 0, source=src)
            p = run_cli("daemon", "--config", c, "--check")
            assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr
    finally:
        pub.close()
        for x in (d, locals().get("d2")):
            if x is not None and x.proc and x.proc.poll() is None:
                x.kill9()
        broker.stop()


def test_metrics_listener_addresses(tmp_path, sensor_bundle, tep_frames):
    run = tmp_path / "run.dat"
    np.savetxt(run, tep_frames[:50], fmt="%.6g")
    mport = T.free_port()
    cfg = T.write_config(tmp_path / "d.toml", sensor_bundle, {"kind": "file", "path": str(run), "rate": 20.0}, mport)
    cfg.write_text(cfg.read_text().replace("[metrics]", '[metrics]\nhost = "::1"'))
    d = T.DaemonProc(cfg, mport)
    d.start(wait_healthy=False)
    try:
        import urllib.request

        t = time.time()
        while time.time() - t < 30:
            try:
                with urllib.request.urlopen(f"http://[::1]:{mport}/healthz", timeout=2) as r:
                    assert json.loads(r.read())["status"] == "ok"
                    break
            except OSError:
                time.sleep(0.2)
        else:
            pytest.fail("no /healthz on [::1]: " + d.log.read_text()[-1500:])
        # the same port again: one line, exit 2
        (tmp_path / "2").mkdir()
        cfg2 = T.write_config(tmp_path / "2" / "d.toml", sensor_bundle, {"kind": "stdin"}, mport)
        cfg2.write_text(cfg2.read_text().replace("[metrics]", '[metrics]\nhost = "::1"'))
        p = run_cli("daemon", "--config", cfg2)
        assert p.returncode == 2 and "[metrics] cannot listen on ::1" in p.stderr and "Traceback" not in p.stderr
    finally:
        d.terminate()
    cfg.write_text(cfg.read_text().replace('host = "::1"', 'host = "0.0.0.0"'))
    p = run_cli("daemon", "--config", cfg, "--check")
    assert p.returncode == 0 and "carry plant data" in p.stderr


# ------------------------------------------------------------------ fault injection

def test_kill9_and_broker_restarts_lose_nothing(tmp_path, sensor_bundle, tep_frames):
    fig = T.fault_run(tmp_path, sensor_bundle, tep_frames)
    assert fig["exit_status"] == 0 and fig["kills"] == 6 and fig["broker_restarts"] == 2
    assert fig["lost"] == 0 and fig["duplicated"] == 0 and fig["results"] == fig["readings"], fig
    assert fig["order_kept"] and fig["other_dead_letters"] == 0, fig


def test_dead_letters_are_bounded_in_bytes(tmp_path, monkeypatch):
    from zeroedge.daemon import spool as S

    monkeypatch.setattr(S, "DEAD_LETTERS_KEPT_BYTES", 10_000)
    sp = Spool(tmp_path)
    for i in range(30):
        sp.commit([DeadLetter("oversized", "x", bytes([i]) * 1000)])
    assert sp.prune() == 20
    db = sp.reader()
    kept = [p[0] for (p,) in db.execute("SELECT payload FROM dead_letters ORDER BY id")]
    assert kept == list(range(20, 30))                        # the newest 10 KB, whole


@pytest.mark.parametrize("section,line,needle", [
    ("daemon", 'sensors = "line1"', "sensors must be a list"),
    ("daemon", "max_sensors = 0", "max_sensors must be a positive integer"),
    ("daemon", "keep_per_stream = true", "keep_per_stream must be a positive integer"),
    ("daemon", "spool_give_up_s = -1", "spool_give_up_s must be a positive number"),
    ("metrics", "host = 5", "[metrics] host must be an address"),
    ("source", "password_file = 3", "[source] password_file must be a string"),
])
def test_config_errors_are_one_line(tmp_path, section, line, needle):
    cfg = tmp_path / "d.toml"
    body = {"daemon": ['bundle = "b"'], "source": ['kind = "stdin"'], "metrics": []}
    body[section].append(line)
    cfg.write_text("".join(f"[{k}]\n" + "".join(v + "\n" for v in vs) for k, vs in body.items()))
    p = run_cli("daemon", "--config", cfg, "--check")
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_export_only_needs_a_bundle_dir():
    from conftest import REPO

    p = subprocess.run([sys.executable, str(REPO / "scripts" / "train_sensor"), "--export-only"],
                       capture_output=True, text=True)
    assert p.returncode != 0 and "--export-only needs --bundle DIR" in p.stderr and "Traceback" not in p.stderr
