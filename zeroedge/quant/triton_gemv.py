"""The decode GEMV over packed group-wise weights (zeroedge.quant.packed.PackedLinear), in Triton, for
one token: y (1, N) = x (1, K) @ W^T, W read as 4- or 8-bit codes with an fp16 step and offset a group.

A program owns BN output rows and walks the input NG groups at a time: per group it loads the rows'
code bytes (4 bits: two inputs a byte, the even inputs in the low nibbles), sums codes x inputs and
the inputs themselves in fp32, and adds  s * sum(q x) + o * sum(x). With SPLIT > 1 a second grid
axis splits the input into SPLIT ranges whose fp32 partial sums are added after (rows too few to
fill the GPU: o_proj, down_proj); with SPLIT == 1 the epilogue is fused:

  swiglu    the rows are [W_gate; W_up]: a program computes gate row n and up row n + N/2 and stores
            silu(g) * u (one launch, N/2 outputs)
  residual  y = r + x W^T

Configurations per matrix shape (CONFIG) are the best of an H200 sweep (benchmarks/weights_gpu.md);
`pick` falls back on a rule for other shapes.
"""
from __future__ import annotations

import torch

_K = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(x_ptr, q_ptr, s_ptr, o_ptr, y_ptr, r_ptr, N, K, NGROUPS, ROWB, GPS,
                    BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr,
                    SWIGLU: tl.constexpr, RES: tl.constexpr, SPLIT: tl.constexpr):
        pid = tl.program_id(0)
        sid = tl.program_id(1)
        rows = pid * BN + tl.arange(0, BN)
        rmask = rows < N
        acc = tl.zeros([BN], dtype=tl.float32)
        acc2 = tl.zeros([BN], dtype=tl.float32)
        g_lo = sid * GPS
        for g0 in range(g_lo, g_lo + GPS, NG):
            gi = g0 + tl.arange(0, NG)
            gmask = gi < NGROUPS
            m2 = rmask[:, None] & gmask[None, :]
            if BITS == 4:
                j = tl.arange(0, G // 2)
                k = gi[:, None] * G + 2 * j[None, :]                                  # [NG, G/2]
                xe = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                xo = tl.load(x_ptr + k + 1, mask=k + 1 < K, other=0.0).to(tl.float32)
                xs = tl.sum(xe + xo, axis=1)                                          # [NG]
                boff = gi[:, None] * (G // 2) + j[None, :]
                qb = tl.load(q_ptr + rows[:, None, None] * ROWB + boff[None, :, :],
                             mask=m2[:, :, None], other=0)                            # [BN, NG, G/2]
                dot = tl.sum((qb & 15).to(tl.float32) * xe[None, :, :]
                             + (qb >> 4).to(tl.float32) * xo[None, :, :], axis=2)     # [BN, NG]
                if SWIGLU:
                    qb2 = tl.load(q_ptr + (rows + N)[:, None, None] * ROWB + boff[None, :, :],
                                  mask=m2[:, :, None], other=0)
                    dot2 = tl.sum((qb2 & 15).to(tl.float32) * xe[None, :, :]
                                  + (qb2 >> 4).to(tl.float32) * xo[None, :, :], axis=2)
            else:
                j = tl.arange(0, G)
                k = gi[:, None] * G + j[None, :]                                      # [NG, G]
                xk = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                xs = tl.sum(xk, axis=1)
                qb = tl.load(q_ptr + rows[:, None, None] * ROWB + k[None, :, :],
                             mask=m2[:, :, None], other=0)
                dot = tl.sum(qb.to(tl.float32) * xk[None, :, :], axis=2)
                if SWIGLU:
                    qb2 = tl.load(q_ptr + (rows + N)[:, None, None] * ROWB + k[None, :, :],
                                  mask=m2[:, :, None], other=0)
                    dot2 = tl.sum(qb2.to(tl.float32) * xk[None, :, :], axis=2)
            so = rows[:, None] * NGROUPS + gi[None, :]
            s = tl.load(s_ptr + so, mask=m2, other=0.0).to(tl.float32)
            o = tl.load(o_ptr + so, mask=m2, other=0.0).to(tl.float32)
            acc += tl.sum(dot * s + o * xs[None, :], axis=1)
            if SWIGLU:
                so2 = (rows + N)[:, None] * NGROUPS + gi[None, :]
                s2 = tl.load(s_ptr + so2, mask=m2, other=0.0).to(tl.float32)
                o2 = tl.load(o_ptr + so2, mask=m2, other=0.0).to(tl.float32)
                acc2 += tl.sum(dot2 * s2 + o2 * xs[None, :], axis=1)
        if SPLIT > 1:
            tl.store(y_ptr + sid * N + rows, acc, mask=rmask)            # fp32 partial sums
        else:
            if SWIGLU:
                acc = acc * tl.sigmoid(acc) * acc2
            if RES:
                acc += tl.load(r_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=rmask)

    return gemv_kernel


def _kernel():
    global _K
    if _K is None:
        _K = _build()
    return _K


# (rows N, inputs K) -> launch settings; filled from the H200 sweep (benchmarks/gpu/weights_gpu.py)
CONFIG: dict = {}


def pick(n: int, k: int, bits: int, group: int) -> dict:
    """Launch settings for an [n, k] weight: the sweep's where it measured this shape, else a rule:
    ~1/4 KiB of codes a row an iteration, 8 rows a program, the input split while there are fewer
    than ~1024 programs."""
    c = CONFIG.get((n, k, bits, group))
    if c is not None:
        return dict(c)
    ng = max(1, min(_pow2_floor(256 * 8 // (group * bits)), _pow2_ceil(-(-k // group))))
    bn = 8
    split = 1
    groups = -(-k // group)
    while -(-n // bn) * split < 1024 and groups // (split * 2) >= ng and split < 16:
        split *= 2
    return dict(BN=bn, NG=ng, SPLIT=split, num_warps=4)


def _pow2_floor(n: int) -> int:
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


def _pow2_ceil(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def gemv(x: torch.Tensor, w, swiglu: bool = False, residual=None, out=None, config=None) -> torch.Tensor:
    """x (1, K) or (K,) -> (1, N) (swiglu: (1, N / 2)) in x's dtype; w a PackedLinear on x's device."""
    xf = x.reshape(-1)
    if xf.numel() != w.k:
        raise ValueError(f"gemv: x has {xf.numel()} inputs, the weight takes {w.k}")
    n = w.n // 2 if swiglu else w.n
    c = dict(config) if config else pick(w.n, w.k, w.bits, w.group)
    split = c.pop("SPLIT", 1)
    if swiglu and split > 1:
        split = 1                      # the fused product needs whole sums
    gps = -(-w.groups // split)
    gps = -(-gps // c["NG"]) * c["NG"]
    split = -(-w.groups // gps)
    if split > 1:
        part = torch.empty(split, n, device=x.device, dtype=torch.float32)
        _kernel()[(-(-n // c["BN"]), split)](xf, w.q, w.scale, w.offset, part, part, n, w.k, w.groups,
                                            w.q.shape[1], gps, BITS=w.bits, G=w.group, SWIGLU=False,
                                            RES=False, SPLIT=split, **c)
        y = part.sum(0, keepdim=True)
        if residual is not None:
            y = y + residual.reshape(1, -1).float()
        return y.to(x.dtype) if out is None else out.copy_(y)
    y = out if out is not None else torch.empty(1, n, device=x.device, dtype=x.dtype)
    r = residual.reshape(-1) if residual is not None else y
    _kernel()[(-(-n // c["BN"]), 1)](xf, w.q, w.scale, w.offset, y, r, n, w.k, w.groups, w.q.shape[1], gps,
                                    BITS=w.bits, G=w.group, SWIGLU=swiglu, RES=residual is not None,
                                    SPLIT=1, **c)
    return y
