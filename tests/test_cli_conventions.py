"""The command line's conventions (zeroedge.commands.common) and its one error path (zeroedge.errors):
-o/--output for outputs, --ctx, fractions as 10% or 0.1, --target = JetPack, --board for plan,
--host always a hostname, no hidden commands; old spellings still work with a deprecation note;
every error one line; bad input refused before torch is imported; readable eval / run output;
every --help ends with examples, and run's options are listed under headings."""
import json
import shlex
import subprocess
import sys

import click
import pytest

from conftest import REPO, run_cli


def _commands():
    from zeroedge.cli import LazyGroup, cli

    g = LazyGroup()
    ctx = click.Context(cli)
    return {n: g.get_command(ctx, n) for n in g.list_commands(ctx)}


# sensor-fit (zeroedge/commands/sensor_fit.py, owned by the sensor work) still spells its output -o/--out;
# it moves to common.output_option(old_out=True) there, and this exception goes
NOT_YET = set()


def test_option_conventions_hold_for_every_command():
    from zeroedge.commands.common import FRACTION

    cmds = _commands()
    for name, c in cmds.items():
        assert not getattr(c, "hidden", False), name
        for p in c.params:
            if isinstance(p, click.Option) and (name, p.opts[0]) in NOT_YET:
                continue
            if not isinstance(p, click.Option):
                continue
            names = set(p.opts) | set(p.secondary_opts)
            where = f"{name} {'/'.join(p.opts)}"
            if p.hidden:       # only the deprecated spellings hide, and they never reach the function
                assert names <= {"--out", "--context", "--target"} and not p.expose_value, where
                continue
            assert not names & {"--out", "--context"}, where
            if "-o" in names:
                assert p.opts == ["-o", "--output"], where
            if "--host" in names:
                assert not p.is_flag and p.metavar == "HOST", where
            if "--target" in names:
                assert name in ("export", "check") and p.default.startswith("jetpack-"), where
            if names & {"--budget", "--kv-budget"}:
                assert p.type is FRACTION, where
    outputs = {n for n, c in cmds.items() for p in c.params if "--output" in getattr(p, "opts", ())}
    assert {"calibrate", "export", "build", "keygen", "demo"} <= outputs
    assert [p.opts for p in cmds["plan"].params if not getattr(p, "hidden", False) and "--board" in p.opts]


def _help(command, name):
    from zeroedge.cli import cli

    parent = click.Context(cli, info_name="zeroedge")
    return command.get_help(click.Context(command, info_name=name, parent=parent))


def test_every_help_ends_with_examples_that_parse():
    """`zeroedge --help` and every command's --help end with "Example(s):" and one or two invocations;
    each parses with that command's own options (names, choices, required options)."""
    from zeroedge.cli import cli

    cmds = _commands()
    for name, c in [("", cli), *cmds.items()]:
        lines = _help(c, name or "zeroedge").rstrip().splitlines()
        heads = [i for i, line in enumerate(lines) if line.strip() in ("Example:", "Examples:")]
        assert heads, f"zeroedge {name} --help has no example"
        head = heads[-1]
        runs = [line.strip() for line in lines[head + 1:]]
        assert 1 <= len(runs) <= 2 and all(r.startswith(f"zeroedge {name}".strip()) for r in runs), (name, runs)
        for piece in (p for r in runs for p in r.split("&&")):
            argv = shlex.split(piece, comments=True)
            assert argv[0] == "zeroedge" and argv[1] in cmds, piece
            sub = cmds[argv[1]]
            sub.make_context(argv[1], argv[2:], parent=click.Context(cli))   # raises on a bad option or value


def test_run_help_lists_its_options_under_headings():
    text = _help(_commands()["run"], "run")
    heads = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert heads == ["Input and output", "Backend", "Thermal KV cache",
                     "Weights, decode paths, speculative decoding, release level", "Device memory",
                     "Other options"], heads
    other = text.split("Other options:")[1].split("Examples:")[0].strip().splitlines()
    assert len(other) == 1 and other[0].endswith("Show this message and exit."), other   # every option placed


def test_fractions_take_percent_and_decimal():
    from zeroedge.commands.common import parse_budget
    from zeroedge.errors import UserError

    assert parse_budget("10%") == parse_budget("0.1") == pytest.approx(0.1)
    assert parse_budget("100%") == 1.0
    for bad in ("0", "0%", "1.5", "101%", "ten", ""):
        with pytest.raises(UserError):
            parse_budget(bad)


def test_old_spellings_still_work_with_one_deprecation_line(tmp_path):
    key = tmp_path / "k.key"
    p = run_cli("keygen", "--out", key, check_rc=0)
    assert key.is_file() and (tmp_path / "k.key.pub").is_file()
    assert p.stderr.strip() == "zeroedge: warning: --out is deprecated; use -o/--output"
    # both spellings at once: refused, nothing written
    p = run_cli("keygen", "-o", tmp_path / "a.key", "--out", tmp_path / "b.key")
    assert p.returncode == 2 and "not both" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "a.key").exists() and not (tmp_path / "b.key").exists()
    # a required -o given by its old spelling only is not "missing"
    p = run_cli("export", "tiny", "--out", tmp_path / "b", "--target", "jetpack-9")
    assert p.returncode == 2 and "unknown target jetpack-9" in p.stderr and "Missing" not in p.stderr


def test_plan_board_ctx_and_the_old_target_context(tmp_path):
    from zeroedge import bundle as bundle_mod
    from zeroedge.export.bundle_writer import export_bundle
    from zeroedge.model import build

    b = tmp_path / "b"
    export_bundle(build("tiny", seed=0), b, window=64)
    bundle_mod.verify(b)
    new = run_cli("plan", b, "--board", "orin-nano-8gb", "--ctx", 512, "--json", check_rc=0)
    old = run_cli("plan", b, "--target", "orin-nano-8gb", "--context", 512, "--json", check_rc=0)
    assert json.loads(new.stdout) == json.loads(old.stdout) and new.stderr == ""
    assert old.stderr.splitlines() == ["zeroedge: warning: --target is deprecated; use --board",
                                       "zeroedge: warning: --context is deprecated; use --ctx"]
    # --target names the JetPack software everywhere else: plan says so instead of guessing
    p = run_cli("plan", b, "--target", "jetpack-6.2", "--ctx", 512)
    assert p.returncode == 2 and "--target is the JetPack software" in p.stderr
    # --host is a hostname everywhere: plan's old flag is gone (renamed --onnxruntime-process)
    p = run_cli("plan", b, "--board", "orin-nano-8gb", "--ctx", 512, "--host")
    assert p.returncode == 2 and "No such option '--host'" in p.stderr
    host = run_cli("plan", b, "--board", "orin-nano-8gb", "--ctx", 512, "--onnxruntime-process", "--json",
                   check_rc=0)
    assert json.loads(host.stdout)["memory"]["workspace"] == 0 < json.loads(new.stdout)["memory"]["workspace"]


@pytest.mark.parametrize("argv", [
    ["run", "--bogus"],
    ["plan"],
    ["export", "tiny"],                                   # -o missing
    ["eval", "x", "--text", "kjv", "--ctx", "ten"],
    ["run", "tiny", "--prompt", "x", "--kv-budget", "lots"],
    ["run", "tiny", "--prompt", "x", "--kv-spill", "/tmp"],                                # torch: no budget, no cap
    ["run", "tiny", "--prompt", "x", "--kv-budget", "0.1", "--kv-spill", "/tmp", "--kv-store-pages", "3"],  # torch
    ["run", "tiny", "--prompt", "x", "--kv-store-pages", "3"],                             # without --kv-spill
    ["run", "--backend", "onnxruntime", "--bundle", ".", "--prompt", "x", "--kv-spill", "/tmp"],  # no --kv-budget
    ["run", "--backend", "onnxruntime", "--bundle", ".", "--prompt", "x", "--kv-budget", "0.1",
     "--kv-spill", "/dev/null/sub"],                                                       # not a folder
    ["run", "--backend", "onnxruntime", "--bundle", ".", "--prompt", "x", "--kv-budget", "0.1", "--kv-spill", ""],
    ["no-such-command"],
])
def test_usage_errors_are_one_line_exit_2(argv):
    p = run_cli(*argv)
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("zeroedge: error: "), p.stderr


@pytest.mark.parametrize("argv,needle", [
    (["run", "tiny", "--prompt", "x", "--kv-ahead", "1"], "--kv-ahead needs thermal KV"),
    (["run", "tiny", "--prompt", "x", "--kv-budget", "0.1", "--kv-ahead", "-1"], "--kv-ahead must be"),
    (["run", "--backend", "onnxruntime", "--bundle", ".", "--prompt", "x", "--kv-budget", "0.1", "--kv-ahead", "1"],
     "--kv-ahead is the torch decoder's"),
    (["eval", "x", "--text", "kjv", "--ctx", "2048", "--kv-ahead", "1", "--calib", "c"], "--kv-ahead needs thermal KV"),
    (["eval", "x", "--text", "kjv", "--ctx", "2048", "--kv-budget", "0.1", "--kv-ahead", "-2"], "--kv-ahead must be"),
    (["eval", "x", "--text", "kjv", "--ctx", "2048", "--kv-budget", "0.1", "--kv-ahead", "1", "--bundle", "b"],
     "--kv-ahead is the torch decoder's"),
    (["run", "tiny", "--prompt", "x", "--kv-fetch", "4"], "--kv-fetch needs thermal KV"),
    (["run", "tiny", "--prompt", "x", "--kv-budget", "0.1", "--kv-fetch", "0"], "--kv-fetch must be"),
    (["run", "tiny", "--prompt", "x", "--kv-budget", "0.1", "--kv-fetch", "65"], "from 1 to 64"),
    (["run", "--backend", "onnxruntime", "--bundle", ".", "--prompt", "x", "--kv-budget", "0.1", "--kv-fetch", "4"],
     "--kv-fetch is the torch decoder's"),
    (["eval", "x", "--text", "kjv", "--ctx", "2048", "--kv-fetch", "4", "--calib", "c"], "--kv-fetch needs thermal KV"),
    (["eval", "x", "--text", "kjv", "--ctx", "2048", "--kv-budget", "0.1", "--kv-fetch", "-3"], "--kv-fetch must be"),
    (["eval", "x", "--text", "kjv", "--ctx", "2048", "--kv-budget", "0.1", "--kv-fetch", "4", "--bundle", "b"],
     "--kv-fetch is the torch decoder's")])
def test_kv_policy_options_are_refused_where_they_cannot_apply(argv, needle):
    p = run_cli(*argv)
    assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_tensorrt_module_cli_takes_the_same_error_path(tmp_path):
    def mod(*args):
        return subprocess.run([sys.executable, "-m", "zeroedge.backends.tensorrt", *map(str, args)],
                              capture_output=True, text=True, cwd=REPO, timeout=120)

    for args, needle in [(["build", tmp_path / "nope", "-o", tmp_path / "o"], "bundle not found"),
                         (["build", tmp_path / "nope"], "Missing option '-o'"),
                         (["build", "-o", tmp_path / "o"], "Missing argument 'BUNDLE'"),
                         (["build", tmp_path / "nope", "-o", tmp_path / "o", "--workspace", "lots"], "not a size"),
                         (["generate", "b", "--engines", "e", "--tokens", "1 x"], "token ids"),
                         (["frobnicate"], "No such command")]:
        p = mod(*args)
        assert p.returncode == 2, (args, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("zeroedge: error: ") and needle in lines[0], p.stderr
    # spelled like `zeroedge build`; the old spellings still work, each with a note
    p = mod("build", "--bundle", tmp_path / "nope", "--out", tmp_path / "o", "--workspace-mb", 64)
    assert p.returncode == 2 and p.stderr.splitlines() == [
        "zeroedge: warning: --bundle is deprecated; use BUNDLE (an argument)",
        "zeroedge: warning: --out is deprecated; use -o/--output",
        "zeroedge: warning: --workspace-mb is deprecated; use --workspace SIZE",
        f"zeroedge: error: bundle not found: {tmp_path / 'nope'}"], p.stderr
    p = mod("build", tmp_path / "nope", "--bundle", tmp_path / "nope", "-o", tmp_path / "o")
    assert p.returncode == 2 and "not both" in p.stderr
    from zeroedge.backends.tensorrt import module_cli

    def spellings(c):
        return {o for q in c.params if isinstance(q, click.Option) and not q.hidden for o in q.opts}

    assert spellings(module_cli().commands["build"]) <= spellings(_commands()["build"])


def test_deploy_exit_codes_user_error_2_failure_1():
    """A host that failed before anything changed (preflight) is the user's to fix: exit 2; one whose
    new release was rolled back after the upload is a Failure: exit 1; both one line."""
    from types import SimpleNamespace

    from zeroedge.deploy.cli import finish
    from zeroedge.errors import UserError, run_command

    def result(phase):
        return SimpleNamespace(ok=False, phase=phase, name="orin-1", error=f"broke in {phase}")

    for phase, code in (("preflight", 2), ("health", 1)):
        @click.command()
        def c():
            finish([result(phase)], False, "deploy", False, lambda r: [])

        with pytest.raises(SystemExit) as e:
            run_command(c, [])
        assert e.value.code == code, phase
    assert UserError.exit_code == 2
    import zeroedge.deploy.cli as dc

    assert not any(isinstance(v, type) and issubclass(v, UserError) and v.exit_code != 2
                   for v in vars(dc).values())


def test_bad_model_is_refused_before_torch_is_imported(tmp_path):
    code = ("import sys\nfrom zeroedge.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    print('RC', e.code)\n"
            "print('TORCH', 'torch' in sys.modules)")
    missing = str(tmp_path / "no-model")
    for argv in (["run", missing, "--prompt", "x"],
                 ["eval", missing, "--text", "kjv", "--ctx", "2048", "--kv-budget", "10%"],
                 ["calibrate", missing, "--text", "kjv", "-o", str(tmp_path / "a")],
                 ["export", missing, "-o", str(tmp_path / "b")]):
        p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=REPO)
        assert "RC 2" in p.stdout and "TORCH False" in p.stdout, (argv, p.stdout, p.stderr)
        assert "model not found" in p.stderr, p.stderr


def test_run_text_output_units_reasons_and_random_weights():
    prompt = "In the beginning God created the heaven and the earth."
    p = run_cli("run", "tiny", "--prompt", prompt, "--max-new", "3", "--kv-budget", "10%", "--threads", "1",
                check_rc=0)
    err = p.stderr.strip().splitlines()
    assert err[0].startswith("zeroedge: warning: tiny is a preset with random weights")
    assert "mechanisms: dense" in err[1] and " MiB of " in err[1] and err[1].endswith("(100%)"), err
    assert err[2].startswith("[run] thermal KV not used: ") and "prompt" in err[2], err
    assert "would hold all" in err[2], err      # nothing would be cold at this length: dense
    # --json is unchanged: the reason is in the mechanisms, no text lines on stdout
    p = run_cli("run", "tiny", "--prompt", prompt, "--max-new", "3", "--kv-budget", "0.1", "--json", check_rc=0)
    out = json.loads(p.stdout)
    assert not out["mechanisms"]["thermal_kv"] and out["mechanisms"]["thermal_kv_reason"]
    assert isinstance(out["device_kv_bytes"], int)


def test_eval_table_has_units_and_explains_all_tokens(tiny_hf, text_file):
    from zeroedge.commands.evaluate import table

    p = run_cli("eval", tiny_hf, "--text", text_file, "--ctx", "1200", "--kv-budget", "10%", check_rc=0)
    out = p.stdout
    assert "thermal KV (--kv-budget 10%" in out and " MiB of " in out and "budget 10%" in out
    assert "{" not in out and "full_kv_bytes" not in out                  # no raw key dump
    j = json.loads(run_cli("eval", tiny_hf, "--text", text_file, "--ctx", "1200", "--kv-budget", "0.1",
                           "--json", check_rc=0).stdout)
    assert j["budget"] == pytest.approx(0.1) and {"full_kv_ppl", "thermal_ppl", "hot_kv_bytes"} <= set(j)
    # the SIH/PAD rows, from a result of the --json shape
    r = {"model": "m", "text": "t", "ctx": 2048, "tokens": 1024, "dense_ppl": 10.0, "zero_ppl": 10.1,
         "ppl_rise": 0.01, "ffn_flops_skipped": 0.155, "ffn_flops_skipped_gross": 0.16,
         "dense_ppl_all_tokens": 11.0, "zero_ppl_all_tokens": 11.5, "prefill_s_dense": 1.2, "prefill_s_zero": 1.0}
    text = "\n".join(table(r, calib="a.calib"))
    assert "(+1.00%)" in text and "15.5% net of anchors" in text and "1,200 ms" in text
    assert "zero_ppl_all_tokens" in text and "every token scored in one pass" in text


def test_eval_measures_a_bundle_runners_thermal_policy(tiny_hf, text_file, tmp_path):
    """eval --bundle --kv-budget: the onnxruntime runner's own thermal policy (what `run --backend
    onnxruntime` serves), in the window a request of that prompt and 1024 new tokens gets; at budget 1
    every position stays, so it is full KV."""
    import math

    b = tmp_path / "b"
    run_cli("export", tiny_hf, "-o", b, "--weights", "fp32", "--graphs", "portable", check_rc=0)
    args = ("eval", tiny_hf, "--text", text_file, "--ctx", "1200", "--json")
    one = json.loads(run_cli(*args, "--bundle", b, "--kv-budget", "1", check_rc=0).stdout)
    assert one["thermal_ppl"] == pytest.approx(one["full_kv_ppl"], rel=1e-4) and one["pages_migrated"] == 0
    tenth = json.loads(run_cli(*args, "--bundle", b, "--kv-budget", "0.1", check_rc=0).stdout)
    assert tenth["window_slots"] == 16 * (math.ceil(0.1 * 176 / 16) + 1024 // 16)   # 10 % of the prompt + new
    assert tenth["hot_kv_bytes"] < tenth["full_kv_bytes"] and tenth["policy"].startswith("bundle")
    assert math.isfinite(tenth["thermal_ppl"]) and tenth["prefix_tokens"] == 176
    for extra, msg in ((["--bundle", b], "--kv-budget F"),
                       (["--bundle", tmp_path / "none", "--kv-budget", "0.1"], "bundle not found"),
                       (["--bundle", b, "--kv-budget", "0.1", "--device-memory", "8G"], "do not combine")):
        p = run_cli(*args, *extra, check_rc=2)
        assert msg in p.stderr and "Traceback" not in p.stderr, p.stderr
