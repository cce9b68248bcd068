"""The SIH/PAD graph rewrite (onnx-graphsurgeon).

`find_layers(graph)` finds, in any decoder graph, every RMSNorm -> gated MLP:

    n = RMSNorm(h)            Pow/Mul(x,x) -> ReduceMean -> (+eps) -> Sqrt+Div / Sqrt+Reciprocal /
                              Rsqrt -> Mul, times a weight (or one RMSNormalization-like op)
    y = down(act(gate(n)) * up(n))      two MatMul/Gemm with constant [D, F] weights reading n,
                                        joined through element-wise ops into one [F, D] MatMul
    h' = h + y                          (the residual; recorded when present)

It is structural (op types and constant weight shapes, never tensor names), so it works on zeroedge's
TorchScript export and on `torch.onnx.export(..., dynamo=True)` graphs of transformers'
LlamaForCausalLM / Qwen2ForCausalLM alike. Layers are numbered in topological order.

`rewrite(graph, layers, policies)` replaces each selected layer's FFN by

    n2 = Reshape(n, [-1, D]);  keep, base = ZeroEdgeSIH(n2, ...);  xs, idx, cnt = ZeroEdgePADGather(n2, keep)
    y2 = MLP(xs);  out = ZeroEdgePADScatter(base, y2, idx);  y = Reshape(out, Shape(n))

(batch 1: the sequence is the flattened B*T axis). With chunked=True (a prefill graph a runner feeds in
chunks) the node is ZeroEdgeSIHChunk: it also reads the graph inputs sih_span (int32 [2]: the chunk's
first position, the prompt's length) and sih_carry.{i} (float32 [2]) and writes the graph output
sih_carry_out.{i}, so layer i's score moving average runs on across chunks.

`rewrite_decode_paths(model, params)` (magnitude decode paths; `paths_from_artifact` reads
the artifact's "paths" section and refuses predictor paths) replaces each selected layer's FFN in
the *decode* graph by one node on the same normalised input:

    x = Reshape(n, [-1, D]);  y2 = ZeroEdgePathsFFN(x, w13_t, wd_t);  y = Reshape(y2, Shape(n))

with new initializers w13_t = [W_gate; W_up]^T [D, 2F], wd_t = W_down^T [F, D]; the dense gate /
up / SiLU * mul / down nodes and their weights leave the graph. The TensorRT flavour is rewritten
with plugin_dtype="float16" (the plugin takes fp16 / bf16 only): Cast(x) -> node with fp16 weights
-> Cast(y).

`mask_heads` applies head pruning to graphs that still carry the pruned heads: it zeroes the pruned
heads' rows of the o_proj weight, which is exactly equivalent to removing them; zeroedge's own export
slices them out before export instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from zeroedge import plugin_spec as spec
from zeroedge.errors import UserError

ELEMENTWISE = {"Mul", "Sigmoid", "Div", "Add", "Sub", "Tanh", "Erf", "Gelu", "Relu", "Cast", "Swish",
               "HardSigmoid", "HardSwish", "Pow", "Identity", "Softplus", "Neg", "FastGelu", "QuickGelu"}
NORM_OPS = {"RMSNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"}


class NoPattern(UserError):
    """The graph has no RMSNorm -> MLP pattern the rewrite recognises; carries a report of what was found."""

    def __init__(self, report: dict):
        self.report = report
        super().__init__("no RMSNorm -> MLP pattern found (" + summary(report) + "); nothing written")


@dataclass
class LayerMatch:
    index: int
    norm_in: object              # gs.Variable h
    norm_out: object             # gs.Variable n
    gate: object                 # gs.Node
    up: object
    down: object
    out: object                  # gs.Variable y
    dim: int
    ffn_dim: int
    residual: Optional[object] = None   # Add node h + y
    o_proj: Optional[object] = None     # MatMul node feeding the residual that made h
    names: dict = field(default_factory=dict)


# --- constants ---------------------------------------------------------------------------------
def const_value(t):
    """numpy value of a constant tensor (initializer, Constant node, or Transpose/Cast/Identity of
    one), else None."""
    import numpy as np
    import onnx_graphsurgeon as gs

    if isinstance(t, gs.Constant):
        return t.values
    if not t.inputs:
        return None
    p = t.inputs[0]
    if p.op == "Constant":
        v = p.attrs.get("value")
        return v.values if isinstance(v, gs.Constant) else (np.asarray(v) if v is not None else None)
    if p.op in ("Identity", "Cast") and len(p.inputs) == 1:
        v = const_value(p.inputs[0])
        return None if v is None else v
    if p.op == "Transpose" and len(p.inputs) == 1:
        v = const_value(p.inputs[0])
        if v is None:
            return None
        perm = p.attrs.get("perm")
        return np.transpose(v, perm) if perm is not None else v.T
    return None


def proj_weight(node):
    """[in, out] weight of a MatMul / Gemm with a constant 2-D weight, else None."""
    if node.op not in ("MatMul", "Gemm") or len(node.inputs) < 2:
        return None
    w = const_value(node.inputs[1])
    if w is None or getattr(w, "ndim", 0) != 2:
        return None
    if node.op == "Gemm" and node.attrs.get("transB", 0):
        w = w.T
    return w


# --- matching ----------------------------------------------------------------------------------
def _ffn_projections(down, max_nodes=12):
    """Walk back from `down`'s data input through element-wise ops; return the projection nodes
    found (or None if the walk meets anything else)."""
    found, seen, stack = [], set(), [down.inputs[0]]
    while stack:
        t = stack.pop()
        if id(t) in seen or const_value(t) is not None:
            continue
        seen.add(id(t))
        if not t.inputs:
            return None
        p = t.inputs[0]
        if proj_weight(p) is not None:
            found.append(p)
            continue
        if p.op not in ELEMENTWISE or len(seen) > max_nodes:
            return None
        stack.extend(p.inputs)
    return found


def _rmsnorm_input(n, max_depth=10):
    """If `n` is an RMSNorm output, return its input h; else None."""
    import onnx_graphsurgeon as gs

    if not n.inputs:
        return None
    if n.inputs[0].op in NORM_OPS:
        return n.inputs[0].inputs[0]
    walk = {"Mul", "Cast", "Div", "Reciprocal", "Sqrt", "Rsqrt", "ReduceMean", "Pow", "Add", "Sub"}
    ops, frontier, seen = {}, [n], set()
    for _ in range(max_depth):
        nxt = []
        for t in frontier:
            if not isinstance(t, gs.Variable) or not t.inputs or id(t) in seen:
                continue
            seen.add(id(t))
            p = t.inputs[0]
            ops.setdefault(p.op, []).append(p)
            var_in = [i for i in p.inputs if const_value(i) is None]
            # stop at the residual stream (an Add of two variables) and at anything not norm-like
            if p.op not in walk or (p.op == "Add" and len(var_in) > 1):
                continue
            nxt.extend(var_in)
        frontier = nxt
    if "ReduceMean" not in ops or "Sub" in ops or "MatMul" in ops or "Gemm" in ops:
        return None
    if not ({"Sqrt", "Rsqrt", "Reciprocal"} & set(ops)):
        return None
    rm = ops["ReduceMean"][0]
    sq = rm.inputs[0].inputs[0] if rm.inputs[0].inputs else None   # Pow(x, 2) or Mul(x, x)
    if sq is None or sq.op not in ("Pow", "Mul"):
        return None
    x = sq.inputs[0]
    while x.inputs and x.inputs[0].op == "Cast":                    # fp16 graphs upcast first
        x = x.inputs[0].inputs[0]
    return x


def find_layers(graph):
    """(matches, report). Raises nothing; an empty list means no pattern."""
    graph.toposort()
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    projs = [n for n in graph.nodes if proj_weight(n) is not None]
    report = {"nodes": len(graph.nodes), "const_projections": len(projs),
              "rmsnorms": 0, "gated_mlps": 0, "matched_layers": 0, "rejected": []}
    norms = sum(1 for n in graph.nodes if n.op in NORM_OPS or (
        n.op == "ReduceMean" and n.inputs[0].inputs and n.inputs[0].inputs[0].op in ("Pow", "Mul")))
    report["rmsnorms"] = norms
    matches = []
    for down in projs:
        wd = proj_weight(down)
        F, D = wd.shape
        ups = _ffn_projections(down)
        if not ups or len(ups) != 2:
            continue
        w1, w2 = proj_weight(ups[0]), proj_weight(ups[1])
        if w1.shape != (D, F) or w2.shape != (D, F):
            continue
        n = ups[0].inputs[0]
        if ups[1].inputs[0] is not n:
            report["rejected"].append(f"{down.name}: gate/up read different tensors")
            continue
        report["gated_mlps"] += 1
        h = _rmsnorm_input(n)
        if h is None:
            report["rejected"].append(f"{down.name}: MLP input {n.name} is not an RMSNorm output")
            continue
        # which of the two is the gate: the one whose output goes through an activation first
        gate, up = ups
        for c in ups[1].outputs[0].outputs:
            if c.op in ("Sigmoid", "Swish", "Gelu", "Erf", "Tanh", "FastGelu"):
                gate, up = ups[1], ups[0]
        y = down.outputs[0]
        residual = next((c for c in y.outputs if c.op == "Add" and h in c.inputs), None)
        o_proj = None
        if h.inputs and h.inputs[0].op == "Add":
            for t in h.inputs[0].inputs:
                p = t.inputs[0] if t.inputs else None
                if p is not None and p.op == "Add" and p.inputs and p.inputs[0].inputs:
                    p = p.inputs[0].inputs[0]            # MatMul + bias
                if p is not None and proj_weight(p) is not None and proj_weight(p).shape[1] == D:
                    o_proj = p
        matches.append(LayerMatch(0, h, n, gate, up, down, y, D, F, residual, o_proj))
    matches.sort(key=lambda m: order[id(m.down)])
    for i, m in enumerate(matches):
        m.index = i
    report["matched_layers"] = len(matches)
    return matches, report


def summary(report: dict) -> str:
    return (f"{report['nodes']} nodes, {report['const_projections']} MatMul/Gemm with constant "
            f"weights, {report['rmsnorms']} RMSNorm-like reductions, {report['gated_mlps']} gated "
            f"MLPs, {report['matched_layers']} RMSNorm -> MLP layers")


# --- rewriting ---------------------------------------------------------------------------------
@dataclass
class SIHParams:
    """Everything one layer's ZeroEdgeSIH node needs (weights as numpy, torch Linear layout)."""
    weights: dict                 # w1..b4, anchor_a, anchor_b, anchor_c
    threshold: Optional[float]    # the threshold rule; None: the rank rule (rate)
    ma: tuple = (0.5, 1 / 3, 1 / 6)
    min_tokens: int = 32
    protect_first: int = 4
    protect_last: int = 1
    block_size: int = 0
    block_frac: float = spec.BLOCK_FRAC
    anchor_rank: int = 0
    rate: Optional[float] = None
    rank_block: int = spec.SIH_DEFAULTS["rank_block"]

    def attrs(self) -> dict:
        # the node's threshold is a required field; a rank-rule node carries 0.0 there, unused
        return {"threshold": 0.0 if self.rate is not None else float(self.threshold), "ma_w0": float(self.ma[0]),
                "ma_w1": float(self.ma[1]), "ma_w2": float(self.ma[2]),
                "min_tokens": int(self.min_tokens), "protect_first": int(self.protect_first),
                "protect_last": int(self.protect_last), "block_size": int(self.block_size),
                "block_frac": float(self.block_frac), "anchor_rank": int(self.anchor_rank),
                "rate": -1.0 if self.rate is None else float(self.rate), "rank_block": int(self.rank_block)}


def rewrite(graph, matches, params: dict, chunked: bool = False):
    """Insert SIH / PAD nodes into the layers in `params` (layer index -> SIHParams); chunked: the
    ZeroEdgeSIHChunk form with its span / carry graph inputs and carry graph outputs."""
    import numpy as np
    import onnx_graphsurgeon as gs

    done = []
    span = None
    if chunked and any(m.index in params for m in matches):
        span = gs.Variable("sih_span", dtype=np.int32, shape=[2])
        graph.inputs.append(span)
    for m in matches:
        p = params.get(m.index)
        if p is None:
            continue
        dt = np.float32
        pre = f"zeroedge/layer{m.index}"
        n, D = m.norm_out, m.dim
        n2 = gs.Variable(f"{pre}/x", dtype=n.dtype)
        shp = gs.Constant(f"{pre}/flat_shape", np.array([-1, D], dtype=np.int64))
        graph.nodes.append(gs.Node("Reshape", f"{pre}/flatten", inputs=[n, shp], outputs=[n2]))
        w = p.weights
        consts = [gs.Constant(f"{pre}/sih.{k}", np.ascontiguousarray(w[k], dtype=dt))
                  for k in ("w1", "b1", "w2", "b2", "w3", "b3", "w4", "b4",
                            "anchor_a", "anchor_b", "anchor_c")]
        keep = gs.Variable(f"{pre}/keep", dtype=np.int32)
        base = gs.Variable(f"{pre}/base", dtype=n.dtype)
        if span is None:
            graph.nodes.append(gs.Node("ZeroEdgeSIH", f"{pre}/ZeroEdgeSIH", attrs=p.attrs(),
                                       inputs=[n2, *consts], outputs=[keep, base], domain=spec.DOMAIN))
        else:
            carry = gs.Variable(f"sih_carry.{m.index}", dtype=np.float32, shape=[2])
            carry_out = gs.Variable(f"sih_carry_out.{m.index}", dtype=np.float32, shape=[2])
            graph.inputs.append(carry)
            graph.outputs.append(carry_out)
            graph.nodes.append(gs.Node("ZeroEdgeSIHChunk", f"{pre}/ZeroEdgeSIHChunk", attrs=p.attrs(),
                                       inputs=[n2, *consts, carry, span], outputs=[keep, base, carry_out],
                                       domain=spec.DOMAIN))
        xs = gs.Variable(f"{pre}/xs", dtype=n.dtype)
        idx = gs.Variable(f"{pre}/idx", dtype=np.int32)
        cnt = gs.Variable(f"{pre}/count", dtype=np.int32)
        graph.nodes.append(gs.Node("ZeroEdgePADGather", f"{pre}/ZeroEdgePADGather",
                                   inputs=[n2, keep], outputs=[xs, idx, cnt], domain=spec.DOMAIN))
        for node in (m.gate, m.up):
            node.inputs[0] = xs
        # shapes between gate/up and down are now [K, F]: forget stale annotations
        _clear_shapes(m)
        y = m.out
        y2 = gs.Variable(f"{pre}/y_kept", dtype=y.dtype)
        m.down.outputs[0] = y2
        out2 = gs.Variable(f"{pre}/ffn_out", dtype=y.dtype)
        graph.nodes.append(gs.Node("ZeroEdgePADScatter", f"{pre}/ZeroEdgePADScatter",
                                   inputs=[base, y2, idx], outputs=[out2], domain=spec.DOMAIN))
        shape_n = gs.Variable(f"{pre}/shape", dtype=np.int64)
        graph.nodes.append(gs.Node("Shape", f"{pre}/shape_of_x", inputs=[n], outputs=[shape_n]))
        graph.nodes.append(gs.Node("Reshape", f"{pre}/unflatten", inputs=[out2, shape_n], outputs=[y]))
        done.append(m.index)
    graph.cleanup().toposort()
    return done


def _clear_shapes(m):
    seen, stack = set(), [m.down.inputs[0]]
    while stack:
        t = stack.pop()
        if id(t) in seen or not hasattr(t, "inputs") or not t.inputs:
            continue
        seen.add(id(t))
        t.shape = None
        p = t.inputs[0]
        if p in (m.gate, m.up):
            p.outputs[0].shape = None
            continue
        stack.extend(i for i in p.inputs if i is not m.norm_out)
    m.down.outputs[0].shape = None


def mask_heads(graph, matches, pruned: dict, head_dim: int, n_heads: int):
    """Zero the o_proj rows of pruned heads (layer -> [head, ...]); returns {layer: status}."""
    import numpy as np
    import onnx_graphsurgeon as gs

    status = {}
    for m in matches:
        heads = [int(h) for h in pruned.get(m.index, pruned.get(str(m.index), []))]
        if not heads:
            continue
        if m.o_proj is None:
            status[m.index] = "no o_proj found"
            continue
        w = proj_weight(m.o_proj)                              # [in, out]
        if w.shape[0] != n_heads * head_dim:
            status[m.index] = f"already sliced ({w.shape[0] // head_dim} heads)"
            continue
        w = np.array(w, copy=True)                            # weights may be shared: copy
        for h in heads:
            w[h * head_dim:(h + 1) * head_dim] = 0
        node = m.o_proj
        if node.op == "Gemm" and node.attrs.get("transB", 0):
            w = w.T
            w = np.ascontiguousarray(w)
        node.inputs[1] = gs.Constant(f"zeroedge/layer{m.index}/o_proj_pruned", np.ascontiguousarray(w))
        status[m.index] = f"masked {len(heads)} heads"
    graph.cleanup()
    return status


# --- decode paths (ZeroEdgePathsFFN) -------------------------------------------------------------
@dataclass
class PathsParams:
    """One layer's magnitude-rule decode path (zeroedge.paths.sparse.PathPolicy(method="magnitude"))."""
    threshold_in: float           # |x_k| >= threshold_in: input dim k is read (rows of w13_t)
    threshold: float              # |a_j| >= threshold: channel j is read (rows of wd_t)

    def attrs(self) -> dict:
        return {"threshold_in": float(self.threshold_in), "threshold": float(self.threshold)}


PREDICTOR_REFUSED = "predictor paths are not exported: recalibrate with the magnitude method"
PATHS_TRT_DTYPE = "float16"   # the TensorRT plugin's x / w13_t / wd_t dtype (it refuses float32)
# the plugin's shape limits (plugins/include/zeroedge_paths.h, plugins/src/fields.cpp)
PATHS_HIDDEN_MULTIPLE, PATHS_MAX_HIDDEN, PATHS_FFN_MULTIPLE = 8, 8192, 8


def paths_plugin_limits(dim: int, ffn_dim: int) -> str:
    """'' when the ZeroEdgePathsFFN plugin takes D = dim, F = ffn_dim, else what it refuses."""
    bad = []
    if dim % PATHS_HIDDEN_MULTIPLE or not 0 < dim <= PATHS_MAX_HIDDEN:
        bad.append(f"hidden size D = {dim} is not a multiple of {PATHS_HIDDEN_MULTIPLE} up to {PATHS_MAX_HIDDEN}")
    if ffn_dim % PATHS_FFN_MULTIPLE or ffn_dim <= 0:
        bad.append(f"FFN width F = {ffn_dim} is not a multiple of {PATHS_FFN_MULTIPLE}")
    return "; ".join(bad)


def paths_from_artifact(meta: dict, tensors: dict) -> dict:
    """layer index -> PathsParams for every layer the artifact's "paths" section marks sparse; {}
    when there is no paths section (the section is validated by calib_artifact). Predictor paths have
    no graph node: UserError naming the layers, never a silent dense export."""
    from zeroedge.calib_artifact import Calibration

    paths = Calibration.from_meta(meta).paths
    if paths is None:
        return {}
    if paths.kind == "whitened-lowrank-swiglu":
        raise UserError(f"{PREDICTOR_REFUSED} (layers {', '.join(map(str, paths.sparse))} use the low-rank "
                        "path predictor, which no graph node runs; the magnitude rule exports as "
                        "ZeroEdgePathsFFN)")
    return {i: PathsParams(t_in, t_act) for i, (t_in, t_act) in paths.magnitude_thresholds(tensors).items()}


def _plain_projection(node) -> bool:
    """MatMul, or a Gemm that is a plain product (no bias, alpha 1, no transA)."""
    if node.op == "MatMul":
        return len(node.inputs) == 2
    return (node.op == "Gemm" and len(node.inputs) == 2 and float(node.attrs.get("alpha", 1.0)) == 1.0
            and not node.attrs.get("transA", 0))


def _swiglu_ops(m):
    """Op types between gate/up and down when they compute silu(gate) * up, else None."""
    g_out, u_out = m.gate.outputs[0], m.up.outputs[0]
    ops, seen, stack, sig = [], set(), [m.down.inputs[0]], False
    while stack:
        t = stack.pop()
        if id(t) in seen or t is g_out or t is u_out:
            continue
        seen.add(id(t))
        if not t.inputs:
            return None
        p = t.inputs[0]
        ops.append(p.op)
        if p.op == "Sigmoid" and p.inputs[0] is g_out:
            sig = True
        if p.op not in ("Mul", "Sigmoid", "Cast", "Identity"):
            return None
        stack.extend(p.inputs)
    return ops if sig and ops.count("Mul") == 2 else None


def rewrite_paths(graph, matches, params: dict, plugin_dtype=None):
    """Replace the FFN (gate, up, SiLU * mul, down) of the layers in `params` (layer -> PathsParams)
    by one ZeroEdgePathsFFN node on the same normalised input:

        x = Reshape(n, [-1, D]);  y2 = ZeroEdgePathsFFN(x, w13_t, wd_t);  y = Reshape(y2, Shape(n))

    w13_t [D, 2F] = [W_gate; W_up]^T and wd_t [F, D] = W_down^T are new initializers; the old
    projection weights leave the graph with the dead nodes when nothing else reads them.

    plugin_dtype (e.g. numpy.float16, for the TensorRT flavour: the plugin takes fp16 / bf16 only)
    stores w13_t / wd_t in that dtype and casts x to it and y back:
    x16 = Cast(x);  y16 = ZeroEdgePathsFFN(x16, w13_t, wd_t);  y2 = Cast(y16)."""
    import numpy as np
    import onnx_graphsurgeon as gs
    from onnx import helper

    by_index = {m.index: m for m in matches}
    missing = sorted(set(params) - set(by_index))
    if missing:
        raise UserError(f"decode graph: no RMSNorm -> MLP found for path layers {missing}; nothing written")
    for i in sorted(params):
        m = by_index[i]
        if not all(_plain_projection(x) for x in (m.gate, m.up, m.down)) or _swiglu_ops(m) is None:
            raise UserError(f"decode graph layer {i}: the FFN is not down(silu(gate(x)) * up(x)) with plain "
                            "weight products, which is all ZeroEdgePathsFFN computes; nothing written")
    done = []
    for i in sorted(params):
        m, p = by_index[i], params[i]
        pre = f"zeroedge/layer{i}/paths"
        n, D = m.norm_out, m.dim
        wg, wu, wd = proj_weight(m.gate), proj_weight(m.up), proj_weight(m.down)   # [D,F] [D,F] [F,D]
        wdt0 = np.result_type(wg.dtype, wu.dtype, wd.dtype)       # the FFN's (MatMul's) dtype
        dt = np.dtype(plugin_dtype) if plugin_dtype is not None else wdt0
        w13 = gs.Constant(f"{pre}.w13_t" + ("" if plugin_dtype is None else f".{dt.name}"),
                          np.ascontiguousarray(np.concatenate([wg, wu], axis=1), dtype=dt))
        wdt = gs.Constant(f"{pre}.wd_t" + ("" if plugin_dtype is None else f".{dt.name}"),
                          np.ascontiguousarray(wd, dtype=dt))
        x = gs.Variable(f"{pre}/x", dtype=n.dtype)
        shp = gs.Constant(f"{pre}/flat_shape", np.array([-1, D], dtype=np.int64))
        graph.nodes.append(gs.Node("Reshape", f"{pre}/flatten", inputs=[n, shp], outputs=[x]))
        y2 = gs.Variable(f"{pre}/y", dtype=m.out.dtype)
        xin, yout = x, y2
        if plugin_dtype is not None:
            to = helper.np_dtype_to_tensor_dtype(dt)
            xin = gs.Variable(f"{pre}/x_{dt.name}", dtype=dt)
            yout = gs.Variable(f"{pre}/y_{dt.name}", dtype=dt)
            graph.nodes.append(gs.Node("Cast", f"{pre}/cast_in", attrs={"to": to}, inputs=[x], outputs=[xin]))
            graph.nodes.append(gs.Node("Cast", f"{pre}/cast_out",
                                       attrs={"to": helper.np_dtype_to_tensor_dtype(wdt0)},
                                       inputs=[yout], outputs=[y2]))
        graph.nodes.append(gs.Node("ZeroEdgePathsFFN", f"{pre}/ZeroEdgePathsFFN", attrs=p.attrs(),
                                   inputs=[xin, w13, wdt], outputs=[yout], domain=spec.DOMAIN))
        shape_n = gs.Variable(f"{pre}/shape", dtype=np.int64)
        graph.nodes.append(gs.Node("Shape", f"{pre}/shape_of_x", inputs=[n], outputs=[shape_n]))
        y = m.out
        m.down.outputs.clear()                     # gate, up, the activation and down go dead
        graph.nodes.append(gs.Node("Reshape", f"{pre}/unflatten", inputs=[y2, shape_n], outputs=[y]))
        done.append(i)
    graph.cleanup().toposort()
    return done


def _layers_of(graph, expect_layers: Optional[int], what: str = ""):
    """find_layers, refusing a graph with none (NoPattern) or with another count than expected."""
    matches, report = find_layers(graph)
    if not matches:
        raise NoPattern(report)
    if expect_layers is not None and len(matches) != expect_layers:
        raise UserError(f"{what}found {len(matches)} RMSNorm -> MLP layers, the model has {expect_layers} "
                        f"({summary(report)}); nothing written")
    return matches, report


def rewrite_decode_paths(model, params: dict, expect_layers: Optional[int] = None, plugin_dtype=None):
    """onnx decode ModelProto -> (rewritten ModelProto, info) with ZeroEdgePathsFFN in the layers
    of `params` (`model` itself is not modified); the model is returned as is when params is empty.
    plugin_dtype: see rewrite_paths (numpy.float16 for the TensorRT flavour)."""
    import onnx_graphsurgeon as gs

    if not params:
        return model, {"rewritten_layers": []}
    graph = gs.import_onnx(model)
    matches, report = _layers_of(graph, expect_layers, "decode graph: ")
    done = rewrite_paths(graph, matches, params, plugin_dtype)
    out = gs.export_onnx(graph)
    out.ir_version = model.ir_version
    del out.opset_import[:]
    out.opset_import.extend(model.opset_import)
    return out, {"report": report, "rewritten_layers": done}


# --- portable / TensorRT flavours ----------------------------------------------------------------
def to_portable(model):
    """Add the model-local functions and the `zeroedge` domain; IR >= 10 (attribute defaults)."""
    from zeroedge.export.functions import all_functions

    used = {n.op_type for n in model.graph.node if n.domain == spec.DOMAIN}
    del model.functions[:]
    model.functions.extend(f for f in all_functions() if f.name in used)
    _set_domain(model)
    model.ir_version = max(model.ir_version, 10)
    return model


def to_trt(model):
    """No model.functions (TensorRT 10.3 would inline them instead of using the plugins); every
    custom node carries plugin_namespace / plugin_version; INT attributes fit int32."""
    from onnx import helper

    del model.functions[:]
    for n in model.graph.node:
        if n.domain != spec.DOMAIN:
            continue
        names = {a.name for a in n.attribute}
        fields = spec.NODES.get(n.op_type, {}).get("fields", {})
        for k, (kind, default) in fields.items():   # write every field: the creator reads them all
            if k not in names and default is not None:
                n.attribute.append(helper.make_attribute(k, float(default) if kind == spec.FLOAT
                                                         else int(default)))
        if "plugin_namespace" not in names:
            n.attribute.append(helper.make_attribute("plugin_namespace", spec.PLUGIN_NAMESPACE))
        if "plugin_version" not in names:
            n.attribute.append(helper.make_attribute("plugin_version", spec.PLUGIN_VERSION))
    _set_domain(model)
    model.ir_version = max(model.ir_version, 10)
    return model


def _set_domain(model):
    from onnx import helper

    if not any(o.domain == spec.DOMAIN for o in model.opset_import):
        if any(n.domain == spec.DOMAIN for n in model.graph.node):
            model.opset_import.append(helper.make_opsetid(spec.DOMAIN, 1))


# --- calibration artifact -> per-layer params --------------------------------------------------
def params_from_artifact(meta: dict, tensors: dict) -> dict:
    """layer index -> SIHParams for every layer the artifact marks skip=True (with a threshold or a rate)."""
    import numpy as np

    from zeroedge.calib_artifact import Calibration

    cal = Calibration.from_meta(meta)
    sih = cal.sih
    if cal.skip_layers:
        sih.require_plugins(cal.where)
    out = {}
    for L in cal.skip_layers:
        pre = f"layers.{L.index}"
        try:
            w = {k: tensors[f"{pre}.sih.{k}"].float().numpy() for k in
                 ("w1", "b1", "w2", "b2", "w3", "b3", "w4", "b4")}
        except KeyError as e:
            raise UserError(f"calibration artifact lacks {e.args[0]} for layer {L.index}") from None
        D = w["w1"].shape[1]
        rank = L.anchor_rank
        if rank and f"{pre}.anchor.a" in tensors:
            for k in ("a", "b", "c"):
                w[f"anchor_{k}"] = tensors[f"{pre}.anchor.{k}"].float().numpy()
            rank = w["anchor_a"].shape[0]
        else:
            rank = 0
            w["anchor_a"] = np.zeros((1, D), np.float32)
            w["anchor_b"] = np.zeros((D, 1), np.float32)
            w["anchor_c"] = np.zeros((D,), np.float32)
        out[L.index] = SIHParams(w, L.threshold, sih.ma_weights, sih.min_tokens, sih.protect_first,
                                 sih.protect_last, L.block_size, L.block_frac, rank, L.rate, L.rank_block)
    return out


def rewrite_model(model, sih_params: dict, pruned_heads: Optional[dict] = None, head_dim: int = 0,
                  n_heads: int = 0, expect_layers: Optional[int] = None, chunked: bool = False):
    """onnx ModelProto -> (rewritten ModelProto, info). NoPattern if nothing matches. chunked: SIH
    nodes for a prefill fed in chunks (ZeroEdgeSIHChunk, see `rewrite`)."""
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(model)
    matches, report = _layers_of(graph, expect_layers)
    heads = mask_heads(graph, matches, pruned_heads or {}, head_dim, n_heads) if pruned_heads else {}
    done = rewrite(graph, matches, sih_params, chunked)
    out = gs.export_onnx(graph)
    out.ir_version = model.ir_version
    del out.opset_import[:]
    out.opset_import.extend(model.opset_import)
    return out, {"report": report, "rewritten_layers": done, "heads": heads}
