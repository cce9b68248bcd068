"""Calibrate the decode path rules and choose each layer's sparsity with the quality gate.

Two rules (PathsConfig.method): "magnitude" (default: read only the gate/up input dims with
|x_k| >= threshold_in and the down channels with |a_j| >= threshold_act; no extra weights) and
"predictor" (the rank-r path predictor of zeroedge.paths.predictor). On SmolLM2 the magnitude rule
skips ~5x more FFN bytes at the same perplexity (benchmarks/paths.md), so it is the default; the
predictor stays selectable and measured.

Same budget semantics as the core calibration (zeroedge.export.calibrate): `budget` is the largest
relative rise of held-out perplexity allowed. Decode mechanisms are measured on every token, so the
held-out perplexity is taken with every token teacher-forced with the paths on.

Steps (each logged):
 1. dense pass with autograd on training sequences (first 70 % of each text): per layer the FFN
    input x, output y and dL/dy (loss over every token);
 2. per layer, the whitened rank-r predictor (zeroedge.paths.predictor.fit_predictor);
 3. per layer and kept fraction, the score threshold (a quantile of the predicted scores) and the
    first-order cost mean_t |dL/dy_t . (y_sparse - y)_t| (or, with costs="measured", the real
    log-perplexity rise of each layer alone at each setting on training sequences);
 4. gate: for a cost-per-byte scale, each layer takes the sparsest setting whose estimated cost per
    skipped weight fits the scale; a binary search over the scale against real held-out perplexity
    (last 30 % of each text) keeps the most bytes skipped within the budget.
If even the mildest sparse setting breaks the budget, `PathBudgetError` says so and nothing is
returned (the caller writes nothing): dense is never passed off as sparse.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from zeroedge.export import gate
from zeroedge.paths.predictor import PathPredictor, fit_predictor
from zeroedge.paths.room import read_fraction
from zeroedge.paths.sparse import PathPolicy, PathRuntime, bytes_summary, install, remove

FORMAT = "zeroedge-paths"
VERSION = 1


class PathBudgetError(Exception):
    """The budget cannot be met by any sparse setting."""


@dataclass
class PathsConfig:
    method: str = "magnitude"       # magnitude (|x| and |a| thresholds, TEAL-style) | predictor
    rank: int = 32
    seq_len: int = 1024
    train_seqs: int = 2
    gate_seqs: int = 2
    keeps: tuple = (0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5, 0.4)
    search_steps: int = 7
    cost_tokens: int = 768          # tokens (strided sample) the per-layer cost estimates use
    costs: str = "first_order"      # first_order | measured (each layer alone at each setting)
    measured_seqs: int = 1          # training sequences a measured cost reads
    log: object = field(default=print, repr=False)


def split(token_lists, seq_len, n_train, n_held):
    from zeroedge.export.calibrate import CalibConfig, split_sequences

    return split_sequences(token_lists, CalibConfig(seq_len=seq_len, train_seqs=n_train,
                                                    gate_seqs=n_held))


@torch.no_grad()
def heldout_ppl_all(model, seqs, runtime: PathRuntime | None = None) -> float:
    """Perplexity of every token of every sequence, teacher-forced, paths on when given."""
    tot, n = 0.0, 0
    for ids in seqs:
        t = torch.tensor([ids])
        if runtime is not None:
            runtime.active = True
        try:
            logits = model(t[:, :-1])
        finally:
            if runtime is not None:
                runtime.active = False
        tot += float(F.cross_entropy(logits[0].float(), t[0, 1:], reduction="sum"))
        n += t.shape[1] - 1
    return math.exp(tot / n)


def calibrate_paths(model, token_lists, budget: float, log=print, cfg: PathsConfig | None = None):
    """Returns (paths_meta, tensors) for the artifact (meta section "paths", tensors
    layers.{i}.paths.*). Raises PathBudgetError when the budget cannot be met.

    collect (FFN inputs, outputs, loss gradients on the training split) -> per layer and kept
    fraction: thresholds (and predictors) and a first-order or measured cost -> the shared gate
    search (export.gate) on the held-out split."""
    from zeroedge.export.importance import collect_ffn_io

    cfg = cfg or PathsConfig()
    log = log or cfg.log
    _check_request(budget, cfg)
    t0 = time.time()
    train, held = split(token_lists, cfg.seq_len, cfg.train_seqs, cfg.gate_seqs)
    if not train or not held:
        raise ValueError(f"calibration text too short for {cfg.seq_len}-token sequences")
    X, Y, G = collect_ffn_io(model, train, 1, cfg.seq_len, log, "paths")   # loss over every token
    preds, thr, thr_in, cost = _settings(model, X, Y, G, cfg)
    del X, Y, G
    pw = preds[0].weights() if preds else 0
    log(_settings_summary(model, cfg, preds, cost, pw))
    policies = functools.partial(_policies, cfg, preds, thr, thr_in)   # chosen -> {layer: PathPolicy}
    rt = PathRuntime()
    if cfg.costs == "measured":
        cost = _measured_costs(model, train[: max(1, cfg.measured_seqs)], policies, rt, len(cfg.keeps), log)
    dense = heldout_ppl_all(model, held)
    log(f"[paths] held-out dense ppl {dense:.4f} ({len(held)} x {cfg.seq_len} tokens, every token)")
    chosen, ppl, b = _gate_search(model, held, cost, cfg, pw, policies, rt, budget, dense, log)
    pol = policies(chosen)
    meta, tensors = _paths_artifact(model, cfg, pol, chosen, pw, b)
    meta["quality"] = {"budget": budget, "dense_ppl": dense, "paths_ppl": ppl, "ppl_rise": ppl / dense - 1,
                       "ffn_bytes_skipped": b["ffn_bytes_skipped"], "channels_kept": b["channels_kept"],
                       "heldout_tokens": len(held) * (cfg.seq_len - 1),
                       "protocol": "every token teacher-forced with the paths on"}
    meta["budget"] = budget
    meta["seconds"] = round(time.time() - t0, 1)
    log(f"[paths] chosen: {len(pol)} sparse layers, held-out ppl {dense:.4f} -> {ppl:.4f} "
        f"({ppl / dense - 1:+.2%}, budget {budget:.2%}), FFN bytes skipped "
        f"{b['ffn_bytes_skipped']:.1%}")
    return meta, tensors


def _check_request(budget: float, cfg: PathsConfig):
    """calibrate_paths' budget (PathBudgetError unless > 0) and cfg's method and cost kind
    (ValueError), checked before any work."""
    if not (budget > 0):
        raise PathBudgetError(f"budget {budget} cannot be met: it must be > 0")
    if cfg.method not in ("predictor", "magnitude"):
        raise ValueError(f"unknown paths method {cfg.method}")
    if cfg.costs not in ("first_order", "measured"):
        raise ValueError(f"unknown cost kind {cfg.costs}")


def _settings_summary(model, cfg: PathsConfig, preds: dict, cost: dict, pw: int) -> str:
    """The log line after the per-layer settings: the predictors' size (method "predictor") and the
    spread of the first-order costs at the middle kept fraction."""
    D, Fdim = model.cfg.dim, model.cfg.ffn_dim
    mid = len(cfg.keeps) // 2
    return (f"[paths] {cfg.method}: {'rank-%d predictors, %d weights each (%.1f%% of a layer FFN); ' % (cfg.rank, pw, 100 * pw / (3 * D * Fdim)) if preds else ''}"
            f"first-order cost at keep {cfg.keeps[mid]}: min {min(c[mid] for c in cost.values()):.4f} "
            f"max {max(c[mid] for c in cost.values()):.4f}")


def _policies(cfg: PathsConfig, preds: dict, thr: dict, thr_in: dict, chosen: dict) -> dict:
    """layer -> PathPolicy for `chosen` (layer -> index of its kept fraction in cfg.keeps)."""
    out = {}
    for i, k in chosen.items():
        if cfg.method == "magnitude":
            out[i] = PathPolicy(method="magnitude", threshold_in=thr_in[i][k], threshold=thr[i][k])
            continue
        p = preds[i]
        out[i] = PathPolicy(method="predictor",
                            predictor=PathPredictor(p.a, p.bg, p.bu, p.wd_norm, thr[i][k]))
    return out


def _gate_search(model, held, cost: dict, cfg: PathsConfig, pw: int, policies, rt: PathRuntime, budget: float,
                 dense: float, log) -> tuple:
    """The shared gate search (export.gate) against the held-out perplexity `dense` * (1 + budget):
    (chosen, its held-out ppl, its bytes_summary). PathBudgetError when even the mildest setting
    breaks the budget."""
    D, Fdim = model.cfg.dim, model.cfg.ffn_dim

    def measure(chosen):
        install(model, policies(chosen), rt)
        rt.reset_stats()
        try:
            ppl = heldout_ppl_all(model, held, rt)
        finally:
            remove(model)
        b = bytes_summary(model, rt)
        return ppl, b["ffn_bytes_skipped"], b

    def step_log(step, scale, ppl, skipped, ok):
        log(f"[paths] gate step {step}: scale {scale:.3g} -> held-out ppl {ppl:.4f} "
            f"({ppl / dense - 1:+.2%}), FFN bytes skipped {skipped:.1%} {'ok' if ok else 'over budget'}")

    # a step of a layer saves 1 - keep of its FFN weights (the predictor reads its own weights too)
    gains = [1 - cfg.keeps[k] if cfg.method == "magnitude" else 1 - read_fraction("predictor", cfg.keeps[k], D, Fdim, pw)
             for k in range(len(cfg.keeps))]
    try:  # the mildest candidate is one layer at one step
        return gate.search(cost, gains, measure, dense * (1 + budget), cfg.search_steps, step_log)
    except gate.GateError as e:
        raise PathBudgetError(
            f"budget {budget:.2%} cannot be met: the mildest path setting "
            f"({e.result['ffn_bytes_skipped']:.1%} FFN bytes skipped) costs "
            f"{e.ppl / dense - 1:+.2%} held-out perplexity") from None


def _settings(model, X, Y, G, cfg: PathsConfig):
    """Per layer and kept fraction: the threshold(s) hitting it on the training FFN inputs, the
    predictor (method "predictor", fitted on every training token) and the first-order cost |g . dy|
    of the FFN output the cut channels carried (on a strided sample of cfg.cost_tokens tokens).
    Returns (predictors, thresholds, input thresholds, costs), dicts by layer."""
    def q(t, keep):
        flat = t.abs().flatten()
        flat = flat[:: max(1, flat.numel() // 1_000_000)].sort().values
        return float(flat[min(flat.numel() - 1, int((1 - keep) * flat.numel()))])

    preds, thr, thr_in, cost = {}, {}, {}, {}
    n_tok = next(iter(X.values())).shape[0]
    sub = torch.arange(0, n_tok, max(1, n_tok // cfg.cost_tokens))
    with torch.no_grad():
        for i in X:
            mlp = model.layers[i].mlp
            thr[i], thr_in[i], cost[i] = [], [], []
            xs, ys, gs = X[i][sub], Y[i][sub], G[i][sub]
            if cfg.method == "predictor":
                preds[i] = p = fit_predictor(X[i], mlp, cfg.rank)
                s = p.scores(xs)
                a = F.silu(mlp.gate_proj(xs)) * mlp.up_proj(xs)
            for keep in cfg.keeps:
                if cfg.method == "predictor":
                    t = q(s, keep)
                    dy = mlp.down_proj(a * (s < t))        # the part of y the cut channels carried
                else:
                    ti = q(xs, keep)
                    xm = xs * (xs.abs() >= ti)
                    am = F.silu(mlp.gate_proj(xm)) * mlp.up_proj(xm)
                    t = q(am, keep)
                    dy = mlp.down_proj(am * (am.abs() >= t)) - ys
                    thr_in[i].append(ti)
                thr[i].append(t)
                cost[i].append(float((gs * dy).sum(-1).abs().mean()))
    return preds, thr, thr_in, cost


def _measured_costs(model, seqs, policies, rt, n_keeps: int, log) -> dict:
    """Each layer alone at each setting: the real log-perplexity rise on `seqs` (made monotone in
    sparsity and >= 0, so noise cannot buy a layer a deeper cut)."""
    base = math.log(heldout_ppl_all(model, seqs))
    cost = {}
    for i in range(model.cfg.n_layers):
        row = []
        for k in range(n_keeps):
            install(model, policies({i: k}), rt)
            try:
                row.append(max(0.0, math.log(heldout_ppl_all(model, seqs, rt)) - base))
            finally:
                remove(model)
        for k in range(1, len(row)):
            row[k] = max(row[k], row[k - 1])
        cost[i] = row
        log(f"[paths] layer {i}: measured cost " + " ".join(f"{c:.4f}" for c in row))
    return cost


def _paths_artifact(model, cfg: PathsConfig, pol: dict, chosen: dict, pw: int, b: dict) -> tuple:
    """(paths meta without quality / budget / seconds, tensors) of the chosen policies."""
    D, Fdim = model.cfg.dim, model.cfg.ffn_dim
    tensors, layers = {}, []
    for i in range(model.cfg.n_layers):
        if i in pol and cfg.method == "predictor":
            tensors.update(pol[i].predictor.state(f"layers.{i}.paths"))
        elif i in pol:
            tensors[f"layers.{i}.paths.threshold_in"] = torch.tensor([pol[i].threshold_in])
            tensors[f"layers.{i}.paths.threshold_act"] = torch.tensor([pol[i].threshold])
        layers.append({"index": i, "sparse": i in pol,
                       "keep_planned": cfg.keeps[chosen[i]] if i in chosen else 1.0,
                       "threshold": (pol[i].predictor.threshold if cfg.method == "predictor"
                                     else pol[i].threshold) if i in pol else None,
                       "threshold_in": pol[i].threshold_in if i in pol and cfg.method == "magnitude" else None,
                       "kept_heldout": round(b["per_layer_kept"].get(i, 1.0), 4)})
    meta = {
        "format": FORMAT, "version": VERSION, "budget": None,
        "predictor": ({"kind": "whitened-lowrank-swiglu", "rank": cfg.rank, "weights": pw,
                       "weights_fraction_of_ffn": pw / (3 * D * Fdim),
                       "score": "|silu(x A Bg) * (x A Bu)| * ||W_down[:, j]||"}
                      if cfg.method == "predictor" else
                      {"kind": "input-magnitude", "weights": 0, "weights_fraction_of_ffn": 0.0,
                       "rule": "read W_gate/W_up columns k with |x_k| >= threshold_in, W_down "
                               "columns j with |a_j| >= threshold_act"}),
        "layers": layers,
    }
    return meta, tensors
