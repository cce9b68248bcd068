"""SIH, the semantic importance head: per layer, a tiny MLP (4 linear layers, sigmoid) that reads the
normalised FFN input of each token and scores whether the token's FFN matters. Scores are smoothed
over the last 3 positions and turned into a keep mask by one of two rules (the same the CUDA plugin
runs): the threshold rule (a token skips when its score is below the layer's threshold) or the rank rule
(in each block of positions a layer skips a fixed share, the lowest-scored; `rank_mask`).

A prompt prefilled in chunks decides exactly as in one pass: `smooth_chunk` takes the previous
chunk's last two raw scores (the carry), `keep_mask` takes the chunk's first absolute position and
the prompt's length, and block-rule blocks are counted from position 0 (a chunk starts on a block
boundary: `ChunkError` otherwise)."""
from __future__ import annotations

import torch
from torch import nn

from zeroedge.plugin_spec import BLOCK_FRAC

MA_WEIGHTS = (0.5, 1 / 3, 1 / 6)  # weights of positions t, t-1, t-2
SIZE_BUDGET_BYTES = 12 * 1024      # per layer, fp16


def head_params(dim: int, width: int) -> int:
    return dim * width + width + 2 * (width * width + width) + width + 1


def head_width(dim: int, budget: int = SIZE_BUDGET_BYTES, cap: int = 16) -> int:
    """The widest hidden layer (<= cap) whose head fits the fp16 byte budget."""
    w = cap
    while w > 1 and 2 * head_params(dim, w) > budget:
        w -= 1
    return w


class SIHHead(nn.Module):
    def __init__(self, dim: int, width: int):
        super().__init__()
        self.l1, self.l2 = nn.Linear(dim, width), nn.Linear(width, width)
        self.l3, self.l4 = nn.Linear(width, width), nn.Linear(width, 1)

    def logits(self, x):
        r = torch.relu
        return self.l4(r(self.l3(r(self.l2(r(self.l1(x))))))).squeeze(-1)

    def forward(self, x):
        """x: (..., T, D) normalised hidden -> importance in (0, 1), shape (..., T)."""
        return torch.sigmoid(self.logits(x))

    def bytes_fp16(self) -> int:
        return 2 * sum(p.numel() for p in self.parameters())

    def state(self, prefix: str) -> dict:
        ls = (self.l1, self.l2, self.l3, self.l4)
        out = {}
        for i, l in enumerate(ls, 1):
            out[f"{prefix}.w{i}"], out[f"{prefix}.b{i}"] = l.weight.data, l.bias.data
        return out

    @classmethod
    def from_state(cls, t: dict, prefix: str) -> "SIHHead":
        w1 = t[f"{prefix}.w1"]
        h = cls(w1.shape[1], w1.shape[0])
        for i, l in enumerate((h.l1, h.l2, h.l3, h.l4), 1):
            l.weight.data.copy_(t[f"{prefix}.w{i}"])
            l.bias.data.copy_(t[f"{prefix}.b{i}"])
        return h.eval()


def smooth(scores: torch.Tensor, weights=MA_WEIGHTS) -> torch.Tensor:
    """Causal weighted moving average over the last 3 positions (renormalised at the start)."""
    w0, w1, w2 = weights
    s1 = torch.nn.functional.pad(scores, (1, 0))[..., :-1]
    s2 = torch.nn.functional.pad(scores, (2, 0))[..., :-2]
    T = scores.shape[-1]
    norm = torch.full((T,), w0 + w1 + w2, dtype=scores.dtype, device=scores.device)
    norm[:1] = w0
    if T > 1:
        norm[1:2] = w0 + w1
    return (w0 * scores + w1 * s1 + w2 * s2) / norm


class ChunkError(ValueError):
    """A chunk does not start on a block-rule block boundary (its decisions would differ from one pass)."""


def smooth_chunk(scores: torch.Tensor, carry: torch.Tensor, start: int, weights=MA_WEIGHTS):
    """`smooth` for the chunk of raw scores (B, T) at positions start..start+T-1, given the carry
    (B, 2): the raw scores at positions start-2, start-1 (read only where those positions exist).
    Returns (smoothed (B, T), the next chunk's carry (B, 2)). Same arithmetic as `smooth`, so the
    chunks of a prompt give bit-identical scores to one pass."""
    w0, w1, w2 = weights
    T = scores.shape[-1]
    ext = torch.cat((carry.to(scores.dtype), scores), -1)
    pos = torch.arange(start, start + T, device=scores.device)
    s1 = torch.where(pos >= 1, ext[..., 1:T + 1], torch.zeros_like(scores))
    s2 = torch.where(pos >= 2, ext[..., :T], torch.zeros_like(scores))
    norm = torch.full((T,), w0 + w1 + w2, dtype=scores.dtype, device=scores.device)
    norm[pos == 0] = w0
    norm[pos == 1] = w0 + w1
    return (w0 * scores + w1 * s1 + w2 * s2) / norm, ext[..., -2:]


def keep_mask(score: torch.Tensor, threshold: float, protect_first: int = 4, protect_last: int = 1,
              block_size: int = 0, block_frac: float = BLOCK_FRAC, limit: int | None = None,
              start: int = 0) -> torch.Tensor:
    """Bool (B, T): True = compute the FFN. Low importance = smoothed score below threshold.

    `score` holds positions start..start+T-1 (start > 0: a chunk of a longer prompt). Block rule
    (block_size > 0): a block of N tokens (counted from position 0) skips when more than block_frac
    of it is low; otherwise every token in it is computed. Positions >= limit (the prompt's length;
    not part of the prompt being prefilled) are always kept; so are the first `protect_first`
    (attention sinks) and the last `protect_last` positions of the prompt (its logits are needed)."""
    B, T = score.shape
    keep = score >= threshold
    if block_size > 0:
        if start % block_size:
            raise ChunkError(f"a chunk starting at position {start} is not on a {block_size}-token block "
                             "boundary: prefill in chunks of a multiple of the block size")
        nb = (T + block_size - 1) // block_size
        low = torch.nn.functional.pad((~keep).float(), (0, nb * block_size - T), value=0.0)
        counts = torch.full((nb,), float(block_size), device=score.device)
        counts[-1] = T - (nb - 1) * block_size
        frac = low.view(B, nb, block_size).sum(-1) / counts
        keep = (frac <= block_frac).repeat_interleave(block_size, dim=1)[:, :T]
    return protect(keep, protect_first, protect_last, limit, start)


def rank_mask(score: torch.Tensor, rate: float, rank_block: int, protect_first: int = 4, protect_last: int = 1,
              limit: int | None = None, start: int = 0) -> torch.Tensor:
    """Bool (B, T): True = compute the FFN, by the rank rule (zeroedge.plugin_spec, RANK RULE).

    `score` holds positions start..start+T-1 of a prompt of `limit` tokens (None: start + T); blocks of
    `rank_block` positions are counted from position 0, so a chunk starts on a block boundary
    (`ChunkError` otherwise). In each block the floor(rate * n + 0.5) lowest-scored of its n skippable
    positions (in the prompt, not protected) skip; ties go to the earlier position."""
    B, T = score.shape
    if rank_block < 1:
        raise ValueError(f"rank_block must be >= 1, got {rank_block}")
    if start % rank_block:
        raise ChunkError(f"a chunk starting at position {start} is not on a {rank_block}-token rank block "
                         "boundary: prefill in chunks of a multiple of the rank block")
    plen = start + T if limit is None else limit
    pos = torch.arange(start, start + T, device=score.device)
    free = (pos >= protect_first) & (pos < plen - protect_last) & (pos < plen)
    nb = (T + rank_block - 1) // rank_block
    padn = nb * rank_block - T
    s = torch.nn.functional.pad(score.float().masked_fill(~free, float("inf")), (0, padn), value=float("inf"))
    free_b = torch.nn.functional.pad(free, (0, padn), value=False).view(nb, rank_block)
    order = s.view(B, nb, rank_block).argsort(dim=-1, stable=True)       # protected positions (inf) last
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(rank_block, device=score.device).expand_as(order))
    n = free_b.sum(-1).to(torch.float32)
    quota = torch.floor(torch.tensor(rate, dtype=torch.float32) * n + 0.5).to(torch.int64)
    skip = free_b & (rank < quota[:, None])
    return ~skip.reshape(B, nb * rank_block)[:, :T]


def protect(keep: torch.Tensor, protect_first: int, protect_last: int, limit: int | None, start: int = 0):
    """keep with the protected positions set (positions start.., the prompt's length limit, or
    start + T when None)."""
    keep = keep.clone()
    T = keep.shape[1]
    end = T if limit is None else min(max(limit - start, 0), T)    # chunk-local end of the prompt
    keep[:, :max(protect_first - start, 0)] = True
    if protect_last:
        last = (start + T if limit is None else limit) - protect_last - start
        keep[:, max(last, 0):end] = True
    keep[:, end:] = True
    return keep
