"""Device-side probes (stdlib only): L4T release, JetPack/TensorRT mapping, libnvinfer version via
ctypes, GPU architecture, disk and memory, all read under an injectable root. `python -m
zeroedge.device` prints the facts of this machine as JSON."""
from zeroedge.device.probe import (L4T_TABLE, decode_trt_version, device_root, disk, gpu,  # noqa: F401
                                   jetpack_for, meminfo, parse_nv_tegra_release, probe,
                                   tensorrt_library)
