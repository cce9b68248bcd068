"""A soak of zeroedge serve: N clients for S seconds, a mix of requests, failures and RSS growth.

    python benchmarks/serve_soak.py --clients 16 --seconds 600 -o benchmarks/results/serve/soak_cpu_16clients_600s.json

Each client loops: a streamed chat (64 tokens), a whole chat with a JSON schema, a completion, and
every fifth round a stream it drops after three chunks (a cancellation). A request fails when it
raises or answers other than 200 (the schema answer must also parse). The server's RSS is read from
/proc every 10 s; growth is the last sample over the first one taken after a warm-up minute.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count"],
          "properties": {"name": {"type": "string", "maxLength": 16}, "count": {"type": "integer"}}}


def rss(pid) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=int, default=600)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    p = subprocess.Popen([sys.executable, "-m", "zeroedge.cli", "serve", "smollm2-135m", "--port", str(port),
                          "--threads", str(args.threads), "--max-batch", str(args.clients)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while True:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
        if time.time() - t0 > 300 or p.poll() is not None:
            raise SystemExit("server did not come up")
    stats = {"ok": 0, "failed": 0, "cancelled": 0, "tokens": 0, "errors": []}
    lock = threading.Lock()
    end = time.time() + args.seconds

    def note(ok, tokens=0, err=None):
        with lock:
            stats["ok" if ok else "failed"] += 1
            stats["tokens"] += tokens
            if err and len(stats["errors"]) < 20:
                stats["errors"].append(err)

    def msg(i, k):
        return [{"role": "user", "content": f"Client {i}, round {k}: tell me something about the number {k}."}]

    def client(i):
        k = 0
        with httpx.Client(base_url=base, timeout=300) as c:
            while time.time() < end:
                k += 1
                try:
                    n = 0
                    with c.stream("POST", "/v1/chat/completions", json={
                            "model": "smollm2-135m", "messages": msg(i, k), "max_tokens": 64, "stream": True,
                            "temperature": 0.8, "seed": k}) as r:
                        r.raise_for_status()
                        for line in r.iter_lines():
                            n += line.startswith("data:")
                            if k % 5 == 0 and n >= 3:
                                break
                    if k % 5 == 0:
                        with lock:
                            stats["cancelled"] += 1
                    note(True, n)
                    r = c.post("/v1/chat/completions", json={
                        "model": "smollm2-135m", "messages": msg(i, k), "max_tokens": 80, "temperature": 0,
                        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}})
                    r.raise_for_status()
                    d = r.json()
                    if d["choices"][0]["finish_reason"] == "stop":
                        json.loads(d["choices"][0]["message"]["content"])
                    note(True, d["usage"]["completion_tokens"])
                    r = c.post("/v1/completions", json={"model": "smollm2-135m", "prompt": f"Item {k}:",
                                                        "max_tokens": 32})
                    r.raise_for_status()
                    note(True, r.json()["usage"]["completion_tokens"])
                except Exception as e:          # noqa: BLE001 - counted and reported
                    note(False, err=f"{type(e).__name__}: {e}"[:300])

    samples = []
    ts = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    [t.start() for t in ts]
    start = time.time()
    while any(t.is_alive() for t in ts):
        samples.append({"t": round(time.time() - start, 1), "rss": rss(p.pid)})
        time.sleep(10)
    [t.join() for t in ts]
    samples.append({"t": round(time.time() - start, 1), "rss": rss(p.pid)})
    p.terminate()
    p.wait(60)
    warm = next((s for s in samples if s["t"] >= 60), samples[0])
    out = {"what": "soak: zeroedge serve smollm2-135m (CPU, --weights q4)", "clients": args.clients,
           "seconds": args.seconds, "threads": args.threads, "cpus": os.cpu_count(), **stats,
           "rss_after_warmup_bytes": warm["rss"], "rss_end_bytes": samples[-1]["rss"],
           "rss_growth_bytes": samples[-1]["rss"] - warm["rss"], "rss_samples": samples,
           "server_exit_code": p.returncode}
    print(json.dumps({k: v for k, v in out.items() if k != "rss_samples"}))
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
