"""Programmatic dependent launch (zeroedge.triton_launch) on a GPU: batch-1 decode ms a step of
the DenseDecoder (llama-3.2-1b shape, random weights; bf16 and packed int4 with int8 inputs) with
ZEROEDGE_PDL=0 and =1 alternated twice, and the logits of one step with and without it (the same
kernels in the same order: they must agree bit for bit).

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 benchmarks/gpu/pdl_gpu.py [--ctx 8192,32768] [--out DIR]
"""
from __future__ import annotations

import json
import os

import bench_setup as bs

GEN = 400


def main(argv=None):
    a = bs.out_ctx_args(__doc__, "/tmp/pdl_out", "8192,32768", "pdl_gpu", argv)
    if a is None:
        return
    import torch

    import weights_gpu as W
    from zeroedge.quant.apply import apply, embedding_group
    from zeroedge.runtime.fast import DenseDecoder

    ctxs = bs.int_list(a.ctx)
    res = bs.device_info()
    res["rows"] = rows = []
    for variant in ("bf16", "int4-g128-sym", "int4-g32-fzp"):
        m = bs.build_model("llama-3.2-1b", "cuda", torch.bfloat16, max_seq_len=max(ctxs) + GEN)
        if variant != "bf16":
            apply(m, W.section(*W.SCHEMES[variant], embedding_group(m.cfg.dim)), pack=True)
        i8 = variant != "bf16"
        for ctx in ctxs:
            for p in ("0", "1", "0", "1"):
                os.environ["ZEROEDGE_PDL"] = p
                d = DenseDecoder(m, ctx + GEN, int8_inputs=i8)
                d.attention.kv.normal_()
                ms = bs.decode_step_ms(d, start=ctx, n=64)
                diff = None
                if p == "1":
                    os.environ["ZEROEDGE_PDL"] = "0"
                    e = DenseDecoder(m, ctx + GEN, int8_inputs=i8)
                    e.attention.kv.copy_(d.attention.kv)
                    diff = float((d.step(5, ctx + 100).float() - e.step(5, ctx + 100).float()).abs().max())
                    del e
                    assert diff == 0.0, f"{variant} at {ctx}: logits differ with PDL ({diff})"
                rows.append(dict(weights=variant + ("/int8-inputs" if i8 else ""), ctx=ctx, pdl=p == "1", ms=ms,
                                 tok_s=1e3 / ms, max_logit_diff=diff))
                print(json.dumps(rows[-1]), flush=True)
                del d
        del m
        torch.cuda.empty_cache()
    os.environ.pop("ZEROEDGE_PDL", None)
    bs.write_json(bs.out_dir(a.out) / "pdl_gpu.json", res)


if __name__ == "__main__":
    main()
