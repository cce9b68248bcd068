"""The serving engine's paged decode attention (zeroedge/kv/paged_attention.py: two Triton kernels
that read each row's keys and values through its page table) in Triton's CPU interpreter: the kernels
against the torch reference at lengths on page, block and share edges, GQA groups that are not powers
of two and an fp16 pool; a row computed alone equals the same row in a batch; and BatchStep with
paged attention against the gathered SDPA step through prompt chunks, decode rows and a verify
segment whose rows equal plain decode steps bit for bit; and the dense decoder's Decoder.verify
through the same kernel against its steps. On CUDA: device_tests/test_serve_gpu.py."""
import os
import textwrap

import interpreter_scripts
import pytest

SCRIPT = textwrap.dedent('''
    import torch
    from zeroedge.kv import paged_attention as PA
    from zeroedge import model as M
    from zeroedge.serve.batch import BatchStep, PagedKV, Segment

    torch.set_num_threads(1)          # a row computed alike in any batch (zeroedge.serve.batch)
    g = torch.Generator().manual_seed(0)
    for H, nkv, hd, ps, lens, S, BN, dt in [(8, 2, 64, 16, [1, 16, 17, 64, 65, 130], 4, 16, torch.float32),
                                            (9, 3, 32, 8, [5, 40], 3, 16, torch.float32),
                                            (4, 4, 16, 16, [33, 2], 8, 16, torch.float16),
                                            (4, 1, 16, 4, [7], 16, 16, torch.float32)]:   # more shares than blocks
        B, W = len(lens), max(-(-n // ps) for n in lens) + 1
        n_pages = B * W + 2
        k = torch.randn(n_pages * ps, nkv, hd, generator=g).to(dt)
        v = torch.randn(n_pages * ps, nkv, hd, generator=g).to(dt)
        pages = torch.randperm(n_pages, generator=g)[: B * W].view(B, W).to(torch.int32)
        q = torch.randn(B, H, hd, generator=g).to(dt)
        lt = torch.tensor(lens, dtype=torch.int32)
        want = PA.paged_attend_ref(q, k, v, pages, lt, ps)
        got = PA.paged_attend(q, k, v, pages, lt, ps, splits=S, block=BN)
        tol = 1e-5 if dt == torch.float32 else 3e-3
        assert float((got.float() - want.float()).abs().max()) < tol, (H, nkv, lens)
        alone = PA.paged_attend(q[-1:].contiguous(), k, v, pages[-1:].contiguous(), lt[-1:], ps, splits=S, block=BN)
        assert torch.equal(alone[0], got[-1])
    try:
        PA.paged_attend(q, k, v, pages.long(), lt, ps)
        raise SystemExit("int64 pages accepted")
    except ValueError as e:
        assert "int32 pages" in str(e), e

    m = M.build("tiny", seed=0).eval()
    ids = torch.randint(0, m.cfg.vocab_size, (3, 80), generator=g).tolist()
    def eager(body):         # the captured step's inputs on the CPU: the graph's body run at each replay
        out = body()
        return (lambda: out.copy_(body())), out

    outs = {}
    for mode in ("gather", "paged", "replayed"):
        pool = PagedKV(m.cfg, 40, 8, "cpu", torch.float32)
        att = "gather" if mode == "gather" else "paged"
        st = BatchStep(m, pool, attention=att)
        assert st.attention == att and not st.graphs
        if mode == "replayed":
            st.graphs, st._graphed = True, eager
        a, b, c = pool.alloc(10), pool.alloc(10), pool.alloc(10)
        res = [st.forward([Segment(a, ids[0][:37], 0), Segment(b, ids[1][:20], 0), Segment(c, ids[2][:50], 0)])]
        res.append(st.forward([Segment(a, [ids[0][37]], 37), Segment(b, ids[1][20:26], 20, verify=True),
                               Segment(c, ids[2][50:64], 50)]))
        res.append(st.forward([Segment(a, [ids[0][38]], 38), Segment(c, [ids[2][64]], 64)]))
        res.append(st.forward([Segment(c, ids[2][65:71], 65, verify=True), Segment(b, [ids[1][26]], 26),
                               Segment(a, [ids[0][39]], 39)]))
        res.append(st.forward([Segment(b, [ids[1][27]], 27)]))
        outs[mode] = res
        if mode == "replayed":   # 2 and 1 rows: one graph of min_rows (4 on an AVX2 CPU); 8 rows (a draft
            mr = st.lin.min_rows  # of 6): one of 8 (or of min_rows, where more)
            assert set(st._captured) == {max(1, mr), max(2, mr), max(8, mr)}, (st._captured, mr)
        if mode == "paged":      # the verify rows of b are the plain steps at 20..25, bit for bit
            for i in range(6):
                one = st.forward([Segment(b, [ids[1][20 + i]], 20 + i), Segment(a, [ids[0][40]], 40)])
                assert torch.equal(one[0], res[1][1 + i]), i
    for mode in ("paged", "replayed"):
        for x, y in zip(outs["gather"], outs[mode]):
            assert x.shape == y.shape and torch.allclose(x, y, atol=1e-4), mode

    # Decoder.verify through the same kernel (the dense cache as one page) against the decoder's steps
    from zeroedge.kv import evaluate as E
    from zeroedge.runtime.fast import DenseDecoder

    seq = torch.tensor(ids[0][:60])
    pre = E.prefill(m, seq[:40].tolist(), stats=False)
    a, b = (DenseDecoder(m, 64, graph=False, attn=at) for at in ("triton", "sdpa"))
    for d in (a, b):
        d.load_prefix(pre["k"], pre["v"])
    rows = a.verify(seq[40:46].tolist(), 40)
    for i in range(6):
        assert torch.allclose(rows[i], b.step(int(seq[40 + i]), 40 + i), atol=1e-4), i
    assert torch.allclose(a.step(int(seq[46]), 46), b.step(int(seq[46]), 46), atol=1e-4)   # the cache it wrote
    print("OK")
''')


@pytest.mark.interpreter_script(interpreter_scripts.register("paged_attention", SCRIPT))
def test_paged_decode_attention_in_the_triton_interpreter():
    pytest.importorskip("triton")
    interpreter_scripts.check("paged_attention")


def test_paged_attention_is_refused_where_it_cannot_run():
    import torch
    from zeroedge import model as M
    from zeroedge.serve.batch import BatchStep, PagedKV

    m = M.build("tiny", seed=0)
    pool = PagedKV(m.cfg, 4, 8, "cpu", torch.float32)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="Triton on CUDA"):
            BatchStep(m, pool, attention="paged")
    step = BatchStep(m, pool)
    assert step.attention == "gather" and not step.graphs                 # auto on a CPU
    with pytest.raises(ValueError, match="attention must be"):
        BatchStep(m, pool, attention="flash")
