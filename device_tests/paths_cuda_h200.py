"""The plugin's CUDA C decode-path kernels (plugins/kernels/paths_gemv.cu) on a CUDA GPU (written for
the H200): check them against fp32 torch references, sweep their block sizes, time one FFN against
cuBLAS dense and the Triton kernels, and time batch-1 decode of a llama-3.2-1b-shaped model (random
weights, real shapes) through zeroedge.paths.decode.PathsDecoder with kernels="cuda" / "triton"
against the dense loop.

    PYTHONUNBUFFERED=1 python3 device_tests/paths_cuda_h200.py --out DIR

Timing as device_tests/paths_h200.py: CUDA graphs, device events, medians; the FFN microbenchmark
rotates over 16 layers of weights (1.6 GB, far past the 60 MB L2).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "device_tests"))
from paths_h200 import copy_bw, graph_ms, rel  # noqa: E402


def build_lib(out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    so = out_dir / "libzeroedge_kernels.so"
    subprocess.run(["nvcc", "-std=c++17", "-O3", "-arch=sm_90", "-shared", "-Xcompiler", "-fPIC",
                    "-I", str(ROOT / "plugins/include"), str(ROOT / "plugins/kernels/paths_gemv.cu"),
                    "-o", str(so)], check=True)
    return so


def decode_ms_of(dec, start=1024, n=64, reps=5):
    """Median ms per step over reps x n graph-replayed steps at position ~start."""
    for s in range(3):
        dec.step(1, start + s)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for s in range(n):
            dec.step(1 + s, start + 3 + s)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / n)
    return statistics.median(ts)


def pred_ref(x, z, bg, bu, wg, wu, wdt, thr):
    zf = z.float()
    keep = (F.silu(zf @ bg.float()) * (zf @ bu.float())).abs().amax(0) >= thr
    act = F.silu(x.float() @ wg.float().T) * (x.float() @ wu.float().T) * keep
    return act @ wdt.float(), float(keep.float().mean())


def mag_parts(x, w13t, thr_in):
    xm = x.float() * (x.float().abs() >= thr_in)
    g, u = (xm @ w13t.float()).chunk(2, -1)
    return F.silu(g) * u


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/paths_cuda_out"))
    ap.add_argument("--skip-decode", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("paths_cuda_h200: skipped, no CUDA GPU here")
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from zeroedge.model import PRESETS, build
    from zeroedge.paths import cuda_gemv as cg
    from zeroedge.paths import triton_gemv as tg

    so = build_lib(Path("/tmp/zeroedge_paths_build"))
    lib = cg.load(so)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    torch.manual_seed(0)
    cfg = PRESETS["llama-3.2-1b"]
    D, Fd, R, L = cfg.dim, cfg.ffn_dim, 32, cfg.n_layers
    res["copy_bw_GBs"] = copy_bw() / 1e9
    print(f"copy bandwidth (read + write): {res['copy_bw_GBs']:.0f} GB/s", flush=True)
    p = lambda t: ctypes.c_void_p(t.data_ptr())
    st = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    # ---- 1. correctness ----------------------------------------------------------------------
    checks = {}
    for dt in (torch.float16, torch.bfloat16):
        for B in (1, 4):
            x = torch.randn(B, D, device="cuda", dtype=dt)
            at = torch.randn(R, D, device="cuda", dtype=dt) / D ** 0.5
            bg = torch.randn(R, Fd, device="cuda", dtype=dt) / R ** 0.5
            bu = torch.randn(R, Fd, device="cuda", dtype=dt) / R ** 0.5
            wg, wu, wdt = (torch.randn(Fd, D, device="cuda", dtype=dt) * 0.02 for _ in range(3))
            z = F.linear(x, at)
            zf = z.float()
            thr = float((F.silu(zf @ bg.float()) * (zf @ bu.float())).abs().amax(0).quantile(0.5))
            yref, kept = pred_ref(x, z, bg, bu, wg, wu, wdt, thr)
            work = cg.work_buffer(lib, B, D, Fd, "cuda")
            errs = []
            for _ in range(3):   # the kernels must leave `work` zeroed: repeated calls agree
                y = torch.full((B, D), float("nan"), device="cuda", dtype=dt)
                cg.ffn_predictor(lib, x, z, bg.T.contiguous(), bu.T.contiguous(), wg, wu, wdt, thr, work, y)
                torch.cuda.synchronize()
                errs.append(rel(y, yref))
            dirty = torch.full_like(work, 3.0)   # TensorRT-style workspace: cleared by the launcher
            y = torch.full((B, D), float("nan"), device="cuda", dtype=dt)
            bg_t, bu_t = bg.T.contiguous(), bu.T.contiguous()
            rc = lib.ze_paths_ffn(cg._dtype(x), p(x), p(z), p(bg_t), p(bu_t),
                                  p(wg), p(wu), p(wdt), p(y), thr, B, D, Fd, R, p(dirty), 0, st())
            torch.cuda.synchronize()
            name = f"pred_{str(dt)[6:]}_B{B}"
            checks[name] = {"rel": errs, "rel_dirty_work": rel(y, yref), "rc": rc, "kept": kept,
                            "work_left_zero": bool((work == 0).all()), "nan": bool(y.isnan().any())}
            # magnitude rule
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
            dirty.fill_(-2.0)
            y = torch.full((B, D), float("nan"), device="cuda", dtype=dt)
            rc = lib.ze_paths_ffn_magnitude(cg._dtype(x), p(x), p(w13t), p(wdt), p(y), thr_in, thr_a, B, D, Fd,
                                            p(dirty), 0, st())
            torch.cuda.synchronize()
            checks[f"mag_{str(dt)[6:]}_B{B}"] = {"rel": errs, "rel_dirty_work": rel(y, yref), "rc": rc,
                                                  "work_left_zero": bool((work == 0).all()),
                                                  "nan": bool(y.isnan().any())}
    x = torch.randn(1, D, device="cuda", dtype=torch.float16)
    w = torch.zeros(Fd, D, device="cuda", dtype=torch.float16)
    checks["bad_args"] = {
        "B9": lib.ze_paths_ffn_magnitude(1, p(x), p(w), p(w), p(x), 0., 0., 9, D, Fd, p(w), 1, st()),
        "D100": lib.ze_paths_ffn_magnitude(1, p(x), p(w), p(w), p(x), 0., 0., 1, 100, Fd, p(w), 1, st()),
        "dtype0": lib.ze_paths_ffn_magnitude(0, p(x), p(w), p(w), p(x), 0., 0., 1, D, Fd, p(w), 1, st()),
        "null": lib.ze_paths_ffn_magnitude(1, None, p(w), p(w), p(x), 0., 0., 1, D, Fd, p(w), 1, st()),
        "R0": lib.ze_paths_ffn(1, p(x), p(x), p(w), p(w), p(w), p(w), p(w), p(x), 0., 1, D, Fd, 0, p(w), 1, st()),
    }
    res["checks"] = checks
    print(json.dumps(checks, indent=1), flush=True)

    # ---- 2. one FFN, batch 1, bf16, 16 layers of weights rotating ---------------------------
    dt = torch.bfloat16
    Ws = []
    for _ in range(L):
        w13 = torch.randn(2 * Fd, D, device="cuda", dtype=dt) * 0.02
        w2 = torch.randn(D, Fd, device="cuda", dtype=dt) * 0.02
        Ws.append(dict(w13=w13, w2=w2, w13t=w13.T.contiguous(), wdt=w2.T.contiguous(),
                       at=torch.randn(R, D, device="cuda", dtype=dt) / D ** 0.5,
                       bg=torch.randn(R, Fd, device="cuda", dtype=dt) / R ** 0.5,
                       bu=torch.randn(R, Fd, device="cuda", dtype=dt) / R ** 0.5))
        Ws[-1]["bg_t"], Ws[-1]["bu_t"] = Ws[-1]["bg"].T.contiguous(), Ws[-1]["bu"].T.contiguous()
    x = torch.randn(1, D, device="cuda", dtype=dt)
    work = cg.work_buffer(lib, 1, D, Fd, "cuda")
    y = torch.empty(1, D, device="cuda", dtype=dt)
    act = torch.empty(1, Fd, device="cuda", dtype=dt)
    part = torch.empty(tg.CONFIG["down"]["splits"], 1, D, device="cuda", dtype=torch.float32)
    part2 = torch.empty(tg.CONFIG["down"]["splits"], 1, 2 * Fd, device="cuda", dtype=torch.float32)

    def dense():
        for w in Ws:
            g, u = F.linear(x, w["w13"]).chunk(2, -1)
            F.linear(F.silu(g) * u, w["w2"])

    micro = {"dense_us": graph_ms(dense) / L * 1e3}
    micro["dense_GBs"] = 3 * D * Fd * 2 / (micro["dense_us"] * 1e-6) / 1e9
    print("dense FFN", micro, flush=True)

    def pred_thr(keep):
        out = []
        for w in Ws:
            zf = F.linear(x, w["at"]).float()
            out.append(float((F.silu(zf @ w["bg"].float()) * (zf @ w["bu"].float())).abs()[0].quantile(1 - keep)))
        return out

    def mag_thr(keep):
        thr_in = float(x.float().abs().quantile(1 - keep))
        return thr_in, [float(mag_parts(x, w["w13t"], thr_in).abs().quantile(1 - keep)) for w in Ws]

    def run_pred_cuda(th):
        def f():
            for w, t in zip(Ws, th):
                z = F.linear(x, w["at"])
                cg.ffn_predictor(lib, x, z, w["bg_t"], w["bu_t"], w["w13"][:Fd], w["w13"][Fd:], w["wdt"], t, work, y)
        return f

    def run_pred_triton(th):
        def f():
            for w, t in zip(Ws, th):
                z = F.linear(x, w["at"])
                tg.paths_gateup(x, z, w["bg"], w["bu"], w["w13"][:Fd], w["w13"][Fd:], t, out=act)
                tg.paths_down(act, w["wdt"], part=part)
        return f

    def run_mag_cuda(thr_in, th):
        def f():
            for w, t in zip(Ws, th):
                cg.ffn_magnitude(lib, x, w["w13t"], w["wdt"], thr_in, t, work, y)
        return f

    def run_mag_triton(thr_in, th):   # PathsDecoder's Triton magnitude path
        def f():
            for w, t in zip(Ws, th):
                hm = x * (x.abs() >= thr_in)
                g, u = tg.paths_down(hm, w["w13t"], part=part2, splits=32).chunk(2, -1)
                aa = F.silu(g) * u
                act.copy_(aa * (aa.abs() >= t))
                tg.paths_down(act, w["wdt"], part=part)
        return f

    sweep = {}
    th5, (ti5, tm5) = pred_thr(0.5), mag_thr(0.5)
    best = {"down": (1e9, 64), "rows": (1e9, 64), "pred": (1e9, 8)}
    for c in (32, 64, 128, 256):
        lib.ze_paths_set_config(0, c, 0)
        us = graph_ms(run_mag_cuda(ti5, tm5)) / L * 1e3
        sweep[f"down_chunk{c}"] = {"mag_us": us}
        best["down"] = min(best["down"], (us, c))
    lib.ze_paths_set_config(0, best["down"][1], 0)
    for r in (32, 64, 128, 256):
        lib.ze_paths_set_config(0, 0, r)
        us = graph_ms(run_mag_cuda(ti5, tm5)) / L * 1e3
        sweep[f"gateup_rows{r}"] = {"mag_us": us}
        best["rows"] = min(best["rows"], (us, r))
    lib.ze_paths_set_config(0, 0, best["rows"][1])
    for c in (2, 4, 8, 16, 32):
        lib.ze_paths_set_config(c, 0, 0)
        us = graph_ms(run_pred_cuda(th5)) / L * 1e3
        sweep[f"pred_chunk{c}"] = {"pred_us": us}
        best["pred"] = min(best["pred"], (us, c))
    lib.ze_paths_set_config(best["pred"][1], 0, 0)
    res["sweep"] = sweep
    res["config"] = {k: v[1] for k, v in best.items()}
    print("sweep", json.dumps(sweep), "best", res["config"], flush=True)

    for keep in (0.9, 0.7, 0.5, 0.3):
        th = pred_thr(keep)
        ti, tm = mag_thr(keep)
        pb = (keep * 3 * D * Fd + 2 * R * Fd + R * D) * 2
        mb = (keep * D * 2 * Fd + keep * Fd * D) * 2
        row = {}
        for name, fn, byt in (("pred_cuda", run_pred_cuda(th), pb), ("pred_triton", run_pred_triton(th), pb),
                              ("mag_cuda", run_mag_cuda(ti, tm), mb), ("mag_triton", run_mag_triton(ti, tm), mb)):
            us = graph_ms(fn) / L * 1e3
            row[name] = {"us": us, "GBs": byt / (us * 1e-6) / 1e9, "of_copy": byt / (us * 1e-6) / 1e9 / res["copy_bw_GBs"],
                         "vs_dense": micro["dense_us"] / us, "bytes_MB": byt / 1e6}
        micro[f"keep{keep}"] = row
        print(f"keep {keep}", json.dumps(row), flush=True)
    res["micro"] = micro
    Ws.clear()
    torch.cuda.empty_cache()
    (out / "paths_cuda_h200.json").write_text(json.dumps(res, indent=1))

    # ---- 3. decode, batch 1: dense vs PathsDecoder (cuda / triton kernels) ------------------
    if not a.skip_decode:
        from zeroedge.paths.decode import PathsDecoder
        from zeroedge.paths.predictor import PathPredictor
        from zeroedge.paths.sparse import PathPolicy
        from zeroedge.runtime.fast import DenseDecoder

        with torch.device("cuda"):
            m = build(cfg, dtype=dt, seed=0)
        m = m.to("cuda", dt)
        max_len = 2048
        dense_dec = DenseDecoder(m, max_len, graph=True)
        dense_dec.kv.normal_()
        dec = {"dense_ms": decode_ms_of(dense_dec)}
        del dense_dec
        torch.cuda.empty_cache()

        class Rec(PathsDecoder):
            record = None

            def _paths_ffn(self, pp, h):
                if self.record is not None:
                    self.record[pp["li"]].append(h.detach().clone())
                return super()._paths_ffn(pp, h)

        def policies(kind):
            if kind == "magnitude":
                return {i: PathPolicy(method="magnitude", threshold_in=0.0, threshold=0.0) for i in range(L)}
            g = torch.Generator().manual_seed(1)
            return {i: PathPolicy(method="predictor", predictor=PathPredictor(
                torch.randn(D, R, generator=g) / D ** 0.5, torch.randn(R, Fd, generator=g) / R ** 0.5,
                torch.randn(R, Fd, generator=g) / R ** 0.5, torch.ones(Fd))) for i in range(L)}

        for kind in ("magnitude", "predictor"):
            for keep in (0.87, 0.73, 0.5):
                for kern in ("cuda", "triton"):
                    pd = Rec(m, max_len, policies(kind), kernels=kern, kernels_lib=so)
                    for i, pp in pd.paths.items():
                        pp["li"] = i
                    pd.kv.normal_()
                    pd.record = {i: [] for i in range(L)}
                    gw, pd.graph_wanted = pd.graph_wanted, False
                    for s in range(8):
                        pd.step(1 + s, 1024 + s)
                    pd.graph_wanted, rec = gw, pd.record
                    pd.record = None
                    for i, pp in pd.paths.items():
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
                    ms = decode_ms_of(pd)
                    name = f"{kind}_{kern}_keep{keep}"
                    dec[name] = {"ms": ms, "tok_s": 1e3 / ms, "speedup": dec["dense_ms"] / ms}
                    print(name, dec[name], flush=True)
                    del pd
                    torch.cuda.empty_cache()
        dec["dense_tok_s"] = 1e3 / dec["dense_ms"]
        res["decode"] = dec
    (out / "paths_cuda_h200.json").write_text(json.dumps(res, indent=1))

    print("\nSUMMARY")
    print(f"copy {res['copy_bw_GBs']:.0f} GB/s; dense FFN {micro['dense_us']:.1f} us/layer "
          f"{micro['dense_GBs']:.0f} GB/s; config {res['config']}")
    bad = [k for k, v in checks.items() if k != "bad_args" and (max(v["rel"]) > 2e-2 or v["nan"] or v["rc"]
                                                               or not v["work_left_zero"] or v["rel_dirty_work"] > 2e-2)]
    print("checks:", "all ok" if not bad else f"FAILED {bad}", "| bad args rc", checks["bad_args"])
    print("| keep | kernel | us/layer | GB/s | of copy | vs dense FFN |")
    for keep in (0.9, 0.7, 0.5, 0.3):
        for k, v in micro[f"keep{keep}"].items():
            print(f"| {keep} | {k} | {v['us']:.1f} | {v['GBs']:.0f} | {v['of_copy']:.0%} | {v['vs_dense']:.2f}x |")
    if "decode" in res:
        print(f"decode dense {res['decode']['dense_tok_s']:.0f} tok/s")
        for k, v in res["decode"].items():
            if isinstance(v, dict):
                print(f"decode {k}: {v['tok_s']:.0f} tok/s x{v['speedup']:.2f}")


if __name__ == "__main__":
    main()
