"""Packed 4- / 8-bit weights in the torch decode loop (zeroedge.quant.packed, quant.triton_gemv,
runtime.fast): the packed form is the group-wise weight; the decoders over packed weights (dense,
thermal, magnitude paths gathering 4-bit rows, int8 inputs) compute what the quantized model computes;
the Triton kernels (run in Triton's interpreter on the CPU: exact and int8 inputs, every epilogue and
split, the input-major gather) compute their references; `calibrate --zero-point float` then `run
--calib` serves the quantized model, under a memory cap that counts the packed bytes."""

import interpreter_scripts
import pytest
import torch

from zeroedge import model as M
from zeroedge.calib_artifact import WeightsSection
from zeroedge.quant.groupwise import Scheme, fake_quantize

SCHEMES = [Scheme(4, 32, False, "float"), Scheme(4, 32, False, "int"), Scheme(4, 128, True), Scheme(8, 64, True)]


def _step_of(w, scheme):
    """The largest quantization step of w's groups (the scale of the rounding error)."""
    n, k = w.shape
    pad = (-k) % scheme.group
    b = torch.nn.functional.pad(w, (0, pad)).reshape(n, -1, scheme.group)
    return float((b.amax(-1) - b.amin(-1)).max()) / scheme.qmax


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_packed_weight_is_the_groupwise_weight(scheme):
    from zeroedge.quant.packed import PackedLinear

    g = torch.Generator().manual_seed(scheme.bits * 100 + scheme.group)
    w = torch.randn(24, 200, generator=g) * 0.05             # 200 inputs: the last group is short
    w[3] = 0                                                  # a zero row
    w[5, :7] = torch.tensor([0.5, -0.5, 0.25, 1e-8, -0.3, 0.0, 0.1])
    p = PackedLinear.from_weight(w, scheme)
    assert p.q.dtype == torch.uint8 and p.q.shape[1] == -(-200 // scheme.group) * scheme.group * scheme.bits // 8
    groups = -(-200 // scheme.group)
    assert p.nbytes() == 24 * groups * (scheme.group * scheme.bits // 8 + 2 + 2)   # codes, fp16 step, fp16 offset
    ref = fake_quantize(w, scheme)
    err = float((p.dequantize() - ref).abs().max())
    if scheme.zero_point == "float":
        assert err <= 1e-6 * float(w.abs().max())             # the same grid (an ulp at most)
    else:                                                     # fp16 steps: 2^-10 of the largest weight
        assert err <= 2 ** -10 * float(w.abs().max())
    assert err <= 0.1 * _step_of(w, scheme)
    assert not torch.equal(p.dequantize(), w)


def _section(scheme, embedding_bits=8):
    return WeightsSection(bits=scheme.bits, group=scheme.group, symmetric=scheme.symmetric, method="rtn",
                          embedding_bits=embedding_bits, embedding_group=32, meta={},
                          zero_point=scheme.zero_point)


@pytest.mark.parametrize("embedding_bits", [8, 4])
def test_decoders_over_packed_weights_compute_the_quantized_model(embedding_bits):
    """Dense and thermal (everything hot) decoders on a packed model give the fake-quantized model's
    logits, step for step; the decoder holds the packed forms (q/k/v and gate/up fused), the LM head
    too (int8, or int4 with --embedding int4: the tied embedding on that grid)."""
    from zeroedge.kv import evaluate as E
    from zeroedge.quant.apply import apply
    from zeroedge.quant.packed import PackedLinear
    from zeroedge.runtime.fast import DenseDecoder, ThermalDecoder

    m = M.build("tiny", seed=4).eval()
    e0 = m.embed_tokens.weight.detach().clone()
    apply(m, _section(Scheme(4, 32, False, "float"), embedding_bits), pack=True)
    e_want = fake_quantize(e0, Scheme(embedding_bits, 32, True))   # up to the packed form's fp16 steps
    assert float((m.embed_tokens.weight - e_want).abs().max()) <= 2 ** -10 * float(e0.abs().max())
    assert float((m.embed_tokens.weight - e0).abs().max()) > (0.02 if embedding_bits == 4 else 0.001) * float(e0.abs().max())
    ids = torch.randint(0, 256, (1, 72), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = m(ids)[0]
    P = 56
    pre = E.prefill(m, ids[0, :P].tolist(), stats=False)
    dense = DenseDecoder(m, 72, graph=False, packed=True)      # the packed path through the torch reference
    dense.load_prefix(pre["k"], pre["v"])
    thermal = ThermalDecoder(m, P, 16, budget=1.0, page_size=8, rank=8, graph=False, packed=True)
    thermal.load_prefix(pre["k"], pre["v"], pre["qcov"])
    auto = DenseDecoder(m, 72, graph=False)                   # on a CPU: the fp weights, the same values
    auto.load_prefix(pre["k"], pre["v"])
    assert auto.packed_layers is None
    w = dense.packed_layers[0]
    assert isinstance(w["wqkv"], PackedLinear) and w["wqkv"].n == 64 + 2 * 32
    assert isinstance(w["w13"], PackedLinear) and w["w13"].n == 2 * 128
    assert isinstance(dense.packed_head, PackedLinear) and dense.packed_head.bits == embedding_bits
    k = m.layers[0].self_attn.k_proj.packed                    # one copy: the linears' forms are row views
    assert k.q.untyped_storage().data_ptr() == w["wqkv"].q.untyped_storage().data_ptr() and k.n == 32
    i8 = DenseDecoder(m, 72, graph=False, packed=True, int8_inputs=True)   # int8-rounded GEMV inputs
    i8.load_prefix(pre["k"], pre["v"])
    for t in range(P, 72):
        tok = ids[0, t].item()
        for dec in (dense, thermal, auto):
            assert torch.allclose(dec.step(tok, t), full[t], atol=1e-4)
        y = i8.step(tok, t)
        assert not torch.equal(y, full[t]) and float((y - full[t]).norm() / full[t].norm()) < 2e-2
    # pages scored a layer ahead: the prediction reads the query's rows of the packed q/k/v (q_proj's
    # form, a view of the fused one), and chooses what the fp weights of the same values choose
    runs = {}
    for pk in (True, False):
        d = ThermalDecoder(m, P, 16, budget=0.3, page_size=8, rank=8, recent_pages=1, fetch=2, graph=False,
                           packed=pk, ahead=1)
        d.load_prefix(pre["k"], pre["v"], pre["qcov"])
        runs[pk] = (torch.stack([d.step(ids[0, t].item(), t).clone() for t in range(P, 72)]),
                    d.attention.slot_page.clone())
    assert torch.allclose(runs[True][0], runs[False][0], atol=1e-4) and torch.equal(runs[True][1], runs[False][1])
    q = w["wqkv"].rows(0, 64)
    assert q.n == 64 and q.q.data_ptr() == w["wqkv"].q.data_ptr()
    assert torch.equal(q.dequantize(), w["wqkv"].dequantize()[:64])
    with pytest.raises(ValueError, match="int8_inputs"):
        DenseDecoder(M.build("tiny", seed=4), 16, graph=False, int8_inputs=True)


def test_packing_without_a_weights_section_changes_nothing():
    from zeroedge.runtime.fast import DenseDecoder

    m = M.build("tiny", seed=4).eval()
    d = DenseDecoder(m, 16, graph=False)
    assert d.packed_layers is None and d.packed_head is None
    with pytest.raises(ValueError, match="packed weights"):
        DenseDecoder(m, 16, graph=False, packed=True)


SCRIPT = r'''
import torch
import torch.nn.functional as F
from zeroedge.quant.groupwise import Scheme
from zeroedge.quant.packed import PackedLinear, round_inputs_int8
from zeroedge.quant import triton_gemv as tg

torch.manual_seed(0)
for sch in [Scheme(4, 32, False, "float"), Scheme(4, 128, True), Scheme(8, 64, True)]:
    N, K = 48, 200                        # K not a multiple of the group; N not of the row block
    w = torch.randn(N, K) * 0.05
    p = PackedLinear.from_weight(w, sch)
    wd = p.dequantize()
    x = torch.randn(1, K) * 3
    r = torch.randn(1, N)
    ln = torch.rand(K) + 0.5
    xn = F.rms_norm(x, (K,), ln, 1e-5)
    ref, refn = x @ wd.T, xn @ wd.T
    for cfg in [dict(BN=8, BW=4, SPLIT=1, num_warps=4), dict(BN=16, BW=2, SPLIT=3, num_warps=4), None]:
        y = tg.gemv(x, p, config=cfg)
        assert y.shape == (1, N) and torch.allclose(y, ref, atol=1e-5), (sch, cfg, (y - ref).abs().max())
        y = tg.gemv(x, p, residual=r, config=cfg)
        assert torch.allclose(y, ref + r, atol=1e-5), (sch, cfg)
        y = tg.gemv(x, p, residual=r, norm=(ln, 1e-5), config=cfg)
        assert torch.allclose(y, refn + r, atol=1e-5), (sch, cfg)
        for nrm, want in ((None, ref), ((ln, 1e-5), refn)):
            g, u = want.chunk(2, -1)
            y = tg.gemv(x, p, swiglu=True, norm=nrm, config=cfg)
            assert y.shape == (1, N // 2) and torch.allclose(y, F.silu(g) * u, atol=1e-5), (sch, cfg)
    xi = round_inputs_int8(xn, sch.bits)                 # the dp4a kernel (emulated here: no inline PTX)
    for cfg in [dict(BN=8, BW=16, SPLIT=1, num_warps=4), dict(BN=4, BW=16, SPLIT=2, num_warps=4),
                dict(BN=8, BW=16, SPLIT=1, num_warps=4, PREPARED=True),     # inputs rounded by a first kernel
                dict(BN=4, BW=16, SPLIT=2, num_warps=4, PREPARED=True), dict(BN=4, BW=4, SPLIT=1, PREPARED=True),
                dict(BN=32, BW=16, SPLIT=1, PREPARED=True)]:        # rows not a multiple of the block
        y = tg.gemv(x, p, residual=r, norm=(ln, 1e-5), config=cfg, int8_inputs=True)
        assert torch.allclose(y, xi @ wd.T + r, atol=1e-5), (sch, cfg, (y - xi @ wd.T - r).abs().max())
        g, u = (xi @ wd.T).chunk(2, -1)
        y2 = tg.gemv(x, p, swiglu=True, norm=(ln, 1e-5), config=cfg, int8_inputs=True)
        assert torch.allclose(y2, F.silu(g) * u, atol=1e-5), (sch, cfg)
        tg.EARLY_WEIGHTS = False          # the first weight tile after PDL's wait: the same sums, in order
        try:
            assert torch.equal(y, tg.gemv(x, p, residual=r, norm=(ln, 1e-5), config=cfg, int8_inputs=True))
            assert torch.equal(y2, tg.gemv(x, p, swiglu=True, norm=(ln, 1e-5), config=cfg, int8_inputs=True))
        finally:
            tg.EARLY_WEIGHTS = True
    assert not torch.equal(xi, xn) and torch.allclose(xi, xn, atol=float(xn.abs().max()) / 250)
    xt = x.clone()
    xt[0, :16] = 1e-38                    # runs of tiny inputs: 127 / max would overflow; they count as 0
    xt[0, 16:24] = 0.0
    want = round_inputs_int8(xt, sch.bits) @ wd.T
    for prep in (False, True):
        y = tg.gemv(xt, p, config=dict(BN=8, BW=16, SPLIT=1, PREPARED=prep), int8_inputs=True)
        assert torch.isfinite(y).all() and torch.allclose(y, want, atol=1e-5), (sch, prep)
    # the predictor rule: rows decided in the kernel from z, bg, bu (rank 5: not a power of two)
    z, bg, bu = torch.randn(1, 5), torch.randn(5, N // 2), torch.randn(5, N // 2)
    score = (F.silu(z @ bg) * (z @ bu)).abs()
    srt = score.flatten().sort().values
    thr = float(srt[N // 4 - 1] + srt[N // 4]) / 2      # midway between two scores: no row on the edge
    live = score >= thr
    g, u = ref.chunk(2, -1)
    for cfg in [dict(BN=8, BW=4, SPLIT=1, num_warps=4), dict(BN=4, BW=2, SPLIT=3, num_warps=4)]:
        y = tg.gemv(x, p, swiglu=True, config=cfg, predictor=(z, bg, bu, thr))
        assert torch.allclose(y, F.silu(g) * u * live, atol=1e-5) and (y[~live] == 0).all(), (sch, cfg)
        gi, ui = (round_inputs_int8(x, sch.bits) @ wd.T).chunk(2, -1)
        for prep in (False, True):
            y = tg.gemv(x, p, swiglu=True, config=dict(cfg, BW=16, PREPARED=prep), int8_inputs=True,
                        predictor=(z, bg, bu, thr))
            assert torch.allclose(y, F.silu(gi) * ui * live, atol=1e-5), (sch, cfg, prep)
        y = tg.gemv(x, p, swiglu=True, config=cfg, predictor=(z, bg, bu, float("inf")))   # no live row
        assert (y == 0).all()
    for bad in ((z, bg[:, :-1], bu, thr), (z, bg.double(), bu, thr), (z, bg.t().contiguous().t(), bu, thr),
                (torch.randn(2, 5), bg, bu, thr)):
        refused(lambda: tg.gemv(x, p, swiglu=True, predictor=bad), "predictor")
    yb = tg.gemv(x.bfloat16(), p)
    assert yb.dtype == torch.bfloat16 and torch.allclose(yb.float(), x.bfloat16().float() @ wd.T, atol=5e-2)
refused(lambda: tg.gemv(torch.randn(1, 10), p), "inputs")
# the down projection's int8 inputs prepared in the gate/up GEMV's epilogue (`then`)
for sch in [Scheme(4, 32, False, "float"), Scheme(4, 128, True), Scheme(8, 64, True)]:
    F_, K, N2 = 128, 96, 40
    p13 = PackedLinear.from_weight(torch.randn(2 * F_, K) * 0.05, sch)
    p2 = PackedLinear.from_weight(torch.randn(N2, F_) * 0.05, sch)
    x, r2 = torch.randn(1, K) * 3, torch.randn(1, N2)
    ln = torch.rand(K) + 0.5
    for cfg in [dict(BN=16, BW=16, SPLIT=1, PREPARED=True), dict(BN=8, BW=4, SPLIT=1, PREPARED=False)]:
        a, prep = tg.gemv(x, p13, swiglu=True, norm=(ln, 1e-5), config=cfg, int8_inputs=True, then=p2)
        assert prep is not None and torch.equal(a, tg.gemv(x, p13, swiglu=True, norm=(ln, 1e-5), config=cfg,
                                                            int8_inputs=True))
        want = round_inputs_int8(a, sch.bits) @ p2.dequantize().T + r2
        for cfg2 in [dict(BN=8, BW=16, SPLIT=1), dict(BN=4, BW=4, SPLIT=3)]:
            y = tg.gemv(a, p2, residual=r2, config=cfg2, int8_inputs=True, inputs=prep)
            assert torch.allclose(y, want, atol=1e-5), (sch, cfg, cfg2, (y - want).abs().max())
            # the same numbers as the rounding launch's: bit for bit
            assert torch.equal(y, tg.gemv(a, p2, residual=r2, config=dict(cfg2, PREPARED=True), int8_inputs=True))
    # rows a program not whole words of the next weight's inputs, or split partials: nothing prepared
    for cfg in (dict(BN=2, BW=16, SPLIT=1), dict(BN=8, BW=4, SPLIT=2)):
        a, prep = tg.gemv(x, p13, swiglu=True, config=cfg, int8_inputs=True, then=p2)
        assert prep is None
    # the last program's rows past the end (F = 3 groups, 2 groups of rows a program) give zero words
    Fs = 3 * sch.group
    p13s, p2s = (PackedLinear.from_weight(torch.randn(2 * Fs, K) * 0.05, sch),
                 PackedLinear.from_weight(torch.randn(N2, Fs) * 0.05, sch))
    a, prep = tg.gemv(x, p13s, swiglu=True, config=dict(BN=2 * sch.group, BW=16, SPLIT=1), int8_inputs=True, then=p2s)
    want = round_inputs_int8(a, sch.bits) @ p2s.dequantize().T
    assert prep is not None and torch.allclose(tg.gemv(a, p2s, int8_inputs=True, inputs=prep), want, atol=1e-5)
    prep = tg._prepared_buffers(p2, a.device)
    a = torch.randn(1, F_)
    refused(lambda: tg.gemv(a, p2, int8_inputs=False, inputs=prep), "prepared")
    from zeroedge.quant import packed as PK            # the torch path (here: CPU) refuses the same misuse
    refused(lambda: PK.linear(a, p2, int8_inputs=True, inputs=prep, norm=(torch.ones(F_), 1e-5)), "prepared")
    refused(lambda: PK.linear(a, p2, int8_inputs=False, inputs=prep), "prepared")
    refused(lambda: tg.gemv(a, p2, int8_inputs=True, inputs=prep, norm=(torch.ones(F_), 1e-5)), "prepared")
    other = PackedLinear.from_weight(torch.randn(N2, F_) * 0.05, Scheme(4 if sch.bits == 8 else 8, 64, True))
    refused(lambda: tg.gemv(a, other, int8_inputs=True, inputs=prep), "prepared")          # other bits
    if sch.group == 32:            # the same K at group 64 pads to other words a row (K = 96: 12 vs 16)
        p96 = PackedLinear.from_weight(torch.randn(N2, 96) * 0.05, sch)
        g64 = PackedLinear.from_weight(torch.randn(N2, 96) * 0.05, Scheme(sch.bits, 64, sch.symmetric, sch.zero_point))
        refused(lambda: tg.gemv(torch.randn(1, 96), g64, int8_inputs=True,
                                inputs=tg._prepared_buffers(p96, a.device)), "prepared")
print("OK")
'''


REFUSED = '''
def refused(call, words):
    """call() must raise ValueError naming `words`."""
    try:
        call()
    except ValueError as e:
        assert words in str(e), str(e)
    else:
        raise AssertionError(f"accepted bad input (expected an error about {words})")
'''


@pytest.mark.interpreter_script(interpreter_scripts.register("packed_gemv", REFUSED + SCRIPT))
def test_packed_gemv_kernel_in_the_triton_interpreter():
    interpreter_scripts.check("packed_gemv")


def test_run_with_a_weights_artifact_serves_the_quantized_model(tiny_hf, text_file, tmp_path):
    """`zeroedge calibrate --weights int4 --zero-point float` then `zeroedge run MODEL --calib ART`: the
    artifact says the float zero point; the torch session quantizes the model
    (packed forms kept; on the CPU the decoder reads their values as fp weights) and says so; the
    same artifact cannot give --paths (it has none); a second quantization of one model is refused."""
    import json

    from conftest import run_cli

    from zeroedge import weights
    from zeroedge.errors import UserError
    from zeroedge.serve.session import ServingSession

    art = tmp_path / "w.calib"
    run_cli("calibrate", tiny_hf, "--text", text_file, "--weights", "int4", "--group", "32", "--zero-point", "float",
            "--weights-only", "-o", art, "--seq-len", "256", "--continuation", "64", "--train-seqs", "2",
            "--gate-seqs", "1",
            "--tokens", "4000", check_rc=0)
    r = json.loads(run_cli("run", tiny_hf, "--calib", art, "--prompt", "the quick brown fox", "--max-new", "4",
                           "--json", check_rc=0).stdout)
    assert r["mechanisms"]["weights"].startswith("int4 g32 asym float-zp") and r["new_tokens"] == 4
    assert r["mechanisms"]["weights_decode"].startswith("dequantized weights")
    p = run_cli("run", tiny_hf, "--calib", art, "--paths", "--prompt", "hi", check_rc=2)
    assert "no decode path predictors" in p.stderr and "Traceback" not in p.stderr

    m, _ = weights.load(tiny_hf)
    m.eval()
    s = ServingSession(m, artifact=art)
    lin = m.layers[0].mlp.down_proj
    assert torch.equal(lin.weight, lin.packed.dequantize().to(lin.weight.dtype))
    assert s.generate(list(range(5, 30)), 3).mechanisms["weights"] == s.weights.describe()
    with pytest.raises(UserError, match="already quantized"):
        ServingSession(m, artifact=art)
    # under a memory cap the packed forms count beside the model's own weights
    from zeroedge.runtime.memory import weights_bytes

    packed = s._packed_bytes()
    assert packed > 0
    m2, _ = weights.load(tiny_hf)
    with pytest.raises(UserError, match="do not fit"):
        ServingSession(m2.eval(), artifact=art, device_memory=weights_bytes(m2.cfg, 4) + packed // 2)


def test_magnitude_paths_gather_rows_of_the_4bit_codes():
    """PathsDecoder on packed weights: the magnitude rule's sparse layers gather rows of the
    input-major 4-bit codes (the kernel checked in Triton's interpreter below) and compute what the
    same decoder computes over the fp weights (the same values); channels really are skipped."""
    from zeroedge.paths.sparse import PathPolicy
    from zeroedge.quant.apply import apply
    from zeroedge.quant.packed import PackedInputs
    from zeroedge.runtime.fast import PathsDecoder

    m = M.build("tiny", seed=6).eval()
    apply(m, _section(Scheme(4, 32, False, "float")), pack=True)
    pol = {i: PathPolicy(method="magnitude", threshold_in=0.5, threshold=0.02) for i in (1, 2)}
    packed_dec = PathsDecoder(m, 40, pol, graph=False, packed=True)
    fp_dec = PathsDecoder(m, 40, pol, graph=False, packed=False)
    assert isinstance(packed_dec.ffn.paths[1]["w13t"], PackedInputs)
    _same_steps_and_kept(packed_dec, fp_dec, 7, {1, 2})


def _same_steps_and_kept(packed_dec, fp_dec, seed: int, layers: set):
    """30 decode steps of both decoders give the same logits, and the same channels kept (some,
    not all) in the sparse layers."""
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(seed))
    for t in range(30):
        a, b = packed_dec.step(int(ids[t]), t), fp_dec.step(int(ids[t]), t)
        assert torch.allclose(a, b, atol=1e-4), t
    kept = packed_dec.kept()
    assert set(kept) == layers and all(0 < v < 1 for v in kept.values()) and kept == fp_dec.kept()


def test_predictor_paths_read_live_rows_of_the_4bit_weights():
    """PathsDecoder on packed weights with the predictor rule: the live channels' gate / up rows of
    the 4-bit [W_gate; W_up] (the row-masked GEMV, checked in Triton's interpreter above), then their
    down rows from the input-major codes; the same values as the decoder over the fp weights (which
    holds the same dequantized numbers), and channels really are skipped."""
    from zeroedge.paths.predictor import fit_predictor
    from zeroedge.paths.sparse import PathPolicy
    from zeroedge.quant.apply import apply
    from zeroedge.quant.packed import PackedInputs, PackedLinear
    from zeroedge.runtime.fast import PathsDecoder

    m = M.build("tiny", seed=8).eval()
    apply(m, _section(Scheme(4, 32, False, "float")), pack=True)
    g = torch.Generator().manual_seed(9)
    pol = {}
    for i in (0, 2):
        x = torch.randn(256, m.cfg.dim, generator=g)
        pr = fit_predictor(x, m.layers[i].mlp, rank=8)
        pr.threshold = float(pr.scores(x).flatten().quantile(0.5))
        pol[i] = PathPolicy(method="predictor", predictor=pr)
    packed_dec = PathsDecoder(m, 40, pol, graph=False, packed=True)
    fp_dec = PathsDecoder(m, 40, pol, graph=False, packed=False)
    p = packed_dec.ffn.paths[0]
    assert p["kind"] == "predictor_packed" and isinstance(p["w13"], PackedLinear)
    assert isinstance(p["wdt"], PackedInputs)
    _same_steps_and_kept(packed_dec, fp_dec, 10, {0, 2})


GATHER = r'''
import torch
from zeroedge.quant.groupwise import Scheme
from zeroedge.quant.packed import PackedLinear, PackedInputs
from zeroedge.quant import triton_gemv as tg

torch.manual_seed(0)
for sch in [Scheme(4, 32, False, "float"), Scheme(4, 32, True), Scheme(8, 64, True)]:
    p = PackedLinear.from_weight(torch.randn(48, 200) * 0.05, sch)
    pi = PackedInputs.of(p)
    assert torch.equal(pi.dequantize(), p.dequantize().t())
    x = torch.randn(1, 200)
    x[0, 10:150] = 0                      # whole groups of zero inputs, and a partial one
    ref = x @ p.dequantize().t()
    for split in (1, 3, None):
        for bc in (8, 64, None):           # None: the launcher's own tile
            y = tg.gather_inputs(x, pi, BC=bc, split=split)
            assert y.shape == (1, 48) and torch.allclose(y, ref, atol=1e-5), (sch, split, bc)
refused(lambda: tg.gather_inputs(torch.randn(1, 10), pi), "inputs")
refused(lambda: PackedInputs.of(PackedLinear.from_weight(torch.randn(7, 64), Scheme(4, 32, True))),
        "even number of outputs")
print("OK")
'''


@pytest.mark.interpreter_script(interpreter_scripts.register("input_major_gather", REFUSED + GATHER))
def test_input_major_gather_kernel_in_the_triton_interpreter():
    interpreter_scripts.check("input_major_gather")
