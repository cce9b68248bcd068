"""Attention-head profiling by softmax entropy, and the two readings of "useless head".

The article says heads with *low* entropy are useless; but near-uniform attention has *high* entropy.
Both readings are measured (and random as a control); what the numbers support is kept.
Entropy is normalised by log(number of visible keys), so 1.0 = uniform at any position."""
from __future__ import annotations

import torch


@torch.no_grad()
def entropy_profile(model, seqs) -> torch.Tensor:
    """(n_layers, n_heads) mean normalised entropy over queries (skipping the first 16)."""
    L, H = model.cfg.n_layers, model.cfg.n_heads
    acc = torch.zeros(L, H, dtype=torch.float64)
    n = 0
    for blk in model.layers:
        blk.self_attn.record_probs = True
    try:
        for ids in seqs:
            t = torch.as_tensor(ids)[None]
            T = t.shape[1]
            vis = torch.arange(1, T + 1, dtype=torch.float64)
            norm = torch.log(vis).clamp_min(1e-9)
            x = model.embed_tokens(t)
            cos, sin = model.rope(0, T)
            for blk in model.layers:
                x = blk(x, cos, sin, 0, None)
                p = blk.self_attn.last_probs[0].double()            # (H, T, T)
                ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)   # (H, T)
                heads = blk.self_attn.kept_heads
                acc[blk.index, heads] += (ent[:, 16:] / norm[16:]).mean(-1)
                blk.self_attn.last_probs = None
            n += 1
    finally:
        for blk in model.layers:
            blk.self_attn.record_probs = False
    return acc / max(n, 1)


def pick_heads(profile: torch.Tensor, k: int, reading: str, first_layer: int = 0, seed: int = 0):
    """The k heads to prune under a reading: 'low' entropy, 'high' (near-uniform), or 'random'."""
    L, H = profile.shape
    cand = [(l, h) for l in range(first_layer, L) for h in range(H)]
    if reading == "random":
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(cand), generator=g).tolist()
    else:
        vals = torch.tensor([float(profile[l, h]) for l, h in cand])
        order = vals.argsort(descending=(reading == "high")).tolist()
    chosen = {}
    for i in order:
        l, h = cand[i]
        if len(chosen.get(l, [])) < H - 1:  # never prune a whole layer
            chosen.setdefault(l, []).append(h)
            if sum(map(len, chosen.values())) == k:
                break
    return chosen


def apply_pruning(model, pruned: dict):
    for layer, heads in pruned.items():
        model.layers[int(layer)].self_attn.prune_heads(heads)


def attention_flops_saved(model, pruned: dict, T: int) -> float:
    """Fraction of the attention block's prefill FLOPs (q/o projections + scores) removed."""
    cfg = model.cfg
    hd = cfg.head_dim
    per_head = 2 * 2 * cfg.dim * hd + 2 * 2 * hd * T / 2   # q and o rows; QK^T and PV, causal
    kv = 2 * 2 * cfg.dim * cfg.n_kv_heads * hd
    total = cfg.n_layers * (cfg.n_heads * per_head + kv)
    return sum(map(len, pruned.values())) * per_head / total
