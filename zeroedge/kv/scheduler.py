"""The bandwidth-aware scheduler. Torch-free.

Inputs: transfer records (bytes, seconds) from the transfer handler (its own CUDA stream), plus
an optional hardware signal: NVML's memory utilisation on a discrete GPU (nvidia-ml-py, imported
lazily) or the EMC load from jtop on a Jetson (jetson-stats, optional, imported lazily: it is
AGPL-3.0 and needs its root service). Policy: fetches needed by the current step are capped by a
per-step page budget; background migration (promote / demote / compress) is deferred while the
utilisation is above `high` (0.85) and resumes only below `low` (hysteresis), and is otherwise
done in idle gaps between requests or stream windows.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, List, Optional, Tuple


@dataclass
class TransferRecord:
    kind: str          # "fetch" (cold -> hot for a step), "migrate", "spill"
    nbytes: int
    seconds: float
    t_end: float       # clock at completion (scheduler clock)

    @property
    def bandwidth(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else float("inf")


def nvml_sampler(index: int = 0) -> Optional[Callable[[], float]]:
    """A function returning NVML memory utilisation in [0, 1], or None where NVML is absent."""
    try:
        import pynvml  # from nvidia-ml-py
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:
        return None

    def sample() -> float:
        return pynvml.nvmlDeviceGetUtilizationRates(h).memory / 100.0

    return sample


def jtop_sampler() -> Optional[Callable[[], float]]:
    """A function returning the Jetson EMC (DRAM controller) load in [0, 1], or None off a
    Jetson / without jetson-stats and its service."""
    try:
        from jtop import jtop  # jetson-stats, optional extra "jetson"
        j = jtop()
        j.start()
    except Exception:
        return None

    def sample() -> float:
        emc = j.memory.get("EMC", {}) if hasattr(j, "memory") else {}
        v = emc.get("val", emc.get("cur", 0))
        return float(v) / 100.0 if v and v > 1 else float(v or 0.0)

    return sample


def hardware_sampler(target: str) -> Optional[Callable[[], float]]:
    if target == "jetson":
        return jtop_sampler()
    if target == "discrete":
        return nvml_sampler()
    return None


class BandwidthScheduler:
    def __init__(self, peak_bytes_per_s: float, high: float = 0.85, low: float = 0.75,
                 fetch_pages_per_step: int = 64, window_s: float = 0.05,
                 sampler: Optional[Callable[[], float]] = None,
                 clock: Callable[[], float] = time.perf_counter, sample_every: float = 0.0):
        if not 0 < low <= high <= 1:
            raise ValueError(f"need 0 < low <= high <= 1 (got low={low}, high={high})")
        if peak_bytes_per_s <= 0:
            raise ValueError("peak bandwidth must be > 0")
        self.peak, self.high, self.low = float(peak_bytes_per_s), high, low
        self.fetch_pages_per_step = fetch_pages_per_step
        self.window_s = window_s
        self.sampler, self.clock = sampler, clock
        # seconds between hardware reads (NVML / jtop cost tens of microseconds: a decode loop that
        # asks every step reads at most this often); 0: every call
        self.sample_every, self._hw, self._hw_at = sample_every, 0.0, None
        self.records: Deque[TransferRecord] = deque(maxlen=4096)
        self.deferring = False
        self.deferred: Deque[Tuple[int, int]] = deque()   # (page, dst tier) waiting for a gap
        self.decode_bytes_per_s = 0.0                      # the decode's own traffic, if known

    # -- inputs ----------------------------------------------------------------------------
    def record(self, kind: str, nbytes: int, seconds: float):
        self.records.append(TransferRecord(kind, int(nbytes), float(seconds), self.clock()))

    def utilization(self) -> float:
        """max(transfer-record utilisation over the last window, hardware signal)."""
        now = self.clock()
        moved = sum(r.nbytes for r in self.records if now - r.t_end <= self.window_s)
        u = (moved / self.window_s + self.decode_bytes_per_s) / self.peak
        if self.sampler is not None:
            if self._hw_at is None or now - self._hw_at >= self.sample_every:
                try:
                    self._hw = float(self.sampler())
                except Exception:
                    self._hw = 0.0
                self._hw_at = now
            u = max(u, self._hw)
        return min(1.0, u)

    # -- decisions -------------------------------------------------------------------------
    def may_migrate(self) -> bool:
        u = self.utilization()
        if self.deferring:
            if u < self.low:
                self.deferring = False
        elif u > self.high:
            self.deferring = True
        return not self.deferring

    def fetch_budget(self) -> int:
        return self.fetch_pages_per_step

    def submit(self, moves: List[Tuple[int, int]], do: Callable[[int, int], int]) -> int:
        """Run background moves now if the bandwidth allows, else queue them for an idle gap.
        `do(page, dst)` performs one move and returns its bytes. Returns moves done now."""
        self.deferred.extend(moves)
        if not self.may_migrate():
            return 0
        return self._drain(do)

    def idle(self, do: Callable[[int, int], int]) -> int:
        """An idle gap (between requests / stream windows): drain the deferred queue."""
        self.deferring = False
        return self._drain(do)

    def _drain(self, do) -> int:
        n = 0
        while self.deferred:
            page, dst = self.deferred.popleft()
            t0 = self.clock()
            nb = do(page, dst)
            self.record("migrate", nb, max(self.clock() - t0, 1e-9))
            n += 1
        return n

    def summary(self) -> dict:
        out = {}
        for kind in {r.kind for r in self.records}:
            rs = [r for r in self.records if r.kind == kind]
            b, s = sum(r.nbytes for r in rs), sum(r.seconds for r in rs)
            out[kind] = {"count": len(rs), "bytes": b, "seconds": s,
                         "bytes_per_s": b / s if s > 0 else None}
        return out
