"""What limits SIH's token ranking: the first-order cost of the tokens each ranking skips, at the
shipped artifact's own per-layer rates, on real SmolLM2 and the five held-out passages of
prefill_frontier.py.

A layer that skips token t instead of running its FFN changes the continuation's loss by about
g . (y - anchor(x)) (g: the loss gradient at the FFN output y; first order, each token alone). For
each ranking the script sums |g . (y - anchor(x))| over the tokens the rank rule skips (in each
512-position block the layer's rate, the lowest-ranked; the artifact's protected positions kept),
over the artifact's partly skipping layers, and reports the share of random's sum a ranking saves
(random: the mean of 4 draws). 1.0 would skip only tokens that cost nothing; the oracle ranks by the
very quantity summed. This is the gate's own cost estimate, not perplexity (prefill_frontier.py
measures that): it shows where the rankings stand against each other without noise from one passage's
continuation.

Rankings:
  sih             the artifact's heads, smoothed over 3 positions (as deployed)
  sih_unsmoothed  the same heads' logits, unsmoothed
  oracle          |g . (y - anchor(x))| itself;  oracle_smoothed: the same through the 3-position smoothing
  grad_norm       |g| alone (how much the continuation reads this token's state at this layer)
  change_norm     |y - anchor(x)| alone (how much the FFN changes the token beyond its anchor)
  norm            |x| (the `norm` scorer)
  attention_received  the attention the token gets from the prompt's later tokens in this layer,
                  averaged over them (what heavy-hitter KV eviction reads; no plugin input carries it)

`--heads` also trains heads on the README calibration's own training rows (kjv and essays, 8
sequences of 2048 tokens, the prefix 1536) under other recipes, within the same rankings: the shipped
recipe again (a check that it reproduces the artifact), standardised inputs (folded into the first
layer afterwards), 5x the steps, a 64-wide head (over the 12 KB budget: a capacity check) and a
pairwise ranking loss.

    python benchmarks/sih_ranking_ceiling.py --heads -o benchmarks/results/prefill/sih_ranking_ceiling_smollm2_cpu.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefill_frontier import OFFSETS, genre_file  # noqa: E402

TEXTS = ("kjv", "essays", "licenses", "manpages", "python")
CTX, CONTINUATION = 4096, 1024
RANDOM_DRAWS = 4


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib", default="zeroedge/data/smollm2-135m.calib")
    ap.add_argument("--texts", nargs="+", default=list(TEXTS))
    ap.add_argument("--heads", action="store_true", help="also train heads by other recipes (about 10 minutes)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from zeroedge import calib_artifact, texts, weights
    from zeroedge.export.importance import ffn_io_and_grads
    from zeroedge.mechanisms.pad import artifact_policies

    t0 = time.time()
    m, folder = weights.load("smollm2-135m")
    tok = weights.tokenizer(folder)
    meta, tens = calib_artifact.load(a.calib)
    pol, rt = artifact_policies(meta, tens)
    layers = [i for i, p in sorted(pol.items()) if p.rate is not None and p.rate < 1]
    P = CTX - CONTINUATION
    passages = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.texts:
            ids = torch.tensor([texts.tokens(tok, texts.load_text(genre_file(name, Path(tmp))), CTX,
                                             offset=OFFSETS.get(name, 0), what=name)])
            io, _ = ffn_io_and_grads(m, ids, P)
            received = attention_received(m, ids[:, :P], layers)
            passages[name] = {i: (io[i][0][:P], io[i][1][:P], io[i][2][:P], received[i]) for i in layers}
            print(f"{name}: FFN inputs, outputs and gradients of {P} prompt tokens", flush=True)
    heads = {"sih (shipped)": {i: pol[i].sih for i in layers}}
    if a.heads:
        heads.update(trained_heads(m, tok, pol, layers))
    result = {"savings": {}, "per_layer": {}}
    for name, layer_io in passages.items():
        costs = {i: ranking_costs(pol[i], rt, *layer_io[i], {h: hs[i] for h, hs in heads.items()})
                 for i in layers}
        random_total = sum(c["random"] for c in costs.values())
        result["savings"][name] = {k: round(1 - sum(c[k] for c in costs.values()) / random_total, 4)
                                   for k in costs[layers[0]]}
        result["per_layer"][name] = {i: {k: round(v, 6) for k, v in c.items()} for i, c in costs.items()}
        print(name, json.dumps(result["savings"][name]), flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": "python benchmarks/sih_ranking_ceiling.py " + " ".join(sys.argv[1:]),
        "calib": a.calib, "rates": {i: pol[i].rate for i in layers}, "rank_block": pol[layers[0]].rank_block,
        "ctx": CTX, "prefix": P, "offsets": {t: OFFSETS.get(t, 0) for t in a.texts},
        "measure": "share of random's summed first-order cost |g . (y - anchor(x))| over the skipped tokens "
                   "that a ranking saves, over the layers that skip part of the prompt",
        "hardware": f"{platform.machine()} CPU, {a.threads} threads, fp32", "weights": "real SmolLM2-135M",
        "seconds": round(time.time() - t0, 1), **result}, indent=1))


@torch.no_grad()
def attention_received(m, ids, layers) -> dict:
    """layer -> (T,) the attention each prompt token receives from the prompt's tokens at or after it,
    summed over heads and averaged over those tokens (one pass over the prompt)."""
    T = ids.shape[1]
    cos, sin = m.rope(0, T)
    x = m.embed_tokens(ids)
    out = {}
    for b in m.layers[:max(layers) + 1]:
        b.self_attn.record_probs = b.index in layers
        x = b(x, cos, sin, 0, None)
        if b.index in layers:
            out[b.index] = b.self_attn.last_probs[0].float().sum(dim=(0, 1)) / torch.arange(T, 0, -1)
            b.self_attn.last_probs = None
        b.self_attn.record_probs = False
    return out


@torch.no_grad()
def ranking_costs(p, rt, x, y, g, received, heads: dict) -> dict:
    """Ranking -> summed |g . (y - anchor(x))| over the tokens the rank rule skips at the layer's rate."""
    from zeroedge.mechanisms.sih import MA_WEIGHTS, rank_mask, smooth

    change = y - (p.anchor(x) if p.anchor is not None else 0)
    cost = (g * change).sum(-1).abs()

    def skipped(score):
        keep = rank_mask(score[None], p.rate, p.rank_block, rt.protect_first, rt.protect_last)[0]
        return float(cost[~keep].sum())

    gen = torch.Generator().manual_seed(0)
    out = {"random": sum(skipped(torch.rand(len(cost), generator=gen)) for _ in range(RANDOM_DRAWS)) / RANDOM_DRAWS,
           "oracle": skipped(cost), "oracle_smoothed": skipped(smooth(cost[None], MA_WEIGHTS)[0]),
           "grad_norm": skipped(g.norm(dim=-1)), "change_norm": skipped(change.norm(dim=-1)),
           "norm": skipped(x.norm(dim=-1)), "attention_received": skipped(received)}
    for name, head in heads.items():
        out[name] = skipped(smooth(head(x)[None], MA_WEIGHTS)[0])
        if name == "sih (shipped)":
            out["sih unsmoothed"] = skipped(head.logits(x))
    return out


def trained_heads(m, tok, pol, layers) -> dict:
    """Heads for `layers` trained by other recipes on the README calibration's training rows."""
    from zeroedge.commands.calibrate import _token_lists
    from zeroedge.export.calibrate import CalibConfig, per_sequence_normalised, split_sequences, train_sih
    from zeroedge.export.importance import collect_ffn_io
    from zeroedge.mechanisms.sih import head_width

    cfg = CalibConfig(seq_len=2048, continuation=512, train_seqs=8, gate_seqs=4)
    train, _ = split_sequences(_token_lists(tok, ["kjv", "essays"], 24000, 2048), cfg)
    rows = cfg.seq_len - cfg.continuation
    X, Y, G = collect_ffn_io(m, train, rows, rows, print, tag="heads")
    free = torch.arange(len(train) * rows) % rows >= cfg.protect_first
    width = head_width(m.cfg.dim)
    recipes = {
        "shipped recipe again": lambda x, t, i: train_sih(x, t, width, cfg.sih_steps, cfg.seed + i),
        "standardised inputs": lambda x, t, i: standardised_head(x, t, i, width, cfg.sih_steps),
        "standardised, 5x steps": lambda x, t, i: standardised_head(x, t, i, width, 5 * cfg.sih_steps),
        "64 wide (67 KB)": lambda x, t, i: standardised_head(x, t, i, 64, 5 * cfg.sih_steps),
        "pairwise loss": lambda x, t, i: standardised_head(x, t, i, width, 5 * cfg.sih_steps, pairwise=True),
    }
    out = {name: {} for name in recipes}
    for i in layers:
        with torch.no_grad():
            cost = (G[i] * (Y[i] - pol[i].anchor(X[i]))).sum(-1).abs()
        target = per_sequence_normalised(cost, rows)[free]
        for name, fit in recipes.items():
            out[name][i] = fit(X[i][free], target, i)
        print(f"heads for layer {i} trained", flush=True)
    return out


def standardised_head(x, target, seed, width, steps, pairwise=False):
    """An SIHHead trained on inputs standardised per channel (folded into its first layer after), by
    Poisson regression (as train_sih) or a pairwise logistic loss weighted by the cost difference."""
    from zeroedge.mechanisms.sih import SIHHead

    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    xs = (x - mu) / sd
    torch.manual_seed(seed)
    head = SIHHead(x.shape[1], width)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    with torch.enable_grad():
        for _ in range(steps):
            idx = torch.randint(0, len(xs), (min(1024, len(xs)),), generator=gen)
            logit, t = head.logits(xs[idx]), target[idx]
            if pairwise:
                a, b = (torch.randint(0, len(idx), (4096,), generator=gen) for _ in range(2))
                loss = ((t[a] - t[b]).abs() * torch.nn.functional.softplus(
                    -torch.sign(t[a] - t[b]) * (logit[a] - logit[b]))).mean()
            else:
                loss = (torch.exp(logit) - t * logit).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        head.l1.bias -= head.l1.weight @ (mu / sd)
        head.l1.weight /= sd
    return head.eval()


if __name__ == "__main__":
    main()
