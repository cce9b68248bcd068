"""The serving engine's step on 4-bit weights (one onnxruntime graph that attends by itself) against
the same engine step on the model's fp32 weights in torch, on real SmolLM2 and real text: prompt chunks
of two sequences in one step, decode rows beside a chunk, a padded single row, teacher-forced; with
zeroedge's onnxruntime kernels and with onnxruntime's own operators."""
import math

import pytest
import torch


@pytest.fixture(scope="module", params=["zeroedge", "stock"])
def steps(request, smollm2, ortops_lib):
    """The 4-bit step on zeroedge's onnxruntime kernels (PagedAttention, BlockOffsets) and on
    onnxruntime's own operators, each beside the fp32 torch step."""
    from zeroedge.serve.batch import BatchStep, PagedKV
    from zeroedge.serve.cpu_q4 import Q4Step

    m = smollm2[0].float().eval()
    threads = torch.get_num_threads()
    q4 = Q4Step(m, 2, kernels=request.param)
    torch.set_num_threads(1)
    out = []
    for lin in (q4, None):
        pool = PagedKV(m.cfg, 64, 16, "cpu", torch.float32, heads_first=lin is not None)
        out.append((BatchStep(m, pool, lin), pool))
    yield m, out
    torch.set_num_threads(threads)


def _nll(logits, targets):
    return torch.nn.functional.cross_entropy(logits.float(), torch.tensor(targets), reduction="none")


def test_q4_step_tracks_the_fp32_step(steps, smol_tok):
    from zeroedge.serve.batch import Segment
    from zeroedge.texts import load_text

    m, runs = steps
    ids = smol_tok.encode(load_text("kjv")[20000:24000], add_special_tokens=False)
    a, b, c = ids[:150], ids[300:440], ids[600:700]
    results = []
    for step, pool in runs:
        pa, pb, pc = pool.alloc(12), pool.alloc(12), pool.alloc(12)
        rows = [step.forward([Segment(pa, a[:48], 0), Segment(pb, b[:40], 0)]),         # two chunks, one step
                step.forward([Segment(pa, a[48:100], 48), Segment(pb, b[40:41], 40)]),  # a chunk beside one row
                step.forward([Segment(pb, b[41:90], 41), Segment(pc, c[:64], 0)])]
        for i in range(100, 140):                      # decode rows beside a prompt chunk, then alone
            segs = [Segment(pa, [a[i]], i), Segment(pb, [b[i - 10]], i - 10)]
            if i < 104:
                segs.append(Segment(pc, c[64 + 8 * (i - 100): 72 + 8 * (i - 100)], 64 + 8 * (i - 100)))
            rows.append(step.forward(segs))
        rows.append(step.forward([Segment(pc, [c[96]], 96)]))                        # one row (padded)
        results.append(torch.cat(rows))
        for pages in (pa, pb, pc):
            pool.release(pages)
    q4, fp32 = results
    assert q4.shape == fp32.shape and torch.isfinite(q4).all()
    # next-token losses of the decode rows, teacher-forced
    targets = []
    for i in range(100, 140):
        targets += [a[i + 1], b[i - 9]] + ([c[72 + 8 * (i - 100)]] if i < 104 else [])
    dec = slice(6, 6 + len(targets))
    nq, nf = _nll(q4[dec], targets).mean().item(), _nll(fp32[dec], targets).mean().item()
    assert math.isfinite(nq) and abs(nq - nf) < 0.05 * nf, (nq, nf)
    agree = (q4.argmax(-1) == fp32.argmax(-1)).float().mean().item()
    assert agree > 0.85, agree


def test_q4_prompts_prefilled_together_equal_alone(steps, smol_tok):
    """Prompt chunks of different lengths in one step give, bit for bit, what each gives alone (a
    row's products do not depend on the other chunks), and so do the decode rows after them."""
    from zeroedge.serve.batch import Segment
    from zeroedge.texts import load_text

    m, runs = steps
    step, pool = runs[0]
    ids = smol_tok.encode(load_text("licenses")[5000:9000], add_special_tokens=False)
    prompts = [ids[:37], ids[100:151], ids[200:223]]
    pages = [pool.alloc(5) for _ in prompts]
    together = step.forward([Segment(p, t, 0) for p, t in zip(pages, prompts)])
    together = torch.cat([together, step.forward([Segment(p, [t[-1]], len(t)) for p, t in zip(pages, prompts)])])
    alone = []
    for p, t in zip(pages, prompts):
        alone.append(step.forward([Segment(p, t, 0)]))
    for p, t in zip(pages, prompts):
        alone.append(step.forward([Segment(p, [t[-1]], len(t))]))
    for p in pages:
        pool.release(p)
    assert torch.equal(together, torch.cat(alone))


def test_q4_step_refuses_a_pool_of_the_other_layout(steps):
    from zeroedge.serve.batch import BatchStep, PagedKV

    m, runs = steps
    q4 = runs[0][0].q4
    with pytest.raises(ValueError, match="heads-first"):
        BatchStep(m, PagedKV(m.cfg, 4, 16, "cpu", torch.float32), q4)
    with pytest.raises(ValueError, match="heads-first"):
        BatchStep(m, PagedKV(m.cfg, 4, 16, "cpu", torch.float32, heads_first=True), None)


def test_a_prompt_from_cached_pages_gives_what_it_gives_whole(steps, smol_tok):
    """The prefix cache: a second prompt sharing the first's opening pages starts from them and its
    logits (last prompt row, then decode rows) equal, bit for bit, those of the same prompt prefilled
    whole; the pool's holders and free pages add up through sharing, release and eviction."""
    from zeroedge.serve.batch import Segment
    from zeroedge.texts import load_text

    m, runs = steps
    step, pool = runs[0]
    ids = smol_tok.encode(load_text("essays")[3000:6000], add_special_tokens=False)
    a, b = ids[:70], ids[:50] + ids[300:321]            # b shares a's first 50 tokens: 3 full pages
    free0 = pool.free_pages
    pa = pool.alloc(6)
    step.forward([Segment(pa, a[:40], 0)])
    step.forward([Segment(pa, a[40:], 40)])
    pool.remember(pa, a)                                 # 4 full pages of a's 70 tokens
    shared = pool.share(b)
    assert shared == pa[:3]                              # 50 tokens: 3 full pages in common
    pb = shared + pool.alloc(3)
    cached = [step.forward([Segment(pb, b[48:], 48)])]
    cached += [step.forward([Segment(pb, [b[-1]], len(b) + i)]) for i in range(3)]
    pw = pool.alloc(6)                                   # the same prompt, every page its own
    whole = [step.forward([Segment(pw, b[:30], 0)]), step.forward([Segment(pw, b[30:], 30)])]
    whole += [step.forward([Segment(pw, [b[-1]], len(b) + i)]) for i in range(3)]
    assert torch.equal(cached[0], whole[1]) and all(torch.equal(x, y) for x, y in zip(cached[1:], whole[2:]))
    pool.release(pa)
    pool.release(pb)
    pool.release(pw)
    assert pool.free_pages == free0                      # the cache's 4 pages count as free
    held = pool.alloc(free0)                             # taking every page evicts the cache
    assert held is not None and len(set(held)) == free0 and pool.share(a) == []
    pool.release(held)
    assert pool.free_pages == free0 and pool.alloc(free0 + 1) is None


def test_the_prefix_cache_never_maps_a_new_page_while_it_holds_one():
    """Prompts of distinct text, one after another, each remembered: the pool hands out the pages the
    cache holds rather than pages never written (the pool is mapped as it is written), so the pages
    ever used stay those of the largest request, and the cache stays useful for a repeated prompt."""
    from types import SimpleNamespace

    from zeroedge.serve.batch import PagedKV

    pool = PagedKV(SimpleNamespace(n_layers=1, n_kv_heads=1, head_dim=4), 64, 4, "cpu", torch.float32)
    used = set()
    for i in range(30):
        prompt = [1000 * i + t for t in range(10)]          # 2 full pages of its own each
        pages = pool.alloc(3)
        used.update(pages)
        pool.remember(pages, prompt)
        pool.release(pages)
    assert len(used) == 3 and pool.free_pages == 64
    pages = pool.alloc(3)
    pool.remember(pages, list(range(10)))
    pool.release(pages)
    assert len(pool.share(list(range(10)) + [7])) == 2      # the last one remembered is still there


def test_a_step_that_releases_the_float_linears_computes_the_same(smollm2, smol_tok, ortops_lib):
    """release_float (what the server builds): the model's float linears are emptied as the 4-bit copies
    are made, the embedding the step reads stays, and the step's logits are those of a step built from
    a model that keeps them, bit for bit."""
    import copy

    from zeroedge.serve.batch import BatchStep, PagedKV, Segment
    from zeroedge.serve.cpu_q4 import Q4Step

    kept = smollm2[0].float().eval()
    own = copy.deepcopy(kept)
    ids = smol_tok.encode("The quick brown fox jumps over the lazy dog, then rests.")
    logits = []
    for m, release in ((kept, False), (own, True)):
        step = Q4Step(m, 2, release_float=release)
        pool = PagedKV(m.cfg, 8, 16, "cpu", torch.float32, heads_first=True)
        pages = pool.alloc(2)
        logits.append(BatchStep(m, pool, step).forward([Segment(pages, ids, 0)]))
    assert torch.equal(logits[0], logits[1])
    linears = [mod for mod in own.modules() if isinstance(mod, torch.nn.Linear)]
    assert all(mod.weight.numel() == 0 or mod.weight is own.embed_tokens.weight for mod in linears)
    assert own.embed_tokens.weight.numel() == kept.embed_tokens.weight.numel()
    assert all(mod.weight.numel() > 0 for mod in kept.modules() if isinstance(mod, torch.nn.Linear))


def test_pages_mapped_ahead_are_the_pages_handed_out_next():
    """map_ahead writes the next never-used pages: resident memory grows by their size then (not by
    huge pages around them), and not again when alloc hands them out and a step writes them (the server
    maps a batch's first chunks before serving, so the first burst does not take those page faults)."""
    import os
    from types import SimpleNamespace

    from zeroedge.serve.batch import PagedKV

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    for heads_first in (True, False):
        pool = PagedKV(SimpleNamespace(n_layers=4, n_kv_heads=2, head_dim=64), 2048, 16, "cpu", torch.float32,
                       heads_first=heads_first)
        size = 256 * pool.page_bytes                      # 16 MiB of a 128 MiB pool
        r0 = rss()
        pool.map_ahead(256)
        r1 = rss()
        assert 0.9 * size < r1 - r0 < 1.3 * size        # 4 KiB pages: no huge page maps 2 MiB of a 1 MiB run
        pages = pool.alloc(256)
        assert sorted(pages) == list(range(256))
        for p in pages:
            at = slice(p * 16, (p + 1) * 16)
            for t in (pool.k, pool.v):
                (t[:, :, at] if heads_first else t[:, at]).fill_(1.0)
        assert rss() - r1 < 0.1 * size


def test_a_long_cached_chain_is_forgotten_whole():
    """A prompt of 2,000 cached pages (a chain longer than Python's recursion limit): taking every page
    of the pool evicts the whole chain, and none of it is shared afterwards."""
    from types import SimpleNamespace

    from zeroedge.serve.batch import PagedKV

    pool = PagedKV(SimpleNamespace(n_layers=1, n_kv_heads=1, head_dim=2), 2100, 1, "cpu", torch.float32)
    prompt = list(range(2001))
    pages = pool.alloc(2001)
    pool.remember(pages, prompt)
    pool.release(pages)
    assert pool.free_pages == 2100
    held = pool.alloc(2100)
    assert held is not None and len(set(held)) == 2100 and pool.share(prompt) == []


def test_q4_step_refuses_unknown_kernels_and_a_missing_library(smollm2, tmp_path, monkeypatch):
    from zeroedge.errors import UserError
    from zeroedge.serve.cpu_q4 import Q4Step

    m = smollm2[0]
    with pytest.raises(ValueError, match="'zeroedge' or 'stock'"):
        Q4Step(m, 1, kernels="fast")
    monkeypatch.setenv("ZEROEDGE_ORTOPS", str(tmp_path / "absent.so"))
    with pytest.raises(UserError, match="scripts/build_ortops"):
        Q4Step(m, 1, kernels="zeroedge")
    assert Q4Step(m, 1).kernels == "stock"                 # without the library: onnxruntime's own operators
