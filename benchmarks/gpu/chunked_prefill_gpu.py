"""The serving prefill in chunks (zeroedge.model.chunked_prefill) against one pass on a GPU:
the same K/V, and the peak memory of each (random weights, llama-3.2-1b shape, bf16).

    PYTHONPATH=$PWD python3 benchmarks/gpu/chunked_prefill_gpu.py
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_setup as bs  # noqa: E402


def main():
    import torch

    from zeroedge.model import chunked_prefill

    m = bs.build_model("llama-3.2-1b", "cuda", torch.bfloat16)
    for T in (8192, 32768):
        ids = torch.randint(0, m.cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(0)).tolist()
        row = {"tokens": T}
        kv = {}
        for chunk in (T, 2048):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            kv[chunk] = chunked_prefill(m, ids, chunk)
            torch.cuda.synchronize()
            row[f"peak_extra_gib_chunk{chunk}"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
        a, b = kv[T], kv[2048]
        row["kv_max_rel_diff"] = max(float((x.float() - y.float()).norm() / y.float().norm())
                                     for x, y in zip([*a[0], *a[1]], [*b[0], *b[1]]))
        print(json.dumps(row), flush=True)
        del kv, a, b


if __name__ == "__main__":
    main()
