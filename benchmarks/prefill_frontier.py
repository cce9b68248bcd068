"""SIH/PAD's token ranking against its peers: continuation perplexity against prefill FFN FLOPs skipped,
on real SmolLM2 weights, five texts (two genres no calibration read), one run.

Protocol (long document): prefill the first N-1024 tokens with skipping, score the last 1024 dense on
that cache (one pass, positions >= N-1024 never skipped: the same computation). Scorers pick the
tokens a layer skips:
  sih     the artifact's heads (smoothed over 3 positions, as deployed)
  random  uniformly at random
  norm    lowest norm of the FFN input
  oracle  lowest first-order importance |g . (y - anchor(x))| from a backward pass on the very text
          (its continuation loss): a measuring stick no deployment can run
Three settings, every scorer with the same anchors and protected positions:
  gated      the artifact as shipped (SIH by its rates, or its thresholds), and each peer skipping
             exactly as many prompt rows per layer as SIH did on that text (per rank block under the
             rank rule; `zeroedge eval --scorer`)
  calibrated each --peer-calib artifact as its gate chose it: another ranking (`calibrate --scorer
             norm|random` at the same budget: the layers and rates the gate affords with it), or SIH
             at another budget or sequence length (then each peer at its per-layer row counts too)
  uniform    a fixed fraction of the prompt tokens in each of layers 2-28 (the ranking frontier)

  python benchmarks/prefill_frontier.py --calib zeroedge/data/smollm2-135m.calib --ctx 4096 \\
      --texts kjv essays licenses manpages python --rates 0.1 0.2 0.3 --peer-calib ARTIFACT ...
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

SCORERS = ("sih", "random", "norm", "oracle")
# where each named text's passage starts, past what calibration reads (KJV, essays: 64,000 tokens; licenses: 40,000)
OFFSETS = {"kjv": 300_000, "essays": 100_000, "licenses": 44_000}


def genre_file(name: str, folder: Path) -> str:
    """A text of a genre no calibration reads, written under `folder`: `manpages` (bash(1) as `man`
    renders it, 80 columns) or `python` (the running Python's standard library sources, sorted by
    name). Other names pass through (kjv / essays / licenses / a file)."""
    if name == "manpages":
        text = subprocess.run(["man", "-P", "cat", "bash"], capture_output=True, text=True, check=True,
                              env={**os.environ, "MANWIDTH": "80"}).stdout
    elif name == "python":
        lib = Path(sysconfig.get_paths()["stdlib"])
        text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(lib.glob("*.py"))[:60])
    else:
        return name
    path = folder / f"{name}.txt"
    path.write_text(text, encoding="utf-8")
    return str(path)


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
    ap.add_argument("--texts", nargs="+", default=["kjv", "essays", "licenses", "manpages", "python"])
    ap.add_argument("--rates", nargs="*", type=float, default=[0.1, 0.2, 0.3])
    ap.add_argument("--layers", default="2-28", help="layers the uniform rates skip in")
    ap.add_argument("--scorers", nargs="+", default=list(SCORERS), choices=SCORERS)
    ap.add_argument("--peer-calib", nargs="*", default=[],
                    help="artifacts calibrated with another --scorer at the same budget, run as they ship")
    ap.add_argument("--out", default="benchmarks/results/prefill/sih_scorers_frontier_smollm2_cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plot-from", metavar="RAW.json", help="only draw the plot of a raw file (beside it)")
    a = ap.parse_args()
    if a.plot_from:
        raw = Path(a.plot_from)
        if not raw.is_file():
            sys.exit(f"prefill_frontier: no raw file {raw}")
        plot(raw.with_suffix(".png"), json.loads(raw.read_text())["rows"])
        return
    torch.set_num_threads(a.threads)

    from zeroedge import calib_artifact, texts, weights
    from zeroedge.evaluation import first_order_importance, ranked_at_counts
    from zeroedge.mechanisms.anchors import Anchor
    from zeroedge.mechanisms.pad import LayerPolicy, ZeroRuntime, artifact_policies, install, remove
    from zeroedge.mechanisms.sih import SIHHead

    m, folder = weights.load("smollm2-135m")
    tok = weights.tokenizer(folder)
    meta, tens = calib_artifact.load(a.calib)
    L = m.cfg.n_layers
    lo, hi = (int(x) for x in a.layers.split("-"))
    shipped, shipped_rt = artifact_policies(meta, tens)
    peers = []                  # (the command that made it, its gate's figures, its ranking, its policies)
    for path in a.peer_calib:
        pm, pt = calib_artifact.load(path)
        own, q, rep = calib_artifact.Calibration.from_meta(pm).sih.scorer, pm["quality"], pm["report"]
        made_by = (f"zeroedge calibrate smollm2-135m {' '.join('--text ' + t for t in pm.get('texts', []))} "
                   f"--budget {100 * q['budget']:g}% --tokens {pm.get('tokens_per_text', 24000)} "
                   f"--seq-len {rep['seq_len']} --continuation {rep['continuation']} "
                   f"--train-seqs {rep['train_sequences']} --gate-seqs {rep['heldout_sequences']} --scorer {own}"
                   + (f" --max-rate {100 * q['max_rate']:g}%" if "max_rate" in q else ""))
        gate = {"budget": q["budget"], "seq_len": rep["seq_len"], "ffn_flops_skipped_heldout": q["ffn_flops_skipped"],
                "ppl_rise_heldout": q["ppl_rise"]}
        peers.append((made_by, gate, own, artifact_policies(pm, pt)))
    heads = {i: SIHHead.from_state(tens, f"layers.{i}.sih") for i in range(L)}
    anchors = {i: Anchor.from_state(tens, f"layers.{i}.anchor") if f"layers.{i}.anchor.a" in tens else None
               for i in range(L)}

    def runtime(like=None, **kw):
        like = like or shipped_rt
        return ZeroRuntime(protect_first=like.protect_first, protect_last=like.protect_last,
                           min_tokens=like.min_tokens, **kw)
    P = a.ctx - 1024
    rows = []

    def record(text, setting, scorer, rate, rt, ppl, t, dense, **extra):
        sk = prefix_skip(rt, P, L)
        rows.append({"text": text, "setting": setting, "scorer": scorer, "rate": rate, "ffn_skipped": sk,
                     "ppl": ppl, "rise": ppl / dense - 1, "prefill_s": t, **extra,
                     "per_layer_skip": {i: (st[1] - st[0]) / st[1] for i, st in sorted(rt.stats.items())}})
        print(f"  {setting:>7} {scorer:>6} {'' if rate is None else f'rate {rate:.2f}':>9}: skipped {sk:.1%} "
              f"ppl {ppl:.4f} ({ppl / dense - 1:+.2%}) {extra.get('artifact', '')}", flush=True)

    def run(policies, external=None, like=None):
        """(runtime, ppl, seconds) of one prefill with `policies` installed (protections: `like`'s,
        else the shipped artifact's)."""
        rt = runtime(external=external or {}, like=like)
        install(m, policies, rt)
        try:
            ppl, t = one_pass_ppl(m, ids, P, rt)
        finally:
            remove(m)
        return rt, ppl, t

    def at_counts(policies, rt, scorers):
        """Each of `scorers` (peers of SIH) skipping the rows SIH skipped in the run `rt`, layer by layer."""
        skipped = {i: st[1] - st[0] for i, st in rt.stats.items()}
        for scorer in scorers:
            yield (scorer, *run(ranked_at_counts(policies, runtime(like=rt), skipped, P, scorer, oracle), oracle,
                                like=rt))

    with tempfile.TemporaryDirectory() as tmp:
        for text in a.texts:
            spec = genre_file(text, Path(tmp))
            ids = torch.tensor([texts.tokens(tok, texts.load_text(spec), a.ctx, offset=OFFSETS.get(text, 0),
                                             what=text)])
            dense, t_dense = one_pass_ppl(m, ids, P)
            print(f"{text}: dense ppl {dense:.4f} ({t_dense:.1f}s)", flush=True)
            rows.append({"text": text, "setting": "dense", "scorer": "-", "rate": 0.0, "ffn_skipped": 0.0,
                         "ppl": dense, "rise": 0.0, "prefill_s": t_dense, "offset": OFFSETS.get(text, 0)})
            oracle = (first_order_importance(m, ids, P, anchors)
                      if "oracle" in a.scorers else None)
            peer_scorers = [s for s in a.scorers if s != "sih"]
            # gated: the artifact as shipped, then each peer at SIH's per-layer row counts on this text
            rt, ppl, t = run(shipped)
            record(text, "gated", "sih", None, rt, ppl, t, dense)
            for scorer, prt, ppl, t in at_counts(shipped, rt, peer_scorers):
                record(text, "gated", scorer, None, prt, ppl, t, dense)
            for path, gate, own, (policies, peer_rt) in peers:
                rt, ppl, t = run(policies, like=peer_rt)
                record(text, "calibrated", own, None, rt, ppl, t, dense, artifact=path, **gate)
                for scorer, prt, ppl, t in at_counts(policies, rt, peer_scorers if own == "sih" else []):
                    record(text, "calibrated", scorer, None, prt, ppl, t, dense, artifact=path, at_counts_of="sih",
                           **gate)
            for r in a.rates:
                for scorer in a.scorers:
                    pol = {i: LayerPolicy(scorer="external" if scorer == "oracle" else scorer, rate=r,
                                          sih=heads[i], anchor=anchors[i]) for i in range(lo, hi + 1)}
                    rt, ppl, t = run(pol, oracle)
                    record(text, "uniform", scorer, r, rt, ppl, t, dense)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/prefill_frontier.py " + " ".join(sys.argv[1:])
    out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "calib": a.calib, "peer_calib": a.peer_calib, "ctx": a.ctx, "prefix": P,
         "layers_uniform": a.layers, "hardware": "2-core x86-64 CPU, fp32", "weights": "real SmolLM2-135M", "rows": rows}, indent=1))
    plot(out.with_suffix(".png"), rows)


def plot(path, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tx = list(dict.fromkeys(r["text"] for r in rows))
    fig, axs = plt.subplots(1, len(tx), figsize=(4.2 * len(tx), 3.8), squeeze=False)
    for ax, t in zip(axs[0], tx):
        for color, scorer in enumerate(SCORERS):
            color = f"C{color}"
            pts = sorted((r["ffn_skipped"], 100 * r["rise"]) for r in rows
                         if r["text"] == t and r["scorer"] == scorer and r["setting"] == "uniform")
            if pts:
                ax.plot(*zip(*pts), marker="o", color=color)
            if ax is axs[0][0]:
                ax.plot([], [], marker="o", color=color, label=scorer)        # the legend's entry
            for setting, marker in (("gated", "x"), ("calibrated", "+")):
                # gated: at the shipped artifact's counts; calibrated: another ranking through its own gate
                g = [r for r in rows if r["text"] == t and r["scorer"] == scorer and r["setting"] == setting
                     and (setting == "gated" or (scorer != "sih" and "at_counts_of" not in r))]
                if g:
                    ax.scatter([g[0]["ffn_skipped"]], [100 * g[0]["rise"]], marker=marker, s=70, color=color)
        ax.axhline(2, color="k", lw=0.5, ls="--")
        ax.set_title(t)
        ax.set_xlabel("prefill FFN rows skipped")
        ax.set_ylabel("continuation ppl rise (%)")
    axs[0][0].legend(fontsize=7, title="uniform (lines), at the shipped\nartifact's counts (x), through\nits own gate (+)",
                     title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
