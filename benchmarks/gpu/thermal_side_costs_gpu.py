"""What each piece of thermal's side-stream refresh costs the decode step (H200, llama-3.2-1b shape,
bf16, random weights and prefix): x the dense loop for the 7.5 % hot, ahead-1 setting (14.9 % device KV)
and for variants that leave a piece out or launch it otherwise. An ablation for speed only: the
left-out variants decide on stale or no scores. Rows alternate in order over --reps runs; the dense
loop is timed before and after and its mean is the divisor.

  shipped       the setting as it ships (kv.policy defaults but budget 0.075, ahead 1)
  window        no refresh after the first step (the ceiling)
  no_swap       the sketch scored, no selection or page move (kernels.swap_pages left out)
  no_sketch     no query projection or sketch (kernels.sketch_page_lse_q returns fixed scores)
  predict_only  neither: the side stream computes only the predicted query
  dec4          the selection's `dec` program with 4 warps (kernels.SWAP_WARPS (1, 4))
  one_stream    every refresh on one side stream, as before the two-stream refresh (whose first runs measured the
                two streams as a `two_streams` row over one: git show d8708f4:benchmarks/gpu/thermal_side_costs_gpu.py)
  predict_int8  the predicted query from a packed int8 (group 128, symmetric) copy of the query rows
  predict_int4  the same from int4 (the queries differ: speed only, quality unmeasured)

    PYTHONPATH=$PWD python3 benchmarks/gpu/thermal_side_costs_gpu.py [--ctx 131072] [--reps 3]
        [--rows shipped,window,...] [--compile] [--json OUT]
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_setup as bs  # noqa: E402

GEN = 400
ROWS = ["shipped", "window", "no_swap", "no_sketch", "predict_only", "dec4", "one_stream", "predict_int8",
        "predict_int4"]


def main():
    ap = bs.parser(__doc__)
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--compile", action="store_true",
                    help="dense and thermal alike with torch.compile'd layer bodies (runtime.fast.Decoder.compile)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = a.rows.split(",")
    if not set(rows) <= set(ROWS):
        raise SystemExit(f"--rows: each of {', '.join(ROWS)}")
    if not bs.cuda_or_skip("thermal_side_costs_gpu: needs CUDA"):
        return
    import torch

    from zeroedge.kv import attention as KA
    from zeroedge.kv import kernels as K
    from zeroedge.quant import packed as QP
    from zeroedge.quant.groupwise import Scheme
    from zeroedge.quant.packed import PackedLinear
    from zeroedge.runtime.fast import Decoder, DenseDecoder, ThermalDecoder, fused_weights

    Decoder.compile = a.compile

    m = bs.build_model("llama-3.2-1b", "cuda", torch.bfloat16)
    TA = KA.ThermalAttention
    shipped = dict(fork=TA._fork, lse=K.sketch_page_lse_q, swap=K.swap_pages, warps=K.SWAP_WARPS, linear=QP.linear)
    qrows = {}          # (data_ptr, rows) of each layer's query rows -> {bits: PackedLinear}

    def query_rows_packed(bits):
        def linear(x, w, bias=None, **kw):
            key = (w.data_ptr(), w.shape[0]) if isinstance(w, torch.Tensor) else None
            if key in qrows:
                if bits not in qrows[key]:
                    qrows[key][bits] = PackedLinear.from_weight(w, Scheme(bits=bits, group=128, symmetric=True))
                w = qrows[key][bits]
            return shipped["linear"](x, w, bias, **kw)
        return linear

    fixed = {}

    def fixed_scores(q, A, codes, scales, page_size, **_):
        key = codes.data_ptr()
        if key not in fixed:
            nkv, P, _r2 = codes.shape
            fixed[key] = torch.randn(nkv, q.shape[0] // nkv, P // page_size, device=codes.device)
        return fixed[key]

    def one_stream_fork(self, li):
        return shipped["fork"](self, 0)

    def set_row(row):
        TA._fork = one_stream_fork if row == "one_stream" else shipped["fork"]
        K.sketch_page_lse_q = fixed_scores if row in ("no_sketch", "predict_only") else shipped["lse"]
        K.swap_pages = (lambda *_, **__: None) if row in ("no_swap", "predict_only") else shipped["swap"]
        K.SWAP_WARPS = (1, 4) if row == "dec4" else shipped["warps"]
        QP.linear = query_rows_packed(int(row[-1])) if row.startswith("predict_int") else shipped["linear"]

    def dense_ms():
        d = DenseDecoder(m, a.ctx + GEN)
        d.attention.kv.normal_()
        ms = bs.decode_step_ms(d, start=a.ctx, n=64)
        del d
        torch.cuda.empty_cache()
        return ms

    rows_q = m.cfg.n_heads * m.cfg.head_dim
    for w in fused_weights(m).layers:
        qrows[(w["wqkv"].data_ptr(), rows_q)] = {}
    d_ms = [dense_ms()]
    ks, vs = bs.random_prefix(m.cfg, a.ctx, "cuda", torch.bfloat16)
    ms = {r: [] for r in rows}
    for rep in range(a.reps):
        for row in (rows if rep % 2 == 0 else rows[::-1]):
            set_row(row)
            opts = dict(budget=0.075, ahead=1, cold="int8", attn="triton")
            if row == "window":
                opts["refresh_every"] = 10 ** 6
            t = ThermalDecoder(m, a.ctx, GEN, **opts)
            t.load_prefix(ks, vs)
            ms[row].append(bs.decode_step_ms(t, start=a.ctx, n=64))
            print(json.dumps({"row": row, "rep": rep, "ms": round(ms[row][-1], 4)}), flush=True)
            del t
            torch.cuda.empty_cache()
    set_row("shipped")
    del ks, vs
    torch.cuda.empty_cache()
    d_ms.append(dense_ms())
    dm = sum(d_ms) / len(d_ms)
    mean = {r: sum(v) / len(v) for r, v in ms.items()}
    out = {"ctx": a.ctx, "compiled": a.compile, "dense_ms": [round(x, 4) for x in d_ms], "rows": {}}
    for r, v in ms.items():
        x = [dm / t for t in v]
        over = (mean[r] - mean["window"]) * 1e3 / m.cfg.n_layers if "window" in mean else None
        out["rows"][r] = {"x_dense": [round(e, 3) for e in x], "mean": round(sum(x) / len(x), 3),
                          "us_a_layer_over_window": None if over is None else round(over, 2)}
    print(json.dumps(out), flush=True)
    if a.json:
        bs.write_json(a.json, {"device": bs.device_info(), **out})


if __name__ == "__main__":
    main()
