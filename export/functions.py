"""Model-local ONNX functions for the custom nodes (domain `zeroedge`), so the portable file runs in
any onnxruntime with no custom-op library. Each body computes exactly what zeroedge.plugin_spec
describes and what the PyTorch reference (zeroedge.mechanisms) does:

ZeroEdgeSIH(x [T, D], w1..b4, anchor_a [r, D], anchor_b [D, r], anchor_c [D]) -> keep int32 [T], base [T, D]
    score = sigmoid(l4(relu(l3(relu(l2(relu(l1(x))))))))       (torch Linear layout: w [out, in])
    s     = (w0 s_t + w1 s_{t-1} + w2 s_{t-2}) / (sum of the weights present)
    keep  = s >= threshold; block rule when block_size > 0; or, rate >= 0, the rank rule (in each
            rank_block block the floor(rate * n + 0.5) lowest-scored of its n skippable positions
            skip); first protect_first and last protect_last positions kept; T < min_tokens keeps
            everything
    base  = keep ? 0 : anchor_b @ (anchor_a @ x) + anchor_c
ZeroEdgePADGather(x [T, D], keep int32 [T]) -> xs [K, D], idx int32 [K], count int32 [1]
ZeroEdgePADScatter(base [T, D], y [K, D], idx int32 [K]) -> out [T, D]
ZeroEdgePathsFFN(x [B, D], w13_t [D, 2F], wd_t [F, D]) -> y [B, D]     (float32 arithmetic, per token)
    x' = x where |x| >= threshold_in else 0; g | u = x' w13_t; a = silu(g) * u
    y  = (a where |a| >= threshold else 0) wd_t

Attribute defaults are carried by the function (`attribute_proto`), which needs IR version >= 9.
"""
from __future__ import annotations

from zeroedge import plugin_spec as spec

OPSET = 18


def _attr_ref(name: str, ref: str, kind: str):
    from onnx import AttributeProto

    a = AttributeProto()
    a.name = name
    a.ref_attr_name = ref
    a.type = AttributeProto.FLOAT if kind == spec.FLOAT else AttributeProto.INT
    return a


def _const_ref(out: str, field: str, op: str = "ZeroEdgeSIH"):
    """Constant node whose value comes from the function's attribute `field`."""
    from onnx import helper

    kind = spec.NODES[op]["fields"][field][0]
    n = helper.make_node("Constant", [], [out])
    n.attribute.append(_attr_ref("value_float" if kind == spec.FLOAT else "value_int", field, kind))
    return n


def _defaults(op: str):
    from onnx import helper

    out, required = [], []
    for name, (kind, default) in spec.NODES[op]["fields"].items():
        if default is None:
            required.append(name)
        else:
            out.append(helper.make_attribute(name, float(default) if kind == spec.FLOAT else int(default)))
    return required, out


def _fn(op, inputs, outputs, nodes):
    from onnx import helper

    required, defaults = _defaults(op)
    f = helper.make_function(spec.DOMAIN, op, inputs, outputs, nodes,
                             [helper.make_opsetid("", OPSET)], attributes=required)
    f.attribute_proto.extend(defaults)
    return f


def sih_function(chunked: bool = False):
    """ZeroEdgeSIH, or with chunked=True ZeroEdgeSIHChunk: positions start.. of a prompt_len-token prompt
    (span), the moving average continued from the carry, the next chunk's carry out."""
    from onnx import TensorProto, helper

    N = helper.make_node
    c = lambda name, value, dt=TensorProto.FLOAT: N(  # noqa: E731
        "Constant", [], [name], value=helper.make_tensor(name, dt, [], [value]))
    c1 = lambda name, values, dt=TensorProto.INT64: N(  # noqa: E731
        "Constant", [], [name], value=helper.make_tensor(name, dt, [len(values)], values))
    nodes = [
        # the head
        N("Gemm", ["x", "w1", "b1"], ["g1"], transB=1), N("Relu", ["g1"], ["h1"]),
        N("Gemm", ["h1", "w2", "b2"], ["g2"], transB=1), N("Relu", ["g2"], ["h2"]),
        N("Gemm", ["h2", "w3", "b3"], ["g3"], transB=1), N("Relu", ["g3"], ["h3"]),
        N("Gemm", ["h3", "w4", "b4"], ["g4"], transB=1),
        c1("flat", [-1]), N("Reshape", ["g4", "flat"], ["lg"]), N("Sigmoid", ["lg"], ["s"]),
        # T and positions
        N("Shape", ["s"], ["T1"]), c1("zero1", [0]), c1("one1", [1]), c1("two1", [2]),
        c("zf", 0.0), c("onef", 1.0), c("ni", 0, TensorProto.INT64), c("oi", 1, TensorProto.INT64),
        N("Squeeze", ["T1", "zero1"], ["T"]),
        N("Range", ["ni", "T", "oi"], ["pos"]),
        *(_chunk_positions(N, c1) if chunked else [
            N("Identity", ["pos"], ["apos"]), N("Identity", ["T"], ["plen"]),
            # moving average over t, t-1, t-2 (renormalised at the start)
            c1("pads1", [1, 0]), c1("pads2", [2, 0]),
            N("Pad", ["s", "pads1"], ["sp1"]), N("Pad", ["s", "pads2"], ["sp2"]),
            N("Slice", ["sp1", "zero1", "T1", "zero1"], ["s1"]),
            N("Slice", ["sp2", "zero1", "T1", "zero1"], ["s2"])]),
        _const_ref("w0", "ma_w0"), _const_ref("w1c", "ma_w1"), _const_ref("w2c", "ma_w2"),
        N("Mul", ["s", "w0"], ["m0"]), N("Mul", ["s1", "w1c"], ["m1"]), N("Mul", ["s2", "w2c"], ["m2"]),
        N("Add", ["m0", "m1"], ["m01"]), N("Add", ["m01", "m2"], ["num"]),
        N("Add", ["w0", "w1c"], ["n01"]), N("Add", ["n01", "w2c"], ["n012"]),
        N("Equal", ["apos", "ni"], ["is0"]), N("Equal", ["apos", "oi"], ["is1"]),
        N("Where", ["is1", "n01", "n012"], ["nrm1"]), N("Where", ["is0", "w0", "nrm1"], ["nrm"]),
        N("Div", ["num", "nrm"], ["sm"]),
        # threshold
        _const_ref("thr", "threshold"), N("GreaterOrEqual", ["sm", "thr"], ["keep_tok"]),
        # block rule: blocks of bs tokens skip when more than block_frac of them is low
        _const_ref("bsz", "block_size"), N("Max", ["bsz", "oi"], ["bs"]),
        N("Sub", ["bs", "oi"], ["bsm1"]), N("Add", ["T", "bsm1"], ["tpb"]), N("Div", ["tpb", "bs"], ["nb"]),
        N("Mul", ["nb", "bs"], ["Tp"]), N("Sub", ["Tp", "T"], ["padn"]),
        N("Not", ["keep_tok"], ["low_b"]), N("Cast", ["low_b"], ["low"], to=TensorProto.FLOAT),
        N("Unsqueeze", ["padn", "zero1"], ["padn1"]), N("Concat", ["zero1", "padn1"], ["bpads"], axis=0),
        N("Pad", ["low", "bpads"], ["lowp"]),
        N("Unsqueeze", ["nb", "zero1"], ["nb1"]), N("Unsqueeze", ["bs", "zero1"], ["bs1"]),
        N("Concat", ["nb1", "bs1"], ["blk_shape"], axis=0),
        N("Reshape", ["lowp", "blk_shape"], ["lowb"]), N("ReduceSum", ["lowb", "one1"], ["lowsum"], keepdims=0),
        N("Range", ["ni", "nb", "oi"], ["bidx"]), N("Sub", ["nb", "oi"], ["lastb"]),
        N("Equal", ["bidx", "lastb"], ["islast"]), N("Mul", ["lastb", "bs"], ["lastoff"]),
        N("Sub", ["T", "lastoff"], ["lastcnt"]),
        N("Where", ["islast", "lastcnt", "bs"], ["cnt_i"]), N("Cast", ["cnt_i"], ["cnt"], to=TensorProto.FLOAT),
        N("Div", ["lowsum", "cnt"], ["frac"]), _const_ref("bfrac", "block_frac"),
        N("LessOrEqual", ["frac", "bfrac"], ["keepb"]),
        N("Unsqueeze", ["keepb", "one1"], ["keepb2"]), N("Expand", ["keepb2", "blk_shape"], ["keepbe"]),
        N("Reshape", ["keepbe", "flat"], ["keepbf"]), N("Slice", ["keepbf", "zero1", "T1", "zero1"], ["keep_blk"]),
        N("Greater", ["bsz", "ni"], ["use_blk"]),
        N("Not", ["use_blk"], ["use_tok"]),           # (onnxruntime has no bool Where)
        N("And", ["use_blk", "keep_blk"], ["kr1"]), N("And", ["use_tok", "keep_tok"], ["kr2"]),
        N("Or", ["kr1", "kr2"], ["keep_thr"]),
        # protections: sinks, the prompt's last positions, short inputs
        _const_ref("pf", "protect_first"), N("Less", ["apos", "pf"], ["first"]),
        _const_ref("pl", "protect_last"), N("Sub", ["plen", "pl"], ["lastfrom"]),
        N("GreaterOrEqual", ["apos", "lastfrom"], ["last"]),
        _const_ref("mt", "min_tokens"), N("Less", ["plen", "mt"], ["short"]),
        *_rank_rule(N, c, c1),
        N("Or", ["keep_r", "first"], ["k1"]), N("Or", ["k1", "last"], ["k2"]), N("Or", ["k2", "short"], ["kb"]),
        N("Cast", ["kb"], ["keep"], to=TensorProto.INT32),
        # anchor output where skipped
        N("Gemm", ["x", "anchor_a"], ["ax"], transB=1), N("Gemm", ["ax", "anchor_b", "anchor_c"], ["anc"], transB=1),
        N("Unsqueeze", ["kb", "one1"], ["kb2"]), N("Where", ["kb2", "zf", "anc"], ["base"]),
    ]
    op = "ZeroEdgeSIHChunk" if chunked else "ZeroEdgeSIH"
    return _fn(op, spec.NODES[op]["inputs"], spec.NODES[op]["outputs"], nodes)


def _rank_rule(N, c, c1):
    """keep_r: the rank rule's keep where the rate field is >= 0, else keep_thr (the threshold and block
    rules). The chunk starts on a rank block (plugin_spec), so its blocks are rows [b*rb, (b+1)*rb);
    a position's rank counts the skippable positions of its block that score lower, or equal and
    earlier: an [nb, rb, rb] comparison, small beside the FFN it saves."""
    from onnx import TensorProto

    return [
        _const_ref("rate", "rate"), _const_ref("rbz", "rank_block"), N("Max", ["rbz", "oi"], ["rb"]),
        N("Or", ["first", "last"], ["held"]), N("Not", ["held"], ["free"]),
        c("inf", float("inf")), N("Where", ["free", "sm", "inf"], ["sr"]),
        N("Sub", ["rb", "oi"], ["rbm1"]), N("Add", ["T", "rbm1"], ["trb"]), N("Div", ["trb", "rb"], ["rnb"]),
        N("Mul", ["rnb", "rb"], ["rTp"]), N("Sub", ["rTp", "T"], ["rpadn"]),
        N("Unsqueeze", ["rpadn", "zero1"], ["rpadn1"]), N("Concat", ["zero1", "rpadn1"], ["rpads"], axis=0),
        N("Pad", ["sr", "rpads", "inf"], ["srp"]),
        N("Cast", ["free"], ["freef"], to=TensorProto.FLOAT), N("Pad", ["freef", "rpads"], ["freep"]),
        N("Unsqueeze", ["rnb", "zero1"], ["rnb1"]), N("Unsqueeze", ["rb", "zero1"], ["rb1"]),
        N("Concat", ["rnb1", "rb1"], ["rshape"], axis=0),
        N("Reshape", ["srp", "rshape"], ["sb"]), N("Reshape", ["freep", "rshape"], ["fb"]),
        N("Unsqueeze", ["sb", "two1"], ["si"]), N("Unsqueeze", ["sb", "one1"], ["sj"]),
        N("Less", ["sj", "si"], ["lower"]), N("Equal", ["sj", "si"], ["tie"]),
        N("Range", ["ni", "rb", "oi"], ["ridx"]),
        N("Unsqueeze", ["ridx", "zero1"], ["jrow"]), N("Unsqueeze", ["ridx", "one1"], ["icol"]),
        N("Less", ["jrow", "icol"], ["earlier"]), N("And", ["tie", "earlier"], ["tie_before"]),
        N("Or", ["lower", "tie_before"], ["below"]), N("Cast", ["below"], ["belowf"], to=TensorProto.FLOAT),
        N("ReduceSum", ["belowf", "two1"], ["rank"], keepdims=0),
        N("ReduceSum", ["fb", "one1"], ["nfree"], keepdims=1),
        c("half", 0.5), N("Mul", ["rate", "nfree"], ["rq"]), N("Add", ["rq", "half"], ["rqh"]),
        N("Floor", ["rqh"], ["quota"]),
        N("Less", ["rank", "quota"], ["under"]), N("Cast", ["fb"], ["fbb"], to=TensorProto.BOOL),
        N("And", ["under", "fbb"], ["skipb"]), N("Reshape", ["skipb", "flat"], ["skipf"]),
        N("Slice", ["skipf", "zero1", "T1", "zero1"], ["skip_rank"]), N("Not", ["skip_rank"], ["keep_rank"]),
        N("GreaterOrEqual", ["rate", "zf"], ["use_rank"]), N("Not", ["use_rank"], ["use_thr"]),
        N("And", ["use_rank", "keep_rank"], ["kq1"]), N("And", ["use_thr", "keep_thr"], ["kq2"]),
        N("Or", ["kq1", "kq2"], ["keep_r"]),
    ]


def _chunk_positions(N, c1):
    """ZeroEdgeSIHChunk's absolute positions apos = start + pos, the prompt's length plen, the shifted
    scores s1, s2 (the carry in front; zero before position 0) and carry_out (the last two of them)."""
    from onnx import TensorProto, helper

    return [
        c1("big1", [2**62]), c1("minus2", [-2]),
        N("Constant", [], ["two"], value=helper.make_tensor("two", TensorProto.INT64, [], [2])),
        N("Cast", ["span"], ["span64"], to=TensorProto.INT64),
        N("Gather", ["span64", "ni"], ["start"], axis=0), N("Gather", ["span64", "oi"], ["plen"], axis=0),
        N("Add", ["pos", "start"], ["apos"]),
        N("Concat", ["carry", "s"], ["ext"], axis=0),
        N("Add", ["T1", "one1"], ["T1p1"]),
        N("Slice", ["ext", "one1", "T1p1", "zero1"], ["s1r"]), N("Slice", ["ext", "zero1", "T1", "zero1"], ["s2r"]),
        N("GreaterOrEqual", ["apos", "oi"], ["has1"]), N("GreaterOrEqual", ["apos", "two"], ["has2"]),
        N("Where", ["has1", "s1r", "zf"], ["s1"]), N("Where", ["has2", "s2r", "zf"], ["s2"]),
        N("Slice", ["ext", "minus2", "big1", "zero1"], ["carry_out"]),
    ]


def gather_function():
    from onnx import TensorProto, helper

    N = helper.make_node
    nodes = [
        N("Constant", [], ["flat"], value=helper.make_tensor("flat", TensorProto.INT64, [1], [-1])),
        N("NonZero", ["keep"], ["nz"]), N("Reshape", ["nz", "flat"], ["idx64"]),
        N("Gather", ["x", "idx64"], ["xs"], axis=0),
        N("Cast", ["idx64"], ["idx"], to=TensorProto.INT32),
        N("Shape", ["idx64"], ["cnt64"]), N("Cast", ["cnt64"], ["count"], to=TensorProto.INT32),
    ]
    return _fn("ZeroEdgePADGather", ["x", "keep"], ["xs", "idx", "count"], nodes)


def scatter_function():
    from onnx import TensorProto, helper

    N = helper.make_node
    nodes = [
        N("Constant", [], ["last"], value=helper.make_tensor("last", TensorProto.INT64, [1], [-1])),
        N("Cast", ["idx"], ["idx64"], to=TensorProto.INT64),
        N("Unsqueeze", ["idx64", "last"], ["ind"]),
        N("ScatterND", ["base", "ind", "y"], ["out"]),
    ]
    return _fn("ZeroEdgePADScatter", ["base", "y", "idx"], ["out"], nodes)


def paths_function():
    from onnx import TensorProto, helper

    N = helper.make_node
    f32 = TensorProto.FLOAT
    nodes = [
        N("Constant", [], ["zf"], value=helper.make_tensor("zf", f32, [], [0.0])),
        _const_ref("tin", "threshold_in", "ZeroEdgePathsFFN"), _const_ref("thr", "threshold", "ZeroEdgePathsFFN"),
        N("Cast", ["x"], ["xf"], to=f32), N("Abs", ["xf"], ["axf"]), N("GreaterOrEqual", ["axf", "tin"], ["kin"]),
        N("Where", ["kin", "xf", "zf"], ["xk"]),
        N("Cast", ["w13_t"], ["w13f"], to=f32), N("MatMul", ["xk", "w13f"], ["gu"]),
        N("Split", ["gu"], ["g", "u"], axis=1, num_outputs=2),
        N("Sigmoid", ["g"], ["sg"]), N("Mul", ["g", "sg"], ["sil"]), N("Mul", ["sil", "u"], ["a"]),
        N("Abs", ["a"], ["aa"]), N("GreaterOrEqual", ["aa", "thr"], ["kch"]), N("Where", ["kch", "a", "zf"], ["ak"]),
        N("Cast", ["wd_t"], ["wdf"], to=f32), N("MatMul", ["ak", "wdf"], ["yf"]),
        N("CastLike", ["yf", "x"], ["y"]),
    ]
    return _fn("ZeroEdgePathsFFN", spec.NODES["ZeroEdgePathsFFN"]["inputs"], spec.NODES["ZeroEdgePathsFFN"]["outputs"],
               nodes)


def all_functions():
    return [sih_function(), sih_function(chunked=True), gather_function(), scatter_function(), paths_function()]
