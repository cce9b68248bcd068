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

The two flavours store different bytes (TensorRT reads signed nibbles, MatMulNBits unsigned ones);
the scales [N, K/g] are the same tensor in both, so weights.bin holds them once. The embedding and the
(tied) LM head are not touched here: the bundle keeps them at its float dtype.

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
    accuracy_level: Optional[int] = None   # MatMulNBits' accuracy_level (4: int8 activations)

    def check(self) -> "Scheme":
        if self.bits != 4:
            raise UserError(f"weights: only 4-bit is exported (got {self.bits}-bit)")
        if self.group not in GROUPS:
            raise UserError(f"--group must be one of {', '.join(map(str, GROUPS))} (got {self.group})")
        if self.accuracy_level not in (None, 0, 1, 2, 3, 4):
            raise UserError(f"accuracy level must be 0-4 (got {self.accuracy_level})")
        return self

    def to_dict(self) -> dict:
        d = asdict(self)
        d["format"] = {"portable": "MatMulNBits (com.microsoft)",
                       "trt": f"DequantizeLinear INT4 block_size {self.group} (opset {TRT_OPSET})"}
        return d


def linear_matmuls(model) -> list:
    """Names of MatMul nodes whose B is a constant 2-D float initializer (the linear layers)."""
    from onnx import TensorProto

    inits = {t.name: t for t in model.graph.initializer}
    out = []
    for n in model.graph.node:
        if n.op_type != "MatMul" or n.domain not in ("", "ai.onnx") or len(n.input) != 2:
            continue
        t = inits.get(n.input[1])
        if t is not None and len(t.dims) == 2 and t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16):
            out.append(n.name)
    return out


def quantize_portable(model, scheme: Scheme):
    """The graph with every linear MatMul replaced by MatMulNBits (onnxruntime's quantizer), in place
    where it can be; returns (model, number of nodes quantized)."""
    import logging

    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    names = linear_matmuls(model)
    if not names:
        return model, 0
    for n in model.graph.node:                          # the quantizer needs named nodes
        if not n.name:
            n.name = f"{n.op_type}_{id(n)}"
    names = linear_matmuls(model)
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
    return out, done


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
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = {t.name: t for t in g.initializer}
    nodes, drop, extra, n_done = [], set(), {}, 0
    for node in g.node:
        if node.op_type != "MatMulNBits":
            nodes.append(node)
            continue
        at = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        K, N, bs = int(at["K"]), int(at["N"]), int(at["block_size"])
        if int(at.get("bits", 4)) != 4:
            raise UserError(f"{node.name}: only 4-bit MatMulNBits has a TensorRT form here")
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
        nodes.append(helper.make_node("DequantizeLinear", [qname, sname], [w], name=base + "_DQ",
                                      axis=1, block_size=bs))
        nodes.append(helper.make_node("Transpose", [w], [w + "_t"], name=base + "_T", perm=[1, 0]))
        y = node.output[0]
        if zname is None:
            nodes.append(helper.make_node("MatMul", [x, w + "_t"], [y], name=base + "_MatMul"))
        else:
            zp = numpy_helper.to_array(inits[zname]).reshape(N, -1)
            z = np.empty((N, zp.shape[1] * 2), np.uint8)
            z[:, 0::2], z[:, 1::2] = zp & 0x0F, zp >> 4
            s = numpy_helper.to_array(inits[sname]).reshape(N, kb).astype(np.float32)
            c = (s * (8.0 - z[:, :kb].astype(np.float32))).T                        # [kb, N]
            cname = base + "_zp_offset"
            g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(c), cname))
            drop.add(zname)
            ename = f"zeroedge_block_sum_K{K}_g{bs}"
            if ename not in extra:
                e = np.zeros((K, kb), np.float32)
                e[np.arange(K), np.arange(K) // bs] = 1.0
                extra[ename] = numpy_helper.from_array(e, ename)
            nodes.append(helper.make_node("MatMul", [x, w + "_t"], [y + "_sym"], name=base + "_MatMul"))
            nodes.append(helper.make_node("MatMul", [x, ename], [y + "_bsum"], name=base + "_BlockSum"))
            nodes.append(helper.make_node("MatMul", [y + "_bsum", cname], [y + "_off"], name=base + "_Offset"))
            nodes.append(helper.make_node("Add", [y + "_sym", y + "_off"], [y], name=base + "_Add"))
        n_done += 1
    used = {i for n in nodes for i in n.input}
    keep = [t for t in g.initializer if t.name not in drop or t.name in used]
    del g.initializer[:]
    g.initializer.extend(keep + list(extra.values()))
    del g.node[:]
    g.node.extend(nodes)
    for o in out.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = max(o.version, TRT_OPSET)
    if not any(n.domain == "com.microsoft" for n in g.node):
        keep_ops = [o for o in out.opset_import if o.domain != "com.microsoft"]
        del out.opset_import[:]
        out.opset_import.extend(keep_ops)
    return out, n_done


def stored_bytes(model) -> int:
    """Bytes the quantized nodes read from their initializers (4-bit weights, scales, zero points,
    offsets), as stored: external data lengths, through the Casts of float16-stored tensors."""
    from onnx import TensorProto, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    cast_of = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Cast"}
    names = set()
    for n in model.graph.node:
        if n.op_type == "MatMulNBits":
            names.update(n.input[1:])                   # input 0: the activations
        elif n.op_type == "DequantizeLinear":
            names.update(n.input)
        elif n.name.endswith(("_Offset", "_BlockSum")):
            names.update(n.input)
    total = 0
    for name in {cast_of.get(x, x) for x in names}:
        t = inits.get(name)
        if t is None:
            continue
        if t.data_location == TensorProto.EXTERNAL:
            total += int(next(e.value for e in t.external_data if e.key == "length"))
        else:
            total += len(t.raw_data) if t.HasField("raw_data") else numpy_helper.to_array(t).nbytes
    return total
