"""Inference speed of a sensor-fit bundle, with and without its gates, against the shipped one: the
Engine the daemon and sensor-eval run (one reading at a time, 1 onnxruntime thread, the daemon's
default) over the Braatz d01 training run (three passes), and the batch-1 latency of
Detector.probs (one 32-frame window of d00). The fit is the README's command on the Braatz
training runs (d00 normal, d01-d21 faults); "Q gate only" is the same bundle with its channel gates
(still, spread, level) off, "no gate" with its Q gate off too.
Results: benchmarks/sensor.md, raw in benchmarks/results/sensor/fit_gate_speed_2core.json.

    python benchmarks/sensor_fit_speed.py [--out FILE]
"""
import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "tep-braatz"


def readings_per_s(det, X) -> float:
    from zeroedge.sensor.runtime import Engine

    eng = Engine(det)
    n, t0 = 0, time.perf_counter()
    for rep in range(3):
        for i, f in enumerate(X):
            eng.process([("s", rep * len(X) + i, f, None)], now=0.0)
            n += 1
    return n / (time.perf_counter() - t0)


def batch1_ms(det, w, n=2000) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            det.probs(w)
        best = min(best, (time.perf_counter() - t0) / n * 1e3)
    return best


def main():
    from zeroedge.sensor import tep
    from zeroedge.sensor.fit import fit
    from zeroedge.sensor.runtime import load_bundle
    from zeroedge.sensor.train import ensure_bundle

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "sensor" / "fit_gate_speed_2core.json")
    a = ap.parse_args()
    X = np.asarray(tep.load_run(DATA / "d01.dat"), dtype=np.float32)
    w = np.asarray(tep.load_run(DATA / "d00.dat"), dtype=np.float32)[None, 100:132]
    res = {"hardware": f"2-core x86 CPU ({platform.processor() or platform.machine()}), shared", "runs": {}}
    with tempfile.TemporaryDirectory() as d:
        fitted = Path(d) / "bundle"
        man = fit([DATA / "d00.dat"], [DATA / f"d{f:02d}.dat" for f in range(1, 22)], out=fitted, force=True,
                  log=lambda s: None)
        res["gates"] = {k: man["sensor"]["alarm"][k] for k in ("q_limit", "still_gate", "spread_limit", "level_limit")}
        gates = load_bundle(fitted)
        q_only = load_bundle(fitted)
        q_only.monitor.update(still_gate=False, spread_limit=None, level_limit=None)
        none = load_bundle(fitted)
        none.monitor.update(still_gate=False, spread_limit=None, level_limit=None, q_limit=None)
        for _ in range(2):                  # interleaved, twice: the machine is shared
            for name, det in (("fitted, its gates", gates), ("fitted, Q gate only", q_only),
                              ("fitted, no gate", none), ("shipped", load_bundle(ensure_bundle()))):
                r = res["runs"].setdefault(name, {"readings_per_s": [], "batch1_ms": []})
                r["readings_per_s"].append(round(readings_per_s(det, X)))
                r["batch1_ms"].append(round(batch1_ms(det, w), 4))
    for name, r in res["runs"].items():
        print(f"{name}: {max(r['readings_per_s']):,} readings/s (one at a time), batch-1 {min(r['batch1_ms']):.3f} ms")
    a.out.write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
