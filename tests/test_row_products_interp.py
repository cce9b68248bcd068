"""The batch-invariant product (zeroedge/runtime/row_products.py) in Triton's CPU interpreter: against
torch's product in fp32 and fp16, with and without a bias, at sizes that are not multiples of its
tiles (rows past one tile, an inner dimension past one block); each row of a product of M rows equals
the same row of a product of 70 rows; bad shapes are a one-line ValueError. On a tiny model: the
invariant dense decoder's steps follow the model, and its checks give those steps' logits; the
invariant engine step gives a sequence the same logits alone and beside a verify segment. Its bit-for-bit row
invariance on a GPU, where cuBLAS's is not: device_tests/test_decoders_gpu.py and
benchmarks/gpu/row_products_gpu.py."""
import interpreter_scripts
import pytest

SCRIPT = '''
import torch
from zeroedge.runtime import row_products as RP

g = torch.Generator().manual_seed(0)
for dt, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
    N, K = 40, 200                       # K past one block of 128, N past one tile of 16 columns
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dt)
    b = torch.randn(N, generator=g).to(dt)
    x = torch.randn(70, K, generator=g).to(dt)        # 70 rows: past one tile of 64
    ref = x.double() @ w.double().t()
    full = RP.linear(x, w)
    assert full.dtype == dt and full.shape == (70, N)
    assert float((full.double() - ref).abs().max() / ref.abs().max()) < tol, dt
    yb = RP.linear(x, w, b)
    assert float((yb.double() - (ref + b.double())).abs().max() / ref.abs().max()) < 2 * tol, dt
    for M in (1, 3, 64, 65):
        assert torch.equal(RP.linear(x[:M], w), full[:M]), (dt, M)
    assert torch.equal(RP.linear(x[5:6], w)[0], full[5])
    assert RP.linear(x[:0], w).shape == (0, N)
for bad in ((torch.zeros(3, 8), torch.zeros(4, 9)), (torch.zeros(3, 8), torch.zeros(4, 8, dtype=torch.float16)),
            (torch.zeros(8), torch.zeros(4, 8))):
    try:
        RP.linear(*bad)
    except ValueError as e:
        assert "\\n" not in str(e)
    else:
        raise AssertionError(bad)

# the invariant decoder (a step is a check of one token) and engine step, on a tiny model
from zeroedge import model as M
from zeroedge.kv import evaluate as E
from zeroedge.runtime.fast import DenseDecoder
from zeroedge.serve.batch import BatchStep, PagedKV, Segment

torch.set_num_threads(1)
m = M.build("tiny", seed=0).eval()
seq = torch.randint(0, m.cfg.vocab_size, (60,), generator=g).tolist()
pre = E.prefill(m, seq[:40], stats=False)
d, ref = DenseDecoder(m, 64, graph=False, invariant=True), DenseDecoder(m, 64, graph=False, attn="sdpa")
assert d.attention.attn == "triton" and d.verify_linears.invariant
for x in (d, ref):
    x.load_prefix(pre["k"], pre["v"])
plain = torch.stack([d.step(t, 40 + i).clone() for i, t in enumerate(seq[40:46])])
for i, t in enumerate(seq[40:46]):
    assert torch.allclose(plain[i], ref.step(t, 40 + i), atol=1e-4), i
assert torch.equal(d.verify(seq[40:46], 40), plain) and torch.equal(d.verify(seq[42:44], 42), plain[2:4])
try:
    d.restrict_head([1, 2])
    raise SystemExit("an invariant decoder restricted its head")
except ValueError as e:
    assert "whole vocabulary" in str(e)
pool = PagedKV(m.cfg, 40, 8, "cpu", torch.float32)
st = BatchStep(m, pool, attention="paged", invariant=True)
a, b = pool.alloc(10), pool.alloc(10)
st.forward([Segment(a, seq[:37], 0), Segment(b, seq[5:30], 0)])
alone = st.forward([Segment(a, [seq[37]], 37)])[0]
beside = st.forward([Segment(a, [seq[37]], 37), Segment(b, seq[30:35], 25, verify=True)])[0]
assert torch.equal(alone, beside)
print("OK")
'''


@pytest.mark.interpreter_script(interpreter_scripts.register("row_products", SCRIPT))
def test_row_products_in_the_triton_interpreter():
    pytest.importorskip("triton")
    interpreter_scripts.check("row_products")
