"""zeroedge keygen: an Ed25519 key pair for signing bundle manifests."""
import click

from zeroedge.commands.common import examples, output_option


@click.command("keygen", epilog=examples(
    "zeroedge keygen -o ~/.zeroedge/sign.key"))
@output_option("Private key file to write (KEY.pub gets the public key).", dest="out", old_out=True,
               metavar="KEY", dir_okay=False)
def cmd(out):
    """Write KEY (Ed25519 private key, PKCS8 PEM, mode 0600; never overwritten) and KEY.pub (its
    public key). Sign bundles with `zeroedge sign BUNDLE --key KEY`; pin KEY.pub on devices with
    `zeroedge deploy --pin-key KEY.pub`, after which they refuse bundles it did not sign."""
    import os
    from pathlib import Path

    from zeroedge.trust import key_id, public_pem
    from zeroedge.errors import UserError, require

    require("cryptography", "deploy")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key, pub = Path(out), Path(str(out) + ".pub")
    for p in (key, pub):
        if os.path.lexists(p):
            raise UserError(f"{p} exists; not overwriting a key (choose another -o)")
    priv = Ed25519PrivateKey.generate()
    pem = priv.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    raw = priv.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    try:
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(pem)
        with open(os.open(pub, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w") as f:
            f.write(public_pem(raw))
    except OSError as e:
        raise UserError(f"cannot write the key: {e.filename or key}: {e.strerror}") from None
    click.echo(f"wrote {key} (private: keep it secret) and {pub} (key id {key_id(raw)})")
