import json
import subprocess
import sys

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
