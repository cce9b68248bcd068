"""Prefill wall time, dense vs zero (PAD compaction through zeroedge's own ZeroMLP), on a GPU.

Real shapes, random weights (real weights cannot travel to the rented GPU; the tokens skipped per
layer are the shipped SmolLM2 artifact's calibrated rates, mapped by relative depth). Reports the
FFN FLOP saving, the wall-time saving and their ratio (target: wall >= 80 % of FLOPs).

  python benchmarks/gpu/prefill_zero_gpu.py      (skips without CUDA)
"""
import json
import statistics
import sys

import bench_setup as bs

ARTIFACT = bs.ROOT / "zeroedge/data/smollm2-135m.calib/calib.json"


class _CpuEvent:
    def __init__(self, **kw):
        self.t = 0.0

    def record(self):
        import time
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def measure(name, T, rates, dev, dry) -> dict:
    """Dense vs zero prefill of T tokens on a random-weight model of preset `name`."""
    import torch

    from zeroedge import model as M
    from zeroedge.mechanisms.pad import LayerPolicy, ZeroRuntime, flops_summary, install, remove

    cfg = M.PRESETS[name]
    m = M.build(cfg, dtype=torch.bfloat16, seed=0).to(dev)
    L = cfg.n_layers
    layer_rates = {i: rates[min(int(i * len(rates) / L), len(rates) - 1)] for i in range(L)}
    layer_rates[L - 1] = 1.0  # final layer: the prompt's FFN output is never read (exact)
    ids = torch.randint(0, cfg.vocab_size, (1, T), device=dev)
    rt = ZeroRuntime()
    install(m, {i: LayerPolicy(scorer="random", rate=r) for i, r in layer_rates.items() if r > 0}, rt)

    def run(zero):
        rt.active = zero
        with torch.inference_mode():
            m.hidden_states(ids)

    times = {True: [], False: []}
    for zero in (False, True):
        run(zero)
    for _ in range(2 if dry else 15):
        for zero in (False, True):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            s.record()
            run(zero)
            e.record()
            torch.cuda.synchronize()
            times[zero].append(s.elapsed_time(e))
    rt.reset_stats()
    run(True)
    fs = flops_summary(m, rt)
    remove(m)
    d, z = statistics.median(times[False]), statistics.median(times[True])
    ffn_share = 6 * cfg.dim * cfg.ffn_dim / (6 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 2 * cfg.n_heads * cfg.head_dim * T)
    flop_saving = fs["ffn_flops_skipped_gross"] * ffn_share
    wall_saving = 1 - z / d
    del m
    torch.cuda.empty_cache()
    return dict(model=name, T=T, dense_ms=d, zero_ms=z, speedup=d / z,
                ffn_skipped=fs["ffn_flops_skipped_gross"], flop_saving=flop_saving,
                wall_saving=wall_saving, ratio=wall_saving / flop_saving)


def main(argv=None):
    ap = bs.parser(__doc__)
    ap.add_argument("--dry", action="store_true", help="CPU smoke run of the script itself, tiny sizes")
    dry = ap.parse_args(argv).dry
    if not bs.cuda_or_skip("SKIP: no CUDA device", dry=dry):
        return 0
    import torch

    rates = [l["skip_rate"] for l in json.loads(ARTIFACT.read_text())["layers"]]
    dev = torch.device("cpu" if dry else "cuda")
    if dry:
        torch.cuda.Event = _CpuEvent
        torch.cuda.synchronize = lambda: None
    shapes = (("tiny", 96),) if dry else (("smollm2-135m", 3072), ("llama-3.2-1b", 3072), ("llama-3.2-1b", 8192))
    rows = [measure(name, T, rates, dev, dry) for name, T in shapes]
    print(json.dumps(rows))
    print(f"{'model':14} {'T':>5} {'dense ms':>9} {'zero ms':>8} {'x':>5} {'FFN skip':>8} {'FLOP save':>9} {'wall save':>9} {'wall/FLOP':>9}")
    for r in rows:
        print(f"{r['model']:14} {r['T']:5d} {r['dense_ms']:9.2f} {r['zero_ms']:8.2f} {r['speedup']:5.2f} "
              f"{r['ffn_skipped']:8.1%} {r['flop_saving']:9.1%} {r['wall_saving']:9.1%} {r['ratio']:9.2f}")
    print("cpu dry run" if dry else torch.cuda.get_device_name())
    return 0


if __name__ == "__main__":
    sys.exit(main())
