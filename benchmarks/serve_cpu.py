"""zeroedge serve against llama.cpp's llama-server on the same GGUF, the same threads, in one run.

    python benchmarks/serve_cpu.py --llama-bin ~/.cache/llama-cpp-peer/src/vendor/llama.cpp/build/bin \
        --clients 1,4,16 --rounds 2 -o benchmarks/results/serve/cpu_smollm2_q4_clients.json

For each round, each server in turn (zeroedge first in odd rounds, llama-server first in even ones):
start it, then for each client count N run N client threads that each stream `--requests` chat
completions back to back (short distinct prompts, `--new` tokens each, ignore_eos, greedy), and record
aggregate completion tokens a second (all tokens / wall time from the first request to the last
answer), each request's time to first token (to its first content chunk), and each server's resident
memory after its run (now and at its peak, from /proc). Both servers are
OpenAI-compatible; the same client code drives them (httpx, server-sent events).
"""
import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time

import httpx

PROMPTS = ["Tell me about the sea.", "What is a good breakfast?", "Write about autumn leaves.",
           "Why is the sky blue?", "List some fruits and their colours.", "What do cats like to eat?",
           "Describe a mountain village.", "How do trains work?", "Explain what rain is.",
           "Give advice to a new gardener.", "What is a library for?", "Describe a busy market.",
           "How do birds fly?", "What makes a good friend?", "Tell a story about a lighthouse.",
           "What is the moon made of?"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(base, proc, timeout=300):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not come up")


def one(base, model, i, new, out):
    body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": new, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, n = None, 0
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            d = json.loads(line[5:])
            if d.get("usage"):
                n = d["usage"]["completion_tokens"]
            ch = d.get("choices") or []
            if first is None and ch and (ch[0].get("delta") or {}).get("content"):
                first = time.perf_counter() - t0
    out.append({"ttft_s": first, "tokens": n, "s": time.perf_counter() - t0})


def load(base, model, clients, requests, new):
    out = []

    def client(c):
        for k in range(requests):
            one(base, model, c * requests + k, new, out)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    wall = time.perf_counter() - t0
    tt = sorted(r["ttft_s"] for r in out if r["ttft_s"] is not None)
    q = lambda p: tt[min(len(tt) - 1, int(round(p * (len(tt) - 1))))]  # noqa: E731
    toks = sum(r["tokens"] for r in out)
    return {"clients": clients, "requests": len(out), "completion_tokens": toks, "wall_s": wall,
            "tokens_per_s": toks / wall, "ttft_p50_s": q(0.5), "ttft_p99_s": q(0.99), "ttft_max_s": tt[-1]}


def resident(pid) -> dict:
    """The server process's resident memory now and at its peak (MiB), from /proc."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[{"VmRSS": "rss_mib", "VmHWM": "peak_rss_mib"}[key]] = int(val.split()[0]) // 1024
    return out


def start(kind, args, port):
    if kind == "zeroedge":
        cmd = [sys.executable, "-m", "zeroedge.cli", "serve", "smollm2-135m", "--port", str(port),
               "--threads", str(args.threads), "--max-batch", str(max(args.clients))]
        model = "smollm2-135m"
    else:
        from zeroedge import weights

        n = max(args.clients)
        cmd = [os.path.join(args.llama_bin, "llama-server"), "-m", str(weights.bundled_gguf("smollm2-135m")),
               "-t", str(args.threads), "-tb", str(args.threads), "--parallel", str(n), "-c", str(1024 * n),
               "--port", str(port), "--host", "127.0.0.1"]
        model = "smollm2"
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    wait_up(base, p)
    return p, base, model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bin", required=True)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=2, help="requests each client sends, back to back")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    load_at_start = os.getloadavg()
    commit_file = os.path.join(args.llama_bin, *[".."] * 5, "COMMIT")     # written by build-llama-cpp
    commit = open(commit_file).read().strip() if os.path.exists(commit_file) else "unknown"
    rows, served, memory = [], None, []
    for rnd in range(args.rounds):
        for kind in (("zeroedge", "llama-server") if rnd % 2 == 0 else ("llama-server", "zeroedge")):
            p, base, model = start(kind, args, free_port())
            try:
                if kind == "zeroedge":                       # how it serves: weights, kernels, batch
                    served = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["zeroedge"]
                one(base, model, 0, 8, [])                   # warm up
                for n in args.clients:
                    r = load(base, model, n, args.requests, args.new)
                    r.update(server=kind, round=rnd)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
                memory.append(dict(server=kind, round=rnd, **resident(p.pid)))
            finally:
                p.terminate()
                p.wait(30)
    res = {"what": "aggregate streamed tokens/s and time to first token, SmolLM2-135M-Instruct Q4_1 GGUF",
           "hardware": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "load_at_start": load_at_start, "load_at_end": os.getloadavg(), "threads": args.threads, "new_tokens": args.new,
           "requests_per_client": args.requests, "llama_cpp_commit": commit,
           "command": "python benchmarks/serve_cpu.py " + " ".join(sys.argv[1:]),
           "zeroedge": "serve --weights q4 (4-bit linears on the GGUF's Q4_1 grid, 8-bit LM head, int8-rounded "
                       "inputs, onnxruntime MatMulNBits; the whole step, fp32 attention included, one onnxruntime graph)",
           "zeroedge_served": served,
           "llama_server": f"llama-server -t {args.threads} --parallel {max(args.clients)} (continuous batching)",
           "rows": rows, "memory_after_run": memory}
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
