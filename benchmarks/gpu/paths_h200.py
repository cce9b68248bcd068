"""Decode paths on a CUDA GPU (written for the H200): check the gather-GEMV kernels (Triton and the
plugin's CUDA C) against torch references, time them against copy bandwidth, and time batch-1 decode
of a llama-3.2-1b-shaped model (random weights, real shapes) dense vs sparse.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu/paths_h200.py --out DIR [--layers benchmarks/results/paths/gate_keep_per_layer_smollm2.json]

Dense side: zeroedge.runtime.fast.DenseDecoder (fused qkv / gate-up GEMVs, one CUDA graph a step).
Sparse side: the same decoder with each FFN replaced by z = h A (rank R), the Triton gate-up kernel
(predictor score, then only live rows of W_gate / W_up) and the Triton down kernel (only live rows
of W_down^T), captured in one CUDA graph too. Random weights make the predictor's choice random, so
per-layer thresholds are set from the scores of a few eager steps to hit the kept fractions wanted
(uniform levels, and the per-layer fractions measured by calibration on SmolLM2 mapped by depth).
Timing: median of graph replays with device events; FFN microbenchmarks rotate over 16 layers of
weights (1.6 GB, far past the 60 MB L2).
"""
from __future__ import annotations

import ctypes
import json
import statistics
import subprocess
from pathlib import Path

import bench_setup as bs
from bench_setup import copy_bw, graph_ms, rel

ROOT = bs.ROOT


def parse_args(argv=None):
    ap = bs.parser(__doc__)
    bs.add_out(ap, "/tmp/paths_out")
    ap.add_argument("--layers", default=str(ROOT / "benchmarks" / "results" / "paths" / "gate_keep_per_layer_smollm2.json"),
                    help="per-layer kept fractions measured by calibration (JSON with 'kept')")
    ap.add_argument("--rank", type=int, default=32, help="predictor rank R")
    return ap.parse_args(argv)


# ---- 1. correctness: Triton kernels vs fp32 torch reference, fresh random inputs ----------------

def check_triton(D, Fd, R, dt) -> dict:
    import torch
    import torch.nn.functional as F

    from zeroedge.paths import triton_gemv as tg

    checks = {}
    for B in (1, 4):
        x = torch.randn(B, D, device="cuda", dtype=dt)
        at = torch.randn(R, D, device="cuda", dtype=dt) / D ** 0.5
        bg = torch.randn(R, Fd, device="cuda", dtype=dt) / R ** 0.5
        bu = torch.randn(R, Fd, device="cuda", dtype=dt) / R ** 0.5
        wg = torch.randn(Fd, D, device="cuda", dtype=dt) * 0.02
        wu = torch.randn(Fd, D, device="cuda", dtype=dt) * 0.02
        wdt = torch.randn(Fd, D, device="cuda", dtype=dt) * 0.02
        z = F.linear(x, at)
        sc = (F.silu(z.float() @ bg.float()) * (z.float() @ bu.float())).abs().amax(0)
        thr = float(sc.quantile(0.5))
        act = torch.full((B, Fd), float("nan"), device="cuda", dtype=dt)   # poisoned
        tg.paths_gateup(x, z, bg, bu, wg, wu, thr, out=act)
        ref = tg.paths_gateup_ref(x, z, bg, bu, wg, wu, thr)
        y = tg.paths_down(act, wdt)
        yref = tg.paths_down_ref(ref, wdt)
        checks[f"triton_B{B}"] = {"gateup_rel": rel(act, ref), "down_rel": rel(y, yref),
                                  "nan": bool(act.isnan().any() or y.isnan().any()),
                                  "kept": float((act != 0).any(0).float().mean())}
    return checks


# ---- the plugin's CUDA C kernels through ctypes (fp16) ------------------------------------------

def _load_paths_lib(out: Path):
    lib_path = out / "libzeroedge_paths.so"
    subprocess.run(["nvcc", "-O3", "-arch=sm_90", "-shared", "-Xcompiler", "-fPIC",
                    "-I", str(ROOT / "plugins/include"), str(ROOT / "plugins/kernels/paths_gemv.cu"),
                    "-o", str(lib_path)], check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(lib_path))
    lib.ze_paths_down_work_bytes.restype = ctypes.c_size_t
    return lib


def _p(t):
    return ctypes.c_void_p(t.data_ptr())


def _time_cuda_c_pair(lib, x, z, bgt, but, act, y, work, thr, D, Fd, R) -> dict:
    """The CUDA C gate-up + down pair at batch 1 over 8 layers' worth of rotating weights."""
    import torch

    h = torch.float16
    W = [(torch.randn(Fd, D, device="cuda", dtype=h) * .02, torch.randn(Fd, D, device="cuda", dtype=h) * .02,
          torch.randn(Fd, D, device="cuda", dtype=h) * .02) for _ in range(8)]

    def run_c():
        st = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        for wg_, wu_, wd_ in W:
            lib.ze_paths_gateup(_p(x), _p(z), _p(bgt), _p(but), _p(wg_), _p(wu_), _p(act),
                                ctypes.c_float(thr), 1, D, Fd, R, st)
            lib.ze_paths_down(_p(act), _p(wd_), _p(y), _p(work), 1, D, Fd, st)

    ms = graph_ms(run_c) / len(W)
    kept = float((act != 0).float().mean())
    byt = (kept * 3 * D * Fd + 2 * R * Fd) * 2
    return {"ms_per_layer_keep50": ms, "bw_GBs_keep50": byt / (ms * 1e-3) / 1e9}


def check_cuda_c(out: Path, D, Fd, R) -> dict:
    """The CUDA C kernels against the torch reference (and timed at batch 1); an error is reported,
    not raised, so the Triton side still runs."""
    import torch
    import torch.nn.functional as F

    from zeroedge.paths import triton_gemv as tg

    checks = {}
    try:
        lib = _load_paths_lib(out)
        for B in (1, 4):
            h = torch.float16
            x = torch.randn(B, D, device="cuda", dtype=h)
            at = torch.randn(R, D, device="cuda", dtype=h) / D ** 0.5
            bgt = (torch.randn(Fd, R, device="cuda", dtype=h) / R ** 0.5).contiguous()
            but = (torch.randn(Fd, R, device="cuda", dtype=h) / R ** 0.5).contiguous()
            wg = torch.randn(Fd, D, device="cuda", dtype=h) * 0.02
            wu = torch.randn(Fd, D, device="cuda", dtype=h) * 0.02
            wdt = torch.randn(Fd, D, device="cuda", dtype=h) * 0.02
            z = F.linear(x, at)
            sc = (F.silu(z.float() @ bgt.float().T) * (z.float() @ but.float().T)).abs().amax(0)
            thr = float(sc.quantile(0.5))
            act = torch.full((B, Fd), float("nan"), device="cuda", dtype=h)
            y = torch.full((B, D), float("nan"), device="cuda", dtype=h)
            work = torch.empty(lib.ze_paths_down_work_bytes(B, D) // 4, device="cuda")
            st = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            rc1 = lib.ze_paths_gateup(_p(x), _p(z), _p(bgt), _p(but), _p(wg), _p(wu), _p(act),
                                      ctypes.c_float(thr), B, D, Fd, R, st)
            rc2 = lib.ze_paths_down(_p(act), _p(wdt), _p(y), _p(work), B, D, Fd, st)
            torch.cuda.synchronize()
            ref = tg.paths_gateup_ref(x, z, bgt.T, but.T, wg, wu, thr)
            checks[f"cuda_B{B}"] = {"rc": [rc1, rc2], "gateup_rel": rel(act, ref),
                                    "down_rel": rel(y, tg.paths_down_ref(act, wdt)),
                                    "nan": bool(act.isnan().any() or y.isnan().any())}
            if B == 1:  # time the CUDA C pair on 16 layers' worth of rotating weights
                checks["cuda_B1"].update(_time_cuda_c_pair(lib, x, z, bgt, but, act, y, work, thr, D, Fd, R))
    except Exception as e:  # report, keep going with the Triton side
        checks["cuda"] = {"error": f"{type(e).__name__}: {getattr(e, 'stderr', '') or e}"[:800]}
    return checks


# ---- 2. FFN microbenchmark: 16 layers' weights, batch 1 -----------------------------------------

def ffn_weights(L, D, Fd, R, dt) -> list:
    import torch

    Ws = []
    for _ in range(L):
        w13 = torch.randn(2 * Fd, D, device="cuda", dtype=dt) * 0.02
        w2 = torch.randn(D, Fd, device="cuda", dtype=dt) * 0.02
        Ws.append(dict(w13=w13, w2=w2, wdt=w2.T.contiguous(),
                       at=torch.randn(R, D, device="cuda", dtype=dt) / D ** 0.5,
                       bg=torch.randn(R, Fd, device="cuda", dtype=dt) / R ** 0.5,
                       bu=torch.randn(R, Fd, device="cuda", dtype=dt) / R ** 0.5))
    return Ws


def _thresholds(Ws, x, keep) -> list:
    """Per-layer predictor-score thresholds that keep a `keep` fraction of x's rows."""
    import torch.nn.functional as F

    thrs = []
    for w in Ws:
        z = F.linear(x, w["at"]).float()
        sc = (F.silu(z @ w["bg"].float()) * (z @ w["bu"].float())).abs()[0]
        thrs.append(float(sc.quantile(1 - keep)))
    return thrs


def sweep_configs(Ws, bufs, x, D, Fd, R, L) -> dict:
    """Each Triton kernel alone over 16 layers at keep 0.5, by block config; the fastest of each
    is set in triton_gemv.CONFIG."""
    import torch
    import torch.nn.functional as F

    from zeroedge.paths import triton_gemv as tg

    t5 = _thresholds(Ws, x, 0.5)
    zs = [F.linear(x, w["at"]) for w in Ws]
    sweep = {}
    best_g = None
    for BF, BK, nw in ((4, 1024, 4), (2, 1024, 2), (2, 2048, 2), (4, 1024, 2), (2, 512, 1), (2, 1024, 1)):
        def gu():
            for w, b, t, z in zip(Ws, bufs, t5, zs):
                tg.paths_gateup(x, z, w["bg"], w["bu"], w["w13"][:Fd], w["w13"][Fd:], t, out=b["act"],
                                BF=BF, BK=BK, num_warps=nw)
        ms = graph_ms(gu) / L
        bw = (0.5 * 2 * D * Fd + 2 * R * Fd) * 2 / (ms * 1e-3) / 1e9
        sweep[f"gateup BF{BF} BK{BK} w{nw}"] = {"us": ms * 1e3, "GBs": bw}
        if best_g is None or ms < best_g[0]:
            best_g = (ms, dict(BF=BF, BK=BK, num_warps=nw))
    best_d = None
    for kind, sp, BF, BD, nw in (("tile", 128, 16, 512, 4), ("rows", 256, 8, 2048, 8), ("rows", 128, 16, 2048, 8),
                                 ("rows_part", 256, 8, 2048, 8), ("rows_part", 512, 8, 2048, 8),
                                 ("rows_part", 128, 16, 2048, 8), ("rows_part", 256, 8, 1024, 4),
                                 ("rows_part", 512, 4, 1024, 4)):
        parts = [torch.empty(sp, 1, D, device="cuda", dtype=torch.float32) for _ in Ws]

        def dn():
            for w, b, pt in zip(Ws, bufs, parts):
                tg.paths_down(b["act"], w["wdt"], part=pt, splits=sp, BF=BF, BD=BD, num_warps=nw, kind=kind)
        ms = graph_ms(dn) / L
        bw = (0.5 * D * Fd) * 2 / (ms * 1e-3) / 1e9
        y_ = tg.paths_down(bufs[0]["act"], Ws[0]["wdt"], part=parts[0], splits=sp, BF=BF, BD=BD, num_warps=nw,
                           kind=kind)
        err = rel(y_, tg.paths_down_ref(bufs[0]["act"], Ws[0]["wdt"]))
        assert err < 1e-2, f"down {kind} S{sp} BF{BF} BD{BD}: rel err {err}"
        sweep[f"down {kind} S{sp} BF{BF} BD{BD} w{nw}"] = {"us": ms * 1e3, "GBs": bw, "rel_err": err}
        if best_d is None or ms < best_d[0]:
            best_d = (ms, dict(splits=sp, BF=BF, BD=BD, num_warps=nw, kind=kind))
    tg.CONFIG["gateup"], tg.CONFIG["down"] = best_g[1], best_d[1]
    return sweep


def ffn_micro(D, Fd, R, L, dt) -> dict:
    """Dense FFN vs the path FFN (Triton) at batch 1, 16 layers of weights rotating."""
    import torch
    import torch.nn.functional as F

    from zeroedge.paths import triton_gemv as tg

    Ws = ffn_weights(L, D, Fd, R, dt)
    x = torch.randn(1, D, device="cuda", dtype=dt)

    def dense_ffn():
        for w in Ws:
            g, u = F.linear(x, w["w13"]).chunk(2, -1)
            F.linear(F.silu(g) * u, w["w2"])

    micro = {"dense_ms_per_layer": graph_ms(dense_ffn) / L}
    micro["dense_bw_GBs"] = 3 * D * Fd * 2 / (micro["dense_ms_per_layer"] * 1e-3) / 1e9
    bufs = [dict(act=torch.empty(1, Fd, device="cuda", dtype=dt), part=None) for _ in Ws]
    sweep = sweep_configs(Ws, bufs, x, D, Fd, R, L)
    micro["sweep_keep0.5"] = sweep
    micro["chosen"] = dict(tg.CONFIG)
    print(json.dumps(sweep, indent=1), flush=True)
    for b in bufs:
        b["part"] = torch.empty(tg.CONFIG["down"]["splits"], 1, D, device="cuda", dtype=torch.float32)
    for keep in (0.9, 0.7, 0.5, 0.3):
        thrs = _thresholds(Ws, x, keep)

        def sparse_ffn():
            for w, b, t in zip(Ws, bufs, thrs):
                z = F.linear(x, w["at"])
                act = tg.paths_gateup(x, z, w["bg"], w["bu"], w["w13"][:Fd], w["w13"][Fd:], t, out=b["act"])
                tg.paths_down(act, w["wdt"], part=b["part"])

        ms = graph_ms(sparse_ffn) / L
        kept = statistics.mean(float((b["act"] != 0).float().mean()) for b in bufs)
        byt = (kept * 3 * D * Fd + R * (D + 2 * Fd)) * 2
        micro[f"keep{keep}"] = {"ms_per_layer": ms, "kept": kept, "bytes_per_layer": byt,
                                "bw_GBs": byt / (ms * 1e-3) / 1e9,
                                "speedup_vs_dense": micro["dense_ms_per_layer"] / ms}
    return micro


# ---- 3. decode loop: DenseDecoder vs the same with path FFNs, batch 1 ---------------------------

def random_predictor_decoder(m, max_len, keeps, R, D, Fd, dt):
    """A Decoder with every FFN through the Triton predictor path FFN (random predictors), each
    layer's threshold set for its kept fraction in `keeps` from 8 eager steps."""
    import torch
    import torch.nn.functional as F

    from zeroedge.paths import triton_gemv as tg
    from zeroedge.runtime.fast import Decoder, DenseAttention

    class RandomPredictorFFN:
        record = None

        def bind(self, layers, cfg, device, dtype):
            self.P = [dict(at=torch.randn(R, D, device="cuda", dtype=dt) / D ** 0.5,
                           bg=torch.randn(R, Fd, device="cuda", dtype=dt) / R ** 0.5,
                           bu=torch.randn(R, Fd, device="cuda", dtype=dt) / R ** 0.5,
                           wg=w["w13"][:Fd], wu=w["w13"][Fd:], wdt=w["w2"].T.contiguous(),
                           act=torch.empty(1, Fd, device="cuda", dtype=dt),
                           part=torch.empty(tg.CONFIG["down"]["splits"], 1, D, device="cuda", dtype=torch.float32),
                           thr=0.0) for w in layers]

        def out(self, li, w, wo, x, o):
            x = x + F.linear(o.reshape(1, -1), w["wo"])
            h = F.rms_norm(x, (x.shape[-1],), w["ln2"], w["eps2"])
            p = self.P[li]
            z = F.linear(h, p["at"])
            if self.record is not None:
                zf = z.float()
                self.record[li].append((F.silu(zf @ p["bg"].float()) * (zf @ p["bu"].float())).abs()[0])
            act = tg.paths_gateup(h, z, p["bg"], p["bu"], p["wg"], p["wu"], p["thr"], out=p["act"])
            return x + tg.paths_down(act, p["wdt"], part=p["part"])

        def kept(self):
            return {}

    ffn = RandomPredictorFFN()
    sd = Decoder(m, DenseAttention(max_len), ffn, graph=True)
    sd.attention.kv.normal_()
    ffn.record = {i: [] for i in range(len(ffn.P))}
    bs.eager_steps(sd)
    for i, p in enumerate(ffn.P):
        p["thr"] = float(torch.cat(ffn.record[i]).quantile(1 - keeps[i]))
    ffn.record = None
    return sd


def decode_plans(L, layers_path) -> dict:
    """Kept fraction per layer: uniform levels, and SmolLM2's calibrated fractions mapped by depth."""
    plans = {f"uniform_keep{k}": [k] * L for k in (0.9, 0.7, 0.5)}
    lp = Path(layers_path)
    if lp.is_file():
        src = json.loads(lp.read_text())["kept"]           # SmolLM2 per layer, by depth
        n = len(src)
        plans["calibrated_smollm2_by_depth"] = [src[min(n - 1, int((i + 0.5) * n / L))] for i in range(L)]
    return plans


def decode_predictor(m, dec: dict, plans: dict, R, D, Fd, dt, max_len):
    import torch

    for name, keeps in plans.items():
        sd = random_predictor_decoder(m, max_len, keeps, R, D, Fd, dt)
        ms = bs.decode_step_ms(sd)
        kept = statistics.mean(float((p["act"] != 0).float().mean()) for p in sd.P)
        dec[name] = {"ms": ms, "tok_s": 1e3 / ms, "speedup": dec["dense_ms"] / ms,
                     "kept_last_step": kept, "keeps_planned_mean": statistics.mean(keeps)}
        print(name, dec[name], flush=True)
        del sd
        torch.cuda.empty_cache()


def decode_magnitude(m, dec: dict, L, max_len):
    """The magnitude rule (calibration's default) through zeroedge.runtime.fast's Decoder with
    zeroedge.paths.ffn.PathsFFN: gate / up rows of the small |h_k| and down rows of the small |a_j| are
    never read."""
    import torch
    import torch.nn.functional as F

    from zeroedge.paths.sparse import PathPolicy

    for keep in (0.87, 0.73, 0.5):
        md, ffn = bs.recording_paths_decoder(m, max_len, {i: PathPolicy(method="magnitude", threshold_in=0.0,
                                                                         threshold=0.0) for i in range(L)})
        md.attention.kv.normal_()
        ffn.record = {i: [] for i in range(L)}
        bs.eager_steps(md)
        rec, ffn.record = ffn.record, None
        for i, p in ffn.paths.items():
            h = torch.cat(rec[i]).float()
            g, u = (h @ md.W.layers[i]["w13"].float().T).chunk(2, -1)
            p["thr_in"] = float(h.abs().quantile(1 - keep))
            p["thr"] = float((F.silu(g) * u).abs().quantile(1 - keep))
        ms = bs.decode_step_ms(md)
        name = f"magnitude_keep{keep}"
        dec[name] = {"ms": ms, "tok_s": 1e3 / ms, "speedup": dec["dense_ms"] / ms, "kept_last_step": keep,
                     "ffn_bytes_skipped": 1 - keep, "keeps_planned_mean": keep}
        print(name, dec[name], flush=True)
        del md, ffn
        torch.cuda.empty_cache()


def decode_bench(cfg, R, dt, layers_path) -> dict:
    import torch

    from zeroedge.runtime.fast import DenseDecoder

    D, Fd, L = cfg.dim, cfg.ffn_dim, cfg.n_layers
    m = bs.build_model("llama-3.2-1b", "cuda", dt)
    max_len = 2048
    dense = DenseDecoder(m, max_len, graph=True)
    dense.attention.kv.normal_()
    dec = {"dense_ms": bs.decode_step_ms(dense)}
    dec["dense_tok_s"] = 1e3 / dec["dense_ms"]
    del dense
    torch.cuda.empty_cache()
    decode_predictor(m, dec, decode_plans(L, layers_path), R, D, Fd, dt, max_len)
    decode_magnitude(m, dec, L, max_len)
    return dec


def print_summary(res):
    micro, dec = res["ffn_micro"], res["decode"]
    print("\nSUMMARY")
    print(f"copy bw {res['copy_bw_GBs']:.0f} GB/s; dense FFN {micro['dense_bw_GBs']:.0f} GB/s")
    for k, v in micro.items():
        if k.startswith("keep"):
            print(f"ffn {k}: kept {v['kept']:.2f} {v['ms_per_layer'] * 1e3:.1f} us/layer "
                  f"{v['bw_GBs']:.0f} GB/s ({v['bw_GBs'] / res['copy_bw_GBs']:.0%} of copy) x{v['speedup_vs_dense']:.2f}")
    print(f"decode dense {dec['dense_tok_s']:.0f} tok/s")
    for k, v in dec.items():
        if isinstance(v, dict):
            print(f"decode {k}: {v['tok_s']:.0f} tok/s x{v['speedup']:.2f} (kept {v['kept_last_step']:.2f})")


def main(argv=None):
    a = parse_args(argv)
    if not bs.cuda_or_skip("paths_h200: skipped, no CUDA GPU here (this script needs one, e.g. the H200)"):
        return
    import torch

    from zeroedge.model import PRESETS

    out = bs.out_dir(a.out)
    res = bs.device_info()
    torch.manual_seed(0)
    cfg = PRESETS["llama-3.2-1b"]
    D, Fd, R, L = cfg.dim, cfg.ffn_dim, a.rank, cfg.n_layers
    dt = torch.bfloat16
    res["copy_bw_GBs"] = copy_bw() / 1e9
    print(f"copy bandwidth (read + write): {res['copy_bw_GBs']:.0f} GB/s", flush=True)
    checks = check_triton(D, Fd, R, dt)
    checks.update(check_cuda_c(out, D, Fd, R))
    res["checks"] = checks
    print(json.dumps(checks, indent=1), flush=True)
    res["ffn_micro"] = ffn_micro(D, Fd, R, L, dt)
    print(json.dumps(res["ffn_micro"], indent=1), flush=True)
    res["decode"] = decode_bench(cfg, R, dt, a.layers)
    bs.write_json(out / "h200_triton_kernels_llama1b_shape.json", res)
    print_summary(res)


if __name__ == "__main__":
    main()
