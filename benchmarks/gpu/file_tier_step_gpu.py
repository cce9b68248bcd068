"""Where a decode step with the cold store in a file goes, on a CUDA GPU (llama-3.2-1b shape, random
weights, 10 % hot, int8 cold store; 96 new tokens after a random prompt): tokens/s with the store in
device memory and in a file, and per host read (one a layer of a refresh step) the seconds the host
waits for the device's piece, the seconds it reads pages, and a piece's replay call. The host's part
is timed by wrapping ThermalAttention.host_read with the same two calls.

    PYTHONPATH=$PWD python3 benchmarks/gpu/file_tier_step_gpu.py 32768,131072 [OUT.json]
"""
import gc
import json
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_setup as bs  # noqa: E402
from zeroedge.kv.attention import ThermalAttention
from zeroedge.serve.session import ServingSession

CTX = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "32768").split(",")]
NEW = 96
spill = tempfile.mkdtemp(prefix="zeroedge-spill-")
m = bs.build_model("llama-3.2-1b", "cuda", torch.bfloat16, max_seq_len=262144).eval()
ServingSession(m).generate(list(range(1, 40)), 2)
g = torch.Generator().manual_seed(0)
orig_host_read = ThermalAttention.host_read
orig_replay = torch.cuda.CUDAGraph.replay
T = {"sync": 0.0, "read": 0.0, "replay": 0.0, "n": 0, "nrep": 0}

def timed_replay(self):
    t0 = time.perf_counter(); orig_replay(self); T["replay"] += time.perf_counter() - t0; T["nrep"] += 1

def host_read(self, li):
    t0 = time.perf_counter()
    torch.cuda.current_stream().synchronize()
    t1 = time.perf_counter()
    self.host_fetch.read(self._cold_np[li])
    t2 = time.perf_counter()
    T["sync"] += t1 - t0; T["read"] += t2 - t1; T["n"] += 1

rows = []
for ctx in CTX:
    ids = torch.randint(0, m.cfg.vocab_size, (ctx,), generator=g).tolist()
    for name, file, hr in (("int8 cold (device)", False, None), ("file", True, host_read), ("file again", True, host_read),
                           ("int8 cold again", False, None)):
        gc.collect(); torch.cuda.empty_cache()
        ThermalAttention.host_read = hr or orig_host_read
        torch.cuda.CUDAGraph.replay = timed_replay
        for k in T: T[k] = 0 if k in ("n", "nrep") else 0.0
        opts = {"cold": "int8", **({"spill_dir": spill} if file else {})}
        r = ServingSession(m, kv_budget=0.1, thermal_opts=opts).generate(ids, NEW)
        row = dict(ctx=ctx, mode=name, tok_s=round(r.tokens_per_s, 1), step_ms=round(1e3 / r.tokens_per_s, 3),
                   reads=T["n"], per_read_us={k: round(T[k] / max(1, T["n"]) * 1e6, 1) for k in ("sync", "read")},
                   replay_us=round(T["replay"] / max(1, T["nrep"]) * 1e6, 1), nrep=T["nrep"],
                   sched=r.detail.get("scheduler"))
        rows.append(row); print(json.dumps(row), flush=True)
ThermalAttention.host_read = orig_host_read
torch.cuda.CUDAGraph.replay = orig_replay
shutil.rmtree(spill, ignore_errors=True)
if len(sys.argv) > 2:
    json.dump(rows, open(sys.argv[2], "w"), indent=1)
print("| ctx | mode | tok/s | step ms | sync us | read us | replay us |")
for r in rows:
    print(f"| {r['ctx']} | {r['mode']} | {r['tok_s']} | {r['step_ms']} | {r['per_read_us']['sync']} | {r['per_read_us']['read']} | {r['replay_us']} |")
