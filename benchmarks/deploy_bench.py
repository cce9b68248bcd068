"""Deploy timings and bytes against real sshd fake Jetsons (the fixtures of tests/test_deploy.py).

Needs openssh-server and mosquitto (scripts/setup installs them). Prints a markdown table and writes
the rows as JSON:

    python3 benchmarks/deploy_bench.py [-o benchmarks/results/deploy/ssh_fake_jetson_steps.json]
"""
import json, os, platform, sys, time, tempfile
from pathlib import Path
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
OUT = sys.argv[sys.argv.index("-o") + 1] if "-o" in sys.argv else os.path.join(REPO, "benchmarks", "results", "deploy", "ssh_fake_jetson_steps.json")
import test_deploy as T

tmp = Path(tempfile.mkdtemp(prefix="zeroedge-bench-"))
class F:
    def mktemp(self, n):
        p = tmp / n; p.mkdir(); return p
gen = T.lab.__wrapped__(F()); lab = next(gen)
rows = []
def run(label, *args):
    t = time.perf_counter()
    p = T.deploy(lab, *args, "--json", "--config", lab.config)
    wall = time.perf_counter() - t
    doc = json.loads(p.stdout)
    for h in doc["hosts"]:
        rows.append((label, h["name"], p.returncode, wall, h["files_uploaded"], h["bytes_uploaded"], h["bytes_total"],
                     h.get("timings", {})))
try:
    a = lab.device("orin-a"); b = lab.device("orin-b")
    pa, pb = T.free_port(), T.free_port()
    run("first deploy", lab.bundle, "--host", "orin-a", "--metrics-port", pa)
    run("repeat deploy (same bundle)", lab.bundle, "--host", "orin-a", "--metrics-port", pa)
    b2 = T.make_sensor_bundle(tmp / "b2", seed=1)
    run("new bundle (model changed)", b2, "--host", "orin-a", "--metrics-port", pa)
    t = time.perf_counter(); p = T.zcli(lab, "rollback", "--host", "orin-a", "--json"); rb = time.perf_counter() - t
    rows.append(("rollback", "orin-a", p.returncode, rb, 0, 0, 0, {}))
    import numpy as np
    from zeroedge.bundle import write_manifest
    big = T.make_sensor_bundle(tmp / "big", seed=2)
    np.savez(big / "weights.npz", w=np.random.default_rng(0).normal(size=(4 << 20,)).astype(np.float32))
    m = json.loads((big / "manifest.json").read_text()); m.pop("files"); [m.pop(k) for k in ("format", "format_version", "zeroedge_version")]
    write_manifest(big, m)
    run("bundle with a 16.8 MB weights.npz", big, "--host", "orin-a", "--metrics-port", pa)
    run("same, repeat", big, "--host", "orin-a", "--metrics-port", pa)
    inv = tmp / "hosts"; inv.write_text(f"orin-a metrics_port={pa}\norin-b metrics_port={pb}\n")
    run("fleet of 2, parallel (a: b2 again, b: first)", b2, "--hosts", inv)
finally:
    try: next(gen)
    except StopIteration: pass
print("| step | host | rc | wall s | files moved | bytes moved | release bytes | connect / preflight / upload / activate s | restart->healthy s |")
print("|---|---|---|---|---|---|---|---|---|")
for label, host, rc, wall, nf, nb, tot, tm in rows:
    phases = " / ".join(f"{tm[k]:.2f}" for k in ("connect_s", "preflight_s", "upload_s", "activate_s") if k in tm)
    print(f"| {label} | {host} | {rc} | {wall:.2f} | {nf} | {nb:,} | {tot:,} | {phases} | {tm.get('restart_to_healthy_s', '')} |")

os.makedirs(os.path.dirname(OUT), exist_ok=True)
with open(OUT, "w") as f:
    json.dump({"what": "zeroedge deploy against real sshd fake Jetsons on 127.0.0.1 (tests/test_deploy.py fixtures)",
               "cpus": os.cpu_count(), "load_at_end": list(os.getloadavg()), "machine": platform.machine(),
               "rows": [{"step": label, "host": host, "rc": rc, "wall_s": round(wall, 3), "files_moved": nf,
                         "bytes_moved": nb, "release_bytes": tot, "timings": tm}
                        for label, host, rc, wall, nf, nb, tot, tm in rows]}, f, indent=1)
