"""4-bit weights in the torch decode loop on a GPU (written for the H200): the packed GEMV
(zeroedge.quant.triton_gemv) checked against its fp32 reference, its launch settings swept per matrix
of the llama-3.2-1b shape (against cuBLAS bf16 on the same shape), then batch-1 decode tok/s of the
bf16 DenseDecoder against the same loop over packed weights (int4 group 32 with a float zero point --
Q4_1's grid -- and int4 group 128 symmetric; the LM head int8), at each context, beside the bandwidth
roofline of the bytes each step really reads; and the thermal decoder (10 % hot) bf16 vs int4.
Random weights (speed and bytes only; quality: benchmarks/weights_quality.py on SmolLM2).

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 benchmarks/gpu/weights_gpu.py [--ctx 8192,32768] [--out DIR]

Timing: CUDA graphs, device events, medians (bench_setup); the GEMV sweep rotates over enough copies
of each matrix to pass 256 MB (far past the 60 MB L2).
"""
from __future__ import annotations

import itertools
import json

import bench_setup as bs

GEN = 400
SCHEMES = {"int4-g32-fzp": (4, 32, False, "float"), "int4-g128-sym": (4, 128, True, "int")}
# the same with the embedding (= tied LM head) int4 (`calibrate --embedding int4`)
EMBEDDING4 = {"int4-g32-fzp-e4": "int4-g32-fzp", "int4-g128-sym-e4": "int4-g128-sym"}


def parse_args(argv=None):
    ap = bs.parser(__doc__)
    bs.add_out(ap, "/tmp/weights_gpu_out")
    bs.add_ctx(ap, "8192,32768")
    ap.add_argument("--no-sweep", action="store_true", help="use the CONFIG in triton_gemv as it is")
    ap.add_argument("--attn-compare", action="store_true",
                    help="each dense row also with the torch attention (attn='sdpa') beside the Triton one")
    ap.add_argument("--variants", default=None,
                    help="comma-separated decode rows' weights (default: every scheme, exact and int8 inputs; "
                         f"also {', '.join(k + '/int8-inputs' for k in EMBEDDING4)})")
    ap.add_argument("--dense-only", action="store_true",
                    help="the graphed dense rows only (no compiled, paths or thermal rows)")
    ap.add_argument("--paths-only", action="store_true",
                    help="decode rows of bf16 and int4 g32 float-zp (int8 inputs) only: dense and both paths rules")
    return ap.parse_args(argv)


def section(bits, group, sym, zp, emb_group, emb_bits: int = 8):
    from zeroedge.calib_artifact import WeightsSection

    return WeightsSection(bits=bits, group=group, symmetric=sym, method="rtn", embedding_bits=emb_bits,
                          embedding_group=emb_group, meta={}, zero_point=zp)


def variant_section(scheme: str, emb_group: int):
    """A decode row's weights name (a SCHEMES or EMBEDDING4 key) -> its WeightsSection."""
    if scheme in EMBEDDING4:
        return section(*SCHEMES[EMBEDDING4[scheme]], emb_group, 4)
    return section(*SCHEMES[scheme], emb_group)


def shapes(cfg) -> dict:
    hd = cfg.head_dim
    return {"qkv": (cfg.n_heads * hd + 2 * cfg.n_kv_heads * hd, cfg.dim, False),
            "o": (cfg.dim, cfg.n_heads * hd, False), "w13": (2 * cfg.ffn_dim, cfg.dim, True),
            "w2": (cfg.dim, cfg.ffn_dim, False), "lm": (cfg.vocab_size, cfg.dim, False)}


def random_packed(n, k, bits, group, seed):
    import torch

    from zeroedge.quant.packed import PackedLinear

    g = torch.Generator(device="cuda").manual_seed(seed)
    kp = -(-k // group) * group
    q = torch.randint(0, 256, (n, kp * bits // 8), generator=g, device="cuda", dtype=torch.int32).to(torch.uint8)
    s = (torch.rand(n, kp // group, generator=g, device="cuda") * 1e-3).half()
    o = (-torch.rand(n, kp // group, generator=g, device="cuda") * 8e-3).half()
    return PackedLinear(q, s, o, bits, group, k)


def check_gemv(cfg) -> dict:
    """rel error of the kernel (bf16 in, bf16 out) against x @ W^T in fp32, per shape and scheme."""
    import torch
    import torch.nn.functional as F

    from zeroedge.quant import triton_gemv as tg
    from zeroedge.quant.groupwise import Scheme
    from zeroedge.quant.packed import PackedLinear

    out = {}
    for (name, (n, k, sw)), (sname, sch) in itertools.product(shapes(cfg).items(), SCHEMES.items()):
        if name == "lm":
            sch = (8, 128, True, "int")
        w = torch.randn(n, k, device="cuda") * 0.02
        p = PackedLinear.from_weight(w, Scheme(*sch))
        x = torch.randn(1, k, device="cuda").bfloat16()
        ref = x.float() @ p.dequantize().T
        if sw:
            g, u = ref.chunk(2, -1)
            ref = F.silu(g) * u
        r = torch.randn(1, ref.shape[1], device="cuda").bfloat16()
        y = tg.gemv(x, p, swiglu=sw)
        y2 = tg.gemv(x, p, residual=r) if not sw else y
        y8 = tg.gemv(x, p, swiglu=sw, int8_inputs=True)
        torch.cuda.synchronize()
        out[f"{name}/{sname}"] = {"rel": bs.rel(y, ref), "rel_residual": bs.rel(y2, ref + r.float()) if not sw else None,
                                  "rel_int8_inputs": bs.rel(y8, ref)}
    return out


def _grid(n, swiglu, int8_inputs=False):
    """Rows a program (BN) x words a row an iteration (BW) x input splits (x int8 inputs rounded in
    every program or once by a first kernel)."""
    splits = (1,) if n > 8192 else (1, 2, 4)
    return [dict(BN=bn, BW=bw, SPLIT=sp, num_warps=nw, PREPARED=pr)
            for bn, bw, sp, nw, pr in itertools.product((2, 4, 8, 16), (64, 128, 256), splits, (4, 8),
                                                        (False, True) if int8_inputs else (False,))]


def sweep_shape(name, n, k, swiglu, bits, group, int8_inputs=False) -> dict:
    """Best launch settings for one shape: µs a call (rotating copies), bytes/s, against cuBLAS bf16."""
    import torch
    import torch.nn.functional as F

    from zeroedge.quant import triton_gemv as tg

    one = random_packed(n, k, bits, group, 0)
    copies = max(2, min(64, -(-256 * 2**20 // one.nbytes())))
    ws = [one] + [random_packed(n, k, bits, group, i) for i in range(1, copies)]
    x = torch.randn(1, k, device="cuda").bfloat16()
    res = {"n": n, "k": k, "bits": bits, "group": group, "bytes": one.nbytes(), "configs": []}
    best = None
    for c in _grid(n, swiglu, int8_inputs):
        try:
            ms = bs.graph_ms(lambda: [tg.gemv(x, w, swiglu=swiglu, config=c, int8_inputs=int8_inputs) for w in ws],
                             reps=10)
        except Exception as e:       # a tile the compiler refuses (registers, shared memory)
            res["configs"].append({**c, "error": str(e).splitlines()[0][:120]})
            continue
        us = ms * 1e3 / copies
        res["configs"].append({**c, "us": us})
        if best is None or us < best[0]:
            best = (us, c)
    res["best"] = dict(best[1])
    res["us"] = best[0]
    res["GBs"] = one.nbytes() / (best[0] * 1e-6) / 1e9
    del ws
    wb = [torch.randn(n, k, device="cuda").bfloat16() for _ in range(max(2, min(64, -(-256 * 2**20 // (n * k * 2)))))]
    ms = bs.graph_ms(lambda: [F.linear(x, w) for w in wb], reps=10)
    res["cublas_bf16_us"] = ms * 1e3 / len(wb)
    res["cublas_bf16_GBs"] = n * k * 2 / (res["cublas_bf16_us"] * 1e-6) / 1e9
    res["x_cublas"] = res["cublas_bf16_us"] / res["us"]
    del wb
    torch.cuda.empty_cache()
    return res


def step_bytes(m, dec, ctx) -> dict:
    """Bytes one decode step reads: the weights as the step reads them, and the KV cache (SDPA over
    the dense cache reads every one of its positions; the Triton attention those up to the token)."""
    cfg = m.cfg
    if dec.packed_layers is None:
        lin = sum(w[k].numel() * 2 for w in dec.W.layers for k in ("wqkv", "wo", "w13", "w2"))
        head = m.lm_head.weight.numel() * 2
    else:
        lin = sum(w[k].nbytes() for w in dec.packed_layers for k in ("wqkv", "wo", "w13", "w2"))
        head = dec.packed_head.nbytes()
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * (ctx if dec.attention.takes_qkv else ctx + GEN) * cfg.head_dim * 2
    return {"linear": lin, "lm_head": head, "kv": kv, "total": lin + head + kv}


def paths_policies(m, keep: float) -> dict:
    """Magnitude-rule paths on every layer, thresholds keeping about `keep` of the FFN inputs and of
    the intermediate channels on a synthetic normed input (random weights: a speed setting; the rows
    report the fractions the timed steps really kept)."""
    import torch
    import torch.nn.functional as F

    from zeroedge.paths.sparse import PathPolicy

    g = torch.Generator(device="cuda").manual_seed(2)
    pol = {}
    for i, blk in enumerate(m.layers):
        h = torch.randn(64, m.cfg.dim, generator=g, device="cuda")
        h = F.rms_norm(h, (m.cfg.dim,), blk.post_attention_layernorm.weight.float(), 1e-5)
        t_in = float(h.abs().quantile(1 - keep))
        hm = h * (h.abs() >= t_in)
        act = F.silu(hm @ blk.mlp.gate_proj.weight.float().T) * (hm @ blk.mlp.up_proj.weight.float().T)
        pol[i] = PathPolicy(method="magnitude", threshold_in=t_in, threshold=float(act.abs().flatten().quantile(1 - keep)))
    return pol


def predictor_policies(m, keep: float, ctx: int, int8_inputs: bool, rank: int = 32) -> dict:
    """Predictor-rule paths on every layer: random rank-`rank` maps (random weights: a speed setting,
    no fit) whose per-layer thresholds are bisected on the decoder itself (eager steps over the same
    random cache the timed steps read) until each layer keeps about `keep` of its channels; the rows
    report the fractions the timed steps really kept."""
    import torch

    from zeroedge.paths.predictor import PathPredictor
    from zeroedge.paths.sparse import PathPolicy
    from zeroedge.runtime.fast import PathsDecoder

    g = torch.Generator(device="cuda").manual_seed(3)
    D, F_ = m.cfg.dim, m.cfg.ffn_dim
    pol = {i: PathPolicy(method="predictor", predictor=PathPredictor(
        torch.randn(D, rank, generator=g, device="cuda") / D ** 0.5,
        torch.randn(rank, F_, generator=g, device="cuda") / rank ** 0.5,
        torch.randn(rank, F_, generator=g, device="cuda") / rank ** 0.5, torch.ones(F_, device="cuda")))
        for i in range(len(m.layers))}
    dec = PathsDecoder(m, ctx + GEN, pol, graph=False, int8_inputs=int8_inputs)
    dec.attention.kv.normal_()
    lo, hi = {i: 1e-6 for i in pol}, {i: 1e3 for i in pol}
    for it in range(14):                      # bisection in log space, 4 steps a probe
        for i, p in dec.ffn.paths.items():
            p["thr"] = (lo[i] * hi[i]) ** 0.5
        kept = {i: 0.0 for i in pol}
        for t in range(4):
            dec.step(100 + t, ctx + t)
            for i, v in dec.kept().items():
                kept[i] += v / 4
        for i, p in dec.ffn.paths.items():
            if kept[i] > keep:
                lo[i] = p["thr"]
            else:
                hi[i] = p["thr"]
    for i, p in dec.ffn.paths.items():
        pol[i].predictor.threshold = p["thr"]
    del dec
    return pol


def decode(cfg_name, ctxs, bw, compile_too: bool = True, paths_keep: float = 0.5, paths_only: bool = False,
           attn_compare: bool = False, variants=None, dense_only: bool = False) -> list:
    import torch

    from zeroedge.quant import packed
    from zeroedge.quant.apply import apply, embedding_group
    from zeroedge.runtime.fast import DenseDecoder, PathsDecoder, ThermalDecoder

    rows = []
    variants = variants or ["bf16", *SCHEMES, "int4-g32-fzp/int8-inputs", "int4-g128-sym/int8-inputs"]
    if dense_only:
        compile_too = False
    if paths_only:
        variants, compile_too = ["bf16", "int4-g32-fzp/int8-inputs"], False
    for variant in variants:
        i8 = variant.endswith("/int8-inputs")
        scheme = variant.split("/")[0]
        m = bs.build_model(cfg_name, "cuda", torch.bfloat16, max_seq_len=max(ctxs) + GEN)
        if variant != "bf16":
            apply(m, variant_section(scheme, embedding_group(m.cfg.dim)), pack=True)
        runs = [(c, False, "auto") for c in ctxs] + ([(min(ctxs), True, "auto")] if compile_too else [])
        if attn_compare:
            runs += [(c, False, "sdpa") for c in ctxs]
        for ctx, compiled, attn in runs:
            dec = DenseDecoder(m, ctx + GEN, int8_inputs=i8, attn=attn)
            dec.compile = compiled
            dec.attention.kv.normal_()
            check = None
            if variant != "bf16" and not compiled:       # the graphed kernels against the torch reference, 3 steps
                ref = DenseDecoder(m, ctx + GEN, graph=False, int8_inputs=i8, attn=attn)
                ref.attention.kv.copy_(dec.attention.kv)
                use = packed._use_kernel
                errs = []
                for s in range(3):
                    a = dec.step(5 + s, ctx - 10 + s).float().clone()
                    packed._use_kernel = lambda x: False
                    try:
                        b = ref.step(5 + s, ctx - 10 + s).float()
                    finally:
                        packed._use_kernel = use
                    errs.append(bs.rel(a, b))
                check = max(errs)
                del ref
            ms = bs.decode_step_ms(dec, start=ctx, n=64)
            by = step_bytes(m, dec, ctx)
            name = "dense compiled" if compiled else "dense" if attn == "auto" else "dense " + attn
            rows.append({"ctx": ctx, "decoder": name, "attn": dec.attention.attn, "weights": variant,
                         "tok_s": round(1e3 / ms, 1),
                         "ms": ms, "bytes": by, "roofline_tok_s": round(bw / by["total"], 1),
                         "of_roofline": round((1e3 / ms) / (bw / by["total"]), 3), "rel_vs_reference": check})
            print(json.dumps(rows[-1]), flush=True)
            del dec
            torch.cuda.empty_cache()
        if variant in ("bf16", "int4-g32-fzp/int8-inputs") and not dense_only:   # paths on every layer, both rules
            for rule in ("", "predictor "):
                for ctx in ctxs:
                    pol = (predictor_policies(m, paths_keep, ctx, i8) if rule else paths_policies(m, paths_keep))
                    dec = PathsDecoder(m, ctx + GEN, pol, int8_inputs=i8)
                    dec.attention.kv.normal_()
                    ms = bs.decode_step_ms(dec, start=ctx, n=64)
                    kept = list(dec.kept().values())
                    rows.append({"ctx": ctx, "decoder": f"paths {rule}keep~{paths_keep}", "weights": variant,
                                 "tok_s": round(1e3 / ms, 1), "ms": ms,
                                 "kept_mean": round(sum(kept) / len(kept), 3)})
                    print(json.dumps(rows[-1]), flush=True)
                    del dec
                    torch.cuda.empty_cache()
        if variant in ("bf16", "int4-g32-fzp") and not (paths_only or dense_only):
            ctx = max(ctxs)
            ks, vs = bs.random_prefix(m.cfg, ctx, "cuda", torch.bfloat16)
            t = ThermalDecoder(m, ctx, GEN, budget=0.1)
            t.load_prefix(ks, vs)
            del ks, vs
            ms = bs.decode_step_ms(t, start=ctx, n=64)
            rows.append({"ctx": ctx, "decoder": "thermal", "weights": variant, "tok_s": round(1e3 / ms, 1), "ms": ms})
            print(json.dumps(rows[-1]), flush=True)
            del t
        del m
        torch.cuda.empty_cache()
    base = {(r["ctx"], r["decoder"]): r["ms"] for r in rows if r["weights"] == "bf16"}
    dense = {r["ctx"]: r["ms"] for r in rows if r["weights"] == "bf16" and r["decoder"] == "dense"}
    for r in rows:
        r["x_bf16"] = round(base[(r["ctx"], r["decoder"])] / r["ms"], 3)
        r["x_bf16_dense"] = round(dense[r["ctx"]] / r["ms"], 3)
    return rows


def main(argv=None):
    a = parse_args(argv)
    if not bs.cuda_or_skip("weights_gpu: skipped, no CUDA GPU here"):
        return
    import torch

    from zeroedge.model import PRESETS
    from zeroedge.quant import triton_gemv as tg

    out = bs.out_dir(a.out)
    torch.manual_seed(0)
    cfg = PRESETS["llama-3.2-1b"]
    res = bs.device_info()
    res["copy_bw_GBs"] = bs.copy_bw() / 1e9
    res["checks"] = check_gemv(cfg)
    print("checks", json.dumps(res["checks"]), flush=True)
    if not a.no_sweep:
        res["sweep"] = {}
        for (name, (n, k, sw)), sname in itertools.product(shapes(cfg).items(), SCHEMES):
            bits, group = (8, 128) if name == "lm" else SCHEMES[sname][:2]
            key = f"{name}/{bits}b-g{group}"
            if key in res["sweep"]:
                continue
            for i8 in (False, True):
                r = sweep_shape(name, n, k, sw, bits, group, int8_inputs=i8)
                res["sweep"][key + ("/int8-inputs" if i8 else "")] = r
                (tg.CONFIG_I8 if i8 else tg.CONFIG)[(n, k, bits, group)] = r["best"]   # what decode uses
                print(key, i8, {x: r[x] for x in ("best", "us", "GBs", "cublas_bf16_us", "x_cublas")}, flush=True)
    res["decode"] = decode("llama-3.2-1b", bs.int_list(a.ctx), res["copy_bw_GBs"] * 1e9, paths_only=a.paths_only,
                           attn_compare=a.attn_compare, variants=a.variants and a.variants.split(","),
                           dense_only=a.dense_only)
    name = ("h200_decode_int4_paths.json" if a.paths_only else "h200_decode_int4_vs_bf16.json" if a.no_sweep
            else "h200_gemv_launch_sweep_vs_cublas.json")      # the names under benchmarks/results/weights/
    bs.write_json(out / name, res)
    print("\nSUMMARY  copy %.0f GB/s" % res["copy_bw_GBs"])
    print("checks max rel", max(v["rel"] for v in res["checks"].values()),
          "int8 inputs", max(v["rel_int8_inputs"] for v in res["checks"].values()))
    for k, r in res.get("sweep", {}).items():
        print(f"| {k} | {r['best']} | {r['us']:.1f} us | {r['GBs']:.0f} GB/s | cuBLAS bf16 {r['cublas_bf16_us']:.1f} us "
              f"| x{r['x_cublas']:.2f} |")
    for r in res["decode"]:
        print(f"| {r['ctx']} | {r['decoder']} | {r['weights']} | {r['tok_s']} tok/s | x{r['x_bf16']} bf16 "
              f"| roofline {r.get('roofline_tok_s')} ({r.get('of_roofline')}) | rel {r.get('rel_vs_reference')} |")


if __name__ == "__main__":
    main()
