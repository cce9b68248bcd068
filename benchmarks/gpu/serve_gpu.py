"""The serving engine's batched decode step on a GPU: aggregate tokens/s at batch 1..64 with every
sequence at an 8K context, beside the dense single-sequence decoder (zeroedge.runtime.fast, CUDA graph
and Triton attention) and the bandwidth roofline. Random weights at the llama-3.2-1b shape, bf16.
Engine variants (`--variants`), each timed in the same run: "graph" (what `zeroedge serve` runs: paged
Triton attention, a CUDA graph per batch size), "paged" (the same, eager), "gather" (eager, each
sequence's pages gathered, then SDPA), "graph-p8" (graph over pages of 8 positions) and "thermal"
(graph-p8 with thermal KV at `--kv-budget`: zeroedge.serve.thermal, the sketch of every sequence's
ctx - 1 prompt positions built first and timed; `zeroedge serve --kv-budget`). Every variant runs the
step's elementwise work fused (zeroedge.runtime.fused) but "graph-unfused" and "thermal-unfused", which
run it as torch ops.

    PYTHONPATH=$PWD python3 benchmarks/gpu/serve_gpu.py --ctx 8192 --batches 1,4,16,64 -o benchmarks/results/serve/gpu_llama1b_8k_batches.json

The KV of each sequence is filled with random values (a prefill would only cost time here); each
batch runs `--steps` decode steps after two warm-up steps, timed with CUDA events. Roofline: the bytes
one step must read (the weights once, each sequence's K and V once) at the memory bandwidth a copy
measures on the same GPU.
"""
import argparse
import json

import torch


def copy_bandwidth(dev) -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        y.copy_(x)
    e.record()
    torch.cuda.synchronize()
    return 2 * 10 * x.numel() / (s.elapsed_time(e) / 1e3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--variants", default="graph,paged,gather,graph-p8,thermal,graph-unfused,thermal-unfused")
    ap.add_argument("--kv-budget", type=float, default=0.1)
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    from zeroedge.model import build
    from zeroedge.runtime.fast import DenseDecoder, TorchLinears
    from zeroedge.serve.batch import BatchStep, PagedKV, Segment
    from zeroedge.serve.thermal import ThermalSketches

    dev = torch.device("cuda")
    m = build(args.model, seed=0).to(dev, torch.bfloat16).eval()
    cfg = m.cfg
    batches = [int(b) for b in args.batches.split(",")]
    variants = {"graph": dict(attention="paged", graphs=True), "paged": dict(attention="paged", graphs=False),
                "gather": dict(attention="gather", graphs=False), "graph-p8": dict(attention="paged", graphs=True),
                "thermal": dict(attention="paged", graphs=True)}
    for name in ("graph", "thermal"):           # the same with the elementwise work as torch ops
        variants[name + "-unfused"] = variants[name]
    names = args.variants.split(",")
    bw = copy_bandwidth(dev)
    wbytes = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if "embed_tokens" not in n or cfg.tie_embeddings)
    kv_seq = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2 * args.ctx
    rows = []
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for name in names:
        ps = 8 if name in ("graph-p8", "thermal", "thermal-unfused") else 16
        per_seq_pages = -(-(args.ctx + args.steps + 4) // ps)
        pool = PagedKV(cfg, per_seq_pages * max(batches), ps, dev, torch.bfloat16)
        pool.k.normal_()
        pool.v.normal_()
        hot = ThermalSketches(pool, cfg, args.kv_budget, max(batches)) if name.startswith("thermal") else None
        step = BatchStep(m, pool, hot=hot, **variants[name])
        if name.endswith("-unfused"):
            step.fused, step.lin = False, TorchLinears(m)
        for B in batches:
            pages = [pool.alloc(per_seq_pages) for _ in range(B)]
            start = args.ctx - 1
            hots, build_ms = [None] * B, None
            if hot is not None:
                torch.cuda.synchronize()
                s.record()
                hots = [hot.build(p, start) for p in pages]
                e.record()
                torch.cuda.synchronize()
                build_ms = s.elapsed_time(e) / B
            for i in range(2):
                step.forward([Segment(p, [7], start + i, hot=h) for p, h in zip(pages, hots)])
            torch.cuda.synchronize()
            s.record()
            for i in range(args.steps):
                step.forward([Segment(p, [7], start + 2 + i, hot=h) for p, h in zip(pages, hots)])
            e.record()
            torch.cuda.synchronize()
            ms = s.elapsed_time(e) / args.steps
            read = kv_seq
            if hot is not None:      # the chosen, sink and tail pages' K / V, and every scored page's sketch
                h = hots[0]
                read = (kv_seq * (h.slots + h.tail - h.scored) * ps / args.ctx
                        + cfg.n_layers * cfg.n_kv_heads * h.scored * ps * (hot.rank // 2 + 2))
            roof = (wbytes + B * read) / bw * 1e3
            rows.append({"variant": name, "batch": B, "page_size": ps, "step_ms": ms, "tokens_per_s": B / ms * 1e3,
                         "roofline_step_ms": roof, "roofline_tokens_per_s": B / roof * 1e3,
                         "kv_bytes_read_per_sequence": read, "sketch_build_ms_per_sequence": build_ms})
            print(json.dumps(rows[-1]), flush=True)
            for p, h in zip(pages, hots):
                pool.release(p)
                if hot is not None:
                    hot.drop(h)
        del step, pool, hot
        torch.cuda.empty_cache()
    # the dense single-sequence decoder (CUDA graph, Triton attention) at the same context
    d = DenseDecoder(m, args.ctx + args.steps + 4)
    d.attention.kv.normal_()
    for i in range(3):
        d.step(7, args.ctx - 1 + i)
    torch.cuda.synchronize()
    s.record()
    for i in range(args.steps):
        d.step(7, args.ctx + 2 + i)
    e.record()
    torch.cuda.synchronize()
    ms1 = s.elapsed_time(e) / args.steps
    for r in rows:
        base = next(b for b in rows if b["variant"] == r["variant"])
        r["x_engine_batch1"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["x_dense_decoder"] = r["tokens_per_s"] / (1e3 / ms1)
        r["x_roofline_batch1"] = r["roofline_tokens_per_s"] / base["roofline_tokens_per_s"]
        # against the dense batch-1 bound (the weights and one sequence's whole KV a token)
        r["roofline_x_dense_batch1"] = r["roofline_tokens_per_s"] / (bw / (wbytes + kv_seq))
    out = {"what": "batched decode step, aggregate tokens/s, every sequence at ctx", "gpu": torch.cuda.get_device_name(),
           "kv_budget": args.kv_budget,
           "model": args.model, "weights": "random, bf16", "ctx": args.ctx, "copy_bandwidth_GBps": bw / 1e9,
           "weights_bytes": wbytes, "kv_bytes_per_sequence": kv_seq, "dense_decoder_step_ms": ms1,
           "dense_decoder_tokens_per_s": 1e3 / ms1, "rows": rows}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
