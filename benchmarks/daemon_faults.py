"""Fault injection against the sensor daemon: readings published at a fixed rate over MQTT (QoS 1,
a real mosquitto with persistence) while the daemon is killed with SIGKILL and the broker is
restarted, then counted: lost, duplicated, late arrivals, per-sensor order.

    python benchmarks/daemon_faults.py [--kills 20] [--broker-restarts 3] [--sensors 4]
        [--per-sensor 5000] [--rate 200] [--seeds 1 2 ...] [--compare REV]

--compare REV runs the same schedule against the daemon of git revision REV (a worktree on its
PYTHONPATH) in the same run. Writes benchmarks/results/sensor/daemon_faults_kill9_broker_restarts.json and prints a markdown table.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--broker-restarts", type=int, default=3)
    ap.add_argument("--sensors", type=int, default=4)
    ap.add_argument("--per-sensor", type=int, default=5000)
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--seeds", type=int, nargs="*", default=[None], help="random schedules (default: even)")
    ap.add_argument("--compare", metavar="REV", help="also run the daemon of this git revision")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "sensor" / "daemon_faults_kill9_broker_restarts.json"))
    a = ap.parse_args()

    import numpy as np

    sys.path.insert(0, str(REPO / "tests"))
    from daemon_harness import fault_run
    from zeroedge.sensor.tep import load_run
    from zeroedge.sensor.train import ensure_bundle

    data = REPO.parent / "shared" / "data" / "tep-braatz"
    frames = np.concatenate([load_run(data / "d00.dat"), load_run(data / "d01.dat")])
    work = Path(tempfile.mkdtemp(prefix="zeroedge-faults-"))
    bundle = ensure_bundle(work / "bundle")
    runs = {"this tree": None}
    if a.compare:
        old = work / "old"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(old), a.compare], check=True,
                       capture_output=True)
        runs[a.compare] = {"PYTHONPATH": str(old)}
    rows = []
    try:
        for seed in a.seeds:
            for name, env in runs.items():
                fig = fault_run(work / f"{name.replace(' ', '-')}-{seed}", bundle, frames, sensors=a.sensors,
                                per_sensor=a.per_sensor, rate=a.rate, kills=a.kills,
                                broker_restarts=a.broker_restarts, env=env, seed=seed)
                fig.update(daemon=name, schedule="even" if seed is None else f"random, seed {seed}")
                rows.append(fig)
                print(json.dumps(fig), flush=True)
    finally:
        if a.compare:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(work / "old")],
                           capture_output=True)
    Path(a.out).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "runs": rows}, indent=2) + "\n")
    cols = ["daemon", "schedule", "readings", "sensors", "rate", "kills", "broker_restarts", "lost", "duplicated",
            "late_arrivals", "redeliveries_absorbed", "other_dead_letters", "order_kept", "exit_status"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c)) for c in cols) + " |")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
