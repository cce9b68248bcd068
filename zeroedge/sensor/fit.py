"""`zeroedge sensor-fit`: fit the sensor detector to a plant from its own recorded runs.

1. Normal-operation files give the normalisation (mean / std per channel, from their training part).
2. Labelled fault files (one per fault class; the class from the file name `dNN...` or `--label`)
   fine-tune the shipped detector on the CPU, with early stopping on the held-out tail of every
   file. Fault files are read as faulty from their first sample (the standard training runs), and
   their fault windows start two windows in (the fault may not show before); a fault class the PCA
   monitor cannot tell from normal operation trains the normal class instead.
   Without fault files the model is not trained: the shipped weights score windows of the plant's
   own normalised data (an anomaly detector).
3. The alarm filter (EMA alpha, threshold) is calibrated on out-of-fold scores that imitate runs
   the fit never saw: in each of 4 folds a detector fitted without one normal run (held out whole;
   with a single normal file, a block of it) and without a block of every fault file, a gap of a
   window plus the EMA's memory around each block, scores what it was not fitted on. The threshold
   keeps the false-alarm rate of those normal scores at the target (their quantile, guarded by a
   Gaussian fit of the smoothed log-odds); gates may take part of that budget (a quarter at most):
   Q (the PCA residual averaged over the window) and each channel's spread and level over its last
   16 frames, limits at quantiles of the same held-out normal samples; and a still gate (a channel
   that moved in every stretch of the normal data held still) counts its raises against it. Alpha,
   the gates and their parts maximise the fault blocks' detection rate. The FAR this predicts rests
   on the independent alarm blocks counted in the manifest, with its 95 % upper bound; when that
   bound is above the target, the fit says so.
4. The bundle (ONNX + weights + manifest, "kind": "sensor") records its provenance: files, their
   SHA-256, the split, the target FAR, the validation figures and the normal-operation statistics of
   the fit data (used by the drift warning of `sensor-eval` and the daemon).

Needs torch (workstation side). Every input problem is a UserError (one line, exit 2) raised before
anything is written.
"""
from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from zeroedge.errors import UserError
from zeroedge.sensor import CLASS_NAMES, N_CHANNELS
from zeroedge.sensor.metrics import ema
from zeroedge.sensor.tep import load_run

VAL_FRAC = 0.25           # tail of every file held out for early stopping
ALPHAS = (1.0, 0.5, 0.3, 0.2, 0.1)
_LABEL_RE = re.compile(r"^d(\d{1,3})(?:_te)?(?:\.\w+)?$", re.IGNORECASE)


@dataclass
class RunFile:
    path: Path
    data: np.ndarray           # (T, channels) float32
    label: int                 # class index (0 = normal)
    sha256: str


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 20):
            h.update(b)
    return h.hexdigest()


def parse_labels(specs) -> dict:
    """['FILE=3', 'other.dat=fault_07'] -> {resolved path: class index}."""
    out = {}
    for s in specs or ():
        if "=" not in s:
            raise UserError(f"--label {s!r}: use FILE=CLASS (e.g. run7.dat=3 or run7.dat=fault_03)")
        f, c = s.rsplit("=", 1)
        k = class_index(c, f"--label {s!r}")
        out[str(Path(f).resolve())] = k
        if Path(f).name == f:
            out[f] = k
    return out


def class_index(text: str, where: str) -> int:
    t = str(text).strip().lower()
    m = re.fullmatch(r"(?:fault_?)?(\d{1,3})", t)
    if not m:
        raise UserError(f"{where}: class must be a fault number 1-{len(CLASS_NAMES) - 1} or fault_NN")
    k = int(m.group(1))
    if not 1 <= k < len(CLASS_NAMES):
        raise UserError(f"{where}: fault number {k} is out of range 1-{len(CLASS_NAMES) - 1}")
    return k


def label_from_name(path: Path) -> Optional[int]:
    m = _LABEL_RE.match(path.name)
    return int(m.group(1)) if m else None


def load_inputs(normal_files, fault_files=(), label_specs=(), window: int = 32):
    """Read and check every input; returns (normal RunFiles, fault RunFiles). UserError on bad input."""
    if not normal_files:
        raise UserError("give at least one normal-operation file")
    labels = parse_labels(label_specs)
    seen = set()
    normal, faults = [], []
    for p in normal_files:
        p = Path(p)
        X = load_run(p)
        normal.append(RunFile(p, X, 0, _sha256(p)))
        seen.add(str(p.resolve()))
    for p in fault_files:
        p = Path(p)
        key = str(p.resolve())
        if key in seen:
            raise UserError(f"{p}: given twice (as normal and fault, or as two faults)")
        seen.add(key)
        X = load_run(p)
        k = labels.pop(key, None)
        if k is None:                            # --label NAME=N also matches by file name
            k = labels.pop(p.name, None)
        if k is None:
            k = label_from_name(p)
            if k is None:
                raise UserError(f"{p}: cannot tell its fault class from the name (expected dNN.dat); "
                                f"give --label {p.name}=N")
            if k == 0:
                raise UserError(f"{p}: named as normal operation (d00); pass it as a NORMAL_FILE, not --faults")
            k = class_index(str(k), str(p))
        if len(X) < window + 8:
            raise UserError(f"{p}: {len(X)} samples, fewer than the window ({window}) + 8: too short to "
                            f"train or validate on")
        faults.append(RunFile(p, X, k, _sha256(p)))
    used = {str(Path(r.path).resolve()) for r in faults} | {r.path.name for r in faults}
    extra = [k for k in labels if k not in used]
    if extra:
        raise UserError(f"--label names a file that is not among --faults: {extra[0]}")
    n_normal = sum(len(r.data) for r in normal)
    if not folds_can_train([len(r.data) for r in normal], window):
        need = next(n for n in range(4 * window, 100 * window) if folds_can_train([n], window))
        raise UserError(f"{n_normal} normal samples: too few for the window of {window} (need at least "
                        f"{need} in one file: each of {FOLDS} validation folds holds out a block and the "
                        f"{fold_gap(window)} samples either side, and keeps 2 windows to train on); give more "
                        f"normal data or a smaller --window")
    short = [r for r in normal if len(r.data) < 2 * window]
    if short:
        raise UserError(f"{short[0].path}: {len(short[0].data)} samples, fewer than 2 windows ({2 * window})")
    return normal, faults


def split_point(n: int, window: int) -> int:
    """Training part = [0, cut), held-out tail = [cut, n); the tail has at least one window."""
    cut = int(round(n * (1 - VAL_FRAC)))
    return max(window, min(cut, n - window))


def norm_stats_checked(normal_train: np.ndarray, files, allow_constant: bool = False) -> tuple:
    """Per-channel mean / std of the normal training part. A constant channel is an error, unless
    allow_constant: then its scale is 1 % of its value (at least 1e-3), so any move of it shows."""
    mean = normal_train.mean(0, dtype=np.float64)
    std = normal_train.std(0, dtype=np.float64)
    const = np.where(std <= 1e-7 * np.maximum(1.0, np.abs(mean)))[0]
    if len(const) and allow_constant:
        std[const] = np.maximum(0.01 * np.abs(mean[const]), 1e-3)
    elif len(const):
        names = ", ".join(str(c + 1) for c in const[:8])
        raise UserError(f"column(s) {names} are constant in the normal data ({', '.join(str(f.path) for f in files)}): "
                        f"a constant channel cannot be normalised; fix the recording, drop that sensor, or pass "
                        f"--allow-constant (a move of it away from its constant value then alarms)")
    return mean.astype(np.float32), std.astype(np.float32)


def normal_profile(Z: np.ndarray, window: int) -> dict:
    """Statistics of normalised normal data for the drift check: per-channel window means of the
    fit data and how far they wander (see runtime.drift_check)."""
    n = len(Z) // window
    means = Z[:n * window].reshape(n, window, -1).mean(1) if n else Z.mean(0, keepdims=True)
    spread = np.abs(means).max(0) if n else np.zeros(Z.shape[1])
    stds = Z[:n * window].reshape(n, window, -1).std(1) if n else Z.std(0, keepdims=True)
    return {"window": int(window), "blocks": int(n),
            "max_abs_window_mean": [round(float(v), 4) for v in spread],
            "window_std_min": [round(float(v), 4) for v in stds.min(0)],
            "window_std_max": [round(float(v), 4) for v in stds.max(0)]}


# ---- training -------------------------------------------------------------------------------------

def _logit(p):
    p = np.clip(np.asarray(p, np.float64), 1e-9, 1 - 1e-9)
    return np.log(p) - np.log1p(-p)


FAULT_SETTLE_WINDOWS = 2   # fault windows start this many windows into a fault file (see _batch)


def _batch(rng, normal, faults, window, batch, p_mix=0.5):
    """Random training windows: normal crops, fault crops, and (p_mix of the fault ones) a normal
    prefix followed by a stretch of a fault run (an onset, as a test run shows it). Fault windows
    start FAULT_SETTLE_WINDOWS windows into their file: a run read as faulty from its first sample
    often does not show a slow fault there yet, and labelling those samples as the fault teaches the
    plant's state at that hour (in simulated runs, the hours after start-up) as the fault."""
    settle = FAULT_SETTLE_WINDOWS * window
    xb = np.zeros((batch, window, normal[0].shape[1]), np.float32)
    yb = np.zeros((batch, window), np.int64)
    n_norm = batch // 3 if faults else batch
    for i in range(batch):
        if i < n_norm:
            Z = normal[rng.integers(len(normal))]
            s = rng.integers(0, len(Z) - window + 1)
            xb[i] = Z[s:s + window]
            continue
        Zf, k = faults[rng.integers(len(faults))]
        if rng.random() < p_mix:
            m = int(rng.integers(1, window))          # normal frames before the onset
            Z = normal[rng.integers(len(normal))]
            s = rng.integers(0, len(Z) - m + 1)
            xb[i, :m] = Z[s:s + m]
            f0 = min(settle, len(Zf) - window)
            xb[i, m:] = Zf[f0:f0 + window - m]
            yb[i, m:] = k
        else:
            s = rng.integers(min(settle, len(Zf) - window), len(Zf) - window + 1)
            xb[i] = Zf[s:s + window]
            yb[i] = k
    return xb, yb


def _val_windows(normal, faults, window, stride=4):
    xs, ys = [], []
    for Z, k in [(Z, 0) for Z in normal] + list(faults):
        for s in range(0, len(Z) - window + 1, stride):
            xs.append(Z[s:s + window])
            ys.append(np.full(window, k, np.int64))
    return np.stack(xs), np.stack(ys)


def train_detector(model, normal_tr, faults_tr, normal_val, faults_val, window, *, max_steps=3000,
                   eval_every=100, patience=6, batch=64, lr=1e-3, noise=0.05, seed=0, threads=2,
                   normal_weight=2.0, log=print):
    """Fine-tune `model` in place; early stopping on the held-out windows' loss. Returns a dict of
    training figures (steps, best step, best validation loss, seconds)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    C = model.cfg.n_classes
    weight = torch.ones(C)
    weight[0] = normal_weight
    if not normal_val:                                 # fixed steps, no early stopping (fold models)
        return _train_fixed(model, normal_tr, faults_tr, window, max_steps, batch, lr, noise, rng, weight)
    xv, yv = _val_windows(normal_val, faults_val, window)
    xv, yv = torch.from_numpy(xv), torch.from_numpy(yv)
    opt = _optimizer(model, lr)
    t0 = time.time()
    best = (float("inf"), 0, None)
    bad = 0
    step = 0

    def val_loss():
        model.eval()
        with torch.no_grad():
            tot = 0.0
            for c in range(0, len(xv), 512):
                lg = model(xv[c:c + 512])
                tot += F.cross_entropy(lg.reshape(-1, C), yv[c:c + 512].reshape(-1), weight=weight,
                                       reduction="sum").item()
        model.train()
        return tot / yv.numel()

    best = (val_loss(), 0, {k: v.detach().clone() for k, v in model.state_dict().items()})
    log(f"[sensor-fit] step 0: held-out loss {best[0]:.4f}")
    model.train()
    for step in range(1, max_steps + 1):
        loss = _step(model, opt, rng, normal_tr, faults_tr, window, batch, noise, weight)
        if step % eval_every == 0 or step == max_steps:
            v = val_loss()
            mark = ""
            if v < best[0] - 1e-4:
                best = (v, step, {k: t.detach().clone() for k, t in model.state_dict().items()})
                bad, mark = 0, " *"
            else:
                bad += 1
            log(f"[sensor-fit] step {step}: train loss {loss.item():.4f}, held-out loss {v:.4f}{mark} "
                f"({time.time() - t0:.0f}s)")
            if bad >= patience:
                break
    model.load_state_dict(best[2])
    model.eval()
    return {"steps": step, "best_step": best[1], "best_val_loss": round(best[0], 5),
            "seconds": round(time.time() - t0, 1), "batch": batch, "lr": lr, "noise": noise,
            "seed": seed, "patience_evals": patience, "eval_every": eval_every}


def _optimizer(model, lr):
    import torch

    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)


def _step(model, opt, rng, normal_tr, faults_tr, window, batch, noise, weight):
    """One optimiser step on a random batch (white noise of `noise` standard deviations added)."""
    import torch
    import torch.nn.functional as F

    xb, yb = _batch(rng, normal_tr, faults_tr, window, batch)
    xt = torch.from_numpy(xb)
    xt = xt + noise * torch.randn_like(xt)
    C = model.cfg.n_classes
    loss = F.cross_entropy(model(xt).reshape(-1, C), torch.from_numpy(yb).reshape(-1), weight=weight)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def _train_fixed(model, normal_tr, faults_tr, window, steps, batch, lr, noise, rng, weight):
    t0 = time.time()
    opt = _optimizer(model, lr)
    model.train()
    for _ in range(steps):
        _step(model, opt, rng, normal_tr, faults_tr, window, batch, noise, weight)
    model.eval()
    return {"steps": steps, "seconds": round(time.time() - t0, 1)}


# ---- the normal-operation monitor (T^2 on the plant's own principal components) --------------------

CHANNEL_FRAMES = 16     # frames over which the channel gates read each channel (at most the window)
STILL_RATIO = 0.05      # "still": moving less than this fraction of the least a channel moved in normal data
SCALE_FLOOR = 0.1       # a channel's spread / level scale is at least this (normalised units)


def channel_limits(parts, frames: int) -> dict:
    """From normalised normal data (one array per run or piece: no stretch crosses from one to the
    next), per channel over every `frames` consecutive samples: the still gate's limit (STILL_RATIO x
    its smallest standard deviation; 0, no gate, for a channel that stood still somewhere), the
    spread gate's scale (its largest standard deviation) and the level gate's (its largest |mean|),
    scales at least SCALE_FLOOR."""
    from numpy.lib.stride_tricks import sliding_window_view

    parts = [np.asarray(P, np.float64) for P in parts]
    c = parts[0].shape[1]
    parts = [P for P in parts if len(P) >= frames]
    if frames < 2 or not parts:
        return {"still_std": np.zeros(c), "spread_scale": np.ones(c), "level_scale": np.ones(c)}
    w = [sliding_window_view(P, frames, axis=0) for P in parts]
    sd = np.concatenate([v.std(-1) for v in w])
    level = np.abs(np.concatenate([v.mean(-1) for v in w]))
    least = sd.min(0)
    return {"still_std": np.where(least > 1e-6, STILL_RATIO * least, 0.0),
            "spread_scale": np.maximum(sd.max(0), SCALE_FLOOR),
            "level_scale": np.maximum(level.max(0), SCALE_FLOOR)}


def fit_monitor(Z, variance: float = 0.90, alpha: float = 0.99, steepness: float = 10.0,
                q_frames: int = 1, channel_frames: int = 0) -> dict:
    """Hotelling T^2 on the principal components of normalised normal data, with its F-distribution
    limit. The detector turns it into an anomaly probability a = sigmoid(steepness * (T^2/limit - 1))
    and scales P(normal) by (1 - a): what is far from this plant's normal operation raises the score
    even where the classifier has never seen anything like it (see runtime.Detector.probs). Q (the
    residual off the components) is measured in units of its mean on Z (`q_scale`, the residual
    eigenvalues' sum), over the last `q_frames` frames of a window; its gate stays off until the
    calibration sets `q_limit`. With `channel_frames`, the channel gates' per-channel limits and scales
    (channel_limits; off until the calibration sets `still_gate`, `spread_limit`, `level_limit`).
    Z: normalised normal data, one array or a list of runs (or pieces) that the channel limits read
    one by one."""
    from scipy import stats

    parts = [Z] if isinstance(Z, np.ndarray) else list(Z)
    Z = np.concatenate([np.asarray(P, np.float64) for P in parts])
    n, c = Z.shape
    Zc = Z - Z.mean(0)
    w, V = np.linalg.eigh(Zc.T @ Zc / (n - 1))
    order = np.argsort(w)[::-1]
    w, V = np.clip(w[order], 1e-9, None), V[:, order]
    k = int(np.searchsorted(np.cumsum(w) / w.sum(), variance) + 1)
    k = max(1, min(k, c, n - 2))
    limit = k * (n - 1) * (n + 1) / (n * (n - k)) * stats.f.ppf(alpha, k, n - k)
    return {"kind": "t2", "center": Z.mean(0).astype(np.float32).tolist(),
            "components": V[:, :k].astype(np.float32).tolist(), "inv_var": (1.0 / w[:k]).astype(np.float32).tolist(),
            "limit": float(limit), "steepness": float(steepness), "variance": variance, "alpha": alpha,
            "samples": int(n), "q_scale": float(max(w[k:].sum(), 1e-9)), "q_frames": int(q_frames),
            "q_limit": None, "channel_frames": int(channel_frames), "still_gate": False, "spread_limit": None,
            "level_limit": None,
            **{k: np.asarray(v, np.float32).tolist() for k, v in channel_limits(parts, channel_frames).items()}}


def observable(Z_fault: np.ndarray, Z_normal_val: np.ndarray, mon: dict, q_pca) -> tuple:
    """Is a fault class visible in the measurements at all? Its file's rate of PCA T^2-or-Q alarms
    (99 % limits, normal training data) against the held-out normal data's rate: a class within
    0.15 of it cannot be told from normal operation (TEP's faults 3, 9, 15 are the known cases)."""
    a_f = q_pca.alarms(Z_fault)["t2_or_q"].mean()
    a_n = q_pca.alarms(Z_normal_val)["t2_or_q"].mean()
    return bool(a_f > a_n + 0.15), float(a_f), float(a_n)


# ---- the whole fit ---------------------------------------------------------------------------------

def fit(normal_files, fault_files=(), label_specs=(), far: float = 0.02, window: int = 32,
        out=None, force: bool = False, max_steps: int = 3000, seed: int = 0, threads: int = 2,
        allow_constant: bool = False, log=print) -> dict:
    """Fit a sensor bundle to a plant (see the module docstring). Returns the manifest."""
    from zeroedge.sensor.pca import PCAMonitor

    t_start = time.time()
    if not 0 < far < 0.5:
        raise UserError(f"--far {far}: must be in (0, 0.5)")
    if window < 4 or window > 512:
        raise UserError(f"--window {window}: must be in 4..512")
    out = Path(out)
    if out.exists() and not force:
        raise UserError(f"{out} exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a folder")
    normal, faults = load_inputs(normal_files, fault_files, label_specs, window)

    # split: the tail of every file is held out
    n_tr, n_val = [], []
    for r in normal:
        c = split_point(len(r.data), window)
        n_tr.append(r.data[:c])
        n_val.append(r.data[c:])
    mean, std = norm_stats_checked(np.concatenate(n_tr), normal, allow_constant)

    def nz(X):
        return np.clip((X - mean) / std, -50, 50).astype(np.float32)

    Zn_tr, Zn_val = [nz(X) for X in n_tr], [nz(X) for X in n_val]
    Zall_tr = np.concatenate(Zn_tr)
    runs = _split_faults(faults, nz, np.concatenate(Zn_val), fit_monitor(Zall_tr), PCAMonitor().fit(Zall_tr),
                         window, log)
    runs.split["normal"] = [{"file": str(r.path), "train": [0, len(a)], "held_out": [len(a), len(r.data)]}
                            for r, a in zip(normal, n_tr)]
    log(f"[sensor-fit] normalisation from {len(Zall_tr)} normal samples; {sum(map(len, Zn_val))} held out; "
        f"{len(runs.f_tr)} fault files to learn from" + (f", {len(runs.unobs)} unobservable" if runs.unobs else ""))

    import torch                            # after the inputs are checked: a bad one fails fast

    model = _shipped_model(window)
    torch.set_num_threads(threads)
    train_info = None
    if runs.f_tr:
        train_info = train_detector(model, Zn_tr + [a for a, _ in runs.extra_normal], runs.f_tr,
                                    Zn_val + [b for _, b in runs.extra_normal], runs.f_val, window,
                                    max_steps=max_steps, seed=seed, threads=threads, log=log)
    # the alarm, calibrated on out-of-fold scores: models fitted without a block of every file score it
    steps = train_info["best_step"] if train_info else 0
    # (fault runs that cannot be told from normal operation count as normal runs here too: they
    # are the other runs of the plant that the fit has, so they stand for the runs it has not)
    scores = fold_scores([r.data for r in normal] + [r.data for r in faults if r.label in runs.unobs],
                         [(r.data, r.label) for r in faults if r.label not in runs.unobs], window, steps,
                         seed=seed, threads=threads, log=log)
    alarm, per_class = _calibrate_alarm(scores, window, far, log, [str(r.path) for r in normal]
                                        + [str(r.path) for r in faults if r.label in runs.unobs])
    # the bundle's monitor is fitted as the folds' were: on every normal run and every run that
    # cannot be told from one (the fold monitors saw all of them but the held-out one)
    mon = fit_monitor([nz(r.data) for r in normal] + [nz(r.data) for r in faults if r.label in runs.unobs],
                      q_frames=window, channel_frames=min(CHANNEL_FRAMES, window))
    for k in ("q_limit", "still_gate", "spread_limit", "level_limit"):
        mon[k] = alarm[k]
    provenance = {
        "tool": "zeroedge sensor-fit", "started_from": "shipped weights (zeroedge/data/tep_sensor.npz), "
        + ("fine-tuned" if train_info else "not trained (normal data only: an anomaly detector)"),
        "normal_files": [{"file": str(r.path), "sha256": r.sha256, "samples": len(r.data)} for r in normal],
        "fault_files": [{"file": str(r.path), "sha256": r.sha256, "samples": len(r.data),
                         "class": CLASS_NAMES[r.label]} for r in faults],
        "unobservable_classes": [CLASS_NAMES[k] for k in runs.unobs], "split": runs.split, "train": train_info,
        "validation": {"far": alarm["val_far"], "far_evidence": alarm["val_far_evidence"], "fdr": alarm["val_fdr"],
                       "per_class": per_class},
        "far_target": far, "window": window, "seconds": None}
    meta = {"config": model.cfg.to_dict(), "window": window, "channels": N_CHANNELS,
            "class_names": list(CLASS_NAMES), "hard_faults": list(runs.unobs),
            "normalisation": {"mean": mean.tolist(), "std": std.tolist(),
                              "fitted_on": ", ".join(str(r.path) for r in normal) + " (training part)"},
            "alarm": alarm, "monitor": mon, "profile": normal_profile(np.concatenate(Zn_tr + Zn_val), window),
            "fit": provenance}
    return _write(out, model, meta, provenance, t_start, log)


def _shipped_model(window: int):
    from dataclasses import replace

    from zeroedge.sensor.train import SHIPPED, load_model

    model, _ = load_model(SHIPPED)
    if model.cfg.window != window:
        model.cfg = replace(model.cfg, window=window)
    return model


FOLDS = 4
GAP_ALPHA = min(ALPHAS)          # the gap between training and held-out blocks covers the slowest EMA


def ema_memory(alpha: float) -> int:
    """Samples after which a reading's weight in the EMA has fallen below 1 %."""
    return 0 if alpha >= 1 else int(np.ceil(np.log(0.01) / np.log(1 - alpha)))


def fold_blocks(n: int, j: int, gap: int, folds: int = FOLDS) -> tuple:
    """Fold j over a stretch of n samples: (held-out block (a, b), training pieces), the pieces
    `gap` samples clear of the block on either side."""
    a, b = round(j * n / folds), round((j + 1) * n / folds)
    return (a, b), [(s, e) for s, e in ((0, a - gap), (b + gap, n)) if e - s > 0]


def fold_gap(window: int) -> int:
    return window + ema_memory(GAP_ALPHA)


def folds_can_train(lengths, window: int) -> bool:
    """Does every fold keep at least 2 windows of normal training data (in pieces of a window or more)?
    Several runs are held out whole (see fold_scores): the others, 2 windows each at least, train."""
    if len(lengths) >= 2:
        return all(n >= 2 * window for n in lengths)
    gap = fold_gap(window)
    return all(sum(e - s for n in lengths for s, e in fold_blocks(n, j, gap)[1] if e - s >= window) >= 2 * window
               for j in range(FOLDS))


@dataclass
class FoldScores:
    """Out-of-fold scores: every held-out block scored by a model that never saw it nor the `gap`
    samples around it. normal: 1 - P(normal) per held-out normal block; faults: (class, (T, classes)
    probabilities, onset) for each held-out fault block after a held-out normal block; normal_q,
    fault_q: the window Q of the same samples (runtime.run_q, the fold monitor's units); normal_channels,
    fault_channels: their runtime.ChannelStats by the fold monitor (runtime.run_channel_stats)."""
    normal: list
    faults: list
    folds: int
    gap: int
    whole_runs: bool = False        # normal runs held out whole (else blocks of the one normal run)
    normal_q: list = None
    fault_q: list = None
    normal_run: list = None         # which of the normal runs each held-out normal block comes from
    normal_channels: list = None
    fault_channels: list = None


def fold_scores(normal_raw, fault_raw, window: int, steps: int, *, seed: int = 0, threads: int = 2,
                folds: int = FOLDS, log=print) -> FoldScores:
    """Blocked, rotated validation imitating a run the fit never saw: for each fold a detector
    (normalisation, monitor, `steps` fine-tuning steps from the shipped weights) fitted on the files
    without their fold block and its gap, scoring that block through the runtime's own path. Normal
    runs are held out whole when there are several (one per fold in turn), in blocks when there is
    one; fault files always in blocks."""
    from zeroedge.sensor.runtime import ChannelStats, Detector, TorchBackend, evaluate_scores, run_channel_stats, run_q

    gap = fold_gap(window)
    whole = len(normal_raw) >= 2               # several normal runs: each is held out whole in one fold
    out = FoldScores([], [], folds, gap, whole, [], [], [], [], [])
    t0 = time.time()
    for j in range(folds):
        def pieces(X):
            return fold_blocks(len(X), j, gap, folds)

        def normal_pieces(i, X):
            if not whole:
                return pieces(X)
            return ((0, len(X)), []) if i % folds == j else (None, [(0, len(X))])

        n_tr = [X[s:e] for i, X in enumerate(normal_raw) for s, e in normal_pieces(i, X)[1] if e - s >= window]
        f_tr = [(X[s:e], k) for X, k in fault_raw for s, e in pieces(X)[1] if e - s >= window]
        mean, std = norm_stats_checked(np.concatenate(n_tr), [], allow_constant=True)
        model = _shipped_model(window)
        if steps and f_tr:
            nz = lambda X: np.clip((X - mean) / std, -50, 50).astype(np.float32)  # noqa: E731
            train_detector(model, [nz(X) for X in n_tr], [(nz(X), k) for X, k in f_tr],
                           [], [], window, max_steps=steps, seed=seed + 1 + j, threads=threads)
        mon = fit_monitor([np.clip((X - mean) / std, -50, 50) for X in n_tr], q_frames=window,
                          channel_frames=min(CHANNEL_FRAMES, window))
        det = Detector({"window": window, "channels": N_CHANNELS, "class_names": list(CLASS_NAMES),
                        "normalisation": {"mean": mean.tolist(), "std": std.tolist()},
                        "alarm": {"ema_alpha": 1.0, "threshold": 0.5}, "monitor": mon},
                       TorchBackend(model))

        def q_of(X):
            return run_q(mon, det.normalise(X))

        def channels_of(X, skip=0, joined=None):
            """ChannelStats from sample `skip` on; where a channel stretch crosses `joined` (a normal
            prefix put before a fault block: a step no run shows), the gates read nothing."""
            st = run_channel_stats(mon, det.normalise(X))
            if joined is not None:
                cut = joined + mon["channel_frames"] - 1
                st.still[:cut], st.spread[:cut], st.level[:cut] = False, 0.0, 0.0
            return ChannelStats(st.still[skip:], st.spread[skip:], st.level[skip:])

        held = []
        for i, X in enumerate(normal_raw):             # the block, scored with the window before it as context
            block = normal_pieces(i, X)[0]
            if block is not None:
                a, b = block
                c = max(0, a - window + 1)
                out.normal.append(evaluate_scores(det, X[c:b])[a - c:])
                out.normal_q.append(q_of(X[c:b])[a - c:])
                out.normal_channels.append(channels_of(X[c:b], a - c))
                out.normal_run.append(i)
                held.append(X[a:b])
        prefix = held[0][-2 * window:] if held else normal_raw[0][-2 * window:]
        for X, k in fault_raw:
            (a, b), _ = pieces(X)
            Xb = np.concatenate([prefix, X[a:b]])
            out.faults.append((k, evaluate_scores(det, Xb, probs=True), len(prefix)))
            out.fault_q.append(q_of(Xb))
            out.fault_channels.append(channels_of(Xb, joined=len(prefix)))
        log(f"[sensor-fit] fold {j + 1}/{folds}: {steps} steps, held-out blocks scored ({time.time() - t0:.0f}s)")
    return out


@dataclass
class _FaultRuns:
    """The fault files split for training: observable ones (train / held-out parts for early
    stopping), unobservable ones as extra normal data."""
    f_tr: list
    f_val: list
    extra_normal: list
    unobs: list
    split: dict


def _split_faults(faults, nz, Zval_all, mon, pca, window: int, log) -> _FaultRuns:
    runs = _FaultRuns([], [], [], [], {"held_out_fraction": VAL_FRAC, "normal": [], "faults": []})
    for r in faults:
        c = split_point(len(r.data), window)
        Z = nz(r.data)
        ok, rate, rate_n = observable(Z, Zval_all, mon, pca)
        runs.split["faults"].append({"file": str(r.path), "class": CLASS_NAMES[r.label], "train": [0, c],
                                     "held_out": [c, len(r.data)], "pca_alarm_rate": round(rate, 4),
                                     "observable": ok})
        if ok:
            runs.f_tr.append((Z[:c], r.label))
            runs.f_val.append((Z[c:], r.label))
        else:
            runs.unobs.append(r.label)
            runs.extra_normal.append((Z[:c], Z[c:]))
            log(f"[sensor-fit] {r.path}: {CLASS_NAMES[r.label]} cannot be told from normal operation "
                f"(PCA alarm rate {rate:.2f} vs {rate_n:.2f} on held-out normal data): its windows train "
                f"the normal class")
    return runs


def far_evidence(alarmed, window: int, alpha: float, far: float, level: float = 0.95) -> dict:
    """What held-out normal data can say about the false-alarm rate: the smoothed alarm of nearby
    samples is one decision (a window plus the EMA's memory apart), so n samples are only about
    n / (window + memory) independent trials. With k of those blocks alarmed, the one-sided
    Clopper-Pearson bound at `level`; the data support the target only when that bound is at or
    below it. `alarmed`: one boolean array per held-out normal stretch."""
    span = window + ema_memory(alpha)
    blocks = [a[i:i + span] for a in alarmed for i in range(0, len(a) - span + 1, span)]
    n, k = len(blocks), int(sum(bool(b.any()) for b in blocks))
    upper = 1.0 if n == 0 else _binomial_upper(k, n, 1 - level)
    return {"independent_blocks": n, "block_samples": span, "alarmed_blocks": k,
            "far_upper": round(upper, 4), "level": level, "supported": upper <= far}


def _binomial_upper(k: int, n: int, tail: float) -> float:
    """The p at which P(X <= k | n, p) = tail (bisection on the binomial CDF)."""
    from math import comb

    if k >= n:
        return 1.0
    lo, hi = k / n, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        cdf = sum(comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))
        lo, hi = (p, hi) if cdf > tail else (lo, p)
    return hi


def choose_threshold(normal_scores: np.ndarray, far: float) -> float:
    """Threshold on smoothed out-of-fold normal scores for a false-alarm rate `far`: the larger of
    their empirical (1 - far) quantile and a Gaussian fit of their log-odds (mean + z(1 - far) * std),
    the latter guarding the tail when there are few blocks."""
    from statistics import NormalDist

    lo = _logit(normal_scores)
    z = NormalDist().inv_cdf(1 - far)
    t = float(lo.mean() + z * lo.std(ddof=1)) if len(lo) > 1 else float(lo.max())
    t = max(t, float(np.quantile(lo, 1 - far, method="higher")))
    return float(1 / (1 + np.exp(-t)))


# parts of the FAR budget the Q, spread and level gates may take (0: gate off); together a quarter at most
GATE_SHARES = tuple((q, sp, lv) for q, sp, lv in
                    [(0, 0, 0), (0.25, 0, 0), (0, 0.25, 0), (0, 0, 0.25), (0.125, 0.125, 0), (0.125, 0, 0.125),
                     (0, 0.125, 0.125), (1 / 12, 1 / 12, 1 / 12)])


def _calibrate_alarm(scores: FoldScores, window: int, far: float, log, run_names=None) -> tuple:
    """The alarm on out-of-fold scores. For the still gate off and on, each split of the FAR budget
    between the Q, spread and level gates (GATE_SHARES; a gate's limit: that quantile of the held-out
    normal samples' window Q, spread or level) and each EMA alpha, the threshold for the target FAR on
    the held-out normal blocks with the gates in (their raised samples count as alarms); kept: the
    setting with the best held-out FDR on the fault blocks (each after a normal block), a gate only
    where it adds to it. Returns (alarm, per-class FDR and predicted fault); a gate's limit is None
    when it does not help; alarm["val_far_runs"]: the out-of-fold FAR of each held-out normal run
    (`run_names`, in the order fold_scores got them)."""
    from zeroedge.sensor.runtime import channel_gates

    held = {"q": np.concatenate(scores.normal_q),
            "spread": np.concatenate([c.spread for c in scores.normal_channels]),
            "level": np.concatenate([c.level for c in scores.normal_channels])}

    def limit(name, share):
        return float(np.quantile(held[name], 1 - share * far, method="higher")) if share else None

    best = None
    for still in (False, True):
        for shares in GATE_SHARES:
            named = list(zip(("q", "spread", "level"), shares))
            gates = {"still_gate": still, **{f"{n}_limit": limit(n, sh) for n, sh in named},
                     **{f"{n}_share": sh for n, sh in named}}

            def gated(x, q, st):                 # the score, 1 where a gate is raised (as the runtime has it)
                up = np.zeros(len(x), bool) if gates["q_limit"] is None else q > gates["q_limit"]
                return np.where(channel_gates(gates, st, up), np.float32(1.0), x)

            nsc = [gated(x, q, c) for x, q, c in zip(scores.normal, scores.normal_q, scores.normal_channels)]
            fsc = [(k, gated(1 - P[:, 0], q, c), o)
                   for (k, P, o), q, c in zip(scores.faults, scores.fault_q, scores.fault_channels)]
            for alpha in ALPHAS:
                sm = [ema(x, alpha) for x in nsc]
                thr = choose_threshold(np.concatenate(sm), far)
                fdrs = [float((ema(x, alpha)[o:] > thr).mean()) for k, x, o in fsc]
                fdr = float(np.mean(fdrs)) if fdrs else 0.0
                if best is None or fdr > best[0] + 1e-9:
                    best = (fdr, alpha, thr, float(np.mean(np.concatenate(sm) > thr)), sm, fsc, gates)
    val_fdr, alpha, thr, val_far, sm, fsc, gates = best
    per_class = {}
    for k in sorted({k for k, _, _ in scores.faults}):
        post = np.concatenate([(ema(x, alpha) > thr)[o:] for kk, x, o in fsc if kk == k])
        guess = np.concatenate([np.argmax(P[o:, 1:], 1) + 1 for kk, P, o in scores.faults if kk == k])
        pred = int(np.bincount(guess[post], minlength=len(CLASS_NAMES)).argmax()) if post.any() else 0
        per_class[CLASS_NAMES[k]] = {"fdr": round(float(post.mean()), 4), "predicted": CLASS_NAMES[pred]}
    evidence = far_evidence([x > thr for x in sm], window, alpha, far)
    by_run = {}
    for i, x in zip(scores.normal_run or [0] * len(sm), sm):
        by_run.setdefault(i, []).append(x > thr)
    names = run_names or [f"normal run {i + 1}" for i in range(max(by_run, default=0) + 1)]
    far_runs = {names[i]: round(float(np.concatenate(v).mean()), 5) for i, v in sorted(by_run.items())}
    alarm = {"ema_alpha": alpha, "threshold": thr, "far_target": far, "val_far": round(val_far, 5),
             "val_far_evidence": evidence, "val_fdr": round(val_fdr, 5) if scores.faults else None,
             **gates, "val_far_runs": far_runs,
             "validation": {"kind": "blocked folds", "folds": scores.folds, "gap_samples": scores.gap,
                            "normal_held_out": "whole runs" if scores.whole_runs else "blocks",
                            "normal_samples": int(sum(map(len, scores.normal)))},
             "rule": "out-of-fold scores of blocked folds; Q, spread and level gates: the (1 - share * far) "
                     "quantile of the held-out normal samples' window Q / spread / level; still gate: a channel "
                     "that always moved in normal data held still; threshold: the larger of the (1 - far) "
                     "quantile and a Gaussian fit of the smoothed log-odds of held-out normal scores, gates in; "
                     "gates and alpha: best held-out FDR"}
    log(f"[sensor-fit] alarm: EMA alpha {alpha}, threshold {thr:.6f}"
        + ("" if gates["q_limit"] is None else
           f", Q gate at {gates['q_limit']:.3f} (window mean, {gates['q_share']:g} of the FAR budget)")
        + "".join(f", {n} gate at {gates[n + '_limit']:.3f} ({gates[n + '_share']:.3g} of the FAR budget)"
                  for n in ("spread", "level") if gates[n + "_limit"] is not None)
        + (", still gate on" if gates["still_gate"] else "")
        + f"; out-of-fold FAR {val_far:.3f}"
        + (f", FDR {val_fdr:.3f} over {len(scores.faults)} fault blocks" if scores.faults else ""))
    if not evidence["supported"]:
        log(f"[sensor-fit] warning: the held-out normal data are {evidence['independent_blocks']} independent "
            f"alarm blocks of {evidence['block_samples']} samples; they bound the FAR only below "
            f"{evidence['far_upper']:.3f} (95 %), not the {far} target: give more normal data")
    return alarm, per_class


def _write(out: Path, model, meta: dict, provenance: dict, t_start: float, log) -> dict:
    """The bundle, through the shipped detector's exporter (weights in a temporary file beside it)."""
    from zeroedge.sensor.train import export_bundle, save_model

    tmp_w = out.with_name(out.name + ".weights.tmp.npz")
    try:
        provenance["seconds"] = round(time.time() - t_start, 1)
        save_model(tmp_w, model, meta)
        man = export_bundle(out, tmp_w)
    finally:
        if tmp_w.exists():
            tmp_w.unlink()
    log(f"[sensor-fit] wrote {out} in {time.time() - t_start:.0f}s")
    return man
