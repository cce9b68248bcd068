"""The plugin library's thermal sketch kernel (plugins/kernels/thermal_sketch.cu, C API in
plugins/include/zeroedge_thermal.h) bound with ctypes: zeroedge.kv.kernels.sketch_page_lse on
tensor cores, on the current stream (so CUDA graphs capture it). Used when the library is built
(zeroedge.kernels_lib) and the shapes fit; the Triton kernel otherwise.
"""
from __future__ import annotations

import ctypes

ERRORS = {-1: "null pointer", -2: "shape outside the limits (rank 16 / 32 / 64, pages of 8 / 16, "
          "1 to 8 query heads a kv head)", -3: "codes or scales misaligned", -4: "compute capability below 8.0"}


def fits(page_size: int, rank: int, grp: int) -> bool:
    return page_size in (8, 16) and rank in (16, 32, 64) and 1 <= grp <= 8


def load(path=None):
    from zeroedge import kernels_lib

    lib = kernels_lib.open_lib(path, "ze_thermal_sketch_lse", "thermal sketch CUDA kernel")
    if not getattr(lib, "_ze_thermal_bound", False):
        vp, i = ctypes.c_void_p, ctypes.c_int
        lib.ze_thermal_sketch_lse.restype = i
        lib.ze_thermal_sketch_lse.argtypes = [vp] * 6 + [i] * 7 + [vp]
        lib._ze_thermal_bound = True
    return lib


def sketch_page_lse(lib, qr, codes, scales, page_size: int, out, part, pages_per_share: int):
    """out (nkv, grp, n) <- every page's sketch log-sum-exp (kernels.sketch_page_lse); part: None or
    (max, sum) (nkv, grp, nb) with share c covering pages c * pages_per_share onwards."""
    import torch

    nkv, P, r2 = codes.shape
    grp = qr.shape[1]
    n = P // page_size
    pm, psum = part if part is not None else (None, None)
    nb = pm.shape[-1] if pm is not None else -(-n // pages_per_share)
    ptr = (lambda t: ctypes.c_void_p(t.data_ptr() if t is not None else 0))
    rc = lib.ze_thermal_sketch_lse(ptr(qr), ptr(codes), ptr(scales), ptr(out), ptr(pm), ptr(psum), nkv, grp, n,
                                   page_size, 2 * r2, nb, pages_per_share,
                                   ctypes.c_void_p(torch.cuda.current_stream(codes.device).cuda_stream))
    if rc != 0:
        raise RuntimeError(f"ze_thermal_sketch_lse: {ERRORS.get(rc, f'CUDA error {rc}')}")
    return out
