"""Bundle bytes of SmolLM2-135M by weights and graph flavour: each bundle exported by `zeroedge
export` into a temporary folder, every file's size read from disk, then the folder removed.

    python benchmarks/weights_bundle_size.py

The default set: the 4-bit bundle for onnxruntime only (`--weights int4 --zero-point float --graphs
portable`, the one the README quotes), the same with zeroedge's CPU kernels, the 4-bit bundle with
both flavours, and the fp16 bundle for onnxruntime only (its peer).
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "results/weights/smollm2_bundle_sizes.json"
BUNDLES = {
    "int4 float zero point, portable": "--weights int4 --zero-point float --graphs portable",
    "int4 float zero point, portable, zeroedge CPU kernels":
        "--weights int4 --zero-point float --graphs portable --cpu-kernels zeroedge",
    "int4 float zero point, both flavours": "--weights int4 --zero-point float",
    "fp16, portable": "--weights fp16 --graphs portable",
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", default=None, help="names from the default set")
    ap.add_argument("-o", "--output", type=Path, default=DEFAULT_OUT)
    a = ap.parse_args(argv)
    rows = []
    for name, args in BUNDLES.items():
        if a.only and name not in a.only:
            continue
        with tempfile.TemporaryDirectory() as d:
            cmd = ["zeroedge", "export", "smollm2-135m", *shlex.split(args), "-o", f"{d}/b"]
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "zeroedge.cli", *cmd[1:]], check=True, capture_output=True)
            files = {p.name: p.stat().st_size for p in sorted(Path(d, "b").iterdir()) if p.is_file()}
            rows.append({"bundle": name, "command": " ".join(cmd[:-1] + ["DIR"]), "export_s": time.perf_counter() - t,
                         "bytes": sum(files.values()), "MB": sum(files.values()) / 1e6, "files": files})
            print(f"{name:60s} {rows[-1]['MB']:8.1f} MB", flush=True)
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps({"model": "smollm2-135m", "MB": "10^6 bytes", "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
