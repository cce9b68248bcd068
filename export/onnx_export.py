"""torch -> ONNX: the prefill graph and the decode graph of the reference model (zeroedge.model).

Both graphs are exported from small torch wrappers that reuse the model's own modules (RMSNorm, the
o projection, the SwiGLU MLP; q/k/v as one product on their weights grouped per kv head), so the FFN
of every layer keeps the plain RMSNorm -> MLP shape the rewrite (export/rewrite.py) looks for. Attention is written out (explicit softmax) because both
graphs report the attention mass each cached position received: the thermal KV runtime's heat.

prefill  inputs : tokens int64 [B, T]                  (positions P..P+T-1)
                  prefix_k.{i}, prefix_v.{i} [B, P, Hkv, hd]  K/V of the P tokens before (keys after
                                                        RoPE), token-major so that a runner's [T, ...]
                                                        buffer feeds its first P rows without a copy;
                                                        P = 0 (empty) for a whole prompt or a first chunk
         outputs: logits [B, 1, V]                      (last position only)
                  present_k.{i}, present_v.{i} [B, Hkv, T, hd]   the T new tokens' keys after RoPE
                  attn_mass [B, L, P+T]                 mass each key received from the T queries,
                                                        averaged over the layer's query heads (sums
                                                        over chunks to the whole prompt's mass)
decode   inputs : tokens int64 [B, 1], pos int64 [B]    (position of the new token)
                  slot_pos int64 [B, S]                 position held by each slot, -1 = empty
                  past_k.{i} [B, Hkv, S, hd]           the fixed-slot hot window (keys post-RoPE, fp32)
                  past_v.{i} [B, Hkv, S, hd] float16   its values: half the bytes the attention reads
                                                        (onnxruntime on x86 casts them to fp32 into cache
                                                        first, still ~1.7x faster at 2K slots than an fp32
                                                        window; the same for K is slower, so K stays fp32)
         outputs: logits [B, 1, V]
                  new_k.{i}, new_v.{i} [B, Hkv, 1, hd]   the runner writes them into a free slot
                  attn_query [B, L, H, hd]              each layer's queries after RoPE (unscaled;
                                                        a pruned head's row is zero): the runner's
                                                        thermal policy ranks the pages it holds
                                                        outside the window with them (kv.ort_policy)
                  attn_mass [B, L, S]                   mass each slot received this step

Keys are stored after RoPE, so a slot's content does not depend on where it sits in the window:
slots can be refilled in any order; only `slot_pos >= 0` (validity) enters the graph. The new
token always attends to itself, so a step with an empty window is well defined.

Head pruning (from the calibration artifact) is applied before export by slicing q_proj / o_proj
(Attention.prune_heads): the graphs carry only the kept heads.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

from zeroedge.plugin_spec import ORTOPS_DOMAIN

OPSET = 18


def _wrappers():
    """The two torch modules the graphs are exported from: (Prefill, Decode). Defined here so that
    torch is imported only when a graph is exported; their forwards are _prefill_forward and
    _decode_forward."""
    from torch import nn

    from zeroedge.model import rope_basis

    class Prefill(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.m = model
            self.cfg = model.cfg
            grouped_qkv_weights(self, model)

        def forward(self, tokens, *prefix):
            return _prefill_forward(self, tokens, prefix)

    class Decode(nn.Module):
        def __init__(self, model, ort_kernels: bool = False):
            super().__init__()
            self.m = model
            self.cfg = model.cfg
            self.window_attention = window_attention_op() if ort_kernels else None
            grouped_qkv_weights(self, model)
            eye, r = rope_basis(model.cfg.head_dim)
            self.register_buffer("rope_eye", eye)
            self.register_buffer("rope_r", r)

        def forward(self, tokens, pos, slot_pos, *past):
            return _decode_forward(self, tokens, pos, slot_pos, past)

    return Prefill, Decode


def _layer_attn(blk, x, cos, sin):
    """The attention's input side (zeroedge.model.Attention.project): a, q, k, v, query heads."""
    a = blk.self_attn
    q, k, v = a.project(x, cos, sin)
    return a, q, k, v, a.q_proj.out_features // a.cfg.head_dim   # a Python int, also when traced


def grouped_qkv_weights(module, model):
    """q / k / v as one product on their weights side by side, grouped per kv head: for each kv
    head its g query heads, its key and its value. Registered on the wrapper (buffers qkv_w{i},
    qkv_b{i}: initializers of the graph) for each layer that keeps all its heads; the prefill and
    decode graphs read the same bytes (stored once), and the decode step splits q, k and v without
    reshaping each. The quantizer sees one linear layer: each column is the same dot product as
    in q_proj / k_proj / v_proj."""
    import torch

    hd, nkv = model.cfg.head_dim, model.cfg.n_kv_heads
    g = model.cfg.n_heads // nkv
    for li, blk in enumerate(model.layers):
        a = blk.self_attn
        if a.kept_heads.numel() != model.cfg.n_heads:
            continue
        parts = [(a.q_proj, g), (a.k_proj, 1), (a.v_proj, 1)]
        with torch.no_grad():
            w = torch.cat([p.weight.view(nkv, n, hd, -1) for p, n in parts], 1).flatten(0, 2)
            module.register_buffer(f"qkv_w{li}", w.t().contiguous())          # [D, Hkv (g + 2) hd]
            if a.q_proj.bias is not None:
                module.register_buffer(f"qkv_b{li}", torch.cat([p.bias.view(nkv, n, hd) for p, n in parts],
                                                               1).flatten())


def grouped_qkv(module, li, x):
    """(..., D) -> (..., Hkv (g + 2) hd) through layer li's grouped weights (grouped_qkv_weights)."""
    y = x @ getattr(module, f"qkv_w{li}")
    return y + getattr(module, f"qkv_b{li}") if hasattr(module, f"qkv_b{li}") else y


def _lm_head(m, x):
    """(B, D) -> (B, 1, V) as Gemm(transB=1) on the [V, D] weight itself, so a tied lm_head
    shares its bytes with the embedding in the bundle's weight file."""
    import torch

    return torch.nn.functional.linear(m.norm(x), m.lm_head.weight)[:, None, :]


def _prefill_forward(module, tokens, prefix):
    """Prefill.forward: logits of the last position, each layer's new K / V, the attention mass."""
    import torch

    m, cfg = module.m, module.cfg
    B, T = tokens.shape
    P = prefix[0].shape[1]                       # tokens before this chunk
    pos = torch.arange(T, dtype=torch.float32) + P
    f = pos[:, None] * m.inv_freq[None, :]
    emb = torch.cat((f, f), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    causal = torch.arange(P + T)[None, :] <= (torch.arange(T) + P)[:, None]   # (T, P+T)
    neg = torch.where(causal, 0.0, float("-inf"))
    x = m.embed_tokens(tokens)
    ks, vs, masses = [], [], []
    for li, blk in enumerate(m.layers):
        xn = blk.input_layernorm(x)
        a, q, k, v, h = _prefill_qkv(module, li, blk, xn, (B, T), cos, sin)
        ks.append(k)
        vs.append(v)
        k = torch.cat((prefix[2 * li].transpose(1, 2), k), 2)          # (B, Hkv, P+T, hd)
        v = torch.cat((prefix[2 * li + 1].transpose(1, 2), v), 2)
        out, mass = _prefill_attention(a, q, k, v, h, neg, cfg, (B, T))
        masses.append(mass)                                            # (B, P+T)
        out = out.transpose(1, 2).reshape(B, T, h * cfg.head_dim)
        x = x + a.o_proj(out)
        x = x + blk.mlp(blk.post_attention_layernorm(x))
    return (_lm_head(m, x[:, -1]), *[t for kv in zip(ks, vs) for t in kv], torch.stack(masses, 1))


def _prefill_qkv(module, li, blk, xn, bt, cos, sin):
    """Layer li's (attention, q, k, v, query heads) for the prefill, q and k rotated: from the grouped
    product (grouped_qkv) when the layer keeps all its heads, else from its own projections. bt: the
    forward's (B, T), read once from the tokens' shape (each shape read is a node when traced)."""
    from zeroedge.model import apply_rope

    cfg = module.cfg
    if blk.self_attn.kept_heads.numel() != cfg.n_heads:
        return _layer_attn(blk, xn, cos, sin)
    B, T = bt
    hd, nkv = cfg.head_dim, cfg.n_kv_heads
    a, h = blk.self_attn, cfg.n_heads
    qkv = grouped_qkv(module, li, xn).view(B, T, nkv, h // nkv + 2, hd)
    q, k, v = qkv.split([h // nkv, 1, 1], 3)
    q = apply_rope(q.flatten(2, 3).transpose(1, 2), cos, sin)
    k = apply_rope(k.squeeze(3).transpose(1, 2), cos, sin)
    v = v.squeeze(3).transpose(1, 2)
    return a, q, k, v, h


def _prefill_attention(a, q, k, v, h, neg, cfg, bt):
    """One layer's prefill attention over the prefix and the chunk (k, v: (B, Hkv, P+T, hd)):
    (out (B, h, T, hd), the mass each key received, averaged over the query heads (B, P+T))."""
    (B, T), S = bt, k.shape[2]
    hd, nkv = cfg.head_dim, cfg.n_kv_heads
    group = cfg.n_heads // nkv
    if h == cfg.n_heads:      # no pruning: grouped view, K/V are not copied
        qg = q.reshape(B, nkv, group * T, hd)
        s = (qg @ k.transpose(-1, -2)).view(B, nkv, group, T, S) * (1.0 / math.sqrt(hd)) + neg
        p = s.softmax(-1)
        mass = p.sum(3).mean((1, 2))
        return (p.view(B, nkv, group * T, S) @ v).view(B, h, T, hd), mass
    kv_index = a.kept_heads // group
    kk, vv = k.index_select(1, kv_index), v.index_select(1, kv_index)
    s = (q @ kk.transpose(-1, -2)) * (1.0 / math.sqrt(hd)) + neg
    p = s.softmax(-1)                                    # (B, h, T, P+T)
    mass = p.sum(2).mean(1)
    return p @ vv, mass


def _decode_forward(module, tokens, pos, slot_pos, past):
    """Decode.forward. Written for a short graph (~37 onnxruntime nodes a layer, was ~88): the batch is
    traced as -1 (no shape arithmetic), q / k / v come from one product grouped per kv head
    (grouped_qkv), q and k are rotated together by one rotation matrix for the step
    (model.rope_matrix), the new token's own score is one more product, and each layer's mass is one
    product that one Concat stacks."""
    import torch

    from zeroedge.model import rope_matrix

    m, cfg = module.m, module.cfg
    hd = cfg.head_dim
    f = pos.float()[:, None] * m.inv_freq[None, :]               # (B, hd/2)
    emb = torch.cat((f, f), dim=-1)[:, None, :]                  # (B, 1, hd)
    rot = rope_matrix(emb.cos(), emb.sin(), (module.rope_eye, module.rope_r))   # (B, 1, hd, hd)
    neg = torch.where(slot_pos >= 0, 0.0, float("-inf"))[:, None, None, :]  # (B,1,1,S)
    S = slot_pos.shape[1]
    x = m.embed_tokens(tokens[:, 0])                                # (B, D): 2-D all the way
    news, queries, masses = [], [], []
    for li, blk in enumerate(m.layers):
        pk, pv = past[2 * li], past[2 * li + 1]
        a = blk.self_attn
        h = a.q_proj.out_features // hd                          # a Python int, also when traced
        xn = blk.input_layernorm(x)
        out, k, v, mass, q = _decode_attention(module, li, a, h, xn, rot, (pk, pv), neg, S)
        masses.append(mass)
        queries.append(q)
        news += [k, v]
        x = x + a.o_proj(out if out.dim() == 2 else out.reshape(-1, h * hd))
        x = x + blk.mlp(blk.post_attention_layernorm(x))
    return (_lm_head(m, x), *news, torch.stack(queries, 1), torch.cat(masses, 1))


def _decode_attention(module, li, a, h, xn, rot, window, neg, S):
    """Layer li's attention (a, with h query heads) for the decode step over the window (past K,
    past V) and the new token: (out, new k, new v, mass each slot received, the queries after RoPE
    (B, n_heads, hd), zero rows for pruned heads)."""
    import torch

    cfg = module.cfg
    nkv, hd, scale = cfg.n_kv_heads, cfg.head_dim, 1.0 / math.sqrt(cfg.head_dim)
    pk, pv = window
    if h == cfg.n_heads and module.window_attention is not None:   # zeroedge.ort: one node
        qkv = grouped_qkv(module, li, xn)
        q = qkv.reshape(-1, nkv, h // nkv + 2, hd)[:, :, : h // nkv] @ rot     # what the node computes
        return (*module.window_attention.apply(qkv, rot, pk, pv, neg, nkv, scale), q.reshape(-1, h, hd))
    if h == cfg.n_heads:       # no pruning: grouped view, no copy of the window
        out, k, v, p_old, q = _decode_grouped_attention(grouped_qkv(module, li, xn), rot, pk, pv, neg, cfg, scale)
    else:
        out, k, v, p_old, q = _decode_pruned_attention(a, xn, rot, pk, pv, neg, cfg, scale)
    # the mean over the query heads as a product: onnxruntime's ReduceMean over the
    # head axes takes ~10 us a layer at 2K slots, this ~1 us
    return out, k, v, torch.full((1, h), 1.0 / h) @ p_old.reshape(-1, h, S), q


def _decode_grouped_attention(qkv, rot, pk, pv, neg, cfg, scale):
    """The decode attention of a layer that keeps all its heads, on the grouped q / k / v product
    (grouped_qkv) and a grouped view of the window (no copy): (out, k, v, p_old, queries (B, H, hd))."""
    nkv, hd = cfg.n_kv_heads, cfg.head_dim
    group = cfg.n_heads // nkv
    qkv = qkv.reshape(-1, nkv, group + 2, hd)
    qk, v = qkv.split([group + 1, 1], 2)                 # (B, Hkv, g + 1, hd), (B, Hkv, 1, hd)
    qg, k = (qk @ rot).split([group, 1], 2)              # (B, Hkv, g, hd), (B, Hkv, 1, hd)
    # the window as the left operand: a long A and a 3-column B run ~20 % faster in
    # onnxruntime's CPU GEMM than the transposed window as B (SmolLM2, 2K slots); the
    # 1/sqrt(hd) on both score products (onnxruntime folds it into them as alpha)
    s_old = ((pk @ qg.transpose(-1, -2)) * scale).transpose(-1, -2) + neg   # (B, Hkv, g, S)
    s_new = (qg @ k.transpose(-1, -2)) * scale           # (B, Hkv, g, 1)
    out, p_old = _attend_window_and_new(s_old, s_new, pv, v)   # (B, Hkv, g, hd)
    return out, k, v, p_old, qg.reshape(-1, nkv * group, hd)


def _decode_pruned_attention(a, xn, rot, pk, pv, neg, cfg, scale):
    """The decode attention of a layer with pruned heads: its own projections, each kept query head
    reading its kv head's rows of the window: (out, k, v, p_old, the kept heads' queries at their
    places among all n_heads, unscaled, zeros for the pruned)."""
    import torch

    q, k, v = a.project(xn, None, None, (rot * scale, rot))
    kv_index = a.kept_heads // (cfg.n_heads // cfg.n_kv_heads)
    kk, vv = pk.index_select(1, kv_index), pv.index_select(1, kv_index)
    kn, vn = k.index_select(1, kv_index), v.index_select(1, kv_index)
    s_old = q @ kk.float().transpose(-1, -2) + neg       # (B, h, 1, S); K fp16 with ortops
    s_new = q @ kn.transpose(-1, -2)                     # (B, h, 1, 1)
    out, p_old = _attend_window_and_new(s_old, s_new, vv, vn)   # (B, h, 1, hd)
    place = torch.zeros(cfg.n_heads, a.kept_heads.numel())     # one-hot: kept head j -> its index
    place[a.kept_heads, torch.arange(a.kept_heads.numel())] = 1.0 / scale
    return out, k, v, p_old, place @ q.reshape(-1, a.kept_heads.numel(), cfg.head_dim)


def _attend_window_and_new(s_old, s_new, values, v_new):
    """Softmax over the window's scores and the new token's own: (the weighted sum of the window's
    values, in their dtype, and the new value; the window's share p_old)."""
    import torch

    p = torch.cat((s_old, s_new), -1).softmax(-1)
    p_old, p_new = p[..., :-1], p[..., -1:]
    return (p_old.to(values.dtype) @ values).float() + p_new * v_new, p_old


def window_attention_op():
    """zeroedge.ort WindowAttention (ortops/window_attention.cc) as a torch function: its forward is
    the decode step's attention for one layer, from the grouped q / k / v product to o_proj's input
    (the stock graph's arithmetic, the window's K and V float16), exported as one custom node:
    (qkv, rot, past_k, past_v, bias) -> (out, new k, new v, mass)."""
    import torch

    class WindowAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, qkv, rot, pk, pv, neg, kv_heads: int, scale: float):
            hd = pk.shape[-1]
            group = qkv.shape[-1] // (kv_heads * hd) - 2
            qk, v = qkv.reshape(-1, kv_heads, group + 2, hd).split([group + 1, 1], 2)
            q, k = (qk @ rot).split([group, 1], 2)                                 # (B, Hkv, g, hd), (B, Hkv, 1, hd)
            s_old = (q @ pk.float().transpose(-1, -2)) * scale + neg               # (B, Hkv, g, S)
            s_new = (q @ k.transpose(-1, -2)) * scale                               # (B, Hkv, g, 1)
            p = torch.cat((s_old, s_new), -1).softmax(-1)
            out = p[..., :-1] @ pv.float() + p[..., -1:] * v
            mass = p[..., :-1].reshape(qkv.shape[0], -1, pk.shape[2]).mean(1, keepdim=True)   # (B, 1, S)
            return out.reshape(qkv.shape[0], -1), k, v, mass

        @staticmethod
        def symbolic(g, qkv, rot, pk, pv, neg, kv_heads, scale):
            out, k, v, mass = g.op(f"{ORTOPS_DOMAIN}::WindowAttention", qkv, rot, pk, pv, neg,
                                   kv_heads_i=kv_heads, scale_f=scale, outputs=4)
            (b, width), (s, hd) = qkv.type().varyingSizes(), pk.type().varyingSizes()[2:]
            heads = width // hd - 2 * kv_heads if width and hd else None                 # query heads
            out.setType(qkv.type().with_sizes([b, heads * hd if heads else None]))
            for t in (k, v):
                t.setType(qkv.type().with_sizes([b, kv_heads, 1, hd]))
            mass.setType(qkv.type().with_sizes([b, 1, s]))
            return out, k, v, mass

    return WindowAttention


def io_names(n_layers: int):
    pre_in = ["tokens"] + [f"prefix_{kv}.{i}" for i in range(n_layers) for kv in "kv"]
    pre_out = ["logits"] + [f"present_{kv}.{i}" for i in range(n_layers) for kv in "kv"] + ["attn_mass"]
    dec_in = ["tokens", "pos", "slot_pos"] + [f"past_{kv}.{i}" for i in range(n_layers) for kv in "kv"]
    dec_out = ["logits"] + [f"new_{kv}.{i}" for i in range(n_layers) for kv in "kv"] + ["attn_query", "attn_mass"]
    return pre_in, pre_out, dec_in, dec_out


def export_graphs(model, out_dir, example_len: int = 8, example_slots: int = 16, progress=None,
                  ort_kernels: bool = False):
    """Write prefill.onnx and decode.onnx (weights in <name>.data beside them) into out_dir.

    Uses the TorchScript exporter (`dynamo=False`): ~15x faster than the dynamo exporter on this
    model and deterministic; the rewrite is structural, so it also handles dynamo graphs (tested on
    transformers' models). Returns {"prefill": path, "decode": path, "seconds": {...}}."""
    import torch

    Prefill, Decode = _wrappers()
    cfg = model.cfg
    L, nkv, hd = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pin, pout, din, dout = io_names(L)
    model = model.float().eval()
    secs = {}
    with torch.no_grad():
        t0 = time.perf_counter()
        tokens = torch.randint(0, cfg.vocab_size, (1, example_len))
        prefix = [torch.randn(1, example_len, nkv, hd) for _ in range(2 * L)]   # P > 0: traced as dynamic
        dyn = {"tokens": {0: "batch", 1: "seq"}, "logits": {0: "batch"}, "attn_mass": {0: "batch", 2: "ctx"}}
        dyn.update({n: {0: "batch", 2: "seq"} for n in pout if n.startswith("present_")})
        dyn.update({n: {0: "batch", 1: "prefix"} for n in pin if n.startswith("prefix_")})
        p_path = out_dir / "prefill.onnx"
        _export(Prefill(model), (tokens, *prefix), p_path, pin, pout, dyn)
        secs["prefill"] = time.perf_counter() - t0
        if progress:
            progress("prefill")
        t0 = time.perf_counter()
        tok1 = torch.randint(0, cfg.vocab_size, (1, 1))
        pos = torch.tensor([example_slots])
        slot_pos = torch.arange(example_slots)[None]
        # K fp32, V fp16; both fp16 with zeroedge's onnxruntime kernels (ort_kernels)
        past = [torch.randn(1, nkv, example_slots, hd, dtype=torch.float16 if i % 2 or ort_kernels else torch.float32)
                for i in range(2 * L)]
        dyn = {"tokens": {0: "batch"}, "pos": {0: "batch"}, "slot_pos": {0: "batch", 1: "slots"},
               "logits": {0: "batch"}, "attn_query": {0: "batch"}, "attn_mass": {0: "batch", 2: "slots"}}
        dyn.update({n: {0: "batch", 2: "slots"} for n in din if n.startswith("past_")})
        dyn.update({n: {0: "batch"} for n in dout if n.startswith("new_")})
        d_path = out_dir / "decode.onnx"
        _export(Decode(model, ort_kernels), (tok1, pos, slot_pos, *past), d_path, din, dout, dyn)
        secs["decode"] = time.perf_counter() - t0
        if progress:
            progress("decode")
    return {"prefill": p_path, "decode": d_path, "seconds": secs}


def export_model_protos(model, tmp_dir, **kw):
    """Export, then load both graphs (with their weights) as onnx ModelProtos."""
    import onnx

    r = export_graphs(model, tmp_dir, **kw)
    pre, dec = onnx.load(str(r["prefill"])), onnx.load(str(r["decode"]))
    if model.cfg.tie_embeddings:
        _tie_lm_head(pre)
        _tie_lm_head(dec)
    return pre, dec, r["seconds"]


def _tie_lm_head(proto):
    """The exporter folds the tied lm_head into a transposed copy of the embedding ([D, V]) for a
    MatMul; use Gemm(transB=1) on the embedding itself so the bundle stores it once."""
    import numpy as np
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in proto.graph.initializer}
    emb = next((i for i in proto.graph.initializer if i.name.endswith("embed_tokens.weight")), None)
    if emb is None:
        return False
    V, D = emb.dims
    for idx, n in enumerate(proto.graph.node):
        w = inits.get(n.input[1]) if n.op_type == "MatMul" and len(n.input) == 2 else None
        if w is None or list(w.dims) != [D, V]:
            continue
        if not np.array_equal(numpy_helper.to_array(w), numpy_helper.to_array(emb).T):
            continue
        g = helper.make_node("Gemm", [n.input[0], emb.name], list(n.output), name=n.name + "_tied", transB=1)
        proto.graph.node.remove(n)
        proto.graph.node.insert(idx, g)
        if not any(w.name in m.input for m in proto.graph.node):
            proto.graph.initializer.remove(w)
        return True
    return False


def _export(module, args, path, in_names, out_names, dynamic_axes):
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), dynamo=False, opset_version=OPSET,
                          input_names=in_names, output_names=out_names, dynamic_axes=dynamic_axes,
                          do_constant_folding=True)
    return path
