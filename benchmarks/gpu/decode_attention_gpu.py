"""The dense decoder's Triton attention (zeroedge.kv.decode_attention: RoPE, the cache write and split
attention in two kernels) on a GPU: batch-1 decode ms a step of the bf16 DenseDecoder (llama-3.2-1b
shape, random weights) with attn="sdpa" against attn="triton" for each number of shares a kv head
(SPLITS) and positions a program reads at a time (BLOCK), at each context. With --launch: the split
kernel's warps and pipeline stages for each BLOCK instead, at the default shares.

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 benchmarks/gpu/decode_attention_gpu.py [--ctx 8192,32768] [--out DIR]
    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 benchmarks/gpu/decode_attention_gpu.py --launch --ctx 8192,131072

Timing: CUDA graphs, device events, medians (bench_setup.decode_step_ms).
"""
from __future__ import annotations

import itertools
import json

import bench_setup as bs

GEN = 400


def main(argv=None):
    ap = bs.parser(__doc__)
    bs.add_out(ap, "/tmp/decode_attention_out")
    bs.add_ctx(ap, "8192,32768")
    ap.add_argument("--launch", action="store_true", help="sweep warps x stages x block at the default shares")
    a = ap.parse_args(argv)
    if not bs.cuda_or_skip("decode_attention_gpu: skipped, no CUDA GPU here"):
        return
    launch = a.launch
    import torch

    from zeroedge.kv import decode_attention as DA
    from zeroedge.runtime.fast import DenseDecoder

    ctxs = bs.int_list(a.ctx)
    m = bs.build_model("llama-3.2-1b", "cuda", torch.bfloat16, max_seq_len=max(ctxs) + GEN)
    res = bs.device_info()
    res["rows"] = rows = []
    saved = DA.SPLITS, DA.BLOCK, DA.WARPS, DA.STAGES
    if launch:      # the shipped launch first and last (its two rows give the run-to-run spread)
        grid = [("triton", None, saved[1], saved[2], saved[3])] + [
            ("triton", None, BN, w, st) for w, st, BN in itertools.product((2, 4, 8), (2, 3, 4), (64, 128))
            if (BN, w, st) != saved[1:]] + [("triton", None, saved[1], saved[2], saved[3])]
    else:
        grid = [("sdpa", None, None, None, None)] + [("triton", S, BN, saved[2], saved[3]) for S, BN in
                                                      itertools.product((16, 32, 64, 128, 256), (32, 64, 128))]
    for ctx in ctxs:
        for attn, S, BN, w, st in grid:
            if attn == "triton":
                DA.SPLITS, DA.BLOCK, DA.WARPS, DA.STAGES = S, BN, w, st
            d = DenseDecoder(m, ctx + GEN, attn=attn)
            d.attention.kv.normal_()
            rows.append(dict(ctx=ctx, attn=attn, splits=S, block=BN, warps=w, stages=st,
                             ms=bs.decode_step_ms(d, start=ctx, n=64)))
            print(json.dumps(rows[-1]), flush=True)
            del d
        torch.cuda.empty_cache()
    DA.SPLITS, DA.BLOCK, DA.WARPS, DA.STAGES = saved
    bs.write_json(bs.out_dir(a.out) / ("h200_decode_attention_launch.json" if launch else "h200_decode_attention_splits.json"),
                  res)
    for ctx in ctxs:
        first = next(r["ms"] for r in rows if r["ctx"] == ctx)
        best = min((r for r in rows if r["ctx"] == ctx and r["attn"] == "triton"), key=lambda r: r["ms"])
        print(f"| {ctx} | {'shipped launch' if launch else 'sdpa'} {first:.3f} ms | triton best {best['ms']:.3f} ms "
              f"(splits {best['splits']}, block {best['block']}, warps {best['warps']}, stages {best['stages']}) "
              f"| x{first / best['ms']:.2f} |")


if __name__ == "__main__":
    main()
