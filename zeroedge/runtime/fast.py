"""Fast decode loops over the reference model's weights: static shapes, one CUDA graph a step.

`DenseDecoder`   the dense baseline (issue 5 uses it too): a static KV cache of `max_len`
                 positions; q/k/v and gate/up weights fused into one matrix each (one GEMV
                 instead of three / two); RMSNorm through F.rms_norm; RoPE for q and k in one
                 roll + multiply-add from a table indexed by a device position; GQA attention by
                 SDPA (enable_gqa, an additive mask built once a step) or two batched matmuls;
                 the whole step captured in one CUDA graph and replayed.
`ThermalDecoder` the same step with a thermal cache: per layer and kv head the device keeps one
                 contiguous window = [sink page | recent window | generated tokens | `slots` pages],
                 the low-rank int4 key sketch of every prefix page and its bases; every prefix page
                 also lives in the cold store (host memory, pinned and mapped on a discrete GPU).
                 Every `refresh_every` steps each kv head scores all pages by the sketch (a fused
                 Triton kernel) and swaps up to `fetch` pages (best missing in, worst resident
                 out while the new one scores higher), copying them straight from host memory
                 into the window in the same kernel, inside the graph (no host round trip);
                 attention reads only the window.

Both take a `zeroedge.model.Transformer` (cast it with `.to(device, dtype)` first) and read its
weights; on CPU they run eagerly (tests), on CUDA `graph=True` captures.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


class _Weights:
    """Per-layer fused weights (views of nothing: concatenated copies, built once per model)."""

    def __init__(self, model):
        self.layers = []
        for blk in model.layers:
            a, mlp = blk.self_attn, blk.mlp
            wqkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0)
            bqkv = (torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], 0)
                    if a.q_proj.bias is not None else None)
            w13 = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0)
            self.layers.append(dict(
                ln1=blk.input_layernorm.weight, eps1=blk.input_layernorm.eps, wqkv=wqkv, bqkv=bqkv,
                wo=a.o_proj.weight, ln2=blk.post_attention_layernorm.weight,
                eps2=blk.post_attention_layernorm.eps, w13=w13, w2=mlp.down_proj.weight))


def fused_weights(model) -> _Weights:
    w = getattr(model, "_zeroedge_fused", None)
    if w is None:
        with torch.no_grad():
            w = _Weights(model)
        object.__setattr__(model, "_zeroedge_fused", w)
    return w


def _layer_in_fn(x, ln1, eps: float, wqkv, bqkv, cos, sin, H: int, nkv: int, hd: int):
    """-> q (H, hd) after RoPE, kv (2, nkv, hd): the new token's key (after RoPE) and value stacked,
    so the cache takes them in one write (and compiled, the stack fuses into the RoPE kernel)."""
    h = F.rms_norm(x, (x.shape[-1],), ln1, eps)
    qkv = F.linear(h, wqkv, bqkv).view(H + 2 * nkv, hd)
    qk = qkv[: H + nkv]
    qk = torch.addcmul(qk * cos, qk.roll(hd // 2, -1), sin)
    return qk[:H], torch.stack((qk[H:], qkv[H + nkv:]))


def _layer_out_fn(x, o, wo, ln2, eps: float, w13, w2):
    x = x + F.linear(o.reshape(1, -1), wo)
    h = F.rms_norm(x, (x.shape[-1],), ln2, eps)
    g, u = F.linear(h, w13).chunk(2, -1)
    return x + F.linear(F.silu(g) * u, w2)


_COMPILED = {}


def _compiled(fn):
    """torch.compile'd once per process (shapes are the same for every layer and context)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False, fullgraph=True)
    return _COMPILED[fn]


class _Step:
    compile = False

    def __init__(self, model, max_len: int, graph: bool):
        self.m = model
        cfg = model.cfg
        self.cfg = cfg
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.hd, self.nkv, self.H = cfg.head_dim, cfg.n_kv_heads, cfg.n_heads
        if model.layers[0].self_attn.kept_heads.numel() != self.H:
            raise ValueError("the fast decoders need unpruned attention heads")
        self.grp = self.H // self.nkv
        self.max_len = max_len
        self.W = fused_weights(model)
        pos = torch.arange(max_len, device=self.device, dtype=torch.float32)
        f = torch.outer(pos, model.inv_freq.to(self.device).float())
        self.cos = torch.cat((f, f), -1).cos().to(self.dtype)
        s = f.sin()
        self.sin_signed = torch.cat((-s, s), -1).to(self.dtype)      # rotate_half folded into sign
        self.tok = torch.zeros(1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.graph_wanted = graph and self.device.type == "cuda"
        self.graphs = {}
        self.outs = {}

    def _layer_in(self, w, x, cos, sin):
        """-> q, k, v; the stacked (2, nkv, hd) k / v stays in self._kv for a single cache write."""
        f = _compiled(_layer_in_fn) if self.compile else _layer_in_fn
        q, self._kv = f(x, w["ln1"], w["eps1"], w["wqkv"], w["bqkv"], cos, sin, self.H, self.nkv, self.hd)
        return q, self._kv[0], self._kv[1]

    def _layer_out(self, w, x, o):
        f = _compiled(_layer_out_fn) if self.compile else _layer_out_fn
        return f(x, o, w["wo"], w["ln2"], w["eps2"], w["w13"], w["w2"])

    def _forward(self, flag):
        m = self.m
        cos = self.cos.index_select(0, self.pos)
        sin = self.sin_signed.index_select(0, self.pos)
        x = m.embed_tokens(self.tok)                     # (1, dim)
        self._per_step()
        for li, w in enumerate(self.W.layers):
            q, k, v = self._layer_in(w, x, cos, sin)
            o = self._attend(li, q, k, v, flag)          # (H, hd)
            x = self._layer_out(w, x, o)
        return m.lm_head(m.norm(x))[0]

    def _per_step(self):
        pass

    def _flag(self, pos):
        return 0

    def step(self, token: int, pos: int):
        """One decode step at position `pos`; returns logits (vocab,) (a static buffer on CUDA)."""
        self.tok.fill_(int(token))
        self.pos.fill_(int(pos))
        self._before(pos)
        flag = self._flag(pos)
        if not self.graph_wanted:
            with torch.no_grad():
                return self._forward(flag)
        if flag not in self.graphs:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s), torch.no_grad():
                for _ in range(2):
                    self._forward(flag)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g), torch.no_grad():
                self.outs[flag] = self._forward(flag)
            self.graphs[flag] = g
        self.graphs[flag].replay()
        return self.outs[flag]

    def _before(self, pos):
        pass


class DenseDecoder(_Step):
    def __init__(self, model, max_len: int, graph: bool = True, attn: str = "sdpa"):
        super().__init__(model, max_len, graph)
        if attn not in ("bmm", "sdpa"):
            raise ValueError("attn must be 'bmm' or 'sdpa'")
        self.attn = attn
        L = len(model.layers)
        # K and V of a layer side by side, so one index_copy writes the new token's pair
        self.kv = torch.zeros((L, 2, self.nkv, max_len, self.hd), device=self.device, dtype=self.dtype)
        self.k, self.v = self.kv[:, 0], self.kv[:, 1]
        self.kpos = torch.arange(max_len, device=self.device)

    def kv_bytes(self, n_tokens: Optional[int] = None) -> int:
        n = self.max_len if n_tokens is None else n_tokens
        return 2 * len(self.m.layers) * self.nkv * n * self.hd * self.k.element_size()

    def load_prefix(self, ks, vs):
        """ks, vs: per layer (nkv, P, hd) keys (rope applied) and values."""
        for li, (k, v) in enumerate(zip(ks, vs)):
            self.k[li, :, : k.shape[1]] = k
            self.v[li, :, : v.shape[1]] = v

    def _per_step(self):
        self.mask = (self.kpos <= self.pos)
        if self.attn == "sdpa":  # additive, built once a step (SDPA would convert a bool mask per layer)
            self.amask = _additive(self.mask, self.dtype).view(1, 1, 1, -1)

    def _attend(self, li, q, k, v, flag):
        K, V = self.k[li], self.v[li]
        if getattr(self, "_kv", None) is not None and self._kv[0].data_ptr() == k.data_ptr():
            self.kv[li].index_copy_(2, self.pos, self._kv[:, :, None])
        else:
            K.index_copy_(1, self.pos, k[:, None])
            V.index_copy_(1, self.pos, v[:, None])
        if self.attn == "sdpa":
            o = F.scaled_dot_product_attention(q.view(1, self.H, 1, self.hd), K[None], V[None],
                                               attn_mask=self.amask, enable_gqa=True)
            return o.view(self.H, self.hd)
        qg = q.view(self.nkv, self.grp, self.hd)
        s = torch.bmm(qg, K.transpose(1, 2)).float() / math.sqrt(self.hd)
        s = s.masked_fill(~self.mask, float("-inf"))
        return torch.bmm(s.softmax(-1).to(self.dtype), V).view(self.H, self.hd)


def _additive(valid: torch.Tensor, dtype) -> torch.Tensor:
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


def sketch_bases(k, qcov=None, rank: int = 16, eps: float = 1e-2):
    """(A, B, mu) for keys k (nkv, P, hd): coords = (k - mu) @ B, query side q @ A (see
    zeroedge.kv.evaluate.Sketch: query-aware when the query covariance is given)."""
    nkv, P, hd = k.shape
    kf = k.float()
    mu = kf.mean(1, keepdim=True)
    c = kf - mu
    if qcov is not None:
        cq = qcov.float() / qcov.float().diagonal(dim1=1, dim2=2).mean(-1)[:, None, None]
        cq = cq + eps * torch.eye(hd, device=k.device)
        e, V = torch.linalg.eigh(cq)
        W = V @ torch.diag_embed(e.sqrt()) @ V.transpose(1, 2)
        Wi = V @ torch.diag_embed(e.rsqrt()) @ V.transpose(1, 2)
    else:
        W = Wi = torch.eye(hd, device=k.device).expand(nkv, hd, hd)
    cw = c @ W
    _, U = torch.linalg.eigh(cw.transpose(1, 2) @ cw)
    U = U[:, :, -rank:].flip(-1)
    return Wi @ U, W @ U, mu


class ThermalDecoder(_Step):
    """Decode over a prefix of P tokens with a thermal cache (see module doc)."""

    def __init__(self, model, prefix_len: int, gen_len: int, budget: float = 0.1,
                 page_size: int = 16, rank: int = 16, recent_pages: int = 2, sink_pages: int = 1,
                 fetch: int = 4, refresh_every: int = 1, graph: bool = True):
        super().__init__(model, prefix_len + gen_len, graph)
        if prefix_len % page_size:
            raise ValueError(f"page size {page_size} does not divide the prefix ({prefix_len})")
        if not 0 < budget <= 1:
            raise ValueError("budget must be in (0, 1]")
        if rank % 2:
            raise ValueError("rank must be even (int4 codes are packed two a byte)")
        L, nkv, hd = len(model.layers), self.nkv, self.hd
        self.P, self.ps, self.n = prefix_len, page_size, prefix_len // page_size
        self.rank, self.fetch, self.refresh_every = rank, fetch, max(1, refresh_every)
        total_pages = max(1, int(round(budget * prefix_len)) // page_size)
        self.fixed = sink_pages + recent_pages
        self.slots = max(1, min(total_pages - self.fixed, self.n - self.fixed))
        self.fetch = min(fetch, self.slots)
        self.sink_pages, self.recent_pages = sink_pages, recent_pages
        dev, dt = self.device, self.dtype
        pin = dev.type == "cuda"
        # cold store: every prefix page, in host memory
        self.host_k = torch.zeros(L, nkv, self.n, page_size, hd, dtype=dt, pin_memory=pin)
        self.host_v = torch.zeros_like(self.host_k, pin_memory=pin) if pin else torch.zeros_like(self.host_k)
        # device window: [fixed tokens | generated tokens | slot pages]
        self.fix_len = self.fixed * page_size + gen_len
        self.win_len = self.fix_len + self.slots * page_size
        self.wk = torch.zeros(L, nkv, self.win_len, hd, device=dev, dtype=dt)
        self.wv = torch.zeros_like(self.wk)
        self.wpos = torch.full((self.win_len,), -1, dtype=torch.long, device=dev)
        self.slot_page = torch.zeros(L, nkv, self.slots, dtype=torch.long, device=dev)
        self.page_slot = torch.full((L, nkv, self.n), -1, dtype=torch.long, device=dev)
        # summaries: query / key bases, int4 codes (packed), per (page, direction) scales
        self.A = torch.zeros(L, nkv, hd, rank, device=dev, dtype=torch.float32)
        self.codes = torch.zeros(L, nkv, prefix_len, rank // 2, device=dev, dtype=torch.uint8)
        self.scales = torch.zeros(L, nkv, self.n, rank, device=dev, dtype=torch.float16)
        self.page_bias = torch.zeros(self.n, device=dev)
        self.page_bias[:sink_pages] = float("-inf")
        if recent_pages:
            self.page_bias[self.n - recent_pages:] = float("-inf")
        self.hk = self.hv = None
        self.gen = 0
        self.widx = torch.zeros(1, dtype=torch.long, device=dev)
        self.use_triton = dev.type == "cuda"
        self.ar_slots = torch.arange(self.slots, device=dev)
        # per-block shares of each query head's log-sum-exp over pages, written by the sketch
        # kernel for the two-stage swap (CUDA)
        from zeroedge.runtime.kernels import part_blocks
        nb = part_blocks(self.n)
        self.lse_part = (torch.empty(self.nkv, self.H // self.nkv, nb, device=dev),
                         torch.empty(self.nkv, self.H // self.nkv, nb, device=dev)) if pin else None

    def device_kv_bytes(self) -> dict:
        el = self.wk.element_size()
        L, nkv, hd, ps = len(self.m.layers), self.nkv, self.hd, self.ps
        hot = 2 * L * nkv * (self.fixed + self.slots) * ps * hd * el
        summ = (self.codes.numel() + self.scales.numel() * 2 + self.A.numel() * 2)
        full = 2 * L * nkv * self.P * hd * el
        return {"hot": hot, "summaries": summ, "generated": 2 * L * nkv * (self.fix_len - self.fixed * ps) * hd * el,
                "prefix_full": full, "page_table": 8 * L * nkv * self.n}

    def load_prefix(self, ks, vs, qcovs=None):
        """ks, vs: per layer (nkv, P, hd); qcovs: optional per layer (nkv, hd, hd) query
        covariances (query-aware sketch). Fills cold store, fixed window, slots, summaries."""
        from zeroedge.runtime.kernels import pack_int4

        ps, n, r, dev = self.ps, self.n, self.rank, self.device
        fix_idx = torch.cat([torch.arange(self.sink_pages * ps),
                             torch.arange(self.P - self.recent_pages * ps, self.P)]).to(dev)
        nf = fix_idx.numel()
        self.wpos[:nf] = fix_idx
        first = torch.arange(self.n - self.recent_pages - self.slots, self.n - self.recent_pages,
                             device=dev).clamp_min(self.sink_pages)
        for li, (k, v) in enumerate(zip(ks, vs)):
            kd, vd = k.to(dev), v.to(dev)
            self.host_k[li].copy_(kd.view(self.nkv, n, ps, self.hd))
            self.host_v[li].copy_(vd.view(self.nkv, n, ps, self.hd))
            self.wk[li, :, :nf] = kd[:, fix_idx]
            self.wv[li, :, :nf] = vd[:, fix_idx]
            A, B, mu = sketch_bases(kd, None if qcovs is None else qcovs[li].to(dev), r)
            coords = ((kd.float() - mu) @ B).view(self.nkv, n, ps, r)
            sc = (coords.abs().amax(2, keepdim=True) / 7).clamp_min(1e-8).half()
            codes = torch.round(coords / sc.float()).clamp(-7, 7)
            self.A[li] = A
            self.scales[li] = sc.view(self.nkv, n, r)
            self.codes[li] = pack_int4(codes.view(self.nkv, self.P, r))
            self.slot_page[li] = first[None].expand(self.nkv, -1)
            self.page_slot[li].fill_(-1)
            self.page_slot[li].scatter_(1, self.slot_page[li], self.ar_slots[None].expand(self.nkv, -1).contiguous())
            sl = self.wk[li, :, self.fix_len:].view(self.nkv, self.slots, ps, self.hd)
            sl.copy_(kd.view(self.nkv, n, ps, self.hd)[:, first])
            self.wv[li, :, self.fix_len:].view(self.nkv, self.slots, ps, self.hd).copy_(
                vd.view(self.nkv, n, ps, self.hd)[:, first])
        self.wpos[self.fix_len:] = 0                    # slot tokens are prefix positions: valid
        if dev.type == "cuda":
            self.hk, self.hv = host_mapped(self.host_k), host_mapped(self.host_v)
        else:
            self.hk, self.hv = self.host_k, self.host_v

    def _before(self, pos):
        i = self.fixed * self.ps + self.gen
        if i >= self.fix_len:
            raise ValueError(f"generated more than the {self.fix_len - self.fixed * self.ps} tokens planned")
        self.wpos[i] = pos
        self.widx.fill_(i)
        self.gen += 1

    def _flag(self, pos):
        return 1 if (self.gen - 1) % self.refresh_every == 0 else 0

    def _per_step(self):
        self.mask = _additive((self.wpos >= 0) & (self.wpos <= self.pos), self.dtype).view(1, 1, 1, -1)

    def _page_lse(self, li, q, part=None):
        """(nkv, grp, n): every query head's sketch log-sum-exp of every prefix page."""
        from zeroedge.runtime.kernels import sketch_page_lse_q

        return sketch_page_lse_q(q, self.A[li], self.codes[li], self.scales[li], self.ps, part=part)

    def _score(self, li, q):
        """(nkv, n) page scores (-inf for sink and recent pages, which are always in the window)."""
        from zeroedge.runtime.kernels import page_scores_ref

        return page_scores_ref(self._page_lse(li, q), self.page_bias)

    def _swap(self, li, q):
        """Up to `fetch` swaps a kv head: best missing page in, worst resident page out while the
        new one scores higher; the fetched pages' K and V go from the cold store into the slots."""
        from zeroedge.runtime.kernels import swap_pages

        S, pe = self.slots, self.ps * self.hd
        wk = self.wk[li, :, self.fix_len:].view(self.nkv, S, pe)
        wv = self.wv[li, :, self.fix_len:].view(self.nkv, S, pe)
        hk = self.hk[li].view(self.nkv, self.n, pe)
        hv = self.hv[li].view(self.nkv, self.n, pe)
        swap_pages(self._page_lse(li, q, self.lse_part), self.page_bias, self.page_slot[li],
                   self.slot_page[li], wk, wv, hk, hv, self.fetch, part=self.lse_part)

    def _attend(self, li, q, k, v, flag):
        K, V = self.wk[li], self.wv[li]
        K.index_copy_(1, self.widx, k[:, None])
        V.index_copy_(1, self.widx, v[:, None])
        if flag:
            self._swap(li, q)
        o = F.scaled_dot_product_attention(q.view(1, self.H, 1, self.hd), K[None], V[None],
                                           attn_mask=self.mask, enable_gqa=True)
        return o.view(self.H, self.hd)
