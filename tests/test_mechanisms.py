import math

import pytest
import torch

from zeroedge import model as M
from zeroedge.mechanisms.anchors import anchor_error, fit_anchor
from zeroedge.mechanisms.pad import (LayerPolicy, MechanismError, ZeroRuntime, flops_summary,
                                     install, remove)
from zeroedge.mechanisms.sih import SIHHead, head_width, keep_mask, smooth


def tiny(seed=0):
    return M.build("tiny", seed=seed)


def test_sih_head_fits_12kb_for_all_presets():
    for name in ("smollm2-135m", "llama-3.2-1b", "qwen2.5-0.5b"):
        d = M.PRESETS[name].dim
        h = SIHHead(d, head_width(d))
        assert h.bytes_fp16() <= 12 * 1024, (name, h.bytes_fp16())
        assert head_width(d) >= 2


def test_smoothing_is_a_causal_weighted_average():
    s = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0]])
    out = smooth(s)
    assert out[0, 0] == 1.0
    assert math.isclose(out[0, 1].item(), (1 / 3) / (0.5 + 1 / 3), rel_tol=1e-6)
    assert math.isclose(out[0, 3].item(), 0.5, rel_tol=1e-6)
    # causal: changing a later score never changes an earlier smoothed value
    s2 = s.clone()
    s2[0, 4] = 0
    assert torch.equal(smooth(s2)[0, :4], out[0, :4])


def test_block_rule_skips_blocks_over_70_percent_low():
    score = torch.ones(1, 64)
    score[0, 16:32] = 0          # block 1 fully low -> skipped
    score[0, 32:42] = 0          # block 2: 10/16 = 62.5 % low -> kept whole
    keep = keep_mask(score, 0.5, protect_first=0, protect_last=0, block_size=16)
    assert keep[0, :16].all() and not keep[0, 16:32].any() and keep[0, 32:48].all()


def test_protected_positions_are_always_kept():
    keep = keep_mask(torch.zeros(1, 50), 0.5, protect_first=4, protect_last=1, limit=40)
    assert keep[0, :4].all() and keep[0, 39] and keep[0, 40:].all() and not keep[0, 4:39].any()


def test_compaction_equals_masked_dense_and_spends_fewer_flops():
    m = tiny()
    ids = torch.randint(0, 256, (1, 80))
    rt = ZeroRuntime(record_masks=True)
    install(m, {1: LayerPolicy(scorer="random", rate=0.5)}, rt)
    with torch.no_grad():
        rt.active = True
        got = m(ids)
        rt.active = False
    keep = rt.masks[1][0]
    remove(m)
    # reference: run the dense FFN on every token, then zero the skipped rows
    mlp = m.layers[1].mlp
    orig = mlp.forward
    mlp.forward = lambda x: orig(x) * keep[None, :, None].to(x.dtype)
    with torch.no_grad():
        want = m(ids)
    mlp.forward = orig
    assert torch.allclose(got, want, atol=1e-5)
    fs = flops_summary(m, rt)
    assert 0 < fs["per_layer_skip"][1] < 1
    assert math.isclose(fs["ffn_flops_skipped"], fs["per_layer_skip"][1] / m.cfg.n_layers, rel_tol=1e-6)


def test_sih_masks_are_deterministic():
    m = tiny(3)
    torch.manual_seed(1)
    heads = {i: SIHHead(m.cfg.dim, 8).eval() for i in range(m.cfg.n_layers)}
    rt = ZeroRuntime(record_masks=True)
    install(m, {i: LayerPolicy(scorer="sih", threshold=0.5, sih=heads[i]) for i in heads}, rt)
    ids = torch.randint(0, 256, (1, 96))
    masks = []
    for _ in range(3):
        with torch.no_grad():
            rt.active = True
            m(ids)
            rt.active = False
        masks.append({k: v.clone() for k, v in rt.masks.items()})
    remove(m)
    for i in heads:
        assert torch.equal(masks[0][i], masks[1][i]) and torch.equal(masks[0][i], masks[2][i])


def test_guards_refuse_training_mode_and_grad():
    m = tiny()
    rt = ZeroRuntime(active=True)
    install(m, {1: LayerPolicy(scorer="random", rate=0.5)}, rt)
    ids = torch.randint(0, 256, (1, 64))
    with pytest.raises(MechanismError, match="no_grad"):
        m(ids)  # grad enabled
    m.train()
    with torch.no_grad(), pytest.raises(MechanismError, match="eval"):
        m(ids)
    m.eval()
    with torch.no_grad():
        m(ids[:, :31])  # short inputs bypass, even with grad off
    assert rt.stats[1][0] == rt.stats[1][1] == 31
    remove(m)


def test_anchor_recovers_a_low_rank_map():
    torch.manual_seed(0)
    x = torch.randn(4000, 32)
    w = torch.randn(32, 4) @ torch.randn(4, 32)
    y = x @ w + 0.5
    a = fit_anchor(x, y, rank=4)
    assert anchor_error(a, x, y) < 1e-4
    a1 = fit_anchor(x, y, rank=1)
    assert anchor_error(a1, x, y) > 0.1  # rank 1 cannot hold a rank-4 map


def test_budget_parsing():
    from zeroedge.commands.common import parse_budget
    from zeroedge.errors import UserError

    assert parse_budget("1%") == 0.01 and parse_budget("0.05") == 0.05
    for bad in ("0", "-1%", "150%", "abc"):
        with pytest.raises(UserError):
            parse_budget(bad)


def test_generate_disables_mechanisms_at_high_temperature_unless_forced():
    from reference_generate import generate

    m = tiny(5)
    rt = ZeroRuntime()
    install(m, {i: LayerPolicy(scorer="random", rate=0.5) for i in range(m.cfg.n_layers)}, rt)
    prompt = torch.randint(0, 256, (64,)).tolist()
    dense, _ = generate(m, prompt, 8)
    toks, info = generate(m, prompt, 8, runtime=rt)
    assert info["mechanisms"] and rt.stats  # prefill skipped rows
    rt.reset_stats()
    _, info = generate(m, prompt, 4, temperature=1.5, runtime=rt)
    assert not info["mechanisms"] and not rt.stats
    _, info = generate(m, prompt, 4, temperature=1.5, runtime=rt, force=True)
    assert info["mechanisms"] and rt.stats
    remove(m)
    # greedy decode with no runtime equals plain argmax continuation of the full forward
    with torch.no_grad():
        full = m(torch.tensor([prompt + dense[:-1]]))
    assert full[0, len(prompt) - 1:].argmax(-1).tolist() == dense


def _sih_policies(m, thresholds):
    """Seeded SIH heads on the layers of `thresholds` (layer -> (threshold, block_size))."""
    torch.manual_seed(3)
    return {i: LayerPolicy(scorer="sih", threshold=thr, sih=SIHHead(m.cfg.dim, 8).eval(), block_size=bs)
            for i, (thr, bs) in thresholds.items()}


def _thresholds_at_median(m, ids, pols):
    """Each layer's threshold at the median of its smoothed scores on ids (half the rows skip)."""
    rt = ZeroRuntime(record_masks=True)
    install(m, {i: LayerPolicy(scorer="sih", threshold=0.0, sih=p.sih) for i, p in pols.items()}, rt)
    seen = {}
    for i, p in pols.items():
        orig = p.sih.forward
        p.sih.forward = lambda x, orig=orig, i=i: seen.setdefault(i, orig(x))
    with torch.no_grad():
        rt.active = True
        m(ids)
    for i, p in pols.items():
        del p.sih.forward
        p.threshold = float(smooth(seen[i]).median())
    remove(m)


def _prefill(m, pols, ids, chunk):
    """Prefill ids with `pols` installed, in one pass (chunk None) or in chunks: (layer -> keep mask,
    the last hidden states, each layer's V cache, the runtime's stats)."""
    T = ids.shape[1]
    rt = ZeroRuntime(record_masks=True)
    install(m, pols, rt)
    m.setup_cache(1, T)
    try:
        with torch.no_grad():
            rt.active = True
            if chunk:
                rt.begin_prompt(T)
            for s in range(0, T, chunk or T):
                h = m.hidden_states(ids[:, s:s + (chunk or T)], start=s)
        kv = [blk.self_attn.kv_cache.v[:, :, :T].clone() for blk in m.layers]
    finally:
        m.drop_cache()
        remove(m)
    return {i: k.clone() for i, k in rt.masks.items()}, h, kv, rt.stats


@pytest.mark.parametrize("T, chunk", [(100, 32), (100, 48), (96, 32), (96, 96), (40, 16)])
def test_chunked_prefill_skips_exactly_what_one_pass_skips(T, chunk):
    """Chunks that do and do not divide the prompt: the same keep masks on every layer (token rule
    and 16-token block rule), the same last logits and the same K/V within float rounding."""
    m = tiny()
    ids = torch.randint(0, 256, (1, T))
    pols = _sih_policies(m, {1: (0.0, 0), 2: (0.0, 16)})
    _thresholds_at_median(m, ids, pols)

    def prefill(c):
        masks, h, kv, stats = _prefill(m, pols, ids, c)
        return masks, m.lm_head(h[:, -1]), kv, stats

    one, logits1, kv1, stats1 = prefill(None)
    got, logits2, kv2, stats2 = prefill(chunk)
    for i in pols:
        assert got[i].shape == (1, T) and torch.equal(got[i], one[i]), i
        skipped = int((~one[i]).sum())
        assert 0 < skipped < T - 5, (i, skipped)      # the rule really skips (and keeps) rows here
    assert stats1 == stats2
    torch.testing.assert_close(logits2, logits1, rtol=1e-4, atol=1e-4)
    for a, b in zip(kv1, kv2):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scorer", ["norm", "random"])
def test_chunked_prefill_with_an_unlearned_ranking_skips_what_one_pass_skips(scorer):
    """An artifact of `calibrate --scorer norm|random` thresholds a per-position score: chunks that do
    not divide the prompt skip the rows one pass skips, and the rule really skips about half."""
    m = tiny()
    T = 100
    ids = torch.randint(0, 256, (1, T))
    inputs = {}
    hooks = [m.layers[i].mlp.register_forward_pre_hook(lambda mod, a, i=i: inputs.setdefault(i, a[0]))
             for i in (1, 2)]
    with torch.no_grad():
        m(ids)
    for h in hooks:
        h.remove()
    thr = {i: float(x[0, :T].norm(dim=-1).median()) if scorer == "norm" else 0.5 for i, x in inputs.items()}
    pols = {i: LayerPolicy(scorer=scorer, threshold=thr[i]) for i in (1, 2)}

    one, got = _prefill(m, pols, ids, None)[0], _prefill(m, pols, ids, 32)[0]
    for i in pols:
        assert torch.equal(got[i], one[i]), i
        assert T // 4 < int((~one[i]).sum()) < 3 * T // 4, i


def test_chunks_off_a_block_boundary_are_refused():
    from zeroedge.mechanisms.sih import ChunkError

    m = tiny()
    ids = torch.randint(0, 256, (1, 64))
    rt = ZeroRuntime()
    install(m, _sih_policies(m, {1: (0.5, 16)}), rt)
    m.setup_cache(1, 64)
    try:
        with torch.no_grad(), pytest.raises(ChunkError, match="block boundary"):
            rt.active = True
            rt.begin_prompt(64)
            for s in range(0, 64, 24):
                m.hidden_states(ids[:, s:s + 24], start=s)
    finally:
        m.drop_cache()
        remove(m)


@pytest.mark.parametrize("T, chunk", [(100, 32), (100, 64), (64, 32)])
def test_rank_rule_chunks_skip_what_one_pass_skips(T, chunk):
    """The rank rule (a rate per 32-position block): chunks on block boundaries keep the rows one pass
    keeps, each block skips its quota of the skippable rows whatever the text, and a chunk off a rank
    block is refused."""
    from zeroedge.mechanisms.sih import ChunkError

    m = tiny()
    ids = torch.randint(0, 256, (1, T))
    pols = _sih_policies(m, {1: (None, 0), 2: (None, 0)})
    for p, rate in zip(pols.values(), (0.5, 0.8)):
        p.rate, p.rank_block = rate, 32
    one, _, kv1, stats1 = _prefill(m, pols, ids, None)
    got, _, kv2, stats2 = _prefill(m, pols, ids, chunk)
    free = (torch.arange(T) >= 4) & (torch.arange(T) < T - 1)
    for i, p in pols.items():
        assert torch.equal(got[i], one[i]), i
        for b0 in range(0, T, 32):
            n = int(free[b0:b0 + 32].sum())
            assert int((~one[i][0, b0:b0 + 32]).sum()) == int(p.rate * n + 0.5), (i, b0)
    assert stats1 == stats2
    with pytest.raises(ChunkError, match="rank block"):
        _prefill(m, pols, ids, 48)


def test_chunks_run_a_deployed_rule_only():
    """A benchmark scorer (random tokens at a rate over the whole prompt) has no chunked form: refused,
    not run wrong."""
    m = tiny()
    ids = torch.randint(0, 256, (1, 64))
    rt = ZeroRuntime()
    install(m, {1: LayerPolicy(scorer="random", rate=0.5)}, rt)
    m.setup_cache(1, 64)
    try:
        with torch.no_grad(), pytest.raises(MechanismError, match="deployed rule only.*'random'.*whole prompt"):
            rt.active = True
            rt.begin_prompt(64)
            m.hidden_states(ids[:, :32], start=0)
    finally:
        m.drop_cache()
        remove(m)


def test_chunk_on_blocks_rounds_up_to_every_layer_s_block():
    from zeroedge.mechanisms.pad import chunk_on_blocks

    pols = [LayerPolicy(block_size=0), LayerPolicy(block_size=16), LayerPolicy(block_size=24)]
    assert chunk_on_blocks(512, pols) == 528 and chunk_on_blocks(48, pols) == 48
    assert chunk_on_blocks(512, [LayerPolicy()]) == 512
    assert chunk_on_blocks(500, [LayerPolicy(rate=0.5, rank_block=512), LayerPolicy(block_size=16)]) == 512
    assert chunk_on_blocks(500, [LayerPolicy(rank_block=512)]) == 500     # no rate: no rank rule
