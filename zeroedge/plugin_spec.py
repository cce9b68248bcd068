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
PLUGIN_VERSION = "1"
PLUGIN_ABI = 1  # bump when a node's inputs, outputs or fields change

INT, FLOAT, STRING, FLOATS = "int", "float", "string", "floats"

NODES = {
    "ZeroEdgeSIH": {
        "inputs": ["x", "w1", "b1", "w2", "b2", "w3", "b3", "w4", "b4",
                   "anchor_a", "anchor_b", "anchor_c"],
        "outputs": ["keep", "base"],
        "fields": {
            "threshold": (FLOAT, None),      # keep a token when its smoothed score >= threshold
            "ma_w0": (FLOAT, 0.5),           # moving-average weight of position t
            "ma_w1": (FLOAT, 0.333333),      # ... of t-1
            "ma_w2": (FLOAT, 0.166667),      # ... of t-2
            "min_tokens": (INT, 32),         # shorter inputs keep every token
            "protect_first": (INT, 4),       # attention-sink positions always kept
            "protect_last": (INT, 1),        # the prompt's last positions always kept (logits)
            "block_size": (INT, 0),          # 0: token-granular; N: the block rule on N-token blocks
            "block_frac": (FLOAT, 0.7),      # a block skips when more than this fraction is low
            "anchor_rank": (INT, 16),        # 0: plain skipping (base is zero)
        },
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


def field_names(op: str) -> list[str]:
    return list(NODES[op]["fields"])


def required_fields(op: str) -> list[str]:
    return [k for k, (_, default) in NODES[op]["fields"].items() if default is None]
