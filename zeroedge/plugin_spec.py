"""The contract between the exporter's custom ONNX nodes and the TensorRT plugin library.

One source of truth (torch-free): the graph rewrite (zeroedge.export) emits these nodes, the
pre-flight check (`zeroedge check`) validates them, and plugins/ implements them. A node's op_type is
the plugin name; the TensorRT file carries `plugin_version` / `plugin_namespace` as string
attributes, and every field is INT (read as int32), FLOAT (float32) or STRING.

The rewritten FFN of one decoder layer:

    n            = RMSNorm(h)                          (unchanged)
    keep, base   = ZeroEdgeSIH(n, W1..b4, A, B, c)     keep: int32 [T] 1 = compute the FFN,
                                                       base: [T, D] anchor output where keep = 0, else 0
    xs, idx, cnt = ZeroEdgePADGather(n, keep)          xs: [K, D] kept rows, idx: int32 [K], cnt: int32 [1]
    y            = MLP(xs)                             (unchanged gate/up/down on K rows only)
    out          = ZeroEdgePADScatter(base, y, idx)    out[idx[k]] = y[k]; other rows keep base
    h'           = h + out

A prompt prefilled in chunks uses the chunked form of the SIH node (a new node, the others are
unchanged, so no ABI bump); its decisions for the whole prompt are exactly those of ZeroEdgeSIH over
the whole prompt in one pass:

    keep, base, carry' = ZeroEdgeSIHChunk(n, W1..b4, A, B, c, carry, span)
                                                       the T rows are positions start..start+T-1 of a
                                                       prompt of prompt_len tokens: span int32 [2] =
                                                       (start, prompt_len); carry float32 [2] = the raw
                                                       scores of positions start-2, start-1 (read only
                                                       where those exist); carry' float32 [2] = those of
                                                       start+T-2, start+T-1 (the next chunk's carry).
                                                       Protections and min_tokens take absolute
                                                       positions and prompt_len; block-rule blocks are
                                                       counted from position 0 (a chunk starts on a
                                                       block boundary)

RANK RULE (rate >= 0): the prompt's positions fall in blocks of rank_block positions counted from
position 0. A position is skippable when it is in the prompt and not protected (the first protect_first,
the last protect_last). In each block of n skippable positions the floor(rate * n + 0.5) (float32)
lowest-scored skippable positions skip; ties go to the earlier position. So a layer skips the same
share of every prompt whatever its text; a chunk starts on a rank_block boundary.

The decode paths FFN of one decode step (magnitude rule of plugins/include/zeroedge_paths.h; a new
node, the others are unchanged, so no ABI bump):

    y            = ZeroEdgePathsFFN(x, w13_t, wd_t)    x, y: [B, D] (B = 1..8 tokens), w13_t = [W_gate; W_up]^T
                                                       [D, 2F], wd_t = W_down^T [F, D]; per token:
                                                       x' = x where |x| >= threshold_in else 0,
                                                       a = silu(x' w13_t[:, :F]) * (x' w13_t[:, F:]),
                                                       y = (a where |a| >= threshold else 0) wd_t

In TensorRT (plugins/src/plugin.cpp) `count` is a 0-D int32 size tensor (TensorRT requires size
tensors to be 0-D); it gives xs and idx their data-dependent first dimension K. Nothing downstream
reads `count`, so the ONNX contract above is unchanged (no ABI bump).
"""
from __future__ import annotations

DOMAIN = "zeroedge"
PLUGIN_NAMESPACE = "zeroedge"
# zeroedge's onnxruntime CPU kernels (ortops/: Q4Linear, WindowAttention): their custom-op domain
ORTOPS_DOMAIN = "zeroedge.ort"
PLUGIN_VERSION = "1"
PLUGIN_ABI = 2  # bump when a node's inputs, outputs or fields change

INT, FLOAT, STRING, FLOATS = "int", "float", "string", "floats"

NODES = {
    "ZeroEdgeSIH": {
        "inputs": ["x", "w1", "b1", "w2", "b2", "w3", "b3", "w4", "b4",
                   "anchor_a", "anchor_b", "anchor_c"],
        "outputs": ["keep", "base"],
        "fields": {
            "threshold": (FLOAT, None),      # threshold rule: keep a token when its smoothed score >= threshold
            "ma_w0": (FLOAT, 0.5),           # moving-average weight of position t
            "ma_w1": (FLOAT, 0.333333),      # ... of t-1
            "ma_w2": (FLOAT, 0.166667),      # ... of t-2
            "min_tokens": (INT, 32),         # shorter inputs keep every token
            "protect_first": (INT, 4),       # attention-sink positions always kept
            "protect_last": (INT, 1),        # the prompt's last positions always kept (logits)
            "block_size": (INT, 0),          # 0: token-granular; N: the block rule on N-token blocks
            "block_frac": (FLOAT, 0.7),      # a block skips when more than this fraction is low
            "anchor_rank": (INT, 16),        # 0: plain skipping (base is zero)
            "rate": (FLOAT, -1.0),           # < 0: the threshold rule; in [0, 1]: the rank rule (threshold
                                             # and the block rule unused), see RANK RULE above
            "rank_block": (INT, 512),        # the rank rule's blocks, counted from position 0
        },
    },
    "ZeroEdgeSIHChunk": {
        "inputs": ["x", "w1", "b1", "w2", "b2", "w3", "b3", "w4", "b4",
                   "anchor_a", "anchor_b", "anchor_c", "carry", "span"],
        "outputs": ["keep", "base", "carry_out"],
        "fields": {},                        # ZeroEdgeSIH's (below)
    },
    "ZeroEdgePADGather": {
        "inputs": ["x", "keep"],
        "outputs": ["xs", "idx", "count"],
        "fields": {},
    },
    "ZeroEdgePADScatter": {
        "inputs": ["base", "y", "idx"],
        "outputs": ["out"],
        "fields": {},
    },
    "ZeroEdgePathsFFN": {
        "inputs": ["x", "w13_t", "wd_t"],
        "outputs": ["y"],
        "fields": {
            "threshold_in": (FLOAT, None),   # a token reads input row k when |x[k]| >= threshold_in
            "threshold": (FLOAT, None),      # ... and channel j when |silu(g_j) * u_j| >= threshold
        },
    },
}


NODES["ZeroEdgeSIHChunk"]["fields"] = NODES["ZeroEdgeSIH"]["fields"]
SIH_OPS = ("ZeroEdgeSIH", "ZeroEdgeSIHChunk")

# the SIH fields' defaults, for every Python side that needs one (calibration, reference, rewrite)
SIH_DEFAULTS = {k: d for k, (_, d) in NODES["ZeroEdgeSIH"]["fields"].items() if d is not None}
BLOCK_FRAC = SIH_DEFAULTS["block_frac"]


def field_names(op: str) -> list[str]:
    return list(NODES[op]["fields"])


def required_fields(op: str) -> list[str]:
    return [k for k, (_, default) in NODES[op]["fields"].items() if default is None]


# What the plugin library accepts beyond the field types (plugins/src/fields.cpp: checkSihParams,
# checkSihShapes, checkPathsParams, checkPathsShapes; tests/test_plugins.py reads the numbers back
# from the C++ side, tests/test_tensorrt_rtx.py checks `zeroedge check` against the real builder).
LIMITS = {
    "hidden_multiple": 8,          # SIH / PAD: D a multiple of this (16-byte fp16 rows)
    "max_sih_width": 32,           # SIH head width W (w1's first dimension): 1..this
    "max_anchor_rank": 64,         # anchor_rank: 0..this
    "paths_max_batch": 8,          # PathsFFN: B (decode tokens) 1..this
    "paths_hidden_multiple": 8,    # PathsFFN: D a positive multiple of this ...
    "paths_max_hidden": 8192,      # ... at most this
    "paths_ffn_multiple": 8,       # PathsFFN: F a positive multiple of this
}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and v == v and abs(v) != float("inf")


def field_value_problems(op: str, values: dict) -> list:
    """The plugin's value rules for one node's fields (already of the right types; absent fields take
    their defaults): one message per broken rule, worded as the plugin library words it."""
    fields = NODES[op]["fields"]
    p = {k: values.get(k, default) for k, (_, default) in fields.items()}
    out = []
    if op in SIH_OPS:
        if p["threshold"] is not None and not _finite(p["threshold"]):
            out.append("field 'threshold' must be a finite number")
        w = [p["ma_w0"], p["ma_w1"], p["ma_w2"]]
        if not all(_finite(x) for x in w) or not (w[0] > 0 and w[1] >= 0 and w[2] >= 0):
            out.append("moving-average weights must be finite with ma_w0 > 0 and ma_w1, ma_w2 >= 0")
        for k in ("min_tokens", "protect_first", "protect_last", "block_size"):
            if p[k] < 0:
                out.append(f"field '{k}' must be >= 0")
        if not 0 <= p["block_frac"] <= 1:
            out.append("field 'block_frac' must be in [0, 1]")
        if not 0 <= p["anchor_rank"] <= LIMITS["max_anchor_rank"]:
            out.append(f"field 'anchor_rank' must be in 0..{LIMITS['max_anchor_rank']}, got {p['anchor_rank']}")
        if not (_finite(p["rate"]) and p["rate"] <= 1):
            out.append("field 'rate' must be a finite number <= 1 (< 0: the threshold rule)")
        if p["rank_block"] < 1:
            out.append("field 'rank_block' must be >= 1")
        if _finite(p["rate"]) and p["rate"] >= 0 and p["block_size"] > 0:
            out.append("the rank rule (rate >= 0) takes no block rule (block_size 0)")
    elif op == "ZeroEdgePathsFFN":
        for k in ("threshold_in", "threshold"):
            if p[k] is not None and not (_finite(p[k]) and p[k] >= 0):
                out.append(f"field '{k}' must be a finite number >= 0, got {p[k]}")
    return out


def shape_problems(op: str, shapes: list, values: dict) -> list:
    """The plugin's shape rules for one node, from what is known before a build: `shapes` has one entry
    per input, a list of dims (int, or None where dynamic or unknown) or None where the rank is unknown."""
    def dims(i):
        return shapes[i] if i < len(shapes) else None

    out = []
    lim = LIMITS
    if op in (*SIH_OPS, "ZeroEdgePADGather", "ZeroEdgePADScatter"):
        x = dims(0)
        name = "base" if op == "ZeroEdgePADScatter" else "x"
        if x is not None and len(x) != 2:
            out.append(f"input 0 ({name}) must be 2-D [T, D], got rank {len(x)}")
        D = x[1] if x is not None and len(x) == 2 else None
        if op in SIH_OPS:
            w1 = dims(1)
            if D is None and w1 is not None and len(w1) == 2:
                D = w1[1]
            W = w1[0] if w1 is not None and len(w1) == 2 else None
            if W is not None and not 1 <= W <= lim["max_sih_width"]:
                out.append(f"head width W = {W} is not supported (1..{lim['max_sih_width']})")
            R = values.get("anchor_rank", NODES[op]["fields"]["anchor_rank"][1])
            a = dims(9)
            if R and a is not None and len(a) == 2 and a[0] is not None and a[0] != R:
                out.append(f"input 9 (anchor_a) must be [anchor_rank, D] = [{R}, D], got {a}")
        if D is not None and D % lim["hidden_multiple"]:
            out.append(f"hidden size D = {D} is not supported: it must be a multiple of {lim['hidden_multiple']}")
    elif op == "ZeroEdgePathsFFN":
        x, w13, wd = dims(0), dims(1), dims(2)
        for i, s, form in ((0, x, "[B, D]"), (1, w13, "[D, 2F]"), (2, wd, "[F, D]")):
            if s is not None and len(s) != 2:
                out.append(f"input {i} ({NODES[op]['inputs'][i]}) must be 2-D {form}, got rank {len(s)}")
        if out:
            return out
        B = x[0] if x else None
        if B is not None and not 1 <= B <= lim["paths_max_batch"]:
            out.append(f"input 0 (x) must be [B, D] with B (decode tokens) in 1..{lim['paths_max_batch']}, got B = {B}")
        if w13 and w13[1] is not None and w13[1] % 2:
            out.append(f"input 1 (w13_t) must be [D, 2F] (gate columns, then up columns), got an odd width: {w13}")
        D = next((d for d in ((x or [None, None])[1], (w13 or [None])[0], (wd or [None, None])[1]) if d is not None), None)
        F = (wd or [None])[0]
        if F is None and w13 and w13[1] is not None:
            F = w13[1] // 2
        if D is not None and (D % lim["paths_hidden_multiple"] or not lim["paths_hidden_multiple"] <= D <= lim["paths_max_hidden"]):
            out.append(f"hidden size D = {D} is not supported: it must be a positive multiple of "
                       f"{lim['paths_hidden_multiple']}, at most {lim['paths_max_hidden']}")
        if F is not None and (F % lim["paths_ffn_multiple"] or F < lim["paths_ffn_multiple"]):
            out.append(f"FFN width F = {F} is not supported: it must be a positive multiple of {lim['paths_ffn_multiple']}")
        if D is not None and F is not None:
            if w13 and ((w13[0] is not None and w13[0] != D) or (w13[1] is not None and w13[1] != 2 * F)):
                out.append(f"input 1 (w13_t) must be [D, 2F] = [{D}, {2 * F}], got {w13}")
            if wd and ((wd[0] is not None and wd[0] != F) or (wd[1] is not None and wd[1] != D)):
                out.append(f"input 2 (wd_t) must be [F, D] = [{F}, {D}], got {wd}")
    return out
