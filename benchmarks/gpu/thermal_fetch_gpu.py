"""The swap's selection against its fetch cap (kv.policy.ThermalSettings.fetch): µs a layer of
zeroedge.kv.kernels.swap_decisions (the two-stage kernels: the best missing and worst resident pages
of every kv head, decisions only, nothing moved), 16 layers in one CUDA graph, llama-3.2-1b shape,
int8 cold store, 10 % hot; and each cap's decisions against the torch reference: the share of
decisions that are equal, and the largest score gap between the pages the two chose (the kernels
normalise with the sketch kernel's log-sum-exp shares, the reference with its own: they part only on
scores within rounding of each other).

    PYTHONPATH=$PWD:$PWD/benchmarks/gpu python3 benchmarks/gpu/thermal_fetch_gpu.py OUT.json [--fetch 4,8,16]
"""
import argparse
import json

import torch

import bench_setup as bs
from bench_setup import graph_timed, random_prefix
from zeroedge.kv import kernels as K
from zeroedge.runtime.fast import ThermalDecoder


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--fetch", default="4,8,16")
    ap.add_argument("--ctx", default="32768,131072")
    a = ap.parse_args()
    if not bs.cuda_or_skip("thermal_fetch_gpu: needs a CUDA GPU"):
        return
    dev, dt = torch.device("cuda"), torch.bfloat16
    ctxs = bs.int_list(a.ctx)
    m = bs.build_model("llama-3.2-1b", dev, dt, max_seq_len=max(ctxs) + 128)
    L = m.cfg.n_layers
    rows = []
    for ctx in ctxs:
        ks, vs = random_prefix(m.cfg, ctx, dev, dt)
        dec = ThermalDecoder(m, ctx, 64, budget=0.1, graph=True, cold="int8")
        dec.load_prefix(ks, vs)
        t = dec.attention
        ks = vs = None
        q = torch.randn(t.H, t.hd, device=dev, dtype=dt)
        pls, parts = [], []          # each layer's page log-sum-exps and their shares (lse_part is one buffer)
        for li in range(L):
            pls.append(t._page_lse(li, q, t.lse_part).clone())
            parts.append(tuple(x.clone() for x in t.lse_part))
        row = {"ctx": ctx, "pages": t.n}
        for F in bs.int_list(a.fetch):
            FP = 1 << max(0, (F - 1).bit_length())
            out = torch.empty(t.nkv, 3, FP, dtype=torch.long, device=dev)
            want = torch.empty_like(out)
            equal, gap = [], 0.0
            for li in range(L):
                K.swap_decisions(pls[li], t.page_bias, t.page_slot[li], F, out, part=parts[li])
                score = K.page_scores_ref(pls[li], t.page_bias)
                K.swap_decisions_ref(score, t.page_slot[li], F, want)
                equal.append(float((out == want).double().mean()))
                for which in (0, 2):    # pages in, pages out: their scores, -1 (no swap) as -1e30
                    pick = lambda d: torch.where(d[:, which] >= 0, score.gather(1, d[:, which].clamp(min=0)), -1e30)
                    gap = max(gap, float((pick(out) - pick(want)).abs().max()))

            def decide():
                for li in range(L):
                    K.swap_decisions(pls[li], t.page_bias, t.page_slot[li], F, out, part=parts[li])
            row[f"fetch{F}"] = {"us_per_layer": round(graph_timed(decide, dev) * 1e6 / L, 2),
                                 "equal_to_reference": round(sum(equal) / L, 4), "largest_score_gap": gap}
        print(json.dumps(row), flush=True)
        rows.append(row)
        dec = t = pls = parts = None
        torch.cuda.empty_cache()
    bs.write_json(a.out, {"device": bs.device_info(), "rows": rows})


if __name__ == "__main__":
    main()
