"""A cheaper page score than the sketch, under the eval contract's protocol (SmolLM2-135M, prefill N -
1024 tokens, the last 1024 scored, 10 % hot, int8 cold store, the default policy otherwise): each
page's bound on q.k from its keys' per-direction min and max (Quest's bound), in place of the sketch's
per-token scores (kv.evaluate._sketch is swapped for the bound; the policy, window and swaps are the
contract's). Variants: "sketch" (the shipped one), "full" (min / max of the exact keys),
"qproj:r=R[,b=B]" (of the keys' coordinates in the sketch's query-aware rank-R basis, optionally
rounded outward to B bits), "proj:..." (plain key PCA basis).

    python benchmarks/thermal_page_bound.py --texts essays \
        --variants "sketch;full;qproj:r=32;qproj:r=32,b=8;qproj:r=64,b=8;proj:r=32,b=8" \
        --json benchmarks/results/thermal_kv/quality_smollm2_cpu_4096_page_bound.json
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zeroedge import texts, weights  # noqa: E402
from zeroedge.kv import evaluate as E  # noqa: E402
from zeroedge.kv.attention import sketch_bases  # noqa: E402
from zeroedge.kv.policy import THERMAL, thermal_settings  # noqa: E402


class Bound:
    """Per page and kv head, the min and max of the keys' coordinates; scores(q) = the bound on q.k."""

    def __init__(self, k, page_size, how, qcov):
        nkv, P, hd = k.shape
        n = P // page_size
        self.ps, self.hd = page_size, hd
        kind, _, arg = how.partition(":")
        opts = dict(x.split("=") for x in arg.split(",") if x)
        rank = int(opts.get("r", hd))
        bits = int(opts.get("b", 0))
        if kind == "full":
            self.A = torch.eye(hd).expand(nkv, hd, hd)
            coords = k.float()
        else:
            A, B, mu, _ = sketch_bases(k, qcov if kind == "qproj" else None, rank)
            self.A = A
            coords = (k.float() - mu) @ B
        c = coords.view(nkv, n, page_size, -1)
        mn, mx = c.amin(2), c.amax(2)
        if bits:
            qm = 2 ** (bits - 1) - 1
            gran = opts.get("g", "dir")
            if gran == "dir":     # one scale per stream and direction
                s = torch.maximum(mn.abs().amax(1, keepdim=True), mx.abs().amax(1, keepdim=True)) / qm
            else:                 # one scale per page (all directions)
                s = torch.maximum(mn.abs().amax(2, keepdim=True), mx.abs().amax(2, keepdim=True)) / qm
            s = s.clamp_min(1e-8)
            mn = torch.floor(mn / s).clamp(-qm - 1, qm) * s
            mx = torch.ceil(mx / s).clamp(-qm - 1, qm) * s
        if opts.get("sym"):
            a = torch.maximum(mn.abs(), mx.abs())
            mn, mx = -a, a
        self.mn, self.mx = mn, mx
        r = mn.shape[-1]
        self.bytes = nkv * (n * r * 2 * max(bits, 8) // 8 + hd * r * 4)

    def nbytes(self):
        return self.bytes

    def scores(self, q, kv_index):
        qa = q.float() @ self.A[kv_index]                       # (H, T, r)
        mx, mn = self.mx[kv_index], self.mn[kv_index]           # (H, n, r)
        b = qa.clamp_min(0) @ mx.transpose(1, 2) + qa.clamp_max(0) @ mn.transpose(1, 2)
        return b.repeat_interleave(self.ps, dim=2) / math.sqrt(self.hd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--texts", default="essays")
    ap.add_argument("--variants", required=True, help="; separated: sketch | full[:b=8] | proj:r=32,b=8 | qproj:r=32,b=8,sym=1")
    ap.add_argument("--opts", default="{}")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(2)
    m, folder = weights.load("smollm2-135m")
    tok = weights.tokenizer(folder)
    orig = E._sketch
    rows = []
    for text in a.texts.split(","):
        ids = texts.tokens(tok, texts.load_text(text), a.ctx, what=text)
        P = E.validate(len(ids), 0.1, 16, 1024)
        pre = E.prefill(m, ids[:P], stats=False)
        full = math.exp(E.score_continuation(m, ids[P:], pre, "full", 1.0).mean().item())
        pre_th = E.quant_prefill(m, ids[:P], "int8")
        for v in a.variants.split(";"):
            o = dict(E.DEFAULTS, recent_pages=thermal_settings(THERMAL.page_size).recent_pages, cold="int8")
            o.update(json.loads(a.opts))
            if v == "sketch":
                E._sketch = orig
            else:
                def patched(cfg, li, pre_, page_size, opts, stats, v=v):
                    key = ("_bound", li, page_size, v)
                    if key not in pre_:
                        pre_[key] = Bound(pre_["k"][li], page_size, v, pre_["qcov"][li])
                    stats["summary_bytes"] = stats.get("summary_bytes", 0) + pre_[key].nbytes()
                    return pre_[key]
                E._sketch = patched
            t0 = time.perf_counter(); st = {}
            nll = E.score_continuation(m, ids[P:], pre_th, "thermal", 0.1, THERMAL.page_size, opts=o, stats=st)
            ppl = math.exp(nll.mean().item())
            row = dict(text=text, ctx=a.ctx, variant=v, opts=a.opts, full=full, ppl=ppl, rise=ppl / full - 1,
                       summary_bytes=st.get("summary_bytes"), s=time.perf_counter() - t0)
            rows.append(row); print(json.dumps(row), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))

if __name__ == "__main__":
    main()
