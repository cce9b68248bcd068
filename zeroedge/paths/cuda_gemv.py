"""The plugin library's decode-path kernels (plugins/kernels/paths_gemv.cu, C API in
plugins/include/zeroedge_paths.h) bound with ctypes, for PyTorch CUDA tensors on the current stream
(so they are captured into the decoder's CUDA graph like any other kernel).

The library is libzeroedge_kernels.so built by scripts/build_plugins (or cmake -S plugins); found
at `path`, else $ZEROEDGE_KERNELS_LIB, else plugins/build/libzeroedge_kernels.so in this checkout.
A missing library is a UserError naming where it looked; nothing falls back to dense.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

from zeroedge import kernels_lib

F16, BF16 = 1, 2
ERRORS = {-1: "null pointer", -2: "dtype must be fp16 or bf16", -3: "shape outside the limits "
          "(B 1..8, D % 8 == 0 and D <= 8192, F % 8 == 0, R 1..128)", -4: "tensor not 16-byte aligned"}


def default_path() -> Path:
    return kernels_lib.default_path()


def load(path=None):
    lib = kernels_lib.open_lib(path, "ze_paths_ffn", "decode-path CUDA kernels")
    if getattr(lib, "_ze_paths_bound", False):
        return lib
    vp, i, f, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_size_t
    lib.ze_paths_work_bytes.restype = sz
    lib.ze_paths_work_bytes.argtypes = [i, i, i]
    lib.ze_paths_ffn.restype = i
    lib.ze_paths_ffn.argtypes = [i] + [vp] * 8 + [f, i, i, i, i, vp, i, vp]
    lib.ze_paths_ffn_magnitude.restype = i
    lib.ze_paths_ffn_magnitude.argtypes = [i, vp, vp, vp, vp, f, f, i, i, i, vp, i, vp]
    lib.ze_paths_set_config.argtypes = [i, i, i]
    lib._ze_paths_bound = True
    return lib


def _dtype(t) -> int:
    import torch
    if t.dtype == torch.float16:
        return F16
    if t.dtype == torch.bfloat16:
        return BF16
    raise ValueError(f"decode-path CUDA kernels take fp16 or bf16, not {t.dtype}")


def _check(rc: int, what: str):
    if rc != 0:
        raise RuntimeError(f"{what}: {ERRORS.get(rc, f'CUDA error {rc}')}")


def work_buffer(lib, B: int, D: int, F: int, device):
    """A zeroed scratch buffer the kernels keep zeroed (pass work_is_zero=True with it)."""
    import torch
    n = lib.ze_paths_work_bytes(B, D, F)
    return torch.zeros((n + 3) // 4, dtype=torch.float32, device=device)


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr())


def _stream():
    import torch
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def ffn_predictor(lib, x, z, bg_t, bu_t, wg, wu, wd_t, thr: float, work, out):
    """out[B, D] = the predictor-path FFN of x[B, D]; bg_t / bu_t are [F, R] (channel-major)."""
    B, D = x.shape
    Fd, R = bg_t.shape
    _check(lib.ze_paths_ffn(_dtype(x), _ptr(x), _ptr(z), _ptr(bg_t), _ptr(bu_t), _ptr(wg), _ptr(wu),
                            _ptr(wd_t), _ptr(out), float(thr), B, D, Fd, R, _ptr(work), 1, _stream()),
           "ze_paths_ffn")
    return out


def ffn_magnitude(lib, x, w13_t, wd_t, thr_in: float, thr: float, work, out):
    """out[B, D] = the magnitude-rule FFN of x[B, D]; w13_t is [D, 2F], wd_t [F, D]."""
    B, D = x.shape
    Fd = wd_t.shape[0]
    _check(lib.ze_paths_ffn_magnitude(_dtype(x), _ptr(x), _ptr(w13_t), _ptr(wd_t), _ptr(out),
                                      float(thr_in), float(thr), B, D, Fd, _ptr(work), 1, _stream()),
           "ze_paths_ffn_magnitude")
    return out
