"""The one way tests make calibration artifacts (through calib_artifact.save, the one writer), in the
format `zeroedge calibrate` writes: random SIH heads and anchors for a preset or config
(`sih_artifact`), and a decode-paths section added to one (`with_paths`, magnitude thresholds or a
low-rank predictor)."""
import torch

PATHS = {0: (0.5, 0.004), 2: (0.3, 0.003)}    # layer -> (threshold_in, threshold_act): ~half kept
SIH_SKIP = [1, 2]                             # layer 2 carries SIH/PAD in prefill and paths in decode


def sih_artifact(path, preset, thr=None, skip=None, prune=None, rank=4, block=None, seed=0, cfg=None, rate=None,
                 rank_block=512):
    """A calibration artifact with random SIH heads / anchors (the format zeroedge calibrate writes);
    `rate` (layer -> rate): those layers by the rank rule in blocks of `rank_block`."""
    from zeroedge import calib_artifact
    from zeroedge.mechanisms.anchors import Anchor
    from zeroedge.mechanisms.sih import SIHHead, head_width
    from zeroedge.model import PRESETS

    cfg = cfg or PRESETS[preset]
    g = torch.Generator().manual_seed(seed)
    t, layers = {}, []
    W = head_width(cfg.dim)
    skip = range(cfg.n_layers) if skip is None else skip
    for i in range(cfg.n_layers):
        torch.manual_seed(seed * 100 + i)
        h = SIHHead(cfg.dim, W)
        t.update(h.state(f"layers.{i}.sih"))
        a = Anchor(torch.randn(rank, cfg.dim, generator=g) * 0.05, torch.randn(cfg.dim, rank, generator=g) * 0.05,
                   torch.randn(cfg.dim, generator=g) * 0.01)
        t.update(a.state(f"layers.{i}.anchor"))
        r = (rate or {}).get(i)
        layers.append({"index": i, "skip": i in skip, "threshold": None if r is not None else (thr or {}).get(i, 0.5),
                       "anchor_rank": rank, "block_size": (block or {}).get(i, 0), "block_frac": 0.7,
                       "skip_rate": 0.3, "rate": r, "rank_block": rank_block})
    meta = {"model": {"name": cfg.name, "config": cfg.to_dict()},
            "sih": {"width": W, "ma_weights": [0.5, 1 / 3, 1 / 6], "min_tokens": 32, "protect_first": 4,
                    "bytes_fp16": 0},
            "layers": layers, "pruned_heads": prune or {},
            "quality": {"budget": 0.02, "ffn_flops_skipped": 0.3}}
    calib_artifact.save(path, meta, t)
    return meta, t



def with_paths(path, meta, tensors, paths=PATHS, kind="input-magnitude", n_layers=4):
    """Add a "paths" section (the format zeroedge calibrate --paths writes) and save the artifact."""
    from zeroedge import calib_artifact

    meta, tensors = dict(meta), dict(tensors)
    layers = []
    for i in range(n_layers):
        on = i in paths
        layers.append({"index": i, "sparse": on, "keep_planned": 0.7 if on else 1.0,
                       "threshold": paths[i][1] if on else None,
                       "threshold_in": paths[i][0] if on and kind == "input-magnitude" else None,
                       "kept_heldout": 0.6 if on else 1.0})
        if on and kind == "input-magnitude":
            tensors[f"layers.{i}.paths.threshold_in"] = torch.tensor([paths[i][0]])
            tensors[f"layers.{i}.paths.threshold_act"] = torch.tensor([paths[i][1]])
    meta["paths"] = {"format": "zeroedge-paths", "version": 1, "budget": 0.05,
                     "predictor": {"kind": kind, "weights": 0},
                     "layers": layers, "quality": {"budget": 0.05, "ppl_rise": 0.01,
                                                   "ffn_bytes_skipped": 0.2}}
    if kind == "whitened-lowrank-swiglu":
        meta["paths"]["predictor"].update(rank=4)
        for i in paths:
            g = torch.Generator().manual_seed(i)
            tensors.update({f"layers.{i}.paths.{k}": torch.randn(*s, generator=g) for k, s in
                            (("a", (64, 4)), ("bg", (4, 128)), ("bu", (4, 128)), ("wd_norm", (128,)))})
            tensors[f"layers.{i}.paths.threshold"] = torch.tensor([0.1])
    calib_artifact.save(path, meta, tensors)
    return meta, tensors


def paths_only(path, cfg, layers=(0, 2), thresholds=(0.5, 0.01), **over):
    """An artifact with decode paths (magnitude rule) on `layers` and no SIH section: what
    `zeroedge calibrate --paths` adds, on its own. Returns the path."""
    meta = {"model": {"name": cfg.name, "config": cfg.to_dict()}, "layers": [], "sih": {}}
    meta.update(over)
    with_paths(path, meta, {}, paths={i: thresholds for i in layers}, n_layers=cfg.n_layers)
    return path
