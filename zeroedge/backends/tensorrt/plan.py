"""The builder's sizes: the workspace and the longest prompt from a bundle's plan, and one
optimisation profile per graph (`profile_shapes`).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple


DEFAULT_WORKSPACE = 256 << 20


def workspace_from_plan(manifest: dict) -> int:
    """Workspace bytes from the bundle's plan (keys workspace / workspace_bytes / workspace_mb, at the
    top level or under "memory"), else DEFAULT_WORKSPACE."""
    plan = manifest.get("plan") if isinstance(manifest.get("plan"), dict) else {}
    for scope in (plan, plan.get("memory") if isinstance(plan.get("memory"), dict) else {}):
        for key, scale in (("workspace_bytes", 1), ("workspace", 1), ("workspace_mb", 1 << 20)):
            v = scope.get(key)
            if isinstance(v, (int, float)) and v > 0:
                return int(v * scale)
    return DEFAULT_WORKSPACE


def max_tokens_from_plan(manifest: dict) -> int:
    plan = manifest.get("plan") if isinstance(manifest.get("plan"), dict) else {}
    for key in ("max_tokens", "context"):
        if isinstance(plan.get(key), int) and plan[key] > 0:
            return int(plan[key])
    return max(int(manifest.get("window") or 0), 2048)


def profile_shapes(inputs: Sequence[Tuple[str, Sequence[int]]], max_tokens: int, window: int,
                   overrides: Optional[Dict[str, Tuple]] = None,
                   chunk: Optional[int] = None) -> Dict[str, Tuple[Tuple, Tuple, Tuple]]:
    """min / opt / max per network input with a dynamic (-1) dimension: the token dimension of
    `tokens` spans 1..max_tokens (opt: min(512, max)); any other dynamic dimension is the KV window.
    A prefill graph with prefix K/V inputs (prefix_k.i / prefix_v.i [B, P, Hkv, hd]): chunked
    (`chunk`), tokens span 1..min(chunk, max_tokens) and P 0..max_tokens-1 (opt: half); one pass
    (chunk None), tokens span 1..max_tokens and P is 0 (empty)."""
    out = {}
    chunked = chunk is not None and any(n.startswith("prefix_") for n, _ in inputs)
    tok_hi = min(int(chunk), max_tokens) if chunked else max_tokens
    for name, shape in inputs:
        if overrides and name in overrides:
            out[name] = tuple(tuple(int(v) for v in s) for s in overrides[name])
            continue
        if all(int(d) >= 0 for d in shape):
            continue
        lo, opt, hi = [], [], []
        for i, d in enumerate(shape):
            d = int(d)
            if d >= 0:
                lo.append(d), opt.append(d), hi.append(d)
            elif name == "tokens" and i == len(shape) - 1:
                lo.append(1), opt.append(min(512, tok_hi)), hi.append(tok_hi)
            elif i == 0:
                lo.append(1), opt.append(1), hi.append(1)          # batch
            elif name.startswith("prefix_") and i == 1:
                top = max_tokens - 1 if chunked else 0
                lo.append(0), opt.append(top // 2), hi.append(top)
            else:
                lo.append(window), opt.append(window), hi.append(window)
        out[name] = (tuple(lo), tuple(opt), tuple(hi))
    return out
