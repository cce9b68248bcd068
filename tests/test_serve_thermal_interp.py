"""Thermal KV's Triton kernels in the serving engine (zeroedge/kv/paged_attention.py: the page scores
from the key sketch, the tables each row and kv head reads, paged attention over a table a kv head) in
Triton's CPU interpreter: against their torch references, and BatchStep with thermal rows through
gathered attention, paged attention and the captured step's body, whose verify rows equal plain
decode steps bit for bit. On CUDA: device_tests/test_serve_gpu.py."""
import textwrap

import interpreter_scripts
import pytest

SCRIPT = textwrap.dedent('''
    import torch
    from zeroedge import model as M
    from zeroedge.kv import paged_attention as PA
    from zeroedge.kv.kernels import pack_int4
    from zeroedge.serve.batch import BatchStep, PagedKV, Segment
    from zeroedge.serve.thermal import ThermalSketches

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    for B, nkv, grp, r, ps, N in [(3, 2, 3, 32, 8, 13), (2, 3, 4, 16, 16, 5)]:
        slots = 40 * ps
        codes = pack_int4(torch.randint(-7, 8, (nkv, slots, r), generator=g))
        scales = (torch.rand(nkv, slots, generator=g) + 0.1).half()
        pages = torch.randperm(40, generator=g)[:B * N].view(B, N).to(torch.int32)
        qr = torch.randn(B, nkv, grp, r, generator=g)
        want = PA.paged_sketch_lse_ref(qr, codes, scales, pages, ps)
        assert float((PA.paged_sketch_lse(qr, codes, scales, pages, ps) - want).abs().max()) < 1e-4
        counts = torch.tensor([N - 2] + [N] * (B - 1))
        got = PA.paged_sketch_lse(qr, codes, scales, pages, ps, counts=counts)
        assert torch.equal(got[0, ..., :N - 2], PA.paged_sketch_lse(qr, codes, scales, pages, ps)[0, ..., :N - 2])
    H, nkv, hd, ps = 8, 2, 32, 8
    k, v = torch.randn(30 * ps, nkv, hd, generator=g), torch.randn(30 * ps, nkv, hd, generator=g)
    tables = torch.randint(0, 30, (3, nkv, 6), generator=g).to(torch.int32)
    lens = torch.tensor([5, 48, 20], dtype=torch.int32)
    q = torch.randn(3, H, hd, generator=g)
    got = PA.paged_attend(q, k, v, tables, lens, ps, splits=4, block=16)
    assert float((got - PA.paged_attend_ref(q, k, v, tables, lens, ps)).abs().max()) < 1e-5
    one = tables[:, :1].contiguous()              # one table for every head: the (B, W) table's result
    assert torch.equal(PA.paged_attend(q, k, v, one.expand(-1, nkv, -1).contiguous(), lens, ps, splits=4, block=16),
                       PA.paged_attend(q, k, v, one[:, 0].contiguous(), lens, ps, splits=4, block=16))

    m = M.build("tiny", seed=0).eval()
    cfg = m.cfg
    ids = torch.randint(0, cfg.vocab_size, (3, 340), generator=g).tolist()
    lens0 = [300, 30, 260]
    def eager(body):         # the captured step's inputs on the CPU: the graph's body run at each replay
        out = body()
        return (lambda: out.copy_(body())), out

    outs = {}
    for mode in ("gather", "paged", "replayed"):
        pool = PagedKV(cfg, 140, 8, "cpu", torch.float32)
        hot = ThermalSketches(pool, cfg, 0.25, 3, triton=True)
        st = BatchStep(m, pool, attention="gather" if mode == "gather" else "paged", hot=hot)
        if mode == "replayed":
            st.graphs, st._graphed = True, eager
        pages = [pool.alloc(45) for _ in range(3)]
        res = [st.forward([Segment(p, ids[j][:n], 0) for j, (p, n) in enumerate(zip(pages, lens0))])]
        hots = [hot.build(p, n) for p, n in zip(pages, lens0)]
        assert hots[1] is None and hots[0].slots < hots[0].scored and hots[2].slots < hots[2].scored
        if mode == "gather":     # the kernels' tables against the torch path's: the same pages per head
            rows = hot.device_rows(hot.rows([(p, n + 1, h) for p, n, h in zip(pages, lens0, hots)]))
            qq = torch.randn(3, cfg.n_heads, cfg.head_dim, generator=g)
            for li in range(cfg.n_layers):
                a, la = hot.tables(li, qq, rows)
                hot.triton = False
                b, lb = hot.tables(li, qq, rows)
                hot.triton = True
                assert torch.equal(la, lb)
                for j in range(3):
                    n = -(-int(la[j]) // 8)
                    for kv in range(cfg.n_kv_heads):
                        assert set(a[j, kv, :n].tolist()) == set(b[j, kv, :n].tolist()), (li, j, kv)
        pos = list(lens0)
        for live in ([0, 1, 2], [0, 2], [1], [0, 1, 2]):
            res.append(st.forward([Segment(pages[j], [ids[j][pos[j]]], pos[j], hot=hots[j]) for j in live]))
            for j in live:
                pos[j] += 1
        res.append(st.forward([Segment(pages[0], ids[0][pos[0]:pos[0] + 4], pos[0], verify=True, hot=hots[0]),
                               Segment(pages[2], [ids[2][pos[2]]], pos[2], hot=hots[2])]))
        for i in range(4):       # the verify rows are the plain steps at those positions, bit for bit
            one = st.forward([Segment(pages[0], [ids[0][pos[0] + i]], pos[0] + i, hot=hots[0])])
            assert torch.equal(one[0], res[-1][i]), (mode, i)
        outs[mode] = res
        if mode == "replayed":   # plain steps and steps with hot rows: graphs of their own
            assert {type(k) for k in st._captured} == {int, tuple}
    for mode in ("paged", "replayed"):
        for x, y in zip(outs["gather"], outs[mode]):
            assert x.shape == y.shape and torch.allclose(x, y, atol=1e-4), mode
    print("OK")
''')


@pytest.mark.interpreter_script(interpreter_scripts.register("serve_thermal", SCRIPT))
def test_thermal_kernels_in_the_triton_interpreter():
    pytest.importorskip("triton")
    interpreter_scripts.check("serve_thermal")
