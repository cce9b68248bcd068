"""Tennessee Eastman runs: the 52-column text format, and generation with tep-studio.

File format (as in ../shared/data/tep-braatz): whitespace-separated text, one row per sample
(every 3 minutes = 0.05 h), 41 XMEAS then 11 XMV columns. `d00.dat` of that set is stored
transposed (52 rows); `load_run` transposes such files. It also reads a plant's own exports:
comma- or semicolon-separated values, a header line of column names, `#` comments.

Generated runs go to a git-ignored cache (default ~/.cache/zeroedge/tep, or $ZEROEDGE_TEP_CACHE),
one `<split>/f<FF>_s<SEED>.dat` per run plus `<split>/index.json` with the onsets. Faults 1-20 are
tep-studio's IDV(1)..IDV(20) (the modified TEP of Bathelt, Ricker and Jelali; 16-20 are defined
there, unlike the original's "unknown" faults); fault 21 is the standard one, the stream-4 valve
(XMV 4) stuck at its position at onset. The closed loop is tep-studio's Ricker decentralized
controller (not the controller Braatz used), so generated runs differ in their operating point from
the Braatz files: normalisation is fitted per source, on that source's normal operation.
"""
from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from zeroedge.errors import UserError
from zeroedge.sensor import N_CHANNELS

SAMPLE_H = 0.05            # 3 minutes between recorded samples
CONTROL_H = 0.01           # controller interval (5 control steps per sample)
BRAATZ = Path(os.environ.get("ZEROEDGE_TEP_BRAATZ") or
              Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tep-braatz")

# The fixed, reproducible plan of generated runs: split -> list of (fault, seed, hours, onset_h).
# Seeds never repeat across splits.
def plan(split: str):
    if split == "train":
        runs = [(0, 1000 + s, 30.0, 0.0) for s in range(6)]
        runs += [(f, 100 * f + s, 30.0, 2.0) for f in range(1, 22) for s in range(3)]
        # more seeds (added once the first 3 per fault over-fitted); same recipe, new seeds
        runs += [(0, 1000 + s, 30.0, 0.0) for s in range(6, 16)]
        runs += [(f, 100 * f + s, 30.0, 2.0) for f in range(1, 22) for s in range(3, 10)]
    elif split == "val":
        runs = [(0, 5000 + s, 48.0, 8.0) for s in range(2)]
        runs += [(f, 5100 + f, 48.0, 8.0) for f in range(1, 22)]
    elif split == "test":
        runs = [(0, 9000 + s, 48.0, 8.0) for s in range(2)]
        runs += [(f, 9000 + 100 * f + s, 48.0, 8.0) for f in range(1, 22) for s in range(2)]
    else:
        raise ValueError(split)
    return runs


def cache_dir() -> Path:
    return Path(os.environ.get("ZEROEDGE_TEP_CACHE", Path.home() / ".cache" / "zeroedge" / "tep"))


MAX_RUN_BYTES = 1 << 30    # a run file larger than this is refused (a year of 3-minute samples is ~110 MB)


def _layout(path: Path) -> tuple:
    """(delimiter or None for whitespace, lines to skip) from the file's first lines: the first line
    that is not blank or a `#` comment is a header (skipped with what comes before it) when its
    fields are not all numbers."""
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            delim = "," if "," in line else ";" if ";" in line else None
            try:
                [float(v) for v in line.split(delim)]
                return delim, 0
            except ValueError:
                return delim, i + 1
    return None, 0


def load_run(path, channels: int = N_CHANNELS, finite: bool = True) -> np.ndarray:
    """(T, channels) float32 from a run file (see the module doc); a file stored transposed (channels
    rows) is transposed back. UserError with one line for anything missing, unreadable, of the wrong
    shape or (with finite) non-finite; finite=False leaves NaN / inf samples to the caller (the
    daemon rejects such a reading alone)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    if path.stat().st_size > MAX_RUN_BYTES:
        raise UserError(f"{path}: {path.stat().st_size / 2**30:.1f} GiB is beyond the "
                        f"{MAX_RUN_BYTES >> 30} GiB a run file may hold; split it")
    try:
        delim, skip = _layout(path)
        with warnings.catch_warnings():          # numpy's note on an empty file: the error below is the one line
            warnings.simplefilter("ignore", UserWarning)
            a = np.loadtxt(path, dtype=np.float64, ndmin=2, delimiter=delim, skiprows=skip, encoding="utf-8")
    except (ValueError, UnicodeDecodeError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{path}: not a numeric run file, one sample a row ({msg[:120]})") from None
    if a.size == 0:
        raise UserError(f"{path}: empty run file")
    if a.shape[1] != channels and a.shape[0] == channels:
        a = a.T
    if a.shape[1] != channels:
        raise UserError(f"{path}: expected {channels} columns (41 XMEAS + 11 XMV), got {a.shape[1]}")
    if finite:
        bad = ~np.isfinite(a)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise UserError(f"{path}: non-finite value (NaN or inf) in column {c + 1}, sample {r + 1}")
        if np.abs(a).max() > 1e30:
            raise UserError(f"{path}: values beyond float32 range")
    return a.astype(np.float32)


def braatz_runs():
    """[(fault, (T,52) array, onset_sample)] for the standard training runs (fault from sample 0)."""
    if not (BRAATZ / "d00.dat").is_file():
        raise UserError(f"TEP training data not found in {BRAATZ}")
    out = [(0, load_run(BRAATZ / "d00.dat"), 0)]
    for f in range(1, 22):
        out.append((f, load_run(BRAATZ / f"d{f:02d}.dat"), 0))
    return out


def stream(fault: int = 0, seed: int = 0, hours: float = 48.0, onset_h: float = 8.0,
           magnitude: float = 1.0) -> Iterator[np.ndarray]:
    """Yield one 52-column frame every simulated 3 minutes from the tep-studio closed loop.

    Stops early if the plant shuts down (a trip). Deterministic for a given seed.
    """
    try:
        from tep_studio import RickerMultiLoopController, TennesseeEastmanProcess
    except ImportError:
        raise UserError("the TEP simulator needs tep-studio: pip install 'zeroedge[dev]'") from None
    sim = TennesseeEastmanProcess()
    ctl = RickerMultiLoopController()
    meas, _ = sim.reset(seed=float(seed))
    ctl.reset(meas, time=sim.time)
    per_sample = int(round(SAMPLE_H / CONTROL_H))
    n_samples = int(round(hours / SAMPLE_H))
    stuck: Optional[float] = None
    idv = np.zeros(28)
    step = 0
    for _ in range(n_samples):
        for _ in range(per_sample):
            t = sim.time
            active = fault and t >= onset_h - 1e-9
            action, _diag = ctl.compute_action(meas, time=t)
            action = np.array(action, dtype=np.float64)
            idv[:] = 0.0
            if active and fault <= 20:
                idv[fault - 1] = magnitude
            if active and fault == 21:          # stream-4 (A/C feed) valve stuck at onset position
                if stuck is None:
                    stuck = float(action[3])
                action[3] = stuck
            res = sim.advance(action, control_interval=CONTROL_H, disturbances=idv)
            meas = res.measurements
            step += 1
            if res.shutdown_status["terminated"]:
                return
        yield np.concatenate([res.measurements[:41], res.implemented_action[:11]]).astype(np.float32)


def simulate(fault: int, seed: int, hours: float, onset_h: float) -> np.ndarray:
    frames = list(stream(fault, seed, hours, onset_h))
    return np.stack(frames) if frames else np.zeros((0, N_CHANNELS), np.float32)


def save_run(path: Path, data: np.ndarray):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    np.savetxt(tmp, data, fmt="%.6g")
    tmp.replace(path)


def _sim_job(job):
    fault, seed, hours, onset_h = job
    return job, simulate(fault, seed, hours, onset_h)


def generate(split: str, root: Optional[Path] = None, log=print, workers: int = 1) -> Path:
    """Generate (or complete) the runs of `split` in the cache; returns the split folder.
    `workers` > 1 simulates runs in parallel processes (results are identical)."""
    root = Path(root or cache_dir()) / split
    root.mkdir(parents=True, exist_ok=True)
    index_path = root / "index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else {}
    todo = [job for job in plan(split)
            if not (f"f{job[0]:02d}_s{job[1]}.dat" in index and (root / f"f{job[0]:02d}_s{job[1]}.dat").is_file())]
    if workers > 1 and len(todo) > 1:
        import multiprocessing as mp

        pool = mp.get_context("fork").Pool(workers)
        results = pool.imap_unordered(_sim_job, todo)
    else:
        pool, results = None, map(_sim_job, todo)
    t0 = time.monotonic()
    if todo:
        log(f"[gen_tep_runs] {split}: {len(todo)} runs to simulate ({len(index)} already in {root})")
    for done, ((fault, seed, hours, onset_h), data) in enumerate(results, 1):
        name = f"f{fault:02d}_s{seed}.dat"
        save_run(root / name, data)
        index[name] = {"fault": fault, "seed": seed, "hours": hours,
                       "onset": int(round(onset_h / SAMPLE_H)) if fault else len(data),
                       "samples": len(data)}
        tmp = index_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(index, indent=1, sort_keys=True))
        tmp.replace(index_path)
        spent = time.monotonic() - t0
        left = spent / done * (len(todo) - done)
        log(f"[gen_tep_runs] {split}/{name}: {len(data)} samples ({done}/{len(todo)}, {spent / 60:.1f} min "
            f"so far, about {left / 60:.1f} min left)")
    if pool is not None:
        pool.close()
    return root


# Replicates shaped like the standard Braatz set, from seeds no other split uses: per replicate r a
# normal run d00.dat (25 h, 500 samples), training fault runs dNN.dat (25 h recorded from 1 h after
# the fault's onset, 500 samples) and test runs dNN_te.dat (48 h, 960 samples, the fault from sample
# 160; d00_te.dat normal throughout). A run that trips the plant ends early. They stand in for "another run of the same plant" when measuring how
# a fitted alarm transfers (benchmarks/sensor_unseen_runs.py).
SHAPED_TRAIN_SKIP = 20      # the first recorded sample of a training fault run is 1 h after onset


def shaped_plan(replicate: int):
    """[(file name, fault, seed, hours, onset_h, first kept sample)] of one Braatz-shaped replicate."""
    base = 20000 + 1000 * int(replicate)
    runs = [("d00.dat", 0, base, 25.0, 0.0, 0)]
    runs += [(f"d{f:02d}.dat", f, base + f, 25.0 + SHAPED_TRAIN_SKIP * SAMPLE_H, SHAPED_TRAIN_SKIP * SAMPLE_H,
              SHAPED_TRAIN_SKIP) for f in range(1, 22)]
    runs += [(f"d{f:02d}_te.dat", f, base + 500 + f, 48.0, 8.0 if f else 0.0, 0) for f in range(0, 22)]
    return runs


def _shaped_job(job):
    name, fault, seed, hours, onset_h, skip = job
    return name, simulate(fault, seed, hours, onset_h)[skip:]


def generate_shaped(replicate: int, root: Optional[Path] = None, workers: int = 1, log=print) -> Path:
    """Generate (or complete) one Braatz-shaped replicate in the cache; returns its folder."""
    d = Path(root or cache_dir()) / "braatz_shaped" / f"r{int(replicate)}"
    d.mkdir(parents=True, exist_ok=True)
    todo = [job for job in shaped_plan(replicate) if not (d / job[0]).is_file()]
    if workers > 1 and len(todo) > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(workers) as pool:
            results = list(pool.imap_unordered(_shaped_job, todo))
    else:
        results = map(_shaped_job, todo)
    for name, data in results:
        save_run(d / name, data)
        log(f"[gen_tep_runs] braatz_shaped/r{replicate}/{name}: {len(data)} samples")
    return d


def normal_runs(split: str = "train", root: Optional[Path] = None):
    """The normal-operation runs of a split that are in the cache (no generation)."""
    d = Path(root or cache_dir()) / split
    index = json.loads((d / "index.json").read_text())
    return [load_run(d / n) for n in sorted(index) if index[n]["fault"] == 0]


def split_runs(split: str, root: Optional[Path] = None):
    """[(name, fault, (T,52) array, onset)] of a generated split (generating it if missing)."""
    d = Path(root or cache_dir()) / split
    if not (d / "index.json").is_file() or len(json.loads((d / "index.json").read_text())) < len(plan(split)):
        generate(split, root)
    index = json.loads((d / "index.json").read_text())
    out = []
    for name in sorted(index):
        info = index[name]
        out.append((name, info["fault"], load_run(d / name), info["onset"]))
    return out
