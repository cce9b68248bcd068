"""`zeroedge daemon --config FILE`: the sensor-stream daemon (see zeroedge/daemon/config.py)."""
import click

from zeroedge.commands.common import examples


@click.command("daemon", epilog=examples(
    "zeroedge daemon --config daemon.toml --check",
    "zeroedge daemon --config daemon.toml"))
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="TOML config (schema in zeroedge/daemon/config.py; example zeroedge/daemon/example.toml)")
@click.option("--exit-at-end", is_flag=True,
              help="Drain and exit when a file/stdin/simulator source has no more readings.")
@click.option("--check", is_flag=True, help="Validate the config and verify the bundle, then exit.")
def cmd(config_path, exit_at_end, check):
    """Run the sensor-stream daemon: readings in (MQTT, file, stdin, simulator), predictions and
    alerts out; SQLite spool, dead letters, Prometheus metrics and /healthz on 127.0.0.1."""
    import sys

    from zeroedge.daemon import config

    cfg = config.load(config_path)
    for w in cfg.warnings if check else ():
        click.echo(f"zeroedge: warning: {w}", err=True)
    if check:
        from zeroedge.sensor.runtime import load_bundle

        det = load_bundle(cfg.bundle, backend=cfg.daemon["backend"])
        click.echo(f"config ok: source={cfg.source['kind']} bundle={cfg.bundle} window={det.window} "
                   f"classes={len(det.class_names)}")
        return
    from zeroedge.daemon.service import Daemon

    sys.exit(Daemon(cfg, exit_at_end=exit_at_end).run())
