"""Perplexity vs fraction of FFN weight bytes a decode step skips, SmolLM2-135M real weights:
the path predictor (uniform per-token budget, and the gated artifact when given) against the two
training-free peers (top-k oracle on silu(g)*u: only down columns skippable; CATS threshold on
|silu(g)|: up and down), plus TEAL-style input-magnitude sparsity, on KJV, the essays and the
licenses (never calibrated on). Every token teacher-forced with the mechanism on; the last
`--ctx - 1` predictions scored. Predictors and CATS thresholds are fitted on the first 1024 tokens
of KJV and the essays (the calibration region); evaluation reads KJV and essays from token 40000.

  python benchmarks/paths_frontier.py --out benchmarks/results/paths/ppl_vs_ffn_bytes_smollm2_cpu.jsonl [--artifact DIR]
  python benchmarks/paths_frontier.py --out ... --methods "" --artifact DIR   (the artifact only)
"""
import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

LEVELS = {  # method -> settings chosen so bytes skipped land near 13 % and 27 %
    "topk": [{"keep": 0.6}, {"keep": 0.2}],
    "cats": [{"keep": 0.8}, {"keep": 0.6}],
    "predictor_topk": [{"keep": 0.83}, {"keep": 0.69}],
    "input": [{"keep_in": 0.87, "keep": 0.87}, {"keep_in": 0.73, "keep": 0.73}],
}


def fit_peers(m, tok, texts, rank):
    """Predictors and CATS gate activations fitted on the first 1024 tokens of KJV and essays."""
    from zeroedge.paths.predictor import fit_predictor

    L = m.cfg.n_layers
    xs = {i: [] for i in range(L)}
    hooks = [blk.mlp.register_forward_hook(lambda mod, inp, o, i=blk.index: xs[i].append(inp[0][0]))
             for blk in m.layers]
    with torch.inference_mode():
        for t in ("kjv", "essays"):
            m(torch.tensor([texts.tokens(tok, texts.load_text(t), 1024)]))
    for h in hooks:
        h.remove()
    X = {i: torch.cat(v) for i, v in xs.items()}
    with torch.no_grad():
        preds = {i: fit_predictor(X[i], m.layers[i].mlp, rank) for i in range(L)}
        gates = {i: m.layers[i].mlp.gate_proj(X[i]) for i in range(L)}

    return preds, gates


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--artifact")
    ap.add_argument("--texts", default="kjv,essays,licenses")
    ap.add_argument("--methods", default="topk,cats,predictor_topk,input")
    a = ap.parse_args()
    torch.set_num_threads(2)
    from zeroedge import calib_artifact, texts, weights
    from zeroedge.paths.predictor import fit_predictor
    from zeroedge.paths.room import cats_threshold
    from zeroedge.paths.sparse import PathPolicy, PathRuntime, bytes_summary, install, remove

    m, folder = weights.load("smollm2-135m")
    tok = weights.tokenizer(folder)
    L = m.cfg.n_layers
    out = open(a.out, "a")

    def emit(rec):
        print(json.dumps(rec), flush=True)
        out.write(json.dumps(rec) + "\n")
        out.flush()

    methods = [x for x in a.methods.split(",") if x]
    preds, gates = {}, {}
    if methods:
        preds, gates = fit_peers(m, tok, texts, a.rank)

    def ppl(ids, rt=None):
        t = torch.tensor([ids])
        with torch.inference_mode():
            if rt is not None:
                rt.reset_stats()
                rt.active = True
            try:
                logits = m(t[:, :-1])
            finally:
                if rt is not None:
                    rt.active = False
        return math.exp(float(F.cross_entropy(logits[0].float(), t[0, 1:])))

    for text in a.texts.split(","):
        off = 0 if text == "licenses" else 40000
        ids = texts.tokens(tok, texts.load_text(text), a.ctx, offset=off)
        t0 = time.time()
        dense = ppl(ids)
        emit({"text": text, "method": "dense", "ppl": dense, "ffn_bytes_skipped": 0.0,
              "s": round(time.time() - t0, 1)})
        for method in methods:
            for lv in LEVELS[method]:
                pol = {}
                for i in range(L):
                    kw = dict(lv)
                    if method == "cats":
                        kw = {"threshold": cats_threshold(gates[i], lv["keep"])}
                    pol[i] = PathPolicy(method=method, predictor=preds[i], **kw)
                rt = PathRuntime()
                install(m, pol, rt)
                t0 = time.time()
                try:
                    p = ppl(ids, rt)
                finally:
                    remove(m)
                b = bytes_summary(m, rt)
                emit({"text": text, "method": method, "setting": lv, "ppl": p,
                      "ppl_rise": p / dense - 1, "ffn_bytes_skipped": b["ffn_bytes_skipped"],
                      "channels_kept": b["channels_kept"], "s": round(time.time() - t0, 1)})
        if a.artifact:
            from zeroedge.paths.evaluate import run_eval

            meta, tens = calib_artifact.load(a.artifact)
            r = run_eval(m, ids, meta, tens, continuation=a.ctx - 1)
            kind = "magnitude" if meta["paths"]["predictor"]["kind"] == "input-magnitude" else "predictor"
            emit({"text": text, "method": f"{kind}_gated", "setting": {"budget": meta["paths"]["budget"]},
                  "ppl": r["paths_ppl"], "ppl_rise": r["paths_ppl_rise"],
                  "ffn_bytes_skipped": r["ffn_bytes_skipped"], "dense_check": r["dense_ppl"]})


if __name__ == "__main__":
    main()
