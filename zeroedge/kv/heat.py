"""Page heat: attention mass a page received, decayed with age as t^-0.7, weighted by how close
the page's mean key is (cosine) to the recent queries. Torch-free.

Exact power-law decay needs the whole history. Instead each page keeps 7 accumulators, each decaying
exponentially with time constants 1..4096 steps; a fixed non-negative mix of them follows t^-0.7
within 6.5 % (relative) for every age from 1 to 4096 steps (fitted by NNLS; see
`decay_kernel` and tests/test_kv_bookkeeping.py). Decay is applied lazily when a page is read or
touched, so a step costs O(pages touched), not O(pages).
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Tuple

ALPHA = 0.7
TAUS = (1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0)
WEIGHTS = (0.4832, 0.26112, 0.17079, 0.04457, 0.02845, 0.00367, 0.00734)
DEFAULT_THRESHOLD = 0.05


def decay_kernel(age: int) -> float:
    """The kernel the accumulators realise for a contribution `age` steps old (age 1 = this step)."""
    return sum(w * math.exp(-(age - 1) / t) for w, t in zip(WEIGHTS, TAUS))


def exact_kernel(age: int) -> float:
    return float(age) ** -ALPHA


class HeatTracker:
    """heat(p) = cos_weight(p) * sum_s mass_s(p) * (now - s + 1)^-0.7   (approximately)."""

    def __init__(self, cos_floor: float = 0.0):
        self.now = 0
        self.cos_floor = cos_floor
        self._acc: Dict[int, List[float]] = {}
        self._at: Dict[int, int] = {}
        self._cos: Dict[int, float] = {}

    def _bring(self, p: int):
        acc = self._acc.get(p)
        if acc is None:
            return None
        dt = self.now - self._at[p]
        if dt:
            for i, t in enumerate(TAUS):
                acc[i] *= math.exp(-dt / t)
            self._at[p] = self.now
        return acc

    def step(self, masses: Dict[int, float], cosines: Optional[Dict[int, float]] = None):
        """Record one decode step: `masses` = attention mass each page received this step
        (summed over heads, any pages absent received none); `cosines` = cosine of each page's
        mean key with the recent queries (pages absent keep their last value, default 1)."""
        self.now += 1
        for p, m in masses.items():
            if m < 0 or m != m:
                raise ValueError(f"attention mass must be >= 0, got {m} for page {p}")
            acc = self._bring(p)
            if acc is None:
                acc = self._acc[p] = [0.0] * len(TAUS)
                self._at[p] = self.now
            # a contribution made now has age 1 at this step: decay starts at the next step
            for i in range(len(TAUS)):
                acc[i] += m
        if cosines:
            for p, c in cosines.items():
                self._cos[p] = float(c)

    def heat(self, p: int) -> float:
        acc = self._bring(p)
        if acc is None:
            return 0.0
        w = max(self.cos_floor, self._cos.get(p, 1.0))
        return w * sum(wi * a for wi, a in zip(WEIGHTS, acc))

    def heats(self, pages: Iterable[int]) -> Dict[int, float]:
        return {p: self.heat(p) for p in pages}

    def forget(self, p: int):
        self._acc.pop(p, None)
        self._at.pop(p, None)
        self._cos.pop(p, None)


def plan_migration(hot: Dict[int, float], cold: Dict[int, float], threshold: float = DEFAULT_THRESHOLD,
                   max_moves: Optional[int] = None) -> List[Tuple[int, int]]:
    """Swaps (cold page up, hot page down) worth doing: a cold page replaces the coldest hot page
    only when its heat exceeds that page's by more than `threshold` (the hysteresis that stops
    pages from ping-ponging). Pages given as {page: heat}. Returns [(promote, demote), ...]."""
    if threshold < 0:
        raise ValueError("threshold must be >= 0")
    ups = sorted(cold.items(), key=lambda kv: -kv[1])
    downs = sorted(hot.items(), key=lambda kv: kv[1])
    out = []
    for (u, hu), (d, hd) in zip(ups, downs):
        if hu - hd <= threshold:
            break
        out.append((u, d))
        if max_moves is not None and len(out) >= max_moves:
            break
    return out
