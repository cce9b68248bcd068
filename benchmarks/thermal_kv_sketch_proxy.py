"""Which key summary ranks pages like the exact scores? A fast proxy for the perplexity runs.

For each layer of a cached SmolLM2 prefill (run thermal_kv_bench.py first: it caches
pre_kjv_4096_stats.pt), the last 32 prefill queries are split: the first 16 calibrate the query
covariance, the next 12 are scored. Every summary picks the same number of 16-token pages per kv
head (10 % budget, sink page and 2 recent pages always read); the number reported is the exact
attention mass that lands in the pages read, averaged over layers, heads and queries.

    python benchmarks/thermal_kv_sketch_proxy.py [kjv|essays]
"""
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zeroedge.kv.evaluate import Sketch, page_scores  # noqa: E402
from zeroedge.weights import cache_dir  # noqa: E402

torch.set_num_threads(1)
TEXT = sys.argv[1] if len(sys.argv) > 1 else "kjv"
pre = torch.load(cache_dir() / "kvbench" / f"pre_{TEXT}_4096_stats.pt")
L = len(pre["k"])
nkv, P, hd = pre["k"][0].shape
H = pre["qwin"][0].shape[0]
grp = H // nkv
ps, n = 16, P // 16
kp = int(0.1 * P) // ps
kvi = torch.arange(H) // grp
forced = torch.zeros(n, dtype=torch.bool)
forced[0] = True
forced[-2:] = True
variants = ["exact page max (oracle)", "key PCA r16 int4", "key PCA r32 int3", "key PCA r64 int4",
            "query-aware r8 int4", "query-aware r16 int4", "query-aware r32 int3",
            "query-aware (whole-prefill cov) r16 int4", "query-aware (whole-prefill cov) r32 int3",
            "query-aware r16 int2", "query-aware r16 sign bits"]
res = {v: [] for v in variants}
for li in range(L):
    K = pre["k"][li]
    qcal, q = pre["qwin"][li][:, :16], pre["qwin"][li][:, 16:28]
    cq = (qcal.transpose(1, 2) @ qcal).view(nkv, grp, hd, hd).sum(1)
    exact = (q @ K[kvi].transpose(1, 2)) / math.sqrt(hd)
    probs = exact.softmax(-1)
    for v in variants:
        if v.startswith("exact"):
            s, how = exact, "max"
        else:
            r = int(v.split(" r")[1].split()[0])
            bits = 1 if "sign" in v else int(v.split("int")[1])
            cov = pre["qcov"][li] if "whole-prefill" in v else cq
            sk = Sketch(K, r, bits, cov if v.startswith("query") else None)
            s, how = sk.scores(q, kvi), "mass"
        pss = page_scores(s, ps, grp, how).masked_fill(forced[None, None], float("-inf"))
        sel = pss.topk(kp - 3, -1).indices
        pm = forced[None, None].expand(nkv, q.shape[1], n).clone()
        pm.scatter_(2, sel, True)
        tm = pm.repeat_interleave(ps, 2)[kvi]
        res[v].append((probs * tm).sum(-1).mean().item())
print("| summary | bytes / token / kv head | attention mass captured |")
print("|---|---|---|")
for v in variants:
    if v.startswith("exact"):
        b = "(full keys)"
    else:
        r = int(v.split(" r")[1].split()[0])
        bits = 1 if "sign" in v else int(v.split("int")[1])
        b = f"{r * bits / 8 + r * 2 / ps:.1f}"
    print(f"| {v} | {b} | {sum(res[v]) / L:.4f} |")
