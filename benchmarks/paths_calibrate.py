"""Calibrate decode path predictors on SmolLM2 (KJV + essays, first 24000 tokens of each, as
`zeroedge calibrate` reads them) and write a paths-only calibration artifact.

  python benchmarks/paths_calibrate.py OUT_DIR [--budget 0.02] [--method predictor|magnitude]
                                       [--costs first_order|measured]
"""
import argparse
import sys

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--budget", type=float, default=0.02)
    ap.add_argument("--tokens", type=int, default=24000)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--method", default="magnitude", choices=("predictor", "magnitude"))
    ap.add_argument("--costs", default="first_order", choices=("first_order", "measured"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    from zeroedge import calib_artifact, texts, weights
    from zeroedge.export.paths_calibrate import PathBudgetError, PathsConfig, calibrate_paths

    m, folder = weights.load("smollm2-135m")
    tok = weights.tokenizer(folder)
    lists = [tok.encode(texts.load_text(t)[: 8 * a.tokens], add_special_tokens=False)[: a.tokens]
             for t in ("kjv", "essays")]
    log = lambda s: print(s, file=sys.stderr, flush=True)
    try:
        meta, tensors = calibrate_paths(m, lists, a.budget, log=log, cfg=PathsConfig(rank=a.rank, method=a.method,
                                                                                     costs=a.costs))
    except PathBudgetError as e:
        sys.exit(f"{e}; nothing written")
    full = {"model": {"name": m.cfg.name, "config": m.cfg.to_dict()}, "layers": [], "sih": {},
            "pruned_heads": {}, "paths": meta, "texts": ["kjv", "essays"]}
    calib_artifact.save(a.out, full, tensors)
    print(meta["quality"])


if __name__ == "__main__":
    main()
