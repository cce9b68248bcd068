"""The FFN's two packed GEMVs alone on a GPU (llama-3.2-1b shapes, int8 inputs, int4 g128 symmetric
and g32 float zero point): gate/up with the norm, SwiGLU and the down projection's inputs prepared
in its epilogue, then down on those inputs with the residual. Each launch setting timed as a CUDA
graph of 20 calls (us a call, TB/s of the weight bytes), the setting in triton_gemv.CONFIG_I8 first.
(The "pipelined" rows of benchmarks/results/weights/h200_gemv_ffn_launch_sweep.json ran a kernel variant of commit 291925e, removed.)

With --qkvo: the attention's two packed GEMVs instead (q/k/v with the norm, o with the residual), in
the one-kernel form and prepared.

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 benchmarks/gpu/ffn_gemv_gpu.py [--qkvo] [--out DIR]
"""
from __future__ import annotations

import json

import bench_setup as bs

GATE_UP = [("table", {}), ("bn8 bw256 w8", dict(BN=8, BW=256, num_warps=8)),
           ("bn32 bw128 w8", dict(BN=32, BW=128, num_warps=8)), ("bn16 bw256 w8", dict(BN=16, BW=256, num_warps=8)),
           ("bn16 bw128 w4", dict(BN=16, BW=128, num_warps=4)), ("bn16 bw64 w4", dict(BN=16, BW=64, num_warps=4)),
           ("table, 1 stage", dict(num_stages=1)), ("table, 4 stages", dict(num_stages=4))]
QKVO = [("table", {})] + [(f"bn{bn} bw{bw} w{w} split {sp}", dict(BN=bn, BW=bw, num_warps=w, SPLIT=sp))
                          for bn, bw in ((2, 256), (4, 256), (8, 256), (4, 128), (8, 128), (16, 128))
                          for w in (4, 8) for sp in (1, 2, 4)] + [
    ("table, prepared", dict(PREPARED=True)), ("table, 1 stage", dict(num_stages=1)),
    ("table, 4 stages", dict(num_stages=4))]
DOWN = [("table", {}), ("split 2", dict(SPLIT=2)), ("split 8", dict(SPLIT=8)),
        ("bn8 bw256 w8", dict(BN=8, BW=256, num_warps=8)), ("bn8 bw256 w4 split 8", dict(BN=8, BW=256, num_warps=4, SPLIT=8)),
        ("bn32 bw128 w8 split 4", dict(BN=32, BW=128, num_warps=8, SPLIT=4)),
        ("bn16 bw256 w8 split 2", dict(BN=16, BW=256, num_warps=8, SPLIT=2)),
        ("bn4 bw256 w4 split 8", dict(BN=4, BW=256, num_warps=4, SPLIT=8)),
        ("bn16 bw128 w4 split 4", dict(BN=16, BW=128, num_warps=4, SPLIT=4)),
        ("table, 1 stage", dict(num_stages=1)), ("table, 4 stages", dict(num_stages=4))]


def main(argv=None):
    ap = bs.parser(__doc__)
    bs.add_out(ap, "/tmp/ffn_gemv_out")
    ap.add_argument("--qkvo", action="store_true", help="the q/k/v and o GEMVs instead of the FFN's")
    a = ap.parse_args(argv)
    if not bs.cuda_or_skip("ffn_gemv_gpu: skipped, no CUDA GPU here"):
        return
    import torch

    import weights_gpu as W
    from zeroedge.quant import triton_gemv as tg

    def us(fn, reps=20):
        def many():
            for _ in range(reps):
                fn()
        return bs.graph_ms(many) * 1e3 / reps

    res = bs.device_info()
    rows = res["rows"] = []
    for group in (128, 32):
        x = torch.randn(1, 2048, device="cuda").bfloat16()
        ln, r = torch.rand(2048, device="cuda").bfloat16(), torch.randn(1, 2048, device="cuda").bfloat16()
        if a.qkvo:
            wqkv, wo = W.random_packed(3072, 2048, 4, group, 3), W.random_packed(2048, 2048, 4, group, 4)
            cases = (("q/k/v", wqkv, QKVO, lambda c: tg.gemv(x, wqkv, norm=(ln, 1e-5), int8_inputs=True, config=c)),
                     ("o", wo, QKVO, lambda c: tg.gemv(x, wo, residual=r, int8_inputs=True, config=c)))
        else:
            w13, w2 = W.random_packed(16384, 2048, 4, group, 1), W.random_packed(2048, 8192, 4, group, 2)
            a13, prep = tg.gemv(x, w13, swiglu=True, norm=(ln, 1e-5), int8_inputs=True, then=w2)
            cases = (("gate/up", w13, GATE_UP, lambda c: tg.gemv(x, w13, swiglu=True, norm=(ln, 1e-5),
                                                                 int8_inputs=True, then=w2, config=c)),
                     ("down", w2, DOWN, lambda c: tg.gemv(a13, w2, residual=r, int8_inputs=True, inputs=prep,
                                                          config=c)))
        for shape, w, settings, call in cases:
            table = tg.pick(w.n, w.k, 4, group, True)
            nbytes = w.q.numel() + 4 * w.scale.numel()           # codes + fp16 step and offset a group
            for name, change in settings:
                c = dict(table, **change)
                t = us(lambda: call(c))
                rows.append(dict(shape=shape, group=group, setting=name, config=c, us=t, tb_s=nbytes / t / 1e6))
                print(json.dumps(rows[-1]), flush=True)
    bs.write_json(bs.out_dir(a.out) / ("h200_gemv_qkvo_launch_sweep.json" if a.qkvo else "h200_gemv_ffn_launch_sweep.json"), res)
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for group in (128, 32):
            rs = [r for r in rows if r["shape"] == shape and r["group"] == group]
            best = min(rs, key=lambda r: r["us"])
            print(f"| {shape} g{group} | table {rs[0]['us']:.2f} us | best {best['us']:.2f} us ({best['setting']}) |")


if __name__ == "__main__":
    main()
