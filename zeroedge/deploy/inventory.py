"""Targets and inventories.

A target is `[user@]host[:port]` or an alias from ~/.ssh/config (ProxyJump and all). An inventory
(`--hosts FILE`) has one target per line, optionally followed by `key=value` settings for that
device; `#` starts a comment:

    # name          target                  settings
    jetson-a        root@10.0.0.21          metrics_port=9100
    jetson-b        lab-orin-2              keep=5 base=/opt/zeroedge

The first column is the device's name in summaries; with a single column, the target is its name.
Every line is checked before anything connects: one bad line refuses the whole inventory.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from zeroedge.errors import UserError

SETTINGS = {"metrics_port": int, "keep": int, "base": str, "python": str, "user": str, "port": int}
_TARGET = re.compile(r"^(?:(?P<user>[A-Za-z0-9._-]+)@)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)"
                     r"(?::(?P<port>\d{1,5}))?$")


@dataclass
class Target:
    name: str
    host: str
    user: str | None = None
    port: int | None = None
    settings: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.name


def parse_target(text: str, name: str | None = None, settings: dict | None = None, where: str = "") -> Target:
    m = _TARGET.match(text.strip())
    if not m:
        raise UserError(f"{where}bad host {text!r}: expected [user@]host[:port] or an ~/.ssh/config alias")
    port = int(m["port"]) if m["port"] else None
    if port is not None and not 0 < port < 65536:
        raise UserError(f"{where}bad port in {text!r}")
    s = dict(settings or {})
    return Target(name=name or text.strip(), host=m["host"].strip("[]"), user=s.pop("user", None) or m["user"],
                  port=s.pop("port", None) or port, settings=s)


def parse_inventory(path: Path) -> list[Target]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"inventory not found: {path}")
    targets, seen = [], {}
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        where = f"{path}:{lineno}: "
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        plain = [w for w in words if "=" not in w]
        kv = [w for w in words if "=" in w]
        if not plain or len(plain) > 2 or words[:len(plain)] != plain:
            raise UserError(f"{where}bad inventory line {raw.strip()!r}: expected "
                            "'[NAME] [user@]host[:port] [key=value ...]'")
        settings = {}
        for w in kv:
            k, v = w.split("=", 1)
            if k not in SETTINGS:
                raise UserError(f"{where}unknown setting {k!r} (known: {', '.join(sorted(SETTINGS))})")
            try:
                settings[k] = SETTINGS[k](v)
            except ValueError:
                raise UserError(f"{where}{k}={v!r} is not a valid {SETTINGS[k].__name__}") from None
        name = plain[0] if len(plain) == 2 else None
        t = parse_target(plain[-1], name=name, settings=settings, where=where)
        if t.name in seen:
            raise UserError(f"{where}duplicate name {t.name!r} (first on line {seen[t.name]})")
        seen[t.name] = lineno
        targets.append(t)
    if not targets:
        raise UserError(f"{path}: inventory lists no hosts")
    return targets
