"""`zeroedge sensor-eval FILE... --onset N --json`: fault-detection metrics per run file."""
import click

from zeroedge.commands.common import examples


@click.command("sensor-eval", epilog=examples(
    "zeroedge sensor-eval d01_te.dat d02_te.dat --onset 160 --json"))
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--onset", type=int, required=True, help="The fault is active from sample N on.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per file on stdout.")
@click.option("--bundle", type=click.Path(file_okay=False), default=None,
              help="Sensor bundle (default: built from the shipped weights).")
@click.option("--backend", type=click.Choice(["onnxruntime", "torch"]), default="onnxruntime")
def cmd(files, onset, as_json, bundle, backend):
    """Run each 52-column TEP run FILE through the daemon's inference path (per-stream window,
    model, alarm filter; inference on every reading) and report fdr (fraction of samples from
    ONSET on that alarmed), far (fraction before ONSET that did), delay (samples from ONSET to
    the first alarm that stays raised for 6 samples) and predicted_fault. A run whose first window
    does not look like the normal operation the bundle was fitted on gets a warning on stderr."""
    import json

    from zeroedge.errors import UserError
    from zeroedge.sensor.runtime import evaluate_frames, load_bundle
    from zeroedge.sensor.tep import load_run

    if onset < 0:
        raise UserError("--onset must be >= 0")
    if bundle is None:
        from zeroedge.sensor.train import ensure_bundle

        bundle = ensure_bundle()
    det = load_bundle(bundle, backend=backend)
    for f in files:
        X = load_run(f)
        if onset > len(X):
            raise UserError(f"{f}: --onset {onset} is past the end of the run ({len(X)} samples)")
        m = evaluate_frames(det, X, onset, sensor=str(f))
        if m.get("warning"):
            click.echo(f"zeroedge: warning: {f}: {m['warning']}", err=True)
        out = {"file": str(f), "fdr": m["fdr"], "far": m["far"], "delay": m["delay"],
               "predicted_fault": m["predicted_fault"], "samples": m["samples"], "onset": onset}
        if as_json:
            click.echo(json.dumps(out))
        else:
            fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
            click.echo(f"{f}: fdr={fmt(out['fdr'])} far={fmt(out['far'])} delay={fmt(out['delay'])} "
                       f"predicted={out['predicted_fault']}")
