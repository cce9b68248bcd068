"""Where a serving request's device memory goes, on a CUDA GPU (llama-3.2-1b shape, bf16, random
weights): for each context and mode, one request (prompt + 16 new tokens) through a fresh
ServingSession, then
- its allocated and reserved peaks beside zeroedge.runtime.memory.request_bytes' forecast;
- with --history, what was alive at the allocated peak, summed by the zeroedge line that made it
  (torch.cuda.memory._record_memory_history over the request);
- what the request left allocated once it returned (after gc and empty_cache): a serving process
  must not grow from one request to the next.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD python3 benchmarks/gpu/memory_peak_gpu.py \\
        --ctx 65536,131072 --modes int8-file --spill /tmp/spill --history [--json OUT]

Modes: dense, host, int8, int4 (thermal KV at 10 % hot with that cold store), int8-file, int4-file
(the cold store mapped from a file in --spill).
"""
from __future__ import annotations

import collections
import gc

import bench_setup as bs

NEW = 16


def _site(frames) -> str:
    """The innermost zeroedge line of an allocation's Python stack."""
    for f in frames:
        if "/zeroedge/" in f["filename"]:
            return f"{f['filename'].split('/zeroedge/')[-1]}:{f['line']}:{f['name']}"
    return "(outside zeroedge)"


def live_at_peak(events) -> dict:
    """Replays the allocation events recorded over a request: its own highest point (what was
    allocated before it, the weights, is not in the events) and what was alive there, by site."""
    live, total, best, at = {}, 0, -1, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > best:
                best, at = total, i
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])
    alive = {}
    for e in events[:at + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        elif e["action"] == "free_completed":
            alive.pop(e["addr"], None)
    by = collections.Counter()
    for e in alive.values():
        by[_site(e.get("frames", []))] += e["size"]
    return {"request_bytes": best, "by_site": by.most_common(12)}


def main(argv=None):
    ap = bs.parser(__doc__)
    bs.add_ctx(ap, "65536,131072")
    ap.add_argument("--modes", default="dense,int8,int8-file")
    ap.add_argument("--spill", default="/tmp/spill", help="folder for the file cold store")
    ap.add_argument("--history", action="store_true", help="record allocations: what is alive at the peak")
    ap.add_argument("--max-seq-len", type=int, default=524288)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not bs.cuda_or_skip("SKIP: needs CUDA"):
        return
    import torch

    from zeroedge.runtime.memory import request_bytes
    from zeroedge.serve.session import ServingSession

    m = bs.build_model("llama-3.2-1b", "cuda", torch.bfloat16, max_seq_len=a.max_seq_len).eval()
    ServingSession(m).generate(list(range(1, 40)), 2)                 # fused weights built once
    g = torch.Generator().manual_seed(0)
    rows = []
    for T in bs.int_list(a.ctx):
        for mode in a.modes.split(","):
            cold, file = mode.split("-")[0], mode.endswith("-file")
            fk = {} if mode == "dense" else dict(budget=0.1, cold=cold, cold_in_file=file)
            opts = {"cold": cold, **({"spill_dir": a.spill} if file else {})}
            kw = {} if mode == "dense" else dict(kv_budget=0.1, thermal_opts=opts)
            ids = torch.randint(0, m.cfg.vocab_size, (T,), generator=g).tolist()
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            if a.history:
                torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
            try:
                r = ServingSession(m, **kw).generate(ids, NEW)
                torch.cuda.synchronize()
                events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()] if a.history else []
            finally:
                if a.history:
                    torch.cuda.memory._record_memory_history(enabled=None)
            peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            fc = request_bytes(m.cfg, 2, T, NEW, **fk)
            row = {"ctx": T, "mode": mode, "allocated_peak": peak, "reserved_peak": reserved, "forecast": fc,
                   "forecast_over_peak": round(fc["peak"] / peak, 4), "reserved_over_peak": round(reserved / peak, 3),
                   "prefill_s": round(r.prefill_s, 1), "decode_tok_s": round(r.tokens_per_s, 1)}
            if a.history:
                row["at_peak"] = live_at_peak(events)
            r = events = None
            gc.collect()
            torch.cuda.empty_cache()
            row["left_allocated"] = torch.cuda.memory_allocated() - before
            rows.append(row)
            print({k: v for k, v in row.items() if k != "forecast"}, flush=True)
    if a.json:
        bs.write_json(a.json, {"device": bs.device_info(), "rows": rows})


if __name__ == "__main__":
    main()
