"""The calibration artifact `zeroedge calibrate` writes and everything downstream reads.

An artifact is a directory:
  calib.json          meta (schema below)
  calib.safetensors   tensors, fp32:
                        layers.{i}.sih.{w1,b1,w2,b2,w3,b3,w4,b4}   SIH head (4 linear layers)
                        layers.{i}.anchor.{a,b,c}                  anchor: b @ (a @ x) + c, a: [r, D]
                        layers.{i}.paths.threshold_in / threshold_act   decode paths, magnitude rule
                        layers.{i}.paths.{a,bg,bu,...}             decode paths, low-rank predictor
meta = {
  "format": "zeroedge-calibration", "format_version": 1,
  "model": {"name": str, "config": {...ModelConfig...}},
  "sih": {"width": int, "ma_weights": [w0, w1, w2], "min_tokens": 32, "protect_first": 4,
          "bytes_fp16": int, "scorer": "sih" | "norm" | "random" (optional, default sih)},
  "layers": [{"index": i, "skip": bool, "threshold": float | None, "anchor_rank": int,
              "block_size": int, "block_frac": float, "skip_rate": float,
              "rate": float | None, "rank_block": int}],   rate set: the rank rule (plugin_spec), threshold null
  "pruned_heads": {"<layer>": [head, ...]},
  "quality": {"budget": float, "dense_ppl": float, "zero_ppl": float, "ffn_flops_skipped": float,
              ...},
  "paths": {                                       (optional: zeroedge calibrate --paths)
    "format": "zeroedge-paths", "version": 1, "budget": float,
    "predictor": {"kind": "input-magnitude" | "whitened-lowrank-swiglu", ...},
    "layers": [{"index": i, "sparse": bool, "threshold": float, ...}],   one per model layer
    "quality": {...}},
  "weights": {                                     (optional: zeroedge calibrate --weights)
    "format": "zeroedge-weights", "version": 1, "layout": "onnxruntime-matmulnbits",
    "scheme": "int4" | "int8", "bits": 4 | 8, "group": 32 | 64 | 128, "symmetric": bool,
    "zero_point": "int" | "float" (optional, default int; float: asymmetric int4, fp16 min/max grid),
    "method": "rtn" | "awq", "embedding": {"bits": 8, "group": int, "symmetric": true} | null,
    "awq": {"alpha": [[qkv, o, gate_up, down] per layer], "grid": int, "tokens": int} (method awq),
    "quality": {...}},
}
  tensors of the weights section (method awq), the per input channel scales s > 0 folded into the
  model before quantizing (zeroedge.quant.apply):
                        layers.{i}.awq.qkv      [dim]     q/k/v columns * s, input_layernorm / s
                        layers.{i}.awq.o        [n_kv_heads * head_dim]  o_proj columns of every
                                                          query head of a kv head * s, v_proj rows / s
                        layers.{i}.awq.gate_up  [dim]     gate/up columns * s, post_attention_layernorm / s
                        layers.{i}.awq.down     [ffn_dim] down_proj columns * s, up_proj rows / s

`read_meta` validates every section once (UserError naming what is wrong) and `read` gives the typed
view, `Calibration`, that the exporter, the evaluators and the serving session use; defaults of the
SIH fields come from the plugin contract (zeroedge.plugin_spec). Torch is imported only by
load_tensors / save.
"""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from zeroedge import plugin_spec
from zeroedge.errors import UserError

FORMAT = "zeroedge-calibration"
FORMAT_VERSION = 1
META, TENSORS = "calib.json", "calib.safetensors"
PATHS_FORMAT, PATHS_VERSION = "zeroedge-paths", 1
PATH_KINDS = ("input-magnitude", "whitened-lowrank-swiglu")
WEIGHTS_FORMAT, WEIGHTS_VERSION, WEIGHTS_LAYOUT = "zeroedge-weights", 1, "onnxruntime-matmulnbits"
WEIGHT_METHODS = ("rtn", "awq")
WEIGHT_BITS = (4, 8)
WEIGHT_GROUPS = (32, 64, 128)
EMBEDDING_BITS = (4, 8)
AWQ_GROUPS = ("qkv", "o", "gate_up", "down")   # the scaled layer groups of a block, in this order

SIH_DEFAULTS = plugin_spec.SIH_DEFAULTS
# The token rankings an artifact may deploy (meta["sih"]["scorer"], `calibrate --scorer`): each scores
# a position from that position alone (SIH: its head on the FFN input, smoothed over 3 positions;
# norm: the input's norm; random: a draw seeded by layer and position), so a prompt prefilled in
# chunks skips the rows one pass would. Only "sih" has the TensorRT / onnxruntime plugins.
SCORERS = ("sih", "norm", "random")


@dataclass(frozen=True)
class SihSettings:
    """meta["sih"]: what every skip layer shares."""
    width: int
    ma_weights: Tuple[float, float, float]
    min_tokens: int
    protect_first: int
    protect_last: int
    scorer: str = "sih"

    def require_plugins(self, where: str) -> None:
        """The one error for an artifact whose ranking the bundles' plugins cannot run."""
        if self.scorer != "sih":
            raise UserError(f"{where} ranks prompt tokens by {self.scorer} (calibrate --scorer {self.scorer}); "
                            "the bundles' plugins run SIH heads only: calibrate with --scorer sih to export "
                            "(`zeroedge eval` measures this one)")


@dataclass(frozen=True)
class SkipLayer:
    """A layer whose FFN SIH may skip (meta["layers"] entries with skip = true): by the threshold rule, or
    by the rank rule when `rate` is set (zeroedge.plugin_spec)."""
    index: int
    threshold: Optional[float]
    anchor_rank: int
    block_size: int
    block_frac: float
    rate: Optional[float] = None
    rank_block: int = SIH_DEFAULTS["rank_block"]


@dataclass(frozen=True)
class PathsSection:
    """meta["paths"]: the decode paths. kind: "input-magnitude" (thresholds, a graph node exists) or
    "whitened-lowrank-swiglu" (a predictor the torch decoders run)."""
    kind: str
    sparse: Tuple[int, ...]
    n_layers: int
    meta: dict

    def magnitude_thresholds(self, tensors: dict, where: str = "calibration artifact") -> Dict[int, Tuple[float, float]]:
        """layer -> (threshold_in, threshold_act) for the magnitude rule, checked finite and >= 0."""
        out = {}
        for i in self.sparse:
            names = [f"layers.{i}.paths.threshold_in", f"layers.{i}.paths.threshold_act"]
            missing = [n for n in names if n not in tensors]
            if missing:
                raise UserError(f"{where}: layer {i} path thresholds missing ({', '.join(missing)})")
            t_in, t_act = (float(tensors[n].reshape(-1)[0]) for n in names)
            if not (math.isfinite(t_in) and math.isfinite(t_act) and t_in >= 0 and t_act >= 0):
                raise UserError(f"{where}: layer {i} path thresholds must be finite and >= 0 "
                                f"(threshold_in {t_in}, threshold_act {t_act})")
            out[i] = (t_in, t_act)
        return out


@dataclass(frozen=True)
class WeightsSection:
    """meta["weights"]: weight-only quantization of every linear layer of the blocks (MatMulNBits'
    numerics, zeroedge.quant.groupwise), RTN or AWQ-scaled; the embedding (= tied LM head) int8,
    int4 (symmetric; the torch decode path only: the ONNX export refuses it) or kept (embedding_bits 0)."""
    bits: int
    group: int
    symmetric: bool
    method: str
    embedding_bits: int
    embedding_group: int
    meta: dict
    zero_point: str = "int"         # asymmetric: "int" (MatMulNBitsQuantizer's) or "float" (Q4_1's form)

    @property
    def scheme(self) -> str:
        return f"int{self.bits}"

    def describe(self) -> str:
        emb = f"embedding int{self.embedding_bits}" if self.embedding_bits else "embedding kept"
        zp = " float-zp" if self.zero_point == "float" else ""
        return (f"{self.scheme} g{self.group} {'sym' if self.symmetric else 'asym'}{zp} {self.method.upper()}, "
                f"{emb}")

    def awq_scales(self, tensors: dict, cfg: dict, where: str = "calibration artifact") -> Dict[int, Dict[str, object]]:
        """layer -> {qkv, o, gate_up, down: scale tensor}, checked: every layer present, the right
        length for the model (cfg: the artifact's model config), finite and > 0. {} for RTN."""
        if self.method != "awq":
            return {}
        hd = cfg["dim"] // cfg["n_heads"]
        size = {"qkv": cfg["dim"], "o": cfg["n_kv_heads"] * hd, "gate_up": cfg["dim"], "down": cfg["ffn_dim"]}
        out = {}
        for i in range(cfg["n_layers"]):
            out[i] = {}
            for g in AWQ_GROUPS:
                name = f"layers.{i}.awq.{g}"
                t = tensors.get(name)
                if t is None:
                    raise UserError(f"{where}: AWQ scales {name} missing")
                if tuple(t.shape) != (size[g],):
                    raise UserError(f"{where}: {name} has shape {tuple(t.shape)}, the model needs ({size[g]},)")
                if not bool((t > 0).all()) or not bool(t.isfinite().all()):
                    raise UserError(f"{where}: {name} must be finite and > 0")
                out[i][g] = t
        return out


@dataclass(frozen=True)
class Calibration:
    """The typed view of an artifact's meta (validated by `from_meta`)."""
    where: str
    model_name: str
    model_config: dict
    sih: SihSettings
    skip_layers: Tuple[SkipLayer, ...]
    pruned_heads: Dict[int, List[int]]
    paths: Optional[PathsSection]
    quality: dict
    weights: Optional[WeightsSection] = None

    @classmethod
    def from_meta(cls, meta: dict, where: str = "calibration artifact") -> "Calibration":
        def bad(msg):
            return UserError(f"{where}: {msg}")

        model = meta.get("model")
        if not isinstance(model, dict) or not isinstance(model.get("config", {}), dict):
            raise bad("artifact 'model' section is not an object")
        cfg = model.get("config", {})
        n_layers = cfg.get("n_layers")
        s = meta.get("sih", {})                 # a paths-only artifact has no SIH section
        if not isinstance(s, dict):
            raise bad("artifact 'sih' section is not an object")
        try:
            ma = tuple(float(w) for w in s.get("ma_weights", [SIH_DEFAULTS[k] for k in ("ma_w0", "ma_w1", "ma_w2")]))
            sih = SihSettings(int(s.get("width", 0)), ma, int(s.get("min_tokens", SIH_DEFAULTS["min_tokens"])),
                              int(s.get("protect_first", SIH_DEFAULTS["protect_first"])),
                              int(s.get("protect_last", SIH_DEFAULTS["protect_last"])), s.get("scorer", "sih"))
        except (TypeError, ValueError):
            raise bad("artifact 'sih' section has a non-numeric value") from None
        if sih.scorer not in SCORERS:
            raise bad(f"'sih.scorer' must be one of {', '.join(SCORERS)}, not {sih.scorer!r:.40}")
        if len(ma) != 3:
            raise bad(f"'sih.ma_weights' must hold 3 weights, got {len(ma)}")
        layers = meta.get("layers", [])
        if not isinstance(layers, list):
            raise bad("artifact 'layers' is not a list")
        skips = []
        for lm in layers:
            try:
                rate = lm.get("rate")
                if not lm.get("skip") or (lm.get("threshold") is None and rate is None):
                    continue
                layer = SkipLayer(int(lm["index"]), None if rate is not None else float(lm["threshold"]),
                                  int(lm.get("anchor_rank") or 0),
                                  int(lm.get("block_size") or SIH_DEFAULTS["block_size"]),
                                  float(lm.get("block_frac", SIH_DEFAULTS["block_frac"])),
                                  None if rate is None else float(rate),
                                  int(lm.get("rank_block") or SIH_DEFAULTS["rank_block"]))
            except (AttributeError, KeyError, TypeError, ValueError):
                raise bad(f"artifact 'layers' entry {lm!r:.80} is malformed") from None
            if layer.rate is not None:      # the plugins' field rules, and a rate that is not the threshold rule's
                problems = (["field 'rate' must be >= 0"] if layer.rate < 0 else []) + plugin_spec.field_value_problems(
                    "ZeroEdgeSIH", {"threshold": 0.0, "rate": layer.rate, "rank_block": layer.rank_block,
                                    "block_size": layer.block_size})
                if problems:
                    raise bad(f"layer {layer.index}: a rank-rule layer needs 'rate' in [0, 1]: {'; '.join(problems)}")
            skips.append(layer)
        if n_layers is not None:
            out_of_range = [L.index for L in skips if not 0 <= L.index < n_layers]
            if out_of_range:
                raise bad(f"skip layers {out_of_range} are outside the model's {n_layers} layers")
        try:
            pruned = {int(k): [int(h) for h in v] for k, v in (meta.get("pruned_heads") or {}).items()}
        except (AttributeError, TypeError, ValueError):
            raise bad("artifact 'pruned_heads' must map a layer to a list of heads") from None
        return cls(where, str(model.get("name") or "?"), cfg, sih, tuple(skips), pruned,
                   _paths_section(meta.get("paths"), n_layers, bad), dict(meta.get("quality") or {}),
                   _weights_section(meta.get("weights"), bad))

    @property
    def has_sih(self) -> bool:
        """Whether the artifact carries SIH/PAD policies (a weights-only artifact does not)."""
        return bool(self.skip_layers or self.pruned_heads)

    def require_paths(self) -> PathsSection:
        """The paths section, or the one error that says it is missing."""
        if self.paths is None:
            raise UserError(f"{self.where} has no decode path predictors (meta section 'paths' is missing): "
                            "re-run zeroedge calibrate with --paths")
        return self.paths


def _section(d, name: str, fmt: str, version, bad) -> bool:
    """Whether the artifact has section `name` (absent or empty: False); one that is not an object
    or of another format / version is refused."""
    if not d:
        return False
    if not isinstance(d, dict):
        raise bad(f"artifact '{name}' section is not an object")
    if d.get("format", fmt) != fmt or d.get("version", version) != version:
        raise bad(f"'{name}' section format {d.get('format')} v{d.get('version')} is not {fmt} v{version}; "
                  f"re-run zeroedge calibrate --{name}")
    return True


def _paths_section(p, n_layers, bad) -> Optional[PathsSection]:
    if not _section(p, "paths", PATHS_FORMAT, PATHS_VERSION, bad):
        return None
    layers = p.get("layers")
    n = n_layers if n_layers is not None else (len(layers) if isinstance(layers, list) else None)
    if not isinstance(layers, list) or len(layers) != n:
        raise bad(f"'paths' describes {len(layers) if isinstance(layers, list) else 'no'} layers, the model has {n}")
    try:
        sparse = tuple(sorted(int(lm["index"]) for lm in layers if lm.get("sparse")))
    except (AttributeError, KeyError, TypeError, ValueError):
        raise bad("'paths' layers are malformed") from None
    if not sparse:
        raise bad("'paths' marks no layer sparse; nothing to run sparse")
    outside = [i for i in sparse if not 0 <= i < n]
    if outside:
        raise bad(f"'paths' marks layers {outside} sparse, which the model lacks")
    kind = (p.get("predictor") or {}).get("kind", "whitened-lowrank-swiglu")
    if kind not in PATH_KINDS:
        raise bad(f"unknown path predictor kind {kind!r}")
    return PathsSection(kind, sparse, n, p)


def _weights_section(w, bad) -> Optional[WeightsSection]:
    if not _section(w, "weights", WEIGHTS_FORMAT, WEIGHTS_VERSION, bad):
        return None
    if w.get("layout", WEIGHTS_LAYOUT) != WEIGHTS_LAYOUT:
        raise bad(f"'weights' layout {w.get('layout')!r} is not {WEIGHTS_LAYOUT!r}")
    emb = w.get("embedding")
    try:
        bits, group, sym = int(w["bits"]), int(w["group"]), w["symmetric"]
        eb, eg = (int(emb["bits"]), int(emb["group"])) if emb else (0, 0)
    except (KeyError, TypeError, ValueError):
        raise bad("'weights' needs integer 'bits' and 'group', 'symmetric', and an embedding of "
                  "integer 'bits' and 'group' or null") from None
    if bits not in WEIGHT_BITS or group not in WEIGHT_GROUPS:
        raise bad(f"'weights' int{bits} group {group} unsupported (bits {WEIGHT_BITS}, groups {WEIGHT_GROUPS})")
    if not isinstance(sym, bool):
        raise bad("'weights.symmetric' must be true or false")
    if emb and (eb not in EMBEDDING_BITS or eg not in WEIGHT_GROUPS):
        raise bad(f"'weights.embedding' int{eb} group {eg} unsupported (int8 or int4, groups {WEIGHT_GROUPS})")
    method = w.get("method")
    if method not in WEIGHT_METHODS:
        raise bad(f"'weights.method' {method!r} is not one of {', '.join(WEIGHT_METHODS)}")
    zp = w.get("zero_point", "int")
    if zp not in ("int", "float") or (zp == "float" and (sym or bits != 4)):
        raise bad(f"'weights.zero_point' {zp!r}: 'int', or 'float' for an asymmetric int4 grid")
    return WeightsSection(bits, group, sym, method, eb, eg, w, zp)


def weights_meta(bits: int, group: int, symmetric: bool, method: str, embedding_group: Optional[int],
                 embedding_bits: int = 8, **extra) -> dict:
    """A weights section (meta["weights"]) as `zeroedge calibrate --weights` writes it; checked."""
    w = {"format": WEIGHTS_FORMAT, "version": WEIGHTS_VERSION, "layout": WEIGHTS_LAYOUT, "scheme": f"int{bits}",
         "bits": bits, "group": group, "symmetric": symmetric, "method": method,
         "embedding": ({"bits": embedding_bits, "group": embedding_group, "symmetric": True}
                       if embedding_group else None),
         **extra}
    weights_section(w)
    return w


def weights_section(w: dict, where: str = "weights section") -> WeightsSection:
    """The typed view of one weights section (UserError naming what is wrong)."""
    return _weights_section(w, lambda msg: UserError(f"{where}: {msg}"))


def read_meta(path) -> dict:
    p = Path(path)
    if not p.exists():
        raise UserError(f"calibration artifact not found: {path}")
    if not (p / META).is_file():
        raise UserError(f"{path}: not a calibration artifact (no {META})")
    try:
        meta = json.loads((p / META).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{p / META}: corrupt ({e})") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{path}: not a zeroedge calibration artifact")
    if meta.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: artifact format {meta.get('format_version')} unsupported "
                        f"(expected {FORMAT_VERSION}); re-run zeroedge calibrate")
    for key in ("model", "layers", "sih"):
        if key not in meta:
            raise UserError(f"{path}: artifact is missing '{key}'")
    Calibration.from_meta(meta, str(path))       # every section checked once, here
    return meta


def read(path) -> Calibration:
    """The artifact's validated, typed meta."""
    return Calibration.from_meta(read_meta(path), str(path))


def load_tensors(path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    f = Path(path) / TENSORS
    if not f.is_file():
        raise UserError(f"{path}: artifact is missing {TENSORS}")
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{f}: corrupt tensors ({e})") from None


def load(path):
    meta = read_meta(path)
    return meta, load_tensors(path)


SHAPE_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")


def shape_mismatch(theirs: dict, mine: dict):
    """None when two model configs (dicts) have the same shape, else (theirs, mine) as 'k=v, ...'."""
    diff = [k for k in SHAPE_KEYS if theirs.get(k) != mine.get(k)]
    if not diff:
        return None
    return (", ".join(f"{k}={theirs.get(k)}" for k in diff), ", ".join(f"{k}={mine.get(k)}" for k in diff))


def check_model(meta: dict, cfg, path="artifact") -> None:
    """UserError unless the artifact was made for a model of exactly this shape."""
    bad = shape_mismatch(meta["model"].get("config", {}), cfg.to_dict())
    if bad:
        raise UserError(f"{path} was calibrated for {meta['model'].get('name')} ({bad[0]}), not for "
                        f"{cfg.name} ({bad[1]})")


def save(path, meta: dict, tensors: dict) -> None:
    """Write atomically: a temp directory renamed into place, so a failure leaves nothing."""
    from safetensors.torch import save_file

    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        save_file({k: v.detach().float().contiguous() for k, v in tensors.items()},
                  str(tmp / TENSORS))
        full = {"format": FORMAT, "format_version": FORMAT_VERSION, **meta}
        (tmp / META).write_text(json.dumps(full, indent=2))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
