"""sd_notify without libsystemd: one datagram to $NOTIFY_SOCKET (a path, or '@' for the abstract
namespace). No-ops when not started by systemd. Never blocks for long: a datagram socket whose reader
has stopped draining it (its queue holds net.unix.max_dgram_qlen messages, 10 by default) would stall
a blocking send, and with it the inference loop or the SIGTERM handler, so a full queue drops the
message instead (returns False)."""
from __future__ import annotations

import os
import socket


def notify(state: str, wait_s: float = 0.0) -> bool:
    """Send `state`; wait at most `wait_s` for room in the receiver's queue (0: not at all)."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(wait_s if wait_s > 0 else 0.0)      # 0.0: non-blocking
            s.connect(addr)
            s.send(state.encode())
        return True
    except OSError:
        return False


def watchdog_interval_s():
    """Half of WatchdogSec (from $WATCHDOG_USEC, when $WATCHDOG_PID is unset or this process's), else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    try:
        return max(0.05, int(usec) / 1e6 / 2)
    except ValueError:
        return None
