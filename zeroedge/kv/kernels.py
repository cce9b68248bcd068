"""Thermal KV's Triton kernels (imported lazily; CUDA only), with torch references: page scoring from
the int4 key sketch and the in-graph page swap of zeroedge.kv.attention.ThermalAttention.

`sketch_page_lse(qr, codes, scales, page_size)`: for every kv head h, query head g of its group
and page p, the log-sum-exp over the page's tokens t of (qr[h, g] . code[h, t]) * scale[h, t]: the
sketch's page score, fused so the packed int4 codes are read once and nothing per token is
written. codes: (nkv, P, r/2) uint8, two signed 4-bit codes a byte (low nibble = even direction),
stored with +8 offset; scales: (nkv, P), one a token (zeroedge.kv.attention.quantized_sketch).
"""
from __future__ import annotations

import torch

_kernel = None
# the sketch kernel's launch: the best of H200 sweeps (64 tokens a block beat 32 pages, 64 programs,
# 4 warps; pages of 8 want the same 64 tokens a block, 8 pages, not 4)
SKETCH_TOKENS = 64    # tokens a sketch program scores at a time (whole pages, a power of two of them)
SKETCH_PROGRAMS = 256  # programs a kv head at most: each loops over its share of the pages
SKETCH_WARPS = 1      # warps a sketch program
# which sketch kernel CUDA runs: "auto" (the plugin library's tensor-core kernel when it is built and
# the shapes fit, zeroedge.kv.cuda_sketch; else Triton), "cuda" (that kernel or an error) or "triton"
SKETCH_KERNEL = "auto"
_cuda_lib = {}


def sketch_pages_per_block(page_size: int) -> int:
    """Pages a sketch program scores at a time: SKETCH_TOKENS of them, rounded down to a power of two."""
    return 1 << (max(1, SKETCH_TOKENS // page_size).bit_length() - 1)


def sketch_kernel_fits(page_size: int, rank: int) -> bool:
    """The sketch kernel's tiles need a power-of-two page and half-rank; other shapes take the torch
    reference (and the one-program swap, without the kernel's log-sum-exp shares)."""
    return not (page_size & (page_size - 1) or (rank // 2) & (rank // 2 - 1))


def sketch_blocks(n: int, pages_per_block: int) -> tuple:
    """(programs a kv head, page blocks each program loops over) for n pages; the sketch kernel
    writes one log-sum-exp share per program, so `part` buffers are (nkv, grp, programs)."""
    blocks = -(-n // pages_per_block)
    it = -(-blocks // min(blocks, SKETCH_PROGRAMS))
    return -(-blocks // it), it


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
    c = (unpack_int4(codes).float() * scales.float()[..., None]).view(nkv, n, page_size, r)
    s = torch.einsum("hgr,hnpr->hgnp", qr.float(), c)
    return s.logsumexp(-1)


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def qp(q_ptr, a_ptr, inv_sqrt, qr_ptr, cos_ptr, sin_ptr, pos_ptr, GRP, GP: tl.constexpr, HD: tl.constexpr,
           R: tl.constexpr, ROPE: tl.constexpr = False):
        # qr = q A / sqrt(hd) for every query head of a kv head; ROPE: q is before RoPE, rotated here
        # at the position pos_ptr holds (sin with rotate_half's sign folded in) and rounded to its dtype
        h = tl.program_id(0)
        gi = tl.arange(0, GP)
        dd = tl.arange(0, HD)
        ri = tl.arange(0, R)
        rows = (h * GRP + gi[:, None]) * HD
        qt = tl.load(q_ptr + rows + dd[None, :], mask=gi[:, None] < GRP, other=0.0).to(tl.float32)
        if ROPE:
            pos = tl.load(pos_ptr)
            rot = tl.load(q_ptr + rows + ((dd + HD // 2) % HD)[None, :], mask=gi[:, None] < GRP,
                          other=0.0).to(tl.float32)
            c = tl.load(cos_ptr + pos * HD + dd).to(tl.float32)
            sn = tl.load(sin_ptr + pos * HD + dd).to(tl.float32)
            qt = (qt * c[None, :] + rot * sn[None, :]).to(q_ptr.dtype.element_ty).to(tl.float32)
        a = tl.load(a_ptr + h * HD * R + dd[:, None] * R + ri[None, :])
        qr = tl.sum(qt[:, :, None] * a[None, :, :], axis=1) * inv_sqrt
        tl.store(qr_ptr + (h * GRP + gi[:, None]) * R + ri[None, :], qr, mask=gi[:, None] < GRP)

    @triton.jit
    def kl(qr_ptr, codes_ptr, scales_ptr, out_ptr, pm_ptr, psum_ptr, P, n, NB, ITER: tl.constexpr,
           GRP: tl.constexpr, GP: tl.constexpr, R2: tl.constexpr, PS: tl.constexpr, PB: tl.constexpr,
           PART: tl.constexpr):
        # for kv head h, query head g of its group and page p: the log-sum-exp over the page's
        # tokens of qr[h, g] . (code[h, t] * scale[h, p]). A program loops over ITER blocks of PB
        # pages (loads pipelined across iterations, few programs) and keeps its share of each
        # query head's log-sum-exp over pages running. (Measured slower on the H200: one program
        # per 16 pages, 1.0-1.7x; int32-word code loads, 2.5-3x; a tensor-core product of the
        # scaled codes with qr, 2.5-3.5x.)
        h = tl.program_id(0)
        c = tl.program_id(1)
        rr = tl.arange(0, R2)
        gi = tl.arange(0, GP)
        # the program's share of each query head's log-sum-exp over pages, kept per page lane
        # (GP, PB) and updated elementwise: no cross-lane reduction until the end
        run_m = tl.full([GP, PB], float("-inf"), tl.float32)
        run_s = tl.zeros([GP, PB], tl.float32)
        for it in range(ITER):
            pages = (c * ITER + it) * PB + tl.arange(0, PB)
            pmask = pages < n
            toks = pages[:, None] * PS + tl.arange(0, PS)[None, :]
            b = tl.load(codes_ptr + h * P * R2 + toks[:, :, None] * R2 + rr[None, None, :],
                        mask=pmask[:, None, None], other=136)
            sc = tl.load(scales_ptr + h * P + toks, mask=pmask[:, None], other=0).to(tl.float32)
            lo = (b & 15).to(tl.float32) - 8.0
            hi = (b >> 4).to(tl.float32) - 8.0
            for g in tl.static_range(GRP):
                qe = tl.load(qr_ptr + (h * GRP + g) * 2 * R2 + 2 * rr)
                qo = tl.load(qr_ptr + (h * GRP + g) * 2 * R2 + 2 * rr + 1)
                s = tl.sum(lo * qe[None, None, :] + hi * qo[None, None, :], axis=2) * sc
                m = tl.max(s, axis=1)
                l = m + tl.log(tl.sum(tl.exp(s - m[:, None]), axis=1))
                tl.store(out_ptr + (h * GRP + g) * n + pages, l, mask=pmask)
                if PART:
                    lv = tl.where(pmask, l, float("-inf"))[None, :]
                    row = gi[:, None] == g
                    nm = tl.maximum(run_m, lv)
                    sh = tl.where(nm == float("-inf"), 0.0, nm)
                    ns = run_s * tl.exp(run_m - sh) + tl.exp(lv - sh)
                    run_m = tl.where(row, nm, run_m)
                    run_s = tl.where(row, ns, run_s)
        if PART:
            bm = tl.max(run_m, axis=1)
            sh = tl.where(bm == float("-inf"), 0.0, bm)
            bs = tl.sum(run_s * tl.exp(run_m - sh[:, None]), axis=1)
            tl.store(pm_ptr + (h * GRP + gi) * NB + c, bm, mask=gi < GRP)
            tl.store(psum_ptr + (h * GRP + gi) * NB + c, bs, mask=gi < GRP)

    return qp, kl


def part_blocks(n: int, page_size: int, pages_per_block: int | None = None) -> int:
    """Length of the last axis of the `part` buffers for n pages (one share per sketch program)."""
    return sketch_blocks(n, pages_per_block or sketch_pages_per_block(page_size))[0]


def rope_rows(x, cos, sin, pos):
    """x (rows, hd) before RoPE -> after, in x's dtype; cos / sin (positions, hd) tables (sin with
    rotate_half's sign folded in), pos a one-element device tensor."""
    hd = x.shape[-1]
    xf = x.float()
    return (xf * cos[pos].float() + xf.roll(hd // 2, -1) * sin[pos].float()).to(x.dtype)


def sketch_page_lse_q(q, A, codes, scales, page_size, out=None, pages_per_block: int | None = None, part=None,
                      rope=None):
    """q (H, hd) queries of one step, A (nkv, hd, r) fp32 query bases -> (nkv, grp, n): the same as
    sketch_page_lse(q @ A / sqrt(hd), ...). part: optional (max, sum) fp32 tensors
    (nkv, grp, part_blocks(n)) that receive each program's share of every query head's
    log-sum-exp over pages (CUDA only; swap_pages' two-stage path reads them). rope: (cos, sin,
    pos) when q is before RoPE (rope_rows)."""
    global _kernel
    nkv, P, r2 = codes.shape
    hd = A.shape[1]
    grp = q.shape[0] // nkv
    if not codes.is_cuda or hd & (hd - 1) or not sketch_kernel_fits(page_size, 2 * r2):
        if rope is not None:
            q = rope_rows(q, *rope)
        qr = torch.bmm(q.view(nkv, grp, hd).float(), A) / hd ** 0.5
        return sketch_page_lse(qr, codes, scales, page_size, out, pages_per_block, part)
    if _kernel is None:
        _kernel = _build()
    qr = torch.empty(nkv, grp, 2 * r2, device=codes.device, dtype=torch.float32)
    q = q.contiguous()
    cos, sin, pos = rope if rope is not None else (q, q, q)          # unread without ROPE
    _kernel[0][(nkv,)](q, A.contiguous(), 1.0 / hd ** 0.5, qr, cos, sin, pos, grp,
                       GP=1 << max(0, (grp - 1).bit_length()), HD=hd, R=2 * r2, ROPE=rope is not None)
    return sketch_page_lse(qr, codes, scales, page_size, out, pages_per_block, part)


def _sketch_cuda_lib(device, page_size: int, rank: int, grp: int):
    """The plugin library when SKETCH_KERNEL lets it score these shapes, else None (Triton)."""
    if SKETCH_KERNEL == "triton":
        return None
    from zeroedge import kernels_lib
    from zeroedge.errors import UserError
    from zeroedge.kv import cuda_sketch

    if SKETCH_KERNEL not in ("auto", "cuda"):
        raise ValueError(f"SKETCH_KERNEL must be auto, cuda or triton, not {SKETCH_KERNEL!r}")
    fits = cuda_sketch.fits(page_size, rank, grp) and torch.cuda.get_device_capability(device)[0] >= 8
    if SKETCH_KERNEL == "cuda":
        if not fits:
            raise ValueError(f"the CUDA sketch kernel takes pages of 8 / 16, rank 16 / 32 / 64, 1-8 query heads "
                             f"a kv head and compute capability 8.0 or newer (pages of {page_size}, rank {rank}, "
                             f"{grp} query heads)")
        return cuda_sketch.load()
    key = str(kernels_lib.default_path())
    if key not in _cuda_lib:        # a library without this kernel (an older build) leaves Triton
        try:
            _cuda_lib[key] = cuda_sketch.load()
        except UserError:
            _cuda_lib[key] = None
    return _cuda_lib[key] if fits else None


def sketch_page_lse(qr, codes, scales, page_size, out=None, pages_per_block: int | None = None, part=None):
    """qr (nkv, grp, r) -> (nkv, grp, n) sketch log-sum-exp of every page; part as above."""
    global _kernel
    pages_per_block = pages_per_block or sketch_pages_per_block(page_size)
    if not codes.is_cuda or not sketch_kernel_fits(page_size, 2 * codes.shape[-1]):
        return sketch_page_lse_ref(qr, codes, scales, page_size)
    if _kernel is None:
        _kernel = _build()
    nkv, P, r2 = codes.shape
    grp = qr.shape[1]
    n = P // page_size
    if out is None:
        out = torch.empty(nkv, grp, n, device=codes.device, dtype=torch.float32)
    nb, it = sketch_blocks(n, pages_per_block)
    lib = _sketch_cuda_lib(codes.device, page_size, 2 * r2, grp)
    if lib is not None:
        from zeroedge.kv import cuda_sketch

        return cuda_sketch.sketch_page_lse(lib, qr.float().contiguous(), codes.contiguous(), scales.contiguous(),
                                           page_size, out, part, it * pages_per_block)
    pm, psum = part if part is not None else (out, out)
    _kernel[1][(nkv, nb)](qr.float().contiguous(), codes.contiguous(), scales.contiguous(), out, pm, psum, P, n,
                          nb, ITER=it, GRP=grp, GP=1 << max(0, (grp - 1).bit_length()), R2=r2, PS=page_size,
                          PB=pages_per_block, PART=part is not None, num_warps=SKETCH_WARPS)
    return out


# ---------------------------------------------------------------------------------------------
# Page swap for the thermal decoder: the sketch's page scores of each kv head become at most `fetch`
# swaps (best missing page in, worst resident page out, while the new one scores higher), and the
# fetched pages' K and V are copied from the cold store straight into the freed slots. One program
# per kv head for few pages; for many, `sel` / `dec` decide and `move` copies, a program a pair.
# Replaces a top-k over every page plus ~25 small bookkeeping kernels a layer.

_swap_kernel = None


def page_scores_ref(pl, page_bias):
    """pl (nkv, grp, n) page log-sum-exps -> (nkv, n): per query head normalised over pages, the
    best query head of the group, plus the bias (-inf: never fetched)."""
    return (pl - pl.logsumexp(-1, keepdim=True)).amax(1) + page_bias


PAGE_BITS = 31      # the low bits of _order_key: a page index


def _order_key(x, low):
    """int64 keys ordered as the fp32 values x, ties ordered by `low` (0 <= low < 2^PAGE_BITS):
    the float's bits with the magnitude bits of negatives flipped are a signed order of the floats
    (x holds no NaN and no -0.0)."""
    b = x.contiguous().view(torch.int32)
    return ((b ^ ((b >> 31) & 0x7FFFFFFF)).long() << PAGE_BITS) | low


def swap_decisions_ref(score, page_slot, fetch: int, out=None):
    """The greedy swap's decisions: score (nkv, n); page_slot (nkv, n) slot or -1. Per kv head, pair
    i is the i-th best missing page and the i-th worst resident one, swapped while the missing page
    scores higher (ties: the lowest page). Returns out (nkv, 3, FP) int64, FP = fetch rounded up
    to a power of two: rows (page in, its slot, page out), -1 where pair i is not swapped."""
    FP = 1 << max(0, (int(fetch) - 1).bit_length())
    if out is None:
        out = torch.empty(score.shape[0], 3, FP, dtype=torch.long, device=score.device)
    out.fill_(-1)
    n = score.shape[1]
    F = min(int(fetch), n)
    inf = float("inf")
    score = score.float() + 0.0                   # -0.0 -> 0.0: equal scores, as the kernels compare them
    real = ~score.isnan()                         # a NaN score neither enters nor leaves (kernels alike)
    missing = torch.where((page_slot < 0) & real, score, -inf)
    resident = torch.where((page_slot >= 0) & real, score, inf)
    # among equal scores the lowest page first, as the kernels' keys order them (page_keys): the F
    # best by a tie-free int64 key (the score's order-preserving bits, then the page), not a full sort
    page = torch.arange(n, device=score.device)
    bm = _order_key(missing, (1 << PAGE_BITS) - 1 - page).topk(F, dim=1).indices
    wr = _order_key(resident, page).topk(F, dim=1, largest=False).indices
    vm, vr = missing.gather(1, bm), resident.gather(1, wr)
    take = (vm > vr).cumprod(1).bool()            # pair i only while every pair before it swapped
    for row, x in enumerate((bm, page_slot.gather(1, wr), wr)):
        out[:, row, :F] = torch.where(take, x, -1)
    return out


def apply_swaps_ref(dec, page_slot, slot_page, wk, wv, hk, hv, scales=None, bits: int = 8, staged: bool = False):
    """In place: the decisions `dec` (swap_decisions_ref) into the page tables and the window's slots
    wk / wv (nkv, S, PE). The pages come from hk / hv (nkv, n, PE) indexed by page, or with `staged`
    from a staging buffer (nkv, F, ...) indexed by pair; int8 / int4 codes (zeroedge.kv.tiers) when
    `scales` = (key scales, value scales) is given."""
    from zeroedge.kv.tiers import dequantize

    taken = dec[:, 1] >= 0
    if staged:                                    # a pair with no staging row is not applied at all
        taken[:, hk.shape[1]:] = False
    h, i = torch.nonzero(taken, as_tuple=True)
    src, dst, out = dec[h, 0, i], dec[h, 1, i], dec[h, 2, i]
    page_slot[h, out] = -1
    page_slot[h, src] = dst
    slot_page[h, dst] = src
    row = i if staged else src
    for w, c, k in ((wk, hk, 0), (wv, hv, 1)):
        if scales is None:
            w[h, dst] = c[h, row].to(w.dtype)
        else:
            g = w.shape[-1] // scales[k].shape[-1]
            w[h, dst] = dequantize(c[h, row], scales[k][h, row], bits, g, w.dtype)


def swap_pages_ref(score, page_slot, slot_page, wk, wv, hk, hv, fetch: int, scales=None, bits: int = 8):
    """In place. score (nkv, n); page_slot (nkv, n) slot or -1; slot_page (nkv, S); wk / wv (nkv, S,
    PE) slot pages of the window; hk / hv (nkv, n, PE) the cold store, or its int8 / int4 codes
    (nkv, n, PE * bits / 8; zeroedge.kv.tiers.quantize) when `scales` = (key scales, value scales)
    (nkv, n, PE // G) is given."""
    dec = swap_decisions_ref(score, page_slot, fetch)
    apply_swaps_ref(dec, page_slot, slot_page, wk, wv, hk, hv, scales, bits)


def _build_swap():
    # Triton looks a jit function's callees (and constexpr globals) up in its module's globals
    global copy_pages, store_swaps, store_decisions, finish_swaps, page_keys, max_pair, greedy_swaps, top_keys
    global evicted_slots
    global KEY_SHIFT, KEY_PAGE, KEY_NONE, COPY_COLUMNS
    import triton
    import triton.language as tl

    KEY_SHIFT, KEY_PAGE = tl.constexpr(PAGE_BITS), tl.constexpr((1 << PAGE_BITS) - 1)
    KEY_NONE = tl.constexpr(-(1 << 62))     # below the key of every score but NaN
    COPY_COLUMNS = tl.constexpr(64)         # a page's values copy_pages moves at a time

    @triton.jit
    def page_keys(sc, page, missing, resident):
        """Scores sc of pages `page` as two int64 key vectors whose max is the best missing page and
        the worst resident one (ties: the lowest page; kernels._order_key): missing pages by their
        order key, resident ones by its negation, the rest KEY_NONE. A key holds its page, so one
        reduction of the pair finds both pages and their scores' order, and `key == max` marks the
        one page to drop before the next."""
        b = (sc + 0.0).to(tl.int32, bitcast=True)           # + 0.0: -0.0 -> 0.0, as the reference
        hi = (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64) << KEY_SHIFT
        real = sc == sc                                      # a NaN score neither enters nor leaves
        mk = tl.where(missing & real, hi | (KEY_PAGE - page), KEY_NONE)
        rk = tl.where(resident & real, -(hi | page), KEY_NONE)
        return mk, rk

    @triton.jit
    def max_pair(a0, a1, b0, b1):
        return tl.maximum(a0, b0), tl.maximum(a1, b1)

    @triton.jit
    def top_keys(mk, rk, F: tl.constexpr, FP: tl.constexpr):
        """The F largest keys of mk and of rk (page_keys: unique but for KEY_NONE), in order, FP long
        (KEY_NONE padded): a reduction of the pair a pass."""
        fi = tl.arange(0, FP)
        km, kr = tl.full([FP], KEY_NONE, tl.int64), tl.full([FP], KEY_NONE, tl.int64)
        for i in tl.static_range(F):
            a, b = tl.reduce((mk, rk), 0, max_pair)
            mk, rk = tl.where(mk == a, KEY_NONE, mk), tl.where(rk == b, KEY_NONE, rk)
            km, kr = tl.where(fi == i, a, km), tl.where(fi == i, b, kr)
        return km, kr

    @triton.jit
    def greedy_swaps(mk, rk, F: tl.constexpr, FP: tl.constexpr):
        """A kv head's greedy decisions from its page keys: pair i is the i-th best missing page and
        the i-th worst resident one, swapped when the missing page scores higher (the pairs' scores
        are monotone, so the pairs taken are a prefix). Returns (slot index, page in, page out),
        -1 where pair i is not swapped."""
        km, kr = top_keys(mk, rk, F, FP)
        take = (km >> KEY_SHIFT) > ((-kr) >> KEY_SHIFT)          # the scores' order, without the pages
        src = tl.where(take, KEY_PAGE - (km & KEY_PAGE), -1)
        return tl.arange(0, FP), src, tl.where(take, (-kr) & KEY_PAGE, -1)

    @triton.jit
    def evicted_slots(out, h, n, pslot_ptr):
        """The slots of the pages out (-1: none), read before any table is written (finish_swaps'
        barrier): a page table read after another warp had written it raced (a warp that read a
        slot after another had freed it copied nowhere: torn slots on the H200), so the tables are
        read up front and written once by store_swaps."""
        return tl.load(pslot_ptr + h * n + out, mask=out >= 0, other=-1)

    @triton.jit
    def store_swaps(src, dst, out, h, n, S, pslot_ptr, spage_ptr):
        """The page tables after the swaps (src into slot dst, out evicted; -1: no swap). Evicted and
        fetched pages are disjoint, so the stores do not overlap. Called where nothing still reads
        the tables: after finish_swaps' barrier, or in `move`, which reads none."""
        ok = dst >= 0
        tl.store(pslot_ptr + h * n + out, tl.full(out.shape, -1, tl.int64), mask=ok)
        tl.store(pslot_ptr + h * n + src, dst, mask=ok)
        tl.store(spage_ptr + h * S + dst, src, mask=ok)

    @triton.jit
    def copy_pages(src, dst, h, n, w_head, hk_ptr, hv_ptr, ks_ptr, vs_ptr, wk_ptr, wv_ptr, PE: tl.constexpr,
                   PEB: tl.constexpr, G: tl.constexpr, QUANT: tl.constexpr):
        """Pages src (cold store, -1: none) of kv head h into window slots dst: PE values a page; with
        QUANT = 8 / 4 the cold pages are int8 codes / int4 codes two a byte (low nibble first, +8)
        with one scale per G values, dequantized on the way. A page's values go COPY_COLUMNS at a
        time: a whole (pages, PEB) tile spilled registers (ptxas, sm_90: 552 bytes at 8 pages of 512
        values, 2.3 KB at 12 or 16)."""
        for e0 in tl.static_range(0, PEB, COPY_COLUMNS):
            e = e0 + tl.arange(0, COPY_COLUMNS)
            ok = ((src >= 0) & (dst >= 0))[:, None] & (e < PE)[None, :]
            do = (h * w_head + dst * PE)[:, None] + e[None, :]
            if QUANT == 4:
                so = (h * n + src)[:, None] * (PE // 2) + (e // 2)[None, :]
                sh = ((e % 2) * 4)[None, :]
                kk = ((tl.load(hk_ptr + so, mask=ok) >> sh) & 15).to(tl.float32) - 8.0
                vv = ((tl.load(hv_ptr + so, mask=ok) >> sh) & 15).to(tl.float32) - 8.0
            else:
                so = (h * n + src)[:, None] * PE + e[None, :]
                kk = tl.load(hk_ptr + so, mask=ok)
                vv = tl.load(hv_ptr + so, mask=ok)
            if QUANT:
                go = (h * n + src)[:, None] * (PE // G) + (e // G)[None, :]
                kk = kk.to(tl.float32) * tl.load(ks_ptr + go, mask=ok).to(tl.float32)
                vv = vv.to(tl.float32) * tl.load(vs_ptr + go, mask=ok).to(tl.float32)
            tl.store(wk_ptr + do, kk.to(wk_ptr.dtype.element_ty), mask=ok)
            tl.store(wv_ptr + do, vv.to(wv_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def store_decisions(fi, src, dst, out, h, dec_ptr, FP: tl.constexpr):
        """A kv head's decisions into dec_ptr (nkv, 3, FP): page in, its slot, page out (-1: no swap)."""
        tl.store(dec_ptr + (h * 3 + 0) * FP + fi, src)
        tl.store(dec_ptr + (h * 3 + 1) * FP + fi, dst)
        tl.store(dec_ptr + (h * 3 + 2) * FP + fi, out)

    @triton.jit
    def finish_swaps(fi, src, dst, out, h, n, S, w_head, pslot_ptr, spage_ptr, wk_ptr, wv_ptr, hk_ptr, hv_ptr, ks_ptr,
                     vs_ptr, dec_ptr, FP: tl.constexpr, PE: tl.constexpr, PEB: tl.constexpr, G: tl.constexpr,
                     QUANT: tl.constexpr, DECIDE: tl.constexpr):
        """Either the swaps done (the tables stored, the pages copied) or, with DECIDE, only the
        decisions written to dec_ptr (nkv, 3, FP): page in, slot, page out (-1: no swap)."""
        if DECIDE:
            store_decisions(fi, src, dst, out, h, dec_ptr, FP)
        else:
            tl.debug_barrier()     # every warp has read the tables (with one warp's reductions, nothing else orders it)
            store_swaps(src, dst, out, h, n, S, pslot_ptr, spage_ptr)
            copy_pages(src, dst, h, n, w_head, hk_ptr, hv_ptr, ks_ptr, vs_ptr, wk_ptr, wv_ptr, PE, PEB, G, QUANT)

    @triton.jit
    def k(pl_ptr, bias_ptr, pslot_ptr, spage_ptr, wk_ptr, wv_ptr, hk_ptr, hv_ptr, ks_ptr, vs_ptr, dec_ptr, n, S,
          w_head, GRP: tl.constexpr, NP: tl.constexpr, F: tl.constexpr, FP: tl.constexpr,
          PE: tl.constexpr, PEB: tl.constexpr, G: tl.constexpr, QUANT: tl.constexpr, DECIDE: tl.constexpr):
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
        mk, rk = page_keys(sc, offs, m & (slot < 0), m & (slot >= 0))
        # decisions first (a swap's page pair into slot i of src / dst), then every copy at once
        fi, src, out = greedy_swaps(mk, rk, F, FP)
        dst = evicted_slots(out, h, n, pslot_ptr)
        finish_swaps(fi, src, dst, out, h, n, S, w_head, pslot_ptr, spage_ptr, wk_ptr, wv_ptr, hk_ptr, hv_ptr, ks_ptr,
                     vs_ptr, dec_ptr, FP, PE, PEB, G, QUANT, DECIDE)

    # two-stage form for many pages: `sel` (a program per kv head and chunk of C pages) scores its
    # chunk, normalising with the per-block log-sum-exp shares the sketch kernel wrote, and keeps
    # its F best missing and F worst resident pages' keys; `dec` (a program per kv head) runs the
    # same greedy on those candidates and writes the decisions, which `move` carries out. The
    # global F best are among the chunks' F best, and the keys order ties as in the one-program
    # kernel, so the decisions are the same.
    @triton.jit
    def sel(pl_ptr, pm_ptr, psum_ptr, bias_ptr, pslot_ptr, cm_ptr, cr_ptr, n, NB,
            GRP: tl.constexpr, NBP: tl.constexpr, C: tl.constexpr, F: tl.constexpr, FP: tl.constexpr):
        h = tl.program_id(0)
        c = tl.program_id(1)
        nc = tl.num_programs(1)
        offs = c * C + tl.arange(0, C)
        m = offs < n
        bo = tl.arange(0, NBP)
        sc = tl.full([C], float("-inf"), tl.float32)
        for g in tl.static_range(GRP):
            pm = tl.load(pm_ptr + (h * GRP + g) * NB + bo, mask=bo < NB, other=float("-inf"))
            ps = tl.load(psum_ptr + (h * GRP + g) * NB + bo, mask=bo < NB, other=0.0)
            mx = tl.max(pm, 0)
            lse = mx + tl.log(tl.sum(ps * tl.exp(pm - mx), 0))
            v = tl.load(pl_ptr + (h * GRP + g) * n + offs, mask=m, other=float("-inf"))
            sc = tl.maximum(sc, v - lse)
        sc = sc + tl.load(bias_ptr + offs, mask=m, other=float("-inf"))
        slot = tl.load(pslot_ptr + h * n + offs, mask=m, other=-1)
        mk, rk = page_keys(sc, offs, m & (slot < 0), m & (slot >= 0))
        km, kr = top_keys(mk, rk, F, FP)
        base = (h * nc + c) * FP + tl.arange(0, FP)
        tl.store(cm_ptr + base, km)
        tl.store(cr_ptr + base, kr)

    @triton.jit
    def dec(cm_ptr, cr_ptr, pslot_ptr, dec_ptr, n, NCAND, NCP: tl.constexpr, F: tl.constexpr, FP: tl.constexpr):
        h = tl.program_id(0)
        offs = tl.arange(0, NCP)
        m = offs < NCAND
        mk = tl.load(cm_ptr + h * NCAND + offs, mask=m, other=KEY_NONE)
        rk = tl.load(cr_ptr + h * NCAND + offs, mask=m, other=KEY_NONE)
        fi, src, out = greedy_swaps(mk, rk, F, FP)
        store_decisions(fi, src, evicted_slots(out, h, n, pslot_ptr), out, h, dec_ptr, FP)

    @triton.jit
    def move(dec_ptr, pslot_ptr, spage_ptr, wk_ptr, wv_ptr, hk_ptr, hv_ptr, ks_ptr, vs_ptr, n, S, w_head, rows,
             FP: tl.constexpr, PE: tl.constexpr, PEB: tl.constexpr, G: tl.constexpr, QUANT: tl.constexpr,
             STAGED: tl.constexpr):
        """Pair program_id(1) of kv head program_id(0)'s decisions (DECIDE) carried out: its page
        tables (n pages, S slots a kv head) stored and its page dequantized into its slot, from the
        cold store (rows = n pages a kv head) or, with STAGED, from a staging buffer (nkv, rows,
        ...) that holds pair i's page in row i.
        A program a pair: one program copying a kv head's pages took 30-40 us a layer at fetch
        12-16 (H200, 128K), where the decisions take 11-21."""
        h = tl.program_id(0)
        i = tl.program_id(1) + tl.arange(0, 1)     # the pair, as a vector of one
        src = tl.load(dec_ptr + (h * 3 + 0) * FP + i)
        dst = tl.load(dec_ptr + (h * 3 + 1) * FP + i)
        out = tl.load(dec_ptr + (h * 3 + 2) * FP + i)
        store_swaps(src, dst, out, h, n, S, pslot_ptr, spage_ptr)       # pairs touch disjoint entries
        if STAGED:
            src = tl.where(dst >= 0, i, -1).to(tl.int64)
        copy_pages(src, dst, h, rows, w_head, hk_ptr, hv_ptr, ks_ptr, vs_ptr, wk_ptr, wv_ptr, PE, PEB, G, QUANT)

    return k, sel, dec, move


SWAP_CHUNK = 256   # pages a `sel` program scores in the two-stage swap
SWAP_WARPS = (1, 2)  # warps of the two-stage swap's `sel` and `dec` programs (an H200 sweep)


def swap_pages(pl, page_bias, page_slot, slot_page, wk, wv, hk, hv, fetch: int, part=None,
               chunk: int | None = None, scales=None, bits: int | None = None):
    """pl (nkv, grp, n) from sketch_page_lse; the rest as in swap_pages_ref, except wk / wv are the
    slot part of the window as (nkv, S, PE) views with any head stride (contiguous within a head).
    CUDA: one fused Triton kernel, or with `part` (the sketch kernel's per-block log-sum-exp
    shares) and more than `chunk` pages the two-stage selection (`sel`, `dec`) and `move`, a
    program a swap; elsewhere the torch reference.
    `scales`, `bits`: the cold store is int8 / int4 (see swap_pages_ref), dequantized by the copy."""
    bits = bits or 8
    if not pl.is_cuda:
        swap_pages_ref(page_scores_ref(pl, page_bias), page_slot, slot_page, wk, wv, hk, hv, fetch, scales, bits)
        return
    if wk.stride(1) != wk.shape[2] or wk.stride(2) != 1 or wk.stride() != wv.stride():
        raise ValueError("swap_pages: window slot pages must be contiguous within a head")
    ks, vs = scales if scales is not None else (hk, hv)       # unread without QUANT
    quant = dict(G=wk.shape[2] // ks.shape[-1] if scales is not None else 1, QUANT=bits if scales is not None else 0)
    _swap_launch(pl, page_bias, page_slot, fetch, part, chunk, (slot_page, wk, wv, hk, hv, ks, vs, None), quant)


def swap_decisions(pl, page_bias, page_slot, fetch: int, out, part=None, chunk: int | None = None):
    """The decisions swap_pages would carry out, written to out (nkv, 3, FP) int64 (swap_decisions_ref);
    nothing moves. The same kernels on CUDA, the reference elsewhere."""
    if not pl.is_cuda:
        swap_decisions_ref(page_scores_ref(pl, page_bias), page_slot, fetch, out)
        return
    _swap_launch(pl, page_bias, page_slot, fetch, part, chunk, (page_slot,) * 7 + (out,), dict(G=1, QUANT=0))


def apply_swaps(dec, page_slot, slot_page, wk, wv, stage, bits: int):
    """Decisions (swap_decisions) applied from a staging buffer: stage = (K codes, V codes, K scales,
    V scales), each (nkv, F, ...) with pair i's page in row i (int8 / int4 codes, zeroedge.kv.tiers);
    wk / wv as in swap_pages."""
    if not dec.is_cuda:
        apply_swaps_ref(dec, page_slot, slot_page, wk, wv, stage[0], stage[1], stage[2:], bits, staged=True)
        return
    kernels = _swap_kernels()
    nkv, F = stage[0].shape[:2]
    if F > dec.shape[2]:
        raise ValueError(f"apply_swaps: {F} staging rows for {dec.shape[2]} decisions a kv head")
    PE = wk.shape[2]
    kernels[3][(nkv, F)](dec, page_slot, slot_page, wk, wv, *stage, page_slot.shape[1], slot_page.shape[1],
                         wk.stride(0), F, FP=dec.shape[2], PE=PE, PEB=1 << max(0, (PE - 1).bit_length()),
                         G=PE // stage[2].shape[-1], QUANT=bits, STAGED=True, num_warps=4)


def _swap_kernels():
    global _swap_kernel
    if _swap_kernel is None:
        _swap_kernel = _build_swap()
    return _swap_kernel


def _swap_launch(pl, page_bias, page_slot, fetch, part, chunk, ptrs, quant):
    """The swap kernels: ptrs = (slot_page, wk, wv, hk, hv, ks, vs, decisions or None); with
    decisions they are only written there (DECIDE)."""
    kernels = _swap_kernels()
    slot_page, wk, wv, hk, hv, ks, vs, decide = ptrs
    pl = pl.contiguous()                    # the kernels index the scores densely
    nkv, grp, n = pl.shape
    S, PE, w_head = (1, 1, 0) if decide is not None else (slot_page.shape[1], wk.shape[2], wk.stride(0))
    chunk = SWAP_CHUNK if chunk is None else chunk
    F, FP = int(fetch), 1 << max(0, (int(fetch) - 1).bit_length())
    if decide is not None and decide.shape != (nkv, 3, FP):
        raise ValueError(f"swap_decisions: out must be ({nkv}, 3, {FP})")
    PEB = 1 << max(0, (PE - 1).bit_length())
    common = dict(F=F, FP=FP, PE=PE, PEB=PEB, DECIDE=decide is not None, num_warps=4, **quant)
    dec_ptr = decide if decide is not None else page_slot
    if part is not None and n > chunk:
        pm, psum = part
        nc = (n + chunk - 1) // chunk
        NB = pm.shape[-1]
        cm = torch.empty(nkv, nc * FP, device=pl.device, dtype=torch.int64)
        cr = torch.empty_like(cm)
        kernels[1][(nkv, nc)](pl, pm, psum, page_bias, page_slot, cm, cr, n, NB, GRP=grp,
                              NBP=1 << max(0, (NB - 1).bit_length()), C=chunk, F=F, FP=FP, num_warps=SWAP_WARPS[0])
        ncand = nc * FP
        moves = decide if decide is not None else torch.empty(nkv, 3, FP, device=pl.device, dtype=torch.int64)
        kernels[2][(nkv,)](cm, cr, page_slot, moves, n, ncand, NCP=1 << max(0, (ncand - 1).bit_length()), F=F, FP=FP,
                           num_warps=SWAP_WARPS[1])
        if decide is None:      # then a program a pair moves the pages
            kernels[3][(nkv, F)](moves, page_slot, slot_page, wk, wv, hk, hv, ks, vs, n, S, w_head, n, FP=FP, PE=PE,
                                 PEB=PEB, G=quant["G"], QUANT=quant["QUANT"], STAGED=False, num_warps=4)
        return
    NP = 1 << max(0, (n - 1).bit_length())
    common["num_warps"] = min(16, max(4, NP // 512))
    kernels[0][(nkv,)](pl, page_bias, page_slot, slot_page, wk, wv, hk, hv, ks, vs, dec_ptr, n, S, w_head,
                       GRP=grp, NP=NP, **common)
