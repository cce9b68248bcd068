"""A decode-loop switch off / on on a GPU: batch-1 decode ms a step of the DenseDecoder (llama-3.2-1b
shape, random weights; bf16 and packed int4 with int8 inputs), the switch alternated off / on twice
(three times with --reps 3), and the logits of one step with and without it (the same arithmetic:
they must agree bit for bit). Switches:
  pdl           programmatic dependent launch (ZEROEDGE_PDL=0 / 1)
  fused-inputs  the down projection's int8 inputs prepared in the gate/up GEMV's epilogue (the
                `then` of zeroedge.quant.triton_gemv.gemv) or by a launch of their own
  qkv-g32       the g32 q/k/v GEMV's launch setting (4 rows x 256 words, 4 warps) or the one before (CONFIG_I8)
  qkvo-split1   the g128 q/k/v and o GEMVs in one launch each (SPLIT 1) or split 4 with a sum launch
  early-weights the int8-input GEMVs' first weight tile loaded before PDL's wait
                (zeroedge.quant.triton_gemv.EARLY_WEIGHTS) or after it
  qkvo-prepared q/k/v and o on inputs rounded by a launch of their own, or in every program
  one-tile      gate/up g128, down g32 and the int8 LM head read in one tile a program
  head4         the LM head packed in the body's 4-bit scheme instead of int8 g128
  head4-launch  with --head4: the 4-bit head's launch (pick's fallback / the int8 head's shape)
  (the launch-setting switches sum in another order: the logits may differ by rounding; head4
  changes the weights)
(benchmarks/results/weights/h200_ab_cuda_q4_gemv.json came from a third switch, cuda-q4, in this script at commit 88eab61;
benchmarks/results/weights/h200_ab_early_kv.json from early-kv, the dense attention's first K / V block loaded before
PDL's wait, at commit 5ec0cbb + a change not kept: bf16 -1.5 %, int4 g128 +0.7 % at 8K, -1.1 % at 32K;
benchmarks/results/weights/h200_ab_early_two_tiles.json from early2, the prepared-input GEMVs' first two tiles before the wait
instead of one, a kernel change not kept: int4 g128 -1.3 %, g32 float-zp -3.1 % at 8K.)

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 benchmarks/gpu/pdl_gpu.py [--switch pdl] [--ctx 8192,32768] [--out DIR]
"""
from __future__ import annotations

import json
import os

import bench_setup as bs

GEN = 400
LAUNCH = {   # launch-setting switches: CONFIG_I8 key -> (off, on)
    "qkv-g32": {(3072, 2048, 4, 32): (dict(BN=8, BW=256, SPLIT=1, num_warps=8),
                                      dict(BN=4, BW=256, SPLIT=1, num_warps=4))},
    "qkvo-split1": {(3072, 2048, 4, 128): (dict(BN=8, BW=256, SPLIT=4, num_warps=8),
                                           dict(BN=8, BW=256, SPLIT=1, num_warps=8)),
                    (2048, 2048, 4, 128): (dict(BN=4, BW=256, SPLIT=4, num_warps=8),
                                           dict(BN=4, BW=256, SPLIT=1, num_warps=8))},
    # the multi-tile GEMVs in one tile a program (the first tile loads before PDL's wait)
    "one-tile": {(16384, 2048, 4, 128): (dict(BN=16, BW=128, SPLIT=1, num_warps=8, num_stages=4, PREPARED=True),
                                         dict(BN=16, BW=256, SPLIT=1, num_warps=8, PREPARED=True)),
                 (2048, 8192, 4, 32): (dict(BN=8, BW=128, SPLIT=4, num_warps=8, num_stages=1, PREPARED=True),
                                       dict(BN=8, BW=256, SPLIT=4, num_warps=8, num_stages=1, PREPARED=True)),
                 (128256, 2048, 8, 128): (dict(BN=16, BW=128, SPLIT=1, num_warps=8, PREPARED=True),
                                          dict(BN=16, BW=512, SPLIT=1, num_warps=8, PREPARED=True))},
    "qkvo-prepared": {key: (dict(cfg, PREPARED=False), dict(cfg, PREPARED=True)) for key, cfg in (
        ((3072, 2048, 4, 32), dict(BN=4, BW=256, SPLIT=1, num_warps=4)),
        ((3072, 2048, 4, 128), dict(BN=8, BW=256, SPLIT=4, num_warps=8)),
        ((2048, 2048, 4, 32), dict(BN=4, BW=256, SPLIT=1, num_warps=8)),
        ((2048, 2048, 4, 128), dict(BN=4, BW=256, SPLIT=4, num_warps=8)))},
    # a 4-bit LM head (--head4): pick's fallback or the int8 head's rows and warps
    "head4-launch": {(128256, 2048, 4, g): (dict(BN=4, BW=256, SPLIT=1, num_warps=4, PREPARED=True),
                                            dict(BN=16, BW=256, SPLIT=1, num_warps=8, PREPARED=True))
                     for g in (32, 128)}}


def _set(switch: str, on: bool) -> None:
    from zeroedge.quant import triton_gemv

    if switch == "pdl":
        os.environ["ZEROEDGE_PDL"] = "1" if on else "0"
        return
    if switch == "early-weights":
        triton_gemv.EARLY_WEIGHTS = on
        return
    if switch == "head4":       # applied to each decoder (_head4)
        return
    if switch in LAUNCH:
        for key, (off, on_) in LAUNCH[switch].items():
            triton_gemv.CONFIG_I8[key] = dict(dict(PREPARED=False), **(on_ if on else off))
        return
    gemv = _set.gemv = getattr(_set, "gemv", triton_gemv.gemv)

    def unfused(*args, then=None, **kw):      # the next weight's inputs left to their own launch
        y = gemv(*args, **kw)
        return (y, None) if then is not None else y

    triton_gemv.gemv = gemv if on else unfused


def _head4(d, m, scheme, on: bool) -> None:
    """head4: the decoder reads the LM head packed in the body's 4-bit scheme (made once a model)."""
    from zeroedge.quant.groupwise import Scheme
    from zeroedge.quant.packed import PackedLinear

    if not on or d.packed_head is None:
        return
    if getattr(m, "_head4", None) is None:
        bits, group, sym, zp = scheme
        m._head4 = PackedLinear.from_weight(m.lm_head.weight.float(), Scheme(bits, group, sym, zp))
    d.packed_head = m._head4


def main(argv=None):
    ap = bs.parser(__doc__)
    bs.add_out(ap, "/tmp/pdl_out")
    bs.add_ctx(ap, "8192,32768")
    ap.add_argument("--switch", choices=("pdl", "fused-inputs", "early-weights", "head4", *LAUNCH),
                    default="pdl")
    ap.add_argument("--head4", action="store_true", help="every int4 row with the 4-bit LM head")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--variants", default="bf16,int4-g128-sym,int4-g32-fzp")
    a = ap.parse_args(argv)
    if not bs.cuda_or_skip("pdl_gpu: skipped, no CUDA GPU here"):
        return
    import torch

    import weights_gpu as W
    from zeroedge.quant.apply import apply, embedding_group
    from zeroedge.runtime.fast import DenseDecoder

    ctxs = bs.int_list(a.ctx)
    res = bs.device_info()
    res["switch"], res["rows"] = a.switch, []
    rows = res["rows"]
    for variant in a.variants.split(","):
        m = bs.build_model("llama-3.2-1b", "cuda", torch.bfloat16, max_seq_len=max(ctxs) + GEN)
        if variant != "bf16":
            apply(m, W.variant_section(variant, embedding_group(m.cfg.dim)), pack=True)
        i8 = variant != "bf16"
        for ctx in ctxs:
            for on in (False, True) * a.reps:
                _set(a.switch, on)
                d = DenseDecoder(m, ctx + GEN, int8_inputs=i8)
                _head4(d, m, W.SCHEMES.get(variant), a.head4 or (on and a.switch == "head4"))
                d.attention.kv.normal_()
                ms = bs.decode_step_ms(d, start=ctx, n=64)
                diff = None
                if on:
                    _set(a.switch, False)
                    e = DenseDecoder(m, ctx + GEN, int8_inputs=i8)
                    _head4(e, m, W.SCHEMES.get(variant), a.head4)
                    e.attention.kv.copy_(d.attention.kv)
                    diff = float((d.step(5, ctx + 100).float() - e.step(5, ctx + 100).float()).abs().max())
                    del e
                    exact = a.switch not in LAUNCH and a.switch != "head4"
                    assert diff == 0.0 or not exact, f"{variant} at {ctx}: logits differ with {a.switch} ({diff})"
                rows.append(dict(weights=variant + ("/int8-inputs" if i8 else ""), ctx=ctx, switch=a.switch,
                                 on=on, pdl=on if a.switch == "pdl" else None, ms=ms, tok_s=1e3 / ms,
                                 max_logit_diff=diff))
                print(json.dumps(rows[-1]), flush=True)
                del d
        del m
        torch.cuda.empty_cache()
    _set(a.switch, True)
    os.environ.pop("ZEROEDGE_PDL", None)
    names = {"early-weights": "early_weights", "head4": "int4_head", "head4-launch": "int4_head_launch",
             "qkv-g32": "qkv_g32_launch", "qkvo-split1": "qkvo_one_launch", "qkvo-prepared": "qkvo_prepared_inputs"}
    name = names.get(a.switch, a.switch.replace("-", "_"))     # the names under benchmarks/results/weights/
    bs.write_json(bs.out_dir(a.out) / f"h200_ab_{name}.json", res)


if __name__ == "__main__":
    main()
