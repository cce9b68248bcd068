"""Pre-flight for TensorRT 10.3 (JetPack 6.1 / 6.2): will this ONNX graph build on the device?

Rules (each finding: severity, file, node, message, fix hint):
  opset     default-domain opset outside TensorRT 10.3's parser range (9..20); IR version > 10
            (its bundled onnx 1.16 reads IR <= 10)
  functions model.functions present: TensorRT 10.3 inlines a local function in preference to a
            same-named plugin (plugin priority arrived in 10.7), so the plugins would never run
  ops       ops its ONNX parser has no importer for (onnx-tensorrt docs/operators.md, 10.x: "N")
  plugins   custom-domain nodes must name a creator of the zeroedge plugin library
            (zeroedge.plugin_spec), carry plugin_namespace / plugin_version that match it, give
            every required field, no unknown field, fields of the declared type, and the
            declared number of inputs / outputs
  attrs     plugin attributes other than INT / FLOAT / STRING (the parser turns attributes into
            PluginFields: INT read as int32, FLOAT as float32, STRING as char); INT out of int32
  values    field values the plugin library refuses (plugin_spec.field_value_problems: finite
            thresholds, block_frac in [0, 1], anchor_rank 0..64, non-negative counts); unknown fields
            are a warning (the creator ignores them)
  shapes    input shapes it refuses where the graph states them (plugin_spec.shape_problems: D a
            multiple of 8, SIH head width 1..32, PathsFFN [B, D] x [D, 2F] x [F, D], B 1..8)
  types     the first input's element type (SIH / PAD: float or float16; PathsFFN: float16 or bfloat16)
            These three come from TensorRT-RTX's builder (tests/test_tensorrt_rtx.py checks
            that this pre-flight and the real parse + build agree on every case it feeds them).
  int64     INT64 initializers whose values do not fit int32 (clamped by the parser)
  profiles  graph inputs without a rank, and dynamic dimensions (each needs a min/opt/max profile)
Torch-free; needs only `onnx`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from zeroedge import plugin_spec as spec
from zeroedge.errors import UserError

TARGETS = {
    "jetpack-6.2": {"tensorrt": "10.3", "cuda": "12.6", "opset": (9, 20), "max_ir": 10},
    "jetpack-6.1": {"tensorrt": "10.3", "cuda": "12.6", "opset": (9, 20), "max_ir": 10},
}
UNSUPPORTED_TARGETS = {
    "jetpack-6.0": "JetPack 6.0 ships TensorRT 8.6, which has no IPluginV3: upgrade the device to "
                   "JetPack 6.1 or 6.2",
    "jetpack-5.1": "JetPack 5.x ships TensorRT 8.5 (no IPluginV3): upgrade the device to JetPack 6.2",
}

# operators the TensorRT 10.x ONNX parser has no importer for (onnx-tensorrt docs/operators.md)
UNSUPPORTED_OPS = {
    "Bernoulli", "BitShift", "BitwiseAnd", "BitwiseNot", "BitwiseOr", "BitwiseXor", "CenterCropPad",
    "Col2Im", "Compress", "ConcatFromSequence", "ConvInteger", "DFT", "Det", "DynamicQuantizeLinear",
    "ImageDecoder", "MatMulInteger", "MaxRoiPool", "MaxUnpool", "MelWeightMatrix", "Multinomial",
    "NegativeLogLikelihoodLoss", "Optional", "OptionalGetElement", "OptionalHasElement",
    "QLinearConv", "QLinearMatMul", "RandomNormal", "RandomNormalLike", "RegexFullMatch",
    "SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceErase", "SequenceInsert",
    "SequenceLength", "SequenceMap", "SoftmaxCrossEntropyLoss", "SplitToSequence", "STFT",
    "StringConcat", "StringNormalizer", "StringSplit", "TfIdfVectorizer", "Unique",
}


@dataclass
class Finding:
    severity: str      # error | warning | info
    rule: str
    file: str
    node: str
    message: str
    fix: str

    def line(self) -> str:
        return f"{self.severity.upper():7s} {self.file}:{self.node}: {self.message} (fix: {self.fix})"

    def to_dict(self):
        return asdict(self)


def target_info(target: str) -> dict:
    if target in UNSUPPORTED_TARGETS:
        raise UserError(f"target {target} is not supported: {UNSUPPORTED_TARGETS[target]}")
    if target not in TARGETS:
        raise UserError(f"unknown target {target}; known targets: {', '.join(TARGETS)}")
    return TARGETS[target]


def check_model(model, target: str = "jetpack-6.2", fname: str = "model.onnx") -> list:
    import onnx
    from onnx import AttributeProto, TensorProto, numpy_helper

    t = target_info(target)
    out = []

    def add(sev, rule, node, msg, fix):
        out.append(Finding(sev, rule, fname, node or "-", msg, fix))

    lo, hi = t["opset"]
    opsets = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    v = opsets.get("ai.onnx")
    blocked_dq = any(n.op_type == "DequantizeLinear" and any(a.name == "block_size" for a in n.attribute)
                     for n in model.graph.node)
    if v == 21 and hi == 20 and blocked_dq:
        # 4-bit bundles (export.quantize_graph): DequantizeLinear's block_size exists from opset 21 only;
        # TensorRT 10's parser imports it (its INT4 weight-only quantization; built with TensorRT-RTX here)
        add("warning", "opset", "", f"default-domain opset 21 (blocked INT4 DequantizeLinear) is past TensorRT "
            f"{t['tensorrt']}'s documented range {lo}..{hi}; its parser imports it for weight-only INT4",
            "none needed; if the device's parser refuses it, export with --weights fp16")
    elif v is None or not lo <= v <= hi:
        add("error", "opset", "", f"default-domain opset {v} is outside TensorRT {t['tensorrt']}'s "
            f"range {lo}..{hi}", f"re-export with opset_version={min(max(v or lo, lo), hi)}")
    if model.ir_version > t["max_ir"]:
        add("error", "opset", "", f"IR version {model.ir_version} > {t['max_ir']} (the parser's onnx "
            "cannot read it)", f"set model.ir_version = {t['max_ir']} (re-export or onnx.save after editing)")
    if len(model.functions):
        names = ", ".join(sorted({f.name for f in model.functions}))
        add("error", "functions", "", f"model.functions present ({names}): TensorRT {t['tensorrt']} "
            "inlines local functions instead of calling a same-named plugin",
            "use the bundle's *.trt.onnx file (no functions)")
    _check_wiring(model.graph, add)
    known = _known_tensors(model.graph)
    for n in model.graph.node:
        nm = n.name or (n.output[0] if n.output else n.op_type)
        dom = n.domain if n.domain not in ("", "ai.onnx") else ""
        if dom == "" and n.op_type in UNSUPPORTED_OPS:
            add("error", "ops", nm, f"{n.op_type} has no importer in TensorRT {t['tensorrt']}'s ONNX parser",
                "rewrite it with supported ops or replace it by a plugin node")
        if dom == "ai.onnx.ml":
            add("error", "ops", nm, f"ai.onnx.ml op {n.op_type} is not supported by TensorRT",
                "run this part outside the engine")
        if dom and dom not in ("ai.onnx.ml",):
            out.extend(_check_plugin_node(n, nm, dom, fname, known))
    for init in model.graph.initializer:
        if init.data_type == TensorProto.INT64 and init.data_location != TensorProto.EXTERNAL:
            a = numpy_helper.to_array(init).ravel()
            # INT64_MAX / INT64_MIN are "to the end" sentinels (Slice): clamping them is harmless
            a = a[(a != 2**63 - 1) & (a != -2**63)]
            if a.size and (a.max() > 2**31 - 1 or a.min() < -2**31):
                add("error", "int64", init.name, "INT64 weights outside the int32 range (the parser "
                    "clamps them)", "store these values as int32 or restructure the op")
        if init.data_type == TensorProto.DOUBLE:
            add("warning", "int64", init.name, "DOUBLE weights are cast down to float32",
                "export in float32")
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            add("error", "profiles", vi.name, "graph input has no rank: TensorRT needs a rank and an "
                "optimization profile for every input", "export with a fixed rank (dynamic_axes)")
            continue
        dyn = [d.dim_param or "?" for d in tt.shape.dim if not d.HasField("dim_value")]
        if "?" in dyn:
            add("error", "profiles", vi.name, "input has an unnamed dynamic dimension",
                "name dynamic dimensions (dynamic_axes) so profiles can be given")
        elif dyn:
            add("info", "profiles", vi.name, f"dynamic dims {dyn}: the build needs a min/opt/max profile",
                "zeroedge deploy passes one from the plan (or trtexec --minShapes/--optShapes/--maxShapes)")
    return out


def _check_wiring(graph, add):
    """Every node input is a graph input, an initializer or an earlier node's output (the parser reads
    nodes in order), and every graph output is produced. Subgraph bodies (If / Loop) are not entered."""
    defined = {vi.name for vi in graph.input} | {t.name for t in graph.initializer} | {""}
    for n in graph.node:
        nm = n.name or (n.output[0] if n.output else n.op_type)
        for name in n.input:
            if name not in defined:
                add("error", "graph", nm, f"input {name!r} of this {n.op_type} is not a graph input, an "
                    "initializer or the output of an earlier node", "re-export the graph (it is broken, or its "
                    "nodes are not in topological order)")
        defined.update(n.output)
    for vi in graph.output:
        if vi.name not in defined:
            add("error", "graph", vi.name, "graph output is produced by no node", "re-export the graph")


def _known_tensors(graph) -> dict:
    """name -> (dims: list of int / None per axis, or None without a rank; ONNX element type or 0) for
    the graph's inputs, outputs, value_info and initializers (what is known without a build)."""
    known = {}
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim] if tt.HasField("shape") else None
        known[vi.name] = (dims, tt.elem_type)
    for t in graph.initializer:
        known[t.name] = (list(t.dims), t.data_type)
    return known


# element types each plugin's first input may have (plugins/src/plugin.cpp supportsFormatCombination)
_X_TYPES = {"ZeroEdgeSIH": ("FLOAT", "FLOAT16"), "ZeroEdgeSIHChunk": ("FLOAT", "FLOAT16"),
            "ZeroEdgePADGather": ("FLOAT", "FLOAT16"), "ZeroEdgePADScatter": ("FLOAT", "FLOAT16"), "ZeroEdgePathsFFN": ("FLOAT16", "BFLOAT16")}


def _check_plugin_node(n, nm, dom, fname, known=None):
    from onnx import AttributeProto, TensorProto

    out = []

    def add(sev, rule, msg, fix):
        out.append(Finding(sev, rule, fname, nm, msg, fix))

    if n.op_type not in spec.NODES:
        add("error", "plugins", f"custom op {dom}::{n.op_type} has no creator in the zeroedge plugin "
            f"library (it has {', '.join(spec.NODES)})", "rewrite the node to a zeroedge plugin or drop it")
        return out
    want = spec.NODES[n.op_type]
    attrs = {a.name: a for a in n.attribute}
    ns = attrs.get("plugin_namespace")
    if ns is None or ns.s.decode() != spec.PLUGIN_NAMESPACE:
        add("error", "plugins", f"plugin_namespace {ns.s.decode() if ns else 'missing'!r} does not match "
            f"the library's {spec.PLUGIN_NAMESPACE!r}", f"set plugin_namespace=\"{spec.PLUGIN_NAMESPACE}\"")
    ver = attrs.get("plugin_version")
    if ver is None or ver.s.decode() != spec.PLUGIN_VERSION:
        add("error", "plugins", f"plugin_version {ver.s.decode() if ver else 'missing'!r} does not match "
            f"the library's {spec.PLUGIN_VERSION!r}", f"set plugin_version=\"{spec.PLUGIN_VERSION}\"")
    if len(n.input) != len(want["inputs"]) or len(n.output) != len(want["outputs"]):
        add("error", "plugins", f"{len(n.input)} inputs / {len(n.output)} outputs; the plugin takes "
            f"{len(want['inputs'])} / {len(want['outputs'])}", "re-export with the current zeroedge")
    kinds = {spec.INT: AttributeProto.INT, spec.FLOAT: AttributeProto.FLOAT, spec.STRING: AttributeProto.STRING}
    for field, (kind, default) in want["fields"].items():
        a = attrs.get(field)
        if a is None:
            if default is None:
                add("error", "plugins", f"required field {field} is missing", f"add the {kind} attribute {field}")
            continue
        if a.type != kinds.get(kind):
            add("error", "attrs", f"field {field} is {AttributeProto.AttributeType.Name(a.type)}, the "
                f"creator reads {kind}", f"store {field} as a single {kind}")
    for name, a in attrs.items():
        if name in ("plugin_namespace", "plugin_version"):
            continue
        if name not in want["fields"]:
            add("warning", "plugins", f"unknown field {name}: the creator ignores it (it has "
                f"{', '.join(want['fields']) or 'no fields'})", f"drop attribute {name}")
        if a.type not in (AttributeProto.INT, AttributeProto.FLOAT, AttributeProto.STRING):
            add("error", "attrs", f"attribute {name} is {AttributeProto.AttributeType.Name(a.type)}; "
                "plugin fields must be INT, FLOAT or STRING", f"store {name} as a scalar")
        elif a.type == AttributeProto.INT and not -2**31 <= a.i < 2**31:
            add("error", "attrs", f"INT attribute {name}={a.i} does not fit int32 (PluginField INT32)",
                f"keep {name} within int32")
    # the plugin's own rules, as the real builder applies them (fields of the right type only)
    values = {k: (a.i if a.type == AttributeProto.INT else a.f) for k, a in attrs.items()
              if k in want["fields"] and a.type == kinds.get(want["fields"][k][0])
              and want["fields"][k][0] in (spec.INT, spec.FLOAT)}
    for msg in spec.field_value_problems(n.op_type, values):
        add("error", "values", f"{n.op_type}: {msg}", "re-export with the current zeroedge (or fix the field)")
    known = known or {}
    shapes = [known.get(i, (None, 0))[0] for i in n.input]
    for msg in spec.shape_problems(n.op_type, shapes, values):
        add("error", "shapes", f"{n.op_type}: {msg}", "this model shape is outside what the plugin supports")
    x_type = known.get(n.input[0], (None, 0))[1] if n.input else 0
    if x_type and TensorProto.DataType.Name(x_type) not in _X_TYPES[n.op_type]:
        add("error", "types", f"{n.op_type}: input 0 is {TensorProto.DataType.Name(x_type)}, the plugin takes "
            f"{' or '.join(_X_TYPES[n.op_type])}", "cast the input (or export in a supported precision)")
    return out


def check_path(path, target: str = "jetpack-6.2") -> tuple:
    """A bundle directory (every *.trt.onnx, manifest verified) or one .onnx file ->
    (findings, files checked)."""
    import onnx

    from zeroedge import bundle as bundle_mod

    target_info(target)
    p = Path(path)
    if p.is_dir():
        mf = bundle_mod.verify(p)
        files = sorted(f for f in mf["files"] if f.endswith(".trt.onnx"))
        if not files:
            raise UserError(f"{path}: the bundle has no *.trt.onnx graph")
        findings = []
        if mf.get("plugin_abi") != spec.PLUGIN_ABI:
            findings.append(Finding("error", "plugins", "manifest.json", "-",
                                    f"bundle plugin ABI {mf.get('plugin_abi')} != library ABI {spec.PLUGIN_ABI}",
                                    "re-export the bundle with this zeroedge"))
        for f in files:
            try:
                m = onnx.load(str(p / f), load_external_data=False)
            except Exception as e:
                raise UserError(f"{p / f}: unreadable ONNX ({type(e).__name__})") from None
            findings += check_model(m, target, f)
        return findings, files
    if p.is_file():
        try:
            m = onnx.load(str(p), load_external_data=False)
        except Exception as e:
            raise UserError(f"{p}: unreadable ONNX ({type(e).__name__})") from None
        return check_model(m, target, p.name), [p.name]
    raise UserError(f"not found: {path}")
