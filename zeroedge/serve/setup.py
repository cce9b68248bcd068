"""From the command line's options to a running server: the model or bundle, the KV pool sized from
the memory there is, the engine, the HTTP app under uvicorn, and systemd's notifications."""
from __future__ import annotations

import threading
from typing import Optional

from zeroedge.errors import UserError

KV_SHARE_OF_AVAILABLE = 0.5      # of MemAvailable (CPU, Jetson) or CUDA free memory, when nothing caps it


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def available_bytes(device) -> tuple:
    """(bytes the KV may take before anything caps it, where that figure comes from). A Jetson's
    device memory is its DRAM shared with the OS: MemAvailable, not CUDA's free figure."""
    from zeroedge.device.probe import device_root, meminfo
    from zeroedge.kv.policy import memory_kind

    kind = memory_kind(device)
    if kind == "discrete":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free * KV_SHARE_OF_AVAILABLE), f"half of the GPU's free memory ({_mib(free)})"
    avail = meminfo(device_root())["available"]
    if not avail:
        raise UserError("cannot read MemAvailable from /proc/meminfo: give --kv-memory SIZE")
    return int(avail * KV_SHARE_OF_AVAILABLE), f"half of MemAvailable ({_mib(avail)}, {kind})"


def _trim_heap() -> None:
    """Hand the heap's free memory back to the OS (glibc keeps it for reuse): building the 4-bit step
    and emptying the float linears free ~350 MiB at once on SmolLM2-135M."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):            # not glibc
        pass


def kv_pool_bytes(model, max_batch: int, ctx: int, kv_bytes: Optional[int], cap: Optional[int],
                  prefill_chunk: int, resident: int) -> tuple:
    """(bytes, why): --kv-memory as given; else what the cap leaves after the weights (`resident`
    bytes) and a step's activations, or a share of the memory available; never more than max_batch
    full contexts."""
    from zeroedge.serve.backends import position_bytes

    p = model.embed_tokens.weight
    cfg = model.cfg
    per_pos = position_bytes(cfg, p.element_size())
    most = max_batch * ctx * per_pos
    if kv_bytes is not None:
        return kv_bytes, "--kv-memory"
    # one step's activations: the chunk's and the batch's rows through the widest layer, the logits
    rows = prefill_chunk + max_batch
    act = rows * (4 * cfg.dim + 3 * cfg.ffn_dim + cfg.vocab_size) * 4 + rows * ctx * cfg.n_heads * 4
    if cap is not None:
        left = cap - resident - act
        if left < per_pos * 16:
            raise UserError(f"the memory cap of {_mib(cap)} leaves no room for KV after the weights "
                            f"({_mib(resident)}) and a step's activations ({_mib(act)})")
        return min(left, most), f"the {_mib(cap)} cap less weights and activations"
    avail, why = available_bytes(p.device)
    return min(max(avail - act, per_pos * 16), most), why


def batched_backend(m, weights: str, threads: int, max_batch: int, chunk: int, kv_bytes: Optional[int],
                    cap: Optional[int], ctx: int, kv_budget: Optional[float] = None, invariant: bool = False) -> tuple:
    """The engine's batched backend over model `m` (on its device, in eval mode) -> (TorchBatched, the
    4-bit CPU step or None, where its KV pool's size comes from). weights: "q4" (the CPU's 4-bit step in
    onnxruntime; the model's float linears are emptied) or "model" (its weights in torch)."""
    import torch

    from zeroedge.serve.backends import TorchBatched

    linears = None
    if weights == "q4":
        if m.embed_tokens.weight.device.type != "cpu":
            raise UserError("--weights q4 runs on the CPU (onnxruntime); on CUDA the model's weights serve")
        from zeroedge.errors import require

        require("onnx", "serve")
        require("onnxruntime", "serve")
        from zeroedge.serve.cpu_q4 import Q4Step

        linears = Q4Step(m, threads, release_float=True)
        _trim_heap()
        torch.set_num_threads(1)            # torch's ops here are small: its idle threads would spin
    from zeroedge.runtime.memory import weights_bytes

    resident = (linears.weight_bytes if linears is not None
                else weights_bytes(m.cfg, m.embed_tokens.weight.element_size()))
    pool, why = kv_pool_bytes(m, max_batch, ctx, kv_bytes, cap, chunk, resident)
    return TorchBatched(m, pool, max_batch, chunk, linears, kv_budget, invariant), linears, why


def build_server(model, backend, bundle, engines, plugins, served_name, max_batch, prefill_chunk, kv_bytes, cap,
                 ctx, device, threads, api_key, max_queue, max_prompt_tokens, default_max_tokens, max_body_bytes,
                 weights="auto", speculative="off", kv_budget=None, release_level=3, invariant=False):
    from zeroedge.serve.api import Server
    from zeroedge.serve.engine import Engine
    from zeroedge.serve.metrics import ServeMetrics
    from zeroedge.serve.plan import Planner

    import torch

    thermal_gate = None                         # zeroedge.kv.policy.ReleaseGate with --kv-budget
    draft_model = None                          # zeroedge.serve.backends.DraftModel with --speculative packed
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    if backend == "torch":
        from zeroedge.weights import resolve_model, tokenizer_for

        dev = "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
        if dev == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device here")
        m, cfg, folder = resolve_model(model, need_weights=True)
        m = m.to(dev, torch.bfloat16 if dev == "cuda" else torch.float32).eval()
        ctx = min(ctx or cfg.max_seq_len, cfg.max_seq_len)
        chunk = prefill_chunk or (512 if dev == "cuda" else 128)
        if speculative == "packed" and weights == "q4":
            raise UserError("--speculative packed drafts with the model's own weights in 4 bits for its weights in "
                            "torch: give --weights model")
        if weights == "auto":                   # thermal KV and the packed drafter's checks run on the torch step
            weights = "q4" if dev == "cpu" and kv_budget is None and speculative != "packed" else "model"
        invariant = invariant and dev == "cuda"     # the CPU steps compute a row alike for any batch already
        b, linears, why = batched_backend(m, weights, threads, max_batch, chunk, kv_bytes, cap, ctx, kv_budget,
                                          invariant)
        b.warm_up()
        if speculative == "packed" and dev == "cuda":   # one request at a time, the context's KV
            from zeroedge.serve.backends import DecoderDraftModel

            draft_model = DecoderDraftModel(m, ctx)
        elif speculative == "packed":           # its own KV pool, as large as the model's
            from zeroedge.serve.backends import DraftModel

            draft_model = DraftModel.build(m, threads, b.positions_total, max_batch, chunk)
        tok = tokenizer_for(cfg, folder)
        name = served_name or (cfg.name if model in _presets() else str(model))
        info = {"mode": "batched", "backend": "torch", "device": b.device, "max_batch": max_batch,
                "weights": (linears.description if linears is not None
                            else f"the model's, {str(m.embed_tokens.weight.dtype)[6:]}"),
                "cpu_kernels": linears.kernels if linears is not None else None, "prefix_cache": b.prefix_cache,
                "prefill_chunk": chunk, "kv_pool_bytes": b.positions_total * b.position_bytes,
                "kv_pool_from": why, "context": ctx, "vocab_size": cfg.vocab_size, "thermal_kv": None,
                "batch_invariant": invariant or dev == "cpu"}
        if draft_model is not None:
            info["speculative_drafter"] = {"weights": draft_model.weights, "kv_pool_bytes": draft_model.kv_bytes()}
        if kv_budget is not None:
            from zeroedge.kv.policy import ReleaseGate

            thermal_gate = ReleaseGate(release_level)
            info["thermal_kv"] = {"budget": kv_budget, "release_level": release_level,
                                  "page_size": b.pool.page_size,
                                  "min_prompt": b.sketches.min_prompt(),
                                  "note": "decode steps read the sink, recent and generated pages and the sketch's "
                                          "choice of the prompt's; every page stays in the pool"}
    else:
        from zeroedge.weights import tokenizer_for
        from zeroedge.serve.session import ServingSession, open_bundle
        from zeroedge.serve.backends import SessionSequential

        sess = ServingSession(open_bundle(bundle, backend, engines, plugins, threads or None),
                              release_level=release_level)
        mc = sess.runner.manifest["model"]
        ctx = min(ctx or sess.context, sess.context)
        b = SessionSequential(sess, ctx)
        from types import SimpleNamespace

        tok = tokenizer_for(SimpleNamespace(vocab_size=mc["vocab_size"], name=mc.get("name")), bundle)
        name = served_name or str(mc.get("name") or "bundle")
        info = {"mode": "sequential", "backend": backend, "device": b.device,
                "max_batch": 1, "context": ctx, "vocab_size": mc["vocab_size"],
                "note": "a bundle serves one request at a time; the others wait in the queue"}
    eos = _eos_ids(tok, folder if backend == "torch" else bundle)
    lltok = _llguidance_tokenizer(tok, eos)
    planner = Planner(ctx, b.positions_total, b.position_bytes, eos, min_prompt=b.min_prompt, thermal_gate=thermal_gate,
                      session=getattr(b, "session", None))
    engine = Engine(b, tok, lltok, on_tick=_watchdog(), speculative=speculative, draft_model=draft_model)
    info["speculative"] = engine.speculative
    if engine.speculative != speculative:
        info["speculative_reason"] = "a bundle's step gives the last position's logits only"
    metrics = ServeMetrics(engine.load, b.kv_stats)
    engine.metrics = metrics
    engine.start()
    return Server(engine, planner, tok, lltok, metrics, name, info, api_key=api_key, max_queue=max_queue,
                  max_prompt_tokens=max_prompt_tokens, default_max_tokens=default_max_tokens,
                  max_body_bytes=max_body_bytes)


def _presets():
    from zeroedge import weights
    from zeroedge.model import PRESETS

    return set(PRESETS) | set(weights.BUNDLED)


def _eos_ids(tok, folder) -> list:
    """The tokens that end a reply: the tokenizer's EOS and generation_config.json's eos_token_id
    (Llama 3 Instruct ends a turn with <|eot_id|>, not its tokenizer's EOS)."""
    import json
    from pathlib import Path

    ids = [getattr(tok, "eos_token_id", None)]
    gc = Path(folder) / "generation_config.json" if folder is not None else None
    if gc is not None and gc.is_file():
        try:
            e = json.loads(gc.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            e = None
        ids += e if isinstance(e, list) else [e]
    return sorted({int(i) for i in ids if isinstance(i, int)})


def _llguidance_tokenizer(tok, eos):
    """llguidance's view of a Hugging Face tokenizer (None for the byte tokenizer of random presets)."""
    try:
        import llguidance.hf
    except ImportError:
        return None
    if not hasattr(tok, "backend_tokenizer") and not hasattr(tok, "_tokenizer"):
        return None
    return llguidance.hf.from_tokenizer(tok, eos_token=eos or None)


def _watchdog():
    """WATCHDOG=1 to systemd from the engine thread, at half the unit's WatchdogSec (no-op otherwise)."""
    import time

    from zeroedge.daemon.notify import notify, watchdog_interval_s

    every = watchdog_interval_s()
    last = [0.0]

    def tick():
        if every is not None and time.monotonic() - last[0] >= every:
            last[0] = time.monotonic()
            notify("WATCHDOG=1")
    return tick


def run_http(server, bind: str, port: int) -> None:
    """uvicorn in this thread until SIGINT / SIGTERM; READY=1 once it listens, STOPPING=1 after."""
    import signal
    import time

    import uvicorn

    from zeroedge.daemon.notify import notify
    from zeroedge.serve.api import create_app

    config = uvicorn.Config(create_app(server), host=bind, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=30, server_header=False)
    http = uvicorn.Server(config)

    def ready():
        while not http.started and not http.should_exit:
            time.sleep(0.05)
        if http.started:
            addr = ", ".join(f"{s.getsockname()[0]}:{s.getsockname()[1]}" for srv in http.servers
                             for s in srv.sockets)
            print(f"zeroedge serve: {server.model_name} ({server.info['mode']}) on http://{addr}/v1", flush=True)
            notify("READY=1")

    # uvicorn restores the handlers it found and raises a captured SIGTERM / SIGINT again once it has
    # shut down: found as Python handlers, that second raise returns here instead of killing the
    # process before the engine stops and systemd hears STOPPING=1
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda n, f: None)
    threading.Thread(target=ready, daemon=True).start()
    try:
        http.run()
    finally:
        notify("STOPPING=1")
        server.engine.stop()
    if server.engine.error:
        raise UserError(f"the engine stopped: {server.engine.error}")
