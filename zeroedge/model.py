"""A readable Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, static KV cache.

One file, gpt-fast style. The zero mechanisms (SIH/PAD, head pruning) are not in here: they wrap a
block's `mlp` or change its `kept_heads`, so this file stays the plain dense reference.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

# SDPA shares kv heads among query heads (enable_gqa) from torch 2.5; before, K/V are expanded
SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 8192
    tie_embeddings: bool = True
    qkv_bias: bool = False                       # Qwen2 has biases on q, k, v
    rope_scaling: Optional[dict] = None          # Llama 3 "llama3" frequency scaling
    name: str = "custom"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    def with_(self, **kw) -> "ModelConfig":
        return replace(self, **kw)


PRESETS = {
    "smollm2-135m": ModelConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                                ffn_dim=1536, rope_theta=1e5, norm_eps=1e-5, max_seq_len=8192,
                                name="smollm2-135m"),
    "llama-3.2-1b": ModelConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                                ffn_dim=8192, rope_theta=5e5, norm_eps=1e-5, max_seq_len=131072,
                                rope_scaling={"factor": 32.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192},
                                name="llama-3.2-1b"),
    "qwen2.5-0.5b": ModelConfig(vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2,
                                ffn_dim=4864, rope_theta=1e6, norm_eps=1e-6, max_seq_len=32768,
                                qkv_bias=True, name="qwen2.5-0.5b"),
    "tiny": ModelConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128,
                        rope_theta=1e4, max_seq_len=512, name="tiny"),
}


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,), with Llama 3's long-context scaling when configured."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    s = cfg.rope_scaling
    if s:
        low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
        high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > low_wl, inv / s["factor"], inv)
        smooth = (s["original_max_position_embeddings"] / wl - s["low_freq_factor"]) / (
            s["high_freq_factor"] - s["low_freq_factor"])
        mid = (1 - smooth) * scaled / s["factor"] + smooth * scaled
        inv = torch.where((wl >= high_wl) & (wl <= low_wl), mid, scaled)
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, hd); cos/sin: (T, hd). Half-split rotation (HF Llama layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_basis(hd: int, dtype=torch.float32, device=None) -> tuple:
    """(I, R) [hd, hd]: the identity and the signed permutation of the half split, x @ R ==
    cat(-x2, x1) (rope_matrix's constants)."""
    r = torch.zeros(hd, hd, dtype=dtype, device=device)
    half = torch.arange(hd // 2, device=device)
    r[half + hd // 2, half] = -1.0
    r[half, half + hd // 2] = 1.0
    return torch.eye(hd, dtype=dtype, device=device), r


def rope_matrix(cos: torch.Tensor, sin: torch.Tensor, basis: Optional[tuple] = None) -> torch.Tensor:
    """apply_rope at one position as a matrix: cos/sin (..., hd) -> M (..., hd, hd) with
    x @ M == apply_rope(x, cos, sin) (up to float rounding): diag(cos) + R diag(sin), R the signed
    permutation of the half split. A decode step builds it once and rotates q and k with one small
    MatMul (the ONNX decode graph) instead of slices, a negation and a concat per head tensor.
    basis: rope_basis(hd), given as constants (the ONNX decode graph: not rebuilt from traced shapes)."""
    eye, r = basis if basis is not None else rope_basis(cos.shape[-1], cos.dtype, cos.device)
    return eye * cos[..., None, :] + r * sin[..., None, :]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class KVCache(nn.Module):
    """Static cache: (B, n_kv, max_len, hd) per layer; positions written in place. With
    track_queries, also the sum over the queries it saw of q^T q per kv head (fp32, batch 0): the
    query covariance the thermal KV sketch is fitted to."""

    def __init__(self, batch: int, n_kv: int, max_len: int, head_dim: int, dtype, device=None,
                 track_queries: bool = False, buffers=None):
        super().__init__()
        shape = (batch, n_kv, max_len, head_dim)
        k, v = buffers if buffers is not None else (torch.zeros(shape, dtype=dtype, device=device),
                                                    torch.zeros(shape, dtype=dtype, device=device))
        if k.shape[:2] != shape[:2] or k.shape[2] < max_len or k.shape != v.shape:
            raise ValueError(f"cache buffers of shape {tuple(k.shape)} do not hold {shape}")
        self.register_buffer("k", k, persistent=False)     # given buffers: written in place, not copied
        self.register_buffer("v", v, persistent=False)
        self.qcov = (torch.zeros(n_kv, head_dim, head_dim, device=device, dtype=torch.float32)
                     if track_queries else None)

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor, q=None, kv_index=None):
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        if self.qcov is not None and q is not None:
            qf = q[0].float()
            self.qcov.index_add_(0, kv_index, qf.transpose(1, 2) @ qf)
        return self.k[:, :, :end], self.v[:, :, :end]

    def layer_kv(self, n: int, which: int):
        """K (which 0) or V (1) of the first n positions, batch 0: (n_kv, n, hd), a view."""
        return (self.k if which == 0 else self.v)[0, :, :n]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        # query heads still computed; head pruning shrinks q_proj/o_proj and this index
        self.register_buffer("kept_heads", torch.arange(cfg.n_heads), persistent=False)
        self.kv_cache: Optional[KVCache] = None
        self.record_probs = False       # keep softmax probabilities of the last call (profiling)
        self.last_probs: Optional[torch.Tensor] = None

    def prune_heads(self, heads_to_drop):
        """Remove query heads for good: their q rows and o columns are sliced out of the weights."""
        drop = set(int(h) for h in heads_to_drop)
        kept_now = self.kept_heads.tolist()
        keep_local = [i for i, h in enumerate(kept_now) if h not in drop]
        if not keep_local:
            raise ValueError("cannot prune every head of a layer")
        hd = self.cfg.head_dim
        rows = torch.cat([torch.arange(i * hd, (i + 1) * hd) for i in keep_local])
        q = nn.Linear(self.cfg.dim, len(rows), bias=self.q_proj.bias is not None)
        q.weight.data = self.q_proj.weight.data[rows].clone()
        if self.q_proj.bias is not None:
            q.bias.data = self.q_proj.bias.data[rows].clone()
        o = nn.Linear(len(rows), self.cfg.dim, bias=False)
        o.weight.data = self.o_proj.weight.data[:, rows].clone()
        self.q_proj, self.o_proj = q.to(self.q_proj.weight), o.to(self.o_proj.weight)
        self.kept_heads = self.kept_heads[keep_local]

    def project(self, x, cos, sin, rope=None):
        """x (B, T, D) -> q (B, h, T, hd), k, v (B, nkv, T, hd), RoPE applied to q and k: the one
        definition of the attention's input side (the ONNX export and the KV evaluator call it; the
        fast decoder runs the same arithmetic on fused weights, zeroedge.runtime.fast). One token
        (T = 1) may give the rotation as rope = (M for q, M for k), (B, 1, hd, hd) rope_matrix's
        (the ONNX decode graph: the batch is traced as -1, so no shape arithmetic)."""
        hd, nkv = self.cfg.head_dim, self.cfg.n_kv_heads
        h = self.kept_heads.numel()
        if rope is not None:
            q = self.q_proj(x).reshape(-1, h, 1, hd) @ rope[0]
            k = self.k_proj(x).reshape(-1, nkv, 1, hd) @ rope[1]
            return q, k, self.v_proj(x).reshape(-1, nkv, 1, hd)
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, h, hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, nkv, hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, nkv, hd).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, start: int, mask: Optional[torch.Tensor]):
        B, T, _ = x.shape
        hd, nkv = self.cfg.head_dim, self.cfg.n_kv_heads
        h = self.kept_heads.numel()
        q, k, v = self.project(x, cos, sin)
        group = self.cfg.n_heads // nkv
        kv_index = self.kept_heads // group
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(start, k, v, q, kv_index)
        if h == self.cfg.n_heads and not self.record_probs and SDPA_GQA:
            # every head kept: each kv head serves its query group without a copy of the past per query
            # head. A chunk over a cache (mask: a lower-right causal bias) runs one SDPA per position in
            # the group (query heads g, g + group, ... pair one to one with the kv heads), as the
            # kernels that take such a bias would otherwise expand K/V to every query head
            if mask is not None and group > 1:
                out = torch.empty_like(q)
                for g in range(group):
                    out[:, g::group] = F.scaled_dot_product_attention(q[:, g::group], k, v, attn_mask=mask)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                                     enable_gqa=group > 1)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, h * hd))
        k, v = k.index_select(1, kv_index), v.index_select(1, kv_index)
        if self.record_probs:
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            if mask is None:
                mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=q.device).tril()
            elif not isinstance(mask, torch.Tensor):                   # a lower-right causal bias
                mask = mask._materialize(q.device)
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = scores.float().softmax(-1).to(q.dtype)
            self.last_probs = probs
            out = probs @ v
        else:
            # mask None = square causal (prefill from 0): lets SDPA use its fused causal kernel
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                 is_causal=mask is None and T > 1)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, h * hd))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg.dim, cfg.ffn_dim)

    def forward(self, x, cos, sin, start, mask):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, start, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)
        self.cache_len = 0

    # --- cache ---------------------------------------------------------------------------------
    def setup_cache(self, batch: int, max_len: int, dtype=None, track_queries: bool = False, buffers=None,
                    caches=None):
        """A KV cache per layer; `buffers`: per layer (k, v) tensors (batch, n_kv, >= max_len, hd) the
        cache writes into (a decoder's own cache), else new zeros; `caches`: per layer cache objects
        to use as they are (KVCache's update / layer_kv / qcov, e.g. zeroedge.kv.tiers.QuantKVCache)."""
        dtype = dtype or self.embed_tokens.weight.dtype
        dev = self.embed_tokens.weight.device
        for i, b in enumerate(self.layers):
            b.self_attn.kv_cache = caches[i] if caches is not None else KVCache(
                batch, self.cfg.n_kv_heads, max_len, self.cfg.head_dim, dtype, dev, track_queries,
                None if buffers is None else buffers[i])
        self.cache_len = max_len

    def drop_cache(self):
        for b in self.layers:
            b.self_attn.kv_cache = None
        self.cache_len = 0

    # --- forward -------------------------------------------------------------------------------
    def rope(self, start: int, T: int):
        pos = torch.arange(start, start + T, device=self.inv_freq.device, dtype=torch.float32)
        f = torch.outer(pos, self.inv_freq)
        emb = torch.cat((f, f), dim=-1)
        dt = self.embed_tokens.weight.dtype
        return emb.cos().to(dt), emb.sin().to(dt)

    def causal_mask(self, start: int, T: int):
        """Queries at start..start+T over keys 0..start+T, causal: a lower-right causal bias that SDPA
        applies without materialising a (T, start+T) mask (a chunk of 2048 over a 128K cache would
        take 0.75 GB in bf16)."""
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(T, start + T)

    def hidden_states(self, tokens: torch.Tensor, start: int = 0, return_all: bool = False,
                      first_layer: int = 0, x: Optional[torch.Tensor] = None):
        """Run the decoder; returns the final normalised hidden state (and each layer's input).

        With `x` and `first_layer`, resume from that layer's input (tokens then only give T)."""
        B, T = tokens.shape
        if self.cache_len and start + T > self.cache_len:
            raise ValueError(f"positions {start}..{start + T} exceed the cache ({self.cache_len})")
        if start > 0 and not self.cache_len:
            raise ValueError("start > 0 needs a KV cache (call setup_cache first)")
        cos, sin = self.rope(start, T)
        mask = None if start == 0 else self.causal_mask(start, T)
        x = self.embed_tokens(tokens) if x is None else x
        inputs = []
        for b in self.layers[first_layer:]:
            if return_all:
                inputs.append(x)
            x = b(x, cos, sin, start, mask)
        x = self.norm(x)
        return (x, inputs) if return_all else x

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        return self.lm_head(self.hidden_states(tokens, start))


PREFILL_CHUNK = 2048   # prompt tokens a prefill step runs at once: activations are bounded by it
# prompt tokens a compressed-cache prefill runs a layer at a time (the span's hidden states held): a
# layer's past is read from the cold store once a span, not once a chunk
PREFILL_SPAN = 16384


class LayerKV:
    """The prefill's K (which 0) or V (1) per layer, (n_kv, n, hd) each, read from its caches when
    indexed: a compressed cache dequantizes one layer at a time."""

    def __init__(self, caches, n: int, which: int):
        self.caches, self.n, self.which = caches, n, which

    def __len__(self):
        return len(self.caches)

    def __getitem__(self, i):
        return self.caches[i].layer_kv(self.n, self.which)


def chunked_prefill(model, ids, chunk: int = PREFILL_CHUNK, into=None, caches=None, return_last: bool = False,
                    span: int = PREFILL_SPAN):
    """K and V (rope applied) of ids per layer (LayerKV, (n_kv, T, hd) each) and each layer's query
    covariance (n_kv, hd, hd) (the thermal sketch's), running the prompt through the model `chunk`
    tokens at a time against its KV cache, so a long prompt's activations (the attention scores
    above all) are those of one chunk, not of the whole prompt. `into`: per layer (k, v) tensors
    (n_kv, >= T, hd) to write into (a dense decoder's cache: no second copy); `caches`: per layer
    cache objects to prefill into (a thermal decoder's compressed cold store, QuantKVCache). Caches
    that can hold a span (QuantKVCache.hold) run `span` tokens a layer at a time, chunk by chunk:
    the same arithmetic, but each layer's past is read from the store once a span instead of once
    a chunk. With return_last, also the final normalised hidden state of the last token (D,)."""
    dev = next(model.parameters()).device
    T = len(ids)
    if caches is None:
        model.setup_cache(1, T, track_queries=True,
                          buffers=None if into is None else [(k[None], v[None]) for k, v in into])
    else:
        model.setup_cache(1, T, caches=caches)
    try:
        t = torch.tensor([ids], device=dev)
        with torch.inference_mode():
            if caches is not None and all(hasattr(c, "hold") for c in caches):
                span = max(1, span // chunk) * chunk        # whole chunks: the chunks of the loop below
                for a in range(0, T, span):
                    x = _prefill_span(model, t[:, a:a + span], a, chunk)
            else:
                for s in range(0, T, chunk):
                    x = model.hidden_states(t[:, s:s + chunk], start=s)
        used = [b.self_attn.kv_cache for b in model.layers]
    finally:
        model.drop_cache()
    out = (LayerKV(used, T, 0), LayerKV(used, T, 1), [c.qcov / T for c in used])
    return out + (x[0, -1],) if return_last else out


def _prefill_span(model, tokens, start: int, chunk: int):
    """The span tokens (1, S) at positions start.. through every layer, a layer at a time and chunk
    by chunk within it, each layer's cache holding the span's K/V; returns the final normalised
    hidden states of the span's last chunk (1, n, D) (as the chunk loop: only its last row is used)."""
    S = tokens.shape[1]
    x = model.embed_tokens(tokens)
    for b in model.layers:
        cache = b.self_attn.kv_cache
        cache.hold(start, start + S)
        try:
            for s in range(0, S, chunk):
                n = min(chunk, S - s)
                cos, sin = model.rope(start + s, n)
                mask = None if start + s == 0 else model.causal_mask(start + s, n)
                x[:, s:s + n] = b(x[:, s:s + n], cos, sin, start + s, mask)
        finally:
            cache.release()
    return model.norm(x[:, (S - 1) // chunk * chunk:])


def build(cfg_or_name, dtype=torch.float32, seed: Optional[int] = None) -> Transformer:
    """A model of a preset's (or config's) shape; random weights with `seed` (std 0.02)."""
    cfg = PRESETS[cfg_or_name] if isinstance(cfg_or_name, str) else cfg_or_name
    if seed is not None:
        torch.manual_seed(seed)
    m = Transformer(cfg)
    if seed is not None:
        for n, p in m.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
    return m.to(dtype).eval()
