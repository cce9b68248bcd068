"""Thermal KV torch parts on the tiny model: the eval contract, peers' masks, sketches, tiers,
the decode runtimes. Small and fast (a few seconds on 2 cores)."""
import math
import os

import pytest
import torch

from zeroedge import model as M
from zeroedge.errors import UserError
from zeroedge.kv import evaluate as E


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return M.build("tiny", seed=0)


def ids_(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize("budget,page,cont,n,msg", [
    (0, 16, 32, 160, r"\(0, 1\]"), (1.5, 16, 32, 160, r"\(0, 1\]"), (float("nan"), 16, 32, 160, r"\(0, 1\]"),
    ("x", 16, 32, 160, "number"), (0.1, 0, 32, 160, "positive"),
    (0.1, 16, 32, 40, "need at least"), (0.1, 16, 0, 160, "continuation")])
def test_bad_input_is_a_user_error_before_any_work(budget, page, cont, n, msg):
    with pytest.raises(UserError, match=msg):
        E.run_eval(None, list(range(n)), budget, page_size=page, continuation=cont)   # None: no work


def test_unknown_option_and_training_mode_are_refused(tiny):
    with pytest.raises(UserError, match="unknown thermal KV option"):
        E.run_eval(tiny, ids_(160), 0.25, page_size=16, continuation=32, colour="red")
    for opts, msg in ((dict(rank=7), "even"), (dict(bits=8), "bits one of"), (dict(cold="int2"), "host, int8 or int4"),
                      (dict(recent_pages=7), "cannot hold"), (dict(lag=2), "lag must be"),
                      (dict(ahead=-1), "ahead must be"), (dict(ahead=1.5), "ahead must be"),
                      (dict(ahead=2, lag=1), "choose one")):  # what serving cannot run
        with pytest.raises(UserError, match=msg):
            E.run_eval(tiny, ids_(160), 0.25, page_size=16, continuation=32, **opts)
    tiny.train()
    try:
        with pytest.raises(ValueError, match="inference-only"):
            E.run_eval(tiny, ids_(160), 0.25, page_size=16, continuation=32)
    finally:
        tiny.eval()


def test_a_prefix_of_part_pages_is_read_like_a_prompt_tail(tiny):
    # 300 - 32 = 268 prefix tokens: 16 whole pages, and 12 more read as serving reads a prompt's
    # tail (teacher-forced, kept hot), not scored; the full-KV perplexity is the model's own
    ids = ids_(300)
    r = E.run_eval(tiny, ids, 0.25, page_size=16, continuation=32, rank=8, cold="host")
    assert (r["prefix_tokens"], r["tail_tokens"], r["scored_tokens"]) == (256, 12, 32)
    with torch.no_grad():
        logits = tiny(torch.tensor([ids]))[0, -33:-1].float()
    want = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[-32:])).exp().item()
    assert r["full_kv_ppl"] == pytest.approx(want, rel=1e-4)
    assert r["thermal_ppl"] > 0 and r["hot_page_bytes"] == r["full_kv_bytes"] * 4 // 16


def test_run_eval_contract_on_tiny_model(tiny):
    r = E.run_eval(tiny, ids_(288), 0.25, page_size=16, continuation=32, rank=8)
    for k in ("full_kv_ppl", "thermal_ppl", "hot_kv_bytes", "full_kv_bytes"):
        assert k in r and r[k] > 0
    P = 256
    assert r["full_kv_bytes"] == 2 * 4 * 2 * P * 16 * 4           # layers, kv heads, hd, fp32
    assert r["hot_page_bytes"] == r["full_kv_bytes"] * 4 // 16     # 4 of 16 pages
    assert r["hot_kv_bytes"] == r["hot_page_bytes"] + r["summary_bytes"]
    assert r["fetch_pages_per_step_mean"] >= 0
    # at budget 1 every page is read: with exact cold pages thermal is full attention; with the int8
    # cold store (the default) the pages fetched back are int8
    r1 = E.run_eval(tiny, ids_(288), 1.0, page_size=16, continuation=32, cold="host")
    assert r1["thermal_ppl"] == pytest.approx(r1["full_kv_ppl"], rel=1e-5)
    r8 = E.run_eval(tiny, ids_(288), 1.0, page_size=16, continuation=32)
    assert r8["options"]["cold"] == "int8" and r8["thermal_ppl"] != r1["thermal_ppl"]
    assert r8["thermal_ppl"] == pytest.approx(r1["full_kv_ppl"], rel=1e-3)


def test_full_method_matches_the_reference_model(tiny):
    ids = ids_(96, 1)
    pre = E.prefill(tiny, ids[:64], stats=True)
    nll = E.score_continuation(tiny, ids[64:], pre, "full", 1.0, 16)
    with torch.no_grad():
        logits = tiny(torch.tensor([ids]))[0]
    ref = torch.nn.functional.cross_entropy(logits[63:95], torch.tensor(ids[64:96]), reduction="none")
    assert torch.allclose(nll, ref, atol=1e-4)
    # the H2O accumulation is a distribution per query: sums to (queries x group) per kv head
    assert torch.allclose(pre["h2o"][0].sum(-1), torch.full((2,), 64.0 * 2), rtol=1e-4)


def test_peer_masks_keep_exactly_the_budget(tiny):
    pre = E.prefill(tiny, ids_(256, 2), stats=True)
    for meth in ("streaming", "h2o", "snapkv"):
        m = E.static_mask(meth, 1, pre, 0.25, 256)
        assert m.shape == (2, 256) and (m.sum(-1) == 64).all(), meth
    s = E.static_mask("streaming", 0, pre, 0.25, 256)
    assert s[:, :4].all() and s[:, -60:].all()


def test_sketch_ranks_like_exact_scores_at_full_rank():
    torch.manual_seed(0)
    k = torch.randn(2, 128, 16) + torch.tensor([3.0] + [0.0] * 15)     # a large mean offset
    q = torch.randn(4, 5, 16)
    kvi = torch.tensor([0, 0, 1, 1])
    exact = (q @ k[kvi].transpose(1, 2)) / 4
    sk = E.Sketch(k, rank=16, bits=8)
    approx = sk.scores(q, kvi)
    centred = exact - exact.mean(-1, keepdim=True)
    got = approx - approx.mean(-1, keepdim=True)
    assert torch.allclose(got, centred, atol=0.05 * centred.abs().max())
    low = E.Sketch(k, rank=4, bits=4, qcov=torch.eye(16).expand(2, 16, 16))
    assert low.nbytes() < sk.nbytes() and low.nbytes() < k.numel() * 4 // 8


def test_quantize_int8_int4_round_trip():
    from zeroedge.kv.tiers import dequantize, quantize, quantized_nbytes

    x = torch.randn(3, 8, 64)
    for bits, tol in ((8, 0.01), (4, 0.2)):
        q, s = quantize(x, bits, 32)
        y = dequantize(q, s, bits, 32, torch.float32)
        err = ((y - x).norm() / x.norm()).item()
        assert err < tol, (bits, err)
        assert q.numel() * q.element_size() + s.numel() * 2 == quantized_nbytes(x.numel(), bits, 32)


def test_file_tensors_live_in_a_private_reserved_file_and_refuse_bad_paths(tmp_path):
    """The torch decoder's cold store on NVMe: records mapped from one file that is reserved in full,
    private (0600) and unlinked at once, so nothing is left in the folder; each record holds its
    fields side by side and they round-trip through the mapping; a bad folder or a disk without room
    is a UserError before anything is written."""
    import os
    import stat

    from zeroedge.kv.tiers import FileTensors

    ft = FileTensors(str(tmp_path / "cold"), (3, 16), {"k": (7, torch.int8), "s": (1, torch.float16)})
    assert not list((tmp_path / "cold").iterdir())                    # unlinked at once
    st = os.fstat(ft.file.fd)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_nlink == 0
    assert ft.offsets == {"k": (0, 7), "s": (8, 2)} and ft.records.shape == (3, 16, 10)   # aligned fields
    assert st.st_blocks * 512 >= ft.nbytes >= 3 * 16 * 10             # every byte reserved
    k, sc = ft.tensors["k"], ft.tensors["s"]
    assert k.shape == (3, 16, 7) and sc.shape == (3, 16, 1) and not k.any() and not sc.any()
    data = torch.randint(-127, 128, (3, 16, 7), dtype=torch.int8)
    k.copy_(data)
    sc.copy_(torch.rand(3, 16, 1).half())
    raw = os.pread(ft.file.fd, 10, 10 * 5)                            # record (0, 5), in the file itself
    assert raw[:7] == data[0, 5].numpy().tobytes() and raw[8:10] == sc[0, 5].numpy().tobytes()
    assert torch.equal(k, data)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="cold store"):
        FileTensors(str(blocker / "sub"), (4,), {"k": (1, torch.int8)})
    with pytest.raises(UserError, match="bytes free"):
        FileTensors(str(tmp_path / "big"), (1 << 40,), {"k": (1, torch.int8)})
    assert not list((tmp_path / "big").glob("zeroedge-kv-*"))         # nothing half-written


def test_transfer_handler_reports_to_scheduler():
    from zeroedge.kv.scheduler import BandwidthScheduler
    from zeroedge.kv.tiers import TransferHandler

    s = BandwidthScheduler(1e9)
    th = TransferHandler(s, "cpu")
    a, b = torch.randn(1000), torch.empty(1000)
    th.copy(b, a, "fetch")
    th.wait()
    assert torch.equal(a, b) and s.summary()["fetch"]["bytes"] == 4000


def test_decoders_match_the_reference_and_keep_maps_consistent(tiny):
    from zeroedge.runtime.fast import DenseDecoder, ThermalDecoder

    ids = torch.tensor([ids_(80, 3)])
    P = 64
    with torch.no_grad():
        full = tiny(ids)[0]
    pre = E.prefill(tiny, ids[0, :P].tolist(), stats=False)
    dense = DenseDecoder(tiny, 80, graph=False)
    dense.load_prefix(pre["k"], pre["v"])
    exact = ThermalDecoder(tiny, P, 16, budget=1.0, page_size=8, rank=8, graph=False)
    exact.load_prefix(pre["k"], pre["v"], pre["qcov"])
    part = ThermalDecoder(tiny, P, 16, budget=0.5, page_size=8, rank=8, recent_pages=1, fetch=8,
                          graph=False)
    part.load_prefix(pre["k"], pre["v"], pre["qcov"])
    for t in range(P, 80):
        tok = ids[0, t].item()
        assert torch.allclose(dense.step(tok, t), full[t], atol=1e-4)
        assert torch.allclose(exact.step(tok, t), full[t], atol=1e-4)
        part.step(tok, t)
    kb = part.device_kv_bytes()
    assert kb["hot"] == kb["prefix_full"] // 2
    # with fetch >= slots, one refresh leaves the slot window holding exactly the best pages
    q = torch.randn(tiny.cfg.n_heads, tiny.cfg.head_dim)
    part = part.attention
    for li in range(len(tiny.layers)):
        want = part.scores(li, q).topk(part.slots, dim=-1).indices
        part._swap(li, q)
        for h in range(part.nkv):
            assert set(part.slot_page[li, h].tolist()) == set(want[h].tolist())
            ps = part.page_slot[li, h]
            assert (ps >= 0).sum() == part.slots
            assert all(ps[p] == s for s, p in enumerate(part.slot_page[li, h].tolist()))
        # and the slot contents are those pages' keys
        K = pre["k"][li].view(part.nkv, part.n, 8, -1)
        win = part._slots(part.wk, li).view(part.nkv, part.slots, 8, -1)
        for h in range(part.nkv):
            assert torch.equal(win[h], K[h, part.slot_page[li, h]])


def test_the_thermal_decoder_refuses_bad_options_and_positions(tiny):
    from zeroedge.runtime.fast import ThermalDecoder

    for opts, msg in ((dict(lag=2), "lag must be 0 or 1"), (dict(attn="flash"), "attn must be"),
                      (dict(ahead=True), "ahead must be"), (dict(ahead=1, lag=1), "choose one")):
        with pytest.raises(ValueError, match=msg):
            ThermalDecoder(tiny, 64, 8, budget=0.5, page_size=8, rank=8, graph=False, **opts)
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="CUDA device with Triton"):
            ThermalDecoder(tiny, 64, 8, budget=0.5, page_size=8, rank=8, graph=False, attn="triton")
    d = ThermalDecoder(tiny, 64, 8, budget=0.5, page_size=8, rank=8, graph=False)
    pre = E.prefill(tiny, ids_(64), stats=False)
    d.load_prefix(pre["k"], pre["v"], pre["qcov"])
    with pytest.raises(ValueError, match="outside the 72 positions"):  # before any kernel reads the tables
        d.step(1, 72)
    for t in range(64, 72):
        d.step(1, t)
    with pytest.raises(ValueError, match="more than the 8 tokens planned"):
        d.step(1, 71)


def test_int4_sketch_kernel_reference_matches_unpacked_math():
    from zeroedge.kv.kernels import pack_int4, sketch_page_lse_ref, unpack_int4

    codes = torch.randint(-7, 8, (2, 32, 8))
    packed = pack_int4(codes)
    assert packed.shape == (2, 32, 4) and torch.equal(unpack_int4(packed), codes.to(torch.int16))
    scales = torch.rand(2, 32).half()
    qr = torch.randn(2, 3, 8)
    got = sketch_page_lse_ref(qr, packed, scales, 8)
    c = (codes.float() * scales.float()[..., None]).view(2, 4, 8, 8)
    want = torch.einsum("hgr,hnpr->hgnp", qr, c).logsumexp(-1)
    assert torch.allclose(got, want, atol=1e-5)


def test_window_policy_equals_topk_uncapped_and_respects_the_fetch_cap():
    from zeroedge.kv.evaluate import topk_page_mask, window_page_mask

    g = torch.Generator().manual_seed(3)
    ps = torch.randn(2, 40, 30, generator=g)
    forced = torch.zeros(30, dtype=torch.bool)
    forced[0] = True
    forced[-2:] = True
    m_top, c_top = topk_page_mask(ps, 6, forced, 4)
    m_win, c_win = window_page_mask(ps, 6, forced, 4, refresh_every=1, fetch=0)
    assert torch.equal(m_top, m_win) and torch.equal(c_top.sort(-1).values, c_win)
    # capped: at most 2 pages change at a refresh (every 3 steps), none in between
    _, c = window_page_mask(ps, 6, forced, 4, refresh_every=3, fetch=2)
    for t in range(1, 40):
        changed = [len(set(c[h, t].tolist()) - set(c[h, t - 1].tolist())) for h in range(2)]
        assert all(x <= (2 if t % 3 == 0 else 0) for x in changed), (t, changed)
    assert any(len(set(c[h, 39].tolist()) ^ set(c[h, 0].tolist())) for h in range(2))
    assert not forced[c].any()
    # lag 1: a step reads the window as the previous step's refresh left it
    m_lag, c_lag = window_page_mask(ps, 6, forced, 4, refresh_every=1, fetch=2, lag=1)
    m_now, c_now = window_page_mask(ps, 6, forced, 4, refresh_every=1, fetch=2)
    assert torch.equal(c_lag[:, 1:], c_now[:, :-1]) and torch.equal(m_lag[:, 1:], m_now[:, :-1])
    free = torch.nonzero(~forced).view(-1)
    assert torch.equal(c_lag[:, 0], free[-6:].expand(2, -1))      # the first step: the initial window



def test_int8_cold_store_serves_within_rounding_and_halves_its_bytes(tiny):
    """cold="int8" (what a Jetson's unified DRAM gets): the cold pages are int8 with fp16 scales on the
    device, fetched pages are dequantized into the window. Same pages chosen, logits within int8
    rounding of the full-precision cold store, one byte a value plus one fp16 scale a group (half the
    bf16 pages' bytes at group 32)."""
    from zeroedge.runtime.fast import ThermalDecoder

    ids = torch.tensor([ids_(80, 3)])
    P = 64
    pre = E.prefill(tiny, ids[0, :P].tolist(), stats=False)
    decs = {}
    for cold in ("host", "int8"):
        d = ThermalDecoder(tiny, P, 16, budget=0.5, page_size=8, rank=8, recent_pages=1, fetch=8,
                           graph=False, cold=cold)
        d.load_prefix(pre["k"], pre["v"], pre["qcov"])
        decs[cold] = d
    start = decs["host"].attention.slot_page.clone()
    worst = 0.0
    for t in range(P, 80):
        tok = ids[0, t].item()
        a, b = decs["host"].step(tok, t), decs["int8"].step(tok, t)
        worst = max(worst, float((a - b).norm() / a.norm()))
    assert (decs["host"].attention.slot_page != start).any()            # pages were fetched
    assert torch.equal(decs["host"].attention.slot_page, decs["int8"].attention.slot_page)
    assert 0 < worst < 2e-2, worst
    full = decs["host"].device_kv_bytes()
    assert full["cold_on_device"] == 0                                  # pinned host memory
    q = decs["int8"].device_kv_bytes()["cold_on_device"]
    values = full["prefix_full"] // decs["host"].attention.wk.element_size()
    assert q == values + 2 * values // decs["int8"].attention.group     # int8 codes + an fp16 scale a group
    with pytest.raises(ValueError, match="cold must be one of"):
        ThermalDecoder(tiny, P, 16, graph=False, cold="int2")


@pytest.mark.parametrize("where", ["memory", "file"])
def test_a_prefill_span_reads_each_layer_s_past_once(tiny, tmp_path, where):
    """chunked_prefill into compressed caches runs a span of tokens a layer at a time: the same K/V
    codes, dequantized K/V, query covariances and last hidden state, bit for bit, whatever the span
    (one chunk, two chunks, the whole prompt), while each layer reads its past from the store once
    a span: sum over spans of the span's start, not over chunks of the chunk's end."""
    from zeroedge.model import chunked_prefill
    from zeroedge.runtime.fast import ThermalDecoder

    ids = ids_(112, 3)
    P, chunk = 96, 16
    runs = {}
    for span in (16, 32, 40, 96):
        d = ThermalDecoder(tiny, P, 16, budget=0.3, page_size=8, rank=8, recent_pages=1, graph=False, cold="int8",
                           spill_dir=str(tmp_path / f"s{span}") if where == "file" else None)
        caches = d.attention.prefill_caches()
        ks, vs, qcov, last = chunked_prefill(tiny, ids[:P], chunk, caches=caches, return_last=True, span=span)
        reads = [c.read_positions for c in caches]
        runs[span] = ([k.clone() for k in ks], [v.clone() for v in vs], [q.clone() for q in qcov], last,
                      d.attention.cold_k.clone(), d.attention.cold_ks.clone(), reads)
    starts = {16: range(0, P, 16), 32: range(0, P, 32), 40: range(0, P, 32), 96: [0]}   # 40: whole chunks, 32
    for span, run in runs.items():
        assert run[6] == [sum(starts[span])] * len(tiny.layers), span
        for a, b in zip(run[:4], runs[16][:4]):
            if isinstance(a, list):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), span
            else:
                assert torch.equal(a, b), span
        assert torch.equal(run[4], runs[16][4]) and torch.equal(run[5], runs[16][5])
    assert runs[96][6][0] == 0 and runs[16][6][0] == 16 * (0 + 1 + 2 + 3 + 4 + 5)
    # the token-major loop (a plain cache, no hold) gives the same hidden state to the dequantization's rounding
    plain_last = chunked_prefill(tiny, ids[:P], chunk, return_last=True)[3]
    assert torch.allclose(plain_last, runs[96][3], atol=0.02, rtol=0)
    # a write past the held span is refused, not written beside it
    c = caches[0]
    c.hold(0, 16)
    k = torch.zeros(1, c.ck.shape[0], 32, c.hd)
    with pytest.raises(ValueError, match="past the held span"):
        c.update(0, k, k)
    c.release()


@pytest.mark.parametrize("cold,ahead", [("int8", 0), ("int4", 0), ("int8", 2)])
def test_a_cold_store_in_a_file_serves_what_the_one_in_memory_does(tiny, tmp_path, cold, ahead, monkeypatch):
    """spill_dir: the compressed cold store is mapped from a private file (no device memory); the
    prefill writes into it whole records (a token's codes and scales) and reads the past back a
    block of records at a time (blocks that split pages here), and the swaps read from it, so the
    decode is the in-memory store's, bit for bit, and the folder is left empty (with ahead too: the
    host reads at the layer that predicts the pages)."""
    from zeroedge.kv import policy
    from zeroedge.model import chunked_prefill
    from zeroedge.runtime.fast import ThermalDecoder

    monkeypatch.setattr(policy, "DEQUANT_BLOCK", 20)

    ids = ids_(96, 5)
    P = 80
    runs = {}
    for where in ("memory", "file"):
        d = ThermalDecoder(tiny, P, 16, budget=0.3, page_size=8, rank=8, recent_pages=1, fetch=4, graph=False,
                           cold=cold, ahead=ahead, spill_dir=str(tmp_path / "spill") if where == "file" else None)
        ks, vs, qcov = chunked_prefill(tiny, ids[:P], 32, caches=d.attention.prefill_caches())
        if where == "file":          # K's read of the records also makes V, kept for V's call after it
            c = ks.caches[0]
            want = c.past_kv(P)
            assert torch.equal(c.layer_kv(P, 0), want[0]) and c._v is not None
            assert torch.equal(c.layer_kv(P, 1), want[1]) and c._v is None
            assert torch.equal(c.layer_kv(P, 1), want[1])                 # V alone: read again
        d.load_prefix(ks, vs, qcov)
        start = d.attention.slot_page.clone()
        logits = torch.stack([d.step(ids[t], t).clone() for t in range(P, 96)])
        runs[where] = (d, logits, start)
    dm, lm, sm = runs["memory"]
    df, lf, _ = runs["file"]
    assert (dm.attention.slot_page != sm).any()                         # pages were fetched
    assert torch.equal(lm, lf) and torch.equal(dm.attention.slot_page, df.attention.slot_page)
    for name in ("cold_k", "cold_v", "cold_ks", "cold_vs"):
        assert torch.equal(getattr(dm.attention, name), getattr(df.attention, name))
    mem, fil = dm.device_kv_bytes(), df.device_kv_bytes()
    assert fil["cold_on_device"] == 0 and fil["cold_in_file"] == mem["cold_on_device"] > 0
    assert df.attention.cold_file.nbytes >= fil["cold_in_file"]
    assert not list((tmp_path / "spill").iterdir())
    with pytest.raises(ValueError, match="compressed"):
        ThermalDecoder(tiny, P, 16, graph=False, cold="host", spill_dir=str(tmp_path / "spill"))


def test_serving_picks_the_cold_store_for_the_memory(tmp_path, monkeypatch):
    """A Jetson (here a fake device tree with an L4T release file, the probe's boundary) gets the
    compressed cold store; a discrete GPU and the CPU keep full-precision pages in host memory."""
    from zeroedge.kv.policy import memory_kind, plan_tiers

    monkeypatch.setenv("ZEROEDGE_DEVICE_ROOT", str(tmp_path))
    assert memory_kind(torch.device("cpu")) == "cpu" and memory_kind(torch.device("cuda")) == "discrete"
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "nv_tegra_release").write_text("# R36 (release), REVISION: 4.3, GCID: 1, BOARD: generic\n")
    assert memory_kind(torch.device("cuda")) == "jetson"
    assert plan_tiers("jetson").cold_compressed and not plan_tiers("discrete").cold_compressed


def test_refreshes_wait_while_the_scheduler_defers_and_are_made_up(tiny):
    """The bandwidth scheduler in the decode loop: with the memory busy (the hardware signal, stubbed
    here: NVML / jtop at the boundary) a due refresh is deferred, nothing moves, and it is made up at
    the first step the scheduler allows again (hysteresis: below `low`); every decision is reported."""
    from zeroedge.kv.scheduler import BandwidthScheduler
    from zeroedge.runtime.fast import ThermalDecoder

    ids = torch.tensor([ids_(80, 3)])
    P = 64
    pre = E.prefill(tiny, ids[0, :P].tolist(), stats=False)
    load = {"u": 0.95}
    sched = BandwidthScheduler(1e12, high=0.85, low=0.75, sampler=lambda: load["u"])
    d = ThermalDecoder(tiny, P, 16, budget=0.5, page_size=8, rank=8, recent_pages=1, fetch=8, graph=False,
                       scheduler=sched)
    d.load_prefix(pre["k"], pre["v"], pre["qcov"])
    att = d.attention
    start = att.slot_page.clone()
    for t in range(P, P + 4):                              # busy: every due refresh deferred
        d.step(ids[0, t].item(), t)
    assert att.deferred == 4 and att.refreshes == 0 and torch.equal(att.slot_page, start)
    load["u"] = 0.8                                        # between low and high: still deferring
    d.step(ids[0, P + 4].item(), P + 4)
    assert att.deferred == 5 and att.refreshes == 0
    load["u"] = 0.1                                        # idle: the owed refresh runs
    d.step(ids[0, P + 5].item(), P + 5)
    assert att.refreshes == 1 and not torch.equal(att.slot_page, start)
    rep = att.scheduler_report()
    assert rep["deferred"] == 5 and rep["refreshes"] == 1 and rep["transfers"]["fetch"]["bytes"] == att.refresh_bytes()


@pytest.mark.parametrize("opts", [dict(cold="host", fetch=2, refresh_every=1, rank=8, bits=4),
                                  dict(cold="host", fetch=2, refresh_every=1, rank=8, bits=4, budget=0.1875),
                                  dict(cold="int8", fetch=3, refresh_every=2, rank=16, bits=3),
                                  dict(cold="int4", fetch=2, refresh_every=1, rank=8, bits=4),
                                  dict(cold="host", fetch=0, refresh_every=1, rank=8, bits=2),
                                  dict(cold="host", fetch=2, refresh_every=1, rank=8, bits=4, lag=1),
                                  dict(cold="int8", fetch=3, refresh_every=2, rank=16, bits=3, lag=1),
                                  dict(cold="host", fetch=2, refresh_every=1, rank=8, bits=4, ahead=1),
                                  dict(cold="int8", fetch=3, refresh_every=2, rank=16, bits=3, ahead=2),
                                  dict(cold="host", fetch=2, refresh_every=1, rank=8, bits=4, ahead=5),
                                  dict(cold="host", fetch=0, refresh_every=1, rank=8, bits=4, ahead=1),
                                  dict(cold="host", fetch=2, refresh_every=1, rank=8, bits=4, ahead=1, qkv_bias=True)])
def test_the_eval_contract_scores_what_the_serving_decoder_computes(opts):
    """One code path: `zeroedge eval --kv-budget` (batched over the continuation) and the serving
    decoder (one step at a time, its own sketch, window, swaps and cold store) give the same
    per-token losses on the same prefill. In float64: in float32 the two orders of summation can
    flip a near-tied swap now and then."""
    import torch.nn.functional as F

    from zeroedge.runtime.fast import ThermalDecoder

    from dataclasses import replace

    opts = dict(opts)
    tiny = M.build(replace(M.PRESETS["tiny"], qkv_bias=opts.pop("qkv_bias", False)), seed=0).double()
    P, T, ps, budget = 256, 48, 16, opts.pop("budget", 0.375)   # 0.1875: a window of the fixed pages + 1 slot
    ids = ids_(P + T, 7)
    o = dict(E.DEFAULTS, **opts)
    # the int8 cold store: the prefill itself writes int8 K/V (serving: into the decoder's cold store)
    pre = E.quant_prefill(tiny, ids[:P], o["cold"]) if o["cold"] != "host" else E.prefill(tiny, ids[:P], stats=False)
    nll_eval = E.score_continuation(tiny, ids[P:], pre, "thermal", budget, ps, opts=o)
    serving = {k: o[k] for k in ("rank", "bits", "sink_pages", "recent_pages", "refresh_every", "lag", "ahead", "cold")}
    dec = ThermalDecoder(tiny, P, T, budget=budget, page_size=ps, graph=False,
                         fetch=o["fetch"] or P // ps, **serving)
    if o["cold"] != "host":
        from zeroedge.model import chunked_prefill

        ks, vs, qcov = chunked_prefill(tiny, ids[:P], caches=dec.attention.prefill_caches())
        assert all(torch.equal(a, b) for a, b in zip(ks, pre["k"]))
        dec.load_prefix(ks, vs, qcov)
    else:
        dec.load_prefix(pre["k"], pre["v"], pre["qcov"])
    start = dec.attention.slot_page.clone()
    logits = [pre["last_logits"]]
    for t in range(P, P + T - 1):
        logits.append(dec.step(ids[t], t))
    nll_dec = F.cross_entropy(torch.stack(logits).float(), torch.tensor(ids[P:]), reduction="none")
    assert not torch.equal(dec.attention.slot_page, start)     # pages really moved
    assert torch.allclose(nll_eval, nll_dec, atol=1e-5), (nll_eval - nll_dec).abs().max()
    # and the thermal losses are not the full-KV ones (the budget bites)
    assert (nll_eval - E.score_continuation(tiny, ids[P:], pre, "full", 1.0, ps)).abs().max() > 1e-3


@pytest.mark.parametrize("cold", ["host", "int8", "int4"])
def test_the_byte_forecast_is_what_the_thermal_window_allocates(tiny, cold):
    """kv.policy.thermal_device_bytes (the planner's and the memory cap's forecast) against the
    tensors ThermalAttention really holds."""
    from dataclasses import replace

    from zeroedge.kv.policy import thermal_device_bytes, thermal_settings
    from zeroedge.runtime.fast import ThermalDecoder

    P, G = 320, 24
    d = ThermalDecoder(tiny, P, G, budget=0.3, page_size=16, rank=8, fetch=3, graph=False, cold=cold)
    a = d.attention
    got = thermal_device_bytes(len(tiny.layers), tiny.cfg.n_kv_heads, tiny.cfg.head_dim, P, G, 4, 0.3,
                               replace(thermal_settings(16), rank=8, fetch=3), cold)
    nb = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    assert got == d.device_kv_bytes()
    assert got["hot"] + got["generated"] == nb(a.wk, a.wv)
    assert got["summaries"] == nb(a.codes, a.scales, a.A)
    assert got["page_table"] == nb(a.page_slot)
    assert got["cold_on_device"] == (nb(a.cold_k, a.cold_v, a.cold_ks, a.cold_vs) if cold != "host" else 0)
    assert got["cold_in_file"] == 0


def test_the_fast_decoder_keeps_one_copy_of_the_weights():
    """The fused q/k/v and gate/up matrices are the model's own storage (no second copy), and the
    model still computes what it did."""
    from zeroedge.runtime.fast import DenseDecoder
    from zeroedge.runtime.memory import weights_bytes

    m = M.build("tiny", seed=1)
    ids = torch.tensor([ids_(12, 2)])
    with torch.no_grad():
        before = m(ids)[0]
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    d = DenseDecoder(m, 16, graph=False)
    a, w = m.layers[0].self_attn, d.W.layers[0]
    assert a.k_proj.weight.untyped_storage().data_ptr() == w["wqkv"].untyped_storage().data_ptr()
    assert m.layers[0].mlp.up_proj.weight.untyped_storage().data_ptr() == w["w13"].untyped_storage().data_ptr()
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in m.parameters()}
    assert sum(storages.values()) == nbytes == weights_bytes(m.cfg, 4)
    with torch.no_grad():
        assert torch.equal(m(ids)[0], before)


def test_the_sketch_is_fitted_in_chunks_with_the_same_result():
    """quantized_sketch reads the keys a chunk at a time (bounded fp32 copies at 128K): the basis is
    the centred key PCA's, its rms the coordinates' (what the codes are whitened by), and the codes
    do not depend on the chunk."""
    from zeroedge.kv.attention import quantized_sketch, sketch_bases

    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 512, 16, generator=g) * torch.linspace(0.2, 3, 16) + 5.0    # far from centred
    A, B, mu, rms = sketch_bases(k, rank=4)
    c = k - k.mean(1, keepdim=True)
    top = torch.linalg.eigh(c.transpose(1, 2) @ c)[1][:, :, -4:].flip(-1)
    assert torch.allclose((B.transpose(1, 2) @ top).abs(), torch.eye(4).expand(2, 4, 4), atol=1e-3)
    assert torch.allclose(rms, (c @ B).pow(2).mean(1).sqrt(), rtol=1e-3)
    one = quantized_sketch(k, 4, 4, chunk=4096)
    many = quantized_sketch(k, 4, 4, chunk=64)
    assert torch.equal(one[1], many[1]) and torch.equal(one[2], many[2])
    # the serving decoder's form: packed a chunk at a time straight into its own tensors
    from zeroedge.kv.kernels import pack_int4

    out = (torch.full((2, 512, 2), 0xAA, dtype=torch.uint8), torch.zeros(2, 512, dtype=torch.float16))
    A, codes, scales = quantized_sketch(k, 4, 4, chunk=64, out=out)
    assert codes is out[0] and scales is out[1] and torch.equal(A, one[0])
    assert torch.equal(codes, pack_int4(one[1])) and torch.equal(scales, one[2])
    with pytest.raises(ValueError, match="rank/2"):                      # unpacked codes are refused
        quantized_sketch(k, 4, 4, out=(torch.zeros(2, 512, 4, dtype=torch.uint8), out[1]))
    from zeroedge.kv.tiers import dequantize, quantize

    c, sc = quantize(k, 8, 16)
    buf = torch.empty(2, 512, 16, dtype=torch.bfloat16)
    assert torch.equal(dequantize(c, sc, 8, 16, out=buf), dequantize(c, sc, 8, 16, torch.bfloat16))
    with pytest.raises(ValueError, match="shape"):
        dequantize(c, sc, 8, 16, out=torch.empty(2, 512, 8))


def test_a_page_size_keeps_the_recent_window_in_tokens_and_the_sketch_block_in_tokens(tiny):
    """--page-size P: the recent window stays THERMAL's 32 tokens (whole pages), in the serving
    decoder, the eval contract and the session alike; the sketch kernel scores 64 tokens a block."""
    from zeroedge.kv import kernels as K
    from zeroedge.kv.policy import THERMAL, thermal_settings
    from zeroedge.runtime.fast import ThermalDecoder

    assert (THERMAL.page_size, THERMAL.recent_pages) == (8, 4) and thermal_settings(None) is THERMAL
    assert [thermal_settings(p).recent_pages for p in (4, 8, 12, 16, 64)] == [8, 4, 3, 2, 1]
    assert [K.sketch_pages_per_block(p) for p in (4, 8, 12, 16, 64, 128)] == [16, 8, 4, 4, 1, 1]
    assert K.sketch_kernel_fits(8, 32) and not K.sketch_kernel_fits(12, 32) and not K.sketch_kernel_fits(8, 24)
    assert ThermalDecoder(tiny, 320, 8, page_size=16, graph=False).attention.recent_pages == 2
    r = E.run_eval(tiny, ids_(288), 0.25, page_size=16, continuation=32)
    assert r["options"]["recent_pages"] == 2 and r["page_size"] == 16
    assert E.run_eval(tiny, ids_(288), 0.25, continuation=32)["options"]["recent_pages"] == 4


def test_the_host_fetch_makes_the_greedy_swaps_decisions(tmp_path):
    """kv.host_fetch (a cold store in a file the device cannot read: decide, read on the host, apply,
    in static shapes): the same page tables and window as the greedy reference, int8 and int4 codes,
    over random scores, with sink / recent pages that never move and stale staging rows ignored;
    the same again when reads run slow enough to ask the disk for the pages first (prefetch)."""
    from zeroedge.kv import host_fetch
    from zeroedge.kv.host_fetch import HostFetch
    from zeroedge.kv.kernels import page_scores_ref, swap_pages_ref
    from zeroedge.kv.tiers import FileTensors, quantize

    g = torch.Generator().manual_seed(3)
    nkv, grp, n, ps, hd, F = 3, 2, 40, 4, 32, 3
    total = 0
    for bits in (8, 4):
        for trial in range(8):
            S = 34 if trial == 7 else 6          # 34 of the 35 movable pages resident: fewer missing than F
            pl = torch.randn(nkv, grp, n, generator=g)
            bias = torch.zeros(n)
            bias[:2] = bias[-3:] = float("-inf")
            slot_page = torch.stack([torch.randperm(n - 5, generator=g)[:S] + 2 for _ in range(nkv)])
            page_slot = torch.full((nkv, n), -1, dtype=torch.long)
            page_slot.scatter_(1, slot_page, torch.arange(S).expand(nkv, -1).contiguous())
            cold = torch.randn(2, nkv, n, ps * hd, generator=g)
            (hk, ks), (hv, vs) = (quantize(c, bits, 32) for c in cold)
            store = FileTensors(str(tmp_path), (1, nkv, n, ps), {"k": (hk.shape[-1] // ps, hk.dtype),
                                "v": (hk.shape[-1] // ps, hk.dtype), "ks": (ks.shape[-1] // ps, ks.dtype),
                                "vs": (ks.shape[-1] // ps, ks.dtype)})
            for name, x in zip(("k", "v", "ks", "vs"), (hk, hv, ks, vs)):
                store.tensors[name][0] = x.view(nkv, n, ps, -1)
            w = torch.randn(2, nkv, S, ps * hd, generator=g)
            ref = [t.clone() for t in (page_slot, slot_page, w[0], w[1])]
            swap_pages_ref(page_scores_ref(pl, bias), *ref, hk, hv, F, (ks, vs), bits)
            hf = HostFetch(nkv, F, store, bits, torch.device("cpu"))
            if trial % 2:
                hf.us_per_page = host_fetch.PREFETCH_ON_US + 1           # as after slow reads: prefetch first
            for st in hf.stage:                                       # stale rows: must not leak in
                st.copy_(torch.randint(0, 100, st.shape).to(st.dtype))
            got = [t.clone() for t in (page_slot, slot_page, w[0], w[1])]
            hf.decide(pl, bias, got[0])
            hf.read(store.records[0].numpy())
            hf.apply(*got)
            for a, b in zip(ref, got):
                assert torch.equal(a, b), (bits, trial)
            moved = int((ref[1] != slot_page).sum())
            assert hf.reads == moved and hf.read_bytes == moved * (hk[0, 0].numel() * 2 + ks[0, 0].numel() * 4)
            assert hf.prefetches == (trial % 2 and moved > 0)
            total += moved
    assert total > 0


def test_the_swap_decisions_are_the_greedys_even_on_tied_scores():
    """kv.kernels.swap_decisions_ref (top-k on tie-free keys) against the greedy one swap at a time:
    best missing page in, worst resident out while the new one scores higher, the lowest page first
    among equal scores (what the Triton kernels' argmax / argmin take), over scores with many ties."""
    from zeroedge.kv.kernels import swap_decisions_ref

    g = torch.Generator().manual_seed(5)
    for trial in range(48):
        nkv, n, S, F = 3, 30, [4, 12, 28][trial % 3], [1, 3, 4, 6][trial % 4]
        if trial >= 40:                                                    # more swaps wanted than pages
            n, S, F = 7, 3, 8
        score = torch.randint(0, 5, (nkv, n), generator=g).float()       # few values: ties everywhere
        score[:, 2::3] *= -1                                               # -0.0 ties with 0.0
        score[:, :2] = float("-inf")                                       # never fetched (sink pages)
        score[:, -1] = float("inf") if trial % 2 else float("-inf")        # a page scored without bound
        page_slot = torch.full((nkv, n), -1, dtype=torch.long)
        for h in range(nkv):
            page_slot[h, torch.randperm(n - 2, generator=g)[:S] + 2] = torch.arange(S)
        got = swap_decisions_ref(score, page_slot, F)
        for h in range(nkv):
            missing = [p for p in range(n) if page_slot[h, p] < 0]
            resident = [p for p in range(n) if page_slot[h, p] >= 0]
            want = []
            for _ in range(F):
                if not missing or not resident:
                    break
                bm = max(missing, key=lambda p: (score[h, p].item(), -p))
                wr = min(resident, key=lambda p: (score[h, p].item(), p))
                if not score[h, bm] > score[h, wr]:
                    break
                want.append((bm, int(page_slot[h, wr]), wr))
                missing.remove(bm)
                resident.remove(wr)
            taken = [tuple(got[h, :, i].tolist()) for i in range(got.shape[2]) if got[h, 1, i] >= 0]
            assert taken == want, (trial, h)
            assert (got[h, :, len(want):] == -1).all()
