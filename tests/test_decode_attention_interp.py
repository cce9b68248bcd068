"""The dense decoder's fused attention (zeroedge/kv/decode_attention.py: RoPE, the cache write and
split attention in two Triton kernels) in Triton's CPU interpreter: the kernels against the torch
reference at positions that fall on share and block edges, GQA groups that are not powers of two
and fp16 caches; and a whole DenseDecoder(attn="triton") against the model's own forward, token by
token after a prefix. The same decoder runs on CUDA in device_tests/test_decoders_gpu.py."""
import os
import textwrap

import interpreter_scripts
import pytest

SCRIPT = textwrap.dedent('''
    import torch
    from zeroedge.kv import decode_attention as DA
    from zeroedge import model as M
    from zeroedge.kv import evaluate as E
    from zeroedge.runtime.fast import DenseDecoder

    g = torch.Generator().manual_seed(0)
    cases = [(8, 2, 64, 300, p, 4, 16, torch.float32) for p in (0, 15, 16, 63, 64, 131, 299)]
    cases += [(9, 3, 32, 200, 199, 8, 16, torch.float32), (6, 6, 16, 100, 57, 3, 32, torch.float16),
              (4, 1, 16, 40, 39, 64, 16, torch.float32)]          # more shares than blocks
    for H, nkv, hd, L, pos, S, BN, dt in cases:
        qkv = torch.randn((H + 2 * nkv) * hd, generator=g).to(dt)
        f = torch.outer(torch.arange(L).float(), torch.rand(hd // 2, generator=g))
        cos = torch.cat((f, f), -1).cos().to(dt)
        sin = torch.cat((-f.sin(), f.sin()), -1).to(dt)
        kv = torch.randn(2, nkv, L, hd, generator=g).to(dt)
        kv[:, :, pos + 1:] = float("nan")                 # never read: positions after pos
        got_kv = kv.clone()
        want = DA.rope_attend_ref(qkv, cos, sin, pos, kv, H)
        shares = DA.Shares(H, hd, "cpu", S)
        q_out = torch.empty(H, hd, dtype=dt)
        got = DA.rope_attend(qkv, cos, sin, torch.tensor([pos]), got_kv, H, shares, block=BN, q_out=q_out)
        tol = 1e-5 if dt == torch.float32 else 2e-3
        assert float((got.float() - want.float()).abs().max()) < tol, (H, nkv, pos, S)
        x = qkv.view(H + 2 * nkv, hd)[:H].float()
        q_want = (x * cos[pos].float() + x.roll(hd // 2, -1) * sin[pos].float()).to(dt)
        assert float((q_out.float() - q_want.float()).abs().max()) < tol
        assert torch.equal(got_kv[:, :, : pos + 1], kv[:, :, : pos + 1])       # the new token written
        assert got_kv[:, :, pos + 1:].isnan().all()                              # nothing after it
    bad = [(qkv, cos, sin, torch.zeros(2, 2, 8, 24), 4, DA.Shares(4, 24, "cpu"), "power-of-two"),
           (qkv[:-1], cos, sin, kv, H, DA.Shares(H, hd, "cpu"), "q/k/v of"),
           (qkv, cos[:-1], sin, kv, H, DA.Shares(H, hd, "cpu"), "cos / sin"),
           (qkv, cos, sin, kv, H, DA.Shares(H + 1, hd, "cpu"), "shares for")]
    huge = torch.zeros(16).as_strided((2, 1, 2 ** 26, 16), (0, 0, 0, 1))     # 2^31 values, no memory
    bad.append((torch.zeros(96), torch.zeros(1, 16), torch.zeros(1, 16), huge, 4, DA.Shares(4, 16, "cpu"), "2^31"))
    for q_, c_, s_, kv_, h_, sh_, words in bad:
        try:
            DA.rope_attend(q_, c_, s_, torch.tensor([0]), kv_, h_, sh_)
            raise SystemExit(f"accepted: {words}")
        except ValueError as e:
            assert words in str(e), e

    from zeroedge.runtime.fast import DenseAttention
    try:                                  # refused before the cache is allocated
        DenseAttention(2 ** 26, attn="triton").bind(1, 1, 4, 16, "cpu", torch.float16)
        raise SystemExit("a cache of 2^31 values a layer was accepted")
    except ValueError as e:
        assert "2^31" in str(e), e

    # whole decoders: 4 shares a kv head instead of the default's 32 (the interpreter runs programs one
    # by one; the shares' edges are the cases' above)
    DA.SPLITS = 4
    m = M.build("tiny", seed=0)
    ids = torch.randint(0, m.cfg.vocab_size, (1, 90), generator=g)
    with torch.no_grad():
        full = m(ids)[0]
    P = 70
    pre = E.prefill(m, ids[0, :P].tolist(), stats=False)
    dec = DenseDecoder(m, 96, graph=False, attn="triton")
    assert dec.attention.takes_qkv
    dec.load_prefix(pre["k"], pre["v"])
    for t in range(P, 90):
        assert torch.allclose(dec.step(ids[0, t].item(), t), full[t], atol=1e-4), t

    # a drafter's window (4 sinks and the last 12 positions in a ring of 16 slots) through the same
    # kernel: the new token at its ring slot, attention over the filled slots, against SDPA
    decs = [DenseDecoder(m, 96, graph=False, attn=a, window=12) for a in ("triton", "sdpa")]
    assert decs[0].attention.takes_qkv and decs[0].attention.slots == 16
    for t in range(40):
        a, b = (d.step(ids[0, t].item(), t) for d in decs)
        assert torch.allclose(a, b, atol=1e-4), ("window", t)
    assert torch.allclose(decs[0].attention.kv, decs[1].attention.kv, atol=1e-5)

    # the thermal window through the same kernel: the new token at its window index, RoPE at its
    # position (lag 0: the refresh first, from the raw query; lag 1: after, from the kernel's
    # rotated query), against the same policy with SDPA over the masked window
    from zeroedge.runtime.fast import ThermalDecoder
    P = 64
    pre = E.prefill(m, ids[0, :P].tolist(), stats=False)
    for lag in (0, 1):
        decs = [ThermalDecoder(m, P, 14, budget=0.5, page_size=8, rank=8, recent_pages=1, fetch=2, lag=lag,
                               graph=False, attn=a) for a in ("triton", "sdpa")]
        assert [d.attention.takes_qkv for d in decs] == [True, False]
        for d in decs:
            d.load_prefix(pre["k"], pre["v"], pre["qcov"])
        start = decs[0].attention.slot_page.clone()
        for t in range(P, 78):
            a, b = (d.step(ids[0, t].item(), t) for d in decs)
            assert torch.allclose(a, b, atol=1e-4), (lag, t)
            assert torch.equal(decs[0].attention.slot_page, decs[1].attention.slot_page), (lag, t)
        assert not torch.equal(decs[0].attention.slot_page, start)          # pages moved
    print("OK")
''')


@pytest.mark.interpreter_script(interpreter_scripts.register("decode_attention", SCRIPT))
def test_fused_decode_attention_in_the_triton_interpreter():
    pytest.importorskip("triton")
    interpreter_scripts.check("decode_attention")


def test_the_triton_attention_is_refused_where_it_cannot_run():
    from zeroedge import model as M
    from zeroedge.runtime.fast import DenseDecoder

    m = M.build("tiny", seed=0)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="CUDA device with Triton"):
            DenseDecoder(m, 16, graph=False, attn="triton")
    d = DenseDecoder(m, 16, graph=False)
    assert not d.attention.takes_qkv                                     # auto on a CPU: sdpa
    for pos in (16, -1):                  # outside the cache: refused before any kernel writes
        with pytest.raises(ValueError, match="outside the cache"):
            d.step(1, pos)
    with pytest.raises(ValueError, match="attn must be"):
        DenseDecoder(m, 16, graph=False, attn="flash")
