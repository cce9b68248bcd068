"""SSH transport (asyncssh, imported lazily): connection with OpenSSH semantics (~/.ssh/config with
ProxyJump, known_hosts checked and never silently accepted), the device agent runner, and
content-addressed SFTP upload. Every failure becomes a one-line UserError naming the host."""
from __future__ import annotations

import json
from pathlib import Path

from zeroedge.errors import UserError

from .inventory import Target

MARKER = "@@ZEROEDGE-RESULT@@"


class HostError(UserError):
    """A failure on one host (connection, preflight, remote operation); exit 2 when it happens
    before anything changed on the device."""

    def __init__(self, target: Target, msg: str, phase: str = "connect"):
        super().__init__(f"{target.label}: {msg}")
        self.target, self.msg, self.phase = target, msg, phase


def _where(t: Target) -> str:
    return f"{t.user + '@' if t.user else ''}{t.host}{':' + str(t.port) if t.port else ''}"


async def connect(t: Target, ssh_config: str | None = None, known_hosts: str | None = None,
                  timeout: float = 15.0):
    import asyncio

    import asyncssh

    kw = {"connect_timeout": timeout, "login_timeout": timeout}
    if t.port:
        kw["port"] = t.port
    if t.user:
        kw["username"] = t.user
    if ssh_config:
        kw["config"] = [ssh_config]
    if known_hosts:
        kw["known_hosts"] = known_hosts
    try:
        return await asyncssh.connect(t.host, **kw)
    except asyncssh.HostKeyNotVerifiable as e:
        raise HostError(t, f"host key verification failed for {_where(t)} ({e.reason}); nothing was "
                           "changed. If the device was re-flashed, check its new key and replace the old "
                           f"one: ssh-keygen -R {_khname(t)} && ssh {_where(t)}") from None
    except asyncssh.PermissionDenied:
        raise HostError(t, f"permission denied for {_where(t)} (public key not accepted); install your "
                           f"key with: ssh-copy-id {_where(t)}") from None
    except asyncssh.ConfigParseError as e:
        raise HostError(t, f"bad ssh config: {e}") from None
    except (asyncssh.DisconnectError, asyncssh.ChannelOpenError) as e:
        raise HostError(t, f"ssh to {_where(t)} failed: {e.reason}") from None
    except (asyncio.TimeoutError, TimeoutError):
        raise HostError(t, f"unreachable: {_where(t)} did not answer within {timeout:g} s") from None
    except ConnectionRefusedError:
        raise HostError(t, f"unreachable: connection refused by {_where(t)} (is sshd running?)") from None
    except OSError as e:
        raise HostError(t, f"unreachable: {_where(t)}: {e.strerror or e}") from None


def _khname(t: Target) -> str:
    return f"'[{t.host}]:{t.port}'" if t.port and t.port != 22 else t.host


def agent_source() -> str:
    """probe.py + remote.py as one script for the device's python3 (stdlib only)."""
    here = Path(__file__).resolve().parent
    probe = (here.parent / "device" / "probe.py").read_text()
    remote = (here / "remote.py").read_text()
    return "_ZEROEDGE_EMBEDDED = True\n" + probe + "\n\n" + remote + "\n"


async def agent(conn, t: Target, payload: dict, python: str = "python3", sudo: bool = False,
                phase: str = "remote") -> tuple[dict, str]:
    """Run one device operation; returns (result, stderr log). Raises HostError on failure."""
    import asyncssh

    script = agent_source() + f"\nmain(json.loads({json.dumps(payload)!r}))\n"
    cmd = ("sudo -n " if sudo else "") + f"{python} -"
    try:
        proc = await conn.run(cmd, input=script, check=False)
    except (asyncssh.Error, OSError) as e:
        raise HostError(t, f"lost the ssh connection during {payload['op']}: {e}", phase) from None
    out, err = proc.stdout or "", proc.stderr or ""
    if MARKER not in out:
        if proc.exit_status == 127:
            raise HostError(t, f"{python} not found on the device (zeroedge needs Python 3.10 there, as "
                               "JetPack 6 ships it)", phase)
        if sudo and "password" in err:
            raise HostError(t, "sudo needs a password on the device; allow passwordless sudo for this user "
                               "or deploy as root", phase)
        last = (err.strip().splitlines() or ["no output"])[-1]
        raise HostError(t, f"device agent failed ({payload['op']}, exit {proc.exit_status}): {last}", phase)
    res = json.loads(out.rsplit(MARKER, 1)[1].strip().splitlines()[0])
    if not res["ok"]:
        raise HostError(t, res["error"], phase)
    return res["result"], err


async def upload(conn, t: Target, files: list[tuple[Path, str, int]], incoming: str, progress=None,
                 parallel: int = 8) -> int:
    """SFTP each (local path, sha256, size) to INCOMING/<sha256>, `parallel` files at a time (a
    bundle is many small files: round trips, not bandwidth, bound it); returns bytes moved.
    `progress(delta_bytes)` is called as bytes go out."""
    import asyncio

    import asyncssh

    sem = asyncio.Semaphore(parallel)

    async def one(sftp, src, sha, size):
        sent = [0]

        def cb(_s, _d, done, _total):
            if progress:
                progress(done - sent[0])
            sent[0] = done

        async with sem:
            await sftp.put(str(src), f"{incoming}/{sha}", progress_handler=cb)
        if progress and sent[0] < size:
            progress(size - sent[0])
        return size

    try:
        async with conn.start_sftp_client() as sftp:
            await sftp.makedirs(incoming, exist_ok=True)
            done = await asyncio.gather(*(one(sftp, *f) for f in files))
    except asyncssh.SFTPError as e:
        reason = e.reason
        if e.code == getattr(asyncssh, "FX_NO_SPACE_ON_FILESYSTEM", -1) or "space" in reason.lower():
            reason = "no space left on the device"
        raise HostError(t, f"upload failed: {reason}", "upload") from None
    except (asyncssh.Error, OSError) as e:
        raise HostError(t, f"upload failed: {e}", "upload") from None
    return sum(done)
