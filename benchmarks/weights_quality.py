"""benchmarks/weights.md: perplexity of SmolLM2-135M with weight-only quantization (zeroedge.quant,
onnxruntime MatMulNBits numerics), RTN and AWQ, on KJV / essays / licenses (4096 tokens at offset 0,
the last 1024 scored: `zeroedge eval`'s protocol); weight bytes per scheme; how far each scheme's
dequantized weights are from the model's own (a Q4_1 GGUF, dequantized).

    python benchmarks/weights_quality.py -o benchmarks/weights_quality.json [--threads 2]

AWQ calibrates on kjv + essays (`zeroedge calibrate`'s defaults: 24000 tokens a text, sequences from
the end of the first 70 %, never the evaluated opening passages); licenses is never calibrated on.
Writes the JSON after every row (a partial run keeps what it measured).
"""
import argparse
import copy
import json
import time

import torch

from zeroedge import calib_artifact, texts, weights
from zeroedge.evaluation import continuation_ppl
from zeroedge.export.awq import AwqConfig, search
from zeroedge.quant import apply as qa
from zeroedge.quant.groupwise import Scheme

TEXTS = ("kjv", "essays", "licenses")
SCHEMES = [  # (bits, group, symmetric, method, embedding int8 (its group: quant.apply.embedding_group) or
            # None = kept); the most telling first
    (4, 32, False, "rtn", 128), (4, 128, True, "rtn", 128), (4, 128, True, "awq", 128),
    (4, 128, False, "rtn", 128), (4, 128, False, "awq", 128), (4, 32, True, "rtn", 128),
    (4, 32, True, "awq", 128), (8, 128, False, "rtn", 128), (4, 32, False, "awq", 128),
    (4, 32, False, "rtn", None), (8, 128, True, "rtn", 128), (8, 32, False, "rtn", 128),
]


def grid_match(model, scheme):
    """Over every linear weight: fraction of values the scheme reproduces exactly, and the RMS error
    relative to the weights' RMS."""
    same = total = 0
    err = ref = 0.0
    for b in model.layers:
        for name in qa.LINEARS:
            w = b.get_submodule(name).weight.data
            d = qa.fake_quantize(w, scheme)
            same += int((d == w).sum())
            total += w.numel()
            err += float(((d - w) ** 2).sum())
            ref += float((w ** 2).sum())
    return {"exact_fraction": same / total, "rel_rms_error": (err / ref) ** 0.5}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--awq-grid", type=int, default=10)
    ap.add_argument("--awq-seqs", type=int, default=4)
    ap.add_argument("--awq-sample", type=int, default=512)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    m, folder = weights.load("smollm2-135m")
    tok = weights.tokenizer(folder)
    ids = {t: torch.tensor([texts.tokens(tok, texts.load_text(t), a.ctx)]) for t in TEXTS}
    calib = [tok.encode(texts.load_text(t)[: 8 * 24000], add_special_tokens=False)[:24000] for t in ("kjv", "essays")]
    state = copy.deepcopy(m.state_dict())
    out = {"model": "smollm2-135m", "ctx": a.ctx, "scored": 1024, "threads": torch.get_num_threads(),
           "awq": {"grid": a.awq_grid, "seqs": a.awq_seqs, "seq_len": 512, "sample": a.awq_sample,
                   "texts": ["kjv", "essays"]}, "rows": []}

    def save():
        with open(a.output, "w") as f:
            json.dump(out, f, indent=1)

    def ppls():
        return {t: continuation_ppl(m, ids[t], 1024)["ppl"] for t in TEXTS}

    t0 = time.perf_counter()
    fp = ppls()
    out["rows"].append({"scheme": "fp32", "ppl": fp, "bytes": qa.weight_bytes(m.cfg, None, 4),
                        "bytes_fp16": qa.weight_bytes(m.cfg, None, 2), "seconds": time.perf_counter() - t0})
    save()
    print("fp32", fp, flush=True)
    for bits, group, sym, method, eg in SCHEMES:
        t0 = time.perf_counter()
        m.load_state_dict(state)
        if hasattr(m, qa.MARK):
            delattr(m, qa.MARK)
        eg = qa.embedding_group(m.cfg.dim) if eg else None
        sec = calib_artifact.weights_section(calib_artifact.weights_meta(bits, group, sym, method, eg))
        row = {"scheme": sec.describe(), "bits": bits, "group": group, "symmetric": sym, "method": method,
               "embedding": f"int8 g{eg}" if eg else "fp", **grid_match(m, Scheme(bits, group, sym))}
        scales = None
        if method == "awq":
            scales, alphas, rep = search(m, calib, Scheme(bits, group, sym),
                                         AwqConfig(grid=a.awq_grid, seqs=a.awq_seqs, sample=a.awq_sample,
                                                   log=lambda s: None))
            row["awq"] = {"alphas": alphas, **rep}
        qa.apply(m, sec, scales)
        p = ppls()
        row.update(ppl=p, rise={t: p[t] / fp[t] - 1 for t in TEXTS}, bytes=qa.weight_bytes(m.cfg, sec),
                   seconds=time.perf_counter() - t0)
        out["rows"].append(row)
        save()
        print(row["scheme"], {t: f"{v:+.2%}" for t, v in row["rise"].items()}, f"{row['seconds']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
