"""User-facing errors: one line, exit code 2, no traceback."""


class UserError(Exception):
    """Bad input from the user (file, option, artifact). The CLI prints it as one line and exits 2."""

    exit_code = 2


class MissingDependency(UserError):
    """An optional stack (TensorRT, torch, paho...) is not installed; the message says how to get it."""


def require(module: str, extra: str):
    """Import `module` or raise MissingDependency naming the pip extra that provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(
            f"{module} is not installed ({e}); install it with: pip install 'zeroedge[{extra}]'") from None
