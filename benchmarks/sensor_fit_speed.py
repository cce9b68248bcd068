"""Inference speed of a sensor-fit bundle against the shipped one: the Engine the daemon and
sensor-eval run, one reading at a time, 2 threads, over the Braatz d01 training run (three passes).

    python benchmarks/sensor_fit_speed.py
"""
import tempfile
import time
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tep-braatz"


def readings_per_s(bundle, X) -> float:
    from zeroedge.sensor.runtime import Engine, load_bundle

    eng = Engine(load_bundle(bundle, threads=2))
    n, t0 = 0, time.perf_counter()
    for rep in range(3):
        for i, f in enumerate(X):
            eng.process([("s", rep * len(X) + i, f, None)], now=0.0)
            n += 1
    return n / (time.perf_counter() - t0)


def main():
    from zeroedge.sensor import tep
    from zeroedge.sensor.fit import fit
    from zeroedge.sensor.train import ensure_bundle

    X = np.asarray(tep.load_run(DATA / "d01.dat"), dtype=np.float32)
    with tempfile.TemporaryDirectory() as d:
        fitted = Path(d) / "bundle"
        fit([DATA / "d00.dat"], out=fitted, force=True, log=lambda s: None)
        for name, b in (("shipped", ensure_bundle()), ("fitted on d00 (normal only)", fitted)):
            print(f"{name}: {readings_per_s(b, X):,.0f} readings/s (one reading at a time, 2 threads)")


if __name__ == "__main__":
    main()
