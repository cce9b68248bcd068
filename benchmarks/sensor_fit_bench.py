#!/usr/bin/env python3
"""`zeroedge sensor-fit` on the standard TEP training runs, scored on a held-out split made from them
(the standard test runs are not in this repository). Results: benchmarks/sensor.md ("Fitting to a
plant"), raw numbers in benchmarks/results/sensor/fit_braatz_two_folds.json.

  python benchmarks/sensor_fit_bench.py [--folds A B] [--out benchmarks/results/sensor/fit_braatz_two_folds.json]

Split (per fold), from ../shared/data/tep-braatz:
  fold A ("onset held out"):  normal d00[160:500] and faults dNN[160:480] fit; test runs are
                              d00[0:160] followed by dNN[0:160] (the fault's first 8 h, its onset).
  fold B ("late held out"):   normal d00[0:340] and faults dNN[0:320] fit; test runs are
                              d00[340:500] followed by dNN[320:480] (hours 16-24 of the fault).
Every test run is 320 samples with the fault from sample 160, written as a file and scored with
`zeroedge sensor-eval --bundle B FILE... --onset 160 --json` (the daemon's code path). Beside it, PCA
T^2 and Q (90 % variance, 99 % limits) fitted on the same normal training part, no filtering, and
PCA T^2 with its limit moved to give the model's own FAR on these test runs (an oracle threshold).
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DATA = REPO.parent / "shared" / "data" / "tep-braatz"
HARD = (3, 9, 15)


def write(path, X):
    np.savetxt(path, X, fmt="%.6g")


def make_fold(fold, root: Path):
    from zeroedge.sensor.tep import load_run

    d0 = load_run(DATA / "d00.dat")
    faults = {f: load_run(DATA / f"d{f:02d}.dat") for f in range(1, 22)}
    if fold == "A":
        n_tr, n_te, sl_tr, sl_te = d0[160:], d0[:160], slice(160, 480), slice(0, 160)
    else:
        n_tr, n_te, sl_tr, sl_te = d0[:340], d0[340:], slice(0, 320), slice(320, 480)
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir()
    write(root / "train" / "d00.dat", n_tr)
    tests = []
    for f, X in faults.items():
        write(root / "train" / f"d{f:02d}.dat", X[sl_tr])
        p = root / "test" / f"d{f:02d}_te.dat"
        write(p, np.concatenate([n_te, X[sl_te]]))
        tests.append((f, p))
    return n_tr, tests


def cli(*args):
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "zeroedge.cli", *map(str, args)], capture_output=True, text=True,
                       cwd=REPO)
    if p.returncode:
        raise SystemExit(f"{args[0]} failed: {p.stderr[-2000:]}")
    return p, time.time() - t0


def evaluate(bundle, tests):
    p, _ = cli("sensor-eval", "--bundle", bundle, *[t for _, t in tests], "--onset", 160, "--json")
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    return {f: r for (f, _), r in zip(tests, rows)}, p.stderr.count("warning")


def pca_rows(n_tr, tests):
    from zeroedge.sensor.metrics import detection_metrics
    from zeroedge.sensor.pca import PCAMonitor
    from zeroedge.sensor.tep import load_run

    pca = PCAMonitor().fit(n_tr)
    out = {}
    for f, p in tests:
        X = load_run(p)
        t2, q = pca.scores(X)
        out[f] = {"t2": detection_metrics(t2 > pca.t2_limit, 160), "q": detection_metrics(q > pca.q_limit, 160),
                  "_t2": t2, "_q": q}
    return out


def at_far(scores, far):
    """PCA T^2 with the limit that gives `far` over all pre-onset samples (oracle)."""
    pre = np.concatenate([s[:160] for s in scores.values()])
    thr = np.quantile(pre, 1 - far) if far > 0 else pre.max()
    return {f: float((s[160:] > thr).mean()) for f, s in scores.items()}, float((pre > thr).mean())


def mean(v):
    v = [x for x in v if x is not None]
    return float(np.mean(v)) if v else None


def run_fold(fold, root):
    n_tr, tests = make_fold(fold, root)
    train = sorted((root / "train").glob("d*.dat"))
    res = {"fold": fold}
    for variant, extra in (("faults", ["--faults", *[p for p in train if p.name != "d00.dat"]]), ("normal", [])):
        b = root / f"bundle_{variant}"
        p, secs = cli("sensor-fit", root / "train" / "d00.dat", *extra, "-o", b, "--json")
        summary = json.loads(p.stdout.splitlines()[-1])
        rows, warnings = evaluate(b, tests)
        res[variant] = {"fit_seconds": round(secs, 1), "fit": summary, "runs": rows, "drift_warnings": warnings}
        print(f"fold {fold} {variant}: fit {secs:.0f}s, mean FDR excl. 3/9/15 "
              f"{mean([r['fdr'] for f, r in rows.items() if f not in HARD]):.3f}, "
              f"FAR {mean([r['far'] for r in rows.values()]):.3f}", flush=True)
    pca = pca_rows(n_tr, tests)
    res["pca"] = {f: {"t2": v["t2"], "q": v["q"]} for f, v in pca.items()}
    for stat in ("t2", "q"):
        sc = {f: v["_" + stat] for f, v in pca.items()}
        for variant in ("faults", "normal"):
            far = mean([r["far"] for r in res[variant]["runs"].values()])
            fdr, got = at_far(sc, far)
            res[f"pca_{stat}_at_{variant}_far"] = {"far": got, "fdr": fdr}
    return res


def table(res):
    L = []
    fmt = lambda v, d=3: "–" if v is None else (f"{v:.{d}f}" if isinstance(v, float) else str(v))  # noqa: E731
    fa, no, pca = res["faults"]["runs"], res["normal"]["runs"], res["pca"]
    L.append(f"| fault | fit with faults: FDR | FAR | delay | predicted | normal-only fit: FDR | FAR | delay | "
             f"PCA T² FDR | FAR | delay | PCA Q FDR | FAR | delay |")
    L.append("|---" * 14 + "|")
    for f in range(1, 22):
        a, b, t, q = fa[f], no[f], pca[f]["t2"], pca[f]["q"]
        L.append(f"| {f}{' (hard)' if f in HARD else ''} | {fmt(a['fdr'])} | {fmt(a['far'])} | {fmt(a['delay'])} | "
                 f"{a['predicted_fault']} | {fmt(b['fdr'])} | {fmt(b['far'])} | {fmt(b['delay'])} | {fmt(t['fdr'])} | "
                 f"{fmt(t['far'])} | {fmt(t['delay'])} | {fmt(q['fdr'])} | {fmt(q['far'])} | {fmt(q['delay'])} |")
    ok = [f for f in range(1, 22) if f not in HARD]
    s = {
        "faults": (mean([fa[f]["fdr"] for f in ok]), mean([fa[f]["far"] for f in fa]), mean([fa[f]["delay"] for f in ok])),
        "normal": (mean([no[f]["fdr"] for f in ok]), mean([no[f]["far"] for f in no]), mean([no[f]["delay"] for f in ok])),
        "t2": (mean([pca[f]["t2"]["fdr"] for f in ok]), mean([pca[f]["t2"]["far"] for f in pca]), mean([pca[f]["t2"]["delay"] for f in ok])),
        "q": (mean([pca[f]["q"]["fdr"] for f in ok]), mean([pca[f]["q"]["far"] for f in pca]), mean([pca[f]["q"]["delay"] for f in ok])),
    }
    correct = sum(fa[f]["predicted_fault"] == f"fault_{f:02d}" for f in ok)
    L.append(f"| **mean excl. 3, 9, 15** | **{fmt(s['faults'][0])}** | **{fmt(s['faults'][1])}** | {fmt(s['faults'][2], 1)} | "
             f"{correct}/18 right | **{fmt(s['normal'][0])}** | **{fmt(s['normal'][1])}** | {fmt(s['normal'][2], 1)} | "
             f"{fmt(s['t2'][0])} | {fmt(s['t2'][1])} | {fmt(s['t2'][2], 1)} | {fmt(s['q'][0])} | {fmt(s['q'][1])} | {fmt(s['q'][2], 1)} |")
    res["summary"] = {k: {"fdr": v[0], "far": v[1], "delay": v[2]} for k, v in s.items()}
    res["summary"]["classified_right"] = correct
    L.append("")
    for stat, nm in (("t2", "T²"), ("q", "Q")):
        pf, pn = res[f"pca_{stat}_at_faults_far"], res[f"pca_{stat}_at_normal_far"]
        res["summary"][f"pca_{stat}_matched"] = {"faults": [mean([pf['fdr'][f] for f in ok]), pf["far"]],
                                                 "normal": [mean([pn['fdr'][f] for f in ok]), pn["far"]]}
        L.append(f"PCA {nm} with its limit moved to the model's FAR on these runs (oracle): "
                 f"{fmt(mean([pf['fdr'][f] for f in ok]))} at FAR {fmt(pf['far'])} (vs the fit with faults); "
                 f"{fmt(mean([pn['fdr'][f] for f in ok]))} at FAR {fmt(pn['far'])} (vs the normal-only fit).  ")
    L.append(f"Fit time: {res['faults']['fit_seconds']} s with faults, {res['normal']['fit_seconds']} s normal only "
             f"(2 threads, wall clock, including the ONNX export). Drift warnings on the test runs: "
             f"{res['faults']['drift_warnings']} (fit with faults), {res['normal']['drift_warnings']} (normal only).")
    return "\n".join(L)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--folds", nargs="+", default=["A", "B"])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "sensor" / "fit_braatz_two_folds.json")
    a = ap.parse_args()
    allres = {}
    for fold in a.folds:
        with tempfile.TemporaryDirectory() as d:
            res = run_fold(fold, Path(d))
        text = table(res)
        print(f"\n### fold {fold}\n\n{text}\n", flush=True)
        res["table_md"] = text
        allres[fold] = res
    a.out.write_text(json.dumps(allres, indent=1, default=float))


if __name__ == "__main__":
    main()
