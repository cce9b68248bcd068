"""What the engine steps: a model behind one interface.

  TorchBatched     the reference model (CPU or CUDA), many sequences a step over a paged KV pool
                   (zeroedge.serve.batch); a prompt is prefilled in chunks between steps. Its linear
                   layers: the model's weights in torch, or on a CPU 4-bit weights in onnxruntime
                   (zeroedge.serve.cpu_q4). With kv_budget, long prompts decode with thermal KV
                   (zeroedge.serve.thermal; the model's weights in torch)
  SessionSequential a ServingSession's decoder (zeroedge.serve.session): one sequence at a time, the
                   prompt in one prefill, the rest queue; the decoder its plan chose (dense, thermal KV
                   with a cold store, decode paths, packed weights; or an exported bundle's runner,
                   onnxruntime or TensorRT engines). `zeroedge run` and `ServingSession.generate` go
                   through it, and `zeroedge serve --bundle`

DraftModel         a drafter's model for speculative decoding (`packed`): a batched backend on the
                   model's 4-bit weights, a KV reservation of its own per request
DecoderDraftModel  the same on CUDA: the dense decoder's step on 4-bit packed forms of the model's
                   weights (its own KV, one request at a time), a head over part of the vocabulary

Both: `reserve(plan)` -> (a KV handle, the prompt positions it already holds) or None (not now),
`remember(handle, plan)` once the prompt is prefilled (-> whether thermal KV starts there: the plan
asks for it and the backend runs it), `release(handle)`, `forward(segments)` (each (handle,
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


def position_bytes(cfg, element_size: int) -> int:
    """One position's K and V over every layer."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * element_size


def pool_bytes(cfg, positions: int, element_size: int = 4) -> int:
    """A KV pool of whole pages for `positions` positions (float32: the 4-bit CPU step's)."""
    return -(-positions // PAGE_SIZE) * PAGE_SIZE * position_bytes(cfg, element_size)


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
                 kv_budget: Optional[float] = None, invariant: bool = False):
        """kv_budget: thermal KV's hot share for the requests whose plan asks for it (None: off); its
        pool has thermal KV's pages, and the sketches take their bytes out of kv_bytes. invariant:
        the step's products batch-invariant (BatchStep's `invariant`)."""
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
        self.step = BatchStep(model, self.pool, linears, hot=self.sketches, invariant=invariant)
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

    def reserve(self, plan) -> Optional[tuple]:
        shared = self.pool.share(plan.prompt) if self.prefix_cache else []
        fresh = self.pool.alloc(self.pool.pages_for(plan.kv_positions) - len(shared))
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
        return out.float().cpu().numpy()

    def prompt_kv(self, kv: Reservation, start: int, stop: int) -> tuple:
        """The K and V the sequence holds at positions start..stop, (layers, kv heads, positions, head
        dim) each, on the pool's device in its dtype (what a packed drafter takes instead of computing
        them itself)."""
        import torch

        slots = torch.tensor(self.pool.slots(kv.pages, start, stop), device=self.pool.k.device)
        d = 2 if self.pool.heads_first else 1
        out = [t.index_select(d, slots) for t in (self.pool.k, self.pool.v)]
        return tuple(t if self.pool.heads_first else t.transpose(1, 2) for t in out)

    def kv_stats(self) -> dict:
        used = self.pool.n_pages - self.pool.free_pages
        out = {"pages_total": self.pool.n_pages, "pages_used": used, "page_size": self.pool.page_size,
               "device_bytes": used * self.pool.page_bytes}
        if self.sketches is not None:
            out["thermal_sequences"] = self.sketches.in_use()
        return out


class SessionSequential:
    """One request at a time through a ServingSession: `reserve` opens the decoder the request's session
    plan chose (ServingSession.open), the prompt's one prefill and each step run it, `release` closes
    it (the session records what it moved). onnxruntime sizes its window to each request (exact KV);
    TensorRT engines were built for the bundle's window, so a request must fit it (the session's
    context; the planner refuses a longer one)."""

    mode = "sequential"
    max_batch = 1
    min_rows = 1
    prefill_chunk = None
    # a thermal KV check's row, in plain steps, until the engine has timed checks (zeroedge.speculative.
    # StepCost): each row runs its own refresh and attention (SmolLM2 at 2,000 positions, 2 CPU cores:
    # 0.27-0.34)
    THERMAL_ROW_COST = 0.35

    def __init__(self, session, ctx: int, thermal: bool = False):
        """ctx: the longest request served (the session's context at most); thermal: the requests
        decode on thermal KV."""
        self.session = session
        self.verifies = session.backend == "torch"      # the torch decoders check drafts
        self.row_cost = self.THERMAL_ROW_COST if thermal else None
        self.min_prompt = 1 if session.backend == "torch" else 2   # a bundle's prefill graph takes two or more
        self.positions_total = min(ctx, session.context)
        if session.backend == "torch":
            cfg = session.model.cfg
            p = next(session.model.parameters())
            self.position_bytes = position_bytes(cfg, p.element_size())
            self.device = str(p.device)
        else:
            r = session.runner
            self.position_bytes = 2 * r.L * r.nkv * r.hd * 4
            self.device = "cuda" if session.backend == "tensorrt" else "cpu"
        self.open = self.last = None                    # the running request's decoder, the latest one

    def reserve(self, plan) -> Optional[tuple]:
        if self.open is not None:
            return None
        self.open = self.last = self.session.open(plan.prompt, plan.sampling.max_tokens, plan.session_plan)
        return self.open, 0

    def remember(self, handle, plan) -> bool:
        return handle.plan.thermal_kv

    def release(self, handle) -> None:
        handle.close()
        if self.open is handle:
            self.open = None

    def forward(self, segments):
        import numpy as np

        (handle, toks, start, verify), = segments
        if verify:
            return handle.verify(toks, start)
        return np.asarray(handle.prefill(toks) if start == 0 else handle.step(toks[0], start))[None]

    def prompt_kv(self, handle, start: int, stop: int) -> tuple:
        """The dense decoder's K and V at positions start..stop (as TorchBatched.prompt_kv; views, read
        before the next step)."""
        att = handle.dec.attention
        return att.k[:, :, start:stop], att.v[:, :, start:stop]

    def kv_stats(self) -> dict:
        return {"pages_total": 1, "pages_used": int(self.open is not None), "page_size": self.positions_total,
                "device_bytes": self.open.device_kv_bytes() if self.open is not None else 0}


class DraftModel:
    """The model a `packed` drafter (zeroedge.speculative.ModelDrafter) runs: a TorchBatched backend on
    the model's 4-bit weights, its own KV pool (no prefix cache: its pages hold draft positions)."""

    def __init__(self, backend: TorchBatched):
        backend.prefix_cache = False
        self.b = backend
        self.weights = getattr(backend.step.q4, "description", "the model's weights")

    @classmethod
    def build(cls, m, threads: int, positions: int, max_batch: int, chunk: int, step=None) -> "DraftModel":
        """Model `m`'s own weights on the 4-bit CPU step (`step`: one made before, else made now; the
        model's float weights stay: they check the drafts), a KV pool of `positions`."""
        if step is None:
            from zeroedge.errors import require

            require("onnx", "serve")
            require("onnxruntime", "serve")
            from zeroedge.serve.cpu_q4 import Q4Step

            step = Q4Step(m, threads)
        b = TorchBatched(m, pool_bytes(m.cfg, positions), max_batch, chunk, step)
        b.warm_up()
        page = b.pool.alloc(1)              # a drafted token's step, once: its first call is not its cost
        b.forward([(Reservation(page), [0], 0, False)])
        b.pool.release(page)
        return cls(b)

    def kv_bytes(self) -> int:
        return self.b.positions_total * self.b.position_bytes

    def open(self, plan) -> Optional["DraftKV"]:
        """A request's drafter KV (prompt + max_tokens positions), or None when the pool is full."""
        got = self.b.reserve(plan)
        return None if got is None else DraftKV(self.b, got[0])


class DraftKV:
    def __init__(self, backend: TorchBatched, kv: Reservation):
        self.b, self.kv = backend, kv

    def forward(self, tokens, start: int):
        """The logits after the last of `tokens`, their K/V written at start.. (in prefill chunks)."""
        chunk = self.b.prefill_chunk or len(tokens)
        for a in range(0, len(tokens), chunk):
            row = self.b.forward([(self.kv, list(tokens[a:a + chunk]), start + a, False)])[0]
        return row

    def load(self, k, v, start: int) -> None:
        """K and V (layers, kv heads, positions, head dim) written at positions start..: the model's own,
        for the prompt, instead of a prefill here."""
        import torch

        pool = self.b.pool
        slots = torch.tensor(pool.slots(self.kv.pages, start, start + k.shape[2]), device=pool.k.device)
        d = 2 if pool.heads_first else 1
        for dst, src in ((pool.k, k), (pool.v, v)):
            dst.index_copy_(d, slots, (src if pool.heads_first else src.transpose(1, 2)).to(dst.device, dst.dtype))

    def close(self) -> None:
        if self.kv is not None:
            self.b.release(self.kv)
            self.kv = None


class DecoderDraftModel:
    """A `packed` drafter on CUDA: zeroedge.runtime.fast.DenseDecoder's step (one CUDA graph) over 4-bit
    packed forms of the model's own weights (runtime.fast.packed_forms: int4 g128 symmetric linears,
    an int8 head; the packed GEMV on int8-rounded inputs) made beside the model's (it reads the model's
    embedding and norms, not its float linears). It attends over the first 4 positions and the
    last WINDOW (runtime.fast.DenseAttention's window), so its step reads as many K/V bytes at 8K
    positions as at 1K (on SmolLM2's greedy replies at 8K positions it agrees with the model at 0.914
    of them against 0.878 attending over all: benchmarks/speculative_packed_acceptance.py). Its KV is
    its own, for one request at a time (`open` -> itself, or None while a request holds it). Its
    head scores VOCAB ids (zeroedge.speculative.draft_vocabulary of the request's prompt): its
    logits' ids are `vocab`."""

    VOCAB = 16384
    WINDOW = 1020                           # and DenseAttention's 4 sinks
    # a draft ends after a token drafted with less probability (zeroedge.speculative.ModelDrafter): this
    # drafter agrees with SmolLM2 at 0.82; the best of 0 / 0.3 / 0.5 / 0.7 in the replay of
    # benchmarks/gpu/speculative_gpu.py
    MIN_CONFIDENCE = 0.3

    def __init__(self, model, positions: int, forms=None, window: Optional[int] = WINDOW):
        """forms: packed_forms(model) made before (a drafter for more positions keeps them);
        window: None attends over every position."""
        from zeroedge.runtime.fast import DenseDecoder, packed_forms

        self.forms = forms if forms is not None else packed_forms(model)
        cuda = next(model.parameters()).device.type == "cuda"
        self.dec = DenseDecoder(model, positions, packed_forms=self.forms, int8_inputs=cuda, window=window)
        attention = self.dec.attention
        self.positions_total = positions
        self.vocab_size = model.cfg.vocab_size
        seen = (f"the first {attention.sinks} and last {attention.window} positions" if attention.ring
                else "every position")
        self.weights = ("the model's own weights as int4 g128 symmetric, int8 head over "
                        f"{min(self.VOCAB, self.vocab_size)} ids, packed GEMV" + (" (int8 inputs)" if cuda else "")
                        + f", attending over {seen}")
        self.vocab = None
        self._open = False

    def open(self, plan) -> Optional["DecoderDraftModel"]:
        from zeroedge.speculative import draft_vocabulary

        if self._open or plan.kv_positions > self.positions_total:
            return None
        if self.vocab_size > self.VOCAB:
            self.vocab = draft_vocabulary(self.vocab_size, plan.prompt, self.VOCAB)
            self.dec.restrict_head(self.vocab)
        self._open = True
        return self

    def kv_bytes(self) -> int:
        return self.dec.kv_bytes()

    def forward(self, tokens, start: int):
        """The logits (over `vocab`) after the last of `tokens`, their K/V written at start.."""
        for i, t in enumerate(tokens):
            logits = self.dec.step(int(t), start + i)
        return logits

    def load(self, k, v, start: int) -> None:
        """K and V (layers, kv heads, positions, head dim): the model's own, at positions start.."""
        self.dec.attention.load_positions(k, v, start)

    def close(self) -> None:
        self._open = False
