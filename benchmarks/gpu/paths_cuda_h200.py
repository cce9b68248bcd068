"""The plugin's CUDA C decode-path kernels (plugins/kernels/paths_gemv.cu) on a CUDA GPU (written for
the H200): check them against fp32 torch references, sweep their block sizes, time one FFN against
cuBLAS dense and the Triton kernels, and time batch-1 decode of a llama-3.2-1b-shaped model (random
weights, real shapes) through zeroedge.runtime.fast.PathsDecoder with kernels="cuda" / "triton"
against the dense loop.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu/paths_cuda_h200.py --out DIR

Timing as benchmarks/gpu/paths_h200.py: CUDA graphs, device events, medians; the FFN microbenchmark
rotates over 16 layers of weights (1.6 GB, far past the 60 MB L2).
"""
from __future__ import annotations

import ctypes
import json
import subprocess
from pathlib import Path

import bench_setup as bs
from bench_setup import copy_bw, graph_ms, rel

ROOT = bs.ROOT
KEEPS = (0.9, 0.7, 0.5, 0.3)


def parse_args(argv=None):
    ap = bs.parser(__doc__)
    bs.add_out(ap, "/tmp/paths_cuda_out")
    ap.add_argument("--skip-decode", action="store_true", help="kernels only, no decode loop")
    return ap.parse_args(argv)


def build_lib(out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    so = out_dir / "libzeroedge_kernels.so"
    subprocess.run(["nvcc", "-std=c++17", "-O3", "-arch=sm_90", "-shared", "-Xcompiler", "-fPIC",
                    "-I", str(ROOT / "plugins/include"), str(ROOT / "plugins/kernels/paths_gemv.cu"),
                    "-o", str(so)], check=True)
    return so


def pred_ref(x, z, bg, bu, wg, wu, wdt, thr):
    import torch.nn.functional as F

    zf = z.float()
    keep = (F.silu(zf @ bg.float()) * (zf @ bu.float())).abs().amax(0) >= thr
    act = F.silu(x.float() @ wg.float().T) * (x.float() @ wu.float().T) * keep
    return act @ wdt.float(), float(keep.float().mean())


def mag_parts(x, w13t, thr_in):
    import torch.nn.functional as F

    xm = x.float() * (x.float().abs() >= thr_in)
    g, u = (xm @ w13t.float()).chunk(2, -1)
    return F.silu(g) * u


def _p(t):
    return ctypes.c_void_p(t.data_ptr())


def _st():
    import torch

    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


# ---- 1. correctness -----------------------------------------------------------------------------

def _check_pred(lib, x, D, Fd, R, work) -> dict:
    """The predictor rule: three repeated calls, then one on a dirty TensorRT-style workspace."""
    import torch
    import torch.nn.functional as F

    from zeroedge.paths import cuda_gemv as cg

    B, dt = x.shape[0], x.dtype
    at = torch.randn(R, D, device="cuda", dtype=dt) / D ** 0.5
    bg = torch.randn(R, Fd, device="cuda", dtype=dt) / R ** 0.5
    bu = torch.randn(R, Fd, device="cuda", dtype=dt) / R ** 0.5
    wg, wu, wdt = (torch.randn(Fd, D, device="cuda", dtype=dt) * 0.02 for _ in range(3))
    z = F.linear(x, at)
    zf = z.float()
    thr = float((F.silu(zf @ bg.float()) * (zf @ bu.float())).abs().amax(0).quantile(0.5))
    yref, kept = pred_ref(x, z, bg, bu, wg, wu, wdt, thr)
    errs = []
    for _ in range(3):   # the kernels must leave `work` zeroed: repeated calls agree
        y = torch.full((B, D), float("nan"), device="cuda", dtype=dt)
        cg.ffn_predictor(lib, x, z, bg.T.contiguous(), bu.T.contiguous(), wg, wu, wdt, thr, work, y)
        torch.cuda.synchronize()
        errs.append(rel(y, yref))
    dirty = torch.full_like(work, 3.0)   # TensorRT-style workspace: cleared by the launcher
    y = torch.full((B, D), float("nan"), device="cuda", dtype=dt)
    bg_t, bu_t = bg.T.contiguous(), bu.T.contiguous()
    rc = lib.ze_paths_ffn(cg._dtype(x), _p(x), _p(z), _p(bg_t), _p(bu_t),
                          _p(wg), _p(wu), _p(wdt), _p(y), thr, B, D, Fd, R, _p(dirty), 0, _st())
    torch.cuda.synchronize()
    return {"rel": errs, "rel_dirty_work": rel(y, yref), "rc": rc, "kept": kept,
            "work_left_zero": bool((work == 0).all()), "nan": bool(y.isnan().any()), "wdt": wdt}


def _check_mag(lib, x, D, Fd, wdt, work) -> dict:
    """The magnitude rule: three repeated calls, then one on a dirty workspace."""
    import torch

    from zeroedge.paths import cuda_gemv as cg

    B, dt = x.shape[0], x.dtype
    w13t = torch.randn(D, 2 * Fd, device="cuda", dtype=dt) * 0.02
    thr_in = float(x.float().abs().quantile(0.5))
    act = mag_parts(x, w13t, thr_in)
    thr_a = float(act.abs().quantile(0.5))
    yref = (act * (act.abs() >= thr_a)) @ wdt.float()
    errs = []
    for _ in range(3):
        y = torch.full((B, D), float("nan"), device="cuda", dtype=dt)
        cg.ffn_magnitude(lib, x, w13t, wdt, thr_in, thr_a, work, y)
        torch.cuda.synchronize()
        errs.append(rel(y, yref))
    dirty = torch.full_like(work, -2.0)
    y = torch.full((B, D), float("nan"), device="cuda", dtype=dt)
    rc = lib.ze_paths_ffn_magnitude(cg._dtype(x), _p(x), _p(w13t), _p(wdt), _p(y), thr_in, thr_a, B, D, Fd,
                                    _p(dirty), 0, _st())
    torch.cuda.synchronize()
    return {"rel": errs, "rel_dirty_work": rel(y, yref), "rc": rc,
            "work_left_zero": bool((work == 0).all()), "nan": bool(y.isnan().any())}


def bad_args(lib, D, Fd) -> dict:
    """Return codes of calls the kernels must refuse."""
    import torch

    x = torch.randn(1, D, device="cuda", dtype=torch.float16)
    w = torch.zeros(Fd, D, device="cuda", dtype=torch.float16)
    p, st = _p, _st
    return {
        "B9": lib.ze_paths_ffn_magnitude(1, p(x), p(w), p(w), p(x), 0., 0., 9, D, Fd, p(w), 1, st()),
        "D100": lib.ze_paths_ffn_magnitude(1, p(x), p(w), p(w), p(x), 0., 0., 1, 100, Fd, p(w), 1, st()),
        "dtype0": lib.ze_paths_ffn_magnitude(0, p(x), p(w), p(w), p(x), 0., 0., 1, D, Fd, p(w), 1, st()),
        "null": lib.ze_paths_ffn_magnitude(1, None, p(w), p(w), p(x), 0., 0., 1, D, Fd, p(w), 1, st()),
        "R0": lib.ze_paths_ffn(1, p(x), p(x), p(w), p(w), p(w), p(w), p(w), p(x), 0., 1, D, Fd, 0, p(w), 1, st()),
    }


def check_kernels(lib, D, Fd, R) -> dict:
    import torch

    from zeroedge.paths import cuda_gemv as cg

    checks = {}
    for dt in (torch.float16, torch.bfloat16):
        for B in (1, 4):
            x = torch.randn(B, D, device="cuda", dtype=dt)
            work = cg.work_buffer(lib, B, D, Fd, "cuda")
            pred = _check_pred(lib, x, D, Fd, R, work)
            wdt = pred.pop("wdt")
            checks[f"pred_{str(dt)[6:]}_B{B}"] = pred
            checks[f"mag_{str(dt)[6:]}_B{B}"] = _check_mag(lib, x, D, Fd, wdt, work)
    checks["bad_args"] = bad_args(lib, D, Fd)
    return checks


# ---- 2. one FFN, batch 1, bf16, 16 layers of weights rotating -----------------------------------

class FfnBench:
    """16 layers of random FFN weights (bf16) and the path FFN runners (predictor / magnitude rule,
    CUDA C / Triton) over all of them, for CUDA-graph timing."""

    def __init__(self, lib, D, Fd, R, L):
        import torch

        from zeroedge.paths import cuda_gemv as cg
        from zeroedge.paths import triton_gemv as tg

        dt = torch.bfloat16
        self.lib, self.D, self.Fd, self.R, self.L = lib, D, Fd, R, L
        self.Ws = []
        for _ in range(L):
            w13 = torch.randn(2 * Fd, D, device="cuda", dtype=dt) * 0.02
            w2 = torch.randn(D, Fd, device="cuda", dtype=dt) * 0.02
            self.Ws.append(dict(w13=w13, w2=w2, w13t=w13.T.contiguous(), wdt=w2.T.contiguous(),
                                at=torch.randn(R, D, device="cuda", dtype=dt) / D ** 0.5,
                                bg=torch.randn(R, Fd, device="cuda", dtype=dt) / R ** 0.5,
                                bu=torch.randn(R, Fd, device="cuda", dtype=dt) / R ** 0.5))
            self.Ws[-1]["bg_t"], self.Ws[-1]["bu_t"] = self.Ws[-1]["bg"].T.contiguous(), self.Ws[-1]["bu"].T.contiguous()
        self.x = torch.randn(1, D, device="cuda", dtype=dt)
        self.work = cg.work_buffer(lib, 1, D, Fd, "cuda")
        self.y = torch.empty(1, D, device="cuda", dtype=dt)
        self.act = torch.empty(1, Fd, device="cuda", dtype=dt)
        self.part = torch.empty(tg.CONFIG["down"]["splits"], 1, D, device="cuda", dtype=torch.float32)
        self.part2 = torch.empty(tg.CONFIG["down"]["splits"], 1, 2 * Fd, device="cuda", dtype=torch.float32)

    def us(self, fn) -> float:
        """Median µs per layer of fn over all layers."""
        return graph_ms(fn) / self.L * 1e3

    def dense(self):
        import torch.nn.functional as F

        for w in self.Ws:
            g, u = F.linear(self.x, w["w13"]).chunk(2, -1)
            F.linear(F.silu(g) * u, w["w2"])

    def pred_thr(self, keep):
        import torch.nn.functional as F

        out = []
        for w in self.Ws:
            zf = F.linear(self.x, w["at"]).float()
            out.append(float((F.silu(zf @ w["bg"].float()) * (zf @ w["bu"].float())).abs()[0].quantile(1 - keep)))
        return out

    def mag_thr(self, keep):
        thr_in = float(self.x.float().abs().quantile(1 - keep))
        return thr_in, [float(mag_parts(self.x, w["w13t"], thr_in).abs().quantile(1 - keep)) for w in self.Ws]

    def run_pred_cuda(self, th):
        import torch.nn.functional as F

        from zeroedge.paths import cuda_gemv as cg

        def f():
            for w, t in zip(self.Ws, th):
                z = F.linear(self.x, w["at"])
                cg.ffn_predictor(self.lib, self.x, z, w["bg_t"], w["bu_t"], w["w13"][:self.Fd], w["w13"][self.Fd:],
                                 w["wdt"], t, self.work, self.y)
        return f

    def run_pred_triton(self, th):
        import torch.nn.functional as F

        from zeroedge.paths import triton_gemv as tg

        def f():
            for w, t in zip(self.Ws, th):
                z = F.linear(self.x, w["at"])
                tg.paths_gateup(self.x, z, w["bg"], w["bu"], w["w13"][:self.Fd], w["w13"][self.Fd:], t, out=self.act)
                tg.paths_down(self.act, w["wdt"], part=self.part)
        return f

    def run_mag_cuda(self, thr_in, th):
        from zeroedge.paths import cuda_gemv as cg

        def f():
            for w, t in zip(self.Ws, th):
                cg.ffn_magnitude(self.lib, self.x, w["w13t"], w["wdt"], thr_in, t, self.work, self.y)
        return f

    def run_mag_triton(self, thr_in, th):   # PathsDecoder's Triton magnitude path
        import torch.nn.functional as F

        from zeroedge.paths import triton_gemv as tg

        def f():
            x = self.x
            for w, t in zip(self.Ws, th):
                hm = x * (x.abs() >= thr_in)
                g, u = tg.paths_down(hm, w["w13t"], part=self.part2, splits=32).chunk(2, -1)
                aa = F.silu(g) * u
                self.act.copy_(aa * (aa.abs() >= t))
                tg.paths_down(self.act, w["wdt"], part=self.part)
        return f


def sweep_config(fb: FfnBench) -> tuple:
    """The CUDA C kernels' chunk / row block sizes at keep 0.5, the fastest of each set in the library."""
    lib = fb.lib
    sweep = {}
    th5, (ti5, tm5) = fb.pred_thr(0.5), fb.mag_thr(0.5)
    best = {"down": (1e9, 64), "rows": (1e9, 64), "pred": (1e9, 8)}
    for c in (32, 64, 128, 256):
        lib.ze_paths_set_config(0, c, 0)
        us = fb.us(fb.run_mag_cuda(ti5, tm5))
        sweep[f"down_chunk{c}"] = {"mag_us": us}
        best["down"] = min(best["down"], (us, c))
    lib.ze_paths_set_config(0, best["down"][1], 0)
    for r in (32, 64, 128, 256):
        lib.ze_paths_set_config(0, 0, r)
        us = fb.us(fb.run_mag_cuda(ti5, tm5))
        sweep[f"gateup_rows{r}"] = {"mag_us": us}
        best["rows"] = min(best["rows"], (us, r))
    lib.ze_paths_set_config(0, 0, best["rows"][1])
    for c in (2, 4, 8, 16, 32):
        lib.ze_paths_set_config(c, 0, 0)
        us = fb.us(fb.run_pred_cuda(th5))
        sweep[f"pred_chunk{c}"] = {"pred_us": us}
        best["pred"] = min(best["pred"], (us, c))
    lib.ze_paths_set_config(best["pred"][1], 0, 0)
    return sweep, {k: v[1] for k, v in best.items()}


def ffn_micro(fb: FfnBench, res: dict) -> dict:
    D, Fd, R = fb.D, fb.Fd, fb.R
    micro = {"dense_us": fb.us(fb.dense)}
    micro["dense_GBs"] = 3 * D * Fd * 2 / (micro["dense_us"] * 1e-6) / 1e9
    print("dense FFN", micro, flush=True)
    res["sweep"], res["config"] = sweep_config(fb)
    print("sweep", json.dumps(res["sweep"]), "best", res["config"], flush=True)
    for keep in KEEPS:
        th = fb.pred_thr(keep)
        ti, tm = fb.mag_thr(keep)
        pb = (keep * 3 * D * Fd + 2 * R * Fd + R * D) * 2
        mb = (keep * D * 2 * Fd + keep * Fd * D) * 2
        row = {}
        for name, fn, byt in (("pred_cuda", fb.run_pred_cuda(th), pb), ("pred_triton", fb.run_pred_triton(th), pb),
                              ("mag_cuda", fb.run_mag_cuda(ti, tm), mb), ("mag_triton", fb.run_mag_triton(ti, tm), mb)):
            us = fb.us(fn)
            row[name] = {"us": us, "GBs": byt / (us * 1e-6) / 1e9, "of_copy": byt / (us * 1e-6) / 1e9 / res["copy_bw_GBs"],
                         "vs_dense": micro["dense_us"] / us, "bytes_MB": byt / 1e6}
        micro[f"keep{keep}"] = row
        print(f"keep {keep}", json.dumps(row), flush=True)
    return micro


# ---- 3. decode, batch 1: dense vs PathsDecoder (cuda / triton kernels) --------------------------

def _policies(kind, D, Fd, R, L):
    import torch

    from zeroedge.paths.predictor import PathPredictor
    from zeroedge.paths.sparse import PathPolicy

    if kind == "magnitude":
        return {i: PathPolicy(method="magnitude", threshold_in=0.0, threshold=0.0) for i in range(L)}
    g = torch.Generator().manual_seed(1)
    return {i: PathPolicy(method="predictor", predictor=PathPredictor(
        torch.randn(D, R, generator=g) / D ** 0.5, torch.randn(R, Fd, generator=g) / R ** 0.5,
        torch.randn(R, Fd, generator=g) / R ** 0.5, torch.ones(Fd))) for i in range(L)}


def _set_thresholds(pd, ffn, kind, keep, L):
    """Per-layer thresholds hitting `keep` on the FFN inputs of 8 eager steps."""
    import torch
    import torch.nn.functional as F

    ffn.record = {i: [] for i in range(L)}
    bs.eager_steps(pd)
    rec, ffn.record = ffn.record, None
    for i, pp in ffn.paths.items():
        hs = torch.cat(rec[i]).float()
        w13 = pd.W.layers[i]["w13"].float()
        if kind == "magnitude":
            pp["thr_in"] = float(hs.abs().quantile(1 - keep))
            hm = hs * (hs.abs() >= pp["thr_in"])
            g, u = (hm @ w13.T).chunk(2, -1)
            pp["thr"] = float((F.silu(g) * u).abs().quantile(1 - keep))
        else:
            zf = hs @ pp["at"].float().T
            sc = (F.silu(zf @ pp["bg"].float()) * (zf @ pp["bu"].float())).abs()
            pp["thr"] = float(sc.quantile(1 - keep))


def decode_bench(so, cfg, dt) -> dict:
    import torch

    from zeroedge.runtime.fast import DenseDecoder

    D, Fd, R, L = cfg.dim, cfg.ffn_dim, 32, cfg.n_layers
    m = bs.build_model("llama-3.2-1b", "cuda", dt)
    max_len = 2048
    dense_dec = DenseDecoder(m, max_len, graph=True)
    dense_dec.attention.kv.normal_()
    dec = {"dense_ms": bs.decode_step_ms(dense_dec)}
    del dense_dec
    torch.cuda.empty_cache()

    for kind in ("magnitude", "predictor"):
        for keep in (0.87, 0.73, 0.5):
            for kern in ("cuda", "triton"):
                pd, ffn = bs.recording_paths_decoder(m, max_len, _policies(kind, D, Fd, R, L), kernels=kern,
                                                     kernels_lib=so)
                pd.attention.kv.normal_()
                _set_thresholds(pd, ffn, kind, keep, L)
                ms = bs.decode_step_ms(pd)
                name = f"{kind}_{kern}_keep{keep}"
                dec[name] = {"ms": ms, "tok_s": 1e3 / ms, "speedup": dec["dense_ms"] / ms}
                print(name, dec[name], flush=True)
                del pd, ffn
                torch.cuda.empty_cache()
    dec["dense_tok_s"] = 1e3 / dec["dense_ms"]
    return dec


def print_summary(res):
    checks, micro = res["checks"], res["micro"]
    print("\nSUMMARY")
    print(f"copy {res['copy_bw_GBs']:.0f} GB/s; dense FFN {micro['dense_us']:.1f} us/layer "
          f"{micro['dense_GBs']:.0f} GB/s; config {res['config']}")
    bad = [k for k, v in checks.items() if k != "bad_args" and (max(v["rel"]) > 2e-2 or v["nan"] or v["rc"]
                                                               or not v["work_left_zero"] or v["rel_dirty_work"] > 2e-2)]
    print("checks:", "all ok" if not bad else f"FAILED {bad}", "| bad args rc", checks["bad_args"])
    print("| keep | kernel | us/layer | GB/s | of copy | vs dense FFN |")
    for keep in KEEPS:
        for k, v in micro[f"keep{keep}"].items():
            print(f"| {keep} | {k} | {v['us']:.1f} | {v['GBs']:.0f} | {v['of_copy']:.0%} | {v['vs_dense']:.2f}x |")
    if "decode" in res:
        print(f"decode dense {res['decode']['dense_tok_s']:.0f} tok/s")
        for k, v in res["decode"].items():
            if isinstance(v, dict):
                print(f"decode {k}: {v['tok_s']:.0f} tok/s x{v['speedup']:.2f}")


def main(argv=None):
    a = parse_args(argv)
    if not bs.cuda_or_skip("paths_cuda_h200: skipped, no CUDA GPU here"):
        return
    import torch

    from zeroedge.model import PRESETS
    from zeroedge.paths import cuda_gemv as cg

    out = bs.out_dir(a.out)
    so = build_lib(Path("/tmp/zeroedge_paths_build"))
    lib = cg.load(so)
    res = bs.device_info()
    torch.manual_seed(0)
    cfg = PRESETS["llama-3.2-1b"]
    D, Fd, R, L = cfg.dim, cfg.ffn_dim, 32, cfg.n_layers
    res["copy_bw_GBs"] = copy_bw() / 1e9
    print(f"copy bandwidth (read + write): {res['copy_bw_GBs']:.0f} GB/s", flush=True)
    res["checks"] = check_kernels(lib, D, Fd, R)
    print(json.dumps(res["checks"], indent=1), flush=True)
    fb = FfnBench(lib, D, Fd, R, L)
    res["micro"] = ffn_micro(fb, res)
    del fb
    torch.cuda.empty_cache()
    bs.write_json(out / "h200_cuda_kernels_llama1b_shape.json", res)
    if not a.skip_decode:
        res["decode"] = decode_bench(so, cfg, torch.bfloat16)
    bs.write_json(out / "h200_cuda_kernels_llama1b_shape.json", res)
    print_summary(res)


if __name__ == "__main__":
    main()
