"""Activation-aware weight quantization (Lin et al. 2023, AWQ): per block and layer group, a scale
per input channel s = mean|x|^alpha (normalised by sqrt(max s * min s)), alpha grid-searched to
minimise the output error of the quantized group on calibration activations:

    err(alpha) = mean || x W^T - (x / s) Q(W * s)^T ||^2    over the group's weights (q, k and v
                                                             together; gate and up together)

Groups: q/k/v (input: input_layernorm's output), o (the attention output; GQA: one scale per kv
channel, the mean of |x| over the query heads that read it, folded into v_proj's rows), gate/up
(post_attention_layernorm's output), down (silu(gate) * up, folded into up_proj's rows). alpha = 0 is
s = 1, plain RTN, so on the calibration sample the search never does worse than RTN. Activations
come from the fp model (folding scales does not change it). Not done: AWQ's weight clipping search.

Returns the scales zeroedge.quant.apply folds (artifact tensors layers.{i}.awq.*) and the alphas.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from zeroedge.calib_artifact import AWQ_GROUPS
from zeroedge.quant.groupwise import Scheme, fake_quantize


@dataclass
class AwqConfig:
    grid: int = 20              # alpha in {0, 1/grid, ..., (grid-1)/grid}
    seq_len: int = 512
    seqs: int = 8               # calibration sequences (statistics over all their tokens)
    sample: int = 1024          # tokens of them the error is measured on
    seed: int = 0
    log: object = field(default=print, repr=False)


def sequences(token_lists, cfg: AwqConfig):
    """cfg.seqs sequences of cfg.seq_len tokens, round-robin over texts, from the end of each text's
    first 70 % (the split SIH trains on; its held-out 30 % and a text's opening passage, where
    `zeroedge eval` reads at offset 0, stay unseen)."""
    per = [[] for _ in token_lists]
    for j, ids in enumerate(token_lists):
        end = int(len(ids) * 0.7)
        while end - cfg.seq_len >= 0 and len(per[j]) < cfg.seqs:
            per[j].append(ids[end - cfg.seq_len:end])
            end -= cfg.seq_len
    out = []
    for k in range(cfg.seqs):
        for p in per:
            if k < len(p) and len(out) < cfg.seqs:
                out.append(p[k])
    return out


@torch.no_grad()
def collect(model, seqs, cfg: AwqConfig):
    """Per layer: mean |x| per channel over every token, and cfg.sample rows of x, for the inputs of
    q_proj (= k, v), o_proj, gate_proj (= up) and down_proj."""
    names = {"qkv": "self_attn.q_proj", "o": "self_attn.o_proj", "gate_up": "mlp.gate_proj",
             "down": "mlp.down_proj"}
    g = torch.Generator().manual_seed(cfg.seed)
    per_seq = max(1, cfg.sample // max(1, len(seqs)))
    stats = {i: {k: None for k in names} for i in range(len(model.layers))}
    rows = {i: {k: [] for k in names} for i in range(len(model.layers))}
    count = [0]
    pick = [None]
    hooks = []
    for i, b in enumerate(model.layers):
        for key, name in names.items():
            def hook(mod, inp, out, i=i, key=key):
                x = inp[0].reshape(-1, inp[0].shape[-1]).float()
                a = x.abs().sum(0)
                stats[i][key] = a if stats[i][key] is None else stats[i][key] + a
                rows[i][key].append(x[pick[0]])
            hooks.append(b.get_submodule(name).register_forward_hook(hook))
    try:
        for ids in seqs:
            t = torch.tensor([ids])
            pick[0] = torch.randperm(t.shape[1], generator=g)[:per_seq]
            model(t)
            count[0] += t.shape[1]
    finally:
        for h in hooks:
            h.remove()
    means = {i: {k: v / count[0] for k, v in d.items()} for i, d in stats.items()}
    samples = {i: {k: torch.cat(v) for k, v in d.items()} for i, d in rows.items()}
    return means, samples


def _weights(block, key):
    a, m = block.self_attn, block.mlp
    return {"qkv": [a.q_proj, a.k_proj, a.v_proj], "o": [a.o_proj], "gate_up": [m.gate_proj, m.up_proj],
            "down": [m.down_proj]}[key]


def _expand(model, block, s):
    """A kv-channel scale [n_kv * hd] -> o_proj's input channels (query heads)."""
    hd = model.cfg.head_dim
    group = model.cfg.n_heads // model.cfg.n_kv_heads
    return torch.cat([s[k * hd:(k + 1) * hd] for k in (block.self_attn.kept_heads // group).tolist()])


def _kv_mean(model, block, m):
    """o_proj's per-input-channel mean |x| -> per kv channel (mean over the query heads reading it)."""
    hd, nkv = model.cfg.head_dim, model.cfg.n_kv_heads
    group = model.cfg.n_heads // nkv
    acc, n = torch.zeros(nkv * hd), torch.zeros(nkv)
    for j, h in enumerate(block.self_attn.kept_heads.tolist()):
        acc[(h // group) * hd:(h // group + 1) * hd] += m[j * hd:(j + 1) * hd]
        n[h // group] += 1
    return acc / n.clamp(min=1).repeat_interleave(hd)


@torch.no_grad()
def search(model, token_lists, scheme: Scheme, cfg: AwqConfig | None = None):
    """-> (scales {layer: {group: tensor}}, alphas [[qkv, o, gate_up, down] per layer], report)."""
    cfg = cfg or AwqConfig()
    t0 = time.perf_counter()
    seqs = sequences(token_lists, cfg)
    if not seqs:
        raise ValueError(f"no calibration sequence of {cfg.seq_len} tokens in the texts")
    means, samples = collect(model, seqs, cfg)
    cfg.log(f"[awq] activations of {len(seqs)} x {len(seqs[0])} tokens in {time.perf_counter() - t0:.1f} s")
    scales, alphas, gains = {}, [], []
    for i, b in enumerate(model.layers):
        scales[i], row = {}, []
        for key in AWQ_GROUPS:
            x = samples[i][key]
            ws = [lin.weight.float() for lin in _weights(b, key)]
            ref = [x @ w.T for w in ws]
            m = means[i][key]
            if key == "o":
                m = _kv_mean(model, b, m)
            best = None
            for step in range(cfg.grid):
                alpha = step / cfg.grid
                s = m.clamp(min=1e-4).pow(alpha)
                s = s / (s.max() * s.min()).sqrt()
                sx = _expand(model, b, s) if key == "o" else s
                err = sum(float(((x @ (fake_quantize(w * sx[None, :], scheme) / sx[None, :]).T - r) ** 2).mean())
                          for w, r in zip(ws, ref))
                if step == 0:
                    rtn = err
                if best is None or err < best[0]:
                    best = (err, alpha, s)
            scales[i][key] = best[2].float()
            row.append(best[1])
            gains.append(best[0] / rtn if rtn > 0 else 1.0)
        alphas.append(row)
        cfg.log(f"[awq] layer {i}: alpha " + " ".join(f"{k} {a:.2f}" for k, a in zip(AWQ_GROUPS, row)))
    report = {"seconds": time.perf_counter() - t0, "sequences": len(seqs), "seq_len": len(seqs[0]),
              "tokens": sum(len(s) for s in seqs), "sample_tokens": int(samples[0]["qkv"].shape[0]),
              "grid": cfg.grid, "mean_error_vs_rtn": sum(gains) / len(gains)}
    return scales, alphas, report
