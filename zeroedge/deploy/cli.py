"""Options and output shared by `zeroedge deploy`, `rollback` and `status`."""
from __future__ import annotations

import json
import re
import sys

import click

from zeroedge.errors import UserError


def target_options(f):
    for opt in reversed([
        click.option("--host", "host", metavar="HOST", help="[user@]host[:port] or an ~/.ssh/config alias."),
        click.option("--hosts", "hosts_file", metavar="FILE", type=click.Path(dir_okay=False),
                     help="Inventory: one '[NAME] [user@]host[:port] [key=value ...]' per line."),
        click.option("--ssh-config", metavar="FILE", help="ssh config to read instead of ~/.ssh/config."),
        click.option("--known-hosts", metavar="FILE", help="known_hosts to check instead of ~/.ssh/known_hosts."),
        click.option("--connect-timeout", type=float, default=15.0, show_default=True, help="Seconds."),
        click.option("--sudo", is_flag=True, help="Run device operations with passwordless sudo."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON document (for scripts)."),
    ]):
        f = opt(f)
    return f


def targets_from(host, hosts_file):
    from .inventory import parse_inventory, parse_target

    if bool(host) == bool(hosts_file):
        raise UserError("give exactly one of --host HOST or --hosts FILE")
    return [parse_target(host)] if host else parse_inventory(hosts_file)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", str(text).lower())
    if not m:
        raise UserError(f"bad size {text!r}: use e.g. 512M or 2G")
    return int(float(m[1]) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m[2]])


def finish(results, as_json: bool, verb: str, fleet: bool, lines_for, extra=None) -> None:
    """Print per-host lines (or JSON), then exit: 0 all ok, 2 if a host failed before anything was
    changed (connect / preflight), 1 if a host failed after changes began."""
    early = {"connect", "preflight", "probe", "have", "not-run", "status", "rollback"}
    failed = [r for r in results if not r.ok]
    code = 0 if not failed else (2 if all(r.phase in early for r in failed) else 1)
    if as_json:
        doc = {"ok": not failed, "command": verb, "hosts": [r.as_dict() for r in results], **(extra or {})}
        click.echo(json.dumps(doc, indent=2, default=str))
        sys.exit(code)
    if not fleet and failed:
        raise _Exit(f"{failed[0].name}: {failed[0].error}", code)
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


class _Exit(UserError):
    def __init__(self, msg, code):
        super().__init__(msg)
        self.exit_code = code
