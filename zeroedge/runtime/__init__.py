"""Decode runtimes over the reference model: the fast dense loop (static shapes, CUDA graphs) and
the thermal-KV decoder (`zeroedge.runtime.fast`); Triton kernels in `zeroedge.runtime.kernels`.
Import the submodules (they need torch)."""
