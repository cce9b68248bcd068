"""How often a 4-bit drafter of SmolLM2 picks the model's own next token: the per-token acceptance
`alpha` of greedy speculative decoding with a packed-weights drafter.

    python benchmarks/speculative_packed_acceptance.py --traces benchmarks/results/speculative/smollm2_greedy_traces.json \
        -o benchmarks/results/speculative/packed_drafter_acceptance_smollm2_cpu.json

Target: the bundled SmolLM2-135M-Instruct (Q4_1 GGUF, its weights in fp32); drafter: the same model
with zeroedge's int4 g128 symmetric weights (zeroedge.quant.apply; on a CPU the packed values as fp).
Each trace (a prompt and the plain greedy reply) runs teacher-forced through both; alpha is the share
of reply positions where the drafter's argmax equals the target's (with the same prefix, that is the
chance a drafted token is accepted). `alpha_draft_vocab` gives the same with the drafter's head over
`--draft-vocab` ids only (zeroedge.speculative.draft_vocabulary of each prompt: what `run`'s CUDA drafter
scores), the argmax over those ids; `alpha_window` the same with the drafter attending only over the
first `--sinks` and the last `--window` positions (what the CUDA drafter, zeroedge.serve.backends.
DecoderDraftModel, attends over: a banded mask here, keys at their true positions). Each row keeps,
per position, whether the windowed drafter agreed and its top probability (softmax over the draft
vocabulary): what benchmarks/gpu/speculative_gpu.py replays.

`--long N` adds rows at long context: the named texts (kjv and essays from the offsets
benchmarks/prefill_frontier.py reads them at) as prompts of N - `--span` tokens, continued greedily
by the target (`zeroedge run`'s decoder) for `--span` tokens, agreement counted over the reply.
"""
import argparse
import copy
import json
from pathlib import Path

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, default=16384, help="ids the restricted head scores")
    ap.add_argument("--window", type=int, default=None, help="positions the windowed drafter attends over "
                    "besides the sinks (default: DecoderDraftModel's)")
    ap.add_argument("--sinks", type=int, default=None, help="first positions it always attends over")
    ap.add_argument("--long", type=int, default=0, help="positions of each long-context row (prompt and reply)")
    ap.add_argument("--span", type=int, default=128, help="greedy reply tokens of a long-context row")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from zeroedge.calib_artifact import WeightsSection
    from zeroedge.quant.apply import apply, embedding_group
    from zeroedge.speculative import draft_vocabulary
    from zeroedge.weights import resolve_model

    target, cfg, folder = resolve_model("smollm2-135m", need_weights=True)
    target = target.float().eval()
    drafter = copy.deepcopy(target)
    apply(drafter, WeightsSection(bits=4, group=128, symmetric=True, method="rtn", embedding_bits=8,
                                  embedding_group=embedding_group(cfg.dim), meta={}, zero_point="int"), pack=True)
    from zeroedge.serve.backends import DecoderDraftModel

    window = a.window or DecoderDraftModel.WINDOW
    sinks = 4 if a.sinks is None else a.sinks              # DenseAttention's, the drafter's

    def hidden(model, ids, banded: bool):
        """The final normalised hidden states, causal, or banded: the sinks and the last `window`."""
        if not banded:
            return model.hidden_states(ids)[0]
        T = ids.shape[1]
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        mask = (j <= i) & ((j < sinks) | (j > i - window))
        x = model.embed_tokens(ids)
        cos, sin = model.rope(0, T)
        for b in model.layers:
            x = b(x, cos, sin, 0, mask)
        return model.norm(x)[0]

    def agreement(ids, first: int, prompt) -> dict:
        """Positions first..T-2 of ids predict first+1..: the target's argmax against the drafter's."""
        t = target(ids)[0, first:-1].argmax(-1)
        h = hidden(drafter, ids, False)[first:-1]
        vocab = torch.tensor(draft_vocabulary(cfg.vocab_size, prompt, a.draft_vocab))
        w = drafter.lm_head.weight[vocab].t()
        lw = hidden(drafter, ids, True)[first:-1] @ w
        counts = {"agree": t == drafter.lm_head(h).argmax(-1), "agree_draft_vocab": t == vocab[(h @ w).argmax(-1)],
                  "agree_window": t == vocab[lw.argmax(-1)]}
        row = {"positions": len(t)}
        for key, same in counts.items():
            row[key] = int(same.sum())
            row[key.replace("agree", "alpha")] = int(same.sum()) / len(t)
        # per position, the windowed drafter: agreed (0 / 1) and its top probability over the draft vocabulary
        row["window_agreed"] = counts["agree_window"].int().tolist()
        row["window_confidence"] = [round(float(c), 4) for c in lw.softmax(-1).amax(-1)]
        return row

    def pooled(rows) -> dict:
        n = sum(r["positions"] for r in rows)
        return {"positions": n, **{k: sum(r[k.replace("alpha", "agree")] for r in rows) / n
                                   for k in ("alpha", "alpha_draft_vocab", "alpha_window")}}

    traces = json.loads(Path(a.traces).read_text())["traces"]
    rows, long_rows = {}, {}
    with torch.inference_mode():
        for name, tr in traces.items():
            ids = torch.tensor([tr["prompt"] + tr["out"]])
            rows[name] = agreement(ids, len(tr["prompt"]) - 1, tr["prompt"])   # from the reply's first token
            print(name, {k: v for k, v in rows[name].items() if not k.startswith("window_")}, flush=True)
        if a.long:
            from zeroedge import texts, weights
            from zeroedge.serve.session import ServingSession

            tok = weights.tokenizer(folder)
            offsets = {"kjv": 300_000, "essays": 30_000}
            for name in texts.NAMED:
                prompt = texts.tokens(tok, texts.load_text(name), a.long - a.span, offset=offsets.get(name, 0),
                                      what=name)
                reply = ServingSession(target).generate(prompt, a.span).tokens     # greedy, `run`'s decoder
                long_rows[name] = agreement(torch.tensor([prompt + reply]), len(prompt) - 1, prompt)
                print(name, a.long, {k: v for k, v in long_rows[name].items() if not k.startswith("window_")},
                      flush=True)
    res = {"what": "per-token acceptance of an int4 g128 symmetric drafter of SmolLM2 (greedy, teacher-forced)",
           "target": "SmolLM2-135M-Instruct (bundled Q4_1 GGUF), fp32 on the CPU",
           "drafter": "the same, zeroedge int4 g128 symmetric weights (rtn), 8-bit embedding",
           **pooled(rows.values()), "draft_vocab": a.draft_vocab, "window": window, "sinks": sinks,
           "traces": a.traces, "rows": rows}
    if long_rows:
        res["long"] = {"tokens": a.long, "span": a.span, "offsets": offsets, **pooled(long_rows.values()),
                       "rows": long_rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print({k: res[k] for k in ("alpha", "alpha_draft_vocab", "alpha_window")}, res.get("long", {}).get("alpha_window"))


if __name__ == "__main__":
    main()
