"""Thermal KV for the onnxruntime runner: pages of P positions over the runner's fixed-slot window.

The exported decode graph reads `slots` KV slots (keys are stored after RoPE, so any slot can hold
any position) and reports the attention mass every slot received. `OrtThermalPolicy` plugs into
`OrtRunner(policy=...)` and decides what the window holds, with zeroedge.kv's torch-free
bookkeeping (numpy only):

- the window is cut into `slots // P` blocks of P slots; a HOT page lives in one block (its
  PageTable entry's slot is the block index). The pages covering the runner's `sinks` positions
  are pinned; the page being written and the `recent` pages before it are never victims.
- worth of a page, with a decode graph that outputs its queries (attn_query, bundles exported
  since it was added): the attention mass the step's queries would give the page if every page were
  in the window, estimated from the page's mean key (per layer and kv head: softmax over pages of
  q . mean key / sqrt(hd) + log(tokens in the page), averaged over layers and query heads). It ranks
  every page, in the window or not, and serves the next step (one step late: the graph attends
  before the runner sees the query). SmolLM2, 4096 tokens, 10 % hot, essays: +2.9 % perplexity
  against +13.7 % with the proxy below (benchmarks/thermal_kv.md).
- without queries (older bundles): heat (HeatTracker, t^-0.7) = the decode graph's mass on its slots
  (mean over layers), weighted by the cosine of the page's mean key to the mean of the last
  `cos_window` new keys (the new tokens' keys stand in for the queries; per layer and kv head,
  averaged). Prefill mass is divided by the prompt length so it is on the scale of a step.
- a new page that finds no free block demotes the least worth unprotected HOT page to the store;
  after each step `plan_migration` swaps stored pages back when their worth beats the least HOT
  page's (heat: by more than `threshold`), at most `fetch` swaps a step (the fetch budget).
- the store keeps pages int8 with one fp16 scale per group of the head dim (Tier.WARM8; the
  scheme of zeroedge.kv.tiers, in numpy), or exact fp32 copies (`store="fp32"`, Tier.COLD).
  Every move goes through PageTable.prepare / complete, so its event log counts each page
  migrated; `migrated` is per request (reset at prefill). A full HOT page keeps its packed arrays
  (packed at prefill, or as fetched back: a full page's K/V never change), so demoting it packs
  nothing; only pages written while decoding are packed when they first leave.
- the file tier (`spill_dir`, Tier.FILE; NVMe on a Jetson): when the store holds more than
  `store_pages` pages, the coldest go, in the store's own bytes, to a zeroedge.kv.spill.PageFile
  there, and a page fetched back is read from it straight into the window. A write the disk
  refuses (full) leaves the page in the store (counted in `spill_failed`): nothing is lost. The
  HOT pages' packed copies stay in memory (at most one a window page, `copy_bytes`).

A page here is P positions of every layer and kv head together: the runner's window is shared by
all of them (the torch ThermalDecoder pages one (layer, kv head) stream at a time).
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Dict

import numpy as np

from zeroedge.errors import UserError
from zeroedge.kv.heat import DEFAULT_THRESHOLD, HeatTracker, plan_migration
from zeroedge.kv.pages import PINNED, PageTable, Tier


PAGE_SIZE = 16             # positions a page, unless the caller says (`zeroedge run --page-size`)
SPILL_RETRY_STEPS = 64     # a refused file write: decode steps before the file tier is tried again
PREFILL_PACK = 4           # pages packed at once at prefill (cache-sized: 64 ran 1.5x slower)


def quantize(x: np.ndarray, group: int):
    """Symmetric int8, one fp16 scale per `group` values of the last dim."""
    *lead, d = x.shape
    g = x.reshape(*lead, d // group, group).astype(np.float32)
    scale = (np.abs(g).max(-1, keepdims=True) / 127.0).astype(np.float16)
    s32 = scale.astype(np.float32)
    q = np.clip(np.round(g / np.where(s32 > 0, s32, 1.0)), -127, 127).astype(np.int8)
    return q.reshape(x.shape), scale[..., 0]


def dequantize(q: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    *lead, d = q.shape
    g = q.reshape(*lead, d // group, group).astype(np.float32) * scale.astype(np.float32)[..., None]
    return g.reshape(q.shape)


class OrtThermalPolicy:
    def __init__(self, page_size: int = PAGE_SIZE, store: str = "int8", threshold: float = DEFAULT_THRESHOLD,
                 recent_pages: int = 1, fetch: int = 2, cos_window: int = 8, max_pages: int = 1 << 16,
                 spill_dir=None, store_pages: int = 0):
        if not isinstance(page_size, int) or page_size < 1:
            raise UserError(f"page size must be a positive integer (got {page_size!r})")
        if store not in ("int8", "fp32"):
            raise UserError(f"store must be int8 or fp32 (got {store!r})")
        if threshold < 0 or fetch < 0 or recent_pages < 0 or cos_window < 1:
            raise UserError("threshold, fetch and recent_pages must be >= 0, cos_window >= 1")
        if not isinstance(store_pages, int) or store_pages < 0:
            raise UserError(f"store_pages must be an integer >= 0 (got {store_pages!r})")
        self.spill_dir, self.store_pages = spill_dir, store_pages
        self.file = None
        self.P, self.store_kind, self.threshold = page_size, store, float(threshold)
        self.recent, self.fetch, self.cos_window, self.max_pages = recent_pages, fetch, cos_window, max_pages
        self.store_tier = Tier.WARM8 if store == "int8" else Tier.COLD
        self.table = None

    def window_pages(self, sinks: int, budget: float, prompt: int, new: int) -> int:
        """Pages of the runner's window for a request under `--kv-budget budget`: that share of the
        prompt (whole pages) and the new tokens' pages, the memory the torch decoder holds; at least
        the sink pages, the page being written, the recent pages and one more."""
        n_sink = -(-sinks // self.P) if sinks > 0 else 0
        return max(math.ceil(budget * prompt / self.P) + math.ceil(new / self.P), n_sink + self.recent + 2)

    # -- request lifetime ----------------------------------------------------------------------
    def reset(self, runner):
        """Called by the runner's reset (WindowRunner.reset: construction and every prefill): checks
        the window shape before any work and starts a fresh page table, heat and store."""
        P, S = self.P, runner.slots
        if S % P:
            raise UserError(f"page size {P} does not divide the window ({S} slots)")
        self.blocks = S // P
        self.n_sink = -(-runner.sinks // P) if runner.sinks > 0 else 0
        need = self.n_sink + self.recent + 2
        if self.blocks < need:
            raise UserError(f"a window of {S} slots holds {self.blocks} pages of {P}: thermal KV needs "
                            f"at least {need} (sink pages, the page being written, {self.recent} "
                            "recent, one more)")
        self.L, self.nkv, self.hd = runner.L, runner.nkv, runner.hd
        self.group = 32 if self.hd % 32 == 0 else self.hd
        self.table = PageTable(P, {Tier.HOT: self.blocks, self.store_tier: self.max_pages,
                                   Tier.FILE: self.max_pages})
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.spill_dir is not None:
            from zeroedge.kv.spill import PageFile

            self.file = PageFile(self.spill_dir, self.page_bytes(), reserve_pages=1)   # grows by doubling
        self.spilled = self.spill_failed = self.file_reads = self.file_read_failed = 0
        self.file_read_s = 0.0
        self.spill_retry_at = 0             # after a refused write: the step the file is tried again
        self.heat = HeatTracker()
        self.store: Dict[int, tuple] = {}
        self.copies: Dict[int, tuple] = {}   # HOT page -> its packed arrays (the store's form)
        self.kmean = np.zeros((self.L * self.nkv, 64, self.hd), np.float32)  # each page's mean key
        self.kcount = np.zeros(64, np.int64)
        self.recent_keys = deque(maxlen=self.cos_window)
        self.migrated = self.promoted = self.demoted = self.steps = 0
        self.worth = None                   # each page's worth to the last step's queries, once known
        self.stored_at_prefill = 0
        self._new_key = None

    def _grow(self, n):
        if n > len(self.kcount):
            m, had = max(n, 2 * len(self.kcount)), len(self.kcount)
            km = np.zeros((self.kmean.shape[0], m, self.hd), np.float32)
            km[:, :had] = self.kmean
            kc = np.zeros(m, np.int64)
            kc[:had] = self.kcount
            self.kmean, self.kcount = km, kc

    # -- store -------------------------------------------------------------------------------
    def page_bytes(self) -> int:
        n = 2 * self.L * self.nkv * self.P * self.hd
        return n + (n // self.group) * 2 if self.store_kind == "int8" else 4 * n

    def _pack(self, k, v):
        if self.store_kind == "fp32":               # exact: a float16 window's V widens losslessly
            return (k.astype(np.float32), v.astype(np.float32))
        return quantize(k, self.group) + quantize(v, self.group)

    def _unpack(self, item):
        if self.store_kind == "fp32":
            return item
        kq, ks, vq, vs = item
        return dequantize(kq, ks, self.group), dequantize(vq, vs, self.group)

    def _layout(self):
        """(dtype, shape) of each array of a stored page, in _pack's order."""
        kv = (self.L, self.nkv, self.P, self.hd)
        if self.store_kind == "fp32":
            return [(np.float32, kv)] * 2
        return [(np.int8, kv), (np.float16, kv[:-1] + (self.hd // self.group,))] * 2

    def _to_bytes(self, item) -> np.ndarray:
        return np.concatenate([np.ascontiguousarray(a).view(np.uint8).reshape(-1) for a in item])

    def _from_bytes(self, raw: np.ndarray) -> tuple:
        out, at = [], 0
        for dtype, shape in self._layout():
            n = int(np.prod(shape)) * np.dtype(dtype).itemsize
            out.append(raw[at:at + n].view(dtype).reshape(shape))
            at += n
        return tuple(out)

    def _block_kv(self, runner, block):
        sl = slice(block * self.P, (block + 1) * self.P)
        return (np.stack([runner.k[i][0, :, sl] for i in range(self.L)]),
                np.stack([runner.v[i][0, :, sl] for i in range(self.L)]))

    # -- hooks called by the runner (WindowRunner) ---------------------------------------------
    def prefill(self, runner, kv, mass, T: int):
        """Fill the window from the prefill graph's K/V (all T positions): sink pages, the last
        (partial) page and its recent pages, then the pages that received the most mass; the
        rest go straight to the store. Every full page is packed once, PREFILL_PACK at a time."""
        P, L, nkv, hd = self.P, self.L, self.nkv, self.hd
        n, full = -(-T // P), T // P
        m = np.asarray(mass)[0].mean(0) / T                      # (T,) per query, over layers
        pm = np.bincount(np.arange(T) // P, weights=m, minlength=n)     # (n,) each page's mass
        tail = n - 1
        keep = set(range(min(self.n_sink, n))) | set(range(max(0, tail - self.recent), n))
        rest = [p for p in np.argsort(-pm, kind="stable").tolist() if p not in keep]
        keep |= set(rest[: self.blocks - len(keep)])
        self._grow(n + self.blocks)                  # room for the new tokens' pages: no copy mid-request
        self.kcount[:n] = P
        self.kcount[n - 1] = T - (n - 1) * P
        for i in range(L):                                        # mean keys, a layer at a time
            k = kv[2 * i][0]                                      # (nkv, T, hd)
            rows = slice(i * nkv, (i + 1) * nkv)
            self.kmean[rows, :full] = k[:, :full * P].reshape(nkv, full, P, hd).mean(2)
            if full < n:
                self.kmean[rows, full] = k[:, full * P:].mean(1)
        for p in range(n):                                        # page ids are allocated in order
            self.table.alloc(Tier.HOT if p in keep else self.store_tier, pinned=p < self.n_sink)
        for p in sorted(keep):
            lo, hi = p * P, min(T, (p + 1) * P)
            b = self.table.lookup(p)[1]
            for i in range(L):
                runner.k[i][0, :, b * P:b * P + hi - lo] = kv[2 * i][0, :, lo:hi]
                runner.v[i][0, :, b * P:b * P + hi - lo] = kv[2 * i + 1][0, :, lo:hi]
            runner.slot_pos[0, b * P:b * P + hi - lo] = np.arange(lo, hi)
            runner.heat[b * P:b * P + hi - lo] = m[lo:hi]
        # every full page packed once: the stored ones go to the store, the HOT ones keep their arrays
        # for their demotion (the tail page is partial and stays HOT)
        for at in range(0, full, PREFILL_PACK):
            c = min(PREFILL_PACK, full - at)
            k, v = (np.ascontiguousarray(np.stack(
                [kv[2 * i + j][0, :, at * P:(at + c) * P].reshape(nkv, c, P, hd) for i in range(L)]
            ).transpose(2, 0, 1, 3, 4)) for j in (0, 1))                  # (pages, L, nkv, P, hd)
            packed = self._pack(k, v)
            for p in range(at, at + c):
                item = tuple(a[p - at] for a in packed)
                if p in keep:
                    self.copies[p] = item
                else:
                    self.store[self.table.lookup(p)[1]] = item
        stored = [p for p in range(n) if p not in keep]
        self.stored_at_prefill = len(stored)
        self.heat.step(dict(enumerate(pm.tolist())))
        self._spill()

    def slot_for(self, runner, out) -> int:
        """After a decode graph run: record heat, then the slot the new token goes to."""
        self.steps += 1
        self.table.step = self.steps
        P = self.P
        new_k = np.stack([out[1 + 2 * i][0, :, 0] for i in range(self.L)]).reshape(-1, self.hd)
        self._new_key = new_k
        query = getattr(runner, "last_query", None)
        if query is not None:
            self.worth = self._query_worth(np.asarray(query, np.float32)[0])
        else:
            mass = np.asarray(out[-1])[0].mean(0)                     # (S,)
            masses = {p: float(mass[self.table.lookup(p)[1] * P:(self.table.lookup(p)[1] + 1) * P].sum())
                      for p in self.table.pages_in(Tier.HOT)}
            self.recent_keys.append(new_k)
            self.heat.step(masses, self._cosines())
        pos = runner.pos
        page, off = divmod(pos, P)
        if off == 0 or page == len(self.table):
            if page != len(self.table):
                raise RuntimeError(f"position {pos} starts page {page}, the table has {len(self.table)}")
            if self.table.pools[Tier.HOT].free == 0:
                self._demote(runner, self._victim(page))
            self.table.alloc(Tier.HOT)
            self._grow(page + 1)
        tier, block, _, _ = self.table.lookup(page)
        if tier != Tier.HOT:
            raise RuntimeError(f"page {page} being written is not HOT")
        return block * P + off

    def after_step(self, runner):
        """The new token is in its slot: update its page's mean key, then migrate."""
        page = (runner.pos - 1) // self.P
        c = self.kcount[page]
        self.kmean[:, page] += (self._new_key - self.kmean[:, page]) / (c + 1)
        self.kcount[page] = c + 1
        self._migrate(runner, page)

    # -- decisions ---------------------------------------------------------------------------
    def _query_worth(self, query) -> np.ndarray:
        """(pages,) the mass the queries (L, H, hd) would give each page, from its mean key (the
        module docstring); a pruned head's zero query takes no part. One batched matrix product
        over the pages: O(pages) a step in BLAS, not in Python. The product runs as mean keys ×
        queries (each page's keys read in their row order: ~1/3 faster at 8K pages than queries ×
        mean keys^T, the same sums), then turns to (heads, pages) for the softmax."""
        n = len(self.table)
        q = query.reshape(self.L * self.nkv, -1, self.hd)                        # (L nkv, g, hd)
        live = (np.abs(q).sum(-1) > 0).reshape(-1)                               # (L nkv g,)
        if not live.any():
            return np.zeros(n)
        s = np.matmul(self.kmean[:, :n], np.ascontiguousarray(q.transpose(0, 2, 1)))   # (L nkv, n, g)
        s = np.ascontiguousarray(s.transpose(0, 2, 1)).reshape(len(live), n)
        if not live.all():
            s = s[live]                                                          # (live heads, n)
        s *= 1.0 / math.sqrt(self.hd)
        s += np.log(np.maximum(self.kcount[:n], 1)).astype(np.float32)
        s -= s.max(-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(-1, keepdims=True)
        return s.mean(0)

    def _tiers(self):
        """(tier, pinned) of every page, as arrays decoded from the table's entries (kv.pages layout)."""
        e = np.array(self.table.entries, np.uint64)
        return (e >> np.uint64(61)) & np.uint64(7), ((e >> np.uint64(56)) & np.uint64(PINNED)) != 0

    def _pages(self, *tiers: int) -> np.ndarray:
        """Ascending ids of the pages in any of `tiers`."""
        return np.flatnonzero(np.isin(self._tiers()[0], np.array(tiers, np.uint64)))

    def _worth_of(self, pages: np.ndarray) -> np.ndarray:
        """Worth of `pages`: the last queries' (a page newer than them counts as most worth), else heat."""
        if self.worth is None:
            return np.array([self.heat.heat(p) for p in pages.tolist()], np.float64)
        w = np.full(len(pages), np.inf)
        known = pages < len(self.worth)
        w[known] = self.worth[pages[known]]
        return w

    def _cosines(self) -> Dict[int, float]:
        n = len(self.table)
        if n == 0:
            return {}
        q = np.mean(np.stack(self.recent_keys), 0)                                # (LH, hd)
        km = self.kmean[:, :n]                                                    # (LH, n, hd)
        num = (km * q[:, None]).sum(-1)
        den = np.linalg.norm(km, axis=-1) * np.linalg.norm(q, axis=-1)[:, None] + 1e-12
        c = (num / den).mean(0)
        return {p: float(c[p]) for p in range(n)}

    def _movable(self, tail: int) -> np.ndarray:
        """HOT pages that may leave: not pinned, not the page being written nor its recent ones."""
        tier, pinned = self._tiers()
        return np.flatnonzero((tier == Tier.HOT) & ~pinned & (np.arange(len(tier)) < tail - self.recent))

    def _victim(self, new_page: int) -> int:
        cands = self._movable(new_page)
        if not len(cands):
            raise RuntimeError("no HOT page may leave the window")
        return int(cands[np.argmin(self._worth_of(cands))])      # the least worth; ties: the oldest

    def _demote(self, runner, page: int):
        """A HOT page to the store: its packed copy when it has one, else packed from the window."""
        _, block, _, _ = self.table.lookup(page)
        _, dslot = self.table.prepare(page, self.store_tier)
        try:
            item = self.copies.pop(page, None)
            self.store[dslot] = item if item is not None else self._pack(*self._block_kv(runner, block))
        except BaseException:
            self.table.complete(page, ok=False)
            raise
        self.table.complete(page, self.page_bytes())
        runner.slot_pos[0, block * self.P:(block + 1) * self.P] = -1
        runner.heat[block * self.P:(block + 1) * self.P] = 0.0
        self.migrated += 1
        self.demoted += 1
        self._spill()

    def _spill(self):
        """The coldest stored pages to the file tier while the store holds more than store_pages (the
        HOT pages' packed copies are not counted: at most one a window page)."""
        if self.file is None or self.steps < self.spill_retry_at:
            return
        stored = self._pages(self.store_tier)
        excess = len(stored) - self.store_pages
        if excess <= 0:
            return
        for page in stored[np.argsort(self._worth_of(stored), kind="stable")[:excess]].tolist():
            sslot = self.table.lookup(page)[1]
            _, fslot = self.table.prepare(page, Tier.FILE)
            try:
                self.file.write(fslot, self._to_bytes(self.store[sslot]))
            except BaseException as e:           # the page stays stored
                self.table.complete(page, ok=False)
                if not isinstance(e, OSError):
                    raise
                self.spill_failed += 1           # the disk is full or failing: try again in 64 steps
                self.spill_retry_at = self.steps + SPILL_RETRY_STEPS
                return
            del self.store[sslot]
            self.table.complete(page, self.page_bytes())
            self.migrated += 1
            self.spilled += 1

    def _load(self, page: int):
        """A stored page's arrays (from the store or the file), or None when its file read fails
        (the page stays in the file; the swap is skipped, the step goes on)."""
        tier, slot, _, _ = self.table.lookup(page)
        if tier != Tier.FILE:
            return self.store[slot]
        t0 = time.perf_counter()
        try:
            item = self._from_bytes(self.file.read(slot))
        except OSError:
            self.file_read_failed += 1
            return None
        self.file_read_s += time.perf_counter() - t0
        self.file_reads += 1
        return item

    def _promote(self, runner, page: int, item):
        """A stored page (its arrays: _load) into a free window block; the arrays are kept for its
        demotion."""
        tier, sslot, _, _ = self.table.lookup(page)
        _, block = self.table.prepare(page, Tier.HOT)
        sl = slice(block * self.P, (block + 1) * self.P)
        try:
            k, v = self._unpack(item)
            for i in range(self.L):
                runner.k[i][0, :, sl] = k[i]
                runner.v[i][0, :, sl] = v[i]
        except BaseException:
            self.table.complete(page, ok=False)
            raise
        if tier != Tier.FILE:
            del self.store[sslot]
        self.copies[page] = item
        runner.slot_pos[0, sl] = np.arange(page * self.P, (page + 1) * self.P)
        self.table.complete(page, self.page_bytes())
        self.migrated += 1
        self.promoted += 1

    def _migrate(self, runner, tail: int):
        cold = self._pages(self.store_tier, Tier.FILE)
        if not len(cold) or not self.fetch:
            return []
        hot = self._movable(tail)
        w_hot, w_cold = self._worth_of(hot), self._worth_of(cold)
        downs = np.argsort(w_hot, kind="stable")[: self.fetch]     # the `fetch` least worth HOT pages
        ups = np.argsort(-w_cold, kind="stable")[: self.fetch]     # and the most worth stored ones
        swaps = plan_migration(dict(zip(hot[downs].tolist(), w_hot[downs].tolist())),
                               dict(zip(cold[ups].tolist(), w_cold[ups].tolist())),
                               0.0 if self.worth is not None else self.threshold, max_moves=self.fetch)
        done = []
        for up, down in swaps:
            item = self._load(up)                # first: a page that cannot be read costs no eviction
            if item is None:
                continue
            self._demote(runner, down)           # may spill `up` to the file: _promote looks it up again
            self._promote(runner, up, item)
            done.append((up, down))
        return done

    # -- reporting / checks ---------------------------------------------------------------------
    def stats(self) -> dict:
        t = self.table
        return {"pages": len(t), "hot_pages": len(t.pages_in(Tier.HOT)),
                "stored_pages": len(t.pages_in(self.store_tier)), "store": self.store_kind,
                "pages_migrated": self.migrated, "promoted": self.promoted, "demoted": self.demoted,
                "migrated_bytes": t.log.bytes.get("migrate", 0),
                "stored_at_prefill": self.stored_at_prefill,
                "store_bytes": len(self.store) * self.page_bytes(),
                "copy_bytes": len(self.copies) * self.page_bytes(),     # the HOT pages' packed copies
                "file_pages": len(t.pages_in(Tier.FILE)), "file_bytes": self.file.nbytes if self.file else 0,
                "spilled": self.spilled, "spill_failed": self.spill_failed, "file_reads": self.file_reads,
                "file_read_failed": self.file_read_failed,
                "file_read_s": round(self.file_read_s, 6),
                "summary_bytes": len(t) * self.L * self.nkv * self.hd * 4, "page_table_bytes": t.nbytes()}

    def check(self, runner):
        """Invariants (tests): HOT pages <-> window blocks, stored pages <-> store slots, sinks
        resident, the event log's migrations equal the count."""
        P, t = self.P, self.table
        seen, file_slots = set(), set()
        for p in range(len(t)):
            tier, slot, off, flags = t.lookup(p)
            assert off == p * P, (p, off)
            if tier == Tier.HOT:
                assert slot not in seen, f"block {slot} holds two pages"
                seen.add(slot)
                pos = runner.slot_pos[0, slot * P:(slot + 1) * P]
                valid = pos[pos >= 0]
                assert valid.size and (valid == p * P + np.arange(valid.size)).all(), (p, pos)
            elif tier == Tier.FILE:
                assert self.file is not None and slot < self.file.capacity, (p, slot)
                assert slot not in file_slots, f"file slot {slot} holds two pages"
                file_slots.add(slot)
                assert not flags & PINNED
            else:
                assert tier == self.store_tier and slot in self.store, (p, tier, slot)
                assert not flags & PINNED
            if p < self.n_sink:
                assert tier == Tier.HOT and flags & PINNED
        free = [b for b in range(self.blocks) if b not in seen]
        for b in free:
            assert (runner.slot_pos[0, b * P:(b + 1) * P] < 0).all(), f"free block {b} holds positions"
        assert t.pools[Tier.HOT].free == len(free)
        assert len(self.store) == len(t.pages_in(self.store_tier))
        assert all(t.tier(p) == Tier.HOT for p in self.copies), "a packed copy of a page not in the window"
        assert t.pools[Tier.FILE].free == self.max_pages - len(file_slots)
        assert t.log.counts.get("migrate", 0) == self.migrated
