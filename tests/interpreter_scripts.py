"""The Triton kernels' checks in Triton's CPU interpreter: scripts run in a child process with
TRITON_INTERPRET=1 (Triton reads it at import). They take minutes of one core each, so once
collection is done the session starts the selected ones in the background, one after another
(conftest.pytest_collection_finish), and each test then waits for its own; a test whose script was
not started (run on its own, say) runs it itself. A script passes when it exits 0 and prints OK."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import Future

TIMEOUT = 900
SCRIPTS = {}        # name -> script text, registered by the test modules when they are imported
_started = {}       # name -> Future of (returncode, stdout, stderr)
_running = []       # the child process now running in the background, if any


def register(name: str, script: str) -> str:
    SCRIPTS[name] = script
    return name


def _run(script: str, keep=None):
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    if keep is not None:
        keep.append(p)
    try:
        out, err = p.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        err += f"\n(killed after {TIMEOUT} s)"
    finally:
        if keep is not None:
            keep.remove(p)
    return p.returncode, out, err


def start(names) -> None:
    """Run these scripts one after another on a background thread."""
    names = [n for n in dict.fromkeys(names) if n in SCRIPTS and n not in _started]
    if not names:
        return
    futures = {n: Future() for n in names}
    _started.update(futures)

    def worker():
        for n in names:
            try:
                futures[n].set_result(_run(SCRIPTS[n], _running))
            except BaseException as e:      # the test that waits for it reports it
                futures[n].set_exception(e)

    threading.Thread(target=worker, name="triton-interpreter-scripts", daemon=True).start()


def stop() -> None:
    """End of the session: a script still running is killed."""
    for p in list(_running):
        p.kill()


def check(name: str) -> None:
    """The script ran (in the background, or now) and passed."""
    f = _started.get(name)
    rc, out, err = f.result() if f is not None else _run(SCRIPTS[name])
    assert rc == 0 and "OK" in out, err[-3000:]
