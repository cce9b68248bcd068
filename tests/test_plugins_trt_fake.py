"""zeroedge.backends.tensorrt's Python paths against a stand-in for the hardware boundary: a fake
`tensorrt` module (builder, parser, config, runtime, engine) and a fake `cuda.bindings.runtime` whose
"device memory" is host memory. The real thing runs in device_tests/test_tensorrt_jetson.py; this
checks the build flow (fp16, workspace, timing cache, plugin serialization, profiles, atomic files)
and the run plumbing (dtypes, shapes, copies, output order, the window bookkeeping) on CI."""
import ctypes
import json
import sys
import types

import numpy as np
import pytest


# ----------------------------------------------------------------------------- fake cuda runtime
def make_cudart():
    m = types.SimpleNamespace()
    mem = {}

    class Kind:
        cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost = 1, 2

    def cudaMalloc(n):
        buf = ctypes.create_string_buffer(n)
        mem[ctypes.addressof(buf)] = buf
        return (0, ctypes.addressof(buf))

    def cudaFree(p):
        mem.pop(p, None)
        return (0,)

    def cudaMemcpyAsync(dst, src, n, kind, stream):
        ctypes.memmove(dst, src, n)
        return (0,)

    m.cudaMemcpyKind = Kind
    m.cudaMalloc, m.cudaFree, m.cudaMemcpyAsync = cudaMalloc, cudaFree, cudaMemcpyAsync
    m.cudaStreamCreate = lambda: (0, 1234)
    m.cudaStreamSynchronize = lambda s: (0,)
    m.cudaStreamDestroy = lambda s: (0,)
    m.cudaGetErrorString = lambda e: (0, b"fake error")
    m.mem = mem
    return m


# ----------------------------------------------------------------------------- fake tensorrt
class FakeEngine:
    """prefill-like engine: tokens [1, T] int64 -> logits [1, 1, V], k.0 / v.0 [1, 1, T, 2], mass [1, 1, T]."""

    V = 5

    def __init__(self, trt):
        self.trt = trt
        self.io = [("tokens", trt.TensorIOMode.INPUT, trt.int64), ("mass", trt.TensorIOMode.OUTPUT, trt.float32),
                   ("logits", trt.TensorIOMode.OUTPUT, trt.float32), ("k.0", trt.TensorIOMode.OUTPUT, trt.float32),
                   ("v.0", trt.TensorIOMode.OUTPUT, trt.float32)]
        self.num_io_tensors = len(self.io)

    def get_tensor_name(self, i):
        return self.io[i][0]

    def get_tensor_mode(self, n):
        return dict((a, b) for a, b, _ in self.io)[n]

    def get_tensor_dtype(self, n):
        return dict((a, c) for a, _, c in self.io)[n]

    def create_execution_context(self):
        return FakeContext(self)


class FakeContext:
    def __init__(self, engine):
        self.engine, self.shapes, self.addr = engine, {}, {}

    def set_input_shape(self, name, shape):
        if shape[-1] > 64:  # the profile's max
            return False
        self.shapes[name] = tuple(shape)
        return True

    def get_tensor_shape(self, name):
        T = self.shapes["tokens"][1]
        return {"logits": (1, 1, FakeEngine.V), "k.0": (1, 1, T, 2), "v.0": (1, 1, T, 2), "mass": (1, 1, T)}[name]

    def set_tensor_address(self, name, ptr):
        self.addr[name] = ptr

    def _view(self, name, dtype, shape):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return np.frombuffer((ctypes.c_char * n).from_address(self.addr[name]), dtype=dtype).reshape(shape)

    def execute_async_v3(self, stream):
        assert isinstance(stream, int)
        T = self.shapes["tokens"][1]
        tok = self._view("tokens", np.int64, (1, T)).astype(np.float32)
        self._view("logits", np.float32, (1, 1, FakeEngine.V))[:] = tok[0, -1] * np.arange(FakeEngine.V)
        self._view("k.0", np.float32, (1, 1, T, 2))[:] = tok[0][None, None, :, None]
        self._view("v.0", np.float32, (1, 1, T, 2))[:] = -tok[0][None, None, :, None]
        self._view("mass", np.float32, (1, 1, T))[:] = np.linspace(1, 0, T)
        return True


def make_trt(calls):
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.3.0"
    trt.int64, trt.float32 = "INT64", "FLOAT"
    trt.nptype = lambda d: {"INT64": np.int64, "FLOAT": np.float32}[d]
    trt.TensorIOMode = types.SimpleNamespace(INPUT="in", OUTPUT="out")
    trt.BuilderFlag = types.SimpleNamespace(FP16="FP16", VERSION_COMPATIBLE="VC", EXCLUDE_LEAN_RUNTIME="XLEAN")
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WS")

    class Logger:
        WARNING = 2

        def __init__(self, level):
            pass

    class Registry:
        def load_library(self, path):
            calls.append(("load_library", path))
            return None if "bad" in path else object()

        def get_creator(self, name, version, ns):
            return object() if (version, ns) == ("1", "zeroedge") else None

    registry = Registry()
    trt.get_plugin_registry = lambda: registry

    class Inp:
        def __init__(self, name, shape):
            self.name, self.shape = name, shape

    class Network:
        num_inputs = 1

        def get_input(self, i):
            return Inp("tokens", (-1, -1))

    class Parser:
        num_errors = 0

        def __init__(self, network, logger):
            pass

        def parse_from_file(self, path):
            calls.append(("parse", path))
            return True

    class Cache:
        def serialize(self):
            return b"timing-cache-bytes"

    class Config:
        def __init__(self):
            self.flags, self.plugins_to_serialize = [], None

        def set_flag(self, f):
            self.flags.append(f)

        def set_memory_pool_limit(self, pool, n):
            calls.append(("workspace", n))

        def create_timing_cache(self, blob):
            calls.append(("timing_cache_in", bytes(blob)))
            return Cache()

        def set_timing_cache(self, cache, ignore_mismatch):
            pass

        def get_timing_cache(self):
            return Cache()

        def add_optimization_profile(self, p):
            calls.append(("profile", dict(p.shapes)))

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, lo, opt, hi):
            self.shapes[name] = (lo, opt, hi)

    class Builder:
        def __init__(self, logger):
            pass

        def get_plugin_registry(self):
            return registry

        def create_network(self, flags):
            return Network()

        def create_builder_config(self):
            self.config = Config()
            return self.config

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            calls.append(("flags", list(config.flags)))
            calls.append(("plugins_to_serialize", config.plugins_to_serialize))
            return b"ENGINE"

    class Runtime:
        engine_host_code_allowed = False

        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, blob):
            calls.append(("deserialize", bytes(blob), self.engine_host_code_allowed))
            return FakeEngine(trt) if blob == b"ENGINE" else None

    trt.Logger, trt.Builder, trt.OnnxParser, trt.Runtime = Logger, Builder, Parser, Runtime
    return trt


@pytest.fixture
def fake(monkeypatch):
    calls = []
    trt = make_trt(calls)
    cudart = make_cudart()
    cuda = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = cudart
    cuda.bindings = bindings
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", cudart)
    # the GPU's device node is hardware too: this machine "has" the GPU the fake engines run on
    monkeypatch.setattr("zeroedge.backends.tensorrt.target.gpu_present", lambda: True)
    return calls, cudart


def fake_engines(bundle_dir, folder):
    """An engines folder as `zeroedge build` leaves it, for the fake runtime: two engine blobs and an
    engines.json naming this bundle and the fake TensorRT 10.3."""
    import hashlib

    folder.mkdir()
    for g in ("prefill", "decode"):
        (folder / f"{g}.engine").write_bytes(b"ENGINE")
    sha = hashlib.sha256((bundle_dir / "manifest.json").read_bytes()).hexdigest()
    (folder / "engines.json").write_text(json.dumps({
        "backend": "tensorrt 10.3.0", "bundle_manifest_sha256": sha, "cc": None, "serialize_plugins": True,
        "engines": {"prefill": {"file": "prefill.engine"}, "decode": {"file": "decode.engine"}}}))
    return folder


@pytest.fixture
def bundle(tmp_path):
    from zeroedge import bundle as bundle_mod
    from zeroedge import plugin_spec

    b = tmp_path / "bundle"
    b.mkdir()
    for g in ("prefill", "decode"):
        (b / f"{g}.trt.onnx").write_bytes(b"graph")
    bundle_mod.write_manifest(b, {
        "plugin_abi": plugin_spec.PLUGIN_ABI, "window": 8, "plan": {"memory": {"workspace_mb": 32}, "context": 64},
        "model": {"n_layers": 1, "n_kv_heads": 1, "dim": 2, "n_heads": 1, "vocab_size": FakeEngine.V},
        "export": {"graphs": {"prefill": {"outputs": [{"name": n} for n in ("logits", "k.0", "v.0", "mass")]}}}})
    lib = tmp_path / "libzeroedge_plugins.so"
    lib.write_bytes(b"\x7fELF")
    return b, lib


def test_build_flow(fake, bundle, tmp_path):
    from zeroedge.backends.tensorrt import build_bundle_engines

    calls, _ = fake
    b, lib = bundle
    out = tmp_path / "engines"
    meta = build_bundle_engines(b, lib, out, log=lambda s: None)
    assert (out / "prefill.engine").read_bytes() == b"ENGINE" and (out / "decode.engine").read_bytes() == b"ENGINE"
    assert (out / "timing.cache").read_bytes() == b"timing-cache-bytes"
    assert json.loads((out / "engines.json").read_text())["workspace_bytes"] == 32 << 20
    assert ("workspace", 32 << 20) in calls
    flags = [c[1] for c in calls if c[0] == "flags"][0]
    assert flags == ["FP16", "VC", "XLEAN"]
    assert [c[1] for c in calls if c[0] == "plugins_to_serialize"][0] == [str(lib.resolve())]
    assert [c[1] for c in calls if c[0] == "profile"][0] == {"tokens": ((1, 1), (1, 64), (1, 64))}
    # the second graph reuses the first one's timing cache
    assert [c[1] for c in calls if c[0] == "timing_cache_in"] == [b"", b"timing-cache-bytes"]
    assert meta["max_tokens"] == 64 and set(meta["engines"]) == {"prefill", "decode"}
    assert not list(out.glob("*.tmp"))


def test_build_refuses_a_library_tensorrt_cannot_load(fake, bundle, tmp_path):
    from zeroedge.backends.tensorrt import build_bundle_engines
    from zeroedge.errors import UserError

    b, lib = bundle
    bad = tmp_path / "bad.so"
    bad.write_bytes(b"x")
    with pytest.raises(UserError, match="could not load the plugin library"):
        build_bundle_engines(b, bad, tmp_path / "out", log=lambda s: None)
    assert not (tmp_path / "out" / "prefill.engine").exists()


def test_session_run_plumbing(fake, tmp_path):
    from zeroedge.backends.tensorrt import TrtSession
    from zeroedge.errors import UserError

    calls, cudart = fake
    (tmp_path / "e.engine").write_bytes(b"ENGINE")
    s = TrtSession(tmp_path / "e.engine", output_order=["logits", "k.0", "v.0", "mass"])
    assert ("deserialize", b"ENGINE", True) in calls  # host code allowed: the embedded plugin library
    out = s.run(None, {"tokens": np.array([[3, 1, 4]], dtype=np.int32)})  # int32 in: converted to int64
    assert [o.shape for o in out] == [(1, 1, 5), (1, 1, 3, 2), (1, 1, 3, 2), (1, 1, 3)]
    assert np.array_equal(out[0][0, 0], 4 * np.arange(5, dtype=np.float32))
    assert np.array_equal(out[1][0, 0, :, 0], [3, 1, 4]) and out[3].dtype == np.float32
    out2 = s.run(None, {"tokens": np.arange(10)[None]})  # larger: buffers grow
    assert out2[1].shape == (1, 1, 10, 2) and out2[0][0, 0, 1] == 9
    with pytest.raises(UserError, match="outside the engine's profile"):
        s.run(None, {"tokens": np.zeros((1, 65), np.int64)})
    with pytest.raises(UserError, match="missing input 'tokens'"):
        s.run(None, {})
    s.close()
    assert not cudart.mem
    (tmp_path / "other.engine").write_bytes(b"OTHER")
    with pytest.raises(UserError, match="rebuild it on this device"):
        TrtSession(tmp_path / "other.engine")


def test_runner_uses_the_window_bookkeeping(fake, bundle, tmp_path):
    from zeroedge.backends.tensorrt import TrtRunner

    b, lib = bundle
    eng = fake_engines(b, tmp_path / "engines")
    with TrtRunner(b, eng, lib, slots=8) as r:
        logits = r.prefill(np.array([2, 7, 1, 8]))
        assert np.array_equal(logits, 8 * np.arange(5, dtype=np.float32))
        assert r.pos == 4 and list(r.slot_pos[0, :4]) == [0, 1, 2, 3]
        assert np.array_equal(r.k[0][0, 0, :4, 0], [2, 7, 1, 8])
        sessions = (r.pre, r.dec)
    assert r.pre is None and all(not s.buffers for s in sessions)


@pytest.mark.parametrize("store", ["fp32", "int8"])
def test_runner_drives_the_thermal_window_policy(fake, bundle, tmp_path, store):
    """TrtRunner takes the thermal policy OrtRunner takes: a prompt longer than the window leaves the hot
    pages in the engine's slots (K = the token ids, the fake engine's cache) and the rest in the
    policy's store, with the page table and the window consistent."""
    from zeroedge.backends.tensorrt import TrtRunner
    from zeroedge.kv.ort_policy import OrtThermalPolicy

    b, lib = bundle
    eng = fake_engines(b, tmp_path / "engines")
    pol = OrtThermalPolicy(page_size=2, store=store)
    toks = np.arange(3, 43)                                   # 40 tokens, 20 pages, 16 slots
    with TrtRunner(b, eng, lib, slots=16, policy=pol) as r:
        r.prefill(toks)
        pol.check(r)
        pos = r.slot_pos[0]
        live = np.flatnonzero(pos >= 0)
        assert live.size == 16 and r.pos == 40
        assert np.array_equal(r.k[0][0, 0, live, 0], toks[pos[live]].astype(np.float32))
        assert np.array_equal(r.v[0][0, 0, live, 0], -toks[pos[live]].astype(np.float32))
        st = pol.stats()
        assert st["pages"] == 20 and st["hot_pages"] == 8 and st["stored_pages"] == 12
