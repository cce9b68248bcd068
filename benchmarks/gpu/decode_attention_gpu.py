"""The dense decoder's Triton attention (zeroedge.kv.decode_attention: RoPE, the cache write and split
attention in two kernels) on a GPU: batch-1 decode ms a step of the bf16 DenseDecoder (llama-3.2-1b
shape, random weights) with attn="sdpa" against attn="triton" for each number of shares a kv head
(SPLITS) and positions a program reads at a time (BLOCK), at each context.

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 benchmarks/gpu/decode_attention_gpu.py [--ctx 8192,32768] [--out DIR]

Timing: CUDA graphs, device events, medians (bench_setup.decode_step_ms).
"""
from __future__ import annotations

import itertools
import json

import bench_setup as bs

GEN = 400


def main(argv=None):
    a = bs.out_ctx_args(__doc__, "/tmp/decode_attention_out", "8192,32768", "decode_attention_gpu", argv)
    if a is None:
        return
    import torch

    from zeroedge.kv import decode_attention as DA
    from zeroedge.runtime.fast import DenseDecoder

    ctxs = bs.int_list(a.ctx)
    m = bs.build_model("llama-3.2-1b", "cuda", torch.bfloat16, max_seq_len=max(ctxs) + GEN)
    res = bs.device_info()
    res["rows"] = rows = []
    saved = DA.SPLITS, DA.BLOCK
    for ctx in ctxs:
        for attn, S, BN in [("sdpa", None, None)] + [("triton", S, BN) for S, BN in
                                                     itertools.product((16, 32, 64, 128, 256), (32, 64, 128))]:
            if S:
                DA.SPLITS, DA.BLOCK = S, BN
            d = DenseDecoder(m, ctx + GEN, attn=attn)
            d.attention.kv.normal_()
            rows.append(dict(ctx=ctx, attn=attn, splits=S, block=BN, ms=bs.decode_step_ms(d, start=ctx, n=64)))
            print(json.dumps(rows[-1]), flush=True)
            del d
        torch.cuda.empty_cache()
    DA.SPLITS, DA.BLOCK = saved
    bs.write_json(bs.out_dir(a.out) / "decode_attention_gpu.json", res)
    for ctx in ctxs:
        sdpa = next(r["ms"] for r in rows if r["ctx"] == ctx and r["attn"] == "sdpa")
        best = min((r for r in rows if r["ctx"] == ctx and r["attn"] == "triton"), key=lambda r: r["ms"])
        print(f"| {ctx} | sdpa {sdpa:.3f} ms | triton best {best['ms']:.3f} ms (splits {best['splits']}, "
              f"block {best['block']}) | x{sdpa / best['ms']:.2f} |")


if __name__ == "__main__":
    main()
