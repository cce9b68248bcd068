"""What a torch serving request holds in device memory, forecast before anything is allocated
(torch-free): the memory cap of `zeroedge run --device-memory` admits a request, or serves it with
thermal KV when dense KV would not fit, from these numbers.

  weights      the model's parameters (the fast decoder's fused q/k/v and gate/up matrices are
               the model's own storage: zeroedge.runtime.fast._Weights), plus the packed 4- / 8-bit
               forms of a model whose weights section was applied (`packed`, zeroedge.quant.packed)
  prefill_kv   the prompt's K/V in a prefill cache of its own (zeroedge.model.chunked_prefill), alive
               until the decoder has taken it: thermal with the pinned-host cold store only (dense
               prefills into the decoder's cache, thermal int8 / int4 into its cold store)
  activations  one prefill chunk's hidden states, q/k/v and MLP intermediates (its causal mask is
               a lower-right bias, never materialised); a compressed cold store's prefill also holds
               a span's hidden states (it runs a span a layer at a time)
  decoder      dense: the static cache of prompt + new tokens; thermal: the window, sketch, page
               table and (int8 / int4 unless mapped from a file, or any cold store on a memory the host
               shares) the cold store
               (zeroedge.kv.policy.thermal_device_bytes), plus what loading a layer's prefix takes
               for a moment (the sketch fit's fp64 / fp32 copies of a chunk of keys); both: the RoPE
               tables of the decode positions
  peak         dense: weights + decoder + activations; thermal int8 / int4: weights + decoder + one
               layer's dequantized past (K and V; the fp32 step one block of it) + a span's hidden
               states + max(activations, sketch copies); thermal host: weights + prefill_kv +
               max(activations, decoder + sketch copies); a cap admits peak x (1 + HEADROOM)
Checked against torch.cuda.max_memory_allocated on an H200 (benchmarks/thermal_kv.md).
"""
from __future__ import annotations

from typing import Optional

from zeroedge.kv.policy import (COLD_BITS, DEQUANT_BLOCK, SKETCH_CHUNK, THERMAL, ThermalSettings, cold_group,
                                thermal_device_bytes)


HEADROOM = 0.1   # the forecast falls 1-3 % short of the H200's allocated peaks (65K-341K): a cap admits forecast x 1.1
ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")      # PyTorch reads one or the other by release


def cap_allocator(environ) -> None:
    """For a memory cap, before torch is imported: PyTorch's CUDA allocator with segments that grow
    in place (expandable_segments), in both variables, unless either already chose. A cap holds the
    allocator's reserved bytes, and with fixed segments the reserve beside the allocated ones took
    ~1 GiB of the Orin Nano's 5.90 GiB: its largest dense and thermal prompts ran out of memory
    (H200; benchmarks/thermal_kv.md)."""
    if any("expandable_segments" in environ.get(k, "") for k in ALLOC_CONF):
        return
    for k in ALLOC_CONF:
        environ[k] = ",".join(filter(None, (environ.get(k), "expandable_segments:True")))


def weights_bytes(cfg, element: int, tied: Optional[bool] = None) -> int:
    """Parameters, the lm_head once when tied."""
    D, F, hd, L = cfg.dim, cfg.ffn_dim, cfg.head_dim, cfg.n_layers
    H, nkv, V = cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size
    tied = cfg.tie_embeddings if tied is None else tied
    qkv = (H + 2 * nkv) * hd * D + ((H + 2 * nkv) * hd if cfg.qkv_bias else 0)
    layer = qkv + H * hd * D + 3 * D * F + 2 * D
    return (L * layer + V * D * (1 if tied else 2) + D) * element


def request_bytes(cfg, element: int, prompt_len: int, max_new: int, budget: Optional[float] = None,
                  settings: ThermalSettings = THERMAL, cold: str = "host", cold_shares_memory: bool = False,
                  chunk: int = 2048, packed: int = 0, cold_in_file: bool = False, span: int = 16384) -> dict:
    """The forecast (bytes) for one request: dense KV when budget is None, else thermal KV at hot
    fraction `budget`. cold: "host", "int8" or "int4"; cold_shares_memory: a "host" cold store is in the
    same memory (CPU serving, or a Jetson's unified DRAM) and counts; cold_in_file: the int8 / int4
    store is mapped from a file (`spill_dir`) and does not count (the page cache it passes through
    is memory the kernel takes back). chunk and span: zeroedge.model.PREFILL_CHUNK and PREFILL_SPAN."""
    L, nkv, hd = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    ps = settings.page_size
    P = ((prompt_len - 1) // ps) * ps               # prefilled; the prompt's tail runs through decode
    kv_token = 2 * L * nkv * hd * element
    C = min(chunk, max(P, 1))
    act = C * (4 * cfg.dim + 3 * cfg.ffn_dim + (cfg.n_heads + 2 * nkv) * hd) * element
    rope = (prompt_len + max_new) * hd * (2 * element + 2)
    layer_kv = 2 * nkv * P * hd * element           # one layer's K/V at full precision
    block = min(P, DEQUANT_BLOCK)                    # dequantized a block at a time: its fp32 step, and
    dequant = nkv * block * hd * 4                   # from a file a block's records (K and V codes and
    if cold_in_file:                                 # scales) moved to the device
        dequant += 2 * nkv * block * (hd * COLD_BITS[cold] // 8 + 2 * (hd // cold_group(hd)))
    load = 3 * min(P, SKETCH_CHUNK) * nkv * hd * 8   # the sketch fit's copies of a chunk of keys
    w = weights_bytes(cfg, element) + packed
    if budget is None:
        decoder = kv_token * (prompt_len + max_new) + rope
        out = {"weights": w, "prefill_kv": 0, "activations": act, "decoder": decoder, "peak": w + decoder + act}
        return out
    kb = thermal_device_bytes(L, nkv, hd, P, prompt_len - P + max_new, element, budget, settings, cold,
                              in_file=cold_in_file)
    decoder = kb["hot"] + kb["generated"] + kb["summaries"] + kb["page_table"] + kb["cold_on_device"] + rope
    if cold != "host":      # the prefill writes into the cold store; one layer's past is dequantized at a time
        hidden = min(P, max(1, span // C) * C) * cfg.dim * element      # the span's hidden states
        out = {"weights": w, "prefill_kv": 0, "activations": act + layer_kv + dequant + hidden,
               "decoder": decoder}
        out["peak"] = w + decoder + layer_kv + dequant + hidden + max(act, load)
        return out
    if cold_shares_memory:
        decoder += kb["prefix_full"]
    out = {"weights": w, "prefill_kv": kv_token * P, "activations": act, "decoder": decoder}
    out["peak"] = w + out["prefill_kv"] + max(act, decoder + load)
    return out
