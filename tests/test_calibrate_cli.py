"""The calibrate / eval contracts end to end on a tiny Llama (fast), plus every bad-input path."""
import json

import pytest

from conftest import run_cli

SMALL = ["--seq-len", "256", "--continuation", "64", "--train-seqs", "2", "--gate-seqs", "1",
         "--tokens", "4000"]


def test_calibrate_then_eval_contract(tiny_hf, text_file, tmp_path):
    art = tmp_path / "tiny.calib"
    p = run_cli("calibrate", tiny_hf, "--text", text_file, "--budget", "5%", "-o", art, "--json",
                "--paths", *SMALL, check_rc=0)
    q = json.loads(p.stdout.strip().splitlines()[-1])
    assert q["ppl_rise"] <= 0.05 + 1e-9
    assert 0 <= q["ffn_flops_skipped"] <= 1
    meta = json.loads((art / "calib.json").read_text())
    assert meta["layers"][-1]["skip"]          # the final layer's prefix FFN is never read
    assert meta["sih"]["bytes_fp16"] <= 12 * 1024
    p = run_cli("eval", tiny_hf, "--calib", art, "--text", text_file, "--ctx", "1200", "--json",
                check_rc=0)
    r = json.loads(p.stdout)
    for k in ("dense_ppl", "zero_ppl", "ffn_flops_skipped", "tokens", "zero_ppl_all_tokens"):
        assert k in r, k
    assert r["tokens"] == 1024 and r["ffn_flops_skipped"] > 0
    # the prefill as bundles run it (chunks of 512; the SIH scores carried between them)
    assert r["chunk"] == 512 and r["chunked_same_skips"] is True
    assert r["zero_ppl_chunked"] == pytest.approx(r["zero_ppl"], rel=1e-4)
    text = run_cli("eval", tiny_hf, "--calib", art, "--text", text_file, "--ctx", "1200", check_rc=0).stdout
    assert "perplexity, all tokens" in text and "zero_ppl_all_tokens" in text and "net of anchors" in text
    assert "prefill in chunks of 512" in text and "the same rows skipped as in one pass" in text
    assert f"{r['ffn_flops_skipped']:.1%}" in text and "dense_ppl:" not in text
    # other token rankings at the very per-layer row counts SIH skips on this text, SIH beside them
    for scorer in ("random", "norm", "oracle"):
        q = json.loads(run_cli("eval", tiny_hf, "--calib", art, "--text", text_file, "--ctx", "1200", "--json",
                               "--scorer", scorer, check_rc=0).stdout)
        assert q["scorer"] == scorer and q["per_layer_skip"] == r["per_layer_skip"]
        assert q["sih_zero_ppl"] == pytest.approx(r["zero_ppl"], rel=1e-6)
        assert q["ffn_flops_skipped_gross"] == pytest.approx(r["ffn_flops_skipped_gross"], rel=1e-9)
        assert "zero_ppl_all_tokens" not in q
    text = run_cli("eval", tiny_hf, "--calib", art, "--text", text_file, "--ctx", "1200", "--scorer", "oracle",
                   check_rc=0).stdout
    assert "tokens ranked by oracle at SIH's per-layer row counts" in text
    assert meta.get("paths"), "calibrate --paths wrote no path section"
    p = run_cli("eval", tiny_hf, "--calib", art, "--text", text_file, "--ctx", "1200", "--paths",
                "--json", check_rc=0)
    r = json.loads(p.stdout)
    assert {"dense_ppl", "paths_ppl", "ffn_bytes_skipped"} <= set(r)


def test_calibrate_gates_another_ranking(tiny_hf, text_file, tmp_path):
    """calibrate --scorer norm: the gate's rates (the rank rule) skip by the FFN input's norm. eval runs
    it as the artifact's own ranking (chunks skip the rows one pass skips; the last layer skips every
    row it may), and what cannot run it says so in one line: export (the plugins run SIH heads), eval
    --scorer with a peer (peers are compared at an SIH artifact's counts), an artifact naming an
    unknown ranking, and rank-rule layers with a rate out of [0, 1] or beside a block rule. --max-rate
    caps the rates the gate picks (the last layer, whose prompt rows nothing reads, skips them all)."""
    art = tmp_path / "norm.calib"
    p = run_cli("calibrate", tiny_hf, "--text", text_file, "--budget", "5%", "-o", art, "--json",
                "--scorer", "norm", "--max-rate", "50%", *SMALL, check_rc=0)
    q = json.loads(p.stdout.strip().splitlines()[-1])
    assert q["scorer"] == "norm" and q["ppl_rise"] <= 0.05 + 1e-9
    meta = json.loads((art / "calib.json").read_text())
    assert meta["sih"]["scorer"] == "norm" and meta["quality"]["max_rate"] == 0.5
    skips = [L for L in meta["layers"] if L["skip"]]
    assert skips and all(0 < L["rate"] <= 1 and L["threshold"] is None and L["rank_block"] == 512 for L in skips)
    assert skips[-1]["rate"] == 1.0 and all(L["rate"] <= 0.5 for L in skips[:-1])
    r = json.loads(run_cli("eval", tiny_hf, "--calib", art, "--text", text_file, "--ctx", "1200", "--json",
                           check_rc=0).stdout)
    assert r["scorer"] == "norm" and r["chunked_same_skips"] is True and "sih_zero_ppl" not in r
    last = str(len(meta["layers"]) - 1)
    prefill = r["ctx"] - r["tokens"]                       # every row but the protected ones
    assert r["per_layer_skip"][last] == pytest.approx(
        1 - (meta["sih"]["protect_first"] + meta["sih"]["protect_last"]) / prefill)
    bad_scorer = tmp_path / "magic.calib"
    bad_scorer.mkdir()
    (bad_scorer / "calib.json").write_text(json.dumps({**meta, "sih": {**meta["sih"], "scorer": "magic"}}))
    bad_rules = []
    for name, change in (("rate", {"rate": 1.5}), ("block", {"block_size": 64})):
        d = tmp_path / f"bad_{name}.calib"
        d.mkdir()
        layers = [{**L, **change} if L["skip"] else L for L in meta["layers"]]
        (d / "calib.json").write_text(json.dumps({**meta, "layers": layers}))
        bad_rules.append((["eval", tiny_hf, "--calib", d, "--text", text_file, "--ctx", "1200"],
                          "a rank-rule layer needs 'rate' in [0, 1]"))
    for args, msg in [
        (["export", tiny_hf, "--calib", art, "-o", tmp_path / "bundle"], "the bundles' plugins run SIH heads only"),
        (["eval", tiny_hf, "--calib", art, "--text", text_file, "--ctx", "1200", "--scorer", "random"],
         "ranks by norm"),
        (["eval", tiny_hf, "--calib", bad_scorer, "--text", text_file, "--ctx", "1200"], "'sih.scorer' must be one of"),
        *bad_rules,
        (["calibrate", tiny_hf, "--text", text_file, "--weights", "int4", "--weights-only", "--scorer", "norm",
          "-o", tmp_path / "w.calib"], "--weights-only calibrates no SIH/PAD"),
    ]:
        p = run_cli(*args)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
    assert not (tmp_path / "bundle").exists() and not (tmp_path / "w.calib").exists()


def test_calibrate_bad_inputs_exit_2_and_write_nothing(tiny_hf, text_file, tmp_path):
    out = tmp_path / "a.calib"
    cases = [
        (["calibrate", tmp_path / "missing", "--text", text_file, "-o", out], "model not found"),
        (["calibrate", tiny_hf, "--text", tmp_path / "none.txt", "-o", out], "text not found"),
        (["calibrate", tiny_hf, "--text", text_file, "--budget", "0%", "-o", out], "out of range"),
        (["calibrate", tiny_hf, "--text", text_file, "--budget", "2x", "-o", out], "not a number"),
        (["calibrate", tiny_hf, "--text", text_file, "--max-rate", "5%", "-o", out], "--max-rate must be between"),
    ]
    short = tmp_path / "short.txt"
    short.write_text("In the beginning God created the heaven and the earth. " * 20)
    cases.append((["calibrate", tiny_hf, "--text", short, "-o", out, *SMALL], "tokens"))
    for args, msg in cases:
        p = run_cli(*args)
        assert p.returncode == 2, (args, p.stderr)
        assert msg in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert not out.exists()


def test_eval_bad_inputs(tiny_hf, text_file, tmp_path):
    from artifacts import sih_artifact

    from zeroedge.model import ModelConfig

    bad = tmp_path / "bad.calib"
    bad.mkdir()
    (bad / "calib.json").write_text("{not json")
    no_skips = tmp_path / "no_skips.calib"
    sih_artifact(no_skips, None, skip=[], cfg=ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=2,
                                                          n_kv_heads=1, ffn_dim=64, name="tiny"))
    for args, msg in [
        (["eval", tiny_hf, "--calib", bad, "--text", text_file, "--ctx", "2048"], "corrupt"),
        (["eval", tiny_hf, "--calib", tmp_path / "x", "--text", text_file, "--ctx", "2048"], "not found"),
        (["eval", tiny_hf, "--text", text_file, "--ctx", "100", "--kv-budget", "0.1"], "--ctx"),
        (["eval", tiny_hf, "--text", text_file, "--ctx", "2048", "--kv-budget", "1.5"], "out of range"),
        (["eval", tiny_hf, "--text", text_file, "--ctx", "2048"], "nothing to evaluate"),
        (["eval", tiny_hf, "--text", text_file, "--ctx", "2048", "--kv-budget", "0.1", "--scorer", "norm"],
         "--scorer ranks SIH/PAD's prompt tokens"),
        (["eval", tiny_hf, "--text", text_file, "--ctx", "2048", "--scorer", "coin"], "Invalid value for '--scorer'"),
        (["eval", tiny_hf, "--calib", bad, "--paths", "--text", text_file, "--ctx", "2048", "--scorer", "random"],
         "--scorer ranks SIH/PAD's prompt tokens"),
        (["eval", tiny_hf, "--calib", no_skips, "--text", text_file, "--ctx", "2048", "--scorer", "oracle"],
         "skips no prompt rows"),
    ]:
        p = run_cli(*args)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)


def test_artifact_for_another_model_is_refused(tiny_hf, text_file, tmp_path):
    from artifacts import sih_artifact

    from zeroedge.model import ModelConfig

    art = tmp_path / "other.calib"
    sih_artifact(art, None, cfg=ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=2, n_kv_heads=1,
                                            ffn_dim=64, name="other"))
    p = run_cli("eval", tiny_hf, "--calib", art, "--text", text_file, "--ctx", "1200")
    assert p.returncode == 2 and "calibrated for other" in p.stderr


def test_eval_under_a_device_memory_cap(tiny_hf, text_file):
    """eval --device-memory / --board: what run would serve at --ctx under the cap (the serving
    forecast on a bf16 device with the int8 cold store): dense, thermal (then evaluated), or exit 2."""
    import pytest

    from zeroedge.commands.evaluate import served_under
    from zeroedge.errors import UserError
    from zeroedge.model import PRESETS
    from zeroedge.planner import TARGETS

    r = json.loads(run_cli("eval", tiny_hf, "--text", text_file, "--ctx", "1200", "--board", "orin-nano-8gb",
                           "--json", check_rc=0).stdout)
    d = r["device_memory"]
    assert d["served"] == "dense" and d["cap"] == TARGETS["orin-nano-8gb"].memory - TARGETS["orin-nano-8gb"].os_reserve
    assert 0 < d["dense_forecast"] < d["cap"] and "thermal_ppl" not in r
    small = run_cli("eval", tiny_hf, "--text", text_file, "--ctx", "1200", "--device-memory",
                    str(d["dense_forecast"] - 1), check_rc=2)
    assert "does not fit" in small.stderr and "Traceback" not in small.stderr
    # a 1B shape on an Orin Nano: dense up to ~94K tokens, thermal with int8 cold pages beyond, int4 further
    cfg, cap = PRESETS["llama-3.2-1b"], int(5.9 * 2**30)
    assert served_under(cfg, 60000, cap)["served"] == "dense"
    t = served_under(cfg, 100000, cap)
    assert t["served"] == "thermal" and t["cold_store"] == "int8" and t["thermal_forecast"] <= cap < t["dense_forecast"]
    t = served_under(cfg, 131000, cap)
    assert t["cold_store"] == "int4" and t["thermal_int4_forecast"] <= cap < t["thermal_forecast"]
    with pytest.raises(UserError, match="does not fit"):
        served_under(cfg, 131000, 3 << 30)
    # the cold store in a file (run --kv-spill) takes no device memory: 3x dense's ~94K fits, in memory it does not
    t = served_under(cfg, 3 * 94721, cap, cold_in_file=True)
    assert t["served"] == "thermal" and t["cold_store"] == "int8" and t["cold_in_file"]
    with pytest.raises(UserError, match="does not fit"):
        served_under(cfg, 3 * 94721, cap)
    r = run_cli("eval", tiny_hf, "--text", text_file, "--ctx", "1200", "--kv-budget", "0.2", "--cold-in-file", check_rc=2)
    assert "goes with a cap" in r.stderr and "Traceback" not in r.stderr


def test_eval_kv_ahead_measures_and_names_that_policy(tiny_hf, text_file):
    """`eval --kv-budget F --kv-ahead 1`: the contract with pages scored a layer ahead (the policy
    `run --kv-ahead 1` serves), named in the JSON options and in the table; not the default's losses."""
    args = ("eval", tiny_hf, "--text", text_file, "--ctx", "1200", "--kv-budget", "0.2")
    own = json.loads(run_cli(*args, "--json", check_rc=0).stdout)
    ahead = json.loads(run_cli(*args, "--kv-ahead", "1", "--json", check_rc=0).stdout)
    assert own["options"]["ahead"] == 0 and ahead["options"]["ahead"] == 1
    assert ahead["full_kv_ppl"] == own["full_kv_ppl"] and ahead["thermal_ppl"] != own["thermal_ppl"]
    assert "1 layer(s) ahead" in run_cli(*args, "--kv-ahead", "1", check_rc=0).stdout


def test_eval_kv_fetch_measures_and_names_that_policy(tiny_hf, text_file):
    """`eval --kv-budget F --kv-fetch 1`: the contract with one page swapped in a refresh (the policy
    `run --kv-fetch 1` serves), named in the JSON options and in the table."""
    from zeroedge.kv.policy import THERMAL

    args = ("eval", tiny_hf, "--text", text_file, "--ctx", "2048", "--kv-budget", "0.2")   # 20 slot pages
    own = json.loads(run_cli(*args, "--json", check_rc=0).stdout)
    one = json.loads(run_cli(*args, "--kv-fetch", "1", "--json", check_rc=0).stdout)
    assert own["options"]["fetch"] == THERMAL.fetch and one["options"]["fetch"] == 1
    assert one["fetch_pages_per_step_p99"] == 1 < own["fetch_pages_per_step_p99"]
    assert one["full_kv_ppl"] == own["full_kv_ppl"] and one["thermal_ppl"] != own["thermal_ppl"]
    assert "at most 1 fetched a refresh" in run_cli(*args, "--kv-fetch", "1", check_rc=0).stdout
