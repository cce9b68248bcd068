"""PyTorch reference for the plugin nodes of zeroedge.plugin_spec (what plugins/src/kernels.cu and
plugins/kernels/paths_gemv.cu compute).

Small, readable functions that mirror the node semantics exactly; the device tests compare the CUDA
kernels against them, and the portable ONNX functions compute the same thing. Arithmetic is float32
(or float64 when the inputs are float64); tensors are [T, D] (no batch dimension), or [B, D] decode
tokens for paths_ffn.

    keep, base   = sih(x, w1, b1, w2, b2, w3, b3, w4, b4, anchor_a, anchor_b, anchor_c, **fields)
    keep, base, carry_out = sih_chunk(x, w1, ..., anchor_c, carry, span, **fields)
    xs, idx, cnt = pad_gather(x, keep)
    out          = pad_scatter(base, y, idx)
    y            = paths_ffn(x, w13_t, wd_t, threshold_in, threshold)
"""
from __future__ import annotations

from zeroedge import plugin_spec


def _fields(op: str, overrides: dict) -> dict:
    spec = plugin_spec.NODES[op]["fields"]
    unknown = set(overrides) - set(spec)
    if unknown:
        raise TypeError(f"unknown {op} fields: {sorted(unknown)}")
    out = {k: d for k, (_, d) in spec.items()}
    out.update(overrides)
    missing = [k for k, v in out.items() if v is None]
    if missing:
        raise TypeError(f"{op} fields without a value: {missing}")
    return out


def sih_fields(**overrides) -> dict:
    """The ZeroEdgeSIH fields with plugin_spec defaults filled in (threshold is required)."""
    return _fields("ZeroEdgeSIH", overrides)


def paths_fields(**overrides) -> dict:
    """The ZeroEdgePathsFFN fields (threshold_in and threshold are both required)."""
    return _fields("ZeroEdgePathsFFN", overrides)


def sih_scores(x, w1, b1, w2, b2, w3, b3, w4, b4):
    """Raw importance in (0, 1) per row of x [T, D]: sigmoid(l4(relu(l3(relu(l2(relu(l1(x))))))))."""
    import torch

    h = torch.relu(x @ w1.T + b1)
    h = torch.relu(h @ w2.T + b2)
    h = torch.relu(h @ w3.T + b3)
    return torch.sigmoid((h @ w4.T + b4).reshape(-1))


def smooth(scores, ma_w0: float, ma_w1: float, ma_w2: float, carry=None, start: int = 0):
    """Causal 3-position weighted moving average, renormalised over the positions that exist.

    `scores` [T] are positions start..start+T-1; carry [2] the raw scores of start-2, start-1 (read
    only where those positions exist). The weights are float32 plugin fields; the normalisers are
    their float64 sums rounded to float32, and the sum runs w0*s[t] + w1*s[t-1] + w2*s[t-2] in that
    order (as the kernel does)."""
    import torch

    f32 = torch.float32
    w0, w1, w2 = (float(torch.tensor(w, dtype=f32)) for w in (ma_w0, ma_w1, ma_w2))
    s = scores
    T = s.shape[0]
    ext = torch.cat((s.new_zeros(2) if carry is None else carry.to(s.dtype), s))
    pos = torch.arange(start, start + T, device=s.device)
    s1 = torch.where(pos >= 1, ext[1:T + 1], torch.zeros_like(s))
    s2 = torch.where(pos >= 2, ext[:T], torch.zeros_like(s))
    norm = torch.full((T,), w0 + w1 + w2, dtype=s.dtype, device=s.device)
    norm[pos == 0] = w0
    norm[pos == 1] = w0 + w1
    return (w0 * s + w1 * s1 + w2 * s2) / norm


def sih_keep(scores, threshold: float, ma_w0: float = 0.5, ma_w1: float = 0.333333, ma_w2: float = 0.166667,
             min_tokens: int = 32, protect_first: int = 4, protect_last: int = 1, block_size: int = 0,
             block_frac: float = plugin_spec.BLOCK_FRAC, carry=None, start: int = 0, prompt_len=None,
             rate: float = -1.0, rank_block: int = 512, **_ignored):
    """int32 [T] keep mask from raw scores [T] (float32): the decision half of ZeroEdgeSIH, or of
    ZeroEdgeSIHChunk for positions start.. of a prompt_len-token prompt with the carry."""
    import torch

    T = scores.shape[0]
    n = T if prompt_len is None else int(prompt_len)
    dev = scores.device
    if n < min_tokens:
        return torch.ones(T, dtype=torch.int32, device=dev)
    sm = smooth(scores.float(), ma_w0, ma_w1, ma_w2, carry, start)
    pos = torch.arange(start, start + T, device=dev)
    if rate >= 0:
        return rank_keep(sm, pos, n, rate, rank_block, protect_first, protect_last)
    thr = torch.tensor(threshold, dtype=torch.float32).item()
    keep = sm >= thr
    if block_size > 0:
        nb = (T + block_size - 1) // block_size
        low = torch.nn.functional.pad((~keep).float(), (0, nb * block_size - T))
        counts = torch.full((nb,), float(block_size), device=dev)
        counts[-1] = T - (nb - 1) * block_size
        frac = low.view(nb, block_size).sum(-1) / counts
        bf = torch.tensor(block_frac, dtype=torch.float32).item()
        keep = (frac <= bf).repeat_interleave(block_size)[:T]
    keep = keep | (pos < protect_first) | (pos >= n - protect_last)
    return keep.to(torch.int32)


def rank_keep(sm, pos, n: int, rate: float, rank_block: int, protect_first: int, protect_last: int):
    """The rank rule, by its definition: position i of a block skips when it is skippable and fewer
    than floor(rate * m + 0.5) of the block's m skippable positions j score below it (s_j < s_i, or
    s_j == s_i with j < i). O(block^2) per block: a reference, not a kernel."""
    import torch

    free = (pos >= protect_first) & (pos < n - protect_last) & (pos < n)
    keep = torch.ones_like(sm, dtype=torch.bool)
    r = torch.tensor(rate, dtype=torch.float32)
    for b in torch.unique(torch.div(pos, rank_block, rounding_mode="floor")):
        rows = torch.nonzero((torch.div(pos, rank_block, rounding_mode="floor") == b) & free).reshape(-1)
        if not rows.numel():
            continue
        s = sm[rows]
        below = (s[None, :] < s[:, None]) | ((s[None, :] == s[:, None]) & (rows[None, :] < rows[:, None]))
        quota = int(torch.floor(r * float(rows.numel()) + 0.5))
        keep[rows] = below.sum(1) >= quota
    return keep.to(torch.int32)


def sih_base(x, keep, anchor_a, anchor_b, anchor_c, anchor_rank: int):
    """[T, D]: anchor_b @ (anchor_a @ x) + anchor_c on rows with keep == 0, zero elsewhere."""
    import torch

    if anchor_rank == 0:
        return torch.zeros_like(x)
    anchor = (x @ anchor_a.T) @ anchor_b.T + anchor_c
    return torch.where(keep.bool()[:, None], torch.zeros_like(anchor), anchor)


def sih(x, w1, b1, w2, b2, w3, b3, w4, b4, anchor_a, anchor_b, anchor_c, **fields):
    """ZeroEdgeSIH: (keep int32 [T], base [T, D]) for x [T, D]."""
    f = sih_fields(**fields)
    scores = sih_scores(x, w1, b1, w2, b2, w3, b3, w4, b4).float()
    keep = sih_keep(scores, **f)
    return keep, sih_base(x, keep, anchor_a, anchor_b, anchor_c, f["anchor_rank"])


def sih_chunk(x, w1, b1, w2, b2, w3, b3, w4, b4, anchor_a, anchor_b, anchor_c, carry, span, **fields):
    """ZeroEdgeSIHChunk: (keep int32 [T], base [T, D], carry_out float32 [2]) for the rows x [T, D] at
    positions span[0].. of a span[1]-token prompt, carry [2] the raw scores of the two positions before."""
    import torch

    f = sih_fields(**fields)
    scores = sih_scores(x, w1, b1, w2, b2, w3, b3, w4, b4).float()
    start, n = (int(v) for v in span)
    keep = sih_keep(scores, **f, carry=carry.float(), start=start, prompt_len=n)
    carry_out = torch.cat((carry.float(), scores))[-2:]
    return keep, sih_base(x, keep, anchor_a, anchor_b, anchor_c, f["anchor_rank"]), carry_out


def pad_gather(x, keep):
    """ZeroEdgePADGather: (xs [K, D], idx int32 [K], count int32 [1])."""
    import torch

    idx = torch.nonzero(keep != 0).reshape(-1).to(torch.int32)
    return x[idx.long()], idx, torch.tensor([idx.numel()], dtype=torch.int32, device=x.device)


def pad_scatter(base, y, idx):
    """ZeroEdgePADScatter: out = base with out[idx[k]] = y[k]."""
    out = base.clone()
    out[idx.long()] = y
    return out


def paths_ffn(x, w13_t, wd_t, threshold_in: float, threshold: float):
    """ZeroEdgePathsFFN: y [B, D] (x's dtype) for x [B, D], w13_t [D, 2F] (gate columns, then up), wd_t [F, D].

    Per token b (masks are per token, never shared across the batch):
    x'[b, k] = x[b, k] where |x[b, k]| >= threshold_in, else 0; g | u = x' w13_t;
    a = silu(g) * u; a'[b, j] = a[b, j] where |a[b, j]| >= threshold, else 0; y = a' wd_t.
    The thresholds are float32 fields; arithmetic float32 (float64 for float64 inputs)."""
    import torch

    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    thr_in, thr = (float(torch.tensor(t, dtype=torch.float32)) for t in (threshold_in, threshold))
    F = wd_t.shape[0]
    if x.dim() != 2 or tuple(w13_t.shape) != (x.shape[1], 2 * F) or tuple(wd_t.shape) != (F, x.shape[1]):
        raise ValueError(f"ZeroEdgePathsFFN: want x [B, D], w13_t [D, 2F], wd_t [F, D]; got {tuple(x.shape)}, "
                         f"{tuple(w13_t.shape)}, {tuple(wd_t.shape)}")
    xf = x.to(ct)
    xk = torch.where(xf.abs() >= thr_in, xf, torch.zeros_like(xf))
    gu = xk @ w13_t.to(ct)
    a = torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]
    a = torch.where(a.abs() >= thr, a, torch.zeros_like(a))
    return (a @ wd_t.to(ct)).to(x.dtype)
