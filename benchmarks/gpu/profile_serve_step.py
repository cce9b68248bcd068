"""Where a captured engine step's time goes: the serving engine's decode step (zeroedge.serve.batch,
the graph `zeroedge serve` replays) at --batch rows, every sequence at --ctx, random bf16 weights at
the llama-3.2-1b shape, dense (pages of 8) and with thermal KV at --kv-budget, each with the
elementwise work fused (zeroedge.runtime.fused, what `zeroedge serve` runs) and as torch ops. torch.profiler over
--steps replays: the step's wall time (CUDA events), its kernels (count and summed time), and the
kernels by summed time; the difference between the wall time and the kernels' time is what the
launches cost inside the graph.

    PYTHONPATH=$PWD python3 benchmarks/gpu/profile_serve_step.py --batch 16 --ctx 8192 -o OUT.json
"""
import argparse
import json
from collections import defaultdict

import torch


def profile(run, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile as tprofile

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(steps):
        run()
    e.record()
    torch.cuda.synchronize()
    wall = s.elapsed_time(e) / steps
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    by_name, n, total = defaultdict(lambda: [0, 0.0]), 0, 0.0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            by_name[ev.name][0] += 1
            by_name[ev.name][1] += us
            n += 1
            total += us
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]
    return {"step_ms": wall, "kernels_per_step": n / steps, "kernel_ms_per_step": total / steps / 1e3,
            "top": [{"kernel": k[:90], "per_step": c / steps, "ms_per_step": t / steps / 1e3} for k, (c, t) in top]}


def show(name, r):
    print(name, json.dumps({k: v for k, v in r.items() if k != "top"}), flush=True)
    for t in r["top"]:
        print("   ", json.dumps(t))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kv-budget", type=float, default=0.1)
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    from zeroedge.model import build
    from zeroedge.runtime.fast import DenseDecoder, TorchLinears
    from zeroedge.serve.batch import BatchStep, PagedKV, Segment
    from zeroedge.serve.thermal import ThermalSketches

    dev, B, ps = torch.device("cuda"), args.batch, 8
    m = build("llama-3.2-1b", seed=0).to(dev, torch.bfloat16).eval()
    per = -(-(args.ctx + 8) // ps)
    out = {"gpu": torch.cuda.get_device_name(), "batch": B, "ctx": args.ctx, "weights": "random, bf16",
           "model": "llama-3.2-1b", "variants": {}}
    for name in ("dense, unfused", "dense", "thermal, unfused", "thermal"):
        pool = PagedKV(m.cfg, per * B, ps, dev, torch.bfloat16)
        pool.k.normal_()
        pool.v.normal_()
        hot = ThermalSketches(pool, m.cfg, args.kv_budget, B) if name.startswith("thermal") else None
        step = BatchStep(m, pool, hot=hot, attention="paged", graphs=True)
        if name.endswith("unfused"):      # the elementwise work as torch ops (zeroedge.runtime.fused off)
            step.fused, step.lin = False, TorchLinears(m)
        pages = [pool.alloc(per) for _ in range(B)]
        hots = [hot.build(p, args.ctx - 1) for p in pages] if hot else [None] * B
        segments = [Segment(p, [7], args.ctx - 1, hot=h) for p, h in zip(pages, hots)]
        out["variants"][name] = profile(lambda: step.forward(segments), args.steps)
        show(name, out["variants"][name])
        del step, pool, hot
        torch.cuda.empty_cache()
    d = DenseDecoder(m, args.ctx + 8)           # `run`'s single-sequence decoder, for comparison
    d.attention.kv.normal_()
    out["variants"]["dense decoder, batch 1"] = profile(lambda: d.step(7, args.ctx - 1), args.steps)
    show("dense decoder, batch 1", out["variants"]["dense decoder, batch 1"])
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
