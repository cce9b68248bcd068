#!/usr/bin/env python3
"""Sensor benchmarks (results recorded in benchmarks/sensor.md).

  python benchmarks/sensor_bench.py detect    # per-fault FDR/FAR/delay on the held-out test runs,
                                              # the sensor transformer (sensor-eval path, onnxruntime)
                                              # beside PCA T^2 / Q (99 % limits) in the same run
  python benchmarks/sensor_bench.py speed     # readings/s and p50/p99 window latency (1 and 2 threads)
  python benchmarks/sensor_bench.py paced     # only the daemon runs paced at 1000 readings/s
  python benchmarks/sensor_bench.py kill      # 20 random kill -9 of an MQTT-fed daemon: exactly once?
  python benchmarks/sensor_bench.py memory    # RSS over a simulated 7-day stream (fast-forwarded)
"""
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # daemon_harness
OUT = REPO / "benchmarks" / "results" / "sensor"


def detect():
    from zeroedge.sensor import HARD_FAULTS, tep
    from zeroedge.sensor.metrics import detection_metrics
    from zeroedge.sensor.pca import PCAMonitor
    from zeroedge.sensor.runtime import evaluate_frames, load_bundle
    from zeroedge.sensor.train import ensure_bundle

    det = load_bundle(ensure_bundle())                 # zero: last block computes the last token only
    dense = load_bundle(ensure_bundle(zero=False))     # dense: every row of every block
    normal = tep.normal_runs("train")
    pca = PCAMonitor().fit(np.concatenate(normal))
    print(f"PCA fitted on {len(normal)} normal runs: {pca.k} components, T2 limit {pca.t2_limit:.1f}, "
          f"Q limit {pca.q_limit:.1f}", flush=True)
    rows = {}
    for name, f, X, onset in tep.split_runs("test"):
        t0 = time.perf_counter()
        m = evaluate_frames(det, X, onset if f else len(X), sensor=name)
        r = {"model": m, "dense": evaluate_frames(dense, X, onset if f else len(X), sensor=name)}
        for k, a in pca.alarms(X).items():
            r["pca_" + k] = detection_metrics(a, onset if f else len(X))
        rows.setdefault(f, []).append(r)
        print(f"{name}: model fdr={m['fdr']} far={m['far']} delay={m['delay']} pred={m['predicted_fault']} "
              f"| pca t2|q fdr={r['pca_t2_or_q']['fdr']} ({time.perf_counter() - t0:.1f}s)", flush=True)
    methods = ["model", "dense", "pca_t2", "pca_q", "pca_t2_or_q"]

    def avg(vals):
        vals = [v for v in vals if v is not None]
        return float(np.mean(vals)) if vals else None

    table = {}
    for f, rs in sorted(rows.items()):
        table[f] = {}
        for meth in methods:
            table[f][meth] = {k: avg([r[meth][k] for r in rs]) for k in ("fdr", "far", "delay")}
        votes = [r["model"]["predicted_fault"] for r in rs]
        table[f]["model"]["predicted"] = votes
    lines = ["| fault | model FDR (zero) | dense FDR | model FAR | model delay | predicted | PCA T² FDR | PCA Q FDR | PCA T²∨Q FDR | PCA T²∨Q FAR | PCA T²∨Q delay |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, d=3: "–" if v is None else (f"{v:.{d}f}" if isinstance(v, float) else str(v))  # noqa
    for f, t in table.items():
        lines.append(f"| {f if f else 'normal'} | {fmt(t['model']['fdr'])} | {fmt(t['dense']['fdr'])} | {fmt(t['model']['far'])} | "
                     f"{fmt(t['model']['delay'], 1)} | {', '.join(t['model']['predicted'])} | "
                     f"{fmt(t['pca_t2']['fdr'])} | {fmt(t['pca_q']['fdr'])} | {fmt(t['pca_t2_or_q']['fdr'])} | "
                     f"{fmt(t['pca_t2_or_q']['far'])} | {fmt(t['pca_t2_or_q']['delay'], 1)} |")
    summary = {}
    for label, faults in (("1-21", [f for f in table if f]),
                          ("1-21 excl. 3, 9, 15", [f for f in table if f and f not in HARD_FAULTS])):
        summary[label] = {meth: {"fdr": avg([table[f][meth]["fdr"] for f in faults]),
                                 "delay": avg([table[f][meth]["delay"] for f in faults])} for meth in methods}
    allfar = {meth: avg([r[meth]["far"] for rs in rows.values() for r in rs]) for meth in methods}
    lines += ["", "| average | model FDR (zero) | dense FDR | PCA T² FDR | PCA Q FDR | PCA T²∨Q FDR |",
              "|---|---|---|---|---|---|"]
    for label, s in summary.items():
        lines.append(f"| faults {label} | {fmt(s['model']['fdr'])} | {fmt(s['dense']['fdr'])} | {fmt(s['pca_t2']['fdr'])} | "
                     f"{fmt(s['pca_q']['fdr'])} | {fmt(s['pca_t2_or_q']['fdr'])} |")
    lines.append(f"| FAR (all pre-onset + normal samples) | {fmt(allfar['model'])} | {fmt(allfar['dense'])} | {fmt(allfar['pca_t2'])} | "
                 f"{fmt(allfar['pca_q'])} | {fmt(allfar['pca_t2_or_q'])} |")
    correct = [f"fault_{f:02d}" == p for f, t in table.items() if f and f not in HARD_FAULTS
               for p in t["model"]["predicted"]]
    lines.append(f"\nclassification: predicted_fault correct on {sum(correct)}/{len(correct)} test runs "
                 f"of faults 1-21 excl. 3, 9, 15")
    text = "\n".join(lines)
    print(text)
    (OUT / "detect_tep_test_runs.json").write_text(json.dumps({"table": {str(k): v for k, v in table.items()},
                                                        "summary": summary, "far": allfar}, indent=1))
    (OUT / "detect_tep_test_runs.md").write_text(text + "\n")
    _plot_fdr(table)


def _plot_fdr(table):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faults = [f for f in table if f]
    x = np.arange(len(faults))
    fig, ax = plt.subplots(figsize=(10, 3.6))
    for i, (meth, lab) in enumerate((("model", "sensor transformer"), ("pca_t2", "PCA T²"),
                                     ("pca_q", "PCA Q"))):
        ax.bar(x + (i - 1) * 0.27, [table[f][meth]["fdr"] for f in faults], 0.27, label=lab)
    ax.set_xticks(x, [str(f) for f in faults])
    ax.set_xlabel("TEP fault")
    ax.set_ylabel("detection rate")
    ax.set_ylim(0, 1.05)
    ax.set_ylim(0, 1.25)
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    ax.set_title("Fault detection rate on held-out tep-studio test runs (fault at sample 160 of 960)")
    fig.tight_layout()
    fig.savefig(OUT / "detect_tep_test_runs.png", dpi=110)


def speed(only_paced=False, daemon_only=False):
    """Per-window latency with one reading at a time (batch 1), and end-to-end daemon throughput."""
    import subprocess

    import daemon_harness as T
    from zeroedge.sensor import tep
    from zeroedge.sensor.runtime import Engine, load_bundle
    from zeroedge.sensor.train import ensure_bundle

    bundle = ensure_bundle()
    bundles = {"zero": bundle, "dense": ensure_bundle(zero=False)}
    X = tep.load_run(sorted((tep.cache_dir() / "test").glob("f01_*.dat"))[0])
    res = {}
    for (variant, b), threads in [(vb, t) for vb in bundles.items() for t in (1, 2) if not (only_paced or daemon_only)]:
        eng = Engine(load_bundle(b, threads=threads))
        lat = []
        t0 = time.perf_counter()
        for i, f in enumerate(np.concatenate([X, X])):
            t = time.perf_counter()
            eng.process([("s", i, f, None)], now=0.0)
            lat.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0
        lat = np.array(lat[64:]) * 1000
        key = f"engine_{variant}_batch1_threads{threads}"
        res[key] = {"readings_per_s": round(2 * len(X) / wall, 1),
                    "p50_ms": round(float(np.percentile(lat, 50)), 3),
                    "p99_ms": round(float(np.percentile(lat, 99)), 3)}
        print(key, res[key], flush=True)
    # end to end: 8 streams x 2 runs through the daemon (JSONL file source, spool, JSONL out)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        lines = []
        for k in range(8):
            for i, f in enumerate(np.concatenate([X, X])):
                lines.append(json.dumps({"sensor": f"s{k}", "seq": i, "values": [float(v) for v in f]}))
        rnd = random.Random(0)
        # interleave streams as a plant would (each stream stays in order)
        order = sorted(range(len(lines)), key=lambda j: (j % (2 * len(X)), rnd.random()))
        (d / "in.jsonl").write_text("\n".join(lines[j] for j in order) + "\n")
        variants = (("zero", 1, 0), ("dense", 1, 0), ("zero", 2, 0), ("zero", 1, 1000), ("dense", 1, 1000))
        for variant, threads, rate in variants:
            if only_paced and not rate:
                continue
            sd = d / f"{variant}{threads}_{rate}"
            sd.mkdir()
            cfg = T.write_config(sd / "c.toml", bundles[variant], {"kind": "file", "path": str(d / "in.jsonl"),
                                                                   "rate": float(rate)},
                                 T.free_port(), threads=threads)
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "zeroedge.cli", "daemon", "--config", str(cfg),
                                "--exit-at-end"], capture_output=True, text=True, cwd=sd)
            wall = time.perf_counter() - t0
            if p.returncode != 0:
                print(p.stderr[-3000:], flush=True)
                continue
            out = [json.loads(line) for line in (sd / "results.jsonl").read_text().splitlines()]
            ts = [r["t"] for r in out]
            n = len(out)
            latline = next((line for line in p.stderr.splitlines() if "window latency" in line), "")
            key = f"daemon_{variant}_8streams_threads{threads}" + (f"_paced{rate}" if rate else "")
            res[key] = {"readings": n, "wall_s_incl_startup": round(wall, 2),
                        "readings_per_s": round(n / (max(ts) - min(ts)), 1), "rc": p.returncode,
                        "latency": latline.split("results: ")[-1]}
            print(key, res[key], flush=True)
    path = OUT / "speed_shared_2core_epyc.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    old.update(res)
    path.write_text(json.dumps(old, indent=1))


def kill(n_kills=20, n=2000, seed=0):
    """Publish n readings over MQTT while killing the daemon with SIGKILL n_kills times at random."""
    import tempfile

    import daemon_harness as T
    from zeroedge.sensor import tep
    from zeroedge.sensor.train import ensure_bundle

    rnd = random.Random(seed)
    bundle = ensure_bundle()
    X = np.concatenate([tep.load_run(p) for p in sorted((tep.cache_dir() / "test").glob("f0*.dat"))[:3]])[:n]
    kill_at = sorted(rnd.sample(range(50, n - 50), n_kills))
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        broker = T.Broker(d / "broker").start()
        mport = T.free_port()
        cfg = T.write_config(d / "c.toml", bundle, {"kind": "mqtt", "port": broker.port,
                                                    "client_id": "bench-kill"}, mport)
        dm = T.DaemonProc(cfg, mport).start()
        pub = T.Publisher(broker.port)
        t0 = time.time()
        for i in range(n):
            pub.publish("zeroedge/readings/s1", T.reading("s1", i, X[i]))
            if kill_at and i == kill_at[0]:
                kill_at.pop(0)
                time.sleep(rnd.uniform(0.0, 0.3))   # let it be mid-batch somewhere
                dm.kill9()
                dm.start()
        pub.wait_all(120)
        res = T.wait_results(d / "results.jsonl", n, timeout=300, proc=dm.proc)
        keys = [(r["sensor"], r["seq"]) for r in res]
        out = {"published": n, "kills": n_kills, "results": len(keys), "unique": len(set(keys)),
               "missing": n - len(set(keys) & {("s1", i) for i in range(n)}),
               "duplicates": len(keys) - len(set(keys)), "wall_s": round(time.time() - t0, 1)}
        import sqlite3
        db = sqlite3.connect(d / "state" / "spool.sqlite")
        out["dead_letters"] = dict(db.execute("SELECT reason, COUNT(*) FROM dead_letters GROUP BY reason").fetchall())
        dm.terminate()
        pub.close()
        broker.stop()
    print(out)
    (OUT / "kill9_exactly_once.json").write_text(json.dumps(out, indent=1))


def memory(streams=20, days=7.0):
    """RSS of the daemon over `days` simulated days (3-minute samples) on `streams` streams, fed
    as fast as it goes from a JSONL file; RSS sampled from /metrics."""
    import tempfile
    import threading

    import daemon_harness as T
    from zeroedge.sensor import tep
    from zeroedge.sensor.train import ensure_bundle

    bundle = ensure_bundle()
    per = int(days * 24 * 20)
    base = np.concatenate([tep.load_run(p) for p in sorted((tep.cache_dir() / "test").glob("f00_*.dat"))])
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        with open(d / "in.jsonl", "w") as f:
            for i in range(per):
                fr = base[i % len(base)]
                for k in range(streams):
                    f.write(json.dumps({"sensor": f"s{k}", "seq": i, "values": [round(float(v), 5) for v in fr]}) + "\n")
        mport = T.free_port()
        cfg = T.write_config(d / "c.toml", bundle, {"kind": "file", "path": str(d / "in.jsonl")}, mport,
                             infer_every=1, keep_per_stream=256)
        dm = T.DaemonProc(cfg, mport, args=["--exit-at-end"]).start()
        samples = []
        while dm.proc.poll() is None:
            try:
                txt = dm.get("/metrics")[1].decode()
                rss = next(float(line.split()[-1]) for line in txt.splitlines()
                           if line.startswith("zeroedge_resident_memory_bytes"))
                done = next(float(line.split()[-1]) for line in txt.splitlines()
                            if line.startswith("zeroedge_readings_processed_total"))
                hot = next(float(line.split()[-1]) for line in txt.splitlines()
                           if line.startswith('zeroedge_kv_memory_bytes{tier="hot"}'))
                samples.append((done / streams / 20 / 24, rss, hot))
            except Exception:
                pass
            time.sleep(1.0)
        spool_mb = (d / "state" / "spool.sqlite").stat().st_size / 1e6
    samples = [s for s in samples if s[0] > 0]
    rss = np.array([s[1] for s in samples])
    warm = rss[len(rss) // 10:]
    out = {"streams": streams, "days": days, "readings": per * streams,
           "rss_mb_first": round(rss[0] / 1e6, 1), "rss_mb_after_warmup_min": round(warm.min() / 1e6, 1),
           "rss_mb_after_warmup_max": round(warm.max() / 1e6, 1), "rss_mb_last": round(rss[-1] / 1e6, 1),
           "spread_after_warmup_pct": round(100 * (warm.max() - warm.min()) / warm.min(), 2),
           "hot_state_bytes": samples[-1][2], "spool_mb_at_end": round(spool_mb, 1),
           "samples": [(round(a, 3), int(b)) for a, b, _ in samples]}
    print({k: v for k, v in out.items() if k != "samples"})
    (OUT / "memory_7days_20streams.json").write_text(json.dumps(out, indent=1))
    _plot_memory(out)


def _plot_memory(out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = int(out["hot_state_bytes"] // out["streams"] // (52 * 4))
    days = [a for a, b in out["samples"]]
    rss = np.array([b for a, b in out["samples"]]) / 1e6
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(days, rss)
    ax.set_xlabel("simulated days")
    ax.set_ylabel("daemon RSS (MB)")
    ax.set_title(f"{out['streams']} streams, bounded {window}-frame window per stream (no thermal KV)")
    ax.set_ylim(0, rss.max() * 1.2)
    fig.tight_layout()
    fig.savefig(OUT / "memory_7days_20streams.png", dpi=110)


def replot():
    d = json.loads((OUT / "detect_tep_test_runs.json").read_text())
    _plot_fdr({int(k): v for k, v in d["table"].items()})
    _plot_memory(json.loads((OUT / "memory_7days_20streams.json").read_text()))


if __name__ == "__main__":
    {"detect": detect, "speed": speed, "kill": kill, "memory": memory,
     "paced": lambda: speed(only_paced=True), "daemon": lambda: speed(daemon_only=True),
     "replot": replot}[sys.argv[1]]()
