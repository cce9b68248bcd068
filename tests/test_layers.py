"""The layers of zeroedge, read from the import graph (every `import` and `from ... import`, the lazy
ones inside functions included):

    core         model, weights, texts, errors, bundle, trust, plugin_spec, calib_artifact, planner,
                 preflight, device (the probe), triton_launch (PDL for the Triton kernels), kernels_lib
                 (where the plugin library's CUDA kernels are)
    mechanisms   mechanisms (SIH, PAD, anchors, heads), paths, kv, sensor, quant (weight-only),
                 speculative (drafts and their length)
    workstation  export (zeroedge.export: calibrate, rewrite, bundle writer), evaluation
    backends     backends (onnxruntime, tensorrt, the plugin reference)
    serving      runtime (the serving session and decoders), daemon, serve (the HTTP API and its engine)
    deploy       deploy
    commands     commands, cli

A module imports only from its own layer or a lower one, the folders' import graph has no cycle, and
the device side (core, mechanisms, backends, serving) never imports the workstation side. A new
top-level module or folder must be given a layer here."""
import ast
from pathlib import Path

from conftest import REPO

LAYERS = [
    ("core", {"zeroedge", "model", "weights", "texts", "errors", "bundle", "trust", "plugin_spec", "calib_artifact",
              "planner", "preflight", "device", "systemd", "data", "triton_launch", "kernels_lib"}),
    ("mechanisms", {"mechanisms", "paths", "kv", "sensor", "quant", "speculative"}),
    ("workstation", {"export", "evaluation"}),
    ("backends", {"backends"}),
    ("serving", {"runtime", "daemon", "serve"}),
    ("deploy", {"deploy"}),
    ("commands", {"commands", "cli"}),
]
RANK = {unit: i for i, (_, units) in enumerate(LAYERS) for unit in units}
DEVICE_SIDE = {"core", "mechanisms", "backends", "serving"}


def _unit(module: str) -> str:
    """zeroedge.paths.sparse -> paths; zeroedge.export.rewrite -> export; zeroedge -> zeroedge."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _modules():
    for folder, prefix in ((REPO / "zeroedge", "zeroedge"), (REPO / "export", "zeroedge.export")):
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("").parts
            name = ".".join((prefix, *rel)).removesuffix(".__init__")
            yield name, path


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("zeroedge"):
            yield node.module, node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("zeroedge"):
                    yield a.name, node.lineno


def _edges():
    out = []
    for name, path in _modules():
        for target, line in _imports(path):
            out.append((name, target, f"{path.relative_to(REPO)}:{line}"))
    return out


def test_every_module_has_a_layer():
    units = {_unit(name) for name, _ in _modules()}
    assert units - set(RANK) == set(), "give these a layer in tests/test_layers.py"


def test_imports_only_go_down():
    up = [f"{where}: {src} ({LAYERS[RANK[_unit(src)]][0]}) imports {dst} ({LAYERS[RANK[_unit(dst)]][0]})"
          for src, dst, where in _edges() if RANK[_unit(dst)] > RANK[_unit(src)]]
    assert not up, "\n".join(up)


def test_device_side_never_imports_the_workstation():
    bad = [f"{where}: {src} imports {dst}" for src, dst, where in _edges()
           if LAYERS[RANK[_unit(src)]][0] in DEVICE_SIDE and LAYERS[RANK[_unit(dst)]][0] == "workstation"]
    assert not bad, "\n".join(bad)


def test_folders_import_each_other_without_cycles():
    graph = {}
    for src, dst, _ in _edges():
        a, b = _unit(src), _unit(dst)
        if a != b and b != "zeroedge":
            graph.setdefault(a, set()).add(b)
    state = {}

    def visit(n, stack):
        state[n] = "open"
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                raise AssertionError(f"import cycle: {' -> '.join(stack + [n, m])}")
            if m not in state:
                visit(m, stack + [n])
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [])


def test_the_checker_sees_lazy_imports(tmp_path):
    """The graph includes imports inside functions (where most of zeroedge's are)."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from zeroedge.export import rewrite\n    import zeroedge.serve.session\n")
    assert sorted(t for t, _ in _imports(f)) == ["zeroedge.export", "zeroedge.serve.session"]
