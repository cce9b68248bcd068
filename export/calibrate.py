"""Calibration: fit anchors and SIH heads on calibration text, then choose per-layer thresholds with
a quality gate on a held-out split, and write the artifact (zeroedge.calib_artifact).

Steps (each reported):
 1. dense pass with autograd on training sequences: per layer and token, the FFN input x, output y
    and the gradient g of the continuation loss with respect to y (importance target (a));
 2. anchors: rank-r reduced-rank ridge regression y ~ a(x) per layer;
 3. SIH target: the first-order loss change of replacing the FFN by the anchor,
    |g . (y - a(x))|; a head learns "above the batch mean" from x (BCE);
 4. gate: estimated per-layer cost curves from the same first-order terms on the held-out split,
    greedy allocation by cost per FLOP, then a binary search of the allocation's scale against real
    held-out perplexity (the protocol: prefix skipped, continuation dense) within the budget.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from zeroedge.calib_artifact import SIH_DEFAULTS
from zeroedge.export import gate
from zeroedge.mechanisms.anchors import Anchor, ZeroAnchor, anchor_error, fit_anchor
from zeroedge.mechanisms.pad import LayerPolicy, ZeroRuntime, ffn_flops_per_token, install, remove
from zeroedge.mechanisms.sih import MA_WEIGHTS, SIHHead, head_width, smooth


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
    rates: tuple = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    sih_steps: int = 200
    seed: int = 0
    gate_steps: int = 7             # binary-search steps against real held-out perplexity
    importance_samples: int = 16    # (layer, token) pairs for the perturbation estimator; 0 = skip
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


def train_sih(x: torch.Tensor, label: torch.Tensor, width: int, steps: int, seed: int) -> SIHHead:
    torch.manual_seed(seed)
    head = SIHHead(x.shape[1], width)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    pos = label.float().mean().clamp(0.05, 0.95)
    weight = torch.where(label, 0.5 / pos, 0.5 / (1 - pos))
    n = x.shape[0]
    g = torch.Generator().manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: thread hand-offs cost more than they save
    with torch.enable_grad():
        for _ in range(steps):
            idx = torch.randint(0, n, (min(1024, n),), generator=g)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                head.logits(x[idx]), label[idx].float(), weight=weight[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    torch.set_num_threads(threads)
    return head.eval()


def _auc(score, label) -> float:
    r = score.argsort().argsort().double() + 1
    npos = int(label.sum())
    nneg = label.numel() - npos
    if npos == 0 or nneg == 0:
        return float("nan")
    return float((r[label].sum() - npos * (npos + 1) / 2) / (npos * nneg))


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
    """Returns (meta, tensors, report). Raises BudgetError when even the cheapest setting fails."""
    log = cfg.log
    torch.manual_seed(cfg.seed)
    L, D = model.cfg.n_layers, model.cfg.dim
    P = cfg.seq_len - cfg.continuation
    train, held = split_sequences(token_lists, cfg)
    if not train or not held:
        raise ValueError(f"calibration text too short for {cfg.seq_len}-token sequences")
    from zeroedge.export.importance import collect_ffn_io, ffn_io_and_grads, perturbation_sensitivity, spearman

    t0 = time.time()
    # 1. dense pass with autograd on training sequences (prefix positions only are candidates)
    X, Y, G = collect_ffn_io(model, train, P, P, log)
    report = {"train_sequences": len(train), "heldout_sequences": len(held),
              "seq_len": cfg.seq_len, "continuation": cfg.continuation}

    # importance (a) vs (b) agreement on a sample
    if cfg.importance_samples:
        # on a short window (fp64 is slow): 512 tokens, the loss on the last 128
        n_short = min(512, len(train[0]))
        short = torch.tensor([train[0][:n_short]])
        Ps = n_short * 3 // 4
        io_s, _ = ffn_io_and_grads(model, short, Ps)
        gen = torch.Generator().manual_seed(cfg.seed)
        pairs = [(int(torch.randint(cfg.first_layer, L - 1, (1,), generator=gen)),
                  int(torch.randint(cfg.protect_first, Ps - 1, (1,), generator=gen)))
                 for _ in range(cfg.importance_samples)]
        pert = perturbation_sensitivity(model, short, Ps, pairs)
        gnorm = [float(io_s[l][2][t].norm()) for l, t in pairs]
        report["importance_rank_correlation"] = spearman(gnorm, pert)
        log(f"[calibrate] gradient norm vs forward perturbation (delta=1e-5, fp64, "
            f"{len(pairs)} pairs): Spearman {report['importance_rank_correlation']:.3f}")

    # 2. anchors
    anchors, errs = {}, {}
    for i in range(L):
        anchors[i] = fit_anchor(X[i], Y[i], cfg.anchor_rank) if cfg.anchor_rank else ZeroAnchor()
        errs[i] = anchor_error(anchors[i], X[i], Y[i])
    report["anchor_rel_error"] = {i: round(e, 4) for i, e in errs.items()}
    log(f"[calibrate] rank-{cfg.anchor_rank} anchors: residual energy "
        f"min {min(errs.values()):.3f} median {sorted(errs.values())[L // 2]:.3f} max {max(errs.values()):.3f}")

    # 3. SIH heads: target = first-order loss change of anchoring the token, above the batch mean
    width = head_width(D)
    heads, aucs = {}, {}
    for i in range(L):
        with torch.no_grad():
            imp = (G[i] * (Y[i] - anchors[i](X[i]))).sum(-1).abs()
        label = imp > imp.mean()
        heads[i] = train_sih(X[i], label, width, cfg.sih_steps, cfg.seed + i)
        with torch.no_grad():
            aucs[i] = _auc(heads[i](X[i]), ~label)  # high score = important, so AUC vs label
            aucs[i] = 1 - aucs[i]
    report["sih_train_auc"] = {i: round(a, 3) for i, a in aucs.items()}
    report["sih_bytes_fp16"] = heads[0].bytes_fp16()
    log(f"[calibrate] SIH heads: width {width}, {heads[0].bytes_fp16()} bytes fp16 each, "
        f"train AUC median {sorted(aucs.values())[L // 2]:.3f}")
    del X, Y, G

    # 4. gate on held-out sequences
    Xh, Yh, Gh, Sh = ({i: [] for i in range(L)} for _ in range(4))
    for ids in held:
        io, _ = ffn_io_and_grads(model, torch.tensor([ids]), P)
        for i, (x, y, g) in io.items():
            Xh[i].append(x[:P])
            Yh[i].append(y[:P])
            Gh[i].append(g[:P])
            with torch.no_grad():
                Sh[i].append(smooth(heads[i](x[None, :P]), MA_WEIGHTS)[0])
    n_cont = len(held) * cfg.continuation
    cost = {}  # layer -> list over rates of estimated nats/token added
    thresholds = {}
    lo, hi = cfg.protect_first, P - 1
    for i in range(cfg.first_layer, L):
        cost[i], thresholds[i] = [], []
        with torch.no_grad():
            deltas = [(g * (anchors[i](x) - y)).sum(-1) for x, y, g in zip(Xh[i], Yh[i], Gh[i])]
        scores = torch.cat([s[lo:hi] for s in Sh[i]])
        for r in cfg.rates:
            thr = float(torch.quantile(scores, r)) if r < 1 else float("inf")
            thresholds[i].append(thr)
            # sum of |first-order loss change| over the skipped tokens: no cancellation between
            # tokens, so a layer cannot look free by accident (signed sums did)
            est = sum(float(dl[lo:hi][s[lo:hi] < thr].abs().sum()) for dl, s in zip(deltas, Sh[i]))
            cost[i].append(est / n_cont)
    del Xh, Yh, Gh

    rt = ZeroRuntime(protect_first=cfg.protect_first)
    dense = heldout_ppl(model, held, P)
    report["heldout_dense_ppl"] = dense
    log(f"[calibrate] held-out dense ppl {dense:.4f} ({len(held)} x {cfg.seq_len} tokens)")

    def prefix_skip(st):
        """Skipped fraction of the prefill (prefix) rows: the continuation is never skipped."""
        return (st[1] - st[0]) / (len(held) * P)

    def policies(chosen):
        pol = {}
        for i, k in chosen.items():
            thr = float("inf") if k is None else thresholds[i][k]
            pol[i] = LayerPolicy(scorer="sih", threshold=thr, sih=heads[i], anchor=anchors[i])
        return pol

    def measure(chosen):
        install(model, policies(chosen), rt)
        rt.reset_stats()
        try:
            ppl = heldout_ppl(model, held, P, rt)
        finally:
            remove(model)
        skipped = sum(prefix_skip(st) for st in rt.stats.values()) / L
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
    pol = policies(chosen)
    install(model, pol, rt)
    rt.reset_stats()
    heldout_ppl(model, held, P, rt)
    per_layer = {i: prefix_skip(st) for i, st in rt.stats.items()}
    remove(model)

    layers_meta = []
    tensors = {}
    for i in range(L):
        p = pol.get(i)
        thr = None if p is None else (p.threshold if math.isfinite(p.threshold) else 2.0)
        layers_meta.append({"index": i, "skip": p is not None, "threshold": thr,
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
        "sih": {"width": width, "ma_weights": list(MA_WEIGHTS), "min_tokens": rt.min_tokens,
                "protect_first": cfg.protect_first, "protect_last": rt.protect_last,
                "bytes_fp16": heads[0].bytes_fp16()},
        "layers": layers_meta,
        "pruned_heads": {},
        "quality": {"budget": cfg.budget, "dense_ppl": dense, "zero_ppl": best_ppl,
                    "ppl_rise": best_ppl / dense - 1, "ffn_flops_skipped": flops_skipped - anchor_overhead,
                    "ffn_flops_skipped_gross": flops_skipped, "heldout_tokens": n_cont,
                    "protocol": f"prefix {P} tokens with mechanisms, continuation {cfg.continuation} dense"},
        "report": report,
        "seconds": round(time.time() - t0, 1),
    }
    return meta, tensors, report


class BudgetError(Exception):
    pass


def load_runtime(model, meta: dict, tensors: dict, runtime: ZeroRuntime | None = None):
    """Install the artifact's deployed policies (SIH thresholds + anchors, pruned heads) on the model."""
    from zeroedge.calib_artifact import Calibration

    cal = Calibration.from_meta(meta)
    rt = runtime or ZeroRuntime()
    rt.protect_first, rt.min_tokens, rt.protect_last = cal.sih.protect_first, cal.sih.min_tokens, cal.sih.protect_last
    pol = {}
    for L in cal.skip_layers:
        anchor = Anchor.from_state(tensors, f"layers.{L.index}.anchor") if L.anchor_rank else None
        pol[L.index] = LayerPolicy(scorer="sih", threshold=L.threshold,
                                   sih=SIHHead.from_state(tensors, f"layers.{L.index}.sih"), anchor=anchor,
                                   block_size=L.block_size, block_frac=L.block_frac)
    for layer, heads in cal.pruned_heads.items():
        model.layers[layer].self_attn.prune_heads(heads)
    install(model, pol, rt)
    return rt
