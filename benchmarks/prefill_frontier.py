"""Continuation perplexity vs prefill FFN FLOPs skipped: SIH (anchor / zero) against training-free
peers at the same skip rate, on real SmolLM2 weights, several texts, one run.

Protocol (long document): prefill the first N-1024 tokens with skipping in layers 2..28, score the
last 1024 dense on that cache (computed in one pass with positions >= N-1024 never skipped, which is
the same computation). Peers pick the tokens to skip by: random; lowest hidden-state norm; lowest
attention received (H2O / LazyLLM style); lowest gradient norm of the continuation loss (the oracle
the article's SIH imitates: it needs a backward pass on the very text). Every method protects the
first 4 positions (attention sinks) and the last prompt position, and uses the same anchors.

  python benchmarks/prefill_frontier.py --calib zeroedge/data/smollm2-135m.calib --ctx 4096 \
      --texts kjv essays licenses --rates 0.15 0.3 --out benchmarks/prefill_frontier
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch


def one_pass_ppl(m, ids, P, rt=None):
    with torch.no_grad():
        if rt is not None:
            rt.active, rt.limit = True, P
            rt.reset_stats()
        t0 = time.perf_counter()
        try:
            h = m.hidden_states(ids)
        finally:
            if rt is not None:
                rt.active, rt.limit = False, None
        dt = time.perf_counter() - t0
        logits = m.lm_head(h[:, P - 1:-1])
        nll = torch.nn.functional.cross_entropy(logits[0].float(), ids[0, P:])
    return math.exp(float(nll)), dt


def prefix_skip(rt, P, L):
    """Fraction of the prefill's FFN rows (P tokens x L layers) not computed."""
    return sum(st[1] - st[0] for st in rt.stats.values()) / (P * L)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calib", default="zeroedge/data/smollm2-135m.calib")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--texts", nargs="+", default=["kjv", "essays", "licenses"])
    ap.add_argument("--offsets", nargs="+", type=int, default=None,
                    help="token offset per text (default: past what calibration read)")
    ap.add_argument("--rates", nargs="*", type=float, default=[0.15, 0.3])
    ap.add_argument("--layers", default="2-28")
    ap.add_argument("--methods", nargs="*",
                    default=["sih", "random", "norm", "attn", "grad"])
    ap.add_argument("--alloc-methods", nargs="*", default=["random", "norm"],
                    help="peers given the artifact's own per-layer skip rates (isolates the token "
                         "ranking from the layer allocation)")
    ap.add_argument("--out", default="benchmarks/results/prefill/sih_pad_frontier_smollm2_cpu")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from zeroedge import calib_artifact, texts, weights
    from zeroedge.mechanisms.pad import install_artifact
    from zeroedge.export.importance import ffn_io_and_grads
    from zeroedge.mechanisms.anchors import Anchor
    from zeroedge.mechanisms.pad import LayerPolicy, ZeroRuntime, install, remove
    from zeroedge.mechanisms.sih import SIHHead

    m, folder = weights.load("smollm2-135m")
    tok = weights.tokenizer(folder)
    meta, tens = calib_artifact.load(a.calib)
    L = m.cfg.n_layers
    lo, hi = (int(x) for x in a.layers.split("-"))
    layers = range(lo, hi + 1)
    heads = {i: SIHHead.from_state(tens, f"layers.{i}.sih") for i in range(L)}
    anchors = {i: Anchor.from_state(tens, f"layers.{i}.anchor") for i in range(L)
               if f"layers.{i}.anchor.a" in tens}
    offsets = a.offsets or [300_000 if t == "kjv" else 30_000 if t == "essays" else 0 for t in a.texts]
    P = a.ctx - 1024
    rows = []
    for text, off in zip(a.texts, offsets):
        ids = torch.tensor([texts.tokens(tok, texts.load_text(text), a.ctx, offset=off, what=text)])
        dense, t_dense = one_pass_ppl(m, ids, P)
        print(f"{text}: dense ppl {dense:.4f} ({t_dense:.1f}s)", flush=True)
        rows.append({"text": text, "method": "dense", "output": "-", "rate": 0.0, "ffn_skipped": 0.0,
                     "ppl": dense, "rise": 0.0, "prefill_s": t_dense})
        grads = None
        if "grad" in a.methods:
            io, _ = ffn_io_and_grads(m, ids, P)
            grads = {i: io[i][2].norm(dim=-1)[None] for i in io}
        # the deployed, gated configuration
        rt = install_artifact(m, meta, tens)
        ppl, t = one_pass_ppl(m, ids, P, rt)
        sk = prefix_skip(rt, P, L)
        remove(m)
        rows.append({"text": text, "method": "sih-gated", "output": "anchor", "rate": None,
                     "ffn_skipped": sk, "ppl": ppl, "rise": ppl / dense - 1, "prefill_s": t})
        print(f"  sih-gated: skipped {sk:.1%} ppl {ppl:.4f} ({ppl / dense - 1:+.2%})", flush=True)
        for meth in a.alloc_methods:
            rt = ZeroRuntime()
            pol = {lm["index"]: LayerPolicy(scorer=meth, rate=min(1.0, lm["skip_rate"]),
                                            anchor=anchors.get(lm["index"]))
                   for lm in meta["layers"] if lm["skip"] and lm["skip_rate"] > 0}
            install(m, pol, rt)
            ppl, t = one_pass_ppl(m, ids, P, rt)
            sk = prefix_skip(rt, P, L)
            remove(m)
            rows.append({"text": text, "method": f"{meth} @ gated layer rates", "output": "anchor",
                         "rate": None, "ffn_skipped": sk, "ppl": ppl, "rise": ppl / dense - 1,
                         "prefill_s": t})
            print(f"  alloc-{meth}: skipped {sk:.1%} ppl {ppl:.4f} ({ppl / dense - 1:+.2%})", flush=True)
        for r in a.rates:
            for meth in a.methods:
                for output in ("anchor", "zero"):
                    if output == "zero" and meth not in ("sih", "random"):
                        continue
                    rt = ZeroRuntime()
                    if meth == "grad":
                        rt.external = grads
                    pol = {i: LayerPolicy(scorer="external" if meth == "grad" else meth, rate=r,
                                          sih=heads[i],
                                          anchor=anchors.get(i) if output == "anchor" else None)
                           for i in layers}
                    install(m, pol, rt)
                    ppl, t = one_pass_ppl(m, ids, P, rt)
                    sk = prefix_skip(rt, P, L)
                    remove(m)
                    rows.append({"text": text, "method": meth, "output": output, "rate": r,
                                 "ffn_skipped": sk, "ppl": ppl, "rise": ppl / dense - 1, "prefill_s": t})
                    print(f"  {meth:>6} {output:>6} rate {r:.2f}: skipped {sk:.1%} ppl {ppl:.4f} "
                          f"({ppl / dense - 1:+.2%})", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    write_md(out.with_suffix(".md"), rows, a)
    plot(out.with_suffix(".png"), rows)


def write_md(path, rows, a):
    lines = ["# Prefill FFN skipping: continuation perplexity vs FLOPs skipped (SmolLM2-135M, CPU fp32)",
             "", "Command:", "", "```", "python benchmarks/prefill_frontier.py --calib " + a.calib +
             f" --ctx {a.ctx} --texts {' '.join(a.texts)} --rates {' '.join(map(str, a.rates))}", "```", "",
             f"Protocol: prefill {a.ctx - 1024} tokens with skipping (layers {a.layers} for the "
             "fixed-rate rows; the gated row uses the artifact's per-layer thresholds, all layers), "
             "score the last 1024 tokens dense. `ffn_skipped` = fraction of all prefill FFN rows not "
             "computed (gross; anchors cost 2 % of an FFN row at rank 16).", "",
             "| text | method | output | rate | FFN skipped | ppl | rise | prefill s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rate = "-" if r["rate"] is None else f"{r['rate']:.2f}"
        lines.append(f"| {r['text']} | {r['method']} | {r['output']} | {rate} | {r['ffn_skipped']:.1%} "
                     f"| {r['ppl']:.3f} | {r['rise']:+.2%} | {r['prefill_s']:.1f} |")
    path.write_text("\n".join(lines) + "\n")


def plot(path, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tx = sorted({r["text"] for r in rows})
    fig, axs = plt.subplots(1, len(tx), figsize=(5 * len(tx), 4), squeeze=False)
    for ax, t in zip(axs[0], tx):
        rs = [r for r in rows if r["text"] == t and r["method"] != "dense"]
        for key in sorted({(r["method"], r["output"]) for r in rs}):
            pts = sorted((r["ffn_skipped"], 100 * r["rise"]) for r in rs if (r["method"], r["output"]) == key)
            ax.plot(*zip(*pts), marker="o", label=f"{key[0]} ({key[1]})")
        ax.axhline(2, color="k", lw=0.5, ls="--")
        ax.set_title(t)
        ax.set_xlabel("prefill FFN FLOPs skipped")
        ax.set_ylabel("continuation ppl rise (%)")
        ax.set_yscale("symlog")
    axs[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
