"""An engines folder checked before any engine is deserialized (`check_engines`): its engines.json
against the bundle, the TensorRT imported here and the GPU present.
"""
from __future__ import annotations

import json
from pathlib import Path

from zeroedge.backends.tensorrt.build import _sha256
from zeroedge.backends.tensorrt.loader import import_tensorrt, runtime_traits
from zeroedge.backends.tensorrt.target import gpu_compute_capability, gpu_here
from zeroedge.errors import UserError


def check_engines(bundle: Path, engines: Path, trt=None) -> dict:
    """engines.json of ENGINES, checked against the bundle, this TensorRT and this machine before any
    engine is deserialized (TensorRT's own refusals are a bare None or an abort): built by `zeroedge
    build` from this very bundle, with the runtime imported here, for the GPU present."""
    engines = Path(engines)
    meta_path = engines / "engines.json"
    if not engines.is_dir():
        raise UserError(f"engines folder not found: {engines} (make it with: zeroedge build BUNDLE -o {engines})")
    try:
        meta = json.loads(meta_path.read_text())
        assert isinstance(meta, dict) and isinstance(meta.get("engines"), dict)
    except (OSError, ValueError, AssertionError):
        raise UserError(f"{meta_path}: missing or unreadable (an engines folder is made by zeroedge build "
                        f"BUNDLE -o {engines})") from None
    missing = [g for g in ("prefill", "decode") if g not in meta["engines"]]
    if missing:
        raise UserError(f"{engines}: no {' or '.join(missing)} engine (its bundle has no such *.trt.onnx graph)")
    for g in ("prefill", "decode"):
        if not (engines / f"{g}.engine").is_file():
            raise UserError(f"{engines / (g + '.engine')}: missing; rebuild with zeroedge build")
    want = meta.get("bundle_manifest_sha256")
    if want is None or want != _sha256(Path(bundle) / "manifest.json"):
        raise UserError(f"{engines} was not built from {bundle} (its manifest differs): rebuild with "
                        f"zeroedge build {bundle} -o {engines} --force")
    trt = trt or import_tensorrt()
    traits = runtime_traits(trt)
    if meta.get("backend") != f"{traits['name']} {traits['version']}":
        raise UserError(f"{engines} was built with {meta.get('backend')}, this machine runs {traits['name']} "
                        f"{traits['version']}: rebuild the engines here (zeroedge build)")
    if not gpu_here():
        raise UserError(f"no NVIDIA GPU here: TensorRT engines run on the GPU they were built for "
                        f"({'compute capability ' + meta['cc'] if meta.get('cc') else 'the build machine'}); "
                        "use --backend onnxruntime on this machine")
    here = gpu_compute_capability()
    if meta.get("cc") not in (None, "current") and here is not None and here != meta["cc"]:
        raise UserError(f"{engines} was built for compute capability {meta['cc']}, this GPU is {here}: rebuild "
                        f"with zeroedge build {bundle} -o {engines} --cc {here} --force")
    return meta
