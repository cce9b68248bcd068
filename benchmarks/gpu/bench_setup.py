"""The setup the GPU benchmark scripts in benchmarks/gpu/ share: repository paths, common flags,
the CUDA check, model building, CUDA-graph / device-event timing, and result files.

Each script starts with `import bench_setup as bs` (the script's own folder is first on sys.path),
which puts the repository root on sys.path so `zeroedge` imports without installing. Only the
standard library is imported here; torch and zeroedge are imported inside the functions, so every
script answers `--help` on a machine without a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# ------------------------------------------------------------------------------ arguments

def parser(doc: str) -> argparse.ArgumentParser:
    """An ArgumentParser whose --help starts with the script's docstring, layout kept."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_out(ap: argparse.ArgumentParser, fallback: str) -> None:
    """--out DIR, defaulting to $OUT (the device machine's result folder), else `fallback`."""
    ap.add_argument("--out", default=os.environ.get("OUT", fallback),
                    help=f"folder for the results (default: $OUT, else {fallback})")


def add_ctx(ap: argparse.ArgumentParser, default: str) -> None:
    """--ctx N,N,...: context lengths, comma-separated (read with int_list)."""
    ap.add_argument("--ctx", default=default, help=f"context lengths, comma-separated (default {default})")


def out_ctx_args(doc: str, out: str, ctx: str, name: str, argv=None):
    """The common command line (--out, --ctx) parsed, or None (with a message) where there is no
    CUDA GPU."""
    ap = parser(doc)
    add_out(ap, out)
    add_ctx(ap, ctx)
    a = ap.parse_args(argv)
    return a if cuda_or_skip(f"{name}: skipped, no CUDA GPU here") else None


def int_list(text: str) -> list:
    return [int(c) for c in text.split(",")]


def out_dir(path) -> Path:
    """The results folder, created."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    return p


def write_json(path, obj, indent: int = 1, default=None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=indent, default=default))
    return path


# ------------------------------------------------------------------------------ device and model

def cuda_or_skip(message: str, dry: bool = False) -> bool:
    """True when a CUDA GPU is here (or a CPU dry run was asked for); else prints `message`."""
    import torch

    if dry or torch.cuda.is_available():
        return True
    print(message)
    return False


def device_info() -> dict:
    import torch

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__}


def build_model(preset: str, device, dtype, max_seq_len=None, seed: int = 0):
    """zeroedge's model of a preset's shapes with random weights (`seed`), built on `device` in `dtype`."""
    import torch

    from zeroedge import model as M

    cfg = M.PRESETS[preset]
    if max_seq_len is not None:
        cfg = cfg.with_(max_seq_len=max_seq_len)
    with torch.device(device):
        m = M.build(cfg, dtype=dtype, seed=seed)
    return m.to(device, dtype)


def random_prefix(cfg, ctx: int, dev, dtype):
    """Random K and V of a `ctx`-token prefix, one (kv heads, ctx, head dim) tensor a layer each."""
    import torch

    g = torch.Generator(device=dev).manual_seed(ctx)
    ks = [torch.randn(cfg.n_kv_heads, ctx, cfg.head_dim, device=dev, dtype=dtype, generator=g)
          for _ in range(cfg.n_layers)]
    vs = [torch.randn(cfg.n_kv_heads, ctx, cfg.head_dim, device=dev, dtype=dtype, generator=g)
          for _ in range(cfg.n_layers)]
    return ks, vs


# ------------------------------------------------------------------------------ timing

def cuda_graph(fn, warmup: int = 2, side_stream: bool = True):
    """fn() captured into one CUDA graph, after `warmup` eager calls (on a side stream, as PyTorch
    recommends before a capture, or inline on the current stream)."""
    import torch

    if side_stream:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(s)
    else:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def event_ms(fn, reps: int, warm: int = 0) -> list:
    """Milliseconds of each of `reps` calls of fn, by CUDA device events, after `warm` untimed calls."""
    import torch

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return ts


def timed(fn, dev, iters: int = 10, warm: int = 2) -> float:
    """Median seconds of fn() (CUDA events on a GPU, perf_counter elsewhere)."""
    if dev.type == "cuda":
        return statistics.median(event_ms(fn, iters, warm)) / 1e3
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def graph_ms(fn, warm: int = 3, reps: int = 30) -> float:
    """Median ms of one replay of fn() captured into a CUDA graph (two eager warm-up calls on a side
    stream, `warm` untimed replays, `reps` timed ones)."""
    g = cuda_graph(fn, warmup=2)
    return statistics.median(event_ms(g.replay, reps, warm))


def graph_timed(f, dev) -> float:
    """Median seconds of f() as CUDA-graph replays on a GPU (eager elsewhere): 5 warm, 50 timed."""
    fn = f
    if dev.type == "cuda":
        fn = cuda_graph(f, warmup=1, side_stream=False).replay
    return timed(fn, dev, iters=50, warm=5)


def decode_step_ms(dec, start: int = 1024, n: int = 64, reps: int = 5) -> float:
    """Median ms per decode step of `dec` (a zeroedge decoder with .step(token, pos)) over `reps`
    runs of `n` steps at position ~start, after 3 warm-up steps (graph capture included)."""
    import torch

    for s in range(3):
        dec.step(1, start + s)
    torch.cuda.synchronize()

    def steps():
        for s in range(n):
            dec.step(1 + s, start + 3 + s)

    return statistics.median(t / n for t in event_ms(steps, reps))


def eager_steps(dec, steps: int = 8, start: int = 1024):
    """`steps` decode steps of `dec` without CUDA graphs (so Python-side recording runs)."""
    gw, dec.graph_wanted = dec.graph_wanted, False
    try:
        for s in range(steps):
            dec.step(1 + s, start + s)
    finally:
        dec.graph_wanted = gw


def recording_paths_decoder(model, max_len: int, policies: dict, **ffn_kw):
    """(Decoder with the dense cache and decode paths, its FFN strategy). While `ffn.record` is a dict
    layer -> list, each sparse layer's FFN input h (1, D) of a step is appended to it (thresholds
    for a wanted kept fraction are read off those inputs)."""
    import torch.nn.functional as F

    from zeroedge.paths.ffn import PathsFFN
    from zeroedge.runtime.fast import Decoder, DenseAttention

    class RecordingPathsFFN(PathsFFN):
        record = None

        def out(self, li, w, wo, x, o):
            if self.record is not None and li in self.paths:
                h = F.rms_norm(x + F.linear(o.reshape(1, -1), w["wo"]), (x.shape[-1],), w["ln2"], w["eps2"])
                self.record[li].append(h.detach().clone())
            return super().out(li, w, wo, x, o)

    ffn = RecordingPathsFFN(policies, **ffn_kw)
    return Decoder(model, DenseAttention(max_len), ffn, graph=True), ffn


def copy_bw() -> float:
    """Device-to-device copy rate of a 2 GiB bf16 buffer, bytes read + written per second."""
    import torch

    n = 1 << 30  # 1 Gi halves = 2 GiB
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = graph_ms(lambda: dst.copy_(src), reps=20)
    return 2 * src.numel() * 2 / (ms * 1e-3)


def rel(a, b) -> float:
    """Relative error |a - b| / |b| in float32."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------ support modules

def kernels_ctypes():
    """device_tests/kernels_ctypes.py (the plugin kernels through ctypes, shared with the GPU tests)."""
    sys.path.insert(0, str(ROOT / "device_tests"))
    import kernels_ctypes as kc

    return kc
