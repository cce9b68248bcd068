"""4-bit bundles (`zeroedge export --weights int4`, export.quantize_graph): MatMulNBits in the portable
graphs, blocked INT4 DequantizeLinear in the TensorRT ones, the same weights in both; onnxruntime
runs them; the real TensorRT-RTX builder builds them (plugins included); check / plan / CLI errors.

Tiny preset (random weights) for the structure, one SmolLM2 test for the logits error and greedy
tokens against the fp16 bundle."""
import json

import numpy as np
import pytest

from conftest import run_cli

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

SCHEMES = {"asym32": {"group": 32}, "sym16": {"group": 16, "symmetric": True},
           "float32": {"group": 32, "zero_point": "float"}}


@pytest.fixture(scope="module")
def b4(tmp_path_factory):
    from zeroedge.export.bundle_writer import export_bundle

    d = tmp_path_factory.mktemp("b4")
    export_bundle("tiny", d / "fp32", window=32, weights="float32")
    export_bundle("tiny", d / "fp16", window=32)
    for name, kw in SCHEMES.items():
        export_bundle("tiny", d / name, window=32, weights="int4", **kw)
    return d


def _graph(path):
    return onnx.load(str(path), load_external_data=False).graph


def _const_matmuls(g):
    inits = {t.name for t in g.initializer}
    cast_from_init = {n.output[0] for n in g.node if n.op_type == "Cast" and n.input[0] in inits}
    return [n.name for n in g.node if n.op_type == "MatMul" and (n.input[1] in inits or n.input[1] in cast_from_init)]


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_every_linear_layer_is_4bit_in_both_flavours(b4, name):
    from zeroedge import bundle

    mf = bundle.verify(b4 / name)
    q = mf["weights"]["quantization"]
    kw = SCHEMES[name]
    assert (q["bits"], q["group"], q["symmetric"], q["method"]) == (4, kw["group"], kw.get("symmetric", False), "rtn")
    assert q["zero_point"] == kw.get("zero_point", "int")
    L = mf["model"]["n_layers"]
    for graph in ("prefill", "decode"):
        p = _graph(b4 / name / f"{graph}.portable.onnx")
        bits = lambda n: next(a.i for a in n.attribute if a.name == "bits")
        nb = [n for n in p.node if n.op_type == "MatMulNBits" and bits(n) == 4]
        assert 5 * L == q["nodes"][graph]          # q / k / v exported as one product (grouped per kv head)
        # gate / up read one input: fused into one node + Split (fuse_sibling_linears)
        assert len(nb) == 4 * L and sum(n.op_type == "Split" and n.name.endswith("_fused_Split") for n in p.node) == L
        assert all(n.domain == "com.microsoft" for n in nb)
        seen = {i.name for i in p.input} | {t.name for t in p.initializer} | {""}
        for n in p.node:                        # still in topological order after export.ort_fusions
            assert all(i in seen for i in n.input), n.name
            seen.update(n.output)
        # no float linear layer left (the offset products of a float zero point are [K, K/g] / [K/g, N])
        assert [n for n in _const_matmuls(p) if not n.endswith(("_BlockSum", "_Offset"))] == []
        int_zp = not kw.get("symmetric") and kw.get("zero_point", "int") == "int"
        assert all(len(n.input) == (4 if int_zp else 3) for n in nb)       # float zp: an offset product
        assert sum(n.name.endswith("_Offset") for n in p.node) == (4 * L if kw.get("zero_point") == "float" else 0)
        # the tied embedding / LM head: one uint8 table read by an 8-bit MatMulNBits and a GatherBlockQuantized
        head = [n for n in p.node if n.op_type == "MatMulNBits" and bits(n) == 8]
        gbq = [n for n in p.node if n.op_type == "GatherBlockQuantized"]
        assert len(head) == len(gbq) == 1 and not [n for n in p.node if n.op_type in ("Gather", "Gemm")
                                                   and "embed" in "".join(n.input)]
        t = _graph(b4 / name / f"{graph}.trt.onnx")
        assert not any(n.domain == "com.microsoft" for n in t.node)
        inits = {i.name: i for i in t.initializer}
        dq8 = [n for n in t.node if n.op_type == "DequantizeLinear" and inits[n.input[0]].data_type == onnx.TensorProto.INT8]
        assert len(dq8) == 1                               # the embedding table, once for Gather and Gemm
        dq = [n for n in t.node if n.op_type == "DequantizeLinear" and n not in dq8]
        assert len(dq) == 4 * L
        for n in dq:
            assert inits[n.input[0]].data_type == onnx.TensorProto.INT4    # signed: TensorRT has no UINT4
            assert len(n.input) == 2                                         # no zero point (TensorRT refuses one)
            at = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            assert at == {"axis": 1, "block_size": kw["group"]}
        ops = {o.domain or "ai.onnx": o.version for o in onnx.load(str(b4 / name / f"{graph}.trt.onnx"),
                                                                     load_external_data=False).opset_import}
        assert ops["ai.onnx"] == 21
    assert q["quantized_params"] == L * (3 * 64 * 128 + 64 * 64 * 2 + 2 * 64 * 32)


def _logits(bundle, flavour, tokens, steps=3):
    from zeroedge.backends.onnxruntime import OrtRunner

    with OrtRunner(bundle, slots=32, flavour=flavour) as r:
        out = [r.prefill(tokens)]
        for _ in range(steps):
            out.append(r.step(int(np.argmax(out[-1]))))
    return np.stack(out)


def _parts(g, node) -> list:
    """Output widths of the linear layers a 4-bit node holds side by side (fused siblings: the sizes
    of the Split after it), else [N]."""
    from onnx import helper, numpy_helper

    split = next((n for n in g.node if n.op_type == "Split" and n.name == node.name[:-3] + "_Split"), None)
    if split is None:
        return [next(helper.get_attribute_value(a) for a in node.attribute if a.name == "N")]
    sizes = next(t for t in g.initializer if t.name == split.input[1])
    return [int(x) for x in numpy_helper.to_array(sizes)]


def _dequantized_reference(model, bundle):
    """The torch model with each linear weight replaced by MatMulNBits' own dequantization (unpacked
    here from the portable prefill graph's blobs, scales and zero points)."""
    from onnx import helper, numpy_helper

    g = onnx.load(str(bundle / "prefill.portable.onnx")).graph
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    cast = {n.output[0]: n.input[0] for n in g.node if n.op_type == "Cast"}
    val = lambda name: inits[cast.get(name, name)].astype(np.float32) if cast.get(name, name) in inits else None
    ws = []
    emb = None
    for n in g.node:
        if n.op_type == "GatherBlockQuantized":                 # int8 embedding: (u - 128) * s by groups of D
            at = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            u8 = inits[n.input[0]].astype(np.float32)
            emb = (u8 - 128) * np.repeat(val(n.input[2]), at["block_size"], 1)
        if n.op_type != "MatMulNBits" or next(a.i for a in n.attribute if a.name == "bits") != 4:
            continue
        at = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        K, N, bs = at["K"], at["N"], at["block_size"]
        blob = inits[n.input[1]].reshape(N, -1)
        u = np.stack([blob & 15, blob >> 4], -1).reshape(N, -1)[:, :K].astype(np.float32)
        s = val(n.input[2]).reshape(N, -1)
        if len(n.input) > 3 and inits.get(n.input[3]) is not None and inits[n.input[3]].dtype == np.uint8:
            zp = inits[n.input[3]].reshape(N, -1)
            z = np.stack([zp & 15, zp >> 4], -1).reshape(N, -1)[:, :s.shape[1]].astype(np.float32)
        else:
            z = np.full_like(s, 8.0)
        w = (u - np.repeat(z, bs, 1)[:, :K]) * np.repeat(s, bs, 1)[:, :K]                 # W [out, in]
        off = val(n.name + "_zp_offset") if cast.get(n.name + "_zp_offset", n.name + "_zp_offset") in inits else None
        if off is not None:                                     # float zero point: + s * (8 - z) per block
            w = w + np.repeat(off.T, bs, 1)[:, :K]
        if n.input[1].startswith("qkv_w"):                     # q / k / v grouped per kv head (export.onnx_export)
            c = model.cfg
            kv = w.reshape(c.n_kv_heads, c.n_heads // c.n_kv_heads + 2, c.head_dim, K)
            ws += [(None, kv[:, :-2].reshape(-1, K)), (None, kv[:, -2].reshape(-1, K)), (None, kv[:, -1].reshape(-1, K))]
            continue
        for i, part in enumerate(np.split(w, np.cumsum(_parts(g, n))[:-1], 0)):
            ws.append((n.name if i == 0 else None, part))
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert len(ws) == 7 * len(model.layers) and emb is not None
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.from_numpy(emb))     # tied: the LM head too
    it = iter(ws)                                         # the graph holds them layer by layer in this order
    with torch.no_grad():
        for blk in model.layers:
            for n in names:
                node, w = next(it)
                assert node is None or f"/{n.split('.')[-1]}" in node, (node, n)
                blk.get_submodule(n).weight.copy_(torch.from_numpy(w))
    return model


def _exact_head(bundle):
    """Copies of the portable graphs as flavour "exact": the 8-bit LM head without accuracy_level 4."""
    for graph in ("prefill", "decode"):
        m = onnx.load(str(bundle / f"{graph}.portable.onnx"), load_external_data=False)
        for n in m.graph.node:
            if n.op_type == "MatMulNBits" and next(a.i for a in n.attribute if a.name == "bits") == 8:
                keep = [a for a in n.attribute if a.name != "accuracy_level"]
                del n.attribute[:]
                n.attribute.extend(keep)
        onnx.save(m, str(bundle / f"{graph}.exact.onnx"))


def test_float_zero_point_reproduces_a_q4_1_block_exactly():
    """GGUF Q4_1: w = d * q + m per block of 32 along K (llama.cpp puts the block's min at q = 0 and
    its max at q = 15); the float-zero-point grid gives back exactly those values, onnxruntime's
    integer zero point does not."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    from zeroedge.export.quantize_graph import minmax_float_zp

    rng = np.random.default_rng(1)
    K, N, g = 96, 8, 32
    q = rng.integers(0, 16, size=(N, K // g, g))
    q[..., 0], q[..., 1] = 0, 15
    d = rng.uniform(0.01, 0.05, size=(N, K // g, 1)).astype(np.float16).astype(np.float32)   # Q4_1: fp16 d, m
    m = rng.uniform(-0.4, -0.1, size=(N, K // g, 1)).astype(np.float16).astype(np.float32)
    w = (d * q + m).reshape(N, K).T.astype(np.float32)                          # [K, N]

    def deq(blob, s, z):
        u = np.stack([blob & 15, blob >> 4], -1).reshape(N, -1).astype(np.float32)
        return ((u - np.repeat(z, g, 1)) * np.repeat(s, g, 1)).T

    blob, s, z = minmax_float_zp(w, g)
    assert np.abs(deq(blob, s, z) - w).max() <= 1e-6
    cfg = mnq.DefaultWeightOnlyQuantConfig(block_size=g, is_symmetric=False)
    blob, s, zp = mnq.DefaultWeightOnlyQuantizer(cfg).qbits_block_quant(w)
    zi = np.stack([zp & 15, zp >> 4], -1).reshape(N, -1)[:, :K // g].astype(np.float32)
    assert np.abs(deq(blob.reshape(N, K // g, -1), s.reshape(N, -1), zi) - w).max() > 1e-3


def test_portable_and_trt_graphs_compute_the_same_4bit_weights(b4):
    """The TensorRT graph (run by onnxruntime: it reads INT4 / INT8 DequantizeLinear) and MatMulNBits
    give the same logits, both asymmetric (offset product) and symmetric, once the LM head's int8
    activations (accuracy_level 4, portable only) are taken out; with them, a small error."""
    tokens = np.arange(3, 15)
    for name in SCHEMES:
        _exact_head(b4 / name)
        p, t = _logits(b4 / name, "exact", tokens), _logits(b4 / name, "trt", tokens)
        assert np.abs(p - t).max() <= 1e-4 * np.abs(p).max(), name
        a4 = _logits(b4 / name, "portable", tokens)
        assert 0 < np.abs(a4 - t).max() <= 0.03 * np.abs(t).max(), name


@pytest.mark.parametrize("name", ["asym32", "float32"])
def test_4bit_logits_match_the_dequantized_model_and_differ_from_fp32(b4, name):
    from zeroedge.model import build

    tokens = torch.arange(3, 15)[None]
    fp = _logits(b4 / "fp32", "portable", tokens.numpy())
    _exact_head(b4 / name)
    q = _logits(b4 / name, "exact", tokens.numpy())
    m = _dequantized_reference(build("tiny", seed=0).float().eval(), b4 / name)
    with torch.no_grad():
        ref = m(tokens)[0, -1].numpy()
    scale = np.abs(ref).max()
    assert np.abs(q[0] - ref).max() <= 2e-3 * scale           # fp16-stored scales: ~1e-3 relative
    err = np.abs(q[0] - fp[0]).max() / np.abs(fp[0]).max()
    assert 1e-4 < err < 0.5, err                               # really 4-bit, still the same model


def test_float_zero_point_bundle_is_what_eval_fake_quantizes(b4):
    """The float-zero-point bundle holds zeroedge.quant's codes and scales (quantize_float: the ones
    `zeroedge eval` fake-quantizes with), the scales losslessly in fp16 (they are fp16 values), and
    its logits are those of the torch model quantized by zeroedge.quant.apply (float zero point,
    int8 embedding), up to the fp16-stored offsets."""
    from onnx import helper, numpy_helper

    from zeroedge.model import build
    from zeroedge.quant import apply as qa
    from zeroedge.quant.groupwise import Scheme, quantize_float

    mf = json.loads((b4 / "float32" / "manifest.json").read_text())["weights"]["quantization"]
    sch = Scheme(4, mf["group"], zero_point="float")
    model = build("tiny", seed=0).float().eval()
    g = onnx.load(str(b4 / "float32" / "prefill.portable.onnx")).graph
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    cast = {n.output[0]: n.input[0] for n in g.node if n.op_type == "Cast"}
    nodes = [n for n in g.node if n.op_type == "MatMulNBits" and helper.get_attribute_value(n.attribute[
        [a.name for a in n.attribute].index("bits")]) == 4]
    it = iter([blk.get_submodule(name).weight.data for blk in model.layers for name in qa.LINEARS])
    weights = []
    for n in nodes:
        if n.input[1].startswith("qkv_w"):                 # q / k / v grouped per kv head (export.onnx_export)
            c = model.cfg
            qkv = [next(it).reshape(c.n_kv_heads, -1, c.head_dim, c.dim) for _ in range(3)]
            weights.append(torch.cat(qkv, 1).reshape(-1, c.dim))
        else:
            weights.append(torch.cat([next(it) for _ in _parts(g, n)]))          # fused siblings side by side
    assert next(it, None) is None
    for n, w in zip(nodes, weights):
        q, s, z, m = quantize_float(w, sch)
        N = w.shape[0]
        blob = inits[n.input[1]].reshape(N, -1)
        u = np.stack([blob & 15, blob >> 4], -1).reshape(N, -1)
        assert np.array_equal(u, q.numpy().reshape(N, -1)), n.name
        stored = inits[cast.get(n.input[2], n.input[2])]
        assert np.array_equal(stored.astype(np.float32).reshape(N, -1), s.numpy()), n.name
    _exact_head(b4 / "float32")
    tokens = torch.arange(3, 15)[None]
    got = _logits(b4 / "float32", "exact", tokens.numpy())[0]
    with torch.no_grad():
        qa.quantize_linears(model, sch)
        qa.quantize_embedding(model, mf["embedding"]["group"])
        ref = model(tokens)[0, -1].numpy()
        fp = build("tiny", seed=0).float().eval()(tokens)[0, -1].numpy()
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() <= 2e-3 * scale
    assert np.abs(fp - ref).max() > 10 * np.abs(got - ref).max()    # the match is not the fp model's


def test_trt_graphs_build_with_tensorrt_rtx(rtx, plugin_lib, b4):
    from zeroedge.backends.tensorrt import EngineFromOnnx

    for name in SCHEMES:
        for graph in ("prefill", "decode"):
            st = EngineFromOnnx(b4 / name / f"{graph}.trt.onnx", plugin_lib, max_tokens=64, window=32,
                                cc="8.6", log=lambda s: None)
            blob = st()
            assert st.parser_errors == [] and len(blob) > 0, (name, graph)


def test_sih_pad_prefill_4bit_builds_with_its_plugins(rtx, plugin_lib, tmp_path):
    """A SIH/PAD artifact: the prefill graph carries zeroedge plugins and 4-bit layers together."""
    from artifacts import sih_artifact
    from zeroedge.backends.tensorrt import EngineFromOnnx
    from zeroedge.export.bundle_writer import export_bundle

    sih_artifact(tmp_path / "c", "tiny", thr={0: 0.5, 1: 0.5, 2: 0.5, 3: 0.5}, block={2: 8})
    export_bundle("tiny", tmp_path / "b", calib=tmp_path / "c", window=32, weights="int4")
    g = _graph(tmp_path / "b" / "prefill.trt.onnx")
    plugins = [n for n in g.node if n.domain == "zeroedge"]
    assert plugins and sum(n.op_type == "DequantizeLinear" for n in g.node) > 0
    st = EngineFromOnnx(tmp_path / "b" / "prefill.trt.onnx", plugin_lib, max_tokens=64, window=32, cc="8.6",
                        log=lambda s: None)
    assert len(st()) > 0 and st.parser_errors == [] and st.plugin_layers == len(plugins)
    r = _logits(tmp_path / "b", "portable", np.arange(40) % 200 + 3, steps=1)
    assert np.isfinite(r).all()


def test_check_passes_and_plan_counts_the_stored_bytes(b4):
    p = run_cli("check", b4 / "asym32", check_rc=0)
    assert "0 error(s)" in p.stdout
    plans = {n: json.loads(run_cli("plan", b4 / n, "--board", "orin-nano-8gb", "--ctx", "256", "--json",
                                   check_rc=0).stdout) for n in ("asym32", "fp16")}
    mf = json.loads((b4 / "asym32" / "manifest.json").read_text())
    w, q = mf["weights"], mf["weights"]["quantization"]
    V, D = mf["model"]["vocab_size"], mf["model"]["dim"]
    e = q["embedding"]
    rest = w["params"] - q["quantized_params"] - e["params"]
    assert e["params"] == V * D and 0 < e["bytes"]["portable"] <= V * D * 1.1     # one int8 table (+ scales)
    # device: TensorRT's stored bytes + the rest at fp16, two engines
    assert plans["asym32"]["memory"]["weights"] == 2 * (q["bytes"]["trt"] + e["bytes"]["trt"] + rest * 2)
    assert plans["asym32"]["memory"]["weights"] < plans["fp16"]["memory"]["weights"]
    assert q["bytes"]["trt"] < q["quantized_params"] * 2 * 0.45          # < 0.45x the fp16 bytes
    host = json.loads(run_cli("plan", b4 / "asym32", "--board", "orin-nano-8gb", "--ctx", "256", "--json",
                              "--onnxruntime-process", check_rc=0).stdout)
    assert host["memory"]["weights"] == 2 * (q["bytes"]["portable"] + e["bytes"]["portable"] + rest * 2)
    assert plans["asym32"]["roofline"]["decode_tok_s"] > plans["fp16"]["roofline"]["decode_tok_s"]


@pytest.mark.parametrize("args,msg", [
    (["--weights", "int4", "--group", "48"], "--group must be"),
    (["--group", "32"], "apply to --weights int4 only"),
    (["--weights", "fp16", "--symmetric"], "apply to --weights int4 only"),
])
def test_bad_int4_options_are_one_line_exit_2(tmp_path, args, msg):
    p = run_cli("export", "tiny", "-o", tmp_path / "b", *args)
    assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()


def test_smollm2_4bit_bundle_logits_and_greedy_tokens(smollm2, tmp_path):
    """Real weights: the 4-bit (asym g32 RTN) bundle against the model itself (fp32, torch) on one short
    prompt: the logits' relative error and how many of 16 greedy tokens agree (teacher-forced on the
    model's)."""
    import torch

    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.export.bundle_writer import TracedGraphs, export_bundle

    m, folder = smollm2
    traced = TracedGraphs()             # the second export writes the graphs the first one traced
    export_bundle(str(folder), tmp_path / "int4", window=64, weights="int4", traced=traced)
    mf_f = export_bundle(str(folder), tmp_path / "float", window=64, weights="int4", zero_point="float", traced=traced)
    assert "torch_export_s" in mf_f["export"] and traced.take((str(folder), False)) is None
    mf = json.loads((tmp_path / "int4" / "manifest.json").read_text())
    size = sum(f["bytes"] for f in mf["files"].values())
    tokens = np.array([504, 2114, 15988, 282, 1978, 253, 6121, 1025, 30, 1387, 314, 253])
    seq = tokens.tolist()
    with torch.no_grad():                   # the model's greedy tokens, and its logits before each
        for _ in range(16):
            seq.append(int(m(torch.tensor([seq]))[0, -1].argmax()))
        ref = m(torch.tensor([seq[:-1]]))[0, len(tokens) - 1:].float().numpy()
    runs = {"model": (ref, seq[len(tokens):])}
    for name in ("int4", "float"):
        with OrtRunner(tmp_path / name, slots=64) as r:
            out = [r.prefill(tokens)]
            ids = [int(np.argmax(out[-1]))]
            for _ in range(15):
                out.append(r.step(runs["model"][1][len(ids) - 1]))         # teacher-forced
                ids.append(int(np.argmax(out[-1])))
            runs[name] = (np.stack(out), ids)
    a, b = runs["model"][0], runs["int4"][0]
    rel = float(np.abs(a - b).max() / np.abs(a).max())
    agree = sum(x == y for x, y in zip(runs["model"][1], runs["int4"][1]))
    top5 = sum(int(np.argmax(x)) in np.argsort(y)[-5:] for x, y in zip(a, b))
    print(f"SmolLM2 int4 vs the model: max rel logits error {rel:.4f}, greedy agreement {agree}/16, the model's token "
          f"in int4's top 5 {top5}/16, bundle {size / 1e6:.1f} MB, quantized bytes "
          f"{mf['weights']['quantization']['bytes']} + embedding {mf['weights']['quantization']['embedding']['bytes']}")
    # measured against the fp16 bundle when written: rel 0.34, agreement 14/16, top-5 16/16 (RTN from the
    # Q4_1-dequantized weights: MatMulNBits' integer zero point cannot hold Q4_1's float minimum, ~8 %
    # error per matrix)
    assert 1e-3 < rel < 0.6, rel
    assert agree >= 12 and top5 >= 15, (agree, top5, runs["model"][1], runs["int4"][1])
    q = mf["weights"]["quantization"]
    assert q["bytes"]["portable"] + q["embedding"]["bytes"]["portable"] < 120e6      # what onnxruntime reads
    # the float zero point reproduces the Q4_1 weights SmolLM2 ships as: left, the int8 embedding / LM
    # head (and its int8 activations) and fp16-stored scales / zero points
    c = runs["float"][0]
    rel_f = float(np.abs(a - c).max() / np.abs(a).max())
    agree_f = sum(x == y for x, y in zip(runs["model"][1], runs["float"][1]))
    print(f"float zero point vs the model: max rel logits error {rel_f:.4f}, greedy agreement {agree_f}/16")
    assert rel_f < rel / 3 and agree_f >= agree, (rel_f, rel, agree_f, agree)


def test_single_flavour_bundles_hold_only_what_their_runtime_reads(b4, tmp_path):
    """`export --graphs portable` / `--graphs trt`: only that flavour's graphs, a smaller weights.bin
    than the two-flavour bundle, the same logits in onnxruntime as the two-flavour bundle's portable
    graphs; `zeroedge build` refuses the portable-only bundle in one line, the onnxruntime runner the
    TensorRT-only one; plan counts the one flavour's bytes."""
    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.bundle import verify

    for fl in ("portable", "trt"):
        run_cli("export", "tiny", "-o", tmp_path / fl, "--window", "32", "--weights", "int4", "--group", "32",
                "--graphs", fl, check_rc=0)
        mf = json.loads((tmp_path / fl / "manifest.json").read_text())
        assert sorted(mf["graph_files"]) == [f"decode.{fl}.onnx", f"prefill.{fl}.onnx"]
        assert set(mf["weights"]["quantization"]["bytes"]) == {fl}
        verify(tmp_path / fl)
        both = (b4 / "asym32" / "weights.bin").stat().st_size
        assert (tmp_path / fl / "weights.bin").stat().st_size < both
    ids = np.arange(1, 20, dtype=np.int64)
    a, b = OrtRunner(tmp_path / "portable"), OrtRunner(b4 / "asym32")
    assert np.allclose(a.prefill(ids)[0], b.prefill(ids)[0], atol=1e-5)
    p = run_cli("build", tmp_path / "portable", "-o", tmp_path / "eng")
    assert p.returncode == 2 and "no *.trt.onnx" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("run", "--backend", "onnxruntime", "--bundle", tmp_path / "trt", "--prompt", "hi")
    assert p.returncode == 2 and "no prefill.portable.onnx" in p.stderr and "Traceback" not in p.stderr
    plan = json.loads(run_cli("plan", tmp_path / "portable", "--board", "orin-nano-8gb", "--ctx", "256", "--json",
                              check_rc=0).stdout)
    host = json.loads(run_cli("plan", b4 / "asym32", "--board", "orin-nano-8gb", "--ctx", "256", "--json",
                              "--onnxruntime-process", check_rc=0).stdout)
    assert plan["memory"]["weights"] == host["memory"]["weights"]
    p = run_cli("export", "tiny", "-o", tmp_path / "x", "--graphs", "onnx")
    assert p.returncode == 2 and not (tmp_path / "x").exists()


def test_fuse_sibling_linears_is_exact_and_leaves_shared_weights():
    """Three linears on one input become one MatMul + Split with the same outputs; a weight that a
    second node also reads, and a lone linear, are left as they are."""
    from onnx import TensorProto, helper, numpy_helper

    from zeroedge.export.quantize_graph import fuse_sibling_linears, linear_matmuls

    rng = np.random.default_rng(0)
    w = {n: rng.standard_normal(s).astype(np.float32) for n, s in
         (("wq", (8, 6)), ("wk", (8, 4)), ("wv", (8, 4)), ("ws", (8, 8)), ("wo", (6, 8)))}
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="q"),
             helper.make_node("MatMul", ["x", "wk"], ["k"], name="k"),
             helper.make_node("MatMul", ["x", "wv"], ["v"], name="v"),
             helper.make_node("MatMul", ["y", "ws"], ["s1"], name="s1"),     # ws shared: not fused
             helper.make_node("MatMul", ["y", "ws"], ["s2"], name="s2"),
             helper.make_node("MatMul", ["q", "wo"], ["o"], name="o")]       # alone on its input
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, d]) for n, d in
            (("k", 4), ("v", 4), ("s1", 8), ("s2", 8), ("o", 8))]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 8]) for n in "xy"],
                          outs, [numpy_helper.from_array(a, n) for n, a in w.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    feed = {"x": rng.standard_normal((2, 8)).astype(np.float32), "y": rng.standard_normal((2, 8)).astype(np.float32)}
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    names = fuse_sibling_linears(model, linear_matmuls(model))
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMul") == 4 and ops.count("Split") == 1 and sorted(names) == ["o", "q_fused", "s1", "s2"]
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
