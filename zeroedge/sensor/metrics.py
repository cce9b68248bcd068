"""Detection metrics on one run: FDR, FAR, detection delay (torch-free)."""
from __future__ import annotations

import numpy as np

HOLD = 6     # an alarm "stays raised" when it holds for 6 consecutive samples (18 min), or to the end


def detection_metrics(alarm, onset: int, hold: int = HOLD) -> dict:
    """alarm: bool per sample; the fault is active from sample `onset` on.

    fdr: fraction of samples from onset on that alarmed; far: fraction before onset that did;
    delay: samples from onset to the first alarm that stays raised (for `hold` consecutive samples,
    or until the run ends), None if there is none.
    """
    a = np.asarray(alarm, bool)
    post, pre = a[onset:], a[:onset]
    fdr = float(post.mean()) if len(post) else None
    far = float(pre.mean()) if len(pre) else None
    delay = None
    run = 0
    for i, v in enumerate(post):
        run = run + 1 if v else 0
        if run >= hold or (v and i == len(post) - 1):
            delay = i - run + 1
            break
    return {"fdr": fdr, "far": far, "delay": delay}


def ema(x: np.ndarray, alpha: float) -> np.ndarray:
    """Exponential moving average of a score series (the alarm filter), starting at x[0]."""
    out = np.empty_like(x)
    s = x[0]
    for i, v in enumerate(x):
        s = v if i == 0 else (1 - alpha) * s + alpha * v
        out[i] = s
    return out
