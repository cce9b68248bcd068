"""zeroedge's onnxruntime CPU kernels (ortops/): each op in a one-node graph against a numpy
reference, a bundle exported with --cpu-kernels zeroedge against the same model's stock bundle, and
the refusals. The library is built by conftest's fixture (scripts/build_ortops, incremental) as CI
does in setup."""
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, run_cli


def _session(lib, node, inputs, outputs, inits=()):
    import onnxruntime as ort
    from onnx import helper

    g = helper.make_graph([node], "t", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("zeroedge.ort", 1)])
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib))
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _rounded_rows(x, kb, bits):
    """x [M, K] rounded as Q4Linear does: to int8 / int16 per block of 32 (step amax / 127 or / 32767),
    padded to kb blocks."""
    M, K = x.shape
    xp = np.zeros((M, kb * 32), np.float64)
    xp[:, :K] = x
    blocks = xp.reshape(M, kb, 32)
    d = np.abs(blocks).max(-1, keepdims=True) / (2.0 ** (bits - 1) - 1)
    q = np.rint(np.divide(blocks, d, out=np.zeros_like(blocks), where=d > 0))
    return (q * d).reshape(M, -1)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("M,K,N,half,act,offsets,bs", [
    (1, 576, 960, True, "", "C", 32), (3, 80, 13, True, "", "C", 32), (2, 64, 37, False, "", "C", 32),
    (1, 96, 38, True, "swiglu", "C", 32), (1, 1536, 20, True, "", "C", 32),
    (1, 576, 96, True, "", "zp", 128), (2, 200, 24, False, "", "zp", 64), (1, 80, 13, True, "", "zp", 32),
    (1, 96, 38, True, "swiglu", "none", 32), (1, 300, 40, True, "", "none", 256)])
def test_q4_linear_is_matmulnbits_product(ortops_libs, M, K, N, half, act, offsets, bs, bits):
    """Q4Linear against numpy: blocks of bs, w = d (q - 8) + c with c the float zero point's offsets
    (C), from MatMulNBits' integer zero points (zp: c = d (8 - z) in d's dtype), or 0 (none)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(K + N + bs)
    kbB, kb = -(-K // bs), -(-K // 32)
    B = rng.integers(0, 256, (N, kbB, bs // 2), dtype=np.uint8)
    dt = np.float16 if half else np.float32
    S = (rng.random(N * kbB) * 0.02 + 1e-3).astype(dt)
    inits = [numpy_helper.from_array(B, "B"), numpy_helper.from_array(S, "S")]
    if offsets == "C":
        c = (rng.standard_normal((kbB, N)) * 0.1).astype(dt)
        inits.append(numpy_helper.from_array(c, "O"))
    elif offsets == "zp":
        z = rng.integers(0, 16, (N, kbB + kbB % 2))
        inits.append(numpy_helper.from_array((z[:, 0::2] | z[:, 1::2] << 4).astype(np.uint8), "O"))
        c = (S.astype(np.float32).reshape(N, kbB) * (8 - z[:, :kbB])).astype(dt).T
    else:
        c = np.zeros((kbB, N))
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[0, :32] = 0.0                                           # an all-zero block: step 0
    x[-1, -5:] = 30.0 * (rng.random(5) - 0.5)              # and a block with an outlier
    node = helper.make_node("Q4Linear", ["x", "B", "S"] + (["O"] if offsets != "none" else []), ["y"],
                            domain="zeroedge.ort", K=K, N=N, block_size=bs,
                            **({"activation": act} if act else {}), **({"input_bits": bits} if bits != 8 else {}))
    s = _session(ortops_libs, node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    y = s.run(None, {"x": x})[0]
    # W[n, k] = S[n, b] * (q - 8) + c[b, n], codes low nibble first
    q = np.empty((N, kbB * bs), np.float64)
    q[:, 0::2], q[:, 1::2] = B.reshape(N, -1) & 15, B.reshape(N, -1) >> 4
    Wq = (np.repeat(S.astype(np.float64).reshape(N, kbB), bs, 1) * (q - 8))[:, :kb * 32]
    Wc = np.repeat(c.astype(np.float64).T, bs, 1)[:, :kb * 32]
    W = Wq + Wc
    xe = np.pad(x.astype(np.float64), ((0, 0), (0, kb * 32 - K)))
    ref = _rounded_rows(x, kb, bits) @ Wq.T + xe @ Wc.T     # x rounded for the codes, exact for the offsets
    exact = xe @ W.T
    if act == "swiglu":                                 # silu(gate) * up, gate the first N / 2 columns
        ref, exact = ((a[:, :N // 2] / (1 + np.exp(-a[:, :N // 2]))) * a[:, N // 2:] for a in (ref, exact))
    assert y.shape == ref.shape
    assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max()
    # and the rounding of x is all that separates it from the exact product: int8's, or int16's 256x finer
    assert np.abs(y - exact).max() <= (2e-2 if bits == 8 else 1e-4) * np.abs(exact).max()


@pytest.mark.parametrize("M,K,N,half", [(1, 576, 96, True), (2, 80, 13, False), (1, 1000, 40, True)])
def test_q8_linear_is_the_8bit_matmulnbits_product(ortops_libs, M, K, N, half):
    """Q8Linear (the 8-bit LM head) against numpy: w = d (q - 128) per block of 32, x rounded to int16."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(K + N)
    kb = -(-K // 32)
    B = rng.integers(0, 256, (N, kb, 32), dtype=np.uint8)
    dt = np.float16 if half else np.float32
    S = (rng.random(N * kb) * 0.02 + 1e-3).astype(dt)
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[0, :32] = 0.0
    x[-1, -3:] = 25.0
    node = helper.make_node("Q8Linear", ["x", "B", "S"], ["y"], domain="zeroedge.ort", K=K, N=N, block_size=32)
    s = _session(ortops_libs, node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                 [numpy_helper.from_array(B, "B"), numpy_helper.from_array(S, "S")])
    y = s.run(None, {"x": x})[0]
    W = (np.repeat(S.astype(np.float64).reshape(N, kb), 32, 1) * (B.reshape(N, -1).astype(np.float64) - 128))[:, :K]
    ref = _rounded_rows(x, kb, 16)[:, :K] @ W.T
    assert y.shape == (M, N)
    assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max()
    assert np.abs(y - x.astype(np.float64) @ W.T).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("op", ["Q4Linear", "Q8Linear"])
def test_tiny_and_nan_inputs_give_zero_and_nan_not_garbage(ortops_libs, op):
    """A block whose largest value is below float's range for a step (~1e-35) rounds to 0 (its
    contribution is that small anyway); a NaN in x makes the outputs NaN."""
    from onnx import TensorProto, helper, numpy_helper

    K, N = 64, 8
    rng = np.random.default_rng(0)
    B = rng.integers(0, 256, (N, 2, 16 if op == "Q4Linear" else 32), dtype=np.uint8)
    S = np.full(N * 2, 0.01, np.float16)
    node = helper.make_node(op, ["x", "B", "S"], ["y"], domain="zeroedge.ort", K=K, N=N, block_size=32,
                            **({"input_bits": 16} if op == "Q4Linear" else {}))
    s = _session(ortops_libs, node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                 [numpy_helper.from_array(B, "B"), numpy_helper.from_array(S, "S")])
    x = rng.standard_normal((1, K)).astype(np.float32)
    x[0, 32:] = np.float32(1e-38) * rng.random(32).astype(np.float32)
    y = s.run(None, {"x": x})[0]
    ref = s.run(None, {"x": np.concatenate([x[:, :32], np.zeros((1, 32), np.float32)], 1)})[0]
    assert np.isfinite(y).all() and np.array_equal(y, ref)
    x[0, 3] = np.nan
    assert np.isnan(s.run(None, {"x": x})[0]).all()


def _attention_reference(qkv, rot, pk, pv, bias, Hkv, scale):
    qkv, rot, pk, pv, bias = (a.astype(np.float64) for a in (qkv, rot, pk, pv, bias))
    B, hd = qkv.shape[0], pk.shape[-1]
    g = qkv.shape[1] // (Hkv * hd) - 2
    x = qkv.reshape(B, Hkv, g + 2, hd)
    qk = np.einsum("bhje,bed->bhjd", x[:, :, :g + 1], rot[:, 0])
    q, k, v = qk[:, :, :g], qk[:, :, g:], x[:, :, g + 1:]
    s_old = np.einsum("bhgd,bhsd->bhgs", q, pk) * scale + bias      # bias [B, 1, 1, S]
    s_new = np.einsum("bhgd,bhod->bhgo", q, k) * scale
    s = np.concatenate([s_old, s_new], -1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhgs,bhsd->bhgd", p[..., :-1], pv) + p[..., -1:] * v
    mass = p[..., :-1].reshape(B, -1, pk.shape[2]).mean(1, keepdims=True)
    return out.reshape(B, -1), k, v, mass


@pytest.mark.parametrize("B,Hkv,g,hd,S,empty", [(1, 3, 3, 64, 600, 0.3), (2, 2, 4, 20, 5, 0.0),
                                                  (1, 2, 2, 16, 40, 1.0), (1, 1, 7, 64, 257, 0.5),
                                                  (1, 2, 4, 64, 71, 0.2), (1, 1, 1, 8, 3, 0.0)])
def test_window_attention_is_softmax_over_window_and_new_token(ortops_libs, B, Hkv, g, hd, S, empty):
    from onnx import TensorProto, helper

    rng = np.random.default_rng(S + hd)
    qkv = rng.standard_normal((B, Hkv * (g + 2) * hd)).astype(np.float32) * 2
    angle = rng.random((B, hd // 2)) * 6
    rot = np.zeros((B, 1, hd, hd), np.float32)                     # a rotation per batch row
    for i in range(hd // 2):
        c, s_ = np.cos(angle[:, i]), np.sin(angle[:, i])
        rot[:, 0, i, i], rot[:, 0, i, i + hd // 2], rot[:, 0, i + hd // 2, i], rot[:, 0, i + hd // 2, i + hd // 2] = c, s_, -s_, c
    pk, pv = (rng.standard_normal((B, Hkv, S, hd)).astype(np.float16) for _ in range(2))
    bias = np.where(rng.random((B, 1, 1, S)) < empty, -np.inf, 0.0).astype(np.float32)
    scale = hd ** -0.5
    f, h = TensorProto.FLOAT, TensorProto.FLOAT16
    names, outs = ["qkv", "rot", "past_k", "past_v", "bias"], ["out", "k", "v", "mass"]
    node = helper.make_node("WindowAttention", names, outs, domain="zeroedge.ort", kv_heads=Hkv, scale=scale)
    s = _session(ortops_libs, node, [helper.make_tensor_value_info(n, h if n.startswith("past") else f, None) for n in names],
                 [helper.make_tensor_value_info(n, f, None) for n in outs])
    got = s.run(None, dict(zip(names, (qkv, rot, pk, pv, bias))))
    ref = _attention_reference(qkv, rot, pk, pv, bias, Hkv, scale)
    for name, a, r in zip(outs, got, ref):
        assert a.shape == r.shape, name
        assert np.abs(a - r).max() < 1e-5 * max(1.0, np.abs(r).max()), name
    assert (got[3][bias[:, :, 0] == -np.inf] == 0).all()          # an empty slot gets no mass at all


def test_window_attention_refuses_a_window_unlike_its_query(ortops_lib):
    from onnx import TensorProto, helper
    from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

    names = ["qkv", "rot", "past_k", "past_v", "bias"]
    node = helper.make_node("WindowAttention", names, ["out", "k", "v", "mass"], domain="zeroedge.ort",
                            kv_heads=2, scale=0.25)
    f, h = TensorProto.FLOAT, TensorProto.FLOAT16
    s = _session(ortops_lib, node, [helper.make_tensor_value_info(n, h if n.startswith("past") else f, None) for n in names],
                 [helper.make_tensor_value_info(n, f, None) for n in ("out", "k", "v", "mass")])
    feed = {"qkv": np.zeros((1, 2 * 5 * 16), np.float32), "rot": np.zeros((1, 1, 16, 16), np.float32),
            "past_k": np.zeros((1, 3, 8, 16), np.float16), "past_v": np.zeros((1, 3, 8, 16), np.float16),
            "bias": np.zeros((1, 1, 1, 8), np.float32)}                          # 3 kv heads, not 2
    with pytest.raises(RuntimeException, match="do not match"):
        s.run(None, feed)


def _paged_session(lib, H, Hkv, layer, layers, scale):
    from onnx import TensorProto, helper

    names = ["qkv", "cos", "sin", "pool_k", "pool_v", "table", "rows"]
    node = helper.make_node("PagedAttention", names, ["out"], domain="zeroedge.ort", heads=H, kv_heads=Hkv,
                            layer=layer, layers=layers, scale=scale)
    types = [TensorProto.INT64 if n in ("table", "rows") else TensorProto.FLOAT for n in names]
    return _session(lib, node, [helper.make_tensor_value_info(n, t, None) for n, t in zip(names, types)],
                    [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])


@pytest.mark.parametrize("H,Hkv,hd", [(9, 3, 64), (4, 4, 20), (8, 2, 6)])
def test_paged_attention_is_causal_softmax_over_pool_and_step_rows(ortops_libs, H, Hkv, hd):
    """PagedAttention against numpy: rows of three segments (a prompt chunk continuing a sequence, a
    verify-like pair, a first chunk) each over its pool slots before its segment and the segment's
    own rows up to it; their rotated K and their V land in the pool at their slots, nothing else."""
    rng = np.random.default_rng(H * hd)
    L, layer, slots, scale = 3, 1, 96, hd ** -0.5
    pool_k, pool_v = (rng.standard_normal((L, Hkv, slots, hd)).astype(np.float32) for _ in range(2))
    before_k, before_v = pool_k.copy(), pool_v.copy()
    table = rng.permutation(slots)[:72].reshape(3, 24).astype(np.int64)        # each sequence its own slots
    # (group, position, start, start's row): group 0 continues at 10 with 3 rows, group 1 has 2 rows
    # at 20, group 2 starts from 0 with 2 rows
    rows = np.array([[0, 10, 10, 0], [0, 11, 10, 0], [0, 12, 10, 0], [1, 20, 20, 3], [1, 21, 20, 3],
                     [2, 0, 0, 5], [2, 1, 0, 5]], np.int64)
    M = len(rows)
    qkv = rng.standard_normal((M, (H + 2 * Hkv) * hd)).astype(np.float32)
    ang = rng.random((M, hd // 2)).astype(np.float32) * 6
    cos, sin = np.cos(ang), np.sin(ang)
    s = _paged_session(ortops_libs, H, Hkv, layer, L, scale)
    out = s.run(None, {"qkv": qkv, "cos": cos, "sin": sin, "pool_k": pool_k.reshape(-1, hd),
                       "pool_v": pool_v.reshape(-1, hd), "table": table, "rows": rows})[0]

    def rope(x):
        a, b = x[..., :hd // 2], x[..., hd // 2:]
        c, s_ = cos[:, None], sin[:, None]
        return np.concatenate([a * c - b * s_, b * c + a * s_], -1)

    x = qkv.reshape(M, H + 2 * Hkv, hd).astype(np.float64)
    q, k, v = rope(x[:, :H]), rope(x[:, H:H + Hkv]), x[:, H + Hkv:]
    ref = np.zeros((M, H, hd))
    g = H // Hkv
    for r, (grp, p, start, r0) in enumerate(rows):
        for h in range(Hkv):
            K = np.stack([before_k[layer, h, table[grp, t]] if t < start else k[r0 + t - start, h] for t in range(p + 1)])
            V = np.stack([before_v[layer, h, table[grp, t]] if t < start else v[r0 + t - start, h] for t in range(p + 1)])
            for j in range(g):
                sc = K @ q[r, h * g + j] * scale
                e = np.exp(sc - sc.max())
                ref[r, h * g + j] = (e / e.sum()) @ V
    assert np.abs(out.reshape(M, H, hd) - ref).max() < 1e-5 * max(1.0, np.abs(ref).max())
    written = {(grp, p) for grp, p, _, _ in rows}
    for r, (grp, p, _, _) in enumerate(rows):
        at = table[grp, p]
        assert np.abs(pool_k[layer, :, at] - k[r]).max() < 1e-5 and np.array_equal(pool_v[layer, :, at], v[r].astype(np.float32))
    mask = np.ones((L, Hkv, slots), bool)
    for grp, p in written:
        mask[layer, :, table[grp, p]] = False
    assert np.array_equal(pool_k[mask], before_k[mask]) and np.array_equal(pool_v[mask], before_v[mask])


def test_paged_attention_rows_compute_alike_in_any_batch(ortops_lib):
    """A row's output does not depend on the other rows of the step (the engine's batch invariance):
    one sequence's decode row alone and beside 15 others, bit for bit."""
    H, Hkv, hd, L, slots = 9, 3, 64, 2, 16 * 260
    rng = np.random.default_rng(7)
    pool = [rng.standard_normal((L * Hkv * slots, hd)).astype(np.float32) for _ in range(2)]
    s = _paged_session(ortops_lib, H, Hkv, 0, L, 0.125)
    tables = rng.permutation(slots).reshape(16, 260).astype(np.int64)          # each sequence its own slots
    table = tables[:1]
    qkv = rng.standard_normal((1, (H + 2 * Hkv) * hd)).astype(np.float32)
    cs = rng.random((1, hd // 2)).astype(np.float32)

    def run(qkv_all, tables, rows):
        feed = {"qkv": qkv_all, "cos": np.repeat(cs, len(rows), 0), "sin": np.repeat(cs[::-1], len(rows), 0),
                "pool_k": pool[0].copy(), "pool_v": pool[1].copy(), "table": tables, "rows": np.asarray(rows, np.int64)}
        return s.run(None, feed)[0]

    alone = run(qkv, table, [[0, 250, 250, 0]])[0]
    others = rng.standard_normal((15, qkv.shape[1])).astype(np.float32)
    batch = run(np.concatenate([others[:7], qkv, others[7:]]), tables[[1, 2, 3, 4, 5, 6, 7, 0] + list(range(8, 16))],
                [[i, 100 + 9 * i, 100 + 9 * i, i] for i in range(7)] + [[7, 250, 250, 7]]
                + [[i, 40 + i, 40 + i, i] for i in range(8, 16)])[7]
    assert np.array_equal(alone, batch)


def test_paged_attention_refuses_rows_and_slots_out_of_range(ortops_lib):
    from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

    H, Hkv, hd = 2, 1, 8
    s = _paged_session(ortops_lib, H, Hkv, 0, 1, 0.3)
    feed = {"qkv": np.zeros((1, 4 * hd), np.float32), "cos": np.ones((1, 4), np.float32), "sin": np.zeros((1, 4), np.float32),
            "pool_k": np.zeros((16, hd), np.float32), "pool_v": np.zeros((16, hd), np.float32),
            "table": np.arange(4, dtype=np.int64)[None], "rows": np.array([[0, 2, 2, 0]], np.int64)}
    assert s.run(None, feed)[0].shape == (1, H * hd)
    for key, bad, why in (("table", np.array([[0, 1, 16, 3]]), "not a slot"), ("rows", np.array([[0, 4, 4, 0]]), "out of range"),
                          ("rows", np.array([[1, 2, 2, 0]]), "out of range"), ("rows", np.array([[0, 2, 0, 0]]), "out of range")):
        with pytest.raises(RuntimeException, match=why):
            s.run(None, dict(feed, **{key: bad.astype(np.int64)}))


@pytest.mark.parametrize("M,K,N,mode", [(1, 576, 960, ""), (3, 80, 13, "residual"), (2, 1536, 576, "residual"),
                                        (2, 576, 3072, "swiglu"), (5, 40, 10, "swiglu")])
def test_block_offsets_add_the_float_zero_points_share(ortops_libs, M, K, N, mode):
    """BlockOffsets against numpy: y + blocksums(x) @ C (blocks of 32, a short last one), plus the
    residual, or silu(gate) * up of the halves."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(M * K + N)
    kb = -(-K // 32)
    y, x = rng.standard_normal((M, N)).astype(np.float32), rng.standard_normal((M, K)).astype(np.float32)
    C, res = rng.standard_normal((kb, N)).astype(np.float32) * 0.1, rng.standard_normal((M, N)).astype(np.float32)
    names = ["y", "x", "C"] + (["residual"] if mode == "residual" else [])
    node = helper.make_node("BlockOffsets", names, ["out"], domain="zeroedge.ort",
                            **({"activation": "swiglu"} if mode == "swiglu" else {}))
    f = TensorProto.FLOAT
    s = _session(ortops_libs, node, [helper.make_tensor_value_info(n, f, None) for n in names if n != "C"],
                 [helper.make_tensor_value_info("out", f, None)], [numpy_helper.from_array(C, "C")])
    feed = {"y": y, "x": x, **({"residual": res} if mode == "residual" else {})}
    got = s.run(None, feed)[0]
    sums = np.pad(x.astype(np.float64), ((0, 0), (0, kb * 32 - K))).reshape(M, kb, 32).sum(-1)
    ref = y + sums @ C
    if mode == "residual":
        ref = ref + res
    if mode == "swiglu":
        gate, up = ref[:, :N // 2], ref[:, N // 2:]
        ref = gate / (1 + np.exp(-gate)) * up
    assert got.shape == ref.shape and np.abs(got - ref).max() < 1e-5 * max(1.0, np.abs(ref).max())


@pytest.fixture(scope="module")
def tiny_int4_pair(tmp_path_factory, ortops_lib):
    from zeroedge.export.bundle_writer import export_bundle

    d = tmp_path_factory.mktemp("ortops")
    kw = dict(window=64, weights="int4", zero_point="float", accuracy_level=4, flavours=("portable",))
    export_bundle("tiny", d / "stock", **kw)
    export_bundle("tiny", d / "zeroedge", cpu_kernels="zeroedge", **kw)
    return d / "stock", d / "zeroedge"


def test_a_zeroedge_kernels_bundle_decodes_like_the_stock_one(tiny_int4_pair):
    import json

    from zeroedge.backends.onnxruntime import OrtRunner

    stock, ours = tiny_int4_pair
    mf = json.loads((ours / "manifest.json").read_text())
    assert mf["cpu_kernels"] == {"kind": "zeroedge", "domain": "zeroedge.ort",
                                 "nodes": {"Q4Linear": 4 * 4, "Q4Linear swiglu": 4,   # 4 layers: qkv, o, gate/up, down
                                           "Q8Linear": 0, "WindowAttention": 4}, "input_bits": 8}
    assert json.loads((stock / "manifest.json").read_text())["cpu_kernels"] == {"kind": "stock"}
    tokens = np.random.default_rng(3).integers(0, 256, 40)
    with OrtRunner(stock, slots=64) as a, OrtRunner(ours, slots=64) as b:
        assert b.k[0].dtype == np.float16 and a.k[0].dtype == np.float32     # the window's K
        la, lb = a.prefill(tokens), b.prefill(tokens)
        assert np.array_equal(la, lb)                                         # the same prefill graph
        for _ in range(20):                                                   # 60 of the 64 slots
            t = int(la.argmax())
            la, lb = a.step(t), b.step(t)
            assert np.abs(la - lb).max() <= 5e-3 * np.abs(la).max()     # int8 roundings of x may differ
        assert np.abs(a.last_mass - b.last_mass).max() < 1e-3


def _decodes_alike(stock, ours, seed, prompt=40, steps=20):
    """Greedy decoding from the stock bundle's logits, both bundles within 1 % of the largest logit at
    every step (the zeroedge window's K is float16)."""
    from zeroedge.backends.onnxruntime import OrtRunner

    tokens = np.random.default_rng(seed).integers(0, 256, prompt)
    with OrtRunner(stock, slots=64) as a, OrtRunner(ours, slots=64) as b:
        la, lb = a.prefill(tokens), b.prefill(tokens)
        for _ in range(steps):
            t = int(la.argmax())
            la, lb = a.step(t), b.step(t)
            assert np.abs(la - lb).max() <= 1e-2 * np.abs(la).max()


@pytest.mark.parametrize("scheme", [{}, {"symmetric": True, "group": 128}, {"group": 64}])
def test_every_4bit_scheme_takes_q4linear_and_decodes_like_the_stock_graph(tmp_path, ortops_lib, scheme):
    """Integer zero points (onnxruntime's quantizer, the default) and symmetric grids, blocks of 32 to
    128: every 4-bit product becomes a Q4Linear, the 8-bit LM head a Q8Linear, and the bundle decodes
    like its stock twin."""
    import json

    import onnx

    from zeroedge.export.bundle_writer import export_bundle

    kw = dict(window=64, weights="int4", flavours=("portable",), **scheme)
    export_bundle("tiny", tmp_path / "stock", **kw)
    mf = export_bundle("tiny", tmp_path / "ours", cpu_kernels="zeroedge", **kw)
    assert mf["cpu_kernels"]["nodes"] == {"Q4Linear": 4 * 4, "Q4Linear swiglu": 4, "Q8Linear": 1, "WindowAttention": 4}
    assert mf["cpu_kernels"]["input_bits"] == 16
    g = onnx.load(str(tmp_path / "ours" / "decode.portable.onnx"), load_external_data=False).graph
    weights = {i.name for i in g.initializer}
    products = [n for n in g.node if n.op_type in ("MatMulNBits", "MatMul", "Gemm")]
    assert not [n for n in products if n.op_type != "MatMul" or set(n.input) & weights]   # the LM head is Q8Linear
    assert len(products) == 4              # left: each layer's query rotation for attn_query (activations only)
    # the plan counts both packed copies: 20 bytes per 32 weights of the 4-bit layers, 34 of the head
    plans = [json.loads(run_cli("plan", tmp_path / b, "--board", "orin-nano-8gb", "--ctx", 60, "--onnxruntime-process",
                                "--json", check_rc=0).stdout)["memory"]["weights"] for b in ("stock", "ours")]
    q = mf["weights"]["quantization"]
    assert plans[1] - plans[0] == 20 / 32 * q["quantized_params"] + 34 / 32 * q["embedding"]["params"]
    _decodes_alike(tmp_path / "stock", tmp_path / "ours", seed=6)


def test_a_zeroedge_kernels_bundle_without_the_library_is_refused_in_one_line(tiny_int4_pair, tmp_path, monkeypatch):
    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.errors import UserError

    monkeypatch.setenv("ZEROEDGE_ORTOPS", str(tmp_path / "missing.so"))
    with pytest.raises(UserError, match="build_ortops") as e:
        OrtRunner(tiny_int4_pair[1], slots=64)
    assert "\n" not in str(e.value)
    (tmp_path / "bad.so").write_bytes(b"not a library")
    monkeypatch.setenv("ZEROEDGE_ORTOPS", str(tmp_path / "bad.so"))
    with pytest.raises(UserError, match="cannot load"):
        OrtRunner(tiny_int4_pair[1], slots=64)


def test_below_accuracy_level_4_the_products_round_their_inputs_to_int16(tiny_int4_pair, tmp_path):
    """Exported without --accuracy-level 4, every Q4Linear rounds its inputs to int16 (the manifest and
    the export's summary say so) and the bundle decodes like the stock graph at the same level."""
    import json

    import onnx


    args = ("export", "tiny", "--weights", "int4", "--zero-point", "float", "--window", 64, "--graphs", "portable")
    run_cli(*args, "-o", tmp_path / "stock", check_rc=0)
    p = run_cli(*args, "--cpu-kernels", "zeroedge", "-o", tmp_path / "ours", check_rc=0)
    assert "Q4Linear in decode, int16 inputs" in p.stdout
    assert "decode kernels (zeroedge.ort): 16 Q4Linear (4 with SwiGLU), 1 Q8Linear, 4 WindowAttention\n" in p.stdout
    assert json.loads((tmp_path / "ours" / "manifest.json").read_text())["cpu_kernels"]["input_bits"] == 16
    g = onnx.load(str(tmp_path / "ours" / "decode.portable.onnx"), load_external_data=False).graph
    bits = [a.i for n in g.node if n.op_type == "Q4Linear" for a in n.attribute if a.name == "input_bits"]
    assert len(bits) == 4 * 4 and set(bits) == {16}                       # 4 layers: qkv, o, gate/up, down
    _decodes_alike(tmp_path / "stock", tmp_path / "ours", seed=4)


def test_export_says_when_the_4bit_products_keep_matmulnbits(tmp_path):
    """Groups of 16 are not Q4Linear's: the bundle exports, the summary says the products stay stock."""
    p = run_cli("export", "tiny", "--weights", "int4", "--group", "16", "--graphs", "portable",
                "--cpu-kernels", "zeroedge", "-o", tmp_path / "b", check_rc=0)
    assert "0 Q4Linear" in p.stdout and "keep MatMulNBits (Q4Linear takes groups of 32 to 256)" in p.stdout


def test_export_refuses_zeroedge_kernels_for_tensorrt_graphs(tmp_path):
    p = run_cli("export", "tiny", "-o", tmp_path / "b", "--cpu-kernels", "zeroedge")
    assert p.returncode == 2 and "--graphs portable" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "b").exists()


def test_plan_counts_the_packed_copy_and_the_float16_window(tiny_int4_pair):
    """`zeroedge plan --onnxruntime-process`: a zeroedge-kernels bundle holds its 4-bit linear layers
    once more (Q4Linear's packed copy) and a float16 K window; both as the runner allocates them."""
    import json

    from zeroedge.backends.onnxruntime import OrtRunner

    stock, ours = tiny_int4_pair
    plans = {}
    for b in (stock, ours):
        p = run_cli("plan", b, "--board", "orin-nano-8gb", "--ctx", 60, "--onnxruntime-process", "--json", check_rc=0)
        plans[b] = json.loads(p.stdout)["memory"]
    qp = json.loads((ours / "manifest.json").read_text())["weights"]["quantization"]["quantized_params"]
    # the packed copy: per block of 32 weights, 16 bytes of codes, a float16 d and c
    assert plans[ours]["weights"] - plans[stock]["weights"] == 20 / 32 * qp > 0
    with OrtRunner(ours, slots=60) as r:
        assert plans[ours]["hot_kv"] == r.window_bytes() < plans[stock]["hot_kv"]


def test_zeroedge_kernels_with_pruned_heads_decode_like_the_stock_graph(tmp_path, ortops_lib):
    """Layers with pruned heads keep the stock attention (over the float16 K window), the others take
    WindowAttention; fp32 weights, so the two graphs differ only there."""
    from artifacts import sih_artifact

    from zeroedge.export.bundle_writer import export_bundle

    sih_artifact(tmp_path / "calib", "tiny", thr={i: 0.5 for i in range(4)}, prune={"1": [0, 3]})
    kw = dict(calib=tmp_path / "calib", window=64, weights="float32", flavours=("portable",))
    export_bundle("tiny", tmp_path / "stock", **kw)
    mf = export_bundle("tiny", tmp_path / "ours", cpu_kernels="zeroedge", **kw)
    assert mf["cpu_kernels"]["nodes"]["WindowAttention"] == 3                 # layer 1 keeps its form
    _decodes_alike(tmp_path / "stock", tmp_path / "ours", seed=5, prompt=30, steps=12)


def test_q4_linear_refuses_a_bad_activation_and_weights_that_are_not_initializers(ortops_lib):
    from onnx import TensorProto, helper, numpy_helper

    K, N = 64, 8
    B, S, C = (np.zeros((N, 2, 16), np.uint8), np.ones(N * 2, np.float16), np.zeros((2, N), np.float16))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])
    y = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    inits = [numpy_helper.from_array(B, "B"), numpy_helper.from_array(S, "S"), numpy_helper.from_array(C, "C")]
    bad = helper.make_node("Q4Linear", ["x", "B", "S", "C"], ["y"], domain="zeroedge.ort", K=K, N=N, block_size=32,
                           activation="gelu")
    with pytest.raises(Exception, match="activation must be swiglu"):
        _session(ortops_lib, bad, [x], y, inits).run(None, {"x": np.zeros((1, K), np.float32)})
    node = helper.make_node("Q4Linear", ["x", "B", "S", "C"], ["y"], domain="zeroedge.ort", K=K, N=N, block_size=32)
    b_in = helper.make_tensor_value_info("B", TensorProto.UINT8, [N, 2, 16])       # fed, not constant
    with pytest.raises(Exception, match="must be initializers"):
        _session(ortops_lib, node, [x, b_in], y, inits[1:]).run(None, {"x": np.zeros((1, K), np.float32), "B": B})


def test_q4_and_q8_linear_refuse_a_bad_block_size_mismatched_weights_and_bad_input_bits(ortops_lib):
    from onnx import TensorProto, helper, numpy_helper

    K, N = 64, 8
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])
    y = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    feed = {"x": np.zeros((1, K), np.float32)}

    def refused(op, arrays, match, **attrs):
        node = helper.make_node(op, ["x"] + list(arrays), ["y"], domain="zeroedge.ort", K=K, N=N, **attrs)
        inits = [numpy_helper.from_array(a, n) for n, a in arrays.items()]
        with pytest.raises(Exception, match=match):
            _session(ortops_lib, node, [x], y, inits).run(None, feed)

    B4, S = np.zeros((N, 2, 16), np.uint8), np.ones(N * 2, np.float16)
    refused("Q4Linear", {"B": B4, "S": S}, "block_size must be 32, 64, 128 or 256", block_size=48)
    refused("Q4Linear", {"B": B4, "S": S}, "input_bits must be 8 or 16", block_size=32, input_bits=4)
    refused("Q4Linear", {"B": B4, "S": S, "Z": np.zeros(N * 2, np.uint8)}, "do not match", block_size=32)  # 2 a byte
    refused("Q4Linear", {"B": B4, "S": S, "C": np.zeros((2, N), np.float32)}, "do not match", block_size=32)  # dtype
    refused("Q4Linear", {"B": B4, "S": S}, "do not match", block_size=64)                 # S: two blocks a row, not one
    B8 = np.zeros((N, 2, 32), np.uint8)
    refused("Q8Linear", {"B": B8, "S": S}, "block_size must be 32", block_size=64)
    refused("Q8Linear", {"B": B4, "S": S}, "do not match", block_size=32)
    node = helper.make_node("Q8Linear", ["x", "B", "S"], ["y"], domain="zeroedge.ort", K=K, N=N, block_size=32)
    with pytest.raises(Exception, match="must be initializers"):
        _session(ortops_lib, node, [x, helper.make_tensor_value_info("B", TensorProto.UINT8, [N, 2, 32])], y,
                 [numpy_helper.from_array(S, "S")]).run(None, {**feed, "B": B8})


def test_export_refuses_zeroedge_kernels_for_a_foreign_graph_and_unknown_kernels(tmp_path):
    from zeroedge.errors import UserError
    from zeroedge.export.bundle_writer import export_bundle

    with pytest.raises(UserError, match="not a foreign .onnx graph"):
        export_bundle(str(tmp_path / "model.onnx"), tmp_path / "b", flavours=("portable",), cpu_kernels="zeroedge")
    with pytest.raises(UserError, match="stock or zeroedge"):
        export_bundle("tiny", tmp_path / "c", flavours=("portable",), cpu_kernels="fast")
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_fetch_headers_refuses_a_package_unlike_its_pinned_hash(tmp_path):
    """The headers are taken only from the package whose SHA-256 is pinned: any other bytes (or none)
    are refused with one line and exit code 2, and nothing is written."""
    def fetch():
        code = ("import sys; sys.path.insert(0, 'ortops'); import fetch_headers as f; "
                f"f.URL = 'file://{tmp_path}/fake.deb'; sys.exit(f.main('{tmp_path}/inc'))")
        return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)

    p = fetch()
    assert p.returncode == 2 and "cannot download" in p.stderr          # no such file yet
    (tmp_path / "fake.deb").write_bytes(b"!<arch>\nnot the package")
    p = fetch()
    assert p.returncode == 2 and "pinned SHA-256" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "inc").exists()


def test_block_offsets_refuses_mismatched_inputs_a_bad_activation_and_a_swiglu_residual(ortops_lib):
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

    f = TensorProto.FLOAT

    def session(C, act=None, residual=False):
        names = ["y", "x", "C"] + (["residual"] if residual else [])
        node = helper.make_node("BlockOffsets", names, ["out"], domain="zeroedge.ort", **({"activation": act} if act else {}))
        return _session(ortops_lib, node, [helper.make_tensor_value_info(n, f, None) for n in names if n != "C"],
                        [helper.make_tensor_value_info("out", f, None)], [numpy_helper.from_array(C, "C")])

    y, x = np.zeros((2, 8), np.float32), np.zeros((2, 64), np.float32)
    with pytest.raises(RuntimeException, match="do not match"):               # C for K = 96, x has 64
        session(np.zeros((3, 8), np.float32)).run(None, {"y": y, "x": x})
    with pytest.raises(RuntimeException, match="float16 or float"):
        session(np.zeros((2, 8), np.float64)).run(None, {"y": y, "x": x})
    with pytest.raises(RuntimeException, match="no residual"):
        session(np.zeros((2, 8), np.float32), "swiglu", True).run(None, {"y": y, "x": x, "residual": y})
    with pytest.raises((Fail, InvalidArgument, RuntimeException), match="swiglu or absent"):
        session(np.zeros((2, 8), np.float32), "gelu").run(None, {"y": y, "x": x})
