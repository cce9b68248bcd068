"""benchmarks/weights.md: what the int8-input GEMV (zeroedge.quant.triton_gemv, int8_inputs: dp4a)
costs SmolLM2-135M's perplexity beside the exact-input one, on the same packed weights. Each linear
layer's inputs (q/k/v, o, gate/up, down and the int8 LM head) are rounded as the kernel rounds them
(zeroedge.quant.packed.round_inputs_int8: runs of 8 inputs for 4-bit weights, of 4 for 8-bit, one
int8 scale a run) by forward pre-hooks, in the teacher-forced forward of `zeroedge eval`'s protocol
(4096 tokens at offset 0 of KJV / essays / licenses, the last 1024 scored).

    python benchmarks/weights_int8_inputs.py -o benchmarks/results/weights/smollm2_ppl_int8_inputs_cpu.json [--threads 2]
"""
import argparse
import copy
import json
import time

import torch

from zeroedge import calib_artifact, texts, weights
from zeroedge.evaluation import continuation_ppl
from zeroedge.quant import apply as qa
from zeroedge.quant.packed import round_inputs_int8

TEXTS = ("kjv", "essays", "licenses")
SCHEMES = [(4, 32, False, "float"), (4, 128, True, "int")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output", default="benchmarks/results/weights/smollm2_ppl_int8_inputs_cpu.json")
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    m, folder = weights.load("smollm2-135m")
    m.eval()
    tok = weights.tokenizer(folder)
    ids = {t: torch.tensor([texts.tokens(tok, texts.load_text(t), 4096)]) for t in TEXTS}
    state = copy.deepcopy(m.state_dict())

    def ppls():
        with torch.no_grad():
            return {t: continuation_ppl(m, ids[t], 1024)["ppl"] for t in TEXTS}

    out = {"model": "smollm2-135m", "ctx": 4096, "scored": 1024, "threads": torch.get_num_threads(), "rows": []}
    fp = ppls()
    out["rows"].append({"scheme": "fp32", "ppl": fp})
    print("fp32", fp, flush=True)
    for bits, group, sym, zp in SCHEMES:
        m.load_state_dict(state)
        if hasattr(m, qa.MARK):
            delattr(m, qa.MARK)
        sec = calib_artifact.weights_section(calib_artifact.weights_meta(bits, group, sym, "rtn",
                                                                         qa.embedding_group(m.cfg.dim), zero_point=zp))
        qa.apply(m, sec, pack=True)
        for inputs in ("exact", "int8"):
            t0 = time.perf_counter()
            hooks = []
            if inputs == "int8":
                lins = [b.get_submodule(n) for b in m.layers for n in qa.LINEARS] + [m.lm_head]
                hooks = [lin.register_forward_pre_hook(
                    lambda mod, args: (round_inputs_int8(args[0], mod.packed.bits).to(args[0].dtype),))
                    for lin in lins]
            try:
                p = ppls()
            finally:
                for h in hooks:
                    h.remove()
            row = {"scheme": sec.describe(), "inputs": inputs, "ppl": p, "rise": {t: p[t] / fp[t] - 1 for t in TEXTS},
                   "seconds": time.perf_counter() - t0}
            out["rows"].append(row)
            with open(a.output, "w") as f:
                json.dump(out, f, indent=1)
            print(row["scheme"], inputs, {t: f"{v:+.2%}" for t, v in row["rise"].items()}, flush=True)


if __name__ == "__main__":
    main()
