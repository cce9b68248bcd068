"""The path predictor: per layer, which FFN channels will matter for this token, decided from the
normalised FFN input x before any FFN weight is read.

Design (the SIH head's family: tiny, calibrated, deterministic). A shared rank-r projection
z = x A (A: D x r) and two small maps give cheap estimates of the gate and up pre-activations,
g~ = z Bg and u~ = z Bu (Bg, Bu: r x F). A channel's predicted contribution to the FFN output is

    s_j = |silu(g~_j) * u~_j| * ||W_down[:, j]||

and the channels with s_j >= threshold (one per layer, set by the quality gate) are computed
exactly; the others are never read. A, Bg, Bu are the closed-form data-aware (whitened) rank-r
fit of [W_gate; W_up] on calibration inputs: with C = E[x x^T] = S S, the best rank-r map in the
input distribution's metric is S^-1 * SVD_r(S [W_gate; W_up]^T). No training loop, no randomness.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class PathPredictor(nn.Module):
    def __init__(self, a: torch.Tensor, bg: torch.Tensor, bu: torch.Tensor, wd_norm: torch.Tensor,
                 threshold: float = 0.0):
        super().__init__()
        self.register_buffer("a", a.float().contiguous())          # (D, r)
        self.register_buffer("bg", bg.float().contiguous())        # (r, F)
        self.register_buffer("bu", bu.float().contiguous())        # (r, F)
        self.register_buffer("wd_norm", wd_norm.float().contiguous())  # (F,)
        self.threshold = float(threshold)

    @property
    def rank(self) -> int:
        return self.a.shape[1]

    def weights(self) -> int:
        """Weights a decode step reads for the prediction (wd_norm is folded into bg at export)."""
        return self.a.numel() + self.bg.numel() + self.bu.numel()

    @torch.no_grad()
    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) -> predicted |contribution| of every channel (..., F), fp32."""
        z = x.float() @ self.a
        return (F.silu(z @ self.bg) * (z @ self.bu)).abs() * self.wd_norm

    @torch.no_grad()
    def mask(self, x: torch.Tensor, threshold: Optional[float] = None) -> torch.Tensor:
        thr = self.threshold if threshold is None else threshold
        return self.scores(x) >= thr

    def state(self, prefix: str) -> dict:
        return {f"{prefix}.a": self.a, f"{prefix}.bg": self.bg, f"{prefix}.bu": self.bu,
                f"{prefix}.wd_norm": self.wd_norm,
                f"{prefix}.threshold": torch.tensor([self.threshold])}

    @classmethod
    def from_state(cls, tensors: dict, prefix: str) -> "PathPredictor":
        need = [f"{prefix}.{k}" for k in ("a", "bg", "bu", "wd_norm", "threshold")]
        missing = [k for k in need if k not in tensors]
        if missing:
            raise KeyError(", ".join(missing))
        return cls(tensors[need[0]], tensors[need[1]], tensors[need[2]], tensors[need[3]],
                   float(tensors[need[4]].reshape(-1)[0]))


@torch.no_grad()
def fit_predictor(x: torch.Tensor, mlp, rank: int, eps: float = 1e-4) -> PathPredictor:
    """Whitened rank-`rank` fit of [W_gate; W_up] on inputs x (n, D). Deterministic (fp64 SVD)."""
    xd = x.double().reshape(-1, x.shape[-1])
    D = xd.shape[1]
    C = xd.T @ xd / xd.shape[0]
    C = C + eps * C.diagonal().mean() * torch.eye(D, dtype=torch.float64)
    lam, Q = torch.linalg.eigh(C)
    lam = lam.clamp_min(1e-12)
    S = (Q * lam.sqrt()) @ Q.T
    S_inv = (Q * lam.rsqrt()) @ Q.T
    wg = mlp.gate_proj.weight.double()             # (F, D)
    wu = mlp.up_proj.weight.double()
    Fdim = wg.shape[0]
    M = S @ torch.cat([wg, wu], 0).T               # (D, 2F)
    U, sig, Vh = torch.linalg.svd(M, full_matrices=False)
    r = min(rank, D)
    # sign convention: make each singular vector's largest entry positive (deterministic output)
    flip = torch.sign(U[:, :r].gather(0, U[:, :r].abs().argmax(0, keepdim=True)))
    flip[flip == 0] = 1
    a = S_inv @ (U[:, :r] * flip)
    b = (sig[:r, None] * Vh[:r]) * flip.T
    wd_norm = mlp.down_proj.weight.double().norm(dim=0)
    return PathPredictor(a.float(), b[:, :Fdim].float(), b[:, Fdim:].float(), wd_norm.float())
