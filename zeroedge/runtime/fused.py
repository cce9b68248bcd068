"""The elementwise work between the products of a torch step over rows (the serving engine's step,
and on CUDA the check of a draft by runtime.fast.Decoder.verify), fused into three Triton kernels
(imported lazily; CUDA, or Triton's CPU interpreter). At batch 16 an elementwise op is a
few microseconds of work but a kernel of its own, and even in a captured step each kernel costs a
few microseconds: a step at the llama-3.2-1b shape ran 457 kernels with these ops in torch, 202 with
them fused (benchmarks/serve.md).

    q = rope_store(qkv, cos, sin, K, V, slots, H, nkv)   # RoPE on q and k; k and v of the first
                                                         # len(slots) rows written at those slots
    x, n = add_rms_norm(x, y, w, eps)                    # x + y, then RMSNorm(x + y) * w
    a = silu_mul(gu)                                     # silu(g) * u, gu = [g | u] on its last dim

Each rounds where its torch form rounds (every product and sum to the tensors' dtype, the norm in
fp32; zeroedge.serve.batch's `_layers` and zeroedge.runtime.fast.TorchLinears): RoPE and the write
give torch's values bit for bit, the norm and the gate agree within an ulp (their sum and exp are
computed in another order). Each row is computed alone, so a row's result does not depend on the
others in its batch: a speculative verify row still equals the plain decode step at its position.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zeroedge.kv.decode_attention import _pow2
from zeroedge.runtime.fast import TorchLinears

_kernels = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr, s_slot, s_head, N,
                          H: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, HP: tl.constexpr,
                          KP: tl.constexpr):
        r = tl.program_id(0)
        d = tl.arange(0, HD)
        half = HD // 2
        dr = (d + half) % HD                                   # rotate_half: (-x[half:], x[:half])
        sign = tl.where(d < half, -1.0, 1.0)
        c = tl.load(cos_ptr + r * HD + d).to(tl.float32)
        s = tl.load(sin_ptr + r * HD + d).to(tl.float32)
        row = qkv_ptr + r * (H + 2 * NKV) * HD
        h = tl.arange(0, HP)
        hm = h < H + NKV                                       # the q heads, then the k heads
        x = tl.load(row + h[:, None] * HD + d[None, :], mask=hm[:, None], other=0.)
        xr = tl.load(row + h[:, None] * HD + dr[None, :], mask=hm[:, None], other=0.)
        dt = x.dtype
        a = (x.to(tl.float32) * c[None, :]).to(dt).to(tl.float32)
        b = ((xr.to(tl.float32) * sign[None, :]) * s[None, :]).to(dt).to(tl.float32)
        y = (a + b).to(dt)
        tl.store(q_ptr + (r * H + h[:, None]) * HD + d[None, :], y, mask=(h < H)[:, None])
        if r < N:
            slot = tl.load(slot_ptr + r).to(tl.int64)
            kh = h - H
            tl.store(k_ptr + slot * s_slot + kh[:, None] * s_head + d[None, :], y,
                     mask=((h >= H) & hm)[:, None])
            j = tl.arange(0, KP)
            jm = j < NKV
            v = tl.load(row + (H + NKV + j[:, None]) * HD + d[None, :], mask=jm[:, None], other=0.)
            tl.store(v_ptr + slot * s_slot + j[:, None] * s_head + d[None, :], v, mask=jm[:, None])

    @triton.jit
    def add_rms_norm_kernel(x_ptr, y_ptr, w_ptr, xo_ptr, n_ptr, eps, D: tl.constexpr, BD: tl.constexpr,
                            HAS_Y: tl.constexpr):
        r = tl.program_id(0)
        i = tl.arange(0, BD)
        im = i < D
        x = tl.load(x_ptr + r * D + i, mask=im, other=0.)
        dt = x.dtype
        if HAS_Y:
            x = (x.to(tl.float32) + tl.load(y_ptr + r * D + i, mask=im, other=0.).to(tl.float32)).to(dt)
            tl.store(xo_ptr + r * D + i, x, mask=im)
        xf = x.to(tl.float32)
        rs = tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)
        nrm = (xf * rs).to(dt).to(tl.float32)
        w = tl.load(w_ptr + i, mask=im, other=0.).to(tl.float32)
        tl.store(n_ptr + r * D + i, (nrm * w).to(dt), mask=im)

    @triton.jit
    def silu_mul_kernel(gu_ptr, out_ptr, F, BF: tl.constexpr):
        r = tl.program_id(0)
        i = tl.program_id(1) * BF + tl.arange(0, BF)
        im = i < F
        g = tl.load(gu_ptr + r * 2 * F + i, mask=im, other=0.)
        u = tl.load(gu_ptr + r * 2 * F + F + i, mask=im, other=0.)
        dt = g.dtype
        gf = g.to(tl.float32)
        a = (gf / (1.0 + tl.exp(-gf))).to(dt).to(tl.float32)
        tl.store(out_ptr + r * F + i, (a * u.to(tl.float32)).to(dt), mask=im)

    return rope_store_kernel, add_rms_norm_kernel, silu_mul_kernel


def _k():
    global _kernels
    if _kernels is None:
        _kernels = _build()
    return _kernels


def rope_store(qkv, cos, sin, k, v, slots, H: int, nkv: int):
    """qkv (M, (H + 2 nkv) * hd), cos / sin (M, hd) in qkv's dtype, k / v one layer's pool (slots,
    nkv, hd; contiguous along hd), slots (N,) int64, N <= M -> q (M, H, hd) after RoPE; the first N
    rows' k (after RoPE) and v written at their slots."""
    M = qkv.shape[0]
    hd = cos.shape[-1]
    if not (qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()) or k.stride(-1) != 1:
        raise ValueError("rope_store takes contiguous rows and a pool contiguous along the head size")
    q = torch.empty(M, H, hd, device=qkv.device, dtype=qkv.dtype)
    _k()[0][(M,)](qkv, cos, sin, q, k, v, slots, k.stride(0), k.stride(1), slots.numel(),
                  H=H, NKV=nkv, HD=hd, HP=_pow2(H + nkv), KP=_pow2(nkv), num_warps=4)
    return q


def add_rms_norm(x, y, w, eps: float):
    """-> (x + y, rms_norm(x + y) * w), each rounded to x's dtype (y None: (x, rms_norm(x) * w));
    rows of x (M, D), contiguous."""
    M, D = x.shape
    xo = torch.empty_like(x) if y is not None else x
    n = torch.empty_like(x)
    _k()[1][(M,)](x, y if y is not None else x, w, xo, n, float(eps), D=D, BD=_pow2(D), HAS_Y=y is not None,
                  num_warps=4)
    return xo, n


def silu_mul(gu):
    """gu (M, 2 n) = [g | u] -> silu(g) * u (M, n)."""
    M, n = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(M, n, device=gu.device, dtype=gu.dtype)
    block = min(1024, _pow2(n))
    _k()[2][(M, -(-n // block))](gu, out, n, BF=block, num_warps=4)
    return out


class FusedLinears(TorchLinears):
    """TorchLinears (zeroedge.runtime.fast) with each residual add, RMSNorm and SwiGLU gate one of
    the kernels above. invariant: the products (the LM head's too, after the final norm in
    add_rms_norm) through zeroedge.runtime.row_products, so every row is computed alike whatever the
    number of rows; else torch's (cuBLAS picks its kernel by the number of rows)."""

    def __init__(self, model, invariant: bool = False):
        super().__init__(model)
        self.invariant = invariant
        if invariant:
            from zeroedge.runtime import row_products

            self._product = row_products.linear
        else:
            self._product = F.linear

    def boundary(self, li: int, x, o=None):
        y, mm = None, self._product
        if li > 0:                               # layer li-1's output side; its last residual add
            w = self.W[li - 1]                   # goes with layer li's norm
            x, n = add_rms_norm(x, mm(o, w["wo"]), w["ln2"], w["eps2"])
            y = mm(silu_mul(mm(n, w["w13"])), w["w2"])
        if li == self.L:
            return x + y, None
        w = self.W[li]
        x, n = add_rms_norm(x, y, w["ln1"], w["eps1"])
        return x, mm(n, w["wqkv"], w["bqkv"])

    def head(self, x):
        if not self.invariant:
            return super().head(x)
        norm = self.m.norm
        return self._product(add_rms_norm(x.contiguous(), None, norm.weight, norm.eps)[1], self.m.lm_head.weight,
                             self.m.lm_head.bias)
