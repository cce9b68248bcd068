"""Workstation side of zeroedge (installed as `zeroedge.export`): calibration, torch -> ONNX export,
graph rewrite, bundle writer. Heavy dependencies (torch, onnx) are imported by the submodules."""
