"""Gather-GEMV for decode on CUDA (Triton), with torch references that run anywhere.

Per layer, for B <= 8 decode tokens x (B, D) with z = x @ A (B, R) already computed:

  paths_gateup(x, z, bg, bu, wg, wu, threshold) -> act (B, F)
      score_j = max_b |silu(z_b . bg[:, j]) * (z_b . bu[:, j])|   (bu carries ||W_down[:, j]||)
      channel j is computed for every token of the batch when score_j >= threshold (the batch's
      union): act[:, j] = silu(x W_gate[j]) * (x W_up[j]); otherwise act[:, j] = 0 and rows j of
      W_gate and W_up are never loaded (the loads are predicated off).
  paths_down(act, wd_t) -> y (B, D)
      y = act @ wd_t over the channels with a nonzero act column only; wd_t = W_down^T (F, D), so
      each channel's weights are one contiguous row.

Everything is fp32 inside; weights and x in fp16/bf16/fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_K = None


def fold_down_norm(bu: torch.Tensor, wd_norm: torch.Tensor) -> torch.Tensor:
    return bu * wd_norm[None, :]


def paths_gateup_ref(x, z, bg, bu, wg, wu, threshold: float):
    zf = z.float()
    score = (F.silu(zf @ bg.float()) * (zf @ bu.float())).abs().amax(0)
    keep = score >= threshold
    act = F.silu(x.float() @ wg.float().T) * (x.float() @ wu.float().T)
    return (act * keep).to(x.dtype)


def paths_down_ref(act, wd_t):
    return (act.float() @ wd_t.float()).to(act.dtype)


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def gateup_kernel(x_ptr, z_ptr, bg_ptr, bu_ptr, wg_ptr, wu_ptr, act_ptr, thr, D, Fd,
                      B: tl.constexpr, BB: tl.constexpr, R: tl.constexpr, BF: tl.constexpr,
                      BK: tl.constexpr):
        pid = tl.program_id(0)
        offs_f = pid * BF + tl.arange(0, BF)
        fmask = offs_f < Fd
        offs_b = tl.arange(0, BB)
        bmask = offs_b < B
        offs_r = tl.arange(0, R)
        z = tl.load(z_ptr + offs_b[:, None] * R + offs_r[None, :], mask=bmask[:, None],
                    other=0.0).to(tl.float32)                                    # [BB, R]
        bg = tl.load(bg_ptr + offs_r[:, None] * Fd + offs_f[None, :], mask=fmask[None, :],
                     other=0.0).to(tl.float32)                                   # [R, BF]
        bu = tl.load(bu_ptr + offs_r[:, None] * Fd + offs_f[None, :], mask=fmask[None, :],
                     other=0.0).to(tl.float32)
        gh = tl.sum(z[:, :, None] * bg[None, :, :], axis=1)                      # [BB, BF]
        uh = tl.sum(z[:, :, None] * bu[None, :, :], axis=1)
        sc = tl.abs(gh * tl.sigmoid(gh) * uh)
        sc = tl.where(bmask[:, None], sc, 0.0)
        keep = (tl.max(sc, axis=0) >= thr) & fmask                               # [BF]
        if BB == 1:                      # batch 1: plain 2-D tiles, no batch axis
            keep1 = keep
            acc_g1 = tl.zeros([BF], dtype=tl.float32)
            acc_u1 = tl.zeros([BF], dtype=tl.float32)
            if tl.max(keep1.to(tl.int32), axis=0) > 0:
                for k in range(0, D, BK):
                    offs_k = k + tl.arange(0, BK)
                    xk = tl.load(x_ptr + offs_k).to(tl.float32)
                    wmask = keep1[:, None]
                    wg = tl.load(wg_ptr + offs_f[:, None] * D + offs_k[None, :], mask=wmask,
                                 other=0.0)
                    wu = tl.load(wu_ptr + offs_f[:, None] * D + offs_k[None, :], mask=wmask,
                                 other=0.0)
                    acc_g1 += tl.sum(wg.to(tl.float32) * xk[None, :], axis=1)
                    acc_u1 += tl.sum(wu.to(tl.float32) * xk[None, :], axis=1)
            act1 = acc_g1 * tl.sigmoid(acc_g1) * acc_u1
            act1 = tl.where(keep1, act1, 0.0)
            tl.store(act_ptr + offs_f, act1.to(act_ptr.dtype.element_ty), mask=fmask)
        else:
            acc_g = tl.zeros([BB, BF], dtype=tl.float32)
            acc_u = tl.zeros([BB, BF], dtype=tl.float32)
            if tl.max(keep.to(tl.int32), axis=0) > 0:
                for k in range(0, D, BK):
                    offs_k = k + tl.arange(0, BK)
                    xk = tl.load(x_ptr + offs_b[:, None] * D + offs_k[None, :],
                                 mask=bmask[:, None], other=0.0).to(tl.float32)  # [BB, BK]
                    wmask = keep[:, None]
                    wg = tl.load(wg_ptr + offs_f[:, None] * D + offs_k[None, :], mask=wmask,
                                 other=0.0).to(tl.float32)                       # [BF, BK]
                    wu = tl.load(wu_ptr + offs_f[:, None] * D + offs_k[None, :], mask=wmask,
                                 other=0.0).to(tl.float32)
                    acc_g += tl.sum(xk[:, None, :] * wg[None, :, :], axis=2)
                    acc_u += tl.sum(xk[:, None, :] * wu[None, :, :], axis=2)
            act = acc_g * tl.sigmoid(acc_g) * acc_u
            act = tl.where(keep[None, :], act, 0.0)
            tl.store(act_ptr + offs_b[:, None] * Fd + offs_f[None, :],
                     act.to(act_ptr.dtype.element_ty), mask=bmask[:, None] & fmask[None, :])

    @triton.jit
    def down_kernel(act_ptr, wd_ptr, part_ptr, D, Fd, FS,
                    B: tl.constexpr, BB: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr):
        pid_d = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_d = pid_d * BD + tl.arange(0, BD)
        offs_b = tl.arange(0, BB)
        bmask = offs_b < B
        f0 = pid_s * FS
        if BB == 1:
            acc1 = tl.zeros([BD], dtype=tl.float32)
            for f in range(f0, f0 + FS, BF):
                offs_f = f + tl.arange(0, BF)
                fmask = offs_f < Fd
                a1 = tl.load(act_ptr + offs_f, mask=fmask, other=0.0).to(tl.float32)   # [BF]
                live1 = (a1 != 0) & fmask
                w1 = tl.load(wd_ptr + offs_f[:, None] * D + offs_d[None, :], mask=live1[:, None],
                             other=0.0)
                acc1 += tl.sum(a1[:, None] * w1.to(tl.float32), axis=0)
            tl.store(part_ptr + pid_s * D + offs_d, acc1)
        else:
            acc = tl.zeros([BB, BD], dtype=tl.float32)
            for f in range(f0, f0 + FS, BF):
                offs_f = f + tl.arange(0, BF)
                fmask = offs_f < Fd
                a = tl.load(act_ptr + offs_b[:, None] * Fd + offs_f[None, :],
                            mask=bmask[:, None] & fmask[None, :], other=0.0).to(tl.float32)
                live = (tl.max(tl.abs(a), axis=0) > 0) & fmask                     # [BF]
                w = tl.load(wd_ptr + offs_f[:, None] * D + offs_d[None, :], mask=live[:, None],
                            other=0.0).to(tl.float32)                             # [BF, BD]
                acc += tl.sum(a[:, :, None] * w[None, :, :], axis=1)
            tl.store(part_ptr + pid_s * (B * D) + offs_b[:, None] * D + offs_d[None, :], acc,
                     mask=bmask[:, None])

    @triton.jit
    def down_rows_kernel(act_ptr, wd_ptr, out_ptr, D, FS, BF: tl.constexpr, BD: tl.constexpr,
                         ATOMIC: tl.constexpr):
        # batch 1 as a plain GEMV: a thread owns columns, rows are walked BF at a time (their loads
        # all in flight, predicated off for dead channels); partial sums meet by atomic adds
        # (ATOMIC) or go to out[pid_s] for a sum afterwards
        pid_d = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_d = pid_d * BD + tl.arange(0, BD)
        dmask = offs_d < D
        acc = tl.zeros([BD], dtype=tl.float32)
        f0 = pid_s * FS
        for f in range(f0, f0 + FS, BF):
            for r in tl.static_range(BF):
                a = tl.load(act_ptr + f + r).to(tl.float32)
                w = tl.load(wd_ptr + (f + r) * D + offs_d, mask=dmask & (a != 0.0), other=0.0)
                acc += a * w.to(tl.float32)
        if ATOMIC:
            tl.atomic_add(out_ptr + offs_d, acc, mask=dmask)
        else:
            tl.store(out_ptr + pid_s * D + offs_d, acc, mask=dmask)

    return gateup_kernel, down_kernel, down_rows_kernel


def _kernels():
    global _K
    if _K is None:
        _K = _build()
    return _K


def _pow2(n):
    p = 1
    while p < n:
        p *= 2
    return p


# Best of the H200 sweeps at llama-3.2-1b shapes (benchmarks/paths.md); other shapes shrink the
# tiles to powers of two that divide them (_fit).
CONFIG = {"gateup": dict(BF=2, BK=512, num_warps=1),
          "down": dict(splits=256, BF=8, BD=2048, num_warps=8, kind="rows")}


def _fit(n: int, want: int) -> int:
    """The largest power of two <= want that divides n (1 at worst)."""
    p = 1
    while p * 2 <= want and n % (p * 2) == 0:
        p *= 2
    return p


def paths_gateup(x, z, bg, bu, wg, wu, threshold: float, out=None, BF=None, BK=None,
                 num_warps=None):
    c = CONFIG["gateup"]
    BF, BK, num_warps = BF or c["BF"], BK or c["BK"], num_warps or c["num_warps"]
    B, D = x.shape
    Fd, R = wg.shape[0], bg.shape[0]
    BK = _fit(D, BK)
    if R != _pow2(R) or D % BK or B > 8:
        raise ValueError(f"paths_gateup needs R a power of 2 (got {R}), D % {BK} == 0, B <= 8")
    act = out if out is not None else torch.empty(B, Fd, device=x.device, dtype=x.dtype)
    gk = _kernels()[0]
    gk[(triton_cdiv(Fd, BF),)](x, z, bg, bu, wg, wu, act, float(threshold), D, Fd, B=B,
                               BB=max(_pow2(B), 1), R=R, BF=BF, BK=BK, num_warps=num_warps)
    return act


def paths_down(act, wd_t, part=None, splits=None, BF=None, BD=None, num_warps=None, kind=None):
    """kind "tile": (splits, B, D) fp32 partial sums of [BF, BD] tiles, then a sum; kind "rows"
    (batch 1): a column-per-thread GEMV with atomic adds into part[0] (zeroed here); kind
    "rows_part" (batch 1): the same GEMV writing (splits, 1, D) partial sums, then a sum."""
    c = CONFIG["down"]
    splits, BF = splits or c["splits"], BF or c["BF"]
    BD, num_warps = BD or c["BD"], num_warps or c["num_warps"]
    kind = kind or c.get("kind", "tile")
    B, Fd = act.shape
    D = wd_t.shape[1]
    BD, BF = _fit(D, BD), _fit(Fd, BF)
    while splits > 1 and Fd % (splits * BF):
        splits //= 2
    if part is not None and part.shape[0] < splits:
        raise ValueError(f"paths_down: part has {part.shape[0]} splits, needs {splits}")
    if D % BD or Fd % (splits * BF):
        raise ValueError(f"paths_down needs D % {BD} == 0 and F % ({splits} * {BF}) == 0")
    part = part if part is not None else torch.empty(splits, B, D, device=act.device,
                                                     dtype=torch.float32)
    _, dk, rk = _kernels()
    if kind == "rows" and B == 1:
        acc = part[0]
        acc.zero_()
        rk[(D // BD, splits)](act, wd_t, acc, D, Fd // splits, BF=BF, BD=BD, ATOMIC=True,
                              num_warps=num_warps)
        return acc.to(act.dtype)
    if kind == "rows_part" and B == 1:
        rk[(D // BD, splits)](act, wd_t, part, D, Fd // splits, BF=BF, BD=BD, ATOMIC=False,
                              num_warps=num_warps)
        return part[:splits].sum(0).to(act.dtype)
    dk[(D // BD, splits)](act, wd_t, part, D, Fd, Fd // splits, B=B, BB=max(_pow2(B), 1),
                          BF=BF, BD=BD, num_warps=num_warps)
    return part[:splits].sum(0).to(act.dtype)


def triton_cdiv(a, b):
    return (a + b - 1) // b
