"""Speculative decoding end to end on a GPU with real SmolLM2: `zeroedge run`'s path
(ServingSession.generate: the dense decoder's CUDA graphs, bf16) with --speculative off / auto / packed,
interleaved, on the five prompts of benchmarks/speculative_cpu.py (their token ids from the traces file).

    PYTHONPATH=$PWD python3 benchmarks/gpu/speculative_smollm2_gpu.py --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --traces benchmarks/results/speculative/smollm2_greedy_traces.json -o OUT

`--kv-budget F`: `run`'s thermal KV decoder with F of each prompt's pages hot instead of the dense one
(its check runs the rows' refreshes and attention row by row, eagerly: measured at 0.05-0.07x, so
`run` now refuses speculative decoding there on CUDA and every mode decodes plainly).

`--invariant`: the products batch-invariant (zeroedge.runtime.row_products): `run`'s plain step is a
check of one token, so every mode's tokens should equal `off`'s.

`--engine`: the same through `zeroedge serve`'s engine instead (TorchBatched on CUDA, batch 1; `packed`
drafts with serve.backends.DecoderDraftModel).

A row gives each mode's decode tokens/s (first token to last, the host's work included), the speed-up
over `off` (median of the rounds' ratios), the acceptance and tokens per model step, and how many
tokens equal `off`'s before the first other one (`run`'s check computes rows with matrix products, its
plain step with the GEMV: equal to bf16 rounding).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from speculative_cpu import first_difference  # noqa: E402  (benchmarks/, beside this folder)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="the bundled SmolLM2 GGUF (or an HF folder)")
    ap.add_argument("--traces", required=True)
    ap.add_argument("--modes", default="off,auto,packed")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine", action="store_true", help="the serving engine instead of run's decoder")
    ap.add_argument("--device", default="cuda", help="cuda (bf16), or cpu (fp32: a check of the script)")
    ap.add_argument("--kv-budget", type=float, help="run's thermal KV decoder, this share of the prompt hot")
    ap.add_argument("--invariant", action="store_true",
                    help="batch-invariant products (run's decoder: a step is a check of one token; the engine's step)")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    if a.kv_budget is not None and a.engine:
        ap.error("--kv-budget measures run's decoder, not the engine")

    from zeroedge.serve.session import ServingSession
    from zeroedge.weights import resolve_model

    m, cfg, _ = resolve_model(a.model, need_weights=True)
    m = m.to(a.device, torch.bfloat16 if a.device == "cuda" else torch.float32).eval()
    prompts = {name: tr["prompt"] for name, tr in json.loads(Path(a.traces).read_text())["traces"].items()}
    modes = a.modes.split(",")
    assert modes[0] == "off", "--modes starts with off (the speed-ups are over it)"
    generate = (engine_generator(m, modes, a.invariant) if a.engine
                else ServingSession(m, kv_budget=a.kv_budget, invariant=a.invariant).generate)
    longest = max(prompts.values(), key=len)
    for mode in modes:                                  # warm-up: graphs, the drafter at its largest
        generate(longest, a.new, speculative=mode)
    runs = {name: {mode: [] for mode in modes} for name in prompts}
    for _ in range(a.repeats):
        for name, p in prompts.items():
            for mode in modes:
                runs[name][mode].append(generate(p, a.new, speculative=mode))
    rows = []
    for name, by_mode in runs.items():
        off = by_mode["off"]
        row = {"task": name, "prompt_tokens": len(prompts[name]), "new_tokens": a.new,
               "off_tok_s": statistics.median(r.tokens_per_s for r in off)}
        for mode in modes[1:]:
            rs = by_mode[mode]
            st = rs[-1].detail.get("speculative") or {}
            row[mode] = {"tok_s": statistics.median(r.tokens_per_s for r in rs),
                         "speedup": statistics.median(r.tokens_per_s / o.tokens_per_s for r, o in zip(rs, off)),
                         "acceptance_rate": st.get("acceptance_rate"), "tokens_per_step": st.get("tokens_per_step"),
                         "tokens_as_off_before_a_difference": min(first_difference(r.tokens, o.tokens)
                                                                  for r, o in zip(rs, off)),
                         "drafter": rs[-1].mechanisms.get("speculative_drafter"),
                         "thermal_kv": rs[-1].mechanisms.get("thermal_kv")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    path = ("zeroedge serve's engine (batch 1)" if a.engine else "zeroedge run's decoder" if a.kv_budget is None
            else f"zeroedge run's thermal KV decoder ({a.kv_budget:g} of the prompt hot)")
    res = {"what": f"speculative decoding end to end through {path} on a GPU, real SmolLM2"
                   + (", batch-invariant products" if a.invariant else ""),
           "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
           "model": "SmolLM2-135M-Instruct (bundled Q4_1 GGUF, its values in bf16), real weights",
           "args": vars(a), "rows": rows}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(res, indent=1))


def engine_generator(m, modes, invariant: bool = False):
    """generate(prompt, new, speculative=mode) -> a Result-like record, through one serving engine a
    mode over one TorchBatched backend (requests one at a time)."""
    from types import SimpleNamespace

    from zeroedge.serve.backends import DecoderDraftModel, TorchBatched
    from zeroedge.serve.engine import Engine

    from speculative_cpu import generate as engine_generate

    b = TorchBatched(m, 1 << 30, 1, 512, None, invariant=invariant)
    b.warm_up()
    draft = DecoderDraftModel(m, m.cfg.max_seq_len) if "packed" in modes else None
    engines = {mode: Engine(b, None, speculative=mode, draft_model=draft if mode == "packed" else None)
               for mode in modes}
    for e in engines.values():
        e.start()

    def generate(prompt, new, speculative):
        r = engine_generate(engines[speculative], prompt, new)
        return SimpleNamespace(tokens=r["tokens"], tokens_per_s=r["decode_tok_s"],
                               detail={"speculative": r["spec"]},
                               mechanisms={"speculative_drafter": draft.weights if speculative == "packed" else None})
    return generate


if __name__ == "__main__":
    main()
