"""Export benchmark (SmolLM2-135M, CPU): export time and bundle size; onnxruntime prefill and decode
speed, dense vs zero bundle, against transformers' generate() on the same prompt, in one run.

    python benchmarks/export_bench.py --prompt 256 --new 32 [--foreign /path/smol_dynamo.onnx]

The zero bundle uses a calibration artifact with random SIH heads (no real `zeroedge calibrate`
artifact existed when this was written): its speed is real, its quality is meaningless.
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--foreign", default=None, help="a dynamo export of transformers' SmolLM2 graph")
    ap.add_argument("--out", default=None, help="write results JSON here")
    a = ap.parse_args()

    import numpy as np
    import torch
    from transformers import LlamaForCausalLM

    from artifacts import sih_artifact
    from zeroedge import texts, weights
    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.export.bundle_writer import export_bundle

    torch.set_num_threads(2)
    res = {"prompt": a.prompt, "new": a.new}
    m, folder = weights.load("smollm2-135m")
    tok = weights.tokenizer(folder)
    ids = texts.tokens(tok, texts.load_text("kjv"), a.prompt)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)[: a.prompt]
    work = Path(tempfile.mkdtemp(prefix="zeroedge-bench-"))
    sih_artifact(work / "calib", "smollm2-135m", thr={i: a.threshold for i in range(30)})
    for name, calib in (("dense", None), ("zero", work / "calib")):
        t0 = time.perf_counter()
        mf = export_bundle("smollm2-135m", work / name, calib=calib, window=a.prompt + a.new + 8)
        res[f"export_{name}_s"] = time.perf_counter() - t0
        res[f"bundle_{name}_mb"] = sum(f["bytes"] for f in mf["files"].values()) / 1e6
    # onnxruntime: dense vs zero, same prompt, greedy
    for name in ("dense", "zero"):
        r = OrtRunner(work / name, slots=a.prompt + a.new + 8, threads=2)
        r.generate(ids[:40], 2)                                       # warm-up
        r.timings = {k: 0 for k in r.timings}
        out = r.generate(ids, a.new)
        t = r.timings
        res[f"ort_{name}_prefill_tok_s"] = t["prefill_tokens"] / t["prefill_s"]
        res[f"ort_{name}_decode_tok_s"] = t["decode_tokens"] / t["decode_s"]
        res[f"ort_{name}_tokens"] = out
    # transformers generate(), same prompt, greedy, same threads
    hf = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    x = torch.tensor(ids)[None]
    with torch.no_grad():
        hf.generate(x[:, :40], max_new_tokens=2, do_sample=False)     # warm-up
        t0 = time.perf_counter()
        hf.generate(x, max_new_tokens=1, do_sample=False, min_new_tokens=1)
        t1 = time.perf_counter()
        g = hf.generate(x, max_new_tokens=a.new + 1, do_sample=False, min_new_tokens=a.new + 1)
        t2 = time.perf_counter()
    res["hf_prefill_tok_s"] = a.prompt / (t1 - t0)
    res["hf_decode_tok_s"] = a.new / ((t2 - t1) - (t1 - t0))
    res["hf_tokens"] = g[0, a.prompt:a.prompt + a.new].tolist()
    res["dense_matches_hf_tokens"] = res["ort_dense_tokens"] == res["hf_tokens"]
    if a.foreign:
        import onnx
        import onnx_graphsurgeon as gs

        from zeroedge.export.rewrite import find_layers, summary

        ms, rep = find_layers(gs.import_onnx(onnx.load(a.foreign)))
        res["foreign_smollm2_layers_found"] = len(ms)
        res["foreign_summary"] = summary(rep)
    print(json.dumps({k: v for k, v in res.items() if not k.endswith("_tokens")}, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
