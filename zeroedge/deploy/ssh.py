"""SSH transport (asyncssh, imported lazily): connection with OpenSSH semantics (~/.ssh/config with
ProxyJump, known_hosts checked and never silently accepted), the device agent runner, and
content-addressed SFTP upload. Every failure becomes a one-line UserError naming the host."""
from __future__ import annotations

import json
import os
import stat
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


def _asyncssh():
    """asyncssh, imported with cryptography's deprecation warnings silenced: asyncssh names the DSA
    key types cryptography deprecates, and those warnings would reach a user's terminal."""
    import warnings

    with warnings.catch_warnings():
        from cryptography.utils import CryptographyDeprecationWarning

        warnings.simplefilter("ignore", CryptographyDeprecationWarning)
        import asyncssh
    return asyncssh


def _where(t: Target) -> str:
    return f"{t.user + '@' if t.user else ''}{t.host}{':' + str(t.port) if t.port else ''}"


GLOBAL_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"


def _options(host: str, port, user, ssh_config: str | None):
    """asyncssh's reading of the ssh config for one host (HostName, Port, User, ProxyJump, ...)."""
    asyncssh = _asyncssh()

    return asyncssh.SSHClientConnectionOptions(config=[ssh_config] if ssh_config else (), host=host,
                                               port=port or (), username=user or ())


def known_hosts_files(opts, explicit: str | None) -> list[str]:
    """The known_hosts files a host may be checked against: --known-hosts if given, else the
    config's UserKnownHostsFile (a `none` there is ignored), else ~/.ssh/known_hosts; plus
    /etc/ssh/ssh_known_hosts. The caller keeps those that exist (as OpenSSH does)."""
    if explicit:
        files = [explicit]
    else:
        files = [f for f in opts.config.get("UserKnownHostsFile", ()) if f.lower() != "none"] \
            or ["~/.ssh/known_hosts"]
    return [str(Path(f).expanduser()) for f in files] + [GLOBAL_KNOWN_HOSTS]


def _jumps(host: str, port, user, ssh_config: str | None, depth: int = 0) -> list[tuple]:
    """The ProxyJump hops to reach `host`, first hop first, as (host, port, user); the first hop's
    own ProxyJump is expanded too (as OpenSSH and asyncssh do)."""
    spec = _options(host, port, user, ssh_config).tunnel
    if not isinstance(spec, str) or depth > 8:
        return []
    hops = []
    for hop in spec.split(","):
        user, _, hostport = hop.rpartition("@")
        name, sep, p = hostport.rpartition(":")
        if not sep or ":" in name or not p.isdigit():   # no port (or a bare IPv6 address)
            name, p = hostport, ""
        hops.append((name, int(p) if p else None, user or None))
    return _jumps(*hops[0], ssh_config, depth + 1) + hops


async def connect(t: Target, ssh_config: str | None = None, known_hosts: str | None = None,
                  timeout: float = 15.0):
    """Connect to `t` the way OpenSSH would (~/.ssh/config, ProxyJump), with every host key checked.
    asyncssh alone would take `UserKnownHostsFile none` in the config as "check nothing" and open
    ProxyJump hops with the config only, so both are done here: each connection, hops included,
    gets an explicit known_hosts, and each hop is opened here and passed on as the next tunnel."""
    asyncssh = _asyncssh()

    try:
        hops = _jumps(t.host, t.port, t.user, ssh_config)
    except asyncssh.ConfigParseError as e:
        raise HostError(t, f"bad ssh config: {e}") from None
    conn = None
    try:
        for host, port, user in hops:
            conn = await _open(t, host, port, user, ssh_config, known_hosts, timeout, conn, jump=True)
        return await _open(t, t.host, t.port, t.user, ssh_config, known_hosts, timeout, conn, jump=False)
    except BaseException:
        if conn is not None:
            conn.close()
        raise


async def _open(t: Target, host, port, user, ssh_config, known_hosts, timeout, tunnel, jump: bool):
    """One connection to `host` (through `tunnel` when given, else direct: a config ProxyJump is
    never followed here); `jump`: it is a jump host on the way to `t`."""
    import asyncio

    asyncssh = _asyncssh()

    dest = Target(host, host, user, port) if jump else t
    where = f"jump host {_where(dest)} (on the way to {t.label})" if jump else _where(t)
    wanted = known_hosts_files(_options(host, port, user, ssh_config), known_hosts)
    files = [f for f in wanted if Path(f).is_file()]
    if not files:
        raise HostError(t, f"host key verification failed for {where}: no known_hosts file (none of "
                           f"{', '.join(wanted)} exists); nothing was changed. Check the host's key and "
                           f"record it: ssh {_where(dest)}")
    try:
        kh = asyncssh.read_known_hosts(files)
    except (OSError, ValueError) as e:
        raise HostError(t, f"cannot read known_hosts ({', '.join(files)}): {e}") from None
    kw = {"connect_timeout": timeout, "login_timeout": timeout, "tunnel": tunnel, "known_hosts": kh}
    if port:
        kw["port"] = port
    if user:
        kw["username"] = user
    if ssh_config:
        kw["config"] = [ssh_config]
    try:
        conn = await asyncssh.connect(host, **kw)
    except asyncssh.HostKeyNotVerifiable as e:
        raise HostError(t, f"host key verification failed for {where} ({e.reason}); nothing was "
                           "changed. If the device was re-flashed, check its new key and replace the old "
                           f"one: ssh-keygen -R {_khname(dest)} && ssh {_where(dest)}") from None
    except asyncssh.PermissionDenied:
        raise HostError(t, f"permission denied for {where} (public key not accepted); install your "
                           f"key with: ssh-copy-id {_where(dest)}") from None
    except asyncssh.ConfigParseError as e:
        raise HostError(t, f"bad ssh config: {e}") from None
    except (asyncssh.DisconnectError, asyncssh.ChannelOpenError) as e:
        raise HostError(t, f"ssh to {where} failed: {e.reason}") from None
    except (asyncio.TimeoutError, TimeoutError):
        raise HostError(t, f"unreachable: {where} did not answer within {timeout:g} s") from None
    except ConnectionRefusedError:
        raise HostError(t, f"unreachable: connection refused by {where} (is sshd running?)") from None
    except OSError as e:
        raise HostError(t, f"unreachable: {where}: {e.strerror or e}") from None
    if tunnel is not None:
        conn.set_tunnel(tunnel)   # closing the connection closes the hops (as asyncssh's own ProxyJump does)
    return conn


def _khname(t: Target) -> str:
    return f"'[{t.host}]:{t.port}'" if t.port and t.port != 22 else t.host


def agent_source() -> str:
    """probe.py + trust.py + remote.py as one script for the device's python3 (stdlib only)."""
    here = Path(__file__).resolve().parent
    parts = [(here.parent / "device" / "probe.py").read_text(), (here.parent / "trust.py").read_text(),
             (here / "remote.py").read_text()]
    return "_ZEROEDGE_EMBEDDED = True\n" + "\n\n".join(parts) + "\n"


def agent_script(payload: dict) -> str:
    """What `python3 -` on the device reads for one operation."""
    return agent_source() + f"\nmain(json.loads({json.dumps(payload)!r}))\n"


def agent_result(stdout: str) -> dict:
    """The agent's {"ok": ..., "result"|"error": ...} from its stdout (which holds MARKER)."""
    return json.loads(stdout.rsplit(MARKER, 1)[1].strip().splitlines()[0])


async def agent(conn, t: Target, payload: dict, python: str = "python3", sudo: bool = False,
                phase: str = "remote") -> tuple[dict, str]:
    """Run one device operation; returns (result, stderr log). Raises HostError on failure."""
    asyncssh = _asyncssh()

    script = agent_script(payload)
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
    res = agent_result(out)
    if not res["ok"]:
        raise HostError(t, res["error"], phase)
    return res["result"], err


async def upload(conn, t: Target, files: list[tuple[Path, str, int]], incoming: str, uid: int, progress=None,
                 parallel: int = 8) -> int:
    """SFTP each (local path, sha256, size) to INCOMING/<sha256>, `parallel` files at a time (a
    bundle is many small files: round trips, not bandwidth, bound it); returns bytes moved.
    `progress(delta_bytes)` is called as bytes go out.

    INCOMING is made 0700 here and refused if it is a link, not `uid`'s or open to group or others,
    so no upload (daemon.toml can hold the MQTT password) is readable by another user at any moment.
    Each file is read locally without following a link and created remotely with O_EXCL and mode
    0600 (SFTP's default would be 0644 under the server's umask), after removing whatever had its
    name: a link planted there is removed, never written through."""
    import asyncio

    asyncssh = _asyncssh()

    sem = asyncio.Semaphore(parallel)

    async def one(sftp, src, sha, size):
        dst = f"{incoming}/{sha}"
        async with sem:
            try:
                await sftp.remove(dst)
            except asyncssh.SFTPNoSuchFile:
                pass
            with open(os.open(src, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                async with sftp.open(dst, "xb", attrs=asyncssh.SFTPAttrs(permissions=0o600)) as out:
                    while chunk := f.read(1 << 20):
                        await out.write(chunk)
                        if progress:
                            progress(len(chunk))
        return size

    try:
        async with conn.start_sftp_client() as sftp:
            await _private_dir(sftp, t, incoming, uid)
            done = await asyncio.gather(*(one(sftp, *f) for f in files))
    except asyncssh.SFTPError as e:
        reason = e.reason
        if e.code == getattr(asyncssh, "FX_NO_SPACE_ON_FILESYSTEM", -1) or "space" in reason.lower():
            reason = "no space left on the device"
        raise HostError(t, f"upload failed: {reason}", "upload") from None
    except (asyncssh.Error, OSError) as e:
        raise HostError(t, f"upload failed: {e}", "upload") from None
    return sum(done)


async def _private_dir(sftp, t: Target, path: str, uid: int):
    """Make the directory `path` with mode 0700 if it is absent; refuse it if it is a link, not a
    directory, not owned by `uid`, or open to group or others."""
    asyncssh = _asyncssh()

    parent = path.rsplit("/", 1)[0]
    if parent:
        await sftp.makedirs(parent, exist_ok=True)
    try:
        await sftp.mkdir(path, asyncssh.SFTPAttrs(permissions=0o700))
    except asyncssh.SFTPError:  # it exists (or cannot be made: lstat says which)
        pass
    a = await sftp.lstat(path)
    why = ("a link" if stat.S_ISLNK(a.permissions) else "not a directory" if not stat.S_ISDIR(a.permissions)
           else f"owned by uid {a.uid}, not {uid}" if a.uid != uid
           else f"mode {a.permissions & 0o7777:o}, open to other users" if a.permissions & 0o077 else None)
    if why:
        raise HostError(t, f"upload dir {path} is {why}; refused (nothing was uploaded): remove it and "
                           "deploy again", "upload")
