"""Thermal KV in the batched engine: the decode rows of a long prompt read about `budget` of its KV.

    sketches = ThermalSketches(pool, cfg, budget=0.1, capacity=16)
    hot = sketches.build(pages, prompt_len)     # after the prompt's prefill; None: too short to gain
    ... Segment(pages, [tok], start, hot=hot) ...  # its decode rows attend through `tables`
    sketches.drop(hot)                          # with the sequence's pages

Each full page of the prompt gets the key sketch of zeroedge.kv.attention (a rank-`rank` basis of the
prompt's keys per layer and kv head, signed 4-bit codes, one fp16 scale a token), stored beside the
pool's K and V at the same slots. At every decode step, per layer and kv head, the step's own query
scores the prompt's pages through the sketch (the scoring of `zeroedge run`'s thermal window:
each query head's page log-sum-exps normalised over the pages, the best head of the group), and
attention reads the sink pages, the `slots` best-scoring pages and the tail: the prompt's last
`recent_pages` full pages, its partial page and every generated token. The choice is made afresh
each step from that step's query (lag 0), for every row alike, so a verify row reads what the
plain decode step at its position would.

Unlike `run`'s thermal window, every page stays in the pool: this saves the bandwidth a step reads
(the attention reads a `budget` share of a long prompt), not device memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch

from zeroedge.kv.paged_attention import HOT_MAX_PAGES, paged_hot_tables, paged_sketch_lse
from zeroedge.kv.policy import ThermalSettings, thermal_settings, window_pages


@dataclass(frozen=True)
class Hot:
    """A sequence whose decode rows read the sketch's choice of its prompt pages."""
    sketch: int          # its row of ThermalSketches.bases
    scored: int          # prompt pages scored: its pages sink_pages .. sink_pages + scored - 1
    slots: int           # of them, read each step
    tail: int            # its first page always read from there on (the recent pages, then the rest)


@dataclass
class HotRows:
    """A decode group's rows as the tables are made from them, device tensors (B rows):
    sketch (B,) long, scored_pages (B, N) int32 (the scratch page past each row's scored count),
    n_scored / n_slots (B,) long, tail_pages (B, T) int32, lens (B,) int32 (the positions a row reads:
    its chosen pages' and its tail's), slots_max: the top-k taken (at least every row's slots, at most N)."""
    sketch: torch.Tensor
    scored_pages: torch.Tensor
    n_scored: torch.Tensor
    n_slots: torch.Tensor
    tail_pages: torch.Tensor
    lens: torch.Tensor
    slots_max: int


SKETCH_GROUP_BYTES = 64 << 20     # keys gathered at once while a prompt's sketches are made


def _pow2_at_least(n: int, low: int = 1) -> int:
    return max(low, 1 << max(0, n - 1).bit_length())


class ThermalSketches:
    """The key sketches of a pool's hot sequences (see the module doc). capacity: sequences with a
    sketch at once (the engine's max batch); the last row of `bases` stays zero for the rows of
    sequences without one. triton: score pages in zeroedge.kv.paged_attention's kernel (default on
    CUDA; True elsewhere runs it in Triton's interpreter), else in torch."""

    def __init__(self, pool, cfg, budget: float, capacity: int, settings: Optional[ThermalSettings] = None,
                 triton: Optional[bool] = None):
        if not 0 < budget < 1:
            raise ValueError("a thermal KV budget is a fraction in (0, 1)")
        self.s = settings or thermal_settings(pool.page_size)
        if self.s.page_size != pool.page_size:
            raise ValueError(f"the sketch's pages ({self.s.page_size}) must be the pool's ({pool.page_size})")
        self.pool, self.budget = pool, budget
        self.triton = pool.k.is_cuda if triton is None else triton     # the scoring kernel, or torch
        self.L, self.nkv, self.hd, self.H = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.n_heads
        self.rank = min(self.s.rank, self.hd)
        if self.rank % 2:
            raise ValueError("the sketch's rank must be even (codes are packed two a byte)")
        dev, slots = pool.k.device, (pool.n_pages + 1) * pool.page_size
        # kv head first: a page's codes and scales are one run for each kv head (the scoring reads them so)
        self._codes = torch.zeros(self.L, self.nkv, slots, self.rank // 2, dtype=torch.uint8, device=dev)
        self._scales = torch.zeros(self.L, self.nkv, slots, dtype=torch.float16, device=dev)
        self.bases = torch.zeros(capacity + 1, self.L, self.nkv, self.hd, self.rank, device=dev)
        self.none = capacity
        self._free = list(range(capacity - 1, -1, -1))

    def in_use(self) -> int:
        return self.none - len(self._free)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._codes, self._scales, self.bases))

    def codes(self, li: int) -> torch.Tensor:
        """Layer li's sketch codes: (nkv, slots, rank / 2)."""
        return self._codes[li]

    def scales(self, li: int) -> torch.Tensor:
        """Layer li's sketch scales: (nkv, slots)."""
        return self._scales[li]

    def shape_for(self, prompt_len: int) -> Optional[tuple]:
        """(scored pages, slots) for a prompt of prompt_len tokens, or None when its budget share would
        not exceed the pages always read (the sink and recent pages): no gain."""
        ps, full = self.pool.page_size, prompt_len // self.pool.page_size
        fixed = self.s.sink_pages + self.s.recent_pages
        if int(round(self.budget * full * ps)) // ps <= fixed:
            return None
        _, slots = window_pages(full * ps, self.budget, self.s)
        return full - fixed, slots

    def min_prompt(self) -> int:
        """The shortest prompt that takes a sketch (shorter ones read all of their KV)."""
        ps, fixed = self.pool.page_size, self.s.sink_pages + self.s.recent_pages
        n = max(1, int(((fixed + 1) * ps - 0.5) / (self.budget * ps)) - 1)
        while self.shape_for(n * ps) is None:
            n += 1
        return n * ps

    def build(self, pages: List[int], prompt_len: int) -> Optional[Hot]:
        """The sketch of a prefilled prompt's full pages -> its Hot, or None (too short, or no free row:
        the sequence then reads all of its KV)."""
        from zeroedge.kv.attention import quantized_sketch

        shape = self.shape_for(prompt_len)
        if shape is None or not self._free:
            return None
        sid, ps = self._free.pop(), self.pool.page_size
        n = prompt_len // ps * ps
        slot = torch.tensor(self.pool.slots(pages, 0, n), device=self.bases.device)
        K = self.pool.k
        # layers a group, their keys gathered together (~SKETCH_GROUP_BYTES): one eigh for the group
        group = max(1, SKETCH_GROUP_BYTES // (n * self.nkv * self.hd * K.element_size()))
        with torch.no_grad():
            for l0 in range(0, self.L, group):
                ls = range(l0, min(self.L, l0 + group))
                k = torch.stack([K[li].index_select(0, slot) for li in ls]).permute(0, 2, 1, 3)   # (G, nkv, n, hd)
                G = len(ls)
                codes = torch.empty(G * self.nkv, n, self.rank // 2, dtype=torch.uint8, device=slot.device)
                scales = torch.empty(G * self.nkv, n, dtype=torch.float16, device=slot.device)
                A = quantized_sketch(k.reshape(G * self.nkv, n, self.hd), self.rank, self.s.bits, out=(codes, scales))[0]
                self.bases[sid, l0:l0 + G] = A.view(G, self.nkv, self.hd, self.rank) / math.sqrt(self.hd)
                for i, li in enumerate(ls):
                    self._codes[li].index_copy_(1, slot, codes.view(G, self.nkv, n, -1)[i])
                    self._scales[li].index_copy_(1, slot, scales.view(G, self.nkv, n)[i])
                del k, codes, scales
        scored, slots = shape
        return Hot(sid, scored, slots, self.s.sink_pages + scored)

    def drop(self, hot: Optional[Hot]) -> None:
        if hot is not None:
            self.bases[hot.sketch].zero_()
            self._free.append(hot.sketch)

    def rows(self, rows) -> dict:
        """rows [(pages, length, Hot or None)] -> host arrays of HotRows (numpy), their widths rounded up
        to powers of two (a captured step's graph serves every batch of the same widths)."""
        import numpy as np

        ps, scratch, sink = self.pool.page_size, self.pool.scratch, self.s.sink_pages
        B = len(rows)
        N = _pow2_at_least(max((h.scored for _, _, h in rows if h), default=1), 16)
        T = _pow2_at_least(max(-(-n // ps) - (h.tail - sink if h else 0) for _, n, h in rows), 16)   # tail pages
        out = {"sketch": np.full(B, self.none, np.int64), "scored_pages": np.full((B, N), scratch, np.int32),
               "n_scored": np.zeros(B, np.int64), "n_slots": np.zeros(B, np.int64),
               "tail_pages": np.full((B, T), scratch, np.int32), "lens": np.zeros(B, np.int32)}
        for j, (pages, n, h) in enumerate(rows):
            k = -(-n // ps)
            if h is None:                   # every page: the rows of sequences without a sketch
                out["tail_pages"][j, :k] = pages[:k]
                out["lens"][j] = n
                continue
            out["sketch"][j], out["n_scored"][j], out["n_slots"][j] = h.sketch, h.scored, h.slots
            out["scored_pages"][j, :h.scored] = pages[sink:sink + h.scored]
            read = list(pages[:sink]) + list(pages[h.tail:k])     # the sink pages, then the tail
            out["tail_pages"][j, :len(read)] = read
            out["lens"][j] = h.slots * ps + n - (h.tail - sink) * ps
        return out

    def slots_max(self, host: dict) -> int:
        """The top-k of `rows`' arrays: a function of their scored width N alone (so a captured step's
        key is its widths), at least every row's slots (a row of `full` prompt pages, N >= full - fixed,
        chooses at most budget * full - fixed + 1 <= budget * N + 1 of them), at most N."""
        N = host["scored_pages"].shape[1]
        k = min(N, _pow2_at_least(math.ceil(self.budget * N) + 1))
        if int(host["n_slots"].max()) > k:
            raise AssertionError("thermal KV: a row chooses more pages than its table holds")
        return k

    def device_rows(self, host: dict) -> HotRows:
        """HotRows on the pool's device from `rows`' host arrays."""
        dev = self.bases.device
        return HotRows(**{k: torch.from_numpy(a).to(dev) for k, a in host.items()}, slots_max=self.slots_max(host))

    def page_scores(self, li: int, q: torch.Tensor, r: HotRows) -> torch.Tensor:
        """q (B, H, hd) after RoPE -> (B, nkv, N) each scored page's score (-inf past a row's pages)."""
        B, N = r.scored_pages.shape
        grp = self.H // self.nkv
        qr = torch.einsum("bkgd,bkdr->bkgr", q.view(B, self.nkv, grp, self.hd).float(), self.bases[r.sketch, li])
        lse = paged_sketch_lse(qr, self.codes(li), self.scales(li), r.scored_pages, self.pool.page_size,
                               triton=self.triton)
        valid = (torch.arange(N, device=q.device)[None, :] < r.n_scored[:, None])[:, None, None, :]
        lse = lse.masked_fill(~valid, float("-inf"))
        norm = lse - lse.logsumexp(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
        return norm.amax(2).masked_fill(~valid[:, :, 0], float("-inf"))

    def tables(self, li: int, q: torch.Tensor, r: HotRows) -> tuple:
        """-> (pages (B, nkv, slots_max + T) int32: each row and kv head's chosen pages, then its tail
        (the order of pages does not matter to attention), lens (B,) int32: the positions read)."""
        B, T = r.tail_pages.shape
        K = r.slots_max
        if self.triton and r.scored_pages.shape[1] <= HOT_MAX_PAGES:      # one kernel
            pages = paged_hot_tables(q.contiguous(), self.bases[:, li], r.sketch, self.codes(li), self.scales(li),
                                     r.scored_pages, r.n_scored, r.n_slots, r.tail_pages, K, self.pool.page_size)
            return pages, r.lens
        top = self.page_scores(li, q, r).topk(K, -1).indices                        # best first
        chosen = r.scored_pages.long().gather(1, top.view(B, -1)).view(B, self.nkv, K)
        j = torch.arange(K + T, device=q.device)[None, :]
        n = r.n_slots[:, None]
        tail = r.tail_pages.long().gather(1, (j - n).clamp(0, T - 1))[:, None]       # (B, 1, K + T)
        pick = chosen.gather(2, j.clamp(max=K - 1).expand(B, -1)[:, None].expand(-1, self.nkv, -1))
        pages = torch.where((j < n)[:, None], pick, tail).to(torch.int32)
        return pages.contiguous(), r.lens
