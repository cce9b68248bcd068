"""`zeroedge export MODEL --calib ARTIFACT -o BUNDLE/` (light module: heavy imports inside)."""
import json

import click

from zeroedge.commands.common import check_model, examples, output_option, target_option


@click.command("export", epilog=examples(
    "zeroedge export smollm2-135m -o bundle/",
    "zeroedge export smollm2-135m --calib smol-int4.calib -o bundle-int4/   # int4: the weights section"))
@click.argument("model")
@click.option("--calib", "calib", type=click.Path(), default=None,
              help="calibration artifact (zeroedge calibrate); without it the bundle is dense")
@output_option("bundle directory", dest="out", old_out=True, metavar="BUNDLE")
@target_option
@click.option("--window", default=1024, show_default=True, type=int,
              help="hot KV slots the decode runner allocates by default")
@click.option("--weights", type=click.Choice(["fp16", "fp32", "int4"]), default="fp16", show_default=True,
              help="how weights.bin stores the weights: fp16 (what the Jetson engines run; half the bundle), "
                   "fp32 (the graphs then match the PyTorch model bit for bit in onnxruntime), or int4 (every "
                   "linear layer 4-bit group-wise: MatMulNBits in the portable graphs, INT4 DequantizeLinear in "
                   "the TensorRT ones; the rest fp16). An artifact with a weights section implies int4")
@click.option("--group", type=int, default=None,
              help="int4: weights per quantization group along the input dimension [default: 32, or the artifact's]")
@click.option("--symmetric", is_flag=True, default=None,
              help="int4: symmetric grid (no zero point) [default: asymmetric, or the artifact's]")
@click.option("--zero-point", "zero_point", type=click.Choice(["int", "float"]), default=None,
              help="int4 asymmetric: int (onnxruntime's quantizer, a uint4 zero point; default) or float "
                   "(min/max grid with a float zero point per group: reproduces a Q4_1 GGUF such as "
                   "the bundled SmolLM2's exactly)")
@click.option("--accuracy-level", "accuracy_level", type=click.IntRange(0, 4), default=None,
              help="int4: MatMulNBits' accuracy_level in the portable graphs (4: int8 activations; "
                   "default: onnxruntime's). With --cpu-kernels zeroedge, 4 rounds the 4-bit products' "
                   "inputs to int8 per block of 32 (faster, ~1 % perplexity), anything else to int16 "
                   "(the 8-bit LM head's too)")
@click.option("--graphs", "flavours", type=click.Choice(["both", "portable", "trt"]), default="both",
              show_default=True, help="graph flavours in the bundle: both, portable (onnxruntime only) or trt "
                                      "(TensorRT only); one flavour leaves weights.bin only what its runtime reads")
@click.option("--cpu-kernels", "cpu_kernels", type=click.Choice(["stock", "zeroedge"]), default="stock",
              show_default=True,
              help="portable decode graph's attention and 4-bit products: onnxruntime's stock operators, or "
                   "zeroedge's own CPU kernels (ortops/: a float16 K / V window, each 4-bit product of "
                   "groups of 32 to 256 in one pass; runs where scripts/build_ortops has built them). "
                   "zeroedge needs --graphs portable")
@click.option("--force", is_flag=True, help="replace a non-empty output directory")
@click.option("--json", "as_json", is_flag=True, help="print the manifest summary as JSON")
@click.option("--sign", "sign_key", type=click.Path(dir_okay=False), metavar="KEY",
              help="sign the manifest with this key (zeroedge keygen); same as `zeroedge sign` after")
def cmd(model, calib, out, target, window, weights, group, symmetric, zero_point, accuracy_level, flavours,
        cpu_kernels, force, as_json, sign_key):
    """Export MODEL (bundled name, HF folder, .gguf, preset, or an .onnx graph to rewrite) into a
    bundle: prefill/decode graphs in portable (onnxruntime) and TensorRT flavours + manifest.

    An artifact with magnitude decode paths (calibrate --paths) also puts one ZeroEdgePathsFFN node
    per sparse layer into the decode graphs; predictor paths are refused (exit 2).

    A graph with no recognisable RMSNorm -> MLP pattern: a report, nothing written, exit 2."""
    _check_args(model, calib, target, window, weights, group, symmetric, zero_point, accuracy_level, flavours,
                cpu_kernels, sign_key)
    mf = _export_with_progress(model, out, as_json, calib=calib, target=target, window=window, force=force,
                               weights={"fp16": "float16", "fp32": "float32", "int4": "int4"}[weights],
                               group=group, symmetric=symmetric, accuracy_level=accuracy_level,
                               zero_point=zero_point, cpu_kernels=cpu_kernels,
                               flavours=("portable", "trt") if flavours == "both" else (flavours,))
    summary = _summary(mf, out, sign_key)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        _echo_text(mf, summary, out, sign_key)


def _check_args(model, calib, target, window, weights, group, symmetric, zero_point, accuracy_level, flavours,
                cpu_kernels, sign_key):
    """The checks of the arguments that need no torch, made before the export starts: a UserError at the first
    that fails."""
    from zeroedge.errors import UserError
    from zeroedge.preflight import target_info

    target_info(target)                                # an unknown or unsupported target: refused first
    if window < 1:
        raise UserError("--window must be >= 1")
    check_model(model, presets=True, onnx=True)        # a missing model: refused before torch loads
    if weights != "int4" and calib is None and (group is not None or symmetric or accuracy_level is not None
                                                or zero_point):
        raise UserError("--group / --symmetric / --zero-point / --accuracy-level apply to --weights int4 only")
    if zero_point == "float" and symmetric:
        raise UserError("--zero-point float is for an asymmetric grid (leave out --symmetric)")
    if cpu_kernels == "zeroedge" and flavours != "portable":
        raise UserError("--cpu-kernels zeroedge is for onnxruntime graphs: add --graphs portable")
    if group is not None and group not in (16, 32, 64, 128, 256):
        raise UserError(f"--group must be a power of two from 16 to 256 (got {group})")
    if calib is not None:
        from zeroedge import calib_artifact

        cal = calib_artifact.read(calib)              # a malformed artifact: refused before torch loads
        if cal.skip_layers:
            cal.sih.require_plugins(str(calib))
    if sign_key:
        from zeroedge.bundle import load_signing_key

        load_signing_key(sign_key)                     # a bad key: refused before the export runs


def _export_with_progress(model, out, as_json, **options) -> dict:
    """export_bundle(model, out, **options) under a spinner on stderr (steps logged unless --json);
    returns the manifest. A graph with no RMSNorm -> MLP pattern: its report on stderr, NoPattern re-raised."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from zeroedge.export.bundle_writer import export_bundle
    from zeroedge.export.rewrite import NoPattern
    console = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True, disable=as_json) as prog:
        task = prog.add_task("export", total=None)

        def step(msg):
            prog.update(task, description=f"export: {msg}")
            if not as_json:
                console.log(msg)
        try:
            return export_bundle(model, out, progress=step, **options)
        except NoPattern as e:
            _print_no_pattern(console, e.report)
            raise


def _print_no_pattern(console, r):
    """What the rewrite found in a graph it could not rewrite, and the first reasons it rejected."""
    console.print(f"[bold]found[/bold]: {r['nodes']} nodes; {r['const_projections']} "
                  f"MatMul/Gemm with constant weights; {r['rmsnorms']} RMSNorm-like "
                  f"reductions; {r['gated_mlps']} gated MLPs; {r['matched_layers']} "
                  f"RMSNorm -> MLP layers")
    for line in r["rejected"][:10]:
        console.print(f"  rejected: {line}")


def _summary(mf, out, sign_key) -> dict:
    """The --json summary of the manifest mf; signs the bundle first when --sign gave a key."""
    total = sum(f["bytes"] for f in mf["files"].values())
    summary = {"bundle": str(out), "files": len(mf["files"]), "bytes": total,
               "seconds": mf["export"]["seconds"], "rewrite": mf["export"].get("rewrite"),
               "graphs": sorted(mf["graph_files"]), "weights": mf["weights"]}
    if sign_key:
        from zeroedge.bundle import sign

        summary["signed_by"] = sign(out, sign_key)
    if mf["export"].get("paths"):
        summary["paths"] = mf["export"]["paths"]
    return summary


def _echo_text(mf, summary, out, sign_key):
    """The text output: what was written, then a line per feature the bundle has."""
    click.echo(f"wrote {out}: {len(mf['files'])} files, {summary['bytes'] / 1e6:.1f} MB in "
               f"{mf['export']['seconds']:.1f} s" + (f"; signed with key {summary['signed_by']}"
                                                      if sign_key else ""))
    q = mf["weights"].get("quantization")
    if q:
        click.echo(_quantization_line(q, mf.get("cpu_kernels", {})))
    ck = mf.get("cpu_kernels", {})
    if ck.get("kind") == "zeroedge":
        n = ck["nodes"]
        click.echo(f"decode kernels (zeroedge.ort): {n['Q4Linear']} Q4Linear ({n['Q4Linear swiglu']} with "
                   f"SwiGLU), {n.get('Q8Linear', 0)} Q8Linear, {n['WindowAttention']} WindowAttention"
                   + ("; the 4-bit products keep MatMulNBits (Q4Linear takes groups of 32 to 256)"
                      if q and not n["Q4Linear"] else ""))
    if summary["rewrite"]:
        rw = summary["rewrite"]
        click.echo(f"rewrite: {rw['layers_found']} layers found, {len(rw['rewritten'])} with SIH/PAD nodes")
    if summary.get("paths"):
        click.echo(f"decode paths: {len(summary['paths']['rewritten'])} layers with ZeroEdgePathsFFN nodes "
                   f"({', '.join(map(str, summary['paths']['rewritten']))})")
        if summary["paths"].get("trt_plugin_limits", "ok") != "ok":
            click.echo(f"warning: decode.trt.onnx will not build with the ZeroEdgePathsFFN plugin "
                       f"({summary['paths']['trt_plugin_limits']}); decode.portable.onnx runs")


def _quantization_line(q, ck) -> str:
    """The weights line of a quantized bundle (the manifest's weights.quantization q, its cpu_kernels ck)."""
    b = q.get("bytes", {})
    zp = "" if q["symmetric"] else f" ({q.get('zero_point', 'int')} zero point)"
    ops = ("MatMulNBits; zeroedge's Q4Linear in decode, "
           f"int{ck['input_bits']} inputs" if "input_bits" in ck else "MatMulNBits")
    read = [f"{b[k] / 1e6:.1f} MB read by the {what}" for k, what in
            (("portable", f"portable graphs ({ops})"), ("trt", "TensorRT ones")) if b.get(k)]
    return (f"weights: int{q['bits']} g{q['group']} {'sym' if q['symmetric'] else 'asym'}{zp} "
            f"{q['method'].upper()} on {q['quantized_params'] / 1e6:.1f} M params; "
            f"{', '.join(read)}; the rest fp16")
