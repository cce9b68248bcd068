"""zeroedge serve: the model behind an OpenAI-compatible HTTP API (zeroedge.serve).

    zeroedge serve smollm2-135m                                  # 127.0.0.1:8000, batched on the torch backend
    zeroedge serve smollm2-135m --max-batch 16 --board orin-nano-8gb
    zeroedge serve --backend onnxruntime --bundle bundle/        # one request at a time, the rest queue
    zeroedge serve smollm2-135m --host 0.0.0.0 --api-key-file /etc/zeroedge/api.key

Then any OpenAI client: base_url http://127.0.0.1:8000/v1, model = the served name (`/v1/models`).
--host is the address the server binds (here, not a device): anything but a loopback address needs
--api-key-file (a file only its owner may read; clients send `Authorization: Bearer KEY`).

The KV memory is a pool of pages shared by all requests: --kv-memory SIZE, or by default what the
machine can give (a --board / --device-memory cap less the weights; else half of MemAvailable, the
figure that counts on a Jetson's shared DRAM; on a discrete GPU its free memory), never more than
--max-batch full contexts. A request reserves prompt + max_tokens positions when it is admitted, so a
running request never runs out of memory; one that fits the pool waits for pages, one that never can
is refused (HTTP 400, with both numbers).
"""
import click

from zeroedge.commands.common import check_model, examples, fraction_option, memory_cap, memory_cap_options


@click.command("serve", epilog=examples(
    "zeroedge serve smollm2-135m --port 8000",
    "zeroedge serve --backend onnxruntime --bundle bundle/"))
@click.argument("model", required=False)
@click.option("--backend", type=click.Choice(["torch", "onnxruntime", "tensorrt"]), default="torch", show_default=True,
              help="torch: batched (continuous batching); onnxruntime / tensorrt: a bundle, one request at a time.")
@click.option("--bundle", type=click.Path(), help="Exported bundle (onnxruntime and tensorrt backends).")
@click.option("--engines", type=click.Path(), help="tensorrt backend: the engines `zeroedge build` made.")
@click.option("--plugins", type=click.Path(), help="tensorrt backend: the zeroedge plugin library.")
@click.option("--host", "bind", default="127.0.0.1", show_default=True, metavar="HOST",
              help="Address to bind; not a loopback address only with --api-key-file.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key-file", type=click.Path(dir_okay=False), help="Bearer key, in a file of mode 0600.")
@click.option("--served-model-name", help="The model id clients send (default: MODEL's name).")
@click.option("--max-batch", type=click.IntRange(1, 256), default=16, show_default=True,
              help="Sequences decoded together (torch backend).")
@click.option("--prefill-chunk", type=click.IntRange(16, 65536), default=None,
              help="Prompt tokens prefilled a step between decode steps (default 128 on a CPU, 512 on CUDA).")
@click.option("--kv-memory", metavar="SIZE", help="KV pool for all requests together (e.g. 512M).")
@click.option("--ctx", type=click.IntRange(16, None), default=None, help="Longest prompt + completion (default: "
              "the model's context).")
@click.option("--max-queue", type=click.IntRange(1, None), default=64, show_default=True,
              help="Requests waiting beyond the batch's free slots before new ones get HTTP 429.")
@click.option("--max-prompt-tokens", type=click.IntRange(1, None), default=None, help="Default: the context.")
@click.option("--default-max-tokens", type=click.IntRange(1, None), default=256, show_default=True,
              help="max_tokens of a request that gives none.")
@click.option("--max-body", "max_body", metavar="SIZE", default="4M", show_default=True, help="Request body limit.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="torch backend device.")
@click.option("--threads", type=click.IntRange(0, None), default=0, help="CPU threads (0 = all cores).")
@click.option("--weights", type=click.Choice(["auto", "q4", "model"]), default="auto", show_default=True,
              help="torch backend: q4 = 4-bit linear layers in onnxruntime on the CPU (the Q4_1 grid: a Q4_1 GGUF's "
                   "own weights), 8-bit LM head; model = the model's weights in torch. auto: q4 on a CPU.")
@click.option("--speculative", type=click.Choice(["auto", "off", "ngram", "packed"]), default="auto", show_default=True,
              help="torch backend: tokens drafted by n-gram lookup in the prompt and the reply (auto, ngram) or by "
                   "the model's own weights in 4 bits (packed, --weights model: the 4-bit CPU step on a CPU, on CUDA "
                   "the packed GEMV step, one request at a time), checked by the "
                   "model in one step (the output is the model's own). auto, packed: while at most 4 requests decode, "
                   "and paused for a request whose drafts do not pay; ngram: always.")
@fraction_option("--kv-budget", "kv_budget",
                 help="torch backend, thermal KV: a long prompt's decode steps read this share of its KV (the sink, "
                      "recent and generated tokens and the pages its key sketch scores best for each step's query); "
                      "every page stays in memory. Off by default; runs on the model's weights in torch.")
@click.option("--release-level", type=click.IntRange(0, 3), default=3, show_default=True,
              help="The requests a mechanism may serve (prompt + max_tokens): 0 none, 1 < 512 tokens, 2 < 4096 "
                   "tokens at temperature 0, 3 all. With --kv-budget, those that take thermal KV; for a bundle "
                   "exported with decode paths, those its decode graph serves (the others: HTTP 400).")
@memory_cap_options("torch backend: device memory the server may use (e.g. 6G); the KV pool is what the "
                    "weights leave of it.")
@click.option("--batch-invariant", "batch_invariant", is_flag=True,
              help="torch backend on CUDA: every product in a kernel that computes a row alike for any number of "
                   "rows, so a request's reply does not depend on what else is batched with it nor on speculative "
                   "checks, bit for bit (the CPU steps are batch-invariant without it; there it changes nothing).")
def cmd(model, backend, bundle, engines, plugins, bind, port, api_key_file, served_model_name, max_batch,
        prefill_chunk, kv_memory, ctx, max_queue, max_prompt_tokens, default_max_tokens, max_body, device, threads,
        weights, speculative, kv_budget, release_level, device_memory, board, batch_invariant):
    """Serve MODEL (or --bundle) over an OpenAI-compatible HTTP API."""
    from zeroedge.commands.common import parse_size
    from zeroedge.errors import UserError, require

    key = _api_key(api_key_file, bind)
    if backend == "torch":
        if model is None:
            raise UserError("the torch backend needs MODEL (or give --backend onnxruntime --bundle DIR)")
        check_model(model, presets=True)
        if bundle or engines:
            raise UserError("--bundle / --engines are for --backend onnxruntime or tensorrt")
    elif bundle is None:
        raise UserError(f"the {backend} backend needs --bundle DIR (an exported bundle)")
    if kv_budget is not None:
        if backend != "torch":
            raise UserError("--kv-budget: thermal KV in the server runs on the torch backend")
        if kv_budget >= 1:
            raise UserError("--kv-budget 1 reads the whole KV: leave --kv-budget out")
        if weights == "q4":
            raise UserError("--kv-budget runs on the model's weights in torch (--weights model), not --weights q4")
    if speculative == "packed" and (backend != "torch" or weights == "q4"):
        raise UserError("--speculative packed drafts with the model's own weights in 4 bits for its weights in "
                        "torch: the torch backend with --weights model")
    cap = memory_cap(device_memory, board)
    if speculative == "packed" and cap is not None:
        raise UserError("--speculative packed: the drafter's 4-bit weights and KV pool are not in the "
                        "--device-memory / --board plan; leave the cap out or use --speculative auto")
    if cap is not None and backend != "torch":
        raise UserError("--device-memory / --board size the torch backend's KV pool; a bundle's window is its own")
    if batch_invariant and (backend != "torch" or weights == "q4"):
        raise UserError("--batch-invariant runs the torch backend's CUDA step on the model's weights "
                        "(--weights model or auto)")
    kv_bytes = parse_size(kv_memory, "--kv-memory") if kv_memory else None
    body_limit = parse_size(max_body, "--max-body", minimum=1 << 10)
    for mod in ("fastapi", "uvicorn", "sse_starlette", "prometheus_client"):
        require(mod, "serve")

    from zeroedge.serve.setup import build_server

    server = build_server(model=model, backend=backend, bundle=bundle, engines=engines, plugins=plugins,
                          served_name=served_model_name, max_batch=max_batch, prefill_chunk=prefill_chunk,
                          kv_bytes=kv_bytes, cap=cap, ctx=ctx, device=device, threads=threads,
                          api_key=key, max_queue=max_queue, max_prompt_tokens=max_prompt_tokens,
                          default_max_tokens=default_max_tokens, max_body_bytes=body_limit, weights=weights,
                          speculative=speculative, kv_budget=kv_budget, release_level=release_level,
                          invariant=batch_invariant)
    from zeroedge.serve.setup import run_http

    run_http(server, bind, port)


def _api_key(path, bind):
    """The key from a file only its owner can read; required off loopback."""
    import ipaddress
    import os
    import stat

    from zeroedge.errors import UserError

    loopback = bind in ("localhost",) or _is_loopback(bind, ipaddress)
    if path is None:
        if not loopback:
            raise UserError(f"--host {bind} is reachable from other machines: give --api-key-file FILE "
                            "(a key in a file of mode 0600)")
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise UserError(f"--api-key-file {path}: {e.strerror} (a symbolic link is refused)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"--api-key-file {path}: not a regular file")
        if st.st_mode & 0o077:
            raise UserError(f"--api-key-file {path}: mode {stat.S_IMODE(st.st_mode):o} lets others read it; "
                            f"chmod 600 {path}")
        key = os.read(fd, 4096).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)
    if len(key) < 16 or any(c.isspace() for c in key):
        raise UserError(f"--api-key-file {path}: the key must be one word of at least 16 characters")
    return key


def _is_loopback(bind, ipaddress) -> bool:
    try:
        return ipaddress.ip_address(bind).is_loopback
    except ValueError:
        return False
