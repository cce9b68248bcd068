"""`zeroedge build BUNDLE -o ENGINES [--plugins LIB] [--cc 8.6] [--json]` through the real CLI (a
subprocess) with TensorRT-RTX on the CPU: the --json contract, the readable output, the shared
`python -m zeroedge.backends.tensorrt build` path, and every kind of bad input (one line, exit 2, no
traceback, nothing left in -o). Tiny bundles, SM86 builds of about a second each; no skip in CI
(conftest's rtx / plugin_lib / tiny_trt_bundles)."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_cli

CC = "8.6"


def _zeroedge_nodes(path):
    import onnx

    from zeroedge import plugin_spec

    return sum(n.domain == plugin_spec.DOMAIN for n in onnx.load(str(path), load_external_data=False).graph.node)


def _env(plugin_lib, **more):
    """The CLI's environment: the plugin library by $ZEROEDGE_PLUGINS_LIB, nothing else inherited
    that would choose it."""
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROEDGE_PLUGINS_LIB", "ZEROEDGE_PLUGIN_LIB")}
    env["ZEROEDGE_PLUGINS_LIB"] = str(plugin_lib)
    env.update(more)
    return env


def _run(*args, env):
    """run_cli with exactly `env` (run_cli adds to os.environ, which may name a plugin library)."""
    return subprocess.run([sys.executable, "-m", "zeroedge.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600, cwd=REPO)


def _leftovers(parent: Path):
    return [p.name for p in parent.iterdir() if ".building-" in p.name]


@pytest.fixture(scope="module")
def built(rtx, plugin_lib, tiny_trt_bundles, tmp_path_factory):
    """`zeroedge build zero -o OUT --cc 8.6 --json`, the plugin library from $ZEROEDGE_PLUGINS_LIB."""
    out = tmp_path_factory.mktemp("build-cli") / "engines"
    p = _run("build", tiny_trt_bundles / "zero", "-o", out, "--cc", CC, "--json", env=_env(plugin_lib))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout), out, p


def test_json_contract(rtx, built, tiny_trt_bundles):
    doc, out, p = built
    assert doc["backend"] == f"tensorrt_rtx {rtx.__version__}"
    bundle = tiny_trt_bundles / "zero"
    graphs = sorted(f.name[: -len(".trt.onnx")] for f in bundle.glob("*.trt.onnx"))
    assert sorted(e["graph"] for e in doc["engines"]) == graphs == ["decode", "prefill"]
    for e in doc["engines"]:
        f = Path(e["file"])
        assert f.is_absolute() and f.parent == out.resolve() and f.name == f"{e['graph']}.engine"
        assert isinstance(e["bytes"], int) and e["bytes"] == f.stat().st_size > 1 << 20
        assert isinstance(e["layers"], int) and e["layers"] > 100
        assert e["plugin_layers"] == _zeroedge_nodes(bundle / f"{e['graph']}.trt.onnx")
    assert {e["graph"]: e["plugin_layers"] for e in doc["engines"]} == {"prefill": 12, "decode": 0}
    assert doc["cc"] == CC and doc["plugins_serialized"] is True
    assert doc["timing_cache"] is None                    # TensorRT-RTX keeps none (runtime_traits)
    assert sorted(x.name for x in out.iterdir()) == ["decode.engine", "engines.json", "prefill.engine"]
    assert p.stdout.strip().startswith("{") and p.stdout.strip().endswith("}")   # one object, nothing else
    assert not _leftovers(out.parent)


def test_plugin_library_is_serialized(rtx, plugin_lib, tiny_trt_bundles, built, tmp_path):
    """The library travels inside the engine: it grows by about the library's size."""
    doc, _, _ = built
    p = _run("build", tiny_trt_bundles / "zero", "-o", tmp_path / "e", "--cc", CC, "--json",
             "--no-serialize-plugins", env=_env(plugin_lib))
    assert p.returncode == 0, p.stderr
    bare = {e["graph"]: e["bytes"] for e in json.loads(p.stdout)["engines"]}
    for e in doc["engines"]:
        assert e["bytes"] - bare[e["graph"]] > 0.8 * plugin_lib.stat().st_size


def test_readable_output_and_default_plugins(rtx, plugin_lib, tiny_trt_bundles, tmp_path):
    """One line per engine on stdout (graph, layers, plugin layers, MiB, seconds), then a summary; the
    paths bundle has plugin layers in decode too. The plugin library: --plugins, or the checkout's
    plugins/build when that is the one the session uses."""
    from zeroedge.backends.tensorrt import source_checkout_plugins

    bundle = tiny_trt_bundles / "paths"
    env = _env(plugin_lib)
    del env["ZEROEDGE_PLUGINS_LIB"]
    (tmp_path / "e").mkdir()                               # an empty -o is fine without --force
    args = ["build", bundle, "-o", tmp_path / "e", "--cc", CC]
    if plugin_lib.resolve() != (source_checkout_plugins() or Path("/")).resolve():
        args += ["--plugins", plugin_lib]
    p = _run(*args, env=env)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 3, p.stdout
    for line, g in zip(lines, ("prefill", "decode")):
        m = re.fullmatch(rf"{g}: (\d+) layers, (\d+) plugin layers, ([\d.]+) MiB, ([\d.]+) s -> (\S+)", line)
        assert m, line
        assert int(m.group(2)) == _zeroedge_nodes(bundle / f"{g}.trt.onnx") > 0
        assert Path(m.group(5)).stat().st_size / (1 << 20) == pytest.approx(float(m.group(3)), abs=0.06)
    assert lines[2].startswith(f"tensorrt_rtx {rtx.__version__} for compute capability {CC}: 2 engine(s)")
    assert p.stderr == ""                                  # no terminal: no progress, and TensorRT kept quiet


def test_force_replaces_and_a_failed_build_keeps_the_old(rtx, plugin_lib, tiny_trt_bundles, tmp_path):
    out = tmp_path / "e"
    out.mkdir()
    (out / "old.txt").write_text("old")
    env = _env(plugin_lib)
    bad = _bad_field_bundle(tiny_trt_bundles, tmp_path / "bad")
    p = _run("build", bad, "-o", out, "--cc", CC, "--force", env=env)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert sorted(x.name for x in out.iterdir()) == ["old.txt"] and not _leftovers(tmp_path)
    p = _run("build", tiny_trt_bundles / "dense", "-o", out, "--cc", CC, "--force", "--json", env=env)
    assert p.returncode == 0, p.stderr
    assert sorted(x.name for x in out.iterdir()) == ["decode.engine", "engines.json", "prefill.engine"]
    assert not _leftovers(tmp_path)


def test_module_build_is_the_same_path(rtx, plugin_lib, tiny_trt_bundles, tmp_path):
    """`python -m zeroedge.backends.tensorrt build` (what the deploy runs on the device) builds through
    the same function into an existing folder, keeping what else it holds, and prints the same JSON."""
    out = tmp_path / "build"
    (out / "plugins").mkdir(parents=True)
    (out / "plugins" / "keep.so").write_bytes(b"x")
    p = subprocess.run([sys.executable, "-m", "zeroedge.backends.tensorrt", "build",
                        tiny_trt_bundles / "zero", "--plugins", plugin_lib, "-o", out, "--cc", CC],
                       capture_output=True, text=True, env=_env(plugin_lib), timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["backend"] == f"tensorrt_rtx {rtx.__version__}"
    assert {e["graph"]: (e["plugin_layers"], Path(e["file"]).stat().st_size == e["bytes"])
            for e in doc["engines"]} == {"prefill": (12, True), "decode": (0, True)}
    assert (out / "plugins" / "keep.so").read_bytes() == b"x" and not _leftovers(out)
    p = subprocess.run([sys.executable, "-m", "zeroedge.backends.tensorrt", "build", "--bundle",
                        tmp_path / "nope", "--out", out], capture_output=True, text=True, env=_env(plugin_lib),
                       timeout=600, cwd=REPO)          # the old spellings: a note each, then the error
    assert p.returncode == 2 and "bundle not found" in p.stderr and "Traceback" not in p.stderr
    assert p.stderr.splitlines()[:2] == ["zeroedge: warning: --bundle is deprecated; use BUNDLE (an argument)",
                                         "zeroedge: warning: --out is deprecated; use -o/--output"]


def test_help_does_not_import_tensorrt():
    code = ("import sys; from zeroedge.cli import main\n"
            "try:\n    main(['build', '--help'])\nexcept SystemExit: pass\n"
            "print('HEAVY', [m for m in ('tensorrt', 'tensorrt_rtx', 'onnx', 'torch', 'numpy') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert "--workspace" in out.stdout and "HEAVY []" in out.stdout, out.stdout + out.stderr


# ------------------------------------------------------------------------------ bad input

def _rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of bundle `src` changed by edit(dst), with a manifest that verifies again."""
    from zeroedge import bundle as bundle_mod

    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    edit(dst)
    bundle_mod.write_manifest(dst, {k: v for k, v in m.items()
                                    if k not in ("files", "format", "format_version", "zeroedge_version")})
    return dst


def _bad_field_bundle(bundles: Path, dst: Path) -> Path:
    """zero with a NaN threshold on the first ZeroEdgeSIH node: the creator refuses it."""
    def edit(b):
        import onnx

        m = onnx.load(str(b / "prefill.trt.onnx"), load_external_data=False)
        sih = next(n for n in m.graph.node if n.op_type in ("ZeroEdgeSIH", "ZeroEdgeSIHChunk"))
        next(a for a in sih.attribute if a.name == "threshold").f = float("nan")
        onnx.save(m, str(b / "prefill.trt.onnx"))
    return _rewrite(bundles / "zero", dst, edit)


def _bad_inputs(bundles: Path, d: Path, plugin_lib: Path):
    """(id, args after `build`, extra env, what stderr must say)."""
    zero = bundles / "zero"
    modified = d / "modified"
    shutil.copytree(zero, modified)
    with open(modified / "decode.trt.onnx", "ab") as f:
        f.write(b"\0")
    no_trt = _rewrite(zero, d / "no-trt", lambda b: [f.unlink() for f in b.glob("*.trt.onnx")])
    garbage = _rewrite(zero, d / "garbage", lambda b: (b / "prefill.trt.onnx").write_bytes(b"not a graph"))
    bad_field = _bad_field_bundle(bundles, d / "bad-field")
    (d / "a-file").write_text("x")
    (d / "full").mkdir()
    (d / "full" / "keep.txt").write_text("keep")
    (d / "not-a-lib.so").write_text("not an ELF file")
    out = d / "out"
    cc = ["--cc", CC]
    cases = [
        ("missing-bundle", [d / "nope", "-o", out, *cc], {}, r"bundle not found: .*nope"),
        ("not-a-bundle", [d / "full", "-o", out, *cc], {}, r"not a zeroedge bundle"),
        ("modified-bundle", [modified, "-o", out, *cc], {},
         r"bundle verification failed \(modified decode\.trt\.onnx\)"),
        ("no-trt-graph", [no_trt, "-o", out, *cc], {}, r"no \*\.trt\.onnx graph to build"),
        ("out-is-a-file", [zero, "-o", d / "a-file", *cc], {}, r"exists and is not a folder"),
        ("out-unwritable", [zero, "-o", d / "a-file" / "engines", *cc], {}, r"cannot write to .*a-file"),
        ("out-not-empty", [zero, "-o", d / "full", *cc], {}, r"not empty \(pass --force to replace it\)"),
        ("out-holds-the-bundle", [zero, "-o", bundles, *cc, "--force"], {}, r"holds the bundle"),
        ("cc-unknown", [zero, "-o", out, "--cc", "8.7"], {},
         r"cannot build for compute capability 8\.7: it knows 7\.5, 8\.0, 8\.6, 8\.9, 12\.0, 12\.1"),
        ("cc-not-a-number", [zero, "-o", out, "--cc", "ampere"], {}, r"compute capability ampere"),
        ("plugins-missing", [zero, "-o", out, *cc, "--plugins", d / "nope.so"], {},
         r"plugin library not found: .*nope\.so \(--plugins\); build it with scripts/build_plugins"),
        ("plugins-env-missing", [zero, "-o", out, *cc], {"ZEROEDGE_PLUGINS_LIB": str(d / "gone.so")},
         r"plugin library not found: .*gone\.so \(\$ZEROEDGE_PLUGINS_LIB\); build it with scripts/build_plugins"),
        ("plugins-not-a-library", [zero, "-o", out, *cc, "--plugins", d / "not-a-lib.so"], {},
         r"could not load the plugin library"),
        ("parser-error", [garbage, "-o", out, *cc], {}, r"ONNX parser rejected prefill\.trt\.onnx"),
        ("plugin-field-error", [bad_field, "-o", out, *cc], {},
         r"ZeroEdgeSIH: field 'threshold' must be a finite number"),
        ("workspace-not-a-size", [zero, "-o", out, *cc, "--workspace", "lots"], {}, r"--workspace 'lots' is not a size"),
        ("workspace-too-small", [zero, "-o", out, *cc, "--workspace", "1K"], {}, r"--workspace '1K' is too small"),
    ]
    if not Path("/dev/nvidiactl").exists():
        cases.append(("no-gpu-no-cc", [zero, "-o", out], {},
                      r"no NVIDIA GPU here to build for: pass --cc, one of 7\.5, 8\.0, 8\.6, 8\.9, 12\.0, 12\.1"))
    return cases


def test_bad_input_is_one_line_exit_2_and_nothing_written(rtx, plugin_lib, tiny_trt_bundles, tmp_path):
    cases = _bad_inputs(tiny_trt_bundles, tmp_path, plugin_lib)
    before = {p.name for p in tmp_path.iterdir()}
    failures = []
    for cid, args, env, expect in cases:
        p = _run("build", *args, env=_env(plugin_lib, **env))
        lines = p.stderr.strip().splitlines()
        ok = (p.returncode == 2 and len(lines) == 1 and lines[0].startswith("zeroedge: error: ")
              and re.search(expect, lines[0]) and "Traceback" not in p.stderr and p.stdout == "")
        if not ok:
            failures.append(f"{cid}: rc {p.returncode}, stdout {p.stdout[-300:]!r}, stderr {p.stderr[-1000:]!r}")
        if {p.name for p in tmp_path.iterdir()} != before or _leftovers(tiny_trt_bundles):
            failures.append(f"{cid}: left {sorted({p.name for p in tmp_path.iterdir()} - before)}")
    assert not failures, "\n".join(failures)
    assert (tmp_path / "full" / "keep.txt").read_text() == "keep"
    assert {p.name for p in tiny_trt_bundles.iterdir()} >= {"dense", "zero", "paths"}


def test_workspace_option(rtx, plugin_lib, tiny_trt_bundles, tmp_path):
    p = _run("build", tiny_trt_bundles / "dense", "-o", tmp_path / "e", "--cc", CC, "--workspace", "512M", "--json",
             env=_env(plugin_lib))
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["workspace_bytes"] == 512 << 20 and {e["workspace_bytes"] for e in doc["engines"]} == {512 << 20}


def test_parse_size():
    from zeroedge.commands.common import parse_size
    from zeroedge.errors import UserError

    assert parse_size("512M") == 512 << 20 and parse_size("1G") == 1 << 30 and parse_size("1GiB") == 1 << 30
    assert parse_size("1.5g") == 3 << 29 and parse_size(str(300 << 20)) == 300 << 20
    for bad in ("", "G", "-1G", "1X", "1 M B", "512"):
        with pytest.raises(UserError):
            parse_size(bad)


def test_workspace_request_is_read_from_the_builder_error():
    from zeroedge.backends.tensorrt.engine import _workspace_request

    err = "[localCheckMacros.cpp::getErrorStr::132] Error Code 2: OutOfMemory (Requested size was 282695872 bytes.)"
    assert _workspace_request(["something else", err]) == 282695872
    assert _workspace_request(["Error Code 4: Internal Error"]) is None


def test_run_cli_helper_is_used_for_usage_errors():
    p = run_cli("build")
    assert p.returncode == 2 and "Missing argument" in p.stderr and "Traceback" not in p.stderr


# ------------------------------------------------------------------------------ zeroedge run --backend tensorrt

def test_run_tensorrt_checks_the_engines_before_loading_them(rtx, plugin_lib, tiny_trt_bundles, built, tmp_path):
    """`zeroedge run --backend tensorrt --bundle B --engines E`: engines from another bundle, another
    TensorRT, a folder zeroedge build did not make, or a machine without the GPU they were built for
    are each one line and exit 2, before TensorRT deserializes anything (where it would only say None)."""
    _, out, _ = built
    zero, dense = tiny_trt_bundles / "zero", tiny_trt_bundles / "dense"
    other_rt = tmp_path / "other-runtime"
    shutil.copytree(out, other_rt)
    meta = json.loads((other_rt / "engines.json").read_text())
    meta["backend"] = "tensorrt 10.3.0"
    (other_rt / "engines.json").write_text(json.dumps(meta))
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    (broken / "engines.json").write_text("{not json")
    no_decode = tmp_path / "no-decode"
    shutil.copytree(out, no_decode)
    (no_decode / "decode.engine").unlink()
    prompt = ["--prompt", "In the beginning God created"]
    cases = [
        ("another-bundle", ["--bundle", dense, "--engines", out], r"was not built from .*dense.*zeroedge build"),
        ("another-runtime", ["--bundle", zero, "--engines", other_rt],
         rf"built with tensorrt 10\.3\.0, this machine runs tensorrt_rtx {re.escape(rtx.__version__)}"),
        ("not-an-engines-folder", ["--bundle", zero, "--engines", broken], r"engines\.json: missing or unreadable"),
        ("engine-missing", ["--bundle", zero, "--engines", no_decode], r"decode\.engine: missing"),
        ("no-engines-folder", ["--bundle", zero, "--engines", tmp_path / "nope"], r"engines folder not found"),
        ("no-engines-option", ["--bundle", zero], r"--backend tensorrt needs --engines DIR"),
        ("engines-for-onnxruntime", ["--bundle", zero, "--engines", out, "--backend", "onnxruntime"],
         r"--engines and --plugins are for --backend tensorrt"),
    ]
    from zeroedge.backends.tensorrt import gpu_here

    if not gpu_here():
        cases.append(("no-gpu", ["--bundle", zero, "--engines", out],
                      r"no NVIDIA GPU here: TensorRT engines run on the GPU they were built for \(compute capability "
                      r"8\.6\); use --backend onnxruntime"))
    failures = []
    for cid, args, expect in cases:
        backend = [] if "--backend" in args else ["--backend", "tensorrt"]
        p = _run("run", *backend, *args, *prompt, env=_env(plugin_lib))
        lines = p.stderr.strip().splitlines()
        if not (p.returncode == 2 and len(lines) == 1 and re.search(expect, lines[0]) and "Traceback" not in p.stderr):
            failures.append(f"{cid}: rc {p.returncode}, stderr {p.stderr[-800:]!r}")
    assert not failures, "\n".join(failures)


def test_run_bundle_backends_need_no_model(tiny_trt_bundles, tmp_path):
    """The bundle has the shapes and the tokenizer: `zeroedge run --backend onnxruntime --bundle B`
    generates without MODEL, the same tokens as with it; a MODEL of another shape is refused."""
    zero = tiny_trt_bundles / "zero"
    args = ["--backend", "onnxruntime", "--bundle", zero, "--prompt", "In the beginning", "--max-new", "6", "--json"]
    a = run_cli("run", *args, check_rc=0)
    b = run_cli("run", "tiny", *args, check_rc=0)
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    assert ja["tokens"] == jb["tokens"] and len(ja["tokens"]) == 6
    assert ja["model"] == "tiny" and ja["backend"] == "onnxruntime"
    p = run_cli("run", "smollm2-135m", *args)
    assert p.returncode == 2 and "was exported from tiny" in p.stderr, p.stderr[-500:]
    p = run_cli("run", "--prompt", "x")
    assert p.returncode == 2 and "give MODEL" in p.stderr and "Traceback" not in p.stderr
    # a bundle whose manifest does not say which model it holds: one line, exit 2
    broken = tmp_path / "no-model"
    shutil.copytree(zero, broken)
    mf = json.loads((broken / "manifest.json").read_text())
    del mf["model"]
    (broken / "manifest.json").write_text(json.dumps(mf))
    p = run_cli("run", "--backend", "onnxruntime", "--bundle", broken, "--prompt", "x")
    assert p.returncode == 2 and "no usable model section" in p.stderr and "Traceback" not in p.stderr, p.stderr
