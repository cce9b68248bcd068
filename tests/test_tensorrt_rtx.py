"""Real TensorRT in CI, on the CPU: TensorRT for RTX (`tensorrt_rtx`, pip tensorrt-rtx-cu13==1.7.1.116)
parses the tiny bundles' *.trt.onnx graphs with the zeroedge plugin library (plugins/, built against the
TensorRT 10.3 headers) and builds SM86 engines ahead of time, through zeroedge.backends.tensorrt:

* every graph a bundle can hold (dense prefill / decode, SIH/PAD prefill, paths prefill / decode):
  no parser error, a non-empty engine, one plugin layer per zeroedge node of the graph;
* bad plugin fields (missing, wrong type, wrong length, bad values, unsupported D, a plugin_version or
  namespace zeroedge does not ship) through the real parser and builder: a UserError that names the
  field or the rule, never an abort. Each of those cases runs in its own process, so an abort fails that case
  instead of ending the test session.

No test here skips in CI (or wherever the TensorRT 10.3 headers are at ../shared): scripts/setup
installs TensorRT-RTX and builds the plugin library into plugins/build; conftest's `plugin_lib`
fixture (re)builds it once per session if it is missing or older than its sources (`rtx`,
`plugin_lib` and the tiny bundles are shared with test_build_cli.py). Building engines needs no GPU
(TensorRT-RTX cannot run them on an H200 anyway).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

CC = "8.6"  # an Ampere target TensorRT-RTX builds for (it has no SM87 / SM90)


@pytest.fixture(scope="module")
def bundles(tiny_trt_bundles):
    """conftest's tiny_trt_bundles: dense, zero (SIH/PAD), paths."""
    return tiny_trt_bundles


def _plugin_nodes(path):
    import onnx

    from zeroedge import plugin_spec

    g = onnx.load(str(path), load_external_data=False).graph
    return [n.op_type for n in g.node if n.domain == plugin_spec.DOMAIN]


# (bundle, graph, the zeroedge nodes it must hold): what the export makes today
GRAPHS = [("dense", "prefill", {}), ("dense", "decode", {}),
          ("zero", "prefill", {"ZeroEdgeSIHChunk": 4, "ZeroEdgePADGather": 4, "ZeroEdgePADScatter": 4}),
          ("zero", "decode", {}),
          ("paths", "prefill", {"ZeroEdgeSIHChunk": 2, "ZeroEdgePADGather": 2, "ZeroEdgePADScatter": 2}),
          ("paths", "decode", {"ZeroEdgePathsFFN": 2})]


@pytest.mark.parametrize("name,graph,nodes", GRAPHS, ids=[f"{b}-{g}" for b, g, _ in GRAPHS])
def test_graph_parses_and_builds_with_the_plugins(rtx, plugin_lib, bundles, name, graph, nodes):
    from zeroedge.backends.tensorrt import EngineFromOnnx

    path = bundles / name / f"{graph}.trt.onnx"
    found = _plugin_nodes(path)
    assert {op: found.count(op) for op in set(found)} == nodes
    stage = EngineFromOnnx(path, plugin_lib, max_tokens=64, window=64, cc=CC, log=lambda s: None)
    blob = stage()
    assert stage.parser_errors == []
    assert len(blob) > 1 << 20, len(blob)                          # an engine, with the plugin library in it
    assert stage.plugin_layers == len(found)
    assert stage.layers > 100 and stage.traits["name"] == "tensorrt_rtx"
    print(f"{name}/{graph}: {stage.layers} layers, {stage.plugin_layers} plugin layers, {len(blob)} bytes, "
          f"built in {stage.build_s:.2f} s")


def test_build_bundle_engines_with_tensorrt_rtx(rtx, plugin_lib, bundles, tmp_path):
    from zeroedge.backends.tensorrt import build_bundle_engines

    out = tmp_path / "engines"
    meta = build_bundle_engines(bundles / "zero", plugin_lib, out, max_tokens=64, cc=CC, log=lambda s: None)
    assert meta["backend"] == f"tensorrt_rtx {rtx.__version__}" and meta["cc"] == CC
    on_disk = json.loads((out / "engines.json").read_text())
    assert on_disk["engines"]["prefill"]["plugin_layers"] == 12 and on_disk["engines"]["decode"]["plugin_layers"] == 0
    for g in ("prefill", "decode"):
        assert (out / f"{g}.engine").stat().st_size == on_disk["engines"][g]["bytes"] > 0
    assert not (out / "timing.cache").exists()      # TensorRT-RTX has no timing cache (runtime_traits)
    assert not list(out.glob("*.tmp"))


def test_parser_link_is_in_place(rtx):
    """The parser abort's cause: it dlopen()s libtensorrt_rtx.so for plugin layers."""
    from zeroedge.backends.tensorrt import ensure_rtx_parser_link

    link = ensure_rtx_parser_link()
    if link is not None:
        assert link.exists() and link.resolve().name.startswith("libtensorrt_rtx.so.")


def test_unknown_compute_capability_is_a_clear_error(rtx, plugin_lib, bundles):
    from zeroedge.backends.tensorrt import EngineFromOnnx
    from zeroedge.errors import UserError

    with pytest.raises(UserError, match=r"compute capability 8\.7.*8\.6"):
        EngineFromOnnx(bundles / "dense" / "prefill.trt.onnx", plugin_lib, cc="8.7", log=lambda s: None)()


# ------------------------------------------------------------------------------ bad plugin fields

def _sih_graph(path, D=16, W=4, R=4, attrs=None, drop=(), rank3=False):
    """One ZeroEdgeSIH node: x [T, D] (T dynamic), head width W, anchor rank R."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    shapes = {"w1": (W, D), "b1": (W,), "w2": (W, W), "b2": (W,), "w3": (W, W), "b3": (W,), "w4": (1, W), "b4": (1,),
              "anchor_a": (R, D), "anchor_b": (D, R), "anchor_c": (D,)}
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n) for n, s in shapes.items()]
    a = {"threshold": 0.5, "anchor_rank": R, "plugin_version": "1", "plugin_namespace": "zeroedge"}
    a.update(attrs or {})
    for k in drop:
        a.pop(k)
    node = helper.make_node("ZeroEdgeSIH", ["x", *shapes], ["keep", "base"], name="sih", domain="zeroedge", **a)
    xs = ["T", 2, D] if rank3 else ["T", D]
    g = helper.make_graph([node], "sih", [helper.make_tensor_value_info("x", TensorProto.FLOAT, xs)],
                          [helper.make_tensor_value_info("keep", TensorProto.INT32, ["T"]),
                           helper.make_tensor_value_info("base", TensorProto.FLOAT, xs)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("zeroedge", 1)])
    m.ir_version = 10
    onnx.save(m, str(path))
    lo, hi = [1, *xs[1:]], [64, *xs[1:]]
    return {"x": [lo, hi, hi]}


def _paths_graph(path, D=64, F=32, attrs=None, drop=(), x_type="FLOAT16"):
    """One ZeroEdgePathsFFN node: x [B, D] (fp16 unless x_type says otherwise; B 1..8), w13_t [D, 2F],
    wd_t [F, D]."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.1).astype(np.float16), n)
             for n, s in (("w13_t", (D, 2 * F)), ("wd_t", (F, D)))]
    a = {"threshold_in": 0.1, "threshold": 0.01, "plugin_version": "1", "plugin_namespace": "zeroedge"}
    a.update(attrs or {})
    for k in drop:
        a.pop(k)
    node = helper.make_node("ZeroEdgePathsFFN", ["x", "w13_t", "wd_t"], ["y"], name="paths", domain="zeroedge", **a)
    xt = getattr(TensorProto, x_type)
    g = helper.make_graph([node], "paths", [helper.make_tensor_value_info("x", xt, ["B", D])],
                          [helper.make_tensor_value_info("y", xt, ["B", D])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("zeroedge", 1)])
    m.ir_version = 10
    onnx.save(m, str(path))
    return {"x": [[1, D], [4, D], [8, D]]}


def _build_in_subprocess(plugin_lib, cases):
    """Build each (onnx, shapes) in a fresh process through EngineFromOnnx; one JSON line per case:
    {"ok": true, "plugin_layers": n} or {"ok": false, "error": "..."}; an abort shows as rc != 0."""
    out = []
    for onnx_path, shapes in cases:
        code = ("import json, sys\n"
                "from zeroedge.backends.tensorrt import EngineFromOnnx\n"
                "from zeroedge.errors import UserError\n"
                "shapes = {k: tuple(tuple(s) for s in v) for k, v in json.loads(sys.argv[3]).items()}\n"
                "st = EngineFromOnnx(sys.argv[1], sys.argv[2], shapes=shapes, cc=sys.argv[4], log=lambda s: None)\n"
                "try:\n"
                "    st()\n"
                "    print(json.dumps({'ok': True, 'plugin_layers': st.plugin_layers}))\n"
                "except UserError as e:\n"
                "    print(json.dumps({'ok': False, 'error': str(e)}))\n")
        r = subprocess.run([sys.executable, "-c", code, str(onnx_path), str(plugin_lib), json.dumps(shapes), CC],
                           capture_output=True, text=True, cwd=REPO, timeout=300,
                           env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert r.returncode == 0, f"{Path(onnx_path).name}: rc {r.returncode} (an abort?)\n{r.stderr[-3000:]}"
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return out


# (case id, graph builder, its keyword arguments, what the error must say; None: it must build)
BAD_FIELDS = [
    ("sih-ok", _sih_graph, {}, None),
    ("sih-unknown-field-ignored", _sih_graph, {"attrs": {"not_a_field": 3}}, None),
    ("sih-missing-threshold", _sih_graph, {"drop": ["threshold"]},
     r"ZeroEdgeSIH: required field 'threshold' is missing"),
    ("sih-threshold-int", _sih_graph, {"attrs": {"threshold": 1}},
     r"field 'threshold' must be FLOAT32 .*got kINT32"),
    ("sih-threshold-string", _sih_graph, {"attrs": {"threshold": "0.5"}},
     r"field 'threshold' must be FLOAT32 .*got kCHAR"),
    ("sih-threshold-floats", _sih_graph, {"attrs": {"threshold": [0.1, 0.2]}},
     r"field 'threshold' must hold exactly one value, got 2"),
    ("sih-threshold-nan", _sih_graph, {"attrs": {"threshold": float("nan")}}, r"'threshold' must be a finite number"),
    ("sih-min-tokens-float", _sih_graph, {"attrs": {"min_tokens": 2.5}}, r"field 'min_tokens' must be INT32"),
    ("sih-anchor-rank-too-big", _sih_graph, {"R": 100, "attrs": {"anchor_rank": 100}},
     r"field 'anchor_rank' must be in 0\.\.64, got 100"),
    ("sih-block-frac-out-of-range", _sih_graph, {"attrs": {"block_frac": 1.5}}, r"'block_frac' must be in \[0, 1\]"),
    ("sih-unsupported-D", _sih_graph, {"D": 12}, r"hidden size D = 12 is not supported: it must be a multiple of 8"),
    ("sih-x-rank-3", _sih_graph, {"rank3": True}, r"input 0 \(x\) must be 2-D"),
    ("sih-head-width-40", _sih_graph, {"W": 40}, r"head width W = 40 is not supported"),
    ("sih-negative-ma-weight", _sih_graph, {"attrs": {"ma_w1": -0.5}}, r"moving-average weights must be finite"),
    ("sih-negative-block-size", _sih_graph, {"attrs": {"block_size": -2}}, r"'block_size' must be >= 0"),
    ("sih-rank-rule-ok", _sih_graph, {"attrs": {"rate": 0.6, "rank_block": 512}}, None),
    ("sih-rate-over-one", _sih_graph, {"attrs": {"rate": 1.5}}, r"field 'rate' must be a finite number <= 1"),
    ("sih-rank-block-zero", _sih_graph, {"attrs": {"rate": 0.5, "rank_block": 0}}, r"'rank_block' must be >= 1"),
    ("sih-rank-rule-with-block-rule", _sih_graph, {"attrs": {"rate": 0.5, "block_size": 64}},
     r"the rank rule \(rate >= 0\) takes no block rule"),
    ("sih-plugin-version-2", _sih_graph, {"attrs": {"plugin_version": "2"}},
     r"asks for plugin_version '2', this plugin library ships ZeroEdgeSIH plugin_version '1'"),
    ("sih-plugin-version-int", _sih_graph, {"attrs": {"plugin_version": 1}},
     r"plugin_version must be a STRING attribute"),
    ("sih-other-namespace", _sih_graph, {"attrs": {"plugin_namespace": "other"}},
     r"asks for plugin_namespace 'other'"),
    ("paths-ok", _paths_graph, {}, None),
    ("paths-missing-threshold-in", _paths_graph, {"drop": ["threshold_in"]},
     r"ZeroEdgePathsFFN: required field 'threshold_in' is missing"),
    ("paths-threshold-int", _paths_graph, {"attrs": {"threshold": 0}}, r"field 'threshold' must be FLOAT32"),
    ("paths-negative-threshold", _paths_graph, {"attrs": {"threshold": -1.0}},
     r"field 'threshold' must be a finite number >= 0"),
    ("paths-unsupported-D", _paths_graph, {"D": 36}, r"hidden size D = 36 is not supported"),
    ("paths-odd-F", _paths_graph, {"F": 12}, r"FFN width F = 12 is not supported"),
    ("paths-fp32-x", _paths_graph, {"x_type": "FLOAT"}, r"ZeroEdgePathsFFN: x must be float16 or bfloat16"),
]


@pytest.fixture(scope="module")
def bad_field_results(rtx, plugin_lib, tmp_path_factory):
    d = tmp_path_factory.mktemp("fields")
    cases = [(d / f"{cid}.onnx", make(d / f"{cid}.onnx", **kw)) for cid, make, kw, _ in BAD_FIELDS]
    return dict(zip([c[0] for c in BAD_FIELDS], _build_in_subprocess(plugin_lib, cases)))


@pytest.mark.parametrize("cid,expect", [(c[0], c[3]) for c in BAD_FIELDS], ids=[c[0] for c in BAD_FIELDS])
def test_bad_plugin_fields_are_clear_errors(bad_field_results, cid, expect):
    import re

    r = bad_field_results[cid]
    if expect is None:
        assert r == {"ok": True, "plugin_layers": 1}, r
    else:
        assert not r["ok"], r
        assert re.search(expect, r["error"]), r["error"]


def _check_errors(onnx_path) -> list:
    """`zeroedge check`'s errors for one graph (the pre-flight, no TensorRT)."""
    import onnx

    from zeroedge.preflight import check_model

    return [f for f in check_model(onnx.load(str(onnx_path)), fname=Path(onnx_path).name) if f.severity == "error"]


@pytest.mark.parametrize("cid", [c[0] for c in BAD_FIELDS])
def test_check_agrees_with_the_real_builder(bad_field_results, tmp_path, cid):
    """`zeroedge check` learned the parser's and the plugin library's rules: it finds an error in a
    graph exactly when the real TensorRT-RTX parse + build refuses it."""
    _, make, kw, _ = next(c for c in BAD_FIELDS if c[0] == cid)
    make(tmp_path / "g.onnx", **kw)
    errors = _check_errors(tmp_path / "g.onnx")
    built = bad_field_results[cid]["ok"]
    assert bool(errors) == (not built), (cid, bad_field_results[cid], [f.line() for f in errors])


def test_fuzzed_sih_fields_never_abort(rtx, plugin_lib, tmp_path):
    """Random field sets (names from the spec, random types and lengths and values): each one builds or
    is refused with a message that names ZeroEdgeSIH; none ends the process; and `zeroedge check`
    predicts which (an error exactly for the refused ones)."""
    import random

    from zeroedge import plugin_spec

    rnd = random.Random(15)
    names = plugin_spec.field_names("ZeroEdgeSIH")
    values = [0, 1, -3, 7, 100, 0.5, -0.25, 1.5, float("inf"), "", "x", [1, 2], [0.1, 0.2, 0.3], []]
    cases = []
    for i in range(12):
        attrs = {k: rnd.choice(values) for k in rnd.sample(names, rnd.randint(1, 4))}
        attrs = {k: v for k, v in attrs.items() if v != []}
        drop = ["threshold"] if "threshold" not in attrs and rnd.random() < 0.5 else []
        R = attrs["anchor_rank"] if isinstance(attrs.get("anchor_rank"), int) and 0 < attrs["anchor_rank"] <= 64 else 4
        cases.append((tmp_path / f"fuzz{i}.onnx", _sih_graph(tmp_path / f"fuzz{i}.onnx", R=R, attrs=attrs, drop=drop)))
    for (path, _), r in zip(cases, _build_in_subprocess(plugin_lib, cases)):
        assert r["ok"] or "ZeroEdgeSIH" in r["error"], (path.name, r)
        errors = _check_errors(path)
        assert bool(errors) == (not r["ok"]), (path.name, r, [f.line() for f in errors])


# ------------------------------------------------------------------------------ SmolLM2

def test_smollm2_bundle_graphs_build(rtx, plugin_lib, smollm2, tmp_path):
    """Real weights and the shipped calibration artifact (SIH/PAD on its skip layers) plus decode paths
    on two layers, through `zeroedge build --cc 8.6 --json` with its defaults (2048 tokens): every graph
    builds with one plugin layer per zeroedge node; the SIH/PAD prefill is built for chunks of 512, so
    its plugins fit the default 256 MiB workspace (one pass over 2048 tokens asked for ~270 MB and was
    built again with 1 GiB) (~40 s: export ~30 s, builds ~25 s, ~3 GB peak)."""
    from conftest import run_cli
    from artifacts import with_paths

    from zeroedge import calib_artifact
    from zeroedge.export.bundle_writer import export_bundle

    _, folder = smollm2
    meta, t = calib_artifact.load(REPO / "zeroedge" / "data" / "smollm2-135m.calib")
    with_paths(tmp_path / "calib", meta, t, paths={0: (0.5, 0.01), 7: (0.4, 0.01)},
              n_layers=meta["model"]["config"]["n_layers"])
    export_bundle(str(folder), tmp_path / "b", calib=tmp_path / "calib", window=1024)
    p = run_cli("build", tmp_path / "b", "-o", tmp_path / "e", "--cc", CC, "--plugins", plugin_lib, "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)
    assert doc["backend"] == f"tensorrt_rtx {rtx.__version__}" and doc["max_tokens"] == 2048
    rows = {e["graph"]: e for e in doc["engines"]}
    assert sorted(rows) == ["decode", "prefill"]
    for graph, e in rows.items():
        nodes = _plugin_nodes(tmp_path / "b" / f"{graph}.trt.onnx")
        assert nodes, graph
        assert e["plugin_layers"] == len(nodes) and e["layers"] > 30 * 100     # every block (30) is in it
        assert e["bytes"] == Path(e["file"]).stat().st_size > 100 << 20
        print(f"smollm2/{graph}: {e['layers']} layers, {e['plugin_layers']} plugin layers, {e['bytes']} bytes, "
              f"built in {e['seconds']:.2f} s with a {e['workspace_bytes'] >> 20} MiB workspace")
    assert rows["prefill"]["workspace_bytes"] == 256 << 20 and doc["prefill_chunk"] == 512
    # the nodes that built become the H200's plugin cases (benchmarks/gpu/plugin_cases.py): the extractor
    # reads every one of them, fp16 weights behind their Cast included
    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    import plugin_cases

    seen = plugin_cases.extract([tmp_path / "b"], tmp_path / "cases", per_op=1)
    assert len(seen) == sum(e["plugin_layers"] for e in rows.values())
    written = sorted(r["op"] for r in seen if r["written"])
    assert written == ["ZeroEdgePathsFFN", "ZeroEdgeSIHChunk"], written
    import numpy as np

    for case in (tmp_path / "cases").iterdir():
        w = np.load(case / "weights.npz")
        assert all(np.isfinite(v).all() and v.dtype == np.float32 for v in w.values())
