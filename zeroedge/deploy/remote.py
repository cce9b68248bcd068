"""The device-side half of `zeroedge deploy`: standard library only, shipped over SSH and run by the
device's python3 (appended to zeroedge/device/probe.py, whose names it uses). One call = one
operation; the result is one JSON line on stdout after MARKER; build logs go to stderr.

Layout on the device (all under the device root, default "/"):

    /opt/zeroedge/objects/<sha256>      content-addressed store (read-only files)
    /opt/zeroedge/.incoming/            uploads land here, verified, then moved into objects/
    /opt/zeroedge/releases/<time>-<id>/ a release: hard links into objects/ + build/ outputs
    /opt/zeroedge/current -> releases/… swapped atomically (symlink to a temp name + rename)
    /etc/systemd/system/zeroedge.service and zeroedge.service.d/zeroedge-deploy.conf
"""
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

if "probe" not in globals():  # imported from the package; over SSH probe.py's source comes first
    from zeroedge.device.probe import device_root, meminfo, probe, under  # noqa: F401

MARKER = "@@ZEROEDGE-RESULT@@"
UNIT = "zeroedge.service"
DROPIN = "zeroedge-deploy.conf"


class Fail(Exception):
    pass


def log(msg):
    sys.stderr.write(msg.rstrip() + "\n")
    sys.stderr.flush()


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Device:
    def __init__(self, p):
        self.root = device_root()
        self.base = under(self.root, p.get("base", "/opt/zeroedge"))
        self.objects = os.path.join(self.base, "objects")
        self.incoming = p.get("incoming") or os.path.join(self.base, ".incoming")
        self.releases = os.path.join(self.base, "releases")
        self.current = os.path.join(self.base, "current")
        self.unit_dir = under(self.root, "/etc/systemd/system")
        self.p = p

    # ----- helpers
    def lock(self):
        os.makedirs(self.base, exist_ok=True)
        self._lockf = open(os.path.join(self.base, ".lock"), "w")
        try:
            fcntl.flock(self._lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise Fail("another zeroedge deploy is running on this device (%s/.lock)" % self.base)

    def release_names(self):
        if not os.path.isdir(self.releases):
            return []
        return sorted(d for d in os.listdir(self.releases)
                      if not d.startswith(".") and os.path.isdir(os.path.join(self.releases, d)))

    def current_name(self):
        try:
            return os.path.basename(os.readlink(self.current))
        except OSError:
            return None

    def release_info(self, name):
        if not name:
            return None
        try:
            with open(os.path.join(self.releases, name, "release.json")) as f:
                info = json.load(f)
        except (OSError, ValueError):
            info = {}
        info["name"] = name
        return info

    def systemctl(self, *args, check=True):
        try:
            r = subprocess.run(["systemctl"] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               universal_newlines=True, timeout=120)
        except FileNotFoundError:
            raise Fail("systemctl not found on the device (zeroedge runs its daemon as a systemd service)")
        if check and r.returncode != 0:
            raise Fail("systemctl %s failed: %s" % (" ".join(args), (r.stderr or r.stdout).strip()[-300:]))
        return r

    def swap_current(self, name):
        tmp = self.current + ".tmp-%d" % os.getpid()
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(os.path.join("releases", name), tmp)
        os.replace(tmp, self.current)  # rename(2) over the old link: atomic

    # ----- operations
    def commit(self):
        """Verify uploaded files in .incoming/ and move them into objects/."""
        os.makedirs(self.objects, exist_ok=True)
        moved = 0
        for h in self.p["hashes"]:
            src = os.path.join(self.incoming, h)
            dst = os.path.join(self.objects, h)
            if os.path.isfile(dst):
                continue
            if not os.path.isfile(src):
                raise Fail("upload of %s… is missing on the device" % h[:12])
            got = sha256_file(src)
            if got != h:
                os.unlink(src)
                raise Fail("upload of %s… arrived corrupted (sha256 %s…)" % (h[:12], got[:12]))
            os.chmod(src, 0o444)
            os.replace(src, dst)
            moved += 1
        return {"committed": moved}

    def stage(self):
        """Make releases/<time>-<id> from the store (reusing an existing dir with the same id)."""
        rid = self.p["release_id"]
        os.makedirs(self.releases, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "%06dZ" % (time.time() % 1 * 1e6)
        name = stamp + "-" + rid
        for d in self.release_names():
            if d.endswith("-" + rid):
                if d != self.current_name():  # re-activated by a deploy: it becomes the newest
                    os.rename(os.path.join(self.releases, d), os.path.join(self.releases, name))
                    return {"release": name, "reused": True}
                return {"release": d, "reused": True}
        tmp = os.path.join(self.releases, ".tmp-" + name)
        shutil.rmtree(tmp, ignore_errors=True)
        for rel, info in sorted(self.p["files"].items()):
            dst = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            src = os.path.join(self.objects, info["sha256"])
            if not os.path.isfile(src):
                raise Fail("object %s… for %s is not on the device" % (info["sha256"][:12], rel))
            if info.get("mode", 0o644) & 0o111:  # executables get their own copy (mode is per inode)
                shutil.copyfile(src, dst)
                os.chmod(dst, 0o755)
            else:
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copyfile(src, dst)
                    os.chmod(dst, 0o444)
        with open(os.path.join(tmp, ".files.json"), "w") as f:
            json.dump(self.p["files"], f)
        os.rename(tmp, os.path.join(self.releases, name))
        return {"release": name, "reused": False}

    def build(self, name):
        """On-device build: plugins (scripts/build_plugins) and the TensorRT engine where TensorRT
        exists; records what was done in build.json (done once per release)."""
        rdir = os.path.join(self.releases, name)
        done = os.path.join(rdir, "build.json")
        if os.path.isfile(done):
            with open(done) as f:
                return json.load(f)
        plan = self.p["build"]
        out = {"backend": plan["backend"], "steps": []}
        env = dict(os.environ, PYTHONPATH=os.path.join(rdir, "app"), ZEROEDGE_BUILD_DIR=os.path.join(rdir, "build"),
                   ZEROEDGE_BUNDLE_DIR=os.path.join(rdir, "bundle"))
        os.makedirs(os.path.join(rdir, "build"), exist_ok=True)
        for step in plan["steps"]:
            if not step.get("argv"):
                out["steps"].append({"name": step["name"], "skipped": step.get("why")})
                continue
            argv = [a.replace("{release}", rdir) for a in step["argv"]]
            log("[%s] %s" % (step["name"], " ".join(argv)))
            t = time.time()
            r = subprocess.run(argv, cwd=os.path.join(rdir, "app"), env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, universal_newlines=True)
            sys.stderr.write(r.stdout[-4000:])
            if r.returncode != 0:
                raise Fail("on-device %s failed (exit %d): %s" % (step["name"], r.returncode,
                                                                   (r.stdout.strip().splitlines() or [""])[-1][:300]))
            out["steps"].append({"name": step["name"], "seconds": round(time.time() - t, 2)})
        with open(done + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(done + ".tmp", done)
        return out

    def service_spec(self, name):
        """The unit text and python a release was deployed with (kept in the release, so a rollback
        reinstalls the unit that went with it)."""
        path = os.path.join(self.releases, name, ".service.json")
        if "unit" in self.p and "python" in self.p:
            spec = {"unit": self.p["unit"], "python": self.p["python"]}
            if not os.path.isfile(path):
                with open(path + ".tmp", "w") as f:
                    json.dump(spec, f)
                os.replace(path + ".tmp", path)
            return spec
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            raise Fail("release %s has no service spec (.service.json); redeploy it" % name)

    def install_unit(self, name):
        """Install the unit file and a drop-in that points it at the current release; reload and
        enable only when something changed."""
        spec = self.service_spec(name)
        os.makedirs(os.path.join(self.unit_dir, UNIT + ".d"), exist_ok=True)
        cur = self.current
        dropin = "\n".join([
            "# written by zeroedge deploy: runs the daemon of the current release",
            "[Service]",
            "WorkingDirectory=%s" % cur,
            "Environment=PYTHONPATH=%s/app" % cur,
            "Environment=ZEROEDGE_DEVICE_ROOT=%s" % self.root,
            "ExecStart=",
            "ExecStart=%s -m zeroedge.cli daemon --config %s/daemon.toml" % (spec["python"], cur),
            ""])
        changed = False
        for path, text in ((os.path.join(self.unit_dir, UNIT), spec["unit"]),
                           (os.path.join(self.unit_dir, UNIT + ".d", DROPIN), dropin)):
            try:
                with open(path) as f:
                    same = f.read() == text
            except OSError:
                same = False
            if not same:
                with open(path + ".tmp", "w") as f:
                    f.write(text)
                os.replace(path + ".tmp", path)
                changed = True
        # /etc/zeroedge/daemon.toml -> the current release's config, so the unit's own ExecStart and
        # `zeroedge daemon --config /etc/zeroedge/daemon.toml` by hand run the deployed config too;
        # a regular file there is the user's and is left alone
        etc = under(self.root, "/etc/zeroedge/daemon.toml")
        if not os.path.exists(etc) or os.path.islink(etc):
            os.makedirs(os.path.dirname(etc), exist_ok=True)
            want = os.path.join(cur, "daemon.toml")
            if not os.path.islink(etc) or os.readlink(etc) != want:
                tmp = etc + ".tmp-%d" % os.getpid()
                os.symlink(want, tmp)
                os.replace(tmp, etc)
        if changed:
            self.systemctl("daemon-reload")
            self.systemctl("enable", UNIT)
        return changed

    def service_active(self):
        r = self.systemctl("is-active", UNIT, check=False)
        return r.stdout.strip() == "active"

    def health(self, port, timeout, stable=None):
        """Poll /healthz until it has answered 200 for `stable` seconds in a row (a daemon that
        answers once and then degrades or dies is not healthy), or `timeout` passes."""
        import urllib.error
        import urllib.request

        stable = self.p.get("health_stable", 1.5) if stable is None else stable
        url = "http://127.0.0.1:%d/healthz" % port
        deadline = time.time() + timeout
        ok_since = None
        while True:
            try:
                with urllib.request.urlopen(url, timeout=3) as r:
                    body = r.read().decode("utf-8", "replace")
                    last = {"ok": r.status == 200, "code": r.status, "body": _json(body)}
            except urllib.error.HTTPError as e:
                last = {"ok": False, "code": e.code, "body": _json(e.read().decode("utf-8", "replace"))}
            except Exception as e:  # connection refused while the daemon starts
                last = {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}
            now = time.time()
            ok_since = (ok_since or now) if last["ok"] else None
            if timeout <= 0 or (ok_since is not None and now - ok_since >= stable) or now >= deadline:
                last["url"] = url
                if timeout > 0 and (ok_since is None or now - ok_since < stable):
                    last["ok"] = False
                    if last.get("code") == 200:
                        last["error"] = "answered 200 but not for %.1f s in a row" % stable
                return last
            time.sleep(0.25)

    def logs(self):
        try:
            r = subprocess.run(["journalctl", "-u", UNIT, "-n", "15", "--no-pager"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, universal_newlines=True, timeout=20)
            return r.stdout[-2000:]
        except (OSError, subprocess.SubprocessError):
            return ""

    def port_of(self, name):
        info = self.release_info(name) or {}
        return int(info.get("metrics_port") or self.p.get("metrics_port") or 9108)

    def restart_and_check(self, name):
        self.systemctl("restart", UNIT)
        h = self.health(self.port_of(name), self.p.get("health_timeout", 60))
        if not h["ok"]:
            h["logs"] = self.logs()
        return h

    def activate(self):
        """stage -> build -> install unit -> swap current -> restart -> health; on an unhealthy
        new release, put the previous one back."""
        self.lock()
        if self.p.get("hashes"):  # uploads of this deploy: verify and move into the store
            self.commit()
        before = self.current_name()
        st = self.stage()
        name = st["release"]
        res = {"release": name, "previous": before, "reused": st["reused"], "steps": []}
        if name == before:
            res["unchanged"] = True
            res["build"] = self.build(name)
            changed = self.install_unit(name)
            if changed or not self.service_active():
                res["restarted"] = True
                res["health"] = self.restart_and_check(name)
            else:
                res["health"] = self.health(self.port_of(name), self.p.get("health_timeout", 60))
            res["gc"] = self.gc()
            return res
        t = time.time()
        res["build"] = self.build(name)
        res["build_s"] = round(time.time() - t, 3)
        self.install_unit(name)
        self.swap_current(name)
        t = time.time()
        res["health"] = self.restart_and_check(name)
        res["restart_to_healthy_s"] = round(time.time() - t, 3)
        if not res["health"]["ok"] and before and self.p.get("auto_rollback", True):
            self.p.pop("unit", None)
            self.install_unit(before)
            self.swap_current(before)
            res["rolled_back_to"] = before
            res["rollback_health"] = self.restart_and_check(before)
        res["gc"] = self.gc()
        return res

    def gc(self):
        keep_n = max(1, int(self.p.get("keep", 3)))
        names = self.release_names()
        cur = self.current_name()
        others = [n for n in names if n != cur]     # keep: current + the newest keep-1 others
        n_others = keep_n - 1 if cur else keep_n
        keep = set(others[max(0, len(others) - n_others):]) if n_others > 0 else set()
        keep |= {cur} if cur else set()
        removed = []
        for n in names:
            if n not in keep:
                shutil.rmtree(os.path.join(self.releases, n), ignore_errors=True)
                removed.append(n)
        for d in os.listdir(self.releases) if os.path.isdir(self.releases) else []:
            if d.startswith(".tmp-"):
                shutil.rmtree(os.path.join(self.releases, d), ignore_errors=True)
        used = set()
        for n in keep:
            try:
                with open(os.path.join(self.releases, n, ".files.json")) as f:
                    used |= {v["sha256"] for v in json.load(f).values()}
            except (OSError, ValueError):
                return {"removed_releases": removed, "removed_objects": 0}  # unsure: keep objects
        gone = 0
        if os.path.isdir(self.objects):
            for h in os.listdir(self.objects):
                if h not in used:
                    os.unlink(os.path.join(self.objects, h))
                    gone += 1
        shutil.rmtree(self.incoming, ignore_errors=True)
        return {"removed_releases": removed, "removed_objects": gone}

    def rollback(self):
        self.lock()
        names = self.release_names()
        cur = self.current_name()
        to = self.p.get("to")
        if to:
            match = [n for n in names if n == to or n.endswith("-" + to) or n.startswith(to)]
            if len(match) != 1:
                raise Fail("release %r: %s (have: %s)" % (to, "ambiguous" if match else "not found",
                                                           ", ".join(names) or "none"))
            target = match[0]
        else:
            if cur not in names:
                raise Fail("no current release to roll back from (nothing deployed under %s)" % self.base)
            i = names.index(cur)
            if i == 0:
                raise Fail("no release older than %s to roll back to" % cur)
            target = names[i - 1]
        if target == cur:
            return {"release": cur, "previous": cur, "unchanged": True,
                    "health": self.health(self.port_of(cur), self.p.get("health_timeout", 60))}
        self.install_unit(target)
        self.swap_current(target)
        return {"release": target, "previous": cur, "health": self.restart_and_check(target)}

    def status(self):
        cur = self.current_name()
        info = self.release_info(cur)
        out = {"release": cur, "info": info, "releases": self.release_names(), "memory": meminfo(self.root)}
        if cur is None:
            out["service"] = "not deployed"
            return out
        out["service"] = self.systemctl("is-active", UNIT, check=False).stdout.strip() or "unknown"
        pid = self.systemctl("show", "-p", "MainPID", "--value", UNIT, check=False).stdout.strip()
        if pid.isdigit() and int(pid) > 0:
            out["pid"] = int(pid)
            try:
                with open("/proc/%s/status" % pid) as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            out["rss"] = int(line.split()[1]) * 1024
            except OSError:
                pass
        out["health"] = self.health(self.port_of(cur), 0)
        return out


def _json(text):
    try:
        return json.loads(text)
    except ValueError:
        return text[:500]


def main(payload):
    op = payload["op"]
    try:
        if op == "probe":
            result = probe(base=payload.get("base", "/opt/zeroedge"), want_modules=payload.get("modules", ()))
            store = os.path.join(result["base"], "objects")  # what the content store already holds
            result["store"] = sorted(os.listdir(store)) if os.path.isdir(store) else []
        else:
            result = getattr(Device(payload), op)()
        out = {"ok": True, "result": result}
    except Fail as e:
        out = {"ok": False, "error": str(e)}
    except Exception as e:  # report, never a bare traceback over SSH
        import traceback

        traceback.print_exc()
        out = {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}
    sys.stdout.write("\n" + MARKER + json.dumps(out) + "\n")
    sys.stdout.flush()
