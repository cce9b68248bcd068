"""fp16 against fp32 weights in a bundle (SmolLM2-135M, dense export, onnxruntime CPU): bundle bytes,
export time, perplexity of a teacher-forced continuation of real text, greedy agreement.

    python benchmarks/bundle_weights.py --prompt 512 --score 256 --json benchmarks/results/weights/cpu_bundle_fp16_vs_fp32_ppl.json

Both bundles come from the same model in the same run; the text is KJV (Debian bible-kjv) and the
essays corpus, tokens [0, prompt) prefilled and the next `score` tokens scored one decode step at a
time (the decode graph the device runs).
"""
import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def nll_run(bundle, ids, prompt, score):
    import numpy as np

    from zeroedge.backends.onnxruntime import OrtRunner

    with OrtRunner(bundle, slots=prompt + score + 1, threads=2) as r:
        logits = r.prefill(np.array(ids[:prompt]))
        nll, argmax = 0.0, []
        for t in range(prompt, prompt + score):
            z = logits.astype(np.float64)
            z = z - z.max()
            nll -= z[ids[t]] - math.log(np.exp(z).sum())
            argmax.append(int(logits.argmax()))
            logits = r.step(ids[t])
    return nll / score, argmax


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--score", type=int, default=256)
    ap.add_argument("--json", default="benchmarks/results/weights/cpu_bundle_fp16_vs_fp32_ppl.json")
    a = ap.parse_args()
    from zeroedge import bundle as bundle_mod
    from zeroedge import texts, weights
    from zeroedge.export.bundle_writer import export_bundle

    folder = weights.resolve("smollm2-135m")
    tok = weights.tokenizer(folder)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        bundles = {}
        for w in ("float32", "float16"):
            t = time.perf_counter()
            export_bundle(str(folder), Path(d) / w, window=a.prompt + a.score + 1, weights=w)
            mf = bundle_mod.verify(Path(d) / w)
            bundles[w] = (Path(d) / w, time.perf_counter() - t, mf)
        for name in ("kjv", "essays"):
            ids = tok.encode(texts.load_text(name), add_special_tokens=False)[: a.prompt + a.score]
            res = {w: nll_run(b, ids, a.prompt, a.score) for w, (b, _, _) in bundles.items()}
            agree = sum(x == y for x, y in zip(res["float32"][1], res["float16"][1])) / a.score
            for w, (b, secs, mf) in bundles.items():
                rows.append({"text": name, "weights": w, "weights_bin_bytes": mf["files"]["weights.bin"]["bytes"],
                             "bundle_bytes": sum(f["bytes"] for f in mf["files"].values()),
                             "export_s": round(secs, 1), "ppl": round(math.exp(res[w][0]), 4),
                             "argmax_agreement_vs_fp32": round(agree, 4)})
    print("| text | weights | weights.bin MB | bundle MB | ppl | greedy agreement with fp32 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['text']} | {r['weights']} | {r['weights_bin_bytes'] / 1e6:.1f} | {r['bundle_bytes'] / 1e6:.1f} | "
              f"{r['ppl']:.4f} | {r['argmax_agreement_vs_fp32']:.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"prompt": a.prompt, "score": a.score, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
