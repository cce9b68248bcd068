"""The bundle runners' thermal policy (zeroedge.kv.ort_policy.OrtThermalPolicy: what `zeroedge run
--backend onnxruntime|tensorrt --kv-budget F` serves a bundle with, e.g. on a Jetson) under the eval
contract's protocol, through `zeroedge.kv.evaluate.run_bundle_eval` (= `zeroedge eval MODEL --bundle B
--kv-budget F`): SmolLM2's fp32 portable bundle in onnxruntime, prefill N - 1024 tokens, the last
1024 teacher-forced, against the same runner with every position in its window.

    zeroedge export smollm2-135m -o B --weights fp32 --graphs portable
    python benchmarks/thermal_bundle_policy.py --bundle B --ctx 4096 --json benchmarks/results/thermal_kv/quality_smollm2_cpu_4096_bundle_policy_ort.json

(The JSON's "F x (prompt + new), before" rows were measured with this script at commit b38b11a, when a
bundle request's window was F of prompt + new tokens.)
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
CONTINUATION = 1024


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
    from zeroedge.kv.evaluate import run_bundle_eval

    _, folder = weights.load("smollm2-135m")
    tok = weights.tokenizer(folder)
    rows = []
    for text in a.texts.split(","):
        ids = texts.tokens(tok, texts.load_text(text), a.ctx, what=text)
        r = run_bundle_eval(OrtRunner(a.bundle, threads=a.threads), ids, a.budget, CONTINUATION)
        rows.append({"text": text, "ctx": a.ctx, "window": "F x prompt + new", "slots": r["window_slots"], **r})
        print(json.dumps({k: rows[-1][k] for k in ("text", "slots", "full_kv_ppl", "thermal_ppl", "ppl_rise")}),
              flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
