"""Speculative decoding on a GPU: what a step that checks k drafted tokens costs against a plain step,
and the decode speed that gives with the acceptance measured on real SmolLM2 (the weights cannot
travel to the GPU machine). Random weights at the llama-3.2-1b shape, bf16, KV at `--ctx`.

    PYTHONPATH=$PWD python3 benchmarks/gpu/speculative_gpu.py --ctx 8192 \
        --traces benchmarks/results/speculative/smollm2_greedy_traces.json \
        --alpha benchmarks/results/speculative/packed_drafter_acceptance_smollm2_cpu.json \
        -o benchmarks/results/speculative/gpu_llama1b_8k.json

Measured (CUDA events, median of `--steps`):
  run path     zeroedge.runtime.fast.DenseDecoder: a plain step and Decoder.verify of 2..9 tokens,
               each one CUDA graph (Triton split attention for the step, zeroedge.kv.paged_attention over
               the cache as one page for verify)
  engine path  zeroedge.serve.batch.BatchStep (what `zeroedge serve` steps: paged attention, a CUDA
               graph per row count): one decode row and a verify segment of 2..9 rows
  drafter      the packed drafter `zeroedge run --speculative packed` uses on CUDA
               (zeroedge.serve.backends.DecoderDraftModel: the model's weights as int4 g128 symmetric
               packed forms, an int8 head, int8 inputs: dp4a), its CUDA-graph step with the whole head
               and with the head over a draft vocabulary (zeroedge.speculative.draft_vocabulary of a
               random prompt of `--ctx` tokens), attending over every position, and as shipped:
               over 4 sinks and the last DecoderDraftModel.WINDOW positions
Composed:
  ngram        each SmolLM2 greedy trace (prompt and reply, from benchmarks/speculative_cpu.py's
               prompts) replayed through zeroedge.speculative.Speculator in auto mode with the step
               costs above: tokens/s against plain decoding on the same path
  packed       tokens/s of draft-k-then-verify at the per-token acceptance measured on SmolLM2 (fp32
               target against its int4 g128 drafter; `alpha` with the whole head, `alpha_draft_vocab`
               with the restricted one): E(k) / (k t_draft + t_verify(k+1)), device time only
  replayed     the shipped drafter (window, restricted head) replayed position by position on what
               SmolLM2's windowed drafter did there (agreed or not, its top probability): drafts of
               up to k tokens ending after one below `min_confidence` (DecoderDraftModel.MIN_CONFIDENCE;
               0: never), each round k' drafter steps and a check of k' + 1 rows; over the greedy
               replies (`traces`) and over greedy replies at 8K positions (`long`)
`--replay-from RAW` recomputes `replayed` from RAW's step times on a CPU.
End to end (`--e2e`): ServingSession.generate with --speculative off and packed on a random prompt of
`--ctx` tokens, 128 new: tokens/s with the host's work included, at the acceptance random weights give.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn, steps: int) -> float:
    """Median milliseconds of fn() over `steps` runs (CUDA events), after two warm-ups."""
    import bench_setup as bs

    return statistics.median(bs.event_ms(fn, steps, warm=2))


def replay(trace, t_plain: float, t_verify: dict) -> dict:
    """A greedy trace replayed through an auto-mode Speculator whose steps cost the measured times."""
    from zeroedge.speculative import Speculator, agreed

    prompt, out = trace["prompt"], trace["out"]
    spec = Speculator.create("auto", prompt + out[:1])
    i, t = 1, 0.0
    while i < len(out):
        d = spec.propose(len(out) - i - 1)
        a = agreed(d, out[i:])
        made = out[i:i + a + 1]
        dt = t_verify[len(d) + 1] if d else t_plain
        spec.cost.observe(len(d), dt)
        spec.update(len(d), a, made)
        i, t = i + len(made), t + dt
    n = len(out) - 1
    return {"speedup": (n / t) / (1 / t_plain), **spec.stats.to_dict()}


def replay_packed(agreed, confidence, k: int, min_confidence: float, t_draft: float, t_plain: float,
                  t_verify: dict) -> float:
    """Speed-up over plain steps of drafts of up to k tokens (ending after a token drafted with less
    than min_confidence) on a recorded sequence: agreed[i], confidence[i] what the drafter did at
    position i given the true prefix."""
    i, t, n = 0, 0.0, len(agreed)
    while i < n:
        d = 1
        while d < min(k, n - i) and confidence[i + d - 1] >= min_confidence:
            d += 1
        a = 0
        while a < d and agreed[i + a]:
            a += 1
        t += d * t_draft + t_verify[d + 1]
        i += a + 1
    return n * t_plain / t


def replayed(ms: dict, acc: dict) -> dict:
    """The shipped drafter replayed (see the module doc) on the step times `ms` and the recorded
    acceptance `acc`: per threshold, path and recorded set, the speed-up at each k of 1..8 and the best."""
    from zeroedge.serve.backends import DecoderDraftModel

    out = {"min_confidence_shipped": DecoderDraftModel.MIN_CONFIDENCE, "rows": []}
    t_draft = ms["packed_drafter_step_draft_vocab_window"]
    for where, rows in (("traces", acc["rows"]), ("long", acc.get("long", {}).get("rows", {}))):
        seqs = [(r["window_agreed"], r["window_confidence"]) for r in rows.values()]
        for tau in (0.0, 0.3, 0.5, 0.7) if seqs else ():
            for path in ("run", "engine"):
                plain, ver = ms[f"{path}_plain_step"], {int(k): v for k, v in ms[f"{path}_verify"].items()}
                by_k = [statistics.mean(replay_packed(ag, cf, k, tau, t_draft, plain, ver) for ag, cf in seqs)
                        for k in range(1, 9)]
                best = max(range(8), key=lambda i: by_k[i])
                out["rows"].append({"on": where, "min_confidence": tau, "path": path, "speedup": by_k[best],
                                    "k": best + 1, "speedup_by_k": by_k})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--traces", required=True)
    ap.add_argument("--alpha", required=True)
    ap.add_argument("--e2e", action="store_true", help="also `run`'s packed drafter end to end")
    ap.add_argument("--replay-from", help="a raw file of this script: its step times replayed again on --alpha "
                    "(no GPU; the other sections are kept)")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    if a.replay_from:
        res = json.loads(Path(a.replay_from).read_text())
        res["replayed"] = replayed(res["ms"], json.loads(Path(a.alpha).read_text()))
        Path(a.output).write_text(json.dumps(res, indent=1))
        return

    import bench_setup as bs

    from zeroedge.runtime.fast import DenseDecoder
    from zeroedge.serve.backends import DecoderDraftModel
    from zeroedge.serve.batch import BatchStep, PagedKV, Segment
    from zeroedge.speculative import draft_vocabulary

    dev = torch.device("cuda")
    G = 64
    m = bs.build_model(a.model, "cuda", torch.bfloat16, max_seq_len=a.ctx + G)
    cfg = m.cfg
    Ts = list(range(2, 10))
    res = {"what": "speculative decoding step costs on a GPU and the composed decode speed",
           "device": torch.cuda.get_device_name(), "model": f"{a.model} shape, random weights, bf16",
           "ctx": a.ctx, "args": vars(a)}
    # run path
    dec = DenseDecoder(m, a.ctx + G)
    dec.attention.kv.normal_()
    toks = [7] * 9
    run_plain = timed(lambda: dec.step(7, a.ctx), a.steps)
    run_verify = {T: timed(lambda T=T: dec.verify(toks[:T], a.ctx), a.steps) for T in Ts}
    del dec
    torch.cuda.empty_cache()
    # engine path
    ps = 16
    pool = PagedKV(cfg, -(-(a.ctx + G) // ps), ps, dev, torch.bfloat16)
    pool.k.normal_()
    pool.v.normal_()
    step = BatchStep(m, pool)
    pages = pool.alloc(pool.n_pages)
    eng_plain = timed(lambda: step.forward([Segment(pages, [7], a.ctx)]), a.steps)
    eng_verify = {T: timed(lambda T=T: step.forward([Segment(pages, toks[:T], a.ctx, verify=True)]), a.steps)
                  for T in Ts}
    del step, pool
    torch.cuda.empty_cache()
    # the packed 4-bit drafter over every position: the whole head, then a draft vocabulary
    draft = DecoderDraftModel(m, a.ctx + G, window=None)
    draft.dec.attention.kv.normal_()
    t_draft_whole = timed(lambda: draft.dec.step(7, a.ctx), a.steps)
    prompt = torch.randint(0, cfg.vocab_size, (a.ctx,), generator=torch.Generator().manual_seed(0)).tolist()
    vocab = draft_vocabulary(cfg.vocab_size, prompt, draft.VOCAB)
    draft.dec.restrict_head(vocab)
    t_draft = timed(lambda: draft.dec.step(7, a.ctx), a.steps)
    t_draft_64 = timed(lambda: draft.dec.step(7, 64), a.steps)      # the same with 64 positions of KV
    del draft
    # as shipped: over the sinks and the last WINDOW positions
    draft = DecoderDraftModel(m, a.ctx + G)
    draft.dec.attention.kv.normal_()
    draft.dec.restrict_head(vocab)
    t_draft_window = timed(lambda: draft.dec.step(7, a.ctx), a.steps)
    sinks = draft.dec.attention.sinks
    del draft
    torch.cuda.empty_cache()
    res["ms"] = {"run_plain_step": run_plain, "run_verify": run_verify, "engine_plain_step": eng_plain,
                 "engine_verify": eng_verify, "packed_drafter_step_whole_head": t_draft_whole,
                 "packed_drafter_step_draft_vocab": t_draft, "packed_drafter_step_draft_vocab_at_64": t_draft_64,
                 "packed_drafter_step_draft_vocab_window": t_draft_window, "draft_vocab": DecoderDraftModel.VOCAB,
                 "window": DecoderDraftModel.WINDOW, "sinks": sinks}
    print(json.dumps(res["ms"]), flush=True)

    traces = json.loads(Path(a.traces).read_text())["traces"]
    res["ngram"] = {}
    for name, tr in traces.items():
        res["ngram"][name] = {"run": replay(tr, run_plain, run_verify), "engine": replay(tr, eng_plain, eng_verify)}
        print(name, json.dumps(res["ngram"][name]), flush=True)
    acc = json.loads(Path(a.alpha).read_text())
    res["packed"] = {"alpha": acc["alpha"], "alpha_draft_vocab": acc["alpha_draft_vocab"], "rows": []}
    for head, alpha, td in (("whole", acc["alpha"], t_draft_whole), ("draft_vocab", acc["alpha_draft_vocab"], t_draft)):
        for k in range(1, 8):
            e = (1 - alpha ** (k + 1)) / (1 - alpha)
            for path, plain, ver in (("run", run_plain, run_verify), ("engine", eng_plain, eng_verify)):
                t = k * td + ver[k + 1]
                res["packed"]["rows"].append({"head": head, "k": k, "path": path, "expected_tokens": e,
                                              "speedup": (e / t) / (1 / plain)})
    print(json.dumps(res["packed"]), flush=True)
    res["replayed"] = replayed(res["ms"], acc)
    print(json.dumps(res["replayed"]), flush=True)
    if a.e2e:
        from speculative_cpu import first_difference

        from zeroedge.serve.session import ServingSession

        sess = ServingSession(m)
        p = prompt[:a.ctx - 128]
        sess.generate(p, 128, speculative="packed")         # warm-up: graphs, the drafter at this size
        res["e2e"] = {}
        for mode in ("off", "packed", "off", "packed"):
            r = sess.generate(p, 128, speculative=mode)
            row = res["e2e"].setdefault(mode, {"tok_s": [], "tokens": r.tokens})
            row["tok_s"].append(r.tokens_per_s)
            off = res["e2e"]["off"]["tokens"]
            row["tokens_as_off_before_a_difference"] = first_difference(r.tokens, off)
            row["speculative"] = r.detail.get("speculative")
        for row in res["e2e"].values():
            row.pop("tokens")
        print(json.dumps(res["e2e"]), flush=True)
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
