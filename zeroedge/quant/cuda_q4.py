"""The plugin library's 4-bit decode GEMV (plugins/kernels/q4_gemv.cu, C API in
plugins/include/zeroedge_q4.h) bound with ctypes, for PyTorch CUDA tensors on the current stream (so
it is captured into the decoder's CUDA graph like any other kernel).

It computes what zeroedge.quant.triton_gemv's int8-input kernel computes (inputs rounded to int8 a
word at a time, dp4a, fp32 sums), but every block rounds the inputs itself (the norm folded in), so
no launch prepares them and none adds split partials. That pays on small matrices and costs on large
ones (H200, llama-3.2-1b shapes, each GEMV alone: o_proj 2.2-2.4 us against Triton's 2.8-3.2, q/k/v
at g32 3.8 against 4.8, but gate/up 10.2 against 6.0; benchmarks/weights.md session 12). So
packed.linear / swiglu take it for 4-bit weights of fewer than SMALL values when the library is
built (scripts/build_plugins), else the Triton kernels.

The library: $ZEROEDGE_KERNELS_LIB, else plugins/build/libzeroedge_kernels.so in this checkout;
absent, or without ze_q4_gemv (an older build), nothing here is used.
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

SMALL = 1 << 24            # weights (n x k) below this go to this kernel
F16, BF16 = 1, 2
ERRORS = {-1: "null pointer", -2: "dtype must be fp16 or bf16", -3: "shape outside the limits (K % 32 == 0, "
          "K <= 8192, group % 32 == 0, K % group == 0)", -4: "tensor not 16-byte aligned"}
MAX_K = 8192


def library_path() -> Path:
    env = os.environ.get("ZEROEDGE_KERNELS_LIB")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "plugins" / "build" / "libzeroedge_kernels.so"


@functools.lru_cache(maxsize=None)
def _load(path: str):
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    if not hasattr(lib, "ze_q4_gemv"):
        return None
    vp, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.ze_q4_gemv.restype = i
    lib.ze_q4_gemv.argtypes = [i, vp, vp, f, vp, vp, vp, vp, vp, i, i, i, i, i, i, i, vp]
    return lib


def library():
    """The loaded library, or None (not built, unloadable, or built before ze_q4_gemv)."""
    p = library_path()
    return _load(str(p)) if p.is_file() else None


def takes(x, w, swiglu: bool = False, norm=None) -> bool:
    """Whether gemv below serves x @ w (a PackedLinear on x's CUDA device): 4-bit codes, a small
    matrix, whole groups, the kernel's limits and layouts, and the library present."""
    import torch

    aligned = [t for t in (x, norm[0] if norm is not None else None) if t is not None]
    if any(not t.is_contiguous() or t.data_ptr() % 16 or t.dtype != x.dtype for t in aligned):
        return False
    if w.bits != 4 or w.n * w.k >= SMALL or w.k % 32 or w.k > MAX_K or w.group % 32 or w.k % w.group:
        return False
    if swiglu and w.n % 2:
        return False
    if x.dtype not in (torch.float16, torch.bfloat16) or w.scale.dtype != torch.float16 or w.offset.dtype != torch.float16:
        return False
    if not (w.q.is_contiguous() and w.scale.is_contiguous() and w.offset.is_contiguous()):
        return False
    return library() is not None


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None


def gemv(x, w, residual=None, norm=None, swiglu: bool = False, out=None):
    """x (1, K) -> (1, N) (swiglu: (1, N / 2)) in x's dtype, the inputs rounded to int8 a word at a
    time after the RMSNorm norm = (weight, eps); residual added. Call only where takes() said yes."""
    import torch

    from zeroedge.quant.triton_gemv import pdl

    xf = x.reshape(-1)
    if xf.numel() != w.k:
        raise ValueError(f"cuda_q4.gemv: x has {xf.numel()} inputs, the weight takes {w.k}")
    n = w.n // 2 if swiglu else w.n
    y = out if out is not None else torch.empty(1, n, device=x.device, dtype=x.dtype)
    r = residual.reshape(-1).contiguous() if residual is not None else None
    ln = norm[0] if norm is not None else None
    rows = 1 if swiglu else 2                    # rows a warp, 16-byte loads a lane and row: the best of
    unroll = 2 if w.k <= 2048 else 4             # the H200 sweep (weights.md session 12)
    rc = library().ze_q4_gemv(BF16 if x.dtype == torch.bfloat16 else F16, _ptr(xf), _ptr(ln),
                              float(norm[1]) if norm is not None else 0.0, _ptr(w.q), _ptr(w.scale),
                              _ptr(w.offset), _ptr(r), _ptr(y), n, w.k, w.group, int(swiglu), rows, unroll,
                              int(bool(pdl(x))), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    if rc != 0:
        raise RuntimeError(f"ze_q4_gemv: {ERRORS.get(rc, f'CUDA error {rc}')}")
    return y
