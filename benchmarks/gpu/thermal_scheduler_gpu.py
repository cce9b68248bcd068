"""The bandwidth scheduler in the thermal decode loop, under a competing copy load: a second process
copies 1 GiB buffers back to back on the same GPU while a thermal request decodes. Reports refreshes
done and deferred, the utilisation the scheduler saw, and tok/s, with and without the load
(random weights, smollm2-135m shape, bf16, 10 % hot of a 4096-token prompt).

    PYTHONPATH=$PWD python3 benchmarks/gpu/thermal_scheduler_gpu.py
"""
import json
import subprocess
import sys
import time

LOAD = ("import torch, time\n"
        "a = torch.empty(1 << 30, dtype=torch.uint8, device='cuda'); b = torch.empty_like(a)\n"
        "t = time.time()\n"
        "while time.time() - t < float(__import__('sys').argv[1]):\n"
        "    b.copy_(a)\n"
        "torch.cuda.synchronize()\n")


def run_once(m, ids, label):
    from zeroedge.serve.session import ServingSession

    s = ServingSession(m, kv_budget=0.1, page_size=16)
    r = s.generate(ids, 128).to_dict()
    sch = r["scheduler"]
    row = {"case": label, "tok_s": round(r["tokens_per_s"], 1), "refreshes": sch["refreshes"],
           "deferred": sch["deferred"], "utilization_at_end": sch["utilization"]}
    print(json.dumps(row), flush=True)
    return row


def main():
    import torch

    from zeroedge.model import build

    m = build("smollm2-135m", seed=0).eval().to("cuda", torch.bfloat16)
    ids = torch.randint(0, m.cfg.vocab_size, (4096,), generator=torch.Generator().manual_seed(0)).tolist()
    run_once(m, ids, "warm-up")
    run_once(m, ids, "idle GPU")
    load = subprocess.Popen([sys.executable, "-c", LOAD, "60"])
    time.sleep(5)                                   # the load is running (NVML samples over ~1 s)
    try:
        run_once(m, ids, "competing 1 GiB copies")
    finally:
        load.terminate()
        load.wait()


if __name__ == "__main__":
    main()
