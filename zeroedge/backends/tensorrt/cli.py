"""`python -m zeroedge.backends.tensorrt build|generate` (module_cli, main)."""
from __future__ import annotations

import json
import sys

from zeroedge.backends.tensorrt.build import build_bundle_engines, build_report
from zeroedge.backends.tensorrt.runner import TrtRunner
from zeroedge.errors import UserError


def module_cli():
    """The click group of `python -m zeroedge.backends.tensorrt build|generate`, spelled like `zeroedge
    build` and `zeroedge run`. `build BUNDLE -o DIR` is what `zeroedge deploy` runs on the device: the
    build of `zeroedge build`, into an existing folder (what else it holds is kept); `generate`
    decodes a few tokens through the engines. The old spellings (--bundle, --out, --workspace-mb,
    --new) still work, each with a one-line deprecation note on stderr. Errors take the path every
    zeroedge command takes (zeroedge.errors.run_command): one line `zeroedge: error: ...`, exit 2 for
    bad input."""
    import click

    from zeroedge.planner import parse_size

    def old(spelling: str, new: str, **kw):
        """A hidden deprecated spelling: a note on stderr when given."""
        def note(ctx, param, value):
            if value is not None:
                click.echo(f"zeroedge: warning: {spelling} is deprecated; use {new}", err=True)
            return value

        return click.option(spelling, "old_" + spelling.lstrip("-").replace("-", "_"), hidden=True, default=None,
                            callback=note, **kw)

    def pick(value, old_value, name: str, old_name: str, required: str = ""):
        if value is not None and old_value is not None:
            raise click.UsageError(f"give {name} or its old spelling {old_name}, not both")
        value = value if value is not None else old_value
        if value is None and required:
            raise click.UsageError(required)
        return value

    @click.group(context_settings={"help_option_names": ["-h", "--help"]},
                 help="Build and run TensorRT engines of a zeroedge bundle (Jetson: TensorRT 10.3; elsewhere "
                      "TensorRT-RTX). The user commands are `zeroedge build` and `zeroedge run --backend "
                      "tensorrt`; `zeroedge deploy` runs `build` here on the device.",
                 epilog="\b\nExample:\n  python -m zeroedge.backends.tensorrt build bundle/ -o build/")
    def cli():
        pass

    @cli.command("build", help="One engine per BUNDLE/*.trt.onnx: the build of `zeroedge build`, into a folder "
                               "that may exist (what else it holds is kept); prints the same JSON.",
                 epilog="\b\nExample:\n  python -m zeroedge.backends.tensorrt build bundle/ -o build/ "
                        "--plugins build/plugins/libzeroedge_plugins.so")
    @click.argument("bundle", required=False, metavar="BUNDLE")
    @click.option("-o", "--output", "out", metavar="ENGINES",
                  help="folder for the engines, timing.cache and engines.json  [required]")
    @click.option("--plugins", default=None, metavar="PATH", help="libzeroedge_plugins.so (default: "
                  "$ZEROEDGE_PLUGINS_LIB, else plugins/build/ of a source checkout; scripts/build_plugins makes it)")
    @click.option("--cc", default=None, metavar="X.Y", help="TensorRT-RTX only: compute capability to build for "
                  "ahead of time (8.6, 8.9, 12.0, ...; default: the GPU present)")
    @click.option("--workspace", default=None, metavar="SIZE", help="builder workspace pool, e.g. 512M or 1G "
                  "(default: from the plan, else 256M, grown once to >= 1G if the builder runs out)")
    @click.option("--max-tokens", type=int, default=None, help="longest prompt (default: from the plan)")
    @click.option("--no-serialize-plugins", is_flag=True,
                  help="do not embed the plugin library (load it at run time instead)")
    @old("--bundle", "BUNDLE (an argument)")
    @old("--out", "-o/--output")
    @old("--workspace-mb", "--workspace SIZE", type=int)
    def build(bundle, out, plugins, cc, workspace, max_tokens, no_serialize_plugins, old_bundle, old_out,
              old_workspace_mb):
        bundle = pick(bundle, old_bundle, "BUNDLE", "--bundle", "Missing argument 'BUNDLE'.")
        out = pick(out, old_out, "-o/--output", "--out", "Missing option '-o' / '--output'.")
        if workspace is not None and old_workspace_mb is not None:
            raise click.UsageError("give --workspace or its old spelling --workspace-mb, not both")
        if old_workspace_mb is not None and old_workspace_mb < 1:
            raise UserError("--workspace-mb must be >= 1")
        ws = parse_size(workspace) if workspace is not None else None
        if old_workspace_mb is not None:
            ws = old_workspace_mb << 20
        if max_tokens is not None and max_tokens < 1:
            raise UserError("--max-tokens must be >= 1")
        meta = build_bundle_engines(bundle, plugins, out, max_tokens=max_tokens, workspace_bytes=ws,
                                    serialize_plugins=not no_serialize_plugins, cc=cc,
                                    mode="update", log=lambda s: print(s, file=sys.stderr))
        print(json.dumps(build_report(meta, out)))

    @cli.command("generate", help="Greedy generation through the engines: prompt token ids in, new ids out.",
                 epilog="\b\nExample:\n  python -m zeroedge.backends.tensorrt generate bundle/ --engines build/ "
                        "--tokens \"1 2 3\" --max-new 8")
    @click.argument("bundle", required=False, metavar="BUNDLE")
    @click.option("--engines", required=True, help="the engines of BUNDLE (zeroedge build BUNDLE -o DIR)")
    @click.option("--plugins", default=None, help="the plugin library, when the engines were built without it")
    @click.option("--tokens", required=True, help="prompt token ids, space separated")
    @click.option("--max-new", type=int, default=None, help="new tokens to generate  [default: 16]")
    @old("--bundle", "BUNDLE (an argument)")
    @old("--new", "--max-new", type=int)
    def generate(bundle, engines, plugins, tokens, max_new, old_bundle, old_new):
        bundle = pick(bundle, old_bundle, "BUNDLE", "--bundle", "Missing argument 'BUNDLE'.")
        new = pick(max_new, old_new, "--max-new", "--new")
        new = 16 if new is None else new
        try:
            toks = [int(t) for t in tokens.split()]
        except ValueError:
            raise UserError(f"--tokens {tokens!r}: give token ids (integers), space separated") from None
        if not toks:
            raise UserError("--tokens is empty")
        if new < 1:
            raise UserError("--max-new must be >= 1")
        with TrtRunner(bundle, engines, plugins) as r:
            print(" ".join(map(str, r.generate(toks, new))))

    return cli


def main(argv=None) -> int:
    """`python -m zeroedge.backends.tensorrt ...` (module_cli)."""
    from zeroedge.errors import run_command

    run_command(module_cli(), argv, prog_name="python -m zeroedge.backends.tensorrt")
    return 0
