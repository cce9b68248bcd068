"""The host's part of a refresh with the cold store in a file (zeroedge.kv.host_fetch.HostFetch.read),
per decode step, when the file is in the page cache and when it is not (pushed out with
madvise(MADV_PAGEOUT), as memory pressure on a Jetson would): the llama-3.2-1b shape (16 layers, 8 kv
heads, 64-wide heads), int8 cold store, pages of 8, 4 pages fetched a kv head and layer, the pages
drawn at random. "Not in memory" pushes the whole file out before every step: a store far larger
than the memory left for it, where no page stays in memory from one step to the next (here the file
fits the measuring host's memory, and the kernel's read-around would otherwise bring most of it in after
one step). With the prefetch (shipped: madvise WILLNEED on every chosen page once reads run
slow) and without it (its threshold set out of reach).

    python benchmarks/file_tier_read.py --ctx 32768 --dir /path/on/the/disk --json benchmarks/results/thermal_kv/read_cpu_file_store_cold_disk.json
"""
import argparse
import ctypes
import ctypes.util
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

L, NKV, HD, PS, FETCH = 16, 8, 64, 8, 4
MADV_PAGEOUT, MS_SYNC = 21, 4          # Linux 5.4+


def pager(store):
    """A function that pushes the FileTensors store's mapped file out of the page cache."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    base, size = ctypes.c_void_p(store.records.data_ptr()), ctypes.c_size_t(store.nbytes)

    def page_out():
        if libc.msync(base, size, MS_SYNC) or libc.madvise(base, size, MADV_PAGEOUT):
            sys.exit(f"madvise(MADV_PAGEOUT) failed: errno {ctypes.get_errno()}")
    return page_out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--dir", required=True, help="a folder on the disk to measure (the store is made there, unlinked)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    from zeroedge.kv import host_fetch
    from zeroedge.kv.tiers import FileTensors

    n = a.ctx // PS
    store = FileTensors(a.dir, (L, NKV, n, PS), {"k": (HD, torch.int8), "v": (HD, torch.int8),
                                                 "ks": (HD // 32, torch.float16), "vs": (HD // 32, torch.float16)})
    store.records.numpy()[:] = np.random.default_rng(0).integers(0, 255, store.records.shape, dtype=np.uint8)
    page_out = pager(store)
    layers = [store.records[li].numpy() for li in range(L)]
    rng = np.random.default_rng(1)
    rows = []
    for prefetch in (True, False):
        host_fetch.PREFETCH_ON_US = 10.0 if prefetch else float("inf")
        for where in ("in memory", "not in memory"):
            hf = host_fetch.HostFetch(NKV, FETCH, store, 8, torch.device("cpu"))
            for r in layers:
                r.sum()                                  # read in
            times = []
            for _ in range(a.steps):
                if where != "in memory":
                    page_out()
                t0 = time.perf_counter()
                for li in range(L):
                    d = hf._np_decisions
                    d[:, 0, :FETCH] = rng.integers(0, n, (NKV, FETCH))
                    d[:, 1, :FETCH] = 0                  # every pair swapped
                    hf.read(layers[li])
                times.append(time.perf_counter() - t0)
            ms = sorted(times)[len(times) // 2] * 1e3
            rows.append(dict(ctx=a.ctx, prefetch=prefetch, where=where, step_ms_median=round(ms, 3),
                             step_ms=[round(t * 1e3, 3) for t in times], pages_a_step=L * NKV * FETCH,
                             prefetched_reads=hf.prefetches))
            print(json.dumps({k: rows[-1][k] for k in ("prefetch", "where", "step_ms_median", "prefetched_reads")}),
                  flush=True)
    print(f"\n| ctx {a.ctx}, {L * NKV * FETCH} pages a step | in memory, ms a step (median) | not in memory: "
          "first step, median |")
    print("|---|---|---|")
    for p in (True, False):
        c = {r["where"]: r for r in rows if r["prefetch"] == p}
        print(f"| {'with' if p else 'without'} the prefetch | {c['in memory']['step_ms_median']} | "
              f"{c['not in memory']['step_ms'][0]}, {c['not in memory']['step_ms_median']} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "command": " ".join(sys.argv)}, indent=1))


if __name__ == "__main__":
    main()
