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


def parse_size(text: str, what: str = "--workspace") -> int:
    """'512M' / '1G' / '1.5GiB' / '268435456' -> bytes (K, M, G, T are binary: 1G = 1 GiB); > 0."""
    import re

    s = str(text).strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?", s)
    if not m:
        raise UserError(f"{what} {text!r} is not a size (use e.g. 512M, 1G or a number of bytes)")
    n = float(m.group(1)) * (1 << (10 * " KMGT".index(m.group(2).upper() or " ")))
    if n < 1 << 20:
        raise UserError(f"{what} {text!r} is too small: give at least 1M")
    return int(n)
