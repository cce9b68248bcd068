"""The serving engine: a thread that owns the batch and steps the backend.

    engine = Engine(backend, tokenizer, lltok)       # lltok: llguidance's tokenizer (grammars)
    engine.start()
    handle = engine.submit(plan, sink)               # sink(event) is called from the engine thread
    engine.cancel(handle)                            # the client went away: freed at the next step

    seq = Engine(backend, tokenizer).run(plan)       # or one request in the caller's thread, no engine
                                                     # thread (zeroedge run, ServingSession.generate)

Each step: queued plans are admitted in order while the batch has room and the backend can reserve
their KV (prompt + max_tokens: a running request never runs out of memory; a prompt's first pages may
come prefilled from the prefix cache, zeroedge.serve.batch.PagedKV); then one forward runs
the next token of every decoding sequence together with the next chunk of the prompts still
prefilling, oldest first, as many as fit in one chunk's tokens (at least one), so a long prompt
never stalls the running streams for longer than one chunk. A prompt's chunks start where its cached
pages end and fall at the same positions whatever else runs (batch invariance).

Events: ("text", str) as text becomes final, ("done", finish_reason, usage dict), ("error", message):
every submitted request gets a "done" or an "error", also when the engine stops.
finish_reason: "stop" (EOS, a stop string, the grammar's end), "length" (max_tokens), "cancelled".

Speculative decoding (`speculative` "ngram", "auto" or "packed", on a backend that verifies): a
decoding sequence whose drafter (zeroedge.speculative: prompt lookup, or for "packed" the model's
4-bit weights with a KV reservation of their own) proposes tokens sends them with its last token as one
verify segment; every position's logits come back, and the sequence's own picks (grammar, sampler)
run over them in order while they agree with the draft. Each emitted token is picked from the logits
plain decoding would have given (zeroedge.serve.batch), so the output is the same. "auto" and
"packed" draft only while at most AUTO_MAX_BATCH sequences decode (a larger batch already reads each
weight for many tokens; draft rows would only add work) and send no draft where the drafts'
acceptance and the step times measured here (the drafter's too) say it does not pay.
"""
from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from zeroedge.errors import UserError
from zeroedge.serve.output import Grammar, Sampler, TextOut
from zeroedge.serve.plan import Plan
from zeroedge.speculative import Speculator, SpecStats, StepCost, agreed


AUTO_MAX_BATCH = 4


@dataclass(eq=False)
class Sequence:
    id: int
    plan: Plan
    sink: Callable
    t_submit: float
    kv: object = None
    prefilled: int = 0                  # prompt tokens in the KV
    cached: int = 0                     # of them, taken from the prefix cache
    out: List[int] = field(default_factory=list)
    picks: int = 0                      # tokens picked, an EOS included
    t_first: Optional[float] = None
    t_done: Optional[float] = None
    finish_reason: Optional[str] = None
    cancelled: bool = False
    sampler: Optional[Sampler] = None
    grammar: Optional[Grammar] = None
    text: Optional[TextOut] = None
    spec: Optional[Speculator] = None


class Engine:
    def __init__(self, backend, tokenizer=None, lltok=None, metrics=None, on_tick: Optional[Callable] = None,
                 speculative: str = "off", draft_model=None):
        """tokenizer: None gives token ids only (no text events, no stop strings); draft_model: the
        drafter's model for speculative "packed" (zeroedge.serve.backends.DraftModel)."""
        self.b, self.tok, self.lltok = backend, tokenizer, lltok
        self.metrics, self.on_tick = metrics, on_tick
        # drafts need a backend whose step returns every position's logits (a bundle's does not)
        self.speculative = speculative if getattr(backend, "verifies", False) else "off"
        if self.speculative == "packed" and draft_model is None:
            raise ValueError("speculative packed needs a draft model")
        self.draft_model = draft_model
        self.spec_stats = SpecStats()           # of finished requests
        # measured on the steps without prefill; until then a row costs the backend's row_cost, if any
        self.step_cost = StepCost(getattr(backend, "row_cost", None))
        self._rows_timed = set()                # row counts of the decode steps it has run
        self.waiting: collections.deque = collections.deque()
        self.running: List[Sequence] = []
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()           # submit against the engine's end: nobody left waiting
        self._thread = threading.Thread(target=self._loop, name="zeroedge-engine", daemon=True)
        self.error: Optional[str] = None        # set when the engine thread died (health says so)
        self.steps = 0

    # -- from any thread -------------------------------------------------------------------------
    def start(self):
        self._thread.start()

    def stop(self, timeout: float = 10.0):
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, plan: Plan, sink: Callable) -> Sequence:
        seq = Sequence(next(self._ids), plan, sink, time.perf_counter())
        with self._lock:
            if self.error is not None or self._stop.is_set():
                sink(("error", f"the engine stopped: {self.error or 'the server is shutting down'}"))
                return seq
            self._inbox.put(seq)
        self._wake.set()
        return seq

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled = True
        self._wake.set()

    def load(self) -> dict:
        """Requests waiting for admission (those not yet taken from the inbox included) and running."""
        return {"waiting": len(self.waiting) + self._inbox.qsize(), "running": len(self.running)}

    def queued(self) -> int:
        """Waiting requests beyond the batch's free slots: those the next admission leaves waiting."""
        load = self.load()
        return max(0, load["waiting"] - max(0, self.b.max_batch - load["running"]))

    def run(self, plan: Plan) -> Sequence:
        """One request to its end in the caller's thread, the engine thread never started -> its
        Sequence (tokens, times, finish_reason). A request refused or failed raises UserError with the
        reason; the backend's own errors (out of memory) propagate as they are, its KV released."""
        events: list = []
        seq = Sequence(next(self._ids), plan, events.append, time.perf_counter())
        self.waiting.append(seq)
        try:
            while self.waiting or self.running:
                self._admit()
                if not self.running and self.waiting:
                    raise UserError("the backend has no room for the request")
                if self.running:
                    self._step()
        finally:
            for s in list(self.running):
                self.running.remove(s)
                self._release(s)
            self.waiting.clear()
        if events and events[-1][0] == "error":
            raise UserError(events[-1][1])
        return seq

    # -- the engine thread ------------------------------------------------------------------------
    def _loop(self):
        why = "the server is shutting down"
        try:
            while not self._stop.is_set():
                self._take_inbox()
                self._drop_cancelled()
                self._admit()
                if self.on_tick is not None:
                    self.on_tick()
                if not self.running:
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                self._step()
        except BaseException as e:          # noqa: BLE001 - reported on /health and to every client
            self.error = why = f"{type(e).__name__}: {e}"
            raise
        finally:
            with self._lock:                    # after this, submit answers at once
                self._stop.set()
                self._take_inbox()
            for s in list(self.running) + list(self.waiting):
                self._release(s)
                s.sink(("error", f"the engine stopped: {why}"))
            self.running.clear()
            self.waiting.clear()

    def _take_inbox(self):
        while True:
            try:
                self.waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _release(self, s: Sequence) -> None:
        """The sequence's KV back to the pool, and its drafter's."""
        if s.kv is not None:
            self.b.release(s.kv)
            s.kv = None
        if s.spec is not None:
            s.spec.close()

    def _finish(self, s: Sequence, reason: str):
        self._release(s)
        if s in self.running:
            self.running.remove(s)
        s.t_done, s.finish_reason = time.perf_counter(), reason
        tail = s.text.add(None) if s.text is not None and reason != "cancelled" else ""
        if tail:
            s.sink(("text", tail))
        usage = {"prompt_tokens": len(s.plan.prompt), "completion_tokens": len(s.out),
                 "total_tokens": len(s.plan.prompt) + len(s.out),
                 "prompt_tokens_details": {"cached_tokens": s.cached}}
        if s.spec is not None:
            self.spec_stats.add(s.spec.stats)
        if self.metrics is not None:
            self.metrics.finished(reason, usage, s.spec.stats if s.spec is not None else None)
        s.sink(("done", reason, usage))

    def _drop_cancelled(self):
        for s in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(s)
            self._finish(s, "cancelled")
        for s in [s for s in self.running if s.cancelled]:
            self._finish(s, "cancelled")

    def _admit(self):
        while self.waiting and len(self.running) < self.b.max_batch:
            s = self.waiting[0]
            try:
                got = self.b.reserve(s.plan)
            except UserError as e:              # a request the backend's decoder refuses: this one only
                self.waiting.popleft()
                s.sink(("error", str(e)))
                continue
            if got is None:
                return                          # FIFO: it waits for pages, and so does everyone after it
            self.waiting.popleft()
            kv, s.prefilled = got               # a cached prefix of the prompt is already in its pages
            s.cached = s.prefilled
            s.kv = kv
            p = s.plan
            try:
                s.sampler = Sampler(p.sampling.temperature, p.sampling.top_p, p.sampling.seed)
                s.text = TextOut(self.tok, p.sampling.stop) if self.tok is not None else None
                if p.grammar is not None:
                    s.grammar = Grammar(self.lltok, p.grammar)
                # a session's plan says whether its decoder checks drafts (thermal KV and paths do not)
                mode = self.speculative if p.session_plan is None or p.session_plan.speculative else "off"
                draft = self.draft_model.open(p) if mode == "packed" else None
                if mode == "packed" and draft is None:
                    mode = "off"                # the drafter's pool is full: this request decodes plainly
                s.spec = Speculator.create(mode, p.prompt, draft_model=draft, cost=self.step_cost)
            except Exception as e:              # noqa: BLE001 - a grammar llguidance refuses: this request only
                self._release(s)
                s.sink(("error", f"response_format: {e}" if p.grammar is not None else str(e)))
                continue
            self.running.append(s)

    def _step(self):
        segs, who, drafts = [], [], {}
        decoding = [s for s in self.running if s.prefilled == len(s.plan.prompt)]
        spec = self.speculative == "ngram" or (self.speculative != "off" and len(decoding) <= AUTO_MAX_BATCH)
        # a step computes at least the backend's min_rows rows: without prompt chunks, the padding rows
        # left over are free for drafts, shared among the decoding sequences
        chunks = any(s.prefilled < len(s.plan.prompt) for s in self.running)
        free = 0 if chunks or not decoding else max(0, self.b.min_rows - len(decoding)) // len(decoding)
        for s in decoding:                      # every decoding sequence: its last token (and a draft)
            draft = self._draft(s, free) if spec and s.spec else []
            drafts[s.id] = draft
            segs.append((s.kv, [s.out[-1]] + draft, len(s.plan.prompt) + len(s.out) - 1, bool(draft)))
            who.append(s)
        pre, budget = [], self.b.prefill_chunk
        for s in self.running:                  # prompts still prefilling, oldest first: a chunk each
            n = len(s.plan.prompt)
            if s.prefilled == n:
                continue
            c = budget if budget is not None else n
            a, z = s.prefilled, min(n, s.prefilled + c)
            if pre and budget is not None and sum(len(t) for _, t, _, _ in segs[-len(pre):]) + z - a > budget:
                break                           # the step's prefill tokens stay within one chunk's
            segs.append((s.kv, s.plan.prompt[a:z], a, False))
            who.append(s)
            pre.append(s)
        t0 = time.perf_counter()
        logits = self.b.forward(segs)
        self.steps += 1
        dt = time.perf_counter() - t0
        if not pre:                             # the rows the drafts added past the padding; on CUDA a row
            rows = sum(len(t) for _, t, _, _ in segs)   # count's first step may capture its graph: not its cost
            if rows in self._rows_timed or not str(getattr(self.b, "device", "cpu")).startswith("cuda"):
                self.step_cost.observe(max(0, sum(len(d) for d in drafts.values()) - free * len(decoding)), dt)
            self._rows_timed.add(rows)
        made, row = 0, 0
        for i, s in enumerate(who):
            r0, row = row, row + (len(segs[i][1]) if segs[i][3] else 1)
            try:
                if s in pre:
                    s.prefilled = segs[i][2] + len(segs[i][1])
                    if s.spec is not None:      # a model drafter takes the chunk's K/V
                        self._drafter(s, s.spec.prompt_chunk, s.prefilled,
                                      lambda a, z, kv=s.kv: self.b.prompt_kv(kv, a, z))
                    if s.prefilled < len(s.plan.prompt):
                        continue
                    if self.b.remember(s.kv, s.plan) and self.metrics is not None:
                        self.metrics.thermal_requests.inc()
                made += self._emit_rows(s, logits[r0:row], drafts.get(s.id, []), s in pre)
            except Exception as e:              # noqa: BLE001 - this sequence fails, the batch goes on
                if s in self.running:
                    self.running.remove(s)
                self._release(s)
                s.sink(("error", f"generation failed: {e}"))
        if self.metrics is not None:
            self.metrics.step(dt, made, len(segs))

    def _drafter(self, s: Sequence, call, *args):
        """call(*args) on the sequence's speculator; a drafter that fails is dropped (the request goes on
        without drafts, its output the same) -> call's result, or None."""
        try:
            return call(*args)
        except Exception:                       # noqa: BLE001 - the drafter's model failed (its memory)
            s.spec.close()
            s.spec = None
            return None

    def _draft(self, s: Sequence, free: int) -> List[int]:
        """The sequence's draft for this step ([] without one); a model drafter catches up on the
        model's own K/V."""
        return self._drafter(s, s.spec.propose, s.plan.sampling.max_tokens - len(s.out) - 1, free,
                             lambda a, z, kv=s.kv: self.b.prompt_kv(kv, a, z)) or []

    def _emit_rows(self, s: Sequence, rows, draft: List[int], prefill: bool = False) -> int:
        """The sequence's picks over its rows, while they agree with the draft -> tokens made (a
        prefill's row: its first token, not a decode step of the drafter's statistics)."""
        picks, end = [], None
        for i in range(len(rows)):
            t, end = self._emit(s, rows[i])
            if t is not None:
                picks.append(t)
            if end is not None or i >= len(draft) or t != draft[i]:
                break                           # finished, or the draft's next rows are not the model's
        if s.spec is not None and prefill:
            s.spec.prefilled(picks)
        elif s.spec is not None:
            s.spec.update(len(draft), agreed(draft, picks), picks)
        if end is not None:
            self._finish(s, end)
        return len(picks)

    def _emit(self, s: Sequence, row) -> tuple:
        """Pick the sequence's next token from its logits row -> (the token or None for EOS, the
        finish reason or None)."""
        if s.grammar is not None:
            s.grammar.apply(row)
        t = s.sampler.pick(row)
        now = time.perf_counter()
        if s.t_first is None:
            s.t_first = now
            if self.metrics is not None:
                self.metrics.first_token(now - s.t_submit)
        s.picks += 1
        if t in s.plan.eos:                     # a grammar allows EOS only where it accepts
            return None, "stop"
        if s.grammar is not None:
            s.grammar.consume(t)
        s.out.append(t)
        piece = s.text.add(t) if s.text is not None else ""
        if piece:
            s.sink(("text", piece))
        if (s.text is not None and s.text.stopped) or (s.grammar is not None and s.grammar.done()):
            return t, "stop"
        return t, "length" if len(s.out) >= s.plan.sampling.max_tokens else None
