"""PAD in prefill: skip the FFN of low-importance tokens for real, by compaction.

`ZeroMLP` wraps a block's MLP: it scores the tokens (an artifact's ranking, or a peer's for benchmarks),
decides a keep mask, gathers the kept rows, runs the FFN on them only, and scatters the result back
over the anchor's output (or zeros). The FLOPs of skipped rows are never spent.

`install(model, policies, runtime)` swaps the wrappers in; `runtime.active` turns them on and off,
so one model can prefill with the mechanisms and score a continuation dense.

Chunked prefill: `runtime.begin_prompt(n)` before the first chunk of an n-token prompt; each wrapper
then counts the positions it has seen and carries its last two raw SIH scores into the next chunk, so
any chunk loop (zeroedge.model.chunked_prefill, a layer at a time or a chunk at a time) skips exactly
the rows one pass would. `runtime.end_prompt()` after the last chunk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from zeroedge.calib_artifact import SCORERS as ARTIFACT_SCORERS
from zeroedge.mechanisms.sih import MA_WEIGHTS, SIHHead, keep_mask, rank_mask, smooth, smooth_chunk
from zeroedge.plugin_spec import BLOCK_FRAC

MIN_TOKENS = 32


class MechanismError(RuntimeError):
    """The mechanisms were asked to run where they must not (training mode, grad enabled)."""


@dataclass
class LayerPolicy:
    """How one layer decides which tokens skip the FFN.

    Deployed: one of ARTIFACT_SCORERS (the plugins: "sih") with the quality gate's threshold (the
    threshold rule) or its rate and rank_block (the rank rule). Benchmarks: any scorer with a fixed
    `rate` over the whole prompt (rank_block 0)."""
    scorer: str = "sih"                  # sih | random | norm | attn | external | all
    threshold: Optional[float] = None
    rate: Optional[float] = None         # skip this share of the skippable tokens, the lowest-scored
    rank_block: int = 0                  # ... in each block of this many positions (0: the whole prompt)
    sih: Optional[SIHHead] = None
    anchor: Optional[nn.Module] = None   # None = zero output
    block_size: int = 0
    block_frac: float = BLOCK_FRAC


@dataclass
class ZeroRuntime:
    active: bool = False
    limit: Optional[int] = None          # positions >= limit are never skipped (not prompt)
    min_tokens: int = MIN_TOKENS
    protect_first: int = 4
    protect_last: int = 1
    allow_grad: bool = False             # calibration only: grads flow, decisions stay no-grad
    seed: int = 0
    external: dict = field(default_factory=dict)   # layer -> (B, T) scores for scorer="external"
    stats: dict = field(default_factory=dict)      # layer -> [kept, total, anchor_flops]
    masks: dict = field(default_factory=dict)      # layer -> last prompt's keep mask (when record_masks)
    record_masks: bool = False
    prompt_len: Optional[int] = None               # set by begin_prompt: prefill in chunks
    carry: dict = field(default_factory=dict)      # layer -> (B, 2) last raw SIH scores of its last chunk
    seen: dict = field(default_factory=dict)       # layer -> positions of the prompt it has run

    def reset_stats(self):
        self.stats.clear()
        self.masks.clear()

    def begin_prompt(self, n: int):
        """The next calls are chunks, in order, of one n-token prompt (each layer sees every chunk)."""
        self.prompt_len = int(n)
        self.carry.clear()
        self.seen.clear()

    def end_prompt(self):
        self.prompt_len = None
        self.carry.clear()
        self.seen.clear()


def artifact_scores(policy: LayerPolicy, x: torch.Tensor, layer: int, seed: int = 0, start: int = 0) -> torch.Tensor:
    """(B, T) scores of positions start..start+T-1 from their FFN inputs x, by one of ARTIFACT_SCORERS
    (low = skip first): sih, the head's scores smoothed (start = 0 only: chunks carry the smoothing,
    ZeroMLP.decide_chunk); norm, the input's L2 norm; random, one draw per position from the layer's
    seed (the same for every row of a batch and every chunking of a prompt)."""
    B, T = x.shape[0], x.shape[1]
    if policy.scorer == "sih":
        return smooth(policy.sih(x), MA_WEIGHTS)
    if policy.scorer == "norm":
        return x.float().norm(dim=-1)
    if policy.scorer == "random":
        g = torch.Generator().manual_seed(seed * 1000 + layer)
        return torch.rand(start + T, generator=g)[start:].expand(B, T).to(x.device)
    raise ValueError(f"unknown scorer {policy.scorer}")


class ZeroMLP(nn.Module):
    def __init__(self, mlp: nn.Module, layer: int, runtime: ZeroRuntime, policy: LayerPolicy,
                 attn: Optional[nn.Module] = None):
        super().__init__()
        self.mlp, self.layer, self.rt, self.policy = mlp, layer, runtime, policy
        self.attn = attn  # for the attention-received peer

    # -- decisions --------------------------------------------------------------------------
    def scores(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        p, T = self.policy, x.shape[1]
        if p.scorer in ARTIFACT_SCORERS:
            return artifact_scores(p, x, self.layer, self.rt.seed, start)
        if p.scorer == "attn":
            probs = self.attn.last_probs  # (B, H, Tq, Tk): attention each key received
            return probs.float().sum(dim=(1, 2))[:, -T:]
        if p.scorer == "external":
            return self.rt.external[self.layer][:, :T].to(x.device)
        if p.scorer == "all":
            return torch.zeros(x.shape[0], T, device=x.device)
        raise ValueError(f"unknown scorer {p.scorer}")

    def decide_chunk(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """The keep mask of the chunk at positions start.. of a prompt of rt.prompt_len tokens."""
        p, rt = self.policy, self.rt
        whole_prompt = p.rate is not None and not p.rank_block
        if p.scorer not in ARTIFACT_SCORERS or whole_prompt:
            raise MechanismError(f"chunked prefill runs a deployed rule only (layer {self.layer} scores with "
                                 f"{p.scorer!r}{' at a rate over the whole prompt' if whole_prompt else ''})")
        if p.scorer == "sih":
            raw = p.sih(x).float()
            carry = self.rt.carry.get(self.layer) if start else None
            if carry is None:
                carry = raw.new_zeros(raw.shape[0], 2)
            s, rt.carry[self.layer] = smooth_chunk(raw, carry, start, MA_WEIGHTS)
        else:
            s = self.scores(x, start).float()
        if p.rate is not None:
            return rank_mask(s, p.rate, p.rank_block, rt.protect_first, rt.protect_last, rt.prompt_len, start)
        return keep_mask(s, p.threshold, rt.protect_first, rt.protect_last, p.block_size, p.block_frac,
                         rt.prompt_len, start)

    def decide(self, x: torch.Tensor) -> torch.Tensor:
        p, rt = self.policy, self.rt
        s = self.scores(x).float()
        if p.rate is not None:  # the rank rule (rank_block 0: one block, the whole prompt)
            keep = rank_mask(s, p.rate, p.rank_block or max(x.shape[1], 1), rt.protect_first, rt.protect_last,
                             rt.limit)
            if p.block_size:
                return keep_mask(keep.float(), 0.5, rt.protect_first, rt.protect_last,
                                 p.block_size, p.block_frac, rt.limit)
            return keep
        return keep_mask(s, p.threshold, rt.protect_first, rt.protect_last, p.block_size,
                         p.block_frac, rt.limit)

    # -- forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rt, B, T, D = self.rt, x.shape[0], x.shape[1], x.shape[2]
        if not rt.active:
            return self.mlp(x)
        start = None
        if rt.prompt_len is not None:                 # a chunk of a prompt (begin_prompt)
            start = rt.seen.get(self.layer, 0)
            rt.seen[self.layer] = start + T
        if (rt.prompt_len if start is not None else T) < rt.min_tokens:  # short prompts bypass the mechanisms
            self._count(B * T, B * T, 0)
            return self.mlp(x)
        if self.training:
            raise MechanismError("zeroedge mechanisms are inference-only: call model.eval() first")
        if torch.is_grad_enabled() and not rt.allow_grad:
            raise MechanismError("zeroedge mechanisms are inference-only: run under "
                                 "torch.no_grad() / torch.inference_mode()")
        with torch.no_grad():
            keep = self.decide(x) if start is None else self.decide_chunk(x, start)
        if rt.record_masks:        # a prompt's chunks: its whole mask so far
            prev = rt.masks.get(self.layer) if start else None
            rt.masks[self.layer] = keep.cpu() if prev is None else torch.cat((prev, keep.cpu()), 1)
        anchor = self.policy.anchor
        flat = x.reshape(B * T, D)
        out = anchor(flat) if anchor is not None else flat.new_zeros(B * T, D)
        idx = keep.reshape(-1).nonzero().squeeze(1)
        if idx.numel():
            out = out.index_copy(0, idx, self.mlp(flat.index_select(0, idx)))   # compaction
        n_skip = B * T - idx.numel()
        self._count(idx.numel(), B * T, n_skip * (anchor.flops_per_token() if anchor is not None else 0))
        return out.view(B, T, D)

    def _count(self, kept, total, anchor_flops):
        s = self.rt.stats.setdefault(self.layer, [0, 0, 0])
        s[0] += kept
        s[1] += total
        s[2] += anchor_flops


def install(model, policies: dict, runtime: ZeroRuntime):
    """Wrap the MLP of every layer in `policies` (layer index -> LayerPolicy)."""
    remove(model)
    for i, p in policies.items():
        blk = model.layers[i]
        if p.scorer == "attn":
            blk.self_attn.record_probs = True
        blk.mlp = ZeroMLP(blk.mlp, i, runtime, p, blk.self_attn).train(model.training)
    return runtime


def chunk_on_blocks(chunk: int, policies) -> int:
    """`chunk` rounded up to a whole number of the block-rule and rank-rule blocks of these
    LayerPolicies (a chunk that starts on a block boundary decides as one pass would)."""
    multiple = 1
    for p in policies:
        multiple = math.lcm(multiple, max(p.block_size, 1), max(p.rank_block if p.rate is not None else 0, 1))
    return -(-chunk // multiple) * multiple


def installed_policies(model) -> list:
    return [blk.mlp.policy for blk in model.layers if isinstance(blk.mlp, ZeroMLP)]


def remove(model):
    for blk in model.layers:
        if isinstance(blk.mlp, ZeroMLP):
            blk.mlp = blk.mlp.mlp
        blk.self_attn.record_probs = False
        blk.self_attn.last_probs = None


def ffn_flops_per_token(cfg) -> int:
    return 2 * 3 * cfg.dim * cfg.ffn_dim


def flops_summary(model, runtime: ZeroRuntime) -> dict:
    """FFN FLOPs of the last prefill(s): skipped fraction, gross and net of anchors and SIH heads."""
    cfg = model.cfg
    per = ffn_flops_per_token(cfg)
    total_tokens = kept = anchor_flops = sih_flops = 0
    for blk in model.layers:
        st = runtime.stats.get(blk.index)
        if st is None:
            continue
        kept += st[0]
        total_tokens += st[1]
        anchor_flops += st[2]
        p = blk.mlp.policy if isinstance(blk.mlp, ZeroMLP) else None
        if p is not None and p.scorer == "sih" and p.sih is not None and st[0] < st[1]:
            h = blk.mlp.policy.sih
            sih_flops += 2 * sum(p.numel() for n, p in h.named_parameters() if "weight" in n) * st[1]
    if not total_tokens:
        return {"ffn_flops_skipped": 0.0, "ffn_flops_skipped_gross": 0.0}
    # every layer's FFN runs on every prefill token when dense, wrapped or not
    dense = per * max(s[1] for s in runtime.stats.values()) * cfg.n_layers
    gross = (total_tokens - kept) * per
    return {"ffn_flops_skipped": (gross - anchor_flops - sih_flops) / dense,
            "ffn_flops_skipped_gross": gross / dense,
            "overhead_flops_fraction": (anchor_flops + sih_flops) / dense,
            "per_layer_skip": {i: 1 - s[0] / s[1] for i, s in sorted(runtime.stats.items()) if s[1]}}


def check_sampling(temperature: float, force: bool = False) -> bool:
    """Mechanisms are disabled for temperature > 1.0 unless forced: pruning removes exactly the
    tail creative sampling wants."""
    return force or temperature <= 1.0


def artifact_policies(meta: dict, tensors: dict, runtime: Optional[ZeroRuntime] = None):
    """A calibration artifact's deployed SIH/PAD policies (layer -> LayerPolicy: threshold or rate, heads,
    anchors) and the runtime that switches them on, set to the artifact's protections."""
    from zeroedge.calib_artifact import Calibration
    from zeroedge.mechanisms.anchors import Anchor

    cal = Calibration.from_meta(meta)
    rt = runtime or ZeroRuntime()
    rt.protect_first, rt.min_tokens, rt.protect_last = cal.sih.protect_first, cal.sih.min_tokens, cal.sih.protect_last
    pol = {}
    for L in cal.skip_layers:
        anchor = Anchor.from_state(tensors, f"layers.{L.index}.anchor") if L.anchor_rank else None
        pol[L.index] = LayerPolicy(scorer=cal.sih.scorer, threshold=L.threshold, rate=L.rate,
                                   rank_block=L.rank_block,
                                   sih=SIHHead.from_state(tensors, f"layers.{L.index}.sih")
                                   if cal.sih.scorer == "sih" else None, anchor=anchor,
                                   block_size=L.block_size, block_frac=L.block_frac)
    return pol, rt


def install_artifact(model, meta: dict, tensors: dict, runtime: Optional[ZeroRuntime] = None) -> ZeroRuntime:
    """Install a calibration artifact's deployed SIH/PAD policies (thresholds, heads, anchors) and its
    head pruning on the model; returns the runtime that switches them on (runtime.active)."""
    from zeroedge.calib_artifact import Calibration

    pol, rt = artifact_policies(meta, tensors, runtime)
    for layer, heads in Calibration.from_meta(meta).pruned_heads.items():
        model.layers[layer].self_attn.prune_heads(heads)
    install(model, pol, rt)
    return rt
