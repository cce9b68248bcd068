"""One engine step over many sequences: the decode tokens of every running sequence and chunks of
prompts go through the model together, reading each weight once, over a paged KV pool.

    pool = PagedKV(cfg, n_pages=512, page_size=16, device, dtype)
    pages = pool.alloc(pool.pages_for(prompt_len + max_new))     # None when the pool has too few
    step = BatchStep(model, pool)
    logits = step.forward([Segment(pages, tokens=[5, 6, 7], start=0), Segment(pages2, [9], start=41)])
    # -> (2, vocab): the last position of each segment
    logits = step.forward([Segment(pages2, [9, 4, 4], start=41, verify=True)])
    # -> (3, vocab): every position of a verify segment (a token and its speculative draft)

`PagedKV` holds every layer's K and V as one slot axis of pages (`k[layer]`: (pages x page size,
kv heads, head dim), or heads first for the 4-bit CPU step); a sequence owns a list of pages (its
block table), so its KV is as long as it is and a finished one gives its pages back at once.
`BatchStep.forward` concatenates the segments' tokens into one row batch for every linear layer;
attention is per segment kind: the decode tokens (one each, and every token of a verify segment,
each as the decode row it would be) together, a prompt chunk against its sequence's past and
itself, causally. Decode rows read their pages in place
through paged Triton kernels on a GPU (zeroedge.kv.paged_attention), the elementwise work between the
products runs fused there (zeroedge.runtime.fused), and a step of decode rows alone replays a CUDA graph; elsewhere their pages are gathered and masked for one SDPA. A verify row at
position p attends to positions 0..p exactly as a plain decode step there would, so checking a
draft gives the logits plain decoding would have given, bit for bit.

Batch invariance on the CPU: a sequence's greedy output does not depend on what else is in the batch.
Rows of a matrix product are computed alike for any number of rows from a kernel's `min_rows` up
(torch's float products on MKL: 4; onnxruntime's MatMulNBits: 2; fewer rows take another kernel), so
every product runs on at least that many rows (padding rows are zeros); masked padding of the
attention adds exact zeros (on 4-bit weights the step is one onnxruntime graph that attends by
itself, zeroedge.serve.cpu_q4). `tests/test_serve.py` checks the whole server for it on the CPU. On CUDA
cuBLAS picks kernels by the number of rows; `invariant` runs the products through
zeroedge.runtime.row_products instead (device_tests/test_serve_gpu.py checks it bit for bit).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from zeroedge.kv.attention import additive_mask
from zeroedge.kv.decode_attention import _pow2
from zeroedge.model import SDPA_GQA
from zeroedge.runtime.fast import TorchLinears

if TYPE_CHECKING:
    from zeroedge.serve.thermal import Hot, ThermalSketches


def _mapped_zeros(shape, dtype) -> torch.Tensor:
    """Zeros in anonymous memory that the OS maps as it is first written, 4 KiB at a time, so a pool
    takes memory as requests use it. Without transparent huge pages: a pool page is a short run in
    each of layers x kv heads rows (heads first), and 2 MiB mapped per run would turn one page of KV
    into hundreds of MiB resident."""
    import mmap

    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = mmap.mmap(-1, max(n, 1))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.from_numpy(np.frombuffer(buf, dtype, count=int(np.prod(shape))).reshape(shape))


class PagedKV:
    """Every layer's K and V in pages of `page_size` positions, and the free list. One more page,
    `scratch`, is never handed out: the padding rows of a captured step write and read there.
    `heads_first`: (layers, kv heads, slots, head dim), each kv head's slots in a row (the 4-bit CPU
    step gathers them so); otherwise (layers, slots, kv heads, head dim).

    Prefix cache: `remember(pages, prompt)` keeps a prefilled prompt's full pages, keyed by the page
    before them and their own tokens (exact: a key is the tokens, not a hash of them); `share(prompt)`
    hands a later prompt the longest chain of them that its tokens begin with. Pages are counted by
    holder (each sequence, and the cache), and go back to the free list when none holds them. A page
    only the cache holds is free for `alloc`, which hands out pages used before, then the least
    recently shared cached ones (forgetting the pages keyed on them), and a page never written last:
    the pool is mapped as it is written (calloc), so the cache holds memory the server already has
    and never grows it."""

    def __init__(self, cfg, n_pages: int, page_size: int, device, dtype, heads_first: bool = False):
        if n_pages < 1 or page_size < 1:
            raise ValueError("a KV pool needs at least one page of at least one position")
        self.page_size, self.n_pages, self.scratch = page_size, n_pages, n_pages
        L, nkv, hd = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        slots = (n_pages + 1) * page_size
        self.heads_first = heads_first
        shape = (L, nkv, slots, hd) if heads_first else (L, slots, nkv, hd)
        if torch.device(device).type == "cpu" and dtype in (torch.float32, torch.float16):
            npd = np.float32 if dtype == torch.float32 else np.float16
            self.k, self.v = _mapped_zeros(shape, npd), _mapped_zeros(shape, npd)
        else:
            self.k = torch.zeros(shape, device=device, dtype=dtype)
            self.v = torch.zeros_like(self.k)
        self.page_bytes = 2 * L * nkv * page_size * hd * self.k.element_size()
        self._free: List[int] = []                                   # released pages, last released on top
        self._unused = list(range(n_pages - 1, -1, -1))             # never handed out (not mapped yet)
        self._holders = [0] * n_pages
        self._cache: "OrderedDict[tuple, int]" = OrderedDict()      # (page before or -1, tokens) -> page
        self._key: dict = {}                                         # page -> its key
        self._children: dict = {}                                    # page -> keys chained on it

    def map_ahead(self, n: int) -> None:
        """Write the next `n` never-used pages alloc will hand out, so that the OS maps them now and not
        during a step. On the CPU only: a GPU pool is allocated whole."""
        n = min(n, len(self._unused))
        if n == 0 or self.k.device.type != "cpu":
            return
        a = self._unused[-1] * self.page_size         # popped from its end, counting up: contiguous
        b = a + n * self.page_size
        for t in (self.k, self.v):
            (t[:, :, a:b] if self.heads_first else t[:, a:b]).zero_()

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    @property
    def free_pages(self) -> int:
        """Pages alloc can hand out: free, or held by the cache alone."""
        return len(self._free) + len(self._unused) + sum(1 for p in self._cache.values() if self._holders[p] == 1)

    def alloc(self, n: int) -> Optional[List[int]]:
        if n > self.free_pages:
            return None
        for key in list(self._cache):               # least recently shared first
            if len(self._free) >= n:
                break
            if key in self._cache and self._holders[self._cache[key]] == 1:
                self._forget(key)
        pages = [self._free.pop() if self._free else self._unused.pop() for _ in range(n)]
        for p in pages:
            self._holders[p] = 1
        return pages

    def release(self, pages: Sequence[int]) -> None:
        for p in reversed(pages):
            self._drop(p)

    def _drop(self, page: int) -> None:
        self._holders[page] -= 1
        if self._holders[page] == 0:
            self._free.append(page)

    def _forget(self, key) -> None:
        """Forget a cached page and every page keyed on it (a chain is as long as a prompt's pages:
        no recursion)."""
        if key[0] in self._children:
            self._children[key[0]].discard(key)
        todo = [key]
        while todo:
            page = self._cache.pop(todo.pop())
            del self._key[page]
            todo += [k for k in self._children.pop(page, ()) if k in self._cache]
            self._drop(page)

    def share(self, prompt: Sequence[int]) -> List[int]:
        """The cached pages `prompt` begins with (its last token never among them: its logits are
        needed), each now held once more by the caller."""
        ps, parent, pages = self.page_size, -1, []
        for i in range((len(prompt) - 1) // ps):
            page = self._cache.get((parent, tuple(prompt[i * ps:(i + 1) * ps])))
            if page is None:
                break
            self._cache.move_to_end(self._key[page])
            self._holders[page] += 1
            pages.append(page)
            parent = page
        return pages

    def remember(self, pages: Sequence[int], prompt: Sequence[int]) -> None:
        """Cache the full pages of a prefilled prompt (their K / V are final)."""
        ps, parent = self.page_size, -1
        for i in range(len(prompt) // ps):
            key = (parent, tuple(prompt[i * ps:(i + 1) * ps]))
            page = self._cache.get(key)
            if page is None:
                page = pages[i]
                if page in self._key:               # a page caches one prefix
                    break
                self._cache[key] = page
                self._key[page] = key
                self._children.setdefault(parent, set()).add(key)
                self._holders[page] += 1
            parent = page

    def slots(self, pages: Sequence[int], start: int, stop: int) -> List[int]:
        ps = self.page_size
        return [pages[p // ps] * ps + p % ps for p in range(start, stop)]


@dataclass
class Segment:
    """Tokens of one sequence at positions start.. (its pages hold them afterwards); the step
    returns the logits of its last position, or of every position if `verify`."""
    pages: List[int]
    tokens: List[int]
    start: int
    verify: bool = False
    hot: Optional["Hot"] = None     # thermal KV (zeroedge.serve.thermal): its decode rows read a choice of pages


class BatchStep:
    """linears: None (the model's weights in torch: TorchLinears) or zeroedge.serve.cpu_q4.Q4Step
    (4-bit weights on a CPU: the whole step is one onnxruntime graph, which attends by itself).
    attention: how decode rows attend, "gather" (their pages gathered, then SDPA), "paged"
    (zeroedge.kv.paged_attention: Triton kernels that read the pages in place; CUDA, or the Triton
    interpreter) or "auto" (paged for fp16 / bf16 where Triton runs).
    graphs: a step of decode rows alone (plain steps and verify segments: no prompt chunk) replays a
    CUDA graph captured per number of rows rounded up to a power of two (paged attention on CUDA
    only; padding rows use the scratch page), and with hot rows per width of their tables too.
    hot: zeroedge.serve.thermal.ThermalSketches of the pool (torch linears): decode rows of a segment
    with `hot` read the pages its sketch chooses each step (prompt chunks read every page).
    invariant (paged attention): the products through zeroedge.runtime.row_products, so a row's
    logits do not depend on the other rows of its step, on a GPU too."""

    def __init__(self, model, pool: PagedKV, linears=None, attention: str = "auto", graphs: bool = True,
                 hot: Optional["ThermalSketches"] = None, invariant: bool = False):
        from zeroedge.kv.decode_attention import triton_runs

        self.m, self.pool, cfg = model, pool, model.cfg
        self.H, self.nkv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        if model.layers[0].self_attn.kept_heads.numel() != self.H:
            raise ValueError("batched serving needs unpruned attention heads")
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.q4 = linears                                 # the whole step in onnxruntime, or None
        if pool.heads_first != (linears is not None):
            raise ValueError("the 4-bit CPU step takes a heads-first KV pool, the torch step the other")
        self.lin = TorchLinears(model) if linears is None else None
        self.L = len(model.layers)
        self.inv_freq = model.inv_freq.to(self.device).float()
        self.scale = 1.0 / math.sqrt(self.hd)
        if attention not in ("auto", "gather", "paged"):
            raise ValueError("attention must be 'auto', 'gather' or 'paged'")
        if attention == "auto":
            half = self.dtype in (torch.float16, torch.bfloat16)
            attention = "paged" if half and not self.q4 and triton_runs(self.device, self.hd) else "gather"
        if attention == "paged" and (self.q4 or not triton_runs(self.device, self.hd, interpreter=True)):
            raise ValueError("paged attention needs the torch linears and Triton on CUDA (or its interpreter) "
                             "with a power-of-two head size >= 16")
        self.attention = attention
        # where the paged kernels run, the elementwise work runs fused too (zeroedge.runtime.fused)
        self.fused = attention == "paged"
        if invariant and not self.fused:
            raise ValueError("a batch-invariant step runs with paged attention (Triton on CUDA)")
        if self.fused:
            from zeroedge.runtime.fused import FusedLinears, rope_store

            self.lin, self._rope_store = FusedLinears(model, invariant=invariant), rope_store
        if hot is not None and (self.q4 or hot.pool is not pool):
            raise ValueError("thermal KV runs on the torch step, with the sketches of its own pool")
        self.hot = hot
        self.graphs = graphs and attention == "paged" and self.device.type == "cuda"
        self._captured = {}           # rows (and hot tables' widths) -> (graph replay, static inputs, logits)
        self._graph_pool = None

    @torch.no_grad()
    def forward(self, segments: List[Segment]) -> torch.Tensor:
        """-> (rows, vocab) float32 logits: each segment's last position, or all of a verify segment's,
        in segment order."""
        if self.q4 is not None:
            return self.q4.forward(self.pool, segments)
        if self.graphs and all(len(s.tokens) == 1 or s.verify for s in segments):
            return self._replay(segments)
        ids, pos, slots, out_rows = [], [], [], []
        plain, verify, pre = [], [], []   # decode rows (row, pages, length); verify segments' rows; chunks
        for s in segments:
            n, r0 = len(s.tokens), len(ids)
            ids += s.tokens
            pos += range(s.start, s.start + n)
            slots += self.pool.slots(s.pages, s.start, s.start + n)
            if s.verify:
                verify.append([(r0 + i, s.pages, s.start + i + 1, s.hot) for i in range(n)])
            elif n == 1:
                plain.append((r0, s.pages, s.start + 1, s.hot))
            else:
                pre.append((r0, s))
            out_rows += range(r0, r0 + n) if s.verify else [r0 + n - 1]
        N = len(ids)
        M = max(N, self.lin.min_rows)
        tok = torch.zeros(M, dtype=torch.long)
        tok[:N] = torch.tensor(ids)
        posf = torch.zeros(M, dtype=torch.float32)
        posf[:N] = torch.tensor(pos, dtype=torch.float32)
        # decode rows attend in one batched product over their slots, masked to their own length; a
        # verify segment's rows in one of their own, over its slots gathered once
        groups = [self._decode_group(g, shared=False) for g in ([plain] if plain else [])]
        groups += [self._decode_group(g, shared=True) for g in verify]
        x = self._layers(tok.to(self.device), posf.to(self.device), torch.tensor(slots, device=self.device),
                         groups, pre)
        rows = torch.zeros(max(len(out_rows), self.lin.min_rows), dtype=torch.long)
        rows[: len(out_rows)] = torch.tensor(out_rows)
        return self.lin.head(x[rows.to(self.device)])[: len(out_rows)].float()

    def _layers(self, tok, posf, slot_t, groups, pre):
        """The model over M rows (tokens `tok` at positions `posf`; the first len(slot_t) rows write
        their K/V at those slots) -> the last hidden states (M, dim); device tensors only, so a
        decode-only step captures in a CUDA graph."""
        M, N, dev = tok.numel(), slot_t.numel(), self.device
        f = torch.outer(posf, self.inv_freq)
        cos, sin = torch.cat((f, f), -1).cos().to(self.dtype), torch.cat((f, f), -1).sin().to(self.dtype)
        x, qkv = self.lin.boundary(0, self.m.embed_tokens(tok))
        # one group of decode rows that is every row, in order (a captured step): its attention is o
        whole = not pre and len(groups) == 1 and groups[0][0].numel() == M
        for li in range(self.L):
            K, V = self.pool.k[li], self.pool.v[li]
            if self.fused:
                q = self._rope_store(qkv, cos, sin, K, V, slot_t, self.H, self.nkv)
            else:
                qkv = qkv.view(M, self.H + 2 * self.nkv, self.hd)
                qk = qkv[:, : self.H + self.nkv]
                qk = (qk * cos[:, None]
                      + torch.cat((-qk[..., self.hd // 2:], qk[..., : self.hd // 2]), -1) * sin[:, None])
                q, k, v = qk[:, : self.H], qk[:N, self.H:], qkv[:N, self.H + self.nkv:]
                K.index_copy_(0, slot_t, k)
                V.index_copy_(0, slot_t, v)
            if whole:
                o = self._decode_attention(li, q, K, V, *groups[0][1:])
            else:
                o = torch.zeros(M, self.H, self.hd, device=dev, dtype=self.dtype)
            for rows_t, *how in ([] if whole else groups):
                o[rows_t] = self._decode_attention(li, q[rows_t], K, V, *how)
            for r0, s in pre:
                o[r0:r0 + len(s.tokens)] = self._chunk_attention(q[r0:r0 + len(s.tokens)], K, V, s)
            o = o.reshape(M, -1)
            x, qkv = self.lin.boundary(li + 1, x, o)
        return x

    def _replay(self, segments):
        """Decode rows alone (a verify segment's tokens are decode rows too) through a captured graph:
        inputs copied into its static tensors, padding rows (token 0 at position 0) on the scratch page."""
        ps, scratch = self.pool.page_size, self.pool.scratch
        rows = [(s.pages, t, s.start + i, s.hot) for s in segments for i, t in enumerate(s.tokens)]
        B = len(rows)
        width = max(self.pool.pages_for(p + 1) for _, _, p, _ in rows)
        Bp = max(_pow2(B), self.lin.min_rows)
        host = {"tok": np.zeros(Bp, np.int64), "posf": np.zeros(Bp, np.float32),
                "slot": np.full(Bp, scratch * ps, np.int64), "pages": np.full((Bp, width), scratch, np.int32),
                "lens": np.ones(Bp, np.int32)}
        for j, (pages, t, p, _) in enumerate(rows):
            n = self.pool.pages_for(p + 1)
            host["tok"][j], host["posf"][j], host["lens"][j] = t, p, p + 1
            host["slot"][j] = pages[p // ps] * ps + p % ps
            host["pages"][j, :n] = pages[:n]
        key, hot = Bp, None
        if self.hot is not None and any(h is not None for *_, h in rows):
            pad = [([scratch], 1, None)] * (Bp - B)
            hot = self.hot.rows([(pages, p + 1, h) for pages, _, p, h in rows] + pad)
            key = (Bp, hot["scored_pages"].shape[1], self.hot.slots_max(hot), hot["tail_pages"].shape[1])
            host = dict(host, **{"hot_" + k: a for k, a in hot.items()})
        if key not in self._captured:
            self._capture(key, host)
        replay, static, logits = self._captured[key]
        for name, a in host.items():      # page tables: the columns in use (the kernel reads no further)
            t = static[name][:, :width] if name == "pages" else static[name]
            t.copy_(torch.from_numpy(a), non_blocking=True)
        replay()
        return logits[:B].clone()

    def _width(self) -> int:
        """Pages a captured step's tables hold: the longest sequence the pool and the model allow."""
        return min(self.pool.n_pages + 1, self.pool.pages_for(self.m.cfg.max_seq_len))

    def _capture(self, key, host):
        """The graph of a step of key's rows (key: Bp, or with hot rows (Bp, and the widths of their
        tables: scored pages, slots, tail)); the plain page table as wide as _width(), so one graph
        serves every context."""
        Bp = key if isinstance(key, int) else key[0]
        pages = np.full((Bp, self._width()), self.pool.scratch, np.int32)
        pages[:, :host["pages"].shape[1]] = host["pages"]
        static = {name: torch.from_numpy(pages if name == "pages" else a).to(self.device) for name, a in host.items()}
        # every tensor the graph reads lives as long as the graph: kept in `static`, never only in the
        # closure (freed after capture, its memory would be handed out again under the graph)
        static["rows"] = torch.arange(Bp, device=self.device)
        if isinstance(key, int):
            how = (static["pages"], static["lens"])
        else:
            from zeroedge.serve.thermal import HotRows

            how = (HotRows(**{k[4:]: t for k, t in static.items() if k.startswith("hot_")}, slots_max=key[2]),)

        def body():
            x = self._layers(static["tok"], static["posf"], static["slot"], [(static["rows"], *how)], [])
            return self.lin.head(x).float()

        replay, logits = self._graphed(body)
        self._captured[key] = (replay, static, logits)

    def _graphed(self, body):
        """body captured in a CUDA graph (in one memory pool for every graph of this step) -> (replay,
        the output it refreshes)."""
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):                  # warm-up (Triton compiles, cuBLAS picks its kernels)
                body()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's other threads may touch CUDA while the engine thread captures
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            out = body()
        return graph.replay, out

    def _slot_table(self, page_lists, n_pages: int) -> torch.Tensor:
        """(sequences, n_pages * page size) slots of each sequence's first n_pages pages (0 past its end)."""
        pt = torch.zeros(len(page_lists), n_pages, dtype=torch.long)
        for j, pages in enumerate(page_lists):
            k = min(n_pages, len(pages))
            pt[j, :k] = torch.tensor(pages[:k])
        ps = self.pool.page_size
        return (pt[:, :, None] * ps + torch.arange(ps)).view(len(page_lists), -1)

    def _sdpa(self, q, K, V, mask):
        """q (B, H, T, hd), K / V (B, nkv, S, hd) strided views, mask (B | 1, 1, T, S)."""
        if SDPA_GQA:
            return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, enable_gqa=self.H != self.nkv)
        rep = self.H // self.nkv
        return F.scaled_dot_product_attention(q, K.repeat_interleave(rep, 1), V.repeat_interleave(rep, 1),
                                              attn_mask=mask)

    def _decode_group(self, rows, shared: bool) -> tuple:
        """rows [(row, pages, length, hot)] -> (row indices, how they attend): with a hot row, (HotRows,);
        else paged, (page tables (B, W) int32, lengths (B,) int32); gathered, (slot table, additive mask
        (B, 1, 1, S), shared): shared, the rows are one sequence's (its first row's pages, gathered once)."""
        dev, ps = self.device, self.pool.page_size
        rows_t = torch.tensor([r for r, *_ in rows], device=dev)
        if self.hot is not None and any(h is not None for *_, h in rows):
            return rows_t, self.hot.device_rows(self.hot.rows([(p, n, h) for _, p, n, h in rows]))
        lens = torch.tensor([n for _, _, n, _ in rows])
        S = -(-int(lens.max()) // ps) * ps
        if self.attention == "paged":
            pages = torch.full((len(rows), S // ps), self.pool.scratch, dtype=torch.int32)
            for j, (_, p, n, _) in enumerate(rows):
                k = self.pool.pages_for(n)
                pages[j, :k] = torch.tensor(p[:k], dtype=torch.int32)
            return rows_t, pages.to(dev), lens.to(dev, torch.int32)
        table = self._slot_table([p for _, p, _, _ in rows[:1 if shared else None]], S // ps).view(-1).to(dev)
        valid = torch.arange(S)[None, :] < lens[:, None]
        mask = torch.zeros(len(rows), S, dtype=self.dtype).masked_fill(~valid, float("-inf"))
        return rows_t, table, mask.to(dev).view(len(rows), 1, 1, S), shared

    def _decode_attention(self, li, q, K, V, *how):
        """q (B, H, hd) of one token each; K, V (slots, nkv, hd) of layer li. how: (HotRows,), the pages
        the sketches choose; paged, (pages, lens); gathered, (table (B * S) slots, or S if shared (every
        row reads the same slots: one copy, expanded), mask (B, 1, 1, S), shared)."""
        if len(how) == 1:
            pages, lens = self.hot.tables(li, q, how[0])
            if self.attention == "gather":
                return self._gather_heads(q, K, V, pages, lens)
            how = (pages, lens)
        if self.attention == "paged":
            from zeroedge.kv.paged_attention import paged_attend

            pages, lens = how
            return paged_attend(q.contiguous(), K, V, pages, lens, self.pool.page_size)
        table, mask, shared = how
        B, S = mask.shape[0], mask.shape[-1]
        n = 1 if shared else B
        Kg = K.index_select(0, table).view(n, S, self.nkv, self.hd).transpose(1, 2).expand(B, -1, -1, -1)
        Vg = V.index_select(0, table).view(n, S, self.nkv, self.hd).transpose(1, 2).expand(B, -1, -1, -1)
        return self._sdpa(q[:, :, None], Kg, Vg, mask)[:, :, 0]

    def _gather_heads(self, q, K, V, pages, lens):
        """Gathered decode attention over a page table a kv head, pages (B, nkv, W), lens (B,)."""
        ps, B = self.pool.page_size, q.shape[0]
        S = -(-int(lens.max()) // ps) * ps
        pos = torch.arange(S, device=q.device)
        slot = pages[:, :, : S // ps].long().repeat_interleave(ps, -1) * ps + pos % ps       # (B, nkv, S)
        heads = torch.arange(self.nkv, device=q.device)[None, :, None]
        mask = additive_mask(pos[None, :] < lens[:, None].long(), self.dtype).view(B, 1, 1, S)
        return self._sdpa(q[:, :, None], K[slot, heads], V[slot, heads], mask)[:, :, 0]

    def _chunk_attention(self, q, K, V, seg: Segment):
        """q (T, H, hd) at positions seg.start..; attends to the sequence's slots 0..end causally."""
        end = seg.start + len(seg.tokens)
        ps = self.pool.page_size
        idx = self._slot_table([seg.pages], -(-end // ps))[0, :end].to(q.device)
        Ks = K.index_select(0, idx).transpose(0, 1)[None]     # (1, nkv, end, hd)
        Vs = V.index_select(0, idx).transpose(0, 1)[None]
        mask = (torch.arange(end, device=q.device)[None, :]
                <= torch.arange(seg.start, end, device=q.device)[:, None])
        return self._sdpa(q.transpose(0, 1)[None], Ks, Vs, mask)[0].transpose(0, 1)
