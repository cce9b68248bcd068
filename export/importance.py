"""Importance targets per token and layer, on calibration text, under the long-document protocol:
the loss is the continuation's (the last C tokens), the positions judged are the prefix's.

(a) exact: g = dL/d(FFN output of token t at layer l), by autograd, one backward per sequence.
(b) forward perturbation: ||logits(h + delta*u) - logits(h)|| / delta for a random unit u, delta ~ 1e-5,
    in float64 (a JVP is its exact limit); expensive, so on a sample of (layer, token) pairs.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _loss(model, ids, P, logits_h):
    """Mean next-token NLL of the continuation (predictions from position P-1 on)."""
    logits = model.lm_head(logits_h[:, P - 1:-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, P:].reshape(-1))


def ffn_io_and_grads(model, ids: torch.Tensor, P: int):
    """One forward + backward. Returns per layer: x (FFN input, normalised), y (FFN output) and
    g (dL/dy) as (T, D) float32 tensors, plus the continuation loss."""
    xs, ys = {}, {}
    hooks = []

    def hook(i):
        def fn(mod, inp, out):
            xs[i] = inp[0].detach()
            leaf = out.detach().requires_grad_(True)
            ys[i] = leaf
            return leaf
        return fn

    for blk in model.layers:
        hooks.append(blk.mlp.register_forward_hook(hook(blk.index)))
    try:
        with torch.enable_grad():
            h = model.hidden_states(ids)
            loss = _loss(model, ids, P, h)
            loss.backward()
    finally:
        for hk in hooks:
            hk.remove()
    out = {i: (xs[i][0], ys[i].detach()[0], ys[i].grad[0]) for i in xs}
    return out, float(loss.detach())


def collect_ffn_io(model, seqs, P: int, rows: int, log=None, tag: str = "calibrate"):
    """ffn_io_and_grads over every sequence (loss from position P), each layer's first `rows` rows
    of x, y, g one after another: (X, Y, G), dicts layer -> (len(seqs) * rows, D) tensors. Each is
    allocated whole at the first sequence and filled in place (no pieces to concatenate: the freed
    pieces of many sequences stayed in the process's heap)."""
    X, Y, G = ({} for _ in range(3))
    for k, ids in enumerate(seqs):
        io, loss = ffn_io_and_grads(model, torch.tensor([ids]), P)
        for i, (x, y, g) in io.items():
            for d, t in ((X, x), (Y, y), (G, g)):
                if i not in d:
                    d[i] = t.new_empty(len(seqs) * rows, t.shape[-1])
                d[i][k * rows:(k + 1) * rows] = t[:rows]
        if log:
            log(f"[{tag}] train sequence {k + 1}/{len(seqs)}: loss {loss:.3f}")
    return X, Y, G


@torch.no_grad()
def perturbation_sensitivity(model, ids: torch.Tensor, P: int, pairs, delta: float = 1e-5,
                             seed: int = 0):
    """||d logits|| / delta for each (layer, token) in pairs, in float64 on a copy of the model."""
    import copy

    m64 = copy.deepcopy(model).double()
    g = torch.Generator().manual_seed(seed)
    _, inputs = m64.hidden_states(ids, return_all=True)
    base = m64.lm_head(m64.hidden_states(ids, first_layer=0)[:, P - 1:-1])
    out = []
    for layer, t in pairs:
        u = torch.randn(m64.cfg.dim, generator=g, dtype=torch.float64)
        u /= u.norm()
        # perturb the residual stream after layer `layer` at token t: resume at layer+1
        x = inputs[layer + 1].clone() if layer + 1 < len(inputs) else None
        if x is None:
            continue
        x[0, t] += delta * u
        pert = m64.lm_head(m64.hidden_states(ids, first_layer=layer + 1, x=x)[:, P - 1:-1])
        out.append(float((pert - base).norm() / delta))
    return out


def spearman(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / math.sqrt(float((ra ** 2).sum() * (rb ** 2).sum())))
