"""Torch-free bookkeeping of a paged KV cache: 8-byte page-table entries, the page table, the
event log. Everything here works on plain integers (vLLM kv_offload style: lookup / prepare /
complete / touch / events), so it is unit-tested without torch and runs on any target.

A page holds P consecutive token positions of one (layer, kv head) stream. Its entry packs into
64 bits:

    bits 63..61  tier        (HOT=0, WARM8=1, WARM4=2, COLD=3, FILE=4, MOVING=5, FREE=7)
    bits 60..56  flags       (bit 0 pinned: sinks / recent window never leave HOT)
    bits 55..32  slot        (24 bits: index of the slot inside the tier's pool)
    bits 31..0   offset      (32 bits: first token position of the page, or a byte offset / 64
                              inside a file-backed cold store)
"""
from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass
from enum import IntEnum
from typing import Deque, Dict, Iterable, List, Optional, Tuple


class Tier(IntEnum):
    HOT = 0      # device memory, model dtype, inside the fixed-slot window the decode graph reads
    WARM8 = 1    # device memory, int8 with per-group scales
    WARM4 = 2    # device memory, int4 with per-group scales
    COLD = 3     # pinned host memory (discrete GPU) / compressed host bytes
    FILE = 4     # file-backed store on NVMe (endless streams)
    MOVING = 5   # a transfer is in flight (lookups must wait for `complete`)
    FREE = 7


SLOT_BITS, OFFSET_BITS = 24, 32
MAX_SLOT = (1 << SLOT_BITS) - 1
MAX_OFFSET = (1 << OFFSET_BITS) - 1
PINNED = 1


def pack_entry(tier: int, slot: int, offset: int, flags: int = 0) -> int:
    """(tier, slot, offset, flags) -> one unsigned 64-bit integer."""
    tier, slot, offset, flags = int(tier), int(slot), int(offset), int(flags)
    if not 0 <= tier <= 7:
        raise ValueError(f"tier {tier} does not fit 3 bits")
    if not 0 <= flags <= 31:
        raise ValueError(f"flags {flags} do not fit 5 bits")
    if not 0 <= slot <= MAX_SLOT:
        raise ValueError(f"slot {slot} does not fit {SLOT_BITS} bits")
    if not 0 <= offset <= MAX_OFFSET:
        raise ValueError(f"offset {offset} does not fit {OFFSET_BITS} bits")
    return (tier << 61) | (flags << 56) | (slot << 32) | offset


def unpack_entry(e: int) -> Tuple[int, int, int, int]:
    """64-bit entry -> (tier, slot, offset, flags)."""
    e = int(e)
    if not 0 <= e < (1 << 64):
        raise ValueError("entry is not an unsigned 64-bit integer")
    return (e >> 61) & 7, (e >> 32) & MAX_SLOT, e & MAX_OFFSET, (e >> 56) & 31


@dataclass
class Event:
    step: int
    kind: str            # "alloc", "migrate", "fetch", "complete", "evict", "free", "alert", "level"
    page: int = -1
    src: int = -1
    dst: int = -1
    nbytes: int = 0
    detail: str = ""


class EventLog:
    """Bounded log of cache events plus running counters (never grows past `maxlen` entries)."""

    def __init__(self, maxlen: int = 10000):
        self.events: Deque[Event] = deque(maxlen=maxlen)
        self.counts: Dict[str, int] = {}
        self.bytes: Dict[str, int] = {}

    def add(self, ev: Event):
        self.events.append(ev)
        self.counts[ev.kind] = self.counts.get(ev.kind, 0) + 1
        self.bytes[ev.kind] = self.bytes.get(ev.kind, 0) + ev.nbytes

    def of(self, kind: str) -> List[Event]:
        return [e for e in self.events if e.kind == kind]


class SlotPool:
    """Free-list of slots of one tier (a fixed pool: the HOT pool is the decode graph's window)."""

    def __init__(self, n: int):
        if n < 0 or n > MAX_SLOT + 1:
            raise ValueError(f"pool of {n} slots does not fit {SLOT_BITS} bits")
        self.n = n
        self._free = list(range(n - 1, -1, -1))
        self._taken = set()             # O(1) checks: a pool may hold 65K slots

    def take(self) -> Optional[int]:
        if not self._free:
            return None
        slot = self._free.pop()
        self._taken.add(slot)
        return slot

    def give(self, slot: int):
        if slot not in self._taken:
            raise ValueError(f"slot {slot} is not taken")
        self._taken.remove(slot)
        self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)


class PageTable:
    """Page id -> 8-byte entry, with one slot pool per tier. The table itself is an array of
    uint64 (8 bytes per page); `nbytes` reports exactly that."""

    def __init__(self, page_size: int, capacity: Dict[int, int]):
        if page_size < 1:
            raise ValueError("page size must be >= 1")
        self.page_size = page_size
        self.pools = {int(t): SlotPool(n) for t, n in capacity.items()}
        self.entries: List[int] = []
        self.log = EventLog()
        self.step = 0

    # -- queries ---------------------------------------------------------------------------
    def __len__(self):
        return len(self.entries)

    def lookup(self, page: int) -> Tuple[int, int, int, int]:
        return unpack_entry(self.entries[page])

    def tier(self, page: int) -> int:
        return self.lookup(page)[0]

    def pages_in(self, tier: int) -> List[int]:
        return [p for p, e in enumerate(self.entries) if (e >> 61) & 7 == tier]

    def nbytes(self) -> int:
        return 8 * len(self.entries)

    def to_bytes(self) -> bytes:
        return struct.pack(f"<{len(self.entries)}Q", *self.entries)

    # -- changes ---------------------------------------------------------------------------
    def alloc(self, tier: int = Tier.HOT, pinned: bool = False) -> int:
        """A new page (the next P positions of the stream) in `tier`; returns its page id."""
        slot = self.pools[tier].take()
        if slot is None:
            raise MemoryError(f"tier {Tier(tier).name} is full ({self.pools[tier].n} slots)")
        page = len(self.entries)
        self.entries.append(pack_entry(tier, slot, page * self.page_size, PINNED if pinned else 0))
        self.log.add(Event(self.step, "alloc", page, -1, int(tier)))
        return page

    def prepare(self, page: int, dst: int) -> Tuple[int, int]:
        """Start moving `page` to tier `dst`: reserves a slot there and marks the page MOVING.
        Returns (src_tier, dst_slot). Raises if the page is pinned, moving, or dst is full."""
        tier, slot, off, flags = self.lookup(page)
        if tier == Tier.MOVING:
            raise ValueError(f"page {page} is already moving")
        if flags & PINNED and dst != tier:
            raise ValueError(f"page {page} is pinned in {Tier(tier).name}")
        if dst == tier:
            raise ValueError(f"page {page} is already in {Tier(tier).name}")
        dslot = self.pools[dst].take()
        if dslot is None:
            raise MemoryError(f"tier {Tier(dst).name} is full")
        self._moving = getattr(self, "_moving", {})
        self._moving[page] = (tier, slot, dst, dslot)
        self.entries[page] = pack_entry(Tier.MOVING, dslot, off, flags)
        return tier, dslot

    def complete(self, page: int, nbytes: int = 0, ok: bool = True):
        """Finish a move begun by prepare: on success the page lives in the new tier and its old
        slot is freed; on failure it stays where it was (never a half-moved page)."""
        src, sslot, dst, dslot = self._moving.pop(page)
        _, _, off, flags = unpack_entry(self.entries[page])
        if ok:
            self.pools[src].give(sslot)
            self.entries[page] = pack_entry(dst, dslot, off, flags)
            self.log.add(Event(self.step, "migrate", page, src, dst, nbytes))
        else:
            self.pools[dst].give(dslot)
            self.entries[page] = pack_entry(src, sslot, off, flags)
            self.log.add(Event(self.step, "migrate_failed", page, src, dst))

    def move(self, page: int, dst: int, nbytes: int = 0):
        self.prepare(page, dst)
        self.complete(page, nbytes)


class SlotWindow:
    """The HOT tier of one (layer, kv head) as the decode graph sees it: a fixed number of slots.

    Each step the retrieval names the pages to read; pages already in a slot are reused, missing
    ones are fetched into the slots of the coldest unneeded residents (ties: oldest first).
    `fetch_cap` bounds fetches a step (the scheduler's budget): beyond it, the best-ranked
    residents stand in. Returns what was read, fetched and evicted; integers only."""

    def __init__(self, n_slots: int, pinned: Iterable[int] = ()):
        self.pinned = list(dict.fromkeys(pinned))
        if len(self.pinned) > n_slots:
            raise ValueError("more pinned pages than slots")
        self.n_slots = n_slots
        self.resident: Dict[int, int] = {p: i for i, p in enumerate(self.pinned)}  # page -> slot
        self.last_used: Dict[int, int] = {p: 0 for p in self.pinned}
        self.step = 0
        self.fetched_total = 0

    def request(self, ranked: List[int], k: int, heat: Optional[Dict[int, float]] = None,
                fetch_cap: Optional[int] = None):
        """ranked: candidate pages best first (pinned excluded); k: pages to read besides the
        pinned ones. Returns (read, fetched, evicted) lists of page ids."""
        self.step += 1
        heat = heat or {}
        want = [p for p in ranked if p not in self.pinned][:k]
        have = [p for p in want if p in self.resident]
        missing = [p for p in want if p not in self.resident]
        cap = len(missing) if fetch_cap is None else max(0, min(fetch_cap, len(missing)))
        fetch = missing[:cap]
        read = have + fetch
        if len(read) < k:   # capped: best residents not yet read stand in for the missing pages
            rank = {p: i for i, p in enumerate(ranked)}
            extra = sorted((p for p in self.resident if p not in self.pinned and p not in read),
                           key=lambda p: rank.get(p, len(rank)))
            read += extra[: k - len(read)]
        keep = set(read) | set(self.pinned)
        victims = sorted((p for p in self.resident if p not in keep),
                         key=lambda p: (heat.get(p, 0.0), self.last_used.get(p, 0)))
        evicted = []
        free = self.n_slots - len(self.resident)
        for p in fetch:
            if free > 0:
                slot = len(self.resident)
                slots_used = set(self.resident.values())
                slot = next(i for i in range(self.n_slots) if i not in slots_used)
                free -= 1
            else:
                v = victims.pop(0)
                slot = self.resident.pop(v)
                self.last_used.pop(v, None)
                evicted.append(v)
            self.resident[p] = slot
        for p in read:
            self.last_used[p] = self.step
        self.fetched_total += len(fetch)
        return read, fetch, evicted
