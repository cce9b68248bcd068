"""Device-side probes, jetson-stats style: every fact is read from files under an injectable root
(`/etc/nv_tegra_release`, `/proc/device-tree`, sysfs, `/proc/meminfo`), so tests build a fake device
tree and a real Jetson is read at "/".

This file is standard-library only and written for old Pythons too (3.6 syntax: no walrus, no
`X | Y`), because `zeroedge deploy` ships its source over SSH and runs it with the device's own
`python3` *before* knowing what that Python is: a JetPack 4/5 device must get a clear refusal, not a
SyntaxError. The root comes from the ZEROEDGE_DEVICE_ROOT environment variable (default "/").
"""
import ctypes
import glob
import importlib
import importlib.util
import json
import os
import platform
import re
import sys

# L4T (Jetson Linux) release -> JetPack and the CUDA / TensorRT it ships (NVIDIA's JetPack archive).
# Only L4T 36.4.x (JetPack 6.1 / 6.2) carries TensorRT 10.3 with IPluginV3, which zeroedge needs.
L4T_TABLE = [
    # (l4t prefix, jetpack, tensorrt, cuda)
    ("36.4.4", "6.2.1", "10.3", "12.6"),
    ("36.4.3", "6.2", "10.3", "12.6"),
    ("36.4.2", "6.1", "10.3", "12.6"),
    ("36.4.0", "6.1", "10.3", "12.6"),
    ("36.4", "6.1+", "10.3", "12.6"),
    ("36.3", "6.0", "8.6", "12.2"),
    ("36.2", "6.0 DP", "8.6", "12.2"),
    ("35.6", "5.1.4", "8.5", "11.4"),
    ("35.5", "5.1.3", "8.5", "11.4"),
    ("35.4", "5.1.2", "8.5", "11.4"),
    ("35.3", "5.1.1", "8.5", "11.4"),
    ("35", "5.x", "8.5", "11.4"),
    ("32", "4.x", "8.2", "10.2"),
]

# SoC (device-tree "compatible" / tegra_chip_id) -> GPU architecture
SOC_GPU = {
    "tegra234": ("Orin", "sm_87"),
    "tegra194": ("Xavier", "sm_72"),
    "tegra186": ("TX2", "sm_62"),
    "tegra210": ("Nano/TX1", "sm_53"),
}
CHIP_ID = {0x23: "tegra234", 0x19: "tegra194", 0x18: "tegra186", 0x21: "tegra210"}

LIB_DIRS = ["usr/lib/aarch64-linux-gnu", "usr/lib/aarch64-linux-gnu/nvidia", "usr/local/cuda/lib64",
            "usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib"]


def device_root():
    return os.environ.get("ZEROEDGE_DEVICE_ROOT") or "/"


def under(root, path):
    """`path` (absolute on the device) resolved under `root`."""
    return os.path.join(root, path.lstrip("/"))


def _read(root, path):
    try:
        with open(under(root, path), "rb") as f:
            return f.read().decode("utf-8", "replace")
    except (OSError, IOError):
        return None


def is_jetson(root=None) -> bool:
    """This machine (or the fake root) is a Jetson: it has an L4T release file."""
    return os.path.isfile(under(root or device_root(), "/etc/nv_tegra_release"))


def parse_nv_tegra_release(text):
    """'# R36 (release), REVISION: 4.3, GCID: ..., BOARD: generic, ...' -> dict or None."""
    if not text:
        return None
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([0-9.]+)", text)
    if not m:
        return None
    rev = m.group(2).strip(".")
    l4t = m.group(1) + "." + rev
    if l4t.count(".") == 1:
        l4t += ".0"
    board = re.search(r"BOARD:\s*([^,\s]+)", text)
    return {"l4t": l4t, "board": board.group(1) if board else None}


def jetpack_for(l4t):
    """L4T version string -> {"jetpack", "tensorrt", "cuda"} (None where unknown)."""
    for prefix, jp, trt, cuda in L4T_TABLE:
        if l4t == prefix or l4t.startswith(prefix + "."):
            return {"jetpack": jp, "tensorrt": trt, "cuda": cuda}
    return {"jetpack": None, "tensorrt": None, "cuda": None}


def decode_trt_version(v):
    """getInferLibVersion(): TensorRT >= 10 encodes major*10000+minor*100+patch, older major*1000+..."""
    if v >= 10000:
        return "%d.%d.%d" % (v // 10000, (v // 100) % 100, v % 100)
    return "%d.%d.%d" % (v // 1000, (v // 100) % 10, v % 100)


def tensorrt_library(root):
    """Find libnvinfer under root and read its version: via ctypes (getInferLibVersion) when the
    library loads here, else from the file name (libnvinfer.so.10.3.0)."""
    found = []
    for d in LIB_DIRS:
        found += sorted(glob.glob(os.path.join(under(root, d), "libnvinfer.so*")))
    if not found:
        return None
    best = max(found, key=lambda p: (len(p.rsplit(".so", 1)[-1]), p))  # most specific soname
    out = {"path": "/" + os.path.relpath(best, root), "version": None, "source": None}
    for p in [best] + found:
        try:
            lib = ctypes.CDLL(p)
            fn = lib.getInferLibVersion
            fn.restype = ctypes.c_int32
            out["version"], out["source"] = decode_trt_version(int(fn())), "ctypes"
            return out
        except (OSError, AttributeError):
            continue
    m = re.search(r"\.so\.(\d+(?:\.\d+)*)$", best)
    if m:
        out["version"], out["source"] = m.group(1), "soname"
    return out


def gpu(root):
    compat = _read(root, "/proc/device-tree/compatible") or ""
    model = (_read(root, "/proc/device-tree/model") or "").strip("\x00\n ") or None
    soc = None
    for name in SOC_GPU:
        if name in compat:
            soc = name
            break
    if soc is None:
        chip = (_read(root, "/sys/module/tegra_fuse/parameters/tegra_chip_id") or "").strip()
        if chip.isdigit():
            soc = CHIP_ID.get(int(chip))
    family, arch = SOC_GPU.get(soc, (None, None))
    return {"soc": soc, "family": family, "arch": arch, "model": model}


def meminfo(root):
    text = _read(root, "/proc/meminfo") or ""
    vals = {}
    for line in text.splitlines():
        m = re.match(r"(\w+):\s+(\d+)\s*kB", line)
        if m:
            vals[m.group(1)] = int(m.group(2)) * 1024
    return {"total": vals.get("MemTotal"), "available": vals.get("MemAvailable", vals.get("MemFree")),
            "swap_free": vals.get("SwapFree")}


def disk(root, path):
    """Free bytes for `path` (on the device), measured at its nearest existing ancestor."""
    p = under(root, path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    st = os.statvfs(p)
    return {"path": path, "measured_at": p, "free": st.f_bavail * st.f_frsize,
            "total": st.f_blocks * st.f_frsize, "writable": os.access(p, os.W_OK)}


def modules(names):
    out = {}
    for n in names:
        try:
            spec = importlib.util.find_spec(n)
        except (ImportError, ValueError):
            spec = None
        out[n] = spec is not None
    return out


def tool(root, names, extra_dirs=()):
    """First existing executable among `names` under the root's usual bin dirs."""
    dirs = list(extra_dirs) + ["/usr/local/cuda/bin", "/usr/local/bin", "/usr/bin", "/bin"]
    for n in names:
        for d in dirs:
            p = under(root, os.path.join(d, n))
            if os.access(p, os.X_OK):
                return p
    return None


def probe(root=None, base="/opt/zeroedge", want_modules=()):
    """Everything preflight needs to decide whether this device can run a bundle. JSON-able."""
    root = root or device_root()
    rel = parse_nv_tegra_release(_read(root, "/etc/nv_tegra_release"))
    facts = {
        "root": root,
        "hostname": platform.node(),
        "machine": platform.machine(),
        "uid": os.getuid() if hasattr(os, "getuid") else None,
        "python": {"version": "%d.%d.%d" % sys.version_info[:3], "executable": sys.executable},
        "jetson": rel is not None,
        "l4t": rel["l4t"] if rel else None,
        "board": rel["board"] if rel else None,
        "gpu": gpu(root),
        "tensorrt_lib": tensorrt_library(root),
        "memory": meminfo(root),
        "disk": disk(root, base),
        "base": under(root, base),
        "modules": modules(list(want_modules) + ["tensorrt"]),
        "nvcc": tool(root, ["nvcc"]),
        "cmake": tool(root, ["cmake"]),
    }
    facts.update(jetpack_for(facts["l4t"]) if rel else {"jetpack": None, "tensorrt": None, "cuda": None})
    return facts


if __name__ == "__main__" and not globals().get("_ZEROEDGE_EMBEDDED"):
    print(json.dumps(probe(), indent=2, sort_keys=True))
