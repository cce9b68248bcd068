"""Portable runner: a bundle's *.portable.onnx graphs in onnxruntime (CPU anywhere).

    with OrtRunner("bundle/") as r:
        logits = r.prefill(tokens)             # fills the hot window, returns last-position logits
        logits = r.step(next_token)            # one decode step over the fixed-slot window
        ids = r.generate(tokens, 32)           # greedy

The window (slots, heat, eviction, the thermal `policy`, chunked prefill) is
zeroedge.backends.window.WindowRunner's; here the graphs run in onnxruntime, and the decode step's
buffers are bound once (IOBinding). PrefillGraph is re-exported from zeroedge.backends.window.

The prefill chunk: the `chunk` argument, else the manifest's prefill.chunk, else
zeroedge.bundle.DEFAULT_PREFILL_CHUNK (rounded up to the manifest's prefill.multiple: the SIH block
rule's block). One pass instead, said in `prefill_mode`: a bundle whose prefill graph has no prefix
inputs (exported before chunking), or one with SIH/PAD layers exported for one pass (the manifest's
prefill.one_pass).
"""
from __future__ import annotations

from typing import Callable, Optional

from zeroedge.backends import ortops
from zeroedge.backends.window import PrefillGraph, WindowRunner
from zeroedge.bundle import prefill_plan
from zeroedge.errors import UserError

__all__ = ["OrtRunner", "PrefillGraph"]


class OrtRunner(WindowRunner):
    """A bundle's prefill.FLAVOUR.onnx and decode.FLAVOUR.onnx (`flavour`, portable by default) in
    onnxruntime on the CPU, over WindowRunner's window."""

    backend = "onnxruntime"

    def __init__(self, bundle, slots: Optional[int] = None, flavour: str = "portable",
                 threads: Optional[int] = None, sinks: int = 4, decay: float = 0.9,
                 evict: Optional[Callable] = None, verify: bool = True, policy=None,
                 chunk: Optional[int] = None):
        from zeroedge.errors import require

        ort = require("onnxruntime", "export")
        self._read_bundle(bundle, verify)
        if "decode" not in {g["graph"] for g in self.manifest.get("graph_files", {}).values()}:
            raise UserError(f"{bundle}: the bundle has no decode graph (a rewritten foreign graph); "
                            "run its prefill graph directly")
        missing = [f"{g}.{flavour}.onnx" for g in ("prefill", "decode")
                   if not (self.dir / f"{g}.{flavour}.onnx").is_file()]
        if missing:
            raise UserError(f"{bundle}: the bundle has no {' or '.join(missing)} (exported with other --graphs): "
                            "run it with the backend it was exported for, or export it with --graphs both")
        self._read_model(slots)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if threads:
            so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        # priority-based node order: each layer's attention scores are freed before the next layer's are
        # made (the default order kept one [h, C, past + C] score tensor per layer alive until the end:
        # SmolLM2's prefill peak at 2K in chunks of 512 is 1.58 GB instead of 2.72 GB, no slower)
        if hasattr(ort, "ExecutionOrder"):
            so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
        # subnormal floats flushed to zero: on real text the softmax weights of far-off slots underflow
        # into them, and every product with one takes a slow path on x86 (decode -5 % at 512 tokens,
        # -10 % at 2048, SmolLM2 KJV). onnxruntime sets this on its pool threads and on the thread that
        # creates the session (numpy there flushes them too from then on)
        so.add_session_config_entry("session.set_denormal_as_zero", "1")
        prov = ["CPUExecutionProvider"]
        if ortops.needs_library(self.manifest):
            ortops.register(so, bundle)
        try:
            self.pre = ort.InferenceSession(str(self.dir / f"prefill.{flavour}.onnx"), so, providers=prov)
            self.dec = ort.InferenceSession(str(self.dir / f"decode.{flavour}.onnx"), so, providers=prov)
        except Exception as e:  # onnxruntime raises its own types for bad graphs
            raise UserError(f"{bundle}: onnxruntime cannot load the {flavour} graphs "
                            f"({type(e).__name__}: {str(e)[:300]})") from None
        self.pre = PrefillGraph(self.pre, [i.name for i in self.pre.get_inputs()], self.nkv, self.hd,
                                [o.name for o in self.pre.get_outputs()])
        self.chunk, self.prefill_mode = prefill_plan(self.manifest, bool(self.pre.prefix), chunk)
        self._start(sinks, decay, evict, policy)

    # -- backend hooks ----------------------------------------------------------------------------
    def reset(self):
        self._bound = None                       # the decode step's IOBinding: made again for the new buffers
        super().reset()

    def _input_dtype(self, name: str):
        """numpy dtype of a decode-graph input: the window's V is float16 in bundles exported since
        it was made so (export.onnx_export), float32 in older ones."""
        kind = next((i.type for i in self.dec.get_inputs() if i.name == name), None)
        if kind not in ("tensor(float)", "tensor(float16)"):
            raise UserError(f"{self.dir}: the decode graph takes no float input {name} "
                            f"({kind or 'missing'}): not a zeroedge decode graph; re-export the bundle")
        return self.np.float16 if kind == "tensor(float16)" else self.np.float32

    def _run_decode(self, token: int) -> list:
        if not hasattr(self.dec, "io_binding"):           # a session without IOBinding: WindowRunner's feed
            return super()._run_decode(token)
        io, out, tok_pos, held = self._bound or self._bind()
        if any(a is not b for a, b in zip(held, (self.slot_pos, *self.k, *self.v))):
            io, out, tok_pos, held = self._bind()         # an array was replaced, not updated
        tok_pos[0][0, 0], tok_pos[1][0] = int(token), self.pos
        self.dec.run_with_iobinding(io)
        return out

    def _bind(self):
        """The decode step's inputs and outputs bound to this runner's arrays, by address: the window
        and slot_pos are updated in place, so a step passes nothing and allocates nothing (SmolLM2 on
        a 2-thread x86 CPU: ~3 % of a step at 512 slots, none at 2048; benchmarks/ort_binding_ab.py). It holds
        the arrays it binds; _run_decode() makes it again when one was replaced (reset() makes new ones)."""
        np = self.np
        io = self.dec.io_binding()
        tok_pos = (np.zeros((1, 1), np.int64), np.zeros(1, np.int64))
        inputs = {"tokens": tok_pos[0], "pos": tok_pos[1], "slot_pos": self.slot_pos}
        for i in range(self.L):
            inputs[f"past_k.{i}"], inputs[f"past_v.{i}"] = self.k[i], self.v[i]
        for name, a in inputs.items():
            io.bind_input(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
        shapes = {"logits": (1, 1, self.vocab), "attn_mass": (1, self.L, self.slots),
                  "attn_query": (1, self.L, self.manifest["model"]["n_heads"], self.hd)}
        out = []
        for o in self.dec.get_outputs():
            a = np.empty(shapes.get(o.name, (1, self.nkv, 1, self.hd)), np.float32)
            if len(o.shape) != a.ndim or any(isinstance(d, int) and d != n for d, n in zip(o.shape, a.shape)):
                raise UserError(f"{self.dir}: the decode graph's output {o.name} has shape {o.shape}, "
                                f"not {list(a.shape)}: not a zeroedge decode graph; re-export the bundle")
            io.bind_output(o.name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
            out.append(a)
        self._bound = (io, out, tok_pos, (self.slot_pos, *self.k, *self.v))
        return self._bound
