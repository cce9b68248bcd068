"""Serving path on SmolLM2 (CPU): every decoder the session picks, side by side in one process.

    python benchmarks/serving_bench.py --bundle BUNDLE --calib PATHS_ARTIFACT [--max-new 32] [--reps 2]

One KJV prompt; configurations run alternately `reps` times; median tokens/s. Writes a markdown
table to stdout (paste into benchmarks/serve.md)."""
import argparse
import statistics
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--calib", required=True)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--chars", type=int, default=5000)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from zeroedge import texts, weights
    from zeroedge.serve.session import ServingSession, open_bundle

    torch.set_num_threads(a.threads)
    m, folder = weights.load("smollm2-135m")
    tok = weights.tokenizer(folder)
    kjv = texts.load_text("kjv")
    ids = tok.encode(kjv[200000 - a.chars:200000], add_special_tokens=False)
    confs = {
        "torch dense": ServingSession(m),
        "torch thermal 10%": ServingSession(m, kv_budget=0.1),
        "torch paths": ServingSession(m, artifact=a.calib),
        "torch thermal 10% + paths": ServingSession(m, kv_budget=0.1, artifact=a.calib),
        "onnxruntime dense": ServingSession(open_bundle(a.bundle, threads=a.threads, model_cfg=m.cfg)),
        "onnxruntime thermal 10%": ServingSession(open_bundle(a.bundle, threads=a.threads, model_cfg=m.cfg),
                                                  kv_budget=0.1),
    }
    runs = {k: [] for k in confs}
    t0 = time.time()
    for _ in range(a.reps):
        for k, s in confs.items():
            runs[k].append(s.generate(ids, a.max_new))
    dense = runs["torch dense"][0].tokens
    print(f"prompt {len(ids)} tokens (KJV), {a.max_new} new, greedy, {a.reps} reps, "
          f"{a.threads} threads, {time.time() - t0:.0f} s total\n")
    print("| configuration | decoder | tok/s (median) | device KV bytes | % of full | pages migrated "
          "| first tokens equal to torch dense |")
    print("|---|---|---|---|---|---|---|")
    for k, rs in runs.items():
        r = rs[-1]
        same = next((i for i, (x, y) in enumerate(zip(r.tokens, dense)) if x != y), len(dense))
        print(f"| {k} | {r.detail['decoder']} | {statistics.median(x.tokens_per_s for x in rs):.1f} | "
              f"{r.device_kv_bytes:,} | {100 * r.device_kv_bytes / r.full_kv_bytes:.1f} | "
              f"{r.pages_migrated} | {same}/{len(dense)} |")


if __name__ == "__main__":
    main()
