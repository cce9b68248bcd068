import json
import subprocess
import sys

import pytest
from conftest import REPO, run_cli


def test_help_does_not_import_heavy_modules():
    code = ("import sys; from zeroedge.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit: pass\n"
            "heavy = [m for m in ('torch','onnx','onnxruntime','transformers','tensorrt','paho',"
            "'asyncssh','onnx_graphsurgeon') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert "Usage" in out.stdout
    assert "HEAVY []" in out.stdout, out.stdout


def test_every_subcommand_help_works():
    from zeroedge.cli import COMMANDS, LazyGroup

    listed = LazyGroup().list_commands(None)
    assert "calibrate" in listed and "eval" in listed
    for name in listed:
        p = run_cli(name, "--help")
        assert p.returncode == 0, (name, p.stderr)
        assert "Usage" in p.stdout


def test_unknown_command_exits_2():
    p = run_cli("no-such-command")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr


def test_setup_maps_export_package():
    import zeroedge.export

    assert zeroedge.export.__file__.endswith("export/__init__.py")


def test_every_registered_command_has_its_module():
    from zeroedge.cli import COMMANDS, LazyGroup

    assert sorted(LazyGroup().list_commands(None)) == sorted(COMMANDS)


def test_bad_input_is_refused_before_any_work(tmp_path):
    """One line, exit 2, nothing written: checked before a model is loaded or a daemon starts."""
    cases = [(["export", "tiny", "-o", tmp_path / "b", "--target", "jetpack-9"], "unknown target jetpack-9"),
             (["export", "tiny", "-o", tmp_path / "b", "--target", "jetpack-6.0"], "JetPack 6.0 ships TensorRT 8.6"),
             (["calibrate", "tiny", "-o", tmp_path / "c", "--train-seqs", "0"], "--train-seqs"),
             (["calibrate", "tiny", "-o", tmp_path / "c", "--gate-seqs", "0"], "--gate-seqs")]
    for args, needle in cases:
        p = run_cli(*args)
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    cfg = tmp_path / "d.toml"
    cfg.write_text(f'[daemon]\nbundle = "{tmp_path / "nope"}"\n[source]\nkind = "stdin"\n')
    p = run_cli("daemon", "--config", cfg)
    assert p.returncode == 2 and "scripts/train_sensor --export-only --bundle" in p.stderr, p.stderr


def test_a_text_is_read_only_as_far_as_needed(tmp_path):
    from zeroedge import texts
    from zeroedge.errors import UserError

    big = tmp_path / "big.txt"
    with big.open("wb") as f:                   # 4 GiB, sparse: reading it whole would take minutes and the RAM
        f.write("é".encode() * 1000)
        f.truncate(4 << 30)
    t = texts.load_text(str(big), texts.chars_for(100))
    assert len(t) == texts.chars_for(100) and t.startswith("é" * 1000)
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 " * 10)
    with pytest.raises(UserError, match="not UTF-8"):
        texts.load_text(str(tmp_path / "latin1.txt"))
    with pytest.raises(UserError, match="cannot read"):      # a regular file whose read fails (EIO)
        texts.load_text("/proc/self/mem", 100)
