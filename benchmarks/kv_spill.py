"""The file tier of the bundle runners' thermal KV: one prompt decoded with the stored
pages in memory, and with them spilled to a page file (all, or all but N), interleaved reps.
Reports decode tok/s, the bytes kept in memory and in the file, pages spilled and read back, and
whether the tokens equal the in-memory run's.

    zeroedge export smollm2-135m --weights int4 --zero-point float --accuracy-level 4 --graphs portable -o /tmp/smollm2-int4
    python benchmarks/kv_spill.py --bundle /tmp/smollm2-int4 --spill /tmp/kv-spill -o benchmarks/results/thermal_kv/speed_cpu_bundle_file_tier.json
"""
import argparse
import json
import subprocess
import sys
import tempfile


def run(bundle, prompt_file, extra, max_new):
    cmd = [sys.executable, "-m", "zeroedge.cli", "run", "--backend", "onnxruntime", "--bundle", bundle,
           "--prompt-file", prompt_file, "--max-new", str(max_new), "--kv-budget", "0.1", "--threads", "2",
           "--json", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(p.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--spill", required=True, help="folder for the page file")
    ap.add_argument("--chars", type=int, default=16000, help="KJV characters of prompt (~4K tokens)")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    from zeroedge import texts

    prompt = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False)
    prompt.write(texts.load_text("kjv")[300000:300000 + a.chars])
    prompt.close()
    configs = {"memory": [], "file, 16 pages in memory": ["--kv-spill", a.spill, "--kv-store-pages", "16"],
               "file, none in memory": ["--kv-spill", a.spill, "--kv-store-pages", "0"]}
    rows = {k: [] for k in configs}
    for rep in range(a.reps):
        for name, extra in configs.items():
            r = run(a.bundle, prompt.name, extra, a.max_new)
            th = r["thermal"]
            rows[name].append({"tok_s": r["tokens_per_s"], "tokens": r["tokens"], "prompt_tokens": r["prompt_tokens"],
                               **{k: th[k] for k in ("pages", "hot_pages", "stored_pages", "store_bytes", "file_pages",
                                                     "file_bytes", "spilled", "spill_failed", "file_reads",
                                                     "file_read_s", "pages_migrated")}})
            print(rep, name, f"{r['tokens_per_s']:.1f} tok/s", {k: th[k] for k in ("store_bytes", "file_bytes",
                                                                                  "spilled", "file_reads")}, flush=True)
    ref = rows["memory"][0]["tokens"]
    out = {"bundle": a.bundle, "prompt_chars": a.chars, "max_new": a.max_new, "kv_budget": 0.1, "rows": rows,
           "same_tokens": {k: all(x["tokens"] == ref for x in v) for k, v in rows.items()}}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["same_tokens"]))


if __name__ == "__main__":
    main()
