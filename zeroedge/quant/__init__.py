"""Weight-only quantization: group-wise int4 / int8 of every linear layer, round-to-nearest
with onnxruntime MatMulNBits' numerics (`groupwise`), and applying a calibration artifact's weights
section to a reference model in place (`apply`: fold the activation-aware scales, then fake-quantize).
The scale search itself (AWQ) is workstation code: zeroedge.export.awq."""
