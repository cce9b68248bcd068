"""Export: graphs, rewrite, portable/TensorRT flavours, bundle, portable runner parity.

Tiny preset for most checks (random weights, fast); one SmolLM2 parity test at a short length."""
import json
import shutil

import numpy as np
import pytest

from artifacts import sih_artifact
from conftest import run_cli

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def reference_zero(model, meta, tensors):
    """Install the same mechanisms on the torch reference (same heads, anchors, thresholds)."""
    from zeroedge.mechanisms import pad
    from zeroedge.mechanisms.anchors import Anchor
    from zeroedge.mechanisms.sih import SIHHead

    for li, heads in (meta.get("pruned_heads") or {}).items():
        model.layers[int(li)].self_attn.prune_heads(heads)
    pol = {}
    for L in meta["layers"]:
        if not L["skip"]:
            continue
        i = L["index"]
        pol[i] = pad.LayerPolicy(scorer="sih", threshold=L["threshold"],
                                 sih=SIHHead.from_state(tensors, f"layers.{i}.sih"),
                                 anchor=Anchor.from_state(tensors, f"layers.{i}.anchor"),
                                 block_size=L["block_size"], block_frac=L["block_frac"])
    rt = pad.ZeroRuntime(active=True)
    pad.install(model, pol, rt)
    return rt


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def torch_greedy_logits(model, tokens, steps):
    """Reference logits: prefill `tokens`, then greedy steps with the static cache."""
    with torch.no_grad():
        model.setup_cache(1, tokens.shape[1] + steps + 1)
        lg = model(tokens)[0, -1]
        out, pos, nxt = [lg], tokens.shape[1], int(lg.argmax())
        for _ in range(steps):
            lg = model(torch.tensor([[nxt]]), start=pos)[0, -1]
            out.append(lg)
            pos += 1
            nxt = int(lg.argmax())
        model.drop_cache()
    return [o.numpy() for o in out]


def ort_greedy_logits(runner, tokens, steps):
    lg = runner.prefill(tokens.numpy())
    out = [lg]
    for _ in range(steps):
        lg = runner.step(int(lg.argmax()))
        out.append(lg)
    return out


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory):
    out = tmp_path_factory.mktemp("b") / "tiny_dense"
    from zeroedge.export.bundle_writer import export_bundle

    export_bundle("tiny", out, window=64, weights="float32")  # parity: the graph math, to 1e-4 (V window fp16)
    return out


@pytest.fixture(scope="module")
def tiny_zero(tmp_path_factory):
    d = tmp_path_factory.mktemp("z")
    # thresholds near the median score of each layer's head, a block rule on layer 2, pruned heads
    meta, t = sih_artifact(d / "calib", "tiny", thr={0: 0.5, 1: 0.5, 2: 0.5, 3: 0.5}, block={2: 8},
                         prune={"1": [0, 3], "3": [2]})
    from zeroedge.export.bundle_writer import export_bundle

    export_bundle("tiny", d / "bundle", calib=d / "calib", window=64, weights="float32")
    return d / "bundle", meta, t


def test_dense_parity_prefill_and_decode(tiny_dense):
    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.model import build

    m = build("tiny", seed=0)
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = torch_greedy_logits(m, tokens, 6)
    with OrtRunner(tiny_dense, slots=64) as r:
        got = ort_greedy_logits(r, tokens, 6)
    errs = [rel_err(g, e) for g, e in zip(got, ref)]
    assert max(errs) <= 1e-4, errs


def test_bound_decode_follows_reset_and_keeps_returned_logits(tiny_dense):
    """The decode step's IOBinding is made for the arrays it binds: a runner reset to another window
    size decodes like a new one, and logits a step returned stay as they were after the next step."""
    from zeroedge.backends.onnxruntime import OrtRunner

    tokens = np.random.default_rng(3).integers(0, 256, 30)
    r = OrtRunner(tiny_dense, slots=64)
    r.prefill(tokens[:20])
    first = r.step(int(tokens[20]))
    kept = first.copy()
    r.step(int(tokens[21]))
    assert np.array_equal(first, kept)
    r.slots = 40
    r.reset()
    r.prefill(tokens[:25])
    got = [r.step(int(t)) for t in tokens[25:]]
    fresh = OrtRunner(tiny_dense, slots=40)
    fresh.prefill(tokens[:25])
    want = [fresh.step(int(t)) for t in tokens[25:]]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert r.last_mass.shape == (40,)


def test_a_decode_graph_unlike_its_manifest_is_refused_in_one_line(tiny_dense, tmp_path):
    """The decode step binds outputs of the shapes the manifest implies: a graph whose new keys are
    not [1, kv heads, 1, head dim] for that manifest is a UserError naming the output, before any
    run, not onnxruntime's error about a buffer."""
    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.errors import UserError

    b = tmp_path / "b"
    shutil.copytree(tiny_dense, b)
    mf = json.loads((b / "manifest.json").read_text())
    mf["model"]["n_kv_heads"] += 1
    (b / "manifest.json").write_text(json.dumps(mf))
    r = OrtRunner(b, slots=64, verify=False)
    with pytest.raises(UserError, match="output new_k.0 has shape"):
        r.step(3)


def test_decode_slots_in_any_order(tiny_dense):
    """Post-RoPE keys: a permuted window with holes gives the same logits."""
    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.model import build

    m = build("tiny", seed=0)
    tokens = torch.randint(0, 256, (1, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = m(tokens)[0, -1].numpy()
    r = OrtRunner(tiny_dense, slots=64)
    r.prefill(tokens[:, :20].numpy())
    perm = np.random.default_rng(0).permutation(64)[:20]
    for i in range(r.L):
        k, v = r.k[i][:, :, :20].copy(), r.v[i][:, :, :20].copy()
        r.k[i][:] = 7.0                     # garbage in empty slots must not leak in
        r.v[i][:] = 7.0
        r.k[i][:, :, perm], r.v[i][:, :, perm] = k, v
    r.slot_pos[:] = -1
    r.slot_pos[0, perm] = np.arange(20)
    got = r.step(int(tokens[0, 20]))
    assert rel_err(got, ref) <= 1e-4
    mass = r.last_mass
    assert mass.shape == (64,) and mass[perm].sum() > 0.5 and np.allclose(np.delete(mass, perm), 0)


def test_zero_parity_same_masks(tiny_zero):
    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.model import build

    bundle, meta, t = tiny_zero
    m = build("tiny", seed=0)
    rt = reference_zero(m, meta, t)
    tokens = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(3))
    ref = torch_greedy_logits(m, tokens, 4)
    st = rt.stats
    skipped = sum(s[1] - s[0] for s in st.values())
    assert skipped > 0, "the test must exercise skipping"          # mechanisms really on
    with OrtRunner(bundle, slots=64) as r:
        got = ort_greedy_logits(r, tokens, 4)
    errs = [rel_err(g, e) for g, e in zip(got, ref)]
    assert max(errs) <= 1e-4, errs
    # and the result differs from dense: the mechanisms did something
    dense = torch_greedy_logits(build("tiny", seed=0), tokens, 0)[0]
    assert rel_err(got[0], dense) > 1e-3


def test_portable_and_trt_flavours(tiny_zero):
    from zeroedge import plugin_spec as spec

    bundle = tiny_zero[0]
    p = onnx.load(str(bundle / "prefill.portable.onnx"), load_external_data=False)
    t = onnx.load(str(bundle / "prefill.trt.onnx"), load_external_data=False)
    assert p.ir_version >= 9 and {f.name for f in p.functions} == set(spec.NODES) - {"ZeroEdgePathsFFN", "ZeroEdgeSIH"}
    assert any(o.domain == "zeroedge" for o in p.opset_import)
    assert len(t.functions) == 0 and any(o.domain == "zeroedge" for o in t.opset_import)
    custom = [n for n in t.graph.node if n.domain == "zeroedge"]
    assert len(custom) == 3 * 4
    for n in custom:
        a = {x.name: x for x in n.attribute}
        assert a["plugin_namespace"].s == b"zeroedge" and a["plugin_version"].s == b"1"
        assert set(spec.field_names(n.op_type)) <= set(a)
        for x in n.attribute:
            assert x.type in (onnx.AttributeProto.INT, onnx.AttributeProto.FLOAT, onnx.AttributeProto.STRING)
            if x.type == onnx.AttributeProto.INT:
                assert -2**31 <= x.i < 2**31
    # one shared weight file
    mf = json.loads((bundle / "manifest.json").read_text())
    assert {"weights.bin", "prefill.trt.onnx", "decode.portable.onnx"} <= set(mf["files"])
    assert mf["plugin_abi"] == spec.PLUGIN_ABI and mf["calibration"]["skip_layers"] == [0, 1, 2, 3]


def test_tampered_and_partial_bundle_refused(tiny_dense, tmp_path):
    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.errors import UserError

    b = tmp_path / "b"
    shutil.copytree(tiny_dense, b)
    with open(b / "weights.bin", "r+b") as f:
        f.seek(100)
        f.write(b"\x01\x02")
    with pytest.raises(UserError, match="modified weights.bin"):
        OrtRunner(b)
    shutil.rmtree(b)
    shutil.copytree(tiny_dense, b)
    (b / "decode.portable.onnx").unlink()
    with pytest.raises(UserError, match="missing decode.portable.onnx"):
        OrtRunner(b)
    # a consistent bundle whose decode graph is not zeroedge's (its window input renamed): one line, no traceback
    shutil.rmtree(b)
    shutil.copytree(tiny_dense, b)
    g = onnx.load(str(b / "decode.portable.onnx"), load_external_data=False)
    for x in [*g.graph.input, *g.graph.node]:
        if getattr(x, "name", None) == "past_v.0":
            x.name = "other"
        if hasattr(x, "input"):
            x.input[:] = ["other" if i == "past_v.0" else i for i in x.input]
    onnx.save(g, str(b / "decode.portable.onnx"))
    with pytest.raises(UserError, match="takes no float input past_v.0"):
        OrtRunner(b, verify=False)


def test_export_cli_and_bad_inputs(tmp_path):
    p = run_cli("export", "tiny", "-o", tmp_path / "b", "--json", check_rc=0)
    s = json.loads(p.stdout)
    assert s["files"] >= 5 and "prefill.portable.onnx" in s["graphs"]
    # non-empty output without --force
    p = run_cli("export", "tiny", "-o", tmp_path / "b")
    assert p.returncode == 2 and "not empty" in p.stderr
    # artifact for another model
    sih_artifact(tmp_path / "c", "smollm2-135m", rank=2)
    p = run_cli("export", "tiny", "--calib", tmp_path / "c", "-o", tmp_path / "b2")
    assert p.returncode == 2 and "calibrated for" in p.stderr and not (tmp_path / "b2").exists()


def test_no_pattern_graph_reports_and_writes_nothing(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((8, 8), np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 8])], [w])
    onnx.save(helper.make_model(g), str(tmp_path / "plain.onnx"))
    p = run_cli("export", tmp_path / "plain.onnx", "-o", tmp_path / "out")
    assert p.returncode == 2, p.stderr
    assert "no RMSNorm -> MLP pattern" in p.stderr and "1 MatMul/Gemm with constant weights" in p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_fp16_weights_halve_the_bundle(tiny_dense, tmp_path):
    """The default export stores the weights as float16 (a Cast back to float32 in the graph): half the
    weights.bin of the float32 bundle, the same parameter count for the planner, logits within fp16
    rounding of the float32 bundle's (and not identical: the weights did change), and a TensorRT
    flavour that still passes the pre-flight."""
    from zeroedge import bundle as bundle_mod
    from zeroedge.backends.onnxruntime import OrtRunner

    p = run_cli("export", "tiny", "-o", tmp_path / "h", "--window", "64", "--json", check_rc=0)
    assert json.loads(p.stdout)["weights"]["dtype"] == "float16"
    half, full = bundle_mod.verify(tmp_path / "h"), bundle_mod.verify(tiny_dense)
    assert half["weights"]["params"] == full["weights"]["params"] > 0
    assert half["files"]["weights.bin"]["bytes"] <= 0.55 * full["files"]["weights.bin"]["bytes"]
    tokens = np.arange(3, 43) % 256
    with OrtRunner(tmp_path / "h", slots=64) as a, OrtRunner(tiny_dense, slots=64) as b:
        la, lb = a.prefill(tokens), b.prefill(tokens)
        err = rel_err(la, lb)
        assert 0 < err <= 2e-3, err
        assert rel_err(a.step(7), b.step(7)) <= 2e-3
    assert run_cli("check", tmp_path / "h").returncode == 0
    plans = [json.loads(run_cli("plan", b, "--board", "orin-nano-8gb", "--ctx", "256", "--json",
                                check_rc=0).stdout) for b in (tmp_path / "h", tiny_dense)]
    assert plans[0]["memory"]["weights"] == plans[1]["memory"]["weights"]


def test_smollm2_parity_short(smollm2, tmp_path):
    """Real weights: dense export of SmolLM2, onnxruntime vs the PyTorch reference."""
    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.export.bundle_writer import export_bundle

    m, folder = smollm2
    export_bundle(str(folder), tmp_path / "b", window=64, weights="float32")
    tokens = torch.randint(0, m.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    ref = torch_greedy_logits(m, tokens, 2)
    with OrtRunner(tmp_path / "b", slots=64) as r:
        got = ort_greedy_logits(r, tokens, 2)
    errs = [rel_err(g, e) for g, e in zip(got, ref)]
    assert max(errs) <= 1e-4, errs
    assert (tmp_path / "b" / "tokenizer.json").is_file()
