"""Triton kernels for the GPU decode loops (imported lazily; CUDA only), with torch references.

`sketch_page_lse(qr, codes, scales, page_size)`: for every kv head h, query head g of its group
and page p, the log-sum-exp over the page's tokens of qr[h, g] . (code[h, t] * scale[h, p]): the
sketch's page score, fused so the packed int4 codes are read once and nothing per token is
written. codes: (nkv, P, r/2) uint8, two signed 4-bit codes a byte (low nibble = even direction),
stored with +8 offset; scales: (nkv, n, r).
"""
from __future__ import annotations

import torch

_kernel = None


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """signed codes in [-7, 7] (..., r) -> (..., r/2) uint8."""
    u = (codes.to(torch.int16) + 8).to(torch.uint8)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    lo = (packed & 0xF).to(torch.int16) - 8
    hi = (packed >> 4).to(torch.int16) - 8
    return torch.stack([lo, hi], -1).flatten(-2)


def sketch_page_lse_ref(qr, codes, scales, page_size):
    """qr (nkv, grp, r) fp32 -> (nkv, grp, n) fp32."""
    nkv, P, r2 = codes.shape
    r = 2 * r2
    n = P // page_size
    c = unpack_int4(codes).view(nkv, n, page_size, r).float() * scales.float().view(nkv, n, 1, r)
    s = torch.einsum("hgr,hnpr->hgnp", qr.float(), c)
    return s.logsumexp(-1)


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def k(qr_ptr, codes_ptr, scales_ptr, out_ptr, P, n,
          GRP: tl.constexpr, R2: tl.constexpr, PS: tl.constexpr, PB: tl.constexpr):
        h = tl.program_id(0)
        pb = tl.program_id(1)
        pages = pb * PB + tl.arange(0, PB)
        pmask = pages < n
        rr = tl.arange(0, R2)
        toks = pages[:, None] * PS + tl.arange(0, PS)[None, :]
        b = tl.load(codes_ptr + h * P * R2 + toks[:, :, None] * R2 + rr[None, None, :],
                    mask=pmask[:, None, None], other=136)          # 0x88 = codes 0, 0
        lo = (b & 15).to(tl.float32) - 8.0
        hi = (b >> 4).to(tl.float32) - 8.0
        sbase = scales_ptr + h * n * 2 * R2 + pages[:, None] * 2 * R2
        se = tl.load(sbase + 2 * rr[None, :], mask=pmask[:, None], other=0).to(tl.float32)
        so = tl.load(sbase + 2 * rr[None, :] + 1, mask=pmask[:, None], other=0).to(tl.float32)
        lo = lo * se[:, None, :]
        hi = hi * so[:, None, :]
        for g in tl.static_range(GRP):
            qe = tl.load(qr_ptr + (h * GRP + g) * 2 * R2 + 2 * rr).to(tl.float32)
            qo = tl.load(qr_ptr + (h * GRP + g) * 2 * R2 + 2 * rr + 1).to(tl.float32)
            s = tl.sum(lo * qe[None, None, :] + hi * qo[None, None, :], axis=2)
            m = tl.max(s, axis=1)
            l = m + tl.log(tl.sum(tl.exp(s - m[:, None]), axis=1))
            tl.store(out_ptr + (h * GRP + g) * n + pages, l, mask=pmask)

    return k


def sketch_page_lse(qr, codes, scales, page_size, out=None, pages_per_block: int = 16):
    global _kernel
    if not codes.is_cuda:
        return sketch_page_lse_ref(qr, codes, scales, page_size)
    if _kernel is None:
        _kernel = _build()
    nkv, P, r2 = codes.shape
    grp = qr.shape[1]
    n = P // page_size
    if out is None:
        out = torch.empty(nkv, grp, n, device=codes.device, dtype=torch.float32)
    grid = (nkv, (n + pages_per_block - 1) // pages_per_block)
    _kernel[grid](qr.contiguous(), codes.contiguous(), scales.contiguous(), out, P, n,
                  GRP=grp, R2=r2, PS=page_size, PB=pages_per_block)
    return out
