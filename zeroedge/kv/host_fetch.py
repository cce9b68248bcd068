"""Page swaps whose cold pages the device cannot read: a cold store mapped from a file
(zeroedge.kv.tiers.FileTensors, `spill_dir`). A swap is three steps with static shapes:

1. decide (device): the greedy swap's decisions (kv.kernels.swap_decisions: the swap kernels with
   nothing moved), copied to pinned host memory;
2. read (host, once the device is done): the chosen pages' codes and scales from the store (the
   page cache, or the disk) into a pinned staging buffer;
3. apply (device, kv.kernels.apply_swaps): the staging buffer to the device, dequantized into the
   chosen slots; the page tables updated.

So a CUDA graph can hold the device steps: the decoder captures a refresh step as one graph per
layer's break (zeroedge.runtime.fast.Decoder), and the host reads between them.
"""
from __future__ import annotations

import functools
import time

import numpy as np
import torch


# A page read's µs (running mean) above which the store is taken as not in memory, so the pages are
# asked for first, and the one below which prefetching stops. On this project's CPU machine a page
# read from memory took ~1 µs, with the prefetch ~3.5, and from disk ~60 one after another, ~11 with
# the prefetch: a missed prefetch costs far more than a needless one.
PREFETCH_ON_US, PREFETCH_OFF_US = 10.0, 4.0
JUDGE_PAGES = 8


class HostFetch:
    FIELDS = ("k", "v", "ks", "vs")     # K codes, V codes, K scales, V scales: a token's record

    def __init__(self, nkv: int, fetch: int, store, bits: int, device):
        """store: the zeroedge.kv.tiers.FileTensors of the cold store, lead (layers, nkv, pages,
        page size), one record a token with the FIELDS."""
        pin = device.type == "cuda"
        self.fetch, self.bits = fetch, bits
        self.ps = store.records.shape[3]
        FP = 1 << max(0, (fetch - 1).bit_length())
        self.fields = [store.offsets[f] for f in self.FIELDS]
        self.stage = [torch.zeros(nkv, fetch, self.ps * store.tensors[f].shape[-1], dtype=store.tensors[f].dtype,
                                  pin_memory=pin) for f in self.FIELDS]
        self.dev_stage = [torch.zeros_like(s, device=device) for s in self.stage]
        self.decisions = torch.full((nkv, 3, FP), -1, dtype=torch.long, device=device)   # kernels.swap_decisions
        self.h_decisions = torch.full((nkv, 3, FP), -1, dtype=torch.long, pin_memory=pin)
        # numpy views, made once: the host's part runs on every layer of every refresh step
        self._np_decisions = self.h_decisions.numpy()
        self._np_stage = [s.numpy().view(np.uint8).reshape(nkv, fetch, self.ps, -1) for s in self.stage]
        self.page_bytes = self.ps * store.records.shape[4]
        self.reads = self.read_bytes = self.prefetches = 0
        self.read_s = 0.0
        self.us_per_page = 0.0         # running mean: when it is high the store is on disk, so prefetch
        self.prefetching = False
        self.can_prefetch = _libc() is not None    # off for good if the kernel refuses the advice

    def decide(self, pl, page_bias, page_slot, part=None):
        """pl (nkv, grp, n) page log-sum-exps (part: the sketch kernel's shares, as swap_pages takes
        them); page_slot (nkv, n) slot or -1. The decisions are copied to pinned host memory."""
        from zeroedge.kv.kernels import swap_decisions

        swap_decisions(pl, page_bias, page_slot, self.fetch, self.decisions, part=part)
        self.h_decisions.copy_(self.decisions, non_blocking=True)

    def read(self, records):
        """Host, after `decide` has finished on the device: the chosen pages into the staging buffer.
        records: one layer's (nkv, pages, page size, record bytes) uint8 (numpy). A page's records
        are one stretch of the file; while reads run slow (the store is not in memory), every chosen
        page is first asked of the disk at once (madvise WILLNEED), so they are read side by side,
        not one after another."""
        t0 = time.perf_counter()
        d = self._np_decisions
        h, j = np.nonzero(d[:, 1, :self.fetch] >= 0)
        if h.size:
            p = d[h, 0, j]
            self.prefetching = self.can_prefetch and self.us_per_page > (
                PREFETCH_OFF_US if self.prefetching else PREFETCH_ON_US)
            if self.prefetching:
                self.can_prefetch = _will_need(records, h, p)
                self.prefetches += 1
            t1 = time.perf_counter()
            got = records[h, p]                                   # (pages, page size, record bytes)
            for (o, b), st in zip(self.fields, self._np_stage):
                st[h, j] = got[:, :, o:o + b]
            # the copies' time a page; over at least JUDGE_PAGES, so the calls' fixed cost on a read of
            # one or two pages does not pass for a slow disk
            us = (time.perf_counter() - t1) * 1e6 / max(int(h.size), JUDGE_PAGES)
            self.us_per_page += 0.25 * (us - self.us_per_page)
            self.reads += int(h.size)
            self.read_bytes += int(h.size) * self.page_bytes
        self.read_s += time.perf_counter() - t0

    def apply(self, page_slot, slot_page, wk, wv):
        """The staged pages into their slots of wk / wv (nkv, S, PE) and the page tables updated
        (kernels.apply_swaps: static shapes on CUDA; rows not swapped are not touched)."""
        from zeroedge.kv.kernels import apply_swaps

        for d, s in zip(self.dev_stage, self.stage):
            d.copy_(s, non_blocking=True)
        apply_swaps(self.decisions, page_slot, slot_page, wk, wv, self.dev_stage, self.bits)


def _will_need(records, h, p) -> bool:
    """Ask the kernel to read pages (h, p) of records (nkv, pages, page size, record bytes) into the
    page cache now (madvise WILLNEED: asynchronous, so the reads of all of them overlap). False if
    it refused."""
    import ctypes
    import mmap

    libc = _libc()
    span = records.shape[2] * records.shape[3]
    for hh, pp in zip(h.tolist(), p.tolist()):
        start = records[hh, pp].ctypes.data
        first = start - start % mmap.PAGESIZE
        if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(start + span - first), mmap.MADV_WILLNEED):
            return False
    return True


@functools.lru_cache(maxsize=1)
def _libc():
    """The C library, for madvise (None where there is none, or no MADV_WILLNEED)."""
    import ctypes
    import ctypes.util
    import mmap

    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name and hasattr(mmap, "MADV_WILLNEED") else None
