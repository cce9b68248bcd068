"""zeroedge rollback: make the previous release current again and restart the service."""
import click

from zeroedge.commands.common import examples, host_options
from zeroedge.deploy.cli import finish, targets_from


@click.command("rollback", epilog=examples(
    "zeroedge rollback --host orin-1"))
@host_options
@click.option("--to", "to", metavar="RELEASE", help="Release name or id to go back to (default: the one before current).")
@click.option("--health-timeout", type=float, default=60.0, show_default=True,
              help="Seconds to wait for /healthz (zeroedge serve's /health for a release deployed with --serve).")
def cmd(host, hosts_file, ssh_config, known_hosts, connect_timeout, sudo, as_json, to, health_timeout):
    """Swap the device's `current` link back to the previous release (atomically), restart its
    service and check its health: zeroedge.service, or zeroedge-serve.service for a release
    deployed with --serve (the other unit stopped and removed: a release runs one)."""
    from zeroedge.deploy import runner

    targets = targets_from(host, hosts_file)
    opts = runner.Options(ssh_config=ssh_config, known_hosts=known_hosts, connect_timeout=connect_timeout,
                          sudo=sudo, health_timeout=health_timeout, quiet=as_json)
    results = runner.rollback(targets, opts, to=to)

    def lines(r):
        if not r.ok:
            return [f"{r.name}: FAILED: {r.error}"]
        res = r.extra["result"]
        if res.get("unchanged"):
            return [f"{r.name}: {r.release} is already current"]
        health = f"{runner.SERVE_UNIT} health ok" if res.get("role") == "serve" else "health ok"
        removed = res.get("removed")
        why = "has no serve unit" if removed == runner.SERVE_UNIT else "runs zeroedge serve, no daemon"
        gone = f"; {removed} stopped and removed ({r.release} {why})" if removed else ""
        return [f"{r.name}: rolled back {r.previous} -> {r.release}; {health}{gone} in {r.seconds:.1f} s"]

    finish(results, as_json, "rollback", bool(hosts_file), lines)
