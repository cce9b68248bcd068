"""TensorRT backend: build engines from a bundle's *.trt.onnx with the zeroedge plugin library, and
run prefill and decode with cuda-python (`cuda.bindings`). For a Jetson with JetPack 6.1 / 6.2
(TensorRT 10.3), or TensorRT-RTX elsewhere (loader); nothing here imports tensorrt or cuda until
it is used.

    zeroedge build BUNDLE -o ENGINES [--plugins LIB] [--cc 8.6] [--json]    # build_bundle_engines
    python -m zeroedge.backends.tensorrt build BUNDLE -o DIR [--plugins LIB]  # what zeroedge deploy runs
    python -m zeroedge.backends.tensorrt generate BUNDLE --engines DIR --tokens "1 2 3" [--max-new N]

    with TrtRunner("bundle/", "build/", "build/plugins/libzeroedge_plugins.so") as r:
        logits = r.prefill(tokens)      # same interface and window bookkeeping as OrtRunner
        ids = r.generate(tokens, 32)

One module per job; each imports only modules listed above it:

    loader   which TensorRT (10.3 or RTX) and cuda-python; runtime_traits names every difference
    target   the GPU present and the compute capability a build is for
    plugins  the plugin library: where it is, what it logged, the graph nodes it cannot take
    plan     workspace, longest prompt and optimisation profiles
    engine   EngineFromOnnx: one serialized engine from one graph (a Polygraphy-style loader)
    build    build_bundle_engines: a bundle's engines and engines.json (`zeroedge build`)
    check    check_engines: an engines folder against its bundle, this TensorRT and this GPU
    session  TrtSession: one engine, run like an onnxruntime session
    runner   TrtRunner: zeroedge.backends.window.WindowRunner over the two engines
    cli      python -m zeroedge.backends.tensorrt build|generate

The names below are re-exported from those modules; to patch one, patch it in the module that
uses it.
"""
from zeroedge.backends.tensorrt.loader import (TensorRTMissing, ensure_rtx_parser_link, import_cudart,
                                               import_tensorrt, is_rtx, runtime_traits)
from zeroedge.backends.tensorrt.target import (build_target, compute_capability, gpu_compute_capability, gpu_here,
                                               gpu_present, rtx_capabilities)
from zeroedge.backends.tensorrt.plugins import (default_plugin_lib, plugin_messages, plugin_node_problems,
                                                source_checkout_plugins)
from zeroedge.backends.tensorrt.plan import (DEFAULT_WORKSPACE, max_tokens_from_plan, profile_shapes,
                                             workspace_from_plan)
from zeroedge.backends.tensorrt.engine import DeferredInterrupt, EngineFromOnnx
from zeroedge.backends.tensorrt.build import build_bundle_engines, build_report, engine_line
from zeroedge.backends.tensorrt.check import check_engines
from zeroedge.backends.tensorrt.session import TrtSession
from zeroedge.backends.tensorrt.runner import TrtRunner
from zeroedge.backends.tensorrt.cli import main, module_cli

__all__ = [
    "TensorRTMissing", "ensure_rtx_parser_link", "import_cudart", "import_tensorrt", "is_rtx", "runtime_traits",
    "build_target", "compute_capability", "gpu_compute_capability", "gpu_here", "gpu_present", "rtx_capabilities",
    "default_plugin_lib", "plugin_messages", "plugin_node_problems", "source_checkout_plugins",
    "DEFAULT_WORKSPACE", "max_tokens_from_plan", "profile_shapes", "workspace_from_plan",
    "DeferredInterrupt", "EngineFromOnnx", "build_bundle_engines", "build_report", "engine_line",
    "check_engines", "TrtSession", "TrtRunner", "main", "module_cli",
]
