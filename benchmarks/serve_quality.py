"""What `zeroedge serve`'s CPU weights cost in perplexity: the batched engine step itself, teacher-forced
over real text, with the model's fp32 weights (`--weights model`) and with 4-bit linears in
onnxruntime (`--weights q4`, the default on a CPU; `q4` on zeroedge's onnxruntime kernels, `q4_stock`
on onnxruntime's own operators), on the bundled SmolLM2 (a Q4_1 GGUF: its fp32
weights are that grid dequantized, so the two differ by the int8-rounded inputs and the 8-bit head).

    python benchmarks/serve_quality.py --texts kjv,licenses --windows 8 --tokens 512 \
        -o benchmarks/results/serve/quality_smollm2_cpu_weights.json

Each text gives `--windows` windows of `--tokens` tokens, decoded together as one batch (one token of
each a step), so the figure is also what a batch of sequences sees.
"""
import argparse
import json
import math
import sys

import torch


def nll(step, pool, windows):
    from zeroedge.serve.batch import Segment

    pages = [pool.alloc(pool.pages_for(len(w))) for w in windows]
    total, n = 0.0, 0
    for pos in range(len(windows[0]) - 1):
        logits = step.forward([Segment(p, [w[pos]], pos) for p, w in zip(pages, windows)])
        lp = torch.log_softmax(logits.double(), -1)
        for j, w in enumerate(windows):
            total -= float(lp[j, w[pos + 1]])
            n += 1
    for p in pages:
        pool.release(p)
    return total / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", default="kjv,licenses")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    from zeroedge import texts, weights
    from zeroedge.serve.batch import BatchStep, PagedKV
    from zeroedge.serve.cpu_q4 import Q4Step

    torch.set_num_threads(args.threads)
    m, folder = weights.load("smollm2-135m")
    tok = weights.tokenizer(folder)
    steps = {"q4": Q4Step(m, args.threads, kernels="zeroedge"), "q4_stock": Q4Step(m, args.threads, kernels="stock")}
    pools = {heads_first: PagedKV(m.cfg, args.windows * (args.tokens // 16 + 2), 16, "cpu", torch.float32,
                                  heads_first=heads_first) for heads_first in (False, True)}
    rows = []
    for name in args.texts.split(","):
        ids = texts.tokens(tok, texts.load_text(name, texts.chars_for(args.windows * args.tokens)),
                           args.windows * args.tokens, what=name)
        ids = [int(t) for t in ids]
        windows = [ids[i * args.tokens:(i + 1) * args.tokens] for i in range(args.windows)]
        r = {"text": name}
        for label, lin in (("model_fp32", None), *steps.items()):
            torch.set_num_threads(args.threads if lin is None else 1)
            pool = pools[lin is not None]
            r[label + "_ppl"] = math.exp(nll(BatchStep(m, pool, lin), pool, windows))
        r["q4_rise"] = r["q4_ppl"] / r["model_fp32_ppl"] - 1
        r["q4_stock_rise"] = r["q4_stock_ppl"] / r["model_fp32_ppl"] - 1
        rows.append(r)
        print(json.dumps(r), flush=True)
    out = {"what": "perplexity of the serving engine's batched step, teacher-forced", "model": "smollm2-135m",
           "command": "python benchmarks/serve_quality.py " + " ".join(sys.argv[1:]),
           "windows": args.windows, "tokens": args.tokens, "rows": rows}
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
