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

    @triton.jit
    def kq(q_ptr, a_ptr, inv_sqrt, codes_ptr, scales_ptr, out_ptr, P, n,
           GRP: tl.constexpr, HD: tl.constexpr, R2: tl.constexpr, PS: tl.constexpr, PB: tl.constexpr):
        # the same, with qr = q @ A / sqrt(hd) computed here (no separate cast / bmm / scale kernels);
        # the code loads repeat k's: a shared @triton.jit helper would have to live at module level,
        # and this module imports triton lazily
        h = tl.program_id(0)
        pb = tl.program_id(1)
        pages = pb * PB + tl.arange(0, PB)
        pmask = pages < n
        rr = tl.arange(0, R2)
        dd = tl.arange(0, HD)
        toks = pages[:, None] * PS + tl.arange(0, PS)[None, :]
        b = tl.load(codes_ptr + h * P * R2 + toks[:, :, None] * R2 + rr[None, None, :],
                    mask=pmask[:, None, None], other=136)
        lo = (b & 15).to(tl.float32) - 8.0
        hi = (b >> 4).to(tl.float32) - 8.0
        sbase = scales_ptr + h * n * 2 * R2 + pages[:, None] * 2 * R2
        se = tl.load(sbase + 2 * rr[None, :], mask=pmask[:, None], other=0).to(tl.float32)
        so = tl.load(sbase + 2 * rr[None, :] + 1, mask=pmask[:, None], other=0).to(tl.float32)
        lo = lo * se[:, None, :]
        hi = hi * so[:, None, :]
        abase = a_ptr + h * HD * 2 * R2 + dd[:, None] * 2 * R2
        ae = tl.load(abase + 2 * rr[None, :])                          # [HD, R2] fp32
        ao = tl.load(abase + 2 * rr[None, :] + 1)
        for g in tl.static_range(GRP):
            qv = tl.load(q_ptr + (h * GRP + g) * HD + dd).to(tl.float32)
            qe = tl.sum(qv[:, None] * ae, axis=0) * inv_sqrt
            qo = tl.sum(qv[:, None] * ao, axis=0) * inv_sqrt
            s = tl.sum(lo * qe[None, None, :] + hi * qo[None, None, :], axis=2)
            m = tl.max(s, axis=1)
            l = m + tl.log(tl.sum(tl.exp(s - m[:, None]), axis=1))
            tl.store(out_ptr + (h * GRP + g) * n + pages, l, mask=pmask)

    return k, kq


def sketch_page_lse_q(q, A, codes, scales, page_size, out=None, pages_per_block: int = 16):
    """q (H, hd) queries of one step, A (nkv, hd, r) fp32 query bases -> (nkv, grp, n): the same as
    sketch_page_lse(q @ A / sqrt(hd), ...), one kernel on CUDA."""
    global _kernel
    nkv, P, r2 = codes.shape
    hd = A.shape[1]
    grp = q.shape[0] // nkv
    # fused only for up to 1024 pages: every program reloads A, which costs more than the two
    # extra kernels beyond that (H200: 17 vs 23 us a layer at 512 pages, 35 vs 32 at 2048, 75 vs
    # 56 at 8192; benchmarks/thermal_kv.md)
    if not codes.is_cuda or hd & (hd - 1) or r2 & (r2 - 1) or P // page_size > 1024:
        qr = torch.bmm(q.view(nkv, grp, hd).float(), A) / hd ** 0.5
        return sketch_page_lse(qr, codes, scales, page_size, out, pages_per_block)
    if _kernel is None:
        _kernel = _build()
    n = P // page_size
    if out is None:
        out = torch.empty(nkv, grp, n, device=codes.device, dtype=torch.float32)
    grid = (nkv, (n + pages_per_block - 1) // pages_per_block)
    _kernel[1][grid](q.contiguous(), A.contiguous(), 1.0 / hd ** 0.5, codes.contiguous(), scales.contiguous(),
                     out, P, n, GRP=grp, HD=hd, R2=r2, PS=page_size, PB=pages_per_block)
    return out


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
    _kernel[0][grid](qr.contiguous(), codes.contiguous(), scales.contiguous(), out, P, n,
                     GRP=grp, R2=r2, PS=page_size, PB=pages_per_block)
    return out


# ---------------------------------------------------------------------------------------------
# Page swap for the thermal decoder: one program per kv head turns the sketch's page scores into
# at most `fetch` swaps (best missing page in, worst resident page out, while the new one scores
# higher) and copies the fetched pages' K and V from the cold store straight into the freed slots.
# Replaces a top-k over every page plus ~25 small bookkeeping kernels a layer.

_swap_kernel = None


def page_scores_ref(pl, page_bias):
    """pl (nkv, grp, n) page log-sum-exps -> (nkv, n): per query head normalised over pages, the
    best query head of the group, plus the bias (-inf: never fetched)."""
    return (pl - pl.logsumexp(-1, keepdim=True)).amax(1) + page_bias


def swap_pages_ref(score, page_slot, slot_page, wk, wv, hk, hv, fetch: int):
    """In place. score (nkv, n); page_slot (nkv, n) slot or -1; slot_page (nkv, S);
    wk / wv (nkv, S, PE) slot pages of the window; hk / hv (nkv, n, PE) the cold store."""
    inf = float("inf")
    for h in range(score.shape[0]):
        sl = page_slot[h]
        ms = torch.where(sl < 0, score[h], -inf)
        rs = torch.where(sl >= 0, score[h], inf)
        for _ in range(fetch):
            bm, wr = int(ms.argmax()), int(rs.argmin())
            vm, vr = float(ms[bm]), float(rs[wr])
            ms[bm], rs[wr] = -inf, inf
            if vm > vr:
                s = int(sl[wr])
                sl[wr], sl[bm] = -1, s
                slot_page[h, s] = bm
                wk[h, s] = hk[h, bm]
                wv[h, s] = hv[h, bm]


def _build_swap():
    import triton
    import triton.language as tl

    @triton.jit
    def k(pl_ptr, bias_ptr, pslot_ptr, spage_ptr, wk_ptr, wv_ptr, hk_ptr, hv_ptr, n, S,
          w_head, GRP: tl.constexpr, NP: tl.constexpr, F: tl.constexpr, FP: tl.constexpr,
          PE: tl.constexpr, PEB: tl.constexpr):
        h = tl.program_id(0)
        offs = tl.arange(0, NP)
        m = offs < n
        sc = tl.full([NP], float("-inf"), tl.float32)
        for g in tl.static_range(GRP):
            v = tl.load(pl_ptr + (h * GRP + g) * n + offs, mask=m, other=float("-inf"))
            mx = tl.max(v, 0)
            lse = mx + tl.log(tl.sum(tl.exp(v - mx), 0))
            sc = tl.maximum(sc, v - lse)
        sc = sc + tl.load(bias_ptr + offs, mask=m, other=float("-inf"))
        slot = tl.load(pslot_ptr + h * n + offs, mask=m, other=-1)
        ms = tl.where(m & (slot < 0), sc, float("-inf"))
        rs = tl.where(m & (slot >= 0), sc, float("inf"))
        # decisions first (a swap's page pair into slot i of src / dst), then every copy at once
        fi = tl.arange(0, FP)
        src = tl.full([FP], -1, tl.int64)
        dst = tl.full([FP], -1, tl.int64)
        for i in tl.static_range(F):
            bm = tl.argmax(ms, 0)
            vm = tl.max(ms, 0)
            wr = tl.argmin(rs, 0)
            vr = tl.min(rs, 0)
            ms = tl.where(offs == bm, float("-inf"), ms)
            rs = tl.where(offs == wr, float("inf"), rs)
            if vm > vr:
                s = tl.sum(tl.where(offs == wr, slot, 0), 0)
                tl.store(pslot_ptr + h * n + wr, -1)
                tl.store(pslot_ptr + h * n + bm, s)
                tl.store(spage_ptr + h * S + s, bm)
                src = tl.where(fi == i, bm, src)
                dst = tl.where(fi == i, s, dst)
        e = tl.arange(0, PEB)
        ok = (src >= 0)[:, None] & (e < PE)[None, :]
        so = (h * n + src)[:, None] * PE + e[None, :]
        do = (h * w_head + dst * PE)[:, None] + e[None, :]
        kv = tl.load(hk_ptr + so, mask=ok)
        vv = tl.load(hv_ptr + so, mask=ok)
        tl.store(wk_ptr + do, kv, mask=ok)
        tl.store(wv_ptr + do, vv, mask=ok)

    return k


def swap_pages(pl, page_bias, page_slot, slot_page, wk, wv, hk, hv, fetch: int):
    """pl (nkv, grp, n) from sketch_page_lse; the rest as in swap_pages_ref, except wk / wv are the
    slot part of the window as (nkv, S, PE) views with any head stride (contiguous within a head).
    CUDA: one fused Triton kernel; elsewhere the torch reference."""
    global _swap_kernel
    if not pl.is_cuda:
        swap_pages_ref(page_scores_ref(pl, page_bias), page_slot, slot_page, wk, wv, hk, hv, fetch)
        return
    if _swap_kernel is None:
        _swap_kernel = _build_swap()
    nkv, grp, n = pl.shape
    S, PE = slot_page.shape[1], wk.shape[2]
    if wk.stride(1) != PE or wk.stride(2) != 1 or wk.stride() != wv.stride():
        raise ValueError("swap_pages: window slot pages must be contiguous within a head")
    NP = 1 << max(0, (n - 1).bit_length())
    _swap_kernel[(nkv,)](pl, page_bias, page_slot, slot_page, wk, wv, hk, hv, n, S, wk.stride(0),
                         GRP=grp, NP=NP, F=int(fetch), FP=1 << max(0, (int(fetch) - 1).bit_length()), PE=PE,
                         PEB=1 << max(0, (PE - 1).bit_length()),
                         num_warps=min(16, max(4, NP // 512)))
