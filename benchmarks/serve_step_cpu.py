"""The serving engine's decode step on the CPU with 4-bit weights (one onnxruntime graph), timed alone.

    python benchmarks/serve_step_cpu.py -o benchmarks/results/serve/cpu_step_q4_batches.json

Real SmolLM2-135M weights on the Q4_1 grid; B sequences, each prefilled with 100 tokens, then 20 decode
steps of all B together (median of the last 16), as `zeroedge serve --weights q4 --threads T` runs them
(torch on one thread).
"""
import argparse
import json
import os
import platform
import statistics
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    import torch

    from zeroedge.serve.batch import BatchStep, PagedKV, Segment
    from zeroedge.serve.cpu_q4 import Q4Step
    from zeroedge.weights import resolve_model

    torch.set_num_threads(a.threads)
    m, cfg, _ = resolve_model("smollm2-135m", need_weights=True)
    m = m.float().eval()
    q4 = Q4Step(m, a.threads)
    torch.set_num_threads(1)
    batches = [int(b) for b in a.batches.split(",")]
    pool = PagedKV(cfg, max(batches) * 10, 16, "cpu", torch.float32, heads_first=True)
    step = BatchStep(m, pool, q4)
    rows, load_at_start = [], os.getloadavg()
    for B in batches:
        seqs = []
        for b in range(B):
            pages = pool.alloc(10)
            step.forward([Segment(pages, list(range(b, b + 100)), 0)])
            seqs.append([pages, 100])
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            step.forward([Segment(p, [5], n) for p, n in seqs])
            times.append(time.perf_counter() - t0)
            for s in seqs:
                s[1] += 1
        ms = 1000 * statistics.median(times[4:])
        rows.append({"batch": B, "step_ms": ms, "tokens_per_s": B * 1000 / ms})
        print(json.dumps(rows[-1]), flush=True)
        for pages, _ in seqs:
            pool.release(pages)
    out = {"what": "serving engine decode step, 4-bit weights, one onnxruntime graph", "model": "smollm2-135m",
           "hardware": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": a.threads,
           "load_at_start": load_at_start, "load_at_end": os.getloadavg(), "positions": "~100-120 per sequence",
           "rows": rows}
    with open(a.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
