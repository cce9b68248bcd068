"""What the engine steps: a model behind one interface.

  TorchBatched     the reference model (CPU or CUDA), many sequences a step over a paged KV pool
                   (zeroedge.serve.batch); a prompt is prefilled in chunks between steps. Its linear
                   layers: the model's weights in torch, or on a CPU 4-bit weights in onnxruntime
                   (zeroedge.serve.cpu_q4). With kv_budget, long prompts decode with thermal KV
                   (zeroedge.serve.thermal; the model's weights in torch)
  BundleSequential an exported bundle's runner (onnxruntime, or TensorRT engines): one sequence at a
                   time (its fixed-slot window is the KV), the prompt in one prefill; the rest queue

Both: `reserve(positions, prompt)` -> (a KV handle, the prompt positions it already holds) or None (not
now), `remember(handle, plan)` once the prompt is prefilled (-> whether thermal KV starts there: the
plan asks for it and the backend runs it), `release(handle)`, `forward(segments)` (each (handle,
tokens, start, verify)) -> float32 logits on the CPU, a row per segment (every
position of a verify segment), `positions_total` / `position_bytes` for the planner, `max_batch`,
`prefill_chunk` (None: the whole prompt), `min_rows` (rows a step computes at the least), `verifies`
(takes verify segments: speculative decoding), `mode` and `kv_stats()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from zeroedge.errors import UserError

PAGE_SIZE = 16


@dataclass
class Reservation:
    """A sequence's KV in the pool: its pages, and its sketch when it runs thermal KV."""
    pages: List[int]
    hot: object = None          # zeroedge.serve.thermal.Hot


class TorchBatched:
    mode = "batched"
    min_prompt = 1
    verifies = True

    def __init__(self, model, kv_bytes: int, max_batch: int, prefill_chunk: int, linears=None,
                 kv_budget: Optional[float] = None):
        """kv_budget: thermal KV's hot share for the requests whose plan asks for it (None: off); its
        pool has thermal KV's pages, and the sketches take their bytes out of kv_bytes."""
        from zeroedge.serve.batch import BatchStep, PagedKV

        p = next(model.parameters())
        cfg = model.cfg
        if kv_budget is not None and linears is not None:
            raise UserError("thermal KV (--kv-budget) runs on the model's weights in torch (--weights model)")
        ps = PAGE_SIZE
        sketch_bytes = 0
        if kv_budget is not None:
            from zeroedge.kv.policy import THERMAL

            ps = THERMAL.page_size
            # a position's sketch: rank / 2 bytes of codes and an fp16 scale a layer and kv head
            sketch_bytes = cfg.n_layers * cfg.n_kv_heads * (min(THERMAL.rank, cfg.head_dim) // 2 + 2)
        page_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * ps * cfg.head_dim * p.element_size()
        n_pages = kv_bytes // (page_bytes + sketch_bytes * ps)
        if n_pages < 1:
            raise UserError(f"a KV pool of {kv_bytes} bytes holds no page of {ps} positions "
                            f"({page_bytes} bytes)")
        self.pool = PagedKV(cfg, int(n_pages), ps, p.device, p.dtype, heads_first=linears is not None)
        self.sketches = None
        if kv_budget is not None:
            from zeroedge.serve.thermal import ThermalSketches

            self.sketches = ThermalSketches(self.pool, cfg, kv_budget, max_batch)
        self.step = BatchStep(model, self.pool, linears, hot=self.sketches)
        self.min_rows = (linears or self.step.lin).min_rows       # rows a step computes at the least
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.positions_total = self.pool.n_pages * ps
        self.position_bytes = page_bytes // ps + sketch_bytes
        self.device = str(p.device)
        # a prompt starts from cached pages where that cannot change its output: the 4-bit CPU step
        # computes each row alike whatever chunk it is in (the torch step's chunk attention does not)
        self.prefix_cache = linears is not None

    def warm_up(self) -> None:
        """Before serving: map the pool pages a full batch's first prompt chunks take, and run one step
        of the largest shape the engine makes (a prompt chunk beside max_batch - 1 decode rows), its
        pages given back. The first burst of requests would otherwise pay those first-time costs
        (a page fault per 4 KiB of KV, the runtime's buffers grown) in its time to first token."""
        self.pool.map_ahead(self.max_batch * self.pool.pages_for(self.prefill_chunk))
        chunk = self.pool.alloc(self.pool.pages_for(self.prefill_chunk))
        singles = [self.pool.alloc(1) for _ in range(self.max_batch - 1)]
        held = [p for p in [chunk] + singles if p is not None]
        try:
            segs = [(Reservation(p), [0], 0, False) for p in singles if p is not None]
            if chunk is not None:
                segs.append((Reservation(chunk), [0] * self.prefill_chunk, 0, False))
            if segs:
                self.forward(segs)
        finally:
            for p in held:
                self.pool.release(p)

    def reserve(self, positions: int, prompt) -> Optional[tuple]:
        shared = self.pool.share(prompt) if self.prefix_cache else []
        fresh = self.pool.alloc(self.pool.pages_for(positions) - len(shared))
        if fresh is None:
            self.pool.release(shared)
            return None
        return Reservation(shared + fresh), len(shared) * self.pool.page_size

    def remember(self, kv: Reservation, plan) -> bool:
        """-> whether the sequence decodes with thermal KV (its plan asks, its prompt is long enough)."""
        if self.prefix_cache:
            self.pool.remember(kv.pages, plan.prompt)
        if plan.thermal and self.sketches is not None:
            kv.hot = self.sketches.build(kv.pages, len(plan.prompt))
        return kv.hot is not None

    def release(self, kv: Reservation) -> None:
        self.pool.release(kv.pages)
        if self.sketches is not None:
            self.sketches.drop(kv.hot)
            kv.hot = None

    def forward(self, segments):
        from zeroedge.serve.batch import Segment

        out = self.step.forward([Segment(kv.pages, toks, start, verify, kv.hot) for kv, toks, start, verify in segments])
        return out.cpu()

    def kv_stats(self) -> dict:
        used = self.pool.n_pages - self.pool.free_pages
        out = {"pages_total": self.pool.n_pages, "pages_used": used, "page_size": self.pool.page_size,
               "device_bytes": used * self.pool.page_bytes}
        if self.sketches is not None:
            out["thermal_sequences"] = self.sketches.in_use()
        return out


class BundleSequential:
    """One request at a time through OrtRunner / TrtRunner (zeroedge.backends). onnxruntime sizes its
    window to each request (exact KV); TensorRT engines were built for the bundle's window, so a request
    must fit it (the planner refuses a longer one)."""

    mode = "sequential"
    max_batch = 1
    min_rows = 1
    prefill_chunk = None
    verifies = False
    min_prompt = 2                      # a bundle's prefill graph takes two tokens or more

    def __init__(self, runner, ctx: int, fixed_window: bool):
        self.r = runner
        self.fixed = fixed_window
        self.positions_total = min(ctx, runner.slots) if fixed_window else ctx
        self.position_bytes = 2 * runner.L * runner.nkv * runner.hd * 4
        self.busy = False
        self.device = "cpu"

    def reserve(self, positions: int, prompt) -> Optional[tuple]:
        if self.busy:
            return None
        self.busy = True
        if not self.fixed:
            self.r.slots = positions            # a window of every position: exact
        self.r.policy = None
        return positions, 0

    def remember(self, handle, plan) -> bool:
        return False

    def release(self, handle) -> None:
        self.busy = False

    def forward(self, segments):
        import numpy as np
        import torch

        (_, toks, start, _), = segments
        lg = self.r.prefill(np.array(toks)) if start == 0 else self.r.step(toks[0])
        return torch.from_numpy(np.asarray(lg, np.float32).reshape(1, -1).copy())

    def kv_stats(self) -> dict:
        return {"pages_total": 1, "pages_used": int(self.busy), "page_size": self.positions_total,
                "device_bytes": self.r.window_bytes() if self.busy else 0}
