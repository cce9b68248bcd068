"""The device-side half of `zeroedge deploy`: standard library only, shipped over SSH and run by the
device's python3 (appended to zeroedge/device/probe.py, whose names it uses). One call = one
operation; the result is one JSON line on stdout after MARKER; build logs go to stderr.

Layout on the device (all under the device root, default "/"):

    /opt/zeroedge/objects/<sha256>      content-addressed store (0700; files 0444, secrets 0400)
    /opt/zeroedge/.incoming/            uploads land here (0700), verified, then copied into objects/
    /opt/zeroedge/releases/<time>-<id>/ a release: hard links into objects/ + build/ outputs;
                                        daemon.toml (it can hold the MQTT password) is its own 0600 copy
    /opt/zeroedge/current -> releases/… swapped atomically (symlink to a temp name + rename)
    /etc/systemd/system/zeroedge.service and zeroedge.service.d/zeroedge-deploy.conf
                                        a release of a sensor bundle: the sensor daemon
    /etc/systemd/system/zeroedge-serve.service and zeroedge-serve.service.d/zeroedge-deploy.conf
                                        a release of a model bundle (deploy --serve): zeroedge serve
                                        on the current release's bundle, 127.0.0.1 only (written
                                        through directory fds)
    /etc/zeroedge/trusted-keys/<key id>.pub  pinned bundle signing keys: when any is present, a
                                        bundle not signed by one of them is refused

A release runs one service, and which one follows its bundle (trust.bundle_role): installing a
release's unit stops, disables and removes the other unit where a deploy installed it (its
drop-in is there), so a deploy or a rollback can switch a device between the two.

The agent trusts nothing in the payload: every path is checked again here (zeroedge.trust),
and the release tree is written through directory file descriptors, never following a link.
"""
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time

if "probe" not in globals():  # imported from the package; over SSH probe.py's and trust.py's source come first
    from zeroedge.device.probe import device_root, meminfo, probe, under  # noqa: F401
    from zeroedge.trust import (HEX64, key_id, path_problem, public_key_raw, public_pem, role_problem,
                                signature_problem)

MARKER = "@@ZEROEDGE-RESULT@@"
UNIT = "zeroedge.service"
SERVE_UNIT = "zeroedge-serve.service"
DROPIN = "zeroedge-deploy.conf"
SERVE_HOST = "127.0.0.1"         # the serve unit's listener: never another address
PLUGIN_LIB = "build/plugins/libzeroedge_plugins.so"
OPS = ("probe", "activate", "rollback", "status")
RELEASE_ID = re.compile(r"[0-9a-f]{12}")
RELEASE_NAME = re.compile(r"\d{8}T\d{12}Z-[0-9a-f]{12}")   # what stage() names a release
MODES = (0o644, 0o755, 0o600)   # 0o600: a secret (daemon.toml): its own copy, its object 0400
TRUSTED_KEYS = "/etc/zeroedge/trusted-keys"
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


class Fail(Exception):
    pass


def log(msg):
    sys.stderr.write(msg.rstrip() + "\n")
    sys.stderr.flush()


def login_uid():
    """The uid that logged in over SSH (sudo's caller when run through sudo)."""
    return int(os.environ.get("SUDO_UID") or os.getuid())


def check_payload(p):
    """Refuse a payload that could write outside the release or store, before anything is done:
    the workstation checked the same, but the device checks for itself."""
    for key in ("base", "incoming"):
        v = p.get(key)
        if v is not None and not (isinstance(v, str) and v.startswith("/") and ".." not in v.split("/")):
            raise Fail("bad %s %r: must be an absolute path without '..'" % (key, v))
    rid = p.get("release_id")
    if rid is not None and not (isinstance(rid, str) and RELEASE_ID.fullmatch(rid)):
        raise Fail("bad release id %r: must be 12 lowercase hex digits" % (rid,))
    for h in p.get("hashes") or []:
        if not (isinstance(h, str) and HEX64.fullmatch(h)):
            raise Fail("bad sha256 %r: must be 64 lowercase hex digits" % (h,))
    if "serve" in p and serve_problem(p["serve"]):
        raise Fail("bad serve spec: %s" % serve_problem(p["serve"]))
    if "serve" in p and "unit" in p:
        raise Fail("bad payload: a release runs the daemon's unit or the serve unit, not both")
    for rel, info in (p.get("files") or {}).items():
        why = path_problem(rel)
        if not why and not (rel in ("daemon.toml", "release.json") or rel.split("/")[0] in ("app", "bundle")
                            and "/" in rel):
            why = "not under app/ or bundle/"
        if why:
            raise Fail("refusing release file %r: %s" % (rel, why))
        if not (isinstance(info, dict) and isinstance(info.get("sha256"), str) and HEX64.fullmatch(info["sha256"])
                and info.get("mode", 0o644) in MODES):
            raise Fail("bad entry for %r: needs a lowercase hex sha256 and mode 644, 755 or 600" % rel)


def serve_problem(s):
    """Why a serve spec ({"unit": text, "port": N}) is unusable, or None."""
    if not isinstance(s, dict) or set(s) != {"unit", "port"}:
        return "needs exactly the unit text and the port"
    if not isinstance(s["unit"], str) or not s["unit"].strip():
        return "the unit text is empty"
    port = s["port"]
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        return "port %r is not 1 to 65535" % (port,)
    return None


def put_text(name, dir_fd, text, what):
    """`name` in dir_fd holds `text` afterwards; True if it was written. A temp file made with
    O_EXCL | O_NOFOLLOW, then renamed over `name`: never written through a link, and a link or
    anything but a regular file at `name` is refused, not replaced."""
    data = text.encode("utf-8")
    fd = open_regular(name, dir_fd, what)
    if fd is not None:
        with os.fdopen(fd, "rb") as f:
            if f.read() == data:
                return False
    tmp = ".%s.tmp-%d" % (name, os.getpid())
    try:
        os.unlink(tmp, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    with create(tmp, dir_fd, 0o644) as f:
        f.write(data)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return True


def pinned_keys(root):
    """{key id: raw key} of the keys this device pins (<root>/etc/zeroedge/trusted-keys/*.pub)."""
    d = under(root, TRUSTED_KEYS)
    out = {}
    for fn in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if fn.endswith(".pub"):
            try:
                with open(os.path.join(d, fn)) as f:
                    raw = public_key_raw(f.read())
            except (OSError, ValueError):
                raise Fail("pinned key %s/%s is not an Ed25519 public key (PEM)" % (TRUSTED_KEYS, fn))
            out[key_id(raw)] = raw
    return out


def open_regular(name, dir_fd, what):
    """fd of the regular file `name` (relative to dir_fd, or absolute), opened without following a
    link; None when it does not exist. A link or anything else is refused."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a link
        raise Fail("%s is not a regular file (%s); refused" % (what, e.strerror))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Fail("%s is not a regular file; refused" % what)
    return fd


def create(name, dir_fd, mode):
    """A new file `name` in dir_fd, opened for writing: O_EXCL and O_NOFOLLOW (never an existing
    file, never through a link), `mode` set with fchmod (umask aside)."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    os.fchmod(fd, mode)
    return os.fdopen(fd, "wb")


def copy_hashing(src_fd, name, dir_fd, mode):
    """Copy the open file src_fd to a new file `name` in dir_fd; returns the sha256 of what was written."""
    h = hashlib.sha256()
    with create(name, dir_fd, mode) as out:
        while True:
            chunk = os.read(src_fd, 1 << 20)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)
            out.write(chunk)


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
        self._lockfd = os.open(os.path.join(self.base, ".lock"), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self._lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise Fail("another zeroedge deploy is running on this device (%s/.lock)" % self.base)

    def release_names(self):
        """Releases: directories (not links) named as stage() names them, oldest first."""
        if not os.path.isdir(self.releases):
            return []
        return sorted(d for d in os.listdir(self.releases) if RELEASE_NAME.fullmatch(d)
                      and stat.S_ISDIR(os.lstat(os.path.join(self.releases, d)).st_mode))

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

    def objects_fd(self):
        """objects/, opened without following a link and kept 0700: the store is the agent's, and
        releases reach its files through their own hard links."""
        os.makedirs(self.objects, mode=0o700, exist_ok=True)
        fd = os.open(self.objects, DIR_FLAGS)
        os.fchmod(fd, 0o700)
        return fd

    def incoming_fd(self):
        """The uploads dir: not a link, owned by the login user (or root), closed to group and others."""
        try:
            fd = os.open(self.incoming, DIR_FLAGS)
        except OSError as e:
            why = "a link" if os.path.islink(self.incoming) else "unusable (%s)" % e.strerror
            raise Fail("upload dir %s is %s; refused" % (self.incoming, why))
        st = os.fstat(fd)
        if st.st_uid not in (0, login_uid()) or st.st_mode & 0o077:
            os.close(fd)
            raise Fail("upload dir %s is not private to the deploying user (uid %d, mode %o); refused"
                       % (self.incoming, st.st_uid, st.st_mode & 0o7777))
        return fd

    def stored_bytes(self, h):
        """Content of object h, from the store or this deploy's uploads (read, never moved)."""
        for d in (self.objects, self.incoming):
            fd = open_regular(os.path.join(d, h), None, "object %s…" % h[:12])
            if fd is not None:
                with os.fdopen(fd, "rb") as f:
                    data = f.read()
                if hashlib.sha256(data).hexdigest() == h:
                    return data
        raise Fail("object %s… is not on the device" % h[:12])

    def new_pins(self):
        out = {}
        for pem in self.p.get("pin_keys") or []:
            try:
                raw = public_key_raw(pem)
            except (ValueError, TypeError):
                raise Fail("--pin-key: not an Ed25519 public key")
            out[key_id(raw)] = raw
        return out

    def check_signature(self):
        """Read-only, before anything changes: when the device pins signing keys (or this deploy
        pins one), the release's manifest must be signed by one of them and its bundle files must
        be exactly the signed ones. Returns the signer's key id, or None (nothing pinned)."""
        pinned = pinned_keys(self.root)
        pinned.update(self.new_pins())
        if not pinned:
            return None
        files = self.p["files"]
        if "bundle/manifest.json" not in files:
            raise Fail("the release has no bundle/manifest.json")
        data = self.stored_bytes(files["bundle/manifest.json"]["sha256"])
        sig = files.get("bundle/manifest.sig")
        sig = self.stored_bytes(sig["sha256"]) if sig else None
        why = signature_problem(data, sig, pinned)
        if why:
            raise Fail("%s; this device pins bundle signing keys (%s): nothing was changed"
                       % (why, ", ".join(sorted(pinned))))
        try:
            signed = {k: v["sha256"] for k, v in json.loads(data.decode("utf-8"))["files"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise Fail("the signed manifest has no valid files{}")
        have = {rel[len("bundle/"):]: i["sha256"] for rel, i in files.items() if rel.startswith("bundle/")
                and rel not in ("bundle/manifest.json", "bundle/manifest.sig")}
        if have != signed:
            raise Fail("the release's bundle files are not the ones its signed manifest lists: nothing was changed")
        return json.loads(sig.decode("utf-8"))["key_id"]

    def install_pins(self):
        """--pin-key: trusted-keys/<key id>.pub, 0644, in a 0755 directory (root's, as the agent)."""
        pins = self.new_pins()
        if not pins:
            return []
        d = under(self.root, TRUSTED_KEYS)
        os.makedirs(d, mode=0o755, exist_ok=True)
        dfd = os.open(d, DIR_FLAGS)
        try:
            os.fchmod(dfd, 0o755)
            for kid, raw in sorted(pins.items()):
                tmp = ".%s.pub.tmp-%d" % (kid, os.getpid())
                with create(tmp, dfd, 0o644) as f:
                    f.write(public_pem(raw).encode())
                os.rename(tmp, kid + ".pub", src_dir_fd=dfd, dst_dir_fd=dfd)
        finally:
            os.close(dfd)
        return sorted(pins)

    # ----- operations
    def commit(self):
        """Move this deploy's uploads into objects/: each upload is opened without following a link,
        must be a regular file, and is copied while hashing into a temp file in objects/ (what is
        verified is what is stored, across filesystems), then renamed into place."""
        secret = {i["sha256"] for i in self.p.get("files", {}).values() if i.get("mode") == 0o600}
        obj = self.objects_fd()
        inc = self.incoming_fd()
        moved = 0
        try:
            for h in self.p["hashes"]:
                fd = open_regular(h, obj, "object %s…" % h[:12])
                if fd is not None:  # already in the store
                    os.close(fd)
                    continue
                src = open_regular(h, inc, "upload of %s…" % h[:12])
                if src is None:
                    raise Fail("upload of %s… is missing on the device" % h[:12])
                tmp = ".tmp-%s-%d" % (h[:12], os.getpid())
                try:
                    got = copy_hashing(src, tmp, obj, 0o400 if h in secret else 0o444)
                finally:
                    os.close(src)
                os.unlink(h, dir_fd=inc)
                if got != h:
                    os.unlink(tmp, dir_fd=obj)
                    raise Fail("upload of %s… arrived corrupted (sha256 %s…)" % (h[:12], got[:12]))
                os.rename(tmp, h, src_dir_fd=obj, dst_dir_fd=obj)
                moved += 1
        finally:
            os.close(obj)
            os.close(inc)
        return {"committed": moved}

    def stage(self):
        """Make releases/<time>-<id> from the store (reusing an existing dir with the same id). The
        tree is built through directory fds (mkdir/link/open relative to an fd opened O_NOFOLLOW),
        so no link, planted or listed, is ever followed while writing."""
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
        tmp = ".tmp-" + name
        shutil.rmtree(os.path.join(self.releases, tmp), ignore_errors=True)
        rel_fd, obj = os.open(self.releases, DIR_FLAGS), self.objects_fd()
        dirs = {}

        def dir_fd(path):  # fd of a directory inside the release, made as needed
            if path not in dirs:
                up, _, leaf = path.rpartition("/")
                parent = dir_fd(up)
                try:
                    os.mkdir(leaf, 0o755, dir_fd=parent)
                except FileExistsError:
                    pass
                dirs[path] = os.open(leaf, DIR_FLAGS, dir_fd=parent)
            return dirs[path]

        try:
            os.mkdir(tmp, 0o755, dir_fd=rel_fd)
            dirs[""] = os.open(tmp, DIR_FLAGS, dir_fd=rel_fd)
            for rel, info in sorted(self.p["files"].items()):
                up, _, leaf = rel.rpartition("/")
                h, mode = info["sha256"], info.get("mode", 0o644)
                src = open_regular(h, obj, "object %s… for %s" % (h[:12], rel))
                if src is None:
                    raise Fail("object %s… for %s is not on the device" % (h[:12], rel))
                try:
                    if mode == 0o600:    # a secret: its store copy private too (older deploys made it 0444)
                        os.fchmod(src, 0o400)
                    if mode != 0o644:    # executables and secrets get their own copy (mode is per inode)
                        copy_hashing(src, leaf, dir_fd(up), mode)
                    else:
                        try:
                            os.link(h, leaf, src_dir_fd=obj, dst_dir_fd=dir_fd(up), follow_symlinks=False)
                        except OSError:  # no hard links on this filesystem
                            copy_hashing(src, leaf, dir_fd(up), 0o444)
                finally:
                    os.close(src)
            with create(".files.json", dirs[""], 0o644) as f:
                f.write(json.dumps(self.p["files"]).encode())
        except BaseException:
            shutil.rmtree(os.path.join(self.releases, tmp), ignore_errors=True)
            raise
        finally:
            for fd in list(dirs.values()) + [rel_fd, obj]:
                os.close(fd)
        os.rename(os.path.join(self.releases, tmp), os.path.join(self.releases, name))
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
        """The python a release was deployed with and its service: the daemon's unit text
        ({"unit", "python"}) or, deployed with --serve, the serve spec ({"serve", "python"}); kept
        in the release, so a rollback reinstalls the unit that went with it."""
        path = os.path.join(self.releases, name, ".service.json")
        if "python" in self.p and ("unit" in self.p or "serve" in self.p):
            spec = {k: self.p[k] for k in ("unit", "python", "serve") if k in self.p}
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

    # ----- the serve unit (deploy --serve)
    def serve_of(self, name, strict=True):
        """The serve spec ({"unit", "port"}) of a release that runs zeroedge serve (deployed with
        --serve), or None: a release that runs the daemon. A spec that holds the daemon's unit too
        (from before a release ran one service) runs the daemon: its bundle is a sensor bundle.
        strict=False: None too when the release has no spec."""
        if not name:
            return None
        try:
            spec = self.service_spec(name)
        except Fail:
            if strict:
                raise
            return None
        return spec.get("serve") if "unit" not in spec else None

    def check_role(self):
        """Read-only, before anything changes: the release's bundle must be one its service runs
        (trust.bundle_role, from the bundle's manifest): a sensor bundle for the daemon, a model
        bundle for zeroedge serve (the payload's serve spec). A payload without the manifest is
        no release deploy sends; the other checks refuse it, or the service, which verifies its
        bundle before it loads anything."""
        files = self.p.get("files") or {}
        if "bundle/manifest.json" not in files:
            return
        try:
            manifest = json.loads(self.stored_bytes(files["bundle/manifest.json"]["sha256"]).decode("utf-8"))
        except ValueError:
            raise Fail("the release's bundle/manifest.json is not JSON: nothing was changed")
        why = role_problem(manifest, "serve" in self.p)
        if why:
            raise Fail("the release's bundle %s: nothing was changed" % why)

    def serve_command(self, name, port, py):
        """zeroedge serve on the current release's bundle, bound to 127.0.0.1: on its TensorRT
        engines when the release's on-device build made them (and with its plugin library when
        that was built too), else on onnxruntime."""
        cur = self.current
        try:
            with open(os.path.join(self.releases, name, "build.json")) as f:
                build = json.load(f)
        except (OSError, ValueError):
            build = {}
        done = {s.get("name") for s in build.get("steps", []) if isinstance(s, dict) and "seconds" in s}
        argv = [py, "-m", "zeroedge.cli", "serve"]
        if build.get("backend") == "tensorrt" and "engine" in done:
            argv += ["--backend", "tensorrt", "--bundle", cur + "/bundle", "--engines", cur + "/build"]
            if "plugins" in done:
                argv += ["--plugins", cur + "/" + PLUGIN_LIB]
        else:
            argv += ["--backend", "onnxruntime", "--bundle", cur + "/bundle"]
        return " ".join(argv + ["--host", SERVE_HOST, "--port", str(int(port))])

    def unit_dir_fd(self):
        os.makedirs(self.unit_dir, exist_ok=True)
        try:
            return os.open(self.unit_dir, DIR_FLAGS)
        except OSError as e:
            raise Fail("%s is unusable (%s); refused" % (self.unit_dir, e.strerror))

    def install_serve(self, name):
        """zeroedge-serve.service and its drop-in for release `name` (reload and enable when
        something changed); a release without the server stops and removes one a deploy installed.
        Returns whether anything changed."""
        spec = self.serve_of(name)
        if not spec:
            return self.remove_unit(SERVE_UNIT)
        py = self.service_spec(name)["python"]
        dropin = "\n".join([
            "# written by zeroedge deploy: serves the bundle of the current release on %s" % SERVE_HOST,
            "[Service]",
            "WorkingDirectory=%s" % self.current,
            "Environment=PYTHONPATH=%s/app" % self.current,
            "Environment=ZEROEDGE_DEVICE_ROOT=%s" % self.root,
            "ExecStart=",
            "ExecStart=%s" % self.serve_command(name, spec["port"], py),
            ""])
        ufd = self.unit_dir_fd()
        dfd = None
        try:
            changed = put_text(SERVE_UNIT, ufd, spec["unit"], os.path.join(self.unit_dir, SERVE_UNIT))
            try:
                os.mkdir(SERVE_UNIT + ".d", 0o755, dir_fd=ufd)
            except FileExistsError:
                pass
            try:
                dfd = os.open(SERVE_UNIT + ".d", DIR_FLAGS, dir_fd=ufd)
            except OSError as e:
                raise Fail("%s/%s.d is not a directory (%s); refused" % (self.unit_dir, SERVE_UNIT, e.strerror))
            changed = put_text(DROPIN, dfd, dropin, os.path.join(self.unit_dir, SERVE_UNIT + ".d", DROPIN)) \
                or changed
        finally:
            for fd in (dfd, ufd):
                if fd is not None:
                    os.close(fd)
        if changed:
            self.systemctl("daemon-reload")
            self.systemctl("enable", SERVE_UNIT)
        return changed

    def remove_serve(self):
        return self.remove_unit(SERVE_UNIT)

    def remove_unit(self, unit):
        """Stop, disable and remove `unit` (the daemon's or the server's), only when a deploy
        installed it (its drop-in is there); nothing at all, not even a systemctl call, otherwise.
        Through directory fds: a link where the drop-in folder is, is refused, never followed. The
        daemon's /etc/zeroedge/daemon.toml link goes with it when it is the one install_unit made."""
        if not os.path.lexists(os.path.join(self.unit_dir, unit + ".d", DROPIN)):
            return False
        self.systemctl("stop", unit, check=False)
        self.systemctl("disable", unit, check=False)
        ufd = self.unit_dir_fd()
        try:
            try:
                dfd = os.open(unit + ".d", DIR_FLAGS, dir_fd=ufd)
            except OSError as e:
                raise Fail("%s/%s.d is not a directory (%s); refused" % (self.unit_dir, unit, e.strerror))
            try:
                os.unlink(DROPIN, dir_fd=dfd)
            finally:
                os.close(dfd)
            try:
                os.rmdir(unit + ".d", dir_fd=ufd)
            except OSError:  # something else of the admin's is in there: theirs
                pass
            try:
                os.unlink(unit, dir_fd=ufd)
            except FileNotFoundError:
                pass
        finally:
            os.close(ufd)
        if unit == UNIT:
            self.remove_config_link()
        self.systemctl("daemon-reload")
        return True

    def remove_config_link(self):
        """/etc/zeroedge/daemon.toml, when it is the link install_unit made (to the current
        release's daemon.toml): a regular file there is the admin's and stays. Read and removed
        relative to /etc/zeroedge opened without following a link."""
        try:
            efd = os.open(under(self.root, "/etc/zeroedge"), DIR_FLAGS)
        except OSError:
            return
        try:
            if os.readlink("daemon.toml", dir_fd=efd) == os.path.join(self.current, "daemon.toml"):
                os.unlink("daemon.toml", dir_fd=efd)      # the link itself: unlink never follows one
        except OSError:  # absent, or not a link
            pass
        finally:
            os.close(efd)

    def install_services(self, name):
        """The unit of release `name`'s service installed (the daemon's, or the server's for a
        release deployed with --serve) and the other one, where a deploy installed it, stopped and
        removed: a release runs one service. Returns (whether its unit changed, the unit removed
        or None)."""
        if self.serve_of(name):
            removed = UNIT if self.remove_unit(UNIT) else None
            return self.install_serve(name), removed
        removed = SERVE_UNIT if self.remove_unit(SERVE_UNIT) else None
        return self.install_unit(name), removed

    def check(self, name, restart=True, timeout=None):
        """Release `name`'s service restarted (unless restart=False) and its health checked: the
        daemon's /healthz, or the server's /health for a release deployed with --serve (a release
        without a spec runs the daemon here: installing its units is what refuses it)."""
        if self.serve_of(name, strict=False):
            return self.serve_health(name, restart, timeout)
        if restart:
            return self.restart_and_check(name)
        return self.health(self.port_of(name), self.p.get("health_timeout", 60) if timeout is None else timeout)

    def serve_active(self):
        return self.systemctl("is-active", SERVE_UNIT, check=False).stdout.strip() == "active"

    def serve_health(self, name, restart=True, timeout=None):
        """Restart the serve unit (unless restart=False) and poll its /health as the daemon's. The
        restart does not wait for the job (--no-block): a Type=notify unit's restart would block
        until READY=1, i.e. until the model is loaded, and fail outright when the server exits, so
        the health check, not systemctl, decides whether the release stays (or is rolled back)."""
        spec = self.serve_of(name)
        failed = None
        if restart:
            r = self.systemctl("restart", "--no-block", SERVE_UNIT, check=False)
            if r.returncode != 0:
                failed = (r.stderr or r.stdout).strip()[-300:] or "exit %d" % r.returncode
        h = self.health(spec["port"], self.p.get("health_timeout", 60) if timeout is None else timeout,
                        path="/health")
        if failed:
            h["restart_error"] = failed
        if not h["ok"] and timeout != 0:
            h["logs"] = self.logs(SERVE_UNIT)
        return h

    def service_active(self):
        r = self.systemctl("is-active", UNIT, check=False)
        return r.stdout.strip() == "active"

    def health(self, port, timeout, stable=None, path="/healthz"):
        """Poll `path` (the daemon's /healthz, the server's /health) until it has answered 200 for
        `stable` seconds in a row (a service that answers once and then degrades or dies is not
        healthy), or `timeout` passes."""
        import urllib.error
        import urllib.request

        stable = self.p.get("health_stable", 1.5) if stable is None else stable
        url = "http://127.0.0.1:%d%s" % (port, path)
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

    def logs(self, unit=UNIT):
        try:
            r = subprocess.run(["journalctl", "-u", unit, "-n", "15", "--no-pager"], stdout=subprocess.PIPE,
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
        """stage -> build -> install the release's unit (and remove the other one a deploy
        installed) -> swap current -> restart -> health (the daemon's /healthz, or the server's
        /health for a release deployed with --serve); on an unhealthy new release, put the previous
        one back, with its own service."""
        signer = self.check_signature()  # read-only: a refusal changes nothing
        self.check_role()                # read-only too
        self.lock()
        if self.p.get("hashes"):  # uploads of this deploy: verify and move into the store
            self.commit()
        pinned = self.install_pins()
        before = self.current_name()
        st = self.stage()
        name = st["release"]
        res = {"release": name, "previous": before, "reused": st["reused"], "steps": [], "signed_by": signer,
               "pinned": pinned}
        if name == before:
            res["unchanged"] = True
            res["build"] = self.build(name)
            changed, removed = self.install_services(name)
            restart = changed or not (self.serve_active() if self.serve_of(name) else self.service_active())
            if restart:
                res["restarted"] = True
            res["health"] = self.check(name, restart=restart)
            res.update(self.role_result(name, removed))
            res["gc"] = self.gc()
            return res
        t = time.time()
        res["build"] = self.build(name)
        res["build_s"] = round(time.time() - t, 3)
        _, removed = self.install_services(name)    # the other service stops before the swap
        self.swap_current(name)
        t = time.time()
        res["health"] = self.check(name)
        res["restart_to_healthy_s"] = round(time.time() - t, 3)
        res.update(self.role_result(name, removed))
        if not res["health"]["ok"] and before and self.p.get("auto_rollback", True):
            self.p.pop("unit", None)
            self.p.pop("serve", None)
            self.install_services(before)
            self.swap_current(before)
            res["rolled_back_to"] = before
            res["rollback_health"] = self.check(before)
        res["gc"] = self.gc()
        return res

    def role_result(self, name, removed):
        """What a result says of release `name`'s service: its role and unit, the serve port, and
        the unit stopped and removed on the way (None when none was)."""
        serve = self.serve_of(name, strict=False)
        out = {"role": "serve" if serve else "daemon", "unit": SERVE_UNIT if serve else UNIT}
        if serve:
            out["serve_port"] = serve["port"]
        if removed:
            out["removed"] = removed
        return out

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
            out = {"release": cur, "previous": cur, "unchanged": True, "health": self.check(cur, restart=False)}
            out.update(self.role_result(cur, None))
            return out
        _, removed = self.install_services(target)
        self.swap_current(target)
        out = {"release": target, "previous": cur, "health": self.check(target)}
        out.update(self.role_result(target, removed))
        return out

    def status(self):
        """The current release, its service (the daemon, or zeroedge serve for a release deployed
        with --serve): state, main process' RSS, health; the releases kept; the device's memory."""
        cur = self.current_name()
        info = self.release_info(cur)
        out = {"release": cur, "info": info, "releases": self.release_names(), "memory": meminfo(self.root)}
        if cur is None:
            out["service"] = "not deployed"
            return out
        out.update(self.role_result(cur, None))
        unit = out["unit"]
        out["service"] = self.systemctl("is-active", unit, check=False).stdout.strip() or "unknown"
        pid = self.systemctl("show", "-p", "MainPID", "--value", unit, check=False).stdout.strip()
        if pid.isdigit() and int(pid) > 0:
            out["pid"] = int(pid)
            try:
                with open("/proc/%s/status" % pid) as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            out["rss"] = int(line.split()[1]) * 1024
            except OSError:
                pass
        out["health"] = self.check(cur, restart=False, timeout=0)
        return out


def _json(text):
    try:
        return json.loads(text)
    except ValueError:
        return text[:500]


def main(payload):
    op = payload.get("op")
    try:
        if op not in OPS:
            raise Fail("unknown operation %r" % (op,))
        check_payload(payload)
        if op == "probe":
            result = probe(base=payload.get("base", "/opt/zeroedge"), want_modules=payload.get("modules", ()))
            store = os.path.join(result["base"], "objects")  # what the content store already holds
            result["store"] = sorted(h for h in os.listdir(store) if HEX64.fullmatch(h)) if os.path.isdir(store) else []
            result["trusted_keys"] = sorted(pinned_keys(result["root"]))
            result["login_uid"] = login_uid()
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
