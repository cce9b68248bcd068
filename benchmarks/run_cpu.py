"""`zeroedge run` on a CPU: the model's fp32 weights in torch (`--weights model`) against the server's
batched 4-bit step (`--weights q4`), each with speculative decoding off and `auto`, beside
`llama-bench` on the same Q4_1 GGUF at the same depth and threads, in one interleaved run.

    python benchmarks/run_cpu.py --llama-bin ~/.cache/llama-cpp-peer/src/vendor/llama.cpp/build/bin \\
        --rounds 3 -o benchmarks/results/serve/cpu_run_weights_q4_vs_model.json

Each round runs every configuration once, the order rotated by one each round. A `zeroedge run` is a
fresh process (`--json`): its decode tokens/s (first token to last) and its prefill time; the prompt
is a KJV passage continued greedily for --new tokens. llama-bench generates --new tokens after the
prompt's token count in its KV cache (`-p 0 -n NEW -d T`, flash attention off, one repetition a
call): its own synthetic tokens, llama_decode timed alone. The raw file says how many greedy tokens
the two zeroedge weight forms share before they part (4-bit weights are another model).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def zeroedge_run(prompt_file, new, threads, weights, speculative) -> dict:
    cmd = [sys.executable, "-m", "zeroedge.cli", "run", "smollm2-135m", "--prompt-file", str(prompt_file),
           "--max-new", str(new), "--device", "cpu", "--threads", str(threads), "--weights", weights,
           "--speculative", speculative, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    d = json.loads(out.stdout.strip().splitlines()[-1])
    return {"tokens_per_s": d["tokens_per_s"], "prefill_s": d["prefill_s"], "prompt_tokens": d["prompt_tokens"],
            "tokens": d["tokens"], "speculative_stats": d.get("speculative")}


def llama_bench(bin_dir, gguf, threads, new, depth) -> dict:
    cmd = [str(Path(bin_dir) / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-fa", "0", "-p", "0",
           "-n", str(new), "-d", str(depth), "-r", "1", "-o", "json"]
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    return {"tokens_per_s": rows[0]["avg_ts"], "build_commit": rows[0].get("build_commit"), "cmd": cmd[1:]}


def main():
    from zeroedge import weights
    from zeroedge.texts import load_text
    from zeroedge.weights import resolve_model, tokenizer_for

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bin", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args()

    prompt = load_text("kjv")[5000:7000]
    prompt_file = Path(args.out).with_suffix(".prompt.txt")
    prompt_file.parent.mkdir(parents=True, exist_ok=True)
    prompt_file.write_text(prompt)
    _, cfg, folder = resolve_model("smollm2-135m", need_weights=False)
    depth = len(tokenizer_for(cfg, folder).encode(prompt, add_special_tokens=False))
    gguf = weights.bundled_gguf("smollm2-135m")
    configs = [("zeroedge", w, s) for w in ("model", "q4") for s in ("off", "auto")] + [("llama-bench", None, None)]
    runs = []
    for rnd in range(args.rounds):
        k = rnd % len(configs)
        for who, w, s in configs[k:] + configs[:k]:
            load = os.getloadavg()[0]
            if who == "zeroedge":
                r = zeroedge_run(prompt_file, args.new, args.threads, w, s)
            else:
                r = llama_bench(args.llama_bin, gguf, args.threads, args.new, depth)
            runs.append({"round": rnd, "who": who, "weights": w, "speculative": s, "load_before": load, **r})
            print(f"round {rnd} {who} {w or ''} {s or ''}: {r['tokens_per_s']:.1f} tok/s", flush=True)
    prompt_file.unlink()

    def tps(who, w=None, s=None):
        return [r["tokens_per_s"] for r in runs if r["who"] == who and r["weights"] == w and r["speculative"] == s]

    summary = {f"zeroedge --weights {w} --speculative {s}": tps("zeroedge", w, s)
               for w in ("model", "q4") for s in ("off", "auto")}
    summary["llama-bench tg"] = tps("llama-bench")
    first = {w: next(r["tokens"] for r in runs if r["weights"] == w) for w in ("model", "q4")}
    same = next((i for i, (a, b) in enumerate(zip(first["model"], first["q4"])) if a != b), len(first["q4"]))
    json.dump({"what": "zeroedge run on a CPU: --weights model (fp32 torch) vs q4 (the server's batched 4-bit step), "
                       "speculative off / auto, beside llama-bench on the same Q4_1 GGUF",
               "hardware": f"{os.cpu_count()}-core CPU", "threads": args.threads, "new_tokens": args.new,
               "prompt": "kjv[5000:7000]", "prompt_tokens": depth,
               "llama_cpp_build_commit": next(r["build_commit"] for r in runs if r["who"] == "llama-bench"),
               "command": "python benchmarks/run_cpu.py " + " ".join(sys.argv[1:]),
               "decode_tokens_per_s": summary,
               "greedy_tokens_model_vs_q4_equal_up_to": same,
               "runs": runs}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
