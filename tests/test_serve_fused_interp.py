"""The engine step's fused elementwise kernels (zeroedge/runtime/fused.py) in Triton's CPU interpreter,
against the torch forms they replace (zeroedge.serve.batch's RoPE and KV write, TorchLinears'
residual, RMSNorm and SwiGLU gate), in fp32 and fp16, at sizes that are not powers of two: RoPE and
the write equal torch's bit for bit (only the first N rows write, every other slot is untouched);
the norm and the gate within an ulp; and a row computed alone equals the same row in a batch. The
whole step through them: tests/test_paged_attention_interp.py; on CUDA, device_tests/test_serve_gpu.py."""
import interpreter_scripts
import pytest

SCRIPT = '''
import torch
import torch.nn.functional as F
from zeroedge.runtime import fused as FU

g = torch.Generator().manual_seed(0)
for dt, ulp in ((torch.float32, 1e-6), (torch.float16, 1e-3)):
    M, H, nkv, hd, N = 5, 6, 2, 16, 3
    qkv = torch.randn(M, (H + 2 * nkv) * hd, generator=g).to(dt)
    f = torch.outer(torch.randint(0, 4000, (M,), generator=g).float(),
                    1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)))
    cos, sin = torch.cat((f, f), -1).cos().to(dt), torch.cat((f, f), -1).sin().to(dt)
    K, V = torch.randn(40, nkv, hd, generator=g).to(dt), torch.randn(40, nkv, hd, generator=g).to(dt)
    K2, V2 = K.clone(), V.clone()
    slots = torch.tensor([3, 17, 30])
    q = FU.rope_store(qkv, cos, sin, K, V, slots, H, nkv)
    x = qkv.view(M, H + 2 * nkv, hd)
    qk = x[:, :H + nkv]
    qk = qk * cos[:, None] + torch.cat((-qk[..., hd // 2:], qk[..., :hd // 2]), -1) * sin[:, None]
    K2.index_copy_(0, slots, qk[:N, H:])
    V2.index_copy_(0, slots, x[:N, H + nkv:])
    assert torch.equal(q, qk[:, :H]) and torch.equal(K, K2) and torch.equal(V, V2), dt
    one = FU.rope_store(qkv[-1:].contiguous(), cos[-1:].contiguous(), sin[-1:].contiguous(), K, V,
                        slots[:0], H, nkv)
    assert torch.equal(one[0], q[-1]) and torch.equal(K, K2)

    D = 72
    a, b = torch.randn(M, D, generator=g).to(dt), torch.randn(M, D, generator=g).to(dt)
    w = torch.randn(D, generator=g).to(dt)
    xo, n = FU.add_rms_norm(a, b, w, 1e-5)
    assert torch.equal(xo, a + b)
    want = F.rms_norm((a + b).float(), (D,), eps=1e-5).to(dt) * w
    assert float((n.float() - want.float()).abs().max()) <= ulp * float(want.float().abs().max()), dt
    assert torch.equal(FU.add_rms_norm(a[2:3], b[2:3], w, 1e-5)[1][0], n[2])
    same, n0 = FU.add_rms_norm(a, None, w, 1e-5)
    want = F.rms_norm(a.float(), (D,), eps=1e-5).to(dt) * w
    assert same is a and float((n0.float() - want.float()).abs().max()) <= ulp * float(want.float().abs().max())

    gu = torch.randn(M, 2 * 1100, generator=g).to(dt)       # two blocks of the gate, the second partial
    got = FU.silu_mul(gu)
    gg, uu = gu.chunk(2, -1)
    want = F.silu(gg) * uu
    assert float((got.float() - want.float()).abs().max()) <= ulp * float(want.float().abs().max()), dt
    assert torch.equal(FU.silu_mul(gu[1:2].contiguous())[0], got[1])
print("OK")
'''


@pytest.mark.interpreter_script(interpreter_scripts.register("serve_fused", SCRIPT))
def test_fused_step_kernels_in_the_triton_interpreter():
    pytest.importorskip("triton")
    interpreter_scripts.check("serve_fused")
