"""4-bit weights in the exported graphs: every linear layer's MatMul (a MatMul whose B is a constant
2-D float initializer) becomes

  portable (onnxruntime)  com.microsoft MatMulNBits, made by onnxruntime's own quantizer
                          (matmul_nbits_quantizer, RTN on the weights it is given: AWQ scales, when
                          an artifact has them, are folded into the model before export)
  trt (TensorRT 10)       DequantizeLinear(INT4 [N, K], scale [N, K/g], axis 1, block_size g) ->
                          Transpose -> MatMul: TensorRT's weight-only quantization. TensorRT takes
                          signed INT4 with no zero point (the real TensorRT-RTX parser refuses UINT4
                          and "Non-zero zero point is not supported"), so the nibbles are
                          MatMulNBits' minus 8 and an asymmetric grid's offset s * (8 - z) is added
                          by a low-rank side product: (x @ E) @ C, E [K, K/g] the 0/1 block indicator,
                          C [K/g, N] = (s * (8 - z))^T. Exactly the same weights as MatMulNBits.

Linear layers that read the same input (gate / up, and q / k / v where the exporter did not already
write them as one product grouped per kv head: onnx_export.grouped_qkv_weights) are first fused into
one MatMul on the weights side by side and a Split (fuse_sibling_linears), in both flavours and in the
prefill and decode graphs alike, so weights.bin still holds each weight once.

The embedding, tied to the LM head (SmolLM2), is int8 symmetric in groups along the hidden dimension
(embedding_bits 8, the calibration's choice, zeroedge.quant.apply): onnxruntime's 8-bit block quantizer
on E^T [D, V] gives one uint8 [V, D] table (q + 128) that the LM head reads as an 8-bit MatMulNBits and
the embedding as GatherBlockQuantized (com.microsoft); TensorRT reads it as INT8 (q) through one
blocked DequantizeLinear feeding both the Gather and the Gemm. The 8-bit MatMulNBits runs with
accuracy_level 4 (int8 activations): at level 0 onnxruntime 1.32 takes a path ~6x slower than the
fp32 Gemm it replaces. embedding_bits 0 keeps the embedding at the bundle's float dtype.

The two flavours store different bytes (TensorRT reads signed values with no zero point, MatMulNBits
unsigned ones); the scales are the same tensors in both, so weights.bin holds them once.

onnxruntime is imported lazily (workstation side: the export extra).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from zeroedge.errors import UserError

TRT_OPSET = 21          # DequantizeLinear's block_size (blocked quantization) is opset 21
GROUPS = (16, 32, 64, 128, 256)   # MatMulNBits: a power of two >= 16


@dataclass(frozen=True)
class Scheme:
    bits: int = 4
    group: int = 32
    symmetric: bool = False
    method: str = "rtn"                 # "awq" when an artifact's scales were folded in first
    accuracy_level: Optional[int] = None   # the linear layers' MatMulNBits accuracy_level (4: int8 activations)
    embedding_bits: int = 8             # 8: int8 embedding = tied LM head; 0: kept at the float dtype
    embedding_group: int = 32
    zero_point: str = "int"             # asymmetric: "int" (onnxruntime's quantizer: uint4, 0.0 on the grid)
    #                                     or "float" (min/max grid, a float zero point per block: the
    #                                     GGUF Q4_1 layout, w = d * q + m, which it reproduces)

    def check(self) -> "Scheme":
        if self.bits != 4:
            raise UserError(f"weights: only 4-bit is exported (got {self.bits}-bit)")
        if self.group not in GROUPS:
            raise UserError(f"--group must be one of {', '.join(map(str, GROUPS))} (got {self.group})")
        if self.accuracy_level not in (None, 0, 1, 2, 3, 4):
            raise UserError(f"accuracy level must be 0-4 (got {self.accuracy_level})")
        if self.zero_point not in ("int", "float") or (self.zero_point == "float" and self.symmetric):
            raise UserError(f"zero point: int or float, float for an asymmetric grid only (got {self.zero_point}"
                            f"{', symmetric' if self.symmetric else ''})")
        if self.embedding_bits not in (0, 8) or self.embedding_group not in GROUPS:
            raise UserError(f"embedding: int8 in groups of {', '.join(map(str, GROUPS))}, or kept (got "
                            f"{self.embedding_bits}-bit, group {self.embedding_group})")
        return self

    def to_dict(self) -> dict:
        d = asdict(self)
        d["format"] = {"portable": "MatMulNBits (com.microsoft)",
                       "trt": f"DequantizeLinear INT4 block_size {self.group} (opset {TRT_OPSET})"}
        if self.zero_point == "float":      # the same weights in both flavours: (q - 8) * s + s * (8 - z)
            side = " + (x @ E) @ C: the float zero point's offset s * (8 - z) per group (C fp16-stored)"
            d["format"] = {"portable": "MatMulNBits (com.microsoft), no zero point" + side,
                           "trt": d["format"]["trt"] + side,
                           "grid": "per group: s = fp16((max - min) / 15), m = fp16(min), q = roundf((w - m) / s), "
                                   "w = m + q * s (zeroedge.quant.groupwise.quantize_float)"}
        if self.embedding_bits:
            d["format"]["embedding"] = {
                "portable": f"uint8 [V, D]: GatherBlockQuantized + 8-bit MatMulNBits (accuracy_level {LM_HEAD_ACCURACY})",
                "trt": f"DequantizeLinear INT8 block_size {self.embedding_group} -> Gather / Gemm"}
        return d


LM_HEAD_ACCURACY = 4


def _embedding(model):
    """(initializer, rows V) of the token embedding: the data of a Gather on a 2-D float initializer."""
    inits = {t.name: t for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Gather" and n.input[0] in inits and len(inits[n.input[0]].dims) == 2:
            return inits[n.input[0]], int(inits[n.input[0]].dims[0])
    return None, None


def linear_matmuls(model) -> list:
    """Names of MatMul nodes whose B is a constant 2-D float initializer (the linear layers; an
    untied LM head [D, V] is not one of them)."""
    from onnx import TensorProto

    inits = {t.name: t for t in model.graph.initializer}
    _, V = _embedding(model)
    out = []
    for n in model.graph.node:
        if n.op_type != "MatMul" or n.domain not in ("", "ai.onnx") or len(n.input) != 2:
            continue
        t = inits.get(n.input[1])
        if (t is not None and len(t.dims) == 2 and t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16)
                and t.dims[1] != V):
            out.append(n.name)
    return out


def quantize_embedding_portable(model, scheme: "Scheme") -> int:
    """The embedding (a Gather's table) tied to the LM head (Gemm transB=1 on the same table) -> one
    uint8 table: GatherBlockQuantized + 8-bit MatMulNBits, in place. Returns the nodes replaced (0 when
    the graph has no tied pair or D is not a multiple of the group: the embedding then stays float)."""
    import numpy as np
    from onnx import helper, numpy_helper
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    g = model.graph
    emb, V = _embedding(model)
    if emb is None or not scheme.embedding_bits:
        return 0
    D, bs = int(emb.dims[1]), scheme.embedding_group
    users = [n for n in g.node if emb.name in n.input]
    heads = [n for n in users if n.op_type == "Gemm" and n.input[1] == emb.name
             and any(a.name == "transB" and a.i == 1 for a in n.attribute)]
    if D % bs or not heads or any(n.op_type not in ("Gather", "Gemm") for n in users):
        return 0
    E = numpy_helper.to_array(emb).astype(np.float32)
    cfg = mnq.DefaultWeightOnlyQuantConfig(block_size=bs, is_symmetric=True, bits=8)
    packed, scales, _ = mnq.DefaultWeightOnlyQuantizer(cfg).qbits_block_quant(np.ascontiguousarray(E.T))
    qname, sname = emb.name + "_Q8", emb.name + "_Q8_scales"
    g.initializer.remove(emb)
    # the same bytes twice: MatMulNBits wants [V, D/g, g], GatherBlockQuantized [V, D] (weights.bin
    # deduplicates by content, so the bundle stores them once)
    g.initializer.extend([numpy_helper.from_array(packed.reshape(V, D // bs, bs), qname + "_blocks"),
                          numpy_helper.from_array(packed.reshape(V, D), qname),
                          numpy_helper.from_array(scales.reshape(V, D // bs).astype(np.float32), sname)])
    done = 0
    for i, n in enumerate(list(g.node)):
        if n not in users:
            continue
        if n.op_type == "Gather":
            new = helper.make_node("GatherBlockQuantized", [qname, n.input[1], sname], list(n.output),
                                   name=(n.name or "embed") + "_Q8", domain="com.microsoft", gather_axis=0,
                                   quantize_axis=1, block_size=bs, bits=8)
        else:
            if len(n.input) > 2 and n.input[2]:
                return 0 if done == 0 else done          # a bias: not a plain LM head (not exported here)
            new = helper.make_node("MatMulNBits", [n.input[0], qname + "_blocks", sname], list(n.output),
                                   name=(n.name or "lm_head") + "_Q8", domain="com.microsoft", K=D, N=V,
                                   bits=8, block_size=bs, accuracy_level=LM_HEAD_ACCURACY)
        idx = list(g.node).index(n)
        g.node.remove(n)
        g.node.insert(idx, new)
        done += 1
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return done


def fuse_sibling_linears(model, linear: list) -> list:
    """Linear MatMuls that read the same input (q / k / v, gate / up) -> one MatMul on the weights
    side by side + Split into the original outputs, in place. A decode step then runs one 4-bit GEMV
    of N = 960 instead of three of 576 / 192 / 192 (SmolLM2, 2 threads: 26 vs 19 GB/s over every
    layer), one side product of the float zero point, and fewer nodes. Exact: each output column is
    the same dot product. linear: the linear MatMuls' names (linear_matmuls); returns them after
    the fusion (fused ones replaced by their one node)."""
    import numpy as np
    from onnx import helper, numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    linear = list(linear)
    wanted = set(linear)
    groups = {}
    for n in g.node:
        if n.name in wanted:
            groups.setdefault(n.input[0], []).append(n)
    used = {}
    for n in g.node:
        for x in n.input:
            used[x] = used.get(x, 0) + 1
    for x, members in groups.items():
        weights = [inits[n.input[1]] for n in members]
        if len(members) < 2 or len({t.data_type for t in weights}) > 1 or any(used[t.name] > 1 for t in weights):
            continue
        arrays = [numpy_helper.to_array(t) for t in weights]
        if len({a.shape[0] for a in arrays}) > 1:
            continue
        first = members[0]
        base = first.name + "_fused"
        w = numpy_helper.from_array(np.concatenate(arrays, axis=1), base + "_weight")
        sizes = numpy_helper.from_array(np.array([a.shape[1] for a in arrays], np.int64), base + "_split")
        fused = helper.make_node("MatMul", [x, w.name], [base + "_out"], name=base)
        split = helper.make_node("Split", [fused.output[0], sizes.name], [n.output[0] for n in members],
                                 name=base + "_Split", axis=-1)
        at = list(g.node).index(first)
        for n in members:
            g.node.remove(n)
        for t in weights:
            g.initializer.remove(t)
        g.node.insert(at, split)
        g.node.insert(at, fused)
        g.initializer.extend([w, sizes])
        gone = {m.name for m in members}
        linear = [n for n in linear if n not in gone] + [base]
    return linear


def quantize_portable(model, scheme: Scheme):
    """The graph with every linear MatMul replaced by MatMulNBits (onnxruntime's quantizer), in place
    where it can be (sibling linears fused first: fuse_sibling_linears); returns (model, number of
    linear layers quantized, fused siblings counted one by one)."""
    import logging

    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    names = linear_matmuls(model)
    if not names:
        quantize_embedding_portable(model, scheme)
        return model, 0
    for n in model.graph.node:                          # the quantizer needs named nodes
        if not n.name:
            n.name = f"{n.op_type}_{id(n)}"
    before = linear_matmuls(model)
    names = fuse_sibling_linears(model, before)
    if scheme.zero_point == "float":
        from onnx import numpy_helper

        inits = {t.name: t for t in model.graph.initializer}
        original = {n.name: numpy_helper.to_array(inits[n.input[1]]).astype("float32")
                    for n in model.graph.node if n.name in set(names)}
    quiet = logging.getLogger("onnxruntime.quantization")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        q = mnq.MatMulNBitsQuantizer(model, bits=scheme.bits, block_size=scheme.group,
                                     is_symmetric=scheme.symmetric, accuracy_level=scheme.accuracy_level,
                                     nodes_to_include=names, op_types_to_quantize=("MatMul",))
        q.process()
    finally:
        quiet.setLevel(level)
    out = q.model.model
    done = sum(1 for n in out.graph.node if n.op_type == "MatMulNBits")
    if done != len(names):
        raise RuntimeError(f"onnxruntime's quantizer replaced {done} of {len(names)} linear MatMuls")
    if scheme.zero_point == "float":
        _float_zero_points(out, original, scheme.group)
    quantize_embedding_portable(out, scheme)
    return out, len(before)


def minmax_float_zp(w, group: int):
    """W [K, N] -> (blob [N, K/g, g/2] uint8, scales [N, K/g], zero points [N, K/g] float32) on the
    min/max grid of each block, zeroedge.quant.groupwise.quantize_float (the codes and grid `zeroedge
    eval` fake-quantizes with): s = fp16((max - min) / 15), m = fp16(min), q = roundf((w - m) / s),
    z with s * z = -m, so that q * s - s * z = m + q * s: a Q4_1 block (w = d * q + m, its min and max
    on the grid) exactly, up to an ulp of m where no float32 z has that product."""
    import numpy as np
    import torch

    from zeroedge.quant.groupwise import Scheme as QScheme, quantize_float

    K, N = w.shape
    q, s, z, _ = quantize_float(torch.from_numpy(np.ascontiguousarray(w.T, np.float32)),
                                QScheme(4, group, zero_point="float"))
    q = q.numpy().reshape(N, -1)
    kb = q.shape[1] // group
    blob = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(N, kb, group // 2)
    return blob, s.numpy(), z.numpy()


def _offset_nodes(x: str, y_sym: str, y: str, K: int, N: int, bs: int, s, z, base: str, extra: dict) -> tuple:
    """y = y_sym + (x @ E) @ C: the part s * (8 - z) of an asymmetric grid that a zero-point-free
    (offset-8) 4-bit product leaves out. E [K, K/g] 0/1 block indicator (one per K, g: in `extra`),
    C [K/g, N]; x @ E once per input (q / k / v and gate / up share theirs: `extra` remembers it).
    Returns (nodes, C initializer)."""
    import numpy as np
    from onnx import helper, numpy_helper

    kb = -(-K // bs)
    c = (s.reshape(N, kb).astype(np.float32) * (8.0 - z.reshape(N, -1)[:, :kb].astype(np.float32))).T
    cname = base + "_zp_offset"
    ename = f"zeroedge_block_sum_K{K}_g{bs}"
    if ename not in extra:
        e = np.zeros((K, kb), np.float32)
        e[np.arange(K), np.arange(K) // bs] = 1.0
        extra[ename] = numpy_helper.from_array(e, ename)
    nodes, key = [], ("bsum", x, ename)
    if key not in extra:
        extra[key] = y + "_bsum"
        nodes.append(helper.make_node("MatMul", [x, ename], [y + "_bsum"], name=base + "_BlockSum"))
    nodes += [helper.make_node("MatMul", [extra[key], cname], [y + "_off"], name=base + "_Offset"),
              helper.make_node("Add", [y_sym, y + "_off"], [y], name=base + "_Add")]
    return nodes, numpy_helper.from_array(np.ascontiguousarray(c), cname)


def _float_zero_points(model, original: dict, group: int):
    """Each 4-bit MatMulNBits on the min/max grid with a float zero point z: onnxruntime's kernel
    takes float zero points but on a slow path (5.6 tok/s decode vs 38 with uint4 ones, SmolLM2 on
    a 2-thread x86 CPU), so the node keeps no zero point (offset 8, the fast path) and the rest, s * (8 - z),
    is the same side product as in the TensorRT graphs (_offset_nodes)."""
    from onnx import numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    extra, out = {}, []
    for n in g.node:
        out.append(n)
        if n.op_type != "MatMulNBits" or not n.name.endswith("_Q4") or n.name[:-3] not in original:
            continue
        w = original[n.name[:-3]]
        K, N = w.shape
        blob, s, z = minmax_float_zp(w, group)
        for name, arr in ((n.input[1], blob), (n.input[2], s)):
            inits[name].CopyFrom(numpy_helper.from_array(arr, name))
        if len(n.input) > 3:
            old = n.input[3]
            del n.input[3:]
            if not any(old in m.input for m in g.node):
                g.initializer.remove(inits[old])
        y = n.output[0]
        n.output[0] = y + "_sym"
        nodes, c = _offset_nodes(n.input[0], y + "_sym", y, K, N, group, s, z, n.name, extra)
        g.initializer.append(c)
        out.extend(nodes)
    g.initializer.extend(v for k, v in extra.items() if isinstance(k, str))
    del g.node[:]
    g.node.extend(out)


def _unpack(b, n: int, k: int, g: int):
    """MatMulNBits' B [N, K/g, g/2] uint8 -> nibbles [N, kb*g] uint8 (low nibble first)."""
    import numpy as np

    flat = b.reshape(n, -1)
    q = np.empty((n, flat.shape[1] * 2), np.uint8)
    q[:, 0::2] = flat & 0x0F
    q[:, 1::2] = flat >> 4
    return q


def _pack_int4(q):
    """Signed values in [-8, 7], [N, K] -> ONNX INT4 raw bytes (row-major, low nibble first)."""
    import numpy as np

    flat = (q.astype(np.int16).reshape(-1) & 0x0F).astype(np.uint8)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return (flat[0::2] | (flat[1::2] << 4)).tobytes()


def trt_from_portable(model):
    """A copy of a MatMulNBits graph for TensorRT: each MatMulNBits becomes blocked INT4
    DequantizeLinear -> Transpose -> MatMul (+ the asymmetric offset product); opset 21."""
    import onnx
    from onnx import helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = {t.name: t for t in g.initializer}
    nodes, drop, extra, n_done = [], set(), {}, 0
    table = {}                                          # uint8 table -> its INT8 DequantizeLinear output
    for node in g.node:
        if node.op_type not in ("MatMulNBits", "GatherBlockQuantized"):
            nodes.append(node)
            continue
        at = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "GatherBlockQuantized" or int(at.get("bits", 4)) == 8:
            nodes += _trt_int8_nodes(node, at, g, inits, table, drop)
            continue
        nodes += _trt_int4_nodes(node, at, g, inits, drop, extra)
        n_done += 1
    _trt_set_graph(g, nodes, drop, extra)
    for o in out.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = max(o.version, TRT_OPSET)
    if not any(n.domain == "com.microsoft" for n in g.node):
        keep_ops = [o for o in out.opset_import if o.domain != "com.microsoft"]
        del out.opset_import[:]
        out.opset_import.extend(keep_ops)
    return out, n_done


def _trt_int8_nodes(node, at: dict, g, inits: dict, table: dict, drop: set) -> list:
    """TensorRT's form of an 8-bit MatMulNBits (LM head) or a GatherBlockQuantized (embedding) on
    the uint8 table: one INT8 DequantizeLinear per table (made on its first reader, noted in table;
    its INT8 copy added to g), then a Gemm(transB=1) or a Gather on it. Returns the new nodes; the
    names of the initializers no longer read go into drop."""
    import numpy as np
    from onnx import helper, numpy_helper

    nodes = []
    qn = node.input[0] if node.op_type == "GatherBlockQuantized" else node.input[1]
    qn = qn[:-len("_blocks")] if qn.endswith("_blocks") else qn     # [V, D/g, g] view of [V, D]
    drop.add(qn + "_blocks")
    sn = node.input[2]
    if qn not in table:
        u8 = numpy_helper.to_array(inits[qn])
        V = u8.shape[0]
        s8 = (u8.reshape(V, -1).astype(np.int16) - 128).astype(np.int8)
        g.initializer.append(numpy_helper.from_array(s8, qn + "_int8"))
        table[qn] = qn + "_dq"
        nodes.append(helper.make_node("DequantizeLinear", [qn + "_int8", sn], [table[qn]],
                                      name=qn + "_DQ", axis=1, block_size=int(at["block_size"])))
        drop.add(qn)
    if node.op_type == "GatherBlockQuantized":
        nodes.append(helper.make_node("Gather", [table[qn], node.input[1]], list(node.output),
                                      name=node.name + "_Gather", axis=0))
    else:
        nodes.append(helper.make_node("Gemm", [node.input[0], table[qn]], list(node.output),
                                      name=node.name + "_Gemm", transB=1))
    return nodes


def _trt_int4_nodes(node, at: dict, g, inits: dict, drop: set, extra: dict) -> list:
    """TensorRT's form of a 4-bit MatMulNBits: signed INT4 weights (added to g) -> blocked
    DequantizeLinear -> Transpose -> MatMul, plus the offset product (_offset_nodes) when it has
    zero points. Returns the new nodes; the names of the initializers no longer read go into drop,
    the offset products' shared tensors into extra."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    K, N, bs = int(at["K"]), int(at["N"]), int(at["block_size"])
    if int(at.get("bits", 4)) != 4:
        raise UserError(f"{node.name}: only 4- and 8-bit MatMulNBits have a TensorRT form here")
    x, bname, sname = node.input[0], node.input[1], node.input[2]
    zname = node.input[3] if len(node.input) > 3 and node.input[3] else None
    kb = -(-K // bs)
    u = _unpack(numpy_helper.to_array(inits[bname]), N, K, bs)[:, :K]        # [N, K] in 0..15
    qname = bname + "_int4"
    g.initializer.append(helper.make_tensor(qname, TensorProto.INT4, [N, K],
                                            _pack_int4(u.astype(np.int16) - 8), raw=True))
    drop.add(bname)
    base = node.name or bname
    w = base + "_dq"
    nodes = [helper.make_node("DequantizeLinear", [qname, sname], [w], name=base + "_DQ", axis=1, block_size=bs),
             helper.make_node("Transpose", [w], [w + "_t"], name=base + "_T", perm=[1, 0])]
    y = node.output[0]
    if zname is None:
        nodes.append(helper.make_node("MatMul", [x, w + "_t"], [y], name=base + "_MatMul"))
        return nodes
    zp = numpy_helper.to_array(inits[zname]).reshape(N, -1)
    if zp.dtype == np.uint8:                    # uint4 pairs
        z = np.empty((N, zp.shape[1] * 2), np.uint8)
        z[:, 0::2], z[:, 1::2] = zp & 0x0F, zp >> 4
    else:                                       # float zero points
        z = zp
    s = numpy_helper.to_array(inits[sname]).reshape(N, kb).astype(np.float32)
    drop.add(zname)
    nodes.append(helper.make_node("MatMul", [x, w + "_t"], [y + "_sym"], name=base + "_MatMul"))
    off, c = _offset_nodes(x, y + "_sym", y, K, N, bs, s, z, base, extra)
    g.initializer.append(c)
    return nodes + off


def _trt_set_graph(g, nodes: list, drop: set, extra: dict):
    """g's nodes replaced by nodes; its initializers: those not dropped (or still read), then the
    offset products' shared tensors (extra's string keys) not already there."""
    used = {i for n in nodes for i in n.input}
    keep = [t for t in g.initializer if t.name not in drop or t.name in used]
    del g.initializer[:]
    have = {t.name for t in keep}
    g.initializer.extend(keep + [t for k, t in extra.items() if isinstance(k, str) and t.name not in have])
    del g.node[:]
    g.node.extend(nodes)


def _bits(node) -> int:
    from onnx import TensorProto

    for at in node.attribute:
        if at.name == "bits":
            return int(at.i)
    return 8 if node.op_type == "GatherBlockQuantized" else 4


def stored_bytes(model, part: str = "linear") -> int:
    """Bytes the quantized nodes of `part` read from their initializers, as stored (external data
    lengths, through the Casts of float16-stored tensors): "linear" the 4-bit layers (weights,
    scales, zero points, offsets), "embedding" the int8 table and its scales."""
    from onnx import TensorProto, numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    cast_of = {n.output[0]: n.input[0] for n in g.node if n.op_type == "Cast"}
    int8 = {t.name for t in g.initializer if t.data_type == TensorProto.INT8}
    names = set()
    for n in g.node:
        if n.op_type == "MatMulNBits":
            if (_bits(n) == 4) == (part == "linear"):
                names.update(n.input[1:])               # input 0: the activations
        elif n.op_type == "GatherBlockQuantized":
            if part == "embedding":
                names.update(n.input[::2])              # input 1: the token ids
        elif n.op_type == "DequantizeLinear":
            if (n.input[0] in int8) == (part == "embedding"):
                names.update(n.input)
        elif part == "linear" and n.name.endswith(("_Offset", "_BlockSum")):
            names.update(n.input)
    seen = {}                                           # one count per stored range (views share one)
    for name in {cast_of.get(x, x) for x in names}:
        t = inits.get(name)
        if t is None:
            continue
        if t.data_location == TensorProto.EXTERNAL:
            ext = {e.key: e.value for e in t.external_data}
            seen[(ext["location"], ext.get("offset"))] = int(ext["length"])
        else:
            seen[name] = len(t.raw_data) if t.HasField("raw_data") else numpy_helper.to_array(t).nbytes
    return sum(seen.values())
