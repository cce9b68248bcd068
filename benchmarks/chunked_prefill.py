"""Peak memory and speed of the onnxruntime prefill, one pass against chunks, on the host CPU.

    python benchmarks/chunked_prefill.py -o benchmarks/results/prefill/chunked_prefill_ort_cpu.json
    python benchmarks/chunked_prefill.py --model smollm2-135m --calib zeroedge/data/smollm2-135m.calib \
        --contexts 2048,4096,8192 --one-pass-max 4096 \
        -o benchmarks/results/prefill/chunked_prefill_sih_smollm2_ort_cpu.json

With --calib the bundle carries SIH/PAD (ZeroEdgeSIHChunk nodes) and each chunked row also gives the
largest |logit| difference from the one-pass row of its context (the same skip decisions give one
pass's logits within float rounding). --one-pass-max: the longest context run in one pass.

A random-weight bundle (8 layers, d512, 8 heads / 4 KV heads, FFN 1408, vocab 8192: small enough
that one pass fits at 4K) is exported once; each (context, chunk) runs in a fresh process:
OrtRunner(chunk=...).prefill twice on the same prompt, the peak RSS over the process's RSS before
the runner (VmHWM - VmRSS, so the weights of both sessions are in it) after the first prefill and
after the second, the faster prefill's tokens/s, and the planner's forecast (`zeroedge plan
--onnxruntime-process --dtype fp32`, one prefill) beside it.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
import numpy as np
def rss(k):
    for l in open("/proc/self/status"):
        if l.startswith(k): return int(l.split()[1]) * 1024
import onnxruntime
from zeroedge.backends.onnxruntime import OrtRunner
b, T, C = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
base = rss("VmRSS:")
r = OrtRunner(b, slots=256, chunk=C)
ids = np.random.default_rng(0).integers(3, 8000, T)
secs, peaks = [], []
for _ in range(2):
    t = time.perf_counter(); logits = r.prefill(ids); secs.append(time.perf_counter() - t)
    peaks.append(rss("VmHWM:") - base)
np.save(sys.argv[4], logits)
print(json.dumps({"context": T, "chunk": C if C < T else None, "mode": r.prefill_mode if C < T else "one pass",
                  "peak_rss_bytes": peaks[0], "peak_rss_bytes_after_second": peaks[1],
                  "prefill_s": min(secs), "tok_s": T / min(secs)}))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output", default="benchmarks/results/prefill/chunked_prefill_ort_cpu.json")
    ap.add_argument("--contexts", default="1024,2048,4096")
    ap.add_argument("--chunks", default="256,512,1024")
    ap.add_argument("--model", help="a bundled model name (default: the random-weight shape below)")
    ap.add_argument("--calib", help="a calibration artifact: SIH/PAD in the bundle")
    ap.add_argument("--one-pass-max", type=int, default=1 << 30, help="longest context run in one pass")
    ap.add_argument("--keep-bundle", help="export the bundle here and keep it")
    a = ap.parse_args()
    import numpy as np

    from zeroedge.export.bundle_writer import export_bundle, resolve_model
    from zeroedge.model import ModelConfig, build

    if a.model:
        m = resolve_model(a.model)[0]
        cfg = m.cfg
    else:
        cfg = ModelConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1408,
                          max_seq_len=8192, name="chunk-bench")
        m = build(cfg, seed=0)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        b = Path(a.keep_bundle or Path(d) / "b")
        export_bundle(m, b, window=256, calib=a.calib)
        del m
        for T in map(int, a.contexts.split(",")):
            one = None
            for C in [T] * (T <= a.one_pass_max) + [int(c) for c in a.chunks.split(",") if int(c) < T]:
                lf = Path(d) / f"logits_{T}_{C}.npy"
                out = subprocess.run([sys.executable, "-c", CHILD, str(b), str(T), str(C), str(lf)],
                                     capture_output=True, text=True, check=True)
                row = json.loads(out.stdout.splitlines()[-1])
                if C == T:
                    one = np.load(lf)
                elif one is not None:
                    row["max_abs_logit_diff_vs_one_pass"] = float(np.abs(np.load(lf) - one).max())
                plan = subprocess.run([sys.executable, "-m", "zeroedge.cli", "plan", str(b), "--board", "orin-nano-8gb",
                                       "--ctx", str(T), "--dtype", "fp32", "--onnxruntime-process",
                                       "--prefill-chunk", str(C), "--json"], capture_output=True, text=True)
                row["planned_bytes"] = json.loads(plan.stdout)["memory"]["model_total"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    doc = {"model": cfg.to_dict(), "weights": "real (" + a.model + ")" if a.model else "random",
           "calibration": a.calib, "cpu_threads": __import__("os").cpu_count(), "rows": rows,
           "command": "python " + " ".join(sys.argv)}
    Path(a.output).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
