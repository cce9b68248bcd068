"""`zeroedge check`: TensorRT 10.3 pre-flight on a clean bundle and on graphs seeded with each kind
of problem."""
import json

import numpy as np
import pytest

from conftest import run_cli

onnx = pytest.importorskip("onnx")
pytest.importorskip("torch")
from onnx import AttributeProto, TensorProto, helper, numpy_helper  # noqa: E402


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from artifacts import sih_artifact

    from zeroedge.export.bundle_writer import export_bundle

    d = tmp_path_factory.mktemp("chk")
    sih_artifact(d / "calib", "tiny", skip=[0, 2])
    export_bundle("tiny", d / "b", calib=d / "calib", window=32)
    return d / "b"


def trt(bundle):
    return onnx.load(str(bundle / "prefill.trt.onnx"), load_external_data=False)


def sih(m):
    return next(n for n in m.graph.node if n.op_type in ("ZeroEdgeSIH", "ZeroEdgeSIHChunk"))


def findings(m, tmp_path, name="seeded.onnx"):
    """In-process (the CLI path is covered by the other tests): (rc the CLI would give, findings)."""
    from zeroedge.preflight import check_path

    onnx.save(m, str(tmp_path / name))
    fs, _ = check_path(tmp_path / name, "jetpack-6.2")
    fs = [f.to_dict() for f in fs]
    return (1 if any(f["severity"] == "error" for f in fs) else 0), fs


def test_clean_bundle_passes(bundle):
    p = run_cli("check", bundle, "--target", "jetpack-6.2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK: 2 graph(s)" in p.stdout and "ERROR" not in p.stdout


def test_portable_file_is_rejected_for_functions(bundle):
    p = run_cli("check", bundle / "prefill.portable.onnx")
    assert p.returncode == 1
    assert "model.functions present" in p.stdout and "plugin_namespace" in p.stdout


def _set_attr(node, attr):
    keep = [a for a in node.attribute if a.name != attr.name]
    del node.attribute[:]
    node.attribute.extend(keep + [attr])


SEEDS = {
    "opset": lambda m: [o for o in m.opset_import if o.domain == ""][0].__setattr__("version", 22),
    "ops": lambda m: m.graph.node.append(helper.make_node("Unique", ["tokens"], ["u"], name="seed_unique")),
    "unknown_plugin": lambda m: sih(m).__setattr__("op_type", "ZeroEdgeFoo"),
    "namespace": lambda m: _set_attr(sih(m), helper.make_attribute("plugin_namespace", "other")),
    "required_field": lambda m: _set_attr(sih(m), helper.make_attribute("threshold", 0.5)) or
    sih(m).attribute.remove(next(a for a in sih(m).attribute if a.name == "threshold")),
    "ints_attr": lambda m: _set_attr(sih(m), helper.make_attribute("block_size", [1, 2])),
    "int32_range": lambda m: _set_attr(sih(m), helper.make_attribute("min_tokens", 2**40)),
    "int64": lambda m: m.graph.initializer.append(
        numpy_helper.from_array(np.array([2**40, 1], np.int64), "seed_big_int64")),
    "profiles": lambda m: m.graph.input[0].type.tensor_type.ClearField("shape"),
    "dangling_input": lambda m: m.graph.node[3].input.__setitem__(0, "renamed_by_mistake"),
    "dangling_output": lambda m: m.graph.output[0].__setattr__("name", "no_such_tensor"),
}
EXPECT = {"opset": ("opset", "outside"), "ops": ("ops", "Unique"), "unknown_plugin": ("plugins", "no creator"),
          "namespace": ("plugins", "plugin_namespace"), "required_field": ("plugins", "required field threshold"),
          "ints_attr": ("attrs", "INTS"), "int32_range": ("attrs", "does not fit int32"),
          "int64": ("int64", "outside the int32 range"), "profiles": ("profiles", "no rank"),
          "dangling_input": ("graph", "'renamed_by_mistake'"), "dangling_output": ("graph", "produced by no node")}


@pytest.mark.parametrize("kind", sorted(SEEDS))
def test_seeded_problem_found(bundle, tmp_path, kind):
    m = trt(bundle)
    SEEDS[kind](m)
    rc, fs = findings(m, tmp_path)
    errs = [f for f in fs if f["severity"] == "error"]
    rule, text = EXPECT[kind]
    hit = [f for f in errs if f["rule"] == rule and text in f["message"]]
    assert rc == 1 and hit, (kind, errs)
    assert all(f["node"] and f["fix"] for f in hit)
    # and nothing else is flagged: each seed is found on its own
    assert {f["rule"] for f in errs} == {rule}, errs


def test_targets(bundle):
    p = run_cli("check", bundle, "--target", "jetpack-7")
    assert p.returncode == 2 and "known targets: jetpack-6.2, jetpack-6.1" in p.stderr
    p = run_cli("check", bundle, "--target", "jetpack-6.0")
    assert p.returncode == 2 and "TensorRT 8.6" in p.stderr
    p = run_cli("check", bundle.parent / "nope")
    assert p.returncode == 2 and "Traceback" not in p.stderr
