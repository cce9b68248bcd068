"""The decode GEMV over packed group-wise weights (zeroedge.quant.packed.PackedLinear), in Triton, for
one token: y (1, N) = x (1, K) @ W^T, W read as 4- or 8-bit codes with an fp16 step and offset a group.

The codes are read as 32-bit words (8 four-bit or 4 eight-bit codes, the first input in the low
bits). A program owns BN output rows and walks the input BW words a row at a time: a [BN, BW] tile
of words (contiguous, 16-byte loads), unpacked code by code against the matching inputs, each word's
partial sum scaled by its group's step and the group's offset times the inputs' sum:
y_n = sum_g (s_ng * sum_{k in g} q_nk x_k + o_ng * sum_{k in g} x_k), in fp32. Fused around it:

  norm      x is RMS-normalised first (x * rsqrt(mean(x^2) + eps) * ln): every program computes the
            norm of x itself, so no separate RMSNorm launch and no normalised copy of x
  swiglu    the rows are [W_gate; W_up]: a program computes gate row n and up row n + N/2 and stores
            silu(g) * u (N/2 outputs)
  residual  y = r + x W^T

With SPLIT > 1 a second grid axis splits the input into SPLIT ranges (matrices with few rows);
each writes fp32 partial sums and one more launch adds them in a fixed order (deterministic) and
applies the epilogue.

int8 inputs (gemv_i8_kernel, `int8_inputs=True`): each word's inputs (8 for 4-bit codes, 4 for
8-bit) rounded to int8 with one scale (zeroedge.quant.packed.round_inputs_int8), and the codes x
inputs summed by dp4a, four products an instruction -- the unpack-convert-multiply of every code is
what bounds the fp32 kernel (Nsight Compute on gate/up: ~78 instructions a 32-bit word, 119 registers,
25 % occupancy; 0.5-1.1 TB/s). On the H200, with the prepared inputs below: 1.3-1.9x cuBLAS's bf16
GEMV of the same shape, decode 1.99-2.10x zeroedge's uncompiled bf16 loop at 8K (with PDL and weights ahead of the
wait, below); on SmolLM2 the rounding costs under 0.3 % of perplexity (benchmarks/weights.md).
Triton's interpreter has no inline PTX: there (DP4A False) the same integer sums by shifts.
Prepared int8 inputs (`PREPARED` in a launch setting): a first kernel (quantize_inputs_kernel) rounds
and packs each word's inputs once a call -- the norm's 1 / RMS folded into their steps -- and sums
each word's rounded inputs; the GEMV (gemv_q_kernel) then scales each word's integer sum by its
input step, adds a group's words (and their input sums) and applies the group's weight step and
offset once a group instead of once a word. Same numbers up to fp32 summation order; one launch
more, so it pays on large matrices only (H200: gate/up 1.6x, the int8 LM head 1.7x faster; q/k/v
and o slower by the launch). `then=`: the GEMV whose output feeds the next weight (gate/up ->
down) prepares that weight's inputs in its epilogue instead, so the next GEMV needs no first
launch (+0.3-1.3 % decode on the H200, the logits bit for bit the same).

Weights ahead of the wait (EARLY_WEIGHTS, int8-input kernels, no predictor): with programmatic
dependent launch a kernel starts while the one ahead still runs and waits (griddepcontrol.wait)
before reading what that one writes. Weights are never written, so each program loads its first
tile of codes, steps and offsets before the wait: the bytes stream in under the previous kernel's
tail. H200, llama-3.2-1b shape at 8K: int4 g128 decode +10.8 % (1464 -> 1622 tok/s), logits bit
for bit the same (benchmarks/weights.md). Without PDL (a Jetson Orin) it changes nothing.
Launch settings per matrix shape (CONFIG, CONFIG_I8) are the best of an H200 sweep
(benchmarks/gpu/weights_gpu.py); `pick` falls back on the common choice for other shapes.
The kernels are in zeroedge.quant.gemv_kernels (imported on first use: it imports Triton).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


def pdl(t: torch.Tensor) -> dict:
    """Launch options for programmatic dependent launch (zeroedge.triton_launch, imported only for a
    CUDA tensor: it imports Triton)."""
    if not t.is_cuda:
        return {}
    from zeroedge.triton_launch import pdl as options

    return options(t)


def _kernels():
    from zeroedge.quant import gemv_kernels      # imports triton

    return gemv_kernels.gemv_kernel, gemv_kernels.finish_kernel, gemv_kernels.gemv_i8_kernel


def _prepared_kernels():
    from zeroedge.quant import gemv_kernels

    return gemv_kernels.quantize_inputs_kernel, gemv_kernels.gemv_q_kernel


def _gather_kernel():
    from zeroedge.quant import gemv_kernels

    return gemv_kernels.gather_inputs_kernel


# (rows N, inputs K, bits, group) -> launch settings: the best of the H200 sweep at llama-3.2-1b's
# shapes (benchmarks/gpu/weights_gpu.py, benchmarks/results/weights/h200_gemv_launch_sweep_vs_cublas.json)
CONFIG: dict = {
    (3072, 2048, 4, 32): dict(BN=4, BW=256, SPLIT=2, num_warps=4),      # q/k/v
    (3072, 2048, 4, 128): dict(BN=8, BW=256, SPLIT=4, num_warps=4),
    (2048, 2048, 4, 32): dict(BN=4, BW=256, SPLIT=1, num_warps=4),      # o_proj
    (2048, 2048, 4, 128): dict(BN=8, BW=256, SPLIT=2, num_warps=4),
    (16384, 2048, 4, 32): dict(BN=4, BW=128, SPLIT=1, num_warps=4),     # gate/up
    (16384, 2048, 4, 128): dict(BN=8, BW=128, SPLIT=1, num_warps=4),
    (2048, 8192, 4, 32): dict(BN=4, BW=256, SPLIT=1, num_warps=4),      # down_proj
    (2048, 8192, 4, 128): dict(BN=4, BW=256, SPLIT=1, num_warps=4),
    (128256, 2048, 8, 128): dict(BN=8, BW=128, SPLIT=1, num_warps=4),   # LM head, int8
}
CONFIG_I8: dict = {     # the int8-input kernels; PREPARED: inputs rounded once by a first kernel
    # (the FFN rows: a sweep of each GEMV alone, benchmarks/results/weights/h200_gemv_ffn_launch_sweep_first.json;
    # q/k/v g32: benchmarks/results/weights/h200_gemv_qkvo_launch_sweep.json, 4.15 against 4.76 us)
    (3072, 2048, 4, 32): dict(BN=4, BW=256, SPLIT=1, num_warps=4, PREPARED=False),
    (3072, 2048, 4, 128): dict(BN=8, BW=256, SPLIT=4, num_warps=8, PREPARED=False),
    (2048, 2048, 4, 32): dict(BN=4, BW=256, SPLIT=1, num_warps=8, PREPARED=False),
    (2048, 2048, 4, 128): dict(BN=4, BW=256, SPLIT=4, num_warps=8, PREPARED=False),
    (16384, 2048, 4, 32): dict(BN=16, BW=256, SPLIT=1, num_warps=4, num_stages=1, PREPARED=True),
    (16384, 2048, 4, 128): dict(BN=16, BW=128, SPLIT=1, num_warps=8, num_stages=4, PREPARED=True),
    (2048, 8192, 4, 32): dict(BN=8, BW=128, SPLIT=4, num_warps=8, num_stages=1, PREPARED=True),
    (2048, 8192, 4, 128): dict(BN=8, BW=256, SPLIT=8, num_warps=4, PREPARED=True),
    (128256, 2048, 8, 128): dict(BN=16, BW=128, SPLIT=1, num_warps=8, PREPARED=True),
    # a 4-bit LM head (embedding int4: groups of 128 at this hidden size): the int8 head's rows and
    # warps, 2.6 % faster decode than pick's fallback (benchmarks/results/weights/h200_ab_int4_head_launch.json)
    (128256, 2048, 4, 128): dict(BN=16, BW=256, SPLIT=1, num_warps=8, PREPARED=True),
}


EARLY_WEIGHTS = True    # the int8-input GEMVs load their first weight tile before PDL's wait


def pick(n: int, k: int, bits: int, group: int, int8_inputs: bool = False) -> dict:
    """Launch settings for an [n, k] weight: the sweep's where it measured this shape, else its
    common choice: 4 rows a program, 256 words (1 KiB) a row an iteration, the input split in two
    while there are fewer than ~600 programs and each split keeps a whole iteration; int8 inputs
    prepared by a first kernel from 16M weights up (below, that launch costs more than it saves)."""
    c = (CONFIG_I8 if int8_inputs else CONFIG).get((n, k, bits, group))
    if c is not None:
        return dict(c)
    words = -(-k // group) * group * bits // 32
    bw = min(256, _pow2_ceil(words))
    bn, split = 4, 1
    if -(-n // bn) < 600 and words >= 2 * bw:
        split = 2
    return dict(BN=bn, BW=bw, SPLIT=split, num_warps=4, PREPARED=int8_inputs and n * k >= 1 << 24)


def _pow2_ceil(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


class Prepared(NamedTuple):
    """A GEMV's int8 inputs made ahead (quantize_inputs_kernel's outputs, or the epilogue of the GEMV
    that computed them: gemv(..., then=w)) for a weight of `bits` bits, `k` inputs and `words` words
    of codes a row (k padded to whole groups): xq the packed words, dx each word's step, xw each
    word's sum of the rounded inputs."""
    xq: torch.Tensor
    dx: torch.Tensor
    xw: torch.Tensor
    bits: int
    k: int
    words: int


def _prepared_buffers(w, device) -> Prepared:
    roww = w.q.shape[1] // 4
    return Prepared(torch.empty((2 if w.bits == 4 else 1) * roww, device=device, dtype=torch.int32),
                    torch.empty(roww, device=device, dtype=torch.float32),
                    torch.empty(roww, device=device, dtype=torch.float32), w.bits, w.k, roww)


def gemv(x: torch.Tensor, w, swiglu: bool = False, residual=None, norm=None, out=None,
         config=None, int8_inputs: bool = False, predictor=None, inputs: Optional[Prepared] = None,
         then=None):
    """x (1, K) or (K,) -> (1, N) (swiglu: (1, N / 2)) in x's dtype; w a PackedLinear on x's device;
    norm: (ln weight, eps) to RMS-normalise x first; residual: added to the output; int8_inputs: the
    dp4a kernel (each word's inputs rounded to int8: zeroedge.quant.packed.round_inputs_int8).
    predictor = (z [r], bg [r, N], bu [r, N] fp32, threshold): only the rows (swiglu: a channel's gate
    and up row together) whose |silu(z bg) * (z bu)| >= threshold are read, decided in the kernel;
    the others give 0 (plus the residual).
    inputs: x's int8 inputs already prepared (a Prepared from `then`; int8_inputs): the prepared-input
    kernel runs whatever the launch setting says, with no rounding launch.
    then: the PackedLinear the output goes into next; returns (y, Prepared or None): with int8 inputs
    the epilogue prepares that weight's inputs where the shapes allow (whole words a program, every
    word written), else None."""
    xf = x.reshape(-1)
    if xf.numel() != w.k:
        raise ValueError(f"gemv: x has {xf.numel()} inputs, the weight takes {w.k}")
    n = w.n // 2 if swiglu else w.n
    c = dict(config) if config else pick(w.n, w.k, w.bits, w.group, int8_inputs)
    split = c.pop("SPLIT", 1)
    if inputs is not None and not (int8_inputs and norm is None and inputs.bits == w.bits and inputs.k == w.k
                                   and inputs.words == w.q.shape[1] // 4 and inputs.dx.device == x.device):
        raise ValueError("gemv: prepared inputs need int8_inputs, no norm, and the weight's bits, K, "
                         "words a row and device")
    prepared = (c.pop("PREPARED", False) and int8_inputs) or inputs is not None
    roww = w.q.shape[1] // 4
    c["BW"] = min(c["BW"], _pow2_ceil(roww))
    wg = w.group * w.bits // 32                       # words a group
    if prepared:
        c["BW"] = max(c["BW"], wg)                    # whole groups a tile
    wps = -(-roww // split)
    wps = -(-wps // c["BW"]) * c["BW"]               # whole tiles a split
    split = -(-roww // wps)
    ln, eps = norm if norm is not None else (xf, 0.0)
    y = out if out is not None else torch.empty(1, n, device=x.device, dtype=x.dtype)
    r = residual.reshape(-1) if residual is not None else y
    gk, fk, ik = _kernels()
    z, bg, bu, thr, rk = xf, xf, xf, 0.0, 1              # no predictor: every row (unused pointers)
    if predictor is not None:
        z, bg, bu, thr = predictor
        if z.dim() > 1 and z.shape[0] != 1:
            raise ValueError(f"gemv: the predictor's z is one token's (1, r), got {tuple(z.shape)}")
        z, rk, thr = z.reshape(-1).float(), z.numel(), float(thr)
        for m in (bg, bu):
            if m.shape != (rk, n) or m.dtype != torch.float32 or not m.is_contiguous() or m.device != x.device:
                raise ValueError(f"gemv: the predictor's maps must be contiguous fp32 [{rk}, {n}] on {x.device}")
    launch = pdl(x)
    extra = dict(launch)
    if int8_inputs:
        gk, extra = ik, dict(extra, DP4A=x.device.type == "cuda", EARLY=EARLY_WEIGHTS and predictor is None)
    nxt = None       # the next weight's inputs, prepared in the epilogue: whole words a program, every word
    if (then is not None and int8_inputs and then.k == n and split == 1
            and c["BN"] % (32 // then.bits) == 0 and n % then.group == 0):
        nxt = _prepared_buffers(then, x.device)
    nq, ndx, nxw = nxt[:3] if nxt is not None else (y, y, y)
    nw = nxt.dx.numel() if nxt is not None else 0
    dst = torch.empty(split, 2 * n if swiglu else n, device=x.device, dtype=torch.float32) if split > 1 else y
    common = dict(SWIGLU=swiglu, RES=residual is not None and split == 1, SPLIT=split,
                  LIVE=predictor is not None, R=_pow2_ceil(rk), NEXT_BITS=then.bits if nxt is not None else 0)
    grid = (-(-n // c["BN"]), split)
    if prepared:
        qk, pk = _prepared_kernels()
        if inputs is None:
            inputs = _prepared_buffers(w, x.device)
            bwq = max(wg, min(256, _pow2_ceil(roww)))
            qk[(-(-roww // bwq),)](xf, ln, float(eps), w.k, inputs.xq, inputs.dx, inputs.xw, roww, BITS=w.bits,
                                   BWQ=bwq, NB=min(1024, _pow2_ceil(w.k)), NORM=norm is not None, **launch)
        pk[grid](inputs.xq, inputs.dx, inputs.xw, w.q.view(torch.int32), w.scale, w.offset, dst, r,
                 nq, ndx, nxw, nw, z, bg, bu, thr, rk, n, w.groups, roww, wps, BITS=w.bits, G=w.group,
                 **common, **c, **extra)
    else:
        gk[grid](xf, ln, float(eps), w.q.view(torch.int32), w.scale, w.offset, dst, r, nq, ndx, nxw,
                 nw, z, bg, bu, thr, rk, n, w.k, w.groups, roww, wps, BITS=w.bits, G=w.group,
                 NB=min(1024, _pow2_ceil(w.k)), NORM=norm is not None, **common, **c, **extra)
    if split > 1:
        fk[(-(-n // 1024),)](dst, y, r, n, SPLIT=split, SWIGLU=swiglu, RES=residual is not None, BLOCK=1024,
                             **launch)
    return (y, nxt) if then is not None else y


def gather_inputs(x: torch.Tensor, w, out=None, BC=None, split=None, num_warps=None) -> torch.Tensor:
    """x (1, K) @ W^T over W's input-major form (a PackedInputs): rows of inputs that are 0 are not
    read (decode paths' magnitude rule). -> (1, N) in x's dtype. BC: bytes of output columns a program
    owns (default 256 with 2 warps: the fastest on the H200 at llama-3.2-1b's FFN shapes, 21 / 28 us
    for W13 / W2 at half the inputs kept, against 28-50 us with 512-4096); split: input ranges run
    in parallel (default: ~512 programs), added after in a fixed order."""
    xf = x.reshape(-1)
    if xf.numel() != w.k:
        raise ValueError(f"gather_inputs: x has {xf.numel()} inputs, the weight takes {w.k}")
    rowb = w.q.shape[1]
    BC = BC or min(256, _pow2_ceil(rowb))
    num_warps = num_warps or max(1, min(8, BC // 128))
    groups = w.scale.shape[0]
    cols = -(-rowb // BC)
    split = split or max(1, min(groups, 512 // cols))
    gps = -(-groups // split)
    split = -(-groups // gps)
    y = out if out is not None else torch.empty(1, w.n, device=x.device, dtype=x.dtype)
    dst = torch.empty(split, w.n, device=x.device, dtype=torch.float32) if split > 1 else y
    launch = pdl(x)
    _gather_kernel()[(cols, split)](xf, w.q, w.scale, w.offset, dst, w.n, w.k, rowb, gps, BITS=w.bits,
                                    G=w.group, BC=BC, SPLIT=split, num_warps=num_warps, **launch)
    if split > 1:
        _kernels()[1][(-(-w.n // 1024),)](dst, y, y, w.n, SPLIT=split, SWIGLU=False, RES=False, BLOCK=1024,
                                          **launch)
    return y
