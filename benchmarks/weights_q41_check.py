"""benchmarks/weights.md, the Q4_1 caveat: a grid with a *float* zero point (Q4_1's own form, w = d*q + m,
m the block minimum, blocks of 32 along the input dimension) on SmolLM2's linear weights. Not a scheme
zeroedge ships (onnxruntime's quantizer writes integer zero points); it shows what "aligned" means.

    python benchmarks/weights_q41_check.py > benchmarks/results/weights/smollm2_q41_grid_check.json
"""
import torch, json
from zeroedge import weights, texts
from zeroedge.evaluation import continuation_ppl
from zeroedge.quant.apply import LINEARS
torch.set_num_threads(2)
m, folder = weights.load("smollm2-135m"); tok = weights.tokenizer(folder)
def q41(w, g=32):
    n, k = w.shape; b = w.float().reshape(n, -1, g)
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d = (hi - lo) / 15; r = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round((b - lo) * r).clamp(0, 15)
    return (q * d + lo).reshape(n, k)
same = tot = 0; err = ref = 0.0
with torch.no_grad():
    for b in m.layers:
        for nm in LINEARS:
            lin = b.get_submodule(nm); d = q41(lin.weight.data)
            same += int((d == lin.weight.data).sum()); tot += d.numel()
            err += float(((d - lin.weight.data) ** 2).sum()); ref += float((lin.weight.data ** 2).sum())
            lin.weight.data = d
ids = torch.tensor([texts.tokens(tok, texts.load_text("licenses"), 4096)])
print(json.dumps({"exact_fraction": same / tot, "rel_rms_error": (err / ref) ** 0.5,
                  "licenses_ppl": continuation_ppl(m, ids, 1024)["ppl"]}))
