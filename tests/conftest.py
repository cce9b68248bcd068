"""Shared fixtures. Real SmolLM2 weights are loaded once per session (CPU, fp32)."""
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def run_cli(*args, check_rc=None, env=None, timeout=900):
    """Run `python -m zeroedge.cli ARGS` in a subprocess; returns CompletedProcess."""
    import subprocess

    e = dict(os.environ, **(env or {}))
    p = subprocess.run([sys.executable, "-m", "zeroedge.cli", *map(str, args)], capture_output=True,
                       text=True, env=e, timeout=timeout)
    if check_rc is not None:
        assert p.returncode == check_rc, f"rc={p.returncode}\nstdout:{p.stdout[-3000:]}\nstderr:{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="session")
def smollm2():
    import torch

    from zeroedge import weights

    torch.manual_seed(0)
    m, folder = weights.load("smollm2-135m")
    return m, folder


@pytest.fixture(scope="session")
def smol_tok(smollm2):
    from zeroedge import weights

    return weights.tokenizer(smollm2[1])
