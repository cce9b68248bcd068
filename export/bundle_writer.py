"""`zeroedge export`: model (+ calibration artifact) -> bundle directory.

bundle/
  prefill.portable.onnx   custom nodes as model-local functions (runs in onnxruntime anywhere)
  prefill.trt.onnx        same graph, plugin nodes for TensorRT (no model.functions)
  decode.portable.onnx    decode step over the fixed-slot window: no SIH/PAD (T = 1 < min_tokens), fusions
                          onnxruntime does not find itself written in (export.ort_fusions); with
                          a magnitude "paths" artifact each sparse layer's FFN is one ZeroEdgePathsFFN
                          node (thresholds from the artifact, weights w13_t [D, 2F] / wd_t [F, D])
  decode.trt.onnx         same graph, plugin nodes; ZeroEdgePathsFFN runs in fp16 there (the plugin takes
                          fp16 / bf16 only): Cast(x) -> node with fp16 w13_t / wd_t -> Cast(y)
  weights.bin             every initializer of every graph, deduplicated by content (ONNX external
                          data with offsets): the four graphs share one copy of the weights, except
                          the decode paths' w13_t (fp32 and fp16: no byte-equal tensor elsewhere)
                          and fp16 wd_t (the fp32 wd_t is the prefill's W_down^T, shared).
                          weights="float16" (the default: a Jetson target's engines run fp16) stores
                          every float32 weight as float16 followed by a Cast to float32 in the graph,
                          so the graphs compute as before from half the bytes (onnxruntime and
                          TensorRT fold the Cast when they load or build); a tensor float16 cannot
                          hold (|w| > 65504) stays float32
                          weights="int4" (export.quantize_graph): every linear layer 4-bit, group-wise;
                          the portable graphs read them through onnxruntime's MatMulNBits, the TensorRT
                          ones through blocked INT4 DequantizeLinear (opset 21); the two store different
                          nibbles (TensorRT reads signed ones with no zero point) and share the scales;
                          the rest (embedding = tied LM head, norms, scales) is stored as float16
  tokenizer files         when the model folder has them
  manifest.json           hashes, versions, opset, target, plugin ABI, calibration summary (incl. the
                          decode path layers and thresholds), graph I/O

Everything is written under BUNDLE.tmp and renamed into place at the end: a failure leaves nothing.
"""
from __future__ import annotations

import hashlib
import math
import shutil
import time
from pathlib import Path
from typing import Optional

from zeroedge.errors import UserError
from zeroedge.export import quantize_graph

WEIGHTS = "weights.bin"
ALIGN = 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


class WeightFile:
    """Append-only external-data file shared by several ModelProtos, deduplicated by content."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.f = open(self.path, "wb")
        self.offset = 0
        self.index = {}

    def externalize(self, model, min_bytes: int = 1024):
        from onnx import TensorProto, numpy_helper

        for t in _all_initializers(model):
            if t.data_location == TensorProto.EXTERNAL:
                raise UserError(f"initializer {t.name} still refers to external data; load it first")
            raw = t.raw_data if t.HasField("raw_data") else numpy_helper.to_array(t).tobytes()
            if len(raw) < min_bytes:
                continue
            key = (len(raw), hashlib.sha1(raw).hexdigest())     # bytes only: one copy for every view
            if key not in self.index:
                pad = (-self.offset) % ALIGN
                self.f.write(b"\0" * pad)
                self.offset += pad
                self.index[key] = (self.offset, len(raw))
                self.f.write(raw)
                self.offset += len(raw)
            off, n = self.index[key]
            dims, dt, name = list(t.dims), t.data_type, t.name
            t.Clear()
            t.name, t.data_type = name, dt
            t.dims.extend(dims)
            t.data_location = TensorProto.EXTERNAL
            for k, v in (("location", self.path.name), ("offset", str(off)), ("length", str(n))):
                e = t.external_data.add()
                e.key, e.value = k, v
        return model

    def close(self):
        self.f.close()


WEIGHT_DTYPES = ("float16", "float32", "int4")
FLAVOURS = ("portable", "trt")      # onnxruntime's graphs and TensorRT's
FP16_MAX = 65504.0


def half_weights(model, min_bytes: int = 1024) -> int:
    """Store the model's float32 initializers of min_bytes or more as float16 (name + "__fp16") and
    put a Cast back to float32 under the original name first in the graph: every consumer reads the
    same name and dtype as before. Returns how many tensors were converted."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    inputs = {vi.name for vi in g.input}
    casts, n = [], 0
    for t in g.initializer:
        if t.data_type != TensorProto.FLOAT or t.data_location == TensorProto.EXTERNAL:
            continue
        a = numpy_helper.to_array(t)
        if a.nbytes < min_bytes or (a.size and not np.abs(a).max() <= FP16_MAX):
            continue
        name = t.name
        t.CopyFrom(numpy_helper.from_array(a.astype(np.float16), name + "__fp16"))
        casts.append(helper.make_node("Cast", [name + "__fp16"], [name], name=f"{name}__to_fp32",
                                      to=TensorProto.FLOAT))
        n += 1
    if casts:
        if inputs & {c.output[0] for c in casts}:       # an initializer also listed as a graph input
            keep = [vi for vi in g.input if vi.name not in {c.output[0] for c in casts}]
            del g.input[:]
            g.input.extend(keep)
        nodes = list(g.node)
        del g.node[:]
        g.node.extend(casts + nodes)
    return n


def quant_scheme(weights: str, meta: Optional[dict], group, symmetric, accuracy_level, calib=None,
                 zero_point: Optional[str] = None):
    """The 4-bit scheme to export with (None: float weights). An artifact's weights section decides
    bits / group / symmetric / method; an explicit --group / --symmetric that disagrees is refused."""
    from zeroedge.export.quantize_graph import Scheme

    ws = (meta or {}).get("weights")
    if ws:
        from zeroedge import calib_artifact

        sec = calib_artifact.Calibration.from_meta(meta, str(calib)).weights
        if weights not in ("int4", "float16"):
            raise UserError(f"{calib} quantizes the weights ({sec.describe()}); --weights {weights} contradicts it")
        for what, mine, theirs in (("--group", group, sec.group), ("--symmetric", symmetric, sec.symmetric),
                                   ("--zero-point", zero_point, sec.zero_point)):
            if mine is not None and mine != theirs:
                raise UserError(f"{what} {mine} contradicts {calib} ({sec.describe()})")
        if sec.embedding_bits == 4:
            raise UserError(f"{calib} quantizes the embedding to int4, which serves on the torch path only; "
                            "export needs an artifact calibrated with --embedding int8 or keep")
        return Scheme(sec.bits, sec.group, sec.symmetric, sec.method, accuracy_level,
                      sec.embedding_bits, sec.embedding_group, sec.zero_point).check()
    if weights != "int4":
        if group is not None or symmetric or zero_point:
            raise UserError("--group / --symmetric / --zero-point apply to --weights int4 only")
        return None
    return Scheme(4, 32 if group is None else int(group), bool(symmetric), "rtn", accuracy_level,
                  zero_point=zero_point or "int").check()


def _quantize_flavours(per: dict, scheme):
    """{"portable": MatMulNBits graph, "trt": DequantizeLinear graph} for the flavours in per (one
    proto for both, or one per flavour: decode paths), and the number of quantized nodes."""
    out, done, n = {}, {}, None
    for f, src in per.items():
        if id(src) not in done:
            done[id(src)], count = quantize_graph.quantize_portable(src, scheme)
            n = count if n is None else n
        out[f] = done[id(src)] if f == "portable" else quantize_graph.trt_from_portable(done[id(src)])[0]
    return out, n


def _embedding_params(model) -> int:
    from onnx import helper

    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and quantize_graph._bits(node) == 8:
            at = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            return int(at["K"]) * int(at["N"])
    return 0


def _quantized_params(model) -> int:
    """Parameters of the 4-bit linear layers."""
    from onnx import helper

    n = 0
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and quantize_graph._bits(node) == 4:
            at = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            n += int(at["K"]) * int(at["N"])
    return n


def _all_initializers(model):
    yield from model.graph.initializer
    for n in model.graph.node:                     # Constant nodes too (TorchScript keeps some)
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value" and a.t.ByteSize() > 1024:
                    yield a.t


def _float_params(model) -> int:
    """Float parameters of a graph's initializers (what a runtime holds, whatever weights.bin stores)."""
    from onnx import TensorProto

    n = 0
    for t in model.graph.initializer:
        if t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16):
            c = 1
            for d in t.dims:
                c *= d
            n += c
    return n


def graph_io(model) -> dict:
    def vi(v):
        d = v.type.tensor_type
        return {"name": v.name, "dtype": int(d.elem_type),
                "shape": [x.dim_param or x.dim_value for x in d.shape.dim]}
    return {"inputs": [vi(v) for v in model.graph.input], "outputs": [vi(v) for v in model.graph.output]}


def resolve_model(model: str):
    """MODEL -> (Transformer, folder or None). A bundled/HF/GGUF model, or a preset name with
    random weights (seed 0) for tests and size planning."""
    from zeroedge import weights
    from zeroedge.model import PRESETS, build

    if not isinstance(model, str):                       # a Transformer already built
        return model, None
    if model in weights.BUNDLED or Path(model).exists():
        return weights.load(model)
    if model in PRESETS:
        return build(model, seed=0), None
    raise UserError(f"model not found: {model} (a bundled name: {', '.join(weights.BUNDLED)}; a "
                    f"preset with random weights: {', '.join(PRESETS)}; an HF folder; a .gguf; or "
                    "an .onnx graph to rewrite)")


def calibration_summary(meta: Optional[dict], path, paths: Optional[dict] = None,
                        paths_graphs: Optional[list] = None) -> dict:
    """`paths`: layer -> PathsParams that went into the graphs `paths_graphs` (the keys appear only
    when the artifact has a "paths" section, so other manifests are unchanged)."""
    if meta is None:
        return {"artifact": None, "dense": True}
    layers = meta.get("layers", [])
    out = {"artifact": str(path), "model": meta["model"].get("name"),
           "skip_layers": [L["index"] for L in layers if L.get("skip")],
           "pruned_heads": {k: len(v) for k, v in (meta.get("pruned_heads") or {}).items() if v},
           "quality": meta.get("quality", {}), "sih": meta.get("sih", {})}
    if meta.get("paths"):
        pm, paths, graphs = meta["paths"], paths or {}, list(paths_graphs or [])
        out["paths_layers"] = sorted(paths) if graphs else []
        out["paths"] = {"kind": (pm.get("predictor") or {}).get("kind"), "node": "ZeroEdgePathsFFN",
                        "graphs": graphs, "trt_dtype": "float16" if graphs else None,
                        "layers": {str(i): paths[i].attrs() for i in sorted(paths)} if graphs else {},
                        "budget": pm.get("budget"), "quality": pm.get("quality", {})}
        if not graphs:
            out["paths"]["not_applied"] = "a rewritten foreign graph has no decode graph"
    return out


def export_bundle(model: str, out, calib=None, target: str = "jetpack-6.2", window: int = 1024,
                  progress=None, force: bool = False, weights: str = "float16",
                  prefill_chunk: Optional[int] = None, group: Optional[int] = None,
                  symmetric: Optional[bool] = None, accuracy_level: Optional[int] = None,
                  zero_point: Optional[str] = None, flavours=FLAVOURS, cpu_kernels: str = "stock",
                  traced: Optional["TracedGraphs"] = None) -> dict:
    """Run the whole export; returns the manifest. weights: the dtype weights.bin stores them in
    (WEIGHT_DTYPES; see the module docstring). prefill_chunk: the runners' prefill chunk, recorded in
    the manifest's "prefill" (default zeroedge.bundle.DEFAULT_PREFILL_CHUNK). int4: group (default
    the artifact's, else 32), symmetric (default the artifact's, else asymmetric), accuracy_level
    (MatMulNBits' attribute; None leaves it out), zero_point ("int", the default, or "float":
    quantize_graph.Scheme); an artifact with a weights section folds its AWQ
    scales into the model first and sets the scheme (weights="int4" is then implied). flavours: the
    graph flavours written (FLAVOURS, or one of them: a bundle for one runtime, weights.bin only
    holding what that runtime reads). cpu_kernels: "stock" (onnxruntime's operators) or "zeroedge"
    (the portable decode graph's attention and float-zero-point 4-bit products as zeroedge.ort
    nodes, ortops/; portable flavour only); the manifest's "cpu_kernels" says which ran. traced: a
    TracedGraphs shared by the exports of one model (another bundle of it, other weights): the model is
    traced once."""
    import onnx
    import torch

    from zeroedge import bundle as bundle_mod
    from zeroedge import plugin_spec

    step = progress or (lambda msg: None)
    out, chunk, flavours = _checked_options(out, force, prefill_chunk, weights, flavours, cpu_kernels)
    t_start = time.perf_counter()
    meta, tensors, scheme, weights, paths = _read_calibration(calib, weights, group, symmetric, accuracy_level,
                                                              zero_point)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        graphs, info, model_cfg, folder, paths_graphs = _make_graphs(model, meta, tensors, paths, calib, tmp, step,
                                                                     scheme, cpu_kernels, traced)
        step("write bundle")
        files, opsets, params, halved, qinfo = _write_graphs(graphs, tmp, weights, info, scheme, step, flavours,
                                                             cpu_kernels)
        _copy_tokenizer_files(folder, tmp)
        mf = bundle_mod.write_manifest(tmp, {
            "opset": opsets.get("prefill"), "target": target, "plugin_abi": plugin_spec.PLUGIN_ABI,
            "plugin_namespace": plugin_spec.PLUGIN_NAMESPACE, "plugin_version": plugin_spec.PLUGIN_VERSION,
            "model": model_cfg, "calibration": calibration_summary(meta, calib, paths, paths_graphs),
            "window": int(window), "dtype": "float32", "graph_files": files,
            "cpu_kernels": info.pop("cpu_kernels", {"kind": "stock"}),
            "prefill": prefill_section(chunk, meta, foreign=_is_foreign_graph(model)),
            "weights": {"dtype": weights, "params": int(params or 0), "tensors_fp16": halved,
                        **({"quantization": qinfo} if qinfo else {})},
            "export": {**info, "seconds": round(time.perf_counter() - t_start, 2),
                       "torch": torch.__version__, "onnx": onnx.__version__}})
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        return mf
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _checked_options(out, force: bool, prefill_chunk: Optional[int], weights: str, flavours, cpu_kernels: str):
    """export_bundle's options checked before anything is read or written: (out as a Path, the
    prefill chunk, flavours as a tuple); a UserError for the first one that does not hold."""
    from zeroedge.bundle import DEFAULT_PREFILL_CHUNK

    chunk = int(prefill_chunk or DEFAULT_PREFILL_CHUNK)
    if chunk < 1:
        raise UserError(f"prefill chunk must be >= 1 (got {chunk})")
    if weights not in WEIGHT_DTYPES:
        raise UserError(f"weights must be one of {', '.join(WEIGHT_DTYPES)} (got {weights!r})")
    flavours = tuple(flavours)
    if cpu_kernels not in ("stock", "zeroedge"):
        raise UserError(f"cpu kernels: stock or zeroedge (got {cpu_kernels!r})")
    if cpu_kernels == "zeroedge" and flavours != ("portable",):
        raise UserError("cpu kernels zeroedge: the portable flavour only (--graphs portable)")
    if not flavours or any(f not in FLAVOURS for f in flavours) or len(set(flavours)) != len(flavours):
        raise UserError(f"graph flavours must be some of {', '.join(FLAVOURS)} "
                        f"(got {', '.join(flavours) or 'none'})")
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise UserError(f"{out} exists and is not empty (use --force to replace it)")
    return out, chunk, flavours


def _read_calibration(calib, weights: str, group, symmetric, accuracy_level, zero_point):
    """The artifact (if any), read before anything is written: (meta, tensors, 4-bit scheme or None,
    the weights dtype ("int4" when a scheme applies), decode paths by layer: refused (predictor) or
    read here)."""
    from zeroedge import calib_artifact
    from zeroedge.export import rewrite

    meta = tensors = None
    if calib is not None:
        meta, tensors = calib_artifact.load(calib)
    scheme = quant_scheme(weights, meta, group, symmetric, accuracy_level, calib, zero_point)
    if scheme is not None:
        weights = "int4"
    paths = rewrite.paths_from_artifact(meta, tensors) if meta else {}
    return meta, tensors, scheme, weights, paths


def _is_foreign_graph(model) -> bool:
    """MODEL names a foreign .onnx graph to rewrite (not a model zeroedge exports itself)."""
    return isinstance(model, str) and model.endswith(".onnx")


def _make_graphs(model, meta, tensors, paths: dict, calib, tmp: Path, step, scheme, cpu_kernels: str,
                 traced: Optional["TracedGraphs"] = None):
    """The graphs to write, from a foreign .onnx graph (_foreign_graphs) or a model zeroedge exports
    (_model_graphs): (graphs, info, model config, tokenizer folder or None, graphs carrying the decode
    paths)."""
    if _is_foreign_graph(model):
        if cpu_kernels != "stock":
            raise UserError("cpu kernels zeroedge: for zeroedge's own export of a model, not a foreign .onnx graph")
        return (*_foreign_graphs(model, meta, tensors, bool(paths), step), [])
    fold_awq, ort_kernels = scheme is not None and scheme.method == "awq", cpu_kernels == "zeroedge"
    key = (str(model), ort_kernels) if meta is None and isinstance(model, str) else None
    got = traced.take(key) if traced is not None and key is not None else None
    if got is None:
        got = _model_graphs(model, meta, tensors, paths, calib, tmp, step, fold_awq=fold_awq, ort_kernels=ort_kernels)
        if traced is not None and key is not None:
            traced.put(key, got)
    else:
        step("torch -> onnx: the graphs traced for another bundle of this model")
    graphs, info, model_cfg, folder = got
    return graphs, info, model_cfg, folder, ["decode"] if paths else []


class TracedGraphs:
    """A model's graphs as torch exported them (no artifact applied), kept for the next bundle of it:
    a copy (writing a bundle changes its protos), held until that export takes it."""

    def __init__(self):
        self._by_key = {}

    def put(self, key, got) -> None:
        graphs, info, model_cfg, folder = got
        self._by_key[key] = ({k: _copy_proto(g) for k, g in graphs.items()}, dict(info), model_cfg, folder)

    def take(self, key):
        return self._by_key.pop(key, None)


def _copy_proto(proto):
    import onnx

    p = onnx.ModelProto()
    p.CopyFrom(proto)
    return p


def _copy_tokenizer_files(folder, tmp: Path):
    """The model folder's tokenizer files (TOKENIZER_FILES it has) into the bundle."""
    if folder is not None:
        for f in TOKENIZER_FILES:
            if (Path(folder) / f).is_file():
                shutil.copy2(Path(folder) / f, tmp / f)


def prefill_section(chunk: int, meta: Optional[dict], foreign: bool = False) -> dict:
    """The manifest's "prefill": the chunk the runners prefill a long prompt in (a multiple of the SIH
    block rule's and rank rule's blocks, written as "multiple"), or one_pass with why (a foreign graph
    has no prefix inputs)."""
    from zeroedge.calib_artifact import Calibration

    if foreign:
        return {"chunk": None, "one_pass": True, "why": "a rewritten foreign graph has no prefix inputs"}
    multiple = 1
    for L in Calibration.from_meta(meta).skip_layers if meta else ():
        multiple = math.lcm(multiple, max(L.block_size, 1), L.rank_block if L.rate is not None else 1)
    out = {"chunk": -(-chunk // multiple) * multiple, "one_pass": False}
    return {**out, "multiple": multiple} if multiple > 1 else out


def _foreign_graphs(path: str, meta, tensors, has_paths: bool, step):
    """A foreign prefill graph, rewritten: ({"prefill": proto}, info, model config, None)."""
    import onnx

    from zeroedge.export import rewrite

    if not Path(path).is_file():
        raise UserError(f"graph not found: {path}")
    step("load graph")
    proto = onnx.load(str(path))
    params = rewrite.params_from_artifact(meta, tensors) if meta else {}
    cfg_d = (meta or {}).get("model", {}).get("config", {})
    hd = cfg_d.get("dim", 0) // max(cfg_d.get("n_heads", 1), 1)
    step("rewrite")
    pre, rinfo = rewrite.rewrite_model(proto, params, (meta or {}).get("pruned_heads"), hd, cfg_d.get("n_heads", 0))
    info = {"rewrite": {"layers_found": rinfo["report"]["matched_layers"],
                        "rewritten": rinfo["rewritten_layers"], "heads": rinfo["heads"]}}
    if has_paths:
        step("decode paths: not applied (a foreign graph has no decode graph)")
    return {"prefill": pre}, info, cfg_d, None


def _model_graphs(model: str, meta, tensors, paths: dict, calib, tmp: Path, step, fold_awq: bool = False,
                  ort_kernels: bool = False):
    """The model exported and rewritten: ({"prefill": proto, "decode": proto or {flavour: proto}},
    info, model config, tokenizer folder). fold_awq: fold the artifact's AWQ scales into the weights
    first (an identity of the fp model; the quantizer then sees W * s). ort_kernels: the decode
    graph's attention as zeroedge.ort WindowAttention nodes over a float16 K / V window."""
    from zeroedge import calib_artifact
    from zeroedge.export import onnx_export, rewrite

    step("load model")
    m, folder = resolve_model(model)
    if meta is not None:
        calib_artifact.check_model(meta, m.cfg, calib)
        for li, heads in (meta.get("pruned_heads") or {}).items():
            if heads:
                m.layers[int(li)].self_attn.prune_heads(heads)
        if fold_awq:
            from zeroedge.quant.apply import apply_artifact

            step("fold AWQ scales")
            apply_artifact(m, meta, tensors, quantize=False, where=str(calib))
    model_cfg = m.cfg.to_dict()
    step("torch -> onnx")
    pre, dec, secs = onnx_export.export_model_protos(m, tmp / "_raw", ort_kernels=ort_kernels)
    info = {"torch_export_s": secs}
    del m
    if meta is not None:
        step("rewrite")
        pre, rinfo = rewrite.rewrite_model(pre, rewrite.params_from_artifact(meta, tensors),
                                           expect_layers=model_cfg["n_layers"], chunked=True)
        info["rewrite"] = {"layers_found": rinfo["report"]["matched_layers"], "rewritten": rinfo["rewritten_layers"]}
    if paths:
        step("decode paths")
        n_l = model_cfg["n_layers"]
        dec_p, pinfo = rewrite.rewrite_decode_paths(dec, paths, expect_layers=n_l)
        # the TensorRT plugin takes fp16 / bf16 only: its flavour casts x / y, fp16 weights
        dec_t, _ = rewrite.rewrite_decode_paths(dec, paths, expect_layers=n_l, plugin_dtype=rewrite.PATHS_TRT_DTYPE)
        dec = {"portable": dec_p, "trt": dec_t}
        limits = rewrite.paths_plugin_limits(model_cfg["dim"], model_cfg["ffn_dim"])
        info["paths"] = {"layers_found": pinfo["report"]["matched_layers"], "rewritten": pinfo["rewritten_layers"],
                         "trt_dtype": rewrite.PATHS_TRT_DTYPE, "trt_plugin_limits": limits or "ok"}
        if limits:
            step(f"warning: decode.trt.onnx will not build with the ZeroEdgePathsFFN plugin ({limits}); "
                 "decode.portable.onnx is unaffected")
    shutil.rmtree(tmp / "_raw")
    return {"prefill": pre, "decode": dec}, info, model_cfg, folder


def _write_graphs(graphs: dict, tmp: Path, weights: str, info: dict, scheme=None, step=None, flavours=FLAVOURS,
                  cpu_kernels: str = "stock"):
    """Every graph in each of `flavours` (portable, TensorRT), weights once in weights.bin; returns
    (files, opsets, float parameters, tensors stored as fp16, quantization summary or None) and fills
    info["graphs"]. scheme (quantize_graph.Scheme): 4-bit linear layers, the rest as float16."""
    import onnx

    from zeroedge.export import ort_fusions, rewrite

    wf = WeightFile(tmp / WEIGHTS)
    files, opsets, params, halved = {}, {}, None, 0
    qinfo = scheme.to_dict() if scheme is not None else None
    for name in list(graphs):
        g = graphs.pop(name)                             # one proto, or one per flavour
        per = g if isinstance(g, dict) else {"portable": g, "trt": g}
        per = {f: per[f] for f in flavours}
        if params is None:                               # the prefill graph holds every weight
            params = _float_params(per[flavours[0]])
        if scheme is not None:
            if step:
                step(f"{name}: int4 weights (onnxruntime MatMulNBitsQuantizer)")
            per, qn = _quantize_flavours(per, scheme)
            qinfo.setdefault("nodes", {})[name] = qn
            if name == "prefill" or "quantized_params" not in qinfo:
                qinfo["quantized_params"] = _quantized_params(per[flavours[0]])
        done = {}
        for src in per.values():                         # weights out first: copies are cheap
            if id(src) not in done:
                if weights in ("float16", "int4"):
                    halved += half_weights(src)
                done[id(src)] = wf.externalize(src)
        if scheme is not None and name == "prefill":    # bytes of the quantized layers, as stored
            qinfo["bytes"] = {f: quantize_graph.stored_bytes(done[id(per[f])]) for f in flavours}
            emb = {f: quantize_graph.stored_bytes(done[id(per[f])], "embedding") for f in flavours}
            if emb[flavours[0]]:
                qinfo["embedding"] = {"bits": scheme.embedding_bits, "group": scheme.embedding_group,
                                      "params": _embedding_params(per[flavours[0]]), "bytes": emb}
            else:
                qinfo["embedding"] = {"bits": 0, "why": "no tied embedding / LM head pair whose width the group divides"}
        proto = done[id(per[flavours[0]])]
        for flavour in flavours:
            conv = rewrite.to_portable if flavour == "portable" else rewrite.to_trt
            p = onnx.ModelProto()
            p.CopyFrom(done[id(per[flavour])])
            conv(p)
            if flavour == "portable" and name == "decode":
                ort_fusions.fuse_decode(p)
                if cpu_kernels == "zeroedge":
                    # the 8-bit LM head: zeroedge's below accuracy level 4 (int16 inputs), else MatMulNBits' (int8)
                    head = scheme is not None and scheme.accuracy_level != 4
                    nodes = {"Q4Linear": ort_fusions.q4_linears(p), "Q4Linear swiglu": ort_fusions.swiglu_q4_linears(p),
                             "Q8Linear": ort_fusions.q8_linears(p) if head else 0,
                             "WindowAttention": sum(n.op_type == "WindowAttention" for n in p.graph.node)}
                    bits = {a.i for n in p.graph.node if n.op_type == "Q4Linear" for a in n.attribute
                            if a.name == "input_bits"}
                    info["cpu_kernels"] = {"kind": "zeroedge", "domain": ort_fusions.ORTOPS_DOMAIN, "nodes": nodes,
                                           **({"input_bits": bits.pop()} if len(bits) == 1 else {})}
            fn = f"{name}.{flavour}.onnx"
            onnx.save_model(p, str(tmp / fn))
            files[fn] = {"graph": name, "flavour": flavour}
        info.setdefault("graphs", {})[name] = graph_io(proto)
        opsets[name] = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    wf.close()
    return files, opsets, params, halved, qinfo
