"""Calibration: fit anchors and SIH heads on calibration text, then choose per-layer skip rates with
a quality gate on a held-out split, and write the artifact (zeroedge.calib_artifact).

Steps (each reported):
 1. dense pass with autograd on training sequences: per layer and token, the FFN input x, output y
    and the gradient g of the continuation loss with respect to y (importance target (a));
 2. anchors: rank-r reduced-rank ridge regression y ~ a(x) per layer;
 3. SIH target: the first-order loss change of replacing the FFN by the anchor,
    |g . (y - a(x))|; a head learns its expected value from x (Poisson regression: train_sih);
 4. gate: estimated per-layer cost curves from the same first-order terms on the held-out split,
    greedy allocation by cost per FLOP, then a binary search of the allocation's scale against real
    held-out perplexity (the protocol: prefix skipped, continuation dense) within the budget.
    A layer's setting is a rate of the rank rule (zeroedge.plugin_spec): in each rank block it skips
    that share of the prompt's tokens, the lowest-ranked by cfg.scorer (SIH by default; norm or random
    to measure what the learned ranking adds: the same anchors, costs and search, another score). So
    the FLOPs a layer saves do not depend on the text, only the tokens it picks do.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from zeroedge.calib_artifact import SIH_DEFAULTS
from zeroedge.export import gate
from zeroedge.mechanisms.anchors import Anchor, ZeroAnchor, anchor_error, fit_anchor
from zeroedge.mechanisms.pad import LayerPolicy, ZeroRuntime, artifact_scores, ffn_flops_per_token, install, remove
from zeroedge.mechanisms.sih import MA_WEIGHTS, SIHHead, head_width, rank_mask


SKIP_RATES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)     # the rank rule's rates the gate chooses from


def skip_rates(max_rate: float) -> tuple:
    """The gate's rates up to max_rate."""
    return tuple(r for r in SKIP_RATES if r <= max_rate + 1e-9)


@dataclass
class CalibConfig:
    budget: float = 0.01            # max relative held-out perplexity rise
    seq_len: int = 2048
    continuation: int = 512
    train_seqs: int = 3
    gate_seqs: int = 2
    anchor_rank: int = 16
    first_layer: int = 1            # layers before this are never skipped
    protect_first: int = 4
    rates: tuple = SKIP_RATES
    sih_steps: int = 600
    seed: int = 0
    gate_steps: int = 7             # binary-search steps against real held-out perplexity
    importance_samples: int = 16    # (layer, token) pairs for the perturbation estimator; 0 = skip
    scorer: str = "sih"             # the token ranking the rank rule reads (calib_artifact.SCORERS)
    rank_block: int = SIH_DEFAULTS["rank_block"]
    log: object = field(default=print, repr=False)


def split_sequences(token_lists, cfg: CalibConfig):
    """Training and held-out sequences of seq_len tokens: the first 70 % of each text trains, the
    last 30 % is held out for the gate, round-robin over texts."""
    train, held = [], []
    for ids in token_lists:
        cut = int(len(ids) * 0.7)
        for src, dst in ((ids[:cut], train), (ids[cut:], held)):
            for s in range(0, len(src) - cfg.seq_len + 1, cfg.seq_len):
                dst.append(src[s:s + cfg.seq_len])
    # interleave texts
    def pick(seqs, n):
        if len(seqs) < n:
            return seqs
        step = len(seqs) / n
        return [seqs[int(i * step)] for i in range(n)]
    return pick(train, cfg.train_seqs), pick(held, cfg.gate_seqs)


def train_sih(x: torch.Tensor, importance: torch.Tensor, width: int, steps: int, seed: int) -> SIHHead:
    """A head whose logit estimates the log of a token's expected importance: Poisson regression on
    `importance` (>= 0, each sequence's divided by its mean so the texts weigh alike). Ranking tokens by
    that conditional mean is what minimises the summed cost of the tokens a rate skips (the cost of a
    skip is its importance, heavy-tailed: a log or a 0/1 target ranks the many cheap tokens and misses
    the rare dear ones)."""
    torch.manual_seed(seed)
    head = SIHHead(x.shape[1], width)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    n = x.shape[0]
    g = torch.Generator().manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: thread hand-offs cost more than they save
    with torch.enable_grad():
        for _ in range(steps):
            idx = torch.randint(0, n, (min(1024, n),), generator=g)
            logit = head.logits(x[idx])
            loss = (torch.exp(logit) - importance[idx] * logit).mean()     # Poisson deviance, up to constants
            opt.zero_grad()
            loss.backward()
            opt.step()
    torch.set_num_threads(threads)
    return head.eval()


def per_sequence_normalised(values: torch.Tensor, rows: int) -> torch.Tensor:
    """values (N,) of consecutive sequences of `rows` rows each, divided by their sequence's mean."""
    seq = torch.arange(values.shape[0]) // rows
    means = torch.zeros(int(seq.max()) + 1).index_add_(0, seq, values) / torch.bincount(seq)
    return values / means.clamp_min(1e-30)[seq]


@torch.no_grad()
def heldout_ppl(model, seqs, P, runtime=None) -> float:
    """Held-out perplexity of the continuation after a prefix run with the mechanisms (one pass:
    positions >= P are never skipped, so this equals prefill-then-score)."""
    tot, n = 0.0, 0
    for ids in seqs:
        t = torch.tensor([ids])
        if runtime is not None:
            runtime.active, runtime.limit = True, P
        try:
            h = model.hidden_states(t)
        finally:
            if runtime is not None:
                runtime.active, runtime.limit = False, None
        logits = model.lm_head(h[:, P - 1:-1])
        tot += float(torch.nn.functional.cross_entropy(logits[0].float(), t[0, P:], reduction="sum"))
        n += t.shape[1] - P
    return math.exp(tot / n)


def calibrate(model, token_lists, cfg: CalibConfig):
    """Returns (meta, tensors, report). Raises BudgetError when even the cheapest setting fails.

    collect (FFN inputs, outputs, loss gradients on the training split) -> anchors -> SIH heads ->
    per-layer cost of each skip rate on the held-out split -> the shared gate search (export.gate)."""
    from zeroedge.export.importance import collect_ffn_io

    log = cfg.log
    torch.manual_seed(cfg.seed)
    L = model.cfg.n_layers
    P = cfg.seq_len - cfg.continuation
    train, held = split_sequences(token_lists, cfg)
    if not train or not held:
        raise ValueError(f"calibration text too short for {cfg.seq_len}-token sequences")
    t0 = time.time()
    X, Y, G = collect_ffn_io(model, train, P, P, log)       # prefix positions only are candidates
    report = {"train_sequences": len(train), "heldout_sequences": len(held),
              "seq_len": cfg.seq_len, "continuation": cfg.continuation}
    if cfg.importance_samples:
        _importance_agreement(model, train[0], cfg, report)
    anchors = _fit_anchors(X, Y, cfg, report)
    heads = _fit_heads(X, Y, G, anchors, cfg, report, P)
    del X, Y, G
    cost = _skip_costs(model, held, heads, anchors, cfg, P)

    rt = ZeroRuntime(protect_first=cfg.protect_first)
    dense = heldout_ppl(model, held, P)
    report["heldout_dense_ppl"] = dense
    log(f"[calibrate] held-out dense ppl {dense:.4f} ({len(held)} x {cfg.seq_len} tokens)")

    def policies(chosen):
        return {i: LayerPolicy(scorer=cfg.scorer, rate=1.0 if k is None else cfg.rates[k], rank_block=cfg.rank_block,
                               sih=heads[i], anchor=anchors[i]) for i, k in chosen.items()}

    def skipped_per_layer(chosen) -> tuple:
        """(held-out ppl, layer -> skipped fraction of its prefill rows) with `chosen` installed."""
        install(model, policies(chosen), rt)
        rt.reset_stats()
        try:
            ppl = heldout_ppl(model, held, P, rt)
        finally:
            remove(model)
        return ppl, {i: (st[1] - st[0]) / (len(held) * P) for i, st in rt.stats.items()}

    def measure(chosen):
        ppl, per_layer = skipped_per_layer(chosen)
        skipped = sum(per_layer.values()) / L
        return ppl, skipped, skipped

    def step_log(step, scale, ppl, skipped, ok):
        log(f"[calibrate] gate step {step}: scale {scale:.3g} -> held-out ppl {ppl:.4f} "
            f"({ppl / dense - 1:+.2%}), tokens skipped {skipped:.1%} {'ok' if ok else 'over budget'}")

    # the final layer's prefix FFN output is never read: an exact skip at every scale
    try:
        chosen, best_ppl, _ = gate.search(cost, cfg.rates, measure, dense * (1 + cfg.budget), cfg.gate_steps,
                                          step_log, include_zero=True, fixed={L - 1: None})
    except gate.GateError as e:
        raise BudgetError(f"budget {cfg.budget:.2%} cannot be met: the cheapest setting costs "
                          f"{e.ppl / dense - 1:+.2%} on the held-out split") from None
    _, per_layer = skipped_per_layer(chosen)
    meta, tensors = _artifact(model, cfg, policies(chosen), anchors, heads, rt, per_layer)
    meta["quality"] = {"budget": cfg.budget, "scorer": cfg.scorer, "max_rate": max(cfg.rates),
                       "dense_ppl": dense, "zero_ppl": best_ppl,
                       "ppl_rise": best_ppl / dense - 1, **meta["quality"],
                       "heldout_tokens": len(held) * cfg.continuation,
                       "protocol": f"prefix {P} tokens with mechanisms, continuation {cfg.continuation} dense"}
    meta.update(report=report, seconds=round(time.time() - t0, 1))
    return meta, tensors, report


def _importance_agreement(model, ids, cfg: CalibConfig, report: dict):
    """Gradient norm vs forward perturbation on a sample of (layer, token) pairs: how far the
    first-order importance can be trusted (report["importance_rank_correlation"])."""
    from zeroedge.export.importance import ffn_io_and_grads, perturbation_sensitivity, spearman

    # on a short window (fp64 is slow): 512 tokens, the loss on the last 128
    n_short = min(512, len(ids))
    short = torch.tensor([ids[:n_short]])
    Ps = n_short * 3 // 4
    io_s, _ = ffn_io_and_grads(model, short, Ps)
    gen = torch.Generator().manual_seed(cfg.seed)
    L = model.cfg.n_layers
    pairs = [(int(torch.randint(cfg.first_layer, L - 1, (1,), generator=gen)),
              int(torch.randint(cfg.protect_first, Ps - 1, (1,), generator=gen)))
             for _ in range(cfg.importance_samples)]
    pert = perturbation_sensitivity(model, short, Ps, pairs)
    gnorm = [float(io_s[layer][2][t].norm()) for layer, t in pairs]
    report["importance_rank_correlation"] = spearman(gnorm, pert)
    cfg.log(f"[calibrate] gradient norm vs forward perturbation (delta=1e-5, fp64, "
            f"{len(pairs)} pairs): Spearman {report['importance_rank_correlation']:.3f}")


def _fit_anchors(X, Y, cfg: CalibConfig, report: dict) -> dict:
    """layer -> the rank-r anchor fitted to the layer's FFN (ZeroAnchor at rank 0)."""
    anchors, errs = {}, {}
    for i in X:
        anchors[i] = fit_anchor(X[i], Y[i], cfg.anchor_rank) if cfg.anchor_rank else ZeroAnchor()
        errs[i] = anchor_error(anchors[i], X[i], Y[i])
    report["anchor_rel_error"] = {i: round(e, 4) for i, e in errs.items()}
    e = sorted(errs.values())
    cfg.log(f"[calibrate] rank-{cfg.anchor_rank} anchors: residual energy "
            f"min {e[0]:.3f} median {e[len(e) // 2]:.3f} max {e[-1]:.3f}")
    return anchors


def _fit_heads(X, Y, G, anchors: dict, cfg: CalibConfig, report: dict, rows: int) -> dict:
    """layer -> SIH head trained to estimate each prompt token's first-order loss change of replacing
    its FFN output by the anchor's, |g . (y - a(x))| (the protected first positions left out); X, Y, G
    hold consecutive sequences of `rows` prompt rows."""
    from zeroedge.export.importance import spearman

    width = head_width(next(iter(X.values())).shape[-1])
    heads, corr = {}, {}
    free = torch.arange(next(iter(X.values())).shape[0]) % rows >= cfg.protect_first   # rows a head may skip
    for i in X:
        with torch.no_grad():
            imp = (G[i] * (Y[i] - anchors[i](X[i]))).sum(-1).abs()
        target = per_sequence_normalised(imp, rows)[free]
        heads[i] = train_sih(X[i][free], target, width, cfg.sih_steps, cfg.seed + i)
        with torch.no_grad():
            corr[i] = spearman(heads[i].logits(X[i][free]), target)
    report["sih_train_spearman"] = {i: round(c, 3) for i, c in corr.items()}
    report["sih_bytes_fp16"] = heads[0].bytes_fp16()
    c = sorted(corr.values())
    cfg.log(f"[calibrate] SIH heads: width {width}, {heads[0].bytes_fp16()} bytes fp16 each, rank correlation "
            f"with the first-order importance on the training rows: median {c[len(c) // 2]:.3f}")
    return heads


def _skip_costs(model, held, heads: dict, anchors: dict, cfg: CalibConfig, P: int) -> dict:
    """On the held-out split, per layer from cfg.first_layer and per skip rate: the estimated nats per
    continuation token the rank rule adds at that rate with the score of cfg.scorer (SIH: smoothed), the
    sum of |first-order loss change| over the tokens it skips (no cancellation between tokens, so a
    layer cannot look free by accident)."""
    from zeroedge.export.importance import ffn_io_and_grads

    L = model.cfg.n_layers
    Xh, Yh, Gh, Sh = ({i: [] for i in range(L)} for _ in range(4))
    for ids in held:
        io, _ = ffn_io_and_grads(model, torch.tensor([ids]), P)
        for i, (x, y, g) in io.items():
            Xh[i].append(x[:P])
            Yh[i].append(y[:P])
            Gh[i].append(g[:P])
            with torch.no_grad():
                Sh[i].append(artifact_scores(LayerPolicy(scorer=cfg.scorer, sih=heads[i]), x[None, :P], i)[0])
    n_cont = len(held) * cfg.continuation
    cost = {}
    for i in range(cfg.first_layer, L):
        with torch.no_grad():
            deltas = [(g * (anchors[i](x) - y)).sum(-1) for x, y, g in zip(Xh[i], Yh[i], Gh[i])]
        cost[i] = []
        for r in cfg.rates:
            skipped = [~rank_mask(s[None], r, cfg.rank_block, cfg.protect_first, 1)[0] for s in Sh[i]]
            cost[i].append(sum(float(dl[sk].abs().sum()) for dl, sk in zip(deltas, skipped)) / n_cont)
    return cost


def _artifact(model, cfg: CalibConfig, pol: dict, anchors: dict, heads: dict, rt: ZeroRuntime,
              per_layer: dict) -> tuple:
    """(meta, tensors) of the chosen policies; meta["quality"] holds the FLOPs skipped."""
    L = model.cfg.n_layers
    layers_meta, tensors = [], {}
    for i in range(L):
        p = pol.get(i)
        layers_meta.append({"index": i, "skip": p is not None, "threshold": None,
                            "rate": None if p is None else p.rate, "rank_block": cfg.rank_block,
                            "anchor_rank": int(getattr(anchors[i], "rank", 0)),
                            "block_size": 0, "block_frac": SIH_DEFAULTS["block_frac"],
                            "skip_rate": round(per_layer.get(i, 0.0), 4)})
        tensors.update(heads[i].state(f"layers.{i}.sih"))
        if isinstance(anchors[i], Anchor):
            tensors.update(anchors[i].state(f"layers.{i}.anchor"))
    flops_skipped = sum(per_layer.values()) / L
    anchor_overhead = sum(per_layer.get(i, 0) * anchors[i].flops_per_token() for i in range(L)) / (
        L * ffn_flops_per_token(model.cfg))
    meta = {
        "model": {"name": model.cfg.name, "config": model.cfg.to_dict()},
        "sih": {"width": head_width(model.cfg.dim), "ma_weights": list(MA_WEIGHTS), "min_tokens": rt.min_tokens,
                "protect_first": cfg.protect_first, "protect_last": rt.protect_last,
                "bytes_fp16": heads[0].bytes_fp16(), "scorer": cfg.scorer},
        "layers": layers_meta,
        "pruned_heads": {},
        "quality": {"ffn_flops_skipped": flops_skipped - anchor_overhead, "ffn_flops_skipped_gross": flops_skipped},
    }
    return meta, tensors


class BudgetError(Exception):
    pass
