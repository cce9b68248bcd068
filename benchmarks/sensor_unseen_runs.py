#!/usr/bin/env python3
"""`zeroedge sensor-fit` scored on runs the fit never saw. Results: benchmarks/sensor.md ("Fitting to a
plant"), raw numbers in benchmarks/results/sensor/fit_unseen_runs.json.

  python benchmarks/sensor_unseen_runs.py [--replicates 0 1 2] [--compare REV] [--out FILE]
  python benchmarks/sensor_unseen_runs.py --table [--out FILE]     (the tables of sensor.md from FILE)

Each replicate is a plant record shaped like the standard Braatz set, simulated by tep-studio from
seeds no other split uses (`zeroedge.sensor.tep.shaped_plan`): fit files d00.dat (normal, 25 h) and
d01-d21.dat (the fault active from 1 h before the first sample, 25 h); test files d00_te.dat (48 h
normal) and d01_te-d21_te.dat (48 h, fault from sample 160). The fit is the README's command,
`zeroedge sensor-fit d00.dat --faults d01.dat ... d21.dat --allow-constant -o B` (tep-studio's
controller holds two valves constant); the test runs go through `zeroedge.sensor.runtime.
evaluate_frames` on the ONNX bundle (the code path of `sensor-eval` and the daemon). Beside it, in
the same run: PCA T^2 and Q (90 % variance, 99 % limits, no filtering) fitted on d00.dat, and with
--compare the sensor-fit of git revision REV on the same files. FAR is reported separately over the
160 normal samples that open each fault run and over d00_te.dat.

Also the fit on the Braatz training runs themselves (../shared/data/tep-braatz, whose test runs
are not in this repository): its manifest's out-of-fold prediction is what it promises there.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BRAATZ = REPO.parent / "shared" / "data" / "tep-braatz"
HARD = (3, 9, 15)
ONSET = 160


def fit_bundle(src: Path, tree: Path, out: Path, extra=()):
    """sensor-fit through the CLI of the source tree `tree`; returns (manifest, seconds)."""
    faults = [src / f"d{f:02d}.dat" for f in range(1, 22)]
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "zeroedge.cli", "sensor-fit", src / "d00.dat", "--faults", *faults,
                        *extra, "-o", out, "--force"], capture_output=True, text=True, cwd=tree,
                       env={**os.environ, "PYTHONPATH": str(tree)})
    if p.returncode:
        raise SystemExit(f"sensor-fit ({tree}) failed: {p.stderr[-2000:]}")
    return json.loads((out / "manifest.json").read_text()), round(time.time() - t0, 1)


def score_bundle(bundle: Path, src: Path) -> dict:
    from zeroedge.sensor.runtime import evaluate_frames, load_bundle
    from zeroedge.sensor.tep import load_run

    det = load_bundle(bundle)
    rows = {}
    for f in range(22):
        X = load_run(src / f"d{f:02d}_te.dat")
        m = evaluate_frames(det, X, ONSET if f else len(X))
        rows[f] = {k: m[k] for k in ("fdr", "far", "delay", "predicted_fault", "samples")}
        rows[f]["false_alarm_samples"] = np.flatnonzero(m["_alarm"][:ONSET if f else len(X)]).tolist()[:200]
    return rows


def score_pca(src: Path) -> dict:
    from zeroedge.sensor.metrics import detection_metrics
    from zeroedge.sensor.pca import PCAMonitor
    from zeroedge.sensor.tep import load_run

    pca = PCAMonitor().fit(load_run(src / "d00.dat"))
    out = {}
    for f in range(22):
        X = load_run(src / f"d{f:02d}_te.dat")
        onset = ONSET if f else len(X)
        al = pca.alarms(X)
        out[f] = {k: detection_metrics(al[k], onset) for k in ("t2", "q", "t2_or_q")}
    return out


def summary(rows: dict, key=None) -> dict:
    """Mean FDR over faults 1-21 excluding 3, 9, 15, over 3, 9, 15, FAR over the fault runs' first 160
    samples (pooled) and over d00_te."""
    get = (lambda f: rows[f]) if key is None else (lambda f: rows[f][key])
    fdr = lambda fs: float(np.mean([get(f)["fdr"] for f in fs]))  # noqa: E731
    return {"fdr_excl_3_9_15": round(fdr([f for f in range(1, 22) if f not in HARD]), 4),
            "fdr_3_9_15": round(fdr(HARD), 4), "fdr_all_21": round(fdr(range(1, 22)), 4),
            "far_fault_runs": round(float(np.mean([get(f)["far"] for f in range(1, 22)])), 4),
            "far_d00_te": round(get(0)["far"], 4)}


def predicted(man: dict) -> dict:
    al = man["sensor"]["alarm"]
    ev = al["val_far_evidence"]
    return {"far_target": al["far_target"], "predicted_far": al["val_far"], "far_upper_95": ev["far_upper"],
            "independent_blocks": ev["independent_blocks"], "out_of_fold_fdr": al.get("val_fdr"),
            "ema_alpha": al["ema_alpha"], "threshold": round(al["threshold"], 6), "q_limit": al.get("q_limit"),
            "q_share": al.get("q_share"), "spread_limit": al.get("spread_limit"), "level_limit": al.get("level_limit"),
            "still_gate": al.get("still_gate"),
            "far_by_held_out_run": {Path(f).name: v for f, v in (al.get("val_far_runs") or {}).items()}}


def tables(res: dict) -> str:
    """sensor.md's tables: one line per replicate, then every fault averaged over the replicates."""
    reps = res["replicates"]
    old = res.get("compare")
    f3 = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    L = ["| replicate | fit | FDR excl. 3, 9, 15 | FDR 3, 9, 15 | FAR, fault runs' first 160 | FAR, d00_te | "
         "predicted FAR (95 % bound, blocks) | unobservable in the fit |", "|---" * 8 + "|"]
    for r, rep in reps.items():
        for name in ["current"] + ([old] if old else []):
            s, m = rep[name]["summary"], rep[name]["manifest"]
            pred = (f"{m['predicted_far']:.3f} (≤ {m['far_upper_95']:.3f}, {m['independent_blocks']})"
                    if name == "current" else f"{m['predicted_far']:.3f}")
            unobs = ", ".join(c.replace("fault_", "") for c in rep[name]["unobservable"])
            L.append(f"| {r} | {'sensor-fit' if name == 'current' else 'sensor-fit of ' + name} | "
                     f"{f3(s['fdr_excl_3_9_15'])} | {f3(s['fdr_3_9_15'])} | {f3(s['far_fault_runs'])} | "
                     f"{f3(s['far_d00_te'])} | {pred} | {unobs} |")
        s = rep["pca_summary"]["t2"]
        L.append(f"| {r} | PCA T² | {f3(s['fdr_excl_3_9_15'])} | {f3(s['fdr_3_9_15'])} | {f3(s['far_fault_runs'])} | "
                 f"{f3(s['far_d00_te'])} | – | – |")
    L += ["", "| fault | sensor-fit FDR | FAR | delay | named right | "
          + (f"fit of {old}: FDR | FAR | " if old else "") + "PCA T² FDR | FAR | PCA Q FDR | FAR |",
          "|---" * (10 if old else 8) + "|"]
    mean = lambda v: None if not [x for x in v if x is not None] else float(np.mean([x for x in v if x is not None]))  # noqa: E731
    for f in [f for f in range(1, 22) if f not in HARD] + list(HARD):
        cur = [rep["current"]["runs"][str(f)] for rep in reps.values()]
        pca = [rep["pca"][str(f)] for rep in reps.values()]
        right = sum(c["predicted_fault"] == f"fault_{f:02d}" for c in cur)
        d = mean([c["delay"] for c in cur])
        row = (f"| {f}{' (unobservable in the Braatz set)' if f in HARD else ''} | {f3(mean([c['fdr'] for c in cur]))} | "
               f"{f3(mean([c['far'] for c in cur]))} | {'–' if d is None else f'{d:.0f}'} | {right}/{len(cur)} | ")
        if old:
            o = [rep[old]["runs"][str(f)] for rep in reps.values()]
            row += f"{f3(mean([c['fdr'] for c in o]))} | {f3(mean([c['far'] for c in o]))} | "
        row += (f"{f3(mean([p['t2']['fdr'] for p in pca]))} | {f3(mean([p['t2']['far'] for p in pca]))} | "
                f"{f3(mean([p['q']['fdr'] for p in pca]))} | {f3(mean([p['q']['far'] for p in pca]))} |")
        L.append(row)
    return "\n".join(L)


def main():
    from zeroedge.sensor import tep

    ap = argparse.ArgumentParser()
    ap.add_argument("--replicates", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--compare", metavar="REV", help="also fit with the sensor-fit of this git revision")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "sensor" / "fit_unseen_runs.json")
    ap.add_argument("--table", action="store_true", help="print sensor.md's tables from --out and stop")
    a = ap.parse_args()
    if a.table:
        print(tables(json.loads(a.out.read_text())))
        return
    res = {"protocol": __doc__.split("\n\n")[1].replace("\n", " "), "replicates": {}, "hardware": "2-core CPU"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        trees = {"current": REPO}
        if a.compare:
            old = tmp / "old"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(old), a.compare], check=True,
                           capture_output=True)
            trees[a.compare] = old
            res["compare"] = a.compare
        try:
            for r in a.replicates:
                src = tep.generate_shaped(r, workers=2)
                rep = {"pca": score_pca(src)}
                for name, tree in trees.items():
                    man, secs = fit_bundle(src, tree, tmp / f"b{r}_{name}", ["--allow-constant"])
                    rows = score_bundle(tmp / f"b{r}_{name}", src)
                    rep[name] = {"fit_seconds": secs, "unobservable": man["sensor"]["fit"]["unobservable_classes"],
                                 "manifest": predicted(man), "runs": rows, "summary": summary(rows)}
                    print(f"r{r} {name}: {rep[name]['summary']} predicted {rep[name]['manifest']['predicted_far']}",
                          flush=True)
                rep["pca_summary"] = {k: summary(rep["pca"], k) for k in ("t2", "q", "t2_or_q")}
                print(f"r{r} PCA T2: {rep['pca_summary']['t2']}", flush=True)
                res["replicates"][r] = rep
            for name, tree in trees.items():
                man, secs = fit_bundle(BRAATZ, tree, tmp / f"braatz_{name}")
                fit = {"fit_seconds": secs, "manifest": predicted(man),
                       "unobservable": man["sensor"]["fit"]["unobservable_classes"],
                       "per_class_out_of_fold": man["sensor"]["fit"]["validation"]["per_class"]}
                res["braatz_fit" if name == "current" else f"braatz_fit_{name}"] = fit
                print(f"braatz {name}: {fit['manifest']}", flush=True)
        finally:
            if a.compare:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tmp / "old")],
                               capture_output=True)
    a.out.write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
