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
scores), the argmax over those ids.
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
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from zeroedge.calib_artifact import WeightsSection
    from zeroedge.quant.apply import apply, embedding_group
    from zeroedge.speculative import draft_vocabulary
    from zeroedge.weights import resolve_model

    target, cfg, _ = resolve_model("smollm2-135m", need_weights=True)
    target = target.float().eval()
    drafter = copy.deepcopy(target)
    apply(drafter, WeightsSection(bits=4, group=128, symmetric=True, method="rtn", embedding_bits=8,
                                  embedding_group=embedding_group(cfg.dim), meta={}, zero_point="int"), pack=True)
    traces = json.loads(Path(a.traces).read_text())["traces"]
    rows, agree, agree_v, total = {}, 0, 0, 0
    with torch.inference_mode():
        for name, tr in traces.items():
            ids = torch.tensor([tr["prompt"] + tr["out"]])
            n0 = len(tr["prompt"]) - 1                  # logits here predict the reply's first token
            t = target(ids)[0, n0:-1].argmax(-1)
            h = drafter.hidden_states(ids)[0, n0:-1]
            d = drafter.lm_head(h).argmax(-1)
            vocab = torch.tensor(draft_vocabulary(cfg.vocab_size, tr["prompt"], a.draft_vocab))
            dv = vocab[(h @ drafter.lm_head.weight[vocab].t()).argmax(-1)]
            same, same_v = int((t == d).sum()), int((t == dv).sum())
            rows[name] = {"positions": len(t), "agree": same, "alpha": same / len(t),
                          "agree_draft_vocab": same_v, "alpha_draft_vocab": same_v / len(t)}
            agree, agree_v, total = agree + same, agree_v + same_v, total + len(t)
            print(name, rows[name], flush=True)
    res = {"what": "per-token acceptance of an int4 g128 symmetric drafter of SmolLM2 (greedy, teacher-forced)",
           "target": "SmolLM2-135M-Instruct (bundled Q4_1 GGUF), fp32 on the CPU",
           "drafter": "the same, zeroedge int4 g128 symmetric weights (rtn), 8-bit embedding",
           "alpha": agree / total, "draft_vocab": a.draft_vocab, "alpha_draft_vocab": agree_v / total,
           "positions": total, "traces": a.traces, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("alpha", res["alpha"], "alpha_draft_vocab", res["alpha_draft_vocab"])


if __name__ == "__main__":
    main()
