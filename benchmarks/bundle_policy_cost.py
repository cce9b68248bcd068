"""What the bundle runners' thermal policy (zeroedge.kv.ort_policy.OrtThermalPolicy) costs a decode
step on the CPU, by context: its own bookkeeping (score every page by the step's queries, pick a
victim, fetch and store pages) against the decode graph's run at that window.

The policy is driven as OrtRunner drives it (prefill, then slot_for / after_step each step) with
random K/V and queries in the model's shape: its cost depends on the shape and the page count, not
on the values. The window is what serving gives a request (10 % of the prompt plus its new tokens,
--new). The graph (optional, --bundle) runs at that window, filled with random K/V, so it needs no
long prefill.

    python benchmarks/bundle_policy_cost.py --ctx 4096,8192,32768,131072 --bundle B \
        --json benchmarks/results/thermal_kv/cost_cpu_bundle_policy_step.json
    # A/B against another version of the policy module:
    git show REV:zeroedge/kv/ort_policy.py > /tmp/old_policy.py
    python benchmarks/bundle_policy_cost.py ... --policy-module /tmp/old_policy.py
    # the plot of both runs' JSON (no measuring):
    python benchmarks/bundle_policy_cost.py --plot benchmarks/results/thermal_kv/cost_cpu_bundle_policy_step.png \
        --from BEFORE.json,benchmarks/results/thermal_kv/cost_cpu_bundle_policy_step.json
"""
import argparse
import importlib.util
import json
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
SHAPES = {"smollm2-135m": dict(L=30, nkv=3, H=9, hd=64), "llama-3.2-1b": dict(L=16, nkv=8, H=32, hd=64)}


def window_runner(L, nkv, hd, slots, pos, sinks=4):
    """The arrays and fields OrtRunner gives its policy (float32 window)."""
    r = types.SimpleNamespace(L=L, nkv=nkv, hd=hd, slots=slots, sinks=sinks, pos=pos, last_query=None)
    r.k = [np.zeros((1, nkv, slots, hd), np.float32) for _ in range(L)]
    r.v = [np.zeros((1, nkv, slots, hd), np.float32) for _ in range(L)]
    r.slot_pos = np.full((1, slots), -1, np.int64)
    r.heat = np.zeros(slots)
    return r


def policy_cost(policy_cls, shape, ctx, budget, new, steps, seed=0):
    """Median ms a step of slot_for + after_step after a `ctx`-token prefill, and pages moved."""
    L, nkv, H, hd = shape["L"], shape["nkv"], shape["H"], shape["hd"]
    rng = np.random.default_rng(seed)
    pol = policy_cls()
    slots = pol.window_pages(4, budget, ctx, new) * pol.P
    r = window_runner(L, nkv, hd, slots, ctx)
    pol.reset(r)
    kv = [rng.standard_normal((1, nkv, ctx, hd), np.float32) for _ in range(2 * L)]
    t0 = time.perf_counter()
    pol.prefill(r, kv, rng.random((1, L, ctx)).astype(np.float32), ctx)
    prefill_s = time.perf_counter() - t0
    del kv
    times = []
    for _ in range(steps):
        r.last_query = rng.standard_normal((1, L, H, hd), np.float32)
        fresh = [rng.standard_normal((1, nkv, 1, hd), np.float32) for _ in range(2 * L)]
        out = [None, *fresh, r.last_query, rng.random((1, L, slots), np.float32)]
        t0 = time.perf_counter()
        s = pol.slot_for(r, out)
        for i in range(L):
            r.k[i][0, :, s], r.v[i][0, :, s] = fresh[2 * i][0, :, 0], fresh[2 * i + 1][0, :, 0]
        r.slot_pos[0, s] = r.pos
        r.pos += 1
        pol.after_step(r)
        times.append(time.perf_counter() - t0)
    return {"slots": slots, "policy_ms": 1e3 * float(np.median(times[2:])), "policy_prefill_s": prefill_s,
            "pages_moved": pol.migrated}


def graph_cost(bundle, slots, steps, threads):
    """Median ms of the decode graph's run (OrtRunner.step without a policy) over a full random window."""
    from zeroedge.backends.onnxruntime import OrtRunner

    r = OrtRunner(bundle, slots=slots, threads=threads)
    rng = np.random.default_rng(0)
    for i in range(r.L):
        r.k[i][...] = rng.standard_normal(r.k[i].shape).astype(r.k[i].dtype)
        r.v[i][...] = rng.standard_normal(r.v[i].shape).astype(r.v[i].dtype)
    r.slot_pos[0] = np.arange(slots)          # only validity enters the graph (keys carry their RoPE)
    r.pos = 1000                              # within the model's positions whatever the window
    times = []
    for j in range(steps):
        r.slot_pos[0, j % slots] = -1                             # the step writes a free slot
        t0 = r.timings["decode_s"]
        r.step(1)
        times.append(r.timings["decode_s"] - t0)
    return 1e3 * float(np.median(times[2:]))


def plot(png, files):
    """ms a step against the prompt, one line per (JSON file, shape), log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for f, style in zip(files, ("--", "-", ":", "-.")):
        rows = json.loads(Path(f).read_text())
        for shape in dict.fromkeys(r["shape"] for r in rows):
            pts = [(r["ctx"], r["policy_ms"]) for r in rows if r["shape"] == shape]
            ax.plot(*zip(*pts), style, marker="o", label=f"{shape}, {Path(f).stem}")
        graph = [(r["ctx"], r["graph_ms"]) for r in rows if "graph_ms" in r]
        if graph and f == files[-1]:
            ax.plot(*zip(*graph), "k:", marker="s", label="SmolLM2 fp32 decode graph (onnxruntime)")
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens (window: 10 % + 1024 new)",
           ylabel="ms a decode step (host CPU)", title="OrtThermalPolicy's own work a step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="4096,8192,32768,131072")
    ap.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--new", type=int, default=1024, help="new tokens a request asks for (the window holds them)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--bundle", default=None, help="SmolLM2 bundle: also time its decode graph at each window")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--policy-module", default=None, help="a file holding another OrtThermalPolicy")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="write a PNG of the --from JSON files instead of measuring")
    ap.add_argument("--from", dest="sources", default=None, help="JSON files for --plot, comma-separated")
    a = ap.parse_args()
    if a.plot:
        if not (a.sources or a.json):
            ap.error("--plot needs --from FILE[,FILE] (or --json FILE)")
        plot(a.plot, (a.sources or a.json).split(","))
        return
    if a.policy_module:
        spec = importlib.util.spec_from_file_location("policy_under_test", a.policy_module)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    else:
        from zeroedge.kv import ort_policy as mod
    rows = []
    for name in a.shapes.split(","):
        for ctx in map(int, a.ctx.split(",")):
            row = {"shape": name, "ctx": ctx, "policy": a.policy_module or "zeroedge.kv.ort_policy",
                   **policy_cost(mod.OrtThermalPolicy, SHAPES[name], ctx, a.budget, a.new, a.steps)}
            if a.bundle and name == "smollm2-135m":
                row["graph_ms"] = graph_cost(a.bundle, row["slots"], 12, a.threads)
                row["policy_per_graph"] = row["policy_ms"] / row["graph_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
