"""The serving session on a CUDA GPU: the decoders it picks run there (CUDA graphs), agree with
CPU where they must, and what a request gets (tokens/s, device KV bytes, pages migrated).

    python benchmarks/serving_gpu.py            # on a CUDA machine; writes gpu_run_llama1b_dense_thermal.json to $OUT

1. tiny model (fp32, TF32 off): session dense on CUDA == on CPU; thermal at budget 1 == dense;
   paths (magnitude rule, Triton) and thermal + paths run.
2. llama-3.2-1b shape, random bf16 weights: a prompt of CTX - 64 tokens, 64 new, dense vs
   thermal 10 % through ServingSession (the same request, side by side).
"""
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from zeroedge import model as M  # noqa: E402
from zeroedge.serve.session import ServingSession  # noqa: E402


def lively():
    m = M.build("tiny", seed=0)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.mul_(8)
    return m


def main():
    if not torch.cuda.is_available():
        print("skip: no CUDA device")
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    res = {"gpu": torch.cuda.get_device_name()}
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(4)).tolist()
    cpu = ServingSession(lively()).generate(ids, 24).tokens
    mg = lively().cuda()
    dense = ServingSession(mg).generate(ids, 24)
    th = ServingSession(mg, kv_budget=1.0, page_size=8).generate(ids, 24)
    from zeroedge import calib_artifact

    d = Path(tempfile.mkdtemp())
    meta = {"model": {"name": "tiny", "config": mg.cfg.to_dict()}, "layers": [], "sih": {},
            "paths": {"predictor": {"kind": "input-magnitude"},
                      "layers": [{"index": i, "sparse": i in (0, 2)} for i in range(4)]}}
    t = {f"layers.{i}.paths.{n}": torch.tensor([v]) for i in (0, 2)
         for n, v in (("threshold_in", 0.5), ("threshold_act", 0.01))}
    calib_artifact.save(d / "a", meta, t)
    pa = ServingSession(mg, artifact=d / "a").generate(ids, 24)
    tp = ServingSession(mg, artifact=d / "a", kv_budget=1.0, page_size=8).generate(ids, 24)
    res["tiny"] = {"dense_cuda_eq_cpu": dense.tokens == cpu, "thermal_b1_eq_dense": th.tokens == dense.tokens,
                   "paths_decoder": pa.detail["decoder"], "thermal_paths_decoder": tp.detail["decoder"],
                   "thermal_paths_eq_paths": tp.tokens == pa.tokens}
    print(json.dumps(res["tiny"]), flush=True)

    cfg = M.PRESETS["llama-3.2-1b"]
    with torch.device("cuda"):
        m = M.build(cfg, dtype=torch.bfloat16, seed=0)
    m = m.to("cuda", torch.bfloat16).eval()
    rows = []
    for ctx in (8192, 32768):
        prompt = torch.randint(0, cfg.vocab_size, (ctx - 64,), generator=torch.Generator().manual_seed(ctx)).tolist()
        for name, kw in (("dense", {}), ("thermal 10%", {"kv_budget": 0.1})):
            s = ServingSession(m, **kw)
            s.generate(prompt[:512], 8)                           # warm-up (kernels, allocator)
            t0 = time.perf_counter()
            r = s.generate(prompt, 64)
            wall = time.perf_counter() - t0
            rows.append({"ctx": ctx, "config": name, "decoder": r.detail["decoder"],
                         "tokens_per_s": r.tokens_per_s, "prefill_s": r.prefill_s, "request_s": wall,
                         "device_kv_bytes": r.device_kv_bytes, "full_kv_bytes": r.full_kv_bytes,
                         "pages_migrated": r.pages_migrated,
                         "migrated_bytes": r.detail.get("migrated_bytes", 0)})
            print(json.dumps(rows[-1]), flush=True)
            del s, r
            torch.cuda.empty_cache()
    res["llama-3.2-1b"] = rows
    out = Path(os.environ.get("OUT", "."))
    (out / "gpu_run_llama1b_dense_thermal.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
