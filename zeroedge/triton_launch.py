"""Programmatic dependent launch (PDL) for zeroedge's Triton kernels (the packed GEMVs, the decode
attention). On sm_90 and newer each kernel is launched with PDL: it lets the next kernel launch at
once and waits, before it reads anything the kernels ahead write, until the previous one has
finished and its writes are visible, so launches overlap inside a CUDA graph (H200 int4 decode:
+2-9 %; the packed GEMVs' weights loaded before the wait another +7-11 %; benchmarks/weights.md).
Off on older GPUs (a Jetson Orin is sm_87), on ROCm, with a Triton that has no grid-dependency
control, and with ZEROEDGE_PDL=0.

`pdl(t)`: the launch options for kernels on `t`'s device. `pdl_start(PDL)`: the first statement of
every such kernel, or split: `pdl_launch` first, `pdl_wait` before the first load of anything a
kernel ahead writes (the packed GEMVs load their first weight tile in between; a kernel may start
while several ahead still run, so only data no kernel of the step writes may be read before the
wait). This module imports Triton: the kernel modules import it, the decoders do not."""
from __future__ import annotations

import functools
import os

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:                      # Triton before 3.4
    HAS_GDC = False

if HAS_GDC:
    @triton.jit
    def pdl_launch(PDL: tl.constexpr):
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        if PDL:
            gdc_wait()
else:
    @triton.jit
    def pdl_launch(PDL: tl.constexpr):
        pass

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        pass


@triton.jit
def pdl_start(PDL: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    import torch

    return HAS_GDC and torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def pdl(t) -> dict:
    if not t.is_cuda or os.environ.get("ZEROEDGE_PDL") == "0":
        return {}
    import torch

    if not _capable(t.device.index if t.device.index is not None else torch.cuda.current_device()):
        return {}
    return dict(PDL=True, launch_pdl=True)
