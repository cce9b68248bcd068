"""The room for decode sparsity in the FFN, and the byte accounting every method shares.

Per layer and token the SwiGLU FFN is  y = W_down (silu(W_gate x) * (W_up x)); channel j owns row j
of W_gate and W_up and column j of W_down. A decode step reads all three matrices (3 * D * F
weights). What each method can leave unread, per token and layer, for the channels it cuts:

  topk      top-k oracle on the product a = silu(g) * u: a needs g and u for every channel, so
            only the down columns of the cut channels go unread (at most a third of the bytes)
  cats      CATS-style threshold on |silu(g)|: g is computed for every channel, the up rows and
            down columns of the cut channels go unread (at most two thirds)
  predictor the path predictor decides from x before any FFN weight is read: gate, up and down of
            the cut channels go unread, minus the predictor's own weights

`read_fraction(method, kept, predictor_weights)` turns a kept-channel fraction into the fraction
of the layer's FFN weight bytes that a step reads (all weights in the same dtype).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

METHODS = ("topk", "cats", "predictor")


def read_fraction(method: str, kept: float, D: int, Fdim: int, predictor_weights: int = 0) -> float:
    """Fraction of 3*D*F FFN weights read by one token in one layer keeping `kept` of F channels."""
    if method == "topk":
        return (2 + kept) / 3
    if method == "cats":
        return (1 + 2 * kept) / 3
    if method in ("predictor", "predictor_topk"):
        return kept + predictor_weights / (3 * D * Fdim)
    if method == "dense":
        return 1.0
    raise ValueError(f"unknown method {method}")


def activation(mlp, x: torch.Tensor):
    """(gate pre-activation, product a = silu(g) * u) of an MLP for inputs x (..., D)."""
    g = mlp.gate_proj(x)
    return g, F.silu(g) * mlp.up_proj(x)


def topk_mask(a: torch.Tensor, keep: float) -> torch.Tensor:
    """Keep the round(keep * F) largest |a| channels of every token (the oracle on the product)."""
    Fdim = a.shape[-1]
    k = max(1, min(Fdim, int(round(keep * Fdim))))
    idx = a.abs().topk(k, dim=-1).indices
    return torch.zeros_like(a, dtype=torch.bool).scatter_(-1, idx, True)


def cats_threshold(g: torch.Tensor, keep: float) -> float:
    """The |silu(g)| threshold that keeps a `keep` fraction of channels over these tokens (CATS
    calibrates one threshold per layer this way)."""
    s = F.silu(g.float()).abs().flatten()
    if keep >= 1:
        return 0.0
    if s.numel() > 2_000_000:  # quantile has an input size limit; a strided sample suffices
        s = s[:: s.numel() // 2_000_000 + 1]
    return float(torch.quantile(s, 1 - keep))


def cats_mask(g: torch.Tensor, threshold: float) -> torch.Tensor:
    return F.silu(g).abs() >= threshold
