"""The swap's selection, an older zeroedge/kv/kernels.py against this one: the same decisions (from
the sketch's page log-sum-exps and from whole numbers, many scores tied; both kernel forms) and µs a
layer of swap_decisions, 16 layers in one CUDA graph, llama-3.2-1b shape, at fetch 4 / 8 / 16.

    git show be38cc5:zeroedge/kv/kernels.py > /tmp/old_kernels.py
    PYTHONPATH=$PWD:$PWD/benchmarks/gpu python3 benchmarks/gpu/thermal_select_ab_gpu.py /tmp/old_kernels.py OUT.json
"""
import importlib.util
import json
import sys

import torch

import bench_setup as bs
from zeroedge.kv import kernels as K
from zeroedge.runtime.fast import ThermalDecoder

if not bs.cuda_or_skip("thermal_select_ab_gpu: needs a CUDA GPU"):
    sys.exit(0)
spec = importlib.util.spec_from_file_location("old_kernels", sys.argv[1])
OLD = importlib.util.module_from_spec(spec)
spec.loader.exec_module(OLD)
dev, dt = torch.device("cuda"), torch.bfloat16
m = bs.build_model("llama-3.2-1b", dev, dt, max_seq_len=131072 + 128)
L = m.cfg.n_layers
res = []
for ctx in (32768, 131072):
    ks, vs = bs.random_prefix(m.cfg, ctx, dev, dt)
    dec = ThermalDecoder(m, ctx, 64, budget=0.1, graph=True, cold="int8")
    dec.load_prefix(ks, vs)
    t = dec.attention
    ks = vs = None
    q = torch.randn(t.H, t.hd, device=dev, dtype=dt)
    # every layer's log-sum-exps, normalised by the last layer's shares (t.lse_part is one buffer):
    # the same inputs to both kernels, which is what this compares (thermal_fetch_gpu.py: each its own)
    pls = [t._page_lse(li, q, t.lse_part).clone() for li in range(L)]
    tied = [p.round() for p in pls]          # many equal scores
    for F in (4, 8, 16):
        FP = 1 << max(0, (F - 1).bit_length())
        o1 = torch.empty(t.nkv, 3, FP, dtype=torch.long, device=dev); o2 = torch.empty_like(o1)
        same = True
        for form_pls in (pls, tied):
            for li in range(L):
                for part in (t.lse_part, None):
                    o1.fill_(7); o2.fill_(9)
                    OLD.swap_decisions(form_pls[li], t.page_bias, t.page_slot[li], F, o1, part=part)
                    K.swap_decisions(form_pls[li], t.page_bias, t.page_slot[li], F, o2, part=part)
                    same &= torch.equal(o1, o2)
        takes = int((o2[:, 1] >= 0).sum())
        def run(mod):
            def f():
                for li in range(L):
                    mod.swap_decisions(pls[li], t.page_bias, t.page_slot[li], F, o2, part=t.lse_part)
            return round(bs.graph_timed(f, dev) * 1e6 / L, 2)
        r = {"ctx": ctx, "fetch": F, "same_as_old": bool(same), "last_takes": takes,
             "old_us": run(OLD), "new_us": run(K), "old_us_again": run(OLD), "new_us_again": run(K)}
        print(json.dumps(r), flush=True)
        res.append(r)
    dec = t = pls = tied = None
    torch.cuda.empty_cache()
bs.write_json(sys.argv[2], {"device": bs.device_info(), "rows": res})
