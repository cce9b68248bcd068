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

import time

import numpy as np
import torch


class HostFetch:
    def __init__(self, nkv: int, fetch: int, stores, bits: int, device):
        """stores: one layer's (K codes, V codes, K scales, V scales), each (nkv, n, ...) per page."""
        pin = device.type == "cuda"
        self.fetch, self.bits = fetch, bits
        FP = 1 << max(0, (fetch - 1).bit_length())
        self.stage = [torch.zeros(nkv, fetch, *s.shape[2:], dtype=s.dtype, pin_memory=pin) for s in stores]
        self.dev_stage = [torch.zeros_like(s, device=device) for s in self.stage]
        self.decisions = torch.full((nkv, 3, FP), -1, dtype=torch.long, device=device)   # kernels.swap_decisions
        self.h_decisions = torch.full((nkv, 3, FP), -1, dtype=torch.long, pin_memory=pin)
        # numpy views, made once: the host's part runs on every layer of every refresh step
        self._np_decisions = self.h_decisions.numpy()
        self._np_stage = [s.numpy() for s in self.stage]
        self.page_bytes = sum(s[0, 0].numel() * s.element_size() for s in self.stage)   # a page's, all four
        self.reads = self.read_bytes = 0
        self.read_s = 0.0

    def decide(self, pl, page_bias, page_slot, part=None):
        """pl (nkv, grp, n) page log-sum-exps (part: the sketch kernel's shares, as swap_pages takes
        them); page_slot (nkv, n) slot or -1. The decisions are copied to pinned host memory."""
        from zeroedge.kv.kernels import swap_decisions

        swap_decisions(pl, page_bias, page_slot, self.fetch, self.decisions, part=part)
        self.h_decisions.copy_(self.decisions, non_blocking=True)

    def read(self, stores):
        """Host, after `decide` has finished on the device: the chosen pages into the staging buffer.
        stores: one layer's four, as numpy arrays (or CPU tensors)."""
        t0 = time.perf_counter()
        d = self._np_decisions
        h, j = np.nonzero(d[:, 1, :self.fetch] >= 0)
        if h.size:
            p = d[h, 0, j]
            for src, st in zip(stores, self._np_stage):
                st[h, j] = (src if isinstance(src, np.ndarray) else src.numpy())[h, p]
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
