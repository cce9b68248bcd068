"""Chunked prefill in the onnxruntime and TensorRT runners: the prefill graph takes the K/V of the tokens
before a chunk (prefix_k/v) and the runners feed a long prompt chunk by chunk. Checked: the same logits,
window K/V, heat and greedy tokens as one pass; old bundles (no prefix inputs) run one pass and say
so; the real TensorRT-RTX builder takes the chunked graph with profiles that cover every chunk; SIH/PAD bundles chunk too and skip exactly the rows one pass skips."""
import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    from zeroedge.export.bundle_writer import export_bundle
    from zeroedge.model import PRESETS, build

    out = tmp_path_factory.mktemp("chunk") / "dense"
    export_bundle(build(PRESETS["tiny"].with_(max_seq_len=1024), seed=3), out, window=48, prefill_chunk=64)
    return out


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(3, 250, n)


def test_manifest_and_graph_carry_the_chunk(dense):
    import onnxruntime as ort

    mf = json.loads((dense / "manifest.json").read_text())
    assert mf["prefill"] == {"chunk": 64, "one_pass": False}
    s = ort.InferenceSession(str(dense / "prefill.portable.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in s.get_inputs()]
    assert names[0] == "tokens" and names[1:3] == ["prefix_k.0", "prefix_v.0"] and len(names) == 1 + 2 * 4


@pytest.mark.parametrize("T,slots", [(200, 256), (300, 48)])   # all in the window; evicted by mass
def test_chunked_prefill_equals_one_pass(dense, T, slots):
    from zeroedge.backends.onnxruntime import OrtRunner

    one = OrtRunner(dense, slots=slots, chunk=10 ** 6)
    chk = OrtRunner(dense, slots=slots)                 # the manifest's 64: 4-5 chunks, a short last one
    assert chk.chunk == 64 and "chunks of 64" in chk.prefill_mode
    p = _prompt(T)
    a, b = one.prefill(p), chk.prefill(p)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    assert np.array_equal(one.slot_pos, chk.slot_pos)
    for i in range(one.L):
        np.testing.assert_allclose(chk.k[i], one.k[i], atol=1e-5)
        np.testing.assert_allclose(chk.v[i], one.v[i], atol=1e-5)
    np.testing.assert_allclose(chk.heat, one.heat, rtol=1e-5, atol=1e-6)
    # decode from either prefill, fed the same tokens (a random model's greedy text repeats one
    # token): step by step the same logits and the same argmax, which varies
    picks_a, picks_b = [], []
    for t in _prompt(16, 9):
        la, lb = one.step(t), chk.step(t)
        np.testing.assert_allclose(lb, la, rtol=1e-4, atol=1e-4)
        picks_a.append(int(la.argmax()))
        picks_b.append(int(lb.argmax()))
    assert picks_a == picks_b and len(set(picks_a)) > 1, picks_a
    assert chk.generate(p, 6) == one.generate(p, 6)     # greedy: the same tokens


def test_chunked_prefill_hands_the_policy_the_whole_prompt(dense):
    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.kv.ort_policy import OrtThermalPolicy

    p = _prompt(150, 1)
    runs = []
    for chunk in (10 ** 6, 32):
        pol = OrtThermalPolicy(page_size=8, store="fp32")
        r = OrtRunner(dense, slots=48, policy=pol, chunk=chunk)
        runs.append((r.generate(p, 8), r.slot_pos.copy(), pol.stats()["stored_pages"]))
        pol.check(r)
    assert runs[0][0] == runs[1][0] and np.array_equal(runs[0][1], runs[1][1]) and runs[0][2] == runs[1][2]


def test_old_bundle_runs_one_pass(dense, tmp_path):
    """A prefill graph from before chunked prefill (tokens only, no manifest "prefill"): loads, runs one
    pass, says so, and gives the chunked runner's results."""
    import shutil

    import onnx
    from onnx import helper

    from zeroedge import bundle as bundle_mod
    from zeroedge.backends.onnxruntime import OrtRunner

    old = tmp_path / "old"
    shutil.copytree(dense, old)
    m = onnx.load(str(old / "prefill.portable.onnx"), load_external_data=False)
    prefix = [vi for vi in m.graph.input if vi.name.startswith("prefix_")]
    for vi in prefix:                          # an empty constant in its place: the old graph's arithmetic
        m.graph.node.insert(0, helper.make_node("ConstantOfShape", [vi.name + "_shape"], [vi.name]))
        m.graph.initializer.append(helper.make_tensor(vi.name + "_shape", onnx.TensorProto.INT64, [4],
                                                      [1, 0, 2, 16]))
        m.graph.input.remove(vi)
    onnx.save(m, str(old / "prefill.portable.onnx"))
    mf = json.loads((old / "manifest.json").read_text())
    meta = {k: v for k, v in mf.items() if k not in ("files", "prefill", "format", "format_version",
                                                     "zeroedge_version")}
    bundle_mod.write_manifest(old, meta)
    r = OrtRunner(old, slots=256, chunk=32)
    assert r.chunk is None and "no prefix inputs" in r.prefill_mode
    p = _prompt(120, 2)
    np.testing.assert_allclose(r.prefill(p), OrtRunner(dense, slots=256, chunk=32).prefill(p), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def sih_bundle(tmp_path_factory):
    """A tiny model's bundle with SIH/PAD on layers 0-2 (layer 1 by the 16-token block rule), each
    threshold at a quantile of its smoothed scores on the test prompt, so a good share of rows skip."""
    import torch
    from artifacts import sih_artifact

    from zeroedge import calib_artifact
    from zeroedge.export.bundle_writer import export_bundle
    from zeroedge.mechanisms.pad import install_artifact, remove
    from zeroedge.mechanisms.sih import keep_mask, smooth
    from zeroedge.model import PRESETS, build

    tmp = tmp_path_factory.mktemp("sih")
    cfg = PRESETS["tiny"].with_(max_seq_len=1024)
    m = build(cfg, seed=3).eval()
    meta, t = sih_artifact(tmp / "c", "tiny", skip=[0, 1, 2], block={1: 16}, cfg=cfg)
    install_artifact(m, meta, t)
    seen = {}
    for i in (0, 1, 2):
        head = m.layers[i].mlp.policy.sih
        head.forward = lambda x, f=head.forward, i=i: seen.setdefault(i, f(x))
    with torch.no_grad():
        m.layers[0].mlp.rt.active = True
        m(torch.from_numpy(_prompt(SIH_T))[None])
    remove(m)
    for L in meta["layers"]:
        if L["skip"]:
            sm = smooth(seen[L["index"]])
            # the threshold at which closest to half the rows skip (whole blocks, under the block rule)
            L["threshold"] = min((float(sm.quantile(q)) for q in np.linspace(0.3, 0.95, 27)),
                                 key=lambda thr: abs(keep_mask(sm, thr, 4, 1, L["block_size"]).float().mean() - 0.5))
    calib_artifact.save(tmp / "c", meta, t)
    export_bundle(m, tmp / "zero", calib=tmp / "c", window=256, prefill_chunk=40)
    return tmp / "zero"


SIH_T = 200


def _keeps(bundle, prompt, chunk):
    """Every SIH layer's keep mask for the prompt, prefilled `chunk` tokens at a time through the
    portable prefill graph (its keep tensors added as outputs), and the last logits."""
    import onnx
    import onnxruntime as ort

    from zeroedge.backends.onnxruntime import PrefillGraph

    m = onnx.load(str(bundle / "prefill.portable.onnx"))
    keep_names = sorted({o for n in m.graph.node if n.op_type == "ZeroEdgeSIHChunk" for o in n.output[:1]})
    m.graph.output.extend(onnx.helper.make_tensor_value_info(k, onnx.TensorProto.INT32, None) for k in keep_names)
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    pg = PrefillGraph(s, [i.name for i in s.get_inputs()], 2, 16, [o.name for o in s.get_outputs()])
    T, L = len(prompt), len([i for i in s.get_inputs() if i.name.startswith("prefix_k.")])
    kv = [np.zeros((1, 0, 2, 16), np.float32) for _ in range(2 * L)]
    keeps, toks = [[] for _ in keep_names], np.asarray(prompt, np.int64)[None]
    for a in range(0, T, chunk):
        feed = {"tokens": toks[:, a:a + chunk], **{n: kv[j] for j, n in enumerate(pg.prefix)}}
        out = pg.run(None, feed, a, T)
        kv = [np.concatenate((kv[j], out[1 + j].transpose(0, 2, 1, 3)), 1) for j in range(2 * L)]
        for j, k in enumerate(out[-len(keep_names):]):
            keeps[j].append(k)
        logits = out[0]
    return [np.concatenate(k) for k in keeps], logits


@pytest.mark.parametrize("chunk", [32, 48, 64, 100])
def test_sih_bundle_chunks_skip_what_one_pass_skips(sih_bundle, chunk):
    """The exported SIH/PAD prefill graph fed in chunks that do and do not divide the prompt: the same
    keep mask on every SIH layer (token rule and block rule), the same logits; the runner chunks by
    default, rounds a chunk up to the block rule's 16 and gives the one-pass results."""
    from zeroedge.backends.onnxruntime import OrtRunner

    mf = json.loads((sih_bundle / "manifest.json").read_text())
    assert mf["prefill"] == {"chunk": 48, "one_pass": False, "multiple": 16}
    p = _prompt(SIH_T)
    rounded = -(-chunk // 16) * 16                           # chunks start on block boundaries
    one, l1 = _keeps(sih_bundle, p, SIH_T)
    got, l2 = _keeps(sih_bundle, p, rounded)
    assert len(one) == 3
    for a, b in zip(one, got):
        assert 0.15 < 1 - a.mean() < 0.85, a.mean()          # the rule really skips (and keeps) rows
        assert np.array_equal(a, b)
    np.testing.assert_allclose(l2, l1, rtol=1e-4, atol=1e-4)
    r = OrtRunner(sih_bundle, slots=256, chunk=chunk)
    assert r.chunk == rounded and (rounded == chunk or "a multiple of the SIH block rule" in r.prefill_mode)
    np.testing.assert_allclose(r.prefill(p), OrtRunner(sih_bundle, slots=256, chunk=10 ** 6).prefill(p),
                               rtol=1e-4, atol=1e-4)


def test_rank_rule_bundle_chunks_skip_what_one_pass_skips(tmp_path):
    """An artifact of rank-rule layers (rates in 32-position blocks) exported: the manifest's chunk is a
    whole number of rank blocks, the prefill graph fed in chunks keeps the rows one pass keeps, and
    each layer skips its rate of every block's skippable rows."""
    from artifacts import sih_artifact
    from zeroedge.export.bundle_writer import export_bundle
    from zeroedge.model import PRESETS, build

    cfg = PRESETS["tiny"].with_(max_seq_len=1024)
    m = build(cfg, seed=3).eval()
    rates = {0: 0.5, 2: 0.9}
    sih_artifact(tmp_path / "c", "tiny", skip=[0, 2], cfg=cfg, rate=rates, rank_block=32)
    export_bundle(m, tmp_path / "zero", calib=tmp_path / "c", window=256, prefill_chunk=40)
    mf = json.loads((tmp_path / "zero" / "manifest.json").read_text())
    assert mf["prefill"] == {"chunk": 64, "one_pass": False, "multiple": 32}
    p = _prompt(SIH_T)
    one, l1 = _keeps(tmp_path / "zero", p, SIH_T)
    got, l2 = _keeps(tmp_path / "zero", p, 64)
    free = (np.arange(SIH_T) >= 4) & (np.arange(SIH_T) < SIH_T - 1)
    for (layer, rate), a, b in zip(sorted(rates.items()), one, got):
        assert np.array_equal(a, b), layer
        for b0 in range(0, SIH_T, 32):
            n = int(free[b0:b0 + 32].sum())
            assert int((a[b0:b0 + 32] == 0).sum()) == int(np.floor(np.float32(rate) * n + np.float32(0.5)))
    np.testing.assert_allclose(l2, l1, rtol=1e-4, atol=1e-4)


def test_a_graph_whose_sih_carries_do_not_pair_up_is_refused():
    """sih_carry.i in, no sih_carry_out.i out (a hand-edited graph): a clear error when the runner
    opens it, not a wrong carry at the second chunk."""
    from zeroedge.backends.onnxruntime import PrefillGraph
    from zeroedge.errors import UserError

    ins = ["tokens", "prefix_k.0", "prefix_v.0", "sih_span", "sih_carry.0", "sih_carry.1"]
    with pytest.raises(UserError, match="2 sih_carry inputs, 1 sih_carry_out outputs"):
        PrefillGraph(object(), ins, 2, 16, ["logits", "sih_carry_out.0"])
    with pytest.raises(UserError, match="do not match"):
        PrefillGraph(object(), ins, 2, 16, ["logits", "sih_carry_out.0", "sih_carry_out.7"])
    assert PrefillGraph(object(), ins, 2, 16, ["sih_carry_out.1", "logits", "sih_carry_out.0"]).sih_out == {
        0: "sih_carry.1", 2: "sih_carry.0"}


def test_bad_chunk_is_one_line(dense):
    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.errors import UserError

    with pytest.raises(UserError, match="chunk must be >= 1"):
        OrtRunner(dense, chunk=0)


def test_tensorrt_profiles_cover_the_chunks():
    from zeroedge.backends.tensorrt import profile_shapes

    ins = [("tokens", (1, -1)), ("prefix_k.0", (1, -1, 2, 16)), ("prefix_v.0", (1, -1, 2, 16))]
    p = profile_shapes(ins, 2048, 64, chunk=512)
    assert p["tokens"] == ((1, 1), (1, 512), (1, 512))
    assert p["prefix_k.0"] == ((1, 0, 2, 16), (1, 1023, 2, 16), (1, 2047, 2, 16))
    one = profile_shapes(ins, 2048, 64, chunk=None)            # one pass: the whole prompt, empty prefix
    assert one["tokens"][2] == (1, 2048) and one["prefix_v.0"] == ((1, 0, 2, 16),) * 3
    assert profile_shapes([("tokens", (1, -1))], 100, 64, chunk=512)["tokens"][2] == (1, 100)


def test_tensorrt_rtx_builds_the_chunked_prefill(rtx, plugin_lib, dense, tmp_path):
    """The real TensorRT-RTX builder (on the CPU, for SM86) takes the chunked prefill graph with its
    prefix profiles (P from 0: an empty prefix for the first chunk), and engines.json records the
    chunk TrtRunner then feeds."""
    from zeroedge.backends.tensorrt import build_bundle_engines

    meta = build_bundle_engines(dense, plugin_lib, tmp_path / "e", max_tokens=256, cc="8.6", log=lambda s: None)
    assert meta["prefill_chunk"] == 64
    prof = meta["engines"]["prefill"]["profiles"]
    assert prof["tokens"] == [[1, 1], [1, 64], [1, 64]]
    assert prof["prefix_k.3"] == [[1, 0, 2, 16], [1, 127, 2, 16], [1, 255, 2, 16]]
    assert "prefix_k.0" not in meta["engines"]["decode"]["profiles"]
    on_disk = json.loads((tmp_path / "e" / "engines.json").read_text())
    assert on_disk["prefill_chunk"] == 64 and (tmp_path / "e" / "prefill.engine").stat().st_size > 0


def test_trt_runner_feeds_the_engine_chunks(rtx, plugin_lib, dense, tmp_path, monkeypatch):
    """TrtRunner on engines built for chunks of 64 (the real TensorRT-RTX build; they cannot run
    here): with each engine stood in for by the same graph in onnxruntime, a 200-token prompt goes
    through in chunks within the profile and gives one pass's logits and window."""
    import onnxruntime as ort

    from zeroedge.backends import tensorrt as T
    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.backends.tensorrt import runner

    eng = tmp_path / "e"
    meta = T.build_bundle_engines(dense, plugin_lib, eng, max_tokens=256, cc="8.6", log=lambda s: None)
    prof = meta["engines"]["prefill"]["profiles"]
    seen = []

    class Session:                                     # the engine's graph, run by onnxruntime
        def __init__(self, path, plugin_lib=None, output_order=None):
            g = path.name.split(".")[0]
            self.s = ort.InferenceSession(str(dense / f"{g}.trt.onnx"), providers=["CPUExecutionProvider"])
            self.inputs = [i.name for i in self.s.get_inputs()]
            self.outputs = [o.name for o in self.s.get_outputs()]
            self.buffers = {}

        def run(self, names, feed):
            if "prefix_k.0" in feed:
                seen.append((feed["tokens"].shape[1], feed["prefix_k.0"].shape[1]))
            return self.s.run(names, feed)

        def input_dtype(self, name):                   # as TrtSession's: the graph's own dtype
            kind = next(i.type for i in self.s.get_inputs() if i.name == name)
            return np.float16 if kind == "tensor(float16)" else np.float32

        def close(self):
            pass

    monkeypatch.setattr(runner, "TrtSession", Session)
    monkeypatch.setattr(runner, "check_engines", lambda bundle, engines: json.loads((engines / "engines.json").read_text()))
    p = _prompt(200, 4)
    with T.TrtRunner(dense, eng, plugin_lib, slots=48) as r:
        assert r.chunk == 64 and "engine's profile" in r.prefill_mode
        got = r.prefill(p)
        window = [k.copy() for k in r.k]
    assert seen == [(64, 0), (64, 64), (64, 128), (8, 192)]
    (tok_lo, _, tok_hi), (pre_lo, _, pre_hi) = prof["tokens"], prof["prefix_k.0"]
    assert all(tok_lo[1] <= t <= tok_hi[1] and pre_lo[1] <= q <= pre_hi[1] for t, q in seen)
    one = OrtRunner(dense, slots=48, chunk=10 ** 6)
    np.testing.assert_allclose(got, one.prefill(p), rtol=1e-5, atol=1e-5)
    for a, b in zip(window, one.k):
        np.testing.assert_allclose(a, b, atol=1e-5)
