"""Batch-invariant products on a GPU (zeroedge.runtime.row_products) against torch's F.linear (cuBLAS):
(1) for each weight of SmolLM2-135M and of the llama-3.2-1b shape (random bf16 values), how many rows
of a product of M rows differ in any bit from the same rows computed in a product of 512 rows, for M
from 1 to 512, and the error against an fp32 product; (2) each product's time at 1-512 rows (a CUDA
graph of 20 calls, replayed; device events); (3) the decode step of `run`'s dense decoder and of the
serving engine (batch 1-64), default against invariant, at the llama-3.2-1b shape (random weights,
bf16, every sequence at --ctx); (4) whether a sequence's logits in the engine depend on the rows
beside it (SmolLM2's shape, random weights): the same sequence stepped alone and beside 1-15 others.

    PYTHONPATH=$PWD python3 benchmarks/gpu/row_products_gpu.py -o benchmarks/results/speculative/row_products_h100.json

`--configs BM,BK,BN_NARROW,BN_WIDE,STAGES;...` times the products under other tile shapes as well
(the first is the module's own; a development aid, the module keeps one).
"""
import argparse
import json

import torch
import torch.nn.functional as F

SHAPES = {"smollm2-135m": {"wqkv": (960, 576), "wo": (576, 576), "w13": (3072, 576), "w2": (576, 1536),
                           "head": (49152, 576)},
          "llama-3.2-1b": {"wqkv": (3072, 2048), "wo": (2048, 2048), "w13": (16384, 2048), "w2": (2048, 8192),
                           "head": (128256, 2048)}}
ROWS = (1, 2, 3, 4, 5, 8, 16, 17, 63, 64, 65, 128, 512)
TIMED_ROWS = (1, 4, 16, 64, 512)


def graph_ms(fn, calls: int = 20, replays: int = 10) -> float:
    """Milliseconds a call, from a CUDA graph of `calls` calls replayed `replays` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / (calls * replays)


def products(dev, configs):
    from zeroedge.runtime import row_products as RP

    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for model, shapes in SHAPES.items():
        for name, (N, K) in shapes.items():
            w = (torch.randn(N, K, device=dev, generator=g) / K ** 0.5).to(torch.bfloat16)
            x = torch.randn(512, K, device=dev, generator=g).to(torch.bfloat16)
            ref = x.float() @ w.float().t()
            full = {"row_products": RP.linear(x, w), "cublas": F.linear(x, w)}
            r = {"model": model, "weight": name, "N": N, "K": K}
            for label, fn in (("row_products", RP.linear), ("cublas", F.linear)):
                r[label + "_rel_err"] = float((full[label].float() - ref).abs().max() / ref.abs().max())
                r[label + "_rows_differing_from_512_rows"] = {
                    M: int((fn(x[:M].contiguous(), w) != full[label][:M]).any(-1).sum()) for M in ROWS}
            for ci, cfg in enumerate(configs):
                RP.BM, RP.BK, narrow, wide, RP.STAGES = cfg
                RP.BN_NARROW, RP.BN_WIDE = narrow, wide
                key = "row_products_ms" if ci == 0 else f"row_products_ms_{'_'.join(map(str, cfg))}"
                r[key] = {M: graph_ms(lambda: RP.linear(x[:M], w)) for M in TIMED_ROWS}
            RP.BM, RP.BK, RP.BN_NARROW, RP.BN_WIDE, RP.STAGES = configs[0]
            r["cublas_ms"] = {M: graph_ms(lambda: F.linear(x[:M], w)) for M in TIMED_ROWS}
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


def decoders(dev, ctx: int, steps: int = 30):
    """run's dense decoder (one step) and the engine's step (batch 1-64), default and invariant."""
    from zeroedge.model import build
    from zeroedge.runtime.fast import DenseDecoder
    from zeroedge.serve.batch import BatchStep, PagedKV, Segment

    m = build("llama-3.2-1b", seed=0).to(dev, torch.bfloat16).eval()
    out = []
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for inv in (False, True):
        d = DenseDecoder(m, ctx + steps + 8, invariant=inv)
        d.attention.kv.normal_()
        for i in range(3):
            d.step(7, ctx - 1 + i)
        torch.cuda.synchronize()
        a.record()
        for i in range(steps):
            d.step(7, ctx + 2 + i)
        b.record()
        torch.cuda.synchronize()
        out.append({"path": "run's dense decoder", "invariant": inv, "batch": 1, "step_ms": a.elapsed_time(b) / steps})
        print(json.dumps(out[-1]), flush=True)
        del d
        torch.cuda.empty_cache()
    per_seq = -(-(ctx + steps + 8) // 16)
    for inv in (False, True):
        pool = PagedKV(m.cfg, per_seq * 64, 16, dev, torch.bfloat16)
        pool.k.normal_()
        pool.v.normal_()
        step = BatchStep(m, pool, attention="paged", graphs=True, invariant=inv)
        for B in (1, 4, 16, 64):
            pages = [pool.alloc(per_seq) for _ in range(B)]
            for i in range(2):
                step.forward([Segment(p, [7], ctx - 1 + i) for p in pages])
            torch.cuda.synchronize()
            a.record()
            for i in range(steps):
                step.forward([Segment(p, [7], ctx + 1 + i) for p in pages])
            b.record()
            torch.cuda.synchronize()
            out.append({"path": "serve's engine step", "invariant": inv, "batch": B,
                        "step_ms": a.elapsed_time(b) / steps})
            print(json.dumps(out[-1]), flush=True)
            for p in pages:
                pool.release(p)
        del step, pool
        torch.cuda.empty_cache()
    return out


def batch_dependence(dev):
    """A sequence's logits stepped alone, then beside 1-15 others (SmolLM2's shape, random weights):
    how many of the batches gave it other logits, default and invariant."""
    from zeroedge.model import build
    from zeroedge.serve.batch import BatchStep, PagedKV, Segment

    m = build("smollm2-135m", seed=0).to(dev, torch.bfloat16).eval()
    res = {}
    for inv in (False, True):
        pool = PagedKV(m.cfg, 16 * 40, 16, dev, torch.bfloat16)
        pool.k.normal_()
        pool.v.normal_()
        step = BatchStep(m, pool, attention="paged", graphs=True, invariant=inv)
        pages = [pool.alloc(40) for _ in range(16)]
        alone = step.forward([Segment(pages[0], [11], 500)])[0]
        differ = 0
        for B in range(2, 17):
            got = step.forward([Segment(p, [11 + j], 500 + 3 * j) for j, p in enumerate(pages[:B])])[0]
            differ += int(not torch.equal(got, alone))
        # a verify segment's rows against plain steps at the same positions
        draft = [11, 12, 13, 14, 15]
        check = step.forward([Segment(pages[1], draft, 600, verify=True)])
        plain = torch.stack([step.forward([Segment(pages[1], [t], 600 + i)])[0] for i, t in enumerate(draft)])
        res["invariant" if inv else "default"] = {"batches_of_2_to_16_with_other_logits": differ,
                                                  "verify_rows_unequal_to_plain_steps": int((check != plain).any(-1).sum())}
        print(json.dumps(res), flush=True)
        del step, pool
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--configs", default="")
    ap.add_argument("--parts", default="products,decoders,batch")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    from zeroedge.runtime import row_products as RP

    dev = torch.device("cuda")
    configs = [(RP.BM, RP.BK, RP.BN_NARROW, RP.BN_WIDE, RP.STAGES)]
    configs += [tuple(int(v) for v in c.split(",")) for c in a.configs.split(";") if c]
    parts = a.parts.split(",")
    res = {"what": "batch-invariant products (zeroedge.runtime.row_products) against cuBLAS", "gpu":
           torch.cuda.get_device_name(), "torch": torch.__version__, "weights": "random, bf16",
           "config": dict(zip(("BM", "BK", "BN_NARROW", "BN_WIDE", "STAGES"), configs[0])), "args": vars(a)}
    if "products" in parts:
        res["products"] = products(dev, configs)
    if "batch" in parts:
        res["batch_dependence_smollm2_shape"] = batch_dependence(dev)
    if "decoders" in parts:
        res["decode_steps_llama1b_shape"] = decoders(dev, a.ctx)
    with open(a.output, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
