"""Torch-free sensor inference: the one code path shared by `zeroedge daemon` and
`zeroedge sensor-eval`.

- `load_bundle(dir)` verifies a *sensor bundle* (zeroedge.bundle manifest with "kind": "sensor")
  and returns a `Detector` on onnxruntime; `Detector.from_checkpoint(...)` gives the torch backend
  (development only; imports torch).
- `Detector.probs(windows)` normalises raw 52-channel frames with the bundle's normal-operation
  statistics and returns class probabilities at the last frame of each window.
- `StreamState` is the bounded per-stream state: a ring of the last `window` frames plus the alarm
  filter; `Engine` feeds readings through stream states and the detector in batches and returns
  result records. The daemon persists and restores `StreamState` through its spool.

Alarm rule: score = 1 - P(normal); s = EMA(score, alpha); the alarm is raised while s > threshold.
Both numbers come from the bundle (chosen on validation runs for a target false-alarm rate).

Bundles made by `zeroedge sensor-fit` also carry a `monitor` (Hotelling T^2 on the plant's own
principal components): P(normal) is scaled by 1 - sigmoid(steepness * (T^2/limit - 1)) of the last
frame, so data far from the plant's normal operation alarm even where the classifier has never seen
anything like them. With a `q_limit`, the monitor also gates on Q (the squared residual off those
components) averaged over the last `q_frames` frames of the window, in units of its mean on the fit
data (`q_scale`): above the limit, P(normal) is 0 (the limit is set beside the threshold on out-of-
fold scores; slow drifts show there before the classifier is sure). Three more gates read each
channel alone over the last `channel_frames` frames of the window: with `still_gate`, a channel that
moved in every such stretch of the fit's normal data and now stands still (its standard deviation
below `still_std`, a small fraction of its least there: a valve stuck where it was, a frozen sensor,
a held value); with a `spread_limit`, a channel that moves more than it did there (its standard
deviation over `spread_scale`, its most there: an oscillating loop, a noisy sensor); with a
`level_limit`, a channel that sits further from its normal mean than it did there (its mean over
`level_scale`, the largest such mean there: a small offset that lasts, which one frame's T^2 or Q
does not show). And a `profile` of their normal data, which `drift_check` compares a stream's first
window with (the warning of `sensor-eval` and the daemon).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from zeroedge.errors import UserError

CLIP = 50.0    # normalised values are clipped to +-CLIP (a broken sensor cannot blow up the model)


class OrtBackend:
    name = "onnxruntime"

    def __init__(self, onnx_path: Path, threads: int = 1):
        from zeroedge.errors import require

        ort = require("onnxruntime", "daemon")
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        self.sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
        self.input = self.sess.get_inputs()[0].name

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.sess.run(None, {self.input: x})[0]


class TorchBackend:
    name = "torch"

    def __init__(self, model, zero: bool = True):
        import torch

        self.torch = torch
        self.model = model.eval()
        self.zero = zero

    def __call__(self, x: np.ndarray) -> np.ndarray:
        with self.torch.inference_mode():
            x = self.torch.from_numpy(x)
            logits = self.model.forward_last(x) if self.zero else self.model(x)[:, -1]
            return logits.softmax(-1).numpy()


class Detector:
    def __init__(self, meta: dict, backend, bundle: Optional[Path] = None):
        self.meta = meta
        self.backend = backend
        self.bundle = bundle
        self.window = int(meta["window"])
        self.channels = int(meta["channels"])
        self.class_names = list(meta["class_names"])
        norm = meta["normalisation"]
        self.mean = np.asarray(norm["mean"], np.float32)
        self.inv_std = (1.0 / np.asarray(norm["std"], np.float32)).astype(np.float32)
        alarm = meta["alarm"]
        self.threshold = float(alarm["threshold"])
        self.alpha = float(alarm["ema_alpha"])
        self.monitor = _monitor_arrays(meta.get("monitor"))
        self.profile = meta.get("profile")

    @classmethod
    def from_checkpoint(cls, path: Path) -> "Detector":
        """Torch backend from a training checkpoint (.npz weights + meta)."""
        from zeroedge.sensor.train import load_model

        model, meta = load_model(path)
        return cls(meta, TorchBackend(model))

    def normalise(self, frames: np.ndarray) -> np.ndarray:
        z = (np.asarray(frames, np.float32) - self.mean) * self.inv_std
        return np.clip(z, -CLIP, CLIP, out=z)

    def probs(self, windows: np.ndarray) -> np.ndarray:
        """windows: (B, T, channels) raw frames, T <= window -> (B, n_classes) probabilities."""
        z = np.ascontiguousarray(self.normalise(windows), dtype=np.float32)
        p = self.backend(z)
        if self.monitor is not None:
            p = apply_monitor(self.monitor, p, z[:, -1], gates_raised(self.monitor, z))
        return p

    def drift_check(self, frames: np.ndarray) -> Optional[str]:
        """None if the frames (a stream's first window, raw) look like the normal operation the
        bundle was fitted on; else one sentence saying which channel is how far out.

        Per channel, the mean of the normalised frames is compared with the largest window mean seen
        in the fit data's normal operation (bundles from sensor-fit record it; for others 1.5 is
        assumed): beyond max(4, 2 x that) standard deviations is "unlike the fit data"."""
        z = self.normalise(frames)
        if len(z) == 0:
            return None
        m = np.abs(z.mean(0))
        spread = np.asarray((self.profile or {}).get("max_abs_window_mean") or [1.5] * self.channels, np.float32)
        limit = np.maximum(4.0, 2.0 * spread)
        over = m / limit
        c = int(np.argmax(over))
        if over[c] <= 1.0:
            return None
        n_out = int((over > 1.0).sum())
        name = f"XMEAS({c + 1})" if c < 41 and self.channels == 52 else (
            f"XMV({c - 40})" if self.channels == 52 else f"column {c + 1}")
        return (f"the first {len(z)} samples do not look like the normal operation this bundle was fitted "
                f"on: {name} (column {c + 1}) averages {m[c]:.1f} standard deviations from the fit data's "
                f"mean ({n_out} of {self.channels} channels beyond their limit); expect false alarms: fit "
                f"the detector to this plant with `zeroedge sensor-fit`")


def _monitor_arrays(mon):
    if not mon:
        return None
    V = np.asarray(mon["components"], np.float32)
    w, E = np.linalg.eigh(np.eye(len(V)) - V.astype(np.float64) @ V.T.astype(np.float64))
    return {"center": np.asarray(mon["center"], np.float32), "components": V,
            "residual": np.ascontiguousarray(E[:, w > 0.5], np.float32),   # a basis of what the components leave (Q)
            "inv_var": np.asarray(mon["inv_var"], np.float32), "limit": float(mon["limit"]),
            "steepness": float(mon["steepness"]),
            "q_limit": None if mon.get("q_limit") is None else float(mon["q_limit"]),
            "q_scale": float(mon.get("q_scale") or 1.0), "q_frames": int(mon.get("q_frames") or 1),
            "channel_frames": int(mon.get("channel_frames") or 0), "still_gate": bool(mon.get("still_gate")),
            **_channel_arrays(mon, len(V)),
            **{k: None if mon.get(k) is None else float(mon[k]) for k in ("spread_limit", "level_limit")}}


def _channel_arrays(mon, channels: int) -> dict:
    """The channel gates' limits in the form _stats compares with: variances (a still limit of 0, no
    gate, becomes -1) and reciprocal scales."""
    still = np.asarray(mon.get("still_std") or [0.0] * channels, np.float64)
    spread = np.asarray(mon.get("spread_scale") or [1.0] * channels, np.float64)
    level = np.asarray(mon.get("level_scale") or [1.0] * channels, np.float64)
    return {"still_var": np.where(still > 0, still * still, -1.0).astype(np.float32),
            "inv_spread_var": (1.0 / (spread * spread)).astype(np.float32),
            "inv_level": (1.0 / level).astype(np.float32)}


def _arrays(mon):
    """The monitor's arrays (a Detector converts its bundle's monitor section once)."""
    return mon if "residual" in mon else _monitor_arrays(mon)


def monitor_t2(mon, z: np.ndarray) -> np.ndarray:
    """Hotelling T^2 of normalised frames (N, channels) on the monitor's components."""
    mon = _arrays(mon)
    t = (np.asarray(z, np.float32) - mon["center"]) @ mon["components"]
    return (t * t) @ mon["inv_var"]


def monitor_q(mon, z: np.ndarray) -> np.ndarray:
    """Q of normalised frames (..., channels): the squared residual off the monitor's components,
    in units of `q_scale` (its mean on the fit data)."""
    mon = _arrays(mon)
    r = (np.asarray(z, np.float32) - mon["center"]) @ mon["residual"]
    return np.square(r).sum(-1) / mon["q_scale"]


def window_q(mon, z: np.ndarray) -> np.ndarray:
    """Windows (B, T, channels) of normalised frames -> (B,) mean Q over their last q_frames frames."""
    mon = _arrays(mon)
    r = (z[:, -mon["q_frames"]:] - mon["center"]) @ mon["residual"]          # (B, frames, residual dims)
    return np.square(r).sum((1, 2)) / (r.shape[1] * mon["q_scale"])


def run_q(mon, z: np.ndarray) -> np.ndarray:
    """The same for every sample of a run (T, channels), each with the frames before it as its window
    (a fresh stream's first windows are shorter): what `window_q` gives the daemon, sample by sample."""
    mon = _arrays(mon)
    q = monitor_q(mon, z).astype(np.float64)
    c = np.concatenate([[0.0], np.cumsum(q)])
    i = np.arange(len(q))
    lo = np.maximum(0, i - mon["q_frames"] + 1)
    return (c[i + 1] - c[lo]) / (i + 1 - lo)


@dataclass
class ChannelStats:
    """Per window (or sample), what the channel gates read: `still`, some channel that moved in every
    stretch of the fit's normal data (still_std > 0) moved less than still_std; `spread`, the largest
    standard deviation of a channel in units of its most in the normal data (spread_scale); `level`,
    the largest |mean| of a channel in units of its largest in the normal data (level_scale)."""
    still: np.ndarray
    spread: np.ndarray
    level: np.ndarray

    @classmethod
    def empty(cls, n: int) -> "ChannelStats":
        return cls(np.zeros(n, bool), np.zeros(n), np.zeros(n))


def _stats(mon, frames: np.ndarray) -> ChannelStats:
    """frames (N, channel_frames, channels) of normalised data -> their ChannelStats (few numpy calls:
    the daemon runs this for every reading)."""
    avg = np.full(frames.shape[1], 1.0 / frames.shape[1], frames.dtype)
    mean = avg @ frames
    d = frames - mean[:, None, :]
    var = avg @ (d * d)
    return ChannelStats((var < mon["still_var"]).any(1), np.sqrt((var * mon["inv_spread_var"]).max(1)),
                        (np.abs(mean) * mon["inv_level"]).max(1))


def window_channel_stats(mon, z: np.ndarray) -> ChannelStats:
    """Windows (B, T, channels) of normalised frames -> ChannelStats of their last channel_frames
    frames. A window shorter than that (a fresh stream) reads as nothing (not still, 0, 0)."""
    mon = _arrays(mon)
    n = mon["channel_frames"]
    if not n or z.shape[1] < n:
        return ChannelStats.empty(len(z))
    return _stats(mon, z[:, -n:])


def run_channel_stats(mon, z: np.ndarray) -> ChannelStats:
    """The same for every sample of a run (T, channels), each with the frames before it as its window."""
    from numpy.lib.stride_tricks import sliding_window_view

    mon = _arrays(mon)
    n = mon["channel_frames"]
    out = ChannelStats.empty(len(z))
    if n and len(z) >= n:
        frames = sliding_window_view(np.asarray(z, np.float32), n, axis=0).transpose(0, 2, 1)
        got = _stats(mon, frames)
        for k in ("still", "spread", "level"):
            getattr(out, k)[n - 1:] = getattr(got, k)
    return out


def channel_gates(mon, st: ChannelStats, raised: np.ndarray) -> np.ndarray:
    """`raised` or where a kept channel gate is raised."""
    if mon["still_gate"]:
        raised = raised | st.still
    if mon["spread_limit"] is not None:
        raised = raised | (st.spread > mon["spread_limit"])
    if mon["level_limit"] is not None:
        raised = raised | (st.level > mon["level_limit"])
    return raised


def gates_raised(mon, z: np.ndarray) -> Optional[np.ndarray]:
    """Windows (B, T, channels) -> (B,) bool where a gate is raised (window Q above q_limit, or a
    channel gate); None when the monitor keeps no gate."""
    mon = _arrays(mon)
    channel = mon["still_gate"] or mon["spread_limit"] is not None or mon["level_limit"] is not None
    if mon["q_limit"] is None and not channel:
        return None
    raised = np.zeros(len(z), bool) if mon["q_limit"] is None else window_q(mon, z) > mon["q_limit"]
    return channel_gates(mon, window_channel_stats(mon, z), raised) if channel else raised


def apply_monitor(mon, p: np.ndarray, z_last: np.ndarray, raised: Optional[np.ndarray] = None) -> np.ndarray:
    """Scale P(normal) by 1 - a, a = sigmoid(steepness * (T^2 / limit - 1)), and a = 1 where a gate
    is raised (`raised`, see gates_raised); the fault classes share the rest in their own
    proportions (argmax unchanged)."""
    t2 = monitor_t2(mon, z_last).astype(np.float64)
    x = np.clip(mon["steepness"] * (t2 / mon["limit"] - 1.0), -60, 60)
    a = 1.0 / (1.0 + np.exp(-x))
    if raised is not None:
        a[raised] = 1.0
    p = np.asarray(p, np.float64)
    pn = p[:, 0] * (1.0 - a)
    rest = np.maximum(1.0 - p[:, 0], 1e-12)
    out = p.copy()
    out[:, 1:] *= ((1.0 - pn) / rest)[:, None]
    out[:, 0] = pn
    return out.astype(np.float32)


def load_bundle(path, backend: str = "onnxruntime", threads: int = 1) -> Detector:
    from zeroedge import bundle as zb

    path = Path(path)
    if not path.exists():
        raise UserError(f"sensor bundle not found: {path}; make one from the shipped detector with "
                        f"`scripts/train_sensor --export-only --bundle {path}` (or deploy one with zeroedge deploy)")
    m = zb.verify(path)
    if m.get("kind") != "sensor":
        raise UserError(f"{path}: not a sensor bundle (kind={m.get('kind')!r})")
    meta = m["sensor"]
    if backend == "onnxruntime":
        be = OrtBackend(path / meta["onnx"], threads=threads)
    elif backend == "torch":
        from zeroedge.sensor.train import load_model

        model, _ = load_model(path / meta["weights"])
        be = TorchBackend(model, zero=meta.get("zero", True))
    else:
        raise UserError(f"unknown backend {backend!r} (onnxruntime or torch)")
    return Detector(meta, be, bundle=path)


@dataclass
class StreamState:
    """Bounded per-stream state: last `window` frames (ring), counters and the alarm filter."""
    sensor: str
    window: int
    channels: int
    frames: np.ndarray = None          # (window, channels) ring buffer
    n: int = 0                         # frames pushed so far (total)
    last_seq: int = -1
    ema: float = 0.0
    alarm: bool = False
    since_infer: int = 0
    last_infer_t: float = float("-inf")

    def __post_init__(self):
        if self.frames is None:
            self.frames = np.zeros((self.window, self.channels), np.float32)

    def push(self, values, seq: int):
        self.frames[self.n % self.window] = values
        self.n += 1
        self.last_seq = seq
        self.since_infer += 1

    def snapshot(self) -> np.ndarray:
        """The frames in time order, oldest first (up to `window`)."""
        k = min(self.n, self.window)
        if self.n <= self.window:
            return self.frames[:k].copy()
        i = self.n % self.window
        return np.concatenate([self.frames[i:], self.frames[:i]])

    def memory_bytes(self) -> int:
        return self.frames.nbytes

    def to_row(self) -> dict:
        return {"n": self.n, "last_seq": self.last_seq, "ema": self.ema, "alarm": int(self.alarm)}


class Engine:
    """Readings in, result records out: per-stream windows, batched inference, the alarm filter."""

    def __init__(self, detector: Detector, infer_every: int = 1, infer_interval_s: float = 0.0):
        self.det = detector
        self.infer_every = max(1, int(infer_every))
        self.infer_interval_s = float(infer_interval_s)
        self.streams: dict[str, StreamState] = {}
        self.latencies: list = []          # seconds per inference call / window (bounded)
        self.warnings: list = []           # drift warnings not yet collected (pop_warnings)

    def stream(self, sensor: str) -> StreamState:
        s = self.streams.get(sensor)
        if s is None:
            s = self.streams[sensor] = StreamState(sensor, self.det.window, self.det.channels)
        return s

    def process(self, readings, now: Optional[float] = None) -> list:
        """readings: iterable of (sensor, seq, values, ts). Returns result dicts in input order
        (one per inference; with infer_every=1 one per reading)."""
        now = time.time() if now is None else now
        due = []                                   # (stream, seq, ts, window snapshot, n)
        for sensor, seq, values, ts in readings:
            st = self.stream(sensor)
            st.push(values, seq)
            if st.n == self.det.window and len(self.warnings) < 1000:     # once per stream, at its first full window
                w = self.det.drift_check(st.snapshot())
                if w:
                    self.warnings.append((sensor, w))
            if st.since_infer >= self.infer_every or (
                    self.infer_interval_s and now - st.last_infer_t >= self.infer_interval_s):
                due.append((st, seq, ts, st.snapshot(), st.n))
                st.since_infer = 0
                st.last_infer_t = now
        return self._infer(due)

    def pop_warnings(self) -> list:
        """[(sensor, message)] raised since the last call: streams whose first window does not look
        like the bundle's fit data (Detector.drift_check)."""
        w, self.warnings = self.warnings, []
        return w

    def tick(self, now: Optional[float] = None) -> list:
        """Time-based inference: streams with unseen readings older than infer_interval_s."""
        if not self.infer_interval_s:
            return []
        now = time.time() if now is None else now
        due = [(st, st.last_seq, None, st.snapshot(), st.n) for st in self.streams.values()
               if st.since_infer and now - st.last_infer_t >= self.infer_interval_s]
        for st, *_ in due:
            st.since_infer, st.last_infer_t = 0, now
        return self._infer(due)

    def _infer(self, due) -> list:
        if not due:
            return []
        probs = [None] * len(due)
        by_len: dict = {}
        for i, d in enumerate(due):
            by_len.setdefault(len(d[3]), []).append(i)
        for T, idx in by_len.items():
            for c in range(0, len(idx), 256):
                chunk = idx[c:c + 256]
                t0 = time.perf_counter()
                p = self.det.probs(np.stack([due[i][3] for i in chunk]))
                dt = time.perf_counter() - t0
                if len(self.latencies) < 100000:
                    self.latencies.append(dt)
                for j, i in enumerate(chunk):
                    probs[i] = p[j]
        out = []
        names = self.det.class_names
        for (st, seq, ts, _w, n), p in zip(due, probs):
            score = float(1.0 - p[0])
            st.ema = score if n <= self.infer_every else (1 - self.det.alpha) * st.ema + self.det.alpha * score
            raised = st.ema > self.det.threshold
            rising = raised and not st.alarm
            st.alarm = raised
            k = int(np.argmax(p[1:]) + 1)
            out.append({"sensor": st.sensor, "seq": int(seq), "ts": ts, "score": round(score, 5),
                        "ema": round(st.ema, 5), "alarm": raised, "rising": rising,
                        "fault": names[k] if raised else "normal", "fault_guess": names[k],
                        "p_fault": round(float(p[k]), 5)})
        return out


def evaluate_scores(detector: Detector, frames: np.ndarray, probs: bool = False) -> np.ndarray:
    """Per-sample scores 1 - P(normal) of a whole run with the daemon's view (up to `window` frames of
    context each), batched; probs=True gives the (T, classes) probabilities instead."""
    W = detector.window
    T = len(frames)
    out = np.zeros((T, len(detector.class_names)), np.float32)
    for t in range(min(T, W)):                      # the first windows are shorter (a fresh stream)
        out[t] = detector.probs(frames[None, :t + 1])[0]
    idx = np.arange(W, T)
    for c in range(0, len(idx), 512):
        ii = idx[c:c + 512]
        out[ii] = detector.probs(np.stack([frames[i - W + 1:i + 1] for i in ii]))
    return out if probs else 1.0 - out[:, 0]


def evaluate_frames(detector: Detector, frames: np.ndarray, onset: int, sensor: str = "eval") -> dict:
    """Run a whole run through an Engine exactly as the daemon does (infer every reading) and score
    it: fdr, far, delay, predicted_fault (majority class named after the first sustained alarm)."""
    from zeroedge.sensor.metrics import detection_metrics

    eng = Engine(detector, infer_every=1)
    res = []
    for i in range(0, len(frames), 256):
        res += eng.process([(sensor, i + j, f, None) for j, f in enumerate(frames[i:i + 256])], now=0.0)
    alarm = np.array([r["alarm"] for r in res], bool)
    m = detection_metrics(alarm, onset)
    votes = [r["fault_guess"] for r in res[onset:] if r["alarm"]]
    if votes:
        names, counts = np.unique(votes, return_counts=True)
        m["predicted_fault"] = str(names[np.argmax(counts)])
    else:
        m["predicted_fault"] = "normal"
    m["samples"] = len(frames)
    m["onset"] = onset
    warns = eng.pop_warnings()
    m["warning"] = warns[0][1] if warns else None
    m["_alarm"] = alarm
    m["_score"] = np.array([r["ema"] for r in res])
    return m
