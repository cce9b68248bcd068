"""`zeroedge build BUNDLE -o ENGINES [--plugins LIB] [--cc 8.6] [--json]` (light module: TensorRT is
imported only when the command runs)."""
import json

import click

from zeroedge.commands.common import examples, output_option

WORKSPACE_HELP = ("builder workspace pool, e.g. 512M or 1G (default: the bundle plan's, else 256M, and a graph "
                  "that runs out of it, as a SmolLM2 prefill at 2048 tokens does, is built again once with "
                  "max(1G, twice what it asked for); a size given here is used as it is)")


class _NativeQuiet:
    """fd 1 and fd 2 go to a scratch file while TensorRT and the plugin library run, so that their
    own prints (the plugin library writes its errors to stderr, TensorRT-RTX gives it no logger) stay
    off the command's output: one JSON object on stdout, one line per error. Those messages are in
    the errors anyway (plugin_messages, the captured logger). `stream` is the real stderr."""

    def __init__(self, enabled: bool):
        import os
        import sys

        self.enabled = enabled
        self.stream = os.fdopen(os.dup(2), "w", buffering=1) if enabled else sys.stderr
        self.saved = []

    def __enter__(self):
        import os
        import sys
        import tempfile

        if self.enabled:
            sys.stdout.flush(), sys.stderr.flush()
            self.sink = tempfile.TemporaryFile()
            self.saved = [os.dup(1), os.dup(2)]
            os.dup2(self.sink.fileno(), 1)
            os.dup2(self.sink.fileno(), 2)
        return self

    def __exit__(self, *exc):
        import ctypes
        import os
        import sys

        if self.enabled and self.saved:
            sys.stdout.flush(), sys.stderr.flush()
            try:
                ctypes.CDLL(None).fflush(None)      # C stdio buffers, before fd 1 points at stdout again
            except (OSError, AttributeError):
                pass
            os.dup2(self.saved[0], 1), os.dup2(self.saved[1], 2)
            for fd in self.saved:
                os.close(fd)
            self.saved = []
            self.sink.close()
        return False

    def close(self):
        if self.enabled:
            self.stream.close()


@click.command("build", epilog=examples(
    "zeroedge build bundle/ -o engines/",
    "zeroedge build bundle/ -o engines/ --cc 8.6 --json"))
@click.argument("bundle", type=click.Path())
@output_option("folder for the engines (GRAPH.engine per GRAPH.trt.onnx), engines.json and the timing "
               "cache where the runtime keeps one; must be absent or empty unless --force",
               dest="out", old_out=True, metavar="ENGINES")
@click.option("--plugins", "plugins", type=click.Path(), default=None,
              help="libzeroedge_plugins.so (default: $ZEROEDGE_PLUGINS_LIB, else plugins/build/ of a source "
                   "checkout; build it with scripts/build_plugins)")
@click.option("--cc", default=None, metavar="X.Y",
              help="TensorRT-RTX: compute capability to build for ahead of time (7.5, 8.0, 8.6, 8.9, 12.0, "
                   "12.1); default: the GPU present. TensorRT 10.3 (a Jetson) builds for its own GPU.")
@click.option("--workspace", default=None, metavar="SIZE", help=WORKSPACE_HELP)
@click.option("--max-tokens", type=int, default=None,
              help="longest prompt the prefill profile takes (default: the plan's, else max(window, 2048))")
@click.option("--no-serialize-plugins", is_flag=True,
              help="do not embed the plugin library in the engines (load it at run time instead)")
@click.option("--force", is_flag=True, help="replace a non-empty -o folder")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object: backend and one row per engine")
@click.option("-v", "--verbose", is_flag=True, help="also TensorRT's warnings and native output")
def cmd(bundle, out, plugins, cc, workspace, max_tokens, no_serialize_plugins, force, as_json, verbose):
    """Build one TensorRT engine per BUNDLE/*.trt.onnx with the zeroedge plugin library, with the
    TensorRT found here: on a Jetson TensorRT 10.3 for its own GPU, elsewhere TensorRT-RTX, ahead of
    time for --cc (no GPU needed) or for the GPU present. The plugin library is serialized into the
    engines. Everything is built in a temporary folder and moved to -o only when every engine built.

    --json prints {"backend": "<name> <version>", "engines": [{"graph", "file", "bytes", "layers",
    "plugin_layers", "seconds", ...}], ...}. Exit 2 on bad input or a failed build."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from zeroedge.backends.tensorrt.build import build_bundle_engines, build_report, engine_line
    from zeroedge.commands.common import parse_size
    from zeroedge.errors import UserError

    ws = parse_size(workspace) if workspace is not None else None
    if max_tokens is not None and max_tokens < 1:
        raise UserError("--max-tokens must be >= 1")
    quiet = _NativeQuiet(enabled=not verbose)
    console = Console(file=quiet.stream, stderr=True)
    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                      transient=True, disable=as_json or not console.is_terminal) as prog:
            task = prog.add_task("build: checking the bundle", total=None)
            started = {}

            def progress(graph, phase, step, steps):
                started.setdefault(graph, len(started) + 1)
                at = f" {step}/{steps}" if steps else ""
                prog.update(task, description=f"build {graph} (engine {started[graph]}): {phase}{at}")

            def note(msg):
                if not as_json or verbose:
                    prog.console.print(msg, markup=False, highlight=False, soft_wrap=True)

            with quiet:
                meta = build_bundle_engines(bundle, plugins, out, max_tokens=max_tokens, workspace_bytes=ws,
                                            serialize_plugins=not no_serialize_plugins, cc=cc,
                                            mode="force" if force else "new", progress=progress,
                                            log=lambda s: None if s.startswith(
                                                "[tensorrt] built") else note(s),
                                            verbose=note if verbose else None)
    finally:
        quiet.close()
    report = build_report(meta, out)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        for row in report["engines"]:
            click.echo(engine_line(row))
        total = sum(e["bytes"] for e in report["engines"])
        click.echo(f"{report['backend']}"
                   + (f" for compute capability {report['cc']}" if report.get("cc") else "")
                   + f": {len(report['engines'])} engine(s), {total / (1 << 20):.1f} MiB in {report['out']}"
                   + (f" (timing cache: {report['timing_cache']})" if report.get("timing_cache") else ""))
