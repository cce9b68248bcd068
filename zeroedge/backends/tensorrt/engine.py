"""One engine from one graph, as Polygraphy's loaders build: `EngineFromOnnx(...)()` returns the
serialized engine.

fp16, the workspace it is given (an automatic one that runs out is grown once to max(1 GiB, twice
what the builder asked for)), a timing cache (TensorRT 10.3; TensorRT-RTX has none), one
optimisation profile (plan.profile_shapes), and the plugin library serialized into the engine
(version-compatible plan with the lean runtime excluded; `serialize_plugins=False` instead loads the
library at run time). The builder's errors become one-line UserErrors (make_logger), its phases are
reported (make_progress_monitor) and a Ctrl-C cancels the build (DeferredInterrupt).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

from zeroedge.backends.tensorrt.loader import import_tensorrt, runtime_traits
from zeroedge.backends.tensorrt.plan import DEFAULT_WORKSPACE, profile_shapes
from zeroedge.backends.tensorrt.plugins import plugin_messages, plugin_node_problems
from zeroedge.backends.tensorrt.target import build_target
from zeroedge.errors import UserError


def _write_atomic(path: Path, data: bytes):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


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
