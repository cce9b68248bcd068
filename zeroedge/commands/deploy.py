"""zeroedge deploy: put a bundle on one Jetson (--host) or a fleet (--hosts), build there, start the
service and prove it healthy. The bundle decides the service: a sensor bundle runs in the sensor
daemon (zeroedge.service), a model bundle in zeroedge serve (zeroedge-serve.service, --serve)."""
import click

from zeroedge.commands.common import examples, host_options, parse_size
from zeroedge.deploy.cli import finish, targets_from


@click.command("deploy", epilog=examples(
    "zeroedge deploy bundle/ --host orin-1 --dry-run",
    "zeroedge deploy llm-bundle/ --hosts inventory.txt --serve"))
@click.argument("bundle", type=click.Path(file_okay=False))
@host_options
@click.option("--dry-run", is_flag=True, help="Say what would change on each device; change nothing.")
@click.option("--config", "config", type=click.Path(dir_okay=False),
              help="Daemon TOML to deploy (default: the daemon's example.toml); model and port are set by deploy. "
                   "Not with --serve (no daemon runs).")
@click.option("--metrics-port", type=int, help="Daemon metrics/health port on the device (default: from the config). "
                                               "Not with --serve.")
@click.option("--keep", type=int, default=3, show_default=True, help="Releases kept on the device.")
@click.option("--min-free", default="256M", show_default=True, help="Disk kept free on the device after upload.")
@click.option("--health-timeout", type=float, default=60.0, show_default=True,
              help="Seconds to wait for /healthz (and, with --serve, for the server's /health).")
@click.option("--no-auto-rollback", is_flag=True, help="Leave an unhealthy new release in place.")
@click.option("--serve", "serve", is_flag=True,
              help="BUNDLE is a model bundle (exported with a decode graph): run it in zeroedge-serve.service, "
                   "`zeroedge serve` on the release's bundle (its TensorRT engines when the release holds them) on "
                   "the device's 127.0.0.1, health-checked through its /health, in place of the sensor daemon "
                   "(zeroedge.service, stopped and removed where a deploy installed it). A sensor bundle deploys "
                   "without --serve, which stops and removes a serve unit an earlier deploy installed; the other "
                   "way round is refused.")
@click.option("--serve-port", type=click.IntRange(1, 65535), metavar="PORT",
              help="Port of the serve unit on the device's 127.0.0.1 (default 8000); needs --serve.")
@click.option("--pin-key", "pin_keys", multiple=True, type=click.Path(dir_okay=False), metavar="KEY.pub",
              help="Pin this bundle signing key on the devices (zeroedge keygen): from then on they refuse "
                   "bundles it (or another pinned key) did not sign. Repeatable.")
def cmd(bundle, host, hosts_file, ssh_config, known_hosts, connect_timeout, sudo, as_json, dry_run, config,
        metrics_port, keep, min_free, health_timeout, no_auto_rollback, serve, serve_port, pin_keys):
    """Deploy BUNDLE over SSH: preflight (L4T/JetPack, TensorRT, sm_87, Python, disk, memory, the
    bundle's signature where the device pins signing keys), content-hash upload (a re-deploy moves
    0 bytes), on-device build, releases/<id> with an atomic `current` link, systemd service, health
    check through the daemon's /healthz (a sensor bundle) or, with --serve, zeroedge serve's /health
    (a model bundle)."""
    from pathlib import Path

    from zeroedge.bundle import verify
    from zeroedge.deploy import runner
    from zeroedge.deploy.preflight import fmt_bytes
    from zeroedge.deploy.release import DEFAULT_SERVE_PORT
    from zeroedge.trust import public_key_raw
    from zeroedge.errors import UserError

    if serve_port is not None and not serve:
        raise UserError("--serve-port is the port of the serve unit: give it with --serve")
    if serve and (config is not None or metrics_port is not None):
        opt = "--config" if config is not None else "--metrics-port"
        raise UserError(f"{opt} is the sensor daemon's; a --serve release runs zeroedge serve and no daemon: "
                        "leave it out")
    min_free_bytes = parse_size(min_free, what="--min-free", minimum=0)
    targets = targets_from(host, hosts_file)           # a bad inventory line: refused here
    manifest = verify(Path(bundle))                     # an unverifiable bundle: refused here
    pems = []
    for k in pin_keys:
        try:
            pems.append(Path(k).read_text())
            public_key_raw(pems[-1])
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise UserError(f"--pin-key {k}: not an Ed25519 public key ({getattr(e, 'strerror', None) or e})") from None
    opts = runner.Options(ssh_config=ssh_config, known_hosts=known_hosts, connect_timeout=connect_timeout,
                          min_free=min_free_bytes, keep=keep, sudo=sudo, dry_run=dry_run,
                          health_timeout=health_timeout, auto_rollback=not no_auto_rollback,
                          config=Path(config) if config else None, metrics_port=metrics_port, quiet=as_json,
                          pin_keys=pems, serve=serve,
                          serve_port=serve_port if serve_port is not None else DEFAULT_SERVE_PORT)
    results = runner.deploy(Path(bundle), manifest, targets, opts)

    def lines(r):
        if not r.ok:
            if r.phase == "not-run":
                return [f"{r.name}: not deployed, nothing changed ({r.error.split(': ', 1)[-1]})"]
            return [f"{r.name}: FAILED ({r.phase}): {r.error}"]
        out = [f"{r.name}: preflight ok: {runner._describe(r.facts)}"]
        out += [f"{r.name}: note: {n}" for n in r.notes]
        if r.phase == "dry-run":
            return out + [f"{r.name}: would {w}" for w in r.would] + [f"{r.name}: dry run: nothing changed"]
        h = r.health or {}
        body = h.get("body") if isinstance(h.get("body"), dict) else {}
        verb = "already current, unchanged" if not r.changed else f"active (was {r.previous or 'none'})"
        for s in (r.extra.get("build") or {}).get("steps", []):
            out.append(f"{r.name}: build {s['name']}: " + (f"skipped ({s['skipped']})" if s.get("skipped")
                                                             else f"done in {s.get('seconds')} s"))
        if r.extra.get("pinned"):
            out.append(f"{r.name}: pinned signing key {', '.join(r.extra['pinned'])}")
        if r.extra.get("signed_by"):
            out.append(f"{r.name}: bundle signature checked by the device (key {r.extra['signed_by']})")
        out.append(f"{r.name}: uploaded {r.files_uploaded} files, {fmt_bytes(r.bytes_uploaded)} "
                   f"(release is {fmt_bytes(r.bytes_total)}); backend {r.backend}")
        if r.extra.get("serve"):
            s = r.extra["serve"]
            out.append(f"{r.name}: release {r.release} {verb}; {s['unit']} serving on 127.0.0.1:{s['port']}; "
                       f"health {body.get('status', 'ok')}" + (f" ({body['mode']})" if body.get("mode") else "")
                       + f" in {r.seconds:.1f} s")
        else:
            out.append(f"{r.name}: release {r.release} {verb}; health {body.get('status', 'ok')} "
                       f"(daemon {body.get('version', '?')}) in {r.seconds:.1f} s")
        if r.extra.get("removed") == runner.SERVE_UNIT:
            out.append(f"{r.name}: {runner.SERVE_UNIT} stopped and removed (this deploy has no --serve)")
        elif r.extra.get("removed"):
            out.append(f"{r.name}: {r.extra['removed']} stopped and removed (a --serve release runs no daemon)")
        return out

    finish(results, as_json, "deploy", bool(hosts_file), lines, {"bundle": str(bundle), "dry_run": dry_run})
