"""The sparse decode MLP: compute only the chosen FFN channels.

`PathMLP` wraps a block's MLP (the ZeroMLP pattern of zeroedge.mechanisms.pad): with the runtime
active, every token keeps only its chosen channels (predictor, or a peer for benchmarks) and
counts the FFN weights its decode step reads. Teacher-forced evaluation computes the masked
product on all tokens at once, which is exactly the sparse step's function; `sparse_mlp_gather`
is the decode step itself (gather rows of gate/up and columns of down), and the tests hold the
two equal.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from zeroedge.mechanisms.pad import MechanismError
from zeroedge.paths.predictor import PathPredictor
from zeroedge.paths.room import activation, cats_mask, read_fraction, topk_mask


@dataclass
class PathPolicy:
    """How one layer picks its channels.

    method="predictor": predicted score >= predictor.threshold (deployed);
    method="predictor_topk": the predictor's top-`keep` channels of every token (benchmarks);
    method="topk": oracle top-`keep` on |silu(g)*u|; method="cats": |silu(g)| >= threshold;
    method="input": TEAL-style, top-`keep_in` |x| input dims for gate/up, then top-`keep` |a|
    for down (benchmarks: a different axis of sparsity, measured beside the others);
    method="magnitude": the deployable form of "input": |x_k| >= threshold_in selects the
    gate/up input dims (columns of W_gate / W_up) to read, |a_j| >= threshold the down rows; both
    thresholds per layer from calibration."""
    method: str = "predictor"
    predictor: Optional[PathPredictor] = None
    keep: float = 1.0
    threshold: float = 0.0
    keep_in: float = 1.0       # method="input": fraction of FFN input dims kept
    threshold_in: float = 0.0  # method="magnitude": |x| threshold


@dataclass
class PathRuntime:
    active: bool = False
    count_from: int = 0                          # positions before this are not counted
    stats: dict = field(default_factory=dict)   # layer -> [tokens, kept channels, weights read]

    def reset_stats(self):
        self.stats.clear()


class PathMLP(nn.Module):
    def __init__(self, mlp: nn.Module, layer: int, runtime: PathRuntime, policy: PathPolicy):
        super().__init__()
        self.mlp, self.layer, self.rt, self.policy = mlp, layer, runtime, policy

    def choose(self, x: torch.Tensor, g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        p = self.policy
        if p.method == "predictor":
            return p.predictor.mask(x)
        if p.method in ("topk", "input"):
            return topk_mask(a, p.keep)
        if p.method == "magnitude":
            return a.abs() >= p.threshold
        if p.method == "predictor_topk":  # fixed per-token count from the predictor's scores
            return topk_mask(p.predictor.scores(x), p.keep)
        if p.method == "cats":
            return cats_mask(g, p.threshold)
        raise ValueError(f"unknown path method {p.method}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.rt.active:
            return self.mlp(x)
        if self.training:
            raise MechanismError("zeroedge mechanisms are inference-only: call model.eval() first")
        if torch.is_grad_enabled():
            raise MechanismError("zeroedge mechanisms are inference-only: run under "
                                 "torch.no_grad() / torch.inference_mode()")
        p = self.policy
        in_keep = None
        if p.method in ("input", "magnitude"):   # TEAL-style: magnitude sparsity of the input
            in_keep = topk_mask(x, p.keep_in) if p.method == "input" else x.abs() >= p.threshold_in
            x = x * in_keep.to(x.dtype)
        g, a = activation(self.mlp, x)
        keep = self.choose(x, g, a)
        self._count(keep, in_keep)
        return self.mlp.down_proj(a * keep.to(a.dtype))

    def _count(self, keep: torch.Tensor, in_keep: Optional[torch.Tensor] = None):
        c = self.rt.count_from
        if keep.dim() == 3:
            keep = keep[:, c:]
            in_keep = in_keep[:, c:] if in_keep is not None else None
        Fdim = keep.shape[-1]
        D = self.mlp.gate_proj.weight.shape[1]
        n = keep.numel() // Fdim
        kept = float(keep.float().sum()) / Fdim           # summed over tokens, as a fraction
        p = self.policy
        if p.method in ("input", "magnitude"):
            read = (2 * float(in_keep.float().sum()) / D + kept) / 3
        else:
            pw = p.predictor.weights() if p.method.startswith("predictor") else 0
            # read_fraction is affine in `kept`, so summing per-token fractions is exact
            r0 = read_fraction(p.method, 0.0, D, Fdim, pw)
            read = r0 * n + (read_fraction(p.method, 1.0, D, Fdim, pw) - r0) * kept
        s = self.rt.stats.setdefault(self.layer, [0, 0.0, 0.0])
        s[0] += n
        s[1] += kept
        s[2] += read


def install(model, policies: dict, runtime: PathRuntime) -> PathRuntime:
    """Wrap the MLP of every layer in `policies` (layer index -> PathPolicy)."""
    remove(model)
    for i, p in policies.items():
        blk = model.layers[i]
        blk.mlp = PathMLP(blk.mlp, i, runtime, p).train(model.training)
    return runtime


def remove(model):
    for blk in model.layers:
        if isinstance(blk.mlp, PathMLP):
            blk.mlp = blk.mlp.mlp


def bytes_summary(model, runtime: PathRuntime) -> dict:
    """Fraction of FFN weight bytes a decode step would not read, averaged over counted tokens
    (layers without a policy read everything)."""
    L = model.cfg.n_layers
    if not runtime.stats:
        return {"ffn_bytes_skipped": 0.0, "channels_kept": 1.0, "per_layer_kept": {}}
    n = max(s[0] for s in runtime.stats.values())
    read = sum(s[2] for s in runtime.stats.values()) + n * (L - len(runtime.stats))
    kept = sum(s[1] for s in runtime.stats.values()) + n * (L - len(runtime.stats))
    return {"ffn_bytes_skipped": 1 - read / (n * L), "channels_kept": kept / (n * L),
            "per_layer_kept": {i: s[1] / s[0] for i, s in sorted(runtime.stats.items())}}


@torch.no_grad()
def sparse_mlp_gather(mlp, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The decode step for one token: x (D,), idx (k,) chosen channels -> FFN output (D,).
    Reads rows idx of W_gate and W_up and columns idx of W_down, nothing else."""
    wg = mlp.gate_proj.weight.index_select(0, idx)
    wu = mlp.up_proj.weight.index_select(0, idx)
    wd = mlp.down_proj.weight.index_select(1, idx)
    return wd @ (F.silu(wg @ x) * (wu @ x))
