"""User-facing errors and the one error path every command line goes through.

  UserError       bad input the user can fix (a file, an option, an artifact): one line, exit 2
  Failure         the command ran and did not succeed for a reason that is not bad input (a device
                  whose new release did not come up healthy): one line, exit 1
  anything else   a programming error: a traceback

`run_command` runs a click command with that contract (`zeroedge` itself and
`python -m zeroedge.backends.tensorrt`): every error is one line `zeroedge: error: ...` on stderr.
"""


class UserError(Exception):
    """Bad input from the user (file, option, artifact). The CLI prints it as one line and exits 2."""

    exit_code = 2


class MissingDependency(UserError):
    """An optional stack (TensorRT, torch, paho...) is not installed; the message says how to get it."""


class Failure(Exception):
    """Not bad input, yet the command failed (e.g. a deployed release was unhealthy and rolled back):
    printed as one line like a UserError, exit code 1."""

    exit_code = 1


def require(module: str, extra: str):
    """Import `module` or raise MissingDependency naming the pip extra that provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(
            f"{module} is not installed ({e}); install it with: pip install 'zeroedge[{extra}]'") from None


def error_line(message) -> str:
    """The one line every command prints for an error."""
    return "zeroedge: error: " + " ".join(str(message).split("\n")).strip()


def run_command(command, argv=None, prog_name: str = "zeroedge"):
    """Run a click command (or group) and turn every expected error into one line on stderr and an
    exit code: UserError and usage errors 2, Failure 1, Ctrl-C 130. Programming errors propagate
    (a traceback). Returns what the command returned."""
    import sys

    import click

    try:
        return command.main(args=argv, prog_name=prog_name, standalone_mode=False)
    except (UserError, Failure) as e:
        click.echo(error_line(e), err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("zeroedge: aborted", err=True)
        sys.exit(130)
    except click.UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":    # a bare group: its help, as click prints it
            e.show()
            sys.exit(2)
        where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
        click.echo(error_line(e.format_message().rstrip(".") + where), err=True)
        sys.exit(2)
    except click.ClickException as e:
        click.echo(error_line(e.format_message()), err=True)
        sys.exit(2 if e.exit_code == 1 else e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("zeroedge: interrupted", err=True)
        sys.exit(130)
