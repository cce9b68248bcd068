"""Does dropping a token as an attention *query* pay? (Its keys and values are still computed.)

For prefix tokens in layers 2..28, the attention output of dropped queries is not added to the
residual (the same result as not computing those query rows). Tokens are picked by the layer's SIH
head (on the attention input) or at random, compared at equal rates with FFN skipping (anchor),
long-document protocol, real SmolLM2 weights.

  python benchmarks/query_drop.py --calib zeroedge/data/smollm2-135m.calib --out benchmarks/query_drop
"""
import argparse
import json
import math
from pathlib import Path

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calib", default="zeroedge/data/smollm2-135m.calib")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--rates", nargs="+", type=float, default=[0.15, 0.3])
    ap.add_argument("--out", default="benchmarks/results/prefill/query_drop_smollm2_cpu")
    a = ap.parse_args()
    torch.set_num_threads(2)
    from zeroedge import calib_artifact, texts, weights
    from zeroedge.mechanisms.sih import SIHHead, protect, smooth

    m, folder = weights.load("smollm2-135m")
    tok = weights.tokenizer(folder)
    _, tens = calib_artifact.load(a.calib)
    heads = {i: SIHHead.from_state(tens, f"layers.{i}.sih") for i in range(m.cfg.n_layers)}
    P = a.ctx - 1024
    cfg = m.cfg
    hd = cfg.head_dim
    # attention FLOPs per dropped query token: q and o projections + scores and PV over ~P/2 keys
    per_q = 2 * 2 * cfg.dim * cfg.n_heads * hd + 2 * 2 * cfg.n_heads * hd * P / 2
    ffn = 6 * cfg.dim * cfg.ffn_dim
    rows = []
    state = {}

    def hook(i):
        def fn(mod, inp, out):
            if not state.get("on"):
                return out
            x = inp[0]
            T = x.shape[1]
            if state["how"] == "sih":
                s = smooth(heads[i](m.layers[i].input_layernorm(x)))
            else:
                s = torch.rand(1, T, generator=torch.Generator().manual_seed(i))
            keep = torch.ones(1, T, dtype=torch.bool)
            n = int(state["rate"] * (P - 5))
            idx = s[:, 4:P - 1].argsort(dim=1)[:, :n] + 4
            keep.scatter_(1, idx, False)
            keep = protect(keep, 4, 1, P)
            return out * keep[..., None].to(out.dtype)
        return fn

    hooks = [m.layers[i].self_attn.register_forward_hook(hook(i)) for i in range(2, 29)]
    for text, off in (("kjv", 300_000), ("essays", 30_000)):
        ids = torch.tensor([texts.tokens(tok, texts.load_text(text), a.ctx, offset=off)])

        def ppl():
            with torch.no_grad():
                h = m.hidden_states(ids)
                logits = m.lm_head(h[:, P - 1:-1])
            return math.exp(float(torch.nn.functional.cross_entropy(logits[0], ids[0, P:])))
        state["on"] = False
        dense = ppl()
        for r in a.rates:
            for how in ("sih", "random"):
                state.update(on=True, rate=r, how=how)
                p = ppl()
                frac_layers = 27 / cfg.n_layers
                rows.append({"text": text, "how": how, "rate": r, "rise": p / dense - 1,
                             "flops_saved_ffn_units": r * frac_layers * per_q / ffn})
                print(rows[-1], flush=True)
    for h in hooks:
        h.remove()
    out = Path(a.out)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    lines = ["# Dropping prefix tokens as attention queries (SmolLM2-135M, CPU fp32)", "",
             f"Command: `python benchmarks/query_drop.py --ctx {a.ctx}`", "",
             f"Long-document protocol at {a.ctx} tokens (prefix {P}, score 1024). Layers 2-28; the "
             "FLOPs saved are expressed in units of the prefill's total FFN FLOPs, to compare with "
             "FFN skipping at the same token rate.", "",
             "| text | picked by | rate | FLOPs saved (FFN units) | ppl rise |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['text']} | {r['how']} | {r['rate']:.2f} | {r['flops_saved_ffn_units']:.1%} | {r['rise']:+.2%} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
