"""The rewrite on graphs zeroedge did not write: torch.onnx.export(..., dynamo=True) of transformers'
LlamaForCausalLM (SmolLM2 real weights, first 2 layers to keep CI fast; the full 30-layer graph is
in benchmarks/export.md) and of a small Qwen2ForCausalLM config (random weights)."""
import numpy as np
import pytest

from conftest import run_cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def dynamo_export(model, path, seq=40):
    import warnings

    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(model, (ids,), dynamo=True, input_names=["input_ids"], output_names=["logits"],
                                 dynamic_shapes=({1: torch.export.Dim("seq", min=2, max=1024)},), verbose=False)
    prog.save(str(path), external_data=True)
    with torch.no_grad():
        ref = model(ids).logits.numpy()
    return ids.numpy(), ref


def run_graph(path, ids):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return s.run(None, {s.get_inputs()[0].name: ids})[0]


def cfg_of(hf, name):
    from zeroedge.model import ModelConfig

    c = hf.config
    return ModelConfig(vocab_size=c.vocab_size, dim=c.hidden_size, n_layers=c.num_hidden_layers,
                       n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads,
                       ffn_dim=c.intermediate_size, name=name)


def check_foreign(hf, name, tmp_path):
    from artifacts import sih_artifact

    from zeroedge.export.bundle_writer import export_bundle
    from zeroedge.export.rewrite import find_layers

    import onnx_graphsurgeon as gs

    hf.config.use_cache = False
    ids, ref = dynamo_export(hf.eval(), tmp_path / "g.onnx")
    n = hf.config.num_hidden_layers
    matches, report = find_layers(gs.import_onnx(onnx.load(str(tmp_path / "g.onnx"))))
    assert len(matches) == n and [m.index for m in matches] == list(range(n)), report
    assert all(m.dim == hf.config.hidden_size and m.ffn_dim == hf.config.intermediate_size for m in matches)
    cfg = cfg_of(hf, name)
    # threshold 0: every token kept -> the rewritten graph computes exactly the original model
    sih_artifact(tmp_path / "keep_all", None, cfg=cfg, thr={i: 0.0 for i in range(n)})
    mf = export_bundle(str(tmp_path / "g.onnx"), tmp_path / "b_all", calib=tmp_path / "keep_all", weights="float32")
    assert mf["export"]["rewrite"]["rewritten"] == list(range(n))
    got = run_graph(tmp_path / "b_all" / "prefill.portable.onnx", ids)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= 1e-4, err
    # threshold 1.01: every skippable token takes the anchor -> runs, and differs
    sih_artifact(tmp_path / "skip", None, cfg=cfg, thr={i: 1.01 for i in range(n)})
    export_bundle(str(tmp_path / "g.onnx"), tmp_path / "b_skip", calib=tmp_path / "skip")
    got2 = run_graph(tmp_path / "b_skip" / "prefill.portable.onnx", ids)
    assert np.isfinite(got2).all() and np.abs(got2 - ref).max() / np.abs(ref).max() > 1e-3
    # and the TensorRT flavour passes the pre-flight
    p = run_cli("check", tmp_path / "b_skip")
    assert p.returncode == 0, p.stdout


def test_smollm2_transformers_dynamo_graph(smollm2, tmp_path):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(smollm2[1]), dtype=torch.float32, num_hidden_layers=2)
    check_foreign(hf, "smollm2-2l", tmp_path)


def test_qwen2_transformers_dynamo_graph(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    check_foreign(hf, "qwen2-small", tmp_path)
