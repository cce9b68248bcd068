"""What prompt lookup could give on a recorded reply at best: tokens per model step when every
check were free and the drafter always sent its whole match (no draft-length choice), for each
reply of the traces file.

    python benchmarks/speculative_lookup_ceiling.py --traces benchmarks/results/speculative/smollm2_greedy_traces.json \
        -o benchmarks/results/speculative/lookup_ceiling_smollm2_traces.json

zeroedge.speculative.PromptLookup over the prompt and the reply so far proposes up to k tokens
(matches of up to `max_ngram` tokens); the model keeps the agreeing prefix and adds its own next
token. The speed-up of any lookup drafter on that reply is at most its tokens per step.
"""
import argparse
import json
from pathlib import Path


def tokens_per_step(prompt, out, k: int, max_ngram: int) -> dict:
    from zeroedge.speculative import PromptLookup, agreed

    pl = PromptLookup(prompt, max_ngram=max_ngram)
    i = steps = drafted = accepted = 0
    while i < len(out):
        _, draft = pl.propose(k)
        a = agreed(draft, out[i:])
        made = out[i:i + a + 1]
        pl.extend(made)
        i, steps, drafted, accepted = i + len(made), steps + 1, drafted + len(draft), accepted + a
    return {"k": k, "max_ngram": max_ngram, "tokens_per_step": len(out) / steps,
            "acceptance_rate": accepted / drafted if drafted else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", required=True)
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    traces = json.loads(Path(a.traces).read_text())["traces"]
    rows = {name: [tokens_per_step(tr["prompt"], tr["out"], k, n) for k in (2, 4, 8) for n in (2, 4, 8)]
            for name, tr in traces.items()}
    for name, r in rows.items():
        print(name, max(x["tokens_per_step"] for x in r))
    res = {"what": "tokens per step prompt lookup gives on recorded greedy replies with free checks",
           "traces": a.traces, "rows": rows}
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
