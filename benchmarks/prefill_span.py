"""What the prefill into a cold store in a file reads, a chunk at a time against a span at a time
(zeroedge.model.chunked_prefill, QuantKVCache.hold): one layer of the llama-3.2-1b shape (8 kv heads,
64-wide heads), int8 codes, chunks of 2048, the layer's side of the prefill only (its writes of each
chunk's codes, and its reads and dequantization of the past; no attention, no weights: what a
span saves does not depend on them). "span 2048" reads the past once a chunk, as the token-major
loop did; "span 16384" is the shipped PREFILL_SPAN. "Not in memory" pushes the file out of the page
cache before every read of the past (madvise(MADV_PAGEOUT)), as on a Jetson whose store outgrows the
memory left for it; "in memory": the page cache holds the whole store.

    python benchmarks/prefill_span.py --ctx 32768,131072 --dir /path/on/the/disk --json benchmarks/results/prefill/span_cold_store_file_reads.json
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from file_tier_read import pager  # noqa: E402

NKV, HD, PS, CHUNK = 8, 64, 8, 2048


def prefill_layer(P: int, span: int, folder: str, page_out: bool) -> dict:
    import torch

    from zeroedge.kv.tiers import FileTensors, QuantKVCache

    store = FileTensors(folder, (NKV, P // PS, PS), {"k": (HD, torch.int8), "ks": (HD // 32, torch.float16),
                                                    "v": (HD, torch.int8), "vs": (HD // 32, torch.float16)})
    t = {n: x.view(NKV, P, -1) for n, x in store.tensors.items()}
    cache = QuantKVCache(t["k"], t["ks"], t["v"], t["vs"], 8, 32, torch.bfloat16, track_queries=False,
                         device="cpu", records=(store.records.view(NKV, P, -1), store.offsets))
    page_out = pager(store) if page_out else None
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 1, NKV, CHUNK, HD, generator=g).to(torch.bfloat16)
    span = max(1, span // CHUNK) * CHUNK
    t0 = time.perf_counter()
    for a in range(0, P, span):
        if page_out:
            page_out()
        cache.hold(a, min(P, a + span))
        for s in range(a, min(P, a + span), CHUNK):
            n = min(CHUNK, P - s)
            cache.update(s, kv[0, :, :, :n], kv[1, :, :, :n])
        cache.release()
    seconds = time.perf_counter() - t0
    record, read = store.records.shape[-1], cache.read_positions
    del cache, store, t
    return {"ctx": P, "span": span, "where": "in memory" if page_out is None else "not in memory", "seconds": round(seconds, 3),
            "positions_read": read, "bytes_read": read * NKV * record}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="32768,131072")
    ap.add_argument("--dir", required=True, help="a folder on the disk to measure (the store is made there, unlinked)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    for P in (int(c) for c in a.ctx.split(",")):
        for where in (False, True):
            for span in (CHUNK, 16384):
                rows.append(prefill_layer(P, span, a.dir, where))
                print(json.dumps(rows[-1]), flush=True)
    print("\n| one layer, 1B shape | span | where | past read | seconds | × |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        base = next(b for b in rows if b["ctx"] == r["ctx"] and b["where"] == r["where"] and b["span"] == CHUNK)
        print(f"| {r['ctx']:,} | {r['span']} | {r['where']} | {r['bytes_read'] / 2**30:.2f} GiB | {r['seconds']} | "
              f"{base['seconds'] / r['seconds']:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "command": " ".join(sys.argv)}, indent=1))


if __name__ == "__main__":
    main()
