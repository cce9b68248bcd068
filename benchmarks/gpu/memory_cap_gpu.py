"""The device memory cap on a GPU (H200), llama-3.2-1b shape, bf16, random weights:

1. forecast vs allocation: the serving session's peak (torch.cuda.max_memory_allocated over one
   request: prefill, decoder, 16 new tokens) against zeroedge.runtime.memory.request_bytes, dense
   and thermal (10 % hot; int8 cold store as on a Jetson, and the pinned-host one of a discrete GPU);
2. the largest context served under a Jetson board's cap (its DRAM less the OS reserve and the CUDA
   runtime the planner assumes): dense KV only (release level 0) against thermal allowed (int8 /
   int4 cold), each found by the forecast and then served for real under the cap
   (ServingSession(device_memory=...) holds the CUDA allocator to it).

    PYTHONPATH=$PWD python3 benchmarks/gpu/memory_cap_gpu.py [--json OUT]
    # what memory alone allows, past llama-3.2-1b's 131K positions (random weights: a shape only):
    PYTHONPATH=$PWD python3 benchmarks/gpu/memory_cap_gpu.py --cap-only --boards orin-nano-8gb --max-seq-len 524288
    # and the cold store in a file (run --kv-spill): thermal int8 / int4 file columns
    ... --spill /path/on/disk
"""
import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_setup as bs  # noqa: E402

NEW = 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="8192,32768")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cap-only", action="store_true", help="part 2 only")
    ap.add_argument("--boards", default="orin-nano-8gb,orin-nx-16gb")
    ap.add_argument("--max-seq-len", type=int, default=None,
                    help="the model's position limit (default: the preset's, 131072)")
    ap.add_argument("--spill", default=None, help="a folder: also the cold store in a file there")
    ap.add_argument("--modes", default=None, help="only these modes (comma-separated names)")
    ap.add_argument("--at-most", type=int, default=None, help="part 2: search no prompt longer than this")
    a = ap.parse_args()
    import torch

    from zeroedge.planner import RUNTIME, TARGETS
    from zeroedge.runtime.memory import HEADROOM, request_bytes
    from zeroedge.serve.session import ServingSession

    m = bs.build_model("llama-3.2-1b", "cuda", torch.bfloat16, max_seq_len=a.max_seq_len).eval()
    cfg = m.cfg
    ServingSession(m).generate(list(range(1, 40)), 2)             # fused weights (shared storage) built
    g = torch.Generator().manual_seed(0)
    rows = []

    def measure(T, **kw):
        ids = torch.randint(0, cfg.vocab_size, (T,), generator=g).tolist()
        gc.collect()                       # the previous request's decoder (reference cycles) is gone
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        r = ServingSession(m, **kw).generate(ids, NEW)
        torch.cuda.synchronize()
        return r, torch.cuda.max_memory_allocated()

    def thermal(cold, file=False):         # (forecast kwargs, session kwargs)
        opts = {"cold": cold, **({"spill_dir": a.spill} if file else {})}
        return dict(budget=0.1, cold=cold, cold_in_file=file), dict(kv_budget=0.1, thermal_opts=opts)

    modes = {"dense": ({}, {}), "thermal int8 cold": thermal("int8"), "thermal int4 cold": thermal("int4"),
             "thermal host cold": thermal("host")}
    if a.spill:
        modes.update({"thermal int8 file": thermal("int8", True), "thermal int4 file": thermal("int4", True)})
    if a.modes:
        modes = {k: v for k, v in modes.items() if k in a.modes.split(",")}

    def served(r):
        return dict(prefill_s=round(r.prefill_s, 2), decode_tok_s=round(r.tokens_per_s, 1),
                    scheduler=r.detail.get("scheduler"))

    for T in bs.int_list(a.ctx) if not a.cap_only else []:
        for mode, (fk, kw) in modes.items():
            r, peak = measure(T, **kw)
            fc = request_bytes(cfg, 2, T, NEW, **fk)["peak"]
            rows.append({"part": "forecast", "ctx": T, "mode": mode, "measured_peak": peak, "forecast_peak": fc,
                         "forecast_over_measured": round(fc / peak, 3), "thermal": r.mechanisms["thermal_kv"],
                         **served(r)})
            print(json.dumps(rows[-1]), flush=True)

    limit = cfg.max_seq_len - NEW
    top = min(limit, a.at_most or limit)
    for board in filter(None, a.boards.split(",")):
        t = TARGETS[board]
        cap = t.memory - t.os_reserve - RUNTIME
        for mode, (fk, kw) in modes.items():
            if mode == "thermal host cold":       # a discrete GPU's store: not a Jetson's
                continue
            kw = kw or dict(release_level=0)
            lo, hi = 64, top
            while lo < hi:                                 # the largest prompt whose forecast fits
                mid = (lo + hi + 1) // 2
                if request_bytes(cfg, 2, mid, NEW, **fk)["peak"] * (1 + HEADROOM) <= cap:
                    lo = mid
                else:
                    hi = mid - 1
            row = {"part": "cap", "board": board, "cap": cap, "mode": mode, "largest_prompt": lo,
                   "limited_by": "model context" if lo == limit else "--at-most" if lo == top else "memory"}
            try:
                r, peak = measure(lo, device_memory=cap, **kw)
                row.update(served=True, measured_peak=peak, thermal=r.mechanisms["thermal_kv"], **served(r))
            except Exception as e:       # noqa: BLE001 - the row says what failed
                row.update(served=False, error=" ".join(str(e).split())[:900])
            torch.cuda.set_per_process_memory_fraction(1.0)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        bs.write_json(a.json, {"device": bs.device_info(), "rows": rows})


if __name__ == "__main__":
    main()
