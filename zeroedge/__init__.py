"""zeroedge: take a transformer from a workstation to a Jetson Orin, and make it fit and run faster.

This package is the device side and must import light: no torch, tensorrt or onnx at import time.
"""
__version__ = "0.1.0"
