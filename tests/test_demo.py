"""The main job end to end on embedded defaults (short context to keep CI fast)."""
from conftest import run_cli


def test_demo_runs_dense_vs_zero_and_sensor_path(tmp_path):
    p = run_cli("demo", "--ctx", "1200", "--repeats", "1", "-o", tmp_path, check_rc=0)
    out = p.stdout
    assert "[dense] continuation ppl" in out and "[ zero] continuation ppl" in out
    assert "prefill FFN FLOPs skipped" in out and "Diagnosis:" in out
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    # quality on a passage the artifact never read stays within a few percent
    import re

    rise = float(re.search(r"continuation ppl = [\d.]+ \(([-+\d.]+)%\)", out).group(1))
    assert rise < 5.0, out
    assert "fdr" in out and (tmp_path / "sensor_timeline.png").is_file()
    # the HTTP server: four concurrent requests answered, 32 tokens each at most
    m = re.search(r"(\d+) tokens for 4 concurrent requests", out)
    assert m and 4 <= int(m.group(1)) <= 128, out


def test_demo_bad_options_exit_2(tmp_path):
    p = run_cli("demo", "--ctx", "100")
    assert p.returncode == 2 and "--ctx" in p.stderr
    p = run_cli("demo", "--calib", tmp_path / "nope", "--skip-sensor")
    assert p.returncode == 2 and "not found" in p.stderr
