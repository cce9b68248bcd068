"""One SIH call (T=4096, D=2048, W=2, R=16, fp16) for Nsight Compute:

    ncu --set full -k regex:sih_ python3 device_tests/profile_sih.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels_ctypes as kc  # noqa: E402


def main():
    import torch

    from zeroedge.backends import plugin_reference as ref

    so = kc.build(Path("/tmp/zeroedge_kernels"), "sm_90")
    K = kc.Kernels(so)
    T, D, W, R = 4096, 2048, 2, 16
    x, w = kc.make_sih(T, D, W, R, torch.float16, seed=1)
    f = ref.sih_fields(threshold=0.5, anchor_rank=R)
    keep = torch.empty(T, dtype=torch.int32, device="cuda")
    base = torch.empty(T, D, dtype=torch.float16, device="cuda")
    for _ in range(3):
        K.sih(x, w, f, keep, base)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
