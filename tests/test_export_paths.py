"""Export of decode paths: a magnitude "paths" artifact puts one ZeroEdgePathsFFN node per
sparse layer into the decode graphs (portable: resolved through the ONNX function; trt: the plugin
node, in fp16 between two Casts since the plugin takes fp16 / bf16 only), onnxruntime decodes like
the torch reference, predictor paths are refused, and an artifact without paths exports as before.
Tiny preset (random weights), one shared bundle: fast (~13 s)."""
import json

import numpy as np
import pytest

from conftest import run_cli

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from artifacts import PATHS, SIH_SKIP, sih_artifact, with_paths  # noqa: E402
from test_export import rel_err  # noqa: E402





@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    from zeroedge.export.bundle_writer import export_bundle

    d = tmp_path_factory.mktemp("paths")
    meta, t = sih_artifact(d / "c0", "tiny", skip=SIH_SKIP)
    with_paths(d / "calib", meta, t)
    export_bundle("tiny", d / "bundle", calib=d / "calib", window=64, weights="float32")  # parity
    return d / "bundle"


def _load(bundle, name):
    return onnx.load(str(bundle / name), load_external_data=False)


def _arrays(bundle, name):
    """name -> numpy value of every initializer of a bundle graph (weights read from weights.bin)."""
    from onnx import numpy_helper

    return {i.name: numpy_helper.to_array(i) for i in onnx.load(str(bundle / name)).graph.initializer}


def _ffn_weights(layer):
    """The tiny model's [W_gate^T, W_up^T, W_down^T] of a layer (the [in, out] layout of the graphs)."""
    from zeroedge.model import build

    mlp = build("tiny", seed=0).layers[layer].mlp
    return [lin.weight.detach().numpy().T for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]


def _holding(arrays, w):
    """Names of the non-zeroedge initializers equal to one of the arrays in w."""
    return [n for n, a in arrays.items() if not n.startswith("zeroedge/")
            and any(a.shape == x.shape and np.array_equal(a, x) for x in w)]


def test_decode_graph_has_one_paths_node_per_sparse_layer(tiny_paths):
    from zeroedge import plugin_spec as spec

    for flavour in ("portable", "trt"):
        m = _load(tiny_paths, f"decode.{flavour}.onnx")
        nodes = [n for n in m.graph.node if n.domain == spec.DOMAIN]
        assert [n.op_type for n in nodes] == ["ZeroEdgePathsFFN"] * len(PATHS), flavour
        by_layer = {int(n.name.split("/")[1][len("layer"):]): n for n in nodes}
        assert set(by_layer) == set(PATHS)
        inits = {i.name: (list(i.dims), i.data_type) for i in m.graph.initializer}
        producer = {o: n for n in m.graph.node for o in n.output}
        consumers = {}
        for x in m.graph.node:
            for t in x.input:
                consumers.setdefault(t, []).append(x)
        # portable: fp32 like the rest of the graph; trt: the plugin takes fp16 / bf16 only, so
        # x and y are cast around it and its weights are stored in fp16
        dt = onnx.TensorProto.FLOAT if flavour == "portable" else onnx.TensorProto.FLOAT16
        for i, n in by_layer.items():
            a = {x.name: x for x in n.attribute}
            assert a["threshold_in"].type == onnx.AttributeProto.FLOAT
            assert a["threshold_in"].f == pytest.approx(PATHS[i][0], rel=1e-7)
            assert a["threshold"].f == pytest.approx(PATHS[i][1], rel=1e-7)
            assert inits[n.input[1]] == ([64, 256], dt) and inits[n.input[2]] == ([128, 64], dt)
            x_src, y_dst = producer[n.input[0]], consumers[n.output[0]]
            if flavour == "trt":
                assert a["plugin_namespace"].s == b"zeroedge" and a["plugin_version"].s == b"1"
                assert set(a) == set(spec.field_names("ZeroEdgePathsFFN")) | {"plugin_namespace",
                                                                              "plugin_version"}
                assert x_src.op_type == "Cast" and x_src.attribute[0].i == onnx.TensorProto.FLOAT16
                assert [c.op_type for c in y_dst] == ["Cast"] and y_dst[0].attribute[0].i == onnx.TensorProto.FLOAT
                x_src, y_dst = producer[x_src.input[0]], consumers[y_dst[0].output[0]]
            # fed by the layer's normalised FFN input (flattened to [B, D]), unflattened back; the
            # portable graph's residual Add + RMSNorm are one node (export.ort_fusions)
            norm = "SkipSimplifiedLayerNormalization" if flavour == "portable" else "Mul"
            assert x_src.op_type == "Reshape" and producer[x_src.input[0]].op_type == norm
            assert "post_attention_layernorm" in x_src.input[0]
            assert [c.op_type for c in y_dst] == ["Reshape"]
        if flavour == "portable":
            assert {f.name for f in m.functions} == {"ZeroEdgePathsFFN"} and m.ir_version >= 9
        else:
            assert len(m.functions) == 0
        assert any(o.domain == spec.DOMAIN for o in m.opset_import)
        # no dense FFN left in the sparse layers: a dense decode layer has 10 MatMuls (q / k / v as one,
        # RoPE of q and k as one, three for attention, the attention mass's mean over the heads, o,
        # gate, up, down), plus the lm_head Gemm
        mm = [n for n in m.graph.node if n.op_type in ("MatMul", "Gemm")]
        assert len(mm) == 10 * 4 + 1 - 3 * len(PATHS)
        assert sum(n.op_type == "Sigmoid" for n in m.graph.node) == 4 - len(PATHS)
    # the sparse layers' W_gate / W_up / W_down initializers are gone (by content), the dense
    # layers keep theirs, and w13_t / wd_t are the transposed weights
    arrays = _arrays(tiny_paths, "decode.portable.onnx")
    trt_arrays = _arrays(tiny_paths, "decode.trt.onnx")
    pre_arrays = _arrays(tiny_paths, "prefill.portable.onnx")
    for i in range(4):
        w = _ffn_weights(i)
        w13, pre = np.concatenate(w[:2], 1), f"zeroedge/layer{i}/paths"
        if i in PATHS:
            assert _holding(arrays, w) == [] and _holding(trt_arrays, w) == [], i
            np.testing.assert_array_equal(arrays[f"{pre}.w13_t"], w13)
            np.testing.assert_array_equal(arrays[f"{pre}.wd_t"], w[2])
            np.testing.assert_array_equal(trt_arrays[f"{pre}.w13_t.float16"], w13.astype(np.float16))
            np.testing.assert_array_equal(trt_arrays[f"{pre}.wd_t.float16"], w[2].astype(np.float16))
            assert not any(k.startswith(pre) and k.endswith("_t") for k in trt_arrays)   # no fp32 copy
        else:
            assert len(_holding(arrays, w)) == 3 and len(_holding(trt_arrays, w)) == 3
            assert not any(k.startswith(pre) for k in list(arrays) + list(trt_arrays))
        assert len(_holding(pre_arrays, w)) == 3               # the prefill keeps the dense weights
    # the prefill graph is untouched by paths: SIH/PAD nodes and functions only
    pre = _load(tiny_paths, "prefill.portable.onnx")
    assert not any(n.op_type == "ZeroEdgePathsFFN" for n in pre.graph.node)
    assert {f.name for f in pre.functions} == {"ZeroEdgeSIHChunk", "ZeroEdgePADGather", "ZeroEdgePADScatter"}
    assert sum(n.op_type == "ZeroEdgeSIHChunk" for n in pre.graph.node) == len(SIH_SKIP)


def test_weights_shared_and_manifest(tiny_paths):
    """The portable wd_t is W_down^T, byte for byte the prefill's down weight: one copy in
    weights.bin. The manifest records the paths layers and thresholds; verify / check accept it."""
    from zeroedge import bundle as bundle_mod
    from zeroedge import plugin_spec as spec
    from zeroedge.preflight import check_path

    dec, pre = _load(tiny_paths, "decode.portable.onnx"), _load(tiny_paths, "prefill.portable.onnx")
    loc = lambda t: {e.key: e.value for e in t.external_data}  # noqa: E731
    pre_arrays = _arrays(tiny_paths, "prefill.portable.onnx")
    for i in PATHS:
        down = _holding(pre_arrays, _ffn_weights(i)[2:])
        assert len(down) == 1
        pre_loc = loc(next(t for t in pre.graph.initializer if t.name == down[0]))
        wd = next(t for t in dec.graph.initializer if t.name == f"zeroedge/layer{i}/paths.wd_t")
        assert loc(wd)["location"] == "weights.bin" and loc(wd)["offset"] == pre_loc["offset"]
    mf = bundle_mod.verify(tiny_paths)
    cal = mf["calibration"]
    assert cal["paths_layers"] == sorted(PATHS) and cal["skip_layers"] == SIH_SKIP
    assert cal["paths"]["kind"] == "input-magnitude" and cal["paths"]["graphs"] == ["decode"]
    assert cal["paths"]["node"] == "ZeroEdgePathsFFN"
    for i, (t_in, t) in PATHS.items():
        got = cal["paths"]["layers"][str(i)]
        assert got["threshold_in"] == pytest.approx(t_in, rel=1e-7) and got["threshold"] == pytest.approx(t, rel=1e-7)
    assert mf["export"]["paths"]["rewritten"] == sorted(PATHS) and cal["paths"]["trt_dtype"] == "float16"
    # D = 64, F = 128 are inside the plugin's shape limits (D % 8, F % 8)
    assert mf["export"]["paths"]["trt_plugin_limits"] == "ok"
    assert mf["plugin_abi"] == spec.PLUGIN_ABI
    findings, files = check_path(tiny_paths, "jetpack-6.2")
    assert files == ["decode.trt.onnx", "prefill.trt.onnx"]
    assert not [f for f in findings if f.severity == "error"], [f.line() for f in findings]


def _reference_logits(tokens, steps):
    """Torch reference: dense prefill (prompt < SIH min_tokens, so SIH keeps every token), then
    greedy decode steps with the magnitude paths installed on the same layers and thresholds."""
    from zeroedge.model import build
    from zeroedge.paths.sparse import PathPolicy, PathRuntime, bytes_summary, install, remove

    m = build("tiny", seed=0)
    pol = {i: PathPolicy(method="magnitude", threshold_in=float(np.float32(ti)), threshold=float(np.float32(t)))
           for i, (ti, t) in PATHS.items()}
    rt = install(m, pol, PathRuntime(active=False))
    try:
        with torch.no_grad():
            m.setup_cache(1, tokens.shape[1] + steps + 1)
            lg = m(tokens)[0, -1]
            out, pos, nxt = [lg], tokens.shape[1], int(lg.argmax())
            rt.active = True
            for _ in range(steps):
                lg = m(torch.tensor([[nxt]]), start=pos)[0, -1]
                out.append(lg)
                pos += 1
                nxt = int(lg.argmax())
            rt.active = False
            m.drop_cache()
        kept = bytes_summary(m, rt)["per_layer_kept"]
    finally:
        remove(m)
    return [o.numpy() for o in out], kept


def test_ort_decode_matches_torch_paths(tiny_paths):
    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.model import build
    from zeroedge.backends import plugin_reference as ref

    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(5))
    want, kept = _reference_logits(tokens, 6)
    assert set(kept) == set(PATHS) and all(0.05 < k < 0.95 for k in kept.values()), kept  # really sparse
    with OrtRunner(tiny_paths, slots=64) as r:
        got = [r.prefill(tokens.numpy())] + [None] * 6
        for s in range(1, 7):
            got[s] = r.step(int(got[s - 1].argmax()))
    errs = [rel_err(g, e) for g, e in zip(got, want)]
    assert max(errs) <= 1e-4, errs
    # and the decode steps differ from dense decoding: the paths did something
    m = build("tiny", seed=0)
    with torch.no_grad():
        m.setup_cache(1, 32)
        m(tokens)
        dense = m(torch.tensor([[int(got[0].argmax())]]), start=20)[0, -1].numpy()
        m.drop_cache()
    assert rel_err(got[1], dense) > 1e-3
    # the torch reference of the plugin node computes the same FFN as the layer's weights
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    mlp = m.layers[0].mlp
    w13_t = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).T
    y = ref.paths_ffn(x, w13_t, mlp.down_proj.weight.T, *PATHS[0])
    xm = x * (x.abs() >= PATHS[0][0])
    a = torch.nn.functional.silu(mlp.gate_proj(xm)) * mlp.up_proj(xm)
    assert torch.allclose(y, mlp.down_proj(a * (a.abs() >= PATHS[0][1])), atol=1e-5)


def test_trt_flavour_wiring_runs_through_the_reference_function(tiny_paths, tmp_path):
    """No TensorRT here: give the *.trt.onnx graphs the portable functions in place of the plugins
    and decode with onnxruntime: the fp16 Cast / weights wiring of the trt flavour decodes like
    the portable graph (up to fp16 rounding of x and the weights)."""
    import shutil

    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.export.rewrite import to_portable

    b = tmp_path / "b"
    shutil.copytree(tiny_paths, b)
    for g in ("prefill", "decode"):
        m = _load(b, f"{g}.trt.onnx")
        for n in m.graph.node:
            keep = [a for a in n.attribute if a.name not in ("plugin_namespace", "plugin_version")]
            del n.attribute[:]
            n.attribute.extend(keep)
        onnx.save(to_portable(m), str(b / f"{g}.trt.onnx"))
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(5)).numpy()
    got = {}
    for flavour, d in (("portable", tiny_paths), ("trt", b)):
        with OrtRunner(d, slots=64, flavour=flavour, verify=False) as r:
            out = [r.prefill(tokens)]
            out += [r.step(int(out[-1].argmax())) for _ in range(4)]
        got[flavour] = out
    errs = [rel_err(t, p) for t, p in zip(got["trt"], got["portable"])]
    assert errs[0] == 0 and 0 < max(errs) <= 2e-3, errs      # prefill identical; decode fp16 paths


def test_predictor_paths_refused(tmp_path):
    meta, t = sih_artifact(tmp_path / "c0", "tiny", skip=[])
    with_paths(tmp_path / "c", meta, t, paths={1: (0, 0.1), 3: (0, 0.1)}, kind="whitened-lowrank-swiglu")
    p = run_cli("export", "tiny", "--calib", tmp_path / "c", "-o", tmp_path / "b")
    assert p.returncode == 2, p.stderr
    assert "predictor paths are not exported: recalibrate with the magnitude method" in p.stderr
    assert "layers 1, 3" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.tmp").exists()


def test_bad_paths_sections_refused(tmp_path):
    from zeroedge.errors import UserError
    from zeroedge.export.rewrite import paths_from_artifact

    meta, t = sih_artifact(tmp_path / "c0", "tiny", skip=[])
    m2, t2 = with_paths(tmp_path / "c", meta, t)
    assert set(paths_from_artifact(m2, t2)) == set(PATHS)
    assert paths_from_artifact(meta, t) == {}                          # no section: nothing
    gone = {k: v for k, v in t2.items() if "threshold_act" not in k}
    with pytest.raises(UserError, match="layer 0 path thresholds missing"):
        paths_from_artifact(m2, gone)
    with pytest.raises(UserError, match="describes 3 layers"):
        paths_from_artifact(dict(m2, paths=dict(m2["paths"], layers=m2["paths"]["layers"][:3])), t2)
    none = dict(m2, paths=dict(m2["paths"], layers=[dict(L, sparse=False) for L in m2["paths"]["layers"]]))
    with pytest.raises(UserError, match="marks no layer sparse"):
        paths_from_artifact(none, t2)
    with pytest.raises(UserError, match="unknown path predictor kind"):
        paths_from_artifact(dict(m2, paths=dict(m2["paths"], predictor={"kind": "oracle"})), t2)
    nopred = dict(m2, paths={k: v for k, v in m2["paths"].items() if k != "predictor"})
    with pytest.raises(UserError, match="predictor paths are not exported"):   # the old default kind
        paths_from_artifact(nopred, t2)


def test_no_paths_section_exports_as_before(tmp_path):
    """An artifact without "paths": the decode graphs stay plain (no custom node, no function, no
    zeroedge opset, the dense decode graph's ops) and the manifest has no paths keys."""
    from collections import Counter

    from zeroedge.export.bundle_writer import export_bundle

    sih_artifact(tmp_path / "c", "tiny", skip=[0, 2])
    export_bundle("tiny", tmp_path / "z", calib=tmp_path / "c", window=32)
    export_bundle("tiny", tmp_path / "d", window=32)
    for flavour in ("portable", "trt"):
        z, d = (_load(tmp_path / b, f"decode.{flavour}.onnx") for b in ("z", "d"))
        assert not any(n.domain == "zeroedge" for n in z.graph.node) and len(z.functions) == 0
        assert not any(o.domain == "zeroedge" for o in z.opset_import) and z.ir_version == d.ir_version
        assert Counter(n.op_type for n in z.graph.node) == Counter(n.op_type for n in d.graph.node)
        assert sorted(i.name for i in z.graph.initializer) == sorted(i.name for i in d.graph.initializer)
    mf = json.loads((tmp_path / "z" / "manifest.json").read_text())
    assert "paths" not in mf["calibration"] and "paths_layers" not in mf["calibration"]
    assert "paths" not in mf["export"] and mf["calibration"]["skip_layers"] == [0, 2]


def test_foreign_graph_records_paths_not_applied(tmp_path):
    """A rewritten foreign graph has no decode graph: the manifest says the paths were not applied
    (and predictor paths are refused there too, before anything is written)."""
    from zeroedge.errors import UserError
    from zeroedge.export import onnx_export
    from zeroedge.export.bundle_writer import export_bundle
    from zeroedge.model import build

    r = onnx_export.export_graphs(build("tiny", seed=0), tmp_path / "raw")
    meta, t = sih_artifact(tmp_path / "c0", "tiny", skip=[1])
    with_paths(tmp_path / "c", meta, t)
    mf = export_bundle(str(r["prefill"]), tmp_path / "b", calib=tmp_path / "c")
    cal = mf["calibration"]
    assert cal["paths_layers"] == [] and cal["paths"]["graphs"] == [] and "not_applied" in cal["paths"]
    assert {g["graph"] for g in mf["graph_files"].values()} == {"prefill"} and "paths" not in mf["export"]
    with_paths(tmp_path / "p", meta, t, kind="whitened-lowrank-swiglu")
    with pytest.raises(UserError, match="predictor paths are not exported"):
        export_bundle(str(r["prefill"]), tmp_path / "b2", calib=tmp_path / "p")
    assert not (tmp_path / "b2").exists() and not (tmp_path / "b2.tmp").exists()


def test_serving_session_runs_the_bundle_paths(tiny_paths):
    """onnxruntime serving of a bundle exported with paths: the decode graph runs them on every
    request the release level allows, says so, and refuses the requests it cannot serve sparse."""
    from zeroedge.errors import UserError
    from zeroedge.serve.session import ServingSession, open_bundle

    s = ServingSession(open_bundle(tiny_paths, threads=1), release_level=1)
    prompt = list(range(3, 23))
    r = s.generate(prompt, 4)
    assert r.mechanisms["paths"] and r.detail["paths_layers"] == sorted(PATHS) and len(r.tokens) == 4
    assert r.tokens == ServingSession(open_bundle(tiny_paths, threads=1)).generate(prompt, 4, paths=True).tokens
    with pytest.raises(UserError, match="runs decode paths on every request"):
        s.generate(prompt, 4, paths=False)
    with pytest.raises(UserError, match="raise the release level"):
        s.decide(600, 10)                                  # L1 excludes 610 tokens


def test_served_paths_bundle_refuses_what_its_release_level_excludes(tiny_paths):
    """`zeroedge serve --bundle` plans each request with the bundle's session: a decode graph with
    paths serves only the requests its release level allows (HTTP 400 for the rest, the server
    going on), as `zeroedge run` refuses them."""
    import httpx
    from test_serve import Served

    for level, status in ((0, 400), (3, 200)):
        s = Served("--backend", "onnxruntime", "--bundle", tiny_paths, "--release-level", level)
        try:
            name = httpx.get(s.base + "/v1/models").json()["data"][0]["id"]
            r = httpx.post(s.base + "/v1/completions", json={"model": name, "prompt": list(range(3, 23)),
                                                            "max_tokens": 4, "temperature": 0}, timeout=120)
            assert r.status_code == status, r.text
            if status == 400:
                assert "raise the release level" in r.json()["error"]["message"]
            else:
                assert r.json()["usage"]["completion_tokens"] == 4
            assert httpx.get(s.base + "/health").status_code == 200
        finally:
            s.stop()
