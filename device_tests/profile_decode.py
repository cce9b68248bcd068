"""Where a decode step's GPU time goes: kernel-by-kernel CUDA time of one eager step (torch
profiler) of DenseDecoder and ThermalDecoder (a refresh step) for a llama-3.2-1b-shaped model with
random bf16 weights. Eager, so launch gaps are not counted: the sums are pure kernel time.

    python3 device_tests/profile_decode.py --ctx 8192,32768
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from zeroedge import model as M  # noqa: E402
from zeroedge.runtime.fast import DenseDecoder, ThermalDecoder  # noqa: E402


def profile(dec, pos, label, top=14):
    from torch.profiler import ProfilerActivity, profile as prof

    for i in range(3):
        dec.step(1, pos + i)
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        dec.step(1, pos + 3)
        torch.cuda.synchronize()
    tot = collections.defaultdict(float)
    cnt = collections.Counter()
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            cnt[e.name] += 1
    s = sum(tot.values())
    print(f"\n== {label}: {sum(cnt.values())} kernels, {s:.0f} us of kernel time")
    for name, t in sorted(tot.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {t:8.1f} us  x{cnt[name]:4d}  {name[:110]}")
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="8192,32768")
    ap.add_argument("--compiled", action="store_true", help="dense only, torch.compile'd layer bodies")
    args = ap.parse_args()
    dev = torch.device("cuda")
    ctxs = [int(c) for c in args.ctx.split(",")]
    with torch.device(dev):
        m = M.build(M.PRESETS["llama-3.2-1b"].with_(max_seq_len=max(ctxs) + 64), dtype=torch.bfloat16, seed=0)
    cfg = m.cfg
    for ctx in ctxs:
        g = torch.Generator(device=dev).manual_seed(ctx)
        ks = [torch.randn(cfg.n_kv_heads, ctx, cfg.head_dim, device=dev, dtype=torch.bfloat16, generator=g)
              for _ in range(cfg.n_layers)]
        vs = [torch.randn_like(k) for k in ks]
        if args.compiled:
            d = DenseDecoder(m, ctx + 16, graph=False)
            d.compile = True
            d.load_prefix(ks, vs)
            profile(d, ctx, f"dense compiled ctx {ctx}", top=40)
            del d
            continue
        for attn in ("sdpa", "bmm"):
            d = DenseDecoder(m, ctx + 16, graph=False, attn=attn)
            d.load_prefix(ks, vs)
            profile(d, ctx, f"dense {attn} ctx {ctx}")
            del d
        t = ThermalDecoder(m, ctx, 16, budget=0.1, fetch=4, refresh_every=1, graph=False)
        t.load_prefix(ks, vs)
        profile(t, ctx, f"thermal refresh-every-step ctx {ctx}", top=30)
        del t
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
