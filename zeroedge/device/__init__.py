"""Device-side probes (stdlib only): L4T release, JetPack/TensorRT mapping, libnvinfer version via
ctypes, GPU architecture, disk and memory, all read under an injectable root
(zeroedge.device.probe). `python -m zeroedge.device [ROOT]` prints the facts of a device as JSON."""
