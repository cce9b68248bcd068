"""Speculative decoding: a drafter proposes the next tokens, the model checks them all in one step.

    spec = Speculator.create("auto", prompt_ids)         # None for "off"
    draft = spec.propose(room)                           # [] when it has nothing to offer
    # one model step over [last token] + draft, logits at every position; the model's own pick at
    # each position in turn, stopping after the first that differs from the draft (still the
    # model's next token): picks
    spec.cost.observe(len(draft), seconds)
    spec.update(len(draft), agreed(draft, picks), picks)

The drafters here are deterministic (a point mass on each proposed token). For such a draft the
standard rejection rule — keep draft token d with probability min(1, p(d) / q(d)) = p(d), on a
rejection draw from max(p - q, 0) normalised, which is p with d removed — is the same as drawing the
model's own token t from p and keeping the draft while t == d. So the caller picks every token
exactly as plain decoding would (greedy argmax, or its sampler, one draw per emitted token): the
output is the model's, token for token, whatever the drafter proposes.

  PromptLookup   n-gram lookup in the prompt and the text made so far (no extra weights): the
                 longest suffix (up to `max_ngram` tokens) seen before proposes what followed it;
                 a prompt is indexed over its last LOOKUP_TOKENS tokens (memory stays bounded).
  ModelDrafter   greedy drafts by a cheaper model of the same vocabulary (`packed`: the model's own
                 4-bit weights): its KV holds the context up to what the model accepted (the
                 prompt's, and the tokens made while it did not draft: the model's own K/V,
                 copied, where the caller can read them); the draft's rejected positions are
                 written over by the next round. It costs a step of its
                 own per drafted token, measured (`seconds`), so k is chosen before it drafts; a
                 draft may end before k after a token it is unsure of (its model's
                 MIN_CONFIDENCE). A drafter model may score only part of the vocabulary
                 (draft_vocabulary: its `vocab`).
  Speculator     a drafter and the draft length: k maximises the expected tokens per unit of step
                 cost, (1 - a^(k+1)) / (1 - a) / c(k), where a is the running acceptance of drafts
                 from matches of the same length and c(k) what a step checking k tokens costs
                 against a plain one (StepCost: measured from the caller's own steps; nothing
                 for draft tokens that fill padding rows the step computes anyway). When no
                 k > 0 pays, `auto` sends no draft (and after PROBE_EVERY tokens the shortest draft
                 that could pay, if any could); `ngram` drafts whenever the lookup matches. Its
                 counters go to --json and /metrics.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

MODES = ("off", "auto", "ngram", "packed")
LOOKUP_TOKENS = 16384


class PromptLookup:
    """Proposals from earlier occurrences of the context's last n tokens (n = max_ngram down to
    min_ngram: the longest match wins; among equal matches, the latest). O(max_ngram) per token."""

    def __init__(self, context: Sequence[int] = (), max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("prompt lookup needs 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.ctx: List[int] = []
        self._last: Dict[Tuple[int, ...], int] = {}    # n-gram -> the latest position it ended at
        self._prev: Dict[int, int] = {}                  # n -> where the current suffix of n ended before
        self.extend(context)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.ctx.append(int(t))
            i = len(self.ctx) - 1
            self._prev = {}
            for n in range(self.min_ngram, min(self.max_ngram, i + 1) + 1):
                key = tuple(self.ctx[i - n + 1:i + 1])
                before = self._last.get(key)
                if before is not None:
                    self._prev[n] = before
                self._last[key] = i

    def propose(self, k: int) -> Tuple[int, List[int]]:
        """(match length n, up to k tokens that followed the longest earlier match of the context's
        suffix); (0, []) if none."""
        if k >= 1:
            for n in range(self.max_ngram, self.min_ngram - 1, -1):
                end = self._prev.get(n)
                if end is not None:
                    return n, self.ctx[end + 1:end + 1 + k]
        return 0, []


def draft_vocabulary(vocab_size: int, prompt: Sequence[int], size: int) -> List[int]:
    """The `size` token ids a drafter's head scores (sorted): the prompt's own ids, the latest first, at
    most half of them (a reply copies its prompt's words), then the lowest ids (a BPE vocabulary numbers
    its tokens in merge order, the most common pieces first). On SmolLM2 16384 of 49152 ids keep the
    packed drafter's greedy agreement with the model (benchmarks/speculative_packed_acceptance.py)."""
    if size >= vocab_size:
        return list(range(vocab_size))
    if size < 2:
        raise ValueError(f"a draft vocabulary needs at least 2 ids (got {size})")
    kept = set()
    for t in reversed(prompt):
        if len(kept) >= size // 2:
            break
        if 0 <= t < vocab_size:
            kept.add(int(t))
    i = 0
    while len(kept) < size:
        kept.add(i)
        i += 1
    return sorted(kept)


class ModelDrafter:
    """Greedy drafts by `model`: forward(tokens, start) -> the logits after the last of `tokens` (their
    K/V written at start..), close(); optionally MIN_CONFIDENCE: a draft ends early after a token the
    drafter gives less than that share of its probability (where the drafter is only near the model,
    a token it is unsure of is the one the model most often rejects: the steps after it would be
    wasted; a drafter that is nearly the model agrees even there, and sets none). `valid`: how many
    context tokens its KV holds correctly."""

    WEIGHT = 0.2                # running mean of the seconds a drafted token costs

    def __init__(self, model, context: Sequence[int] = ()):
        self.model = model
        self.min_confidence = getattr(model, "MIN_CONFIDENCE", 0.0)
        self.ctx: List[int] = [int(t) for t in context]
        self.valid = 0
        self._fed: List[int] = []           # draft tokens whose K/V the last draft wrote past the context
        self.seconds: Optional[float] = None

    def extend(self, tokens: Sequence[int]) -> None:
        if self._fed:                       # the fed draft tokens the model kept stay valid
            self.valid = len(self.ctx) + agreed(self._fed, tokens)
            self._fed = []
        self.ctx.extend(int(t) for t in tokens)

    def prefill(self, upto: int, read_kv=None) -> None:
        """The context's K/V up to position `upto`: read_kv(start, stop) -> the model's own K and V there
        (`model.load` takes them), else computed by a forward of its own."""
        if upto > self.valid:
            if read_kv is not None:
                self.model.load(*read_kv(self.valid, upto), self.valid)
            else:
                self.model.forward(self.ctx[self.valid:upto], self.valid)
            self.valid = upto

    def _next(self, tokens: Sequence[int], start: int) -> Tuple[int, float]:
        """The drafter's greedy token after `tokens` and the probability it gives it."""
        import torch

        top = torch.as_tensor(self.model.forward(tokens, start)).float().softmax(-1).max(-1)
        i = int(top.indices)
        vocab = getattr(self.model, "vocab", None)          # the ids its logits are for, else all in order
        return (i if vocab is None else vocab[i]), float(top.values)

    def propose(self, k: int, read_kv=None) -> Tuple[int, List[int]]:
        """(0, up to k greedy tokens). The context the KV lacks goes in first: up to the context's last
        token the model's own K/V where read_kv reads them (see prefill), else steps of its own, not
        timed; the last token is timed as drafting."""
        if k < 1:
            return 0, []
        self.prefill(len(self.ctx) - 1, read_kv)
        self.valid = min(self.valid, len(self.ctx) - 1)     # the last token goes in (again) for its logits
        t0 = time.perf_counter()
        token, confidence = self._next(self.ctx[self.valid:], self.valid)
        out = [token]
        self.valid = len(self.ctx)
        while len(out) < k and confidence >= self.min_confidence:
            self._fed.append(out[-1])
            token, confidence = self._next(out[-1:], len(self.ctx) + len(out) - 1)
            out.append(token)
        dt = (time.perf_counter() - t0) / len(out)
        self.seconds = dt if self.seconds is None else self.seconds + self.WEIGHT * (dt - self.seconds)
        return 0, out

    def close(self) -> None:
        self.model.close()


@dataclass
class SpecStats:
    """drafted / accepted: draft tokens proposed and kept; verify_steps: model steps that checked a
    draft; steps: every model step that made tokens; tokens: tokens made."""
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    steps: int = 0
    tokens: int = 0

    def add(self, other: "SpecStats") -> None:
        for f in ("drafted", "accepted", "verify_steps", "steps", "tokens"):
            setattr(self, f, getattr(self, f) + getattr(other, f))

    def to_dict(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "verify_steps": self.verify_steps,
                "steps": self.steps, "tokens": self.tokens,
                "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
                "tokens_per_step": round(self.tokens / self.steps, 4) if self.steps else None}


class StepCost:
    """What a step that checks k draft tokens costs, relative to a step without drafts (k counts the
    rows a step adds: draft tokens in its padding rows are not counted): running averages
    of the caller's own step times for each k (a GPU step that reads every weight once costs about the
    same for 1 row or 9; a CPU pays for each row, and its matrix library may take a k+1-row product
    faster than a smaller one). Until a draft was checked, a k costs `prior` per row."""

    PRIOR = 0.1

    def __init__(self, prior: Optional[float] = None, weight: float = 0.2):
        self.prior, self.w = self.PRIOR if prior is None else prior, weight
        self.seconds: Dict[int, float] = {}         # draft tokens -> running mean of the step's seconds

    def observe(self, draft_rows: int, seconds: float) -> None:
        old = self.seconds.get(draft_rows)
        self.seconds[draft_rows] = seconds if old is None else old + self.w * (seconds - old)

    def relative(self, k: int) -> float:
        """A step checking k draft tokens, in steps without drafts (a k not measured yet: as the
        nearest one measured, or past the largest one measured at that one's cost per draft token,
        else the prior)."""
        plain = self.seconds.get(0)
        if k == 0:
            return 1.0
        seen = [j for j in self.seconds if j > 0]
        if plain is None or plain <= 0 or not seen:
            return 1 + self.prior * k
        top = max(seen)
        if k > top:                     # a check whose rows each cost their own work grows with k
            return 1 + max(0.0, self.seconds[top] / plain - 1) * k / top
        return self.seconds[min(seen, key=lambda j: (abs(j - k), j))] / plain


class Speculator:
    """A drafter (PromptLookup, or a ModelDrafter for `packed`) and its draft length (see the module's
    doc). `cost`: the StepCost of the steps that check its drafts (shared by the sequences of one
    engine)."""

    PRIOR = (0.6, 1.0)       # acceptance a prior: as if 0.6 of one draft token had been accepted
    MODEL_PRIOR = (0.9, 1.0)  # ... for a model drafter, the model's own weights: they mostly agree
    DECAY = 0.8              # older drafts weigh less: a reply that starts to copy is noticed quickly
    PROBE_EVERY = 16         # auto: tokens without a draft before one token is drafted again
    DRAFT_PRIOR = 0.3        # a model drafter's token, in plain steps, until its own are measured

    def __init__(self, drafter, mode: str = "ngram", k_max: int = 8,
                 cost: Optional[StepCost] = None):
        if mode not in ("auto", "ngram", "packed") or (mode == "packed") != isinstance(drafter, ModelDrafter):
            raise ValueError(f"speculative mode must be one of {MODES}, a model drafter for packed")
        self.drafter, self.mode, self.k_max = drafter, mode, k_max
        self._prior = self.MODEL_PRIOR if mode == "packed" else self.PRIOR
        self.cost = cost if cost is not None else StepCost()
        self.stats = SpecStats()
        self._acc: Dict[int, List[float]] = {}          # match length -> [accepted, trials], decayed
        self._since_draft = 0
        self._last_n = 0

    @classmethod
    def create(cls, mode: str, context: Sequence[int], draft_model=None, **kw) -> Optional["Speculator"]:
        """draft_model: the drafter's model for `packed` (ModelDrafter's `model`)."""
        if mode not in MODES:
            raise ValueError(f"speculative mode must be one of {', '.join(MODES)}, not {mode!r}")
        if mode == "off":
            return None
        if mode == "packed":
            if draft_model is None:
                raise ValueError("speculative mode packed needs a draft model")
            return cls(ModelDrafter(draft_model, context), mode, **kw)
        return cls(PromptLookup(context[-LOOKUP_TOKENS:], max_ngram=4), mode, **kw)

    def close(self) -> None:
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.close()

    def acceptance(self, n: int) -> float:
        acc, trials = self._acc.get(n, (0.0, 0.0))
        return (acc + self._prior[0]) / (trials + self._prior[1])

    def best_k(self, a: float, room: int, free: int = 0, per_draft: float = 0.0) -> int:
        """The k in 0..min(k_max, room) with the most expected tokens per unit of step cost (the first
        `free` draft tokens take rows the step computes anyway: the cost is that of the rows past them,
        as StepCost keys it; per_draft: what drafting one token costs, in plain steps)."""
        best, best_k = 1.0, 0
        for k in range(1, min(self.k_max, room) + 1):
            gain = (1 - a ** (k + 1)) / (1 - a) / (self.cost.relative(max(0, k - free)) + k * per_draft)
            if gain > best * 1.01:
                best, best_k = gain, k
        return best_k

    def propose(self, room: int, free: int = 0, read_kv=None) -> List[int]:
        """A draft for the next step (room: tokens the request may still make after the model's own
        next one; free: draft tokens that would take padding rows, computed in any case; read_kv: the
        model's K/V at context positions, for a model drafter's catch-up, see ModelDrafter.prefill);
        [] when there is no match or no draft length pays."""
        if isinstance(self.drafter, ModelDrafter):
            return self._model_draft(room, free, read_kv)
        n, cont = self.drafter.propose(min(self.k_max, room))
        self._last_n = n
        if not cont or (self.cost.seconds and 0 not in self.cost.seconds):
            return []                           # (a plain step is timed before any cost is judged)
        k = self.best_k(self.acceptance(n), len(cont), free)
        if k == 0 and self.mode == "ngram":
            k = 1
        elif k == 0 and self._since_draft >= self.PROBE_EVERY:   # the shortest draft that could pay
            k = next((j for j in range(1, len(cont) + 1) if j + 1 > self.cost.relative(j) * 1.01), 0)
        return cont[:k]

    def _model_draft(self, room: int, free: int, read_kv=None) -> List[int]:
        """A model drafter's draft: k from the acceptance so far, the check's cost and the drafter's
        own (measured; DRAFT_PRIOR of a plain step until it has drafted), then k drafted tokens."""
        plain = self.cost.seconds.get(0)
        if plain is None or plain <= 0:
            return []                           # a plain step is timed before any cost is judged
        d = self.DRAFT_PRIOR if self.drafter.seconds is None else self.drafter.seconds / plain
        a = self.acceptance(0)
        k = self.best_k(a, room, free, d)
        if k == 0 and self._since_draft >= self.PROBE_EVERY:    # the shortest draft that could pay
            k = next((j for j in range(1, min(self.k_max, room) + 1)
                      if j + 1 > (self.cost.relative(max(0, j - free)) + j * d) * 1.01), 0)
        self._last_n = 0
        return self.drafter.propose(k, read_kv)[1]

    def prompt_chunk(self, upto: int, read_kv=None) -> None:
        """The model prefilled the prompt up to position `upto`: a model drafter takes those positions'
        K/V (read_kv(start, stop): the model's, see ModelDrafter.prefill), or else prefills them itself."""
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.prefill(upto, read_kv)

    def prefilled(self, made: Sequence[int]) -> None:
        """The token the prompt's prefill produced: the drafter reads it; no decode step is counted."""
        self.drafter.extend(made)

    def update(self, drafted: int, accepted: int, made: Sequence[int]) -> None:
        """One model step: `drafted` tokens were checked, the first `accepted` kept, `made` are the
        tokens the step produced (the accepted ones and the model's own next, fewer if it ended)."""
        s = self.stats
        s.steps += 1
        s.tokens += len(made)
        self.drafter.extend(made)
        if drafted == 0:
            self._since_draft += len(made)
            return
        self._since_draft = 0
        s.drafted += drafted
        s.accepted += accepted
        s.verify_steps += 1
        st = self._acc.setdefault(self._last_n, [0.0, 0.0])
        st[0] = st[0] * self.DECAY + accepted
        st[1] = st[1] * self.DECAY + accepted + (1 if accepted < drafted else 0)


def agreed(draft: Sequence[int], picks: Sequence[int]) -> int:
    """How many leading draft tokens the model's picks confirm (picks[i] is the model's token after
    the draft's first i)."""
    n = 0
    while n < len(draft) and n < len(picks) and picks[n] == draft[n]:
        n += 1
    return n
