"""Decode tok/s and device bytes: dense vs thermal KV with the pinned host cold store vs the int8 cold store,
llama-3.2-1b shape, bf16, 10 % hot, random weights (speed only).

    PYTHONPATH=$PWD python3 benchmarks/gpu/thermal_cold_int8_gpu.py
"""
import sys, torch
sys.path.insert(0, __import__("os").path.dirname(__file__))
import bench_setup as bs
from zeroedge.runtime.fast import DenseDecoder, ThermalDecoder
dt = torch.bfloat16
m = bs.build_model("llama-3.2-1b", "cuda", dt)
cfg = m.cfg
for ctx in (8192, 32768):
    G = 400
    dense = DenseDecoder(m, ctx + G); dense.attention.kv.normal_()
    d = bs.decode_step_ms(dense, start=ctx, n=64); del dense; torch.cuda.empty_cache()
    row = {"ctx": ctx, "dense_tok_s": round(1e3 / d, 1)}
    for cold in ("host", "int8"):
        for every in (1, 4):
            t = ThermalDecoder(m, ctx, G, budget=0.1, fetch=4, refresh_every=every, cold=cold)
            L, nkv, hd = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
            ks = [torch.randn(nkv, ctx, hd, device="cuda", dtype=dt) for _ in range(L)]
            t.load_prefix(ks, ks)
            del ks
            ms = bs.decode_step_ms(t, start=ctx, n=64)
            kb = t.device_kv_bytes()
            row[f"{cold}_every{every}_tok_s"] = round(1e3 / ms, 1)
            row[f"{cold}_device_bytes_frac"] = round((kb["hot"] + kb["summaries"] + kb["cold_on_device"]) / kb["prefix_full"], 3)
            del t; torch.cuda.empty_cache()
    print(row, flush=True)
