"""Thermal KV against the eviction peers on SmolLM2-135M real weights (CPU).

Protocol: prefill the first N-1024 tokens with full attention, score the last 1024 teacher-forced;
the budget is the fraction of the prefix a continuation token may read. One prefill per
(text, N) is shared by every method (cached under $ZEROEDGE_CACHE/kvbench, never in the repo).
Results are appended to benchmarks/results/thermal_kv/quality_smollm2_cpu_peers_pages16.jsonl (a run resumes where it
stopped); `--table` rewrites benchmarks/results/thermal_kv/quality_smollm2_cpu_peers_pages16_table.md and the plot
benchmarks/thermal_kv.png from it.

    python benchmarks/thermal_kv_bench.py --texts kjv,essays --ctx 4096 --budgets 0.1,0.25
    python benchmarks/thermal_kv_bench.py --needle --ctx 4096,8192
    python benchmarks/thermal_kv_bench.py --table
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
RESULTS = HERE / "results" / "thermal_kv" / "quality_smollm2_cpu_peers_pages16.jsonl"

NEEDLE = ("\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a "
          "sunny day.\n")
QUESTION = ("\n\nQuestion: What is the best thing to do in San Francisco? Answer from the text "
            "above.\nAnswer: The best thing to do in San Francisco is")


def done_keys():
    keys = set()
    if RESULTS.exists():
        for line in RESULTS.read_text().splitlines():
            r = json.loads(line)
            keys.add(r["key"])
    return keys


def append(rec):
    with open(RESULTS, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(json.dumps({k: v for k, v in rec.items() if k != "key"}), flush=True)


def get_prefill(model, text, N, ids, P, stats):
    import torch

    from zeroedge.kv.evaluate import prefill
    from zeroedge.weights import cache_dir

    d = cache_dir() / "kvbench"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"pre_{text}_{N}_{'stats' if stats else 'plain'}.pt"
    if path.exists():
        return torch.load(path)
    t = time.time()
    pre = prefill(model, ids[:P], stats=stats)
    torch.save(pre, str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)
    print(f"prefill {text} {N}: {time.time() - t:.0f}s", flush=True)
    return pre


def ppl_runs(args, model, tok):
    import torch

    from zeroedge import texts
    from zeroedge.kv import evaluate as E

    have = done_keys()
    methods = args.methods.split(",")
    for N in [int(c) for c in args.ctx.split(",")]:
        for text in args.texts.split(","):
            ids = texts.tokens(tok, texts.load_text(text), N)
            P = N - 1024
            need_stats = any(m in ("h2o", "snapkv") for m in methods)
            pre = None
            plan = [("full", 1.0)] + [(m, b) for b in map(float, args.budgets.split(","))
                                      for m in methods if m != "full"]
            for meth, b in plan:
                if meth == "oracle_page" and b > 0.1 and not args.all_oracles:
                    continue
                key = f"{text}|{N}|{meth}|{b}|{args.tag}"
                if key in have:
                    continue
                if pre is None:
                    pre = get_prefill(model, text, N, ids, P, need_stats)
                st = {}
                t = time.time()
                opts = dict(E.DEFAULTS, **json.loads(args.opts)) if meth == "thermal" else {}
                ps_ = args.page_size
                nll = E.score_continuation(model, ids[P:], pre, meth, b, ps_, opts=opts, stats=st)
                rec = {"key": key, "text": text, "ctx": N, "method": meth, "budget": b, "page_size": ps_,
                       "ppl": math.exp(nll.mean().item()), "seconds": round(time.time() - t),
                       "tag": args.tag}
                full_b = E.kv_bytes(model, P)
                if meth == "thermal":
                    pages = max(1, E._budget_tokens(P, b) // ps_)
                    rec["hot_fraction"] = (E.kv_bytes(model, pages * ps_) + st["summary_bytes"]) / full_b
                    rec["summary_fraction"] = st["summary_bytes"] / full_b
                    rec["opts"] = opts
                    rec.update(E.fetch_stats(st["chosen"], pages - opts["sink_pages"] - opts["recent_pages"]))
                elif meth != "full":
                    rec["hot_fraction"] = E._budget_tokens(P, b) / P
                else:
                    rec["hot_fraction"] = 1.0
                append(rec)
                have.add(key)


def needle_runs(args, model, tok):
    import torch

    from zeroedge import texts
    from zeroedge.kv import evaluate as E

    have = done_keys()
    essays = texts.load_text("essays")
    q_ids = tok.encode(QUESTION, add_special_tokens=False)
    n_ids = tok.encode(NEEDLE, add_special_tokens=False)
    for N in [int(c) for c in args.ctx.split(",")]:
        for depth in [float(d) for d in args.depths.split(",")]:
            key0 = f"needle|{N}|{depth}"
            methods = ["full"] + [f"thermal@{b}" for b in args.budgets.split(",")] + \
                      [f"streaming@{b}" for b in args.budgets.split(",")]
            if all(f"{key0}|{m}" in have for m in methods):
                continue
            # haystack of N - len(question) tokens with the needle at `depth`, cut to a page multiple
            P = ((N - len(q_ids)) // 16) * 16
            hay = texts.tokens(tok, essays, P - len(n_ids))
            at = int(depth * len(hay))
            prefix = hay[:at] + n_ids + hay[at:]
            pre = E.prefill(model, prefix, stats=False)
            for m in methods:
                key = f"{key0}|{m}"
                if key in have:
                    continue
                meth, b = (m.split("@")[0], float(m.split("@")[1])) if "@" in m else (m, 1.0)
                gen = []
                first = pre["last_logits"]
                cont = list(q_ids)
                for i in range(12):
                    lg = E.score_continuation(model, cont, pre, meth, b, 16,
                                              opts=dict(E.DEFAULTS) if meth == "thermal" else {},
                                              return_logits=True)
                    nxt = int(lg[-1].argmax())
                    gen.append(nxt)
                    cont.append(nxt)
                answer = tok.decode(gen)
                found = ("dolores" in answer.lower()) or ("sandwich" in answer.lower())
                rec = {"key": key, "needle": True, "ctx": N, "depth": depth, "method": meth,
                       "budget": b, "answer": answer, "found": found}
                if meth == "thermal":
                    rec["opts"] = dict(E.DEFAULTS)
                append(rec)
                have.add(key)


def table():
    rows = [json.loads(l) for l in RESULTS.read_text().splitlines()] if RESULTS.exists() else []
    ppl = [r for r in rows if not r.get("needle")]
    for r in ppl:                       # thermal rows are labelled by their sketch
        if r["method"] == "thermal":
            o = r.get("opts", {})
            r["method"] = f"thermal r{o.get('rank', 16)} int{o.get('bits', 4)}"
        elif r.get("tag") and r["method"] != "full":
            r["method"] = f"{r['method']} [{r['tag']}]"
    needle = [r for r in rows if r.get("needle")]
    lines = []
    full = {(r["text"], r["ctx"]): r["ppl"] for r in ppl if r["method"] == "full"}
    order = ["streaming", "h2o", "snapkv", "oracle_token", "oracle_page", "thermal r16 int4",
             "thermal r32 int3"]
    order += sorted({r["method"] for r in ppl} - set(order) - {"full"})
    combos = sorted({(r["ctx"], r["budget"]) for r in ppl if r["method"] != "full"})
    textsz = sorted({r["text"] for r in ppl})
    lines.append("| ctx | budget | method | " + " | ".join(f"{t} ppl (rise)" for t in textsz)
                 + " | device prefix KV / full |")
    lines.append("|---|---|---|" + "---|" * len(textsz) + "---|")
    for N, b in combos:
        for t in textsz:
            pass
        lines.append(f"| {N} | full | full KV | " + " | ".join(
            f"{full[(t, N)]:.4f}" if (t, N) in full else "-" for t in textsz) + " | 1.00 |")
        for m in order:
            cells, frac = [], "-"
            for t in textsz:
                r = [x for x in ppl if x["text"] == t and x["ctx"] == N and x["budget"] == b and x["method"] == m]
                if r and (t, N) in full:
                    cells.append(f"{r[-1]['ppl']:.4f} ({100 * (r[-1]['ppl'] / full[(t, N)] - 1):+.2f} %)")
                    frac = f"{r[-1].get('hot_fraction', b):.3f}"
                else:
                    cells.append("-")
            if any(c != "-" for c in cells):
                lines.append(f"| {N} | {b:.0%} | {m} | " + " | ".join(cells) + f" | {frac} |")
    th = [r for r in ppl if r["method"].startswith("thermal")]
    if th:
        lines.append("")
        lines.append("Thermal traffic through the slot window (pages fetched per step per (layer, kv head) stream):")
        lines.append("")
        lines.append("| text | ctx | budget | sketch | mean | p99 | summaries / full KV |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in th:
            lines.append(f"| {r['text']} | {r['ctx']} | {r['budget']:.0%} | {r['method'][8:]} | "
                         f"{r.get('fetch_pages_per_step_mean', 0):.2f} | {r.get('fetch_pages_per_step_p99', 0)} | "
                         f"{r.get('summary_fraction', 0):.3f} |")
    if needle:
        lines.append("")
        lines.append("Needle in the essays (greedy answer, 12 tokens; found = mentions Dolores Park or the sandwich):")
        lines.append("")
        lines.append("| ctx | depth | method | budget | found | answer |")
        lines.append("|---|---|---|---|---|---|")
        for r in needle:
            if r["method"] == "thermal":
                o = r.get("opts", {"rank": 16, "bits": 4})
                r["method"] = f"thermal r{o['rank']} int{o['bits']}"
            ans = r["answer"].replace("|", "/").replace("\n", " ")
            lines.append(f"| {r['ctx']} | {r['depth']:.0%} | {r['method']} | {r['budget']:.0%} | "
                         f"{'yes' if r['found'] else 'no'} | {ans} |")
    (RESULTS.parent / "quality_smollm2_cpu_peers_pages16_table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        plot(ppl, full)
    except Exception as e:  # matplotlib missing: the table is the record
        print(f"(no plot: {e})")


def plot(ppl, full):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["text"], r["ctx"]) for r in ppl if r["method"] != "full" and (r["text"], r["ctx"]) in full})
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(4.2 * max(1, len(keys)), 3.6), squeeze=False)
    for ax, (t, N) in zip(axes[0], keys):
        for m, mk in [("streaming", "s"), ("h2o", "^"), ("snapkv", "v"), ("oracle_page", "x"),
                      ("thermal r16 int4", "o"), ("thermal r32 int3", "D")]:
            rs = sorted([r for r in ppl if r["text"] == t and r["ctx"] == N and r["method"] == m],
                        key=lambda r: r["budget"])
            if rs:
                ax.plot([r["budget"] * 100 for r in rs], [100 * (r["ppl"] / full[(t, N)] - 1) for r in rs],
                        marker=mk, label=m)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_title(f"{t}, {N} tokens")
        ax.set_xlabel("prefix budget (%)")
        ax.set_ylabel("perplexity rise vs full KV (%)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "thermal_kv.png", dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", default="kjv,essays")
    ap.add_argument("--ctx", default="4096")
    ap.add_argument("--budgets", default="0.1,0.25")
    ap.add_argument("--methods", default="streaming,h2o,snapkv,oracle_page,thermal")
    ap.add_argument("--opts", default="{}", help="thermal options as JSON")
    ap.add_argument("--tag", default="")
    ap.add_argument("--page-size", type=int, default=16, help="page size of thermal / oracle_page")
    ap.add_argument("--all-oracles", action="store_true")
    ap.add_argument("--needle", action="store_true")
    ap.add_argument("--depths", default="0.2,0.5,0.8")
    ap.add_argument("--table", action="store_true")
    args = ap.parse_args()
    if args.table:
        return table()
    import torch

    torch.set_num_threads(2)
    from zeroedge import weights

    model, folder = weights.load("smollm2-135m")
    tok = weights.tokenizer(folder)
    if args.needle:
        needle_runs(args, model, tok)
    else:
        ppl_runs(args, model, tok)


if __name__ == "__main__":
    main()
