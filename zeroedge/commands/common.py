"""Option parsing and the options every command shares, defined once (light: no heavy imports).

Conventions of the `zeroedge` command line:
  -o/--output PATH   whatever a command writes (artifact, bundle, engines, key, demo folder); the old
                     spelling --out still works, hidden, with a one-line deprecation note on stderr
  --ctx N            context length in tokens (old --context: a hidden alias, same note)
  fractions          every budget or fraction takes 10% or 0.1 (one parser: parse_budget)
  --target T         the JetPack software target (jetpack-6.2, jetpack-6.1), in export and check
  --board B          a Jetson board (orin-nano-8gb, ...), in plan; plan's old --target, which named
                     a board there, is a hidden alias that takes board names only (no JetPack value
                     is a board name, so it cannot be misread)
  --host HOST        always a device's hostname ([user@]host[:port] or an ~/.ssh/config alias)
  --help             ends with one or two example invocations (examples()); a command with many
                     options lists them under headings (SectionedCommand)
"""
import click
from click.core import ParameterSource

from zeroedge.errors import UserError
from zeroedge.planner import parse_size  # noqa: F401 (a size option's parser; the TensorRT module's CLI shares it)


def parse_budget(text, what: str = "budget") -> float:
    """'1%' or '0.01' -> 0.01; must lie in (0, 1]."""
    if isinstance(text, float):
        v = text
    else:
        s = str(text).strip()
        try:
            v = float(s[:-1]) / 100 if s.endswith("%") else float(s)
        except ValueError:
            raise UserError(f"{what} {text!r} is not a number (use e.g. 1% or 0.01)") from None
    if not (0 < v <= 1):
        raise UserError(f"{what} {text!r} is out of range: it must be in (0%, 100%], e.g. 10% or 0.1")
    return v


class Fraction(click.ParamType):
    """A budget or fraction in (0, 1]: '10%' or '0.1' (parse_budget)."""

    name = "fraction"

    def get_metavar(self, param, *args, **kwargs):
        return "F|P%"

    def convert(self, value, param, ctx):
        return parse_budget(value, what=param.opts[-1] if param is not None and param.opts else "budget")


FRACTION = Fraction()


# ------------------------------------------------------------------ help: examples and option headings

def examples(*lines: str) -> str:
    """A command's help epilog: its example invocations, printed as written (click's \\b marker keeps
    the lines unwrapped)."""
    head = "Example:" if len(lines) == 1 else "Examples:"
    return "\b\n" + head + "\n" + "\n".join("  " + line for line in lines)


class SectionedCommand(click.Command):
    """A command whose --help lists its options under headings: `sections` is [(heading, [parameter
    names])], in order; an option named in no section goes under "Other options"."""

    def __init__(self, *args, sections=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.sections = list(sections)

    def format_options(self, ctx, formatter):
        records = {}
        for p in self.get_params(ctx):
            rec = p.get_help_record(ctx) if isinstance(p, click.Option) else None
            if rec is not None:                  # hidden options have none
                records[p.name] = rec
        width = min(max(len(term) for term, _ in records.values()), 30)
        groups = [(title, [records.pop(n) for n in names if n in records]) for title, names in self.sections]
        groups.append(("Other options", list(records.values())))
        for title, rows in groups:
            if rows:
                with formatter.section(title):     # one first-column width across the sections
                    formatter.write_dl([(term.ljust(width), text) for term, text in rows])


# ------------------------------------------------------------------ options with deprecated aliases

class _Primary(click.Option):
    """An option whose value a hidden deprecated alias (declared beside it) may have given."""

    def consume_value(self, ctx, opts):
        value, source = super().consume_value(ctx, opts)
        old = ctx.meta.get(("zeroedge.alias", self.name))
        if old is not None:
            if source == ParameterSource.COMMANDLINE:
                raise click.UsageError(f"give {'/'.join(self.opts)} or its old spelling {old[0]}, not both", ctx)
            return old[1], ParameterSource.COMMANDLINE
        return value, source

    def process_value(self, ctx, value):
        if self.required and value is None:
            raise click.MissingParameter(ctx=ctx, param=self)
        return super().process_value(ctx, value)


def _alias_callback(old: str, dest: str, new: str):
    def callback(ctx, param, value):
        if value is None:
            return None
        click.echo(f"zeroedge: warning: {old} is deprecated; use {new}", err=True)
        if ctx.get_parameter_source(dest) == ParameterSource.COMMANDLINE:
            raise click.UsageError(f"give {new} or its old spelling {old}, not both", ctx)
        ctx.meta[("zeroedge.alias", dest)] = (old, value)
        return None

    return callback


def _with_alias(old: str, dest: str, new: str, type=None):
    """A hidden option OLD that sets DEST (the option NEW) and says on stderr that it is deprecated."""
    return click.option(old, "_alias_" + dest, type=type, default=None, hidden=True, expose_value=False,
                        callback=_alias_callback(old, dest, new))


def _aliased(decls, dest, old, new, **kw):
    def deco(f):
        f = click.option(*decls, dest, cls=_Primary, **kw)(f)
        for o in old:
            f = _with_alias(o, dest, new, type=kw.get("type"))(f)
        return f

    return deco


def output_option(help: str, dest: str = "output", required: bool = True, default=None, old_out: bool = False,
                  metavar: str = "PATH", **kw):
    """-o/--output: what the command writes. old_out: the command used to spell it --out (kept hidden)."""
    return _aliased(("-o", "--output"), dest, ("--out",) if old_out else (), "-o/--output", help=help,
                    required=required, default=default, type=click.Path(**kw), metavar=metavar,
                    show_default=default is not None)


def ctx_option(help: str, required: bool = False, default=None, old_context: bool = False):
    """--ctx N: context length in tokens. old_context: the command used to spell it --context."""
    return _aliased(("--ctx",), "ctx", ("--context",) if old_context else (), "--ctx", help=help,
                    required=required, default=default, type=int, metavar="N",
                    show_default=default is not None)


def fraction_option(name: str, dest: str, help: str, default=None, required: bool = False):
    """A budget or fraction in (0, 1]: takes 10% or 0.1; the command gets a float."""
    return click.option(name, dest, type=FRACTION, default=default, required=required,
                        show_default=default is not None, help=help + " Give e.g. 10% or 0.1.")


def target_option(f):
    """--target: the JetPack software on the device (export, check)."""
    return click.option("--target", "target", default="jetpack-6.2", show_default=True, metavar="JETPACK",
                        help="device software: jetpack-6.2 or jetpack-6.1 (TensorRT 10.3)")(f)


BOARDS_HELP = "Jetson board: orin-nano-8gb | orin-nx-16gb | orin-agx-64gb"


def board_option(f=None, *, required: bool = True, help: str = BOARDS_HELP):
    """--board: a Jetson board (plan; optional in run, as a memory cap). The old `plan --target
    BOARD` still works, hidden: it accepts board names only, and a JetPack value there is refused
    with a word on --target's meaning."""
    if f is None:
        return lambda g: board_option(g, required=required, help=help)

    def board_names():
        from zeroedge.planner import TARGETS

        return list(TARGETS)

    def check(ctx, param, value):
        if value is not None and value not in board_names():
            hint = (" (--target is the JetPack software, in export and check; plan takes the board)"
                    if str(value).startswith("jetpack") else "")
            raise click.BadParameter(f"unknown board {value}{hint}; known boards: {', '.join(board_names())}",
                                     ctx, param)
        return value

    f = click.option("--board", "board", cls=_Primary, required=required, metavar="BOARD", callback=check,
                     help=help)(f)
    if not required:
        return f

    def alias(ctx, param, value):
        return _alias_callback("--target", "board", "--board")(ctx, param, check(ctx, param, value))

    return click.option("--target", "_alias_board", default=None, hidden=True, expose_value=False,
                        callback=alias)(f)


def host_options(f):
    """--host HOST or --hosts FILE and the SSH options (deploy, status, rollback)."""
    for opt in reversed([
        click.option("--host", "host", metavar="HOST", help="[user@]host[:port] or an ~/.ssh/config alias."),
        click.option("--hosts", "hosts_file", metavar="FILE", type=click.Path(dir_okay=False),
                     help="Inventory: one '[NAME] [user@]host[:port] [key=value ...]' per line."),
        click.option("--ssh-config", metavar="FILE", help="ssh config to read instead of ~/.ssh/config."),
        click.option("--known-hosts", metavar="FILE", help="known_hosts to check instead of ~/.ssh/known_hosts."),
        click.option("--connect-timeout", type=float, default=15.0, show_default=True, help="Seconds."),
        click.option("--sudo", is_flag=True, help="Run device operations with passwordless sudo."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON document (for scripts)."),
    ]):
        f = opt(f)
    return f


def check_model(model: str, presets: bool = False, onnx: bool = False) -> None:
    """The checks of MODEL that need no torch, made before a command imports it: a bundled name whose
    wheel is missing, or a path that does not exist or is not a model, is refused at once. A bare
    name that may be a preset (presets=True) is left to the command."""
    from pathlib import Path

    from zeroedge import weights

    if model in weights.BUNDLED:
        weights.bundled_gguf(model)
        return
    p = Path(model)
    kinds = "an HF folder with config.json and *.safetensors, or a .gguf file" + (", or an .onnx graph" if onnx else "")
    if not p.exists():
        if presets and "/" not in model and not p.suffix:
            return                              # maybe a preset name: the command knows the presets
        raise UserError(f"model not found: {model} (give a bundled name: {', '.join(weights.BUNDLED)}, {kinds})")
    if p.is_dir() and (p / "config.json").is_file():
        return
    if p.is_file() and (p.suffix == ".gguf" or (onnx and p.suffix == ".onnx")):
        return
    raise UserError(f"{model}: not a model (expected {kinds})")


def memory_cap_options(help: str):
    """--device-memory SIZE and --board BOARD (a board's DRAM less its OS reserve) as a memory cap
    (run, eval); memory_cap() turns them into bytes."""

    def wrap(f):
        f = board_option(f, required=False, help="cap device memory at what a Jetson board leaves a model (its "
                                                 "DRAM less the OS reserve): " + BOARDS_HELP.split(": ")[1])
        return click.option("--device-memory", "device_memory", metavar="SIZE", help=help)(f)

    return wrap


def memory_cap(device_memory, board):
    """--device-memory SIZE, or --board B (the memory the planner leaves a model there: the board's
    DRAM less its OS reserve), or None. Both at once are refused."""
    from zeroedge.errors import UserError

    if device_memory is not None and board is not None:
        raise UserError("give --device-memory SIZE or --board BOARD, not both")
    if device_memory is not None:
        return parse_size(device_memory, "--device-memory")
    if board is not None:
        from zeroedge.planner import target

        t = target(board)
        return t.memory - t.os_reserve
    return None


def check_policy_value(flag: str, value: int) -> None:
    """--kv-ahead: layers >= 0; --kv-fetch: pages 1..kv.policy.MAX_FETCH (run and eval alike)."""
    if flag == "--kv-ahead" and value < 0:
        raise UserError(f"--kv-ahead must be a number of layers >= 0 (got {value})")
    if flag == "--kv-fetch":
        from zeroedge.kv.policy import MAX_FETCH

        if not 1 <= value <= MAX_FETCH:
            raise UserError(f"--kv-fetch must be a number of pages from 1 to {MAX_FETCH} (got {value})")
