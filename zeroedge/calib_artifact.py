"""The calibration artifact `zeroedge calibrate` writes and everything downstream reads.

An artifact is a directory:
  calib.json          meta (schema below)
  calib.safetensors   tensors, fp32:
                        layers.{i}.sih.{w1,b1,w2,b2,w3,b3,w4,b4}   SIH head (4 linear layers)
                        layers.{i}.anchor.{a,b,c}                  anchor: b @ (a @ x) + c, a: [r, D]
                        layers.{i}.paths.*                         decode path predictor (issue 5)
meta = {
  "format": "zeroedge-calibration", "format_version": 1,
  "model": {"name": str, "config": {...ModelConfig...}},
  "sih": {"width": int, "ma_weights": [w0, w1, w2], "min_tokens": 32, "protect_first": 4,
          "bytes_fp16": int},
  "layers": [{"index": i, "skip": bool, "threshold": float | None, "anchor_rank": int,
              "block_size": int, "block_frac": float, "skip_rate": float}],
  "pruned_heads": {"<layer>": [head, ...]},
  "quality": {"budget": float, "dense_ppl": float, "zero_ppl": float, "ffn_flops_skipped": float,
              ...},
}
Torch is imported only by load_tensors / save.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from zeroedge.errors import UserError

FORMAT = "zeroedge-calibration"
FORMAT_VERSION = 1
META, TENSORS = "calib.json", "calib.safetensors"


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
    return meta


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
