"""sd_notify without libsystemd: one datagram to $NOTIFY_SOCKET (a path, or '@' for the abstract
namespace). No-ops when not started by systemd."""
from __future__ import annotations

import os
import socket


def notify(state: str) -> bool:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError:
        return False


def watchdog_interval_s():
    """Half of WatchdogSec (from $WATCHDOG_USEC, when $WATCHDOG_PID is unset or ours), else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    try:
        return max(0.05, int(usec) / 1e6 / 2)
    except ValueError:
        return None
