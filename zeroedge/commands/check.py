"""`zeroedge check BUNDLE --target jetpack-6.2`: TensorRT 10.3 pre-flight (light module)."""
import json
import sys

import click

from zeroedge.commands.common import examples, target_option


@click.command("check", epilog=examples(
    "zeroedge check bundle/ --target jetpack-6.2"))
@click.argument("bundle", type=click.Path())
@target_option
@click.option("--json", "as_json", is_flag=True, help="findings as JSON")
@click.option("-v", "--verbose", is_flag=True, help="also the info lines (dynamic dims needing profiles)")
def cmd(bundle, target, as_json, verbose):
    """Pre-flight a bundle (or one .onnx file) against the target's TensorRT ONNX parser: opset,
    unsupported ops, plugin names and fields, attribute types, int64 weights, shape profiles.
    Exit 0 when it will build, 1 on errors, 2 on bad input."""
    from zeroedge.preflight import check_path

    findings, files = check_path(bundle, target)
    errors = [f for f in findings if f.severity == "error"]
    if as_json:
        click.echo(json.dumps({"target": target, "files": files, "errors": len(errors),
                               "findings": [f.to_dict() for f in findings]}, indent=2))
    else:
        for f in findings:
            if not verbose and f.severity == "info":
                continue
            click.echo(f.line())
        warns = sum(f.severity == "warning" for f in findings)
        click.echo(f"{'FAIL' if errors else 'OK'}: {len(files)} graph(s) for {target}: "
                   f"{len(errors)} error(s), {warns} warning(s)")
    if errors:
        sys.exit(1)
