"""The plugin library's tensor-core sketch kernel (plugins/kernels/thermal_sketch.cu) seen from a
CPU: its C API refuses bad arguments before touching a GPU, and the Python side picks it only for
shapes it takes. Its arithmetic is checked on a GPU (device_tests/test_decoders_gpu.py)."""
import ctypes

import pytest

from zeroedge.kv import cuda_sketch


@pytest.fixture(scope="module")
def lib(plugin_lib):
    return cuda_sketch.load(plugin_lib.parent / "libzeroedge_kernels.so")


def _call(lib, qr=64, codes=64, scales=64, out=64, pm=0, psum=0, nkv=8, grp=4, n=100, ps=8, rank=32, nb=13, pps=8):
    return lib.ze_thermal_sketch_lse(*(ctypes.c_void_p(p) for p in (qr, codes, scales, out, pm, psum)),
                                     nkv, grp, n, ps, rank, nb, pps, None)


def test_the_c_api_refuses_bad_arguments_before_any_launch(lib):
    assert _call(lib, qr=0) == -1                        # null pointer
    assert _call(lib, pm=64) == -1                       # one of the two share buffers
    for bad in (dict(rank=24), dict(ps=12), dict(grp=9), dict(grp=0), dict(n=0), dict(nb=12), dict(pps=0, nb=1)):
        assert _call(lib, **bad) == -2, bad
    assert _call(lib, codes=65) == -3                    # codes not 8-byte aligned
    assert _call(lib, scales=66) == -3                   # scales not 4-byte aligned
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():                    # valid arguments reach CUDA, which has no device here
        assert _call(lib) > 0


def test_only_shapes_the_kernel_takes_are_sent_to_it():
    assert cuda_sketch.fits(8, 32, 4) and cuda_sketch.fits(16, 64, 8) and cuda_sketch.fits(8, 16, 1)
    assert not any(cuda_sketch.fits(*s) for s in ((12, 32, 4), (32, 32, 4), (8, 24, 4), (8, 128, 4), (8, 32, 9)))


def test_a_bad_kernel_choice_or_a_shape_the_kernel_refuses_is_a_clear_error(monkeypatch):
    """kv.kernels.SKETCH_KERNEL: an unknown value, or "cuda" for a shape the tensor-core kernel does not
    take, is a ValueError naming what it takes (before any GPU is touched); "triton" never loads it."""
    torch = pytest.importorskip("torch")
    from zeroedge.kv import kernels as K

    dev = torch.device("cuda")
    monkeypatch.setattr(K, "SKETCH_KERNEL", "cublas")
    with pytest.raises(ValueError, match="auto, cuda or triton"):
        K._sketch_cuda_lib(dev, 8, 32, 4)
    monkeypatch.setattr(K, "SKETCH_KERNEL", "cuda")
    with pytest.raises(ValueError, match="pages of 8 / 16, rank 16 / 32 / 64"):
        K._sketch_cuda_lib(dev, 12, 32, 4)
    monkeypatch.setattr(K, "SKETCH_KERNEL", "triton")
    assert K._sketch_cuda_lib(dev, 8, 32, 4) is None
