"""The sensor part of `zeroedge demo`: the TEP simulator streams readings (fault introduced
mid-run) through the daemon's inference path (per-stream window, onnxruntime model, alarm filter);
writes a fault-detection timeline PNG and returns a summary. No broker needed."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

FAULT, SEED, HOURS, ONSET_H = 1, 424242, 12.0, 4.0   # IDV(1): A/C feed ratio step, 4 h into 12 h


def run(out_dir: Path, fault: int = FAULT, seed: int = SEED, hours: float = HOURS,
        onset_h: float = ONSET_H) -> dict:
    from zeroedge.sensor.metrics import detection_metrics
    from zeroedge.sensor.runtime import Engine, load_bundle
    from zeroedge.sensor.tep import SAMPLE_H, stream
    from zeroedge.sensor.train import ensure_bundle

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    det = load_bundle(ensure_bundle())
    eng = Engine(det, infer_every=1)
    t_sim = time.perf_counter()
    frames = np.stack(list(stream(fault, seed, hours, onset_h)))
    t_sim = time.perf_counter() - t_sim
    t0 = time.perf_counter()
    res = []
    for i, f in enumerate(frames):                 # one reading at a time, as the daemon sees them
        res += eng.process([("tep-sim", i, f, None)], now=0.0)
    dt = time.perf_counter() - t0
    onset = int(round(onset_h / SAMPLE_H))
    alarm = np.array([r["alarm"] for r in res])
    m = detection_metrics(alarm, onset)
    votes = [r["fault_guess"] for r in res[onset:] if r["alarm"]]
    predicted = max(set(votes), key=votes.count) if votes else "normal"
    lat = np.array(eng.latencies) * 1000
    summary = {"fault": f"fault_{fault:02d}", "predicted_fault": predicted, "fdr": m["fdr"],
               "far": m["far"], "delay": m["delay"], "samples": len(frames), "onset": onset,
               "readings_per_s": round(len(frames) / dt, 1),
               "window_latency_ms_p50": round(float(np.percentile(lat, 50)), 3),
               "window_latency_ms_p99": round(float(np.percentile(lat, 99)), 3),
               "simulator_s": round(t_sim, 2), "backend": det.backend.name}
    png = out_dir / "sensor_timeline.png"
    _plot(png, frames, res, onset, det, summary)
    summary["png"] = str(png)
    return summary


def _plot(png: Path, frames, res, onset, det, summary):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = np.arange(len(frames)) * 0.05
    fig, ax = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    z = (frames - det.mean) * det.inv_std
    for ch, name in ((0, "XMEAS(1) A feed"), (3, "XMEAS(4) A+C feed"), (43, "XMV(3) A feed valve")):
        ax[0].plot(t, z[:, ch], lw=0.8, label=name)
    ax[0].set_ylabel("normalised value")
    ax[0].legend(loc="upper left", fontsize=8)
    ax[0].axvline(onset * 0.05, color="k", ls="--", lw=1)
    lo, hi = 1e-5, 1 - 1e-6
    ax[1].plot(t, np.clip([r["score"] for r in res], lo, hi), lw=0.6, color="0.6", label="1 - P(normal)")
    ax[1].plot(t, np.clip([r["ema"] for r in res], lo, hi), lw=1.2, color="C3", label="filtered score")
    ax[1].axhline(det.threshold, color="C3", ls=":", lw=1, label=f"threshold {det.threshold:.4f}")
    al = np.array([r["alarm"] for r in res])
    ax[1].fill_between(t, lo, hi, where=al, color="C3", alpha=0.12, step="mid", label="alarm")
    ax[1].axvline(onset * 0.05, color="k", ls="--", lw=1, label="fault onset")
    ax[1].set_yscale("logit")
    ax[1].set_ylim(lo, hi)
    ax[1].set_xlabel("hours")
    ax[1].legend(loc="upper left", fontsize=7)
    fdr = "-" if summary["fdr"] is None else f"{summary['fdr']:.2f}"
    far = "-" if summary["far"] is None else f"{summary['far']:.2f}"
    fig.suptitle(f"TEP {summary['fault']} -> predicted {summary['predicted_fault']}: FDR {fdr}, "
                 f"FAR {far}, delay {summary['delay']} samples", fontsize=10)
    fig.tight_layout()
    tmp = png.with_name(png.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(png)


def fit_demo(out_dir: Path, seed_fit: int = 515151, seed_run: int = 626262, fault: int = FAULT,
             hours: float = 15.0, onset_h: float = ONSET_H, log=print) -> dict:
    """`zeroedge sensor-fit` on one plant, detection on another run of it: the simulator's normal
    operation (15 h, one seed) fits a bundle (normalisation, T^2 monitor, threshold for FAR 1 %);
    a different run (another seed, IDV(1) at 4 h) streams through the daemon's path with it."""
    from zeroedge.sensor import fit as F
    from zeroedge.sensor.runtime import evaluate_frames, load_bundle
    from zeroedge.sensor.tep import SAMPLE_H, save_run, simulate

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    normal = out_dir / "plant_normal.dat"
    save_run(normal, simulate(0, seed_fit, hours, 0.0))
    t_fit = time.perf_counter()
    # tep-studio's controller holds two valves (XMV 5, 9) fixed: constant channels, accepted here
    F.fit([normal], out=out_dir / "plant_bundle", force=True, far=0.01, allow_constant=True, log=lambda s: None)
    t_fit = time.perf_counter() - t_fit
    run = simulate(fault, seed_run, hours, onset_h)
    save_run(out_dir / "plant_run.dat", run)
    det = load_bundle(out_dir / "plant_bundle")
    onset = int(round(onset_h / SAMPLE_H))
    m = evaluate_frames(det, run, onset, sensor="plant-run")
    return {"fit_on": f"{normal} ({hours:g} h of normal operation, seed {seed_fit})",
            "bundle": str(out_dir / "plant_bundle"), "fit_s": round(t_fit, 1),
            "run": f"fault_{fault:02d} at {onset_h:g} h, seed {seed_run}", "fdr": m["fdr"], "far": m["far"],
            "delay": m["delay"], "predicted_fault": m["predicted_fault"], "drift_warning": m["warning"],
            "total_s": round(time.perf_counter() - t0, 1)}
