"""Apply a calibration artifact's weights section to a reference model, in place.

  1. fold the AWQ scales (method awq; none for rtn): per block, with s > 0 per input channel,
       q/k/v columns * s, input_layernorm.weight / s
       o_proj columns of query head h * s[kv(h)], v_proj rows / s      (GQA: a kv channel's scale is
                                                                        shared by its query heads)
       gate/up columns * s, post_attention_layernorm.weight / s
       down_proj columns * s, up_proj rows / s
     -- each an identity of the fp model (up to rounding): the quantizer then sees W * s;
  2. fake-quantize q/k/v/o/gate/up/down (zeroedge.quant.groupwise: MatMulNBits' numerics), weights
     dequantized back into the model's dtype;
  3. the embedding (SmolLM2 ties it to the LM head: one tensor) int8 symmetric in groups along the
     hidden dimension, or kept. Why int8 by default and not int4: it is 21 % of SmolLM2's parameters
     and both the first and the last operation of the model; int8 costs ~nothing (benchmarks/weights.md)
     and halves its fp16 bytes, which is what brings a 4-bit SmolLM2 bundle under 120 MB. int4
     (`calibrate --embedding int4`, symmetric) halves the LM head's bytes again, the largest single
     read of a decode step on a GPU (+5 % decode on the H200 at 8K), but costs SmolLM2 +12 / +16 /
     +29 % perplexity on KJV / essays / licenses (benchmarks/weights.md); the ONNX
     export refuses it. Its numerics
     are MatMulNBits' 8-bit ones on the LM head's B = E^T [D, V] (blocks along D); the embedding's
     rows dequantize to the same values (the same blocks).

The export (`zeroedge export --calib ART`) calls `apply_artifact(model, meta, tensors, quantize=False)`
to fold the scales only, then quantizes the folded fp32 weights with onnxruntime's MatMulNBitsQuantizer
(bits, block_size=group, is_symmetric from the section): the weights it ships dequantize to exactly
the ones step 2 computes here (tests/test_quant.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from zeroedge.quant.groupwise import Scheme, fake_quantize
from zeroedge.quant.packed import PackedLinear

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
MARK = "_zeroedge_weights"      # set on a model once a weights section is applied


def _scale_cols(lin, s):
    lin.weight.data = (lin.weight.data.float() * s[None, :]).to(lin.weight.dtype)


def _scale_rows(t, s):
    """Divide the output rows (or a norm's weight) by s."""
    f = t.data.float()
    t.data = (f / (s[:, None] if f.dim() == 2 else s)).to(t.dtype)


def fold_scales(model, scales: dict) -> None:
    """scales: layer -> {qkv, o, gate_up, down: fp32 tensor} (calib_artifact.WeightsSection.awq_scales)."""
    cfg = model.cfg
    hd = cfg.head_dim
    for i, sc in scales.items():
        b = model.layers[i]
        a, mlp = b.self_attn, b.mlp
        s = sc["qkv"].float()
        for lin in (a.q_proj, a.k_proj, a.v_proj):
            _scale_cols(lin, s)
        _scale_rows(b.input_layernorm.weight, s)
        s = sc["o"].float()                                       # per kv channel [n_kv * hd]
        group = cfg.n_heads // cfg.n_kv_heads
        kv = (a.kept_heads // group).tolist()
        _scale_cols(a.o_proj, torch.cat([s[k * hd:(k + 1) * hd] for k in kv]))
        _scale_rows(a.v_proj.weight, s)
        if a.v_proj.bias is not None:
            _scale_rows(a.v_proj.bias, s)
        s = sc["gate_up"].float()
        _scale_cols(mlp.gate_proj, s)
        _scale_cols(mlp.up_proj, s)
        _scale_rows(b.post_attention_layernorm.weight, s)
        s = sc["down"].float()
        _scale_cols(mlp.down_proj, s)
        _scale_rows(mlp.up_proj.weight, s)


def _quantize(lin, scheme: Scheme, pack: bool) -> None:
    """Fake-quantize lin's weight; with pack, keep its packed form as lin.packed (zeroedge.quant.packed,
    what the CUDA decode GEMV reads) and make the weight that form's, so prefill and decode compute
    with one set of weights (fp16 steps: within 2^-10 of a group's largest magnitude of
    onnxruntime's fp32-step weight; the same for a float zero point)."""
    if pack:
        lin.packed = PackedLinear.from_weight(lin.weight.data, scheme)
        lin.weight.data = lin.packed.dequantize().to(lin.weight.dtype)
    else:
        lin.weight.data = fake_quantize(lin.weight.data, scheme)


def quantize_linears(model, scheme: Scheme, pack: bool = False) -> None:
    for b in model.layers:
        for name in LINEARS:
            _quantize(b.get_submodule(name), scheme, pack)


def quantize_embedding(model, group: int, pack: bool = False, bits: int = 8) -> None:
    """int8 (or int4) symmetric in groups along the hidden dimension; a separate LM head the same
    way. With pack, the LM head keeps its packed form (model.lm_head.packed)."""
    sch = Scheme(bits, group, True)
    e = model.embed_tokens.weight
    _quantize(model.lm_head, sch, pack)                 # tied: this is the embedding's weight too
    if model.lm_head.weight is not e:
        e.data = fake_quantize(e.data, sch)


def embedding_group(dim: int) -> int:
    """The embedding's group: the largest offered that divides the hidden size (no padded block;
    64 for SmolLM2's 576), else 128."""
    from zeroedge.quant.groupwise import GROUPS

    return next((g for g in sorted(GROUPS, reverse=True) if dim % g == 0), 128)


def apply(model, section, scales: Optional[dict] = None, quantize: bool = True, pack: bool = False) -> None:
    """Fold `scales` (AWQ; None for RTN) and, with quantize, fake-quantize per `section`
    (a calib_artifact.WeightsSection); with pack, also keep each linear's packed form for the torch
    decode loop (zeroedge.runtime.fast reads them). Once per model: a second call is refused."""
    if getattr(model, MARK, None):
        raise ValueError(f"weights already applied to this model ({getattr(model, MARK)})")
    if section.method == "awq" and not scales:
        raise ValueError("an AWQ weights section needs its scales")
    with torch.no_grad():
        if scales:
            fold_scales(model, scales)
        if quantize:
            quantize_linears(model, Scheme(section.bits, section.group, section.symmetric,
                                           getattr(section, "zero_point", "int")), pack)
            if section.embedding_bits:
                quantize_embedding(model, section.embedding_group, pack, section.embedding_bits)
    setattr(model, MARK, section.describe() + ("" if quantize else " (scales folded only)"))


def apply_artifact(model, meta: dict, tensors: dict, quantize: bool = True, where: str = "calibration artifact",
                   pack: bool = False):
    """Apply an artifact's weights section (if any) to `model` in place; returns the WeightsSection
    or None. The artifact must have been made for this model's shape (calib_artifact.check_model)."""
    from zeroedge import calib_artifact

    cal = calib_artifact.Calibration.from_meta(meta, where)
    if cal.weights is None:
        return None
    calib_artifact.check_model(meta, model.cfg, where)
    apply(model, cal.weights, cal.weights.awq_scales(tensors, cal.model_config, where), quantize=quantize,
          pack=pack)
    return cal.weights


def weight_bytes(cfg, section=None, dtype_bytes: int = 2) -> dict:
    """Bytes of the weights as stored: linear layers (MatMulNBits layout with fp32 scales when
    quantized, else dtype_bytes each), the embedding (+ LM head when untied), and the rest (norms)."""
    hd = cfg.head_dim
    shapes = [(cfg.dim, cfg.n_heads * hd), (cfg.dim, cfg.n_kv_heads * hd), (cfg.dim, cfg.n_kv_heads * hd),
              (cfg.n_heads * hd, cfg.dim), (cfg.dim, cfg.ffn_dim), (cfg.dim, cfg.ffn_dim), (cfg.ffn_dim, cfg.dim)]
    if section is None:
        linear = sum(k * n for k, n in shapes) * cfg.n_layers * dtype_bytes
    else:
        sch = Scheme(section.bits, section.group, section.symmetric, getattr(section, "zero_point", "int"))
        linear = sum(sch.nbytes(k, n) for k, n in shapes) * cfg.n_layers
    heads = 1 if cfg.tie_embeddings else 2
    if section is not None and section.embedding_bits:
        emb = Scheme(section.embedding_bits, section.embedding_group, True).nbytes(cfg.dim, cfg.vocab_size) * heads
    else:
        emb = cfg.vocab_size * cfg.dim * dtype_bytes * heads
    other = (2 * cfg.n_layers + 1) * cfg.dim * dtype_bytes
    return {"linear": linear, "embedding": emb, "other": other, "total": linear + emb + other}
