"""Plugins on a CPU machine: the kernels compile for sm_87 and sm_90 (skips without nvcc), the
TensorRT-free field/shape rules pass their host test and match zeroedge.plugin_spec, the glue links
without libnvinfer and passes the host harness against the TensorRT 10.3 headers in
../shared/third_party/TensorRT-10.3/include (every machine and CI has them), the PyTorch reference agrees with the mechanisms, and the TensorRT
backend fails cleanly where TensorRT is missing."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PLUGINS = REPO / "plugins"
TRT_INCLUDE = next((d for d in (REPO.parent / "shared" / "third_party" / "TensorRT-10.3" / "include",
                                REPO / "third_party" / "TensorRT" / "include") if (d / "NvInferRuntime.h").is_file()),
                   REPO.parent / "shared" / "third_party" / "TensorRT-10.3" / "include")
GET_HEADERS = (f"TensorRT 10.3 headers not found at {TRT_INCLUDE} (../shared beside the checkout, or "
               "third_party/TensorRT/include from NVIDIA/TensorRT tag v10.3.0, git-ignored)")


def _nvcc():
    for c in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if c and os.path.exists(c):
            return c
    return None


def _cxx():
    return shutil.which("g++") or shutil.which("c++")


def _cuda_root(nvcc):
    """The toolkit folder holding include/cuda_runtime_api.h (nvcc may be a wrapper script)."""
    for c in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), Path(nvcc).resolve().parents[1],
              "/usr/local/cuda", "/usr/local/cuda-12.6"):
        if c and (Path(c) / "include" / "cuda_runtime_api.h").is_file():
            return Path(c)
    pytest.skip(f"CUDA headers not found next to {nvcc} (set CUDA_HOME)")


def run(cmd, **kw):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("plugins_build")


def _compile_cu(build_dir, src, name):
    """src compiled for sm_87 and sm_90 (position-independent, hidden visibility): (object, ptxas log)."""
    nvcc = _nvcc()
    if not nvcc:
        pytest.skip("nvcc not found (install the CUDA toolkit or set CUDACXX): the kernels are not compiled")
    obj = build_dir / name
    r = run([nvcc, "-std=c++17", "-O3", "-gencode", "arch=compute_87,code=sm_87", "-gencode",
             "arch=compute_90,code=sm_90", "-Xptxas", "-v", "-Xcompiler", "-fPIC,-fvisibility=hidden",
             "-I", PLUGINS / "include", "-c", src, "-o", obj])
    assert r.returncode == 0, r.stderr[-4000:]
    return obj, r.stderr


@pytest.fixture(scope="module")
def kernels_obj(build_dir):
    """kernels.cu compiled once for sm_87 and sm_90."""
    return _compile_cu(build_dir, PLUGINS / "src" / "kernels.cu", "kernels.o")


@pytest.fixture(scope="module")
def paths_obj(build_dir):
    """kernels/paths_gemv.cu (ZeroEdgePathsFFN's launcher) compiled the same way."""
    return _compile_cu(build_dir, PLUGINS / "kernels" / "paths_gemv.cu", "paths_gemv.o")


@pytest.fixture(scope="module")
def test_fields_bin(build_dir):
    cxx = _cxx()
    if not cxx:
        pytest.skip("no C++ compiler (g++)")
    exe = build_dir / "test_fields"
    r = run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-I", PLUGINS / "include",
             PLUGINS / "src" / "fields.cpp", PLUGINS / "tests" / "test_fields.cpp", "-o", exe])
    assert r.returncode == 0, r.stderr[-4000:]
    return exe


def test_kernels_and_rules_use_no_tensorrt_headers():
    for p in ("src/kernels.cu", "include/zeroedge_kernels.h", "include/zeroedge_paths.h", "src/fields.cpp",
              "include/zeroedge_fields.h", "tests/test_fields.cpp"):
        assert "NvInfer" not in (PLUGINS / p).read_text(), p


def test_kernels_compile_for_sm87_and_sm90(kernels_obj):
    obj, log = kernels_obj
    assert obj.stat().st_size > 0
    for arch in ("sm_87", "sm_90"):
        assert "sih_proj_tc" in log and f"for '{arch}'" in log, arch
    # the kernels the plugins launch are all there, for both architectures
    for k in ("sih_prep", "sih_proj_tc", "sih_proj_generic", "sih_decide_base_tc", "sih_decide_base_cc",
              "pad_scan", "pad_gather_rows", "pad_fill", "pad_inverse", "pad_merge_rows"):
        assert log.count(k) >= 2, k


def test_paths_kernels_compile_for_sm87_and_sm90(build_dir):
    """The decode-path kernels build for Orin and H200 with no TensorRT header, spill no
    registers, and export only their ze_paths_* C API."""
    nvcc = _nvcc()
    if not nvcc:
        pytest.skip("nvcc not found (install the CUDA toolkit or set CUDACXX): the kernels are not compiled")
    src = PLUGINS / "kernels" / "paths_gemv.cu"
    assert "NvInfer" not in src.read_text()
    so = build_dir / "libpaths.so"
    r = run([nvcc, "-std=c++17", "-O3", "-gencode", "arch=compute_87,code=sm_87", "-gencode",
             "arch=compute_90,code=sm_90", "-Xptxas", "-v", "-Xcompiler", "-fPIC,-fvisibility=hidden", "-shared",
             "-I", PLUGINS / "include", src, "-o", so, f"-Xlinker=--version-script={PLUGINS / 'kernels.map'}"])
    assert r.returncode == 0, r.stderr[-4000:]
    for arch in ("sm_87", "sm_90"):
        assert f"for '{arch}'" in r.stderr, arch
    for k in ("pred_gateup_kernel", "mag_gateup_kernel", "down_kernel"):
        assert r.stderr.count(k) >= 2, k
    assert " 0 bytes spill stores" in r.stderr and "bytes spill stores" not in r.stderr.replace(" 0 bytes spill stores", "")
    syms = run(["nm", "-D", "--defined-only", so]).stdout.split()
    assert {"ze_paths_ffn", "ze_paths_ffn_magnitude", "ze_paths_work_bytes", "ze_paths_set_config"} <= set(syms)


def test_field_rules_host_test(test_fields_bin):
    r = run([test_fields_bin])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checks passed" in r.stdout


def test_cpp_contract_matches_plugin_spec(test_fields_bin):
    """Names, input/output counts, field types and defaults, ABI: the C++ side and plugin_spec agree."""
    from zeroedge import plugin_spec

    r = run([test_fields_bin, "--spec-json"])
    spec = json.loads(r.stdout)
    assert spec["abi"] == plugin_spec.PLUGIN_ABI
    assert spec["namespace"] == plugin_spec.PLUGIN_NAMESPACE and spec["version"] == plugin_spec.PLUGIN_VERSION
    assert set(spec["nodes"]) == set(plugin_spec.NODES)
    for op, node in plugin_spec.NODES.items():
        c = spec["nodes"][op]
        assert c["inputs"] == len(node["inputs"]) and c["outputs"] == len(node["outputs"]), op
        assert list(c["fields"]) == list(node["fields"]), op
        for name, (kind, default) in node["fields"].items():
            ckind, cdefault = c["fields"][name]
            assert ckind == kind, (op, name)
            if default is None:
                assert cdefault is None, (op, name)
            else:
                assert cdefault == pytest.approx(default, rel=1e-6), (op, name)
    assert spec["limits"] == plugin_spec.LIMITS  # the shape and value limits `zeroedge check` applies


def test_glue_links_without_libnvinfer_and_passes_harness(kernels_obj, paths_obj, build_dir):
    if not (TRT_INCLUDE / "NvInferRuntime.h").is_file():
        pytest.skip(GET_HEADERS)
    cxx, nvcc = _cxx(), _nvcc()
    cuda = _cuda_root(nvcc)
    inc = ["-I", PLUGINS / "include", "-isystem", TRT_INCLUDE, "-isystem", cuda / "include"]
    lib = build_dir / "libzeroedge_plugins.so"
    r = run([cxx, "-std=c++17", "-O1", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-Werror", "-shared", *inc,
             PLUGINS / "src" / "plugin.cpp", PLUGINS / "src" / "fields.cpp", kernels_obj[0], paths_obj[0],
             "-o", lib,
             f"-Wl,--version-script={PLUGINS / 'exports.map'}", "-Wl,--no-undefined",
             "-L", cuda / "lib64", "-L", cuda / "lib64" / "stubs", "-lcudart_static", "-ldl", "-lpthread", "-lrt"])
    assert r.returncode == 0, r.stderr[-4000:]
    syms = run(["nm", "-D", "--defined-only", lib]).stdout.split("\n")
    exported = sorted(line.split()[-1] for line in syms if line.strip() and line.split()[-2] in ("T", "W", "D"))
    assert exported == ["getCreators", "setLoggerFinder", "zeroedge_plugin_messages"], exported
    needed = run(["readelf", "-d", lib]).stdout
    assert "libnvinfer" not in needed
    harness = build_dir / "zeroedge_harness"
    r = run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", *inc, PLUGINS / "harness" / "harness.cpp", "-o", harness,
             "-L", cuda / "lib64", "-lcudart_static", "-ldl", "-lpthread", "-lrt"])
    assert r.returncode == 0, r.stderr[-4000:]
    r = run([harness, lib])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "harness:" in r.stdout and "checks passed" in r.stdout
    assert "count 0-D size tensor" in r.stdout and "round-trip" in r.stdout
    assert "creators: 5" in r.stdout and "ZeroEdgePathsFFN: 3 fields round-trip" in r.stdout
    assert "SIH chunk: 14 inputs / 3 outputs" in r.stdout


def test_build_plugins_refuses_tensorrt_8(tmp_path):
    (tmp_path / "NvInferRuntime.h").write_text("// stand-in\n")
    (tmp_path / "NvInferVersion.h").write_text("#define NV_TENSORRT_MAJOR 8 //!< major\n")
    r = run([REPO / "scripts" / "build_plugins", "--build-dir", tmp_path / "b", "--trt-include", tmp_path])
    assert r.returncode == 2
    if _nvcc():
        assert "no IPluginV3" in r.stderr and "JetPack 6.1" in r.stderr
    else:
        assert "nvcc not found" in r.stderr
    assert not (tmp_path / "b").exists()


# ------------------------------------------------------------------------ the PyTorch reference

def test_reference_keep_matches_mechanisms():
    torch = pytest.importorskip("torch")
    sih = pytest.importorskip("zeroedge.mechanisms.sih")
    from zeroedge.backends import plugin_reference as ref

    g = torch.Generator().manual_seed(0)
    for T in (5, 31, 32, 33, 100, 777):
        for bs in (0, 8, 64):
            s = torch.rand(T, generator=g)
            thr = float(s.median())
            f = ref.sih_fields(threshold=thr, block_size=bs, protect_last=2)
            mine = ref.sih_keep(s, **f)
            if T < f["min_tokens"]:
                assert bool(mine.all())
                continue
            theirs = sih.keep_mask(sih.smooth(s[None], (f["ma_w0"], f["ma_w1"], f["ma_w2"])), thr, f["protect_first"],
                                   f["protect_last"], bs, f["block_frac"])[0]
            assert torch.equal(mine.bool(), theirs), (T, bs)
            assert 0 < int(mine.sum()) < T or bs == 64


def test_reference_scores_match_sih_head_and_anchor():
    torch = pytest.importorskip("torch")
    sih = pytest.importorskip("zeroedge.mechanisms.sih")
    anchors = pytest.importorskip("zeroedge.mechanisms.anchors")
    from zeroedge.backends import plugin_reference as ref

    torch.manual_seed(0)
    D, W, R, T = 64, 6, 4, 50
    head = sih.SIHHead(D, W)
    st = head.state("h")
    x = torch.randn(T, D)
    s = ref.sih_scores(x, *(st[f"h.{k}"] for k in ("w1", "b1", "w2", "b2", "w3", "b3", "w4", "b4")))
    with torch.no_grad():
        assert torch.allclose(s, head(x), atol=1e-6)
    a = anchors.Anchor(torch.randn(R, D), torch.randn(D, R), torch.randn(D))
    keep = (torch.rand(T) < 0.5).int()
    base = ref.sih_base(x, keep, a.a, a.b, a.c, R)
    with torch.no_grad():
        want = torch.where(keep.bool()[:, None], torch.zeros(T, D), a(x))
    assert torch.allclose(base, want, atol=1e-5)
    assert torch.equal(ref.sih_base(x, keep, a.a, a.b, a.c, 0), torch.zeros(T, D))


def test_reference_compaction_is_the_masked_ffn():
    torch = pytest.importorskip("torch")
    from zeroedge.backends import plugin_reference as ref

    torch.manual_seed(1)
    T, D = 40, 16
    x, base = torch.randn(T, D), torch.randn(T, D)
    keep = (torch.rand(T) < 0.4).int()
    w = torch.randn(D, D)
    xs, idx, cnt = ref.pad_gather(x, keep)
    assert int(cnt) == int(keep.sum()) == xs.shape[0] == idx.numel() and idx.dtype == torch.int32
    assert bool((idx[1:] > idx[:-1]).all())
    out = ref.pad_scatter(base, xs @ w, idx)
    assert torch.allclose(out, torch.where(keep.bool()[:, None], x @ w, base), atol=1e-5)


def test_reference_paths_ffn_matches_direct_computation():
    """paths_ffn == the FFN computed token by token from W_gate, W_up, W_down with the header's masks."""
    torch = pytest.importorskip("torch")
    from zeroedge.backends import plugin_reference as ref

    g = torch.Generator().manual_seed(3)
    B, D, F = 4, 64, 48
    wg, wu = torch.randn(F, D, generator=g) / 8, torch.randn(F, D, generator=g) / 8
    wdown = torch.randn(D, F, generator=g) / 7
    x = torch.randn(B, D, generator=g)
    w13_t, wd_t = torch.cat([wg, wu]).T.contiguous(), wdown.T.contiguous()
    # zero thresholds: the dense FFN
    dense = (torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)) @ wdown.T
    assert torch.allclose(ref.paths_ffn(x, w13_t, wd_t, 0.0, 0.0), dense, atol=1e-5)
    thr_in, thr = 0.6, 0.08
    t_in, t = (float(torch.tensor(v, dtype=torch.float32)) for v in (thr_in, thr))  # float32 fields
    y = ref.paths_ffn(x.double(), w13_t.double(), wd_t.double(), thr_in, thr)
    assert y.dtype == torch.float64
    kept_ch = []
    for b in range(B):
        xb = x[b].double()
        xb = torch.where(xb.abs() >= t_in, xb, torch.zeros_like(xb))
        a = torch.nn.functional.silu(wg.double() @ xb) * (wu.double() @ xb)
        keep = a.abs() >= t
        kept_ch.append(keep)
        assert 0 < int(keep.sum()) < F
        assert torch.allclose(y[b], wdown.double()[:, keep] @ a[keep], atol=1e-10), b
        # per-token masks: a token alone gives the same row
        assert torch.allclose(ref.paths_ffn(x[b:b + 1].double(), w13_t.double(), wd_t.double(), thr_in, thr)[0],
                              y[b], atol=1e-12)
    assert any(not torch.equal(kept_ch[0], k) for k in kept_ch[1:])  # the tokens keep different channels
    assert 0 < int((x.abs() >= t_in).sum()) < B * D
    assert not torch.allclose(y.float(), dense, atol=1e-3)
    y32 = ref.paths_ffn(x, w13_t, wd_t, thr_in, thr)
    assert y32.dtype == torch.float32 and torch.allclose(y32.double(), y, atol=1e-5)
    y16 = ref.paths_ffn(x.half(), w13_t.half(), wd_t.half(), thr_in, thr)
    assert y16.dtype == torch.float16 and y16.shape == (B, D)
    with pytest.raises(ValueError, match="w13_t"):
        ref.paths_ffn(x, w13_t[:, :-1], wd_t, thr_in, thr)
    assert ref.paths_fields(threshold_in=0.1, threshold=0.2) == {"threshold_in": 0.1, "threshold": 0.2}
    with pytest.raises(TypeError, match="threshold_in"):
        ref.paths_fields(threshold=0.2)


def test_reference_fields_validation():
    from zeroedge.backends import plugin_reference as ref

    with pytest.raises(TypeError, match="threshold"):
        ref.sih_fields()
    with pytest.raises(TypeError, match="unknown"):
        ref.sih_fields(threshold=0.5, nope=1)


# ------------------------------------------------------------------------ the TensorRT backend

def test_tensorrt_backend_imports_light():
    r = run([sys.executable, "-c", "import sys, zeroedge.backends.tensorrt as t; "
             "print(sorted(m for m in ('torch', 'tensorrt', 'onnxruntime', 'cuda', 'numpy') if m in sys.modules))"],
            cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_profile_shapes_and_plan():
    from zeroedge.backends import tensorrt as t

    p = t.profile_shapes([("tokens", (-1, -1)), ("pos", (-1,)), ("slot_pos", (-1, -1)),
                          ("past_k.0", (-1, 2, -1, 16)), ("fixed", (1, 4))], max_tokens=4096, window=64)
    assert p["tokens"] == ((1, 1), (1, 512), (1, 4096))
    assert p["pos"] == ((1,), (1,), (1,))
    assert p["slot_pos"] == ((1, 64), (1, 64), (1, 64))
    assert p["past_k.0"] == ((1, 2, 64, 16),) * 3
    assert "fixed" not in p
    assert t.workspace_from_plan({}) == t.DEFAULT_WORKSPACE
    assert t.workspace_from_plan({"plan": {"memory": {"workspace": 123456}}}) == 123456
    assert t.workspace_from_plan({"plan": {"workspace_mb": 64}}) == 64 << 20
    assert t.max_tokens_from_plan({"plan": {"context": 8192}}) == 8192
    assert t.max_tokens_from_plan({"window": 1024}) == 2048


@pytest.fixture
def fake_bundle(tmp_path):
    from zeroedge import bundle, plugin_spec

    b = tmp_path / "bundle"
    b.mkdir()
    (b / "prefill.trt.onnx").write_bytes(b"not parsed before TensorRT is found")
    bundle.write_manifest(b, {"plugin_abi": plugin_spec.PLUGIN_ABI, "window": 64,
                              "model": {"n_layers": 1, "n_kv_heads": 1, "dim": 8, "n_heads": 1, "vocab_size": 10}})
    return b


def test_tensorrt_missing_is_one_line_and_exit_2(fake_bundle, tmp_path, monkeypatch):
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    # the Jetson runtime asked for explicitly (TensorRT-RTX, when installed, is the fallback otherwise)
    monkeypatch.setenv("ZEROEDGE_TENSORRT", "tensorrt")
    r = run([sys.executable, "-m", "zeroedge.backends.tensorrt", "build", fake_bundle, "--plugins",
             tmp_path / "lib.so", "-o", tmp_path / "out"], cwd=REPO)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "python3-libnvinfer" in lines[0] and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()
    from zeroedge.backends.tensorrt import TensorRTMissing, TrtSession
    from zeroedge.errors import UserError

    with pytest.raises(TensorRTMissing) as e:
        TrtSession(tmp_path / "x.engine")
    assert isinstance(e.value, UserError) and e.value.exit_code == 2


def test_bundle_for_another_plugin_abi_is_refused(fake_bundle, tmp_path):
    from zeroedge import bundle
    from zeroedge.backends.tensorrt import build_bundle_engines
    from zeroedge.errors import UserError

    m = json.loads((fake_bundle / "manifest.json").read_text())
    m.pop("files")
    m["plugin_abi"] = 99
    bundle.write_manifest(fake_bundle, {k: v for k, v in m.items() if k not in ("format", "format_version",
                                                                              "zeroedge_version")})
    with pytest.raises(UserError, match="plugin ABI 99"):
        build_bundle_engines(fake_bundle, tmp_path / "lib.so", tmp_path / "out")


# ------------------------------------------------------------------------ reference == portable graph

def _run_function_node(op, inputs: dict, outputs, attrs=None):
    """One custom node with the exporter's model-local functions, run in onnxruntime."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    functions = pytest.importorskip("zeroedge.export.functions")
    from onnx import TensorProto, helper

    from zeroedge import plugin_spec

    types = {np.dtype("float32"): TensorProto.FLOAT, np.dtype("int32"): TensorProto.INT32}
    ins = [helper.make_tensor_value_info(k, types[v.dtype], list(v.shape)) for k, v in inputs.items()]
    otype = {"keep": TensorProto.INT32, "idx": TensorProto.INT32, "count": TensorProto.INT32}
    outs = [helper.make_tensor_value_info(o, otype.get(o, TensorProto.FLOAT), None) for o in outputs]
    node = helper.make_node(op, list(inputs), outputs, domain=plugin_spec.DOMAIN, **(attrs or {}))
    model = helper.make_model(helper.make_graph([node], "g", ins, outs), functions=functions.all_functions(),
                              opset_imports=[helper.make_opsetid("", functions.OPSET),
                                             helper.make_opsetid(plugin_spec.DOMAIN, 1)], ir_version=9)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, inputs)


import numpy as np  # noqa: E402


@pytest.mark.parametrize("block_size,T,R", [(0, 100, 4), (8, 77, 4), (0, 20, 4), (16, 64, 0)])
def test_reference_matches_portable_onnx_function(block_size, T, R):
    """plugin_reference (what the kernels are checked against) == the exporter's portable ZeroEdgeSIH,
    ZeroEdgePADGather and ZeroEdgePADScatter functions in onnxruntime (what the Jetson test compares
    the engines with)."""
    torch = pytest.importorskip("torch")
    from zeroedge.backends import plugin_reference as ref

    rng = np.random.default_rng(T + block_size)
    D, W = 16, 3
    f32 = np.float32
    w = {"x": rng.standard_normal((T, D)).astype(f32), "w1": (rng.standard_normal((W, D)) / 2).astype(f32),
         "b1": np.full(W, 0.5, f32), "w2": rng.standard_normal((W, W)).astype(f32), "b2": np.full(W, 0.5, f32),
         "w3": rng.standard_normal((W, W)).astype(f32), "b3": np.full(W, 0.5, f32),
         "w4": rng.standard_normal((1, W)).astype(f32), "b4": np.zeros(1, f32),
         "anchor_a": rng.standard_normal((max(R, 1), D)).astype(f32)[:R],
         "anchor_b": rng.standard_normal((D, max(R, 1))).astype(f32)[:, :R].copy(),
         "anchor_c": rng.standard_normal(D).astype(f32)}
    t = {k: torch.from_numpy(v) for k, v in w.items()}
    scores = ref.sih_scores(t["x"], *(t[k] for k in ("w1", "b1", "w2", "b2", "w3", "b3", "w4", "b4")))
    sm = np.sort(ref.smooth(scores, 0.5, 0.333333, 0.166667).numpy())
    i = int(np.argmax(np.diff(sm[T // 4: 3 * T // 4]))) + T // 4  # a threshold far from every score
    thr = float((sm[i] + sm[i + 1]) / 2)
    fields = ref.sih_fields(threshold=thr, block_size=block_size, anchor_rank=R)
    keep_r, base_r = ref.sih(*(t[k] for k in w), **fields)
    keep_o, base_o = _run_function_node("ZeroEdgeSIH", w, ["keep", "base"], fields)
    assert np.array_equal(keep_o.reshape(-1), keep_r.numpy())
    assert np.allclose(base_o, base_r.numpy(), rtol=1e-5, atol=1e-5)
    xs_o, idx_o, cnt_o = _run_function_node("ZeroEdgePADGather", {"x": w["x"], "keep": keep_o.astype(np.int32)},
                                            ["xs", "idx", "count"])
    xs_r, idx_r, cnt_r = ref.pad_gather(t["x"], keep_r)
    assert np.array_equal(idx_o.reshape(-1), idx_r.numpy()) and int(cnt_o.reshape(-1)[0]) == int(cnt_r)
    assert np.array_equal(xs_o, xs_r.numpy())
    y = (xs_o * 3).astype(f32)
    (out_o,) = _run_function_node("ZeroEdgePADScatter", {"base": base_o.astype(f32), "y": y,
                                                         "idx": idx_o.astype(np.int32)}, ["out"])
    assert np.array_equal(out_o, ref.pad_scatter(torch.from_numpy(base_o), torch.from_numpy(y), idx_r).numpy())


def _sih_inputs(rng, T: int, R: int, D: int = 16, W: int = 3) -> dict:
    """x [T, D] and a random SIH head (width W, biases that keep the ReLUs alive) and rank-R anchor,
    float32 numpy, in ZeroEdgeSIH's input order."""
    f32 = np.float32
    return {"x": rng.standard_normal((T, D)).astype(f32), "w1": (rng.standard_normal((W, D)) / 2).astype(f32),
            "b1": np.full(W, 0.5, f32), "w2": rng.standard_normal((W, W)).astype(f32), "b2": np.full(W, 0.5, f32),
            "w3": rng.standard_normal((W, W)).astype(f32), "b3": np.full(W, 0.5, f32),
            "w4": rng.standard_normal((1, W)).astype(f32), "b4": np.zeros(1, f32),
            "anchor_a": rng.standard_normal((R, D)).astype(f32), "anchor_b": rng.standard_normal((D, R)).astype(f32),
            "anchor_c": rng.standard_normal(D).astype(f32)}


def _in_chunks(torch, ref, w: dict, T: int, chunk: int, fields: dict) -> list:
    """ZeroEdgeSIHChunk over w's x chunk by chunk, through the reference and the portable function, each
    chunk's carry_out the next one's carry: per chunk (reference keep, function keep, function base,
    reference carry_out, function carry_out)."""
    out = []
    carry_r = carry_o = np.zeros(2, np.float32)
    for a in range(0, T, chunk):
        part = {**w, "x": w["x"][a:a + chunk]}
        span = np.array([a, T], np.int32)
        k_r, _, carry_r = ref.sih_chunk(*(torch.from_numpy(v) for v in part.values()), torch.from_numpy(carry_r),
                                        torch.from_numpy(span), **fields)
        carry_r = carry_r.numpy()
        k_o, b_o, carry_o = _run_function_node("ZeroEdgeSIHChunk", {**part, "carry": carry_o, "span": span},
                                               ["keep", "base", "carry_out"], fields)
        out.append((k_r.numpy(), k_o.reshape(-1), b_o, carry_r, carry_o))
    return out


@pytest.mark.parametrize("block_size,T,chunk", [(0, 100, 30), (8, 77, 24), (0, 40, 1), (16, 100, 32)])
def test_chunk_reference_and_portable_function_decide_as_one_pass(block_size, T, chunk):
    """ZeroEdgeSIHChunk fed chunk by chunk (the carry of one into the next): the reference and the
    exporter's portable function both give ZeroEdgeSIH's one-pass keep and base; the carry is the
    chunk's last two raw scores."""
    torch = pytest.importorskip("torch")
    from zeroedge.backends import plugin_reference as ref

    R = 4
    w = _sih_inputs(np.random.default_rng(T + chunk), T, R)
    t = {k: torch.from_numpy(v) for k, v in w.items()}
    scores = ref.sih_scores(t["x"], *(t[k] for k in ("w1", "b1", "w2", "b2", "w3", "b3", "w4", "b4")))
    sm = np.sort(ref.smooth(scores, 0.5, 0.333333, 0.166667).numpy())
    lo, hi = (T // 4, 3 * T // 4) if not block_size else (3 * T // 4, T - 2)   # blocks skip when > 70 % low
    i = int(np.argmax(np.diff(sm[lo:hi]))) + lo                     # a threshold far from every score
    fields = ref.sih_fields(threshold=float((sm[i] + sm[i + 1]) / 2), block_size=block_size, anchor_rank=R)
    keep1, base1 = ref.sih(*(t[k] for k in w), **fields)
    assert 0 < int(keep1.sum()) < T
    keeps_r, keeps_o, bases_o, carries_r, carries_o = zip(*_in_chunks(torch, ref, w, T, chunk, fields))
    for carry_r, carry_o in zip(carries_r, carries_o):
        np.testing.assert_allclose(carry_o, carry_r, rtol=1e-5, atol=1e-6)   # onnxruntime's own rounding
    assert np.array_equal(np.concatenate(keeps_r), keep1.numpy())
    assert np.array_equal(np.concatenate(keeps_o), keep1.numpy())
    assert np.allclose(np.concatenate(bases_o), base1.numpy(), rtol=1e-5, atol=1e-5)
    # the chunk's last two raw scores (a product of fewer rows may round the last bit otherwise)
    np.testing.assert_allclose(carries_r[-1], scores[-2:].numpy(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("T,rate,rank_block,chunk,ties", [(100, 0.6, 32, 32, False), (77, 0.9, 16, 48, False),
                                                         (300, 0.3, 128, 128, True), (40, 1.0, 512, 512, False),
                                                         (200, 0.0, 64, 64, False)])
def test_rank_rule_reference_function_and_torch_agree(T, rate, rank_block, chunk, ties):
    """The rank rule (rate >= 0): the reference (by its definition, pairwise), the portable ONNX
    function and the torch mechanism (zeroedge.mechanisms.sih.rank_mask) keep the same rows, in one
    pass and chunk by chunk; every rank block skips exactly floor(rate * n + 0.5) of its n skippable
    rows, the lowest-scored, and ties (a head that scores every row alike) go to the earlier row."""
    torch = pytest.importorskip("torch")
    from zeroedge.backends import plugin_reference as ref
    from zeroedge.mechanisms.sih import rank_mask

    R = 4
    w = _sih_inputs(np.random.default_rng(T + rank_block), T, R)
    if ties:
        w["w4"][:] = 0
    t = {k: torch.from_numpy(v) for k, v in w.items()}
    fields = ref.sih_fields(threshold=0.0, rate=rate, rank_block=rank_block, anchor_rank=R)
    keep, base = ref.sih(*(t[k] for k in w), **fields)
    keep_o, base_o = _run_function_node("ZeroEdgeSIH", w, ["keep", "base"], fields)
    assert np.array_equal(keep_o.reshape(-1), keep.numpy())
    assert np.allclose(base_o, base.numpy(), rtol=1e-5, atol=1e-5)
    scores = ref.sih_scores(*(t[k] for k in ("x", "w1", "b1", "w2", "b2", "w3", "b3", "w4", "b4")))
    sm = ref.smooth(scores, 0.5, 0.333333, 0.166667)
    assert torch.equal(rank_mask(sm[None], rate, rank_block, 4, 1)[0], keep.bool())
    free = (torch.arange(T) >= 4) & (torch.arange(T) < T - 1)
    for b0 in range(0, T, rank_block):
        blk = slice(b0, b0 + rank_block)
        n = int(free[blk].sum())
        skipped = free[blk] & (keep[blk] == 0)
        assert int(skipped.sum()) == int(np.floor(np.float32(rate) * np.float32(n) + np.float32(0.5)))
        if 0 < int(skipped.sum()) < n:       # every skipped row scores no higher than every kept free row
            assert float(sm[blk][skipped].max()) <= float(sm[blk][free[blk] & (keep[blk] == 1)].min())
    if ties:
        first = int(np.floor(np.float32(rate) * np.float32(int(free[:rank_block].sum())) + np.float32(0.5)))
        assert keep[4:4 + first].eq(0).all() and keep[4 + first:rank_block].eq(1).all()
    keeps_r, keeps_o, *_ = zip(*_in_chunks(torch, ref, w, T, chunk, fields))
    assert np.array_equal(np.concatenate(keeps_r), keep.numpy())
    assert np.array_equal(np.concatenate(keeps_o), keep.numpy())


def test_rank_rule_fields_are_checked():
    from zeroedge import plugin_spec

    ok = plugin_spec.field_value_problems("ZeroEdgeSIH", {"threshold": 0.0, "rate": 0.5})
    assert ok == []
    assert any("'rate'" in m for m in plugin_spec.field_value_problems("ZeroEdgeSIH", {"threshold": 0.0, "rate": 1.5}))
    assert any("rank_block" in m for m in plugin_spec.field_value_problems("ZeroEdgeSIH",
                                                                            {"threshold": 0.0, "rank_block": 0}))
    assert any("no block rule" in m for m in plugin_spec.field_value_problems(
        "ZeroEdgeSIH", {"threshold": 0.0, "rate": 0.5, "block_size": 64}))
