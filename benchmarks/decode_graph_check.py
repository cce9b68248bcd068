"""Two bundles of the same weights, two decode graphs: is the new graph the same model? (SmolLM2-135M,
onnxruntime CPU.) Per text (KJV, essays): tokens [0, 512) prefilled, the next 256 scored one decode
step at a time (benchmarks/bundle_weights.nll_run: the decode graph the device runs), the mean NLL,
the greedy agreement of the two bundles, and the largest logit difference over the steps relative
to the largest logit.

To compare two graphs of the same weights, export both at accuracy level 0 (exact fp32
activations: at level 4 each MatMulNBits rounds its inputs to int8, and any change upstream flips
some of those roundings, which hides the graph's own error). Against the fp32 bundle (the cost of
the 4-bit bundle's decode path, benchmarks/weights_cpu.md):

    zeroedge export smollm2-135m --weights fp32 --graphs portable -o /tmp/f32
    zeroedge export smollm2-135m --weights int4 --zero-point float --graphs portable --cpu-kernels zeroedge -o /tmp/zk
    python3 benchmarks/decode_graph_check.py /tmp/f32 /tmp/zk --score 1024 \\
        -o benchmarks/results/weights/cpu_int4_bundle_ppl_vs_fp32_bundle.json
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def logits_run(bundle, ids, prompt, steps):
    import numpy as np

    from zeroedge.backends.onnxruntime import OrtRunner

    with OrtRunner(bundle, slots=prompt + steps + 1, threads=2) as r:
        out = [r.prefill(np.array(ids[:prompt]))]
        for t in range(prompt, prompt + steps):
            out.append(r.step(ids[t]))
    return np.stack(out)


def main():
    import numpy as np

    from bundle_weights import nll_run
    from zeroedge import texts, weights

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference")
    ap.add_argument("candidate")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--score", type=int, default=256)
    ap.add_argument("-o", "--output", type=Path, default=None)
    a = ap.parse_args()
    tok = weights.tokenizer(weights.resolve("smollm2-135m"))
    res = {"reference": a.reference, "candidate": a.candidate, "prompt": a.prompt, "score": a.score, "texts": {}}
    for name, text in (("kjv", texts.kjv()), ("essays", texts.essays())):
        ids = [int(t) for t in texts.tokens(tok, text, a.prompt + a.score, what=name)]
        (n0, g0), (n1, g1) = (nll_run(b, ids, a.prompt, a.score) for b in (a.reference, a.candidate))
        l0, l1 = (logits_run(b, ids, a.prompt, 48) for b in (a.reference, a.candidate))
        rel = np.abs(l1 - l0).max(-1) / np.abs(l0).max(-1)
        res["texts"][name] = {"nll_reference": n0, "nll_candidate": n1, "ppl_change_pct": 100 * (np.exp(n1 - n0) - 1),
                              "greedy_agree": sum(x == y for x, y in zip(g0, g1)), "of": len(g0),
                              "max_rel_logit_diff_prefill": float(rel[0]), "max_rel_logit_diff_decode": float(rel[1:].max())}
        print(name, json.dumps(res["texts"][name]), flush=True)
    if a.output:
        a.output.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
