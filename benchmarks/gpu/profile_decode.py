"""Where a decode step's GPU time goes: kernel-by-kernel CUDA time of one eager step (torch
profiler) of DenseDecoder and ThermalDecoder (a refresh step) for a llama-3.2-1b-shaped model with
random bf16 weights. Eager, so launch gaps are not counted: the sums are pure kernel time.
--weights SCHEME: the dense loop only, weights packed (weights_gpu.SCHEMES or EMBEDDING4) with int8 inputs and PDL
off (a kernel launched early would count its wait).

    python3 benchmarks/gpu/profile_decode.py --ctx 8192,32768 [--weights int4-g128-sym]
"""
from __future__ import annotations

import collections

import bench_setup as bs


def profile(dec, pos, label, top=14):
    import torch
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


def main(argv=None):
    ap = bs.parser(__doc__)
    bs.add_ctx(ap, "8192,32768")
    ap.add_argument("--compiled", action="store_true", help="dense only, torch.compile'd layer bodies")
    ap.add_argument("--weights", default=None, help="dense only, packed weights: a weights_gpu.SCHEMES name")
    args = ap.parse_args(argv)
    if not bs.cuda_or_skip("SKIP: profile_decode needs CUDA"):
        return
    import torch

    from zeroedge.runtime.fast import DenseDecoder, ThermalDecoder

    dev = torch.device("cuda")
    ctxs = bs.int_list(args.ctx)
    m = bs.build_model("llama-3.2-1b", dev, torch.bfloat16, max_seq_len=max(ctxs) + 64)
    cfg = m.cfg
    if args.weights:
        import os

        import weights_gpu as W
        from zeroedge.quant.apply import apply, embedding_group

        apply(m, W.variant_section(args.weights, embedding_group(cfg.dim)), pack=True)
        os.environ["ZEROEDGE_PDL"] = "0"
    for ctx in ctxs:
        g = torch.Generator(device=dev).manual_seed(ctx)
        ks = [torch.randn(cfg.n_kv_heads, ctx, cfg.head_dim, device=dev, dtype=torch.bfloat16, generator=g)
              for _ in range(cfg.n_layers)]
        vs = [torch.randn_like(k) for k in ks]
        if args.weights:
            d = DenseDecoder(m, ctx + 16, graph=False, int8_inputs=True)
            d.load_prefix(ks, vs)
            profile(d, ctx, f"dense {args.weights} int8 inputs ctx {ctx}")
            del d
            continue
        if args.compiled:
            d = DenseDecoder(m, ctx + 16, graph=False)
            d.compile = True
            d.load_prefix(ks, vs)
            profile(d, ctx, f"dense compiled ctx {ctx}", top=40)
            del d
            continue
        for attn in ("triton", "sdpa", "bmm"):
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
