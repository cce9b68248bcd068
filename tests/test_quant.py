"""Weight-only quantization (zeroedge.quant, export.awq, the artifact's weights section, calibrate /
eval --weights): onnxruntime's MatMulNBits numerics bit for bit, scale folding an identity of the fp
model, AWQ never worse than RTN on its own sample, bad input one line and exit 2."""
import json

import numpy as np
import pytest
import torch

from conftest import run_cli

SMALL = ["--seq-len", "256", "--continuation", "64", "--train-seqs", "2", "--gate-seqs", "1",
         "--tokens", "4000"]


def _ort_matmulnbits(B: np.ndarray, bits: int, group: int, symmetric: bool):
    """Quantize MatMul weight B [K, N] with onnxruntime's own tool; run the MatMulNBits node on the
    identity: its output is the weight it computes with. Also the bytes of its initializers."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    K, N = B.shape
    g = helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["Y"])], "g",
                          [helper.make_tensor_value_info("A", TensorProto.FLOAT, [K, K])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [K, N])],
                          [numpy_helper.from_array(B, "B")])
    q = MatMulNBitsQuantizer(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), bits=bits,
                             block_size=group, is_symmetric=symmetric)
    q.process()
    m = q.model.model
    assert [n.op_type for n in m.graph.node] == ["MatMulNBits"]
    nbytes = sum(numpy_helper.to_array(t).nbytes for t in m.graph.initializer)
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"A": np.eye(K, dtype=np.float32)})[0], nbytes


def _weight(K, N, seed):
    rng = np.random.default_rng(seed)
    B = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    B[:, 1] = np.abs(B[:, 1])            # a column with no negative value (asymmetric: lo clamps to 0)
    B[:, 2] = -np.abs(B[:, 2])
    B[:, 3] = 0                          # scale 0
    B[:5, 4] = [0.5, -0.5, 0.25, 1e-8, -0.3]   # an outlier block, a tie in magnitude
    return B


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_dequantized_weights_equal_onnxruntime_matmulnbits(bits, group, symmetric):
    from zeroedge.quant.groupwise import Scheme, fake_quantize

    K, N = 200, 24                       # K not a multiple of the group: the last block is padded
    B = _weight(K, N, seed=bits * 1000 + group + symmetric)
    ref, nbytes = _ort_matmulnbits(B, bits, group, symmetric)
    sch = Scheme(bits, group, symmetric)
    mine = fake_quantize(torch.from_numpy(B.T.copy()), sch).T.numpy()
    assert np.array_equal(mine, ref), float(np.abs(mine - ref).max())
    assert not np.array_equal(mine, B)   # it did quantize
    assert sch.nbytes(K, N) == nbytes    # the bytes counted are the bytes onnxruntime stores


def test_on_real_weights_rounding_matches_onnxruntime(smollm2):
    """SmolLM2's weights sit on a Q4_1 grid: many values land on exact halves, where roundf (away
    from zero) and torch.round (to even) differ; onnxruntime rounds like C's roundf."""
    from zeroedge.quant.groupwise import Scheme, fake_quantize, roundf

    assert roundf(torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997])).tolist() == [1, 2, 3, -1, -3, 0]
    w = smollm2[0].layers[3].mlp.down_proj.weight.data[:64]          # [64, 1536]
    for bits, group, sym in ((4, 32, False), (4, 128, True), (8, 128, False)):
        ref, _ = _ort_matmulnbits(w.T.contiguous().numpy(), bits, group, sym)
        assert np.array_equal(fake_quantize(w, Scheme(bits, group, sym)).T.numpy(), ref), (bits, group, sym)


def _ort_float_zero_point(q, s, z, K: int):
    """A one-node MatMulNBits (4-bit) with float32 zero points (the op's zero_points of type T) run on
    the identity: the weight [K, N] onnxruntime computes with."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    N, kb, g = q.shape
    q = q.numpy()
    blob = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    node = helper.make_node("MatMulNBits", ["A", "B", "S", "Z"], ["Y"], domain="com.microsoft", K=K, N=N,
                            bits=4, block_size=g)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [K, K])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [K, N])],
                              [numpy_helper.from_array(blob, "B"),
                               numpy_helper.from_array(s.numpy().reshape(-1), "S"),
                               numpy_helper.from_array(z.numpy().reshape(-1), "Z")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"A": np.eye(K, dtype=np.float32)})[0]


@pytest.mark.parametrize("group", [32, 128])
def test_float_zero_point_equals_onnxruntime_matmulnbits(group):
    """The float zero point's dequantization is onnxruntime's for zero_points of type float, bit for
    bit (fl(q * s) - fl(s * z)); the textbook (q - z) * s is not (so the test can tell)."""
    from zeroedge.quant.groupwise import Scheme, dequantize_float, fake_quantize, quantize_float

    K, N = 200, 24                       # a short last block: its padding is not in its min / max
    B = _weight(K, N, seed=7 + group)
    B[:, 5] = 0.125                      # a constant column: constant blocks
    w = torch.from_numpy(B.T.copy())
    sch = Scheme(4, group, zero_point="float")
    q, s, z, m = quantize_float(w, sch)
    assert torch.equal(s, s.half().float()) and torch.equal(m, m.half().float())     # fp16 values
    assert int(q.max()) == 15 and int(q.min()) == 0
    ref = _ort_float_zero_point(q, s, z, q.shape[1] * group)[:K]
    mine = fake_quantize(w, sch)
    assert np.array_equal(mine.T.numpy(), ref), float(np.abs(mine.T.numpy() - ref).max())
    textbook = ((q.float() - z[..., None]) * s[..., None]).reshape(N, -1)[:, :K]
    assert not torch.equal(textbook, mine)
    assert torch.equal(dequantize_float(q, s, z, K), mine)
    assert torch.equal(mine[5], torch.full((K,), 0.125))        # a constant block is kept exactly
    blocks_min = torch.stack([w[:, i:i + group].amin(1) for i in range(0, K, group)], 1)
    assert torch.equal(m, blocks_min.half().float())            # the padding is not the minimum
    err = (mine - w).abs().max()
    assert 0 < err <= float(s.max()) / 2 + float((m - blocks_min).abs().max()) + 1e-6
    assert Scheme(4, group, zero_point="float").nbytes(K, N) == N * q.shape[1] * (group // 2 + 8)


def test_float_zero_point_recovers_a_q4_1_weight():
    """A weight born on a Q4_1 grid (w = fl(fl(d * q) + m), d and m fp16, the block's min at q = 0 and
    max at q = 15, as llama.cpp quantizes): the float zero point finds its q, d and m exactly, and
    onnxruntime's fl(q * d) - fl(d * z) gives w back bit for bit in every block where a float32 z has
    fl(d * z) = -m (most of them; the others are off by about an ulp of m, not a grid step); the
    integer zero point does not come close."""
    from zeroedge.quant.groupwise import Scheme, fake_quantize, quantize_float

    g = torch.Generator().manual_seed(3)
    N, K = 64, 256
    q = torch.randint(0, 16, (N, K // 32, 32), generator=g)
    q[..., 0], q[..., 7] = 0, 15
    d = (torch.rand(N, K // 32, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = -(torch.rand(N, K // 32, 1, generator=g) * 0.2 + 0.01).half().float()
    w = (d * q.float() + m).reshape(N, K)
    sch = Scheme(4, 32, zero_point="float")
    qq, s, z, mm = quantize_float(w, sch)
    assert torch.equal(qq.long(), q) and torch.equal(s, d[..., 0]) and torch.equal(mm, m[..., 0])
    exact = (s * z == -mm)                                          # [N, blocks]
    assert 0.5 < float(exact.float().mean()) < 1.0                  # both kinds of block occur here
    mine = fake_quantize(w, sch)
    assert np.array_equal(_ort_float_zero_point(qq, s, z, K), mine.T.numpy())
    same = (mine == w).reshape(N, -1, 32)
    assert bool(same[exact].all())
    ulp = torch.finfo(torch.float32).eps * m.abs().max()
    assert 0 < float((mine - w).abs().max()) <= 4 * float(ulp)
    assert float((fake_quantize(w, Scheme(4, 32)) - w).abs().max()) > 1e4 * float(ulp)


def test_scheme_refuses_a_float_zero_point_on_a_symmetric_grid():
    from zeroedge.quant.groupwise import Scheme, quantize

    with pytest.raises(ValueError, match="asymmetric"):
        Scheme(4, 32, True, zero_point="float")
    with pytest.raises(ValueError, match="zero point"):
        Scheme(4, 32, zero_point="half")
    with pytest.raises(ValueError, match="quantize_float"):
        quantize(torch.zeros(4, 32), Scheme(4, 32, zero_point="float"))


def _tiny(seed=0):
    from zeroedge.model import build

    return build("tiny", seed=seed)


def _random_scales(m, seed):
    g = torch.Generator().manual_seed(seed)
    hd = m.cfg.head_dim
    sizes = {"qkv": m.cfg.dim, "o": m.cfg.n_kv_heads * hd, "gate_up": m.cfg.dim, "down": m.cfg.ffn_dim}
    return {i: {k: torch.rand(n, generator=g) * 3 + 0.2 for k, n in sizes.items()} for i in range(m.cfg.n_layers)}


def test_folding_scales_leaves_the_fp_model_unchanged():
    from zeroedge.quant.apply import fold_scales

    m = _tiny()
    ids = torch.randint(0, m.cfg.vocab_size, (1, 40))
    with torch.no_grad():
        before = m(ids)
        w_before = m.layers[1].mlp.down_proj.weight.clone()
        fold_scales(m, _random_scales(m, 1))
        after = m(ids)
    assert not torch.equal(w_before, m.layers[1].mlp.down_proj.weight)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def _section(**kw):
    from zeroedge import calib_artifact

    args = dict(bits=4, group=32, symmetric=False, method="rtn", embedding_group=32)
    args.update(kw)
    return calib_artifact.weights_section(calib_artifact.weights_meta(**args))


def test_apply_folds_then_quantizes_what_the_exporter_quantizes():
    """apply_artifact(quantize=False) (the export's call) then the MatMulNBits numerics on the folded
    weights give exactly the weights apply_artifact(quantize=True) leaves in the model."""
    from zeroedge import calib_artifact
    from zeroedge.quant.apply import LINEARS, apply_artifact
    from zeroedge.quant.groupwise import Scheme, fake_quantize

    src = _tiny()
    scales = _random_scales(src, 2)
    tensors = {f"layers.{i}.awq.{k}": t for i, d in scales.items() for k, t in d.items()}
    meta = {"model": {"name": "tiny", "config": src.cfg.to_dict()}, "sih": {}, "layers": [],
            "weights": calib_artifact.weights_meta(4, 32, True, "awq", 32)}
    folded, quant = _tiny(), _tiny()
    assert apply_artifact(folded, meta, tensors, quantize=False).method == "awq"
    apply_artifact(quant, meta, tensors)
    sch = Scheme(4, 32, True)
    for name in LINEARS:
        a, b = folded.layers[2].get_submodule(name).weight, quant.layers[2].get_submodule(name).weight
        assert torch.equal(fake_quantize(a, sch), b), name
    e = quant.embed_tokens.weight
    assert quant.lm_head.weight is e and torch.equal(e, fake_quantize(src.embed_tokens.weight, Scheme(8, 32, True)))
    with pytest.raises(ValueError, match="already applied"):
        apply_artifact(quant, meta, tensors)


def test_awq_search_is_never_worse_than_rtn_on_its_sample():
    from zeroedge.export.awq import AwqConfig, search
    from zeroedge.quant.groupwise import Scheme

    m = _tiny(3)
    # make a few input channels loud, as real activations are: AWQ's case
    with torch.no_grad():
        for b in m.layers:
            b.input_layernorm.weight[:4] *= 20
            b.post_attention_layernorm.weight[:4] *= 20
    lists = [torch.randint(0, m.cfg.vocab_size, (3000,)).tolist()]
    scales, alphas, rep = search(m, lists, Scheme(4, 32, True), AwqConfig(seq_len=128, seqs=3, sample=256,
                                                                          grid=10, log=lambda s: None))
    assert len(alphas) == m.cfg.n_layers and all(len(a) == 4 for a in alphas)
    assert rep["mean_error_vs_rtn"] <= 1.0
    assert any(a > 0 for row in alphas for a in row)          # the search did choose a scale somewhere
    assert all(bool((t > 0).all()) for d in scales.values() for t in d.values())
    assert scales[0]["o"].shape == (m.cfg.n_kv_heads * m.cfg.head_dim,)


def test_weights_section_bad_input_is_a_user_error():
    from zeroedge import calib_artifact
    from zeroedge.errors import UserError

    good = calib_artifact.weights_meta(4, 128, False, "awq", None)
    for patch, msg in [({"bits": 3}, "unsupported"), ({"group": 100}, "unsupported"), ({"method": "gptq"}, "method"),
                       ({"symmetric": "yes"}, "true or false"), ({"version": 9}, "re-run"),
                       ({"embedding": {"bits": 2, "group": 32}}, "embedding"),
                       ({"embedding": {"bits": 4, "group": 48}}, "embedding"),
                       ({"zero_point": "half"}, "zero_point"), ({"zero_point": "float", "symmetric": True}, "zero_point"),
                       ({"zero_point": "float", "bits": 8}, "zero_point")]:
        with pytest.raises(UserError, match=msg):
            calib_artifact.weights_section({**good, **patch})
    assert calib_artifact.weights_section({**good, "zero_point": "float"}).zero_point == "float"
    assert "float-zp" in calib_artifact.weights_section({**good, "zero_point": "float"}).describe()
    e4 = calib_artifact.weights_section(calib_artifact.weights_meta(4, 128, False, "awq", 32, embedding_bits=4))
    assert e4.embedding_bits == 4 and "embedding int4" in e4.describe()
    sec = calib_artifact.weights_section(good)
    assert sec.zero_point == "int"                              # an older artifact: the integer zero point
    cfg = _tiny().cfg.to_dict()
    scales = {f"layers.{i}.awq.{k}": t for i, d in _random_scales(_tiny(), 0).items() for k, t in d.items()}
    assert len(sec.awq_scales(scales, cfg)) == cfg["n_layers"]
    for name, bad, msg in [("layers.1.awq.o", None, "missing"), ("layers.1.awq.o", torch.ones(3), "shape"),
                           ("layers.2.awq.down", -torch.ones(cfg["ffn_dim"]), "> 0")]:
        t = dict(scales)
        if bad is None:
            del t[name]
        else:
            t[name] = bad
        with pytest.raises(UserError, match=msg):
            sec.awq_scales(t, cfg)


def test_weight_bytes_count_the_stored_layout():
    from zeroedge.model import PRESETS
    from zeroedge.quant.apply import weight_bytes

    cfg = PRESETS["smollm2-135m"]
    fp16 = weight_bytes(cfg)
    q = weight_bytes(cfg, _section(bits=4, group=32, symmetric=False, embedding_group=64))
    assert fp16["total"] == 2 * (134_515_008)                   # SmolLM2-135M's parameters, tied head
    assert q["linear"] < fp16["linear"] / 3 and q["embedding"] < fp16["embedding"] * 0.55
    assert q["total"] < 120 * 10 ** 6                            # the 4-bit bundle bound, for the weights
    e4 = weight_bytes(cfg, _section(bits=4, group=32, symmetric=False, embedding_group=64, embedding_bits=4))
    assert e4["linear"] == q["linear"] and 0.45 < e4["embedding"] / q["embedding"] < 0.6   # codes halved, scales kept


def test_calibrate_weights_then_eval_contract(tiny_hf, text_file, tmp_path):
    art = tmp_path / "w.calib"
    p = run_cli("calibrate", tiny_hf, "--text", text_file, "--weights", "int4", "--group", "32", "--method", "awq",
                "--weights-only", "-o", art, "--json", *SMALL, check_rc=0)
    w = json.loads(p.stdout.strip().splitlines()[-1])["weights"]
    assert w["heldout_ppl"] > 0 and w["bytes"] < w["bytes_fp16"]
    meta = json.loads((art / "calib.json").read_text())
    assert meta["weights"]["method"] == "awq" and meta["weights"]["bits"] == 4 and not meta["layers"]
    assert len(meta["weights"]["awq"]["alpha"]) == 4           # tiny has 4 layers
    r = json.loads(run_cli("eval", tiny_hf, "--calib", art, "--text", text_file, "--ctx", "1200", "--json",
                           check_rc=0).stdout)
    assert {"dense_ppl", "weights_ppl", "weights_ppl_rise", "weight_bytes"} <= set(r) and "zero_ppl" not in r
    assert r["weights_ppl"] != r["dense_ppl"] and r["weights_ppl_rise"] == pytest.approx(
        r["weights_ppl"] / r["dense_ppl"] - 1)
    text = run_cli("eval", tiny_hf, "--calib", art, "--text", text_file, "--ctx", "1200", check_rc=0).stdout
    assert "int4 g32 asym AWQ" in text and "quantized" in text and " MiB" in text


def test_int4_embedding_serves_on_torch_and_export_refuses_it(tiny_hf, text_file, tmp_path):
    """`calibrate --embedding int4`: the artifact says so, eval serves it (another perplexity than
    int8's on the same weights), and export refuses it in one line (its graphs have an 8-bit embedding only)."""
    rises = {}
    for emb in ("int8", "int4"):
        art = tmp_path / f"{emb}.calib"
        run_cli("calibrate", tiny_hf, "--text", text_file, "--weights", "int4", "--group", "32", "--method", "rtn",
                "--embedding", emb, "--weights-only", "-o", art, *SMALL, check_rc=0)
        meta = json.loads((art / "calib.json").read_text())
        assert meta["weights"]["embedding"]["bits"] == int(emb[3:])
        r = json.loads(run_cli("eval", tiny_hf, "--calib", art, "--text", text_file, "--ctx", "1200", "--json",
                               check_rc=0).stdout)
        rises[emb] = r["weights_ppl_rise"]
    assert abs(rises["int4"] - rises["int8"]) > 1e-4          # the served embedding is the int4 one
    p = run_cli("export", tiny_hf, "--calib", art, "--weights", "int4", "-o", tmp_path / "b")
    assert p.returncode == 2 and "--embedding int8" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "b").exists()


def test_calibrate_weights_and_sih_in_one_artifact(tiny_hf, text_file, tmp_path):
    """Item 4: SIH/PAD is calibrated on the quantized model; eval measures it there."""
    art = tmp_path / "ws.calib"
    p = run_cli("calibrate", tiny_hf, "--text", text_file, "--weights", "int8", "--method", "rtn", "--budget", "5%",
                "-o", art, *SMALL, check_rc=0)
    assert "weights int8 g128 asym RTN" in p.stdout and "on the quantized model" in p.stdout
    meta = json.loads((art / "calib.json").read_text())
    assert meta["weights"]["bits"] == 8 and any(lm["skip"] for lm in meta["layers"])
    # the SIH gate measured the quantized model: its dense perplexity is the weights' held-out one
    assert meta["quality"]["dense_ppl"] == pytest.approx(meta["weights"]["quality"]["heldout_ppl"], rel=1e-6)
    r = json.loads(run_cli("eval", tiny_hf, "--calib", art, "--text", text_file, "--ctx", "1200", "--json",
                           check_rc=0).stdout)
    assert {"dense_ppl", "weights_ppl", "zero_ppl", "ffn_flops_skipped"} <= set(r)
    assert r["ppl_rise"] == pytest.approx(r["zero_ppl"] / r["weights_ppl"] - 1)


def test_weights_options_bad_input_one_line_exit_2(tiny_hf, text_file, tmp_path):
    out = tmp_path / "x.calib"
    for args, msg in [(["--group", "32"], "only apply with --weights"),
                      (["--weights-only"], "only apply with --weights"),
                      (["--weights", "int3"], "int3"),
                      (["--weights", "int4", "--group", "48"], "48"),
                      (["--zero-point", "float"], "only apply with --weights"),
                      (["--weights", "int4", "--symmetric", "--zero-point", "float"], "asymmetric int4"),
                      (["--weights", "int8", "--zero-point", "float"], "asymmetric int4")]:
        p = run_cli("calibrate", tiny_hf, "--text", text_file, "-o", out, *args)
        assert p.returncode == 2 and msg in p.stderr, (args, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
        assert not out.exists()
