"""Decode attention for many sequences over a paged KV pool in two Triton kernels (imported lazily;
CUDA, or Triton's CPU interpreter), with a torch reference.

`paged_attend(q, k, v, pages, lens, page_size)`: q (B, H, hd) holds one query row each (after RoPE),
k / v the pool of one layer (slots, nkv, hd; any strides but along hd: a dense cache (nkv, positions,
hd) passed transposed is one page of all its positions), pages (B, W) int32 each row's page table
(or (B, nkv, W), a table a kv head: thermal KV's choice of pages differs by head), lens (B) int32 the
positions each row attends to (0..len-1, len >= 1). The split kernel lets each
of SPLITS programs of a (row, kv head) read its share of the row's positions through the page table
and keep a running max, sum and weighted value for every query head of the group (flash-decoding);
the combine kernel merges the shares into (B, H, hd). Nothing is gathered: each key and value is
read once, where it lies. The shares adapt to each row's length inside the kernel, so one launch
shape serves every length and captures in a CUDA graph, and a row's result depends only on its own
query, pages and length: a speculative draft's verify rows equal the decode rows plain steps give,
bit for bit.

`paged_sketch_lse`: thermal KV's page scores (zeroedge.serve.thermal) from the key sketch kept beside
the pool, one kernel for every row.
"""
from __future__ import annotations

import math

import torch

from zeroedge.kv.decode_attention import _pow2

SPLITS = 16       # programs a (row, kv head)
BLOCK = 64        # positions a program reads at a time
WARPS, STAGES = 4, 2

_kernels = None


def paged_attend_ref(q, k, v, pages, lens, page_size: int):
    """The torch reference (fp32 products): -> (B, H, hd) in q's dtype."""
    B, H, hd = q.shape
    nkv = k.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        n = int(lens[b])
        pos = torch.arange(n, device=q.device)
        tab = pages[b].long().view(-1, pages.shape[-1]).expand(nkv, -1)             # (nkv, W)
        slot = tab[:, pos // page_size] * page_size + pos % page_size               # (nkv, n)
        heads = torch.arange(nkv, device=q.device)[:, None]
        K, V = k[slot, heads].float(), v[slot, heads].float()                        # (nkv, n, hd)
        qg = q[b].float().view(nkv, H // nkv, hd)
        p = torch.softmax(qg @ K.transpose(1, 2) / math.sqrt(hd), -1)
        out[b] = (p @ V).reshape(H, hd).to(q.dtype)
    return out


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(q_ptr, k_ptr, v_ptr, s_n, s_h, pages_ptr, s_pb, s_ph, lens_ptr, pm_ptr, pl_ptr, pacc_ptr,
                     scale_log2, S,
                     H: tl.constexpr, NKV: tl.constexpr, GRP: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr,
                     PS: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
        bh = tl.program_id(0)
        s = tl.program_id(1)
        b = bh // NKV
        h = bh % NKV
        n_len = tl.load(lens_ptr + b).to(tl.int32)
        chunk = tl.cdiv(tl.cdiv(n_len, S), BN) * BN         # every share a whole number of blocks
        start = s * chunk
        end = tl.minimum(start + chunk, n_len)
        d = tl.arange(0, HD)
        g = tl.arange(0, GP)
        gm = g < GRP
        row = h * GRP + g
        q = tl.load(q_ptr + (b * H + row[:, None]) * HD + d[None, :], mask=gm[:, None], other=0.)
        m = tl.full([GP], float("-inf"), tl.float32)
        lsum = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, HD], tl.float32)
        for n0 in range(start, end, BN):
            n = n0 + tl.arange(0, BN)
            nm = n < end
            page = tl.load(pages_ptr + b * s_pb + h * s_ph + n // PS, mask=nm, other=0).to(tl.int64)
            at = (page * PS + n % PS) * s_n + h * s_h
            k = tl.load(k_ptr + at[:, None] + d[None, :], mask=nm[:, None], other=0.)
            if IEEE:                                         # fp32 pools: no TF32 products
                sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
            else:
                sc = tl.dot(q, tl.trans(k)) * scale_log2
            sc = tl.where(nm[None, :], sc, float("-inf"))
            mn = tl.maximum(m, tl.max(sc, 1))
            p = tl.exp2(sc - mn[:, None])
            alpha = tl.exp2(m - mn)
            lsum = lsum * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + at[:, None] + d[None, :], mask=nm[:, None], other=0.)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = mn
        at_s = (b * S + s) * H + row
        tl.store(pm_ptr + at_s, m, mask=gm)
        tl.store(pl_ptr + at_s, lsum, mask=gm)
        tl.store(pacc_ptr + at_s[:, None] * HD + d[None, :], acc, mask=gm[:, None])

    @triton.jit
    def combine_kernel(pm_ptr, pl_ptr, pacc_ptr, out_ptr, S, H: tl.constexpr, HD: tl.constexpr,
                       SP: tl.constexpr):
        bq = tl.program_id(0)                                # b * H + query head
        b = bq // H
        hq = bq % H
        si = tl.arange(0, SP)
        sm = si < S
        d = tl.arange(0, HD)
        at = (b * S + si) * H + hq
        m = tl.load(pm_ptr + at, mask=sm, other=float("-inf"))
        w = tl.where(sm & (m > float("-inf")), tl.exp2(m - tl.max(m, 0)), 0.)   # empty shares weigh 0
        total = tl.sum(w * tl.load(pl_ptr + at, mask=sm, other=0.), 0)
        acc = tl.load(pacc_ptr + at[:, None] * HD + d[None, :], mask=sm[:, None], other=0.)
        o = tl.sum(w[:, None] * acc, 0) / total
        tl.store(out_ptr + bq * HD + d, o.to(out_ptr.dtype.element_ty))

    return split_kernel, combine_kernel


def paged_attend(q, k, v, pages, lens, page_size: int, out=None, splits: int | None = None,
                 block: int | None = None):
    """The two kernels (see the module doc). The caller ensures every page id and length lies in the
    pool and the table (the kernel reads them on the device). Returns out (B, H, hd) in q's dtype."""
    global _kernels
    B, H, hd = q.shape
    nkv = k.shape[1]
    if (H % nkv or hd < 16 or hd & (hd - 1) or k.shape != v.shape or k.shape[2] != hd or q.dtype != k.dtype
            or k.stride() != v.stride() or k.stride(2) != 1
            or not (q.is_contiguous() and pages.is_contiguous())
            or pages.dtype != torch.int32 or lens.dtype != torch.int32 or pages.shape[0] != B
            or pages.dim() not in (2, 3) or (pages.dim() == 3 and pages.shape[1] != nkv) or lens.shape != (B,)):
        raise ValueError("paged_attend needs q (B, H, hd) and k / v (slots, nkv, hd) of one dtype and layout, "
                         "unit stride along hd, H a multiple of nkv, a power-of-two head size >= 16, int32 "
                         "pages (B, W) or (B, nkv, W) and lens (B,)")
    if _kernels is None:
        _kernels = _build()
    split, combine = _kernels
    S, BN = splits or SPLITS, block or BLOCK
    pm = torch.empty(B * S, H, device=q.device, dtype=torch.float32)
    pl = torch.empty_like(pm)
    pacc = torch.empty(B * S, H, hd, device=q.device, dtype=torch.float32)
    if out is None:
        out = torch.empty_like(q)
    grp = H // nkv
    s_ph = pages.stride(1) if pages.dim() == 3 else 0          # a table a kv head, or one for all
    split[(B * nkv, S)](q, k, v, k.stride(0), k.stride(1), pages, pages.stride(0), s_ph, lens, pm, pl, pacc,
                        math.log2(math.e) / math.sqrt(hd), S, H=H, NKV=nkv, GRP=grp, GP=max(16, _pow2(grp)),
                        HD=hd, PS=page_size, BN=BN, IEEE=q.dtype == torch.float32, num_warps=WARPS, num_stages=STAGES)
    combine[(B * H,)](pm, pl, pacc, out, S, H=H, HD=hd, SP=_pow2(S))
    return out


# ---------------------------------------------------------------------------------------------
# Page scores from the thermal key sketch over the same pool (zeroedge.serve.thermal): for each row,
# kv head, query head of its group and listed page, the log-sum-exp over the page's tokens of the
# sketch scores (qr . code[t]) * scale[t], codes being int4 pairs stored beside the pool's K and V.

SKETCH_PAGES = 16    # pages a scoring program reads
SKETCH_WARPS = 2     # (H100, llama-3.2-1b shape, 16 rows at 8K: 16 pages on 2 warps ~37 us a layer, the best
                     # of 8-64 pages on 1-8 warps: benchmarks/gpu/profile_serve_thermal.py)

_sketch_kernel = None


def paged_sketch_lse_ref(qr, codes, scales, pages, page_size: int):
    """qr (B, nkv, grp, r) fp32, codes (nkv, slots, r/2) uint8 (zeroedge.kv.kernels.pack_int4),
    scales (nkv, slots) fp16, pages (B, N) -> (B, nkv, grp, N) fp32."""
    from zeroedge.kv.kernels import unpack_int4

    B, N = pages.shape
    slot = (pages.long()[:, :, None] * page_size + torch.arange(page_size, device=qr.device)).view(-1)
    c = unpack_int4(codes.index_select(1, slot)).float() * scales.index_select(1, slot).float()[..., None]
    c = c.view(codes.shape[0], B, N, page_size, -1)
    return torch.einsum("bkgr,kbnpr->bkgnp", qr.float(), c).logsumexp(-1)


def _build_sketch():
    import triton
    import triton.language as tl

    @triton.jit
    def sketch_scores(qr_ptr, words_ptr, scales_ptr, pages_ptr, count_ptr, out_ptr, N, s_wh, s_sh,
                      NKV: tl.constexpr, GRP: tl.constexpr, GP: tl.constexpr, W: tl.constexpr, PS: tl.constexpr,
                      PB: tl.constexpr):
        bh = tl.program_id(0)
        b = bh // NKV
        h = bh % NKV
        pp = tl.program_id(1) * PB + tl.arange(0, PB)
        pm = pp < tl.minimum(N, tl.load(count_ptr + b))                # a row's pages past its count: unread
        page = tl.load(pages_ptr + b * N + pp, mask=pm, other=0).to(tl.int64)
        slot = page[:, None] * PS + tl.arange(0, PS)[None, :]           # (PB, PS)
        m8 = tl.arange(0, W)
        # a token's codes as W int32 words (8 signed nibbles each: direction 8 m + k in nibble k), one
        # thread's wide load; 0x88888888: zero codes past the count
        words = tl.load(words_ptr + h * s_wh + slot[:, :, None] * W + m8[None, None, :], mask=pm[:, None, None],
                        other=-2004318072)
        sc = tl.load(scales_ptr + h * s_sh + slot, mask=pm[:, None], other=0.).to(tl.float32)
        g = tl.arange(0, GP)
        gm = g < GRP
        q = qr_ptr + (bh * GRP + g[:, None]) * (8 * W) + 8 * m8[None, :]               # (GP, W)
        acc = tl.zeros([GP, PB, PS, W], tl.float32)
        for k in tl.static_range(8):           # each nibble for every query head of the group
            nib = ((words >> (4 * k)) & 15).to(tl.float32) - 8.
            acc += nib[None, :, :, :] * tl.load(q + k, mask=gm[:, None], other=0.)[:, None, None, :]
        s = tl.sum(acc, 3) * sc[None, :, :]                                              # (GP, PB, PS)
        m = tl.max(s, 2)
        lse = tl.log(tl.sum(tl.exp(s - m[:, :, None]), 2)) + m
        tl.store(out_ptr + (bh * GRP + g[:, None]) * N + pp[None, :], lse, mask=gm[:, None] & pm[None, :])

    return sketch_scores


def paged_sketch_lse(qr, codes, scales, pages, page_size: int, triton: bool = True, counts=None):
    """paged_sketch_lse_ref's result from one Triton kernel (triton=True; CUDA, or Triton's
    interpreter), reading each listed page's codes once; the caller ensures every page id lies in the
    pool. counts: optional (B,) pages of each row's list to score (the rest of its row is left
    unwritten). Else the torch reference."""
    global _sketch_kernel
    if not triton:
        return paged_sketch_lse_ref(qr, codes, scales, pages, page_size)
    B, nkv, grp, r = qr.shape
    N = pages.shape[1]
    if (r % 8 or page_size & (page_size - 1) or codes.shape[0] != nkv or codes.shape[2] != r // 2
            or codes.dtype != torch.uint8 or codes.stride(2) != 1 or codes.stride(1) != r // 2
            or codes.stride(0) % 4 or pages.dtype != torch.int32 or not pages.is_contiguous()
            or scales.shape != codes.shape[:2] or scales.stride(1) != 1):
        raise ValueError("paged_sketch_lse needs qr (B, nkv, grp, r) with r a multiple of 8, codes (nkv, slots, "
                         "r/2) uint8 and scales (nkv, slots), each kv head's slots in a row, int32 pages (B, N) "
                         "and a power-of-two page size")
    if _sketch_kernel is None:
        _sketch_kernel = _build_sketch()
    out = torch.empty(B, nkv, grp, N, device=qr.device, dtype=torch.float32)
    if counts is None:
        counts = torch.full((B,), N, device=qr.device, dtype=torch.int64)
    words = codes.view(torch.int32)            # the checks above: each token's codes whole words, in place
    _sketch_kernel[(B * nkv, -(-N // SKETCH_PAGES))](
        qr.float().contiguous(), words, scales, pages, counts, out, N, words.stride(0), scales.stride(0),
        NKV=nkv, GRP=grp, GP=_pow2(grp), W=r // 8, PS=page_size, PB=SKETCH_PAGES, num_warps=SKETCH_WARPS)
    return out


# Thermal KV's page table of every row in three launches (zeroedge.serve.thermal.ThermalSketches.tables):
# `hot_qr` turns each row's query into sketch coordinates through its sketch's bases, the sketch kernel
# above scores every listed page (in parallel over pages), and `hot_select`, one program a (row, kv head),
# normalises the page log-sum-exps over the pages per query head, takes the group's best, sorts the
# pages by it in registers (ties: the earlier page first) and writes the n_slots best, then the tail.

HOT_MAX_PAGES = 4096     # scored pages `select` sorts in registers (32K positions at pages of 8)
SELECT_WARPS = 8         # warps a `select` program

_hot_kernels = None


def _build_hot():
    import triton
    import triton.language as tl

    @triton.jit
    def hot_qr(q_ptr, a_ptr, s_as, sid_ptr, qr_ptr, NKV: tl.constexpr, GRP: tl.constexpr, GP: tl.constexpr,
               HD: tl.constexpr, R: tl.constexpr):
        bh = tl.program_id(0)
        b = bh // NKV
        h = bh % NKV
        g = tl.arange(0, GP)
        gm = g < GRP
        d = tl.arange(0, HD)
        r = tl.arange(0, R)
        q = tl.load(q_ptr + (bh * GRP + g[:, None]) * HD + d[None, :], mask=gm[:, None], other=0.).to(tl.float32)
        a = tl.load(a_ptr + tl.load(sid_ptr + b) * s_as + (h * HD + d[:, None]) * R + r[None, :])
        qr = tl.sum(q[:, :, None] * a[None, :, :], 1)                                     # (GP, R)
        tl.store(qr_ptr + (bh * GRP + g[:, None]) * R + r[None, :], qr, mask=gm[:, None])

    @triton.jit
    def hot_select(lse_ptr, spages_ptr, nsc_ptr, nsl_ptr, tail_ptr, out_ptr, N, T, KT, NKV: tl.constexpr,
                   GRP: tl.constexpr, GP: tl.constexpr, NMAX: tl.constexpr, BT: tl.constexpr):
        bh = tl.program_id(0)
        b = bh // NKV
        ns = tl.load(nsc_ptr + b).to(tl.int32)
        k = tl.load(nsl_ptr + b).to(tl.int32)
        g = tl.arange(0, GP)
        gm = g < GRP
        pn = tl.arange(0, NMAX)
        pv = pn < ns
        lse = tl.load(lse_ptr + (bh * GRP + g[:, None]) * N + pn[None, :], mask=gm[:, None] & pv[None, :],
                      other=float("-inf"))
        mx = tl.max(lse, 1)
        mx = tl.where(mx > float("-inf"), mx, 0.)
        total = tl.log(tl.maximum(tl.sum(tl.exp(lse - mx[:, None]), 1), 1e-30)) + mx      # per query head
        score = tl.max(tl.where(gm[:, None], lse - total[:, None], float("-inf")), 0)      # (NMAX,)
        score = tl.where(pv, score, float("-inf"))                     # past the row's pages: last
        bits = score.to(tl.int32, bitcast=True)
        order = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)        # ordered as the floats
        best = tl.sort((order << 32) | (NMAX - 1 - pn).to(tl.int64), descending=True)   # ties: earlier page
        page = NMAX - 1 - (best & 0xFFFFFFFF).to(tl.int32)
        sel = pn < k
        tl.store(out_ptr + bh * KT + pn, tl.load(spages_ptr + b * N + page, mask=sel, other=0), mask=sel)
        for j0 in range(0, T, BT):
            j = j0 + tl.arange(0, BT)
            tl.store(out_ptr + bh * KT + k + j, tl.load(tail_ptr + b * T + j, mask=j < T), mask=j < T)

    return hot_qr, hot_select


def paged_hot_tables(q, bases, sketch, codes, scales, scored_pages, n_scored, n_slots, tail_pages, slots_max: int,
                     page_size: int):
    """q (B, H, hd) after RoPE; bases (rows, nkv, hd, r) fp32 of one layer (each sketch's query bases,
    the 1 / sqrt(hd) folded in), sketch (B,) each row's; codes / scales as paged_sketch_lse;
    scored_pages (B, N) int32, n_scored / n_slots (B,), tail_pages (B, T) int32 -> pages (B, nkv,
    slots_max + T) int32: each row and kv head's n_slots best scored pages, then its tail. N at most
    HOT_MAX_PAGES."""
    global _hot_kernels
    B, H, hd = q.shape
    _, nkv, _, r = bases.shape
    N, T = scored_pages.shape[1], tail_pages.shape[1]
    if (N > HOT_MAX_PAGES or hd & (hd - 1) or r & (r - 1) or not q.is_contiguous() or bases.stride(1) != hd * r
            or bases.stride(2) != r or bases.stride(3) != 1 or scored_pages.dtype != torch.int32
            or tail_pages.dtype != torch.int32 or not (scored_pages.is_contiguous() and tail_pages.is_contiguous())):
        raise ValueError(f"paged_hot_tables needs at most {HOT_MAX_PAGES} scored pages, a power-of-two head size "
                         "and rank, contiguous q and int32 tables")
    if _hot_kernels is None:
        _hot_kernels = _build_hot()
    qr_k, select = _hot_kernels
    grp = H // nkv
    GP = _pow2(grp)
    qr = torch.empty(B, nkv, grp, r, device=q.device, dtype=torch.float32)
    qr_k[(B * nkv,)](q, bases, bases.stride(0), sketch, qr, NKV=nkv, GRP=grp, GP=GP, HD=hd, R=r)
    lse = paged_sketch_lse(qr, codes, scales, scored_pages, page_size, counts=n_scored)
    out = torch.empty(B, nkv, slots_max + T, device=q.device, dtype=torch.int32)
    NMAX = max(16, _pow2(N))
    select[(B * nkv,)](lse, scored_pages, n_scored, n_slots, tail_pages, out, N, T, slots_max + T, NKV=nkv, GRP=grp,
                       GP=GP, NMAX=NMAX, BT=256, num_warps=SELECT_WARPS if NMAX <= 1024 else 8)
    return out
