"""Output shared by `zeroedge deploy`, `rollback` and `status` (their options: commands.common.host_options)."""
from __future__ import annotations

import json
import sys

import click

from zeroedge.errors import Failure, UserError


def targets_from(host, hosts_file):
    from .inventory import parse_inventory, parse_target

    if bool(host) == bool(hosts_file):
        raise UserError("give exactly one of --host HOST or --hosts FILE")
    return [parse_target(host)] if host else parse_inventory(hosts_file)


def finish(results, as_json: bool, verb: str, fleet: bool, lines_for, extra=None) -> None:
    """Print per-host lines (or JSON), then exit: 0 all ok, 2 if a host failed before anything was
    changed (connect / preflight: something the user fixes), 1 if a host failed after changes began
    (errors.Failure: not bad input)."""
    early = {"connect", "preflight", "probe", "have", "not-run", "status", "rollback"}
    failed = [r for r in results if not r.ok]
    code = 0 if not failed else (2 if all(r.phase in early for r in failed) else 1)
    if as_json:
        doc = {"ok": not failed, "command": verb, "hosts": [r.as_dict() for r in results], **(extra or {})}
        click.echo(json.dumps(doc, indent=2, default=str))
        sys.exit(code)
    if not fleet and failed:
        msg = f"{failed[0].name}: {failed[0].error}"
        raise UserError(msg) if code == 2 else Failure(msg)
    for r in results:
        for line in lines_for(r):
            click.echo(line)
    if fleet:
        n_ok = len(results) - len(failed)
        click.echo(f"{verb}: {n_ok}/{len(results)} hosts ok" + (f", {len(failed)} failed: "
                                                                + ", ".join(r.name for r in failed) if failed else ""))
        for r in failed:
            if r.phase != "not-run":
                click.echo(f"{r.name}: {r.error}", err=True)
    sys.exit(code)
