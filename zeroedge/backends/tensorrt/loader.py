"""Which TensorRT runs here, and cuda-python: `import_tensorrt`, `import_cudart`, `runtime_traits`.

Two runtimes, chosen at import (`import_tensorrt`): `tensorrt` (TensorRT 10.3, JetPack 6.1 / 6.2) when
it is importable, else `tensorrt_rtx` (TensorRT for RTX, `pip install tensorrt-rtx-cu13==1.7.1.116`: builds
engines ahead of time on a machine without a GPU, for a chosen compute capability; runs them on
Ampere / Ada / Blackwell only). $ZEROEDGE_TENSORRT=tensorrt|tensorrt_rtx forces one. Every difference
between the two is named in `runtime_traits`. Where TensorRT or cuda-python is missing, TensorRTMissing
(a UserError, exit code 2) says in one line how to get it.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Optional

from zeroedge.errors import MissingDependency, UserError


RUNTIMES = ("tensorrt", "tensorrt_rtx")  # the order import_tensorrt tries them
RUNTIME_ENV = "ZEROEDGE_TENSORRT"
RTX_PIN = "tensorrt-rtx-cu13==1.7.1.116"
HOW_TO_GET_TRT = ("TensorRT's Python bindings are not installed: on a Jetson use JetPack 6.1 / 6.2 and run "
                  "`sudo apt install python3-libnvinfer` (TensorRT 10.3); elsewhere `pip install "
                  f"{RTX_PIN}` (TensorRT for RTX: builds engines ahead of time, runs them on Ampere / Ada / "
                  "Blackwell GPUs), or use the portable onnxruntime backend")
HOW_TO_GET_CUDA = ("cuda-python is not installed: on a Jetson (CUDA 12.6) pip install 'zeroedge[jetson]'; with "
                   "TensorRT-RTX (CUDA 13) pip install 'cuda-python>=13'")


class TensorRTMissing(MissingDependency):
    """TensorRT (or cuda-python) is not installed; exit code 2 with the line that says how to get it."""


def import_tensorrt(runtime: Optional[str] = None):
    """The TensorRT Python module: `tensorrt` (a Jetson's TensorRT 10.3) when importable, else
    `tensorrt_rtx`; `runtime` (or $ZEROEDGE_TENSORRT) forces one of RUNTIMES."""
    want = runtime or os.environ.get(RUNTIME_ENV) or None
    if want is not None and want not in RUNTIMES:
        raise UserError(f"unknown TensorRT runtime '{want}' (${RUNTIME_ENV}): choose {' or '.join(RUNTIMES)}")
    for name in [want] if want else RUNTIMES:
        try:
            trt = importlib.import_module(name)
        except ImportError:
            continue
        if is_rtx(trt):
            ensure_rtx_parser_link()
            return trt
        major = int(str(trt.__version__).split(".")[0])
        if major < 10:
            raise UserError(f"TensorRT {trt.__version__} has no IPluginV3 (JetPack 6.0 ships TensorRT 8.6); "
                            "use JetPack 6.1 / 6.2 (TensorRT 10.3)")
        return trt
    if want == "tensorrt_rtx":
        raise TensorRTMissing(f"TensorRT for RTX is not installed: pip install {RTX_PIN}")
    raise TensorRTMissing(HOW_TO_GET_TRT)


def is_rtx(trt) -> bool:
    return str(getattr(trt, "__name__", "")).startswith("tensorrt_rtx")


def runtime_traits(trt) -> dict:
    """What differs between TensorRT 10.3 (`tensorrt`, a Jetson) and TensorRT for RTX (`tensorrt_rtx`)
    for this backend, in one place:

    fp16_flag      10.3: BuilderFlag.FP16 lets the builder pick fp16. RTX has no such flag: its networks
                   are strongly typed, the graph's own dtypes decide (the trt graphs carry fp16 where the
                   plugins want it).
    timing_cache   10.3: a timing cache kept beside the engines. RTX: timing-cache calls are deprecated
                   no-ops (it has a runtime cache instead), so none is written.
    target_cc      RTX builds ahead of time for the compute capabilities set on the builder config
                   (ComputeCapability.SM75 / SM80 / SM86 / SM89 / SM120 / SM121; no SM87, no SM90), also
                   on a machine with no GPU. 10.3 builds for the GPU it runs on (a Jetson: SM87).
    parser_link    RTX's ONNX parser dlopen()s "libtensorrt_rtx.so" when it adds a plugin layer
                   (ensure_rtx_parser_link).
    plugin_logger  10.3 hands plugins a logger; RTX 1.7's logger finder returns none, so the plugin
                   library's messages are read back with plugin_messages() for the errors.
    """
    rtx = is_rtx(trt)
    return {"name": "tensorrt_rtx" if rtx else "tensorrt", "version": str(getattr(trt, "__version__", "?")),
            "fp16_flag": not rtx, "timing_cache": not rtx, "target_cc": rtx, "parser_link": rtx,
            "plugin_logger": not rtx}


RTX_CORE = "libtensorrt_rtx.so"


def ensure_rtx_parser_link() -> Optional[Path]:
    """Make "libtensorrt_rtx.so" loadable by TensorRT-RTX's ONNX parser; returns the link (None: not
    a wheel install).

    The parser (libtensorrt_onnxparser_rtx.so.1) reaches INetworkDefinition's plugin-layer code through
    a private entry point: the first time it adds a plugin layer it dlopen()s "libtensorrt_rtx.so" (the
    unversioned development name) and looks up getPrivateApi_INTERNAL. The pip wheel ships only
    libtensorrt_rtx.so.1, so dlopen fails, the parser throws std::runtime_error("Unable to open library:
    libtensorrt_rtx.so ...") inside a noexcept function, and the process ends in std::terminate
    ("terminate called without an active exception"): any graph with a plugin node, never a dense one.
    The parser's RPATH is $ORIGIN, so a link beside the wheel's libraries is enough (glibc maps the same
    file once, so it is the same library, not a second copy)."""
    try:
        import tensorrt_rtx_libs
    except ImportError:
        return None  # an SDK (tar / zip) install: its lib/ folder ships the unversioned link
    folder = Path(tensorrt_rtx_libs.__file__).resolve().parent
    link = folder / RTX_CORE
    if link.exists():
        return link
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        if d and (Path(d) / RTX_CORE).exists():
            return Path(d) / RTX_CORE
    versioned = sorted(folder.glob(RTX_CORE + ".*"))
    if not versioned:
        return None
    tmp = folder / f".{RTX_CORE}.{os.getpid()}.tmp"
    try:
        tmp.symlink_to(versioned[0].name)
        os.replace(tmp, link)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise UserError(f"TensorRT-RTX's ONNX parser needs {link} to import plugin layers (it aborts the process "
                        f"without it) and it could not be created ({e.strerror or e}): run `ln -s "
                        f"{versioned[0].name} {link}`") from None
    return link


def import_cudart():
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # cuda-python 12.2 - 12.5
        except ImportError:
            raise TensorRTMissing(HOW_TO_GET_CUDA) from None
    return cudart
