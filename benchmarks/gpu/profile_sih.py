"""One SIH call (T=4096, D=2048, W=2, R=16, fp16) for Nsight Compute:

    ncu --set full -k regex:sih_ python3 benchmarks/gpu/profile_sih.py
"""
from pathlib import Path

import bench_setup as bs

kc = bs.kernels_ctypes()  # light: ctypes and subprocess only


def main(argv=None):
    ap = bs.parser(__doc__)
    ap.add_argument("--arch", default="sm_90", help="nvcc architecture (default sm_90)")
    args = ap.parse_args(argv)
    import torch

    from zeroedge.backends import plugin_reference as ref

    so = kc.build(Path("/tmp/zeroedge_kernels"), args.arch)
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
