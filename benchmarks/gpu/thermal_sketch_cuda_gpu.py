"""The plugin library's tensor-core sketch kernel (plugins/kernels/thermal_sketch.cu) against the Triton
one, with launch variants: pages a warp loads at a time (ZE_SKETCH_PAGES), warps a block
(ZE_SKETCH_WARPS) and pages a block (a share), or two builds of the kernel (old and new source);
µs a layer, 16 layers' sketches in one CUDA graph, llama-3.2-1b shape (8 kv heads x 4 query heads,
rank 32, pages of 8), random codes. Its arithmetic is checked by
device_tests/test_decoders_gpu.py.

    for u in 2 4 8; do for w in 4 8; do nvcc -shared -Xcompiler -fPIC -O3 -arch=sm_90 \
      -DZE_SKETCH_PAGES=$u -DZE_SKETCH_WARPS=$w -Iplugins/include plugins/kernels/thermal_sketch.cu \
      -o /tmp/v/libP${u}W${w}.so; done; done
    PYTHONPATH=$PWD python3 benchmarks/gpu/thermal_sketch_cuda_gpu.py /tmp/v OUT.json
"""
import glob
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_setup as bs  # noqa: E402
from zeroedge.kv import cuda_sketch  # noqa: E402
from zeroedge.kv import kernels as K  # noqa: E402

dev = torch.device("cuda")
L = 16


def timeit(f):
    """µs a layer: the median replay of f (all L layers) in one CUDA graph."""
    return bs.graph_ms(f) * 1e3 / L


res = []
libs = {os.path.basename(p)[3:-3]: cuda_sketch.load(p) for p in sorted(glob.glob(sys.argv[1] + "/lib*.so"))}
for ctx in (32768, 131072):
    n = ctx // 8
    data = []
    for _ in range(L):
        codes = torch.randint(0, 256, (8, n * 8, 16), dtype=torch.uint8, device=dev)
        scales = (torch.rand(8, n * 8, device=dev) * 0.5 + 0.01).half()
        qr = torch.randn(8, 4, 32, device=dev) * 3
        data.append((qr, codes, scales))
    outs = [torch.empty(8, 4, n, device=dev) for _ in range(L)]
    row = {"ctx": ctx}
    K.SKETCH_KERNEL = "triton"
    nbt = K.part_blocks(n, 8)
    parts_t = [(torch.empty(8, 4, nbt, device=dev), torch.empty(8, 4, nbt, device=dev)) for _ in range(L)]
    row["triton"] = round(timeit(lambda: [K.sketch_page_lse(d[0], d[1], d[2], 8, out=o, part=p)
                                          for d, o, p in zip(data, outs, parts_t)]), 2)
    for name, lib in libs.items():
        for pps in (16, 32, 64, 128, 256):
            nb = -(-n // pps)
            parts = [(torch.empty(8, 4, nb, device=dev), torch.empty(8, 4, nb, device=dev)) for _ in range(L)]
            row[f"{name}_pps{pps}"] = round(timeit(lambda: [cuda_sketch.sketch_page_lse(lib, d[0], d[1], d[2], 8, o, p, pps)
                                                            for d, o, p in zip(data, outs, parts)]), 2)
    best = min((v, k) for k, v in row.items() if k not in ("ctx",))
    row["best"] = best
    print(json.dumps(row), flush=True)
    res.append(row)
json.dump(res, open(sys.argv[2], "w"), indent=1)
