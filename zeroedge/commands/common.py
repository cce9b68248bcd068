"""Option parsing shared by commands (light: no heavy imports)."""
from zeroedge.errors import UserError


def parse_budget(text: str) -> float:
    """'1%' or '0.01' -> 0.01; must lie in (0, 1]."""
    s = str(text).strip()
    try:
        v = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise UserError(f"budget {text!r} is not a number (use e.g. 1% or 0.01)") from None
    if not (0 < v <= 1):
        raise UserError(f"budget {text!r} is out of range: it must be in (0%, 100%]")
    return v
