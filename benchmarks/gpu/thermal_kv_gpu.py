"""Thermal KV on a GPU (H200): copy bandwidth, the fast dense decode loop, thermal decode at
8K / 32K / 128K for a llama-3.2-1b-shaped model with random bf16 weights, page-fetch latency,
migration bandwidth against the measured copy bandwidth. Prints a short table last and writes
thermal_kv_gpu.json under $OUT (or the current folder).

    python benchmarks/gpu/thermal_kv_gpu.py            # on a CUDA machine
    python benchmarks/gpu/thermal_kv_gpu.py --dry      # tiny model on CPU: checks the script runs

Skips (exit 0, says why) where CUDA is absent, unless --dry.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import bench_setup as bs
from bench_setup import graph_timed, random_prefix, timed

RES = {"errors": []}
T0 = 0.0
CHUNKS = (0, 128, 256, 512, 1024)


def log(*a):
    print(*a, flush=True)


def sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def free(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(dev, nbytes):
    import torch

    n = nbytes // 2
    x = torch.randn(n, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    d2d = 2 * nbytes / timed(lambda: y.copy_(x), dev)                 # read + write
    out = {"d2d_Bps": d2d}
    if dev.type == "cuda":
        h = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
        out["h2d_Bps"] = nbytes / timed(lambda: x.copy_(h, non_blocking=True), dev)
        out["d2h_Bps"] = nbytes / timed(lambda: h.copy_(x, non_blocking=True), dev)
        del h
    del x, y
    return out


def decode_rate(dec, ctx, steps, dev):
    import torch

    tok = 1
    for i in range(4):                     # warm-up + graph capture (every graph variant)
        dec.step(tok, ctx)
    ctx += 4
    sync(dev)
    t0 = time.perf_counter()
    for i in range(1, steps):
        out = dec.step(tok, ctx + i)
    sync(dev)
    dt = time.perf_counter() - t0
    if not torch.isfinite(out.float()).all():
        raise RuntimeError("non-finite logits")
    return (steps - 1) / dt


def fetch_latency(dec, dev, pages_per_head):
    """Seconds to fetch `pages_per_head` pages a kv head of one layer (K and V) from the cold
    store into the slot window, as the graphed refresh does it (zero-copy reads of mapped pinned
    host memory, whole pages as int64 words); timed as CUDA-graph replays on a GPU."""
    import torch

    dec = getattr(dec, "attention", dec)   # the thermal state lives on the decoder's attention strategy
    li, nkv = 0, dec.nkv
    pages_per_head = min(pages_per_head, dec.slots)
    src = torch.randint(0, dec.n, (nkv, pages_per_head), device=dev)
    dst = torch.randperm(dec.slots, device=dev)[:pages_per_head].expand(nkv, -1).contiguous()
    hidx = torch.arange(nkv, device=dev)[:, None].expand_as(src)
    views = []
    for win, host in ((dec.wk, dec.hk), (dec.wv, dec.hv)):
        w = dec._slots(win, li).view(nkv, dec.slots, dec.ps * dec.hd).view(torch.int64)
        h = host[li].view(nkv, dec.n, dec.ps * dec.hd).view(torch.int64)
        views.append((w, h))

    def f():
        for w, h in views:
            w[hidx, dst] = h[hidx, src]

    t = graph_timed(f, dev)
    nbytes = 2 * nkv * pages_per_head * dec.ps * dec.hd * dec.wk.element_size()
    return t, nbytes


def refresh_latency(dec, dev):
    """Seconds of one layer's refresh (sketch scores, swap decisions, page copies), graph-timed."""
    import torch

    dec = getattr(dec, "attention", dec)
    q = torch.randn(dec.H, dec.hd, device=dev, dtype=dec.dtype)
    return graph_timed(lambda: dec._swap(0, q), dev)


def migration_bandwidth(dev, n_pages, page_elems, copy_bw):
    """Demote n random pages device -> pinned host and promote them back, through the transfer
    handler (own stream, events): gather on device + one bulk copy (+ scatter)."""
    import torch

    from zeroedge.kv.scheduler import BandwidthScheduler
    from zeroedge.kv.tiers import TransferHandler

    pool = torch.randn(n_pages * 2, page_elems, device=dev, dtype=torch.bfloat16)
    idx = torch.randperm(n_pages * 2, device=dev)[:n_pages]
    pin = dev.type == "cuda"
    host = torch.empty(n_pages, page_elems, dtype=torch.bfloat16, pin_memory=pin)
    stage = torch.empty(n_pages, page_elems, device=dev, dtype=torch.bfloat16)
    sched = BandwidthScheduler(peak_bytes_per_s=copy_bw.get("h2d_Bps", copy_bw["d2d_Bps"]))
    th = TransferHandler(sched, dev)
    nbytes = host.numel() * 2

    def demote():
        torch.index_select(pool, 0, idx, out=stage)
        th.copy(host, stage, "migrate_down")
        th.wait()

    def promote():
        th.copy(stage, host, "migrate_up")
        th.wait()
        pool.index_copy_(0, idx, stage)

    res = {"bytes": nbytes, "down_Bps": nbytes / timed(demote, dev, iters=5),
           "up_Bps": nbytes / timed(promote, dev, iters=5)}
    # the pages must survive the round trip
    before = pool[idx].clone()
    demote()
    pool[idx] = 0
    promote()
    res["round_trip_exact"] = bool(torch.equal(pool[idx], before))
    res["handler"] = sched.summary()
    return res


def check_swap_kernel(dev):
    """The fused Triton page swap against the torch reference on random tables (raises if not equal)."""
    import torch

    from zeroedge.kv import kernels as K

    out = []
    g = torch.Generator().manual_seed(5)
    for nkv, grp, n, S, PE, F in ((8, 4, 2048, 196, 1024, 4), (8, 4, 8192, 812, 1024, 4), (3, 2, 100, 10, 64, 16)):
        pl = torch.randn(nkv, grp, n, generator=g)
        bias = torch.zeros(n)
        bias[:1] = float("-inf")
        bias[-2:] = float("-inf")
        sp = torch.stack([torch.randperm(n - 3, generator=g)[:S] + 1 for _ in range(nkv)])
        ps = torch.full((nkv, n), -1, dtype=torch.long)
        for h in range(nkv):
            ps[h, sp[h]] = torch.arange(S)
        hk, hv = torch.randn(nkv, n, PE, generator=g), torch.randn(nkv, n, PE, generator=g)
        wk, wv = torch.randn(nkv, S, PE, generator=g), torch.randn(nkv, S, PE, generator=g)
        ref = [t.clone() for t in (ps, sp, wk, wv)]
        K.swap_pages_ref(K.page_scores_ref(pl, bias), *ref, hk, hv, F)
        gpu = [t.to(dev) for t in (ps, sp, wk, wv)]
        K.swap_pages(pl.to(dev), bias.to(dev), *gpu, hk.to(dev), hv.to(dev), F)
        same = all(torch.equal(a, b.cpu()) for a, b in zip(ref, gpu))
        moved = int((ref[1] != sp).sum())
        if not same:
            raise RuntimeError(f"swap kernel differs from the reference at n={n} S={S} F={F}")
        # the two-stage kernels, with the per-block log-sum-exp shares the sketch kernel writes
        nb = (n + 15) // 16
        pad = torch.full((nkv, grp, nb * 16), float("-inf"))
        pad[..., :n] = pl
        blk = pad.view(nkv, grp, nb, 16)
        pm = blk.amax(-1)
        part = (pm.to(dev), (blk - pm[..., None]).exp().sum(-1).to(dev))
        two = [t.to(dev) for t in (ps, sp, wk, wv)]
        K.swap_pages(pl.to(dev), bias.to(dev), *two, hk.to(dev), hv.to(dev), F, part=part, chunk=64)
        same2 = all(torch.equal(a, b.cpu()) for a, b in zip(ref, two))
        if not same2:
            raise RuntimeError(f"two-stage swap differs from the reference at n={n} S={S} F={F}")
        out.append({"n": n, "S": S, "F": F, "moved": moved, "equal": same, "two_stage_equal": same2})
    # the fused query-projection sketch kernel against the two-step path
    nkv, grp, hd, r, P, ps = 8, 4, 64, 16, 32768, 16
    q = torch.randn(nkv * grp, hd, generator=g).to(dev, torch.bfloat16)
    A = torch.randn(nkv, hd, r, generator=g).to(dev)
    codes = K.pack_int4(torch.randint(-7, 8, (nkv, P, r), generator=g)).to(dev)
    scales = torch.rand(nkv, P, generator=g).half().to(dev)
    qr = torch.bmm(q.view(nkv, grp, hd).float(), A) / hd ** 0.5
    two = K.sketch_page_lse(qr, codes, scales, ps)
    one = K.sketch_page_lse_q(q, A, codes, scales, ps)
    ref = K.sketch_page_lse_ref(qr.cpu(), codes.cpu(), scales.cpu(), ps)
    err = float((one - two).abs().max())
    err_ref = float((one.cpu() - ref).abs().max())
    if err > 1e-3 or err_ref > 1e-3:
        raise RuntimeError(f"sketch kernel differs from the two-step path ({err}) or the reference ({err_ref})")
    out.append({"sketch_q_max_abs_diff": err, "sketch_vs_cpu_reference": err_ref})
    return out


def parse_args(argv=None):
    ap = bs.parser(__doc__)
    ap.add_argument("--dry", action="store_true", help="tiny model on CPU")
    bs.add_ctx(ap, "8192,32768,131072")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--fetch", type=int, default=4, help="pages fetched per kv head per layer per step")
    ap.add_argument("--page-size", type=int, default=16, help="thermal page size (tokens)")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile'd layer bodies")
    ap.add_argument("--compile-budget-s", type=float, default=150.0)
    ap.add_argument("--swap-chunk", type=int, default=None,
                    help="pages a two-stage swap program scores (0: the one-program swap kernel)")
    return ap.parse_args(argv)


def weight_bytes(m) -> int:
    seen = set()
    wbytes = 0
    for p in m.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            wbytes += p.numel() * p.element_size()
    return wbytes


def dense_rates(m, ks, vs, ctx, steps, dev, row) -> float:
    """Dense decode tok/s (sdpa, and bmm up to 8K) into row; returns the best."""
    from zeroedge.runtime.fast import DenseDecoder

    dense_best = 0.0
    for attn in (("sdpa", "bmm") if ctx <= 8192 else ("sdpa",)):
        try:
            d = DenseDecoder(m, ctx + steps + 8, graph=True, attn=attn)
            d.load_prefix(ks, vs)
            r = decode_rate(d, ctx, steps, dev)
            row[f"dense_{attn}_tps"] = r
            row["dense_kv_bytes"] = d.kv_bytes(ctx)
            dense_best = max(dense_best, r)
            del d
        except Exception as e:
            RES["errors"].append(f"dense {attn} {ctx}: {type(e).__name__}: {e}")
            log(RES["errors"][-1])
    return dense_best


def thermal_rates(m, ks, vs, ctx, steps, dev, args, row):
    """Thermal decode tok/s refreshing every 4, 2 (twice the fetch) and 1 steps into row; returns the
    every-step decoder for the latency measurements."""
    from zeroedge.runtime.fast import ThermalDecoder

    for every, fetch in ((4, args.fetch), (2, 2 * args.fetch), (1, args.fetch)):
        t = ThermalDecoder(m, ctx, 2 * steps + 2, budget=args.budget, fetch=fetch, page_size=args.page_size,
                           refresh_every=every, graph=True)
        t.load_prefix(ks, vs)
        key = f"thermal_r{every}_tps" if fetch == args.fetch else f"thermal_r{every}f{fetch}_tps"
        row[key] = decode_rate(t, ctx, steps, dev)
        if every != 1:
            del t
            free(dev)
    return t


def thermal_latencies(t, dev, args, row):
    """One layer's refresh (by swap chunk too) and page fetches, graph-timed, into row."""
    from zeroedge.kv import kernels as K

    row["refresh_layer_us"] = refresh_latency(t, dev) * 1e6
    keep = K.SWAP_CHUNK
    for c in CHUNKS:   # one-program kernel (0) vs two-stage chunk sizes
        K.SWAP_CHUNK = c if c else 1 << 30
        row[f"refresh_us_chunk{c}"] = refresh_latency(t, dev) * 1e6
    K.SWAP_CHUNK = keep
    for f in (1, args.fetch):
        lat, nb = fetch_latency(t, dev, f)
        row[f"fetch_{f}_us"] = lat * 1e6
        row[f"fetch_{f}_bytes"] = nb


def measure_ctx(m, ctx, args, dev, dtype, steps, bw, wbytes) -> dict:
    """Dense and thermal decode at one context length (errors recorded, not raised)."""
    import torch

    cfg = m.cfg
    row = {"ctx": ctx}
    try:
        ks, vs = random_prefix(cfg, ctx, dev, dtype)
        dense_best = dense_rates(m, ks, vs, ctx, steps, dev, row)
        row["dense_tps"] = dense_best
        kvb = 2 * cfg.n_layers * cfg.n_kv_heads * ctx * cfg.head_dim * (2 if dtype == torch.bfloat16 else 4)
        row["roofline_tps"] = bw["d2d_Bps"] / (wbytes + kvb)
        row["dense_frac_roofline"] = dense_best / row["roofline_tps"]
        free(dev)
        t = thermal_rates(m, ks, vs, ctx, steps, dev, args, row)
        del ks, vs
        row["thermal_tps"] = row["thermal_r1_tps"]
        kb = t.device_kv_bytes()
        row["thermal_device_kv_bytes"] = kb["hot"] + kb["summaries"]
        row["thermal_kv_frac"] = row["thermal_device_kv_bytes"] / kb["prefix_full"]
        row["speedup"] = row["thermal_tps"] / max(dense_best, 1e-9)
        row["speedup_r4"] = row["thermal_r4_tps"] / max(dense_best, 1e-9)
        thermal_latencies(t, dev, args, row)
        del t
        free(dev)
    except Exception as e:
        RES["errors"].append(f"ctx {ctx}: {type(e).__name__}: {e}")
        log(traceback.format_exc())
    return row


def measure_compiled(m, rows, args, dev, dtype, steps):
    """torch.compile'd layer bodies (fused norm / rope / residual / SwiGLU), compiled once and
    reused at every context; run last so a slow compile cannot cost the table above."""
    from zeroedge.runtime.fast import DenseDecoder, ThermalDecoder

    for row in rows:
        ctx = row["ctx"]
        if time.perf_counter() - T0 > args.compile_budget_s:
            RES["errors"].append(f"compiled {ctx}: skipped (time budget)")
            continue
        try:
            ks, vs = random_prefix(m.cfg, ctx, dev, dtype)
            d = DenseDecoder(m, ctx + steps + 8, graph=True, attn="sdpa")
            d.compile = True
            d.load_prefix(ks, vs)
            row["dense_compiled_tps"] = decode_rate(d, ctx, steps, dev)
            del d
            row["dense_compiled_frac_roofline"] = row["dense_compiled_tps"] / row["roofline_tps"]
            t = ThermalDecoder(m, ctx, 2 * steps + 2, budget=args.budget, fetch=args.fetch, page_size=args.page_size,
                               refresh_every=4, graph=True)
            t.compile = True
            t.load_prefix(ks, vs)
            del ks, vs
            row["thermal_compiled_r4_tps"] = decode_rate(t, ctx, steps, dev)
            del t
            free(dev)
            log(json.dumps({"ctx": ctx, "dense_compiled_tps": row["dense_compiled_tps"],
                            "thermal_compiled_r4_tps": row["thermal_compiled_r4_tps"],
                            "t": time.perf_counter() - T0}))
        except Exception as e:
            RES["errors"].append(f"compiled {ctx}: {type(e).__name__}: {str(e)[:300]}")
            log(RES["errors"][-1])


def print_table(rows, bw, wbytes, args):
    g = 1e9
    log("\n== thermal KV on", RES["device"], "| weights", f"{wbytes / g:.2f} GB",
        "| copy d2d", f"{bw['d2d_Bps'] / g:.0f} GB/s", "h2d", f"{bw.get('h2d_Bps', 0) / g:.1f}",
        "d2h", f"{bw.get('d2h_Bps', 0) / g:.1f} GB/s")
    log("compiled (dense, thermal every 4) tok/s:", {r["ctx"]: (round(r.get("dense_compiled_tps", 0)),
        round(r.get("thermal_compiled_r4_tps", 0))) for r in rows})
    log("compiled dense / roofline:", {r["ctx"]: round(r.get("dense_compiled_frac_roofline", 0), 3) for r in rows})
    log("refresh of one layer (us):", {r["ctx"]: round(r.get("refresh_layer_us", 0), 1) for r in rows})
    log("refresh us by swap chunk (0 = one program a head):", {r["ctx"]: {c: round(r.get(f"refresh_us_chunk{c}", 0), 1)
        for c in CHUNKS} for r in rows})
    log(f"thermal every 2 steps, fetch {2 * args.fetch} (tok/s, x dense):",
        {r["ctx"]: (round(r.get(f"thermal_r2f{2 * args.fetch}_tps", 0)),
                    round(r.get(f"thermal_r2f{2 * args.fetch}_tps", 0) / max(r.get("dense_tps", 1), 1), 2)) for r in rows})
    log("| ctx | dense tok/s (sdpa / bmm) | roofline | dense/roof | thermal tok/s every step / every 4 | "
        "speedup | device KV thermal/dense | fetch 1 pg/head us | fetch F pg/head us |")
    for r in rows:
        log(f"| {r['ctx']} | {r.get('dense_sdpa_tps', 0):.0f} / {r.get('dense_bmm_tps', 0):.0f} | "
            f"{r.get('roofline_tps', 0):.0f} | {r.get('dense_frac_roofline', 0):.2f} | "
            f"{r.get('thermal_tps', 0):.0f} / {r.get('thermal_r4_tps', 0):.0f} | "
            f"{r.get('speedup', 0):.2f} / {r.get('speedup_r4', 0):.2f} | "
            f"{r.get('thermal_kv_frac', 0):.3f} | {r.get('fetch_1_us', 0):.0f} | "
            f"{r.get(f'fetch_{args.fetch}_us', 0):.0f} |")
    mg = RES.get("migration")
    if mg:
        ref_up, ref_down = bw.get("h2d_Bps", bw["d2d_Bps"]), bw.get("d2h_Bps", bw["d2d_Bps"])
        log(f"migration {mg['bytes'] / 1e6:.0f} MB of random 4 KB pages: down {mg['down_Bps'] / g:.1f} GB/s "
            f"({mg['down_Bps'] / ref_down:.0%} of d2h copy), up {mg['up_Bps'] / g:.1f} GB/s "
            f"({mg['up_Bps'] / ref_up:.0%} of h2d copy), round trip exact: {mg['round_trip_exact']}")
    if RES["errors"]:
        log("errors:\n  " + "\n  ".join(RES["errors"]))


def main(argv=None):
    args = parse_args(argv)
    import torch

    from zeroedge.kv import kernels as K
    if args.swap_chunk is not None:
        K.SWAP_CHUNK = args.swap_chunk if args.swap_chunk > 0 else 1 << 30
    RES["swap_chunk"] = K.SWAP_CHUNK
    if not bs.cuda_or_skip("SKIP: thermal_kv_gpu needs CUDA (use --dry for a CPU smoke run)", dry=args.dry):
        return 0
    dev = torch.device("cpu" if args.dry else "cuda")
    dtype = torch.float32 if args.dry else torch.bfloat16
    ctxs = bs.int_list(args.ctx) if not args.dry else [256, 512]
    steps = args.steps if not args.dry else 4
    out_dir = Path(os.environ.get("OUT", "."))
    torch.manual_seed(0)
    global T0
    T0 = time.perf_counter()
    if dev.type == "cuda":
        log(torch.cuda.get_device_name(), torch.__version__)
    RES["device"] = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"

    if dev.type == "cuda":
        RES["swap_kernel_check"] = check_swap_kernel(dev)
        log("swap kernel vs reference:", RES["swap_kernel_check"])
    bw = copy_bandwidth(dev, (2 << 30) if dev.type == "cuda" else (64 << 20))
    RES["copy"] = bw
    log("copy bandwidth", {k: f"{v / 1e9:.1f} GB/s" for k, v in bw.items()})

    m = bs.build_model("tiny" if args.dry else "llama-3.2-1b", dev, dtype, max_seq_len=max(ctxs) + steps + 16)
    wbytes = RES["weight_bytes"] = weight_bytes(m)
    rows = []
    for ctx in ctxs:
        rows.append(measure_ctx(m, ctx, args, dev, dtype, steps, bw, wbytes))
        log(json.dumps(rows[-1]))
    RES["rows"] = rows
    if args.compile:
        measure_compiled(m, rows, args, dev, dtype, steps)
    try:
        page_elems = 2 * m.cfg.head_dim * 16          # K and V of one page of one kv head
        RES["migration"] = migration_bandwidth(dev, 65536 if dev.type == "cuda" else 256, page_elems, bw)
    except Exception as e:
        RES["errors"].append(f"migration: {type(e).__name__}: {e}")
        log(traceback.format_exc())
    bs.write_json(out_dir / "thermal_kv_gpu.json", RES, default=str)
    print_table(rows, bw, wbytes, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
