"""Deploy / rollback / status for one host or a fleet, in parallel with asyncio.

Deploy is two-phase. Phase 1 (every host, in parallel, read-only on the devices): connect, probe,
ask which objects each store already has, evaluate. If any host fails phase 1, nothing is changed on
any device and the exit code is 2. Phase 2 (in parallel): upload what is missing, then one device
operation stages the release, builds, installs the unit, swaps `current`, restarts and checks
health; an unhealthy new release is rolled back to the previous one on the spot.

A release runs one service, and the bundle decides which: a sensor bundle the daemon
(zeroedge.service, health /healthz), a model bundle zeroedge serve (zeroedge-serve.service, deploy
--serve, health /health). A deploy that asks for the other one is refused before anything connects.
"""
from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from zeroedge.errors import UserError

from . import preflight as pf
from .inventory import Target
from .ssh import HostError, agent, connect, upload

DEFAULT_BASE = "/opt/zeroedge"
SERVE_UNIT = "zeroedge-serve.service"


@dataclass
class Options:
    ssh_config: str | None = None
    known_hosts: str | None = None
    connect_timeout: float = 15.0
    min_free: int = 256 << 20
    keep: int = 3
    sudo: bool = False
    dry_run: bool = False
    health_timeout: float = 60.0
    auto_rollback: bool = True
    config: Path | None = None
    metrics_port: int | None = None
    unit_file: Path | None = None
    quiet: bool = False       # --json: no progress bars
    pin_keys: list = field(default_factory=list)   # --pin-key: PEM public keys to pin on the devices
    serve: bool = False       # --serve: zeroedge-serve.service (zeroedge serve on the release's model bundle)
    serve_port: int = 8000    # --serve-port: where it listens on the device's 127.0.0.1


@dataclass
class HostResult:
    name: str
    ok: bool = False
    phase: str = "connect"
    error: str | None = None
    changed: bool = False
    release: str | None = None
    previous: str | None = None
    backend: str | None = None
    files_uploaded: int = 0
    bytes_uploaded: int = 0
    bytes_total: int = 0
    health: dict | None = None
    notes: list = field(default_factory=list)
    facts: dict | None = None
    would: list = field(default_factory=list)
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("facts", "extra")}
        d.update(self.extra)
        if self.facts:
            f = self.facts
            d["device"] = {"l4t": f.get("l4t"), "jetpack": f.get("jetpack"), "gpu": (f.get("gpu") or {}).get("arch"),
                           "python": (f.get("python") or {}).get("version"),
                           "tensorrt": (f.get("tensorrt_lib") or {}).get("version"),
                           "disk_free": (f.get("disk") or {}).get("free"),
                           "mem_available": (f.get("memory") or {}).get("available")}
        return d


def _s(t: Target, key, default=None):
    return t.settings.get(key, default)


def _payload(t: Target, opts: Options, op: str, **kw) -> dict:
    return {"op": op, "base": _s(t, "base", DEFAULT_BASE), "keep": _s(t, "keep", opts.keep),
            "health_timeout": opts.health_timeout, **kw}


async def _run(t, opts, conn, op, **kw):
    return await agent(conn, t, _payload(t, opts, op, **kw), python=_s(t, "python", "python3"), sudo=opts.sudo,
                       phase=op)


def _describe(facts: dict) -> str:
    g, m, d = facts.get("gpu") or {}, facts.get("memory") or {}, facts.get("disk") or {}
    trt = (facts.get("tensorrt_lib") or {}).get("version")
    return (f"L4T {facts.get('l4t')} (JetPack {facts.get('jetpack')}), {g.get('arch')}"
            f"{' ' + g['model'] if g.get('model') else ''}, TensorRT {trt or 'none'}, "
            f"Python {facts['python']['version']}, {pf.fmt_bytes(d.get('free'))} disk free, "
            f"{pf.fmt_bytes(m.get('available'))} memory available")


class Deployer:
    def __init__(self, bundle: Path, manifest: dict, targets: list[Target], opts: Options, echo):
        self.bundle, self.manifest, self.targets, self.opts, self.echo = Path(bundle), manifest, targets, opts, echo
        self.tmp = tempfile.TemporaryDirectory(prefix="zeroedge-deploy-")
        from zeroedge.bundle import signer

        from .release import daemon_template, has_plugins, has_trt_backend, serve_spec
        from zeroedge.trust import key_id, public_key_raw

        self.template = {} if opts.serve else daemon_template(opts.config)   # a --serve release has no daemon
        self.serve = serve_spec(opts.serve_port) if opts.serve else None   # --serve: unit template + port
        self.has_plugins, self.has_trt = has_plugins(), has_trt_backend()
        self.signer = signer(self.bundle)      # None: unsigned; a bad signature is refused here
        self.new_pins = [key_id(public_key_raw(pem)) for pem in opts.pin_keys]

    # ---------------- phase 1: read-only on every device
    async def prepare(self, t: Target, r: HostResult):
        from .release import build_release, metrics_port

        r.phase = "connect"
        t0 = time.perf_counter()
        conn = await connect(t, self.opts.ssh_config, self.opts.known_hosts, self.opts.connect_timeout)
        r.extra["_conn"] = conn
        _tick(r, "connect_s", t0)
        t0 = time.perf_counter()
        r.phase = "preflight"
        want = list(pf.SERVE_MODULES) + ["cryptography"] if self.serve else \
            list(pf.DAEMON_MODULES) + ["tomli", "cryptography"]
        facts, _ = await _run(t, self.opts, conn, "probe", modules=want)
        r.facts = facts
        # a first verdict decides the backend (which shapes daemon.toml); the disk check needs the
        # upload size, known once the release exists, so evaluate again below
        sig = {"signer": self.signer, "new_pins": self.new_pins}
        if self.opts.serve:
            sig["serve"] = True
        v0 = pf.evaluate(facts, self.manifest, 0, 0, self.opts.sudo, self.has_plugins, self.has_trt, **sig)
        if v0.problems:
            raise HostError(t, "; ".join(v0.problems), "preflight")
        port = None if self.serve else metrics_port(self.template, _s(t, "metrics_port", self.opts.metrics_port))
        rel = build_release(self.bundle, self.manifest, self.template, port, v0.backend,
                            Path(self.tmp.name) / t.name, self.opts.unit_file, root=facts["root"],
                            base=_s(t, "base", DEFAULT_BASE), name=t.name, serve=self.serve)
        present = set(facts.pop("store", []))
        missing, seen = [], set()
        for e in rel.entries.values():
            if e.sha256 not in present and e.sha256 not in seen:
                seen.add(e.sha256)
                missing.append((e.src, e.sha256, e.bytes))
                r.extra.setdefault("uploaded", []).append(e.rel)
        up = sum(m[2] for m in missing)
        v = pf.evaluate(facts, self.manifest, up, self.opts.min_free, self.opts.sudo, self.has_plugins, self.has_trt,
                        **sig)
        if v.problems:
            raise HostError(t, "; ".join(v.problems), "preflight")
        r.backend, r.notes = v.backend, v.notes
        r.bytes_total = rel.total_bytes
        r.extra.update(_rel=rel, _missing=missing, _verdict=v)
        _tick(r, "preflight_s", t0)
        r.phase = "ready"

    # ---------------- phase 2: change the device
    async def apply(self, t: Target, r: HostResult, progress):
        conn, rel, missing, v = (r.extra.pop(k) for k in ("_conn", "_rel", "_missing", "_verdict"))
        base, login = r.facts["base"], r.facts.get("login_uid", r.facts.get("uid"))
        # uploads land in the store's .incoming/, or (--sudo as a plain user, who may not write the
        # store) in the login's own dir in the device's /tmp; both are 0700, the login's. The agent
        # (root through sudo) verifies them and copies them into the store
        incoming = f"{base}/.incoming" if login == 0 or not self.opts.sudo else \
            f"{r.facts['root'].rstrip('/')}/tmp/zeroedge-incoming-{login}"
        r.phase = "upload"
        t0 = time.perf_counter()
        if missing:
            task = progress.add_task(t.name, total=sum(m[2] for m in missing)) if progress else None

            def adv(n):
                if progress:
                    progress.advance(task, n)

            r.bytes_uploaded = await upload(conn, t, missing, incoming, login, adv)
            r.files_uploaded = len(missing)
        _tick(r, "upload_s", t0)
        t0 = time.perf_counter()
        r.phase = "activate"
        steps = v.steps
        service = {"serve": rel.serve} if rel.serve else {"unit": rel.unit, "metrics_port": rel.info["metrics_port"]}
        res, log = await _run(t, self.opts, conn, "activate", hashes=[m[1] for m in missing], incoming=incoming,
                              release_id=rel.id, files=rel.files_payload(), python=r.facts["python"]["executable"],
                              auto_rollback=self.opts.auto_rollback, build={"backend": v.backend, "steps": steps},
                              pin_keys=self.opts.pin_keys, **service)
        _tick(r, "activate_s", t0)
        r.release, r.previous, r.health = res["release"], res.get("previous"), res.get("health")
        r.changed = not res.get("unchanged") or bool(r.bytes_uploaded)
        r.extra["build"] = res.get("build")
        for k in ("build_s", "restart_to_healthy_s"):
            if k in res:
                r.extra.setdefault("timings", {})[k] = res[k]
        r.extra["gc"] = res.get("gc")
        r.extra.update(signed_by=res.get("signed_by"), pinned=res.get("pinned"))
        if res.get("rolled_back_to"):
            r.extra["rolled_back_to"] = res["rolled_back_to"]
        r.extra["role"] = "serve" if rel.serve else "daemon"
        if rel.serve:
            r.extra["serve"] = {"unit": SERVE_UNIT, "port": rel.serve["port"], "health": r.health}
        if res.get("removed"):
            r.extra["removed"] = res["removed"]     # the other service's unit, stopped and removed
        if not (r.health or {}).get("ok"):
            r.phase = "health"
            h = r.health or {}
            back = (f"; rolled back to {res['rolled_back_to']}" if res.get("rolled_back_to")
                    else "; no previous release to roll back to" if not r.previous else "")
            if rel.serve:
                r.error = f"release {r.release}: {_unhealthy(h, back)}"
                return
            why = f"HTTP {h['code']} {_short(h.get('body'))}" if h.get("code") not in (None, 200) \
                else h.get("error", "no answer")
            logs = (h.get("logs") or "").strip().splitlines()
            r.error = (f"release {r.release} is not healthy ({why} from {h.get('url')}){back}"
                       + (f"; daemon log: {logs[-1][:200]}" if logs else ""))
            return
        r.phase, r.ok = "done", True

    def dry(self, t: Target, r: HostResult):
        rel, missing, v = r.extra["_rel"], r.extra["_missing"], r.extra["_verdict"]
        cur = None
        r.would.append(f"upload {len(missing)} of {len(rel.entries)} files, {pf.fmt_bytes(sum(m[2] for m in missing))}"
                       f" of {pf.fmt_bytes(rel.total_bytes)}")
        if rel.serve:
            r.would.append(f"activate release ...-{rel.id} (backend {v.backend}) and restart {SERVE_UNIT} (zeroedge "
                           f"serve on 127.0.0.1:{rel.serve['port']}; no daemon: zeroedge.service stopped and removed "
                           "where a deploy installed it), unless it is already current and healthy")
        else:
            r.would.append(f"activate release ...-{rel.id} (backend {v.backend}) and restart zeroedge.service, "
                           "unless it is already current and healthy")
        for s in v.steps:
            r.would.append(f"build {s['name']}: " + (" ".join(s["argv"]) if s.get("argv") else f"skipped ({s['why']})"))
        r.release, r.ok, r.phase = cur, True, "dry-run"
        r.bytes_uploaded = 0
        r.extra["would_upload_bytes"] = sum(m[2] for m in missing)
        r.extra["release_id"] = rel.id

    async def run(self) -> list[HostResult]:
        results = [HostResult(t.name) for t in self.targets]
        t0 = time.perf_counter()

        async def one_prepare(t, r):
            try:
                await self.prepare(t, r)
            except HostError as e:
                r.error = e.msg
        await asyncio.gather(*(one_prepare(t, r) for t, r in zip(self.targets, results)))
        try:
            failed = [r for r in results if r.error]
            if failed or self.opts.dry_run:
                for r in results:
                    r.seconds = round(time.perf_counter() - t0, 2)
                    if not r.error and failed:
                        r.phase, r.error = "not-run", "not deployed: another host failed preflight"
                    elif not r.error:
                        self.dry(self.targets[results.index(r)], r)
                return results
            progress = None
            if not self.opts.quiet and any(r.extra["_missing"] for r in results):
                from rich.console import Console
                from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                           TransferSpeedColumn)

                progress = Progress(TextColumn("upload {task.description}"), BarColumn(), DownloadColumn(),
                                    TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                                    transient=False)

            async def one_apply(t, r):
                ts = time.perf_counter()
                try:
                    await self.apply(t, r, progress)
                except HostError as e:
                    r.error = e.msg
                r.seconds = round(r.seconds + time.perf_counter() - ts, 2)

            for r in results:
                r.seconds = round(time.perf_counter() - t0, 2)
            if progress:
                with progress:
                    await asyncio.gather(*(one_apply(t, r) for t, r in zip(self.targets, results)))
            else:
                await asyncio.gather(*(one_apply(t, r) for t, r in zip(self.targets, results)))
            return results
        finally:
            for r in results:
                c = r.extra.pop("_conn", None)
                for k in ("_rel", "_missing", "_verdict"):
                    r.extra.pop(k, None)
                if c is not None:
                    c.close()
            self.tmp.cleanup()


def _tick(r: HostResult, key: str, t0: float):
    r.extra.setdefault("timings", {})[key] = round(time.perf_counter() - t0, 3)


def _unhealthy(h, back: str = "") -> str:
    """The serve unit's failed health check as one line: why, from where, what was done about it
    (`back`), its last log line."""
    h = h or {}
    why = (f"HTTP {h['code']} {_short(h.get('body'))}" if h.get("code") not in (None, 200)
           else h.get("error", "no answer"))
    logs = (h.get("logs") or "").strip().splitlines()
    return (f"{SERVE_UNIT} is not healthy ({why} from {h.get('url')}){back}"
            + (f"; systemctl restart: {h['restart_error'].splitlines()[-1][:200]}" if h.get("restart_error") else "")
            + (f"; serve log: {logs[-1][:200]}" if logs else ""))


def _short(body) -> str:
    if isinstance(body, dict):
        return f"status={body.get('status')}" + (f" ({body.get('reason') or body.get('error')})"
                                                 if body.get("reason") or body.get("error") else "")
    return str(body or "")[:120]


# ---------------------------------------------------------------- rollback / status

async def _simple(targets: list[Target], opts: Options, op: str, **kw) -> list[HostResult]:
    async def one(t):
        r = HostResult(t.name)
        ts = time.perf_counter()
        try:
            conn = await connect(t, opts.ssh_config, opts.known_hosts, opts.connect_timeout)
            try:
                r.phase = op
                res, _ = await _run(t, opts, conn, op, **kw)
            finally:
                conn.close()
            r.extra["result"] = res
            r.release, r.previous, r.health = res.get("release"), res.get("previous"), res.get("health")
            r.changed = op == "rollback" and not res.get("unchanged")
            if op == "rollback" and not (r.health or {}).get("ok"):
                h = r.health or {}
                r.error = (f"rolled back to {r.release}, but {_unhealthy(h)}" if res.get("role") == "serve" else
                           f"rolled back to {r.release}, but it is not healthy "
                           f"({'HTTP %s' % h['code'] if h.get('code') else h.get('error')})")
            else:
                r.ok, r.phase = True, "done"
        except HostError as e:
            r.error = e.msg
        r.seconds = round(time.perf_counter() - ts, 2)
        return r

    return list(await asyncio.gather(*(one(t) for t in targets)))


def rollback(targets, opts, to=None):
    return asyncio.run(_simple(targets, opts, "rollback", to=to))


def status(targets, opts):
    return asyncio.run(_simple(targets, opts, "status"))


def deploy(bundle, manifest, targets, opts, echo=print):
    from .release import check_role

    if not targets:
        raise UserError("no hosts: give --host HOST or --hosts FILE")
    check_role(bundle, manifest, opts.serve)   # a sensor bundle runs in the daemon, a model bundle in zeroedge serve
    return asyncio.run(Deployer(bundle, manifest, targets, opts, echo).run())
