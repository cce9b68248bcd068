"""Thermal decode against dense at 32K and 128K on a GPU (H200): llama-3.2-1b shape, bf16, random
weights and prefix (speed and bytes only; quality of the same settings: benchmarks/thermal_one_path.py
on SmolLM2). Each row: tok/s of the graphed decode loop, x the dense loop in the same run, and the
device KV (hot window + sketch + page table) as a fraction of the dense prefix KV.

    PYTHONPATH=$PWD python3 benchmarks/gpu/thermal_long_gpu.py [--ctx 32768,131072] [--lag | --frontier]
        [--ahead 1,2,3] [--sketch-kernels triton,cuda] [--weights int4-g128-sym] [--compile] [--json OUT]
    # chosen rows (the default's options but those named: rank, fetch, lag, ahead, refresh_every,
    # budget; int8 cold store, pages of 8, 4 recent), rows separated by ";"
    PYTHONPATH=$PWD python3 benchmarks/gpu/thermal_long_gpu.py --rows "fetch=4;ahead=1;rank=16,lag=1;budget=0.075"
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_setup as bs  # noqa: E402

GEN = 400          # decode_step_ms takes 3 + 5 x 64 steps
SETTINGS = [       # (rank, fetch, refresh_every, cold store)
    (16, 4, 1, "host"), (32, 4, 1, "host"), (32, 8, 2, "host"), (32, 8, 4, "host"), (32, 8, 8, "host"),
    (32, 16, 8, "host"), (16, 8, 8, "host"), (32, 4, 1, "int8"), (32, 4, 1, "int4")]
# --page-sizes: the default policy with the int8 cold store at pages of 16 (2 recent) and
# of 8 (4 recent: the same 32 recent tokens; fetch 4 and 8 pages; pages of 8 are the default)
# -- (page size, recent pages, fetch)
PAGE_SETTINGS = [(16, 2, 4), (8, 4, 4), (8, 4, 8)]
# --lag: the window's attention by SDPA (before) or the Triton kernel, and the refresh
# one step behind on a side stream (lag 1) -- (rank, fetch, refresh_every, cold store, lag, page
# size, recent pages, attention); the refresh_every of 10^6 row is the window alone (one refresh at
# the first step only)
LAG_SETTINGS = [(32, 4, 1, "int8", 0, 16, 2, "sdpa"), (32, 4, 1, "int8", 0, 16, 2, "triton"),
                (16, 4, 1, "int8", 0, 16, 2, "triton"), (32, 4, 1, "int8", 1, 16, 2, "triton"),
                (16, 4, 1, "int8", 1, 16, 2, "triton"), (32, 4, 1, "int8", 0, 8, 4, "triton"),
                (32, 4, 10 ** 6, "int8", 0, 16, 2, "triton")]
# --frontier: the defaults (pages of 8, 4 recent) at rank 32 and 16, lag 0
# and 1, and the window alone; with --sketch-kernels each row (but the window alone) once a sketch kernel
FRONTIER_SETTINGS = [(32, 4, 1, "int8", 0, 8, 4, "triton"), (16, 4, 1, "int8", 0, 8, 4, "triton"),
                     (32, 4, 1, "int8", 1, 8, 4, "triton"), (16, 4, 1, "int8", 1, 8, 4, "triton"),
                     (32, 4, 10 ** 6, "int8", 0, 8, 4, "triton")]
# --ahead D,...: with --frontier, its lag-0 rows once more for each D (kv.policy.ThermalSettings.ahead)
# (the predict rows of benchmarks/results/thermal_kv/speed_h200_llama1b_32k_128k_lag_predict_pages16_old.json
# were measured with commit 9d9b594's PREDICT_SETTINGS and ThermalAttention(predict=1), since removed:
# benchmarks/thermal_kv.md)


def row_options(text: str) -> dict:
    """--rows' "name=value,..." over the default policy (kv.policy.THERMAL) at 10 % hot."""
    from zeroedge.kv.policy import THERMAL

    o = {"rank": THERMAL.rank, "fetch": THERMAL.fetch, "lag": THERMAL.lag, "ahead": THERMAL.ahead,
         "refresh_every": THERMAL.refresh_every, "budget": 0.1}
    for item in filter(None, text.split(",")):
        k, _, v = item.partition("=")
        if k not in o:
            raise SystemExit(f"--rows: unknown option {k!r} (one of {', '.join(o)})")
        o[k] = float(v) if k == "budget" else int(v)
    return o


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="32768,131072")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only-cold", action="store_true", help="the default setting with each cold store only")
    ap.add_argument("--page-sizes", action="store_true", help="the default setting, int8 cold, at PAGE_SETTINGS only")
    ap.add_argument("--lag", action="store_true", help="LAG_SETTINGS only")
    ap.add_argument("--frontier", action="store_true", help="FRONTIER_SETTINGS only")
    ap.add_argument("--weights", default=None,
                    help="dense and thermal alike on packed weights (a weights_gpu.SCHEMES or EMBEDDING4 name), "
                         "int8 inputs")
    ap.add_argument("--rows", default="", help="only these rows: name=value,... (rank, fetch, lag, ahead, "
                                                "refresh_every, budget) separated by ; (the rest: the default)")
    ap.add_argument("--ahead", default="", help="with --frontier: its lag-0 rows again for each of these ahead values")
    ap.add_argument("--compile", action="store_true",
                    help="dense and thermal alike with torch.compile'd layer bodies (fp weights: norms, RoPE, "
                         "residuals and SwiGLU fused; runtime.fast.Decoder.compile)")
    ap.add_argument("--sketch-kernels", default="auto",
                    help="comma list of zeroedge.kv.kernels.SKETCH_KERNEL values, each row once a kernel")
    a = ap.parse_args()
    if a.rows and (a.frontier or a.lag or a.page_sizes or a.only_cold or a.ahead):
        raise SystemExit("--rows names every row: not with --frontier, --lag, --page-sizes, --only-cold or --ahead")
    import torch

    from zeroedge.kv import kernels as K
    from zeroedge.runtime.fast import Decoder, DenseDecoder, ThermalDecoder

    Decoder.compile = a.compile

    dt = torch.bfloat16
    m = bs.build_model("llama-3.2-1b", "cuda", dt)
    wkw = {}
    if a.weights:
        import weights_gpu as W
        from zeroedge.quant.apply import apply, embedding_group

        apply(m, W.variant_section(a.weights, embedding_group(m.cfg.dim)), pack=True)
        wkw = dict(int8_inputs=True)
    rows = []
    for ctx in bs.int_list(a.ctx):
        dense = DenseDecoder(m, ctx + GEN, **wkw)
        dense.attention.kv.normal_()
        d_ms = bs.decode_step_ms(dense, start=ctx, n=64)
        del dense
        torch.cuda.empty_cache()
        rows.append({"ctx": ctx, "decoder": "dense", "weights": a.weights or "bf16", "compiled": a.compile,
                     "tok_s": round(1e3 / d_ms, 1), "x_dense": 1.0})
        print(json.dumps(rows[-1]), flush=True)
        ks, vs = bs.random_prefix(m.cfg, ctx, "cuda", dt)
        runs = [(*s, 0, 16, 2, "auto") for s in SETTINGS if not a.only_cold or s[:3] == (32, 4, 1)]
        if a.page_sizes:
            runs = [(32, f, 1, "int8", 0, ps, rp, "auto") for ps, rp, f in PAGE_SETTINGS]
        if a.lag:
            runs = LAG_SETTINGS
        if a.frontier:
            runs = FRONTIER_SETTINGS
        kernels = a.sketch_kernels.split(",")
        runs = [(*r, kern, 0) for r in runs for kern in (kernels[:1] if r[2] == 10 ** 6 else kernels)]
        if a.rows:
            runs = [(o["rank"], o["fetch"], o["refresh_every"], "int8", o["lag"], 8, 4, "triton", kernels[0],
                     o["ahead"], o["budget"]) for o in map(row_options, a.rows.split(";"))]
        if a.frontier:
            runs += [(*r[:-1], d) for d in (bs.int_list(a.ahead) if a.ahead else []) for r in runs
                     if r[4] == 0 and r[2] == 1]
        for rank, fetch, every, cold, lag, ps, recent, attn, kern, ahead, *budget in runs:
            budget = budget[0] if budget else 0.1
            K.SKETCH_KERNEL = kern
            t = ThermalDecoder(m, ctx, GEN, budget=budget, rank=rank, fetch=fetch, refresh_every=every, cold=cold,
                               page_size=ps, recent_pages=recent, lag=lag, ahead=ahead, attn=attn, **wkw)
            t.load_prefix(ks, vs)
            ms = bs.decode_step_ms(t, start=ctx, n=64)
            kb = t.device_kv_bytes()
            rows.append({"ctx": ctx, "decoder": "thermal", "weights": a.weights or "bf16", "compiled": a.compile,
                         "budget": budget, "rank": rank, "fetch": fetch, "refresh_every": every, "cold": cold, "page_size": ps,
                         "recent_pages": recent, "lag": lag, "ahead": ahead, "attention": t.attention.attn,
                         "sketch_kernel": kern,
                         "tok_s": round(1e3 / ms, 1), "x_dense": round(d_ms / ms, 3),
                         "device_kv_frac": round((kb["hot"] + kb["summaries"] + kb["page_table"]) / kb["prefix_full"], 4),
                         "with_cold_on_device_frac": round((kb["hot"] + kb["summaries"] + kb["page_table"]
                                                            + kb["cold_on_device"]) / kb["prefix_full"], 4)})
            print(json.dumps(rows[-1]), flush=True)
            del t
            torch.cuda.empty_cache()
        del ks, vs
        torch.cuda.empty_cache()
    if a.json:
        bs.write_json(a.json, {"device": bs.device_info(), "rows": rows})


if __name__ == "__main__":
    main()
