import pytest
import torch

from zeroedge import model as M


def test_logits_match_transformers_on_smollm2(smollm2, smol_tok):
    from transformers import AutoModelForCausalLM

    m, folder = smollm2
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([smol_tok.encode("In the beginning God created the heaven and the earth. "
                                        "And the earth was without form, and void; and darkness")])
    with torch.no_grad():
        ours, theirs = m(ids), ref(ids).logits
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert rel <= 1e-4, rel


def test_kv_cache_decode_matches_full_forward():
    m = M.build("tiny", seed=0)
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        full = m(ids)
        m.setup_cache(2, 64)
        pre = m(ids[:, :30], start=0)
        steps = [m(ids[:, t:t + 1], start=t) for t in range(30, 40)]
        m.drop_cache()
    got = torch.cat([pre] + steps, dim=1)
    assert torch.allclose(got, full, atol=1e-5, rtol=1e-4)


def test_presets_have_real_shapes():
    c = M.PRESETS["llama-3.2-1b"]
    m = M.Transformer(c.with_(n_layers=1, vocab_size=64))
    assert m.layers[0].mlp.gate_proj.weight.shape == (8192, 2048)
    assert m.layers[0].self_attn.k_proj.weight.shape == (512, 2048)
    q = M.PRESETS["qwen2.5-0.5b"]
    mq = M.Transformer(q.with_(n_layers=1, vocab_size=64))
    assert mq.layers[0].self_attn.q_proj.bias is not None
    # llama3 scaling slows the low frequencies only
    inv = M.rope_frequencies(c)
    plain = M.rope_frequencies(c.with_(rope_scaling=None))
    assert torch.allclose(inv[:4], plain[:4]) and (inv[-4:] < plain[-4:]).all()


def test_head_pruning_removes_weights_and_matches_masking():
    m = M.build("tiny", seed=1)
    ids = torch.randint(0, 256, (1, 20))
    attn = m.layers[1].self_attn
    with torch.no_grad():
        # reference: zero the o_proj columns of head 2 (same as the head contributing nothing)
        hd = m.cfg.head_dim
        ref_model = M.build("tiny", seed=1)
        ref_model.layers[1].self_attn.o_proj.weight[:, 2 * hd:3 * hd] = 0
        want = ref_model(ids)
        attn.prune_heads([2])
        got = m(ids)
    assert attn.q_proj.weight.shape[0] == 3 * hd and attn.o_proj.weight.shape[1] == 3 * hd
    assert attn.kept_heads.tolist() == [0, 1, 3]
    assert torch.allclose(got, want, atol=1e-5)


def test_bad_model_inputs_are_user_errors(tmp_path):
    from zeroedge import weights
    from zeroedge.errors import UserError

    with pytest.raises(UserError, match="not found"):
        weights.load(str(tmp_path / "nope"))
    (tmp_path / "x.gguf").write_bytes(b"NOTG" + b"\0" * 100)
    with pytest.raises(UserError, match="GGUF"):
        weights.load(str(tmp_path / "x.gguf"))
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(UserError, match="unsupported architecture"):
        weights.load(str(d))
