"""TrtRunner: prefill and decode of a bundle through its TensorRT engines, over the fixed-slot window
of zeroedge.backends.window (a sibling of the onnxruntime backend's OrtRunner).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from zeroedge.backends.tensorrt.check import check_engines
from zeroedge.backends.tensorrt.plugins import default_plugin_lib
from zeroedge.backends.tensorrt.session import TrtSession
from zeroedge.backends.window import PrefillGraph, WindowRunner
from zeroedge.bundle import prefill_plan


class TrtRunner(WindowRunner):
    """Prefill and decode of a bundle through its TensorRT engines (TrtSession), with WindowRunner's
    bookkeeping (slots, heat, eviction, the thermal policy): the same protocol as OrtRunner. The
    prefill runs in the chunks its engine's profile was built for (engines.json's prefill_chunk; None
    or engines from before it: one pass)."""

    backend = "tensorrt"

    def __init__(self, bundle, engines, plugin_lib=None, slots: Optional[int] = None, sinks: int = 4,
                 decay: float = 0.9, evict: Optional[Callable] = None, verify: bool = True, policy=None):
        self._read_bundle(bundle, verify)
        self._read_model(slots)
        graphs = (self.manifest.get("export") or {}).get("graphs") or {}

        def order(g):
            return [o["name"] for o in (graphs.get(g) or {}).get("outputs", [])] or None

        engines = Path(engines)
        self.engines_meta = check_engines(self.dir, engines)
        if plugin_lib is None and not self.engines_meta.get("serialize_plugins", True):
            plugin_lib = default_plugin_lib(None)  # built without the library inside: load it here
        self.pre = self.dec = None
        self.pre = TrtSession(engines / "prefill.engine", plugin_lib, order("prefill"))
        self.dec = TrtSession(engines / "decode.engine", plugin_lib, order("decode"))
        self.pre = PrefillGraph(self.pre, self.pre.inputs, self.nkv, self.hd, self.pre.outputs)
        built = self.engines_meta.get("prefill_chunk")   # the chunk the prefill engine's profile covers
        if self.pre.prefix and "prefill_chunk" not in self.engines_meta:
            self.chunk, self.prefill_mode = None, "one pass: engines built before chunked prefill"
        elif self.pre.prefix and built:
            self.chunk, self.prefill_mode = int(built), f"chunks of {int(built)} tokens (the engine's profile)"
        elif self.pre.prefix:                             # built one pass: the bundle's one_pass
            why = (self.manifest.get("prefill") or {}).get("why") or "the engine's profile has no prefix"
            self.chunk, self.prefill_mode = None, f"one pass: {why}"
        else:
            self.chunk, self.prefill_mode = prefill_plan(self.manifest, False)
        self._start(sinks, decay, evict, policy)

    def _input_dtype(self, name: str):
        """numpy dtype the decode engine takes for input `name` (TrtSession.input_dtype)."""
        return self.dec.input_dtype(name)

    def __exit__(self, *exc):
        for s in (self.pre, self.dec):
            if s is not None:
                s.close()
        return super().__exit__(*exc)
