"""Reproducible training of the sensor transformer on the CPU, alarm calibration on validation
runs, and export to a sensor bundle (ONNX + manifest). Needs torch (workstation side).

Data: the tep-studio `train` split (fault introduced 2 h in) plus the Braatz training runs d00 and
d01..d15; each source is normalised with its own normal-operation statistics. Faults 3, 9, 15 are
left out of training (they are indistinguishable from normal operation and only teach the model to
alarm on normal data); their classes stay in the head. The alarm filter (EMA alpha, threshold) is
chosen on the `val` split: the best average detection rate over the detectable faults with a
false-alarm rate <= `far_target` on val.
"""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Optional

import numpy as np

from zeroedge.sensor import CLASS_NAMES, HARD_FAULTS, N_CHANNELS, tep
from zeroedge.sensor.metrics import ema

SHIPPED = Path(__file__).resolve().parents[1] / "data" / "tep_sensor.npz"


def norm_stats(X: np.ndarray):
    mean = X.mean(0)
    std = X.std(0)
    std = np.where(std < 1e-6 * np.maximum(1.0, np.abs(mean)), 1.0, std)   # constant channels
    return mean.astype(np.float32), std.astype(np.float32)


def load_model(path):
    """(SensorTransformer, meta) from a .npz written by `save_model`."""
    import torch

    from zeroedge.sensor.model import SensorConfig, SensorTransformer

    z = np.load(path, allow_pickle=False)
    meta = json.loads(str(z["__meta__"]))
    cfg = SensorConfig(**meta["config"])
    m = SensorTransformer(cfg)
    sd = {k: torch.from_numpy(z[k]) for k in z.files if k != "__meta__"}
    m.load_state_dict(sd)
    return m.eval(), meta


def save_model(path: Path, model, meta: dict):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, __meta__=np.array(json.dumps(meta)), **arrays)
    tmp.replace(path)


def _windows_dataset(runs, window):
    """runs: [(Xnorm (T,C), labels (T,))] -> arrays for random window sampling."""
    starts = []
    for r, (X, y) in enumerate(runs):
        T = len(X)
        if T < 2:
            continue
        last = max(0, T - window)
        starts += [(r, s) for s in range(0, last + 1)]
    return starts


def score_series(model, Xn: np.ndarray, window: int) -> np.ndarray:
    """1 - P(normal) at every sample of a normalised run, each with up to `window` frames of
    context (the daemon's view), in batches. Returns (T, n_classes) probabilities."""
    import torch

    T = len(Xn)
    out = np.zeros((T, model.cfg.n_classes), np.float32)
    with torch.inference_mode():
        first = torch.from_numpy(Xn[:min(T, window)][None])
        out[:first.shape[1]] = model(first)[0].softmax(-1).numpy()
        if T > window:
            idx = np.arange(window, T)
            for c in range(0, len(idx), 512):
                ii = idx[c:c + 512]
                W = np.stack([Xn[i - window + 1:i + 1] for i in ii])
                out[ii] = model(torch.from_numpy(W))[:, -1].softmax(-1).numpy()
    return out


def calibrate_alarm(val_scores, far_target: float):
    """val_scores: [(fault, score (T,), onset)]. Pick (alpha, threshold) maximising the average FDR
    over detectable faults subject to FAR <= far_target over all pre-onset / normal samples."""
    best = None
    for alpha in (1.0, 0.5, 0.3, 0.2, 0.1):
        sm = [(f, ema(s, alpha), o) for f, s, o in val_scores]
        normal = np.concatenate([s[:o] for f, s, o in sm])
        for q in (0.99, 0.993, 0.995, 0.997, 0.999, 1.0):
            thr = float(np.quantile(normal, q)) if q < 1 else float(normal.max())
            far = float((normal > thr).mean())
            if far > far_target:
                continue
            fdrs = [float((s[o:] > thr).mean()) for f, s, o in sm if f and f not in HARD_FAULTS]
            fdr = float(np.mean(fdrs))
            if best is None or fdr > best[0]:
                best = (fdr, far, alpha, thr)
    fdr, far, alpha, thr = best
    return {"ema_alpha": alpha, "threshold": thr, "val_fdr": fdr, "val_far": far}


def train(steps: int = 4000, window: int = 32, seed: int = 1, far_target: float = 0.02,
          out: Path = SHIPPED, log=print, batch: int = 64, lr: float = 2e-3, threads: int = 2,
          noise: float = 0.05, label_smoothing: float = 0.0) -> dict:
    import torch
    import torch.nn.functional as F

    from zeroedge.sensor.model import SensorConfig, SensorTransformer

    torch.manual_seed(seed)
    np.random.seed(seed)
    torch.set_num_threads(threads)
    t0 = time.time()
    train_runs = tep.split_runs("train")
    normal_sim = np.concatenate([X for n, f, X, o in train_runs if f == 0])
    mean, std = norm_stats(normal_sim)
    braatz = tep.braatz_runs()
    b_mean, b_std = norm_stats(braatz[0][1])
    data = []
    for name, f, X, onset in train_runs:
        if f in HARD_FAULTS:
            continue
        y = np.zeros(len(X), np.int64)
        if f:
            y[onset:] = f
        data.append(((X - mean) / std, y))
    for f, X, onset in braatz:
        if f in HARD_FAULTS or f > 15:      # Braatz 16-21 are not the same faults as tep-studio's
            continue
        data.append(((X - b_mean) / b_std, np.full(len(X), f, np.int64)))
    data = [(np.clip(X, -50, 50).astype(np.float32), y) for X, y in data]
    starts = _windows_dataset(data, window)
    log(f"[train] {len(data)} runs, {sum(len(X) for X, _ in data)} samples, "
        f"{len(starts)} windows ({time.time() - t0:.1f}s to load)")

    cfg = SensorConfig(window=window)
    model = SensorTransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    weight = torch.ones(cfg.n_classes)
    weight[0] = 2.0
    rng = np.random.default_rng(seed)
    model.train()
    for step in range(steps):
        pick = rng.integers(0, len(starts), batch)
        xb = np.zeros((batch, window, N_CHANNELS), np.float32)
        yb = np.full((batch, window), -100, np.int64)
        for i, k in enumerate(pick):
            r, s = starts[k]
            X, y = data[r]
            seg = X[s:s + window]
            xb[i, :len(seg)] = seg
            yb[i, :len(seg)] = y[s:s + window]
        xt = torch.from_numpy(xb)
        xt = xt + noise * torch.randn_like(xt)                 # noise augmentation
        logits = model(xt)
        loss = F.cross_entropy(logits.reshape(-1, cfg.n_classes), torch.from_numpy(yb).reshape(-1),
                               weight=weight, ignore_index=-100, label_smoothing=label_smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 250 == 0 or step == steps - 1:
            log(f"[train] step {step} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
    model.eval()
    meta = {"config": cfg.to_dict(), "window": window, "channels": N_CHANNELS,
            "class_names": CLASS_NAMES, "hard_faults": list(HARD_FAULTS),
            "normalisation": {"mean": mean.tolist(), "std": std.tolist(),
                              "fitted_on": "tep-studio normal operation (train split, 6 runs x 30 h)"},
            "alarm": {"ema_alpha": 1.0, "threshold": 0.5},
            "train": {"steps": steps, "seed": seed, "batch": batch, "lr": lr, "threads": threads,
                      "noise": noise, "label_smoothing": label_smoothing,
                      "seconds": round(time.time() - t0, 1),
                      "data": "tep-studio train split + Braatz d00-d15 (3, 9, 15 left out)"}}
    save_model(out, model, meta)                    # provisional alarm; calibrated next
    meta["alarm"] = calibrate(model, meta, far_target, log)
    save_model(out, model, meta)
    log(f"[train] wrote {out} ({out.stat().st_size} bytes) in {time.time() - t0:.0f}s")
    return meta


def calibrate(model, meta, far_target: float = 0.02, log=print) -> dict:
    """Choose the alarm filter on the val split (see calibrate_alarm)."""
    mean = np.asarray(meta["normalisation"]["mean"], np.float32)
    std = np.asarray(meta["normalisation"]["std"], np.float32)
    val_scores = []
    for name, f, X, onset in tep.split_runs("val"):
        Xn = np.clip((X - mean) / std, -50, 50).astype(np.float32)
        p = score_series(model, Xn, meta["window"])
        val_scores.append((f, 1.0 - p[:, 0], onset if f else len(X)))
    alarm = calibrate_alarm(val_scores, far_target)
    alarm["far_target"] = far_target
    log(f"[train] alarm calibration on val: {alarm}")
    return alarm


def recalibrate(path: Path = SHIPPED, far_target: float = 0.02, log=print) -> dict:
    model, meta = load_model(path)
    meta["alarm"] = calibrate(model, meta, far_target, log)
    save_model(path, model, meta)
    return meta


def export_bundle(out_dir, weights: Optional[Path] = None, opset: int = 17, zero: bool = True) -> dict:
    """Write a sensor bundle: model.onnx (last-position probabilities, dynamic batch and time),
    weights.npz (for the torch backend), manifest.json with "kind": "sensor" and the "sensor" meta
    (window, channels, class_names, normalisation, alarm, onnx and weights file names).
    zero=True (default) exports the last-token path of the last block (exact; see
    SensorTransformer.forward_last); zero=False the dense graph, for comparison."""
    import shutil

    import torch

    from zeroedge import bundle as zb
    from zeroedge.sensor.model import LastPosition

    weights = Path(weights or ensure_weights())
    model, meta = load_model(weights)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    x = torch.zeros(1, meta["window"], meta["channels"])
    with warnings.catch_warnings():        # the tracer's notes on Python branches: not for a user's terminal
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(LastPosition(model, zero=zero), (x,), str(tmp / "model.onnx"), opset_version=opset,
                          input_names=["frames"], output_names=["probs"], dynamo=False,
                          dynamic_axes={"frames": {0: "batch", 1: "time"}, "probs": {0: "batch"}})
    shutil.copyfile(weights, tmp / "weights.npz")
    sensor = {k: meta[k] for k in ("window", "channels", "class_names", "normalisation", "alarm",
                                   "hard_faults", "config")}
    sensor.update({k: meta[k] for k in ("monitor", "profile", "fit") if k in meta})   # sensor-fit bundles
    sensor.update(onnx="model.onnx", weights="weights.npz", input="frames", output="probs",
                  opset=opset, zero=bool(zero))
    m = zb.write_manifest(tmp, {"kind": "sensor", "opset": opset, "sensor": sensor})
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.replace(out_dir)
    return m


def ensure_weights(log=print) -> Path:
    """The shipped weights; trained here (a few minutes) if they are missing."""
    if not SHIPPED.is_file():
        log("[sensor] no shipped weights; training them (a few minutes)")
        train(log=log)
    return SHIPPED


def ensure_bundle(out_dir=None, zero: bool = True) -> Path:
    """A sensor bundle built from the shipped weights, cached next to the generated data."""
    from zeroedge import bundle as zb
    from zeroedge.errors import UserError

    out_dir = Path(out_dir or tep.cache_dir().parent / ("sensor_bundle" if zero else "sensor_bundle_dense"))
    w = ensure_weights()
    try:
        m = zb.verify(out_dir)
        if m["files"].get("weights.npz", {}).get("sha256") == zb.sha256_file(w) and \
                m["sensor"].get("zero", False) == zero:
            return out_dir
    except UserError:
        pass
    export_bundle(out_dir, w, zero=zero)
    return out_dir
