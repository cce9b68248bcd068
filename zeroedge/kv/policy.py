"""Release levels, the circuit breaker, and the tier policy for each kind of memory (discrete GPU, Jetson unified DRAM, CPU). Torch-free.

Release levels (switchable at run time):
  L0  thermal KV off (dense cache)
  L1  requests under 512 tokens
  L2  requests under 4096 tokens at temperature 0
  L3  every request
Circuit breaker: when `trip_requests` (5) consecutive requests each migrate more than
`trip_pages` (1200) pages, drop one level and raise an alert (a log line and a metric).

Tier policy: on a Jetson device, host and pinned memory are the same DRAM (and on a CPU host memory
is the only memory), so moving a page to host memory frees nothing and costs the bandwidth decode
needs. There the cold side must be compressed (int8 / int4) or on NVMe. On a discrete GPU pinned
host memory is a real tier; long streams spill to a file.
"""
from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional

from zeroedge.errors import UserError
from zeroedge.kv.pages import Tier

log = logging.getLogger("zeroedge.kv")


@dataclass(frozen=True)
class ThermalSettings:
    """The thermal KV policy and sketch: one set of defaults for the serving decoder
    (zeroedge.kv.attention.ThermalAttention) and the evaluation contract (zeroedge.kv.evaluate),
    which simulates that decoder's arithmetic step by step. Chosen in benchmarks/thermal_kv.md; pages
    of 8 (with pages of 16 even the exact page oracle misses <= 3 % on essays).

    page_size      tokens a page (another page size: `thermal_settings`)
    rank, bits     the key sketch: rank-`rank` query-aware basis, signed `bits`-bit codes (1..4;
                   stored two a byte) of whitened coordinates, one fp16 scale a token
    sink_pages, recent_pages   always in the window (the recent window: 32 tokens)
    fetch          at most this many pages swapped into the window a refresh, per kv head and layer
                   (8: essays at 4096 +3.13 % with 4, +2.96 % with 8; the swap's one-reduction
                   selection makes 8 cost what 4 did; benchmarks/thermal_kv.md)
    refresh_every  steps between refreshes (page scoring + swaps)
    lag            0: a step's refresh uses its own query and its attention reads the result;
                   1: the refresh runs after the step's attention, so its swaps serve the next
                   step (the GPU decoder then overlaps it with the rest of the step, at a higher
                   perplexity cost than `ahead`)
    ahead          0: off; d > 0: layer l's pages are scored with the query layer l's weights make
                   from layer l - d's input (layers 1..d: from the first layer's), so its refresh
                   can run beside the d layers before it (the InfiniGen idea), and layer 0's
                   refresh runs one step late (as lag 1): no refresh on the step's path. H200,
                   128K, 10 % hot: 1.48-1.50x dense against lag 0's 1.19x, essays +2.84 % against
                   +2.96 % at 4096 (benchmarks/thermal_kv.md)"""
    page_size: int = 8
    rank: int = 32
    bits: int = 4
    sink_pages: int = 1
    recent_pages: int = 4
    fetch: int = 8
    refresh_every: int = 1
    lag: int = 0
    ahead: int = 0


THERMAL = ThermalSettings()
MAX_FETCH = 64      # the most `fetch` the CLI takes: the GPU swap kernels unroll one pass a page fetched

COLD_GROUP = 32   # values per fp16 scale in a compressed cold store (along the head dimension)
COLD_BITS = {"int8": 8, "int4": 4}   # the compressed cold stores (on the device)


def cold_group(hd: int) -> int:
    """Values per scale of a compressed cold store with heads hd wide: COLD_GROUP, or the whole head
    where COLD_GROUP does not divide it."""
    return COLD_GROUP if hd % COLD_GROUP == 0 else hd
SKETCH_CHUNK = 16384   # keys a sketch fit reads at a time: its fp32 copies are bounded by it, not the prefix
DEQUANT_BLOCK = 16384  # positions a compressed prefill cache dequantizes at a time (its fp32 step's bound)


def check_ahead(ahead, lag, error=ValueError):
    """`ahead` (ThermalSettings) is a whole number of layers >= 0, and not with lag 1: both take the
    refresh off the step's path, one step late or from a predicted query; raises `error`."""
    if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
        raise error(f"ahead must be a whole number of layers >= 0 (got {ahead!r})")
    if ahead and lag:
        raise error("ahead and lag 1 are two ways to take the refresh off the step's path: choose one")


def thermal_settings(page_size: Optional[int] = None) -> ThermalSettings:
    """THERMAL with pages of `page_size` tokens, its recent window kept at the same tokens (rounded up
    to whole pages): what `--page-size` means in `zeroedge run` and `zeroedge eval`."""
    if page_size is None or page_size == THERMAL.page_size:
        return THERMAL
    recent_tokens = THERMAL.recent_pages * THERMAL.page_size
    return replace(THERMAL, page_size=page_size, recent_pages=max(1, -(-recent_tokens // page_size)))


def sketch_nbytes(prefix_len: int, rank: int, hd: int) -> int:
    """Device bytes of one kv head's sketch as the decoder stores it: codes two a byte, an fp16
    scale a token, the fp32 query basis."""
    return prefix_len * rank // 2 + prefix_len * 2 + hd * rank * 4


def window_pages(prefix_len: int, budget: float, s: ThermalSettings = THERMAL) -> tuple:
    """(fixed, slots): the window's always-kept pages (sink + recent) and its slot pages for a prefix
    of prefix_len tokens at hot fraction `budget` (at least one slot)."""
    n = prefix_len // s.page_size
    total = max(1, int(round(budget * prefix_len)) // s.page_size)
    fixed = s.sink_pages + s.recent_pages
    return fixed, max(1, min(total - fixed, n - fixed))


def thermal_device_bytes(L: int, nkv: int, hd: int, prefix_len: int, gen_len: int, element: int,
                         budget: float, s: ThermalSettings = THERMAL, cold: str = "host",
                         in_file: bool = False) -> dict:
    """What zeroedge.kv.attention.ThermalAttention holds in device memory (bytes): hot (the window's
    prefix pages), generated (the window's positions for new tokens), summaries (the sketch:
    codes two a byte, fp16 scales, fp32 query basis), page_table, cold_on_device (an int8 / int4 cold
    store: on the device, which on a Jetson is the one DRAM; a "host" cold store is in pinned host
    memory; in_file: the compressed store is mapped from a file, cold_in_file, and takes none), and
    prefix_full (the dense KV of the prefix, for comparison)."""
    ps = s.page_size
    n = prefix_len // ps
    fixed, slots = window_pages(prefix_len, budget, s)
    group = cold_group(hd)
    kv = 2 * L * nkv * hd
    cold_bytes = (kv * n * ps * COLD_BITS[cold] // 8 + kv * n * ps // group * 2) if cold in COLD_BITS else 0
    return {"hot": kv * (fixed + slots) * ps * element,
            "generated": kv * gen_len * element,
            "summaries": L * nkv * sketch_nbytes(prefix_len, min(s.rank, hd), hd),
            "page_table": 8 * L * nkv * n,
            "cold_on_device": 0 if in_file else cold_bytes,
            "cold_in_file": cold_bytes if in_file else 0,
            "prefix_full": kv * prefix_len * element}


LEVELS = {0: "off", 1: "requests < 512 tokens", 2: "requests < 4096 tokens, temperature 0",
          3: "all requests"}


class ReleaseGate:
    """Decides per request whether thermal KV runs, and trips down a level on migration storms."""

    def __init__(self, level: int = 3, trip_pages: int = 1200, trip_requests: int = 5,
                 on_alert: Optional[Callable[[str], None]] = None):
        self.set_level(level)
        self.trip_pages, self.trip_requests = trip_pages, trip_requests
        self.streak = 0
        self.alerts: List[str] = []
        self.metrics: Dict[str, int] = {"thermal_kv_breaker_trips": 0, "thermal_kv_requests": 0}
        self.on_alert = on_alert

    def set_level(self, level: int):
        if level not in LEVELS:
            raise UserError(f"release level must be one of 0, 1, 2, 3 (got {level!r})")
        self.level = int(level)

    def allows(self, n_tokens: int, temperature: float = 0.0) -> bool:
        if self.level == 0:
            return False
        if self.level == 1:
            return n_tokens < 512
        if self.level == 2:
            return n_tokens < 4096 and temperature == 0
        return True

    def record(self, pages_migrated: int) -> bool:
        """Report one finished request. Returns True when this report tripped the breaker."""
        self.metrics["thermal_kv_requests"] += 1
        self.streak = self.streak + 1 if pages_migrated > self.trip_pages else 0
        if self.streak >= self.trip_requests and self.level > 0:
            old = self.level
            self.level -= 1
            self.streak = 0
            msg = (f"thermal KV circuit breaker: {self.trip_requests} consecutive requests each "
                   f"migrated more than {self.trip_pages} pages; release level L{old} -> L{self.level}")
            self.alerts.append(msg)
            self.metrics["thermal_kv_breaker_trips"] += 1
            log.warning(msg)
            if self.on_alert:
                self.on_alert(msg)
            return True
        return False


@dataclass
class TierPlan:
    memory: str                 # "discrete", "jetson" or "cpu"
    warm: Tier                  # compressed device tier
    cold: Tier                  # where cold pages go
    cold_compressed: bool       # cold pages are stored int8/int4
    cold_path: Optional[str]    # file store for FILE
    reason: str


def memory_kind(device=None) -> str:
    """The memory the serving process runs on: "jetson" (unified DRAM: /etc/nv_tegra_release), else
    "discrete" for a CUDA device, else "cpu"."""
    from zeroedge.device.probe import is_jetson

    if is_jetson():
        return "jetson"
    return "discrete" if getattr(device, "type", str(device or "")) == "cuda" else "cpu"


def plan_tiers(memory: str, stream: bool = False, cold_path: Optional[str] = None,
               cold_bits: int = 8) -> TierPlan:
    """Where WARM and COLD live for a memory kind: "discrete" (a GPU with its own memory), "jetson"
    (unified DRAM) or "cpu"."""
    if cold_bits not in (4, 8):
        raise UserError(f"cold pages are stored in int8 or int4, not {cold_bits} bits")
    warm = Tier.WARM8 if cold_bits == 8 else Tier.WARM4
    if memory in ("jetson", "cpu"):
        what = "Jetson: unified DRAM" if memory == "jetson" else "CPU: host memory is the only memory"
        if stream or cold_path:
            return TierPlan(memory, warm, Tier.FILE, True, check_cold_path(cold_path),
                            f"{what}; long streams spill compressed pages to NVMe")
        return TierPlan(memory, warm, warm, True, None,
                        f"{what}; a host cold store frees nothing, so cold pages stay compressed in place")
    if memory == "discrete":
        if stream or cold_path:
            return TierPlan(memory, warm, Tier.FILE, False, check_cold_path(cold_path),
                            "long stream: cold pages go to a file store")
        return TierPlan(memory, warm, Tier.COLD, False, None,
                        "discrete GPU: cold pages in pinned host memory, fetched over PCIe")
    raise ValueError(f"unknown memory kind {memory!r} (discrete, jetson or cpu)")


def check_cold_path(path: Optional[str], need_bytes: int = 0) -> str:
    """A cold-store folder must exist (or be creatable), be writable and have room: checked
    before any work so a full or read-only disk never leaves a half-written cache."""
    import shutil

    path = path or os.path.join(tempfile.gettempdir(), "zeroedge-kv")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UserError(f"cold store {path}: cannot create ({e.strerror})") from None
    if not os.path.isdir(path):
        raise UserError(f"cold store {path}: not a folder")
    if not os.access(path, os.W_OK):
        raise UserError(f"cold store {path}: not writable")
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"cold store {path}: not writable ({e.strerror})") from None
    free = shutil.disk_usage(path).free
    if need_bytes and free < need_bytes:
        raise UserError(f"cold store {path}: {free} bytes free, {need_bytes} needed")
    return path
