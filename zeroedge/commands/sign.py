"""zeroedge sign: sign a bundle's manifest with an Ed25519 key from `zeroedge keygen`."""
import click

from zeroedge.commands.common import examples


@click.command("sign", epilog=examples(
    "zeroedge sign bundle/ --key ~/.zeroedge/sign.key"))
@click.argument("bundle", type=click.Path(file_okay=False))
@click.option("--key", "key", required=True, type=click.Path(dir_okay=False), metavar="KEY",
              help="Private key from `zeroedge keygen`.")
def cmd(bundle, key):
    """Write BUNDLE/manifest.sig: an Ed25519 signature over the exact bytes of manifest.json (which
    lists every file's sha256), so any change to the bundle after signing is detected. Devices that
    pin the key (`zeroedge deploy --pin-key KEY.pub`) refuse unsigned or otherwise signed bundles."""
    from zeroedge.bundle import sign

    click.echo(f"signed {bundle} with key {sign(bundle, key)} ({bundle}/manifest.sig)")
