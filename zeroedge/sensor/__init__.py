"""Sensor-stream fault detection on Tennessee Eastman process data.

- `tep`: read the 52-column run files (Braatz layout), generate runs with the tep-studio simulator.
- `model`: the causal sensor transformer (torch, built from zeroedge.model's blocks).
- `train`: reproducible training on the CPU; `export_bundle` writes an ONNX sensor bundle.
- `pca`: the classical PCA T^2 / Q monitor (99 % control limits) as the baseline.
- `runtime`: torch-free detector (onnxruntime) and a torch backend; one code path for the daemon
  and `zeroedge sensor-eval`.
- `demo`: the sensor part of `zeroedge demo`.

Importing this package imports nothing heavy.
"""
N_XMEAS = 41
N_XMV = 11
N_CHANNELS = N_XMEAS + N_XMV          # 52 columns per frame, as in the Braatz files
N_FAULTS = 21
CLASS_NAMES = ["normal"] + [f"fault_{i:02d}" for i in range(1, N_FAULTS + 1)]
HARD_FAULTS = (3, 9, 15)              # nearly undetectable from these measurements
