"""Memory and roofline planner for Jetson Orin targets (torch-free).

Memory (bytes, unified DRAM on Orin: GPU and CPU share it):
  weights        every weight tensor once per engine, at the plan dtype: WEIGHT_COPIES = 2, because
                 that is what the runtimes hold. Prefill and decode are two graphs; an onnxruntime
                 session keeps its own initializers (the fp16 -> fp32 Casts are folded per session)
                 and its own prepacked GEMM copies: measured on an x86 CPU, prefill alone 58-74 MiB, both
                 sessions 132 MiB for 45 MiB of fp32 weights (6-layer d384 bundle); sharing them
                 would need onnxruntime's prepacked-weights container, which its Python API does not
                 offer. A TensorRT engine carries and deserializes its own weights (both engines of
                 that bundle are ~55 MB, TensorRT-RTX build). One copy needs one graph serving both
                 roles (not done). onnxruntime CPU with a tied lm_head also keeps ~2 packed
                 [V, D] fp32 copies per session
                 4-bit bundles (manifest weights.quantization): the quantized linear layers count the
                 bytes weights.bin really stores for the flavour that runs (TensorRT: signed INT4 +
                 scales + zero-point offsets; onnxruntime: MatMulNBits' blobs + scales + zero points),
                 the rest (embedding, norms) params at the plan dtype; a bundle exported with
                 --cpu-kernels zeroedge: the linear layers' bytes once more in an onnxruntime process
                 (its Q4Linear nodes keep their own packed copy)
  hot_kv         L * Hkv * hd * min(context, window) * (K + V element bytes as the decode graph takes
                 them: fp32 K + fp16 V; the plan dtype's for bundles that do not record it)
  compressed     the rest of the context in the int8 tier: 1 byte per value + an fp16 scale per 64
  activations    the larger of prefill and one decode step. Prefill runs in chunks of C tokens
                 (the bundle's prefill.chunk; one pass, C = T, for bundles from before chunking and for
                 SIH/PAD bundles exported one pass): `score_copies` live [h, c, past + c] fp32 score tensors of the
                 largest chunk (the last full one or the last; onnxruntime CPU: 3 in one pass, 4
                 chunked, fitted on two shapes (1.9-4.9 over T 1-4K, C 512-1K) and checked on a
                 third in tests/test_plan.py; TensorRT: 2, assumed) + the
                 prompt's K/V (one pass: the graph's presents; chunked: the runner's fp32 buffer,
                 on a device also the prefix copied into the engine's inputs) + one chunk's MLP
                 intermediates + logits
  workspace      TensorRT builder/runtime scratch (assumed 256 MiB on device; 0 on host)
  runtime        CUDA context + TensorRT/cuDNN/cuBLAS libraries resident in DRAM (assumed 0.6 GiB)
  os_reserve     JetPack's headless L4T + services (assumed; see TARGETS)

Roofline: time = max(FLOPs / (peak * compute_eff), bytes / (bandwidth * bandwidth_eff)).
Compute figures: dense FP16 tensor-core peak = tensor cores x 512 FLOP/clock x GPU max clock
(Ampere 3rd-gen tensor core: 256 dense FP16 FMA per clock, NVIDIA A100/GA10x whitepapers), with the
GPU configuration of NVIDIA's Jetson Orin module data sheets (tensor cores, max GPU clock in the
module's top standard power mode). FP32 on CUDA cores = cores x 2 x clock. Cross-check: AGX Orin
64GB is listed at 170 sparse INT8 TOPS for the GPU -> 85 dense INT8 -> 42.5 dense FP16 TFLOPS.
Bandwidths are the data-sheet DRAM figures (68 / 102.4 / 204.8 GB/s).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from zeroedge.errors import UserError

GiB = 1 << 30


def parse_size(text: str, what: str = "--workspace", minimum: int = 1 << 20) -> int:
    """'512M' / '1G' / '1.5GiB' / '268435456' -> bytes (K, M, G, T are binary: 1G = 1 GiB); at least
    `minimum` (1 MiB unless said otherwise)."""
    import re

    s = str(text).strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?", s)
    if not m:
        raise UserError(f"{what} {text!r} is not a size (use e.g. 512M, 1G or a number of bytes)")
    n = float(m.group(1)) * (1 << (10 * " KMGT".index(m.group(2).upper() or " ")))
    if n < minimum:
        raise UserError(f"{what} {text!r} is too small: give at least {minimum >> 20}M")
    return int(n)


@dataclass(frozen=True)
class Target:
    name: str
    memory: int            # bytes of DRAM
    bandwidth: float       # bytes / s
    cuda_cores: int
    tensor_cores: int
    gpu_clock: float       # Hz
    os_reserve: int        # bytes (assumption: headless JetPack 6 + services)

    @property
    def fp16_flops(self) -> float:
        return self.tensor_cores * 512 * self.gpu_clock

    @property
    def fp32_flops(self) -> float:
        return self.cuda_cores * 2 * self.gpu_clock


TARGETS = {
    "orin-nano-8gb": Target("orin-nano-8gb", 8 * GiB, 68e9, 1024, 32, 625e6, int(1.5 * GiB)),
    "orin-nx-16gb": Target("orin-nx-16gb", 16 * GiB, 102.4e9, 1024, 32, 918e6, 2 * GiB),
    "orin-agx-64gb": Target("orin-agx-64gb", 64 * GiB, 204.8e9, 2048, 64, 1.3e9, 3 * GiB),
}
COMPUTE_EFF = 0.4          # fraction of tensor-core peak a TensorRT LLM layer reaches (assumption)
BANDWIDTH_EFF = 0.7        # fraction of DRAM bandwidth decode streams reach (assumption)
WORKSPACE = 256 << 20
RUNTIME = int(0.6 * GiB)
DTYPES = {"fp16": 2, "fp32": 4}


def target(name: str) -> Target:
    if name not in TARGETS:
        raise UserError(f"unknown board {name}; known boards: {', '.join(TARGETS)}")
    return TARGETS[name]


def model_numbers(manifest: dict, weight_bytes: int) -> dict:
    """The model's shapes; params from the manifest's weights section (export records them), else
    weights.bin's bytes / 4 (bundles from before it: float32 weights)."""
    c = manifest["model"]
    hd = c["dim"] // c["n_heads"]
    w = manifest.get("weights") or {}
    params = int(w.get("params") or weight_bytes // 4)
    q = w.get("quantization") or {}
    return {"L": c["n_layers"], "D": c["dim"], "F": c["ffn_dim"], "h": c["n_heads"], "hkv": c["n_kv_heads"],
            "hd": hd, "V": c["vocab_size"], "params": params,
            "tied": bool(c.get("tie_embeddings", True)),
            "quant_params": int(q.get("quantized_params") or 0),
            "quant_bytes": {k: int(v) for k, v in (q.get("bytes") or {}).items()},
            "emb_params": int((q.get("embedding") or {}).get("params") or 0),
            "emb_bytes": {k: int(v) for k, v in ((q.get("embedding") or {}).get("bytes") or {}).items()},
            "window_bytes": _window_bytes(manifest),
            "cpu_kernels": (manifest.get("cpu_kernels") or {}).get("kind", "stock"),
            "q8_head": bool(((manifest.get("cpu_kernels") or {}).get("nodes") or {}).get("Q8Linear"))}


ONNX_DTYPE_BYTES = {1: 4, 10: 2, 16: 2, 11: 8}     # float, float16, bfloat16, double


def _window_bytes(manifest: dict):
    """Bytes of one key + one value element in the hot window, as the decode graph takes them (fp32 K
    + fp16 V = 6), or None (no decode graph recorded: the plan dtype then)."""
    inputs = {i["name"]: i["dtype"] for i in
              ((manifest.get("export") or {}).get("graphs") or {}).get("decode", {}).get("inputs", [])}
    k, v = (ONNX_DTYPE_BYTES.get(inputs.get(n)) for n in ("past_k.0", "past_v.0"))
    return k + v if k and v else None


def _flavour_bytes(by_flavour, device: bool):
    """The stored bytes of the flavour that runs (trt on a device, portable in an onnxruntime process),
    or of the one flavour a single-flavour bundle has."""
    by_flavour = by_flavour or {}
    return by_flavour.get("trt" if device else "portable") or next(iter(by_flavour.values()), None)


def linear_bytes_per_param(m: dict, b: int, device: bool) -> float:
    """Bytes per parameter of the linear layers as the runtime reads them: the stored 4-bit bytes of
    the flavour that runs (trt on a device, portable in an onnxruntime process), else the plan dtype."""
    qb = _flavour_bytes(m.get("quant_bytes"), device)
    return qb / m["quant_params"] if qb and m.get("quant_params") else float(b)


def embedding_bytes(m: dict, b: int, device: bool) -> float:
    """The embedding (= tied LM head) as stored when it is int8, else V * D at the plan dtype."""
    eb = _flavour_bytes(m.get("emb_bytes"), device)
    return float(eb) if eb and m.get("emb_params") else float(m["V"] * m["D"] * b)


def _weights_once(m: dict, b: int, device: bool) -> float:
    qp, ep = m.get("quant_params", 0), m.get("emb_params", 0)
    rest = m["params"] - qp - (ep or 0)
    return (qp * linear_bytes_per_param(m, b, device) + (embedding_bytes(m, b, device) if ep else 0)
            + rest * b)


# onnxruntime CPU with OrtRunner's priority-based node order, live fp32 score tensors at the peak, fitted on
# two shapes (8 layers d512 8/4 heads; SmolLM2's 30 layers d576 9/3 heads; T 1-4K, C 512-1K):
SCORE_COPIES_HOST = 3     # one pass: [h, T, T] (measured 1.9-4.0)
SCORE_COPIES_HOST_CHUNKED = 4    # chunked: [h, C, T] at the last chunk (measured 3.2-4.9)
SCORE_COPIES_DEVICE = 2   # TensorRT fuses the softmax chain (assumption, not measured)
WEIGHT_COPIES = 2         # prefill and decode each hold the weights (module docstring)


def prefill_chunk(manifest: dict) -> Optional[int]:
    """The chunk the runners prefill this bundle in (zeroedge.bundle.prefill_plan); None: one pass."""
    from zeroedge.bundle import prefill_plan

    return prefill_plan(manifest)[0]


def memory(m: dict, context: int, window: int, dtype: str, device: bool, engines: int = WEIGHT_COPIES,
           score_copies: Optional[int] = None, chunk: Optional[int] = None) -> dict:
    """chunk: the prefill's chunk (None: one pass of the whole context)."""
    b = DTYPES[dtype]
    T = context
    C = min(chunk, T) if chunk else T                 # queries per prefill pass
    chunked = C < T
    if score_copies is None:
        score_copies = SCORE_COPIES_DEVICE if device else (SCORE_COPIES_HOST_CHUNKED if chunked
                                                           else SCORE_COPIES_HOST)
    hot = min(context, window)
    per_tok_kv = 2 * m["L"] * m["hkv"] * m["hd"]
    # the prompt's K/V: one pass, the graph's presents; chunked, the runner's fp32 buffer (+ on a
    # device the prefix copied into the engine's input buffers)
    prompt_kv = per_tok_kv * T * ((4 * (2 if device else 1)) if chunked else b)
    n = -(-T // C)                                    # passes; the largest scores: the last full
    scores = max(C * min(T, (n - 1) * C) if n > 1 else C * C, (T - (n - 1) * C) * T)   # chunk or the last
    act_prefill = (score_copies * m["h"] * scores * 4 + prompt_kv + 3 * C * m["F"] * b
                   + 4 * C * m["D"] * b + m["V"] * 4 + m["L"] * T * 4)
    act_decode = 4 * m["h"] * hot * 4 + per_tok_kv * b + 3 * m["F"] * b + m["V"] * 4
    # onnxruntime CPU, tied lm_head (Gemm transB=1 on the embedding the Gather also reads): the
    # original stays and the MatMul kernel keeps its own transposed/packed copies (measured ~2 per
    # session). TensorRT: counted once (assumption).
    tied = 2 * m["V"] * m["D"] * 4 if (m.get("tied") and not device and not m.get("emb_params")) else 0
    qp = m.get("quant_params", 0)
    w_one = _weights_once(m, b, device)
    # zeroedge's onnxruntime kernels (cpu_kernels zeroedge): the decode session's Q4Linear nodes copy the
    # 4-bit linear layers once more, in their own order (ortops/q4_linear.cc): per block of 32 weights
    # 16 bytes of codes and a float16 d and c, whatever the bundle's group and zero point; a Q8Linear
    # LM head its 8-bit codes and float16 d (ortops/q8_linear.cc)
    packed = 0
    if not device and m.get("cpu_kernels") == "zeroedge":
        packed = qp * (16 + 2 + 2) / 32 + (m.get("emb_params", 0) * (32 + 2) / 32 if m.get("q8_head") else 0)
    out = {"weights": engines * (w_one + tied) + packed, "weight_copies": engines, "prefill_chunk": C,
           "weights_quantized": int(qp * linear_bytes_per_param(m, b, device)) if qp else 0,
           "prefill_activations": act_prefill,
           "hot_kv": per_tok_kv // 2 * hot * m["window_bytes"] if m.get("window_bytes") else per_tok_kv * hot * b,
           "compressed_kv": per_tok_kv * max(context - window, 0) * (1 + 2 / 64),
           "activations": max(act_prefill, act_decode),
           "workspace": WORKSPACE if device else 0,
           "runtime": RUNTIME if device else 0}
    out["model_total"] = out["weights"] + out["hot_kv"] + out["compressed_kv"] + out["activations"]
    out["total"] = out["model_total"] + out["workspace"] + out["runtime"]
    return out


def roofline(m: dict, t: Target, context: int, window: int, dtype: str, ffn_skip: float = 0.0,
             decode_ffn_bytes_skip: float = 0.0, sparse_eff: float = 1.0, chunk: Optional[int] = None) -> dict:
    """ffn_skip: fraction of prefill FFN FLOPs skipped (SIH/PAD). decode_ffn_bytes_skip: fraction
    of FFN weight bytes a decode step does not read (decode paths); sparse_eff: the bandwidth the
    sparse FFN kernels reach relative to the dense GEMV (measured on the H200: 0.70-0.91,
    benchmarks/paths.md), applied to the FFN bytes still read. chunk: the prefill's chunk (None: one
    pass, the graph's [T, T] scores computed whole; chunked, each chunk's [C, past + C], the weights
    and the prefix K/V read once per chunk)."""
    if not (0 <= decode_ffn_bytes_skip < 1) or not (0 < sparse_eff <= 1):
        raise UserError("decode_ffn_bytes_skip must be in [0, 1) and sparse_eff in (0, 1]")
    b = DTYPES[dtype]
    peak = t.fp16_flops if dtype == "fp16" else t.fp32_flops
    L, D, F, h, hd = m["L"], m["D"], m["F"], m["h"], m["hd"]
    ffn = 3 * D * F * L
    other = m["params"] - ffn - m["V"] * D            # attention projections (+ SIH, tiny)
    T = context
    C = min(chunk, T) if chunk else T
    n = -(-T // C)                                    # passes; the last may be shorter
    qk = sum(min(C, T - i * C) * min(T, (i + 1) * C) for i in range(n))   # query x key pairs scored
    pf_flops = 2 * T * (ffn * (1 - ffn_skip) + other + 0) + 4 * qk * h * hd * L + 2 * m["V"] * D
    per_tok_kv = 2 * L * m["hkv"] * hd * b
    pf_bytes = n * _weights_once(m, b, True) + per_tok_kv * (T + C * n * (n - 1) // 2)
    pf_t = max(pf_flops / (peak * COMPUTE_EFF), pf_bytes / (t.bandwidth * BANDWIDTH_EFF))
    S = min(context, window)
    ffn_read = ffn if decode_ffn_bytes_skip == 0 else ffn * (1 - decode_ffn_bytes_skip) / sparse_eff
    lb = linear_bytes_per_param(m, b, True)          # roofline: the device's (TensorRT) bytes
    dec_bytes = (ffn_read + other) * lb + embedding_bytes(m, b, True) + 2 * L * m["hkv"] * hd * S * b
    dec_flops = 2 * (ffn + other + m["V"] * D) + 4 * S * h * hd * L
    dec_t = max(dec_flops / (peak * COMPUTE_EFF), dec_bytes / (t.bandwidth * BANDWIDTH_EFF))
    return {"prefill_s": pf_t, "prefill_tok_s": T / pf_t, "prefill_passes": n,
            "prefill_bound": "compute" if pf_flops / peak > pf_bytes / t.bandwidth else "bandwidth",
            "decode_ms": dec_t * 1e3, "decode_tok_s": 1 / dec_t,
            "decode_bound": "compute" if dec_flops / peak > dec_bytes / t.bandwidth else "bandwidth",
            "peak_flops": peak, "compute_eff": COMPUTE_EFF, "bandwidth": t.bandwidth,
            "bandwidth_eff": BANDWIDTH_EFF, "ffn_flops_skipped": ffn_skip,
            "decode_ffn_bytes_skipped": decode_ffn_bytes_skip, "sparse_eff": sparse_eff}


def plan(bundle, target_name: str, context: int, window: Optional[int] = None, dtype: str = "fp16",
         device: bool = True, chunk: Optional[int] = None) -> dict:
    """chunk: the prefill chunk to plan for (default: the bundle's; prefill_chunk)."""
    from zeroedge import bundle as bundle_mod

    t = target(target_name)
    if context < 1:
        raise UserError("--ctx must be >= 1")
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype}; known: {', '.join(DTYPES)}")
    mf = bundle_mod.verify(Path(bundle))
    wb = mf["files"].get("weights.bin", {}).get("bytes")
    if wb is None:
        raise UserError(f"{bundle}: bundle has no weights.bin")
    m = model_numbers(mf, wb)
    window = int(window or mf.get("window", 1024))
    skip = float((mf.get("calibration") or {}).get("quality", {}).get("ffn_flops_skipped", 0.0) or 0.0)
    if chunk is not None and chunk < 1:
        raise UserError(f"--prefill-chunk must be >= 1 (got {chunk})")
    chunk = chunk if chunk is not None else prefill_chunk(mf)
    mem = memory(m, context, window, dtype, device, chunk=chunk)
    cap = t.memory - t.os_reserve
    model_context = int(mf["model"].get("max_seq_len", 1 << 20))
    lo, hi = 0, model_context
    while lo < hi:                                  # largest context that fits, up to the model's own
        mid = (lo + hi + 1) // 2
        if memory(m, mid, window, dtype, device, chunk=chunk)["total"] <= cap:
            lo = mid
        else:
            hi = mid - 1
    fits_memory = mem["total"] <= cap
    return {"target": t.name, "context": context, "window": window, "dtype": dtype, "prefill_chunk": chunk,
            "memory": mem, "available": cap, "device_memory": t.memory, "os_reserve": t.os_reserve,
            "fits": fits_memory and context <= model_context, "fits_memory": fits_memory,
            "model_context": model_context, "max_context": lo,
            "max_context_limited_by": "model context" if lo == model_context else "memory",
            "roofline": roofline(m, t, context, window, dtype, skip, chunk=chunk),
            "figures": {"fp16_tflops": t.fp16_flops / 1e12, "fp32_tflops": t.fp32_flops / 1e12,
                        "tensor_cores": t.tensor_cores, "gpu_clock_mhz": t.gpu_clock / 1e6,
                        "bandwidth_gbs": t.bandwidth / 1e9,
                        "source": "NVIDIA Jetson Orin module data sheets (GPU config, clocks, DRAM "
                                  "bandwidth); 512 dense FP16 FLOP/clk per Ampere tensor core"}}
