"""The causal sensor transformer: the LLM's decoder blocks over a window of process frames.

frame (52 normalised channels) -> Linear -> [Block x n_layers] (RoPE, causal attention, SwiGLU)
-> RMSNorm -> Linear -> logits over CLASS_NAMES (normal + 21 faults), at every position.

Because attention is causal and RoPE is relative, the logits at position t of a window are those of
the prefix ending at t: the daemon's window and an evaluation over a whole file agree.
"""
from __future__ import annotations

from dataclasses import dataclass, asdict

import torch
from torch import nn

from zeroedge.model import Block, ModelConfig, RMSNorm, rope_frequencies
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, channels) normalised frames -> (B, T, n_classes) logits."""
        T = x.shape[1]
        pos = torch.arange(T, device=x.device, dtype=torch.float32)
        f = torch.outer(pos, self.inv_freq)
        emb = torch.cat((f, f), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        idx = torch.arange(T, device=x.device)
        mask = idx[None, :] <= idx[:, None]
        h = self.embed(x)
        for b in self.layers:
            h = b(h, cos, sin, 0, mask)
        return self.head(self.norm(h))


class LastPosition(nn.Module):
    """Export wrapper: class probabilities at the last position of each window, (B, n_classes)."""

    def __init__(self, m: SensorTransformer):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x)[:, -1].softmax(-1)
