"""The main job end to end on embedded defaults (short contexts and few tokens to keep CI fast): every step
with its peer from the same run, one summary table printed and written as DIR/summary.json."""
import json
import math
import re

import pytest

from conftest import run_cli

STEPS = ["4-bit bundle, decode", "thermal KV, 768 tokens", "SIH/PAD prefill, 176 tokens", "serve, 4 clients at once",
         "sensor stream, shipped detector", "sensor-fit, another plant run"]


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_demo_runs_every_step_beside_its_peer(tmp_path):
    p = run_cli("demo", "--ctx", "1200", "--repeats", "1", "--max-new", "16", "--kv-ctx", "768", "-o", tmp_path,
                check_rc=0)
    out = p.stdout
    s = json.loads((tmp_path / "summary.json").read_text())
    rows = {r["step"]: r for r in s["rows"]}
    assert list(rows) == STEPS, list(rows)
    # one table at the end, each row's cells as summary.json has them
    table = out.split("=== zeroedge demo: summary")[1]
    for r in s["rows"]:
        line = next(x for x in table.splitlines() if x.startswith(r["step"]))
        assert r["figure"] in line and r["peer"] in line and r["quality"] in line, line
        assert finite(r["seconds"]) and r["seconds"] >= 0
    assert finite(s["total_s"]) and s["total_s"] >= sum(r["seconds"] for r in s["rows"]) - 1

    # 1. the 4-bit bundle against the fp16 bundle, both exported by this run, both decoding the same prompt
    v = rows["4-bit bundle, decode"]["values"]
    assert v["int4_tokens_per_s"] > 0 and v["fp16_tokens_per_s"] > 0 and v["new_tokens"] == 16
    assert v["speedup"] == pytest.approx(v["int4_tokens_per_s"] / v["fp16_tokens_per_s"])
    assert f"{v['int4_tokens_per_s']:.1f} tok/s" in rows["4-bit bundle, decode"]["figure"]
    assert v["int4_bundle_bytes"] < 0.5 * v["fp16_bundle_bytes"]
    assert finite(v["int4_ppl"]) and finite(v["fp16_ppl"]) and abs(v["ppl_rise"]) < 0.05, v
    assert 0 <= v["greedy_tokens_same"] <= 16
    for kind in ("int4", "fp16"):
        assert (tmp_path / "bundles" / f"smollm2-135m-{kind}" / "manifest.json").is_file()
        assert v["export_s"][kind] > 0
    assert "zeroedge export smollm2-135m --weights int4" in out

    # 2. thermal KV: less KV on the device than full KV, perplexity of both over the same tokens
    v = rows["thermal KV, 768 tokens"]["values"]
    assert 0 < v["hot_kv_fraction"] < v["device_kv_fraction"] < 1, v
    assert finite(v["full_kv_ppl"]) and finite(v["thermal_ppl"]) and v["scored_tokens"] == 256
    assert v["ppl_rise"] == pytest.approx(v["thermal_ppl"] / v["full_kv_ppl"] - 1)

    # 3. SIH/PAD prefill: quality on a passage the artifact never read stays within a few percent
    v = rows["SIH/PAD prefill, 176 tokens"]["values"]
    assert v["ppl_rise"] < 0.05 and 0 < v["ffn_flops_skipped"] < 1 and v["speedup"] > 0, v
    assert "prefill FFN FLOPs skipped" in out and "Diagnosis:" in out
    rise = float(re.search(r"continuation ppl = [\d.]+ \(([-+\d.]+)%\)", out).group(1))
    assert abs(rise / 100 - v["ppl_rise"]) < 1e-4
    assert (tmp_path / "demo.png").stat().st_size > 10_000

    # 4. the HTTP server: four concurrent requests answered (32 tokens each at most), then one at a time
    v = rows["serve, 4 clients at once"]["values"]
    assert 4 <= v["tokens"] <= 128 and 4 <= v["tokens_alone"] <= 128 and 0 <= v["answers_identical"] <= 4, v
    assert re.search(rf"{v['tokens']} tokens for 4 concurrent requests", out)

    # 5. the sensor path and the PCA monitor on the same runs
    for step in STEPS[4:]:
        v = rows[step]["values"]
        assert 0 <= v["fdr"] <= 1 and 0 <= v["far"] <= 1 and 0 <= v["pca"]["fdr"] <= 1, v
        assert v["predicted_fault"] == "fault_01"
    assert (tmp_path / "sensor_timeline.png").is_file()

    # a rerun reuses the bundles exported here, and only bundles of the same kind
    from zeroedge.commands.demo import cached

    d, k = tmp_path / "bundles", rows["4-bit bundle, decode"]["values"]["cpu_kernels"]
    assert cached(d / "smollm2-135m-int4", "int4", k)["weights"]["quantization"]["zero_point"] == "float"
    assert cached(d / "smollm2-135m-fp16", "fp16", k)["weights"]["dtype"] == "float16"
    assert cached(d / "smollm2-135m-fp16", "int4", k) is None
    assert cached(d / "smollm2-135m-int4", "int4", "stock" if k == "zeroedge" else "zeroedge") is None
    assert cached(tmp_path / "nothing", "int4", k) is None


def test_demo_bad_options_exit_2(tmp_path):
    p = run_cli("demo", "--ctx", "100")
    assert p.returncode == 2 and "--ctx" in p.stderr
    p = run_cli("demo", "--kv-ctx", "300")
    assert p.returncode == 2 and "--kv-ctx" in p.stderr
    p = run_cli("demo", "--calib", tmp_path / "nope", "--skip-sensor")
    assert p.returncode == 2 and "not found" in p.stderr
