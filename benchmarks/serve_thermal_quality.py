"""What thermal KV costs in `zeroedge serve`'s batched engine (`--kv-budget`), on real text and real
weights, beside `zeroedge run`'s thermal window on the same tokens: the thermal KV evaluation
contract (zeroedge.kv.evaluate: prefill the first N - C tokens, score the last C teacher-forced) with
the engine's own step.

    python benchmarks/serve_thermal_quality.py --texts kjv,essays,licenses --ctx 4096 --continuation 1024 \
        -o benchmarks/results/serve/thermal_quality_smollm2_cpu_4096.json

Engine rows: the texts' windows decoded together as one batch (one token of each a step), the
model's fp32 weights (`--weights model`), pages of 8; `dense` reads every position, `thermal` the
sketch's choice at `--budget` of each prompt (zeroedge.serve.thermal). Peer rows, same windows:
`zeroedge.kv.evaluate.run_eval` (`run`'s thermal window at the same budget, its full-KV reference).
"""
import argparse
import json
import math
import time

import torch


def engine_nll(model, windows, prefix: int, budget):
    """-> per window mean NLL of tokens prefix..end through BatchStep (thermal when budget)."""
    from zeroedge.serve.batch import BatchStep, PagedKV, Segment
    from zeroedge.serve.thermal import ThermalSketches

    n = len(windows[0])
    pool = PagedKV(model.cfg, len(windows) * (n // 8 + 2), 8, "cpu", torch.float32)
    hot = ThermalSketches(pool, model.cfg, budget, len(windows)) if budget else None
    step = BatchStep(model, pool, hot=hot)
    pages = [pool.alloc(pool.pages_for(n)) for _ in windows]
    logits = None
    for a in range(0, prefix, 512):              # the prompts in chunks, as the server prefills them
        z = min(prefix, a + 512)
        logits = step.forward([Segment(p, w[a:z], a) for p, w in zip(pages, windows)])
    hots = [hot.build(p, prefix) for p in pages] if hot else [None] * len(windows)
    total = [0.0] * len(windows)
    for pos in range(prefix, n):
        lp = torch.log_softmax(logits.double(), -1)
        for j, w in enumerate(windows):
            total[j] -= float(lp[j, w[pos]])
        if pos + 1 < n:
            logits = step.forward([Segment(p, [w[pos]], pos, hot=h) for p, w, h in zip(pages, windows, hots)])
    return [t / (n - prefix) for t in total], hots


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", default="kjv,essays,licenses")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--continuation", type=int, default=1024)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    from zeroedge import texts, weights
    from zeroedge.kv.evaluate import run_eval

    torch.set_num_threads(args.threads)
    m, folder = weights.load("smollm2-135m")
    m = m.float().eval()
    tok = weights.tokenizer(folder)
    names = args.texts.split(",")
    windows = [[int(t) for t in texts.tokens(tok, texts.load_text(n, texts.chars_for(args.ctx)), args.ctx, what=n)]
               for n in names]
    prefix = args.ctx - args.continuation
    t0 = time.perf_counter()
    dense, _ = engine_nll(m, windows, prefix, None)
    thermal, hots = engine_nll(m, windows, prefix, args.budget)
    engine_s = time.perf_counter() - t0
    rows = []
    for j, name in enumerate(names):
        peer = run_eval(m, windows[j], args.budget, continuation=args.continuation)
        h = hots[j]
        rows.append({"text": name, "engine_dense_ppl": math.exp(dense[j]), "engine_thermal_ppl": math.exp(thermal[j]),
                     "engine_rise": math.exp(thermal[j] - dense[j]) - 1,
                     "engine_prompt_pages": None if h is None else {
                         "scored": h.scored, "chosen": h.slots, "always (sink and recent)": prefix // 8 - h.scored},
                     "run_full_kv_ppl": peer["full_kv_ppl"], "run_thermal_ppl": peer["thermal_ppl"],
                     "run_rise": peer["ppl_rise"], "run_hot_pages_per_head": peer["hot_pages_per_head"]})
        print(json.dumps(rows[-1]), flush=True)
    out = {"what": "thermal KV's perplexity cost: zeroedge serve's batched engine and zeroedge run's window",
           "hardware": "CPU", "weights": "real SmolLM2-135M-Instruct, fp32", "ctx": args.ctx,
           "scored_tokens": args.continuation, "budget": args.budget, "page_size": 8,
           "engine_seconds": engine_s, "rows": rows}
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
