"""`zeroedge eval ... --paths`: dense vs predicted-paths perplexity, every token teacher-forced with
the paths on (decode mechanisms are measured on every token), and the FFN weight bytes a decode
step would not read."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from zeroedge.errors import UserError
from zeroedge.paths.policies import policies_from_artifact
from zeroedge.paths.sparse import PathRuntime, bytes_summary, install, remove


def load_paths(model, meta: dict, tensors: dict, runtime: PathRuntime | None = None,
               where: str = "artifact") -> PathRuntime:
    rt = runtime or PathRuntime()
    install(model, policies_from_artifact(model, meta, tensors, where), rt)
    return rt


@torch.inference_mode()
def _ppl(model, t: torch.Tensor, continuation: int, rt: PathRuntime | None):
    N = t.shape[1]
    if rt is not None:
        rt.reset_stats()
        rt.active, rt.count_from = True, N - 1 - continuation
    try:
        logits = model(t[:, :-1])
    finally:
        if rt is not None:
            rt.active, rt.count_from = False, 0
    tail = logits[0, -continuation:].float()
    return math.exp(float(F.cross_entropy(tail, t[0, -continuation:])))


def run_eval(model, ids: list, meta: dict, tensors: dict, continuation: int = 1024) -> dict:
    """Dense vs paths perplexity of the last `continuation` tokens of ids (every position,
    context included, runs with the paths on) and ffn_bytes_skipped averaged over them."""
    if len(ids) < continuation + 1:
        raise UserError(f"{len(ids)} tokens; at least {continuation + 1} are needed")
    pol_rt = PathRuntime()
    pol = policies_from_artifact(model, meta, tensors)
    t = torch.tensor([list(ids)])
    dense = _ppl(model, t, continuation, None)
    install(model, pol, pol_rt)
    try:
        sparse = _ppl(model, t, continuation, pol_rt)
        b = bytes_summary(model, pol_rt)
    finally:
        remove(model)
    first = next(iter(pol.values()))
    pw = first.predictor.weights() if first.predictor is not None else 0
    L, D, Fdim = model.cfg.n_layers, model.cfg.dim, model.cfg.ffn_dim
    return {"dense_ppl": dense, "paths_ppl": sparse, "paths_ppl_rise": sparse / dense - 1,
            "ffn_bytes_skipped": b["ffn_bytes_skipped"],
            "ffn_bytes_skipped_gross": b["ffn_bytes_skipped"] + len(pol) * pw / (3 * D * Fdim) / L,
            "paths_channels_kept": b["channels_kept"], "paths_sparse_layers": len(pol),
            "paths_scored_tokens": continuation}
