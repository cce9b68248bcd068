"""What the int8 cold store costs in quality: SmolLM2-135M on CPU, the serving decoders teacher-forced
over real text (prefix prefilled, the continuation scored one decode step at a time): dense KV, thermal
KV with the full-precision cold store (a discrete GPU's pinned host memory), thermal KV with the int8
cold store (what a Jetson's unified DRAM gets), at the same hot budget.

    python benchmarks/thermal_cold_int8.py --prefix 2048 --score 512 --budget 0.1 --json benchmarks/results/thermal_kv/quality_smollm2_cpu_cold_int8.json
"""
import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def score(dec, ids, P, n):
    import torch
    import torch.nn.functional as F

    nll = 0.0
    for t in range(P, P + n):
        logits = dec.step(ids[t], t).float()
        nll += float(F.cross_entropy(logits[None], torch.tensor([ids[t + 1]])))
    return math.exp(nll / n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--score", type=int, default=512)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--texts", default="kjv,essays,licenses")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    from zeroedge import texts, weights
    from zeroedge.kv.evaluate import prefill
    from zeroedge.runtime.fast import DenseDecoder, ThermalDecoder

    torch.set_num_threads(2)
    m, folder = weights.load("smollm2-135m")
    tok = weights.tokenizer(folder)
    rows = []
    for name in a.texts.split(","):
        ids = texts.tokens(tok, texts.load_text(name), a.prefix + a.score + 1, what=name)
        pre = prefill(m, ids[: a.prefix], stats=True)
        row = {"text": name, "prefix": a.prefix, "scored": a.score, "budget": a.budget}
        dense = DenseDecoder(m, a.prefix + a.score, graph=False)
        dense.load_prefix(pre["k"], pre["v"])
        row["dense_ppl"] = score(dense, ids, a.prefix, a.score)
        for cold in ("host", "int8"):
            d = ThermalDecoder(m, a.prefix, a.score, budget=a.budget, graph=False, cold=cold)
            d.load_prefix(pre["k"], pre["v"], pre["qcov"])
            row[f"thermal_{cold}_ppl"] = score(d, ids, a.prefix, a.score)
            kb = d.device_kv_bytes()
            # on a Jetson every byte is the same DRAM: hot + summaries + the cold store wherever it lives
            cold_bytes = kb["cold_on_device"] or kb["prefix_full"]
            row[f"thermal_{cold}_dram_frac"] = round((kb["hot"] + kb["summaries"] + cold_bytes) / kb["prefix_full"], 4)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("| text | dense ppl | thermal, full-precision cold | thermal, int8 cold | DRAM vs dense KV (full / int8 cold) |")
    print("|---|---|---|---|---|")
    for r in rows:
        d = r["dense_ppl"]
        print(f"| {r['text']} | {d:.3f} | {r['thermal_host_ppl']:.3f} ({r['thermal_host_ppl'] / d - 1:+.2%}) | "
              f"{r['thermal_int8_ppl']:.3f} ({r['thermal_int8_ppl'] / d - 1:+.2%}) | "
              f"{r['thermal_host_dram_frac']:.2f} / {r['thermal_int8_dram_frac']:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
