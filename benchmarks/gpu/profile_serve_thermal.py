"""Where a batched thermal KV step's attention time goes, one layer at the llama-3.2-1b shape (random
bf16 K / V, every sequence at --ctx): the dense paged attention beside thermal KV's parts (query
coordinates, page scores, selection and tables, attention over the tables), each timed alone with
triton.testing.do_bench (median ms).

    PYTHONPATH=$PWD python3 benchmarks/gpu/profile_serve_thermal.py --batch 16 --ctx 8192
"""
import argparse
import json

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--scores-only", action="store_true", help="run the scoring kernel 3 times (for ncu)")
    args = ap.parse_args()
    from triton.testing import do_bench

    from zeroedge.kv import paged_attention as PA
    from zeroedge.model import PRESETS
    from zeroedge.serve.batch import PagedKV
    from zeroedge.serve.thermal import ThermalSketches

    cfg = PRESETS["llama-3.2-1b"]
    dev, B, ps = torch.device("cuda"), args.batch, 8
    per = -(-(args.ctx + 8) // ps)
    pool = PagedKV(cfg, per * B, ps, dev, torch.bfloat16)
    pool.k.normal_()
    pool.v.normal_()
    hot = ThermalSketches(pool, cfg, args.budget, B)
    pages = [pool.alloc(per) for _ in range(B)]
    hots = [hot.build(p, args.ctx - 1) for p in pages]
    host = hot.rows([(p, args.ctx, h) for p, h in zip(pages, hots)])
    r = hot.device_rows(host)
    q = torch.randn(B, cfg.n_heads, cfg.head_dim, device=dev, dtype=torch.bfloat16)
    dense = torch.tensor([p[:per] for p in pages], dtype=torch.int32, device=dev)
    lens = torch.full((B,), args.ctx, dtype=torch.int32, device=dev)
    K, V = pool.k[0], pool.v[0]
    tables = PA.paged_hot_tables(q, hot.bases[:, 0], r.sketch, hot.codes(0), hot.scales(0), r.scored_pages,
                                 r.n_scored, r.n_slots, r.tail_pages, r.slots_max, ps)
    qr = torch.empty(B, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, hot.rank, device=dev)
    if args.scores_only:
        qr = torch.randn(B, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, hot.rank, device=dev)
        for _ in range(3):
            PA.paged_sketch_lse(qr, hot.codes(0), hot.scales(0), r.scored_pages, ps, counts=r.n_scored)
        torch.cuda.synchronize()
        return
    qr_k, _ = PA._hot_kernels
    grp = cfg.n_heads // cfg.n_kv_heads
    out = {
        "dense attention": do_bench(lambda: PA.paged_attend(q, K, V, dense, lens, ps), return_mode="median"),
        "qr": do_bench(lambda: qr_k[(B * cfg.n_kv_heads,)](q, hot.bases[:, 0], hot.bases.stride(0), r.sketch, qr,
                                                           NKV=cfg.n_kv_heads, GRP=grp, GP=PA._pow2(grp),
                                                           HD=cfg.head_dim, R=hot.rank), return_mode="median"),
        "page scores": do_bench(lambda: PA.paged_sketch_lse(qr, hot.codes(0), hot.scales(0), r.scored_pages, ps,
                                                            counts=r.n_scored), return_mode="median"),
        "tables (all three)": do_bench(lambda: PA.paged_hot_tables(
            q, hot.bases[:, 0], r.sketch, hot.codes(0), hot.scales(0), r.scored_pages, r.n_scored, r.n_slots,
            r.tail_pages, r.slots_max, ps), return_mode="median"),
        "attention over the tables": do_bench(lambda: PA.paged_attend(q, K, V, tables, r.lens, ps),
                                              return_mode="median"),
    }
    ref = PA.paged_sketch_lse_ref(qr, hot.codes(0), hot.scales(0), r.scored_pages, ps)
    n = int(r.n_scored.min())
    for pb, w in ((8, 2), (8, 4), (16, 2), (16, 4), (32, 4), (32, 8)):   # pages a scoring program, warps
        PA.SKETCH_PAGES, PA.SKETCH_WARPS = pb, w
        got = PA.paged_sketch_lse(qr, hot.codes(0), hot.scales(0), r.scored_pages, ps, counts=r.n_scored)
        err = float((got[..., :n] - ref[..., :n]).abs().max())
        out[f"page scores, {pb} pages a program, {w} warps"] = (do_bench(lambda: PA.paged_sketch_lse(
            qr, hot.codes(0), hot.scales(0), r.scored_pages, ps, counts=r.n_scored), return_mode="median"), err)
    PA.SKETCH_PAGES, PA.SKETCH_WARPS = 16, 4
    for w in (4, 8, 16):
        PA.SELECT_WARPS = w
        out[f"tables, select on {w} warps"] = do_bench(lambda: PA.paged_hot_tables(
            q, hot.bases[:, 0], r.sketch, hot.codes(0), hot.scales(0), r.scored_pages, r.n_scored, r.n_slots,
            r.tail_pages, r.slots_max, ps), return_mode="median")
    print(json.dumps({"batch": B, "ctx": args.ctx, "scored_pages": int(r.n_scored[0]), "slots": int(r.n_slots[0])}))
    for k, v in out.items():           # ms (and the largest difference from the first variant's scores)
        print(k, [round(x, 5) for x in v] if isinstance(v, tuple) else round(v, 4))


if __name__ == "__main__":
    main()
