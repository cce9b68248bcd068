"""The onnxruntime decode step with its inputs and outputs bound once (OrtRunner's IOBinding) against
the same session fed a dict every step, interleaved in one process: SmolLM2's int4 bundle, KJV
prompt, 8 reps x 20 greedy steps each, 2 threads; also checks both decode the same tokens.

    zeroedge export smollm2-135m --weights int4 --zero-point float --accuracy-level 4 --graphs portable -o /tmp/cpu/new
    python benchmarks/ort_binding_ab.py --bundle /tmp/cpu/new --runs 3 -o benchmarks/results/weights/cpu_ort_iobinding_ab.json
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weights_cpu import kjv_tokens  # noqa: E402


class FeedOnly:
    """The same session without io_binding: OrtRunner.step takes its feed-dict path."""

    def __init__(self, session):
        self.session = session

    def run(self, *a):
        return self.session.run(*a)

    def get_inputs(self):
        return self.session.get_inputs()


def one(bundle, T, reps=8, steps=20):
    import numpy as np

    from zeroedge.backends.onnxruntime import OrtRunner

    toks = kjv_tokens(T)
    runners = {"bound": OrtRunner(bundle, slots=T + reps * steps + 8, threads=2),
               "feed": OrtRunner(bundle, slots=T + reps * steps + 8, threads=2)}
    runners["feed"].dec = FeedOnly(runners["feed"].dec)
    logits = {k: r.prefill(np.asarray(toks)) for k, r in runners.items()}
    ms, ids = {k: [] for k in runners}, {k: [] for k in runners}
    for _ in range(reps):
        for k, r in runners.items():
            lg = logits[k]
            t0 = time.perf_counter()
            for _ in range(steps):
                ids[k].append(int(np.argmax(lg)))
                lg = r.step(ids[k][-1])
            ms[k].append((time.perf_counter() - t0) / steps * 1e3)
            logits[k] = lg
    return {"T": T, **{f"{k}_ms": round(statistics.median(v), 3) for k, v in ms.items()},
            "same_tokens": ids["bound"] == ids["feed"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-o", "--output", type=Path, default=Path("benchmarks/results/weights/cpu_ort_iobinding_ab.json"))
    a = ap.parse_args()
    rows = []
    for run in range(a.runs):
        for T in a.lengths:
            rows.append({"run": run, **one(a.bundle, T)})
            r = rows[-1]
            print(json.dumps({**r, "bound_vs_feed": round(r["bound_ms"] / r["feed_ms"], 3)}), flush=True)
    if a.output:
        a.output.write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
