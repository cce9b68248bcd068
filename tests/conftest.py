"""Shared fixtures. Real SmolLM2 weights are loaded once per session (CPU, fp32)."""
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def pytest_configure(config):
    config.addinivalue_line("markers", "interpreter_script(name): the test checks that script of "
                                       "interpreter_scripts (started in the background once collected)")


def pytest_collection_finish(session):
    """The selected tests' Triton-interpreter scripts start now, beside the rest of the suite."""
    import importlib.util

    import interpreter_scripts

    names = [m.args[0] for item in session.items for m in item.iter_markers("interpreter_script")]
    if names and not session.config.option.collectonly and importlib.util.find_spec("triton") is not None:
        interpreter_scripts.start(names)


def pytest_sessionfinish(session):
    import interpreter_scripts

    interpreter_scripts.stop()


def run_cli(*args, check_rc=None, env=None, timeout=900):
    """Run `python -m zeroedge.cli ARGS` in a subprocess; returns CompletedProcess."""
    import subprocess

    e = dict(os.environ, **(env or {}))
    p = subprocess.run([sys.executable, "-m", "zeroedge.cli", *map(str, args)], capture_output=True,
                       text=True, env=e, timeout=timeout)
    if check_rc is not None:
        assert p.returncode == check_rc, f"rc={p.returncode}\nstdout:{p.stdout[-3000:]}\nstderr:{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="session")
def ortops_lib():
    import subprocess

    p = subprocess.run([str(REPO / "scripts" / "build_ortops")], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"scripts/build_ortops failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    from zeroedge.backends.ortops import library_path

    assert library_path().is_file()
    return library_path()


@pytest.fixture(scope="session", params=["native", "plain"])
def ortops_libs(request, ortops_lib):
    """The library as built for the CPU running the tests (AVX2 where it has it), and its plain C++
    kernels (what a CPU without AVX2, a Jetson's included, runs), built into ortops/build/plain."""
    if request.param == "native":
        return ortops_lib
    import subprocess

    inc = REPO / "ortops" / "build" / "include"
    build = REPO / "ortops" / "build" / "plain"
    p = subprocess.run([str(REPO / "scripts" / "build_ortops"), "--plain", "--build-dir", str(build)]
                       + (["--ort-include", str(inc)] if inc.is_dir() else []), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"scripts/build_ortops --plain failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return build / "libzeroedge_ortops.so"


@pytest.fixture(scope="session")
def smollm2():
    import torch

    from zeroedge import weights

    torch.manual_seed(0)
    m, folder = weights.load("smollm2-135m")
    return m, folder


@pytest.fixture(scope="session")
def smol_tok(smollm2):
    from zeroedge import weights

    return weights.tokenizer(smollm2[1])


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory, smollm2):
    """A tiny Llama (random weights, SmolLM2's tokenizer) saved in HF layout: fast CLI tests."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    from zeroedge import model as M

    folder = tmp_path_factory.mktemp("tiny-llama")
    cfg = M.PRESETS["tiny"].with_(vocab_size=49152, max_seq_len=2048, name="tiny-llama")
    m = M.build(cfg, seed=0)
    state = {f"model.{k}": v.contiguous() for k, v in m.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "intermediate_size": cfg.ffn_dim, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": True}))
    for f in smollm2[1].iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    from zeroedge import texts

    p = tmp_path_factory.mktemp("text") / "licenses.txt"
    p.write_text(texts.licenses())
    return p


# ---- real TensorRT on the CPU (TensorRT-RTX): test_tensorrt_rtx.py, test_build_cli.py

TRT_HEADERS = SHARED / "third_party" / "TensorRT-10.3" / "include"
PLUGINS = REPO / "plugins"
PLUGINS_BUILD = PLUGINS / "build"
# in CI, and wherever the TensorRT 10.3 headers are in ../shared (every machine of this project), a
# missing TensorRT-RTX or plugin library fails these tests instead of skipping them
TRT_REQUIRED = bool(os.environ.get("CI")) or TRT_HEADERS.is_dir()
TRT_HOW = ("pip install tensorrt-rtx-cu13==1.7.1.116 and scripts/build_plugins --trt-include "
           "../shared/third_party/TensorRT-10.3/include (scripts/setup does both)")


def need_trt(what):
    if TRT_REQUIRED:
        pytest.fail(f"{what}: {TRT_HOW}", pytrace=False)
    pytest.skip(f"{what}: {TRT_HOW}")


@pytest.fixture(scope="session")
def rtx():
    """The tensorrt_rtx module (through zeroedge.backends.tensorrt.import_tensorrt)."""
    try:
        import tensorrt_rtx  # noqa: F401
    except ImportError:
        need_trt("tensorrt_rtx is not installed")
    from zeroedge.backends.tensorrt import import_tensorrt

    return import_tensorrt("tensorrt_rtx")


def _plugin_sources_mtime():
    files = [PLUGINS / "CMakeLists.txt", PLUGINS / "exports.map"]
    for sub in ("src", "include", "kernels"):
        files += [p for p in (PLUGINS / sub).iterdir() if p.is_file()]
    return max(p.stat().st_mtime for p in files)


@pytest.fixture(scope="session")
def plugin_lib():
    """libzeroedge_plugins.so: $ZEROEDGE_PLUGINS_LIB (or the older $ZEROEDGE_PLUGIN_LIB), else
    plugins/build's, (re)built once if missing or older than its sources."""
    import subprocess

    for var in ("ZEROEDGE_PLUGINS_LIB", "ZEROEDGE_PLUGIN_LIB"):
        if os.environ.get(var):
            return Path(os.environ[var]).resolve()
    lib = PLUGINS_BUILD / "libzeroedge_plugins.so"
    if lib.is_file() and lib.stat().st_mtime >= _plugin_sources_mtime():
        return lib
    if not (TRT_HEADERS / "NvInferRuntime.h").is_file():
        need_trt(f"no plugin library at {lib} and no TensorRT 10.3 headers at {TRT_HEADERS} to build it")
    r = subprocess.run(["nice", "-n", "10", str(REPO / "scripts" / "build_plugins"), "--build-dir",
                        str(PLUGINS_BUILD), "--trt-include", str(TRT_HEADERS)], capture_output=True, text=True,
                       timeout=1200)
    if r.returncode != 0 or not lib.is_file():
        pytest.fail(f"scripts/build_plugins failed (rc {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}",
                    pytrace=False)
    return lib


@pytest.fixture(scope="session")
def tiny_trt_bundles(tmp_path_factory):
    """The tiny preset exported three ways (window 64): dense; zero = SIH/PAD (test_export's tiny_zero:
    thresholds near the median, a block rule on layer 2, pruned heads); paths = SIH/PAD in prefill +
    decode paths (test_export_paths' tiny_paths)."""
    try:
        import onnx  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        need_trt(f"the export stack is not installed ({e})")
    from artifacts import sih_artifact
    from artifacts import SIH_SKIP, with_paths

    from zeroedge.export.bundle_writer import export_bundle

    d = tmp_path_factory.mktemp("rtx")
    export_bundle("tiny", d / "dense", window=64)
    sih_artifact(d / "c_zero", "tiny", thr={0: 0.5, 1: 0.5, 2: 0.5, 3: 0.5}, block={2: 8},
               prune={"1": [0, 3], "3": [2]})
    export_bundle("tiny", d / "zero", calib=d / "c_zero", window=64)
    meta, t = sih_artifact(d / "c0", "tiny", skip=SIH_SKIP)
    with_paths(d / "c_paths", meta, t)
    export_bundle("tiny", d / "paths", calib=d / "c_paths", window=64)
    return d


# ---- the sensor daemon's tests (test_daemon*.py)

@pytest.fixture(scope="session")
def sensor_bundle(tmp_path_factory):
    """The shipped sensor detector as a bundle ($ZEROEDGE_SENSOR_BUNDLE: a prebuilt one)."""
    if os.environ.get("ZEROEDGE_SENSOR_BUNDLE"):
        return Path(os.environ["ZEROEDGE_SENSOR_BUNDLE"])
    from zeroedge.sensor.train import ensure_bundle

    return ensure_bundle(tmp_path_factory.mktemp("sensor-bundle") / "sensor")


@pytest.fixture(scope="session")
def tep_frames():
    """400 real TEP readings: 200 normal (d00), then 200 of fault 1 (d01)."""
    import numpy as np

    from zeroedge.sensor.tep import load_run

    data = SHARED / "data" / "tep-braatz"
    return np.concatenate([load_run(data / "d00.dat")[:200], load_run(data / "d01.dat")[:200]])


@pytest.fixture
def mqtt_broker(tmp_path):
    """A real mosquitto on 127.0.0.1 with persistence."""
    import daemon_harness as T

    if T.mosquitto_bin() is None:
        pytest.fail("mosquitto is not installed (scripts/setup installs it)")
    b = T.Broker(tmp_path / "broker").start()
    yield b
    b.stop()
