"""zeroedge's onnxruntime CPU kernels (ortops/, domain "zeroedge.ort"): where the built library is and
how a session takes it. A bundle exported with `--cpu-kernels zeroedge` says so in its manifest
("cpu_kernels"); its decode graph runs only in a session that registered the library.

The library: $ZEROEDGE_ORTOPS, else ortops/build/libzeroedge_ortops.so in the checkout this package
runs from (scripts/build_ortops builds it; scripts/setup runs that)."""
from __future__ import annotations

import os
from pathlib import Path

from zeroedge.errors import UserError

LIBRARY = "libzeroedge_ortops.so"


def library_path() -> Path:
    env = os.environ.get("ZEROEDGE_ORTOPS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "ortops" / "build" / LIBRARY


def needs_library(manifest: dict) -> bool:
    return (manifest.get("cpu_kernels") or {}).get("kind") == "zeroedge"


def register(session_options, bundle) -> Path:
    """Register the library with onnxruntime session options; a missing or foreign file is a one-line
    error naming the bundle and the fix."""
    path = library_path()
    if not path.is_file():
        raise UserError(f"{bundle}: its decode graph runs zeroedge's onnxruntime kernels, and {path} is not "
                        "built: run scripts/build_ortops (or set ZEROEDGE_ORTOPS to the library)")
    try:
        session_options.register_custom_ops_library(str(path))
    except Exception as e:  # onnxruntime raises its own types for a library it cannot load
        raise UserError(f"{bundle}: onnxruntime cannot load {path} ({type(e).__name__}: {str(e)[:200]}): "
                        "rebuild it with scripts/build_ortops") from None
    return path
