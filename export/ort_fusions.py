"""Fusions onnxruntime does not find itself, written into the portable decode graph (com.microsoft
ops: the portable flavour only; the TensorRT graphs keep standard ONNX, and the prefill graphs keep
their form). fuse_decode applies the first two; a bundle exported with --cpu-kernels zeroedge also
gets the last two (zeroedge.ort ops, ortops/):

skip_rmsnorms: a residual Add whose sum feeds an RMSNorm and the rest of the residual stream ->
one SkipSimplifiedLayerNormalization (its 4th output is the sum). onnxruntime fuses Add +
SimplifiedLayerNormalization only when the sum has no other reader, which is never the case in a
pre-norm transformer: 2 nodes fewer a layer.

side_product_gemms: the float zero point's offset product and its Add (quantize_graph._offset_nodes:
(x @ E) @ C + y_sym) -> Gemm(x @ E, C, y_sym), for graphs whose activations are 2-D (the decode
graph). onnxruntime's own MatMul + Add fusion takes most of them, not those whose shapes it cannot
infer (the o_proj's, after the attention's Reshape).

q4_linears: each 4-bit MatMulNBits (with its side product, for a float zero point) -> one
zeroedge.ort Q4Linear.

q8_linears: the 8-bit LM head's MatMulNBits -> one zeroedge.ort Q8Linear (int16 inputs).

swiglu_q4_linears: the gate / up Q4Linear, its Split and silu(gate) * up -> one Q4Linear with a
SwiGLU epilogue. (The attention's zeroedge.ort WindowAttention nodes come from the exporter itself:
onnx_export.window_attention_op.)
"""
from __future__ import annotations

from zeroedge.plugin_spec import ORTOPS_DOMAIN


def fuse_decode(model) -> dict:
    """Both fusions on a portable decode graph (2-D activations), in place; returns their counts."""
    return {"skip_rmsnorms": skip_rmsnorms(model), "side_product_gemms": side_product_gemms(model)}


def _index(graph) -> tuple:
    """(initializers by name, each output's producing node, each name's reading nodes)."""
    producer = {o: n for n in graph.node for o in n.output}
    readers = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    return {t.name: t for t in graph.initializer}, producer, readers


def _set_nodes(graph, nodes) -> None:
    """The graph's nodes become `nodes`, less those whose outputs nothing reads any more (a fusion's
    leftovers: block sums, Casts); initializers that no node reads are dropped."""
    while True:
        used = {i for n in nodes for i in n.input} | {o.name for o in graph.output}
        keep = [n for n in nodes if any(o in used for o in n.output)]
        if len(keep) == len(nodes):
            break
        nodes = keep
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for n in nodes for i in n.input}
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)


def _stored_scales(name: str, inits: dict, producer: dict):
    """A MatMulNBits' scales as zeroedge's kernels read them: the initializer behind a Cast to float, or a
    float initializer; None when they are neither (the node's input is then not float32 either, or
    not constant: it keeps MatMulNBits)."""
    from onnx import TensorProto, helper

    c = producer.get(name)
    if c is not None and c.op_type == "Cast" and c.input[0] in inits:
        to = next((helper.get_attribute_value(a) for a in c.attribute if a.name == "to"), None)
        src = inits[c.input[0]].data_type in (TensorProto.FLOAT16, TensorProto.FLOAT)
        return c.input[0] if to == TensorProto.FLOAT and src else None
    return name if name in inits and inits[name].data_type == TensorProto.FLOAT else None


def _const(graph, inits: dict, name: str):
    """A scalar constant's value (an initializer or a Constant node's output), or None."""
    from onnx import numpy_helper

    if name in inits:
        a = numpy_helper.to_array(inits[name])
        return float(a.reshape(-1)[0]) if a.size == 1 else None
    for n in graph.node:
        if n.op_type == "Constant" and n.output[0] == name:
            for at in n.attribute:
                if at.name == "value" and at.t.data_location != 1:
                    a = numpy_helper.to_array(at.t)
                    return float(a.reshape(-1)[0]) if a.size == 1 else None
    return None


def _match_rmsnorm(graph, inits: dict, producer: dict, readers: dict, mean):
    """From a ReduceMean over the last axis: x -> Pow(x, 2) -> ReduceMean -> + eps -> Sqrt ->
    1 / . -> x * . -> [Cast] -> * gamma, the form torch exports zeroedge.model.RMSNorm in.
    Returns (x, gamma, eps, chain nodes, output) or None."""
    def only_reader(name, op):
        r = readers.get(name, [])
        return r[0] if len(r) == 1 and r[0].op_type == op else None

    sq = producer.get(mean.input[0])
    if (sq is None or sq.op_type != "Pow" or _const(graph, inits, sq.input[1]) != 2.0
            or len(mean.input) < 2 or _const(graph, inits, mean.input[1]) != -1.0):
        return None
    x = sq.input[0]
    add = only_reader(mean.output[0], "Add")
    if add is None:
        return None
    eps = _const(graph, inits, add.input[1])
    sqrt = only_reader(add.output[0], "Sqrt")
    div = sqrt and only_reader(sqrt.output[0], "Div")
    if eps is None or div is None or div.input[1] != sqrt.output[0] or _const(graph, inits, div.input[0]) != 1.0:
        return None
    mul = only_reader(div.output[0], "Mul")
    if mul is None or x not in mul.input:
        return None
    chain = [sq, mean, add, sqrt, div, mul]
    nxt = readers.get(mul.output[0], [])
    if len(nxt) == 1 and nxt[0].op_type == "Cast":
        chain.append(nxt[0])
        nxt = readers.get(nxt[0].output[0], [])
    if len(nxt) != 1 or nxt[0].op_type != "Mul":
        return None
    scale = nxt[0]
    gamma = scale.input[1] if scale.input[0] == chain[-1].output[0] else scale.input[0]
    return x, gamma, eps, chain + [scale], scale.output[0]


def skip_rmsnorms(model) -> int:
    """Residual Add + RMSNorm -> com.microsoft SkipSimplifiedLayerNormalization, in place (see the
    module's docstring). The sum keeps its name (the node's 4th output), so the residual stream reads
    it as before. Returns the number of fusions."""
    from onnx import TensorProto, helper

    g = model.graph
    inits, producer, readers = _index(g)
    gone, new = set(), {}
    for mean in list(g.node):
        if mean.op_type != "ReduceMean":
            continue
        m = _match_rmsnorm(g, inits, producer, readers, mean)
        if m is None:
            continue
        x, gamma, eps, chain, out = m
        cast = producer.get(x)                  # torch's x.float(): a Cast to float of the sum
        total = cast.input[0] if cast is not None and cast.op_type == "Cast" and any(
            a.name == "to" and a.i == TensorProto.FLOAT for a in cast.attribute) else x
        add = producer.get(total)
        if add is None or add.op_type != "Add" or any(i in inits or _const(g, inits, i) is not None
                                                      for i in add.input):
            continue
        gone.update(id(n) for n in chain + [add])
        new[id(add)] = helper.make_node(
            "SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], gamma], [out, "", "", total],
            name=add.name + "_SkipRMSNorm", domain="com.microsoft", epsilon=eps)
    if not new:
        return 0
    # the fused node takes the Add's place: its inputs are there already, and every reader of its
    # outputs (the sum's, the norm's) came after the Add, so the order stays topological
    _set_nodes(g, [new.get(id(n), n) for n in g.node if id(n) not in gone or id(n) in new])
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return len(new)


def side_product_gemms(model) -> int:
    """(x @ E) @ C + y_sym -> one Gemm, in place, where the MatMul is an offset product of
    quantize_graph._offset_nodes (named *_Offset) read by one Add. Only for graphs
    whose activations are 2-D (Gemm's A); returns the number of fusions."""
    from onnx import helper

    g = model.graph
    _, _, readers = _index(g)
    gone, new = set(), {}
    for mm in g.node:
        if mm.op_type != "MatMul" or not mm.name.endswith("_Offset"):
            continue
        r = readers.get(mm.output[0], [])
        if len(r) != 1 or r[0].op_type != "Add":
            continue
        add = r[0]
        y_sym = add.input[1] if add.input[0] == mm.output[0] else add.input[0]
        gone.add(id(mm))
        new[id(add)] = helper.make_node("Gemm", [mm.input[0], mm.input[1], y_sym], list(add.output),
                                        name=mm.name)          # still the offset product
    _set_nodes(g, [new.get(id(n), n) for n in g.node if id(n) not in gone])
    return len(new)


def q4_linears(model) -> int:
    """Each 4-bit MatMulNBits -> one zeroedge.ort Q4Linear(x, B, S[, offsets]), in place: zeroedge's
    onnxruntime CPU kernel (ortops/q4_linear.cc) reads the same codes and the float16-stored S behind
    its Cast. A float zero point's MatMulNBits and its side product (MatMulNBits(x) + Gemm(x @ E, C),
    after side_product_gemms) become one node reading C (no fp32 side-product matrix); an integer
    zero point's node reads MatMulNBits' zero points; a symmetric one none. Blocks of 32 to 256 (the
    kernel works in blocks of 32; g16 keeps MatMulNBits). Its inputs are rounded per block of 32 as
    MatMulNBits' accuracy level asks: to int8 at level 4, else to int16 (as good as exact). Returns
    the number of fusions."""
    from onnx import TensorProto, helper

    g = model.graph
    inits, producer, readers = _index(g)

    def stored(name):                       # the float16 initializer behind a Cast, else the name
        c = producer.get(name)
        return c.input[0] if c is not None and c.op_type == "Cast" and c.input[0] in inits else name

    def q4linear(mm, at, inputs, outputs):
        return helper.make_node("Q4Linear", inputs, outputs, name=mm.name + "_Q4Linear", domain=ORTOPS_DOMAIN,
                                K=int(at["K"]), N=int(at["N"]), block_size=int(at["block_size"]),
                                input_bits=8 if at.get("accuracy_level", 0) == 4 else 16)

    def attrs(mm):
        at = {a.name: helper.get_attribute_value(a) for a in mm.attribute}
        ok = at.get("bits", 4) == 4 and at.get("block_size") in (32, 64, 128, 256)
        return at if ok else None

    gone, new = set(), {}
    for gemm in g.node:                     # float zero point: MatMulNBits + its side product
        if gemm.op_type != "Gemm" or not gemm.name.endswith("_Offset") or len(gemm.input) != 3:
            continue
        bsum, c, y_sym = gemm.input
        mm, bs = producer.get(y_sym), producer.get(bsum)
        if mm is None or mm.op_type != "MatMulNBits" or len(mm.input) != 3 or bs is None or bs.op_type != "MatMul":
            continue
        at, scales = attrs(mm), _stored_scales(mm.input[2], inits, producer)
        if at is None or scales is None or bs.input[0] != mm.input[0] or len(readers[y_sym]) != 1:
            continue
        gone.add(id(mm))
        new[id(gemm)] = q4linear(mm, at, [mm.input[0], mm.input[1], scales, stored(c)], list(gemm.output))
    for mm in g.node:                       # integer zero points, or none (symmetric)
        if mm.op_type != "MatMulNBits" or id(mm) in gone or len(mm.input) not in (3, 4):
            continue
        at, scales = attrs(mm), _stored_scales(mm.input[2], inits, producer)
        if at is None or scales is None or mm.input[1] not in inits or (len(mm.input) == 4 and (
                mm.input[3] not in inits or inits[mm.input[3]].data_type != TensorProto.UINT8)):
            continue
        new[id(mm)] = q4linear(mm, at, [mm.input[0], mm.input[1], scales] + list(mm.input[3:]), list(mm.output))
    if not new:
        return 0
    _set_nodes(g, [new.get(id(n), n) for n in g.node if id(n) not in gone])
    if not any(o.domain == ORTOPS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(ORTOPS_DOMAIN, 1))
    return len(new)


def q8_linears(model) -> int:
    """Each 8-bit MatMulNBits with blocks of 32 and no zero points (the tied embedding's LM head) ->
    one zeroedge.ort Q8Linear(x, B, S), in place: int16-rounded inputs where onnxruntime's 8-bit
    kernel runs at accuracy level 4 (int8 inputs). float32 inputs only. Returns the number of fusions."""
    from onnx import helper

    g = model.graph
    inits, producer, _ = _index(g)
    new = {}
    for mm in g.node:
        if mm.op_type != "MatMulNBits" or len(mm.input) != 3 or mm.input[1] not in inits:
            continue
        at = {a.name: helper.get_attribute_value(a) for a in mm.attribute}
        scales = _stored_scales(mm.input[2], inits, producer)
        if at.get("bits") != 8 or at.get("block_size") != 32 or scales is None:
            continue
        new[id(mm)] = helper.make_node("Q8Linear", [mm.input[0], mm.input[1], scales], list(mm.output),
                                       name=mm.name + "_Q8Linear", domain=ORTOPS_DOMAIN,
                                       K=int(at["K"]), N=int(at["N"]), block_size=32)
    if new:
        _set_nodes(g, [new.get(id(n), n) for n in g.node])
        if not any(o.domain == ORTOPS_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(ORTOPS_DOMAIN, 1))
    return len(new)


def swiglu_q4_linears(model) -> int:
    """Q4Linear on [gate | up] -> Split -> silu(gate) * up (Sigmoid, Mul, Mul) -> one Q4Linear with
    activation "swiglu", in place (3 onnxruntime nodes fewer a layer). Returns the number of fusions."""
    from onnx import helper, numpy_helper

    g = model.graph
    inits, producer, readers = _index(g)

    def only(name, op):
        r = readers.get(name, [])
        return r[0] if len(r) == 1 and r[0].op_type == op else None

    gone, done = set(), 0
    for q in g.node:
        if q.op_type != "Q4Linear" or q.domain != ORTOPS_DOMAIN:
            continue
        at = {a.name: helper.get_attribute_value(a) for a in q.attribute}
        split = only(q.output[0], "Split")
        if at.get("activation") or split is None or len(split.output) != 2 or len(split.input) != 2 \
                or split.input[1] not in inits:
            continue
        sizes = numpy_helper.to_array(inits[split.input[1]]).tolist()
        if sizes != [at["N"] // 2] * 2:
            continue
        gate, up = split.output
        r = readers.get(gate, [])
        sig = next((n for n in r if n.op_type == "Sigmoid"), None)
        mul = next((n for n in r if n.op_type == "Mul" and sig is not None and sig.output[0] in n.input), None)
        if len(r) != 2 or sig is None or mul is None or only(sig.output[0], "Mul") is not mul:
            continue
        last = only(mul.output[0], "Mul")
        if last is None or only(up, "Mul") is not last or set(last.input) != {mul.output[0], up}:
            continue
        q.output[0] = last.output[0]
        q.attribute.append(helper.make_attribute("activation", "swiglu"))
        gone.update(id(n) for n in (split, sig, mul, last))
        done += 1
    _set_nodes(g, [n for n in g.node if id(n) not in gone])
    return done
