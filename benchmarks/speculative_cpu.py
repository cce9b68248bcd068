"""Speculative decoding (n-gram prompt lookup) in the serving engine on the CPU, real SmolLM2.

    python benchmarks/speculative_cpu.py --repeats 3 -o benchmarks/results/speculative/ngram_smollm2_cpu_q4.json

The bundled SmolLM2-135M-Instruct (a Q4_1 GGUF) behind zeroedge's serving engine with the weights
`zeroedge serve` uses on a CPU (4-bit linears in onnxruntime, `--weights q4`), one request at a time,
greedy, on prompts of the project's texts: summarising and extracting (chat template) and plain
continuation of KJV, essays and licenses. Each prompt runs with `--speculative off`, `ngram` and
`auto`, interleaved `--repeats` times; a row gives the decode tokens/s (first token to last), the
speed-up over off in the same round, the acceptance rate, tokens per model step, and whether the
tokens equal plain decoding's. `--run-path` measures the same through `zeroedge run`'s decoder
(zeroedge.serve.session.ServingSession: the dense decoder over the model's fp32 weights, drafts
checked by Decoder.verify) instead of the serving engine.

    python benchmarks/speculative_cpu.py --run-path --modes off,auto,ngram,packed --q4-peer --repeats 3 \
        -o benchmarks/results/speculative/drafters_smollm2_cpu_run_decoder.json

`--kv-budget F` (with `--run-path`) decodes on thermal KV with F of the prompt's pages hot (`zeroedge
run --kv-budget F`): the thermal decoder checks the drafts, its refreshes row by row.

    python benchmarks/speculative_cpu.py --run-path --kv-budget 0.1 --prompt-tokens 2000 --repeats 2 \
        -o benchmarks/results/speculative/ngram_smollm2_cpu_thermal_kv.json

`--modes` picks the modes (packed: the model's own weights on the 4-bit CPU step draft, its fp32
weights check: `--run-path`, or the engine with `--weights model`); `--q4-peer` also times, in the
same rounds, the engine's plain 4-bit step (`zeroedge run --weights q4`): faster, and other tokens
(the share of each reply it matches before its first other token is recorded).
"""
import argparse
import json
import os
import platform
import statistics
import threading
import time

TASKS = {
    "summarise": ("essays", "Summarise the text above in five sentences, keeping its own words where you can."),
    "extract": ("licenses", "From the text above, write a JSON object with the keys \"name\", \"version\", "
                            "\"permissions\" (a list) and \"conditions\" (a list), quoting the text's own phrases."),
    "kjv": ("kjv", None),
    "essays": ("essays", None),
    "licenses": ("licenses", None),
}


def prompts(tok, prompt_tokens: int, offset: int) -> dict:
    from zeroedge.texts import load_text

    out = {}
    for name, (text_name, ask) in TASKS.items():
        ids = tok.encode(load_text(text_name), add_special_tokens=False)
        body = tok.decode(ids[offset:offset + prompt_tokens])
        if ask is None:
            out[name] = tok.encode(body, add_special_tokens=False)
        else:
            msgs = [{"role": "user", "content": body + "\n\n" + ask}]
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            out[name] = tok.encode(text, add_special_tokens=False)
    return out


def first_difference(tokens, ref) -> int:
    """How many tokens equal the reference's before the first other one."""
    return next((i for i, (x, y) in enumerate(zip(tokens, ref)) if x != y), min(len(tokens), len(ref)))


def generate(engine, prompt, new: int) -> dict:
    from zeroedge.serve.plan import Plan, Sampling

    done = threading.Event()
    events = []

    def sink(ev):
        events.append((time.perf_counter(), ev))
        if ev[0] in ("done", "error"):
            done.set()

    seq = engine.submit(Plan(list(prompt), Sampling(max_tokens=new, temperature=0.0), len(prompt) + new, 0,
                             eos=()), sink)
    done.wait()
    if events[-1][1][0] == "error":
        raise RuntimeError(events[-1][1][1])
    t_first = seq.t_first
    t_end = events[-1][0]
    n = len(seq.out)
    st = seq.spec.stats.to_dict() if seq.spec is not None else None
    return {"tokens": list(seq.out), "decode_tok_s": (n - 1) / (t_end - t_first), "spec": st,
            "prefill_s": t_first - seq.t_submit}


def generate_run(sess, prompt, new: int, mode: str) -> dict:
    res = sess.generate(prompt, new, speculative=mode)
    return {"tokens": res.tokens, "decode_tok_s": res.tokens_per_s, "spec": res.detail.get("speculative"),
            "prefill_s": res.prefill_s, "thermal_kv": res.mechanisms.get("thermal_kv")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=700)
    ap.add_argument("--offset", type=int, default=2000, help="where in each text the prompt starts (tokens)")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("-o", "--out")
    ap.add_argument("--traces", help="also write each prompt and its plain greedy reply here (JSON)")
    ap.add_argument("--run-path", action="store_true", help="zeroedge run's decoder instead of the serving engine")
    ap.add_argument("--modes", default="off,ngram,auto", help="speculative modes, off first")
    ap.add_argument("--weights", choices=("q4", "model"), default="q4", help="the serving engine's weights")
    ap.add_argument("--q4-peer", action="store_true", help="also the engine's plain 4-bit step, same rounds")
    ap.add_argument("--kv-budget", type=float, help="with --run-path: thermal KV, this share of the prompt hot")
    a = ap.parse_args()
    if a.kv_budget is not None and not a.run_path:
        ap.error("--kv-budget measures zeroedge run's decoder: add --run-path")

    import torch

    from zeroedge.serve.backends import TorchBatched
    from zeroedge.serve.cpu_q4 import Q4Step
    from zeroedge.serve.engine import Engine
    from zeroedge.weights import resolve_model, tokenizer_for

    load_at_start = os.getloadavg()
    torch.set_num_threads(a.threads)
    m, cfg, folder = resolve_model("smollm2-135m", need_weights=True)
    m = m.float().eval()
    tok = tokenizer_for(cfg, folder)
    modes = tuple(a.modes.split(","))
    assert modes[0] == "off", "--modes starts with off (the speed-ups are over it)"
    engines, gen = {}, {}
    if a.q4_peer or (not a.run_path and a.weights == "q4"):
        lin = Q4Step(m, a.threads)
        b4 = TorchBatched(m, 256 << 20, 1, 128, lin)
    if a.run_path:
        from zeroedge.serve.session import ServingSession

        sess = ServingSession(m, kv_budget=a.kv_budget)
        gen = {mode: (lambda p, n, mode=mode: generate_run(sess, p, n, mode)) for mode in modes}
    else:
        from zeroedge.serve.backends import DraftModel

        b = b4 if a.weights == "q4" else TorchBatched(m, 256 << 20, 1, 128)
        draft = DraftModel.build(m, a.threads, 4096, 1, 128) if "packed" in modes else None
        engines = {mode: Engine(b, tok, speculative=mode, draft_model=draft) for mode in modes}
    if a.q4_peer:
        engines["q4"] = Engine(b4, tok)
    for mode, e in engines.items():
        e.start()
        gen[mode] = lambda p, n, e=e: generate(e, p, n)
    ps = prompts(tok, a.prompt_tokens, a.offset)
    tasks = a.tasks.split(",")
    gen["off"](ps[tasks[0]], 8)                                      # warm-up
    timed = modes + (("q4",) if a.q4_peer else ())
    runs = {t: {mode: [] for mode in timed} for t in tasks}
    for r in range(a.repeats):
        for t in tasks:
            for mode in timed:
                if mode == "q4" or (not a.run_path and a.weights == "q4"):
                    torch.set_num_threads(1)     # as `zeroedge serve` on a CPU (the 4-bit step's own threads)
                runs[t][mode].append(gen[mode](ps[t], a.new))
                torch.set_num_threads(a.threads)
    rows = []
    for t in tasks:
        off = runs[t]["off"]
        row = {"task": t, "text": TASKS[t][0], "prompt_tokens": len(ps[t]), "new_tokens": len(off[0]["tokens"]),
               "off_tok_s": statistics.median(x["decode_tok_s"] for x in off),
               "off_prefill_s": statistics.median(x["prefill_s"] for x in off)}
        if a.kv_budget is not None:             # every run of the row decoded on thermal KV
            row["thermal_kv"] = all(x["thermal_kv"] for rs in runs[t].values() for x in rs)
        for mode in modes[1:]:
            rs = runs[t][mode]
            row[f"{mode}_tok_s"] = statistics.median(x["decode_tok_s"] for x in rs)
            row[f"{mode}_speedup"] = statistics.median(x["decode_tok_s"] / o["decode_tok_s"] for x, o in zip(rs, off))
            row[f"{mode}_identical"] = all(x["tokens"] == o["tokens"] for x, o in zip(rs, off))
            row[f"{mode}_acceptance_rate"] = rs[0]["spec"]["acceptance_rate"]
            row[f"{mode}_tokens_per_step"] = rs[0]["spec"]["tokens_per_step"]
            row[f"{mode}_prefill_s"] = statistics.median(x["prefill_s"] for x in rs)
        if a.q4_peer:
            q4, ref = runs[t]["q4"], off[0]["tokens"]
            row["q4_tok_s"] = statistics.median(x["decode_tok_s"] for x in q4)
            row["q4_speedup"] = statistics.median(x["decode_tok_s"] / o["decode_tok_s"] for x, o in zip(q4, off))
            row["q4_tokens_before_first_difference"] = first_difference(q4[0]["tokens"], ref)
        rows.append(row)
        print(json.dumps(row))
    for e in engines.values():
        e.stop()
    path = ("the serving engine, batch 1" if not a.run_path else "zeroedge run's dense decoder"
            if a.kv_budget is None else f"zeroedge run's thermal KV decoder ({a.kv_budget:g} of the prompt hot)")
    drafters = ("n-gram prompt lookup" if set(modes) & {"ngram", "auto"} else "") + (
        " and " if set(modes) & {"ngram", "auto"} and "packed" in modes else "") + (
        "the model's own 4-bit CPU step (packed)" if "packed" in modes else "")
    res = {"what": f"speculative decoding by {drafters} in {path}, greedy",
           "hardware": f"CPU ({platform.processor() or platform.machine()}), {a.threads} threads",
           "load_at_start": load_at_start, "load_at_end": os.getloadavg(),
           "model": "SmolLM2-135M-Instruct (bundled Q4_1 GGUF), real weights",
           "weights_path": ("the model's fp32 weights (the GGUF's 4-bit values dequantized), torch"
                            if a.run_path or a.weights == "model"
                            else "4-bit linears in onnxruntime MatMulNBits (zeroedge serve --weights q4)"),
           "args": vars(a), "rows": rows}
    if a.out:
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    if a.traces:
        with open(a.traces, "w") as f:
            json.dump({"what": "prompts and their plain greedy replies (SmolLM2, serving engine, 4-bit linears)",
                       "traces": {t: {"prompt": ps[t], "out": runs[t]["off"][0]["tokens"]} for t in tasks}}, f)


if __name__ == "__main__":
    main()
