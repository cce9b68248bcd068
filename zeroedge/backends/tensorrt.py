"""TensorRT backend: build engines from a bundle's *.trt.onnx with the zeroedge plugin library, and
run prefill and decode with cuda-python (`cuda.bindings`). For a Jetson with JetPack 6.1 / 6.2
(TensorRT 10.3); nothing here imports tensorrt or cuda until it is used.

    zeroedge build BUNDLE -o ENGINES [--plugins LIB] [--cc 8.6] [--json]    # build_bundle_engines
    python -m zeroedge.backends.tensorrt build BUNDLE -o DIR [--plugins LIB]  # what zeroedge deploy runs
    python -m zeroedge.backends.tensorrt generate BUNDLE --engines DIR --tokens "1 2 3" [--max-new N]

    with TrtRunner("bundle/", "build/", "build/plugins/libzeroedge_plugins.so") as r:
        logits = r.prefill(tokens)      # same interface and window bookkeeping as OrtRunner
        ids = r.generate(tokens, 32)

Build stages follow Polygraphy's loaders: `EngineFromOnnx(...)()` returns the serialized engine.
fp16, the workspace from the bundle's plan (else 256 MiB, the planner's assumption; a graph that runs
out of it is built again once with max(1 GiB, twice what it asked for)), a timing cache kept beside
the engines (TensorRT 10.3; TensorRT-RTX has none), one optimisation profile per graph (token length 1..max_tokens, every other
dynamic dimension fixed at the bundle's KV window; a chunked prefill graph: tokens 1..chunk and its
prefix K/V 0..max_tokens-1 tokens, see profile_shapes), and the plugin library serialized into the
engine (version-compatible plan with the lean runtime excluded; `serialize_plugins=False` instead
loads the library at run time). Where TensorRT or cuda-python is missing, TensorRTMissing (a
UserError, exit code 2) says in one line how to get it.

Two runtimes, chosen at import (`import_tensorrt`): `tensorrt` (TensorRT 10.3, JetPack 6.1 / 6.2) when
it is importable, else `tensorrt_rtx` (TensorRT for RTX, `pip install tensorrt-rtx-cu13==1.7.1.116`: builds
engines ahead of time on a machine without a GPU, for a chosen compute capability; runs them on
Ampere / Ada / Blackwell only). $ZEROEDGE_TENSORRT=tensorrt|tensorrt_rtx forces one. Every difference
between the two is named in `runtime_traits`.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

from zeroedge.backends.onnxruntime import OrtRunner, PrefillGraph  # light: imports onnxruntime only when used
from zeroedge.bundle import prefill_plan
from zeroedge.errors import MissingDependency, UserError

GRAPHS = ("prefill", "decode")
DEFAULT_WORKSPACE = 256 << 20
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


def plugin_messages(plugin_lib, clear: bool = True) -> str:
    """The plugin library's errors and warnings since the last clear (zeroedge_plugin_messages), '' if it
    cannot say (not loadable, an older build)."""
    import ctypes

    try:
        f = ctypes.CDLL(str(Path(plugin_lib).resolve())).zeroedge_plugin_messages
    except (OSError, AttributeError):
        return ""
    f.restype, f.argtypes = ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    n = int(f(None, 0, 0))
    buf = ctypes.create_string_buffer(n + 1)
    f(buf, n + 1, int(clear))
    return buf.value.decode("utf-8", "replace").strip()


def plugin_node_problems(onnx_path) -> list:
    """One line per zeroedge node of a graph that no creator of this plugin library can take: an op
    the library does not ship, a plugin_version / plugin_namespace other than plugin_spec's (TensorRT
    itself only says "Plugin not found"). [] when fine or when the graph cannot be read here."""
    from zeroedge import plugin_spec as spec

    try:
        import onnx

        graph = onnx.load(str(onnx_path), load_external_data=False).graph
    except Exception:  # not readable here (no onnx, not a graph): TensorRT's parser will say
        return []
    out = []
    for n in graph.node:
        if n.domain != spec.DOMAIN:
            continue
        where = f"node '{n.name or (n.output[0] if n.output else '?')}' ({n.op_type})"
        if n.op_type not in spec.NODES:
            out.append(f"{where}: this plugin library ships {', '.join(spec.NODES)} only")
            continue
        attrs = {a.name: a for a in n.attribute}
        for key, want in (("plugin_version", spec.PLUGIN_VERSION), ("plugin_namespace", spec.PLUGIN_NAMESPACE)):
            a = attrs.get(key)
            if a is None:
                continue
            if a.type != onnx.AttributeProto.STRING:
                out.append(f"{where}: {key} must be a STRING attribute ('{want}')")
            elif a.s.decode("utf-8", "replace") != want:
                out.append(f"{where}: asks for {key} '{a.s.decode('utf-8', 'replace')}', this plugin library "
                           f"ships {n.op_type} {key} '{want}' (re-export the bundle with this zeroedge)")
    return out


def rtx_capabilities(trt) -> list:
    """The compute capabilities this TensorRT-RTX builds for, as "7.5", "8.6", ... in numeric order."""
    names = [n for n in dir(trt.ComputeCapability) if n.startswith("SM") and n[2:].isdigit()]
    return [f"{n[2:-1]}.{n[-1]}" for n in sorted(names, key=lambda n: int(n[2:]))]


def compute_capability(trt, cc: Optional[str]):
    """A ComputeCapability of TensorRT-RTX from "8.6" / "86" / "sm86" / "SM86"; None: the GPU present."""
    if cc is None or str(cc).strip().lower() in ("", "current"):
        return trt.ComputeCapability.CURRENT
    digits = str(cc).strip().upper().replace("SM_", "").replace("SM", "").replace(".", "")
    have = rtx_capabilities(trt)
    if not digits.isdigit() or f"{digits[:-1]}.{digits[-1]}" not in have:
        raise UserError(f"TensorRT-RTX {trt.__version__} cannot build for compute capability {cc}: it knows "
                        f"{', '.join(have)}")
    return getattr(trt.ComputeCapability, f"SM{digits}")


def gpu_present() -> bool:
    """An NVIDIA GPU driver node on this machine (a discrete GPU; a Jetson has its own nodes)."""
    return Path("/dev/nvidiactl").exists()


def gpu_compute_capability() -> Optional[str]:
    """The first GPU's compute capability ("9.0") from nvidia-smi, None when it cannot say."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        r = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    first = (r.stdout.strip().splitlines() or [""])[0].strip()
    return first if r.returncode == 0 and first.replace(".", "").isdigit() else None


def build_target(trt, cc: Optional[str]) -> Tuple[object, Optional[str]]:
    """(the builder's target, its label) for `cc`, checked before anything is built.

    TensorRT-RTX: ComputeCapability.SMxy for --cc, else the GPU present (CURRENT), refused with the
    list it accepts when there is no GPU or the GPU is not one it builds for. TensorRT 10.3 builds for
    the GPU it runs on: `cc` must be that GPU's (when it can be read) and the target is None."""
    if is_rtx(trt):
        have = ", ".join(rtx_capabilities(trt))
        if cc is not None and str(cc).strip().lower() not in ("", "current"):
            target = compute_capability(trt, cc)
            digits = str(cc).strip().upper().replace("SM_", "").replace("SM", "").replace(".", "")
            return target, f"{digits[:-1]}.{digits[-1]}"
        if not gpu_present():
            raise UserError(f"no NVIDIA GPU here to build for: pass --cc, one of {have} (TensorRT-RTX "
                            f"{trt.__version__} builds ahead of time for those)")
        here = gpu_compute_capability()
        if here is not None and here not in rtx_capabilities(trt):
            raise UserError(f"the GPU here has compute capability {here}, which TensorRT-RTX {trt.__version__} "
                            f"does not build for: pass --cc, one of {have}")
        return trt.ComputeCapability.CURRENT, here or "current"
    if cc is None or str(cc).strip().lower() in ("", "current"):
        return None, gpu_compute_capability()
    want = str(cc).strip().upper().replace("SM_", "").replace("SM", "").replace(".", "")
    here = gpu_compute_capability()
    if not want.isdigit():
        raise UserError(f"--cc {cc}: not a compute capability (e.g. 8.7)")
    label = f"{want[:-1]}.{want[-1]}"
    if here is not None and here != label:
        raise UserError(f"TensorRT {trt.__version__} builds only for the GPU it runs on (compute capability "
                        f"{here}), not {label}: drop --cc, or build with TensorRT-RTX elsewhere")
    return None, label


def import_cudart():
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # cuda-python 12.2 - 12.5
        except ImportError:
            raise TensorRTMissing(HOW_TO_GET_CUDA) from None
    return cudart


def _check(cudart, result, what: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        name = cudart.cudaGetErrorString(err)[1] if hasattr(cudart, "cudaGetErrorString") else err
        raise RuntimeError(f"{what} failed: {name}")
    return rest[0] if len(rest) == 1 else rest


def _write_atomic(path: Path, data: bytes):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _sha256(path: Path) -> str:
    """bundle.sha256_file of the file a path names (the plugin library may be reached by a link)."""
    from zeroedge.bundle import sha256_file

    return sha256_file(Path(path).resolve())


# ------------------------------------------------------------------------------------ planning

def workspace_from_plan(manifest: dict) -> int:
    """Workspace bytes from the bundle's plan (keys workspace / workspace_bytes / workspace_mb, at the
    top level or under "memory"), else DEFAULT_WORKSPACE."""
    plan = manifest.get("plan") if isinstance(manifest.get("plan"), dict) else {}
    for scope in (plan, plan.get("memory") if isinstance(plan.get("memory"), dict) else {}):
        for key, scale in (("workspace_bytes", 1), ("workspace", 1), ("workspace_mb", 1 << 20)):
            v = scope.get(key)
            if isinstance(v, (int, float)) and v > 0:
                return int(v * scale)
    return DEFAULT_WORKSPACE


def max_tokens_from_plan(manifest: dict) -> int:
    plan = manifest.get("plan") if isinstance(manifest.get("plan"), dict) else {}
    for key in ("max_tokens", "context"):
        if isinstance(plan.get(key), int) and plan[key] > 0:
            return int(plan[key])
    return max(int(manifest.get("window") or 0), 2048)


def profile_shapes(inputs: Sequence[Tuple[str, Sequence[int]]], max_tokens: int, window: int,
                   overrides: Optional[Dict[str, Tuple]] = None,
                   chunk: Optional[int] = None) -> Dict[str, Tuple[Tuple, Tuple, Tuple]]:
    """min / opt / max per network input with a dynamic (-1) dimension: the token dimension of
    `tokens` spans 1..max_tokens (opt: min(512, max)); any other dynamic dimension is the KV window.
    A prefill graph with prefix K/V inputs (prefix_k.i / prefix_v.i [B, P, Hkv, hd]): chunked
    (`chunk`), tokens span 1..min(chunk, max_tokens) and P 0..max_tokens-1 (opt: half); one pass
    (chunk None), tokens span 1..max_tokens and P is 0 (empty)."""
    out = {}
    chunked = chunk is not None and any(n.startswith("prefix_") for n, _ in inputs)
    tok_hi = min(int(chunk), max_tokens) if chunked else max_tokens
    for name, shape in inputs:
        if overrides and name in overrides:
            out[name] = tuple(tuple(int(v) for v in s) for s in overrides[name])
            continue
        if all(int(d) >= 0 for d in shape):
            continue
        lo, opt, hi = [], [], []
        for i, d in enumerate(shape):
            d = int(d)
            if d >= 0:
                lo.append(d), opt.append(d), hi.append(d)
            elif name == "tokens" and i == len(shape) - 1:
                lo.append(1), opt.append(min(512, tok_hi)), hi.append(tok_hi)
            elif i == 0:
                lo.append(1), opt.append(1), hi.append(1)          # batch
            elif name.startswith("prefix_") and i == 1:
                top = max_tokens - 1 if chunked else 0
                lo.append(0), opt.append(top // 2), hi.append(top)
            else:
                lo.append(window), opt.append(window), hi.append(window)
        out[name] = (tuple(lo), tuple(opt), tuple(hi))
    return out


# ------------------------------------------------------------------------------------ build

def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def make_logger(trt, verbose: Optional[Callable[[str], None]] = None):
    """A TensorRT logger that keeps the errors (for the one-line UserError) and hands warnings to
    `verbose` (else drops them); trt.Logger(WARNING) where the module has no ILogger to subclass."""
    base = getattr(trt, "ILogger", None)
    if base is None:
        lg = trt.Logger(trt.Logger.WARNING)
        lg.errors, lg.interrupted = [], False
        return lg

    class CaptureLogger(base):
        def __init__(self):
            base.__init__(self)
            self.errors: list = []
            self.interrupted = False   # a Ctrl-C that landed in here (TensorRT would swallow it)

        def log(self, severity, msg):
            try:
                level = int(getattr(severity, "value", severity))
                if level <= 1:                       # INTERNAL_ERROR, ERROR
                    self.errors.append(_one_line(msg))
                if verbose is not None and level <= 2:   # and WARNING
                    verbose(f"[TRT] {_one_line(msg)}")
            except BaseException:  # noqa: B036 - KeyboardInterrupt: raised again by the caller
                self.interrupted = True

    return CaptureLogger()


def make_progress_monitor(trt, report: Callable[[str, int, int], None], cancel: Callable[[], bool] = lambda: False):
    """A trt.IProgressMonitor that calls report(phase, step, steps) (None where the module has none).
    A Ctrl-C while the builder runs (or cancel() true) cancels the build (the builder then returns
    None); the caller raises KeyboardInterrupt again (`interrupted`)."""
    base = getattr(trt, "IProgressMonitor", None)
    if base is None:
        return None

    class Monitor(base):
        def __init__(self):
            base.__init__(self)
            self.steps: Dict[str, int] = {}
            self.interrupted = False

        def phase_start(self, phase_name, parent_phase, num_steps):
            try:
                self.steps[phase_name] = int(num_steps)
                report(str(phase_name), 0, int(num_steps))
            except BaseException:  # noqa: B036 - nothing may escape into the builder
                self.interrupted = True

        def step_complete(self, phase_name, step):
            try:
                report(str(phase_name), int(step) + 1, self.steps.get(phase_name, 0))
            except BaseException:  # noqa: B036
                self.interrupted = True
            return not (self.interrupted or cancel())

        def phase_finish(self, phase_name):
            pass

    return Monitor()


class DeferredInterrupt:
    """While TensorRT parses and builds, a Ctrl-C only sets `hit` (TensorRT catches and drops a
    KeyboardInterrupt raised inside its Python callbacks); the progress monitor then cancels the
    build and the caller raises KeyboardInterrupt. Nothing changes outside the main thread."""

    def __init__(self):
        self.hit, self.prev = False, None

    def _handler(self, signum, frame):
        self.hit = True

    def __enter__(self):
        import signal

        try:
            self.prev = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread
            self.prev = None
        return self

    def __exit__(self, *exc):
        import signal

        if self.prev is not None:
            signal.signal(signal.SIGINT, self.prev)
        return False

    def check(self):
        if self.hit:
            raise KeyboardInterrupt


WORKSPACE_RETRY_MIN = 1 << 30   # an automatic workspace that runs out is retried with at least this


def _workspace_request(errors: Sequence[str]) -> Optional[int]:
    """The bytes an OutOfMemory error of the builder asked for ("Requested size was N bytes"), else None."""
    import re

    for e in reversed(list(errors)):
        if "OutOfMemory" in e or "out of memory" in e.lower():
            m = re.search(r"[Rr]equested size was (\d+)", e)
            return int(m.group(1)) if m else 0
    return None


class EngineFromOnnx:
    """Serialized TensorRT engine (bytes) from a *.trt.onnx file and the plugin library.

    workspace_auto: when the builder runs out of the workspace pool (TensorRT-RTX: "OutOfMemory
    (Requested size was N bytes)"), build again once with max(1 GiB, 2 N) (rounded up to 64 MiB);
    `workspace_bytes` then says what the engine was built with. progress(phase, step, steps) follows
    the builder's phases where the runtime has an IProgressMonitor."""

    def __init__(self, onnx_path, plugin_lib, *, workspace_bytes: int = DEFAULT_WORKSPACE,
                 timing_cache: Optional[Path] = None, max_tokens: int = 2048, window: int = 1024,
                 shapes: Optional[Dict[str, Tuple]] = None, fp16: bool = True, serialize_plugins: bool = True,
                 cc: Optional[str] = None, log: Callable[[str], None] = print, workspace_auto: bool = False,
                 progress: Optional[Callable[[str, int, int], None]] = None,
                 verbose: Optional[Callable[[str], None]] = None, chunk: Optional[int] = None):
        self.onnx_path, self.plugin_lib = Path(onnx_path), Path(plugin_lib).resolve()
        self.chunk = chunk  # a prefill graph's chunk (profile_shapes); None: one pass
        self.workspace_bytes, self.timing_cache = int(workspace_bytes), timing_cache
        self.workspace_auto = workspace_auto
        self.max_tokens, self.window, self.shapes = int(max_tokens), int(window), shapes
        self.fp16, self.serialize_plugins, self.log = fp16, serialize_plugins, log
        self.progress, self.verbose = progress, verbose
        self.cc = cc  # TensorRT-RTX's target ("8.6"); None: the GPU present
        self.profiles: dict = {}
        self.layers = self.plugin_layers = None  # counted after parsing
        self.build_s = None
        self.traits: dict = {}
        self.parser_errors: list = []
        self.logger = None
        self._interrupt = DeferredInterrupt()   # replaced by __call__'s

    def _fail(self, msg: str, detail: str = ""):
        """UserError: msg, then the plugin library's own words when it logged any (TensorRT-RTX hands
        plugins no logger), then TensorRT's; one line."""
        own = _one_line(plugin_messages(self.plugin_lib))
        detail = _one_line(detail)
        if own:
            raise UserError(f"{msg}: {own[-600:]}" + (f" (TensorRT: {detail[:300]})" if detail else ""))
        raise UserError(f"{msg}: {detail[:600]}" if detail else msg)

    def _progress(self, phase: str, step: int, steps: int):
        if self.progress is not None:
            self.progress(phase, step, steps)

    def __call__(self) -> bytes:
        with DeferredInterrupt() as self._interrupt:
            blob = self.call_impl()
        self._interrupt.check()
        return blob

    def _interrupted(self, monitor=None):
        if (getattr(monitor, "interrupted", False) or getattr(self.logger, "interrupted", False)
                or self._interrupt.hit):
            raise KeyboardInterrupt

    def _count_plugin_layers(self, trt, network) -> int:
        """Layers of the network that are zeroedge plugins: PLUGIN_V3 layers named after a node of the
        zeroedge domain (the parser names a layer after its node); every PLUGIN_V3 layer when the
        graph's node names cannot be read here."""
        from zeroedge import plugin_spec as spec

        plugin_type = getattr(getattr(trt, "LayerType", None), "PLUGIN_V3", None)
        layers = [network.get_layer(i) for i in range(self.layers)]
        plugins = [layer for layer in layers if layer.type == plugin_type]
        try:
            import onnx

            nodes = [n for n in onnx.load(str(self.onnx_path), load_external_data=False).graph.node
                     if n.domain == spec.DOMAIN]
        except Exception:  # not readable here: the parser read it
            return len(plugins)
        if not nodes or any(not n.name for n in nodes):
            return len(plugins)
        names = {n.name for n in nodes}
        return sum(1 for layer in plugins if str(getattr(layer, "name", "")) in names)

    def call_impl(self) -> bytes:
        trt = import_tensorrt()
        traits = self.traits = runtime_traits(trt)
        if not self.onnx_path.is_file():
            raise UserError(f"graph not found: {self.onnx_path}")
        if not self.plugin_lib.is_file():
            raise UserError(f"plugin library not found: {self.plugin_lib} (build it with scripts/build_plugins)")
        target = build_target(trt, self.cc)[0] if traits["target_cc"] else None  # a bad cc: before any work
        logger = self.logger = make_logger(trt, self.verbose)
        builder = trt.Builder(logger)
        self._load_plugins(builder)
        network = self._parse(trt, builder, logger)
        config = self._configure(trt, builder, network, target)
        monitor = make_progress_monitor(trt, self._progress if self.progress is not None else (lambda *a: None),
                                        cancel=lambda: getattr(logger, "interrupted", False) or self._interrupt.hit)
        if monitor is not None:
            config.progress_monitor = monitor
        t0 = time.perf_counter()
        engine = self._build(trt, builder, network, config, logger, monitor)
        self._parser = None
        self.build_s = time.perf_counter() - t0
        self.log(f"[tensorrt] built {self.onnx_path.name} in {self.build_s:.1f} s ({traits['name']} "
                 f"{traits['version']}, {self.layers} layers, {self.plugin_layers} plugin layers)")
        if self.timing_cache and traits["timing_cache"]:
            _write_atomic(Path(self.timing_cache), bytes(config.get_timing_cache().serialize()))
        return bytes(engine)

    def _load_plugins(self, builder):
        """The plugin library into the builder's registry, every creator of plugin_spec present, and
        every zeroedge node of the graph one a creator takes (TensorRT would only say "not found")."""
        from zeroedge import plugin_spec as spec

        self._progress("load the plugin library", 0, 0)
        registry = builder.get_plugin_registry()
        if registry.load_library(str(self.plugin_lib)) is None:
            raise UserError(f"TensorRT could not load the plugin library {self.plugin_lib}")
        missing = [n for n in spec.NODES
                   if registry.get_creator(n, spec.PLUGIN_VERSION, spec.PLUGIN_NAMESPACE) is None]
        if missing:
            raise UserError(f"{self.plugin_lib} does not provide {', '.join(missing)} (rebuild the plugins)")
        problems = plugin_node_problems(self.onnx_path)
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise UserError(f"{self.onnx_path.name}: {'; '.join(problems[:3])}{more}")
        plugin_messages(self.plugin_lib)  # start clean: the errors below name only this graph's

    def _parse(self, trt, builder, logger):
        self._progress(f"parse {self.onnx_path.name}", 0, 0)
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, logger)
        ok = parser.parse_from_file(str(self.onnx_path))
        self._interrupted()
        self.parser_errors = [str(parser.get_error(i)) for i in range(int(parser.num_errors))]
        if not ok:
            self._fail(f"TensorRT's ONNX parser rejected {self.onnx_path.name}",
                       "; ".join(e.strip() for e in (self.parser_errors or getattr(logger, "errors", []))[:3]))
        self.layers = int(getattr(network, "num_layers", 0))
        self.plugin_layers = self._count_plugin_layers(trt, network)
        self._parser = parser          # the network refers to the parser's weights
        return network

    def _configure(self, trt, builder, network, target):
        """The builder config: precision, the compute capability, the timing cache, the plugin library
        serialized into the engine, and one optimization profile for the dynamic inputs."""
        traits = self.traits
        config = builder.create_builder_config()
        if self.fp16 and traits["fp16_flag"]:
            config.set_flag(trt.BuilderFlag.FP16)
        if target is not None:
            config.num_compute_capabilities = 1
            if not config.set_compute_capability(target, 0):
                raise UserError(f"TensorRT-RTX refused compute capability {self.cc}")
        if traits["timing_cache"]:
            blob = self.timing_cache.read_bytes() if self.timing_cache and self.timing_cache.is_file() else b""
            cache = config.create_timing_cache(blob)
            config.set_timing_cache(cache, ignore_mismatch=False)
        if self.serialize_plugins:
            config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
            config.set_flag(trt.BuilderFlag.EXCLUDE_LEAN_RUNTIME)
            config.plugins_to_serialize = [str(self.plugin_lib)]
        inputs = [(network.get_input(i).name, tuple(network.get_input(i).shape)) for i in range(network.num_inputs)]
        self.profiles = profile_shapes(inputs, self.max_tokens, self.window, self.shapes, self.chunk)
        if self.profiles:
            profile = builder.create_optimization_profile()
            for name, (lo, opt, hi) in self.profiles.items():
                profile.set_shape(name, lo, opt, hi)
            config.add_optimization_profile(profile)
        return config

    def _build(self, trt, builder, network, config, logger, monitor):
        """The serialized engine; a workspace OutOfMemory grows the workspace once (workspace_auto)."""
        for attempt in range(2):
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, self.workspace_bytes)
            errors = getattr(logger, "errors", [])
            del errors[:]
            self._progress("build", 0, 0)
            engine = builder.build_serialized_network(network, config)
            self._interrupted(monitor)
            if engine is not None:
                return engine
            wanted = _workspace_request(errors)
            if wanted is not None and self.workspace_auto and attempt == 0:
                grown = max(WORKSPACE_RETRY_MIN, 2 * wanted)
                grown = -(-grown // (64 << 20)) * (64 << 20)
                if grown > self.workspace_bytes:
                    self.log(f"[tensorrt] {self.onnx_path.name}: the {self.workspace_bytes >> 20} MiB workspace is "
                             f"too small ({wanted} bytes requested): building again with {grown >> 20} MiB")
                    self.workspace_bytes = grown
                    continue
            if wanted is not None:
                self._fail(f"TensorRT ran out of workspace building {self.onnx_path.name} ("
                           f"{self.workspace_bytes >> 20} MiB, {wanted} bytes requested): pass a larger --workspace",
                           "; ".join(errors[-2:]))
            self._fail(f"TensorRT could not build an engine from {self.onnx_path.name}", "; ".join(errors[-3:]))


def source_checkout_plugins() -> Optional[Path]:
    """plugins/build/libzeroedge_plugins.so of the source checkout this zeroedge runs from (None when
    it is an installed package)."""
    root = Path(__file__).resolve().parents[2]
    if (root / "plugins" / "CMakeLists.txt").is_file():
        return root / "plugins" / "build" / "libzeroedge_plugins.so"
    return None


PLUGINS_ENV = "ZEROEDGE_PLUGINS_LIB"


def default_plugin_lib(plugin_lib=None) -> Path:
    """The plugin library to build with: `plugin_lib`, else $ZEROEDGE_PLUGINS_LIB, else the source
    checkout's plugins/build/libzeroedge_plugins.so; UserError when that file is not there."""
    if plugin_lib:
        path, why = Path(plugin_lib), "--plugins"
    elif os.environ.get(PLUGINS_ENV):
        path, why = Path(os.environ[PLUGINS_ENV]), f"${PLUGINS_ENV}"
    else:
        path, why = source_checkout_plugins(), "the default"
        if path is None:
            raise UserError("no plugin library: pass --plugins libzeroedge_plugins.so (build it from a zeroedge "
                            f"checkout with scripts/build_plugins) or set ${PLUGINS_ENV}")
    if not path.is_file():
        raise UserError(f"plugin library not found: {path} ({why}); build it with scripts/build_plugins "
                        "[--trt-include DIR] (it writes plugins/build/libzeroedge_plugins.so)")
    return path


def bundle_trt_graphs(manifest: dict) -> list:
    """The bundle's *.trt.onnx files (listed in its manifest, so verified), prefill and decode first."""
    names = [rel for rel in manifest.get("files", {}) if rel.endswith(".trt.onnx") and "/" not in rel]
    order = {f"{g}.trt.onnx": i for i, g in enumerate(GRAPHS)}
    return sorted(names, key=lambda n: (order.get(n, len(order)), n))


OUT_MODES = ("new", "force", "update")


def _prepare_out(out: Path, mode: str, bundle: Path, plugin_lib: Path) -> Path:
    """Check OUT before any work; returns the folder to build in (a fresh temporary folder beside OUT
    for "new" / "force", inside OUT for "update"), whose files _commit_out moves into place.

    new: OUT absent or empty. force: OUT replaced whatever it holds. update: the engine files replace
    their namesakes in OUT, the rest of OUT stays (the deploy builds into a release's build/ folder
    that holds the plugin library); an OUT that does not exist yet is made as for new."""
    import secrets

    if mode not in OUT_MODES:
        raise ValueError(mode)
    out = Path(os.path.abspath(out))
    if os.path.lexists(out) and not out.is_dir():
        raise UserError(f"-o {out}: exists and is not a folder")
    res = out.resolve()
    for what, path in (("the bundle", bundle.resolve()), ("the plugin library", plugin_lib.resolve())):
        if mode != "update" and (res == path or res in path.parents):
            raise UserError(f"-o {out}: holds {what} ({path}); choose another folder for the engines")
    if mode == "new" and out.is_dir() and any(out.iterdir()):
        raise UserError(f"-o {out}: not empty (pass --force to replace it)")
    parent = out if mode == "update" and out.is_dir() else res.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = parent / f".{out.name or 'engines'}.building-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()  # the umask's mode, as the folder -o becomes
        return tmp
    except OSError as e:
        raise UserError(f"-o {out}: cannot write to {parent} ({e.strerror or e})") from None


def _commit_out(tmp: Path, out: Path, mode: str):
    """Move what `tmp` holds into OUT. An OUT that exists keeps its folder (its mode, a mount point,
    a shell standing in it): for force, what it held goes first into a trash folder beside it."""
    import shutil

    out = Path(os.path.abspath(out))
    if not out.is_dir():
        os.rename(tmp, out)
        return
    trash = None
    if mode == "force":
        trash = tmp.with_name(f"{tmp.name}.old")
        trash.mkdir()
        for f in list(out.iterdir()):
            if f != tmp:
                os.rename(f, trash / f.name)
    for f in sorted(tmp.iterdir()):
        os.replace(f, out / f.name)
    tmp.rmdir()
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def build_bundle_engines(bundle, plugin_lib, out, *, max_tokens: Optional[int] = None,
                         workspace_bytes: Optional[int] = None, serialize_plugins: bool = True,
                         cc: Optional[str] = None, log: Callable[[str], None] = print, mode: str = "update",
                         progress: Optional[Callable[[str, str, int, int], None]] = None,
                         on_engine: Optional[Callable[[dict], None]] = None,
                         verbose: Optional[Callable[[str], None]] = None,
                         prefill_chunk: Optional[int] = None) -> dict:
    """Build one engine per BUNDLE/*.trt.onnx (GRAPH.trt.onnx -> OUT/GRAPH.engine), plus timing.cache
    where the runtime keeps one and engines.json. Every input is checked before the first build, the
    engines are built in a temporary folder and moved into OUT only when all of them built (`mode`:
    see _prepare_out), so a failure leaves OUT as it was. This is `zeroedge build` and `python -m
    zeroedge.backends.tensorrt build` (mode "update").

    workspace_bytes None: the bundle plan's workspace, else DEFAULT_WORKSPACE, grown once on a
    workspace OutOfMemory (EngineFromOnnx's workspace_auto). progress(graph, phase, step, steps);
    on_engine(row) after each engine. prefill_chunk: the chunk the prefill engine's profile covers
    (default: the manifest's prefill.chunk; one pass for a bundle whose manifest says one_pass), recorded
    as engines.json's prefill_chunk for TrtRunner. Returns the engines.json content; its "engines" maps each graph
    to {"file", "bytes", "layers", "plugin_layers", "seconds", "workspace_bytes", "profiles"}."""
    import shutil

    from zeroedge import bundle as bundle_mod
    from zeroedge import plugin_spec

    bundle, out = Path(bundle), Path(out)
    manifest = bundle_mod.verify(bundle)
    abi = manifest.get("plugin_abi")
    if abi is not None and abi != plugin_spec.PLUGIN_ABI:
        raise UserError(f"{bundle}: exported for plugin ABI {abi}, this zeroedge builds ABI "
                        f"{plugin_spec.PLUGIN_ABI}; re-export the bundle")
    files = bundle_trt_graphs(manifest)
    if not files:
        raise UserError(f"{bundle}: no *.trt.onnx graph to build (export it with a TensorRT target: "
                        "zeroedge export MODEL -o BUNDLE)")
    trt = import_tensorrt()
    traits = runtime_traits(trt)
    plugin_lib = default_plugin_lib(plugin_lib)
    _, cc_label = build_target(trt, cc) if traits["target_cc"] or cc is not None else (None, None)
    auto = not workspace_bytes
    ws = int(workspace_bytes or workspace_from_plan(manifest))
    mt = int(max_tokens or max_tokens_from_plan(manifest))
    window = int(manifest.get("window") or 1024)
    chunk = prefill_plan(manifest, True, prefill_chunk)[0]   # the profiles: tokens and prefix of a chunk
    meta = {"tensorrt": traits["version"], "backend": f"{traits['name']} {traits['version']}",
            "runtime": traits["name"], "bundle_manifest_sha256": _sha256(bundle / "manifest.json"), "cc": cc_label, "plugins": str(plugin_lib.resolve()),
            "plugins_sha256": _sha256(plugin_lib), "serialize_plugins": serialize_plugins,
            "workspace_bytes": ws, "workspace_auto": auto, "max_tokens": mt, "window": window,
            "prefill_chunk": chunk,
            "timing_cache": "timing.cache" if traits["timing_cache"] else None, "engines": {}}
    tmp = _prepare_out(out, mode, bundle, plugin_lib)
    try:
        cache = tmp / "timing.cache"
        if traits["timing_cache"] and (out / "timing.cache").is_file() and mode != "new":
            shutil.copyfile(out / "timing.cache", cache)  # a cache of earlier builds speeds this one up
        for rel in files:
            g = rel[: -len(".trt.onnx")]
            stage = EngineFromOnnx(bundle / rel, plugin_lib, workspace_bytes=ws, timing_cache=cache,
                                   max_tokens=mt, window=window, serialize_plugins=serialize_plugins, cc=cc,
                                   chunk=chunk if g == "prefill" else None,
                                   log=log, workspace_auto=auto, verbose=verbose,
                                   progress=(lambda ph, i, n, g=g: progress(g, ph, i, n)) if progress else None)
            blob = stage()
            _write_atomic(tmp / f"{g}.engine", blob)
            row = {"file": f"{g}.engine", "bytes": len(blob), "layers": stage.layers,
                   "plugin_layers": stage.plugin_layers, "seconds": round(stage.build_s, 2),
                   "workspace_bytes": stage.workspace_bytes,
                   "profiles": {k: [list(s) for s in v] for k, v in stage.profiles.items()}}
            meta["engines"][g] = row
            if on_engine is not None:
                on_engine(dict(row, graph=g))
        _write_atomic(tmp / "engines.json", json.dumps(meta, indent=2).encode())
        _commit_out(tmp, out, mode)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def build_report(meta: dict, out) -> dict:
    """`zeroedge build --json`: {"backend": "<name> <version>", "engines": [{"graph", "file" (the
    engine's path), "bytes", "layers", "plugin_layers", ...}], "prefill_chunk" (the chunk the prefill
    engine's profile covers; None: one pass), ...}."""
    out = Path(os.path.abspath(out))
    engines = [dict({"graph": g, "file": str(out / e["file"])}, **{k: v for k, v in e.items()
                                                                 if k not in ("file", "profiles")})
               for g, e in meta["engines"].items()]
    cache = meta.get("timing_cache")
    return {"backend": meta["backend"], "engines": engines, "out": str(out), "cc": meta.get("cc"),
            "plugins": meta["plugins"], "plugins_serialized": bool(meta["serialize_plugins"]),
            "max_tokens": meta["max_tokens"], "workspace_bytes": meta["workspace_bytes"],
            "prefill_chunk": meta.get("prefill_chunk"),
            "timing_cache": str(out / cache) if cache and (out / cache).is_file() else None,
            "tensorrt": meta["tensorrt"]}


def engine_line(row: dict) -> str:
    """The readable line `zeroedge build` prints per engine."""
    return (f"{row['graph']}: {row['layers']} layers, {row['plugin_layers']} plugin layers, "
            f"{row['bytes'] / (1 << 20):.1f} MiB, {row['seconds']:.1f} s -> {row['file']}")


# ------------------------------------------------------------------------------------ run

def gpu_here() -> bool:
    """A GPU that can run engines: a discrete NVIDIA GPU or a Jetson's integrated one."""
    from zeroedge.device.probe import is_jetson

    return gpu_present() or is_jetson()


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


class TrtSession:
    """One engine with an onnxruntime-like `run(None, feed) -> [outputs]` (host numpy in and out)."""

    def __init__(self, engine_path, plugin_lib=None, output_order: Optional[Sequence[str]] = None):
        import numpy as np

        trt = import_tensorrt()
        self.np, self.trt = np, trt
        self.cudart = cudart = import_cudart()
        self.logger = trt.Logger(trt.Logger.WARNING)
        if plugin_lib is not None:
            if trt.get_plugin_registry().load_library(str(Path(plugin_lib).resolve())) is None:
                raise UserError(f"TensorRT could not load the plugin library {plugin_lib}")
        self.runtime = trt.Runtime(self.logger)
        self.runtime.engine_host_code_allowed = True  # the plugin library serialized in the plan
        path = Path(engine_path)
        if not path.is_file():
            raise UserError(f"engine not found: {path} (build it with: zeroedge build BUNDLE -o DIR)")
        self.engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise UserError(f"TensorRT could not load {path}: built by another TensorRT version or for another "
                            "GPU? rebuild it on this device")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        mode = trt.TensorIOMode.INPUT
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == mode]
        outs = [n for n in names if self.engine.get_tensor_mode(n) != mode]
        self.outputs = [n for n in (output_order or outs) if n in outs] or outs
        self.stream = _check(cudart, cudart.cudaStreamCreate(), "cudaStreamCreate")
        self.buffers: Dict[str, Tuple[int, int]] = {}  # name -> (device pointer, bytes)

    def input_dtype(self, name: str):
        """numpy dtype the engine takes for input `name` (OrtRunner sizes its window by it;
        float32 for a name the engine does not take)."""
        if name not in self.inputs:
            return self.np.float32
        return self.np.dtype(self.trt.nptype(self.engine.get_tensor_dtype(name))).type

    def _buffer(self, name: str, nbytes: int) -> int:
        ptr, size = self.buffers.get(name, (0, 0))
        if size < nbytes:
            if ptr:
                _check(self.cudart, self.cudart.cudaFree(ptr), "cudaFree")
            ptr = int(_check(self.cudart, self.cudart.cudaMalloc(max(nbytes, 256)), "cudaMalloc"))
            self.buffers[name] = (ptr, max(nbytes, 256))
        return self.buffers[name][0]

    def run(self, _output_names, feed: dict) -> list:
        np, trt, cudart = self.np, self.trt, self.cudart
        h2d, d2h = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        keep_alive = []
        for name in self.inputs:
            if name not in feed:
                raise UserError(f"missing input '{name}' for the TensorRT engine")
            a = np.ascontiguousarray(feed[name], dtype=trt.nptype(self.engine.get_tensor_dtype(name)))
            keep_alive.append(a)
            if not self.context.set_input_shape(name, tuple(a.shape)):
                raise UserError(f"input '{name}' of shape {tuple(a.shape)} is outside the engine's profile "
                                "(rebuild with a larger --max-tokens)")
            ptr = self._buffer(name, a.nbytes)
            _check(cudart, cudart.cudaMemcpyAsync(ptr, a.ctypes.data, a.nbytes, h2d, self.stream), "copy in")
            self.context.set_tensor_address(name, ptr)
        results = []
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            a = np.empty(shape, dtype=trt.nptype(self.engine.get_tensor_dtype(name)))
            self.context.set_tensor_address(name, self._buffer(name, a.nbytes))
            results.append(a)
        if not self.context.execute_async_v3(int(self.stream)):
            raise RuntimeError("TensorRT execute_async_v3 failed (see the log above)")
        for name, a in zip(self.outputs, results):
            _check(cudart, cudart.cudaMemcpyAsync(a.ctypes.data, self.buffers[name][0], a.nbytes, d2h, self.stream),
                   "copy out")
        _check(cudart, cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        del keep_alive
        return results

    def close(self):
        for ptr, _ in self.buffers.values():
            self.cudart.cudaFree(ptr)
        self.buffers.clear()
        if self.stream is not None:
            self.cudart.cudaStreamDestroy(self.stream)
            self.stream = None


class TrtRunner(OrtRunner):
    """Prefill and decode of a bundle through its TensorRT engines, with OrtRunner's window
    bookkeeping (slots, heat, eviction): OrtRunner's prefill / step / generate run unchanged on
    TrtSession objects, so both backends follow one protocol. The prefill runs in the chunks its engine's
    profile was built for (engines.json's prefill_chunk; None or engines from before it: one pass)."""

    def __init__(self, bundle, engines, plugin_lib=None, slots: Optional[int] = None, sinks: int = 4,
                 decay: float = 0.9, evict: Optional[Callable] = None, verify: bool = True, policy=None):
        import numpy as np

        from zeroedge import bundle as bundle_mod

        self.np = np
        self.dir = Path(bundle)
        self.manifest = bundle_mod.verify(self.dir) if verify else bundle_mod.read_manifest(self.dir)
        cfg = self.manifest["model"]
        self.L, self.nkv = cfg["n_layers"], cfg["n_kv_heads"]
        self.hd = cfg["dim"] // cfg["n_heads"]
        self.vocab = cfg["vocab_size"]
        self.slots = int(slots or self.manifest.get("window", 1024))
        graphs = (self.manifest.get("export") or {}).get("graphs") or {}

        def order(g):
            return [o["name"] for o in (graphs.get(g) or {}).get("outputs", [])] or None

        engines = Path(engines)
        self.engines_meta = check_engines(self.dir, engines)
        if plugin_lib is None and not self.engines_meta.get("serialize_plugins", True):
            plugin_lib = default_plugin_lib(None)  # built without the library inside: load it here
        self.pre = self.dec = None
        self.pre = TrtSession(engines / "prefill.engine", plugin_lib, order("prefill"))
        self.dec = TrtSession(engines / "decode.engine", plugin_lib, order("decode"))
        self.pre = PrefillGraph(self.pre, self.pre.inputs, self.nkv, self.hd, self.pre.outputs)
        built = self.engines_meta.get("prefill_chunk")   # the chunk the prefill engine's profile covers
        if self.pre.prefix and "prefill_chunk" not in self.engines_meta:
            self.chunk, self.prefill_mode = None, "one pass: engines built before chunked prefill"
        elif self.pre.prefix and built:
            self.chunk, self.prefill_mode = int(built), f"chunks of {int(built)} tokens (the engine's profile)"
        elif self.pre.prefix:                             # built one pass: the bundle's one_pass
            why = (self.manifest.get("prefill") or {}).get("why") or "the engine's profile has no prefix"
            self.chunk, self.prefill_mode = None, f"one pass: {why}"
        else:
            self.chunk, self.prefill_mode = prefill_plan(self.manifest, False)
        self.sinks, self.decay = sinks, decay
        self.evict = evict or self._coldest
        self.policy = policy  # the thermal window policy (zeroedge.kv.ort_policy), as for OrtRunner
        self.timings = {"prefill_s": 0.0, "prefill_tokens": 0, "decode_s": 0.0, "decode_tokens": 0}
        self.reset()

    def __exit__(self, *exc):
        for s in (self.pre, self.dec):
            if s is not None:
                s.close()
        self.pre = self.dec = None
        return False


# ------------------------------------------------------------------------------------ CLI

def module_cli():
    """The click group of `python -m zeroedge.backends.tensorrt build|generate`, spelled like `zeroedge
    build` and `zeroedge run`. `build BUNDLE -o DIR` is what `zeroedge deploy` runs on the device: the
    build of `zeroedge build`, into an existing folder (what else it holds is kept); `generate`
    decodes a few tokens through the engines. The old spellings (--bundle, --out, --workspace-mb,
    --new) still work, each with a one-line deprecation note on stderr. Errors take the path every
    zeroedge command takes (zeroedge.errors.run_command): one line `zeroedge: error: ...`, exit 2 for
    bad input."""
    import click

    from zeroedge.planner import parse_size

    def old(spelling: str, new: str, **kw):
        """A hidden deprecated spelling: a note on stderr when given."""
        def note(ctx, param, value):
            if value is not None:
                click.echo(f"zeroedge: warning: {spelling} is deprecated; use {new}", err=True)
            return value

        return click.option(spelling, "old_" + spelling.lstrip("-").replace("-", "_"), hidden=True, default=None,
                            callback=note, **kw)

    def pick(value, old_value, name: str, old_name: str, required: str = ""):
        if value is not None and old_value is not None:
            raise click.UsageError(f"give {name} or its old spelling {old_name}, not both")
        value = value if value is not None else old_value
        if value is None and required:
            raise click.UsageError(required)
        return value

    @click.group(context_settings={"help_option_names": ["-h", "--help"]},
                 help="Build and run TensorRT engines of a zeroedge bundle (Jetson: TensorRT 10.3; elsewhere "
                      "TensorRT-RTX). The user commands are `zeroedge build` and `zeroedge run --backend "
                      "tensorrt`; `zeroedge deploy` runs `build` here on the device.",
                 epilog="\b\nExample:\n  python -m zeroedge.backends.tensorrt build bundle/ -o build/")
    def cli():
        pass

    @cli.command("build", help="One engine per BUNDLE/*.trt.onnx: the build of `zeroedge build`, into a folder "
                               "that may exist (what else it holds is kept); prints the same JSON.",
                 epilog="\b\nExample:\n  python -m zeroedge.backends.tensorrt build bundle/ -o build/ "
                        "--plugins build/plugins/libzeroedge_plugins.so")
    @click.argument("bundle", required=False, metavar="BUNDLE")
    @click.option("-o", "--output", "out", metavar="ENGINES",
                  help="folder for the engines, timing.cache and engines.json  [required]")
    @click.option("--plugins", default=None, metavar="PATH", help="libzeroedge_plugins.so (default: "
                  "$ZEROEDGE_PLUGINS_LIB, else plugins/build/ of a source checkout; scripts/build_plugins makes it)")
    @click.option("--cc", default=None, metavar="X.Y", help="TensorRT-RTX only: compute capability to build for "
                  "ahead of time (8.6, 8.9, 12.0, ...; default: the GPU present)")
    @click.option("--workspace", default=None, metavar="SIZE", help="builder workspace pool, e.g. 512M or 1G "
                  "(default: from the plan, else 256M, grown once to >= 1G if the builder runs out)")
    @click.option("--max-tokens", type=int, default=None, help="longest prompt (default: from the plan)")
    @click.option("--no-serialize-plugins", is_flag=True,
                  help="do not embed the plugin library (load it at run time instead)")
    @old("--bundle", "BUNDLE (an argument)")
    @old("--out", "-o/--output")
    @old("--workspace-mb", "--workspace SIZE", type=int)
    def build(bundle, out, plugins, cc, workspace, max_tokens, no_serialize_plugins, old_bundle, old_out,
              old_workspace_mb):
        bundle = pick(bundle, old_bundle, "BUNDLE", "--bundle", "Missing argument 'BUNDLE'.")
        out = pick(out, old_out, "-o/--output", "--out", "Missing option '-o' / '--output'.")
        if workspace is not None and old_workspace_mb is not None:
            raise click.UsageError("give --workspace or its old spelling --workspace-mb, not both")
        if old_workspace_mb is not None and old_workspace_mb < 1:
            raise UserError("--workspace-mb must be >= 1")
        ws = parse_size(workspace) if workspace is not None else None
        if old_workspace_mb is not None:
            ws = old_workspace_mb << 20
        if max_tokens is not None and max_tokens < 1:
            raise UserError("--max-tokens must be >= 1")
        meta = build_bundle_engines(bundle, plugins, out, max_tokens=max_tokens, workspace_bytes=ws,
                                    serialize_plugins=not no_serialize_plugins, cc=cc,
                                    mode="update", log=lambda s: print(s, file=sys.stderr))
        print(json.dumps(build_report(meta, out)))

    @cli.command("generate", help="Greedy generation through the engines: prompt token ids in, new ids out.",
                 epilog="\b\nExample:\n  python -m zeroedge.backends.tensorrt generate bundle/ --engines build/ "
                        "--tokens \"1 2 3\" --max-new 8")
    @click.argument("bundle", required=False, metavar="BUNDLE")
    @click.option("--engines", required=True, help="the engines of BUNDLE (zeroedge build BUNDLE -o DIR)")
    @click.option("--plugins", default=None, help="the plugin library, when the engines were built without it")
    @click.option("--tokens", required=True, help="prompt token ids, space separated")
    @click.option("--max-new", type=int, default=None, help="new tokens to generate  [default: 16]")
    @old("--bundle", "BUNDLE (an argument)")
    @old("--new", "--max-new", type=int)
    def generate(bundle, engines, plugins, tokens, max_new, old_bundle, old_new):
        bundle = pick(bundle, old_bundle, "BUNDLE", "--bundle", "Missing argument 'BUNDLE'.")
        new = pick(max_new, old_new, "--max-new", "--new")
        new = 16 if new is None else new
        try:
            toks = [int(t) for t in tokens.split()]
        except ValueError:
            raise UserError(f"--tokens {tokens!r}: give token ids (integers), space separated") from None
        if not toks:
            raise UserError("--tokens is empty")
        if new < 1:
            raise UserError("--max-new must be >= 1")
        with TrtRunner(bundle, engines, plugins) as r:
            print(" ".join(map(str, r.generate(toks, new))))

    return cli


def main(argv=None) -> int:
    """`python -m zeroedge.backends.tensorrt ...` (module_cli)."""
    from zeroedge.errors import run_command

    run_command(module_cli(), argv, prog_name="python -m zeroedge.backends.tensorrt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
