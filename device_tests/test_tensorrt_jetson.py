"""TensorRT engines against the portable graph, where engines can run: a Jetson (JetPack 6.1 / 6.2,
TensorRT 10.3, sm_87) or any GPU TensorRT-RTX runs engines on (Ampere / Ada / Blackwell: compute
capability 8.0, 8.6, 8.9, 12.x; not the H200's 9.0). It builds the plugin library with
scripts/build_plugins for the GPU present, builds the bundle's engines through zeroedge.backends.tensorrt
(the plugin library serialized into them), and compares them with the portable graph in onnxruntime on
the same tokens: prefill logits and a teacher-forced decode, then `zeroedge run --backend tensorrt`
against `--backend onnxruntime`. Skips elsewhere and says why.

    python -m pytest -q device_tests/test_tensorrt_jetson.py
    ZEROEDGE_TEST_BUNDLE=/path/to/bundle python -m pytest -q device_tests/test_tensorrt_jetson.py

Without ZEROEDGE_TEST_BUNDLE the test exports the tiny preset with a random calibration (SIH on
every layer, a block rule on one), which needs torch and onnx on the device. Off a Jetson the plugin
library is built against the TensorRT 10.3 headers at ../shared/third_party/TensorRT-10.3/include
(or $ZEROEDGE_TRT_INCLUDE).
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOL = 3e-2  # fp16 engine against the fp32 portable graph
JETSON = Path("/etc/nv_tegra_release").is_file()
TRT_INCLUDE = Path(os.environ.get("ZEROEDGE_TRT_INCLUDE") or REPO.parent / "shared/third_party/TensorRT-10.3/include")


def _target():
    """(reason to skip or None, CUDA arch for the plugin library, --cc for the build or None)."""
    from zeroedge.backends import tensorrt as be
    from zeroedge.errors import UserError

    try:
        trt = be.import_tensorrt()
        be.import_cudart()
    except UserError as e:
        return str(e), None, None
    if JETSON:
        if be.is_rtx(trt):
            return "a Jetson runs TensorRT 10.3 (import tensorrt), not TensorRT-RTX", None, None
        arch, cc = "87", None
    else:
        if not be.is_rtx(trt):
            return "off a Jetson this test runs engines with TensorRT-RTX (pip install tensorrt-rtx-cu13)", None, None
        here = be.gpu_compute_capability() if be.gpu_present() else None
        runs = [c for c in be.rtx_capabilities(trt) if c != "7.5"]  # RTX runs engines on 8.0 and later
        if here is None or here not in runs:
            return (f"no GPU TensorRT-RTX runs engines on here (compute capability {here}; it runs "
                    f"{', '.join(runs)})"), None, None
        if not (TRT_INCLUDE / "NvInferRuntime.h").is_file():
            return f"the TensorRT 10.3 headers are not at {TRT_INCLUDE} (set $ZEROEDGE_TRT_INCLUDE)", None, None
        arch, cc = here.replace(".", ""), here
    nvcc = shutil.which("nvcc") or next((c for c in ("/usr/local/cuda/bin/nvcc", "/usr/local/cuda-12.6/bin/nvcc")
                                         if os.path.exists(c)), None)
    if not nvcc or not shutil.which("cmake"):
        return "nvcc or cmake missing (Jetson: sudo apt install nvidia-jetpack cmake)", None, None
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return "onnxruntime is not installed (pip install 'zeroedge[jetson]')", None, None
    if not os.environ.get("ZEROEDGE_TEST_BUNDLE"):
        try:
            import onnx  # noqa: F401
            import torch  # noqa: F401
        except ImportError:
            return "set ZEROEDGE_TEST_BUNDLE to an exported bundle (exporting one here needs torch and onnx)", None, None
    return None, arch, cc


REASON, ARCH, CC = _target()
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))


@pytest.fixture(scope="module")
def plugin_lib(tmp_path_factory):
    build = tmp_path_factory.mktemp("plugins")
    cmd = [str(REPO / "scripts" / "build_plugins"), "--build-dir", str(build), "--arch", ARCH, "--test"]
    if not JETSON:
        cmd += ["--trt-include", str(TRT_INCLUDE)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "harness:" in r.stdout and "checks passed" in r.stdout
    return build / "libzeroedge_plugins.so"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    if os.environ.get("ZEROEDGE_TEST_BUNDLE"):
        return Path(os.environ["ZEROEDGE_TEST_BUNDLE"])
    sys.path.insert(0, str(REPO / "tests"))
    from artifacts import sih_artifact

    from zeroedge.export.bundle_writer import export_bundle

    d = tmp_path_factory.mktemp("bundle")
    sih_artifact(d / "calib", "tiny", thr={0: 0.5, 1: 0.5, 2: 0.5, 3: 0.5}, block={2: 8})
    export_bundle("tiny", d / "bundle", calib=d / "calib", window=64)
    return d / "bundle"


@pytest.fixture(scope="module")
def engines(bundle, plugin_lib, tmp_path_factory):
    from zeroedge.backends.tensorrt import build_bundle_engines

    out = tmp_path_factory.mktemp("engines")
    meta = build_bundle_engines(bundle, plugin_lib, out, max_tokens=256, cc=CC)
    assert set(meta["engines"]) == {"prefill", "decode"}
    if meta["timing_cache"]:  # TensorRT 10.3 keeps one; TensorRT-RTX has none
        assert (out / "timing.cache").stat().st_size > 0
    return out


def rel(a, b):
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def test_engine_matches_portable_graph(bundle, engines, plugin_lib):
    import numpy as np

    from zeroedge.backends.onnxruntime import OrtRunner
    from zeroedge.backends.tensorrt import TrtRunner

    rng = np.random.default_rng(0)
    vocab = OrtRunner(bundle, slots=64).vocab
    tokens = rng.integers(0, vocab, size=48)  # >= min_tokens: SIH and PAD are active in prefill
    with OrtRunner(bundle, slots=64) as o, TrtRunner(bundle, engines, plugin_lib, slots=64) as t:
        lo, lt = o.prefill(tokens), t.prefill(tokens)
        errs, agree = [rel(lt, lo)], [int(lo.argmax() == lt.argmax())]
        for _ in range(8):  # teacher-forced: both get the portable graph's greedy token
            tok = int(lo.argmax())
            lo, lt = o.step(tok), t.step(tok)
            errs.append(rel(lt, lo))
            agree.append(int(lo.argmax() == lt.argmax()))
    assert max(errs) <= TOL, errs
    assert sum(agree) >= len(agree) - 1, agree


def test_plugin_library_is_embedded(bundle, engines, plugin_lib):
    """The engine carries the plugin library: a fresh process that never loads the .so runs it."""
    code = ("import sys, numpy as np; from zeroedge.backends.tensorrt import TrtSession; "
            "s = TrtSession(sys.argv[1], plugin_lib=None); "
            "out = s.run(None, {'tokens': np.arange(40, dtype=np.int64)[None] % 200}); "
            "print('ok', out[0].shape); s.close()")
    r = subprocess.run([sys.executable, "-c", code, str(engines / "prefill.engine")], capture_output=True, text=True,
                       cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout[-2000:] + r.stderr[-2000:]


def test_wrong_plugin_library_is_refused(bundle, tmp_path):
    from zeroedge.backends.tensorrt import build_bundle_engines
    from zeroedge.errors import UserError

    fake = tmp_path / "libnot_a_plugin.so"
    fake.write_bytes(b"\x7fELF not really")
    with pytest.raises(UserError, match="plugin library"):
        build_bundle_engines(bundle, fake, tmp_path / "out")


def test_run_cli_tensorrt_matches_onnxruntime(bundle, engines, plugin_lib):
    """`zeroedge run --backend tensorrt` against `--backend onnxruntime` on the same bundle and prompt:
    the first greedy tokens agree (fp16 engine, fp32 portable graph)."""
    def run(*backend):
        r = subprocess.run([sys.executable, "-m", "zeroedge.cli", "run", "--bundle", str(bundle), *backend,
                            "--prompt", "In the beginning God created the heaven and the earth. " * 4,
                            "--max-new", "8", "--json"], capture_output=True, text=True, cwd=str(REPO),
                           env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout)

    trt = run("--backend", "tensorrt", "--engines", str(engines))
    ort = run("--backend", "onnxruntime")
    assert trt["decoder"] == "TrtRunner" and trt["backend"] == "tensorrt"
    assert trt["tokens"][:4] == ort["tokens"][:4], (trt["tokens"], ort["tokens"])
