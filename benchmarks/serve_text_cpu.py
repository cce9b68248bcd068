"""The reply's text as tokens arrive (`zeroedge.serve.output.TextOut`): microseconds a token at reply
lengths of 256, 1,024 and 4,000 tokens, against TextOut of another commit, alternated in one run.

    python benchmarks/serve_text_cpu.py --compare 999c137 -o benchmarks/results/serve/text_decode_per_token.json

SmolLM2-135M's tokenizer; the reply is README.md's tokens, one stop string that never matches.
"""
import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def textout_of(commit: str):
    src = subprocess.run(["git", "-C", REPO, "show", f"{commit}:zeroedge/serve/output.py"], check=True,
                         capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"output_{commit}", f.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    os.unlink(f.name)
    return mod.TextOut


def per_token_us(TextOut, tok, ids) -> float:
    out = TextOut(tok, ["zzz"])
    t0 = time.perf_counter()
    for i in ids:
        out.add(i)
    return (time.perf_counter() - t0) / len(ids) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", required=True, help="the commit whose TextOut runs beside this one")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    sys.path.insert(0, REPO)
    from zeroedge.serve.output import TextOut
    from zeroedge.weights import resolve_model, tokenizer_for

    _, cfg, folder = resolve_model("smollm2-135m", need_weights=False)
    tok = tokenizer_for(cfg, folder)
    with open(os.path.join(REPO, "README.md")) as f:
        ids = tok.encode(f.read() * 4, add_special_tokens=False)
    other = textout_of(args.compare)
    rows = []
    for n in (256, 1024, 4000):
        us = {"current": [], args.compare: []}
        for _ in range(args.rounds):
            us["current"].append(per_token_us(TextOut, tok, ids[:n]))
            us[args.compare].append(per_token_us(other, tok, ids[:n]))
        rows.append({"reply_tokens": n, "us_per_token": us})
        print(json.dumps(rows[-1]), flush=True)
    res = {"what": "TextOut.add, microseconds a token averaged over a reply, SmolLM2-135M tokenizer",
           "hardware": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "load_at_start": os.getloadavg(), "compare": args.compare,
           "command": "python benchmarks/serve_text_cpu.py " + " ".join(sys.argv[1:]), "rows": rows}
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
