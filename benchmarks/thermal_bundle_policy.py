"""The bundle runners' thermal policy (zeroedge.kv.ort_policy.OrtThermalPolicy: what `zeroedge run
--backend onnxruntime|tensorrt --kv-budget F` serves a bundle with, e.g. on a Jetson) under the eval
contract's protocol: SmolLM2's fp32 portable bundle in onnxruntime, prefill N - 1024 tokens, the last
1024 teacher-forced, perplexity against the same runner with every position in its window.

Two window sizes: "F x prompt + new" is what `ServingSession` gives a bundle request since session 18,
the torch decoder's memory (F of the prompt, whole pages, plus a page for every 16 new tokens); "F x
(prompt + new)" is what it gave before (the new tokens compete for F of every position).

    zeroedge export smollm2-135m -o B --weights fp32 --graphs portable
    python benchmarks/thermal_bundle_policy.py --bundle B --ctx 4096 --json benchmarks/thermal_bundle_policy.json
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
CONTINUATION = 1024


def nll(runner, ids, P):
    """Mean negative log-likelihood of ids[P:] given everything before, through the runner."""
    import numpy as np

    def lp(logits, target):
        x = logits.astype(np.float64)
        m = x.max()
        return m + math.log(np.exp(x - m).sum()) - x[target]

    total = lp(runner.prefill(ids[:P]), ids[P])
    for t in range(P, len(ids) - 1):
        total += lp(runner.step(ids[t]), ids[t + 1])
    return total / (len(ids) - P)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--texts", default="kjv,essays,licenses")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from zeroedge import texts, weights
    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.kv.ort_policy import PAGE_SIZE, OrtThermalPolicy

    _, folder = weights.load("smollm2-135m")
    tok = weights.tokenizer(folder)
    rows = []
    for text in a.texts.split(","):
        ids = texts.tokens(tok, texts.load_text(text), a.ctx, what=text)
        P = len(ids) - CONTINUATION
        t0 = time.perf_counter()
        full = math.exp(nll(OrtRunner(a.bundle, slots=len(ids) + 8, threads=a.threads), ids, P))
        full_s = time.perf_counter() - t0
        windows = {"F x (prompt + new), before": math.ceil(a.budget * len(ids) / PAGE_SIZE),
                   "F x prompt + new": math.ceil(a.budget * P / PAGE_SIZE) + math.ceil(CONTINUATION / PAGE_SIZE)}
        for name, pages in windows.items():
            pol = OrtThermalPolicy(page_size=PAGE_SIZE)
            r = OrtRunner(a.bundle, slots=pages * PAGE_SIZE, threads=a.threads, policy=pol)
            t0 = time.perf_counter()
            ppl = math.exp(nll(r, ids, P))
            rows.append({"text": text, "ctx": a.ctx, "budget": a.budget, "window": name,
                         "slots": pages * PAGE_SIZE, "full_kv_ppl": full, "thermal_ppl": ppl,
                         "ppl_rise": ppl / full - 1, "full_s": full_s, "thermal_s": time.perf_counter() - t0})
            print(json.dumps({k: rows[-1][k] for k in ("text", "window", "slots", "full_kv_ppl", "thermal_ppl",
                                                       "ppl_rise")}), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
