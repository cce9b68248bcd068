"""The sensor daemon against a real mosquitto on 127.0.0.1: broker restart and kill -9 mid-stream
(every reading processed exactly once), the bad-input suite, health/metrics, sd_notify, SIGTERM."""
import json
import signal
import socket
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import daemon_harness as T

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "tep-braatz"


@pytest.fixture
def bundle(sensor_bundle):
    return sensor_bundle


@pytest.fixture
def frames(tep_frames):
    return tep_frames


@pytest.fixture
def broker(mqtt_broker):
    return mqtt_broker


def mqtt_daemon(tmp_path, bundle, broker, client_id="zd-test", **daemon):
    mport = T.free_port()
    cfg = T.write_config(tmp_path / "daemon.toml", bundle,
                         {"kind": "mqtt", "host": "127.0.0.1", "port": broker.port,
                          "topic": "zeroedge/readings/#", "client_id": client_id}, mport, **daemon)
    return T.DaemonProc(cfg, mport)


def reference(bundle, frames):
    """Scores of an uninterrupted in-process run, for comparison with the daemon's output."""
    from zeroedge.sensor.runtime import Engine, load_bundle

    eng = Engine(load_bundle(bundle))
    return eng.process([("s1", i, f, None) for i, f in enumerate(frames)], now=0.0)


def check_exactly_once(results, n, sensor="s1"):
    keys = [(r["sensor"], r["seq"]) for r in results]
    assert len(keys) == len(set(keys)), "a reading was processed twice"
    assert set(keys) == {(sensor, i) for i in range(n)}, f"missing {n - len(set(keys))} readings"


def test_broker_restart_mid_stream(tmp_path, bundle, broker, frames):
    d = mqtt_daemon(tmp_path, bundle, broker).start()
    pub = T.Publisher(broker.port)
    n = len(frames)
    try:
        for i in range(n):
            pub.publish("zeroedge/readings/s1", T.reading("s1", i, frames[i]))
            if i == n // 2:
                pub.wait_all()
                T.wait_results(tmp_path / "results.jsonl", n // 4, timeout=30)
                broker.stop()                                  # broker goes away mid-stream
                time.sleep(1.0)
                assert d.proc.poll() is None
                h = d.health()
                assert h["status"] == "degraded" and d.get("/healthz")[0] == 503
                assert not h["source_connected"]
                assert metric(d.get("/metrics")[1].decode(), "zeroedge_source_connected") == 0
                broker.start()
                pub.wait_connected()
        pub.wait_all(timeout=60)
        res = T.wait_results(tmp_path / "results.jsonl", n, timeout=90, proc=d.proc)
        check_exactly_once(res, n)
        assert d.health()["status"] == "ok"
        assert metric(d.get("/metrics")[1].decode(), "zeroedge_source_connected") == 1
        ref = {r["seq"]: r["ema"] for r in reference(bundle, frames)}
        assert max(abs(r["ema"] - ref[r["seq"]]) for r in res) < 1e-3
        assert d.terminate() == 0
    finally:
        pub.close()
        if d.proc.poll() is None:
            d.kill9()


def test_kill9_mid_stream_resumes_exactly_once(tmp_path, bundle, broker, frames):
    d = mqtt_daemon(tmp_path, bundle, broker).start()
    pub = T.Publisher(broker.port)
    n = len(frames)
    out = tmp_path / "results.jsonl"
    kills = 0
    try:
        for i in range(n):
            pub.publish("zeroedge/readings/s1", T.reading("s1", i, frames[i]))
            if i in (n // 3, 2 * n // 3):
                pub.wait_all()
                T.wait_results(out, i // 2, timeout=30)
                d.kill9()                                      # no chance to drain
                kills += 1
                time.sleep(0.3)
                d.start()
        pub.wait_all(timeout=60)
        res = T.wait_results(out, n, timeout=90, proc=d.proc)
        check_exactly_once(res, n)
        ref = {r["seq"]: r["ema"] for r in reference(bundle, frames)}
        # per-stream windows and alarm filters are rebuilt from the spool: same scores as uninterrupted
        assert max(abs(r["ema"] - ref[r["seq"]]) for r in res) < 1e-3
        assert kills == 2
        assert d.terminate() == 0
    finally:
        pub.close()
        if d.proc.poll() is None:
            d.kill9()


def metric(text: str, name: str) -> float:
    """The value of one sample line of a /metrics page (0.0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_bad_input_goes_to_dead_letters(tmp_path, bundle, broker, frames):
    """Every bad payload becomes a dead letter holding its exact bytes and a reason, while valid
    readings (late ones included) keep flowing; /metrics counts what the spool holds."""
    d = mqtt_daemon(tmp_path, bundle, broker, max_payload_bytes=4096).start()
    pub = T.Publisher(broker.port)
    good = lambda i: T.reading("s1", i, frames[i])  # noqa: E731
    sent = {}                                         # payload bytes -> expected reason

    def bad(payload, reason):
        payload = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        sent[payload] = reason
        pub.publish("zeroedge/readings/s1", payload)

    try:
        pub.publish("zeroedge/readings/s1", good(0))
        pub.publish("zeroedge/readings/s1", good(1))
        bad(json.dumps(good(2)).replace(str(float(frames[2][0])), "NaN", 1).encode(), "non-finite")
        inf = good(2); inf["values"][5] = 1e400
        bad(inf, "non-finite")                                                # json.dumps writes Infinity
        f32 = good(2); f32["values"][7] = 1e39
        bad(f32, "non-finite")                                                # finite float64, inf float32
        huge = json.dumps(good(2)).replace(str(float(frames[2][3])), "1" + "0" * 400, 1).encode()
        bad(huge, "non-finite")                                               # an integer beyond float64
        short = good(2); short["values"] = short["values"][:51]
        bad(short, "wrong-channel-count")
        bad(b'{"sensor": "s1", "seq": 2, "values": [1, 2,', "malformed-json")
        bad(b"\xff\xfe not json", "malformed-json")
        bad(b"[" * 2000 + b"]" * 2000, "malformed-json")                     # nesting bomb
        big = good(2); big["pad"] = "x" * 10000
        bad(big, "oversized")
        bad({**good(3), "seq": 2 ** 63}, "bad-schema")                       # beyond SQLite's INTEGER
        bad({**good(3), "seq": -1}, "bad-schema")
        bad({**good(3), "sensor": "s1\nwarning: forged log line"}, "bad-schema")
        bad({"sensor": "s1", "values": []}, "bad-schema")                   # no seq
        pub.publish("zeroedge/readings/s1", good(2))
        bad(good(2), "duplicate-seq")                                         # a redelivery
        pub.publish("zeroedge/readings/s1", good(5))
        pub.publish("zeroedge/readings/s1", good(4))                        # late, never seen: kept
        bad(good(4), "duplicate-seq")
        top = good(6); top["seq"] = 2 ** 63 - 1
        pub.publish("zeroedge/readings/s1", top)                            # the largest seq ...
        pub.publish("zeroedge/readings/s1", good(7))                        # ... blocks nothing after it
        pub.wait_all()
        res = T.wait_results(tmp_path / "results.jsonl", 7, timeout=60, proc=d.proc)
        time.sleep(0.5)
        assert d.proc.poll() is None, "bad input stopped the daemon"
        assert [r["seq"] for r in res] == [0, 1, 2, 5, 4, 2 ** 63 - 1, 7], d.log.read_text()[-3000:]
        db = sqlite3.connect(tmp_path / "state" / "spool.sqlite")
        stored = {bytes(p): r for r, p in db.execute("SELECT reason, payload FROM dead_letters")}
        assert stored == sent                                 # every payload whole, each with its reason
        m = d.get("/metrics")[1].decode()
        for reason, n in db.execute("SELECT reason, COUNT(*) FROM dead_letters GROUP BY reason"):
            assert metric(m, f'zeroedge_dead_letters_total{{reason="{reason}"}}') == n, reason
        assert metric(m, "zeroedge_readings_total") == 7 and metric(m, "zeroedge_readings_late_total") == 2     # 4 after 5, 7 after 2**63-1
        assert metric(m, "zeroedge_readings_processed_total") == 7
        log = d.log.read_text()
        for reason in set(sent.values()):
            assert f"dead letter: reason={reason}" in log
        assert "\nwarning: forged log line" not in log         # a hostile id cannot write a log line
        assert d.terminate() == 0
    finally:
        pub.close()
        if d.proc.poll() is None:
            d.kill9()


def test_health_metrics_sd_notify_and_sigterm(tmp_path, bundle, frames):
    """File source (no broker): READY / WATCHDOG / STOPPING datagrams, /healthz contract, drain."""
    run = tmp_path / "run.dat"
    np.savetxt(run, frames[:300], fmt="%.6g")
    sock_path = tmp_path / "notify.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(sock_path))
    s.settimeout(0.2)
    msgs, draining = [], threading.Event()

    def drain():                                  # as systemd does: read every datagram as it comes
        while not draining.is_set():
            try:
                msgs.append(s.recv(4096).decode())
            except socket.timeout:
                pass
            except OSError:
                return

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    mport = T.free_port()
    cfg = T.write_config(tmp_path / "daemon.toml", bundle,
                         {"kind": "file", "path": str(run), "sensor": "f1", "rate": 200.0}, mport)
    d = T.DaemonProc(cfg, mport, env={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "400000",
                                      "JOURNAL_STREAM": "8:1234"}).start()
    try:
        t = time.time()
        while time.time() - t < 10 and not any("WATCHDOG=1" in m for m in list(msgs)):
            time.sleep(0.05)
        assert any(m.startswith("READY=1") for m in msgs)
        assert any("WATCHDOG=1" in m for m in msgs)
        code, body = d.get("/healthz")
        h = json.loads(body)
        assert code == 200 and h["status"] == "ok"
        for k in ("status", "version", "uptime_s", "readings", "last_inference_age_s", "bundle"):
            assert k in h
        assert h["bundle"] == str(bundle)
        m = d.get("/metrics")[1].decode()
        for name in ("zeroedge_readings_total", "zeroedge_window_latency_seconds_bucket",
                     'zeroedge_kv_memory_bytes{tier="hot"}', "zeroedge_alerts_total"):
            assert name in m, name
        assert metric(m, "zeroedge_source_connected") == 1 and metric(m, "zeroedge_spool_writable") == 1
        assert d.get("/nope")[0] == 404
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0
        draining.set()
        reader.join(5)
        assert any("STOPPING=1" in m for m in msgs)
        log = d.log.read_text()
        assert "<6>zeroedge daemon" in log and "<6>stopped cleanly" in log     # journald priorities
        # processed readings are all in the output, in order, each once
        res = T.read_results(tmp_path / "results.jsonl")
        seqs = [r["seq"] for r in res]
        assert seqs == list(range(len(seqs))) and len(seqs) > 0
        # a restart resumes the file after the last committed reading
        d2 = T.DaemonProc(cfg, mport, args=["--exit-at-end"]).start(wait_healthy=False)
        assert d2.proc.wait(60) == 0
        res = T.read_results(tmp_path / "results.jsonl")
        assert [r["seq"] for r in res] == list(range(300))
    finally:
        draining.set()
        s.close()
        if d.proc.poll() is None:
            d.kill9()


def test_an_undrained_notify_socket_cannot_stall_the_daemon(tmp_path, bundle, frames):
    """A notify socket nobody reads (its queue full, here before the daemon starts) must not block
    the inference loop's WATCHDOG=1 or the SIGTERM handler's STOPPING=1: the daemon keeps
    processing; once the socket is read again, the READY=1 the full queue refused arrives, and
    watchdog pings with it; SIGTERM stops it cleanly."""
    run = tmp_path / "run.dat"
    np.savetxt(run, frames, fmt="%.6g")
    sock_path = tmp_path / "notify.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(sock_path))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)     # fills after a few datagrams on any kernel
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.setblocking(False)
    filled = 0
    while filled < 100000:
        try:
            filler.sendto(b"FILLER=1", str(sock_path))
            filled += 1
        except BlockingIOError:
            break
    filler.close()
    mport = T.free_port()
    cfg = T.write_config(tmp_path / "daemon.toml", bundle,
                         {"kind": "file", "path": str(run), "sensor": "f1", "rate": 50.0}, mport)
    d = T.DaemonProc(cfg, mport, env={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "100000"}).start()

    def processed():
        return metric(d.get("/metrics")[1].decode(), "zeroedge_readings_processed_total")

    def grows_past(n, within=20.0):
        t = time.time()
        while time.time() - t < within and processed() <= n:
            time.sleep(0.1)
        return processed() > n

    try:
        assert grows_past(0)                      # READY=1 waited 2 s for room, then gave up: the loop runs
        time.sleep(1.0)                           # ~20 WATCHDOG=1 due, the queue still full
        assert grows_past(processed())            # ... and it still runs
        s.settimeout(0.2)
        msgs, t = [], time.time()
        while time.time() - t < 10 and not (any(m.startswith("READY=1") for m in msgs)
                                             and any("WATCHDOG=1" in m for m in msgs)):
            try:
                msgs.append(s.recv(4096).decode())
            except socket.timeout:
                pass
        assert msgs.count("FILLER=1") == filled
        assert any(m.startswith("READY=1") for m in msgs) and any("WATCHDOG=1" in m for m in msgs)
        assert d.terminate(timeout=30) == 0
        assert "stopped cleanly" in d.log.read_text()
    finally:
        s.close()
        if d.proc.poll() is None:
            d.kill9()


def test_daemon_config_errors(tmp_path, bundle):
    from conftest import run_cli

    bad = tmp_path / "bad.toml"
    bad.write_text('[daemon]\nbundle = "x"\nbogus = 1\n')
    p = run_cli("daemon", "--config", bad)
    assert p.returncode == 2 and "bogus" in p.stderr and "Traceback" not in p.stderr
    cfg = T.write_config(tmp_path / "c.toml", tmp_path / "missing", {"kind": "stdin"}, 0)
    p = run_cli("daemon", "--config", cfg)
    assert p.returncode == 2 and "bundle not found" in p.stderr
    p = run_cli("daemon", "--config", tmp_path / "nope.toml")
    assert p.returncode == 2
    # a tampered bundle is refused
    import shutil

    b2 = tmp_path / "b2"
    shutil.copytree(bundle, b2)
    with open(b2 / "model.onnx", "ab") as f:
        f.write(b"x")
    cfg = T.write_config(tmp_path / "c2.toml", b2, {"kind": "stdin"}, 0)
    p = run_cli("daemon", "--config", cfg, "--check")
    assert p.returncode == 2 and "verification failed" in p.stderr


def test_example_config_parses():
    from zeroedge.daemon import config

    c = config.load(Path(config.__file__).with_name("example.toml"))
    assert c.source["kind"] == "mqtt" and c.metrics["port"] == 9108


def test_stdin_source_and_daemon_path_is_torch_free(tmp_path, bundle, frames):
    import subprocess
    import sys

    mport = T.free_port()
    cfg = T.write_config(tmp_path / "c.toml", bundle, {"kind": "stdin"}, mport)
    lines = "".join(json.dumps(T.reading("x", i, frames[i])) + "\n" for i in range(50))
    lines += "garbage\n"
    code = ("import sys, runpy\nsys.argv=['zeroedge','daemon','--config',sys.argv[1]]\n"
            "import zeroedge.cli as c\ntry:\n    c.main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    assert 'torch' not in sys.modules, 'torch was imported'\n    raise\n")
    p = subprocess.run([sys.executable, "-c", code, str(cfg)], input=lines, text=True,
                       capture_output=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert [r["seq"] for r in T.read_results(tmp_path / "results.jsonl")] == list(range(50))
    assert "dead letter: reason=malformed-json" in p.stderr


def test_results_and_alerts_published_to_mqtt(tmp_path, bundle, broker):
    """A fault stream raises an alert: it lands on the alerts topic (and every result on the
    results topic), besides the JSONL file."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    from zeroedge.sensor import tep

    normal = tep.load_run(SHARED / "d00.dat")
    fault = tep.load_run(SHARED / "d06.dat")             # A feed loss: a large, fast fault
    frames = np.concatenate([normal[:40], fault[:40]])
    mport = T.free_port()
    cfg = T.write_config(tmp_path / "daemon.toml", bundle,
                         {"kind": "mqtt", "port": broker.port, "client_id": "zd-pub-test"}, mport,
                         output={"mqtt_results_topic": "zeroedge/results",
                                 "mqtt_alerts_topic": "zeroedge/alerts"})
    d = T.DaemonProc(cfg, mport).start()
    got = {"zeroedge/results": [], "zeroedge/alerts": []}
    sub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="zd-sub", protocol=mqtt.MQTTv5)
    sub.on_message = lambda c, u, m: got[m.topic].append(json.loads(m.payload))
    sub.connect("127.0.0.1", broker.port)
    sub.subscribe([("zeroedge/results", 1), ("zeroedge/alerts", 1)])
    sub.loop_start()
    time.sleep(0.5)
    pub = T.Publisher(broker.port, client_id="zd-pub-test-pub")
    try:
        for i, f in enumerate(frames):
            pub.publish("zeroedge/readings/p1", T.reading("p1", i, f))
        pub.wait_all()
        T.wait_results(tmp_path / "results.jsonl", len(frames), timeout=30, proc=d.proc)
        t = time.time()
        while len(got["zeroedge/results"]) < len(frames) and time.time() - t < 20:
            time.sleep(0.1)
        assert sorted(r["seq"] for r in got["zeroedge/results"]) == list(range(len(frames)))
        assert got["zeroedge/alerts"] and all(a["rising"] and a["alarm"] for a in got["zeroedge/alerts"])
        assert any(a["fault"] == "fault_06" for a in got["zeroedge/alerts"])
        assert "ALERT sensor=p1" in d.log.read_text()
        time.sleep(1.2)                                   # gauges refresh every second
        m = d.get("/metrics")[1].decode()
        # every series reads back what the daemon did
        assert metric(m, "zeroedge_alerts_total") == len(got["zeroedge/alerts"]) > 0
        assert metric(m, "zeroedge_inferences_total") == metric(m, "zeroedge_readings_processed_total") == len(frames)
        assert metric(m, "zeroedge_readings_total") == len(frames)
        assert metric(m, "zeroedge_window_latency_seconds_count") == len(frames)
        assert metric(m, "zeroedge_inference_latency_seconds_count") >= 1
        assert metric(m, "zeroedge_streams") == 1 and metric(m, "zeroedge_spool_pending") == 0
        assert metric(m, 'zeroedge_kv_memory_bytes{tier="hot"}') > 0 and metric(m, "zeroedge_resident_memory_bytes") > 0
        assert metric(m, "zeroedge_source_connected") == 1 and metric(m, "zeroedge_spool_writable") == 1
        assert d.terminate() == 0
    finally:
        sub.loop_stop()
        pub.close()
        if d.proc.poll() is None:
            d.kill9()


def test_simulator_source_runs_to_the_end(tmp_path, bundle):
    pytest.importorskip("tep_studio")
    mport = T.free_port()
    cfg = T.write_config(tmp_path / "c.toml", bundle, {"kind": "simulator", "fault": 1, "seed": 3,
                                                       "hours": 0.6, "onset_h": 0.3}, mport,
                         infer_every=2)
    d = T.DaemonProc(cfg, mport, args=["--exit-at-end"]).start(wait_healthy=False)
    assert d.proc.wait(120) == 0, d.log.read_text()[-2000:]
    res = T.read_results(tmp_path / "results.jsonl")
    assert [r["seq"] for r in res] == [1, 3, 5, 7, 9, 11]          # every 2nd of 12 readings
    assert all(r["sensor"] == "tep-sim" and r["ts"] for r in res)
