"""The causal sensor transformer: the LLM's decoder blocks over a window of process frames.

frame (52 normalised channels) -> Linear -> [Block x n_layers] (RoPE, causal attention, SwiGLU)
-> RMSNorm -> Linear -> logits over CLASS_NAMES (normal + 21 faults), at every position.

Because attention is causal and RoPE is relative, the logits at position t of a window are those of
the prefix ending at t: the daemon's window and an evaluation over a whole file agree.
"""
from __future__ import annotations

from dataclasses import dataclass, asdict

import torch
import torch.nn.functional as F
from torch import nn

from zeroedge.model import Block, ModelConfig, RMSNorm, apply_rope, rope_frequencies
from zeroedge.sensor import CLASS_NAMES, N_CHANNELS


@dataclass(frozen=True)
class SensorConfig:
    channels: int = N_CHANNELS
    n_classes: int = len(CLASS_NAMES)
    window: int = 64
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 128

    def block_config(self) -> ModelConfig:
        return ModelConfig(vocab_size=1, dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                           n_kv_heads=self.n_heads, ffn_dim=self.ffn_dim, rope_theta=1e4,
                           max_seq_len=max(self.window, 8), tie_embeddings=False, name="tep-sensor")

    def to_dict(self):
        return asdict(self)


class SensorTransformer(nn.Module):
    def __init__(self, cfg: SensorConfig):
        super().__init__()
        self.cfg = cfg
        bc = cfg.block_config()
        self.embed = nn.Linear(cfg.channels, cfg.dim)
        self.layers = nn.ModuleList(Block(bc, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, bc.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.n_classes)
        self.register_buffer("inv_freq", rope_frequencies(bc), persistent=False)

    def _rope(self, T, device):
        pos = torch.arange(T, device=device, dtype=torch.float32)
        f = torch.outer(pos, self.inv_freq)
        emb = torch.cat((f, f), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, channels) normalised frames -> (B, T, n_classes) logits."""
        T = x.shape[1]
        cos, sin = self._rope(T, x.device)
        idx = torch.arange(T, device=x.device)
        mask = idx[None, :] <= idx[:, None]
        h = self.embed(x)
        for b in self.layers:
            h = b(h, cos, sin, 0, mask)
        return self.head(self.norm(h))

    def forward_last(self, x: torch.Tensor) -> torch.Tensor:
        """Logits at the last position only, (B, n_classes), skipping the work nothing reads.

        The "zero" path for windowed detection: only the last position's output is used, so in the
        last block the attention query, output projection and the whole FFN are computed for that
        one token (the other T-1 rows of the last FFN are never computed). Exact: same logits as
        `forward(x)[:, -1]` up to float rounding.
        """
        T = x.shape[1]
        cos, sin = self._rope(T, x.device)
        idx = torch.arange(T, device=x.device)
        mask = idx[None, :] <= idx[:, None]
        h = self.embed(x)
        for b in self.layers[:-1]:
            h = b(h, cos, sin, 0, mask)
        b = self.layers[-1]
        att = b.self_attn
        B = x.shape[0]
        hd, nkv, nh = att.cfg.head_dim, att.cfg.n_kv_heads, att.kept_heads.numel()
        xn = b.input_layernorm(h)
        q = att.q_proj(xn[:, -1:]).view(B, 1, nh, hd).transpose(1, 2)
        k = att.k_proj(xn).view(B, T, nkv, hd).transpose(1, 2)
        v = att.v_proj(xn).view(B, T, nkv, hd).transpose(1, 2)
        q, k = apply_rope(q, cos[-1:], sin[-1:]), apply_rope(k, cos, sin)
        kv_index = att.kept_heads // (att.cfg.n_heads // nkv)
        k, v = k.index_select(1, kv_index), v.index_select(1, kv_index)
        out = F.scaled_dot_product_attention(q, k, v)          # the last query sees every key
        hl = h[:, -1:] + att.o_proj(out.transpose(1, 2).reshape(B, 1, nh * hd))
        hl = hl + b.mlp(b.post_attention_layernorm(hl))
        return self.head(self.norm(hl))[:, 0]


class LastPosition(nn.Module):
    """Export wrapper: class probabilities at the last position of each window, (B, n_classes).
    zero=True exports `forward_last` (last-block work for the last token only)."""

    def __init__(self, m: SensorTransformer, zero: bool = True):
        super().__init__()
        self.m = m
        self.zero = zero

    def forward(self, x):
        return (self.m.forward_last(x) if self.zero else self.m(x)[:, -1]).softmax(-1)
