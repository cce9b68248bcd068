"""Decode paths: mechanics on the tiny preset — the sparse MLP equals the dense MLP
restricted to the chosen channels, the predictor is deterministic, guards, byte accounting, the
calibration gate and the artifact errors."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from zeroedge.errors import UserError
from zeroedge.mechanisms.pad import MechanismError
from zeroedge.model import build
from zeroedge.paths import triton_gemv as tg
from zeroedge.export.paths_calibrate import PathBudgetError, PathsConfig, calibrate_paths
from zeroedge.paths.evaluate import run_eval
from zeroedge.paths.predictor import PathPredictor, fit_predictor
from zeroedge.paths.room import read_fraction, topk_mask
from zeroedge.paths.sparse import (PathPolicy, PathRuntime, bytes_summary, install, remove,
                                   sparse_mlp_gather)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny():
    return build("tiny", seed=0)


def _x(n=48, d=64, seed=1):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def test_gather_step_equals_dense_restricted_to_channels(tiny):
    mlp = tiny.layers[1].mlp
    x = _x(1)[0]
    idx = torch.tensor([3, 17, 40, 41, 100, 127])
    a = F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
    mask = torch.zeros(128)
    mask[idx] = 1
    want = mlp.down_proj(a * mask)
    got = sparse_mlp_gather(mlp, x, idx)
    assert torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(got, mlp(x), atol=1e-4)   # it really is sparse


def test_path_mlp_matches_gather_per_token(tiny):
    mlp = tiny.layers[2].mlp
    x = _x(40, seed=2)
    p = fit_predictor(x, mlp, 8)
    p.threshold = float(p.scores(x).median())
    rt = PathRuntime(active=True)
    install(tiny, {2: PathPolicy(predictor=p)}, rt)
    try:
        with torch.no_grad():
            y = tiny.layers[2].mlp(x[None])[0]
    finally:
        remove(tiny)
    keep = p.mask(x)
    assert 0.2 < keep.float().mean() < 0.8
    for t in (0, 7, 39):
        idx = keep[t].nonzero().squeeze(1)
        assert torch.allclose(y[t], sparse_mlp_gather(mlp, x[t], idx), atol=1e-5)
    # the kernels' torch references compute the same step (batch 1)
    t = 5
    z = (x[t:t + 1] @ p.a)
    act = tg.paths_gateup_ref(x[t:t + 1], z, p.bg, tg.fold_down_norm(p.bu, p.wd_norm),
                              mlp.gate_proj.weight, mlp.up_proj.weight, p.threshold)
    y_ref = tg.paths_down_ref(act, mlp.down_proj.weight.T.contiguous())
    assert torch.allclose(y_ref[0], y[t], atol=1e-5)


def test_predictor_is_deterministic_and_ranks_channels(tiny):
    mlp = tiny.layers[0].mlp
    x = _x(64, seed=3)
    p1, p2 = fit_predictor(x, mlp, 16), fit_predictor(x.clone(), mlp, 16)
    for k in ("a", "bg", "bu", "wd_norm"):
        assert torch.equal(getattr(p1, k), getattr(p2, k))
    assert torch.equal(p1.mask(x, 0.01), p2.mask(x, 0.01))
    # full rank reproduces gate and up exactly, so its top-k is the oracle's top-k
    full = fit_predictor(x, mlp, 64)
    a = F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
    oracle = topk_mask(a.abs() * mlp.down_proj.weight.norm(dim=0), 0.5)
    assert (topk_mask(full.scores(x), 0.5) == oracle).float().mean() > 0.99
    st = p1.state("layers.0.paths")
    q = PathPredictor.from_state(st, "layers.0.paths")
    assert torch.equal(q.scores(x), p1.scores(x))


def test_guards_inference_only(tiny):
    p = fit_predictor(_x(32), tiny.layers[0].mlp, 4)
    rt = PathRuntime(active=True)
    install(tiny, {0: PathPolicy(predictor=p)}, rt)
    try:
        with torch.enable_grad(), pytest.raises(MechanismError, match="inference-only"):
            tiny(torch.zeros(1, 4, dtype=torch.long))
        tiny.train()
        with torch.no_grad(), pytest.raises(MechanismError, match="model.eval"):
            tiny(torch.zeros(1, 4, dtype=torch.long))
    finally:
        tiny.eval()
        remove(tiny)


def test_byte_accounting(tiny):
    assert read_fraction("topk", 0.4, 64, 128) == pytest.approx(0.8)
    assert read_fraction("cats", 0.4, 64, 128) == pytest.approx(0.6)
    assert read_fraction("predictor", 0.4, 64, 128, 3 * 64 * 128 // 10) == pytest.approx(0.5, abs=1e-4)
    rt = PathRuntime(active=True)
    pol = {i: PathPolicy(method="topk", keep=0.25) for i in range(tiny.cfg.n_layers)}
    install(tiny, pol, rt)
    try:
        with torch.no_grad():
            tiny(torch.arange(20)[None])
    finally:
        remove(tiny)
    b = bytes_summary(tiny, rt)
    assert b["ffn_bytes_skipped"] == pytest.approx(0.75 / 3, abs=1e-6)
    assert b["channels_kept"] == pytest.approx(0.25, abs=0.01)


def _lists():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (500,), generator=g).tolist()]


def test_calibrate_and_eval_roundtrip(tmp_path):
    from zeroedge import calib_artifact

    m = build("tiny", seed=0)
    cfg = PathsConfig(method="predictor", seq_len=64, train_seqs=2, gate_seqs=2, rank=8,
                      search_steps=4, log=None)
    meta, tens = calibrate_paths(m, _lists(), 0.05, log=lambda s: None, cfg=cfg)
    q = meta["quality"]
    assert q["ppl_rise"] <= 0.05 and q["ffn_bytes_skipped"] > 0
    sparse = [lm["index"] for lm in meta["layers"] if lm["sparse"]]
    assert sparse and all(f"layers.{i}.paths.a" in tens for i in sparse)
    meta2, _ = calibrate_paths(m, _lists(), 0.05, log=lambda s: None, cfg=cfg)
    assert meta2["layers"] == meta["layers"]                    # deterministic
    full = {"model": {"name": "tiny", "config": m.cfg.to_dict()}, "layers": [], "sih": {},
            "paths": meta}
    calib_artifact.save(tmp_path / "a", full, tens)
    meta_r, tens_r = calib_artifact.load(tmp_path / "a")
    ids = _lists()[0][:200]
    r = run_eval(m, ids, meta_r, tens_r, continuation=128)
    assert r["paths_ppl"] != r["dense_ppl"] and 0 < r["ffn_bytes_skipped"] < 1
    assert not any(type(b.mlp).__name__ == "PathMLP" for b in m.layers)   # removed afterwards

    # bad artifacts: no paths section, another model, a missing tensor -> UserError, never dense
    with pytest.raises(UserError, match="paths"):
        run_eval(m, ids, {k: v for k, v in full.items() if k != "paths"}, tens, continuation=128)
    other = dict(full, model={"name": "other", "config": dict(m.cfg.to_dict(), dim=32)})
    with pytest.raises(UserError, match="dim"):
        run_eval(m, ids, other, tens, continuation=128)
    gone = {k: v for k, v in tens.items() if not k.startswith(f"layers.{sparse[0]}.paths.bg")}
    with pytest.raises(UserError, match=f"layer {sparse[0]}"):
        run_eval(m, ids, full, gone, continuation=128)


def test_budget_that_cannot_be_met_raises():
    m = build("tiny", seed=0)
    with torch.no_grad():               # confident predictions, so cutting channels costs
        m.embed_tokens.weight.mul_(40)
        for b in m.layers:
            b.mlp.down_proj.weight.mul_(30)
    cfg = PathsConfig(seq_len=64, train_seqs=1, gate_seqs=1, rank=4, keeps=(0.3,), log=None)
    with pytest.raises(PathBudgetError, match="cannot be met"):
        calibrate_paths(m, _lists(), 1e-6, log=lambda s: None, cfg=cfg)
    with pytest.raises(PathBudgetError, match="cannot be met"):
        calibrate_paths(m, _lists(), 0.0, log=lambda s: None, cfg=cfg)


def test_magnitude_method_calibrates_and_evaluates():
    m = build("tiny", seed=0)
    cfg = PathsConfig(method="magnitude", seq_len=64, train_seqs=1, gate_seqs=1, search_steps=3,
                      log=None)
    meta, tens = calibrate_paths(m, _lists(), 0.05, log=lambda s: None, cfg=cfg)
    assert meta["predictor"]["kind"] == "input-magnitude"
    sparse = [lm["index"] for lm in meta["layers"] if lm["sparse"]]
    assert sparse and f"layers.{sparse[0]}.paths.threshold_in" in tens
    full = {"model": {"name": "tiny", "config": m.cfg.to_dict()}, "paths": meta}
    r = run_eval(m, _lists()[0][:200], full, tens, continuation=128)
    assert 0 < r["ffn_bytes_skipped"] < 1
    gone = {k: v for k, v in tens.items() if "threshold_act" not in k}
    with pytest.raises(UserError, match="threshold_act"):
        run_eval(m, _lists()[0][:200], full, gone, continuation=128)


def test_measured_costs_are_monotone_and_the_gate_holds():
    m = build("tiny", seed=0)
    logs = []
    cfg = PathsConfig(method="magnitude", seq_len=64, train_seqs=1, gate_seqs=1, search_steps=3,
                      keeps=(0.9, 0.7, 0.5), costs="measured", log=None)
    meta, _ = calibrate_paths(m, _lists(), 0.05, log=logs.append, cfg=cfg)
    rows = [[float(c) for c in line.split("measured cost ")[1].split()] for line in logs
            if "measured cost" in line]
    assert len(rows) == m.cfg.n_layers
    assert all(r[0] >= 0 and all(b >= a for a, b in zip(r, r[1:])) for r in rows)
    assert meta["quality"]["ppl_rise"] <= 0.05
    with pytest.raises(ValueError, match="cost kind"):
        calibrate_paths(m, _lists(), 0.05, log=lambda s: None,
                        cfg=PathsConfig(method="magnitude", seq_len=64, train_seqs=1, gate_seqs=1,
                                        costs="guess", log=None))


def test_paths_decoder_matches_teacher_forced_paths():
    from zeroedge.runtime.fast import PathsDecoder

    m = build("tiny", seed=0)
    ids = _lists()[0][:24]
    pol = {}
    with torch.no_grad():
        _, inputs = m.hidden_states(torch.tensor([ids]), return_all=True)
    for i in (1, 3):
        blk = m.layers[i]
        x = blk.post_attention_layernorm(inputs[i][0])     # near enough to fit a predictor
        p = fit_predictor(x, blk.mlp, 8)
        p.threshold = float(p.scores(x).median())
        pol[i] = PathPolicy(predictor=p)
    rt = PathRuntime(active=True)
    install(m, pol, rt)
    try:
        with torch.no_grad():
            want = m(torch.tensor([ids]))[0]
    finally:
        remove(m)
    dec = PathsDecoder(m, 32, pol, graph=False)
    for pos, t in enumerate(ids):
        got = dec.step(t, pos)
        assert torch.allclose(got, want[pos], atol=1e-4), pos
    assert 0 < dec.kept()[1] < 1
    # the magnitude rule through the same loop
    mpol = {i: PathPolicy(method="magnitude", threshold_in=0.5, threshold=0.001) for i in (0, 2)}
    install(m, mpol, rt)
    try:
        with torch.no_grad():
            want = m(torch.tensor([ids]))[0]
    finally:
        remove(m)
    dec = PathsDecoder(m, 32, mpol, graph=False)
    for pos, t in enumerate(ids):
        assert torch.allclose(dec.step(t, pos), want[pos], atol=1e-4), pos
    assert 0 < dec.kept()[2] < 1
    with pytest.raises(ValueError, match="refusing"):   # a programming error: the CLI cannot reach it
        PathsDecoder(m, 32, {}, graph=False)


def test_paths_decoder_kernel_choice_is_checked(tmp_path, monkeypatch):
    """kernels='cuda' needs a CUDA device and the plugin library; a bad choice or a missing library
    is an error naming what is wrong (ValueError: the CLI always asks for "auto"; a missing library
    is the user's UserError), never a silent dense or torch fallback."""
    from zeroedge.paths import cuda_gemv
    from zeroedge.runtime.fast import PathsDecoder

    m = build("tiny", seed=0)
    pol = {0: PathPolicy(method="magnitude", threshold_in=0.5, threshold=0.001)}
    with pytest.raises(ValueError, match="auto, triton, cuda or torch"):
        PathsDecoder(m, 16, pol, graph=False, kernels="cublas")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        PathsDecoder(m, 16, pol, graph=False, kernels="cuda")
    with pytest.raises(ValueError, match="needs a CUDA device and Triton"):
        PathsDecoder(m, 16, pol, graph=False, kernels="triton")
    assert PathsDecoder(m, 16, pol, graph=False, kernels="torch").step(1, 0).shape[-1] == m.cfg.vocab_size
    missing = tmp_path / "nowhere" / "libzeroedge_kernels.so"
    with pytest.raises(UserError, match="not found at .*nowhere.*build_plugins"):
        cuda_gemv.load(missing)
    monkeypatch.setenv("ZEROEDGE_KERNELS_LIB", str(missing))
    assert cuda_gemv.default_path() == missing
    junk = tmp_path / "libjunk.so"
    junk.write_text("not a library")
    with pytest.raises(UserError, match="cannot load"):
        cuda_gemv.load(junk)
    libm = next((q for q in Path("/").glob("*lib*/**/libm.so.6")), None)
    if libm is not None:   # a real shared library that is not zeroedge's
        with pytest.raises(UserError, match="has no decode-path CUDA kernels"):
            cuda_gemv.load(libm)
