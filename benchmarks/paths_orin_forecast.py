"""Orin forecast of the decode-path saving from the planner's roofline, checked against
the H200 where it was measured.

    python benchmarks/paths_orin_forecast.py > benchmarks/results/paths/orin_forecast.md

Inputs: the model shapes (zeroedge.model.PRESETS), the fraction of FFN weight bytes a decode step
skips, and the bandwidth the sparse FFN kernels reach relative to cuBLAS's dense GEMV, both from
benchmarks/results/paths/h200_cuda_kernels_llama1b_shape.json (magnitude rule, CUDA C kernels; keep k of inputs and of
activations skips 1 - k of FFN bytes). The roofline is zeroedge.planner.roofline: decode is
bandwidth-bound, time = bytes / (DRAM bandwidth x 0.7).
"""
from __future__ import annotations

import json
from pathlib import Path

from zeroedge import planner
from zeroedge.model import PRESETS

HERE = Path(__file__).resolve().parent


def numbers(cfg) -> dict:
    hd = cfg.dim // cfg.n_heads
    attn = cfg.dim * cfg.n_heads * hd * 2 + cfg.dim * cfg.n_kv_heads * hd * 2
    per_layer = attn + 3 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim
    params = cfg.vocab_size * cfg.dim + cfg.n_layers * per_layer + cfg.dim
    return {"L": cfg.n_layers, "D": cfg.dim, "F": cfg.ffn_dim, "h": cfg.n_heads, "hkv": cfg.n_kv_heads,
            "hd": hd, "V": cfg.vocab_size, "params": params, "tied": True}


def main():
    r = json.loads((HERE / "results" / "paths" / "h200_cuda_kernels_llama1b_shape.json").read_text())
    micro = r["micro"]
    dense_bw = micro["dense_GBs"]
    eff = {round(1 - k, 2): micro[f"keep{k}"]["mag_cuda"]["GBs"] / dense_bw for k in (0.9, 0.7, 0.5, 0.3)}

    def eff_at(skip):  # linear between the measured points
        xs = sorted(eff)
        if skip <= xs[0]:
            return min(1.0, eff[xs[0]])
        for a, b in zip(xs, xs[1:]):
            if skip <= b:
                return eff[a] + (eff[b] - eff[a]) * (skip - a) / (b - a)
        return eff[xs[-1]]

    dec = r.get("decode", {})
    measured = {0.13: dec.get("magnitude_cuda_keep0.87"), 0.27: dec.get("magnitude_cuda_keep0.73"),
                0.5: dec.get("magnitude_cuda_keep0.5")}
    print("# Decode paths: Orin forecast from the planner\n")
    print("Command: `python benchmarks/paths_orin_forecast.py > benchmarks/results/paths/orin_forecast.md`. "
          "Sparse-kernel efficiency relative to the dense GEMV, measured on the H200 "
          "(`benchmarks/results/paths/h200_cuda_kernels_llama1b_shape.json`, magnitude rule, CUDA C kernels): "
          + ", ".join(f"{s:.0%} skipped: {e:.2f}" for s, e in sorted(eff.items())) + ". "
          "17 % is the calibrated SmolLM2 artifact (+0.8 / +0.9 / +2.3 % perplexity on licenses / KJV / "
          "essays, measured per-layer costs); 27 % costs +4.7-5.4 %; 50 % is far past the quality "
          "budget and shown for the kernels only.\n")
    print("Check of the method on the H200 (llama-3.2-1b shape, context 1024): forecast speedup = dense "
          "step bytes / sparse step bytes at the measured efficiency, against the decode measured "
          "in the same run as the efficiencies:\n")
    print("| FFN bytes skipped | forecast | measured |")
    print("|---|---|---|")
    m1 = numbers(PRESETS["llama-3.2-1b"])
    h200 = planner.Target("h200", 141 << 30, 4.8e12, 16896, 528, 1.98e9, 0)
    base = planner.roofline(m1, h200, 1024, 1024, "fp16")["decode_ms"]
    for s, meas in measured.items():
        f = base / planner.roofline(m1, h200, 1024, 1024, "fp16", decode_ffn_bytes_skip=s,
                                    sparse_eff=eff_at(s))["decode_ms"]
        print(f"| {s:.0%} | {f:.2f}x | {meas['speedup']:.2f}x |" if meas else f"| {s:.0%} | {f:.2f}x | - |")
    print("\nForecast and measurement agree within 0.01 at 13 %; from 27 % the forecast runs ahead "
          "(kernel gaps and the atomic tail of each FFN, which a byte count leaves out), so read the "
          "Orin rows as upper bounds. They assume the sparse kernels keep the same efficiency "
          "relative to the dense GEMV on an Orin as on the H200: not measured on an Orin.\n")
    print("| model | target | context | dense tok/s | 17 % skipped | 27 % | 50 % |")
    print("|---|---|---|---|---|---|---|")
    for name in ("smollm2-135m", "llama-3.2-1b"):
        m = numbers(PRESETS[name])
        for tname in planner.TARGETS:
            t = planner.target(tname)
            d = planner.roofline(m, t, 2048, 2048, "fp16")["decode_tok_s"]
            cells = []
            for s in (0.17, 0.27, 0.5):
                v = planner.roofline(m, t, 2048, 2048, "fp16", decode_ffn_bytes_skip=s,
                                     sparse_eff=eff_at(s))["decode_tok_s"]
                cells.append(f"{v:.1f} ({v / d:.2f}x)")
            print(f"| {name} | {tname} | 2048 | {d:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
