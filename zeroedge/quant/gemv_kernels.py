"""The Triton kernels of zeroedge.quant.triton_gemv (what they compute and how: its docstring). This
module imports Triton; triton_gemv imports it on first use."""
import triton
import triton.language as tl

from zeroedge.quant.packed import TINY_INPUTS
from zeroedge.triton_launch import pdl_launch as _pdl_launch
from zeroedge.triton_launch import pdl_start as _pdl_start
from zeroedge.triton_launch import pdl_wait as _pdl_wait

TINY = tl.constexpr(TINY_INPUTS)     # a word whose inputs are all below this is taken as 0


@triton.jit
def _rstd(x_ptr, eps, K, NB: tl.constexpr):
    """1 / RMS of x (K values), eps inside the root."""
    ss = tl.zeros([NB], dtype=tl.float32)
    for k0 in range(0, K, NB):
        kk = k0 + tl.arange(0, NB)
        xv = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        ss += xv * xv
    return 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def _live_rows(z_ptr, bg_ptr, bu_ptr, thr, RK, rows, rmask, N, LIVE: tl.constexpr, R: tl.constexpr):
    """The rows whose codes are read (the others sum to 0): every row, or with LIVE decode paths'
    predictor rule, decided here: z = the RK values at z_ptr, score_j = |silu(z . bg[:, j]) *
    (z . bu[:, j])| >= thr (bg, bu fp32 [RK, N]), so a dead channel's gate / up rows are never loaded."""
    if LIVE:
        rr = tl.arange(0, R)
        z = tl.load(z_ptr + rr, mask=rr < RK, other=0.0).to(tl.float32)
        m = (rr < RK)[:, None] & rmask[None, :]
        g = tl.sum(z[:, None] * tl.load(bg_ptr + rr[:, None] * N + rows[None, :], mask=m, other=0.0), axis=0)
        u = tl.sum(z[:, None] * tl.load(bu_ptr + rr[:, None] * N + rows[None, :], mask=m, other=0.0), axis=0)
        rmask = rmask & (tl.abs(g * tl.sigmoid(g) * u) >= thr)
    return rmask


@triton.jit
def _epilogue(y, y2, rows, rmask, pid, y_ptr, r_ptr, nq_ptr, ndx_ptr, nxw_ptr, NW,
              SWIGLU: tl.constexpr, RES: tl.constexpr, BN: tl.constexpr, NEXT_BITS: tl.constexpr):
    """The output rows from their fp32 sums: SwiGLU, the residual, stored in y's dtype. NEXT_BITS > 0:
    also the next GEMV's prepared int8 inputs for a BITS-bit weight (what quantize_inputs_kernel
    writes, no norm), from the stored values: this program's BN rows are whole words of them."""
    if SWIGLU:
        y = y * tl.sigmoid(y) * y2
    if RES:
        y += tl.load(r_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    yo = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows, yo, mask=rmask)
    if NEXT_BITS > 0:
        VALS: tl.constexpr = 32 // NEXT_BITS
        WN: tl.constexpr = BN // VALS                      # words this program owns
        _store_words(tl.reshape(tl.where(rmask, yo.to(tl.float32), 0.0), [WN, VALS]),
                     pid * WN + tl.arange(0, WN), 1.0, nq_ptr, ndx_ptr, nxw_ptr, NW, NEXT_BITS, WN)


@triton.jit
def _store_words(xv, wi, rstd, xq_ptr, dx_ptr, xw_ptr, W, BITS: tl.constexpr, BWQ: tl.constexpr):
    """Words of inputs xv [BWQ, 32 / BITS] (word indices wi) rounded to int8 with one step a word and
    packed four to a 32-bit word in the byte order of the codes they meet (4-bit codes: even inputs
    in xq[0:W], odd in xq[W:2W]); dx: the word's step (times rstd); xw: the word's sum of the
    rounded inputs (for the group offsets)."""
    VALS: tl.constexpr = 32 // BITS
    amax = tl.max(tl.abs(xv), axis=1)
    xq = tl.floor(xv * tl.where(amax > TINY, 127.0 / amax, 0.0)[:, None] + 0.5).to(tl.int32)
    dx = amax / 127.0 * rstd
    sh = tl.arange(0, 4) * 8
    wm = wi < W
    if BITS == 4:
        xe, xo = tl.split(tl.reshape(xq, [BWQ, VALS // 2, 2]))
        tl.store(xq_ptr + wi, tl.sum((xe & 255) << sh[None, :], axis=1), mask=wm)
        tl.store(xq_ptr + W + wi, tl.sum((xo & 255) << sh[None, :], axis=1), mask=wm)
    else:
        tl.store(xq_ptr + wi, tl.sum((xq & 255) << sh[None, :], axis=1), mask=wm)
    tl.store(dx_ptr + wi, dx, mask=wm)
    tl.store(xw_ptr + wi, tl.sum(xq, axis=1).to(tl.float32) * dx, mask=wm)


@triton.jit
def _finish(y, y2, rows, rmask, pid, sid, N, y_ptr, r_ptr, nq_ptr, ndx_ptr, nxw_ptr, NW,
            SWIGLU: tl.constexpr, RES: tl.constexpr, SPLIT: tl.constexpr, BN: tl.constexpr,
            NEXT_BITS: tl.constexpr):
    """Store a program's row sums y (and y2, the up rows): fp32 partials with SPLIT > 1 ([SPLIT, N],
    swiglu [SPLIT, 2N]), else the output (_epilogue)."""
    if SPLIT > 1:
        if SWIGLU:
            tl.store(y_ptr + sid * 2 * N + rows, y, mask=rmask)
            tl.store(y_ptr + sid * 2 * N + N + rows, y2, mask=rmask)
        else:
            tl.store(y_ptr + sid * N + rows, y, mask=rmask)
    else:
        _epilogue(y, y2, rows, rmask, pid, y_ptr, r_ptr, nq_ptr, ndx_ptr, nxw_ptr, NW, SWIGLU, RES, BN, NEXT_BITS)


@triton.jit
def _word_dots(qw, pa, pb, BN: tl.constexpr, BW: tl.constexpr, BITS: tl.constexpr, DP4A: tl.constexpr):
    """[BN, BW] int32: each word of codes (unsigned bytes; 4-bit: low nibbles meet pa, high nibbles
    pb) times its packed int8 inputs (signed bytes), by dp4a (four byte products an instruction) or,
    for Triton's interpreter (no inline PTX), by shifts."""
    d = tl.zeros([BN, BW], dtype=tl.int32)
    for t in tl.static_range(2 if BITS == 4 else 1):
        a = (qw if BITS == 8 else qw & 0x0F0F0F0F) if t == 0 else (qw >> 4) & 0x0F0F0F0F
        b = tl.broadcast_to(pa if t == 0 else pb, [BN, BW])
        if DP4A:
            d = tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, d],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            for j in tl.static_range(4):
                d += ((a >> (8 * j)) & 255) * ((b << (24 - 8 * j)) >> 24)
    return d


@triton.jit
def gemv_kernel(x_ptr, ln_ptr, eps, q_ptr, s_ptr, o_ptr, y_ptr, r_ptr, nq_ptr, ndx_ptr,
                nxw_ptr, NW, z_ptr, bg_ptr, bu_ptr, thr, RK, N, K, NGROUPS, ROWW, WPS,
                BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr,
                NB: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr, RES: tl.constexpr,
                SPLIT: tl.constexpr, LIVE: tl.constexpr, R: tl.constexpr, NEXT_BITS: tl.constexpr = 0,
                PDL: tl.constexpr = False):
    _pdl_start(PDL)
    VALS: tl.constexpr = 32 // BITS          # codes a word
    WG: tl.constexpr = G // VALS             # words a group
    MASK: tl.constexpr = (1 << BITS) - 1
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < N
    lmask = _live_rows(z_ptr, bg_ptr, bu_ptr, thr, RK, rows, rmask, N, LIVE, R)   # the rows read
    rstd = _rstd(x_ptr, eps, K, NB) if NORM else 1.0
    acc = tl.zeros([BN], dtype=tl.float32)
    acc2 = tl.zeros([BN], dtype=tl.float32)
    w_lo = sid * WPS
    for w0 in range(w_lo, w_lo + WPS, BW):
        wi = w0 + tl.arange(0, BW)
        m2 = lmask[:, None] & (wi < ROWW)[None, :]
        qw = tl.load(q_ptr + rows[:, None] * ROWW + wi[None, :], mask=m2, other=0)      # [BN, BW]
        if SWIGLU:
            qw2 = tl.load(q_ptr + (rows + N)[:, None] * ROWW + wi[None, :], mask=m2, other=0)
        part = tl.zeros([BN, BW], dtype=tl.float32)
        part2 = tl.zeros([BN, BW], dtype=tl.float32)
        xs = tl.zeros([BW], dtype=tl.float32)
        for i in tl.static_range(VALS):      # code i of every word meets input VALS * word + i
            k = wi * VALS + i
            xv = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            if NORM:
                xv = xv * tl.load(ln_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            xs += xv
            part += ((qw >> (BITS * i)) & MASK).to(tl.float32) * xv[None, :]
            if SWIGLU:
                part2 += ((qw2 >> (BITS * i)) & MASK).to(tl.float32) * xv[None, :]
        so = rows[:, None] * NGROUPS + (wi // WG)[None, :]                              # a word's group
        s = tl.load(s_ptr + so, mask=m2, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + so, mask=m2, other=0.0).to(tl.float32)
        acc += tl.sum(part * s + o * xs[None, :], axis=1)
        if SWIGLU:
            s2 = tl.load(s_ptr + so + N * NGROUPS, mask=m2, other=0.0).to(tl.float32)
            o2 = tl.load(o_ptr + so + N * NGROUPS, mask=m2, other=0.0).to(tl.float32)
            acc2 += tl.sum(part2 * s2 + o2 * xs[None, :], axis=1)
    _finish(acc * rstd, acc2 * rstd, rows, rmask, pid, sid, N, y_ptr, r_ptr, nq_ptr, ndx_ptr, nxw_ptr, NW,
            SWIGLU, RES, SPLIT, BN, NEXT_BITS)


@triton.jit
def _i8_inputs(x_ptr, ln_ptr, w0, K, BITS: tl.constexpr, BW: tl.constexpr, NORM: tl.constexpr):
    """A tile's BW words of inputs (x * ln when NORM) rounded to int8 with one step a word and packed
    four to a 32-bit word in the byte order of the codes they meet -> (pa, pb [1, BW] int32; for 4-bit
    codes low nibbles meet pa (even inputs), high ones pb (odd)), dx [1, BW] the steps, xs [BW] each
    word's sum of the rounded inputs (the offsets see the same inputs)."""
    VALS: tl.constexpr = 32 // BITS
    wi = w0 + tl.arange(0, BW)
    k8 = wi[:, None] * VALS + tl.arange(0, VALS)[None, :]                              # [BW, VALS]
    xv = tl.load(x_ptr + k8, mask=k8 < K, other=0.0).to(tl.float32)
    if NORM:
        xv = xv * tl.load(ln_ptr + k8, mask=k8 < K, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(xv), axis=1)                                                   # [BW]
    xq = tl.floor(xv * tl.where(amax > TINY, 127.0 / amax, 0.0)[:, None] + 0.5).to(tl.int32)
    xs = tl.sum(xq, axis=1).to(tl.float32) * (amax / 127.0)
    sh = tl.arange(0, 4) * 8
    if BITS == 4:
        xe, xo = tl.split(tl.reshape(xq, [BW, VALS // 2, 2]))
        pa = tl.sum((xe & 255) << sh[None, :], axis=1)[None, :]
        pb = tl.sum((xo & 255) << sh[None, :], axis=1)[None, :]
    else:
        pa = tl.sum((xq & 255) << sh[None, :], axis=1)[None, :]
        pb = pa
    return pa, pb, (amax / 127.0)[None, :], xs


@triton.jit
def _word_codes(q_ptr, s_ptr, o_ptr, rows, lmask, w0, N, NGROUPS, ROWW, h: tl.constexpr, BW: tl.constexpr,
                WG: tl.constexpr):
    """A tile's codes [BN, BW] (h 1: the up rows of a swiglu weight) and each word's group step and
    offset [BN, BW] (fp16)."""
    wi = w0 + tl.arange(0, BW)
    m2 = lmask[:, None] & (wi < ROWW)[None, :]
    so = (rows + h * N)[:, None] * NGROUPS + (wi // WG)[None, :]
    qw = tl.load(q_ptr + (rows + h * N)[:, None] * ROWW + wi[None, :], mask=m2, other=0)
    return qw, tl.load(s_ptr + so, mask=m2, other=0.0), tl.load(o_ptr + so, mask=m2, other=0.0)


@triton.jit
def _i8_dot(qw, s, o, pa, pb, dx, xs, BN: tl.constexpr, BW: tl.constexpr, BITS: tl.constexpr,
            DP4A: tl.constexpr):
    d = _word_dots(qw, pa, pb, BN, BW, BITS, DP4A)
    return tl.sum(d.to(tl.float32) * dx * s.to(tl.float32) + o.to(tl.float32) * xs[None, :], axis=1)


@triton.jit
def gemv_i8_kernel(x_ptr, ln_ptr, eps, q_ptr, s_ptr, o_ptr, y_ptr, r_ptr, nq_ptr, ndx_ptr,
                   nxw_ptr, NW, z_ptr, bg_ptr, bu_ptr, thr, RK, N, K, NGROUPS, ROWW, WPS,
                   BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr,
                   NB: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr, RES: tl.constexpr,
                   SPLIT: tl.constexpr, LIVE: tl.constexpr, R: tl.constexpr, DP4A: tl.constexpr,
                   NEXT_BITS: tl.constexpr = 0, PDL: tl.constexpr = False, EARLY: tl.constexpr = False):
    # each word's inputs rounded to int8 (one scale a word) in every program (_i8_inputs), codes x
    # inputs summed by _word_dots. EARLY (not LIVE): the program's first tile of codes, steps and
    # offsets is loaded before PDL's wait -- weights do not depend on the previous kernel, so their
    # loads overlap its tail
    tl.static_assert(not (EARLY and LIVE), "a predictor's rows depend on the input: no weights before the wait")
    _pdl_launch(PDL)
    WG: tl.constexpr = G // (32 // BITS)
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < N
    w_lo = sid * WPS
    if EARLY:
        qa, sa, oa = _word_codes(q_ptr, s_ptr, o_ptr, rows, rmask, w_lo, N, NGROUPS, ROWW, 0, BW, WG)
        if SWIGLU:
            qb, sb, ob = _word_codes(q_ptr, s_ptr, o_ptr, rows, rmask, w_lo, N, NGROUPS, ROWW, 1, BW, WG)
    _pdl_wait(PDL)
    lmask = _live_rows(z_ptr, bg_ptr, bu_ptr, thr, RK, rows, rmask, N, LIVE, R)   # the rows read
    rstd = _rstd(x_ptr, eps, K, NB) if NORM else 1.0
    acc = tl.zeros([BN], dtype=tl.float32)
    acc2 = tl.zeros([BN], dtype=tl.float32)
    start = w_lo
    if EARLY:
        pa, pb, dx, xs = _i8_inputs(x_ptr, ln_ptr, w_lo, K, BITS, BW, NORM)
        acc += _i8_dot(qa, sa, oa, pa, pb, dx, xs, BN, BW, BITS, DP4A)
        if SWIGLU:
            acc2 += _i8_dot(qb, sb, ob, pa, pb, dx, xs, BN, BW, BITS, DP4A)
        start = w_lo + BW
    for w0 in range(start, w_lo + WPS, BW):
        pa, pb, dx, xs = _i8_inputs(x_ptr, ln_ptr, w0, K, BITS, BW, NORM)
        for h in tl.static_range(2 if SWIGLU else 1):                    # h 1: the up rows
            qw, s, o = _word_codes(q_ptr, s_ptr, o_ptr, rows, lmask, w0, N, NGROUPS, ROWW, h, BW, WG)
            contrib = _i8_dot(qw, s, o, pa, pb, dx, xs, BN, BW, BITS, DP4A)
            if h == 0:
                acc += contrib
            else:
                acc2 += contrib
    _finish(acc * rstd, acc2 * rstd, rows, rmask, pid, sid, N, y_ptr, r_ptr, nq_ptr, ndx_ptr, nxw_ptr, NW,
            SWIGLU, RES, SPLIT, BN, NEXT_BITS)


@triton.jit
def gather_inputs_kernel(x_ptr, q_ptr, s_ptr, o_ptr, y_ptr, N, K, ROWB, GPS,
                         BITS: tl.constexpr, G: tl.constexpr, BC: tl.constexpr, SPLIT: tl.constexpr,
                         PDL: tl.constexpr = False):
    # input-major codes (zeroedge.quant.packed.PackedInputs): a program owns BC bytes of outputs and
    # walks its split's groups of inputs one row at a time (each thread sums its own columns: no
    # reduction across threads); the row of an input that is 0 is never loaded (predicated off), so
    # a step reads the kept rows plus each group's scales and offsets
    _pdl_start(PDL)
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    cb = pid * BC + tl.arange(0, BC)                                     # byte columns
    cmask = cb < ROWB
    VALS: tl.constexpr = 8 // BITS                                       # outputs a byte
    nb = pid * BC * VALS + tl.arange(0, BC * VALS)                       # output columns
    nmask = nb < N
    acc = tl.zeros([BC * VALS], dtype=tl.float32)
    for g in range(sid * GPS, sid * GPS + GPS):
        lo = tl.zeros([BC], dtype=tl.float32)
        hi = tl.zeros([BC], dtype=tl.float32)
        xs = 0.0
        for r in tl.static_range(G):
            k = g * G + r
            xk = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            xb = tl.zeros([BC], dtype=tl.float32) + xk                     # a vector: a mask needs one
            qb = tl.load(q_ptr + k * ROWB + cb, mask=cmask & (xb != 0.0), other=0)
            if BITS == 4:
                lo += (qb & 15).to(tl.float32) * xb
                hi += (qb >> 4).to(tl.float32) * xb
            else:
                lo += qb.to(tl.float32) * xb
            xs += xk
        if BITS == 4:
            part = tl.reshape(tl.join(lo, hi), [BC * VALS])                # outputs 2c, 2c + 1
        else:
            part = lo
        gmask = nmask & (nb * 0 + g * G < K)                               # the last split's spare groups
        sc = tl.load(s_ptr + g * N + nb, mask=gmask, other=0.0).to(tl.float32)
        of = tl.load(o_ptr + g * N + nb, mask=gmask, other=0.0).to(tl.float32)
        acc += part * sc + of * xs
    dst = y_ptr + sid * N if SPLIT > 1 else y_ptr                          # fp32 partials, [SPLIT, N]
    tl.store(dst + nb, acc.to(dst.dtype.element_ty), mask=nmask)


@triton.jit
def finish_kernel(part_ptr, y_ptr, r_ptr, N, SPLIT: tl.constexpr, SWIGLU: tl.constexpr,
                  RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Adds the SPLIT partial sums in a fixed order and applies the SwiGLU / residual epilogue."""
    _pdl_start(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    width = 2 * N if SWIGLU else N
    y = tl.zeros([BLOCK], dtype=tl.float32)
    u = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        y += tl.load(part_ptr + s * width + offs, mask=m, other=0.0)
        if SWIGLU:
            u += tl.load(part_ptr + s * width + N + offs, mask=m, other=0.0)
    if SWIGLU:
        y = y * tl.sigmoid(y) * u
    if RES:
        y += tl.load(r_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def quantize_inputs_kernel(x_ptr, ln_ptr, eps, K, xq_ptr, dx_ptr, xw_ptr, W,
                           BITS: tl.constexpr, BWQ: tl.constexpr, NB: tl.constexpr, NORM: tl.constexpr,
                           PDL: tl.constexpr = False):
    # the int8-input GEMV's inputs, once per call instead of in every program (_store_words: each
    # word's inputs, x * ln when NORM, rounded to int8 with one step, packed, the word's sum), 1 / RMS
    # folded into the steps
    _pdl_start(PDL)
    VALS: tl.constexpr = 32 // BITS
    wi = tl.program_id(0) * BWQ + tl.arange(0, BWQ)
    k8 = wi[:, None] * VALS + tl.arange(0, VALS)[None, :]
    xv = tl.load(x_ptr + k8, mask=k8 < K, other=0.0).to(tl.float32)
    rstd = 1.0
    if NORM:
        xv = xv * tl.load(ln_ptr + k8, mask=k8 < K, other=0.0).to(tl.float32)
        rstd = _rstd(x_ptr, eps, K, NB)
    _store_words(xv, wi, rstd, xq_ptr, dx_ptr, xw_ptr, W, BITS, BWQ)


@triton.jit
def _group_codes(q_ptr, s_ptr, o_ptr, rows, lmask, w0, N, NGROUPS, ROWW, h: tl.constexpr, BW: tl.constexpr,
                 WG: tl.constexpr):
    """A tile's codes [BN, BW] (h 1: the up rows) and its groups' steps and offsets [BN, BW / WG]."""
    GT: tl.constexpr = BW // WG
    wi = w0 + tl.arange(0, BW)
    m2 = lmask[:, None] & (wi < ROWW)[None, :]
    gi = w0 // WG + tl.arange(0, GT)
    sm = lmask[:, None] & (gi < NGROUPS)[None, :]
    so = (rows + h * N)[:, None] * NGROUPS + gi[None, :]
    qw = tl.load(q_ptr + (rows + h * N)[:, None] * ROWW + wi[None, :], mask=m2, other=0)
    return qw, tl.load(s_ptr + so, mask=sm, other=0.0), tl.load(o_ptr + so, mask=sm, other=0.0)


@triton.jit
def _prepared_inputs(xq_ptr, dx_ptr, xw_ptr, w0, ROWW, BITS: tl.constexpr, BW: tl.constexpr, WG: tl.constexpr):
    """A tile's prepared inputs: pa, pb [1, BW], the word steps dx [1, BW], the groups' input sums xg
    [1, BW / WG]."""
    GT: tl.constexpr = BW // WG
    wi = w0 + tl.arange(0, BW)
    wm = wi < ROWW
    pa = tl.load(xq_ptr + wi, mask=wm, other=0)[None, :]
    pb = tl.load(xq_ptr + ROWW + wi, mask=wm, other=0)[None, :] if BITS == 4 else pa
    dx = tl.load(dx_ptr + wi, mask=wm, other=0.0)[None, :]
    xg = tl.sum(tl.reshape(tl.load(xw_ptr + wi, mask=wm, other=0.0), [GT, WG]), axis=1)[None, :]
    return pa, pb, dx, xg


@triton.jit
def _group_dot(qw, s, o, pa, pb, dx, xg, BN: tl.constexpr, BW: tl.constexpr, BITS: tl.constexpr,
               WG: tl.constexpr, DP4A: tl.constexpr):
    GT: tl.constexpr = BW // WG
    d = _word_dots(qw, pa, pb, BN, BW, BITS, DP4A)
    f = tl.sum(tl.reshape(d.to(tl.float32) * dx, [BN, GT, WG]), axis=2)               # [BN, GT]
    return tl.sum(f * s.to(tl.float32) + o.to(tl.float32) * xg, axis=1)


@triton.jit
def gemv_q_kernel(xq_ptr, dx_ptr, xw_ptr, q_ptr, s_ptr, o_ptr, y_ptr, r_ptr, nq_ptr, ndx_ptr,
                  nxw_ptr, NW, z_ptr, bg_ptr, bu_ptr, thr, RK, N, NGROUPS, ROWW, WPS,
                  BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr,
                  SWIGLU: tl.constexpr, RES: tl.constexpr, SPLIT: tl.constexpr, LIVE: tl.constexpr,
                  R: tl.constexpr, DP4A: tl.constexpr, NEXT_BITS: tl.constexpr = 0,
                  PDL: tl.constexpr = False, EARLY: tl.constexpr = False):
    # codes x the prepared int8 inputs (quantize_inputs_kernel, or the epilogue of the GEMV that made
    # them) by _word_dots; each word's integer sum scaled by its input step, summed over the group's
    # words, then the group's weight step and offset applied once a group (not once a word).
    # EARLY (not LIVE): the first tile of weights loaded before PDL's wait, as gemv_i8_kernel
    tl.static_assert(not (EARLY and LIVE), "a predictor's rows depend on the input: no weights before the wait")
    _pdl_launch(PDL)
    WG: tl.constexpr = G // (32 // BITS)
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < N
    w_lo = sid * WPS
    if EARLY:
        qa, sa, oa = _group_codes(q_ptr, s_ptr, o_ptr, rows, rmask, w_lo, N, NGROUPS, ROWW, 0, BW, WG)
        if SWIGLU:
            qb, sb, ob = _group_codes(q_ptr, s_ptr, o_ptr, rows, rmask, w_lo, N, NGROUPS, ROWW, 1, BW, WG)
    _pdl_wait(PDL)
    lmask = _live_rows(z_ptr, bg_ptr, bu_ptr, thr, RK, rows, rmask, N, LIVE, R)   # the rows read
    acc = tl.zeros([BN], dtype=tl.float32)
    acc2 = tl.zeros([BN], dtype=tl.float32)
    start = w_lo
    if EARLY:
        pa, pb, dx, xg = _prepared_inputs(xq_ptr, dx_ptr, xw_ptr, w_lo, ROWW, BITS, BW, WG)
        acc += _group_dot(qa, sa, oa, pa, pb, dx, xg, BN, BW, BITS, WG, DP4A)
        if SWIGLU:
            acc2 += _group_dot(qb, sb, ob, pa, pb, dx, xg, BN, BW, BITS, WG, DP4A)
        start = w_lo + BW
    for w0 in range(start, w_lo + WPS, BW):
        pa, pb, dx, xg = _prepared_inputs(xq_ptr, dx_ptr, xw_ptr, w0, ROWW, BITS, BW, WG)
        for h in tl.static_range(2 if SWIGLU else 1):                    # h 1: the up rows
            qw, s, o = _group_codes(q_ptr, s_ptr, o_ptr, rows, lmask, w0, N, NGROUPS, ROWW, h, BW, WG)
            contrib = _group_dot(qw, s, o, pa, pb, dx, xg, BN, BW, BITS, WG, DP4A)
            if h == 0:
                acc += contrib
            else:
                acc2 += contrib
    _finish(acc, acc2, rows, rmask, pid, sid, N, y_ptr, r_ptr, nq_ptr, ndx_ptr, nxw_ptr, NW,
            SWIGLU, RES, SPLIT, BN, NEXT_BITS)
