"""The serving engine's step on a CUDA GPU: the paged Triton attention against its torch reference,
and BatchStep with paged attention and CUDA graphs against the eager step over gathered pages (same
bf16 weights, same pool contents) through prompt chunks, decode batches of changing size, and a
verify segment (its rows replayed as decode rows). Skips without a CUDA GPU.

    python -m pytest -q device_tests/test_serve_gpu.py
"""
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to PyTorch")


@pytest.mark.parametrize("H,nkv,hd,ps,lens", [(32, 8, 64, 16, [1, 16, 17, 8192]), (9, 3, 64, 16, [5, 300]),
                                              (16, 16, 128, 8, [1000])])
def test_paged_kernel_matches_the_reference(H, nkv, hd, ps, lens):
    from zeroedge.kv.paged_attention import paged_attend, paged_attend_ref

    g = torch.Generator(device="cuda").manual_seed(0)
    B, W = len(lens), max(-(-n // ps) for n in lens)
    n_pages = B * W + 3
    k = torch.randn(n_pages * ps, nkv, hd, generator=g, device="cuda").bfloat16()
    v = torch.randn(n_pages * ps, nkv, hd, generator=g, device="cuda").bfloat16()
    pages = torch.randperm(n_pages, generator=g, device="cuda")[: B * W].view(B, W).int()
    q = torch.randn(B, H, hd, generator=g, device="cuda").bfloat16()
    lt = torch.tensor(lens, dtype=torch.int32, device="cuda")
    got = paged_attend(q, k, v, pages, lt, ps).float()
    want = paged_attend_ref(q, k, v, pages, lt, ps).float()
    assert float((got - want).abs().max()) < 2e-2


def test_captured_batch_steps_match_the_gathered_eager_steps():
    from zeroedge.model import build
    from zeroedge.serve.batch import BatchStep, PagedKV, Segment

    m = build("smollm2-135m", seed=0).to("cuda", torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.cfg.vocab_size, (4, 400), generator=g).tolist()
    lens0 = [300, 37, 129, 250]
    outs = {}
    for name, kw in (("graph", dict(attention="paged", graphs=True)), ("gather", dict(attention="gather"))):
        pool = PagedKV(m.cfg, 128, 16, "cuda", torch.bfloat16)
        step = BatchStep(m, pool, **kw)
        pages = [pool.alloc(26) for _ in range(4)]
        res = [step.forward([Segment(p, ids[j][:n], 0) for j, (p, n) in enumerate(zip(pages, lens0))])]
        pos = list(lens0)
        for t, live in enumerate([[0, 1, 2, 3], [0, 2], [0, 1, 2, 3], [1, 3], [0, 1, 2, 3], [0, 1, 2]]):
            res.append(step.forward([Segment(pages[j], [ids[j][pos[j]]], pos[j]) for j in live]))
            for j in live:
                pos[j] += 1
        res.append(step.forward([Segment(pages[0], ids[0][pos[0]:pos[0] + 5], pos[0], verify=True),
                                 Segment(pages[1], [ids[1][pos[1]]], pos[1])]))
        outs[name] = [r.float().cpu() for r in res]
        if name == "graph":
            assert set(step._captured) == {4, 8}                  # 2 to 4 rows: one graph; 6 (verify): 8
    for a, b in zip(outs["graph"], outs["gather"]):
        assert a.shape == b.shape and torch.isfinite(a).all()
        rel = ((a - b).norm(dim=-1) / b.norm(dim=-1)).max()
        assert float(rel) < 2e-2


def test_thermal_kernels_match_their_references():
    from zeroedge.kv.kernels import pack_int4
    from zeroedge.kv.paged_attention import paged_attend, paged_attend_ref, paged_sketch_lse, paged_sketch_lse_ref

    g = torch.Generator(device="cuda").manual_seed(0)
    B, nkv, grp, r, ps, N, n_pages = 4, 8, 4, 32, 8, 300, 1400
    codes = pack_int4(torch.randint(-7, 8, (nkv, n_pages * ps, r), generator=g, device="cuda"))
    scales = (torch.rand(nkv, n_pages * ps, generator=g, device="cuda") + 0.1).half()
    pages = torch.randperm(n_pages, generator=g, device="cuda")[: B * N].view(B, N).int()
    qr = torch.randn(B, nkv, grp, r, generator=g, device="cuda")
    got = paged_sketch_lse(qr, codes, scales, pages, ps)
    assert float((got - paged_sketch_lse_ref(qr, codes, scales, pages, ps)).abs().max()) < 1e-3
    k = torch.randn(n_pages * ps, nkv, 64, generator=g, device="cuda").bfloat16()
    v = torch.randn_like(k)
    q = torch.randn(B, nkv * grp, 64, generator=g, device="cuda").bfloat16()
    tables = torch.randint(0, n_pages, (B, nkv, 200), generator=g, device="cuda").int()
    lens = torch.tensor([1, 9, 800, 1600], dtype=torch.int32, device="cuda")
    got = paged_attend(q, k, v, tables, lens, ps).float()
    assert float((got - paged_attend_ref(q, k, v, tables, lens, ps).float()).abs().max()) < 2e-2


def test_captured_thermal_steps_match_the_eager_steps():
    """Thermal KV (zeroedge.serve.thermal) in captured steps against the same eager steps: long prompts
    with sketches beside a short one without, changing batches, a verify segment."""
    from zeroedge.model import build
    from zeroedge.serve.batch import BatchStep, PagedKV, Segment
    from zeroedge.serve.thermal import ThermalSketches

    m = build("smollm2-135m", seed=0).to("cuda", torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.cfg.vocab_size, (3, 1300), generator=g).tolist()
    lens0 = [1200, 40, 700]
    outs = {}
    for graphs in (True, False):
        pool = PagedKV(m.cfg, 500, 8, "cuda", torch.bfloat16)
        hot = ThermalSketches(pool, m.cfg, 0.1, 3)
        step = BatchStep(m, pool, attention="paged", graphs=graphs, hot=hot)
        pages = [pool.alloc(163) for _ in range(3)]
        res = [step.forward([Segment(p, ids[j][:n], 0) for j, (p, n) in enumerate(zip(pages, lens0))])]
        hots = [hot.build(p, n) for p, n in zip(pages, lens0)]
        assert hots[1] is None and hots[0].slots > 1 and hots[2].slots > 1
        pos = list(lens0)
        for live in ([0, 1, 2], [0, 2], [1], [0, 1, 2]):
            res.append(step.forward([Segment(pages[j], [ids[j][pos[j]]], pos[j], hot=hots[j]) for j in live]))
            for j in live:
                pos[j] += 1
        res.append(step.forward([Segment(pages[0], ids[0][pos[0]:pos[0] + 4], pos[0], verify=True, hot=hots[0]),
                                 Segment(pages[2], [ids[2][pos[2]]], pos[2], hot=hots[2])]))
        outs[graphs] = [r.float().cpu() for r in res]
        if graphs:
            assert {type(k) for k in step._captured} == {int, tuple}     # plain steps and steps with hot rows
    for a, b in zip(outs[True], outs[False]):
        assert a.shape == b.shape and torch.isfinite(a).all()
        rel = ((a - b).norm(dim=-1) / b.norm(dim=-1)).max()
        assert float(rel) < 2e-2


def test_engine_serves_thermal_requests_on_cuda():
    """The whole engine on CUDA with thermal KV (zeroedge serve --kv-budget): long prompts take sketches,
    a short one does not, every request completes, the same requests give the same replies again, and
    every sketch row comes back."""
    from zeroedge.model import build
    from zeroedge.serve.backends import TorchBatched
    from zeroedge.serve.engine import Engine
    from zeroedge.weights import ByteTokenizer

    m = build("smollm2-135m", seed=0).to("cuda", torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (2000, 900, 40, 1500)]
    replies = []
    for mode in ("off", "ngram", "off"):
        b = TorchBatched(m, 1 << 30, 4, 512, None, kv_budget=0.1)
        b.warm_up()
        e = Engine(b, ByteTokenizer(), speculative=mode)
        e.start()
        try:
            replies.append(_replies(e, prompts, 32, thermal=True))
        finally:
            e.stop()
        assert b.sketches.in_use() == 0
        assert sum(isinstance(k, tuple) for k in b.step._captured) >= 1          # graphs with thermal rows ran
    assert all(len(r) == 32 for r in replies[0])
    assert replies[0] == replies[2]


def test_engine_packed_drafter_on_cuda():
    """`serve --speculative packed` on CUDA: the engine's requests draft with DecoderDraftModel (one at a
    time: the second concurrent request decodes plainly; over a ring of 4 + 100 slots of its 232
    positions), the drafts are checked and some kept, and the replies equal plain decoding's."""
    from zeroedge.model import build
    from zeroedge.serve.backends import DecoderDraftModel, TorchBatched
    from zeroedge.serve.engine import Engine
    from zeroedge.weights import ByteTokenizer

    m = build("smollm2-135m", seed=0).to("cuda", torch.bfloat16).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, m.cfg.vocab_size, (50,), generator=g).tolist() * 4 for _ in range(2)]
    replies, stats = {}, {}
    for mode in ("off", "packed"):
        b = TorchBatched(m, 1 << 28, 2, 512, None)
        b.warm_up()
        e = Engine(b, ByteTokenizer(), speculative=mode,
                   draft_model=DecoderDraftModel(m, 1024, window=100) if mode == "packed" else None)
        e.start()
        try:
            replies[mode] = _replies(e, prompts, 32)
            stats[mode] = e.spec_stats
        finally:
            e.stop()
    assert replies["packed"] == replies["off"]
    assert stats["packed"].drafted > 0 and stats["packed"].verify_steps > 0


def _replies(engine, prompts, max_tokens: int, **plan) -> list:
    """The engine's greedy replies to the prompts, submitted together."""
    import threading

    from zeroedge.serve.plan import Plan, Sampling

    seqs, done = [], []
    for p in prompts:
        ev = threading.Event()
        done.append(ev)
        seqs.append(engine.submit(Plan(p, Sampling(max_tokens=max_tokens, temperature=0.0), len(p) + max_tokens, 0,
                                       **plan), lambda x, ev=ev: x[0] in ("done", "error") and ev.set()))
    for ev in done:
        assert ev.wait(300)
    return [s.out for s in seqs]


def test_invariant_step_gives_a_sequence_the_same_logits_whatever_is_beside_it():
    """BatchStep(invariant=True): a sequence's logits alone and beside 1-11 others (captured steps of
    other sizes), and a verify segment's rows against plain steps at its positions, equal in every
    bit; and they stay the model's (close to the default step's)."""
    from zeroedge.model import build
    from zeroedge.serve.batch import BatchStep, PagedKV, Segment

    m = build("smollm2-135m", seed=0).to("cuda", torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, m.cfg.vocab_size, (12, 300), generator=g).tolist()
    got = {}
    for inv in (False, True):
        pool = PagedKV(m.cfg, 12 * 20, 16, "cuda", torch.bfloat16)
        step = BatchStep(m, pool, attention="paged", graphs=True, invariant=inv)
        pages = [pool.alloc(20) for _ in range(12)]
        step.forward([Segment(p, ids[j][:200 + j], 0) for j, p in enumerate(pages)])     # prompts
        alone = step.forward([Segment(pages[0], [ids[0][200]], 200)])[0].clone()
        beside = [step.forward([Segment(pages[0], [ids[0][200]], 200)]
                               + [Segment(p, [ids[j][200 + j]], 200 + j) for j, p in enumerate(pages[1:B], 1)])[0]
                  for B in (2, 3, 5, 8, 12)]
        draft = ids[0][200:205]
        check = step.forward([Segment(pages[0], draft, 200, verify=True)])
        plain = torch.stack([step.forward([Segment(pages[0], [t], 200 + i)])[0] for i, t in enumerate(draft)])
        got[inv] = alone
        if inv:
            assert all(torch.equal(b, alone) for b in beside)
            assert torch.equal(check, plain)
    assert float((got[True] - got[False]).norm() / got[False].norm()) < 2e-2
