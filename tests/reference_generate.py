"""The tests' reference generation loop: prompt prefill + sampling on the reference model, with the
mechanisms where they are allowed (the decoders are checked against it).

The zero mechanisms run in prefill (the prompt); decode steps are single tokens and bypass them
(inputs under 32 tokens). Sampling at temperature > 1.0 disables them unless forced: pruning
removes exactly the tail that creative sampling wants."""
from __future__ import annotations

import torch

from zeroedge.mechanisms.pad import ZeroRuntime, check_sampling


@torch.inference_mode()
def generate(model, prompt: list[int], max_new: int, temperature: float = 0.0,
             runtime: ZeroRuntime | None = None, force: bool = False, seed: int = 0,
             eos: int | None = None) -> tuple[list[int], dict]:
    """Returns (new tokens, info). info["mechanisms"] says whether prefill used them."""
    if max_new < 1:
        raise ValueError("max_new must be >= 1")
    use = runtime is not None and check_sampling(temperature, force)
    T = len(prompt)
    model.setup_cache(1, T + max_new)
    g = torch.Generator().manual_seed(seed)
    out = []
    try:
        if use:
            runtime.active, runtime.limit = True, None
        try:
            h = model.hidden_states(torch.tensor([prompt]), start=0)
        finally:
            if runtime is not None:
                runtime.active = False
        logits = model.lm_head(h[:, -1])
        for i in range(max_new):
            if temperature <= 0:
                nxt = int(logits.argmax(-1))
            else:
                probs = torch.softmax(logits.float() / temperature, -1)
                nxt = int(torch.multinomial(probs, 1, generator=g))
            out.append(nxt)
            if nxt == eos or i == max_new - 1:
                break
            logits = model(torch.tensor([[nxt]]), start=T + i)[:, -1]
    finally:
        model.drop_cache()
    return out, {"mechanisms": use, "temperature": temperature}
