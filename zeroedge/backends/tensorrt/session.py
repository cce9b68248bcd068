"""TrtSession: one deserialized engine, run like an onnxruntime session (`run(None, feed) ->
[outputs]`, host numpy in and out) through cuda-python.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

from zeroedge.backends.tensorrt.loader import import_cudart, import_tensorrt
from zeroedge.errors import UserError


def _check(cudart, result, what: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        name = cudart.cudaGetErrorString(err)[1] if hasattr(cudart, "cudaGetErrorString") else err
        raise RuntimeError(f"{what} failed: {name}")
    return rest[0] if len(rest) == 1 else rest


class TrtSession:
    """One engine with an onnxruntime-like `run(None, feed) -> [outputs]` (host numpy in and out)."""

    def __init__(self, engine_path, plugin_lib=None, output_order: Optional[Sequence[str]] = None):
        import numpy as np

        trt = import_tensorrt()
        self.np, self.trt = np, trt
        self.cudart = cudart = import_cudart()
        self.logger = trt.Logger(trt.Logger.WARNING)
        if plugin_lib is not None:
            if trt.get_plugin_registry().load_library(str(Path(plugin_lib).resolve())) is None:
                raise UserError(f"TensorRT could not load the plugin library {plugin_lib}")
        self.runtime = trt.Runtime(self.logger)
        self.runtime.engine_host_code_allowed = True  # the plugin library serialized in the plan
        path = Path(engine_path)
        if not path.is_file():
            raise UserError(f"engine not found: {path} (build it with: zeroedge build BUNDLE -o DIR)")
        self.engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise UserError(f"TensorRT could not load {path}: built by another TensorRT version or for another "
                            "GPU? rebuild it on this device")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        mode = trt.TensorIOMode.INPUT
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == mode]
        outs = [n for n in names if self.engine.get_tensor_mode(n) != mode]
        self.outputs = [n for n in (output_order or outs) if n in outs] or outs
        self.stream = _check(cudart, cudart.cudaStreamCreate(), "cudaStreamCreate")
        self.buffers: Dict[str, Tuple[int, int]] = {}  # name -> (device pointer, bytes)

    def input_dtype(self, name: str):
        """numpy dtype the engine takes for input `name` (TrtRunner sizes its window by it;
        float32 for a name the engine does not take)."""
        if name not in self.inputs:
            return self.np.float32
        return self.np.dtype(self.trt.nptype(self.engine.get_tensor_dtype(name))).type

    def _buffer(self, name: str, nbytes: int) -> int:
        ptr, size = self.buffers.get(name, (0, 0))
        if size < nbytes:
            if ptr:
                _check(self.cudart, self.cudart.cudaFree(ptr), "cudaFree")
            ptr = int(_check(self.cudart, self.cudart.cudaMalloc(max(nbytes, 256)), "cudaMalloc"))
            self.buffers[name] = (ptr, max(nbytes, 256))
        return self.buffers[name][0]

    def run(self, _output_names, feed: dict) -> list:
        np, trt, cudart = self.np, self.trt, self.cudart
        h2d, d2h = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        keep_alive = []
        for name in self.inputs:
            if name not in feed:
                raise UserError(f"missing input '{name}' for the TensorRT engine")
            a = np.ascontiguousarray(feed[name], dtype=trt.nptype(self.engine.get_tensor_dtype(name)))
            keep_alive.append(a)
            if not self.context.set_input_shape(name, tuple(a.shape)):
                raise UserError(f"input '{name}' of shape {tuple(a.shape)} is outside the engine's profile "
                                "(rebuild with a larger --max-tokens)")
            ptr = self._buffer(name, a.nbytes)
            _check(cudart, cudart.cudaMemcpyAsync(ptr, a.ctypes.data, a.nbytes, h2d, self.stream), "copy in")
            self.context.set_tensor_address(name, ptr)
        results = []
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            a = np.empty(shape, dtype=trt.nptype(self.engine.get_tensor_dtype(name)))
            self.context.set_tensor_address(name, self._buffer(name, a.nbytes))
            results.append(a)
        if not self.context.execute_async_v3(int(self.stream)):
            raise RuntimeError("TensorRT execute_async_v3 failed (see the log above)")
        for name, a in zip(self.outputs, results):
            _check(cudart, cudart.cudaMemcpyAsync(a.ctypes.data, self.buffers[name][0], a.nbytes, d2h, self.stream),
                   "copy out")
        _check(cudart, cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        del keep_alive
        return results

    def close(self):
        for ptr, _ in self.buffers.values():
            self.cudart.cudaFree(ptr)
        self.buffers.clear()
        if self.stream is not None:
            self.cudart.cudaStreamDestroy(self.stream)
            self.stream = None
