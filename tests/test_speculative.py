"""Speculative decoding: the prompt-lookup drafter, the draft length, and the output — the serving
engine and `zeroedge run` give, token for token, what plain decoding gives on real SmolLM2 (greedy,
and sampled with a seed), whatever the drafter proposes."""
import json
import random
import threading

import pytest
import torch

from conftest import run_cli
from zeroedge.speculative import PromptLookup, Speculator, StepCost, agreed

MODEL = "smollm2-135m"


def test_prompt_lookup_proposes_what_followed_the_longest_match():
    pl = PromptLookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3], max_ngram=3)
    # suffix (1, 2, 3) last seen at 0..2, followed by 4 5 9
    assert pl.propose(3) == (3, [4, 5, 9])
    pl.extend([7])                    # (2, 3, 7) seen at 6..8: what followed it
    assert pl.propose(2) == (3, [8, 1])
    pl.extend([42])                   # 42 never seen: nothing to propose
    assert pl.propose(4) == (0, [])
    assert pl.propose(0) == (0, [])
    with pytest.raises(ValueError):
        PromptLookup([], max_ngram=1, min_ngram=2)


def test_prompt_lookup_prefers_the_latest_of_equal_matches():
    pl = PromptLookup([5, 6, 1, 5, 6, 2, 5, 6])
    assert pl.propose(1) == (2, [2])


def test_agreed_counts_the_confirmed_prefix():
    assert agreed([4, 5, 6], [4, 5, 9]) == 2
    assert agreed([4, 5], [4, 5, 7]) == 2
    assert agreed([4], [3]) == 0
    assert agreed([], [3]) == 0


def test_step_cost_is_measured_from_the_steps():
    c = StepCost(prior=0.5)
    assert c.relative(0) == 1 and c.relative(2) == 2.0          # nothing measured: the prior
    c.observe(0, 0.010)
    c.observe(4, 0.014)
    c.observe(4, 0.019)
    assert c.relative(4) == pytest.approx(1.5)                 # running mean 0.015 over 0.010
    assert c.relative(3) == pytest.approx(1.5)                 # not measured: as the nearest k measured
    assert c.relative(6) == pytest.approx(1.75)                # past the largest: its cost per draft token


def _replay(spec, out, cost_ratio, free=0):
    """Drive a speculator against a known greedy output, a step checking k tokens costing
    1 + cost_ratio (k - free) plain steps (the first `free` fill padding rows) -> (steps, cost in plain
    steps)."""
    i, steps, cost = 1, 0, 0.0
    while i < len(out):
        d = spec.propose(len(out) - i - 1, free)
        a = agreed(d, out[i:])
        made = out[i:i + a + 1]
        c = 1 + cost_ratio * max(0, len(d) - free)
        spec.cost.observe(max(0, len(d) - free), c)
        spec.update(len(d), a, made)
        i, steps, cost = i + len(made), steps + 1, cost + c
    return steps, cost


def test_draft_length_follows_acceptance_and_cost():
    text = list(range(100, 160))
    copy = text + text                         # a reply that copies its prompt: drafts always agree
    spec = Speculator.create("auto", copy[:61])
    steps, cost = _replay(spec, copy[60:], 0.05)
    assert spec.stats.accepted == spec.stats.drafted > 0
    assert steps < 20 and spec.stats.to_dict()["tokens_per_step"] > 3
    # a reply that never repeats what the lookup proposes: auto stops drafting, ngram keeps trying
    rng = random.Random(0)
    prompt = [rng.randrange(50) for _ in range(400)]
    reply = [rng.randrange(50, 100) if i % 2 else prompt[rng.randrange(400)] for i in range(300)]
    auto = Speculator.create("auto", prompt + reply[:1])
    _, auto_cost = _replay(auto, reply, 0.3)
    ngram = Speculator.create("ngram", prompt + reply[:1])
    _, ngram_cost = _replay(ngram, reply, 0.3)
    assert auto.stats.drafted < ngram.stats.drafted / 3
    assert auto_cost < 1.05 * (len(reply) - 1) < ngram_cost
    # a check whose rows cost 14 plain steps each never pays, not even for drafts that always agree:
    # auto stops drafting once it has measured one
    dear = Speculator.create("auto", copy[:61])
    dear_steps, _ = _replay(dear, copy[60:], 14.0)
    assert dear.stats.verify_steps == 1 and dear.stats.accepted == dear.stats.drafted
    # ... but a draft token that takes a padding row (a CPU step computes at least 2 or 4 rows) is
    # free: auto drafts one whenever the lookup matches, and drafts one alone where rows are dear
    padded = Speculator.create("auto", copy[:61])
    steps, _ = _replay(padded, copy[60:], 14.0, free=1)
    assert padded.stats.verify_steps >= steps - 3 and steps < 0.6 * dear_steps
    sparse = Speculator.create("auto", prompt + reply[:1])
    _replay(sparse, reply, 0.3, free=1)
    assert sparse.stats.drafted > auto.stats.drafted
    assert Speculator.create("off", prompt) is None
    with pytest.raises(ValueError):
        Speculator.create("packed", prompt)           # a model drafter needs its model
    with pytest.raises(ValueError):
        Speculator.create("sometimes", prompt)


# -- the serving engine on real weights -------------------------------------------------------------
@pytest.fixture(scope="module")
def model_tok(smollm2, smol_tok):
    return smollm2[0].float().eval(), smol_tok


def _engine_outputs(model_tok, mode, requests, weights, draft=None):
    from zeroedge.serve.backends import TorchBatched
    from zeroedge.serve.engine import Engine
    from zeroedge.serve.plan import Plan

    m, tok = model_tok
    lin = None
    if weights == "q4":
        from zeroedge.serve.cpu_q4 import Q4Step

        lin = Q4Step(m, 2)
    e = Engine(TorchBatched(m, 64 << 20, 4, 32, lin), tok, speculative=mode, draft_model=draft)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # as `zeroedge serve` on a CPU: torch's SDPA splits a batch by threads
    e.start()
    try:
        seqs, done = [], []
        for prompt, sampling in requests:
            ev = threading.Event()
            done.append(ev)
            seqs.append(e.submit(Plan(prompt, sampling, len(prompt) + sampling.max_tokens, 0, eos=()),
                                 lambda x, ev=ev: x[0] in ("done", "error") and ev.set()))
        for ev in done:
            assert ev.wait(300)
        return [s.out for s in seqs], e.spec_stats, [s.spec.stats if s.spec else None for s in seqs]
    finally:
        e.stop()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("weights", ["q4", "model"])
def test_verify_rows_are_plain_decode_steps_bit_for_bit(model_tok, weights):
    """A verify segment's logits at each position equal those of plain decode steps there, beside
    another sequence's decode row and a prompt chunk."""
    from zeroedge.serve.batch import BatchStep, PagedKV, Segment

    m, tok = model_tok
    lin = None
    if weights == "q4":
        from zeroedge.serve.cpu_q4 import Q4Step

        lin = Q4Step(m, 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pool = PagedKV(m.cfg, 64, 16, "cpu", torch.float32, heads_first=lin is not None)
        step = BatchStep(m, pool, lin)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, m.cfg.vocab_size, (140,), generator=g).tolist()
        a, b, c = pool.alloc(12), pool.alloc(12), pool.alloc(12)
        for pages in (a, b, c):
            step.forward([Segment(pages, ids[:100], 0)])
        plain = torch.cat([step.forward([Segment(a, [t], 100 + i)]) for i, t in enumerate(ids[100:106])])
        got = step.forward([Segment(c, [9], 100), Segment(b, ids[100:106], 100, verify=True),
                            Segment(c, ids[101:120], 101)])
        assert got.shape[0] == 1 + 6 + 1
        assert torch.equal(got[1:7], plain)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("weights", ["q4", "model"])
def test_engine_output_equals_plain_decoding(model_tok, weights):
    from zeroedge.serve.plan import Sampling
    from zeroedge.texts import load_text

    _, tok = model_tok
    lic = tok.encode(load_text("licenses")[30000:32000], add_special_tokens=False)[:300]
    kjv = tok.encode(load_text("kjv")[5000:7000], add_special_tokens=False)[:200]
    reqs = [(lic, Sampling(max_tokens=48, temperature=0)), (kjv, Sampling(max_tokens=40, temperature=0)),
            (lic[:120], Sampling(max_tokens=40, temperature=0.8, top_p=0.95, seed=7)),
            (kjv[:90], Sampling(max_tokens=32, temperature=1.2, seed=3))]
    plain, _, _ = _engine_outputs(model_tok, "off", reqs, weights)
    spec, stats, _ = _engine_outputs(model_tok, "ngram", reqs, weights)
    assert spec == plain
    # every token but the first of each request (its prefill's) comes from a counted decode step
    assert stats.drafted > 0 and stats.accepted > 0 and stats.tokens == sum(len(o) - 1 for o in plain)
    assert stats.steps < stats.tokens                    # some steps made more than one token
    if weights == "model":
        # the model's own 4-bit CPU step drafts for its fp32 weights: plain decoding's tokens again; the
        # greedy drafts agree almost always (the drafter's KV rolled back past each rejection: a stale
        # position would show as rejected drafts), and every drafter page goes back to its pool. Its
        # pool holds the first two requests only: the others decode without drafts, the same tokens.
        from zeroedge.serve.backends import DraftModel

        draft = DraftModel.build(model_tok[0], 2, 600, 4, 32)
        packed, stats, each = _engine_outputs(model_tok, "packed", reqs, weights, draft)
        assert packed == plain
        for st in each[:2]:
            assert st.drafted > 10 and st.accepted >= 0.85 * st.drafted, st
        assert each[2:] == [None, None]
        assert stats.tokens == sum(len(o) - 1 for o in plain[:2]) and stats.steps < stats.tokens
        assert draft.b.pool.free_pages == draft.b.pool.n_pages


@pytest.mark.parametrize("weights", ["model", "q4"])
def test_run_speculative_equals_plain(tmp_path, model_tok, weights):
    """`zeroedge run` through the serving engine: drafts checked give plain decoding's tokens; with
    --weights q4 they are the tokens the server's batched 4-bit step gives the same prompt."""
    from zeroedge.serve.plan import Sampling
    from zeroedge.texts import load_text

    text = load_text("licenses")[30000:31500]
    f = tmp_path / "prompt.txt"
    f.write_text(text)
    outs = {}
    for mode in ("off", "ngram") + (("packed",) if weights == "model" else ()):
        r = run_cli("run", MODEL, "--prompt-file", f, "--max-new", 40, "--device", "cpu", "--speculative", mode,
                    "--weights", weights, "--json")
        assert r.returncode == 0, r.stderr
        outs[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    assert outs["ngram"]["tokens"] == outs["off"]["tokens"]
    if weights == "model":                  # drafts by the model's own 4-bit step, checked by its fp32 weights
        assert outs["packed"]["tokens"] == outs["off"]["tokens"]
        assert outs["packed"]["mechanisms"]["speculative_drafter"].startswith("4-bit blocks of 32")
        assert outs["packed"]["speculative"]["accepted"] > 0
    st = outs["ngram"]["speculative"]
    assert outs["ngram"]["mechanisms"]["speculative"] == "ngram"
    assert st["drafted"] > 0 and st["tokens"] == len(outs["off"]["tokens"]) - 1
    assert "speculative" not in outs["off"]
    if weights == "q4":
        assert outs["off"]["mechanisms"]["weights"].startswith("4-bit blocks of 32")
        ids = model_tok[1].encode(text, add_special_tokens=False)
        (served,), _, _ = _engine_outputs(model_tok, "off", [(ids, Sampling(max_tokens=40, temperature=0))], "q4")
        got = outs["off"]["tokens"]
        assert got == served[:len(got)] and (len(got) == 40 or got[-1] == model_tok[1].eos_token_id)


def test_run_q4_refuses_what_its_step_does_not_run(tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("In the beginning")
    for extra, says in ((["--kv-budget", "0.1"], "--kv-budget run on --weights model"),
                        (["--device", "cuda"], "runs on the CPU"),
                        (["--paths"], "--paths run on --weights model"),
                        (["--backend", "onnxruntime", "--bundle", tmp_path], "runs its bundle's weights"),
                        (["--max-new", "100000"], "exceed the model's context")):
        model = [] if "--backend" in extra else [MODEL]
        r = run_cli("run", *model, "--prompt-file", f, "--weights", "q4", *extra, check_rc=None)
        assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_run_thermal_speculative_equals_plain(tmp_path):
    """`zeroedge run --kv-budget` with drafts: the thermal decoder checks them, the tokens are plain
    decoding's on the same window."""
    from zeroedge.texts import load_text

    f = tmp_path / "prompt.txt"
    f.write_text(load_text("kjv")[:6000])
    outs = {}
    for mode in ("off", "ngram"):
        r = run_cli("run", MODEL, "--prompt-file", f, "--max-new", 32, "--device", "cpu", "--speculative", mode,
                    "--kv-budget", 0.3, "--json")
        assert r.returncode == 0, r.stderr
        outs[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    assert outs["ngram"]["tokens"] == outs["off"]["tokens"]
    mech, st = outs["ngram"]["mechanisms"], outs["ngram"]["speculative"]
    assert mech["thermal_kv"] is True and mech["speculative"] == "ngram"
    assert st["drafted"] > 0 and st["steps"] < st["tokens"], st


def test_run_speculative_says_where_it_does_not_apply(tmp_path):
    r = run_cli("run", "--backend", "onnxruntime", "--bundle", tmp_path, "--speculative", "ngram", "--prompt", "x")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "logits only" in r.stderr
    r = run_cli("run", MODEL, "--speculative", "sometimes", "--prompt", "x")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "sometimes" in r.stderr
    r = run_cli("run", MODEL, "--speculative", "packed", "--weights", "q4", "--prompt", "x")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--weights model" in r.stderr
    for extra, says in ((["--weights", "q4"], "--weights model"),
                        (["--device-memory", "1G"], "--device-memory / --board plan")):
        r = run_cli("serve", MODEL, "--speculative", "packed", *extra, "--port", 1)
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and says in r.stderr, r.stderr
    r = run_cli("serve", "--backend", "onnxruntime", "--bundle", tmp_path, "--speculative", "packed", "--port", 1)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--weights model" in r.stderr, r.stderr


def test_packed_drafter_says_where_it_does_not_run():
    """A plan the packed drafter cannot serve decodes plainly and says why: a memory cap (the drafter's
    weights and KV are not in its forecast), a model that is not float32."""
    from zeroedge.model import build
    from zeroedge.serve.session import ServingSession

    m = build("tiny", seed=0).eval()
    assert ServingSession(m).plan(10, 4, speculative="packed").speculative == "packed"
    capped = ServingSession(m, device_memory=1 << 30).plan(10, 4, speculative="packed")
    assert capped.speculative is False and "memory cap" in capped.speculative_reason
    half = ServingSession(m.bfloat16()).plan(10, 4, speculative="packed")
    assert half.speculative is False and "float32" in half.speculative_reason
    thermal = ServingSession(m, kv_budget=0.2).plan(400, 4, speculative="packed")
    assert thermal.thermal_kv and thermal.speculative is False and "thermal KV" in thermal.speculative_reason
    assert ServingSession(m, kv_budget=0.2).plan(400, 4, speculative="ngram").speculative == "ngram"
    spill = ServingSession(m, kv_budget=0.2, thermal_opts={"spill_dir": "unused"}).plan(400, 4, speculative="ngram")
    assert spill.thermal_kv and spill.speculative is False and "in a file" in spill.speculative_reason


def test_decoder_verify_rows_match_its_steps():
    """Decoder.verify: the logits of plain steps at each position (to float rounding), its cache
    written at those positions; refused outside the cache and on the thermal decoder."""
    from zeroedge.model import build
    from zeroedge.runtime.fast import DenseDecoder, ThermalDecoder

    m = build("tiny", seed=0).eval()
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    a, b = DenseDecoder(m, 64, graph=False), DenseDecoder(m, 64, graph=False)
    for pos, t in enumerate(ids[:30]):
        a.step(t, pos)
        b.step(t, pos)
    steps = torch.stack([a.step(t, 30 + i).clone() for i, t in enumerate(ids[30:36])])
    rows = b.verify(ids[30:36], 30)
    assert rows.shape == steps.shape
    torch.testing.assert_close(rows, steps.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b.attention.kv[:, :, :, :36], a.attention.kv[:, :, :, :36], atol=1e-5, rtol=1e-5)
    # after a rejected draft the next step writes over the stale positions
    torch.testing.assert_close(b.step(ids[33], 33), a.verify([ids[33]], 33)[0], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError):
        b.verify([1, 2, 3], 62)
    th = ThermalDecoder(m, 160, 8, graph=False, budget=0.5, page_size=8)
    with pytest.raises(ValueError):                 # more rows than the window has room for
        th.verify(list(range(9)), 160)


def test_check_products_agree_in_either_form():
    """A check's products as x @ W^T or as W @ x^T (whichever the host CPU runs faster: columns_pay, timed
    once a process) give the same rows to float rounding."""
    from zeroedge.model import build
    from zeroedge.runtime.fast import TorchLinears, columns_pay

    m = build("tiny", seed=0).eval()
    by_rows, by_columns = TorchLinears(m, columns=False), TorchLinears(m, columns=True)
    x = torch.randn(5, m.cfg.dim, generator=torch.Generator().manual_seed(0))
    o = torch.randn(5, m.cfg.n_heads * m.cfg.head_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for a, b in zip(by_rows.boundary(1, x, o), by_columns.boundary(1, x, o)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(by_rows.head(x), by_columns.head(x), atol=1e-5, rtol=1e-5)
    assert columns_pay(m) in (True, False) and columns_pay(m) == columns_pay(m)


@pytest.mark.parametrize("thermal", [{}, {"lag": 1}, {"ahead": 1}, {"cold": "int8"},
                                     {"cold": "int4", "refresh_every": 3}])
def test_thermal_verify_keeps_plain_decodings_window(thermal):
    """The thermal decoder checks drafts row by row through its refreshes: greedy tokens equal plain
    decoding's, and once the next call settles a check the window (page tables, slot pages, refresh
    count) is the one plain decoding left after the same tokens, whatever the draft got wrong."""
    from zeroedge.model import build, chunked_prefill
    from zeroedge.runtime.fast import ThermalDecoder

    m = build("tiny", seed=0).eval()
    P, N = 160, 30
    prompt = torch.randint(0, 256, (P + 1,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ks, vs, qcov = chunked_prefill(m, prompt[:P], 64)

    def decoder():
        d = ThermalDecoder(m, P, N + 8, graph=False, budget=0.2, page_size=8, **{"fetch": 1, **thermal})
        d.load_prefix(ks, vs, qcov)
        return d

    plain, toks, want = decoder(), [prompt[P]], []
    for i in range(N):
        want.append(plain.step(toks[-1], P + i).clone())
        toks.append(int(want[-1].argmax()))
    spec, out, rng, checks, rejected = decoder(), [prompt[P]], random.Random(0), 0, 0
    while len(out) <= N:
        truth = toks[len(out):len(out) + rng.randint(0, 4)]
        draft = [t if rng.random() < 0.7 else (t + 1) % 256 for t in truth]
        pos = P + len(out) - 1
        rows = spec.verify([out[-1]] + draft, pos) if draft else spec.step(out[-1], pos)[None]
        checks += bool(draft)
        for i in range(rows.shape[0]):
            torch.testing.assert_close(rows[i], want[len(out) - 1], atol=1e-4, rtol=1e-4)
            out.append(int(rows[i].argmax()))
            if i >= len(draft) or out[-1] != draft[i] or len(out) > N:
                rejected += i < len(draft)
                break
    assert out == toks and checks > 5 and rejected > 2
    spec.attention.settle(P + N)
    a, b = plain.attention, spec.attention
    for name in ("slot_page", "page_slot", "wpos"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.kv[..., :a.gen0, :], b.kv[..., :b.gen0, :])         # sink, recent and slot pages
    torch.testing.assert_close(a.kv[..., a.gen0:a.gen0 + N, :], b.kv[..., b.gen0:b.gen0 + N, :])
    assert (a.gen, a.refreshes) == (b.gen, b.refreshes)
    spec.verify([1, 2], P + N)
    with pytest.raises(ValueError, match="next position"):    # the check's rows kept: 1 or 2, not 3
        spec.step(1, P + N + 3)


def test_draft_vocabulary_keeps_the_prompts_ids_and_the_lowest():
    from zeroedge.speculative import draft_vocabulary

    v = draft_vocabulary(1000, [900, 901, 5, 900, 999, 7000], 8)
    assert v == sorted(v) and len(v) == 8
    assert {900, 999, 5} <= set(v) and 7000 not in v              # ids outside the vocabulary are no tokens
    assert draft_vocabulary(1000, list(range(500, 600)), 10) == [0, 1, 2, 3, 4, 595, 596, 597, 598, 599]
    assert draft_vocabulary(50, [3], 64) == list(range(50))
    with pytest.raises(ValueError):
        draft_vocabulary(1000, [], 1)


def test_restricted_head_scores_the_ids_it_was_given():
    """Decoder.restrict_head: the step's logits are the whole head's at those ids, on packed forms of the
    model's weights (the model's own unchanged); a second restriction copies new rows in."""
    from zeroedge.model import build
    from zeroedge.runtime.fast import DenseDecoder, packed_forms

    m = build("tiny", seed=0).eval()
    before = m.layers[0].mlp.down_proj.weight.clone()
    forms = packed_forms(m)
    assert torch.equal(m.layers[0].mlp.down_proj.weight, before)
    full, part = DenseDecoder(m, 32, packed_forms=forms), DenseDecoder(m, 32, packed_forms=forms)
    for ids in ([3, 7, 200, 255], [0, 1, 2, 254]):
        part.restrict_head(ids)
        for pos, t in enumerate([5, 9, 11]):
            a, b = full.step(t, pos), part.step(t, pos)
            torch.testing.assert_close(b, a[ids])
    # the packed drafter is not the model: 4-bit weights give other logits than its fp decoder
    assert not torch.allclose(full.step(5, 0), DenseDecoder(m, 32).step(5, 0))
    with pytest.raises(ValueError):
        part.restrict_head([1, 2])


def test_windowed_drafter_attention_is_the_banded_model():
    """DenseAttention's window: stepping through a sequence gives the model's logits under a mask
    that keeps the first 4 positions and the last 12 (keys at their true RoPE positions, in a ring of
    16 slots); load_positions puts the model's K/V of a span where the steps would have."""
    from zeroedge.model import build
    from zeroedge.runtime.fast import DenseDecoder

    m = build("tiny", seed=0).eval()
    T, sinks, window = 48, 4, 12
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(2))
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    band = (j <= i) & ((j < sinks) | (j > i - window))
    with torch.no_grad():
        x = m.embed_tokens(ids)
        cos, sin = m.rope(0, T)
        for b in m.layers:
            x = b(x, cos, sin, 0, band)
        want = m.lm_head(m.norm(x))[0]
    for attn in ("sdpa", "bmm"):
        dec = DenseDecoder(m, 64, graph=False, attn=attn, window=window)
        assert dec.attention.slots == sinks + window and dec.kv_bytes() == dec.kv_bytes(10 ** 6)
        for t in range(T):
            torch.testing.assert_close(dec.step(int(ids[0, t]), t), want[t], atol=1e-4, rtol=1e-4)
    # positions 0..39 loaded at once: the sinks and the last 12 where 40 steps leave them
    full = DenseDecoder(m, 64, graph=False)
    for t in range(40):
        full.step(int(ids[0, t]), t)
    ring = DenseDecoder(m, 64, graph=False, window=window)
    ring.attention.load_positions(full.attention.k[:, :, :40], full.attention.v[:, :, :40], 0)
    slots = ring.attention.slot_of(torch.arange(40))
    kept = list(range(sinks)) + list(range(40 - window, 40))
    assert sorted(slots[kept].tolist()) == list(range(sinks + window))
    assert torch.equal(ring.attention.k[:, :, slots[kept]], full.attention.k[:, :, kept])
    assert torch.equal(ring.attention.v[:, :, slots[kept]], full.attention.v[:, :, kept])
    with pytest.raises(ValueError, match="outside the cache"):
        ring.attention.load_positions(full.attention.k[:, :, :40], full.attention.v[:, :, :40], 30)
    with pytest.raises(ValueError, match="verify runs on the dense and thermal decoders"):
        ring.verify([1, 2], 40)
    # a window as long as the positions is the plain dense cache; an empty window is refused
    assert not DenseDecoder(m, 16, graph=False, window=12).attention.ring
    with pytest.raises(ValueError, match="at least one position"):
        DenseDecoder(m, 64, graph=False, window=0)


@pytest.mark.parametrize("min_confidence", [0.0, 1.01])
def test_decoder_drafter_gives_the_models_own_tokens(monkeypatch, min_confidence):
    """The packed drafter `run` uses on CUDA (the dense decoder's step on packed forms, a head over a
    draft vocabulary, attending over a window), here on the CPU: the engine's output equals plain
    decoding's token for token, and its drafts were checked and some kept. A draft ends after a token
    the drafter is unsure of: with a confidence no token reaches every draft is one token long (the
    tiny model's random weights are unsure of every token: 0 lets its drafts run)."""
    from zeroedge.model import build
    from zeroedge.serve.backends import DecoderDraftModel, SessionSequential
    from zeroedge.serve.engine import Engine
    from zeroedge.serve.plan import Plan, Sampling
    from zeroedge.serve.session import ServingSession

    monkeypatch.setattr(DecoderDraftModel, "MIN_CONFIDENCE", min_confidence)
    m = build("tiny", seed=0).eval()
    sess = ServingSession(m)
    rng = random.Random(3)
    prompt = [rng.randrange(256) for _ in range(12)] * 4
    new = 48
    plain = sess.generate(prompt, new).tokens
    draft = DecoderDraftModel(m, len(prompt) + new, window=20)       # a ring: 4 + 20 slots of 96 positions
    assert draft.dec.attention.ring and "last 20 positions" in draft.weights
    draft.VOCAB = 128
    plan = sess.plan(len(prompt), new, speculative="packed")
    assert plan.speculative == "packed"
    req = Plan(prompt, Sampling(new, 0.0, 1.0, 0), len(prompt) + new, 0, eos=(), session_plan=plan)
    seq = Engine(SessionSequential(sess, len(prompt) + new), speculative="packed", draft_model=draft).run(req)
    assert list(seq.out) == plain
    st = seq.spec.stats
    assert st.drafted > 0 and st.accepted > 0 and st.steps < new
    assert (st.drafted == st.verify_steps) == (min_confidence > 1)
    assert len(draft.vocab) == 128 and set(prompt) <= set(draft.vocab)
    assert draft.open(req) is not None                      # closed with its request: free again


def test_batch_invariant_says_where_it_does_not_run(tmp_path):
    """--batch-invariant: CUDA's dense decoder / batched step on the model's weights; elsewhere one line
    (`serve` on a CPU takes it: its steps compute a row alike for any batch already).
    (Its kernel: tests/test_row_products_interp.py; its bit-for-bit checks on a GPU: device_tests/.)"""
    f = tmp_path / "prompt.txt"
    f.write_text("In the beginning")
    for extra, says in ((["--device", "cpu"], "runs on CUDA"),
                        (["--kv-budget", "0.1"], "no --weights q4, --kv-budget"),
                        (["--weights", "q4"], "no --weights q4, --kv-budget")):
        r = run_cli("run", MODEL, "--prompt-file", f, "--batch-invariant", *extra, check_rc=None)
        assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    r = run_cli("serve", MODEL, "--batch-invariant", "--weights", "q4", "--port", 0, check_rc=None)
    assert r.returncode != 0 and "--batch-invariant runs the torch backend's CUDA step" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_batch_invariant_parts_refuse_what_they_do_not_run():
    """The invariant decoder needs the dense cache's Triton attention, the invariant engine step paged
    attention, the invariant session a CUDA model: each refused elsewhere with a one-line error."""
    from zeroedge.errors import UserError
    from zeroedge.model import build
    from zeroedge.runtime.fast import DenseDecoder
    from zeroedge.serve.batch import BatchStep, PagedKV
    from zeroedge.serve.session import ServingSession

    m = build("tiny", seed=0).eval()
    with pytest.raises(ValueError, match="invariant decoding runs over the dense cache with the Triton attention"):
        DenseDecoder(m, 64, graph=False, attn="sdpa", invariant=True)
    with pytest.raises(ValueError, match="batch-invariant step runs with paged attention"):
        BatchStep(m, PagedKV(m.cfg, 4, 8, "cpu", torch.float32), attention="gather", invariant=True)
    with pytest.raises(UserError, match="runs the model's own weights on CUDA") as e:
        ServingSession(m, invariant=True)
    assert "\n" not in str(e.value)
