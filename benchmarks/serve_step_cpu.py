"""The serving engine's decode step on the CPU with 4-bit weights (one onnxruntime graph), timed alone.

    python benchmarks/serve_step_cpu.py -o benchmarks/results/serve/cpu_step_q4_batches.json

Real SmolLM2-135M weights on the Q4_1 grid, as `zeroedge serve --weights q4 --threads T` runs them
(torch on one thread), on zeroedge's onnxruntime kernels and on onnxruntime's own operators (each
`--rounds` times, each run in a process of its own, alternated). Batches: B sequences, each prefilled
with `--context` tokens, then 20 decode steps of all B together (median of the last 16). Checks: one
sequence at `--context`, a step of a verify segment of R rows (a token and R - 1 drafted ones) against
a plain step, alternated.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="100,800")
    ap.add_argument("--verify-rows", default="1,2,5,9")
    ap.add_argument("--kernels", default="zeroedge,stock")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", help=argparse.SUPPRESS)        # one run: its rows as JSON on stdout
    ap.add_argument("-o", "--output")
    a = ap.parse_args()
    if a.only:
        print(json.dumps(measure(a, a.only)))
        return
    if not a.output:
        ap.error("-o/--output is required")
    runs, load_at_start = [], os.getloadavg()
    kernels = a.kernels.split(",")
    for r in range(a.rounds):
        for k in kernels if r % 2 == 0 else kernels[::-1]:
            argv = [sys.executable, __file__, "--only", k] + [f"--{n.replace('_', '-')}={getattr(a, n)}" for n in
                                                              ("batches", "threads", "contexts", "verify_rows")]
            p = subprocess.run(argv, capture_output=True, text=True, check=True)
            runs.append({"kernels": k, "round": r, **json.loads(p.stdout.strip().splitlines()[-1])})
            print(json.dumps({"kernels": k, "round": r, "rows": runs[-1]["rows"]}), flush=True)
    out = {"what": "serving engine decode step, 4-bit weights, one onnxruntime graph", "model": "smollm2-135m",
           "command": "python benchmarks/serve_step_cpu.py " + " ".join(sys.argv[1:]),
           "hardware": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": a.threads,
           "load_at_start": load_at_start, "load_at_end": os.getloadavg(), "runs": runs}
    with open(a.output, "w") as f:
        json.dump(out, f, indent=1)


def measure(a, kernels: str) -> dict:
    import torch

    from zeroedge.serve.batch import BatchStep, PagedKV, Segment
    from zeroedge.serve.cpu_q4 import Q4Step
    from zeroedge.weights import resolve_model

    torch.set_num_threads(a.threads)
    m, cfg, _ = resolve_model("smollm2-135m", need_weights=True)
    m = m.float().eval()
    q4 = Q4Step(m, a.threads, kernels=kernels)
    torch.set_num_threads(1)
    batches = [int(b) for b in a.batches.split(",")]
    contexts = [int(c) for c in a.contexts.split(",")]
    pool = PagedKV(cfg, max(batches) * (max(contexts) // 16 + 4), 16, "cpu", torch.float32, heads_first=True)
    step = BatchStep(m, pool, q4)
    rows, checks = [], []
    for ctx in contexts:
        for B in batches:
            seqs = []
            for b in range(B):
                pages = pool.alloc(ctx // 16 + 4)
                step.forward([Segment(pages, [(b + i) % 1000 for i in range(ctx)], 0)])
                seqs.append([pages, ctx])
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                step.forward([Segment(p, [5], n) for p, n in seqs])
                times.append(time.perf_counter() - t0)
                for s in seqs:
                    s[1] += 1
            ms = 1000 * statistics.median(times[4:])
            rows.append({"context": ctx, "batch": B, "step_ms": ms, "tokens_per_s": B * 1000 / ms})
            if B == 1:                        # checks of R rows against the plain step, alternated
                pages, n = seqs[0]
                cost = {R: [] for R in [int(r) for r in a.verify_rows.split(",")]}
                for _ in range(12):
                    for R in cost:
                        t0 = time.perf_counter()
                        step.forward([Segment(pages, [5] * R, n, verify=R > 1)])
                        cost[R].append(time.perf_counter() - t0)
                plain = statistics.median(cost[min(cost)][2:])
                for R, ts in cost.items():
                    checks.append({"context": ctx, "rows": R, "step_ms": 1000 * statistics.median(ts[2:]),
                                   "x_plain_step": statistics.median(ts[2:]) / plain})
            for pages, _ in seqs:
                pool.release(pages)
    return {"rows": rows, "checks": checks}


if __name__ == "__main__":
    main()
