"""One decode step's attention over a static KV cache in two Triton kernels (imported lazily; CUDA only),
with a torch reference.

`rope_attend(qkv, cos, sin, pos, kv, H, shares)`: qkv is the q/k/v GEMV's raw output for the new token
((H + 2 nkv) * hd, before RoPE); cos / sin the decoder's tables (max_len, hd), sin with rotate_half's
sign folded in; pos a one-element device tensor; kv the layer's cache (2, nkv, max_len, hd). The split
kernel applies RoPE to q and the new key, writes the new key and value at `pos`, and lets each of S
programs a kv head attend over its share of positions 0..pos for every query head of the group
(flash-decoding: a running max, sum and weighted value per share); the combine kernel merges the S
shares into (H, hd). The shares adapt to `pos` inside the kernel, so one launch shape serves every
position and the pair captures in a CUDA graph. `at` (a device index, default pos) puts the new token at
another cache index than its RoPE position and attends over 0..at: the thermal window
(zeroedge.kv.attention) keeps its tokens in slot order; `q_out` receives the query after RoPE. Before: RoPE, the cache write, the mask and SDPA were
~10 small kernels a layer. (Merging the shares in the split kernel -- the last program of a kv head,
by an atomic counter -- measured slower on the H200: 16.1 against 12.7 us a layer at 8K.)
"""
from __future__ import annotations

import math
import os

import torch

SPLITS = None     # programs a kv head; None: default_splits
BLOCK = 64        # positions a program reads at a time
WARPS, STAGES = 4, 3

_kernels = None


def default_splits(max_len: int) -> int:
    """Programs a kv head for a cache of max_len positions: the H200 sweep's best whole decode step
    (benchmarks/gpu/decode_attention_gpu.py) is 32 at 8K and 64 at 128K (32 there is 6 % slower);
    at 32K they are within 1 %."""
    return SPLITS or (64 if max_len > 16384 else 32)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def rope_attend_ref(qkv, cos, sin, pos: int, kv, H: int):
    """The torch reference: writes the new key / value into kv at pos; returns (H, hd)."""
    nkv, hd = kv.shape[1], kv.shape[3]
    x = qkv.reshape(H + 2 * nkv, hd).float()
    qk = x[: H + nkv] * cos[pos].float() + x[: H + nkv].roll(hd // 2, -1) * sin[pos].float()
    kv[0, :, pos] = qk[H:].to(kv.dtype)
    kv[1, :, pos] = x[H + nkv:].to(kv.dtype)
    q = qk[:H].to(kv.dtype).float().view(nkv, H // nkv, hd)
    K, V = kv[0, :, : pos + 1].float(), kv[1, :, : pos + 1].float()
    p = torch.softmax(q @ K.transpose(1, 2) / math.sqrt(hd), -1)
    return (p @ V).reshape(H, hd).to(kv.dtype)


def triton_runs(device: torch.device, hd: int, interpreter: bool = False) -> bool:
    """Triton kernels run here: a CUDA device (or, when asked, Triton's CPU interpreter) and a head
    size tl.dot takes (a power of two >= 16)."""
    on_device = ((device.type == "cuda" and torch.version.hip is None)
                 or (interpreter and os.environ.get("TRITON_INTERPRET") == "1"))
    if not on_device or hd < 16 or hd & (hd - 1):
        return False
    try:
        import triton
    except ImportError:
        return False
    return int(triton.__version__.split(".")[0]) >= 3


def choose(attn: str, nkv: int, length: int, hd: int, device, dtype) -> str:
    """The attention a decoder runs over a cache of `length` positions: "auto" is "triton" for
    fp16 / bf16 where the kernels run and the cache is under 2^31 values a layer (the kernel's
    32-bit offsets), else "sdpa" (fp32 caches keep SDPA's exact fp32 products); an explicit "triton"
    that cannot run is refused. Other choices pass through."""
    fits = 2 * nkv * length * hd < 2 ** 31
    if attn == "auto":
        half = dtype in (torch.float16, torch.bfloat16)
        attn = "triton" if half and fits and triton_runs(torch.device(device), hd) else "sdpa"
    if attn == "triton" and not (fits and triton_runs(torch.device(device), hd, interpreter=True)):
        raise ValueError("attn='triton' needs a CUDA device with Triton >= 3, a power-of-two head size "
                         ">= 16 and a cache under 2^31 values a layer")
    return attn


def _build():
    import triton
    import triton.language as tl
    global pdl_start                  # a module global: Triton resolves a kernel's callees there

    from zeroedge.triton_launch import pdl_start

    @triton.jit
    def split_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, at_ptr, n_ptr, kv_ptr, s_kv, s_h, s_n, pm_ptr, pl_ptr,
                     pacc_ptr, qout_ptr, scale_log2, S, H: tl.constexpr, NKV: tl.constexpr, GRP: tl.constexpr,
                     GP: tl.constexpr, HD: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
                     QOUT: tl.constexpr, HAS_N: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)      # zeroedge.triton_launch: no load or store before the previous kernel is done
        h = tl.program_id(0)
        s = tl.program_id(1)
        pos = tl.load(pos_ptr).to(tl.int32)                 # the new token's RoPE position
        at = tl.load(at_ptr).to(tl.int32)                   # its cache index
        if HAS_N:                                            # attend over cache indices 0..n-1
            n_att = tl.load(n_ptr).to(tl.int32)
        else:                                                # over 0..at
            n_att = at + 1
        chunk = tl.cdiv(tl.cdiv(n_att, S), BN) * BN         # every share a whole number of blocks
        start = s * chunk
        end = tl.minimum(start + chunk, n_att)
        d = tl.arange(0, HD)
        rd = (d + HD // 2) % HD                              # rotate_half's source (its sign is in sin)
        c = tl.load(cos_ptr + pos * HD + d).to(tl.float32)
        sn = tl.load(sin_ptr + pos * HD + d).to(tl.float32)
        g = tl.arange(0, GP)
        gm = g < GRP
        row = h * GRP + g
        q = tl.load(qkv_ptr + row[:, None] * HD + d[None, :], mask=gm[:, None], other=0.).to(tl.float32)
        qr = tl.load(qkv_ptr + row[:, None] * HD + rd[None, :], mask=gm[:, None], other=0.).to(tl.float32)
        dt = kv_ptr.dtype.element_ty
        q = (q * c[None, :] + qr * sn[None, :]).to(dt)       # rounded as the cache's keys are
        if QOUT:
            if s == 0:
                tl.store(qout_ptr + row[:, None] * HD + d[None, :], q, mask=gm[:, None])
        kn = (tl.load(qkv_ptr + (H + h) * HD + d).to(tl.float32) * c
              + tl.load(qkv_ptr + (H + h) * HD + rd).to(tl.float32) * sn).to(dt)
        vn = tl.load(qkv_ptr + (H + NKV + h) * HD + d).to(dt)
        kb = kv_ptr + h * s_h
        vb = kv_ptr + s_kv + h * s_h
        if (start <= at) & (at < end):                       # the share holding `at` writes the new token
            tl.store(kb + at * s_n + d, kn)
            tl.store(vb + at * s_n + d, vn)
        m = tl.full([GP], float("-inf"), tl.float32)
        lsum = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, HD], tl.float32)
        for n0 in range(start, end, BN):
            n = n0 + tl.arange(0, BN)
            nm = n < end
            new = (n == at)[:, None]                         # taken from registers, not the cache
            k = tl.where(new, kn[None, :], tl.load(kb + n[:, None] * s_n + d[None, :], mask=nm[:, None], other=0.))
            if IEEE:                                         # fp32 caches: no TF32 products
                sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
            else:
                sc = tl.dot(q, tl.trans(k)) * scale_log2
            sc = tl.where(nm[None, :], sc, float("-inf"))
            mn = tl.maximum(m, tl.max(sc, 1))
            p = tl.exp2(sc - mn[:, None])
            alpha = tl.exp2(m - mn)
            lsum = lsum * alpha + tl.sum(p, 1)
            v = tl.where(new, vn[None, :], tl.load(vb + n[:, None] * s_n + d[None, :], mask=nm[:, None], other=0.))
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(dt), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(dt), v)
            m = mn
        tl.store(pm_ptr + s * H + row, m, mask=gm)
        tl.store(pl_ptr + s * H + row, lsum, mask=gm)
        tl.store(pacc_ptr + (s * H + row[:, None]) * HD + d[None, :], acc, mask=gm[:, None])

    @triton.jit
    def combine_kernel(pm_ptr, pl_ptr, pacc_ptr, out_ptr, S, H: tl.constexpr, HD: tl.constexpr, SP: tl.constexpr,
                       PDL: tl.constexpr = False):
        pdl_start(PDL)
        hq = tl.program_id(0)
        si = tl.arange(0, SP)
        sm = si < S
        d = tl.arange(0, HD)
        m = tl.load(pm_ptr + si * H + hq, mask=sm, other=float("-inf"))
        w = tl.where(sm & (m > float("-inf")), tl.exp2(m - tl.max(m, 0)), 0.)   # empty shares weigh 0
        total = tl.sum(w * tl.load(pl_ptr + si * H + hq, mask=sm, other=0.), 0)
        acc = tl.load(pacc_ptr + (si[:, None] * H + hq) * HD + d[None, :], mask=sm[:, None], other=0.)
        o = tl.sum(w[:, None] * acc, 0) / total
        tl.store(out_ptr + hq * HD + d, o.to(out_ptr.dtype.element_ty))

    return split_kernel, combine_kernel


class Shares:
    """The split kernel's per-share buffers for H query heads (fp32; reused every layer and step)."""

    def __init__(self, H: int, hd: int, device, splits: int | None = None, max_len: int = 0):
        self.splits = splits = splits or default_splits(max_len)
        self.m = torch.empty(splits, H, device=device, dtype=torch.float32)
        self.l = torch.empty(splits, H, device=device, dtype=torch.float32)
        self.acc = torch.empty(splits, H, hd, device=device, dtype=torch.float32)


def rope_attend(qkv, cos, sin, pos, kv, H: int, shares: Shares, out=None, block: int | None = None, at=None,
                q_out=None, n=None):
    """The two kernels (see the module doc); kv (2, nkv, max_len, hd) with unit stride along hd;
    0 <= at < max_len (at: pos when None) and pos within the tables are the caller's to ensure
    (DenseAttention.before and ThermalAttention.before check them on the host: the kernel reads
    them on the device). n: a one-element device tensor, at < n <= max_len: attend over cache
    indices 0..n-1 instead of 0..at (a ring of slots: runtime.fast.DenseAttention's window). q_out: an
    (H, hd) tensor in kv's dtype that receives the query after RoPE. Returns out (H, hd) in kv's
    dtype."""
    global _kernels
    if _kernels is None:
        _kernels = _build()
    split, combine = _kernels
    from zeroedge.triton_launch import pdl

    launch = pdl(kv)
    nkv, L, hd = kv.shape[1], kv.shape[2], kv.shape[3]
    if H % nkv or hd < 16 or hd & (hd - 1) or kv.stride(3) != 1 or 2 * nkv * L * hd >= 2 ** 31:
        raise ValueError("rope_attend needs H a multiple of the kv heads, a power-of-two head size >= 16, "
                         "caches contiguous along it and under 2^31 values a layer (32-bit offsets)")
    if (qkv.numel() != (H + 2 * nkv) * hd or not qkv.is_contiguous() or shares.acc.shape[1:] != (H, hd)
            or cos.shape != sin.shape or cos.shape[1:] != (hd,) or not (cos.is_contiguous() and sin.is_contiguous())
            or (at is None and cos.shape[0] != L)
            or (q_out is not None and (q_out.shape != (H, hd) or not q_out.is_contiguous() or q_out.dtype != kv.dtype))):
        raise ValueError(f"rope_attend: q/k/v of {(H + 2 * nkv) * hd} values, cos / sin tables (positions, {hd}) "
                         f"covering the cache's {L}, shares for {H} heads of {hd} and q_out ({H}, {hd}) expected")
    grp = H // nkv
    if out is None:
        out = torch.empty(H, hd, device=kv.device, dtype=kv.dtype)
    S = shares.splits
    block = block or BLOCK
    at = pos if at is None else at
    split[(nkv, S)](qkv, cos, sin, pos, at, at if n is None else n, kv, kv.stride(0), kv.stride(1), kv.stride(2),
                    shares.m, shares.l, shares.acc, out if q_out is None else q_out,
                    math.log2(math.e) / math.sqrt(hd), S, H=H, NKV=nkv, GRP=grp, GP=max(16, _pow2(grp)), HD=hd,
                    BN=block, IEEE=kv.dtype == torch.float32, QOUT=q_out is not None, HAS_N=n is not None,
                    num_warps=WARPS,
                    num_stages=STAGES, **launch)
    combine[(H,)](shares.m, shares.l, shares.acc, out, S, H=H, HD=hd, SP=_pow2(S), **launch)
    return out
