"""The two-stage swap's launch (zeroedge.kv.kernels.SWAP_WARPS: warps of its `sel` and `dec` programs;
SWAP_CHUNK: pages a `sel` program scores): µs a layer, 16 layers in one CUDA graph, with nothing to
move (every page barred) and with the page moves, llama-3.2-1b shape, int8 cold store in device
memory, 10 % hot; and each variant's decisions against (4, 4) warps and 256 pages at the same tables
(they must be equal). Each cell: [no moves, with moves, same decisions].

    PYTHONPATH=$PWD:$PWD/benchmarks/gpu python3 benchmarks/gpu/thermal_swap_warps_gpu.py OUT.json
"""
import json
import sys

import torch

import bench_setup as bs
from bench_setup import graph_timed, random_prefix
from zeroedge.kv import kernels as K
from zeroedge.runtime.fast import ThermalDecoder

dev, dt = torch.device("cuda"), torch.bfloat16
m = bs.build_model("llama-3.2-1b", dev, dt, max_seq_len=131072 + 128)
L = m.cfg.n_layers
res = []
default = K.SWAP_WARPS
for ctx in (32768, 131072):
    ks, vs = random_prefix(m.cfg, ctx, dev, dt)
    dec = ThermalDecoder(m, ctx, 64, budget=0.1, fetch=4, graph=True, cold="int8")
    dec.load_prefix(ks, vs)
    t = dec.attention
    ks = vs = None
    q = torch.randn(t.H, t.hd, device=dev, dtype=dt)
    pls = [t._page_lse(li, q, t.lse_part).clone() for li in range(L)]
    S, pe = t.slots, t.ps * t.hd
    barred = torch.full_like(t.page_bias, float("-inf"))
    per = lambda f: graph_timed(f, dev) * 1e6 / L
    out = torch.empty(t.nkv, 3, 4, dtype=torch.long, device=dev)
    row = {"ctx": ctx, "pages": t.n}
    for chunk in (256, 512, 1024):
        for sw in ((4, 4), (1, 4), (2, 4), (4, 1), (1, 1), (2, 2), (1, 2), (2, 1)):
            same = True
            for li in range(L):
                K.SWAP_WARPS = (4, 4)
                K.swap_decisions(pls[li], t.page_bias, t.page_slot[li], t.fetch, out, part=t.lse_part)
                want = out.clone()
                K.SWAP_WARPS = sw
                K.swap_decisions(pls[li], t.page_bias, t.page_slot[li], t.fetch, out, part=t.lse_part, chunk=chunk)
                same &= torch.equal(out, want)

            def swaps(bias):
                for li in range(L):
                    wk = t._slots(t.wk, li).view(t.nkv, S, pe)
                    wv = t._slots(t.wv, li).view(t.nkv, S, pe)
                    K.swap_pages(pls[li], bias, t.page_slot[li], t.slot_page[li], wk, wv,
                                 t.cold_k[li].view(t.nkv, t.n, -1), t.cold_v[li].view(t.nkv, t.n, -1), t.fetch,
                                 part=t.lse_part, chunk=chunk, scales=(t.cold_ks[li].view(t.nkv, t.n, -1),
                                                                       t.cold_vs[li].view(t.nkv, t.n, -1)), bits=8)
            row[f"c{chunk}_w{sw[0]}{sw[1]}"] = [round(per(lambda: swaps(barred)), 2), round(per(lambda: swaps(t.page_bias)), 2), bool(same)]
    K.SWAP_WARPS = default
    print(json.dumps(row), flush=True)
    res.append(row)
    dec = t = pls = None
    torch.cuda.empty_cache()
json.dump(res, open(sys.argv[1], "w"), indent=1)
