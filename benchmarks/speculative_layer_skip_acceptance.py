"""Could a fewer-layers copy of the model draft for it? Greedy agreement of SmolLM2 with some of its
layers skipped, against the recorded greedy replies of the 4-bit serving step (the model a drafter for
`--weights q4` would draft for).

    python benchmarks/speculative_layer_skip_acceptance.py \
        --traces benchmarks/results/speculative/smollm2_greedy_traces.json \
        -o benchmarks/results/speculative/layer_skip_acceptance_smollm2.json

Teacher-forced: each prompt and its recorded reply go through the model once per skip set (the
skipped layers' residual passes through unchanged), and a position agrees when the argmax after it
is the reply's next token. That is the acceptance a drafter of those layers would see with a KV of
its own; the full model's row (no layer skipped; the model's fp32 weights, so not the 4-bit step's
every pick) is the ceiling. A drafted token costs about the kept layers' share of a step plus the LM
head's (28 M of the model's 135 M weights), so a drafter of 20 of the 30 layers costs about 0.7 of a
step.
"""
import argparse
import json
import platform
from pathlib import Path

SKIP_SETS = {"none": (), "10-19 (10 layers)": range(10, 20), "15-24 (10 layers)": range(15, 25),
             "every 3rd from 2 (9 layers)": range(2, 28, 3), "8-23 (16 layers)": range(8, 24),
             "every 2nd from 1 (14 layers)": range(1, 29, 2)}


def main():
    import torch

    from zeroedge import weights

    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    traces = json.loads(Path(a.traces).read_text())["traces"]
    m, _ = weights.load("smollm2-135m")

    @torch.no_grad()
    def picks(ids, skip):
        t = torch.tensor([ids])
        cos, sin = m.rope(0, t.shape[1])
        x = m.embed_tokens(t)
        for b in m.layers:
            if b.index not in skip:
                x = b(x, cos, sin, 0, None)
        return m.lm_head(m.norm(x))[0].argmax(-1)

    rows = {}
    for name, tr in traces.items():
        prompt, out = tr["prompt"], tr["out"]
        ids = prompt + out
        nxt = torch.tensor(out[1:])        # out[0] is the prefill's token; each later one follows a position
        rows[name] = {}
        for label, skip in SKIP_SETS.items():
            got = picks(ids, set(skip))[len(prompt):len(ids) - 1]
            rows[name][label] = round(float((got == nxt).float().mean()), 4)
        print(name, rows[name], flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": f"python benchmarks/speculative_layer_skip_acceptance.py --traces {a.traces} -o {a.out}",
        "what": "teacher-forced greedy agreement with the recorded 4-bit replies, per skip set",
        "weights": "real SmolLM2-135M-Instruct (fp32, from the bundled Q4_1 GGUF)",
        "hardware": f"{platform.machine()} CPU, {a.threads} threads",
        "skip_sets": {k: list(v) for k, v in SKIP_SETS.items()}, "agreement": rows}, indent=1))


if __name__ == "__main__":
    main()
