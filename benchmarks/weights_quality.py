"""benchmarks/weights.md: perplexity of SmolLM2-135M with weight-only quantization (zeroedge.quant,
onnxruntime MatMulNBits numerics), RTN and AWQ, on KJV / essays / licenses (4096 tokens at offset 0,
the last 1024 scored: `zeroedge eval`'s protocol); weight bytes per scheme; how far each scheme's
dequantized weights are from the model's own (a Q4_1 GGUF, dequantized).

    python benchmarks/weights_quality.py -o benchmarks/results/weights/smollm2_ppl_by_scheme_cpu.json [--threads 2]
    python benchmarks/weights_quality.py -o benchmarks/results/weights/smollm2_ppl_by_scheme_cpu.json --append \
        --rows 'int4 g32 asym float-zp RTN, embedding int8' ...       (more rows into the same JSON:
        fp32 re-measured in the run and checked against the file's)

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
    # a float zero point (Q4_1's form, zeroedge.quant.groupwise.quantize_float): (..., "float")
    (4, 32, False, "rtn", 128, "float"), (4, 32, False, "rtn", None, "float"), (4, 128, False, "rtn", 128, "float"),
    # the embedding (= tied LM head) int4 (`calibrate --embedding int4`): (..., zp, 4)
    (4, 32, False, "rtn", 128, "float", 4), (4, 128, True, "rtn", 128, "int", 4),
]


def grid_match(model, scheme):
    """Over every linear weight: fraction of values the scheme reproduces exactly (with the numerics
    onnxruntime's MatMulNBits computes), and the RMS error relative to the weights' RMS. A float zero
    point also: the fraction that d * q + m (the same q, d, m dequantized as Q4_1 / llama.cpp do)
    reproduces, and the fraction of blocks whose zero point z has fl(d * z) = -m exactly."""
    from zeroedge.quant.groupwise import quantize_float

    same = total = q41 = zblocks = blocks = 0
    err = ref = 0.0
    for b in model.layers:
        for name in qa.LINEARS:
            w = b.get_submodule(name).weight.data
            d = qa.fake_quantize(w, scheme)
            same += int((d == w).sum())
            total += w.numel()
            err += float(((d - w) ** 2).sum())
            ref += float((w ** 2).sum())
            if scheme.zero_point == "float":
                q, s, z, m = quantize_float(w, scheme)
                v = (q.float() * s[..., None] + m[..., None]).reshape(w.shape[0], -1)[:, :w.shape[1]]
                q41 += int((v == w).sum())
                zblocks += int((s * z == -m).sum())
                blocks += s.numel()
    out = {"exact_fraction": same / total, "rel_rms_error": (err / ref) ** 0.5}
    if blocks:
        out.update(exact_fraction_q41_formula=q41 / total, exact_zero_point_blocks=zblocks / blocks)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output", default="benchmarks/results/weights/smollm2_ppl_by_scheme_cpu.json")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--awq-grid", type=int, default=10)
    ap.add_argument("--awq-seqs", type=int, default=4)
    ap.add_argument("--awq-sample", type=int, default=512)
    ap.add_argument("--rows", nargs="*", default=None, metavar="SCHEME",
                    help="only these rows (their 'scheme' strings, as the JSON names them)")
    ap.add_argument("--append", action="store_true", help="add the rows to the existing JSON's")
    a = ap.parse_args()
    prior = None
    if a.append:
        try:
            with open(a.output) as f:
                prior = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"--append: cannot read {a.output} ({e})")
    schemes = [(*s, *(("int", 8) if len(s) == 5 else (8,) if len(s) == 6 else ())) for s in SCHEMES]

    def name(bits, group, sym, method, eg, zp, eb):
        e = qa.embedding_group(576) if eg else None
        return calib_artifact.weights_section(calib_artifact.weights_meta(bits, group, sym, method, e, eb,
                                                                          zero_point=zp)).describe()

    if a.rows is not None:
        known = {name(*s): s for s in schemes}
        bad = [r for r in a.rows if r not in known]
        if bad:
            raise SystemExit(f"unknown row(s) {bad}; known: {sorted(known)}")
        schemes = [known[r] for r in a.rows]
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
    if prior is not None:
        out = prior
        out.setdefault("appended_runs", []).append({"threads": torch.get_num_threads(), "rows": []})

    def save():
        with open(a.output, "w") as f:
            json.dump(out, f, indent=1)

    def ppls():
        return {t: continuation_ppl(m, ids[t], 1024)["ppl"] for t in TEXTS}

    t0 = time.perf_counter()
    fp = ppls()
    if prior is None:
        out["rows"].append({"scheme": "fp32", "ppl": fp, "bytes": qa.weight_bytes(m.cfg, None, 4),
                            "bytes_fp16": qa.weight_bytes(m.cfg, None, 2), "seconds": time.perf_counter() - t0})
    else:
        was = next(r["ppl"] for r in out["rows"] if r["scheme"] == "fp32")
        out["appended_runs"][-1]["fp32_ppl"] = fp
        out["appended_runs"][-1]["fp32_max_rel_diff_to_first_run"] = max(abs(fp[t] / was[t] - 1) for t in TEXTS)
    save()
    print("fp32", fp, flush=True)
    for bits, group, sym, method, eg, zp, eb in schemes:
        t0 = time.perf_counter()
        m.load_state_dict(state)
        if hasattr(m, qa.MARK):
            delattr(m, qa.MARK)
        eg = qa.embedding_group(m.cfg.dim) if eg else None
        sec = calib_artifact.weights_section(calib_artifact.weights_meta(bits, group, sym, method, eg, eb,
                                                                         zero_point=zp))
        row = {"scheme": sec.describe(), "bits": bits, "group": group, "symmetric": sym, "method": method,
               "zero_point": zp, "embedding": f"int{eb} g{eg}" if eg else "fp",
               **grid_match(m, Scheme(bits, group, sym, zp))}
        scales = None
        if method == "awq":
            scales, alphas, rep = search(m, calib, Scheme(bits, group, sym, zp),
                                         AwqConfig(grid=a.awq_grid, seqs=a.awq_seqs, sample=a.awq_sample,
                                                   log=lambda s: None))
            row["awq"] = {"alphas": alphas, **rep}
        qa.apply(m, sec, scales)
        p = ppls()
        row.update(ppl=p, rise={t: p[t] / fp[t] - 1 for t in TEXTS}, bytes=qa.weight_bytes(m.cfg, sec),
                   seconds=time.perf_counter() - t0)
        out["rows"].append(row)
        if prior is not None:
            out["appended_runs"][-1]["rows"].append(row["scheme"])
        save()
        print(row["scheme"], {t: f"{v:+.2%}" for t, v in row["rise"].items()}, f"{row['seconds']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
