"""The plugin kernels on a CUDA GPU against the PyTorch reference (every shape in
kernels_ctypes.SIH_CASES / PAD_CASES, fresh random inputs, outputs poisoned first).
Skips without a CUDA GPU, PyTorch with CUDA, or nvcc. Timings: benchmarks/gpu/run_kernels_h200.py.

    python -m pytest -q device_tests/test_kernels_gpu.py
"""
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels_ctypes as kc  # noqa: E402  (light: ctypes and subprocess only)


def _skip_reason():
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to PyTorch"
    if shutil.which("nvcc") is None:
        return "nvcc not on PATH (the kernels are compiled for this GPU)"
    return None


REASON = _skip_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    import torch

    major, minor = torch.cuda.get_device_capability()
    so = kc.build(tmp_path_factory.mktemp("zk"), f"sm_{major}{minor}")
    return kc.Kernels(so)


def test_abi(kernels):
    from zeroedge import plugin_spec

    assert kernels.lib.ze_kernels_abi() == plugin_spec.PLUGIN_ABI


@pytest.mark.parametrize("case", range(len(kc.SIH_CASES)))
def test_sih(kernels, case):
    import torch

    T, D, W, R, dt, bs, var = kc.SIH_CASES[case]
    kc.check_sih(kernels, T, D, W, R, getattr(torch, dt), block_size=bs, variant=var, seed=1000 + case,
                 quantile=0.75 if bs else 0.5)


@pytest.mark.parametrize("T,rate,rank_block,dt", [(4096, 0.6, 512, "float16"), (1000, 0.9, 512, "float32"),
                                                    (777, 0.3, 128, "float16"), (40, 1.0, 512, "float32")])
def test_sih_rank_rule(kernels, T, rate, rank_block, dt):
    """The rank rule: the kernel's keep is the reference's decision on the kernel's own scores, and each
    rank block skips exactly its quota."""
    import torch

    r = kc.check_sih(kernels, T, 2048 if T > 1000 else 576, 10, 16, getattr(torch, dt), rate=rate,
                     rank_block=rank_block, seed=3000 + T)
    assert r["kept"] < T


@pytest.mark.parametrize("T,chunk,dt", [(2000, 512, "float16"), (1500, 1024, "float32")])
def test_sih_rank_rule_in_chunks(kernels, T, chunk, dt):
    """ZeroEdgeSIHChunk's kernels under the rank rule, fed chunk by chunk (the carry of one into the
    next, chunks on rank blocks): the keep of the one-pass kernel, row for row."""
    import torch

    from zeroedge.backends import plugin_reference as ref

    f = ref.sih_fields(threshold=0.0, rate=0.6, rank_block=512, anchor_rank=16)
    x, w = kc.make_sih(T, 576, 10, 16, getattr(torch, dt), seed=T)
    one = torch.full((T,), -7, dtype=torch.int32, device="cuda")
    kernels.sih(x, w, f, one, torch.empty(T, 576, dtype=x.dtype, device="cuda"))
    carry = torch.zeros(2, dtype=torch.float32, device="cuda")
    got = []
    for a in range(0, T, chunk):
        n = min(chunk, T - a)
        keep = torch.full((n,), -7, dtype=torch.int32, device="cuda")
        out = torch.empty(2, dtype=torch.float32, device="cuda")
        span = torch.tensor([a, T], dtype=torch.int32, device="cuda")
        kernels.sih_chunk(x[a:a + n].contiguous(), w, f, carry, span, keep,
                          torch.empty(n, 576, dtype=x.dtype, device="cuda"), out)
        got.append(keep)
        carry = out
    torch.cuda.synchronize()
    assert torch.equal(torch.cat(got), one)
    assert 0.5 < float((one == 0).float().mean()) < 0.7


@pytest.mark.parametrize("case", range(len(kc.PAD_CASES)))
def test_gather_scatter(kernels, case):
    import torch

    T, D, dt, frac = kc.PAD_CASES[case]
    kc.check_gather_scatter(kernels, T, D, getattr(torch, dt), frac, seed=2000 + case)


def test_bad_arguments_are_refused(kernels):
    """Unsupported sizes come back as an error code with a message, nothing launched."""
    import ctypes

    import torch

    x = torch.randn(40, 100, device="cuda")  # D = 100: not a multiple of 8
    keep = torch.zeros(40, dtype=torch.int32, device="cuda")
    rc = kernels.lib.ze_pad_gather(kc.F32, x.data_ptr(), keep.data_ptr(), 40, 100, x.data_ptr(), keep.data_ptr(),
                                   keep.data_ptr(), None, 0, ctypes.c_void_p(0))
    assert rc == -3 and b"multiple of 8" in kernels.lib.ze_strerror(rc)
    assert kernels.lib.ze_pad_gather(7, x.data_ptr(), keep.data_ptr(), 40, 96, None, None, keep.data_ptr(),
                                     None, 0, ctypes.c_void_p(0)) == -2
