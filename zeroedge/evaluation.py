"""Perplexity under the long-document protocol (as LazyLLM evaluates): prefill the first N - C
tokens with the mechanisms on, then score the last C tokens teacher-forced on that cache, dense."""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from zeroedge.mechanisms.pad import ZeroRuntime, flops_summary


def nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                 reduction="sum"))


@torch.inference_mode()
def continuation_ppl(model, ids: torch.Tensor, continuation: int = 1024,
                     runtime: ZeroRuntime | None = None, chunk: int | None = None) -> dict:
    """ids: (1, N). Returns ppl of the last `continuation` tokens, prefill time and FLOP stats.
    chunk: prefill the first N - continuation tokens `chunk` at a time (None: one pass)."""
    N = ids.shape[1]
    P = N - continuation
    model.setup_cache(1, N)
    try:
        if runtime is not None:
            runtime.reset_stats()
            runtime.active, runtime.limit = True, None
            if chunk:
                runtime.begin_prompt(P)
        t0 = time.perf_counter()
        for s in range(0, P, chunk or P):
            h = model.hidden_states(ids[:, s:min(s + (chunk or P), P)], start=s)
        prefill_s = time.perf_counter() - t0
        stats = flops_summary(model, runtime) if runtime is not None else {}
        if runtime is not None:
            runtime.active = False
            runtime.end_prompt()
        first = model.lm_head(h[:, -1:])
        rest = model(ids[:, P:N - 1], start=P)
        nll = nll_sum(torch.cat([first, rest], 1), ids[:, P:N])
    finally:
        model.drop_cache()
        if runtime is not None:
            runtime.active = False
            runtime.end_prompt()
    return {"ppl": math.exp(nll / continuation), "prefill_s": prefill_s, **stats}


@torch.inference_mode()
def all_tokens_ppl(model, ids: torch.Tensor, runtime: ZeroRuntime | None = None) -> float:
    """Every token teacher-forced in one pass, mechanisms on for every position."""
    if runtime is not None:
        runtime.active, runtime.limit = True, None
    try:
        logits = model(ids[:, :-1])
    finally:
        if runtime is not None:
            runtime.active = False
    return math.exp(nll_sum(logits, ids[:, 1:]) / (ids.shape[1] - 1))


def first_order_importance(model, ids: torch.Tensor, prefix: int, anchors: dict) -> dict:
    """The oracle ranking: per layer, |g . (y - anchor(x))| for each prompt token, the first-order change
    of the continuation loss when that token's FFN output y is replaced by its anchor's (g = dLoss/dy,
    the loss of the tokens after `prefix`). Needs a backward pass on the very text, so it is a
    measuring stick, not a deployable scorer. layer -> (1, T) scores (only the prompt's are ranked)."""
    from zeroedge.export.importance import ffn_io_and_grads

    io, _ = ffn_io_and_grads(model, ids, prefix)
    out = {}
    with torch.no_grad():
        for i, anchor in anchors.items():
            x, y, g = io[i]
            base = anchor(x) if anchor is not None else torch.zeros_like(y)
            out[i] = (g * (y - base)).sum(-1).abs()[None]
    return out


def ranked_at_counts(policies: dict, runtime: ZeroRuntime, skipped: dict, prefix: int, scorer: str,
                     oracle: dict | None = None) -> dict:
    """The artifact's policies re-ranked: layer i skips exactly skipped[i] of its prompt rows, the ones
    `scorer` ranks lowest (random / norm / oracle), with the same anchors and protected positions, so
    only the choice of tokens differs from the shipped SIH rule (token by token, also where SIH's
    layer skips by the block rule; a rank-rule layer keeps its rate and blocks, so each block skips as
    many rows as SIH's). Returns the new policies; sets runtime.external for the oracle."""
    from dataclasses import replace

    span = prefix - runtime.protect_first - runtime.protect_last     # rows a policy may skip
    if scorer == "oracle":
        runtime.external = oracle
    return {i: replace(p, scorer="external" if scorer == "oracle" else scorer, threshold=None, block_size=0,
                       rate=skipped.get(i, 0) / span if p.rate is None else p.rate,
                       rank_block=0 if p.rate is None else p.rank_block)
            for i, p in policies.items()}
