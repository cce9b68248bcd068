"""Plot and tabulate benchmarks/results/paths/ppl_vs_ffn_bytes_smollm2_cpu.jsonl (written by paths_frontier.py).

  python benchmarks/paths_plot.py benchmarks/results/paths/ppl_vs_ffn_bytes_smollm2_cpu.jsonl benchmarks/results/paths/ppl_vs_ffn_bytes_smollm2_cpu.png
"""
import json
import sys

LABEL = {"topk": "top-k oracle on silu(g)*u (peer)", "cats": "CATS |silu(g)| threshold (peer)",
         "predictor_topk": "rank-32 path predictor (this issue)",
         "input": "input magnitude |x|, |a| (TEAL-style)",
         "predictor_gated": "predictor, gated artifact", "magnitude_gated": "magnitude, gated artifact (2 % budget)"}


def main():
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    texts = list(dict.fromkeys(r["text"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "dense"))
    print("| text | method | setting | FFN bytes skipped | ppl | rise vs dense |")
    print("|---|---|---|---|---|---|")
    for t in texts:
        d = next(r for r in rows if r["text"] == t and r["method"] == "dense")
        print(f"| {t} | dense | | 0 % | {d['ppl']:.3f} | |")
        for r in rows:
            if r["text"] == t and r["method"] != "dense":
                print(f"| {t} | {r['method']} | {json.dumps(r.get('setting', {}))} | "
                      f"{r['ffn_bytes_skipped']:.1%} | {r['ppl']:.3f} | {r['ppl_rise']:+.2%} |")
    if len(sys.argv) > 2:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(texts), figsize=(5 * len(texts), 4), sharey=True)
        for ax, t in zip(axes, texts):
            for m in methods:
                pts = sorted((r["ffn_bytes_skipped"], 100 * r["ppl_rise"]) for r in rows
                             if r["text"] == t and r["method"] == m)
                if pts:
                    ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], "o-", label=LABEL.get(m, m))
            ax.axhline(2, color="grey", ls="--", lw=0.8)
            ax.axvline(35, color="grey", ls=":", lw=0.8)
            ax.set_yscale("symlog", linthresh=1)
            ax.set_title(f"{t} (1024 tokens, every token)")
            ax.set_xlabel("FFN weight bytes skipped per decode step (%)")
        axes[0].set_ylabel("perplexity rise (%)")
        axes[0].legend(fontsize=7)
        fig.suptitle("SmolLM2-135M decode paths: dashed = 2 % budget, dotted = 35 % target")
        fig.tight_layout()
        fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
