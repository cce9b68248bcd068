"""The plugin library's CUDA 4-bit GEMV (plugins/kernels/q4_gemv.cu, session 12) against the Triton
packed GEMV at llama-3.2-1b's q/k/v, o, gate/up and down shapes, int8 inputs, g128 / g32: us a call in
a CUDA graph of 20 calls, each launch setting (rows a warp R, 16-byte loads a lane U), and the error
against the rounded reference.

    PYTHONPATH=$PWD python3 benchmarks/gpu/cuda_q4_alone_gpu.py plugins/build/libzeroedge_kernels.so
"""
import ctypes, json, os, sys
sys.path.insert(0, "benchmarks/gpu")
import torch
import torch.nn.functional as F
import bench_setup as bs
import weights_gpu as W
from zeroedge.quant import triton_gemv as tg
from zeroedge.quant.packed import round_inputs_int8

lib = ctypes.CDLL(sys.argv[1])
vp, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
lib.ze_q4_gemv.restype = i
lib.ze_q4_gemv.argtypes = [i, vp, vp, f, vp, vp, vp, vp, vp, i, i, i, i, i, i, i, vp]
P = lambda t: ctypes.c_void_p(t.data_ptr()) if t is not None else None

def cuda(x, w, y, norm=None, res=None, swiglu=False, R=1, U=2, pdl=1):
    n = w.n // 2 if swiglu else w.n
    rc = lib.ze_q4_gemv(2, P(x), P(norm[0]) if norm else None, float(norm[1]) if norm else 0.0, P(w.q), P(w.scale),
                        P(w.offset), P(res), P(y), n, w.k, w.group, int(swiglu), R, U, pdl,
                        ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    assert rc == 0, rc
    return y

def us(fn, reps=20):
    def many():
        for _ in range(reps):
            fn()
    return bs.graph_ms(many) * 1e3 / reps

torch.manual_seed(0)
res = []
for group in (128, 32):
    for name, n, k, sw, nrm, rs in (("qkv", 3072, 2048, False, True, False), ("o", 2048, 2048, False, False, True),
                                    ("gate/up", 16384, 2048, True, True, False), ("down", 2048, 8192, False, False, True)):
        w = W.random_packed(n, k, 4, group, 1)
        x = (torch.randn(1, k, device="cuda") * 2).bfloat16()
        ln = (torch.rand(k, device="cuda") + 0.5).bfloat16()
        r = torch.randn(1, n // 2 if sw else n, device="cuda").bfloat16() if rs else None
        norm = (ln, 1e-5) if nrm else None
        xi = round_inputs_int8(F.rms_norm(x.float(), (k,), ln.float(), 1e-5) if nrm else x.float(), 4)
        ref = xi @ w.dequantize().T
        if sw:
            g_, u_ = ref.chunk(2, -1)
            ref = F.silu(g_) * u_
        if rs:
            ref = ref + r.float()
        y = torch.empty(1, n // 2 if sw else n, device="cuda", dtype=torch.bfloat16)
        nbytes = w.q.numel() + 4 * w.scale.numel()
        t_tr = us(lambda: tg.gemv(x, w, swiglu=sw, norm=norm, residual=r, int8_inputs=True))
        yt = tg.gemv(x, w, swiglu=sw, norm=norm, residual=r, int8_inputs=True)
        row = dict(shape=name, group=group, triton_us=t_tr, triton_tbs=nbytes / t_tr / 1e6,
                   triton_rel=float((yt.float() - ref).norm() / ref.norm()))
        for R in (1, 2):
            for U in (2, 4):
                cuda(x, w, y, norm, r, sw, R, U)
                torch.cuda.synchronize()
                rel = float((y.float() - ref).norm() / ref.norm())
                t = us(lambda: cuda(x, w, y, norm, r, sw, R, U))
                row[f"cuda_R{R}U{U}_us"] = t
                row[f"cuda_R{R}U{U}_rel"] = rel
        best = min((row[f"cuda_R{R}U{U}_us"], f"R{R}U{U}") for R in (1, 2) for U in (2, 4))
        print(f"{name:8s} g{group:<4d} triton {t_tr:6.2f} us ({row['triton_tbs']:.2f} TB/s, rel {row['triton_rel']:.1e})"
              f"  cuda best {best[1]} {best[0]:6.2f} us ({nbytes / best[0] / 1e6:.2f} TB/s)  "
              + " ".join(f"R{R}U{U} {row[f'cuda_R{R}U{U}_us']:.2f}/{row[f'cuda_R{R}U{U}_rel']:.1e}" for R in (1, 2) for U in (2, 4)),
              flush=True)
        res.append(row)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "q4_bench.json"), "w"), indent=1)
