"""Serving path: thermal KV driving the onnxruntime runner's slot window, the
request-level session (release levels, circuit breaker, decoder choice, paths refusals) and
`zeroedge run`. A "lively" tiny model (random weights scaled so greedy tokens vary) and a real
exported tiny bundle in onnxruntime."""
import json
import os

import numpy as np
import pytest

from artifacts import paths_only
from conftest import REPO, run_cli

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from zeroedge.errors import UserError  # noqa: E402
from zeroedge.kv.pages import Tier  # noqa: E402

torch.set_num_threads(1)


def lively(seed=0):
    from zeroedge.model import build

    m = build("tiny", seed=seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.mul_(8)
    return m


def ids_(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model():
    return lively()


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from zeroedge.export.bundle_writer import export_bundle

    out = tmp_path_factory.mktemp("serving") / "bundle"
    export_bundle(lively(), out, window=64)              # its own copy: export changes the module
    return out


# ----------------------------------------------------------------------------------------------
# OrtThermalPolicy in a real onnxruntime runner
# ----------------------------------------------------------------------------------------------
def _greedy(r, prompt, steps, each=None):
    lg = r.prefill(np.array(prompt))
    out = []
    for _ in range(steps):
        out.append(int(lg.argmax()))
        lg = r.step(out[-1])
        if each:
            each(r)
    return out


def test_ort_policy_equals_dense_when_the_window_holds_everything(bundle, model):
    from zeroedge.backends.onnxruntime import OrtRunner
    from reference_generate import generate
    from zeroedge.kv.ort_policy import OrtThermalPolicy

    prompt = ids_(45, 1)
    ref, _ = generate(model, prompt, 20)
    assert len(set(ref)) > 5                                  # a model whose tokens move
    with OrtRunner(bundle, slots=72) as r:
        dense = _greedy(r, prompt, 20)
    pol = OrtThermalPolicy(page_size=8)
    with OrtRunner(bundle, slots=72, policy=pol) as r:
        got = _greedy(r, prompt, 20, pol.check)
    assert dense == ref and got == ref
    st = pol.stats()
    assert st["pages_migrated"] == 0 and st["stored_pages"] == 0 and st["pages"] == 9   # 65 positions / 8


def test_decode_graph_outputs_the_models_queries(bundle):
    """attn_query is each layer's queries after RoPE, unscaled: what the torch model computes for
    the token at that position (the policy ranks pages by them)."""
    from zeroedge import model as zm
    from zeroedge.backends.onnxruntime import OrtRunner

    prompt = ids_(40, 5)
    r = OrtRunner(bundle, slots=64)
    r.prefill(np.array(prompt[:-1]))
    r.step(prompt[-1])
    got = np.asarray(r.last_query)[0]                                 # (L, H, hd)
    caught, project = [], zm.Attention.project

    def spy(self, *a, **kw):
        q, k, v = project(self, *a, **kw)
        caught.append(q[0, :, -1].detach().numpy())
        return q, k, v
    zm.Attention.project = spy
    try:
        with torch.no_grad():
            lively()(torch.tensor([prompt]))
    finally:
        zm.Attention.project = project
    want = np.stack(caught)
    assert got.shape == want.shape
    cos = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    assert cos.min() > 0.99 and np.allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(want, axis=-1), rtol=0.05)


@pytest.mark.parametrize("store", ["fp32", "int8"])
def test_ort_policy_under_pressure_keeps_window_table_and_log_consistent(bundle, store):
    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.kv.ort_policy import OrtThermalPolicy

    prompt, S, P = ids_(70, 2), 32, 4
    pol = OrtThermalPolicy(page_size=P, store=store)
    r = OrtRunner(bundle, slots=S, policy=pol)
    prefill_kv = r.pre.run(None, {"tokens": np.array([prompt])})[1:-1]

    def each(r):
        pol.check(r)
        pos = r.slot_pos[0]
        valid = pos[pos >= 0]
        assert valid.size <= S and len(set(valid.tolist())) == valid.size
        assert set(range(r.sinks)) <= set(valid.tolist())               # sinks never leave
    new = _greedy(r, prompt, 40, each)
    st = pol.stats()
    assert st["demoted"] > 0 and st["pages_migrated"] == pol.table.log.counts["migrate"]
    assert st["migrated_bytes"] == st["pages_migrated"] * pol.page_bytes()
    assert st["stored_pages"] + st["hot_pages"] == st["pages"] == -(-(70 + 40) // P)
    assert st["hot_pages"] <= S // P
    for e in pol.table.log.of("migrate"):
        assert {e.src, e.dst} == {int(Tier.HOT), int(pol.store_tier)}
    # every slot holds the K/V of the position it claims: prompt positions as prefill computed
    # them (all layers); generated ones at layer 0 (later layers saw a partial window). A page
    # fetched back from an int8 store holds its dequantised values
    full = r.pre.run(None, {"tokens": np.array([prompt + new])})[1:-1]
    assert pol.promoted > 0                          # the graph's queries fetch pages back
    for s, p in enumerate(r.slot_pos[0]):
        if p < 0:
            continue
        layers = range(r.L) if p < 70 else [0]
        for i in layers:
            ref = (prefill_kv if p < 70 else full)[2 * i][0, :, p]
            tol = 1e-4 if store == "fp32" else 1e-4 + 0.01 * np.abs(ref).max()
            np.testing.assert_allclose(r.k[i][0, :, s], ref, atol=tol)
    # the pages in the store round-trip (int8 within its quantisation error)
    for p in pol.table.pages_in(pol.store_tier):
        k, _ = pol._unpack(pol.store[pol.table.lookup(p)[1]])
        want = np.stack([prefill_kv[2 * i][0, :, p * P:(p + 1) * P] for i in range(r.L)]) \
            if (p + 1) * P <= 70 else None
        if want is not None:
            tol = 0 if store == "fp32" else 0.01 * np.abs(want).max()
            assert np.abs(k - want).max() <= tol + 1e-6


def _favour(pol, page):
    """The last step's queries as if they gave `page` all their mass (the bundle's decode graph
    outputs its queries: the policy ranks pages by them, kv.ort_policy)."""
    assert pol.worth is not None
    pol.worth = np.zeros(len(pol.table))
    pol.worth[page] = 1.0


def test_ort_policy_brings_a_stored_page_back_when_the_queries_want_it(bundle):
    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.kv.ort_policy import OrtThermalPolicy

    prompt, P = ids_(70, 3), 4
    pol = OrtThermalPolicy(page_size=P, store="fp32", fetch=1)
    r = OrtRunner(bundle, slots=32, policy=pol)
    kv = r.pre.run(None, {"tokens": np.array([prompt])})[1:-1]
    _greedy(r, prompt, 3)
    stored = pol.table.pages_in(pol.store_tier)
    page = stored[len(stored) // 2]
    before = pol.migrated
    _favour(pol, page)                                  # this page just became the queries' pick
    swaps = pol._migrate(r, (r.pos - 1) // P)
    assert [u for u, _ in swaps] == [page] and pol.migrated == before + 2
    assert pol.table.tier(page) == Tier.HOT and pol.table.tier(swaps[0][1]) == pol.store_tier
    block = pol.table.lookup(page)[1]
    assert (r.slot_pos[0, block * P:(block + 1) * P] == np.arange(page * P, (page + 1) * P)).all()
    for i in range(r.L):
        np.testing.assert_array_equal(r.k[i][0, :, block * P:(block + 1) * P],
                                      kv[2 * i][0, :, page * P:(page + 1) * P])
    pol.check(r)
    # no swap without a difference in worth
    assert pol._migrate(r, (r.pos - 1) // P) == []
    _greedy(r, prompt, 2, pol.check)


@pytest.mark.parametrize("store", ["fp32", "int8"])
def test_ort_policy_file_tier_is_lossless_private_and_removed(bundle, tmp_path, store):
    """Stored pages beyond store_pages go to the page file and come back bit for bit: the same
    greedy tokens and windows as without the file tier. The file is 0600 and unlinked from the
    start (nothing is ever left in the folder); once closed it refuses reads, and a page that cannot
    be read costs no eviction: its swap is skipped."""
    import os
    import stat

    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.kv.ort_policy import OrtThermalPolicy

    prompt, P = ids_(70, 4), 4
    ref_pol = OrtThermalPolicy(page_size=P, store=store)
    ref = OrtRunner(bundle, slots=32, policy=ref_pol)
    want = _greedy(ref, prompt, 30)
    pol = OrtThermalPolicy(page_size=P, store=store, spill_dir=tmp_path / "spill", store_pages=1)
    r = OrtRunner(bundle, slots=32, policy=pol)
    got = _greedy(r, prompt, 30, pol.check)
    assert got == want
    for i in range(r.L):
        np.testing.assert_array_equal(r.k[i], ref.k[i])
    st = pol.stats()
    assert st["spilled"] > 0 and st["stored_pages"] <= 1 and st["file_pages"] == st["spilled"] - st["file_reads"]
    assert st["stored_pages"] + st["file_pages"] == ref_pol.stats()["stored_pages"]
    fs = os.fstat(pol.file.fd)
    assert stat.S_IMODE(fs.st_mode) == 0o600 and fs.st_nlink == 0 and os.listdir(tmp_path / "spill") == []
    assert fs.st_size == st["file_bytes"] >= st["file_pages"] * pol.page_bytes()
    # a page in the file comes back into the window as the reference store holds it
    page, other = pol.table.pages_in(Tier.FILE)[:2]
    _favour(pol, page)
    swaps = pol._migrate(r, (r.pos - 1) // P)
    assert [u for u, _ in swaps] == [page] and pol.file_reads == st["file_reads"] + 1
    block = pol.table.lookup(page)[1]
    k_ref, _ = ref_pol._unpack(ref_pol.store[ref_pol.table.lookup(page)[1]])
    for i in range(r.L):
        np.testing.assert_array_equal(r.k[i][0, :, block * P:(block + 1) * P], k_ref[i])
    pol.check(r)
    # a closed file: the read fails, the swap is skipped and no page leaves the window
    pol.file.close()
    hot = sorted(pol.table.pages_in(Tier.HOT))
    _favour(pol, other)
    assert pol._migrate(r, (r.pos - 1) // P) == [] and pol.file_read_failed == 1
    assert sorted(pol.table.pages_in(Tier.HOT)) == hot and pol.table.tier(other) == Tier.FILE
    with pytest.raises(OSError):
        pol.file.write(0, np.zeros(pol.page_bytes(), np.uint8))


def test_ort_policy_file_tier_on_a_full_disk_keeps_every_page(bundle, tmp_path):
    """The file may not grow past 3 pages (RLIMIT_FSIZE, a real EFBIG from the kernel, in a child
    process): a growth that does not fit is retried for the one page needed, the spills past the
    limit leave their pages in the store, and decoding is unchanged."""
    import subprocess
    import sys

    code = f"""
import json, resource, signal, sys
sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(REPO / "tests")!r})
import numpy as np
from zeroedge.backends.onnxruntime import OrtRunner
from zeroedge.kv.ort_policy import OrtThermalPolicy
from test_serving import _greedy, ids_
prompt = ids_(70, 5)
ref = OrtThermalPolicy(page_size=4)
want = _greedy(OrtRunner({str(bundle)!r}, slots=32, policy=ref), prompt, 20)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)               # EFBIG instead of the signal
lim = 3 * ref.page_bytes()
resource.setrlimit(resource.RLIMIT_FSIZE, (lim, lim))
pol = OrtThermalPolicy(page_size=4, spill_dir={str(tmp_path / "full")!r}, store_pages=0)
r = OrtRunner({str(bundle)!r}, slots=32, policy=pol)
got = _greedy(r, prompt, 20, pol.check)
print(json.dumps({{"same": got == want, "page_bytes": pol.page_bytes(), **pol.stats()}}))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    st = json.loads(p.stdout.strip().splitlines()[-1])
    assert st["same"] and st["spill_failed"] > 0 and st["file_pages"] <= 3 and st["stored_pages"] > 0
    assert st["file_bytes"] == 3 * st["page_bytes"]     # the doubling to 4 did not fit, the 3rd page did


@pytest.fixture(scope="module")
def queryless_bundle(bundle, tmp_path_factory):
    """The same real export with the decode graph's attn_query output removed: a bundle exported
    before the graph output its queries (the runner is made with verify=False: a file changed)."""
    import shutil

    import onnx

    out = tmp_path_factory.mktemp("serving_old") / "bundle"
    shutil.copytree(bundle, out)
    g = onnx.load(str(out / "decode.portable.onnx"), load_external_data=False)
    kept = [o for o in g.graph.output if o.name != "attn_query"]
    assert len(kept) == len(g.graph.output) - 1
    del g.graph.output[:]
    g.graph.output.extend(kept)
    onnx.save(g, str(out / "decode.portable.onnx"))
    return out


def test_ort_policy_without_queries_ranks_by_heat_and_stays_consistent(queryless_bundle):
    """An older bundle (no attn_query): the runner passes no queries and the policy ranks pages by
    its proxy (decayed attention mass weighted by key cosines). Under pressure the window, table,
    store and log stay consistent, and a page the proxy finds hot comes back from the store."""
    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.kv.ort_policy import OrtThermalPolicy

    prompt, P = ids_(70, 6), 4
    pol = OrtThermalPolicy(page_size=P, store="fp32", fetch=1)
    r = OrtRunner(queryless_bundle, slots=32, policy=pol, verify=False)
    kv = r.pre.run(None, {"tokens": np.array([prompt])})[1:-1]
    _greedy(r, prompt, 30, pol.check)
    assert r.last_query is None and pol.worth is None
    st = pol.stats()
    assert st["demoted"] > 0 and st["stored_pages"] + st["hot_pages"] == st["pages"] == -(-(70 + 30) // P)
    hot = pol.table.pages_in(Tier.HOT)
    assert max(pol.heat.heat(p) for p in hot) > 0                 # the graph's mass reached the heat
    page = pol.table.pages_in(pol.store_tier)[0]
    pol.heat.step({page: 10.0})                                   # the proxy now finds it hottest
    swaps = pol._migrate(r, (r.pos - 1) // P)
    assert [u for u, _ in swaps] == [page] and pol.table.tier(page) == Tier.HOT
    block = pol.table.lookup(page)[1]
    for i in range(r.L):
        np.testing.assert_array_equal(r.k[i][0, :, block * P:(block + 1) * P],
                                      kv[2 * i][0, :, page * P:(page + 1) * P])
    pol.check(r)


def test_ort_policy_bad_window_is_refused_before_any_work(bundle):
    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.kv.ort_policy import OrtThermalPolicy

    with pytest.raises(UserError, match="does not divide the window"):
        OrtRunner(bundle, slots=30, policy=OrtThermalPolicy(page_size=8))
    with pytest.raises(UserError, match="needs at least"):
        OrtRunner(bundle, slots=16, policy=OrtThermalPolicy(page_size=8))
    with pytest.raises(UserError, match="int8 or fp32"):
        OrtThermalPolicy(store="fp16")


# ----------------------------------------------------------------------------------------------
# ServingSession
# ----------------------------------------------------------------------------------------------
def test_session_torch_dense_thermal_and_run_time_levels(model):
    from reference_generate import generate
    from zeroedge.serve.session import ServingSession

    prompt = ids_(100, 4)
    ref, _ = generate(model, prompt, 16)
    s = ServingSession(model, kv_budget=1.0, page_size=8, release_level=0)
    r0 = s.generate(prompt, 16)
    assert r0.tokens == ref and r0.detail["decoder"] == "DenseDecoder"
    assert not r0.mechanisms["thermal_kv"] and "L0" in r0.mechanisms["thermal_kv_reason"]
    s.set_level(3)                                      # switched at run time
    r1 = s.generate(prompt, 16)
    assert r1.detail["decoder"] == "ThermalDecoder" and r1.mechanisms["thermal_kv"]
    assert r1.tokens == ref                             # budget 1: every page is read
    s2 = ServingSession(model, kv_budget=0.25)               # the default pages: 8 tokens, 4 recent
    r2 = s2.generate(ids_(200, 5), 16)
    assert r2.detail["page_size"] == 8
    assert r2.mechanisms["thermal_kv"] and r2.device_kv_bytes < r2.full_kv_bytes
    assert r2.detail["hot_kv_bytes"] < r2.full_kv_bytes * 0.4
    assert len(r2.tokens) == 16 and r2.tokens_per_s > 0
    # gate semantics per request
    s2.set_level(1)
    assert s2.decide(500, 10).thermal_kv and not s2.decide(600, 10).thermal_kv
    s2.set_level(2)
    assert s2.decide(600, 10).thermal_kv and not s2.decide(600, 10, temperature=0.7).thermal_kv
    assert not s2.decide(10, 10).thermal_kv         # short prompts bypass
    with pytest.raises(UserError, match="release level"):
        s2.set_level(4)
    with pytest.raises(UserError, match="unknown thermal KV option.*colour"):
        ServingSession(model, kv_budget=0.1, thermal_opts={"colour": "red"})
    for bad in (0, 1.5, float("nan"), "x"):
        with pytest.raises(UserError, match=r"\(0, 1\]"):
            ServingSession(model, kv_budget=bad)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_circuit_breaker_drops_a_level_after_five_heavy_requests(model, bundle, backend):
    from zeroedge.serve.session import ServingSession, open_bundle

    alerts = []
    s = ServingSession(model if backend == "torch" else open_bundle(bundle, model_cfg=model.cfg), kv_budget=0.25,
                       page_size=4, trip_pages=1, on_alert=alerts.append)
    prompt = ids_(64, 5)
    for i in range(5):
        r = s.generate(prompt, 20)
        assert r.mechanisms["thermal_kv"] and r.pages_migrated > 1, r.pages_migrated
        assert s.thermal_gate.level == (3 if i < 4 else 2)
        assert r.mechanisms.get("attention_decode") == ("thermal window, sdpa" if backend == "torch" else None)
    # the breaker counts whole-model pages: torch's (layer, kv head) fetches / (layers x kv heads)
    per = len(model.layers) * model.cfg.n_kv_heads if backend == "torch" else 1
    assert s.model_pages(r.pages_migrated) == -(-r.pages_migrated // per)
    assert s.model_pages(per) == 1 and s.model_pages(per + 1) == (2 if per > 1 else per + 1)
    assert r.mechanisms["release_level_after"] == 2
    assert len(alerts) == 1 and "L3 -> L2" in alerts[0] and s.alerts == alerts
    assert s.metrics["thermal_kv_breaker_trips"] == 1 and s.metrics["thermal_kv_requests"] == 5
    # the default trip point: 1200 pages; these requests stay far below it
    s = ServingSession(model, kv_budget=0.25, page_size=4)
    for _ in range(5):
        s.generate(prompt, 8)
    assert s.thermal_gate.level == 3 and not s.alerts


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_generate_goes_through_the_engine_ends_at_eos_and_samples_by_seed(model, bundle, backend):
    """ServingSession.generate runs the serving engine over the session's decoder: greedy equals the
    reference, a picked EOS ends the tokens (kept last), sampling repeats by seed, and a request the
    decoder refuses is one UserError with the session still serving."""
    from reference_generate import generate
    from zeroedge.serve.session import ServingSession, open_bundle

    s = ServingSession(model if backend == "torch" else open_bundle(bundle, model_cfg=model.cfg))
    prompt = ids_(40, 8)
    ref, _ = generate(model, prompt, 16)
    k = next(i for i in range(3, 16) if ref[i] not in ref[:i])      # its first appearance ends the reply
    r = s.generate(prompt, 16, eos=ref[k])
    assert r.tokens == ref[:k + 1] and r.tokens_per_s > 0 and r.decode_s > 0 and r.prefill_s > 0
    assert s.generate(prompt, 16).tokens == ref
    hot = [s.generate(prompt, 12, temperature=1.5, seed=seed).tokens for seed in (1, 1, 2, 3, 4)]
    assert hot[0] == hot[1] and any(h != hot[0] for h in hot[2:]) and all(len(h) == 12 for h in hot)
    if backend == "onnxruntime":
        with pytest.raises(UserError, match="at least 2 tokens"):
            s.generate(prompt[:1], 4)
        assert s.generate(prompt, 16).tokens == ref                   # the runner was released
    with pytest.raises(UserError, match="new tokens exceed the model's context"):
        s.generate(prompt, 10 ** 6)
    with pytest.raises(UserError, match="needs a model or a bundle's runner"):
        ServingSession(None)
    with pytest.raises(UserError, match="a bundle runs on onnxruntime or tensorrt"):
        open_bundle(bundle, "torch")
    with pytest.raises(UserError, match="needs --engines"):
        open_bundle(bundle, "tensorrt")


def test_session_onnxruntime_dense_equals_reference(model, bundle):
    from reference_generate import generate
    from zeroedge.serve.session import ServingSession, open_bundle

    prompt = ids_(90, 6)
    ref, _ = generate(model, prompt, 12)
    s = ServingSession(open_bundle(bundle, model_cfg=model.cfg), kv_budget=0.2, page_size=4, release_level=0)
    r = s.generate(prompt, 12)
    assert r.tokens == ref and r.detail["window_slots"] == 102 and r.pages_migrated == 0
    s.set_level(3)
    r = s.generate(prompt, 12)
    # the torch decoder's memory: 20 % of the prompt (5 pages of 4) and the 12 new tokens (3 pages)
    assert r.mechanisms["thermal_kv"] and r.detail["window_slots"] == 32
    assert r.detail["thermal"]["stored_at_prefill"] > 0 and r.device_kv_bytes < r.full_kv_bytes
    other = model.cfg.with_(dim=32, name="other")
    with pytest.raises(UserError, match="dim=64"):
        open_bundle(bundle, model_cfg=other)
    with pytest.raises(UserError, match="bundle not found"):
        open_bundle(REPO / "no-such-bundle")


def test_session_paths_run_and_combine_with_thermal(model, tmp_path):
    from zeroedge.runtime.fast import PathsDecoder
    from zeroedge.serve.session import ServingSession, path_policies

    art = paths_only(tmp_path / "a", model.cfg)
    prompt = ids_(96, 7)
    s = ServingSession(model, artifact=art, kv_budget=1.0, page_size=8, release_level=3)
    r = s.generate(prompt, 12, paths=True)
    assert r.mechanisms["paths"] and r.mechanisms["thermal_kv"]
    assert r.detail["decoder"] == "ThermalPathsDecoder"
    kept = r.detail["paths_channels_kept_last_step"]
    assert set(kept) == {0, 2} and all(0 < v < 1 for v in kept.values())
    # the same tokens as the paths decode loop over a dense cache (budget 1 reads every page):
    # the prompt prefilled dense up to its last whole page (88), the rest through the loop
    from zeroedge.kv.evaluate import prefill

    pre = prefill(model, prompt[:88], stats=False)
    dec = PathsDecoder(model, 96 + 12, path_policies(model, art), graph=False)
    dec.load_prefix(pre["k"], pre["v"])
    lg, got = None, []
    for pos in range(88, 96):
        lg = dec.step(prompt[pos], pos)
    for i in range(12):
        got.append(int(lg.argmax()))
        lg = dec.step(got[-1], 96 + i)
    assert r.tokens == got
    s.set_level(0, which="thermal")
    r = s.generate(prompt, 12)                          # paths on by default at their level
    assert r.detail["decoder"] == "PathsDecoder" and r.tokens == got


def test_paths_are_never_silently_dense(model, bundle, tmp_path):
    from zeroedge.serve.session import ServingSession, open_bundle

    shipped = REPO / "zeroedge" / "data" / "smollm2-135m.calib"          # SIH only: no 'paths'
    with pytest.raises(UserError, match="no decode path predictors"):
        ServingSession(model, artifact=shipped)
    other = model.cfg.with_(dim=32, name="other")
    art = paths_only(tmp_path / "other", other)
    with pytest.raises(UserError, match=r"calibrated for other \(dim=32"):
        ServingSession(model, artifact=art)
    from zeroedge import calib_artifact

    good = paths_only(tmp_path / "good", model.cfg)
    meta, t = calib_artifact.load(good)
    with pytest.raises(UserError, match="threshold_act"):
        ServingSession(model, artifact=(meta, {k: v for k, v in t.items() if "threshold_act" not in k}))
    # asked for, but no predictors / a level that excludes the request: refused
    with pytest.raises(UserError, match="no path predictors"):
        ServingSession(model).generate(ids_(40), 4, paths=True)
    s = ServingSession(model, artifact=good, release_level=1)
    with pytest.raises(UserError, match="refusing to run dense"):
        s.decide(600, 10, paths=True)                   # 610 tokens: L1 excludes them
    r = s.generate(ids_(40), 4, paths=True)             # 44 tokens < 512: allowed at L1
    assert r.mechanisms["paths"] and r.detail["decoder"] == "PathsDecoder"
    assert r.mechanisms["attention_decode"] == "sdpa"        # a CPU: the Triton attention is CUDA's
    s.set_level(0, which="paths")
    r = s.generate(ids_(40), 4)                          # not asked: off below its level, said so
    assert not r.mechanisms["paths"] and "L0" in r.mechanisms["paths_reason"]
    with pytest.raises(UserError, match="refusing"):
        s.generate(ids_(40), 4, paths=True)
    with pytest.raises(UserError, match="runs the decode paths its bundle was exported with"):
        ServingSession(open_bundle(bundle), artifact=good)
    with pytest.raises(UserError, match="has no decode paths"):           # a dense bundle
        ServingSession(open_bundle(bundle)).generate(ids_(40), 4, paths=True)


# ----------------------------------------------------------------------------------------------
# zeroedge run
# ----------------------------------------------------------------------------------------------
PROMPT = "In the beginning God created the heaven and the earth. " * 2


def test_run_cli_torch_and_onnxruntime(bundle, tmp_path):
    p = run_cli("run", "tiny", "--prompt", PROMPT, "--max-new", "6", "--kv-budget", "25%",
                "--page-size", "8", "--json", "--threads", "1", check_rc=0)
    out = json.loads(p.stdout)
    assert out["new_tokens"] == 6 and out["prompt_tokens"] == len(PROMPT.encode())
    assert out["mechanisms"]["thermal_kv"] and out["decoder"] == "ThermalDecoder"
    assert 0 < out["device_kv_bytes"] < out["full_kv_bytes"] and out["tokens_per_s"] > 0
    art = paths_only(tmp_path / "a", __import__("zeroedge.model").model.PRESETS["tiny"])
    pf = tmp_path / "prompt.txt"
    pf.write_text(PROMPT)
    p = run_cli("run", "tiny", "--prompt-file", pf, "--max-new", "4", "--paths", "--calib", art,
                "--backend", "onnxruntime", "--bundle", bundle)
    assert p.returncode == 2 and "--calib is for the torch backend" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("run", "tiny", "--prompt-file", pf, "--max-new", "4", "--paths", "--backend", "onnxruntime",
                "--bundle", bundle)
    assert p.returncode == 2 and "has no decode paths" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("run", "tiny", "--prompt-file", pf, "--max-new", "4", "--paths", "--calib", art,
                "--json", check_rc=0)
    assert json.loads(p.stdout)["mechanisms"]["paths"]
    # onnxruntime: the bundle was exported from the lively model, which has tiny's shape
    p = run_cli("run", "tiny", "--prompt", PROMPT, "--max-new", "5", "--kv-budget", "0.3",
                "--page-size", "4", "--backend", "onnxruntime", "--bundle", bundle, check_rc=0)
    assert "[run] 5 tokens" in p.stderr and "thermal_kv" in p.stderr


@pytest.mark.parametrize("args,msg", [
    (["tiny", "--prompt", "x", "--kv-budget", "0"], "out of range"),
    (["tiny", "--prompt", "x", "--kv-budget", "1.5"], "out of range"),
    (["tiny", "--prompt", "x", "--backend", "onnxruntime"], "needs --bundle"),
    (["tiny", "--prompt", "x", "--backend", "onnxruntime", "--bundle", "/no/such/bundle"], "bundle not found"),
    (["no-such-model", "--prompt", "x"], "unknown model"),
    (["tiny", "--prompt", "x", "--paths"], "--paths needs --calib"),
    (["tiny", "--prompt", "x", "--paths", "--calib", str(REPO / "zeroedge/data/smollm2-135m.calib")],
     "no decode path predictors"),
    (["tiny", "--prompt", "x", "--release-level", "7"], "release-level"),
    (["tiny"], "exactly one of --prompt"),
    (["tiny", "--prompt-file", "/no/such/file"], "prompt file not found"),
])
def test_run_cli_bad_input_is_a_one_line_error(args, msg):
    p = run_cli("run", *args)
    assert p.returncode == 2, p.stderr
    assert msg in p.stderr and "Traceback" not in p.stderr and p.stdout == ""


@pytest.mark.parametrize("chunk", [2048, 40])      # one chunk; 3 chunks of 48 (40 rounded to the block of 16)
def test_the_torch_prefill_runs_an_artifact_s_sih_layers_as_one_pass_would(model, tmp_path, monkeypatch, chunk):
    """The same artifact gives the same mechanisms on every backend: the torch serving prefill runs its
    SIH/PAD layers (block rule on one), in chunks, skipping exactly the rows one pass over the same
    tokens skips; the model is left dense for decode and the next request; at temperature > 1 and for
    a paths-only artifact nothing is skipped, and the result says why."""
    import copy

    from zeroedge import model as model_mod

    monkeypatch.setattr(model_mod, "PREFILL_CHUNK", chunk)
    from artifacts import paths_only, sih_artifact, with_paths

    from zeroedge.mechanisms.pad import ZeroMLP, install_artifact
    from zeroedge.serve.session import ServingSession

    meta, t = sih_artifact(tmp_path / "sih", None, cfg=model.cfg, skip=[1, 3], block={3: 16}, thr={1: 0.5, 3: 0.5})
    with_paths(tmp_path / "both", meta, t, paths={0: (0.5, 0.01)}, n_layers=model.cfg.n_layers)
    s = ServingSession(model, artifact=tmp_path / "both")
    s.sih[1].record_masks = True
    prompt = ids_(130)
    res = s.generate(prompt, 3, paths=True)
    mech = res.mechanisms
    assert mech["paths"] and mech["sih_pad"] and mech["sih_pad_layers"] == [1, 3] and "not_applied" not in mech
    assert -1 < mech["sih_pad_ffn_flops_skipped"] < 1          # net of the anchors (negative on a tiny model)
    assert not any(isinstance(b.mlp, ZeroMLP) for b in model.layers)       # dense again after the prefill
    served = {i: k.clone() for i, k in s.sih[1].masks.items()}
    P = served[1].shape[1]
    assert P == (len(prompt) - 1) // s.page_size * s.page_size           # the prompt up to its last page
    ref = copy.deepcopy(model)
    rt = install_artifact(ref, meta, t)
    rt.record_masks, rt.active = True, True
    with torch.inference_mode():
        ref.hidden_states(torch.tensor([prompt[:P]]))
    for i in (1, 3):
        assert torch.equal(served[i], rt.masks[i]), i
        assert 0 < int((~served[i]).sum()) < P                          # the rule skips (and keeps) rows
    hot = s.generate(prompt, 3, temperature=1.5, paths=True).mechanisms
    assert hot["sih_pad"] is False and "temperature 1.5" in hot["sih_pad_reason"]
    res = ServingSession(model, artifact=paths_only(tmp_path / "p", model.cfg)).generate(ids_(40), 3, paths=True)
    assert "not_applied" not in res.mechanisms and "sih_pad" not in res.mechanisms


def test_chunked_prefill_gives_the_whole_prompt_s_kv(model):
    """The serving prefill on a GPU runs the prompt in chunks against the KV cache (activations of one
    chunk): the K/V it leaves are the one-pass prefill's."""
    from zeroedge.model import chunked_prefill

    ids = ids_(100)
    whole_k, whole_v, whole_q = chunked_prefill(model, ids, chunk=len(ids))
    k, v, q = chunked_prefill(model, ids, chunk=16)
    assert len(k) == len(model.layers) and k[0].shape[1] == len(ids)
    assert max(float((a - b).abs().max()) for a, b in zip([*k, *v], [*whole_k, *whole_v])) < 1e-4
    # the query covariances (the thermal sketch's) are the evaluator's, whatever the chunk
    from zeroedge.kv.evaluate import prefill

    ref = prefill(model, ids, stats=False)["qcov"]
    assert max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(q + whole_q, ref + ref)) < 1e-4


def test_a_device_memory_cap_admits_serves_thermal_or_refuses(tmp_path):
    """--device-memory: the request's forecast (runtime.memory) decides. Dense KV that fits runs
    dense; dense that does not but thermal does runs thermal (int8 cold store: on a CPU, host memory
    is the only memory) and says why; neither: a UserError naming both forecasts."""
    from zeroedge.model import ModelConfig, build
    from zeroedge.runtime.memory import HEADROOM, request_bytes
    from zeroedge.serve.session import ServingSession

    cfg = ModelConfig(vocab_size=256, dim=64, n_layers=48, n_heads=8, n_kv_heads=8, ffn_dim=128,
                      max_seq_len=8192, name="long-kv")
    m = build(cfg, seed=0).eval()
    T, new = 4000, 4
    dense = int(request_bytes(cfg, 4, T, new)["peak"] * (1 + HEADROOM))
    thermal = int(request_bytes(cfg, 4, T, new, 0.1, cold="int8", cold_shares_memory=True)["peak"] * (1 + HEADROOM))
    assert thermal < dense
    ids = ids_(T, 5)
    r = ServingSession(m, device_memory=dense + 1).generate(ids, new)
    assert not r.mechanisms["thermal_kv"] and r.mechanisms["device_memory"]["dense_forecast"] == dense
    r = ServingSession(m, device_memory=(dense + thermal) // 2).generate(ids, new)
    assert r.mechanisms["thermal_kv"] and "device memory cap" in r.mechanisms["thermal_kv_reason"]
    assert r.detail["cold_store"] == "int8" and r.device_kv_bytes < r.full_kv_bytes
    int4 = int(request_bytes(cfg, 4, T, new, 0.1, cold="int4", cold_shares_memory=True)["peak"] * (1 + HEADROOM))
    assert int4 < thermal
    r = ServingSession(m, device_memory=(int4 + thermal) // 2).generate(ids, new)   # int8 no longer fits
    assert r.mechanisms["thermal_kv"] and r.detail["cold_store"] == "int4"
    assert r.mechanisms["device_memory"]["cold_store"] == "int4"
    with pytest.raises(UserError, match="do not fit the .* device memory cap: dense KV needs"):
        ServingSession(m, device_memory=int4 - 1).generate(ids, new)
    with pytest.raises(UserError, match="do not fit"):                    # the session pinned int8
        ServingSession(m, device_memory=(int4 + thermal) // 2, thermal_opts={"cold": "int8"}).generate(ids, new)
    with pytest.raises(UserError, match="thermal KV is not allowed"):      # L0: thermal off
        ServingSession(m, device_memory=(dense + thermal) // 2, release_level=0).generate(ids, new)
    with pytest.raises(UserError, match="weights .* do not fit"):
        ServingSession(m, device_memory=1 << 20)
    # the cold store in a file (spill_dir) takes no device memory: served where int4 in memory is refused
    spill = str(tmp_path / "spill")
    in_file = int(request_bytes(cfg, 4, T, new, 0.1, cold="int8", cold_shares_memory=True,
                                cold_in_file=True)["peak"] * (1 + HEADROOM))
    assert in_file < int4
    r = ServingSession(m, device_memory=(in_file + int4) // 2, thermal_opts={"spill_dir": spill}).generate(ids, new)
    assert r.mechanisms["thermal_kv"] and r.detail["cold_store"] == "int8"
    assert r.detail["cold_on_device_bytes"] == 0 < r.detail["cold_in_file_bytes"]
    assert r.detail["scheduler"]["file_bytes"] >= r.detail["cold_in_file_bytes"]
    assert not os.listdir(spill)
    with pytest.raises(UserError, match="compressed"):
        ServingSession(m, thermal_opts={"spill_dir": spill, "cold": "host"})
    # a thermal request (budget 0.9: its window alone is nearly dense) that fits no cold store runs dense
    big = int(request_bytes(cfg, 4, T, new, 0.9, cold="int4", cold_shares_memory=True)["peak"] * (1 + HEADROOM))
    assert big > dense
    r = ServingSession(m, kv_budget=0.9, device_memory=dense + 1).generate(ids, new)
    assert not r.mechanisms["thermal_kv"] and "dense KV fits" in r.mechanisms["thermal_kv_reason"]


def test_run_under_a_cap_starts_the_allocator_with_segments_that_grow():
    """`run --device-memory / --board` sets PyTorch's expandable_segments before CUDA starts (fixed
    segments' reserve took ~1 GiB of the Orin Nano's cap on the H200); a setting already made is kept,
    and a run without a cap changes nothing."""
    import subprocess
    import sys

    from zeroedge.runtime.memory import cap_allocator

    code = ("import os, sys\nfrom zeroedge.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    assert not e.code, e.code\nprint('CONF=' + repr(os.environ.get('PYTORCH_CUDA_ALLOC_CONF')))")
    args = ["run", "tiny", "--prompt", "the quick brown fox", "--max-new", "2", "--json"]

    def conf(extra, env):
        e = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
        p = subprocess.run([sys.executable, "-c", code, *args, *extra], capture_output=True, text=True,
                           env={**e, **env}, timeout=900)
        assert p.returncode == 0, p.stderr[-2000:]
        return p.stdout.splitlines()[-1]

    assert conf(["--device-memory", "8G"], {}) == "CONF='expandable_segments:True'"
    assert conf(["--board", "orin-nano-8gb"], {}) == "CONF='expandable_segments:True'"
    assert conf([], {}) == "CONF=None"
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    assert conf(["--device-memory", "8G"], mine) == "CONF='expandable_segments:False'"
    on = "expandable_segments:True"
    for env, want in (({}, {"PYTORCH_CUDA_ALLOC_CONF": on, "PYTORCH_ALLOC_CONF": on}),
                      ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"},         # PyTorch reads one or the other
                       {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64," + on, "PYTORCH_ALLOC_CONF": on}),
                      ({"PYTORCH_ALLOC_CONF": ""}, {"PYTORCH_CUDA_ALLOC_CONF": on, "PYTORCH_ALLOC_CONF": on}),
                      (dict(mine), mine),
                      ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, {"PYTORCH_ALLOC_CONF": "expandable_segments:False"})):
        cap_allocator(env)
        assert env == want


def test_a_requests_decoder_is_gone_when_it_returns(tmp_path):
    """No reference cycle keeps a request's decoder (its KV, window and cold store) alive after
    generate returns: a serving process must not wait for the cyclic collector to get it back."""
    import gc

    from zeroedge.kv.attention import ThermalAttention
    from zeroedge.model import build
    from zeroedge.runtime.fast import Decoder
    from zeroedge.serve.session import ServingSession

    m = build("tiny", seed=0).eval()
    ids = [i % 200 + 1 for i in range(400)]
    for kw in ({}, {"kv_budget": 0.25}, {"kv_budget": 0.25, "thermal_opts": {"cold": "int8"}},
               {"kv_budget": 0.25, "thermal_opts": {"cold": "int4", "spill_dir": str(tmp_path)}}):
        sess = ServingSession(m, **kw)
        gc.collect()
        gc.disable()
        try:
            r = sess.generate(ids, 4)
            left = [type(o).__name__ for o in gc.get_objects() if issubclass(type(o), (Decoder, ThermalAttention))]
        finally:
            gc.enable()
        assert r.mechanisms["thermal_kv"] == ("kv_budget" in kw) and not left, (kw, left)


def test_run_keeps_the_torch_cold_store_in_a_spill_file(tmp_path):
    """`run --kv-spill DIR` on the torch backend: the same text as the cold store in memory, the cold
    pages in the file (none on the device), nothing left in DIR."""
    spill = tmp_path / "spill"
    args = ("run", "tiny", "--prompt", "the quick brown fox jumps over the lazy dog " * 5, "--max-new", "6",
            "--kv-budget", "0.2", "--json")
    mem = json.loads(run_cli(*args, check_rc=0).stdout.splitlines()[-1])
    fil = json.loads(run_cli(*args, "--kv-spill", str(spill), check_rc=0).stdout.splitlines()[-1])
    assert mem["mechanisms"]["thermal_kv"] and fil["mechanisms"]["thermal_kv"]
    assert fil["text"] == mem["text"]
    assert fil["cold_on_device_bytes"] == 0
    assert fil["cold_in_file_bytes"] == mem["cold_on_device_bytes"] > 0
    assert fil["device_kv_bytes"] == mem["device_kv_bytes"] - mem["cold_on_device_bytes"]
    assert not list(spill.iterdir())


def test_run_kv_ahead_serves_the_policy_eval_reports():
    """`run --kv-ahead 1`: thermal KV with pages scored a layer ahead, its policy in the JSON under the
    names `eval --kv-budget` reports (kv.policy.ThermalSettings); `--kv-fetch 1` likewise."""
    from dataclasses import fields

    from zeroedge.kv.policy import ThermalSettings

    args = ("run", "tiny", "--prompt", "the quick brown fox jumps over the lazy dog " * 5, "--max-new", "6",
            "--kv-budget", "0.2", "--json")
    own = json.loads(run_cli(*args, check_rc=0).stdout.splitlines()[-1])
    ahead = json.loads(run_cli(*args, "--kv-ahead", "1", check_rc=0).stdout.splitlines()[-1])
    assert own["mechanisms"]["thermal_kv"] and ahead["mechanisms"]["thermal_kv"]
    pol = ahead["thermal_policy"]
    assert set(pol) == {f.name for f in fields(ThermalSettings)}
    assert pol["ahead"] == 1 and own["thermal_policy"]["ahead"] == 0
    assert {k: v for k, v in pol.items() if k != "ahead"} == {k: v for k, v in own["thermal_policy"].items()
                                                                 if k != "ahead"}
    longer = ("run", "tiny", "--prompt", "the quick brown fox jumps over the lazy dog " * 10, "--max-new", "2",
              "--kv-budget", "0.2", "--json")                  # enough slot pages for more than one fetch
    own = json.loads(run_cli(*longer, check_rc=0).stdout.splitlines()[-1])
    one = json.loads(run_cli(*longer, "--kv-fetch", "1", check_rc=0).stdout.splitlines()[-1])
    assert one["thermal_policy"]["fetch"] == 1 < own["thermal_policy"]["fetch"]


def test_run_kv_spill_that_the_disk_refuses_is_one_line_and_leaves_nothing(tmp_path):
    """The torch cold store's file is reserved in full before a byte is written: a disk that refuses
    (here a 4 KiB file size limit) is a one-line error, exit 2, and an empty folder."""
    import resource
    import subprocess
    import sys

    spill = tmp_path / "spill"
    p = subprocess.run([sys.executable, "-m", "zeroedge.cli", "run", "tiny", "--prompt",
                        "the quick brown fox jumps over the lazy dog " * 5, "--max-new", "2", "--kv-budget", "0.2",
                        "--kv-spill", str(spill)], capture_output=True, text=True, timeout=900,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 12, 1 << 12)))
    errors = [x for x in p.stderr.splitlines() if x.startswith("zeroedge: error")]
    assert p.returncode == 2 and len(errors) == 1 and "cannot reserve" in errors[0], p.stderr
    assert "Traceback" not in p.stderr and not list(spill.iterdir())


def test_run_takes_a_memory_cap_or_a_board(tmp_path):
    out = run_cli("run", "tiny", "--prompt", "hello " * 30, "--max-new", "2", "--board", "orin-nano-8gb",
                  "--json", check_rc=0)
    assert json.loads(out.stdout.splitlines()[-1])["mechanisms"]["device_memory"]["cap"] == int(6.5 * 2**30)
    for args, msg in ((["--device-memory", "1M"], "do not fit"), (["--device-memory", "lots"], "not a size"),
                      (["--device-memory", "1G", "--board", "orin-nano-8gb"], "not both"),
                      (["--board", "orin-nano-4gb"], "unknown board"),
                      (["--backend", "onnxruntime", "--bundle", str(tmp_path), "--device-memory", "1G"],
                       "cap the torch backend")):
        r = run_cli("run", "tiny", "--prompt", "hello " * 30, "--max-new", "2", *args, check_rc=2)
        errors = [x for x in r.stderr.splitlines() if x.startswith("zeroedge: error")]
        assert len(errors) == 1 and msg in errors[0] and "Traceback" not in r.stderr
