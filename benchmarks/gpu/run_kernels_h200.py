"""One run on a CUDA GPU (written for the H200): build the plugin kernels, check every kernel against
the PyTorch reference, then time them.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu/run_kernels_h200.py [--out DIR] [--arch sm_90]
    python3 benchmarks/gpu/run_kernels_h200.py --plot results.json benchmarks/results/plugins/h200_sih_pad_kernels.png

Timing: CUDA graphs of 8 iterations over 8 rotating input sets (more bytes than the 60 MB L2),
3 warm-up replays, then the median of 25 timed replays (device events), divided by 8.
Measured in one run: copy bandwidth; SIH per layer at T=4096, hidden 2048 against the dense decoder
layer (attention + SwiGLU FFN 8192, fp16) and against its FFN alone; gather + FFN(K rows) + scatter
against the dense FFN at 30 / 50 / 70 % kept. Writes results.json and plugins.md to --out.
The kernels' ctypes binding and checks: device_tests/kernels_ctypes.py (shared with the GPU tests).
"""
from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import bench_setup as bs

kc = bs.kernels_ctypes()  # light: ctypes and subprocess only

NSETS, WARM, REPS = 8, 3, 25
T, D, FF, H = 4096, 2048, 8192, 16   # the dense layer, hidden 2048
W, R = 2, 16  # SIH: the widest head under the 12 KB fp16 budget at D = 2048 (zeroedge.mechanisms.sih.head_width)


def parse_args(argv=None):
    ap = bs.parser(__doc__)
    bs.add_out(ap, "/tmp/zeroedge_bench")
    ap.add_argument("--arch", default="sm_90", help="nvcc architecture (default sm_90)")
    ap.add_argument("--plot", nargs=2, metavar=("RESULTS_JSON", "PNG"),
                    help="only draw benchmarks/results/plugins/h200_sih_pad_kernels.png from a results.json (no GPU needed)")
    return ap.parse_args(argv)


def graph_time(fn, nsets=NSETS):
    """Median seconds per call of fn(i) for i in range(nsets), captured into one CUDA graph;
    also (min, max)."""
    def body():
        for i in range(nsets):
            fn(i)

    g = bs.cuda_graph(body, warmup=1)   # eager warm-up first (allocations, cuBLAS handles)
    ts = [t / 1e3 / nsets for t in bs.event_ms(g.replay, REPS, warm=WARM)]
    return statistics.median(ts), (min(ts), max(ts))


def copy_bandwidth():
    """Best device-to-device copy rate (bytes read + written per second) over two buffer sizes."""
    import torch

    best = 0.0
    for n in (1 << 30, 1 << 28):  # bytes per buffer
        srcs = [torch.randn(n // 2, device="cuda", dtype=torch.float16) for _ in range(4)]
        dsts = [torch.empty_like(srcs[0]) for _ in range(4)]
        t, _ = graph_time(lambda i: dsts[i % 4].copy_(srcs[i % 4]), nsets=4)
        best = max(best, 2 * n / t)
        del srcs, dsts
    return best


class DenseLayer:
    """A dense decoder layer (attention + SwiGLU FFN), fp16 random weights from one generator."""

    def __init__(self):
        import torch

        self.dt = torch.float16
        self.gen = torch.Generator(device="cuda").manual_seed(0)
        self.wq, self.wk, self.wv, self.wo = (self.rn(D, D, scale=D ** -0.5) for _ in range(4))
        self.wg, self.wu = self.rn(FF, D, scale=D ** -0.5), self.rn(FF, D, scale=D ** -0.5)
        self.wd = self.rn(D, FF, scale=FF ** -0.5)
        self.g1 = torch.ones(D, device="cuda", dtype=self.dt)
        self.g2 = torch.ones(D, device="cuda", dtype=self.dt)
        self.w13 = torch.cat([self.wg, self.wu], 0)

    def rn(self, *s, scale=1.0):
        import torch

        return (torch.randn(*s, generator=self.gen, device="cuda") * scale).to(self.dt)

    def rms(self, h, g):
        import torch.nn.functional as F

        return F.rms_norm(h, (D,), g, 1e-5)

    def ffn(self, x):
        import torch.nn.functional as F

        return (F.silu(x @ self.wg.T) * (x @ self.wu.T)) @ self.wd.T

    def ffn_fused(self, x):
        """The FFN with gate and up in one GEMM."""
        import torch.nn.functional as F

        g, u = (x @ self.w13.T).chunk(2, -1)
        return (F.silu(g) * u) @ self.wd.T

    def layer(self, h):
        import torch.nn.functional as F

        hd = D // H
        n = self.rms(h, self.g1)
        q, k, v = ((n @ w.T).view(T, H, hd).transpose(0, 1)[None] for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1).reshape(T, D)
        h = h + a @ self.wo.T
        return h + self.ffn(self.rms(h, self.g2))

    def random_keeps(self, k):
        """NSETS keep masks of exactly k random tokens."""
        import torch

        keeps = []
        for _ in range(NSETS):
            kp = torch.zeros(T, dtype=torch.int32, device="cuda")
            kp[torch.randperm(T, generator=self.gen, device="cuda")[:k]] = 1
            keeps.append(kp)
        return keeps


# ---------------------------------------------------------------- SIH at T=4096, D=2048

SIH_VARIANTS = (("SIH (tensor cores, PDL)", 0, 0), ("SIH block rule 64", 0, 64),
                ("SIH without PDL", 2, 0), ("SIH with the CUDA-core base", 4, 0),
                ("SIH (generic proj + CUDA-core base)", 5, 0))


def sih_stages(K, sih_call, t_sih) -> dict:
    """Stage times by differences: runs stopped after prep / projection / decide."""
    stages = {}
    prev = 0.0
    for stop, sname in ((1, "prep"), (2, "projection")):
        K.lib.ze_sih_set_variant(stop << 8)
        ts, _ = graph_time(sih_call)
        stages[sname] = (ts - prev) * 1e6
        prev = ts
    K.lib.ze_sih_set_variant(0)
    stages["decide + base"] = (t_sih - prev) * 1e6
    print("  stages (us): " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()), flush=True)
    return stages


def time_sih(K, xs_in, t_layer, t_ffn, bw_copy) -> list:
    import torch

    from zeroedge.backends import plugin_reference as ref

    dt = torch.float16
    _, wts = kc.make_sih(T, D, W, R, dt, seed=7)
    s_ref = ref.sih_scores(xs_in[0].float(), *(wts[k].float() for k in ("w1", "b1", "w2", "b2", "w3", "b3", "w4", "b4")))
    thr = float(torch.quantile(ref.smooth(s_ref, 0.5, 0.333333, 0.166667), 0.5))
    sih_rows = []
    for name, variant, bs_ in SIH_VARIANTS:
        f = ref.sih_fields(threshold=thr, anchor_rank=R, block_size=bs_)
        keeps = [torch.empty(T, dtype=torch.int32, device="cuda") for _ in range(NSETS)]
        bases = [torch.empty(T, D, dtype=dt, device="cuda") for _ in range(NSETS)]
        wss = [K.sih_workspace(T, D, W, R, kc.F16) for _ in range(NSETS)]

        def sih_call(i, f=f, keeps=keeps, bases=bases, wss=wss):
            K.sih(xs_in[i], wts, f, keeps[i], bases[i], ws=wss[i])

        K.lib.ze_sih_set_variant(variant)
        t_sih, spread = graph_time(sih_call)
        K.lib.ze_sih_set_variant(0)
        kept = float(keeps[0].float().mean())
        stages = sih_stages(K, sih_call, t_sih) if variant == 0 and bs_ == 0 else {}
        nbytes = 2 * T * D * 2 + T * 4 + (W + R + 15) // 16 * 16 * D * 2 + R * D * 2
        sih_rows.append({"name": name, "us": t_sih * 1e6, "spread_us": [s * 1e6 for s in spread],
                         "pct_layer": 100 * t_sih / t_layer, "pct_ffn": 100 * t_sih / t_ffn, "bytes": nbytes,
                         "bw_TBps": nbytes / t_sih / 1e12, "bw_frac_copy": nbytes / t_sih / bw_copy,
                         "kept": kept, "stages_us": stages})
        print(f"{name}: {t_sih * 1e6:.1f} us = {100 * t_sih / t_layer:.2f} % of the layer, "
              f"{nbytes / t_sih / 1e12:.2f} TB/s ({100 * nbytes / t_sih / bw_copy:.0f} % of copy), kept {kept:.2f}",
              flush=True)
    return sih_rows


# ---------------------------------------------------------------- compaction vs dense FFN

class Compaction:
    """Gather + FFN(K rows) + scatter buffers, NSETS of each."""

    def __init__(self, K, lay: DenseLayer, xs_in):
        import torch

        dt = lay.dt
        self.K, self.lay, self.xs_in = K, lay, xs_in
        self.bases = [lay.rn(T, D) for _ in range(NSETS)]
        self.outs = [torch.empty(T, D, dtype=dt, device="cuda") for _ in range(NSETS)]
        self.xsb = [torch.empty(T, D, dtype=dt, device="cuda") for _ in range(NSETS)]
        self.idxb = [torch.empty(T, dtype=torch.int32, device="cuda") for _ in range(NSETS)]
        self.cnts = [torch.empty(1, dtype=torch.int32, device="cuda") for _ in range(NSETS)]
        self.wsc = [torch.empty(K.lib.ze_pad_scatter_workspace_size(T), dtype=torch.uint8, device="cuda")
                    for _ in range(NSETS)]

    def gather(self, i, keeps):
        self.K.gather(self.xs_in[i], keeps[i], self.xsb[i], self.idxb[i], self.cnts[i])

    def scatter(self, i, y, k):
        self.K.scatter(self.bases[i], y, self.idxb[i], k, self.outs[i], self.wsc[i])

    def run(self, i, k, keeps, ffn):
        self.gather(i, keeps)
        self.scatter(i, ffn(self.xsb[i][:k]), k)


def compaction_row(c: Compaction, frac, t_ffn) -> dict:
    import torch

    from zeroedge.backends import plugin_reference as ref

    lay, xs_in = c.lay, c.xs_in
    k = int(round(frac * T))
    keeps = lay.random_keeps(k)
    ys = [lay.ffn(c.xsb[i][:k]) for i in range(NSETS)]   # scatter's input (whatever the buffers hold)
    t_c, spread = graph_time(lambda i: c.run(i, k, keeps, lay.ffn))
    t_g, _ = graph_time(lambda i: c.gather(i, keeps))
    t_s, _ = graph_time(lambda i: c.scatter(i, ys[i], k))
    t_fk, _ = graph_time(lambda i: lay.ffn(xs_in[i][:k]))
    # correctness of the timed path on the last set
    c.run(0, k, keeps, lay.ffn)
    torch.cuda.synchronize()
    ref_out = ref.pad_scatter(c.bases[0], lay.ffn(xs_in[0][keeps[0].bool()]), torch.nonzero(keeps[0]).reshape(-1).int())
    err = kc.rel_err(c.outs[0], ref_out)
    assert err <= 1e-3, f"compaction path error {err}"
    flop_saving = 1 - k / T
    wall_saving = 1 - t_c / t_ffn
    print(f"kept {frac:.0%}: {t_c * 1e6:.1f} us vs dense {t_ffn * 1e6:.1f} us -> {t_ffn / t_c:.2f}x, "
          f"saving {wall_saving:.3f} of {flop_saving:.3f} FLOP ({wall_saving / flop_saving:.2f}); "
          f"gather {t_g * 1e6:.1f} us, scatter {t_s * 1e6:.1f} us, FFN(K) {t_fk * 1e6:.1f} us", flush=True)
    return {"kept": frac, "K": k, "us": t_c * 1e6, "spread_us": [s * 1e6 for s in spread],
            "dense_us": t_ffn * 1e6, "speedup": t_ffn / t_c, "flop_saving": flop_saving,
            "wall_saving": wall_saving, "saving_ratio": wall_saving / flop_saving,
            "gather_us": t_g * 1e6, "scatter_us": t_s * 1e6, "ffn_k_us": t_fk * 1e6,
            "rel_err": err}


def fused_rows(c: Compaction) -> list:
    """The same at 50 / 70 % with gate and up fused into one GEMM (both sides)."""
    lay, xs_in = c.lay, c.xs_in
    t_ffn_fused, _ = graph_time(lambda i: lay.ffn_fused(xs_in[i]))
    rows = []
    for frac in (0.5, 0.7):
        k = int(round(frac * T))
        keeps = lay.random_keeps(k)
        t_c, _ = graph_time(lambda i: c.run(i, k, keeps, lay.ffn_fused))
        ws_ = 1 - t_c / t_ffn_fused
        rows.append({"kept": frac, "K": k, "us": t_c * 1e6, "dense_us": t_ffn_fused * 1e6,
                     "speedup": t_ffn_fused / t_c, "wall_saving": ws_, "saving_ratio": ws_ / (1 - k / T)})
        print(f"fused FFN, kept {frac:.0%}: {t_c * 1e6:.1f} us vs dense {t_ffn_fused * 1e6:.1f} us, "
              f"wall/FLOP {ws_ / (1 - k / T):.2f}", flush=True)
    return rows


def print_summary(res):
    m = res["meta"]
    print("\n" + "=" * 100)
    print(f"{m['device']}; copy {m['copy_bw_TBps']:.2f} TB/s; dense layer {m['layer_us']:.0f} us, "
          f"dense FFN {m['ffn_us']:.0f} us")
    print(f"{'SIH variant':28s} {'us':>8s} {'% layer':>8s} {'% FFN':>7s} {'TB/s':>6s} {'% copy':>7s}")
    for r in res["sih"]:
        print(f"{r['name']:28s} {r['us']:8.1f} {r['pct_layer']:8.2f} {r['pct_ffn']:7.2f} {r['bw_TBps']:6.2f} "
              f"{100 * r['bw_frac_copy']:7.0f}")
    print(f"{'kept':>5s} {'compact us':>10s} {'dense us':>9s} {'speedup':>8s} {'wall/FLOP saving':>17s}")
    for r in res["compaction"]:
        print(f"{r['kept']:5.0%} {r['us']:10.1f} {r['dense_us']:9.1f} {r['speedup']:8.2f} {r['saving_ratio']:17.2f}")


def main(argv=None):
    args = parse_args(argv)
    if args.plot:
        plot(*args.plot)
        return
    out = bs.out_dir(args.out)

    import torch

    t0 = time.time()
    so = kc.build(Path("/tmp/zeroedge_kernels"), args.arch)
    print(f"built {so} in {time.time() - t0:.1f} s", flush=True)
    K = kc.Kernels(so)
    assert K.lib.ze_kernels_abi() == 1
    checks = kc.run_checks(K)
    print(f"all {len(checks)} kernel checks passed", flush=True)

    dev = torch.cuda.get_device_name()
    bw_copy = copy_bandwidth()
    print(f"copy bandwidth {bw_copy / 1e12:.2f} TB/s (read + write)", flush=True)

    lay = DenseLayer()
    hs = [lay.rn(T, D) for _ in range(NSETS)]
    xs_in = [lay.rms(h, lay.g2) for h in hs]
    t_layer, _ = graph_time(lambda i: lay.layer(hs[i]))
    t_ffn, _ = graph_time(lambda i: lay.ffn(xs_in[i]))
    print(f"dense layer {t_layer * 1e6:.1f} us, dense FFN {t_ffn * 1e6:.1f} us", flush=True)

    sih_rows = time_sih(K, xs_in, t_layer, t_ffn, bw_copy)
    c = Compaction(K, lay, xs_in)
    comp_rows = [compaction_row(c, frac, t_ffn) for frac in (0.3, 0.5, 0.7)]
    fused = fused_rows(c)
    ffn_m = {}
    for m_ in (1229, 2048, 2867, 2880, 2944, 3072, 4096):
        ffn_m[m_] = graph_time(lambda i, m_=m_: lay.ffn(xs_in[i][:m_]))[0] * 1e6
    print("FFN us by rows: " + ", ".join(f"{m_}: {v:.1f}" for m_, v in ffn_m.items()), flush=True)

    meta = {"device": dev, "torch": torch.__version__, "cuda": torch.version.cuda, "arch": args.arch,
            "python": platform.python_version(), "copy_bw_TBps": bw_copy / 1e12, "layer_us": t_layer * 1e6,
            "ffn_us": t_ffn * 1e6, "T": T, "D": D, "FF": FF, "heads": H, "W": W, "R": R,
            "timing": f"CUDA graph of {NSETS} rotating input sets, {WARM} warm-up replays, median of {REPS}"}
    res = {"meta": meta, "checks": checks, "sih": sih_rows, "compaction": comp_rows,
           "compaction_fused_ffn": fused, "ffn_us_by_rows": ffn_m}
    bs.write_json(out / "results.json", res, indent=2)
    (out / "plugins.md").write_text(render_markdown(res))
    print_summary(res)


def render_markdown(res) -> str:
    m = res["meta"]
    L = ["# Plugin kernels on the GPU (SIH, PAD gather / scatter)", "",
         "Command (on the rented H200, from the repository root):", "",
         "    PYTHONUNBUFFERED=1 python3 benchmarks/gpu/run_kernels_h200.py --out $OUT", "",
         f"Machine: {m['device']}, torch {m['torch']} (CUDA {m['cuda']}), kernels built with nvcc for {m['arch']}. "
         f"Timing: {m['timing']} (device events).", "",
         f"Shapes: T = {m['T']} tokens, hidden D = {m['D']}, SwiGLU FFN {m['FF']}, {m['heads']} heads, fp16; "
         f"SIH head width W = {m['W']} (12 KB fp16 budget), anchor rank {m['R']}, threshold at the median score.", "",
         f"Measured copy bandwidth (device-to-device, read + write): **{m['copy_bw_TBps']:.2f} TB/s**. "
         f"Dense decoder layer (attention + FFN): **{m['layer_us']:.0f} µs**; dense FFN alone: "
         f"**{m['ffn_us']:.0f} µs**.", "",
         "## SIH per layer (target: ≤ 3 % of the layer's dense time)", "",
         "| variant | time µs (min–max) | % of dense layer | % of dense FFN | bytes moved | TB/s | % of copy bw | kept |",
         "|---|---|---|---|---|---|---|---|"]
    for r in res["sih"]:
        L.append(f"| {r['name']} | {r['us']:.1f} ({r['spread_us'][0]:.1f}–{r['spread_us'][1]:.1f}) | "
                 f"{r['pct_layer']:.2f} | {r['pct_ffn']:.2f} | {r['bytes'] / 1e6:.1f} MB | {r['bw_TBps']:.2f} | "
                 f"{100 * r['bw_frac_copy']:.0f} | {r['kept']:.2f} |")
    for r in res["sih"]:
        if r.get("stages_us"):
            L += ["", f"Stages of '{r['name']}' (µs, by differences of runs stopped after each stage): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in r["stages_us"].items()) + "."]
    L += ["", "Bytes counted: x read once, base written once, keep, the concatenated head/anchor weights and "
          "the anchor up-projection.", "",
          "## Compaction: gather + FFN(K rows) + scatter vs the dense FFN "
          "(targets: ≥ 1.6× at 50 %; wall-time saving ≥ 80 % of the FLOP saving)", "",
          "| kept | K | compaction µs | dense FFN µs | speedup | FLOP saving | wall saving | wall / FLOP | "
          "gather µs | FFN(K) µs | scatter µs | rel err |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["compaction"]:
        L.append(f"| {r['kept']:.0%} | {r['K']} | {r['us']:.1f} | {r['dense_us']:.1f} | {r['speedup']:.2f}× | "
                 f"{r['flop_saving']:.2f} | {r['wall_saving']:.3f} | {r['saving_ratio']:.2f} | "
                 f"{r['gather_us']:.1f} | {r['ffn_k_us']:.1f} | {r['scatter_us']:.1f} | {r['rel_err']:.1e} |")
    L += ["", "K is known on the host here (the FFN runs on `xs[:K]`); inside TensorRT the size tensor gives "
          "it. The FFN is torch's matmul on the kept rows; gather and scatter are the plugin kernels.", "",
          "Same with gate and up fused into one GEMM on both sides:", "",
          "| kept | K | compaction µs | dense FFN µs | speedup | wall / FLOP |", "|---|---|---|---|---|---|"]
    for r in res.get("compaction_fused_ffn", []):
        L.append(f"| {r['kept']:.0%} | {r['K']} | {r['us']:.1f} | {r['dense_us']:.1f} | {r['speedup']:.2f}× | "
                 f"{r['saving_ratio']:.2f} |")
    if res.get("ffn_us_by_rows"):
        L += ["", "Dense FFN time against the number of rows M (cuBLAS through torch): "
              + ", ".join(f"M={m_}: {v:.1f} µs" for m_, v in res["ffn_us_by_rows"].items()) + "."]
    L += ["",
          "## Kernel checks (fresh random inputs, outputs poisoned first)", "",
          "| kernel | shape | dtype | details | result |", "|---|---|---|---|---|"]
    for c in res["checks"]:
        if "scores_rel_err" in c:
            L.append(f"| SIH ({c['variant']}) | T={c['T']} D={c['D']} W={c['W']} R={c['R']} block={c['block_size']} | "
                     f"{c['dtype']} | scores rel err {c['scores_rel_err']:.1e}, base rel err {c['base_rel_err']:.1e}, "
                     f"keep identical to the reference decision; {c['flips_vs_ref_scores']} near-threshold flips vs "
                     f"float64 scores | ok (tol {c['tol']:.0e}) |")
        else:
            L.append(f"| PAD gather + scatter | T={c['T']} D={c['D']} kept {c['frac']:.0%} (K={c['K']}) | "
                     f"{c['dtype']} | bit-exact, rows past K untouched | ok |")
    return "\n".join(L) + "\n"


def plot(results_json: str, png: str):
    """benchmarks/results/plugins/h200_sih_pad_kernels.png from a results.json: SIH stages against the layer; compaction vs kept."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(Path(results_json).read_text())
    m, sih, comp = res["meta"], res["sih"][0], res["compaction"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    st = sih["stages_us"]
    left = 0.0
    for name, v in st.items():
        a.barh(0, v, left=left, label=f"{name} {v:.1f} µs")
        left += v
    a.axvline(0.03 * m["layer_us"], color="k", ls="--", label=f"3 % of the layer = {0.03 * m['layer_us']:.1f} µs")
    a.axvline(2 * m["T"] * m["D"] * 2 / (m["copy_bw_TBps"] * 1e12) * 1e6, color="gray", ls=":",
              label="x read + base write at copy bandwidth")
    a.set_yticks([])
    a.set_xlabel("µs")
    a.set_title(f"SIH per layer, T={m['T']}, D={m['D']} (fp16, {m['device']})")
    a.legend(fontsize=8, loc="upper right")
    ks = [r["kept"] for r in comp]
    b.plot(ks, [r["us"] for r in comp], "o-", label="gather + FFN(K) + scatter")
    b.plot(ks, [r["ffn_k_us"] for r in comp], "s--", label="FFN(K) alone")
    b.plot(ks, [r["dense_us"] * k for r, k in zip(comp, ks)], ":", color="gray", label="dense × kept (FLOP-proportional)")
    b.axhline(m["ffn_us"], color="k", ls="--", label=f"dense FFN {m['ffn_us']:.0f} µs")
    b.set_xlabel("fraction of tokens kept")
    b.set_ylabel("µs")
    b.set_title(f"Compaction vs dense FFN ({m['D']} → {m['FF']})")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
