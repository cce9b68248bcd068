"""Where a thermal-KV refresh spends its time, per layer, on a CUDA GPU (llama-3.2-1b shape,
random prefix): the sketch scores alone, the swap decisions with no page moving (every page
barred), the whole refresh, and a copy of the same pages from device memory instead of mapped
host memory. CUDA-graph replays, medians.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu/profile_refresh.py [--ctx 8192,32768,131072]
        [--sketch-kernels triton,cuda]
"""
from __future__ import annotations

import json

import bench_setup as bs
from bench_setup import graph_timed, random_prefix


def main(argv=None):
    ap = bs.parser(__doc__)
    bs.add_ctx(ap, "8192,32768,131072")
    ap.add_argument("--sketch-kernels", default="auto",
                    help="comma list of zeroedge.kv.kernels.SKETCH_KERNEL values: the sketch and the refresh "
                         "timed once each (keys suffixed with the kernel when more than one)")
    a = ap.parse_args(argv)
    if not bs.cuda_or_skip("SKIP: needs CUDA"):
        return
    import torch

    from zeroedge.kv import kernels as K
    from zeroedge.runtime.fast import ThermalDecoder

    dev, dt = torch.device("cuda"), torch.bfloat16
    ctxs = bs.int_list(a.ctx)
    m = bs.build_model("llama-3.2-1b", dev, dt, max_seq_len=max(ctxs) + 128)
    out = {}
    L = m.cfg.n_layers
    default_programs = K.SKETCH_PROGRAMS
    for ctx in ctxs:
        ks, vs = random_prefix(m.cfg, ctx, dev, dt)
        dec = ThermalDecoder(m, ctx, 64, budget=0.1, fetch=4, graph=True)
        dec.load_prefix(ks, vs)
        t = dec.attention   # the thermal state: cold store, slots, sketches, swaps
        ks = vs = None
        q = torch.randn(t.H, t.hd, device=dev, dtype=dt)
        z = torch.zeros(1, device=dev)
        r = {"pages": t.n}
        per = lambda f: graph_timed(f, dev) * 1e6 / L        # µs per layer, all layers in one graph
        r["floor"] = graph_timed(lambda: z.add_(1), dev) * 1e6 / L
        kernels = a.sketch_kernels.split(",")
        for kern in kernels:
            K.SKETCH_KERNEL = kern
            sfx = f"_{kern}" if len(kernels) > 1 else ""
            r["sketch" + sfx] = per(lambda: [t._page_lse(li, q) for li in range(L)])
            r["sketch_part" + sfx] = per(lambda: [t._page_lse(li, q, t.lse_part) for li in range(L)])
            r["refresh" + sfx] = per(lambda: [t._swap(li, q) for li in range(L)])
        K.SKETCH_KERNEL = kernels[0]
        pls = [t._page_lse(li, q, t.lse_part).clone() for li in range(L)]
        S, pe = t.slots, t.ps * t.hd
        views = [(t._slots(t.wk, li).view(t.nkv, S, pe), t._slots(t.wv, li).view(t.nkv, S, pe),
                  t.hk[li].view(t.nkv, t.n, pe), t.hv[li].view(t.nkv, t.n, pe)) for li in range(L)]
        barred = torch.full_like(t.page_bias, float("-inf"))

        def swaps(bias, chunk):
            for li in range(L):
                wk, wv, hk, hv = views[li]
                K.swap_pages(pls[li], bias, t.page_slot[li], t.slot_page[li], wk, wv, hk, hv, t.fetch,
                             part=t.lse_part, chunk=chunk)

        for name, chunk in (("one", 1 << 30), ("two256", 256)):
            r[f"swap_{name}_no_moves"] = per(lambda: swaps(barred, chunk))
            r[f"swap_{name}"] = per(lambda: swaps(t.page_bias, chunk))
        for pb, progs in ((16, 64), (32, 32), (32, 64), (32, 128), (64, 64)):   # sketch blocks / programs
            K.SKETCH_PROGRAMS = progs
            nb = K.part_blocks(t.n, t.ps, pages_per_block=pb)
            grp = t.H // t.nkv
            part = (torch.empty(t.nkv, grp, nb, device=dev), torch.empty(t.nkv, grp, nb, device=dev))
            r[f"sketch_pb{pb}_p{progs}"] = per(
                lambda: [K.sketch_page_lse_q(q, t.A[li], t.codes[li], t.scales[li], t.ps, pages_per_block=pb,
                                             part=part) for li in range(L)])
        K.SKETCH_PROGRAMS = default_programs
        out[ctx] = r
        print(ctx, json.dumps({k: round(v, 2) for k, v in r.items()}), flush=True)
        dec = t = pls = views = None
        torch.cuda.empty_cache()
    print("sketch variants (µs / layer):", {c: {k[7:]: round(v, 1) for k, v in r.items() if k.startswith("sketch_")}
                                            for c, r in out.items()})
    print("\nper layer, µs (16 layers in one CUDA graph):")
    print("| ctx | pages | sketch | sketch + lse shares | swap, no page moves (one program / two-stage) | swap (one / two-stage) | refresh |")
    for ctx, r in out.items():
        for kern in kernels:
            sfx = f"_{kern}" if len(kernels) > 1 else ""
            print(f"| {ctx}{' ' + kern if sfx else ''} | {r['pages']} | {r['sketch' + sfx]:.1f} | "
                  f"{r['sketch_part' + sfx]:.1f} | {r['swap_one_no_moves']:.1f} / {r['swap_two256_no_moves']:.1f} | "
                  f"{r['swap_one']:.1f} / {r['swap_two256']:.1f} | {r['refresh' + sfx]:.1f} |")


if __name__ == "__main__":
    main()
