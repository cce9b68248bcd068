"""Packed 4- / 8-bit weights in the torch decode loop (zeroedge.quant.packed, quant.triton_gemv,
runtime.fast): the packed form is the group-wise weight, the decoders over packed weights compute
what the fake-quantized model computes, and the Triton GEMV (run in Triton's interpreter on this CPU)
computes the reference product with every epilogue and split."""
import os
import subprocess
import sys

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


def test_decoders_over_packed_weights_compute_the_quantized_model():
    """Dense and thermal (everything hot) decoders on a packed model give the fake-quantized model's
    logits, step for step; the decoder holds the packed forms (q/k/v and gate/up fused), the LM head
    too."""
    from zeroedge.kv import evaluate as E
    from zeroedge.quant.apply import apply
    from zeroedge.quant.packed import PackedLinear
    from zeroedge.runtime.fast import DenseDecoder, ThermalDecoder

    m = M.build("tiny", seed=4).eval()
    apply(m, _section(Scheme(4, 32, False, "float")), pack=True)
    ids = torch.randint(0, 256, (1, 72), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = m(ids)[0]
    P = 56
    pre = E.prefill(m, ids[0, :P].tolist(), stats=False)
    dense = DenseDecoder(m, 72, graph=False)
    dense.load_prefix(pre["k"], pre["v"])
    thermal = ThermalDecoder(m, P, 16, budget=1.0, page_size=8, rank=8, graph=False)
    thermal.load_prefix(pre["k"], pre["v"], pre["qcov"])
    w = dense.W.layers[0]["packed"]
    assert isinstance(w["wqkv"], PackedLinear) and w["wqkv"].n == 64 + 2 * 32
    assert isinstance(w["w13"], PackedLinear) and w["w13"].n == 2 * 128
    assert isinstance(dense.W.lm_head, PackedLinear) and dense.W.lm_head.bits == 8
    for t in range(P, 72):
        tok = ids[0, t].item()
        assert torch.allclose(dense.step(tok, t), full[t], atol=1e-4)
        assert torch.allclose(thermal.step(tok, t), full[t], atol=1e-4)


def test_packing_without_a_weights_section_changes_nothing():
    from zeroedge.runtime.fast import DenseDecoder

    m = M.build("tiny", seed=4).eval()
    d = DenseDecoder(m, 16, graph=False)
    assert "packed" not in d.W.layers[0] and d.W.lm_head is None


SCRIPT = r'''
import torch
from zeroedge.quant.groupwise import Scheme, fake_quantize
from zeroedge.quant.packed import PackedLinear
from zeroedge.quant import triton_gemv as tg

torch.manual_seed(0)
for sch in [Scheme(4, 32, False, "float"), Scheme(4, 128, True), Scheme(8, 64, True)]:
    N, K = 48, 200                        # K not a multiple of the group; N not of the row block
    w = torch.randn(N, K) * 0.05
    p = PackedLinear.from_weight(w, sch)
    wd = p.dequantize()
    x = torch.randn(1, K)
    r = torch.randn(1, N)
    ref = x @ wd.T
    for cfg in [dict(BN=8, NG=2, SPLIT=1, num_warps=4), dict(BN=16, NG=1, SPLIT=3, num_warps=4), None]:
        y = tg.gemv(x, p, config=cfg)
        assert y.shape == (1, N) and torch.allclose(y, ref, atol=1e-5), (sch, cfg, (y - ref).abs().max())
        y = tg.gemv(x, p, residual=r, config=cfg)
        assert torch.allclose(y, ref + r, atol=1e-5), (sch, cfg)
    g, u = ref.chunk(2, -1)
    y = tg.gemv(x, p, swiglu=True, config=dict(BN=8, NG=4, SPLIT=2, num_warps=4))
    assert y.shape == (1, N // 2) and torch.allclose(y, torch.nn.functional.silu(g) * u, atol=1e-5), sch
    yb = tg.gemv(x.bfloat16(), p)
    assert yb.dtype == torch.bfloat16 and torch.allclose(yb.float(), x.bfloat16().float() @ wd.T, atol=2e-2)
try:
    tg.gemv(torch.randn(1, 10), p)
except ValueError as e:
    assert "inputs" in str(e)
else:
    raise AssertionError("a wrong input size was accepted")
print("OK")
'''


def test_packed_gemv_kernel_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
