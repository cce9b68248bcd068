"""Where the plugin library's CUDA kernels live (libzeroedge_kernels.so: C API, loaded with ctypes),
for the decode paths (zeroedge.paths.cuda_gemv) and thermal KV (zeroedge.kv.cuda_sketch).

Built by scripts/build_plugins (or cmake -S plugins); found at an explicit path, else
$ZEROEDGE_KERNELS_LIB, else plugins/build/libzeroedge_kernels.so in this checkout.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

from zeroedge.errors import UserError

_LIBS = {}


def default_path() -> Path:
    env = os.environ.get("ZEROEDGE_KERNELS_LIB")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1] / "plugins" / "build" / "libzeroedge_kernels.so"


def open_lib(path, symbol: str, what: str):
    """The library at path (default_path() when None), which must export `symbol`; a UserError
    naming where it looked and how to build it otherwise. One handle a path."""
    p = Path(path) if path else default_path()
    key = str(p)
    if key not in _LIBS:
        if not p.is_file():
            raise UserError(f"{what} not found at {p}: build them with scripts/build_plugins (or cmake -S "
                            "plugins -B plugins/build) or set ZEROEDGE_KERNELS_LIB")
        try:
            _LIBS[key] = ctypes.CDLL(str(p))
        except OSError as e:
            raise UserError(f"cannot load {p}: {e}") from None
    lib = _LIBS[key]
    if not hasattr(lib, symbol):
        raise UserError(f"{p} has no {what} ({symbol}): rebuild it from this checkout")
    return lib
