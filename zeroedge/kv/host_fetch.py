"""Page swaps whose cold pages the device cannot read: a cold store mapped from a file
(zeroedge.kv.tiers.FileTensors, `spill_dir`). A swap is three steps with static shapes:

1. decide (device): per kv head the `fetch` best missing pages and the `fetch` worst resident ones,
   pair i swapped while the missing page scores higher (what the greedy swap does: kv.kernels);
   the decisions are copied to pinned host memory;
2. read (host, once the device is done): the chosen pages' codes and scales from the store (the
   page cache, or the disk) into a pinned staging buffer;
3. apply (device): the staging buffer to the device, dequantized into the chosen slots; the page
   tables updated.

So a CUDA graph can hold the device steps: the decoder captures a refresh step as one graph per
layer's break (zeroedge.runtime.fast.Decoder), and the host reads between them.
"""
from __future__ import annotations

import time

import numpy as np
import torch


class HostFetch:
    def __init__(self, nkv: int, fetch: int, stores, bits: int, group: int, device):
        """stores: one layer's (K codes, V codes, K scales, V scales), each (nkv, n, ...) per page."""
        pin = device.type == "cuda"
        self.fetch, self.bits, self.group = fetch, bits, group
        self.stage = [torch.zeros(nkv, fetch, *s.shape[2:], dtype=s.dtype, pin_memory=pin) for s in stores]
        self.dev_stage = [torch.zeros_like(s, device=device) for s in self.stage]
        self.h_page = torch.zeros(nkv, fetch, dtype=torch.long, pin_memory=pin)
        self.h_do = torch.zeros(nkv, fetch, dtype=torch.bool, pin_memory=pin)
        z = lambda t: torch.zeros(nkv, fetch, dtype=t, device=device)  # noqa: E731
        self.page, self.out, self.slot, self.do = z(torch.long), z(torch.long), z(torch.long), z(torch.bool)
        self.heads = torch.arange(nkv, device=device)[:, None].expand(nkv, fetch)
        self.page_bytes = sum(s[0, 0].numel() * s.element_size() for s in self.stage)   # a page's, all four
        self.reads = self.read_bytes = 0
        self.read_s = 0.0

    def decide(self, pl, page_bias, page_slot):
        """pl (nkv, grp, n) page log-sum-exps; page_slot (nkv, n) slot or -1."""
        from zeroedge.kv.kernels import page_scores_ref

        score = page_scores_ref(pl, page_bias)
        inf = torch.full((), float("inf"), device=score.device)
        vm, bm = torch.where(page_slot < 0, score, -inf).topk(self.fetch, dim=1)
        vr, wr = torch.where(page_slot >= 0, score, inf).topk(self.fetch, dim=1, largest=False)
        self.page.copy_(bm)
        self.out.copy_(wr)
        self.slot.copy_(page_slot.gather(1, wr))
        self.do.copy_(vm > vr)
        self.h_page.copy_(bm, non_blocking=True)
        self.h_do.copy_(self.do, non_blocking=True)

    def read(self, stores):
        """Host, after `decide` has finished on the device: the chosen pages into the staging buffer."""
        t0 = time.perf_counter()
        h, j = np.nonzero(self.h_do.numpy())         # numpy: a quarter of torch's indexing overhead here
        if h.size:
            p = self.h_page.numpy()[h, j]
            for src, st in zip(stores, self.stage):
                st.numpy()[h, j] = src.numpy()[h, p]
            self.reads += int(h.size)
            self.read_bytes += int(h.size) * self.page_bytes
        self.read_s += time.perf_counter() - t0

    def apply(self, page_slot, slot_page, wk, wv):
        """The staged pages into their slots of wk / wv (nkv, S, PE) and the page tables updated (rows
        not swapped keep what they hold: static shapes)."""
        from zeroedge.kv.tiers import dequantize

        for d, s in zip(self.dev_stage, self.stage):
            d.copy_(s, non_blocking=True)
        kc, vc, ks, vs = self.dev_stage
        nkv, F = self.do.shape
        h, slot, do = self.heads, self.slot, self.do
        for w, c, s in ((wk, kc, ks), (wv, vc, vs)):
            new = dequantize(c.view(nkv, F, -1), s.view(nkv, F, -1), self.bits, self.group, w.dtype)
            w[h, slot] = torch.where(do[..., None], new, w[h, slot])
        came, left = page_slot.gather(1, self.page), page_slot.gather(1, self.out)
        page_slot.scatter_(1, self.page, torch.where(do, slot, came))   # a page not swapped keeps its entry
        page_slot.scatter_(1, self.out, torch.where(do, -1, left))      # (written last: an evicted page)
        slot_page.scatter_(1, slot, torch.where(do, self.page, slot_page.gather(1, slot)))
