"""Thermal KV in zeroedge serve's batched engine (zeroedge/serve/thermal.py) on the CPU: the pages each
row and kv head reads are the sink, the tail and the pages `zeroedge run`'s sketch scoring ranks best;
a budget that chooses every page gives the dense step's logits; short prompts take no sketch; and a
real server with --kv-budget runs a long prompt with thermal KV and a short one without. The Triton
kernels (the scoring, the tables, paged attention over them) in tests/test_thermal_interp.py; on CUDA in
device_tests/test_serve_gpu.py."""
import httpx
import pytest
import torch

from conftest import run_cli


def _step(budget, n_pages=260, capacity=4):
    from zeroedge import model as M
    from zeroedge.serve.batch import BatchStep, PagedKV
    from zeroedge.serve.thermal import ThermalSketches

    m = M.build("tiny", seed=0).eval()
    pool = PagedKV(m.cfg, n_pages, 8, "cpu", torch.float32)
    hot = ThermalSketches(pool, m.cfg, budget, capacity, triton=False) if budget else None
    return m, pool, hot, BatchStep(m, pool, hot=hot)


def _prefill(step, pool, ids, lens):
    from zeroedge.serve.batch import Segment

    pages = [pool.alloc(pool.pages_for(n + 16)) for n in lens]
    step.forward([Segment(p, ids[j][:n], 0) for j, (p, n) in enumerate(zip(pages, lens))])
    return pages


def test_each_head_reads_the_sink_the_tail_and_the_pages_the_sketch_ranks_best():
    from zeroedge.kv.kernels import page_scores_ref, sketch_page_lse_ref

    g = torch.Generator().manual_seed(1)
    m, pool, hot, step = _step(0.2)
    cfg, ps = m.cfg, 8
    lens = [700, 35, 421]                               # the middle one is too short for a sketch
    ids = torch.randint(0, cfg.vocab_size, (3, 720), generator=g).tolist()
    pages = _prefill(step, pool, ids, lens)
    hots = [hot.build(p, n) for p, n in zip(pages, lens)]
    assert hots[1] is None and hot.shape_for(35) is None and hot.min_prompt() > 35
    assert hot.shape_for(hot.min_prompt()) is not None and hot.shape_for(hot.min_prompt() - ps) is None
    rows = hot.device_rows(hot.rows([(p, n + 1, h) for p, n, h in zip(pages, lens, hots)]))
    q = torch.randn(3, cfg.n_heads, cfg.head_dim, generator=g)
    grp = cfg.n_heads // cfg.n_kv_heads
    for li in range(cfg.n_layers):
        tables, lens_t = hot.tables(li, q, rows)
        for j, (p, n, h) in enumerate(zip(pages, lens, hots)):
            used = -(-int(lens_t[j]) // ps)
            for kv in range(cfg.n_kv_heads):
                read = tables[j, kv, :used].tolist()
                assert len(set(read)) == len(read)
                if h is None:
                    assert read == p[:used] and int(lens_t[j]) == n + 1
                    continue
                # run's scoring (zeroedge.kv.kernels) on this head's sketch of the scored pages
                scored = p[1:1 + h.scored]
                slots = (torch.tensor(scored)[:, None] * ps + torch.arange(ps)).view(-1)
                codes = hot.codes(li)[kv:kv + 1, slots]
                scales = hot.scales(li)[kv:kv + 1, slots]
                qr = q[j].view(cfg.n_kv_heads, grp, -1)[kv:kv + 1] @ hot.bases[h.sketch, li, kv]
                score = page_scores_ref(sketch_page_lse_ref(qr, codes, scales, ps), torch.zeros(h.scored))[0]
                best = {scored[i] for i in score.topk(h.slots).indices.tolist()}
                always = set(p[:1]) | set(p[h.tail:-(-(n + 1) // ps)])   # the sink page, the tail
                assert set(read) == best | always, (li, j, kv)
                assert int(lens_t[j]) == (h.slots + 1) * ps + n + 1 - (1 + h.scored) * ps


def test_choosing_every_page_gives_the_dense_step_and_rows_leave_no_sketch_behind():
    from zeroedge.serve.batch import Segment

    g = torch.Generator().manual_seed(2)
    outs = {}
    for budget in (None, 0.9999):
        m, pool, hot, step = _step(budget)
        ids = torch.randint(0, m.cfg.vocab_size, (2, 660), generator=g if budget is None else
                            torch.Generator().manual_seed(2)).tolist()
        pages = _prefill(step, pool, ids, [600, 300])
        hots = [hot.build(p, n) for p, n in zip(pages, [600, 300])] if hot else [None, None]
        if hot:
            assert all(h is not None and h.slots == h.scored for h in hots)
            assert hot.in_use() == 2
        outs[budget] = [step.forward([Segment(p, [ids[j][n + i]], n + i, hot=h)
                                      for j, (p, n, h) in enumerate(zip(pages, [600, 300], hots))]) for i in range(4)]
        if hot:
            for h in hots:
                hot.drop(h)
            assert hot.in_use() == 0 and float(hot.bases.abs().sum()) == 0
    for a, b in zip(outs[None], outs[0.9999]):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_sketch_rows_run_out_and_bad_budgets_are_refused():
    m, pool, hot, step = _step(0.2, capacity=1)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, m.cfg.vocab_size, (2, 520), generator=g).tolist()
    pages = _prefill(step, pool, ids, [500, 500])
    first = hot.build(pages[0], 500)
    assert first is not None and hot.build(pages[1], 500) is None      # no free row: that one reads every page
    from zeroedge.serve.thermal import ThermalSketches

    for bad in (0, 1, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            ThermalSketches(pool, m.cfg, bad, 2)


def _engine_replies(engine, prompts, new: int):
    import threading

    from zeroedge.serve.plan import Plan, Sampling

    engine.start()
    try:
        seqs, done = [], []
        for prompt in prompts:
            ev = threading.Event()
            done.append(ev)
            seqs.append(engine.submit(Plan(prompt, Sampling(max_tokens=new, temperature=0.0), len(prompt) + new, 0,
                                           thermal=True), lambda x, ev=ev: x[0] in ("done", "error") and ev.set()))
        for ev in done:
            assert ev.wait(300)
        return [s.out for s in seqs]
    finally:
        engine.stop()


def test_drafts_checked_on_thermal_rows_change_no_token(smollm2, smol_tok):
    """The engine on real weights, thermal KV at 10 %: greedy replies with prompt-lookup drafts (verify
    segments of thermal rows) are the replies without, token for token; a short prompt beside them
    takes no sketch."""
    from zeroedge import texts
    from zeroedge.serve.backends import TorchBatched
    from zeroedge.serve.engine import Engine
    from zeroedge.serve.metrics import ServeMetrics

    m = smollm2[0].float().eval()
    kjv = smol_tok(texts.load_text("kjv", 6000)[:6000])["input_ids"]
    prompts = [kjv[:700], kjv[300:900], smol_tok("The first law of thermodynamics")["input_ids"]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # as `zeroedge serve` on a CPU: torch's SDPA splits a batch by threads
    try:
        out = {}
        for mode in ("off", "ngram"):
            b = TorchBatched(m, 96 << 20, 4, 64, None, kv_budget=0.1)
            e = Engine(b, smol_tok, speculative=mode)
            e.metrics = ServeMetrics(e.load, b.kv_stats)
            out[mode] = _engine_replies(e, prompts, 24)
            assert b.sketches.in_use() == 0                 # every sketch row back once the requests end
            assert b"zeroedge_serve_thermal_kv_requests_total 2.0" in e.metrics.render()
        assert out["off"] == out["ngram"] and all(len(r) == 24 for r in out["off"])
        assert e.spec_stats.drafted > 0                     # drafts were checked on thermal rows
    finally:
        torch.set_num_threads(threads)


def test_cli_refuses_thermal_where_it_does_not_run(tmp_path):
    for args, words in ((("serve", "smollm2-135m", "--kv-budget", "10%", "--weights", "q4"), "--weights model"),
                        (("serve", "smollm2-135m", "--kv-budget", "1"), "leave --kv-budget out"),
                        (("serve", "--backend", "onnxruntime", "--bundle", tmp_path, "--kv-budget", "10%"),
                         "torch backend"),
                        (("serve", "smollm2-135m", "--kv-budget", "0"), "--kv-budget")):
        p = run_cli(*args, check_rc=2)
        assert words in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_server_runs_long_prompts_with_thermal_kv():
    from test_serve import Served

    from zeroedge import texts

    s = Served("smollm2-135m", "--weights", "model", "--kv-budget", "10%", "--max-batch", 2, "--ctx", 2048,
               "--prefill-chunk", 256, "--speculative", "off")
    try:
        info = s.client().models.list().data[0].model_extra["zeroedge"]
        th = info["thermal_kv"]
        assert th["budget"] == 0.1 and th["page_size"] == 8 and th["release_level"] == 3 and th["min_prompt"] > 100
        assert info["weights"].startswith("the model's")
        c = s.client()
        short = c.completions.create(model="smollm2-135m", prompt="The sky is", max_tokens=4, temperature=0)
        assert short.usage.prompt_tokens < th["min_prompt"]
        assert s.metric("zeroedge_serve_thermal_kv_requests_total") == 0
        long_text = texts.load_text("kjv", 5000)[:5000]         # ~1,300 tokens
        r = c.completions.create(model="smollm2-135m", prompt=long_text, max_tokens=12, temperature=0)
        assert r.usage.prompt_tokens >= th["min_prompt"] and r.usage.completion_tokens == 12
        assert r.choices[0].text.strip()
        assert s.metric("zeroedge_serve_thermal_kv_requests_total") == 1
        assert httpx.get(s.base + "/health").json()["status"] == "ok"
    finally:
        s.stop()
