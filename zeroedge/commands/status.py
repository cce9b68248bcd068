"""zeroedge status: version, release, service, health and memory of deployed devices."""
import click

from zeroedge.commands.common import examples, host_options
from zeroedge.deploy.cli import finish, targets_from


@click.command("status", epilog=examples(
    "zeroedge status --hosts inventory.txt"))
@host_options
def cmd(host, hosts_file, ssh_config, known_hosts, connect_timeout, sudo, as_json):
    """Show each device's current release, zeroedge version, service state, health and memory: the
    sensor daemon's (zeroedge.service, /healthz), or zeroedge serve's (zeroedge-serve.service,
    /health) where the current release was deployed with --serve."""
    from zeroedge.deploy import runner
    from zeroedge.deploy.preflight import fmt_bytes

    targets = targets_from(host, hosts_file)
    opts = runner.Options(ssh_config=ssh_config, known_hosts=known_hosts, connect_timeout=connect_timeout,
                          sudo=sudo, health_timeout=0, quiet=True)
    results = runner.status(targets, opts)

    def lines(r):
        if not r.ok:
            return [f"{r.name}: FAILED: {r.error}"]
        s = r.extra["result"]
        if not s.get("release"):
            return [f"{r.name}: nothing deployed"]
        info, h, m = s.get("info") or {}, s.get("health") or {}, s.get("memory") or {}
        body = h.get("body") if isinstance(h.get("body"), dict) else {}
        health = body.get("status") or ("ok" if h.get("ok") else f"down ({h.get('error') or h.get('code')})")
        out = [f"{r.name}: release {s['release']} (bundle {info.get('bundle')}, backend {info.get('backend')}, "
               f"{len(s.get('releases', []))} kept)"]
        version = body.get("version") or info.get("zeroedge_version")
        serve = s.get("role") == "serve"     # the current release was deployed with --serve
        if serve:
            out.append(f"{r.name}: zeroedge {version}; {s['unit']} {s.get('service')} on 127.0.0.1:"
                       f"{s.get('serve_port')}; health {health}" + (f" ({body['mode']})" if body.get("mode") else ""))
        else:
            out.append(f"{r.name}: zeroedge {version}; service {s.get('service')}; health {health}")
        return out + [f"{r.name}: memory {fmt_bytes(m.get('available'))} available of {fmt_bytes(m.get('total'))}"
                      + (f"; {'server' if serve else 'daemon'} RSS {fmt_bytes(s['rss'])}" if s.get("rss") else "")]

    finish(results, as_json, "status", bool(hosts_file), lines)
