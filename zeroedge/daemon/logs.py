"""Logs journald understands: one line per event on stderr, prefixed with the syslog priority
("<3>" error, "<4>" warning, "<6>" info, "<7>" debug; see sd-daemon(3)); journald strips the prefix
and records the priority. Outside systemd (no $JOURNAL_STREAM) the prefix is the level name."""
from __future__ import annotations

import logging
import os
import sys

PRIO = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class JournalFormatter(logging.Formatter):
    def __init__(self, journald: bool):
        super().__init__()
        self.journald = journald

    def format(self, record):
        msg = record.getMessage().replace("\n", " | ")
        if self.journald:
            return f"<{PRIO.get(record.levelno, 6)}>{msg}"
        return f"{record.levelname.lower()}: {msg}"


def setup(level: str = "info") -> logging.Logger:
    log = logging.getLogger("zeroedge.daemon")
    log.handlers.clear()
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JournalFormatter(bool(os.environ.get("JOURNAL_STREAM"))))
    log.addHandler(h)
    log.setLevel(getattr(logging, str(level).upper(), logging.INFO))
    log.propagate = False
    return log
