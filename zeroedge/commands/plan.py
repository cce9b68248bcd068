"""`zeroedge plan BUNDLE --board orin-... --ctx N [--json]` (light module)."""
import json
import sys

import click

from zeroedge.commands.common import board_option, ctx_option, examples


def _mb(x):
    return f"{x / 2**20:,.0f} MiB"


@click.command("plan", epilog=examples(
    "zeroedge plan bundle/ --board orin-nano-8gb --ctx 8192"))
@click.argument("bundle", type=click.Path())
@board_option
@ctx_option("tokens of context to plan for", required=True, old_context=True)
@click.option("--window", type=int, default=None, help="hot KV slots (default: the bundle's)")
@click.option("--dtype", default="fp16", show_default=True, help="engine precision: fp16 | fp32")
@click.option("--onnxruntime-process", "ort_process", is_flag=True,
              help="plan for an onnxruntime process (on the CPU host running it) instead of the device's TensorRT "
                   "engines (no TensorRT workspace / CUDA runtime, no OS reserve), to compare with what it "
                   "allocates")
@click.option("--prefill-chunk", "chunk", type=int, default=None,
              help="prefill chunk in tokens to plan for (default: the bundle's; one pass for a bundle "
                   "exported before chunked prefill or with SIH/PAD layers)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def cmd(bundle, board, ctx, window, dtype, ort_process, chunk, as_json):
    """Memory and speed forecast: weights, hot KV, compressed tier, activations, workspace, OS
    reserve; prefill/decode roofline; verdict and the largest context that fits (memory or the
    model's own context, whichever is smaller). Exit 0 when it fits, 1 when it does not (also with
    --json), 2 on bad input."""
    from zeroedge.planner import plan

    if ctx < 1:
        from zeroedge.errors import UserError

        raise UserError(f"--ctx must be >= 1 (got {ctx})")
    if chunk is not None and chunk < 1:
        from zeroedge.errors import UserError

        raise UserError(f"--prefill-chunk must be >= 1 (got {chunk})")
    p = plan(bundle, board, ctx, window, dtype, device=not ort_process, chunk=chunk)
    if as_json:
        click.echo(json.dumps(p, indent=2))
        if not p["fits"]:
            sys.exit(1)
        return
    m, r, f = p["memory"], p["roofline"], p["figures"]
    click.echo(f"{p['target']}  context {ctx}  window {p['window']}  {dtype}")
    wnote = f"{m['weight_copies']} copies: the prefill and decode graphs each hold them"
    if m.get("weights_quantized"):
        wnote += f"; 4-bit linear layers at their stored {_mb(m['weights_quantized'])} each"
    notes = {"weights": wnote,
             "activations": (f"prefill in chunks of {m['prefill_chunk']:,} tokens"
                             if m["prefill_chunk"] < ctx else "prefill in one pass")}
    for k in ("weights", "hot_kv", "compressed_kv", "activations", "workspace", "runtime"):
        click.echo(f"  {k:14s} {_mb(m[k]):>12s}" + (f"   ({notes[k]})" if k in notes else ""))
    click.echo(f"  {'total':14s} {_mb(m['total']):>12s}   available {_mb(p['available'])} "
               f"(= {_mb(p['device_memory'])} - OS reserve {_mb(p['os_reserve'])})")
    click.echo(f"  prefill  {r['prefill_s'] * 1e3:,.1f} ms ({r['prefill_tok_s']:,.0f} tok/s, "
               f"{r['prefill_bound']}-bound)   decode {r['decode_ms']:.2f} ms/token "
               f"({r['decode_tok_s']:,.1f} tok/s, {r['decode_bound']}-bound)")
    click.echo(f"  figures: {f['fp16_tflops']:.1f} TFLOPS fp16 dense x {r['compute_eff']}, "
               f"{f['bandwidth_gbs']:.1f} GB/s x {r['bandwidth_eff']} ({f['source']})")
    click.echo(f"verdict: {verdict(p)}")
    if not p["fits"]:
        sys.exit(1)


def verdict(p: dict) -> str:
    """FITS / DOES NOT FIT and why, with the largest context that fits and what limits it."""
    largest = f"largest context that fits: {p['max_context']:,}" + (
        " (the model's own context limit)" if p["max_context_limited_by"] == "model context" else "")
    if p["fits"]:
        return f"FITS; {largest}"
    if p["context"] > p["model_context"]:
        return f"DOES NOT FIT: the model's context is {p['model_context']:,} tokens, {p['context']:,} asked; {largest}"
    return (f"DOES NOT FIT: needs {_mb(p['memory']['total'])}, {_mb(p['available'])} available; {largest}")
