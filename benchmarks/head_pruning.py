"""Static attention-head pruning by softmax entropy: which reading of "useless head" holds?

Profile entropy on calibration text (KJV + essays, the first tokens), prune k heads of the 270 in
SmolLM2 by the lowest-entropy, the highest-entropy (near-uniform) reading, or at random, and measure
perplexity of every token on held-out text (pruning is static: it changes every token).

  python benchmarks/head_pruning.py --out benchmarks/head_pruning
"""
import argparse
import copy
import json
import math
from pathlib import Path

import torch


def ppl(m, ids):
    with torch.no_grad():
        logits = m(ids[:, :-1])
    return math.exp(float(torch.nn.functional.cross_entropy(logits[0].float(), ids[0, 1:])))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ks", nargs="+", type=int, default=[9, 27, 54])
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--out", default="benchmarks/results/prefill/head_pruning_smollm2_cpu")
    a = ap.parse_args()
    torch.set_num_threads(2)
    from zeroedge import texts, weights
    from zeroedge.mechanisms.heads import apply_pruning, attention_flops_saved, entropy_profile, pick_heads

    m, folder = weights.load("smollm2-135m")
    tok = weights.tokenizer(folder)
    calib = [texts.tokens(tok, texts.load_text("kjv"), 1024), texts.tokens(tok, texts.load_text("essays"), 1024)]
    prof = entropy_profile(m, calib)
    evals = {"kjv": 300_000, "essays": 30_000, "licenses": 0}
    ids = {t: torch.tensor([texts.tokens(tok, texts.load_text(t), a.ctx, offset=o)]) for t, o in evals.items()}
    dense = {t: ppl(m, x) for t, x in ids.items()}
    rows = []
    for k in a.ks:
        for reading in ("low", "high", "random"):
            pr = pick_heads(prof, k, reading, first_layer=0)
            mm = copy.deepcopy(m)
            apply_pruning(mm, pr)
            r = {"k": k, "reading": reading, "attn_flops_saved": attention_flops_saved(m, pr, a.ctx)}
            for t, x in ids.items():
                r[t] = ppl(mm, x) / dense[t] - 1
            rows.append(r)
            print(r, flush=True)
    out = Path(a.out)
    out.with_suffix(".json").write_text(json.dumps({"dense": dense, "rows": rows,
                                                    "profile": prof.tolist()}, indent=1))
    lines = ["# Attention-head pruning by softmax entropy (SmolLM2-135M, CPU fp32)", "",
             "Command: `python benchmarks/head_pruning.py`", "",
             f"Entropy profiled on 2 x 1024 calibration tokens (KJV + essays starts); perplexity of "
             f"every token on {a.ctx}-token held-out passages. Dense ppl: " +
             ", ".join(f"{t} {v:.3f}" for t, v in dense.items()) + ".", "",
             "| heads pruned (of 270) | reading | attention FLOPs saved | KJV | essays | licenses |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['k']} | {r['reading']} | {r['attn_flops_saved']:.1%} | {r['kjv']:+.2%} | "
                     f"{r['essays']:+.2%} | {r['licenses']:+.2%} |")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.5))
    im = ax.imshow(prof.T.numpy(), aspect="auto", cmap="viridis")
    ax.set_xlabel("layer"); ax.set_ylabel("head"); ax.set_title("normalised attention entropy (1 = uniform)")
    fig.colorbar(im); fig.tight_layout(); fig.savefig(out.with_suffix(".png"), dpi=110)
    lines += ["", f"![entropy profile]({out.with_suffix('.png').name})"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
