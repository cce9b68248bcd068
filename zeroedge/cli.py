"""The `zeroedge` command line. Subcommands live in zeroedge/commands/<name>.py and are imported
only when invoked (or listed), and those modules import nothing heavy at module level, so
`zeroedge --help` starts fast and works without torch."""
import importlib
import sys

import click

from zeroedge import __version__
from zeroedge.errors import UserError

# name -> module under zeroedge.commands holding a click command called `cmd`
COMMANDS = {
    "demo": "demo",
    "calibrate": "calibrate",
    "eval": "evaluate",
    "export": "export",
    "check": "check",
    "build": "build",
    "plan": "plan",
    "daemon": "daemon",
    "sensor-eval": "sensor_eval",
    "sensor-fit": "sensor_fit",
    "deploy": "deploy",
    "rollback": "rollback",
    "status": "status",
    "keygen": "keygen",
    "sign": "sign",
    "run": "run",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(n for n in COMMANDS if self._spec(n) is not None)

    @staticmethod
    def _spec(name):
        return importlib.util.find_spec(f"zeroedge.commands.{COMMANDS[name]}")

    def get_command(self, ctx, name):
        if name not in COMMANDS or self._spec(name) is None:
            return None
        return importlib.import_module(f"zeroedge.commands.{COMMANDS[name]}").cmd


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="zeroedge")
def cli():
    """zeroedge: export transformers to Jetson Orin; SIH/PAD skipping and thermal KV tiers."""


def main(argv=None):
    try:
        cli.main(args=argv, prog_name="zeroedge", standalone_mode=False)
    except UserError as e:
        click.echo(f"zeroedge: error: {e}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("zeroedge: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(2 if e.exit_code == 1 else e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("zeroedge: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
