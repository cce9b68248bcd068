"""zeroedge status: version, release, service, health and memory of deployed devices."""
import click

from zeroedge.commands.common import host_options
from zeroedge.deploy.cli import finish, targets_from


@click.command(name="status")
@host_options
def cmd(host, hosts_file, ssh_config, known_hosts, connect_timeout, sudo, as_json):
    """Show each device's current release, zeroedge version, service state, /healthz and memory (and
    zeroedge-serve.service's state and /health where the current release was deployed with --serve)."""
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
               f"{len(s.get('releases', []))} kept)",
               f"{r.name}: zeroedge {body.get('version') or info.get('zeroedge_version')}; service {s.get('service')}"
               f"; health {health}"]
        if s.get("serve"):      # the current release was deployed with --serve
            sv = s["serve"]
            sh = sv.get("health") or {}
            sb = sh.get("body") if isinstance(sh.get("body"), dict) else {}
            down = f"down ({sh.get('error') or sh.get('code')})"
            out.append(f"{r.name}: {sv['unit']} {sv.get('service')} on 127.0.0.1:{sv['port']}; health "
                       + (sb.get("status") or ("ok" if sh.get("ok") else down)))
        return out + [f"{r.name}: memory {fmt_bytes(m.get('available'))} available of {fmt_bytes(m.get('total'))}"
                      + (f"; daemon RSS {fmt_bytes(s['rss'])}" if s.get("rss") else "")]

    finish(results, as_json, "status", bool(hosts_file), lines)
