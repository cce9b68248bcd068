"""Thermal KV as the decode step's attention strategy (zeroedge.runtime.fast.Decoder composes it
with an FFN strategy): per layer and kv head the device keeps one contiguous window = [sink page |
recent window | `slots` pages | generated tokens], the low-rank quantized key sketch of every prefix
page and its bases (settings: zeroedge.kv.policy.THERMAL, shared with the evaluation contract); every prefix page also lives in the cold store (host memory, pinned and mapped on a
discrete GPU; with cold="int8" / "int4", codes with one fp16 scale per 32 values kept in device
memory (one scale per head_dim when it is not a multiple of 32), which on a Jetson is the same DRAM:
the cold store then takes about a half / a quarter of the bytes instead of all of them; with
`spill_dir`, the compressed store is mapped from one private file there instead, NVMe on a Jetson,
and takes no device memory). Every `refresh_every` steps each kv head scores all pages by the sketch (a fused
Triton kernel, zeroedge.kv.kernels) and swaps up to `fetch` pages (best missing in, worst resident
out while the new one scores higher), copying them straight from host memory into the window in the
same kernel, inside the step's CUDA graph (no host round trip; a cold store in a file is the
exception: the host reads the chosen pages between the graph's pieces, zeroedge.kv.host_fetch);
attention reads only the window.
Attention is the dense decoder's Triton kernel over the window's valid prefix on CUDA
(zeroedge.kv.decode_attention), masked SDPA elsewhere. With lag 1 (kv.policy.ThermalSettings) a
layer's refresh runs after its attention and serves the next step; on CUDA it then runs on a side
stream inside the step's graph, beside the rest of the step (two side streams, even and odd layers
apart). With ahead d, layer l's refresh scores pages with the query layer l's weights make from layer
l - d's input (the decoder's `layer_input` hook), and on CUDA runs on its side stream beside layers
l - d .. l - 1; layer l's attention waits for it. Layer 0's refresh then runs as with lag 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zeroedge.kv.policy import (COLD_BITS, SKETCH_CHUNK, THERMAL, ThermalSettings, check_ahead, cold_group,
                                thermal_device_bytes, thermal_settings, window_pages)


def additive_mask(valid: torch.Tensor, dtype) -> torch.Tensor:
    """0 where valid, -inf elsewhere, in the attention's dtype."""
    return torch.zeros((), dtype=dtype, device=valid.device).masked_fill(~valid, float("-inf"))


def host_mapped(t: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor aliasing pinned host memory (zero-copy reads over PCIe through UVA)."""
    if not t.is_pinned():
        raise ValueError("host_mapped needs pinned memory")
    raw = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)

    class _CAI:
        __cuda_array_interface__ = {"shape": tuple(raw.shape),
                                    "typestr": "<i2" if t.element_size() == 2 else "<i4",
                                    "data": (raw.data_ptr(), False), "version": 3, "strides": None}

    return torch.as_tensor(_CAI(), device="cuda").view(t.dtype)


def sketch_bases(k, qcov=None, rank: int = 16, eps: float = 1e-2, chunk: int = SKETCH_CHUNK):
    """(A, B, mu, rms) for keys k (nkv, P, hd): coords = (k - mu) @ B, query side q @ A, rms (nkv, rank)
    each coordinate's root mean square over the keys. With the query
    covariance Cq the basis is query-aware: q.k = (Cq^-1/2 q) . (Cq^1/2 k), and the top `rank`
    principal directions of Cq^1/2 k minimise the expected squared score error over the queries;
    without it, plain key PCA. (A per-query constant shift does not change a softmax ranking, so
    keys are centred on their mean.) The key moments are summed `chunk` keys at a time, in fp64."""
    nkv, P, hd = k.shape
    s = torch.zeros(nkv, 1, hd, device=k.device, dtype=torch.float64)
    S = torch.zeros(nkv, hd, hd, device=k.device, dtype=torch.float64)
    for i in range(0, P, chunk):
        kc = k[:, i:i + chunk].double()
        s += kc.sum(1, keepdim=True)
        S += kc.transpose(1, 2) @ kc
    mu = s / P
    cov = (S - P * mu.transpose(1, 2) @ mu).float()     # sum over keys of (k - mu)^T (k - mu)
    if qcov is not None:
        cq = qcov.float() / qcov.float().diagonal(dim1=1, dim2=2).mean(-1)[:, None, None]
        cq = cq + eps * torch.eye(hd, device=k.device)
        e, V = torch.linalg.eigh(cq)
        W = V @ torch.diag_embed(e.sqrt()) @ V.transpose(1, 2)
        Wi = V @ torch.diag_embed(e.rsqrt()) @ V.transpose(1, 2)
    else:
        W = Wi = torch.eye(hd, device=k.device).expand(nkv, hd, hd)
    e, U = torch.linalg.eigh(W.transpose(1, 2) @ cov @ W)   # e: the coordinates' sums of squares
    U = U[:, :, -rank:].flip(-1)
    rms = (e[:, -rank:].flip(-1).clamp_min(0) / P).sqrt()
    return Wi @ U, W @ U, mu.float(), rms


def quantized_sketch(k, rank: int, bits: int, qcov=None, chunk: int = SKETCH_CHUNK, out=None):
    """The key sketch of keys k (nkv, P, hd): (A (nkv, hd, rank) fp32 query bases, codes (nkv, P,
    rank) int8, scales (nkv, P) fp16). The score of query q against key t is (q @ A) . codes[t] *
    scales[t], up to a per-query constant. The coordinates are whitened (each divided by its root
    mean square over the keys, which A takes back), so one scale a token serves all of them: codes
    round-to-nearest on `bits` bits (|code| <= 2^(bits-1) - 1, scale = the token's max |coord| over
    that), or signs with the token's mean |coord| when bits = 1 (benchmarks/thermal_kv.md: the
    quality of a scale per (page, direction), in 2 bytes a token instead of rank / 4). A rank above
    hd is hd. Coordinates are made a chunk at a time. out: (codes (nkv, P, rank / 2) uint8, scales)
    to fill instead, the codes packed two a byte (kernels.pack_int4) a chunk at a time: nothing the
    size of the prefix beyond them (at 341K tokens the unpacked codes and their packing took ~0.4 GB)."""
    from zeroedge.kv.kernels import pack_int4

    nkv, P, hd = k.shape
    rank = min(rank, hd)
    A, B, mu, rms = sketch_bases(k, qcov, rank, chunk=chunk)
    rms = rms.clamp_min(1e-12)[:, None, :]
    A, B = A * rms, B / rms
    if out is not None and (out[0].dtype != torch.uint8 or tuple(out[0].shape) != (nkv, P, rank // 2)
                            or tuple(out[1].shape) != (nkv, P)):
        raise ValueError(f"out: codes (nkv, P, rank/2) uint8 and scales (nkv, P) for rank {rank}")
    codes, scales = out if out is not None else (
        torch.empty(nkv, P, rank, dtype=torch.int8, device=k.device),
        torch.empty(nkv, P, dtype=torch.float16, device=k.device))
    for i in range(0, P, chunk):
        coords = (k[:, i:i + chunk].float() - mu) @ B
        if bits == 1:
            sc = coords.abs().mean(-1, keepdim=True).clamp_min(1e-8).half()
            c = torch.where(coords >= 0, 1, -1)
        else:
            qmax = 2 ** (bits - 1) - 1
            sc = (coords.abs().amax(-1, keepdim=True) / qmax).clamp_min(1e-8).half()
            c = torch.round(coords / sc.float()).clamp(-qmax, qmax)
        c = c.to(torch.int8)
        codes[:, i:i + chunk] = pack_int4(c) if out is not None else c
        scales[:, i:i + chunk] = sc[..., 0]
    return A, codes, scales


class ThermalAttention:
    """Attention over a prefix of P tokens with a thermal cache (see the module doc); the decoder
    gives it the model's shapes, device and dtype through `bind`."""

    COLD = ("host", "int8", "int4")   # host: full precision in (pinned) host memory; int8 / int4: compressed, on the device

    def __init__(self, prefix_len: int, gen_len: int, budget: float = 0.1, page_size: int = THERMAL.page_size,
                 rank: int = THERMAL.rank, bits: int = THERMAL.bits, recent_pages: int | None = None,
                 sink_pages: int = THERMAL.sink_pages, fetch: int = THERMAL.fetch,
                 refresh_every: int = THERMAL.refresh_every, lag: int = THERMAL.lag, ahead: int = THERMAL.ahead,
                 cold: str = "host", attn: str = "auto", scheduler=None, spill_dir=None):
        if prefix_len % page_size:
            raise ValueError(f"page size {page_size} does not divide the prefix ({prefix_len})")
        if recent_pages is None:            # the default recent window in tokens, at this page size
            recent_pages = thermal_settings(page_size).recent_pages
        if not 0 < budget <= 1:
            raise ValueError("budget must be in (0, 1]")
        if rank % 2:
            raise ValueError("rank must be even (sketch codes are packed two a byte)")
        if bits not in (1, 2, 3, 4):
            raise ValueError(f"sketch bits must be 1..4 (codes are stored two a byte), got {bits}")
        if lag not in (0, 1):
            raise ValueError(f"lag must be 0 or 1, got {lag!r}")
        check_ahead(ahead, lag)
        if attn not in ("auto", "sdpa", "triton"):
            raise ValueError("attn must be 'auto', 'sdpa' or 'triton'")
        if cold not in self.COLD:
            raise ValueError(f"cold must be one of {', '.join(self.COLD)} (got {cold!r})")
        if spill_dir is not None and cold == "host":
            raise ValueError("a cold store in a file (spill_dir) is compressed: cold must be int8 or int4")
        if sink_pages + recent_pages + 1 > prefix_len // page_size:
            raise ValueError(f"a prefix of {prefix_len // page_size} pages cannot hold {sink_pages} sink + "
                             f"{recent_pages} recent pages and a slot")
        self.cold, self.lag, self.ahead, self.attn, self.spill_dir = cold, lag, ahead, attn, spill_dir
        self.cold_file = None                   # zeroedge.kv.tiers.FileTensors with spill_dir
        self.host_fetch = None                  # zeroedge.kv.host_fetch.HostFetch with spill_dir
        # set by the decoder while it captures a refresh step: the step's graph ends at each host read
        self.on_host_read = None
        self.cold_filled = False
        # zeroedge.kv.scheduler.BandwidthScheduler: a refresh (page scoring + swaps) is deferred while
        # memory bandwidth is busy, and made up at the next step it is not
        self.scheduler = scheduler
        self.refreshes = self.deferred = 0
        self._owed = False
        self.max_len = prefix_len + gen_len
        self.P, self.ps, self.n, self.gen_len = prefix_len, page_size, prefix_len // page_size, gen_len
        self.budget, self.rank, self.bits, self.refresh_every = budget, rank, bits, max(1, refresh_every)
        self.sink_pages, self.recent_pages, self.fetch_wanted = sink_pages, recent_pages, fetch
        self.settings = ThermalSettings(page_size, rank, bits, sink_pages, recent_pages, fetch, refresh_every, lag,
                                        ahead)

    def bind(self, L: int, nkv: int, H: int, hd: int, device, dtype):
        """Allocate the window, the cold store and the sketches for L layers of nkv kv heads."""
        from zeroedge.kv.decode_attention import Shares, choose
        from zeroedge.kv.kernels import part_blocks, sketch_kernel_fits

        self.L, self.nkv, self.H, self.hd, self.device, self.dtype = L, nkv, H, hd, device, dtype
        self.rank = min(self.rank, hd)                 # small heads: a full-rank sketch
        ps, n = self.ps, self.n
        self.fixed, self.slots = window_pages(self.P, self.budget, self.settings)
        self.fetch = min(self.fetch_wanted, self.slots)
        pin = device.type == "cuda"
        # cold store: every prefix page, in host memory at full precision, or int8 / int4 on the device
        # (or in a mapped file)
        if self.cold != "host":
            from zeroedge.kv.tiers import FileTensors

            self.cold_bits = COLD_BITS[self.cold]
            self.group = cold_group(hd)
            codes = (hd * self.cold_bits // 8, torch.int8 if self.cold_bits == 8 else torch.uint8)
            scales = (hd // self.group, torch.float16)
            lead = (L, nkv, n, ps)
            if self.spill_dir is not None:      # a token's K, V codes and scales side by side in the file
                self.cold_file = FileTensors(self.spill_dir, lead, {"k": codes, "v": codes, "ks": scales, "vs": scales})
                t = self.cold_file.tensors
                self.cold_k, self.cold_v, self.cold_ks, self.cold_vs = t["k"], t["v"], t["ks"], t["vs"]
            else:
                self.cold_k, self.cold_v = (torch.zeros(*lead, codes[0], dtype=codes[1], device=device) for _ in "kv")
                self.cold_ks, self.cold_vs = (torch.zeros(*lead, scales[0], dtype=scales[1], device=device) for _ in "kv")
        else:
            self.cold_k = torch.zeros(L, nkv, n, ps, hd, dtype=dtype, pin_memory=pin)
            self.cold_v = torch.zeros_like(self.cold_k, pin_memory=pin) if pin else torch.zeros_like(self.cold_k)
            self.cold_ks = self.cold_vs = None
        # device window: [fixed tokens | slot pages | generated tokens], K and V of a layer side by side
        self.slot0 = self.fixed * ps
        self.gen0 = self.slot0 + self.slots * ps
        self.win_len = self.gen0 + self.gen_len
        # (K and V, layer, kv head, position, hd): layer li's pair for the attention kernel is kv[:, li]
        self.kv = torch.zeros(2, L, nkv, self.win_len, hd, device=device, dtype=dtype)
        self.wk, self.wv = self.kv[0], self.kv[1]
        self.attn = choose(self.attn, nkv, self.win_len, hd, device, dtype)
        self.takes_qkv = self.attn == "triton"
        if self.takes_qkv:
            self.shares = Shares(H, hd, device, max_len=self.win_len)
            self.o = torch.empty(H, hd, device=device, dtype=dtype)
        # lag 1 (ahead: layer 0): each layer's query after RoPE, read by its refresh (on CUDA on a side
        # stream, joined at the end of the step by `finish`)
        self.qbuf = torch.empty(L, H, hd, device=device, dtype=dtype) if self.lag or self.ahead else None
        # the side streams at the lowest priority and the step's own at the highest: the refreshes fill
        # the gaps the step leaves (CUDA graphs keep each node's stream priority). Even and odd layers
        # refresh on two streams, so a layer's refresh can start while the one before it still runs
        # (with the layer bodies compiled the step otherwise waits on that chain: benchmarks/thermal_kv.md)
        self.side = self.main_stream = None
        self.sides = []
        if (self.lag or self.ahead) and pin:
            from zeroedge.kv.tiers import shared_stream

            low, high = torch.cuda.Stream.priority_range()
            self.sides = [shared_stream(device, "refresh", low), shared_stream(device, "refresh-odd", low)]
            self.side, self.main_stream = self.sides[0], shared_stream(device, "step", high)
        self._forked = set()        # the side streams this step forked (indices into sides)
        # ahead on the side stream: layer l's refresh done (its attention waits for it)
        self.ready = ([torch.cuda.Event() for _ in range(L)] if self.ahead and self.side is not None
                      and self.spill_dir is None else None)
        self.wpos = torch.full((self.win_len,), -1, dtype=torch.long, device=device)
        self.slot_page = torch.zeros(L, nkv, self.slots, dtype=torch.long, device=device)
        self.page_slot = torch.full((L, nkv, n), -1, dtype=torch.long, device=device)
        # summaries: query bases, int4 codes (packed), a scale a token
        self.A = torch.zeros(L, nkv, hd, self.rank, device=device, dtype=torch.float32)
        self.codes = torch.zeros(L, nkv, self.P, self.rank // 2, device=device, dtype=torch.uint8)
        self.scales = torch.zeros(L, nkv, self.P, device=device, dtype=torch.float16)
        self.page_bias = torch.zeros(n, device=device)
        self.page_bias[:self.sink_pages] = float("-inf")
        if self.recent_pages:
            self.page_bias[n - self.recent_pages:] = float("-inf")
        self.hk = self.hv = None
        self.gen = 0
        self._check = None                      # the last speculative check, until the next call settles it
        self.widx = torch.zeros(1, dtype=torch.long, device=device)
        self.ar_slots = torch.arange(self.slots, device=device)
        # per-block shares of each query head's log-sum-exp over pages, written by the sketch kernel
        # for the two-stage swap (CUDA): a pair of buffers for even layers' refreshes (lse_part) and one
        # for odd layers', so the two side streams never share one
        nb = part_blocks(n, ps)
        self.lse_parts = [tuple(torch.empty(nkv, H // nkv, nb, device=device) for _ in range(2)) for _ in range(2)
                          ] if pin and sketch_kernel_fits(ps, self.rank) else None
        self.lse_part = self.lse_parts[0] if self.lse_parts is not None else None
        if self.cold_file is not None:
            from zeroedge.kv.host_fetch import HostFetch

            self.host_fetch = HostFetch(nkv, self.fetch, self.cold_file, self.cold_bits, device)
            self._cold_np = [self.cold_file.records[li].numpy() for li in range(L)]   # the host reads these

    @property
    def _refresh_beside(self) -> bool:
        """Lag 1 / ahead refreshes run on the side stream (CUDA, and no host read, which cuts the graph)."""
        return self.side is not None and self.host_fetch is None

    @property
    def host_refresh(self) -> bool:
        """A refresh reads pages on the host (a cold store in a file): on CUDA its step is captured in
        pieces (zeroedge.runtime.fast.Decoder)."""
        return self.host_fetch is not None and self.device.type == "cuda"

    def host_read(self, li):
        """The host's part of layer li's refresh (a cold store in a file), once the device decided."""
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self.host_fetch.read(self._cold_np[li])

    def policy(self) -> dict:
        """The settings this window runs (kv.policy.ThermalSettings, the rank as bound: at most hd), as
        `zeroedge eval --kv-budget` reports its options."""
        from dataclasses import asdict, replace

        return asdict(replace(self.settings, rank=self.rank, fetch=self.fetch))

    def kv_bytes(self) -> int:
        return self.device_kv_bytes()["hot"]

    def device_kv_bytes(self) -> dict:
        """zeroedge.kv.policy.thermal_device_bytes of this window (tests check it against the tensors)."""
        return thermal_device_bytes(self.L, self.nkv, self.hd, self.P, self.gen_len, self.wk.element_size(),
                                    self.budget, self.settings, self.cold, in_file=self.cold_file is not None)

    def prefill_caches(self):
        """A compressed cold store only: per layer a zeroedge.kv.tiers.QuantKVCache writing straight
        into the cold store, for zeroedge.model.chunked_prefill; load_prefix then takes the prefix
        from there."""
        from zeroedge.kv.tiers import QuantKVCache

        if self.cold == "host":
            raise ValueError("only a compressed cold store takes the prefill in place")
        self.cold_filled = True
        flat = lambda t, li: t[li].view(self.nkv, self.P, -1)  # noqa: E731
        f = self.cold_file      # in a file: whole records written and read (a token's four fields side by side)
        return [QuantKVCache(flat(self.cold_k, li), flat(self.cold_ks, li), flat(self.cold_v, li),
                             flat(self.cold_vs, li), self.cold_bits, self.group, self.dtype, device=self.device,
                             records=None if f is None else (flat(f.records, li), f.offsets))
                for li in range(self.L)]

    def load_prefix(self, ks, vs, qcovs=None):
        """ks, vs: per layer (nkv, P, hd); qcovs: optional per layer (nkv, hd, hd) query
        covariances (query-aware sketch). Fills cold store, fixed window, slots, summaries."""
        ps, n, r, dev = self.ps, self.n, self.rank, self.device
        fix_idx = torch.cat([torch.arange(self.sink_pages * ps),
                             torch.arange(self.P - self.recent_pages * ps, self.P)]).to(dev)
        nf = fix_idx.numel()
        self.wpos[:nf] = fix_idx
        first = torch.arange(self.n - self.recent_pages - self.slots, self.n - self.recent_pages,
                             device=dev).clamp_min(self.sink_pages)
        for li in range(self.L):                # one layer's K/V alive at a time (a compressed prefill's
            kd, vd = ks[li].to(dev), vs[li].to(dev)  # are dequantized when read)
            kd, vd = kd.view(self.nkv, n, ps, self.hd), vd.view(self.nkv, n, ps, self.hd)
            # the cold store already holds the prefix when the prefill wrote it (prefill_caches): ks
            # and vs are then its dequantized pages
            pk, pv = (kd, vd) if self.cold_filled else self._store_cold(li, kd, vd)
            kd, vd = kd.view(self.nkv, self.P, self.hd), vd.view(self.nkv, self.P, self.hd)
            self.wk[li, :, :nf] = kd[:, fix_idx]
            self.wv[li, :, :nf] = vd[:, fix_idx]
            self.A[li] = quantized_sketch(kd, r, self.bits, None if qcovs is None else qcovs[li].to(dev),
                                          out=(self.codes[li], self.scales[li]))[0]
            self.slot_page[li] = first[None].expand(self.nkv, -1)
            self.page_slot[li].fill_(-1)
            self.page_slot[li].scatter_(1, self.slot_page[li], self.ar_slots[None].expand(self.nkv, -1).contiguous())
            # slot pages always hold what a fetch from the cold store would bring (int8: dequantized)
            self._slots(self.wk, li).view(self.nkv, self.slots, ps, self.hd).copy_(pk[:, first])
            self._slots(self.wv, li).view(self.nkv, self.slots, ps, self.hd).copy_(pv[:, first])
            del kd, vd, pk, pv
        self.wpos[self.slot0:self.gen0] = 0             # slot tokens are prefix positions: valid
        if dev.type == "cuda" and self.cold == "host":
            self.hk, self.hv = host_mapped(self.cold_k), host_mapped(self.cold_v)
        else:
            self.hk, self.hv = self.cold_k, self.cold_v

    def _store_cold(self, li, k, v):
        """Layer li's prefix pages (nkv, n, ps, hd) into the cold store; returns the pages as a fetch
        reads them back (K, V in the window's dtype)."""
        if self.cold == "host":
            self.cold_k[li].copy_(k)
            self.cold_v[li].copy_(v)
            return k, v
        from zeroedge.kv.tiers import dequantize, quantize

        back = []
        for x, codes, scales in ((k, self.cold_k, self.cold_ks), (v, self.cold_v, self.cold_vs)):
            c, sc = quantize(x, self.cold_bits, self.group)
            codes[li].copy_(c)
            scales[li].copy_(sc)
            back.append(dequantize(c, sc, self.cold_bits, self.group, self.dtype))
        return back

    # -- the decoder's per-step hooks ----------------------------------------------------------
    def _slots(self, w, li):
        """Layer li's slot pages of window w (wk or wv): (nkv, slots * ps, hd)."""
        return w[li, :, self.slot0:self.gen0]

    def before(self, pos: int):
        self.settle(pos)
        i = self.gen0 + self.gen
        if i >= self.win_len:
            raise ValueError(f"generated more than the {self.gen_len} tokens planned")
        if not 0 <= pos < self.max_len:      # the RoPE tables' rows (the Triton kernel reads them on the device)
            raise ValueError(f"position {pos} is outside the {self.max_len} positions planned")
        self.wpos[i] = pos
        self.widx.fill_(i)
        self.gen += 1

    def flag(self, pos: int) -> int:
        """1 on the steps that refresh (score and swap pages): a CUDA graph of its own. A refresh due
        while the scheduler defers migration is owed, and done at the first step it allows."""
        due = (self.gen - 1) % self.refresh_every == 0 or self._owed
        if not due:
            return 0
        if self.scheduler is not None and not self.scheduler.may_migrate():
            self.deferred += 1
            self._owed = True
            return 0
        self._owed = False
        self.refreshes += 1
        if self.scheduler is not None:    # an upper bound: every kv head of every layer fetches `fetch` pages
            self.scheduler.record("fetch", self.refresh_bytes(), 0.0)
        return 1

    def refresh_bytes(self) -> int:
        """The most a refresh copies into the window: K and V of `fetch` pages per kv head and layer."""
        return 2 * self.L * self.nkv * self.fetch * self.ps * self.hd * self.wk.element_size()

    def scheduler_report(self) -> dict:
        """refreshes done; deferred: steps on which a due (or owed) refresh waited for bandwidth."""
        out = {"refreshes": self.refreshes, "deferred": self.deferred}
        if self.cold_file is not None:
            hf = self.host_fetch
            out.update(file_bytes=self.cold_file.nbytes, file_reads=hf.reads, file_read_bytes=hf.read_bytes,
                       file_read_s=round(hf.read_s, 4))
        if self.scheduler is not None:
            out.update(utilization=round(self.scheduler.utilization(), 3), deferring=self.scheduler.deferring,
                       transfers=self.scheduler.summary())
        return out

    def per_step(self, pos: torch.Tensor):
        self.pos = pos
        if self.takes_qkv:
            return
        self.mask = additive_mask((self.wpos >= 0) & (self.wpos <= pos), self.dtype).view(1, 1, 1, -1)

    def _page_lse(self, li, q, part=None, rope=None):
        """(nkv, grp, n): every query head's sketch log-sum-exp of every prefix page of layer li.
        rope: (cos, sin, pos) when q is before RoPE."""
        from zeroedge.kv.kernels import sketch_page_lse_q

        return sketch_page_lse_q(q, self.A[li], self.codes[li], self.scales[li], self.ps, part=part, rope=rope)

    def scores(self, li, q):
        """(nkv, n) page scores (-inf for sink and recent pages, which are always in the window)."""
        from zeroedge.kv.kernels import page_scores_ref

        return page_scores_ref(self._page_lse(li, q), self.page_bias)

    def _swap(self, li, q, rope=None, lse=None):
        """Up to `fetch` swaps a kv head: best missing page in, worst resident page out while the
        new one scores higher; the fetched pages' K and V go from the cold store into the slots.
        rope: (cos, sin, pos) when q is before RoPE; lse: the pages' sketch log-sum-exps from q,
        computed before (_page_lse; then q is not read)."""
        from zeroedge.kv.kernels import swap_pages

        S, pe = self.slots, self.ps * self.hd
        part = self.lse_parts[li % 2] if self.lse_parts is not None and lse is None else None
        if lse is None:
            lse = self._page_lse(li, q, part, rope)
        wk = self._slots(self.wk, li).view(self.nkv, S, pe)
        wv = self._slots(self.wv, li).view(self.nkv, S, pe)
        if self.host_fetch is not None:         # a cold store in a file: decide, read on the host, apply
            self.host_fetch.decide(lse, self.page_bias, self.page_slot[li], part)
            (self.on_host_read or self.host_read)(li)
            self.host_fetch.apply(self.page_slot[li], self.slot_page[li], wk, wv)
            return
        hk = self.hk[li].view(self.nkv, self.n, -1)
        hv = self.hv[li].view(self.nkv, self.n, -1)
        scales = None if self.cold == "host" else (self.cold_ks[li].view(self.nkv, self.n, -1),
                                                    self.cold_vs[li].view(self.nkv, self.n, -1))
        swap_pages(lse, self.page_bias, self.page_slot[li],
                   self.slot_page[li], wk, wv, hk, hv, self.fetch, part=part, scales=scales,
                   bits=None if self.cold == "host" else self.cold_bits)

    def attend(self, li, q, kv, flag):
        """q (H, hd), kv (2, nkv, hd) of the new token -> (H, hd)."""
        K, V = self.wk[li], self.wv[li]
        K.index_copy_(1, self.widx, kv[0][:, None])
        V.index_copy_(1, self.widx, kv[1][:, None])
        if flag and not self._late(li):
            self._own_refresh(li, q)
        o = F.scaled_dot_product_attention(q.view(1, self.H, 1, self.hd), K[None], V[None],
                                           attn_mask=self.mask, enable_gqa=True)
        if flag and self._late(li):
            self.qbuf[li].copy_(q)
            self._refresh_after(li)
        return o.view(self.H, self.hd)

    def attend_qkv(self, li, qkv, cos, sin, flag):
        """The new token's raw q/k/v projection -> (H, hd): RoPE, the window write and attention over
        the window's valid prefix in zeroedge.kv.decode_attention's kernels (attn="triton"). Lag 0:
        the refresh first, its sketch kernel rotating the raw query itself; lag 1: after, from the
        query after RoPE the attention kernel leaves in qbuf."""
        from zeroedge.kv.decode_attention import rope_attend

        late = self._late(li)
        if flag and not late:
            self._own_refresh(li, qkv.view(-1, self.hd)[:self.H], rope=(cos, sin, self.pos))
        o = rope_attend(qkv, cos, sin, self.pos, self.kv[:, li], self.H, self.shares, self.o, at=self.widx,
                        q_out=self.qbuf[li] if late else None)
        if flag and late:
            self._refresh_after(li)
        return o

    def _late(self, li) -> bool:
        """Layer li's refresh runs after its attention and serves the next step: lag 1, or ahead's layer 0."""
        return bool(self.lag or (self.ahead and li == 0))

    def _own_refresh(self, li, q, rope=None):
        """Before layer li's attention: its refresh from its own query (lag 0), or with ahead a wait
        for the one `layer_input` started from a predicted query."""
        if not self.ahead:
            self._swap(li, q, rope)
        elif self._refresh_beside:
            torch.cuda.current_stream().wait_event(self.ready[li])

    def layer_input(self, li, x, predict, flag):
        """The decoder's hook at layer li's input x (ahead only): the refreshes of the layers whose
        pages are scored from x (li + ahead; at layer 0, layers 1..ahead), each from the query
        predict(layer, x) -> (query, rope or None) gives; on CUDA on the side stream."""
        if not (flag and self.ahead):
            return
        for t in self._ahead_targets(li):
            if not self._refresh_beside:
                self._swap(t, *predict(t, x))
                continue
            side = self._fork(t)
            x.record_stream(side)
            with torch.cuda.stream(side):
                self._swap(t, *predict(t, x))
                self.ready[t].record()

    def _ahead_targets(self, li):
        """The layers whose pages are scored from layer li's input (ahead): li + ahead; at layer 0,
        layers 1..ahead."""
        if li == 0:
            return range(1, min(self.ahead, self.L - 1) + 1)
        return [li + self.ahead] if li + self.ahead < self.L else []

    def _fork(self, li):
        """Layer li's side stream (even or odd), made to wait for the step's work so far."""
        side = self.sides[li % 2]
        side.wait_stream(torch.cuda.current_stream())
        self._forked.add(li % 2)
        return side

    def _refresh_after(self, li):
        """Lag 1 (ahead: layer 0): layer li's refresh from its query in qbuf, after its attention; on CUDA on the side
        stream (nothing later in the step reads layer li's window or page tables; batching several
        layers' refreshes into one launch measured no faster on the H200)."""
        if not self._refresh_beside:
            self._swap(li, self.qbuf[li])
            return
        with torch.cuda.stream(self._fork(li)):
            self._swap(li, self.qbuf[li])

    # -- a speculative check (Decoder.verify): rows at positions pos.. in one pass, each as its own plain
    # step would run (its refresh, then its attention over the window as that refresh left it), so the
    # rows go through a layer one after the other; the next call settles how many rows were kept ---------
    def verify_begin(self, pos: int, T: int) -> list:
        """Places T rows at positions pos.. (window indices, positions) and returns each row's refresh
        flag, taken as its plain step would take it (flag)."""
        if self.host_fetch is not None:
            raise ValueError("a check of several rows needs the cold store in memory, not in a file")
        self.settle(pos)
        if T < 1 or self.gen + T > self.gen_len or pos < 0 or pos + T > self.max_len:
            raise ValueError(f"a check of {T} rows at position {pos} does not fit the window "
                             f"({self.gen_len - self.gen} generated tokens left)")
        first, flags, counters = self.gen, [], []
        for j in range(T):
            self.before(pos + j)
            flags.append(self.flag(pos + j))
            counters.append((self.refreshes, self.deferred, self._owed))
        # tables[li][j]: layer li's slot pages after row j's refresh (None: row j did not refresh)
        self._check = dict(pos=pos, first=first, T=T, flags=flags, counters=counters,
                           start=[None] * self.L, tables=[[None] * T for _ in range(self.L)],
                           predicted=[[None] * T for _ in range(self.L)])
        return flags

    def verify_predict(self, li, x, predict, pos):
        """The check's `layer_input` (ahead only): the predicted queries of the layers layer li's input
        x (T rows) scores pages for, one per row (predict(t, row, pos) -> query, rope), kept until
        those layers' rows attend."""
        c = self._check
        if not self.ahead or not any(c["flags"]):
            return
        for t in self._ahead_targets(li):
            c["predicted"][t] = [predict(t, x[j:j + 1], pos[j:j + 1]) if f else None
                                 for j, f in enumerate(c["flags"])]

    def verify_attend(self, li, q, kv, pos) -> torch.Tensor:
        """q (T, H, hd) after RoPE, kv (2, T, nkv, hd) of the check's rows at positions pos (T,) ->
        (T, H, hd): every row's K/V into the window and every refreshing row's page scores (the
        sketch read once for all rows: it does not change), then row by row its swaps (lag 0:
        before its attention, from its query or with ahead the predicted one; lag 1 and ahead's
        layer 0: after) and its attention over the window's positions up to its own."""
        c = self._check
        T = q.shape[0]
        at = torch.arange(self.gen0 + c["first"], self.gen0 + c["first"] + T, device=self.device)
        self.wk[li].index_copy_(1, at, kv[0].transpose(0, 1))
        self.wv[li].index_copy_(1, at, kv[1].transpose(0, 1))
        flags, late = c["flags"], self._late(li)
        lse = self._check_lse(li, q, [j for j in range(T) if flags[j]])
        if lse:
            c["start"][li] = self.slot_page[li].clone()
        out = []
        for j in range(T):
            if flags[j] and not late:
                self._swap(li, None, lse=lse[j])
            mask = additive_mask((self.wpos >= 0) & (self.wpos <= pos[j]), self.dtype).view(1, 1, 1, -1)
            out.append(F.scaled_dot_product_attention(q[j].view(1, self.H, 1, self.hd), self.wk[li][None],
                                                      self.wv[li][None], attn_mask=mask, enable_gqa=True))
            if flags[j] and late:
                self._swap(li, None, lse=lse[j])
            if flags[j]:
                c["tables"][li][j] = self.slot_page[li].clone()
        return torch.cat(out).view(T, self.H, self.hd)

    def _check_lse(self, li, q, rows) -> dict:
        """{row: (nkv, grp, n) page log-sum-exps} for the check's refreshing rows of layer li, in one
        sketch pass: from each row's query q[row] (after RoPE), or with ahead (layers past 0) its
        predicted one."""
        from zeroedge.kv.kernels import rope_rows

        if not rows:
            return {}
        if self.ahead and li > 0:
            qs = torch.stack([rope_rows(pq, *rope) for pq, rope in (self._check["predicted"][li][j] for j in rows)])
        else:
            qs = q[rows]
        n, grp = len(rows), self.H // self.nkv
        qs = qs.view(n, self.nkv, grp, self.hd).transpose(0, 1).reshape(self.nkv * n * grp, self.hd)
        lse = self._page_lse(li, qs).view(self.nkv, n, grp, -1)
        return {j: lse[:, i].contiguous() for i, j in enumerate(rows)}     # the swap kernel reads it dense

    def settle(self, pos: int) -> None:
        """The call after a check comes at position pos: the check's rows before pos are kept; the
        rest are undone (their window entries, their refreshes: slot pages back to what the last
        kept row left, fetched again from the cold store, and the refresh counters)."""
        c, self._check = self._check, None
        if c is None:
            return
        kept = pos - c["pos"]
        if not 1 <= kept <= c["T"]:
            raise ValueError(f"after a check of {c['T']} rows at position {c['pos']} the next position is "
                             f"{c['pos'] + 1}..{c['pos'] + c['T']}, not {pos}")
        if kept == c["T"]:
            return
        self.gen = c["first"] + kept
        self.wpos[self.gen0 + self.gen:self.gen0 + c["first"] + c["T"]] = -1
        self.refreshes, self.deferred, self._owed = c["counters"][kept - 1]
        for li in range(self.L):
            if c["start"][li] is None:
                continue
            back = next((t for t in reversed(c["tables"][li][:kept]) if t is not None), c["start"][li])
            self._restore(li, back)

    def _restore(self, li, slot_page):
        """Layer li's slot pages set to `slot_page` (nkv, S): the slots that differ take their page from
        the cold store, as a fetch brings it (swap_pages), and the page table follows."""
        from zeroedge.kv.tiers import dequantize

        cur = self.slot_page[li]
        h, s = torch.nonzero(cur != slot_page, as_tuple=True)
        if h.numel() == 0:
            return
        page = slot_page[h, s]
        cur[h, s] = page
        self.page_slot[li].fill_(-1)
        self.page_slot[li].scatter_(1, cur, self.ar_slots[None].expand(self.nkv, -1).contiguous())
        pe = self.ps * self.hd
        for w, cold, sc in ((self.wk, self.hk, self.cold_ks), (self.wv, self.hv, self.cold_vs)):
            slots = self._slots(w, li).view(self.nkv, self.slots, pe)
            src = cold[li].view(self.nkv, self.n, -1)[h, page]
            if sc is None:
                slots[h, s] = src.to(slots.dtype)
            else:
                scale = sc[li].view(self.nkv, self.n, -1)[h, page]
                slots[h, s] = dequantize(src, scale, self.cold_bits, pe // scale.shape[-1], slots.dtype)

    def finish(self):
        """End of a step: the step (and its CUDA graph) waits for the side streams' refreshes (only
        those it forked: a graph may not wait on a stream outside its capture)."""
        for i in sorted(self._forked):
            torch.cuda.current_stream().wait_stream(self.sides[i])
        self._forked = set()
