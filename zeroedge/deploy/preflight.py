"""Preflight: decide from a device's probed facts (zeroedge.device.probe, run over SSH) and the
bundle's manifest whether the device can run the bundle, and say exactly why not. Pure functions:
nothing here touches a device."""
from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED = "JetPack 6.1/6.2 (L4T 36.4.x)"
MIN_PYTHON = (3, 10)
# what the daemon imports on the device (import name -> pip name)
DAEMON_MODULES = {"numpy": "numpy", "onnxruntime": "onnxruntime", "paho": "paho-mqtt",
                  "prometheus_client": "prometheus-client"}
# what `zeroedge serve` imports on the device (deploy --serve: it runs instead of the daemon; onnxruntime
# for a bundle on the portable backend); llguidance is optional there
SERVE_MODULES = {"numpy": "numpy", "onnxruntime": "onnxruntime", "torch": "torch", "fastapi": "fastapi",
                 "uvicorn": "uvicorn", "sse_starlette": "sse-starlette", "prometheus_client": "prometheus-client"}


@dataclass
class Verdict:
    problems: list = field(default_factory=list)   # refusals: the deploy must not proceed
    notes: list = field(default_factory=list)      # facts worth printing (fallbacks, skipped steps)
    backend: str = "onnxruntime"
    steps: list = field(default_factory=list)      # on-device build steps: {"name", "argv"|"why"}

    @property
    def ok(self) -> bool:
        return not self.problems


def fmt_bytes(n) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0


def _ver(s) -> tuple:
    out = []
    for p in str(s or "").split("."):
        if not p.isdigit():
            break
        out.append(int(p))
    return tuple(out)


def plan_memory_bytes(plan) -> int | None:
    """Peak memory the bundle's plan asks for, if the plan states one (bytes, MB or GB keys, at the
    top level or under "memory")."""
    if not isinstance(plan, dict):
        return None
    for scope in (plan, plan.get("memory") if isinstance(plan.get("memory"), dict) else {}):
        for key, scale in (("peak_bytes", 1), ("memory_bytes", 1), ("total_bytes", 1), ("bytes", 1),
                           ("peak_mb", 1 << 20), ("memory_mb", 1 << 20), ("total_mb", 1 << 20),
                           ("peak_gb", 1 << 30), ("memory_gb", 1 << 30)):
            v = scope.get(key)
            if isinstance(v, (int, float)) and v > 0:
                return int(v * scale)
    return None


def evaluate(facts: dict, manifest: dict, upload_bytes: int, min_free: int, sudo: bool = False,
             app_has_plugins: bool = False, app_has_trt_backend: bool = False, signer: str | None = None,
             new_pins=(), serve: bool = False) -> Verdict:
    """`signer`: key id of the bundle's (checked) signature, None if unsigned; `new_pins`: key ids
    this deploy pins (--pin-key); `serve`: the release runs zeroedge serve, not the daemon (--serve)."""
    v = Verdict()
    if not facts.get("jetson"):
        v.problems.append(f"not a Jetson: no /etc/nv_tegra_release on the device (zeroedge deploys to Jetson "
                          f"Orin with {SUPPORTED})")
        return v
    _check_platform(facts, v)
    _check_python(facts, v, serve)
    _plan_build(facts, manifest, v, app_has_plugins, app_has_trt_backend)
    _check_resources(facts, manifest, v, upload_bytes, min_free, sudo)
    _check_signature(facts, v, signer, new_pins)
    return v


def _check_platform(facts: dict, v: Verdict):
    """JetPack (IPluginV3 arrived with TensorRT 10.3 in L4T 36.4) and an Orin GPU (sm_87)."""
    P = v.problems.append
    l4t, jp = facts.get("l4t"), facts.get("jetpack")
    lv = _ver(l4t)
    if lv[:2] in ((36, 3), (36, 2)):
        P(f"JetPack {jp} (L4T {l4t}) ships TensorRT 8.6, which has no IPluginV3; zeroedge needs "
          f"{SUPPORTED}: re-flash the device with JetPack 6.2")
    elif lv[:1] in ((35,), (32,)) or lv < (36,):
        P(f"JetPack {jp or '?'} (L4T {l4t}) is not supported; zeroedge needs {SUPPORTED}")
    elif lv[:2] != (36, 4):
        v.notes.append(f"L4T {l4t} is newer than the tested {SUPPORTED}")
    g = facts.get("gpu") or {}
    if g.get("arch") != "sm_87":
        what = f"{g.get('arch')} ({g.get('family')})" if g.get("arch") else "unknown (no tegra234 in /proc/device-tree)"
        P(f"GPU is {what}; zeroedge targets Jetson Orin (sm_87)")


def _check_python(facts: dict, v: Verdict, serve: bool = False):
    """The device's python3 and the imports of what the release runs: the daemon's, or zeroedge
    serve's (--serve)."""
    P = v.problems.append
    py = facts.get("python", {}).get("version", "?")
    if _ver(py)[:2] < MIN_PYTHON:
        P(f"device python3 is {py}; zeroedge needs Python >= 3.10 (JetPack 6 ships 3.10)")
    mods = facts.get("modules", {})
    if serve:
        lack = [pip for mod, pip in SERVE_MODULES.items() if mods.get(mod) is False]
        if lack and not v.problems:
            P(f"device python3 lacks {', '.join(lack)}, which zeroedge serve needs (--serve); install with: "
              f"python3 -m pip install {' '.join(lack)}")
        return
    missing = [pip for mod, pip in DAEMON_MODULES.items() if mods.get(mod) is False]
    if _ver(py)[:2] < (3, 11) and mods.get("tomli") is False:
        missing.append("tomli")
    if missing and not v.problems:
        P(f"device python3 lacks {', '.join(missing)}; install with: python3 -m pip install {' '.join(missing)}")


def _plan_build(facts: dict, manifest: dict, v: Verdict, app_has_plugins: bool, app_has_trt_backend: bool):
    """The on-device build steps: plugins and engines where TensorRT >= 10 and its Python bindings are
    there (the engine through the same build as `zeroedge build`), else the portable backend; and
    the bundle's JetPack target against the device's."""
    P = v.problems.append
    mods = facts.get("modules", {})
    lib = facts.get("tensorrt_lib") or {}
    trt_ver = lib.get("version")
    if trt_ver and _ver(trt_ver)[:1] < (10,):
        if not any("TensorRT 8.6" in p for p in v.problems):
            P(f"TensorRT {trt_ver} found ({lib.get('path')}); zeroedge needs TensorRT >= 10 (IPluginV3)")
    has_trt_onnx = any(k.endswith(".trt.onnx") for k in manifest.get("files", {}))
    if trt_ver and _ver(trt_ver)[:1] >= (10,) and mods.get("tensorrt") and has_trt_onnx and app_has_trt_backend:
        v.backend = "tensorrt"
        if app_has_plugins and facts.get("nvcc") and facts.get("cmake"):
            v.steps.append({"name": "plugins", "argv": ["./scripts/build_plugins", "--build-dir",
                                                        "{release}/build/plugins", "--arch", "87"]})
        else:
            why = "no plugin sources in this zeroedge" if not app_has_plugins else "no nvcc/cmake on the device"
            v.steps.append({"name": "plugins", "why": why})
        v.steps.append({"name": "engine", "argv": [facts["python"]["executable"], "-m", "zeroedge.backends.tensorrt",
                                                   "build", "{release}/bundle", "-o", "{release}/build", "--plugins",
                                                   "{release}/build/plugins/libzeroedge_plugins.so"]})
    else:
        if not trt_ver:
            why = "TensorRT not found on the device"
        elif not mods.get("tensorrt"):
            why = f"TensorRT {trt_ver} library found but not its Python bindings (apt install python3-libnvinfer)"
        elif not has_trt_onnx:
            why = "the bundle has no *.trt.onnx graph"
        else:
            why = "this zeroedge has no TensorRT backend"
        v.notes.append(f"{why}: using the portable onnxruntime backend (slower than a TensorRT engine)")
        v.steps += [{"name": "plugins", "why": why}, {"name": "engine", "why": why}]
    # the bundle's target: a JetPack release must match the device's TensorRT generation
    l4t, jp = facts.get("l4t"), facts.get("jetpack")
    target = str(manifest.get("target") or "")
    if target.startswith("jetpack-") and jp and not v.problems:
        want = _ver(target[len("jetpack-"):])
        if want[:1] != _ver(jp)[:1] or (want[:2] >= (6, 1) and _ver(l4t)[:2] != (36, 4)):
            P(f"the bundle targets {target} but the device runs JetPack {jp} (L4T {l4t}); re-export for it")


def _check_resources(facts: dict, manifest: dict, v: Verdict, upload_bytes: int, min_free: int, sudo: bool):
    """Memory against the bundle's plan; disk for the upload (plus room for an engine) and the reserve
    kept free; a writable install folder."""
    P = v.problems.append
    need = plan_memory_bytes(manifest.get("plan"))
    avail = (facts.get("memory") or {}).get("available")
    if need and avail is not None and need > avail:
        P(f"not enough memory: the bundle's plan needs {fmt_bytes(need)}, the device has {fmt_bytes(avail)} "
          "available")
    d = facts.get("disk") or {}
    headroom = upload_bytes + (sum(f.get("bytes", 0) for k, f in manifest.get("files", {}).items()
                                   if k.endswith(".trt.onnx")) if v.backend == "tensorrt" else 0)
    if d.get("free") is not None and d["free"] < headroom + min_free:
        P(f"disk full: {fmt_bytes(d['free'])} free at {d.get('path')}, the deploy needs {fmt_bytes(headroom)}"
          f" plus {fmt_bytes(min_free)} kept free (--min-free)")
    if not d.get("writable", True) and facts.get("uid") != 0 and not sudo:
        P(f"cannot write {d.get('path')} as this user; deploy as root or pass --sudo (passwordless sudo)")


def _check_signature(facts: dict, v: Verdict, signer, new_pins):
    """A device that pins signing keys (or gets one now) takes only bundles they signed."""
    P = v.problems.append
    pins = sorted(set(facts.get("trusted_keys") or ()) | set(new_pins))
    if not pins:
        v.notes.append("the device pins no bundle signing key, so " + (f"the signature (key {signer}) is not checked"
                       if signer else "an unsigned bundle is accepted") + " (pin one with --pin-key KEY.pub)")
    elif signer is None:
        P(f"the bundle is unsigned and the device pins signing keys ({', '.join(pins)}); sign it with: "
          "zeroedge sign BUNDLE --key KEY")
    elif signer not in pins:
        P(f"the bundle is signed by key {signer}, which the device does not pin (it pins {', '.join(pins)})")
    elif (facts.get("modules") or {}).get("cryptography") is False:
        P("device python3 lacks cryptography, needed to check bundle signatures; install with: "
          "python3 -m pip install cryptography")
