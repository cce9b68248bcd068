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


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory, smollm2):
    """A tiny Llama (random weights, SmolLM2's tokenizer) saved in HF layout: fast CLI tests."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    from zeroedge import model as M

    folder = tmp_path_factory.mktemp("tiny-llama")
    cfg = M.PRESETS["tiny"].with_(vocab_size=49152, max_seq_len=2048, name="tiny-llama")
    m = M.build(cfg, seed=0)
    state = {f"model.{k}": v.contiguous() for k, v in m.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "intermediate_size": cfg.ffn_dim, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": True}))
    for f in smollm2[1].iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    from zeroedge import texts

    p = tmp_path_factory.mktemp("text") / "licenses.txt"
    p.write_text(texts.licenses())
    return p


# ---- the sensor daemon's tests (test_daemon*.py)

@pytest.fixture(scope="session")
def sensor_bundle(tmp_path_factory):
    """The shipped sensor detector as a bundle ($ZEROEDGE_SENSOR_BUNDLE: a prebuilt one)."""
    if os.environ.get("ZEROEDGE_SENSOR_BUNDLE"):
        return Path(os.environ["ZEROEDGE_SENSOR_BUNDLE"])
    from zeroedge.sensor.train import ensure_bundle

    return ensure_bundle(tmp_path_factory.mktemp("sensor-bundle") / "sensor")


@pytest.fixture(scope="session")
def tep_frames():
    """400 real TEP readings: 200 normal (d00), then 200 of fault 1 (d01)."""
    import numpy as np

    from zeroedge.sensor.tep import load_run

    data = SHARED / "data" / "tep-braatz"
    return np.concatenate([load_run(data / "d00.dat")[:200], load_run(data / "d01.dat")[:200]])


@pytest.fixture
def mqtt_broker(tmp_path):
    """A real mosquitto on 127.0.0.1 with persistence."""
    from zeroedge.daemon import testing as T

    if T.mosquitto_bin() is None:
        pytest.fail("mosquitto is not installed (scripts/setup installs it)")
    b = T.Broker(tmp_path / "broker").start()
    yield b
    b.stop()
