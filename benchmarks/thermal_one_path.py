"""Which policy and sketch the serving decoder and the evaluation contract share (kv.policy.THERMAL):
SmolLM2-135M on the CPU, the eval contract's protocol (prefill N - 1024 tokens, score the last
1024 teacher-forced, kv.evaluate.score_continuation, which computes what the serving decoder does:
tests/test_kv_runtime.py checks it token for token), 10 % hot, per text and setting.

    python benchmarks/thermal_one_path.py --ctx 4096 --json benchmarks/results/thermal_kv/quality_smollm2_cpu_4096_settings.json
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SETTINGS = {   # name: options over kv.evaluate.DEFAULTS
    "r16 int4, fetch 4 (former serving setting)": dict(rank=16, bits=4, fetch=4),
    "r32 int3, no fetch cap (former eval setting)": dict(rank=32, bits=3, fetch=0),
    "r16 int4, no fetch cap": dict(rank=16, bits=4, fetch=0),
    "r32 int4, fetch 4": dict(rank=32, bits=4, fetch=4),
    "r32 int4, fetch 8": dict(rank=32, bits=4, fetch=8),
    "r32 int4, no fetch cap": dict(rank=32, bits=4, fetch=0),
    "r32 int4, fetch 8, int8 cold": dict(rank=32, bits=4, fetch=8, cold="int8"),
    "r32 int4, fetch 8, every 4 steps": dict(rank=32, bits=4, fetch=8, refresh_every=4),
    # the cold store with the default policy (r32 int4, fetch 4, every step); a compressed
    # store is also what the prefill writes (chunks attend to the compressed past, kv.evaluate.quant_prefill)
    "default, exact cold pages (host)": dict(cold="host"),
    "default, int8 cold store": dict(cold="int8"),
    "default, int4 cold store": dict(cold="int4"),
    # the page-retrieval limit (the exact top pages by max score, per query and kv head) and
    # 8-token pages with the same 32 recent tokens (page_size / method are this script's keys)
    "oracle pages of 16 (exact, a limit)": dict(method="oracle_page", page_size=16, recent_pages=2),
    "oracle pages of 8 (exact, a limit)": dict(method="oracle_page", page_size=8, recent_pages=4),
    "pages of 8, 4 recent, int8 cold store": dict(cold="int8", page_size=8, recent_pages=4),
    # the refresh one step behind (its swaps serve the next step), which lets the GPU
    # decoder run it beside the rest of the step
    "default, int8 cold, lag 1": dict(cold="int8", lag=1),
    "r16, int8 cold, lag 1": dict(cold="int8", rank=16, lag=1),
    "pages of 8, 4 recent, int8 cold, lag 1": dict(cold="int8", page_size=8, recent_pages=4, lag=1),
    # does a larger fetch budget win back what the lag costs?
    "lag 1, fetch 8, int8 cold": dict(cold="int8", lag=1, fetch=8),
    "lag 1, fetch 16, int8 cold": dict(cold="int8", lag=1, fetch=16),
    # the default is pages of 8 (4 recent); the earlier default, pages of 16, for comparison
    "pages of 16, 2 recent, int8 cold store": dict(cold="int8", page_size=16, recent_pages=2),
    "pages of 16, 2 recent, int4 cold store": dict(cold="int4", page_size=16, recent_pages=2),
    "default, fetch 8 (the tokens of fetch 4 at pages of 16), int8 cold": dict(cold="int8", fetch=8),
    # rank 16 at the default pages of 8, 15.1 % device KV (the 1.5x target's <= 15 %)
    "r16, int8 cold": dict(cold="int8", rank=16),
    # pages scored a layer (or d layers) ahead, by the query layer l's weights make from
    # layer l - d's input (layer 0's refresh one step late), so the GPU decoder refreshes off the step's path
    "default, int8 cold": dict(cold="int8"),    # "default, int8 cold store" again, beside its ahead rows
    "default, int8 cold, ahead 1": dict(cold="int8", ahead=1),
    "default, int8 cold, fetch 4": dict(cold="int8", fetch=4),   # the earlier default (fetch is 8 now)
    "default, int8 cold, ahead 2": dict(cold="int8", ahead=2),
    "default, int8 cold, ahead 3": dict(cold="int8", ahead=3),
    "r16, int8 cold, ahead 1": dict(cold="int8", rank=16, ahead=1),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--texts", default="kjv,essays,licenses")
    ap.add_argument("--only", default=None, help="setting names separated by ;")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    from zeroedge import texts, weights
    from zeroedge.kv import evaluate as E
    from zeroedge.kv.policy import THERMAL, thermal_settings

    torch.set_num_threads(2)
    m, folder = weights.load("smollm2-135m")
    tok = weights.tokenizer(folder)
    names = a.only.split(";") if a.only else list(SETTINGS)
    rows = []
    for text in a.texts.split(","):
        ids = texts.tokens(tok, texts.load_text(text), a.ctx, what=text)
        P = E.validate(len(ids), a.budget, 16, 1024)      # whole pages of 8 and of 16
        pre = E.prefill(m, ids[:P], stats=False)
        full = math.exp(E.score_continuation(m, ids[P:], pre, "full", 1.0).mean().item())
        for name in names:
            ps = SETTINGS[name].get("page_size", THERMAL.page_size)   # "default": kv.policy.THERMAL
            o = dict(E.DEFAULTS, recent_pages=thermal_settings(ps).recent_pages)
            o.update(SETTINGS[name])
            method = o.pop("method", "thermal")
            o.pop("page_size", None)
            t0 = time.perf_counter()
            st = {}
            pre_th = E.quant_prefill(m, ids[:P], o["cold"]) if o["cold"] != "host" and method == "thermal" else pre
            nll = E.score_continuation(m, ids[P:], pre_th, method, a.budget, ps, opts=o, stats=st)
            ppl = math.exp(nll.mean().item())
            row = {"text": text, "ctx": a.ctx, "budget": a.budget, "setting": name, "options": o,
                   "method": method, "page_size": ps,
                   "full_kv_ppl": full, "thermal_ppl": ppl, "ppl_rise": ppl / full - 1,
                   "summary_bytes": st.get("summary_bytes", 0), "seconds": time.perf_counter() - t0}
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("text", "setting", "full_kv_ppl", "thermal_ppl", "ppl_rise")}),
                  flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
