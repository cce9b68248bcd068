"""What a torch serving request holds in device memory, forecast before anything is allocated
(torch-free): the memory cap of `zeroedge run --device-memory` admits a request, or serves it with
thermal KV when dense KV would not fit, from these numbers.

  weights      the model's parameters (the fast decoder's fused q/k/v and gate/up matrices are
               the model's own storage: zeroedge.runtime.fast._Weights)
  prefill_kv   the prompt's K/V in the prefill cache (zeroedge.runtime.session.chunked_prefill),
               alive until the decoder has taken it
  activations  one prefill chunk's hidden states, q/k/v and MLP intermediates, and its attention
               mask over the cache (bool + additive in the model's dtype)
  decoder      dense: the static cache of prompt + new tokens; thermal: the window, sketch, page
               table and (int8, or any cold store on a memory the host shares) the cold store
               (zeroedge.kv.policy.thermal_device_bytes), plus what loading a layer's prefix takes
               for a moment (fp32 copies of its keys while the sketch is fitted); both: the RoPE
               tables of the decode positions
  peak         weights + prefill_kv + max(activations, decoder); a cap admits peak x (1 + HEADROOM)
Checked against torch.cuda.max_memory_allocated on an H200 (benchmarks/thermal_kv.md §2j).
"""
from __future__ import annotations

from typing import Optional

from zeroedge.kv.policy import THERMAL, ThermalSettings, thermal_device_bytes


HEADROOM = 0.06  # the forecast falls 2-5 % short of the H200's measured peaks: a cap admits forecast x 1.06
LOAD_COPIES = 6   # fp32 copies of one layer's prefix keys alive while ThermalAttention loads it (fitted on the H200)


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
                  chunk: int = 2048) -> dict:
    """The forecast (bytes) for one request: dense KV when budget is None, else thermal KV at hot
    fraction `budget`. cold: "host" or "int8"; cold_shares_memory: a "host" cold store is in the
    same memory (CPU serving, or a Jetson's unified DRAM) and counts."""
    L, nkv, hd = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    ps = settings.page_size
    P = ((prompt_len - 1) // ps) * ps               # prefilled; the prompt's tail runs through decode
    kv_token = 2 * L * nkv * hd * element
    C = min(chunk, max(P, 1))
    act = C * (4 * cfg.dim + 3 * cfg.ffn_dim + (cfg.n_heads + 2 * nkv) * hd) * element + C * P * (1 + element)
    rope = (prompt_len + max_new) * hd * (2 * element + 2)
    if budget is None:
        decoder = kv_token * (prompt_len + max_new) + rope
    else:
        kb = thermal_device_bytes(L, nkv, hd, P, prompt_len - P + max_new, element, budget, settings, cold)
        decoder = (kb["hot"] + kb["generated"] + kb["summaries"] + kb["page_table"] + kb["cold_on_device"]
                   + rope + LOAD_COPIES * nkv * P * hd * 4)
        if cold == "host" and cold_shares_memory:
            decoder += kb["prefix_full"]
    out = {"weights": weights_bytes(cfg, element), "prefill_kv": kv_token * P, "activations": act,
           "decoder": decoder}
    out["peak"] = out["weights"] + out["prefill_kv"] + max(act, decoder)
    return out
