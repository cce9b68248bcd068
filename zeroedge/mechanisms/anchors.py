"""Anchors: a cheap rank-r linear surrogate for a layer's FFN output, used for tokens whose FFN is
skipped so the residual stream keeps its statistics. y ~ b @ (a @ x) + c, fitted by reduced-rank
ridge regression on calibration tokens (x = normalised FFN input, y = true FFN output)."""
from __future__ import annotations

import torch
from torch import nn


class Anchor(nn.Module):
    def __init__(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor):
        super().__init__()
        self.register_buffer("a", a)  # (r, D)
        self.register_buffer("b", b)  # (D, r)
        self.register_buffer("c", c)  # (D,)

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def forward(self, x):
        return (x @ self.a.T) @ self.b.T + self.c

    def flops_per_token(self) -> int:
        return 2 * 2 * self.a.shape[0] * self.a.shape[1]

    def state(self, prefix: str) -> dict:
        return {f"{prefix}.a": self.a, f"{prefix}.b": self.b, f"{prefix}.c": self.c}

    @classmethod
    def from_state(cls, t: dict, prefix: str) -> "Anchor":
        return cls(t[f"{prefix}.a"].clone(), t[f"{prefix}.b"].clone(), t[f"{prefix}.c"].clone())


class ZeroAnchor(nn.Module):
    """Plain skipping: the FFN output of a skipped token is zero."""

    rank = 0

    def forward(self, x):
        return torch.zeros_like(x)

    def flops_per_token(self) -> int:
        return 0


def fit_anchor(x: torch.Tensor, y: torch.Tensor, rank: int, ridge: float = 1e-3) -> Anchor:
    """Reduced-rank ridge regression of y on x (both (N, D)), in float64."""
    x, y = x.double().reshape(-1, x.shape[-1]), y.double().reshape(-1, y.shape[-1])
    xm, ym = x.mean(0), y.mean(0)
    xc, yc = x - xm, y - ym
    d = x.shape[1]
    gram = xc.T @ xc
    lam = ridge * gram.diagonal().mean()
    w = torch.linalg.solve(gram + lam * torch.eye(d, dtype=x.dtype), xc.T @ yc)  # (D, D)
    # best rank-r approximation of the fitted values x @ w: project onto their top right vectors
    _, _, vh = torch.linalg.svd(xc @ w, full_matrices=False)
    v = vh[:rank].T                                                           # (D, r)
    a = (w @ v).T                                                             # (r, D)
    c = ym - (xm @ w @ v) @ v.T
    return Anchor(a.float().contiguous(), v.float().contiguous(), c.float())


def anchor_error(anchor, x, y) -> float:
    """Fraction of the FFN output's energy the anchor misses: ||y - a(x)||^2 / ||y||^2."""
    with torch.no_grad():
        return float(((y - anchor(x)) ** 2).sum() / (y ** 2).sum())
