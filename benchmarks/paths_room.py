"""The room for decode FFN sparsity, per layer, SmolLM2-135M real weights: for KJV and the essays
(1024 tokens each, a dense forward + backward for every layer's FFN input x, output y and dL/dy),
each layer's FFN is cut alone at 50 % of its channels by
  topk   the oracle on |silu(g) * u| (skips only down columns: 1/6 of the FFN bytes),
  cats   a per-layer |silu(g)| threshold (skips up rows and down columns: 1/3),
  pred   the rank-32 path predictor's top 50 % (skips all three, minus its own 4.4 %),
and reports the relative output error ||dy||^2 / ||y||^2 and the first-order loss change
mean_t |dL/dy_t . dy_t| (nats/token; a per-layer perplexity-rise estimate without 30 x 3 x 2 full
forwards, which a 2-core CPU cannot afford). Predictors and thresholds are fitted on the
first half of each sequence and measured on the second half.

  python benchmarks/paths_room.py [--cache DIR]   (DIR holds io_kjv.pt / io_essays.pt to reuse)
"""
import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache")
    ap.add_argument("--keep", type=float, default=0.5)
    a = ap.parse_args()
    torch.set_num_threads(2)
    from zeroedge import texts, weights
    from zeroedge.export.importance import ffn_io_and_grads
    from zeroedge.paths.predictor import fit_predictor
    from zeroedge.paths.room import cats_mask, cats_threshold, topk_mask

    m, folder = weights.load("smollm2-135m")
    tok = weights.tokenizer(folder)
    io = {}
    for t in ("kjv", "essays"):
        f = Path(a.cache or "/nonexistent") / f"io_{t}.pt"
        if f.is_file():
            io[t] = torch.load(f)
        else:
            ids = texts.tokens(tok, texts.load_text(t), 1024)
            io[t] = ffn_io_and_grads(m, torch.tensor([ids]), 1)[0]
    rows = []
    with torch.no_grad():
        for i in range(m.cfg.n_layers):
            mlp = m.layers[i].mlp
            wdn = mlp.down_proj.weight.norm(dim=0)
            xtr = torch.cat([io[t][i][0][:512] for t in io])
            pred = fit_predictor(xtr, mlp, 32)
            thr = cats_threshold(mlp.gate_proj(xtr), a.keep)
            row = {"layer": i}
            for t in io:
                x, y, g = (v[512:] for v in io[t][i])
                gate = mlp.gate_proj(x)
                act = F.silu(gate) * mlp.up_proj(x)
                for name, mask in (("topk", topk_mask(act, a.keep)), ("cats", cats_mask(gate, thr)),
                                   ("pred", topk_mask(pred.scores(x), a.keep))):
                    dy = mlp.down_proj(act * mask) - y
                    row[f"{t}_{name}_relerr"] = float((dy ** 2).sum() / (y ** 2).sum())
                    # g is d(mean loss over the 1023 scored tokens)/dy: scale to nats per token
                    row[f"{t}_{name}_dnll"] = float((g * dy).sum(-1).abs().mean()) * (io[t][i][0].shape[0] - 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    hdr = ("| layer | " + " | ".join(f"{t} {n} err / dnll" for t in io for n in ("topk", "cats", "pred"))
           + " |")
    print(hdr)
    print("|" + "---|" * (1 + 3 * len(io)))
    for r in rows:
        print(f"| {r['layer']} | " + " | ".join(
            f"{r[f'{t}_{n}_relerr']:.3f} / {r[f'{t}_{n}_dnll']:.3f}" for t in io for n in ("topk", "cats", "pred")) + " |")


if __name__ == "__main__":
    main()
