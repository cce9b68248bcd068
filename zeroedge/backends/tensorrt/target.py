"""The GPU: the one present (`gpu_present`, `gpu_here`, `gpu_compute_capability`), the compute
capabilities TensorRT-RTX builds for (`rtx_capabilities`, `compute_capability`) and the builder's
target for --cc (`build_target`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

from zeroedge.backends.tensorrt.loader import is_rtx
from zeroedge.errors import UserError


def rtx_capabilities(trt) -> list:
    """The compute capabilities this TensorRT-RTX builds for, as "7.5", "8.6", ... in numeric order."""
    names = [n for n in dir(trt.ComputeCapability) if n.startswith("SM") and n[2:].isdigit()]
    return [f"{n[2:-1]}.{n[-1]}" for n in sorted(names, key=lambda n: int(n[2:]))]


def compute_capability(trt, cc: Optional[str]):
    """A ComputeCapability of TensorRT-RTX from "8.6" / "86" / "sm86" / "SM86"; None: the GPU present."""
    if cc is None or str(cc).strip().lower() in ("", "current"):
        return trt.ComputeCapability.CURRENT
    digits = str(cc).strip().upper().replace("SM_", "").replace("SM", "").replace(".", "")
    have = rtx_capabilities(trt)
    if not digits.isdigit() or f"{digits[:-1]}.{digits[-1]}" not in have:
        raise UserError(f"TensorRT-RTX {trt.__version__} cannot build for compute capability {cc}: it knows "
                        f"{', '.join(have)}")
    return getattr(trt.ComputeCapability, f"SM{digits}")


def gpu_present() -> bool:
    """An NVIDIA GPU driver node on this machine (a discrete GPU; a Jetson has its own nodes)."""
    return Path("/dev/nvidiactl").exists()


def gpu_compute_capability() -> Optional[str]:
    """The first GPU's compute capability ("9.0") from nvidia-smi, None when it cannot say."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        r = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    first = (r.stdout.strip().splitlines() or [""])[0].strip()
    return first if r.returncode == 0 and first.replace(".", "").isdigit() else None


def gpu_here() -> bool:
    """A GPU that can run engines: a discrete NVIDIA GPU or a Jetson's integrated one."""
    from zeroedge.device.probe import is_jetson

    return gpu_present() or is_jetson()


def build_target(trt, cc: Optional[str]) -> Tuple[object, Optional[str]]:
    """(the builder's target, its label) for `cc`, checked before anything is built.

    TensorRT-RTX: ComputeCapability.SMxy for --cc, else the GPU present (CURRENT), refused with the
    list it accepts when there is no GPU or the GPU is not one it builds for. TensorRT 10.3 builds for
    the GPU it runs on: `cc` must be that GPU's (when it can be read) and the target is None."""
    if is_rtx(trt):
        have = ", ".join(rtx_capabilities(trt))
        if cc is not None and str(cc).strip().lower() not in ("", "current"):
            target = compute_capability(trt, cc)
            digits = str(cc).strip().upper().replace("SM_", "").replace("SM", "").replace(".", "")
            return target, f"{digits[:-1]}.{digits[-1]}"
        if not gpu_present():
            raise UserError(f"no NVIDIA GPU here to build for: pass --cc, one of {have} (TensorRT-RTX "
                            f"{trt.__version__} builds ahead of time for those)")
        here = gpu_compute_capability()
        if here is not None and here not in rtx_capabilities(trt):
            raise UserError(f"the GPU here has compute capability {here}, which TensorRT-RTX {trt.__version__} "
                            f"does not build for: pass --cc, one of {have}")
        return trt.ComputeCapability.CURRENT, here or "current"
    if cc is None or str(cc).strip().lower() in ("", "current"):
        return None, gpu_compute_capability()
    want = str(cc).strip().upper().replace("SM_", "").replace("SM", "").replace(".", "")
    here = gpu_compute_capability()
    if not want.isdigit():
        raise UserError(f"--cc {cc}: not a compute capability (e.g. 8.7)")
    label = f"{want[:-1]}.{want[-1]}"
    if here is not None and here != label:
        raise UserError(f"TensorRT {trt.__version__} builds only for the GPU it runs on (compute capability "
                        f"{here}), not {label}: drop --cc, or build with TensorRT-RTX elsewhere")
    return None, label
