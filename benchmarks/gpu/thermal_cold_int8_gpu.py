"""Decode tok/s and device bytes: dense vs thermal KV with the pinned host cold store vs the int8 cold
store, llama-3.2-1b shape, bf16, 10 % hot, random weights (speed and bytes only; quality:
benchmarks/thermal_cold_int8.py).

    PYTHONPATH=$PWD python3 benchmarks/gpu/thermal_cold_int8_gpu.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_setup as bs  # noqa: E402

GEN = 400          # decode_step_ms takes 3 + 5 x 64 steps


def main():
    import torch

    from zeroedge.runtime.fast import DenseDecoder, ThermalDecoder

    dt = torch.bfloat16
    m = bs.build_model("llama-3.2-1b", "cuda", dt)
    L, nkv, hd = m.cfg.n_layers, m.cfg.n_kv_heads, m.cfg.head_dim
    for ctx in (8192, 32768):
        dense = DenseDecoder(m, ctx + GEN)
        dense.attention.kv.normal_()
        row = {"ctx": ctx, "dense_tok_s": round(1e3 / bs.decode_step_ms(dense, start=ctx, n=64), 1)}
        del dense
        torch.cuda.empty_cache()
        for cold in ("host", "int8"):
            for every in (1, 4):
                t = ThermalDecoder(m, ctx, GEN, budget=0.1, fetch=4, refresh_every=every, cold=cold)
                ks = [torch.randn(nkv, ctx, hd, device="cuda", dtype=dt) for _ in range(L)]
                t.load_prefix(ks, ks)
                del ks
                row[f"{cold}_every{every}_tok_s"] = round(1e3 / bs.decode_step_ms(t, start=ctx, n=64), 1)
                kb = t.device_kv_bytes()
                row[f"{cold}_device_bytes_frac"] = round(
                    (kb["hot"] + kb["summaries"] + kb["cold_on_device"]) / kb["prefix_full"], 3)
                del t
                torch.cuda.empty_cache()
        print(row, flush=True)


if __name__ == "__main__":
    main()
