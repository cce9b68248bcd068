"""The quality gate both calibrations share (SIH/PAD in prefill, decode paths).

Each layer has a list of settings, each with an estimated cost (the loss it adds) and a gain (the
FLOPs or bytes it saves). `allocation(scale)` gives every layer the deepest setting whose cost per
gain fits `scale`: one knob for the whole model, spending the budget where it is cheapest. The
allocation only changes at the ratios cost / gain, so `search` bisects over those ratios, measuring
the held-out perplexity of each candidate, and keeps the candidate with the largest measured gain
within the budget.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple


class GateError(Exception):
    """Even the mildest candidate costs more than the budget: (perplexity, its measurement)."""

    def __init__(self, ppl: float, result):
        super().__init__(f"the mildest setting reaches held-out perplexity {ppl:.4f}")
        self.ppl, self.result = ppl, result


def allocation(cost: Dict[int, Sequence[float]], gain: Sequence[float], scale: float,
               fixed: Optional[dict] = None) -> dict:
    """layer -> index of its deepest setting k with gain[k] > 0 and cost[layer][k] <= scale * gain[k];
    layers with no such setting are left out; `fixed` entries are added as they are."""
    chosen = {}
    for layer, row in cost.items():
        best = None
        for k, c in enumerate(row):
            if gain[k] > 0 and c <= scale * gain[k]:
                best = k
        if best is not None:
            chosen[layer] = best
    chosen.update(fixed or {})
    return chosen


def candidate_scales(cost: Dict[int, Sequence[float]], gain: Sequence[float], include_zero: bool) -> List[float]:
    """The scales at which the allocation changes, mildest first (0.0 first when asked: the settings
    that cost nothing)."""
    ratios = {row[k] / gain[k] for row in cost.values() for k in range(len(row)) if gain[k] > 0}
    if include_zero:
        ratios.add(0.0)
    return sorted(ratios)


def search(cost: Dict[int, Sequence[float]], gain: Sequence[float],
           measure: Callable[[dict], Tuple[float, float, object]], limit: float, steps: int,
           log: Callable[[int, float, float, float, bool], None] = lambda *a: None,
           include_zero: bool = False, fixed: Optional[dict] = None) -> Tuple[dict, float, object]:
    """Bisect the candidate scales for the deepest allocation whose measured perplexity is within
    `limit`. measure(chosen) -> (ppl, measured gain, anything the caller wants back). Returns
    (chosen, ppl, that result) of the candidate with the largest measured gain; GateError when the
    mildest candidate is already over the limit."""
    scales = candidate_scales(cost, gain, include_zero)
    if not scales:
        raise GateError(float("inf"), None)
    ppl, got, res = measure(allocation(cost, gain, scales[0], fixed))
    if ppl > limit:
        raise GateError(ppl, res)
    best = (0, ppl, got, res)
    lo, hi = 0, len(scales) - 1
    for step in range(steps):
        if lo >= hi:
            break
        mid = (lo + hi + 1) // 2
        ppl, got, res = measure(allocation(cost, gain, scales[mid], fixed))
        ok = ppl <= limit
        log(step + 1, scales[mid], ppl, got, ok)
        if ok:
            lo = mid
            if got >= best[2]:
                best = (mid, ppl, got, res)
        else:
            hi = mid - 1
    return allocation(cost, gain, scales[best[0]], fixed), best[1], best[3]
