"""Build plugins/src/kernels.cu into a shared library, bind its C API with ctypes, and check every
kernel against the PyTorch reference (zeroedge/backends/plugin_reference.py). Needs a CUDA GPU,
nvcc and PyTorch with CUDA; used by device_tests/test_kernels_gpu.py and the GPU benchmarks
benchmarks/gpu/run_kernels_h200.py and profile_sih.py (through bench_setup.kernels_ctypes)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
KERNELS = REPO / "plugins" / "src" / "kernels.cu"
F32, F16 = 0, 1


class Params(ctypes.Structure):
    _fields_ = [("threshold", ctypes.c_float), ("ma_w0", ctypes.c_float), ("ma_w1", ctypes.c_float),
                ("ma_w2", ctypes.c_float), ("min_tokens", ctypes.c_int32), ("protect_first", ctypes.c_int32),
                ("protect_last", ctypes.c_int32), ("block_size", ctypes.c_int32), ("block_frac", ctypes.c_float),
                ("anchor_rank", ctypes.c_int32), ("rate", ctypes.c_float), ("rank_block", ctypes.c_int32)]


class Weights(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in
                ("w1", "b1", "w2", "b2", "w3", "b3", "w4", "b4", "anchor_a", "anchor_b", "anchor_c")]


def build(out_dir: Path, arch: str = "sm_90") -> Path:
    """nvcc -shared the kernels for one architecture; returns the .so path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    so = out_dir / f"libzeroedge_kernels_{arch}.so"
    cmd = ["nvcc", "-std=c++17", "-O3", f"-arch={arch}", "-Xcompiler", "-fPIC", "-shared",
           "-I", str(REPO / "plugins" / "include"), str(KERNELS), "-o", str(so)]
    subprocess.run(cmd, check=True)
    return so


class Kernels:
    def __init__(self, so: Path):
        L = self.lib = ctypes.CDLL(str(so))
        vp, i64, i32, sz = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_size_t
        L.ze_sih_workspace_size.restype = sz
        L.ze_sih_workspace_size.argtypes = [i64, i64, i32, i32, ctypes.c_int]
        L.ze_sih_forward.restype = ctypes.c_int
        L.ze_sih_forward.argtypes = [ctypes.c_int, vp, i64, i64, i32, ctypes.POINTER(Weights), ctypes.POINTER(Params),
                                     vp, vp, vp, vp, sz, vp]
        L.ze_sih_chunk_forward.restype = ctypes.c_int
        L.ze_sih_chunk_forward.argtypes = [ctypes.c_int, vp, i64, i64, i32, ctypes.POINTER(Weights),
                                           ctypes.POINTER(Params), vp, vp, vp, vp, vp, vp, vp, sz, vp]
        L.ze_pad_gather.restype = ctypes.c_int
        L.ze_pad_gather.argtypes = [ctypes.c_int, vp, vp, i64, i64, vp, vp, vp, vp, sz, vp]
        L.ze_pad_scatter_workspace_size.restype = sz
        L.ze_pad_scatter_workspace_size.argtypes = [i64]
        L.ze_pad_scatter.restype = ctypes.c_int
        L.ze_pad_scatter.argtypes = [ctypes.c_int, vp, vp, vp, i64, i64, i64, vp, vp, sz, vp]
        L.ze_strerror.restype = ctypes.c_char_p
        L.ze_strerror.argtypes = [ctypes.c_int]
        L.ze_sih_set_variant.argtypes = [ctypes.c_int]
        L.ze_kernels_abi.restype = ctypes.c_int

    def _ok(self, rc):
        if rc != 0:
            raise RuntimeError(f"kernel launcher failed ({rc}): {self.lib.ze_strerror(rc).decode()}")

    @staticmethod
    def _stream():
        import torch

        return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    @staticmethod
    def dtype_code(t):
        import torch

        return {torch.float32: F32, torch.float16: F16}[t.dtype]

    def sih_workspace(self, T, D, W, R, dtype):
        import torch

        n = self.lib.ze_sih_workspace_size(T, D, W, R, dtype)
        return torch.empty(max(n, 256), dtype=torch.uint8, device="cuda")

    def sih(self, x, weights: dict, fields: dict, keep, base, scores=None, ws=None):
        """weights: w1..b4, anchor_a, anchor_b, anchor_c tensors (x's dtype); outputs preallocated."""
        T, D = x.shape
        W = weights["w1"].shape[0]
        R = int(fields["anchor_rank"])
        dt = self.dtype_code(x)
        ws = ws if ws is not None else self.sih_workspace(T, D, W, R, dt)
        w = Weights(*[ctypes.c_void_p(weights[n].data_ptr()) for n, _ in Weights._fields_])
        p = Params(**{n: fields[n] for n, _ in Params._fields_})
        self._ok(self.lib.ze_sih_forward(dt, x.data_ptr(), T, D, W, ctypes.byref(w), ctypes.byref(p), keep.data_ptr(),
                                         base.data_ptr(), scores.data_ptr() if scores is not None else None,
                                         ws.data_ptr(), ws.numel(), self._stream()))

    def sih_chunk(self, x, weights: dict, fields: dict, carry, span, keep, base, carry_out):
        """ZeroEdgeSIHChunk's kernels: rows x are positions span[0].. of a span[1]-token prompt (device
        tensors: carry, carry_out float32 [2], span int32 [2])."""
        T, D = x.shape
        W = weights["w1"].shape[0]
        R = int(fields["anchor_rank"])
        dt = self.dtype_code(x)
        ws = self.sih_workspace(T, D, W, R, dt)
        w = Weights(*[ctypes.c_void_p(weights[n].data_ptr()) for n, _ in Weights._fields_])
        p = Params(**{n: fields[n] for n, _ in Params._fields_})
        self._ok(self.lib.ze_sih_chunk_forward(dt, x.data_ptr(), T, D, W, ctypes.byref(w), ctypes.byref(p),
                                               carry.data_ptr(), span.data_ptr(), keep.data_ptr(), base.data_ptr(),
                                               carry_out.data_ptr(), None, ws.data_ptr(), ws.numel(), self._stream()))

    def gather(self, x, keep, xs, idx, count):
        T, D = x.shape
        self._ok(self.lib.ze_pad_gather(self.dtype_code(x), x.data_ptr(), keep.data_ptr(), T, D, xs.data_ptr(),
                                        idx.data_ptr(), count.data_ptr(), None, 0, self._stream()))

    def scatter(self, base, y, idx, K, out, ws):
        T, D = base.shape
        self._ok(self.lib.ze_pad_scatter(self.dtype_code(base), base.data_ptr(), y.data_ptr() if K else None,
                                         idx.data_ptr(), T, K, D, out.data_ptr(), ws.data_ptr(), ws.numel(),
                                         self._stream()))


# ---------------------------------------------------------------------------------------------- checks

def rel_err(out, ref) -> float:
    import torch

    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    den = ref.norm()
    return float((out - ref).norm() / (den if den > 0 else 1.0))


def make_sih(T, D, W, R, dtype, seed):
    """Random x and head/anchor weights with spread-out scores (biases keep the ReLUs alive)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)

    def rn(*s, scale=1.0):
        return (torch.randn(*s, generator=g, device="cuda") * scale).to(dtype)

    x = rn(T, D)
    w = {"w1": rn(W, D, scale=2.0 / D ** 0.5), "b1": rn(W, scale=0.1) + 0.5,
         "w2": rn(W, W, scale=1.0 / W ** 0.5), "b2": rn(W, scale=0.1) + 0.5,
         "w3": rn(W, W, scale=1.0 / W ** 0.5), "b3": rn(W, scale=0.1) + 0.5,
         "w4": rn(1, W, scale=2.0 / W ** 0.5), "b4": rn(1, scale=0.1),
         "anchor_a": rn(max(R, 1), D, scale=1.0 / D ** 0.5), "anchor_b": rn(D, max(R, 1), scale=1.0 / max(R, 1) ** 0.5),
         "anchor_c": rn(D, scale=0.1)}
    if R == 0:
        w["anchor_a"], w["anchor_b"] = w["anchor_a"][:0], w["anchor_b"][:, :0]
    return x, w


def check_sih(K: Kernels, T, D, W, R, dtype, block_size=0, quantile=0.5, seed=0, variant=0, min_tokens=32,
              rate=None, rank_block=512):
    """Run the SIH kernel on fresh random inputs (outputs poisoned first) against the reference (the
    threshold rule at the score's `quantile`, or with `rate` the rank rule). Returns a dict of errors;
    raises AssertionError on a failure."""
    import torch

    from zeroedge.backends import plugin_reference as ref

    tol = 1e-3 if dtype == torch.float16 else 1e-5
    x, w = make_sih(T, D, W, R, dtype, seed)
    w64 = {k: v.double() for k, v in w.items()}
    s_ref = ref.sih_scores(x.double(), *(w64[k] for k in ("w1", "b1", "w2", "b2", "w3", "b3", "w4", "b4")))
    sm = ref.smooth(s_ref.float(), 0.5, 0.333333, 0.166667)
    thr = float(torch.quantile(sm.float(), quantile)) if T > 0 else 0.5
    f = ref.sih_fields(threshold=thr, block_size=block_size, anchor_rank=R, min_tokens=min_tokens,
                       **({} if rate is None else {"rate": rate, "rank_block": rank_block}))
    keep = torch.full((T,), -7, dtype=torch.int32, device="cuda")
    base = torch.full((T, D), float("nan"), dtype=dtype, device="cuda")
    scores = torch.full((T,), float("nan"), dtype=torch.float32, device="cuda")
    K.lib.ze_sih_set_variant(variant)
    try:
        K.sih(x, w, f, keep, base, scores)
        torch.cuda.synchronize()
    finally:
        K.lib.ze_sih_set_variant(0)
    e_scores = rel_err(scores, s_ref)
    keep_from_kernel_scores = ref.sih_keep(scores, **f)
    keep_from_ref_scores = ref.sih_keep(s_ref.float(), **f)
    base_ref = ref.sih_base(x.double(), keep, w64["anchor_a"], w64["anchor_b"], w64["anchor_c"], R)
    e_base = rel_err(base, base_ref)
    flips = int((keep_from_ref_scores != keep).sum())
    res = {"T": T, "D": D, "W": W, "R": R, "dtype": str(dtype).split(".")[-1], "block_size": block_size,
           "rate": rate, "rank_block": rank_block if rate is not None else None,
           "variant": VARIANTS[variant], "scores_rel_err": e_scores, "base_rel_err": e_base,
           "kept": int(keep.clamp(min=0).sum()), "flips_vs_ref_scores": flips, "tol": tol}
    assert ((keep == 0) | (keep == 1)).all(), f"keep not fully written / not 0-1: {res}"
    assert torch.equal(keep, keep_from_kernel_scores), f"keep differs from the reference decision: {res}"
    assert e_scores <= tol, f"scores error: {res}"
    assert e_base <= tol, f"base error: {res}"
    # a flip against the reference scores may only come from a near-threshold score
    assert flips <= max(2, T // 200) * max(1, block_size), f"too many near-threshold flips: {res}"
    return res


def check_gather_scatter(K: Kernels, T, D, dtype, frac, seed=0):
    import torch

    from zeroedge.backends import plugin_reference as ref

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, D, generator=g, device="cuda").to(dtype)
    keep = (torch.rand(T, generator=g, device="cuda") < frac).to(torch.int32)
    xs = torch.full((T, D), float("nan"), dtype=dtype, device="cuda")
    idx = torch.full((T,), -9, dtype=torch.int32, device="cuda")
    cnt = torch.full((1,), -9, dtype=torch.int32, device="cuda")
    K.gather(x, keep, xs, idx, cnt)
    torch.cuda.synchronize()
    xs_r, idx_r, cnt_r = ref.pad_gather(x, keep)
    k = int(cnt_r)
    assert int(cnt) == k, (int(cnt), k)
    assert torch.equal(idx[:k], idx_r), "idx differs"
    assert torch.equal(xs[:k], xs_r), "xs differs"
    assert bool(torch.isnan(xs[k:].float()).all()) and bool((idx[k:] == -9).all()), "rows past K were written"
    base = torch.randn(T, D, generator=g, device="cuda").to(dtype)
    y = torch.randn(max(k, 1), D, generator=g, device="cuda").to(dtype)[:k]
    out = torch.full((T, D), float("nan"), dtype=dtype, device="cuda")
    ws = torch.empty(max(K.lib.ze_pad_scatter_workspace_size(T), 256), dtype=torch.uint8, device="cuda")
    K.scatter(base, y.contiguous(), idx_r, k, out, ws)
    torch.cuda.synchronize()
    out_r = ref.pad_scatter(base, y, idx_r)
    assert torch.equal(out, out_r), "scatter differs"
    return {"T": T, "D": D, "dtype": str(dtype).split(".")[-1], "frac": frac, "K": k,
            "gather": "exact", "scatter": "exact"}


VARIANTS = {0: "auto", 1: "generic proj", 2: "no PDL", 4: "CUDA-core base", 5: "generic proj + CUDA-core base"}
SIH_CASES = [  # T, D, W, R, dtype, block_size, variant
    (4096, 2048, 2, 16, "float16", 0, 0),
    (4096, 2048, 2, 16, "float16", 0, 1),
    (4096, 2048, 2, 16, "float16", 0, 2),
    (4096, 2048, 2, 16, "float16", 0, 4),
    (4133, 2048, 10, 64, "float16", 0, 0),
    (4133, 2048, 10, 64, "float16", 0, 5),
    (4096, 576, 10, 16, "float16", 64, 0),
    (31, 4096, 2, 16, "float16", 0, 0),
    (4096, 2048, 2, 16, "float32", 0, 0),
    (1000, 576, 10, 16, "float16", 64, 0),
    (1000, 576, 10, 16, "float32", 64, 0),
    (4099, 1024, 16, 64, "float16", 0, 0),
    (2050, 1024, 16, 32, "float16", 0, 0),
    (777, 520, 32, 8, "float16", 16, 0),
    (300, 64, 4, 0, "float32", 0, 0),
    (20, 256, 3, 16, "float16", 0, 0),
    (1, 64, 1, 1, "float32", 0, 0),
]
PAD_CASES = [(4096, 2048, "float16", 0.5), (4099, 576, "float32", 0.3), (1000, 520, "float16", 0.0),
             (777, 64, "float32", 1.0), (70000, 8, "float16", 0.7)]


def run_checks(K: Kernels, log=print) -> list:
    import torch

    out = []
    for i, (T, D, W, R, dt, bs, var) in enumerate(SIH_CASES):
        r = check_sih(K, T, D, W, R, getattr(torch, dt), block_size=bs, variant=var, seed=100 + i,
                      quantile=0.75 if bs else 0.5)
        log(f"SIH  ok  {r}")
        out.append(r)
    for i, (T, D, dt, frac) in enumerate(PAD_CASES):
        r = check_gather_scatter(K, T, D, getattr(torch, dt), frac, seed=200 + i)
        log(f"PAD  ok  {r}")
        out.append(r)
    return out


if __name__ == "__main__":
    so = build(Path(os.environ.get("ZE_BUILD", "/tmp/zeroedge_kernels")))
    run_checks(Kernels(so))
