"""The thermal-KV evaluation contract and the eviction peers it is measured against.

Protocol ("compress after prefill", as the peers publish it): prefill the first N - C tokens with
full attention, then score the last C tokens teacher-forced. The budget F applies to the prefix: a
continuation token may read F * (N - C) prefix tokens (the continuation's own keys stay hot).

Methods (all see the same prefill, except thermal with a compressed cold store, which sees the
serving decoder's: chunks attending to the int8 / int4 past, quant_prefill; all read the same number
of prefix tokens a step):

  full          every prefix token
  streaming     StreamingLLM: 4 sink tokens + the most recent prefix tokens
  h2o           H2O: half heavy hitters by attention accumulated over the whole prefill, half recent
  snapkv        SnapKV: the last 32 prefill queries' attention, max-pooled (kernel 7), + that window
  oracle_token  per query and query head, the exact top-F prefix tokens by score (a limit)
  oracle_page   per query and kv head, the top pages by exact max score (the retrieval limit)
  thermal       zeroedge's: sink page and a recent window always hot; every step each kv head ranks the
                other pages by a low-rank quantized key sketch (the summaries that stay on device)
                and reads the best ones through a fixed slot window (fetching the pages it lacks)

Every step of a decode is simulated exactly: the continuation is scored in one batched pass per
layer, but each query's prefix mask depends only on that query and on state from earlier steps.
"""
from __future__ import annotations

import math

from zeroedge.errors import UserError
from zeroedge.kv.policy import (COLD_BITS, THERMAL, ThermalSettings, check_ahead, cold_group, thermal_device_bytes,
                                thermal_settings, window_pages)

METHODS = ("full", "streaming", "h2o", "snapkv", "oracle_token", "oracle_page", "thermal")


# --------------------------------------------------------------------------------------------
# validation (before any work)
# --------------------------------------------------------------------------------------------
def validate(n_ids: int, budget, page_size, continuation) -> int:
    """Check the arguments; returns the prefix length: the tokens before the scored ones, rounded
    down to whole pages (the rest, fewer than a page, is read as the serving decoder reads a
    prompt's tail: teacher-forced steps whose keys stay hot, not scored). Raises UserError with
    one line."""
    try:
        b = float(budget)
    except (TypeError, ValueError):
        raise UserError(f"--kv-budget must be a number in (0, 1], got {budget!r}") from None
    if not (0.0 < b <= 1.0) or math.isnan(b):
        raise UserError(f"--kv-budget must be in (0, 1] (the hot fraction of the prefix), got {budget}")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise UserError(f"page size must be a positive integer, got {page_size!r}")
    if not isinstance(continuation, int) or continuation < 1:
        raise UserError(f"continuation must be a positive integer, got {continuation!r}")
    prefix = n_ids - continuation
    if prefix < 4 * page_size:
        raise UserError(f"context of {n_ids} tokens leaves a prefix of {prefix} tokens before the "
                        f"{continuation} scored ones; need at least {4 * page_size + continuation}")
    return prefix - prefix % page_size


# --------------------------------------------------------------------------------------------
# the model walked layer by layer (zeroedge.model.Attention.project, then the attention here)
# --------------------------------------------------------------------------------------------
def prefill(model, ids, stats: bool = True, chunk: int = 512, window: int = 32):
    """Full-attention prefill. Returns dict: k, v (per layer, (nkv, P, hd)), last_logits,
    h2o (per layer (nkv, P) attention accumulated over all prefill queries, summed over the group),
    snap (per layer (nkv, P) attention of the last `window` queries), qwin (per layer (H, window, hd))."""
    import torch
    import torch.nn.functional as F

    P = len(ids)
    cfg = model.cfg
    hd, nkv, H = cfg.head_dim, cfg.n_kv_heads, cfg.n_heads
    grp = H // nkv
    with torch.no_grad():
        tok = torch.tensor([ids])
        cos, sin = model.rope(0, P)
        x = model.embed_tokens(tok)
        out = {"k": [], "v": [], "h2o": [], "snap": [], "qwin": [], "qcov": []}
        for blk in model.layers:
            a = blk.self_attn
            q, k, v = a.project(blk.input_layernorm(x), cos, sin)
            kv_index = a.kept_heads // grp
            kk, vv = k.index_select(1, kv_index), v.index_select(1, kv_index)
            if stats:
                acc = torch.zeros(H, P)
                outs = []
                for s in range(0, P, chunk):
                    e = min(P, s + chunk)
                    sc = (q[0, :, s:e] @ kk[0, :, :e].transpose(-1, -2)) / math.sqrt(hd)
                    causal = torch.arange(e)[None, :] > torch.arange(s, e)[:, None]
                    pr = sc.masked_fill(causal, float("-inf")).softmax(-1)
                    acc[:, :e] += pr.sum(1)
                    outs.append(pr @ vv[0, :, :e])
                    if e == P:
                        snap = pr[:, -window:].sum(1)
                o = torch.cat(outs, 1)[None]
                out["h2o"].append(acc.view(nkv, grp, P).sum(1))
                out["snap"].append(snap.view(nkv, grp, P).sum(1))
                out["qwin"].append(q[0, :, -window:].clone())
            else:
                o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
                out["qwin"].append(q[0, :, -window:].clone())
            x = x + a.o_proj(o.transpose(1, 2).reshape(1, P, -1))
            x = x + blk.mlp(blk.post_attention_layernorm(x))
            qf = q[0].float()
            out["qcov"].append((qf.transpose(1, 2) @ qf).view(nkv, grp, hd, hd).sum(1) / P)
            out["k"].append(k[0].clone())
            out["v"].append(v[0].clone())
        out["last_logits"] = model.lm_head(model.norm(x[:, -1:]))[0, 0]
    return out


# --------------------------------------------------------------------------------------------
# per-layer prefix masks
# --------------------------------------------------------------------------------------------
def _budget_tokens(P, budget):
    return max(1, int(round(budget * P)))


def static_mask(method, layer, pre, budget, P, page_size=16, sinks=4, window=32, pool=7):
    """(nkv, P) bool for the eviction peers (same set for every continuation query)."""
    import torch
    import torch.nn.functional as F

    nkv = pre["k"][layer].shape[0]
    B = _budget_tokens(P, budget)
    m = torch.zeros(nkv, P, dtype=torch.bool)
    if method == "streaming":
        m[:, :min(sinks, B)] = True
        rest = B - min(sinks, B)
        if rest:
            m[:, P - rest:] = True
    elif method == "h2o":
        recent = B // 2
        if recent:
            m[:, P - recent:] = True
        score = pre["h2o"][layer].clone()
        score[:, P - recent:] = -1
        top = score.topk(B - recent, dim=-1).indices
        m.scatter_(1, top, True)
    elif method == "snapkv":
        w = min(window, B)
        m[:, P - w:] = True
        score = pre["snap"][layer]
        score = F.max_pool1d(score[:, None], pool, stride=1, padding=pool // 2)[:, 0]
        score[:, P - w:] = -1
        if B - w:
            m.scatter_(1, score.topk(B - w, dim=-1).indices, True)
    else:
        raise ValueError(method)
    return m


class Sketch:
    """Per-layer, per-kv-head low-rank quantized key sketch (the summaries that stay on device):
    zeroedge.kv.attention.quantized_sketch, the serving decoder's own, held dequantized.
    nbytes: what the decoder stores (zeroedge.kv.policy.sketch_nbytes)."""

    def __init__(self, k, rank: int = THERMAL.rank, bits: int = THERMAL.bits, qcov=None):
        from zeroedge.kv.attention import quantized_sketch
        from zeroedge.kv.policy import sketch_nbytes

        nkv, P, hd = k.shape
        self.rank, self.bits = min(rank, hd), bits
        self.A, codes, scales = quantized_sketch(k, self.rank, bits, qcov)
        self.coords = codes.float() * scales.float()[..., None]
        self.nbytes_per_head = sketch_nbytes(P, self.rank, hd)

    def nbytes(self) -> int:
        return int(self.nbytes_per_head * self.A.shape[0])

    def scores(self, q, kv_index):
        """Approximate q.k / sqrt(hd) (up to a per-query constant): (H, T, P)."""
        hd = q.shape[-1]
        return (q.float() @ self.A[kv_index]) @ self.coords[kv_index].transpose(1, 2) / math.sqrt(hd)


def page_scores(tok_scores, page_size, grp, how="mass"):
    """Token scores (H, T, P) -> per kv head page scores (nkv, T, n): max over the group's query
    heads of the page's log attention mass (softmax over the prefix per head) or of its max score."""
    H, T, P = tok_scores.shape
    n = P // page_size
    if how == "mass":
        lp = tok_scores - tok_scores.logsumexp(-1, keepdim=True)
        ps = lp.view(H, T, n, page_size).logsumexp(-1)
    elif how == "max":
        lp = tok_scores - tok_scores.logsumexp(-1, keepdim=True)
        ps = lp.view(H, T, n, page_size).amax(-1)
    else:
        raise ValueError(how)
    return ps.view(H // grp, grp, T, n).amax(1)


def topk_page_mask(ps, k, forced, page_size):
    """ps (nkv, T, n) page scores; forced (n,) bool always read. Returns ((nkv, T, P) token mask,
    (nkv, T, k) chosen page ids)."""
    import torch

    nkv, T, n = ps.shape
    ps = ps.masked_fill(forced[None, None], float("-inf"))
    k = max(0, min(k, n - int(forced.sum())))
    chosen = ps.topk(k, dim=-1).indices if k else torch.zeros(nkv, T, 0, dtype=torch.long)
    pm = forced[None, None].expand(nkv, T, n).clone()
    if k:
        pm.scatter_(2, chosen, True)
    return pm.repeat_interleave(page_size, dim=2), chosen


def window_page_mask(ps, k, forced, page_size, refresh_every=1, fetch=0, lag=0):
    """The GPU decoder's policy, step by step: a window of k slot pages per kv head (starting with
    the k pages before the forced recent ones), and every `refresh_every` steps up to `fetch`
    swaps (best missing page in, worst resident out while the new one scores higher; fetch 0 =
    no cap); with lag 1 a step attends to the window as it was before its own refresh. ps (nkv, T,
    n). Returns ((nkv, T, P) token mask, (nkv, T, k) resident page ids)."""
    import torch

    nkv, T, n = ps.shape
    ps = ps.masked_fill(forced[None, None], float("-inf"))
    k = max(0, min(k, n - int(forced.sum())))
    free = torch.nonzero(~forced).view(-1)
    resident = torch.zeros(nkv, n, dtype=torch.bool)
    resident[:, free[len(free) - k:]] = True
    F_ = fetch if fetch > 0 else k
    r = max(1, int(refresh_every))
    chosen = torch.zeros(nkv, T, k, dtype=torch.long)
    pm = torch.zeros(nkv, T, n, dtype=torch.bool)
    rows = torch.arange(nkv)
    inf = float("inf")

    def attended(t):          # step t attends to the window as it is now
        pm[:, t] = resident | forced[None]
        if k:
            chosen[:, t] = torch.nonzero(resident)[:, 1].view(nkv, k)

    for t in range(T):
        if lag:
            attended(t)
        if t % r == 0 and k:
            ms = torch.where(resident | forced[None], -inf, ps[:, t])
            rs = torch.where(resident, ps[:, t], inf)
            for _ in range(F_):
                bm, wr = ms.argmax(-1), rs.argmin(-1)
                do = ms[rows, bm] > rs[rows, wr]
                if not bool(do.any()):
                    break
                resident[rows[do], bm[do]] = True
                resident[rows[do], wr[do]] = False
                ms[rows, bm] = -inf
                rs[rows, wr] = inf
        if not lag:
            attended(t)
    return pm.repeat_interleave(page_size, dim=2), chosen


# --------------------------------------------------------------------------------------------
# continuation
# --------------------------------------------------------------------------------------------
def score_continuation(model, ids_cont, pre, method, budget, page_size=THERMAL.page_size, chunk=256, opts=None,
                       stats=None, return_logits=False):
    """Teacher-forced pass over the continuation with the method's prefix masks.
    Returns the per-token NLL (tensor, len(ids_cont)) of ids_cont given everything before it."""
    import torch
    import torch.nn.functional as F

    opts = dict(opts or {})
    grp = model.cfg.n_heads // model.cfg.n_kv_heads
    P = pre["k"][0].shape[1]
    T = len(ids_cont)
    if stats is None:
        stats = {}
    with torch.no_grad():
        tok = torch.tensor([ids_cont])
        cos, sin = model.rope(P, T)
        x = model.embed_tokens(tok)
        causal = torch.arange(T)[None, :] <= torch.arange(T)[:, None]     # (T, T)
        ahead = int(opts.get("ahead", 0)) if method == "thermal" else 0
        layers = list(model.layers)
        predicted = {}                   # ahead: layer -> the query its pages are scored with
        for li, blk in enumerate(layers):
            a = blk.self_attn
            q, k, v = a.project(blk.input_layernorm(x), cos, sin)
            if ahead:
                for t in (range(1, min(ahead, len(layers) - 1) + 1) if li == 0 else [li + ahead]):
                    if t < len(layers):
                        b = layers[t]
                        predicted[t] = b.self_attn.project(b.input_layernorm(x), cos, sin)[0]
            kv_index = a.kept_heads // grp
            pk, pv = (cold_readback(pre, li, page_size, opts)
                      if method == "thermal" and opts.get("cold", "host") != "host" else (pre["k"][li], pre["v"][li]))
            kall = torch.cat([pk[None], k], 2).index_select(1, kv_index)
            vall = torch.cat([pv[None], v], 2).index_select(1, kv_index)
            pmask = _prefix_mask(model.cfg, method, li, predicted.pop(li, q), kall, kv_index, pre, budget, page_size,
                                 opts, stats)
            o = _masked_attention(q, kall, vall, pmask, causal, P, chunk)
            x = x + a.o_proj(o.transpose(1, 2).reshape(1, T, -1))
            x = x + blk.mlp(blk.post_attention_layernorm(x))
        logits = model.lm_head(model.norm(x))[0]                          # (T, V)
        if return_logits:
            return logits
        # target of prefill's last logits is ids_cont[0]; continuation logits predict the rest
        lg = torch.cat([pre["last_logits"][None], logits[:-1]], 0).float()
        return F.cross_entropy(lg, torch.tensor(ids_cont), reduction="none")


def _prefix_mask(cfg, method, li, q, kall, kv_index, pre, budget, page_size, opts, stats):
    """Which prefix positions each query head of layer li may attend to under `method`: (H, T, P)
    bool, or None for every position ("full")."""
    import torch

    H, T, P = q.shape[1], q.shape[2], pre["k"][0].shape[1]
    if method == "full":
        return None
    if method in ("streaming", "h2o", "snapkv"):
        pmask = static_mask(method, li, pre, budget, P, page_size)
        return pmask.index_select(0, kv_index)[:, None].expand(H, T, P)
    B = _budget_tokens(P, budget)
    if method == "oracle_token":
        sc = q[0] @ kall[0, :, :P].transpose(-1, -2)
        pmask = torch.zeros(H, T, P, dtype=torch.bool)
        pmask.scatter_(2, sc.topk(B, dim=-1).indices, True)
        return pmask
    if method not in ("oracle_page", "thermal"):
        raise ValueError(f"unknown method {method}")
    n_pages, grp = P // page_size, cfg.n_heads // cfg.n_kv_heads
    kpages = max(1, B // page_size)
    if method == "thermal":             # the serving decoder's window: its fixed pages and slots
        fixed, slots = window_pages(P, budget, _settings(opts, page_size))
        kpages = fixed + slots
    forced = torch.zeros(n_pages, dtype=torch.bool)
    if method == "thermal":
        forced[: opts.get("sink_pages", THERMAL.sink_pages)] = True
        rp = opts.get("recent_pages", thermal_settings(page_size).recent_pages)
        if rp:
            forced[-rp:] = True
    if method == "oracle_page":
        sc = (q[0] @ kall[0, :, :P].transpose(-1, -2)) / math.sqrt(cfg.head_dim)
        how = opts.get("oracle_how", "max")
    else:
        sc = _sketch(cfg, li, pre, opts, stats).scores(q[0], kv_index)
        how = opts.get("how", "mass")
    ps = page_scores(sc, page_size, grp, how)
    # ahead (ThermalSettings): layer 0's refresh one step late, the others from the predicted query q
    lag = int(opts.get("lag", 0)) or int(li == 0 and int(opts.get("ahead", 0)) > 0)
    if method == "thermal" and (int(opts.get("refresh_every", 1)) > 1 or int(opts.get("fetch", 0)) > 0 or lag):
        m, chosen = window_page_mask(ps, kpages - int(forced.sum()), forced, page_size,
                                     int(opts.get("refresh_every", 1)), int(opts.get("fetch", 0)),
                                     lag)
    else:
        m, chosen = topk_page_mask(ps, kpages - int(forced.sum()), forced, page_size)
    if method == "thermal":
        stats.setdefault("chosen", []).append(chosen)
    return m.index_select(0, kv_index)


def quant_prefill(model, ids, cold: str = "int8") -> dict:
    """The serving prefill of a thermal decoder with a compressed cold store (zeroedge.model.chunked_prefill
    into zeroedge.kv.tiers.QuantKVCache: chunks attend to the int8 / int4 past): k, v (per layer,
    dequantized), qcov and last_logits, as prefill() gives them."""
    import torch

    from zeroedge.kv.tiers import QuantKVCache
    from zeroedge.model import chunked_prefill

    cfg = model.cfg
    g = cold_group(cfg.head_dim)
    dt = next(model.parameters()).dtype
    caches = [QuantKVCache.empty(COLD_BITS[cold], cfg.n_kv_heads, len(ids), cfg.head_dim, g, dt)
              for _ in model.layers]
    ks, vs, qcov, last = chunked_prefill(model, ids, caches=caches, return_last=True)
    with torch.no_grad():
        logits = model.lm_head(last)
    return {"k": list(ks), "v": list(vs), "qcov": qcov, "last_logits": logits}


def _settings(opts, page_size: int) -> ThermalSettings:
    """The serving decoder's settings for these options (kv.policy.thermal_settings where they are silent)."""
    names = ("rank", "bits", "sink_pages", "recent_pages", "fetch", "refresh_every", "lag", "ahead")
    base = thermal_settings(page_size)
    return ThermalSettings(page_size, **{k: int(opts.get(k, getattr(base, k))) for k in names})


def cold_readback(pre, li, page_size, opts):
    """Layer li's prefix K and V as the serving decoder reads them with a compressed cold store: the
    sink and recent pages (always in the window) as the prefill left them, every other page as a
    fetch brings it back (zeroedge.kv.tiers int8 / int4 codes, one fp16 scale per COLD_GROUP values)."""
    import torch

    from zeroedge.kv.tiers import dequantize, quantize

    bits = COLD_BITS[opts["cold"]]
    key = ("_cold", li, page_size, bits, opts.get("sink_pages"), opts.get("recent_pages"))
    if key not in pre:
        k, v = pre["k"][li], pre["v"][li]
        P, hd = k.shape[1], k.shape[2]
        g = cold_group(hd)
        exact = torch.zeros(P, dtype=torch.bool)
        exact[: opts.get("sink_pages", THERMAL.sink_pages) * page_size] = True
        rp = opts.get("recent_pages", thermal_settings(page_size).recent_pages)
        if rp:
            exact[P - rp * page_size:] = True
        pre[key] = tuple(torch.where(exact[None, :, None], x, dequantize(*quantize(x, bits, g), bits, g, x.dtype))
                         for x in (k, v))
    return pre[key]


def _sketch(cfg, li, pre, opts, stats):
    """Layer li's key sketch (built once: the prefix is frozen), query-aware unless qaware = 0,
    optionally blending in the observation window's queries; its bytes go to stats."""
    qcov = pre["qcov"][li] if opts.get("qaware", 1) else None
    w = float(opts.get("recent_cov", 0))
    if qcov is not None and w > 0 and pre.get("qwin"):
        # the most recent prefill queries look most like the continuation's; both normalised first
        nkv, hd = cfg.n_kv_heads, cfg.head_dim
        qw = pre["qwin"][li].float()
        cw = (qw.transpose(1, 2) @ qw).view(nkv, cfg.n_heads // nkv, hd, hd).sum(1)
        nrm = lambda c: c / c.diagonal(dim1=1, dim2=2).sum(-1)[:, None, None]  # noqa: E731
        qcov = nrm(qcov) + w * nrm(cw)
    key = ("_sketch", li, opts.get("rank", THERMAL.rank), opts.get("bits", THERMAL.bits), opts.get("qaware", 1), w)
    sk = pre.get(key)
    if sk is None:
        sk = pre[key] = Sketch(pre["k"][li], opts.get("rank", THERMAL.rank), opts.get("bits", THERMAL.bits), qcov)
    stats["summary_bytes"] = stats.get("summary_bytes", 0) + sk.nbytes()
    return sk


def _masked_attention(q, kall, vall, pmask, causal, P: int, chunk: int):
    """Attention of the continuation's queries over prefix (under pmask) + causal continuation, in
    chunks of queries."""
    import torch
    import torch.nn.functional as F

    H, T = q.shape[1], q.shape[2]
    outs = []
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        cm = causal[s:e][None].expand(H, e - s, T)
        if pmask is None:
            mask = torch.cat([torch.ones(H, e - s, P, dtype=torch.bool), cm], 2)
        else:
            mask = torch.cat([pmask[:, s:e], cm], 2)
        outs.append(F.scaled_dot_product_attention(q[:, :, s:e], kall, vall, attn_mask=mask[None]))
    return torch.cat(outs, 2)


def fetch_stats(chosen, slots: int) -> dict:
    """chosen: per layer (nkv, T, k) page ids read at each step (besides the pinned pages).
    Replays every (layer, kv head) stream through a SlotWindow of `slots` slots and counts
    fetches (misses). Returns mean / p99 pages fetched per step per stream and the total."""
    from zeroedge.kv.pages import SlotWindow

    per_step = []
    total = 0
    streams = 0
    for ch in chosen:
        nkv, T, k = ch.shape
        rows = ch.tolist()
        for h in range(nkv):
            w = SlotWindow(max(slots, k))
            streams += 1
            for t in range(T):
                _, fetched, _ = w.request(rows[h][t], k)
                if t:                       # the first step fills the window
                    per_step.append(len(fetched))
                    total += len(fetched)
    per_step.sort()
    n = max(1, len(per_step))
    return {"fetch_pages_per_step_mean": total / n,
            "fetch_pages_per_step_p99": per_step[min(len(per_step) - 1, int(0.99 * n))] if per_step else 0,
            "streams": streams}


# --------------------------------------------------------------------------------------------
# the contract used by `zeroedge eval MODEL --text FILE --ctx N --kv-budget F --json`
# --------------------------------------------------------------------------------------------
# the serving decoder's policy and sketch (kv.policy.THERMAL) and its cold store ("int8": compressed,
# what serving uses on a Jetson and on a CPU; "int4"; "host": exact pages, beside a discrete GPU); research
# options: how (page score "mass" is the decoder's, "max"), qaware (0: plain key PCA), recent_cov,
# fetch 0 (no cap on swaps a refresh)
DEFAULTS = {"rank": THERMAL.rank, "bits": THERMAL.bits, "recent_pages": THERMAL.recent_pages,
            "sink_pages": THERMAL.sink_pages, "fetch": THERMAL.fetch, "refresh_every": THERMAL.refresh_every,
            "lag": THERMAL.lag, "ahead": THERMAL.ahead, "cold": "int8", "how": "mass", "qaware": 1, "recent_cov": 0.0}


def kv_bytes(model, tokens: int) -> int:
    cfg = model.cfg
    el = next(model.parameters()).element_size()
    return 2 * cfg.n_layers * cfg.n_kv_heads * tokens * cfg.head_dim * el


def run_eval(model, ids, budget: float, page_size: int = THERMAL.page_size, continuation: int = 1024,
             **opts) -> dict:
    """Prefill ids[:P] (P: N - continuation rounded down to whole pages; validate), then score the
    last `continuation` tokens teacher-forced twice: with the full prefix KV (exact prefill) and
    with thermal KV at hot fraction `budget` of the prefix, as the serving decoder runs it (its
    prefill into a compressed cold store, its window, sketch and swaps; the continuation's own
    tokens stay hot). Returns full_kv_ppl,
    thermal_ppl, hot_kv_bytes (the window's prefix pages, into which retrieved pages are fetched,
    plus the key summaries), cold_on_device_bytes (a compressed cold store: on a Jetson's one
    DRAM), device_kv_bytes (their sum with the page table), full_kv_bytes and details, every byte
    count from kv.policy.thermal_device_bytes. Raises UserError for bad arguments before any work."""
    import time

    ids = list(ids)
    P = validate(len(ids), budget, page_size, continuation)
    unknown = set(opts) - set(DEFAULTS) - {"with_traffic"}
    if unknown:
        raise UserError(f"unknown thermal KV option(s): {', '.join(sorted(unknown))}")
    o = dict(DEFAULTS, recent_pages=thermal_settings(page_size).recent_pages)
    o.update((k, v) for k, v in opts.items() if k in DEFAULTS)
    if "rank" not in opts and model is not None:
        o["rank"] = min(o["rank"], model.cfg.head_dim)      # small heads: full-rank sketch
    if o["bits"] not in (1, 2, 3, 4) or not 2 <= int(o["rank"]) <= model.cfg.head_dim or int(o["rank"]) % 2:
        raise UserError(f"sketch rank must be even, 2..{model.cfg.head_dim}, and bits one of 1, 2, 3, 4 "
                        "(the decoder stores two codes a byte)")
    if o["sink_pages"] + o["recent_pages"] + 1 > P // page_size:
        raise UserError(f"a prefix of {P // page_size} pages cannot hold {o['sink_pages']} sink + "
                        f"{o['recent_pages']} recent pages and a slot")
    if o["lag"] not in (0, 1):
        raise UserError(f"lag must be 0 or 1 (got {o['lag']!r})")
    check_ahead(o["ahead"], o["lag"], UserError)
    if o["cold"] not in ("host", *COLD_BITS):
        raise UserError(f"cold store must be host, int8 or int4, got {o['cold']!r}")
    if model.training:
        raise ValueError("thermal KV is inference-only: call model.eval() first")
    t0 = time.perf_counter()
    pre = prefill(model, ids[:P], stats=False)
    cont = ids[P:]
    tail = len(cont) - continuation                  # < a page: read, not scored
    nll_full = score_continuation(model, cont, pre, "full", 1.0, page_size)[tail:]
    st = {}
    pre_th = quant_prefill(model, ids[:P], o["cold"]) if o["cold"] != "host" else pre
    nll_th = score_continuation(model, cont, pre_th, "thermal", float(budget), page_size, opts=o,
                                stats=st)[tail:]
    cfg = model.cfg
    fixed, slots = window_pages(P, float(budget), _settings(o, page_size))
    kb = thermal_device_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, P, 0,
                              next(model.parameters()).element_size(), float(budget), _settings(o, page_size),
                              o["cold"])
    out = {
        "full_kv_ppl": math.exp(nll_full.mean().item()),
        "thermal_ppl": math.exp(nll_th.mean().item()),
        "hot_kv_bytes": kb["hot"] + kb["summaries"],
        "full_kv_bytes": kb["prefix_full"],
        "hot_page_bytes": kb["hot"],
        "summary_bytes": kb["summaries"],
        "page_table_bytes": kb["page_table"],
        "cold_store": o["cold"],
        "cold_on_device_bytes": kb["cold_on_device"],
        "device_kv_bytes": kb["hot"] + kb["summaries"] + kb["page_table"] + kb["cold_on_device"],
        "budget": float(budget), "page_size": page_size, "prefix_tokens": P,
        "tail_tokens": tail, "scored_tokens": continuation, "hot_pages_per_head": fixed + slots, "options": o,
    }
    out["ppl_rise"] = out["thermal_ppl"] / out["full_kv_ppl"] - 1
    out["hot_fraction"] = out["hot_kv_bytes"] / kb["prefix_full"]
    if opts.get("with_traffic", True) and st.get("chosen"):
        out.update(fetch_stats(st["chosen"], slots))
    out["seconds"] = time.perf_counter() - t0
    return out


def run_bundle_eval(runner, ids, budget: float, continuation: int = 1024, page_size: int | None = None) -> dict:
    """The contract for a bundle runner (zeroedge.backends.onnxruntime.OrtRunner, what `zeroedge run
    --backend onnxruntime --kv-budget F` serves): ids[:N - continuation] prefilled, the last
    `continuation` tokens teacher-forced twice through the runner, with every position in its window
    (full KV) and with its thermal policy (zeroedge.kv.ort_policy) in the window a request of that
    prompt and that many new tokens gets (OrtThermalPolicy.window_pages). Returns full_kv_ppl,
    thermal_ppl, ppl_rise, hot_kv_bytes (the window), full_kv_bytes (the window of every position)
    and the policy's counters."""
    import time

    from zeroedge.kv.ort_policy import PAGE_SIZE, OrtThermalPolicy

    ids = [int(t) for t in ids]
    P = len(ids) - continuation
    if P < 2:
        raise UserError(f"{len(ids)} tokens leave no prompt before the {continuation} scored ones")
    t0 = time.perf_counter()
    runner.slots, runner.policy = len(ids), None
    full = _runner_nll(runner, ids, P)
    full_bytes = runner.window_bytes()
    pol = OrtThermalPolicy(page_size=page_size or PAGE_SIZE)
    runner.slots, runner.policy = pol.window_pages(runner.sinks, budget, P, continuation) * pol.P, pol
    thermal = _runner_nll(runner, ids, P)
    st = pol.stats()
    out = {"full_kv_ppl": math.exp(full), "thermal_ppl": math.exp(thermal), "hot_kv_bytes": runner.window_bytes(),
           "full_kv_bytes": full_bytes, "budget": float(budget), "page_size": pol.P, "window_slots": runner.slots,
           "prefix_tokens": P, "scored_tokens": continuation, "policy": "bundle (zeroedge.kv.ort_policy)",
           "pages_migrated": st["pages_migrated"], "store_bytes": st["store_bytes"],
           "copy_bytes": st["copy_bytes"]}
    out["ppl_rise"] = out["thermal_ppl"] / out["full_kv_ppl"] - 1
    out["seconds"] = time.perf_counter() - t0
    return out


def _runner_nll(runner, ids, P) -> float:
    """Mean negative log-likelihood of ids[P:], each token given every one before it, through a bundle
    runner: its prefill of ids[:P], then one teacher-forced decode step a token."""
    import numpy as np

    def nll(logits, target):
        x = np.asarray(logits, np.float64)
        m = x.max()
        return m + math.log(np.exp(x - m).sum()) - x[target]

    total = nll(runner.prefill(ids[:P]), ids[P])
    for t in range(P, len(ids) - 1):
        total += nll(runner.step(ids[t]), ids[t + 1])
    return total / (len(ids) - P)
