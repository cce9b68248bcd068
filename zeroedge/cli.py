"""The `zeroedge` command line. Subcommands live in zeroedge/commands/<name>.py and are imported
only when invoked (or listed), and those modules import nothing heavy at module level, so
`zeroedge --help` starts fast and works without torch."""
import importlib

import click

from zeroedge import __version__
from zeroedge.commands.common import examples
from zeroedge.errors import run_command

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
    "serve": "serve",
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


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]}, epilog=examples(
    'zeroedge run smollm2-135m --prompt "In the beginning" --max-new 32',
    "zeroedge export smollm2-135m -o bundle/ && zeroedge plan bundle/ --board orin-nano-8gb --ctx 8192"))
@click.version_option(__version__, prog_name="zeroedge")
def cli():
    """zeroedge: export transformers to Jetson Orin; SIH/PAD skipping and thermal KV tiers."""


def main(argv=None):
    """Every error is one line on stderr (zeroedge.errors.run_command): bad input exit 2."""
    run_command(cli, argv, prog_name="zeroedge")


if __name__ == "__main__":
    main()
