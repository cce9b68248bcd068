"""The decode path policies of a calibration artifact, for a model: what the serving session and the
evaluator install (zeroedge.paths.sparse.PathPolicy per sparse layer)."""
from __future__ import annotations

from zeroedge import calib_artifact
from zeroedge.errors import UserError
from zeroedge.paths.predictor import PathPredictor
from zeroedge.paths.sparse import PathPolicy


def policies_from_artifact(model, meta: dict, tensors: dict, where: str = "artifact") -> dict:
    """layer -> PathPolicy for every layer the artifact's paths section marks sparse; UserError when
    the artifact has no paths, was made for another model, or lacks a layer's tensors."""
    cal = calib_artifact.Calibration.from_meta(meta, where)
    paths = cal.require_paths()
    if meta.get("model"):
        calib_artifact.check_model(meta, model.cfg, where)
    if paths.n_layers != model.cfg.n_layers:
        raise UserError(f"{where}: 'paths' describes {paths.n_layers} layers, the model has {model.cfg.n_layers}")
    if paths.kind == "input-magnitude":
        return {i: PathPolicy(method="magnitude", threshold_in=t_in, threshold=t_act)
                for i, (t_in, t_act) in paths.magnitude_thresholds(tensors, where).items()}
    pol = {}
    D, F = model.cfg.dim, model.cfg.ffn_dim
    for i in paths.sparse:
        try:
            p = PathPredictor.from_state(tensors, f"layers.{i}.paths")
        except KeyError as e:
            raise UserError(f"{where}: layer {i} path predictor tensors missing ({e})") from None
        if p.a.shape[0] != D or p.bg.shape[1] != F or p.bu.shape != p.bg.shape:
            raise UserError(f"{where}: layer {i} path predictor has shape {tuple(p.a.shape)} x "
                            f"{tuple(p.bg.shape)}, the model needs D={D}, F={F}")
        pol[i] = PathPolicy(method="predictor", predictor=p)
    return pol
