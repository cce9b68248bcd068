"""What `zeroedge run`'s check of a speculative draft costs on a CPU: Decoder.verify over R rows (a
token and R - 1 drafted ones) against one plain decode step, with the products as x @ W^T
(F.linear, MKL's row kernel) and as W @ x^T (TorchLinears(columns=True), what the decoder uses on a
CPU with MKL).

    python benchmarks/verify_cost_cpu.py -o benchmarks/results/speculative/verify_cost_smollm2_cpu.json

Real SmolLM2-135M-Instruct (the bundled Q4_1 GGUF dequantized to fp32), zeroedge.runtime.fast.
DenseDecoder over a 1024-position cache at position `--pos`; the two products and every row count
interleaved in each of `--rounds` rounds, each figure the mean of two calls after a warm one; the
ratio is the median over rounds of verify / plain step of the same round.
"""
import argparse
import json
import os
import platform
import statistics
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="2,3,4,5,6,8,9,12,16")
    ap.add_argument("--pos", type=int, default=800)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-o", "--out")
    a = ap.parse_args()

    import torch

    from zeroedge.runtime.fast import DenseDecoder, TorchLinears
    from zeroedge.weights import resolve_model

    load_at_start = os.getloadavg()
    torch.set_num_threads(a.threads)
    m, _, _ = resolve_model("smollm2-135m", need_weights=True)
    m = m.float().eval()
    dec = DenseDecoder(m, 1024)
    rows = [int(r) for r in a.rows.split(",")]
    tokens = list(range(5, 5 + max(rows)))
    kinds = {"rows (x @ W^T)": TorchLinears(m, columns=False), "columns (W @ x^T)": TorchLinears(m, columns=True)}
    ms = {(k, r): [] for k in kinds for r in [1] + rows}

    def timed(fn) -> float:
        fn()
        t = time.perf_counter()
        fn()
        fn()
        return (time.perf_counter() - t) / 2 * 1e3

    for _ in range(a.rounds):
        for k, lin in kinds.items():
            dec.verify_linears = lin
            ms[k, 1].append(timed(lambda: dec.step(5, a.pos)))
            for r in rows:
                ms[k, r].append(timed(lambda r=r: dec.verify(tokens[:r], a.pos)))
    out = {k: {"plain_step_ms": statistics.median(ms[k, 1]),
               "verify_steps": {r: statistics.median(v / p for v, p in zip(ms[k, r], ms[k, 1])) for r in rows}}
           for k in kinds}
    print(json.dumps(out, indent=1))
    res = {"what": "zeroedge run's check of a draft of R - 1 tokens (R rows), in plain decode steps",
           "hardware": f"CPU ({platform.processor() or platform.machine()}), {a.threads} threads",
           "load_at_start": load_at_start, "load_at_end": os.getloadavg(), "model": "SmolLM2-135M-Instruct (bundled Q4_1 GGUF), fp32, real weights",
           "mkl": torch.backends.mkl.is_available(), "torch": torch.__version__, "args": vars(a), "products": out}
    if a.out:
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
