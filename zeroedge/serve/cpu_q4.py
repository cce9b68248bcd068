"""A model's linear layers as onnxruntime graphs with 4-bit weights, for batched serving on a CPU.

Each weight is stored on its min/max grid of blocks of 32 along the input (zeroedge.quant.groupwise.
quantize_float: w = s * q + m, the grid of a Q4_1 GGUF, so the bundled SmolLM2 keeps its own weights
bit for bit), the LM head on a symmetric 8-bit grid of blocks of 32 (w = d * q: a Q8_0 embedding's own
grid). onnxruntime's MatMulNBits runs them with int8-rounded inputs (accuracy level 4, what llama.cpp
does for these types); its fast path takes no float zero point, so a product is the offset-8 one plus
`blocksums(x) @ C`, C = s * 8 + m, computed exactly in float.

The step between two attentions is one graph: layer l-1's o_proj and residual, its FFN and residual,
then layer l's RMSNorm and q/k/v projection (`boundary(l, x, o) -> (x, qkv)`; `boundary(0, x)` is
layer 0's input side alone, `boundary(L, x, o)` layer L-1's output side alone); `head(x)` is the final
norm and the LM head. A step of the serving engine is L + 2 onnxruntime calls whatever the batch.
"""
from __future__ import annotations

from typing import List

import numpy as np

GROUP = 32
ACCURACY = 4            # MatMulNBits: int8 inputs, int32 accumulation


def _q4_init(w, name: str, inits: list):
    """nn.Linear weight [N, K] -> (MatMulNBits inputs B, S; the offsets C [K/32, N]) as initializers."""
    from onnx import numpy_helper

    from zeroedge.quant.groupwise import Scheme, quantize_float

    N, K = w.shape
    q, s, z, _ = quantize_float(w.detach().float().cpu(), Scheme(4, GROUP, zero_point="float"))
    q = q.numpy()
    blob = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)          # [N, K/32, 16]
    s, z = s.numpy(), z.numpy()
    c = (s * (8.0 - z)).astype(np.float32).T                                  # [K/32, N]
    inits += [numpy_helper.from_array(blob, name + "_B"), numpy_helper.from_array(s.reshape(-1), name + "_S"),
              numpy_helper.from_array(np.ascontiguousarray(c), name + "_C")]


def _q8_init(w, name: str, inits: list):
    """nn.Linear weight [N, K] -> 8-bit MatMulNBits inputs (zero point 128: w = d * (u - 128))."""
    import torch
    from onnx import numpy_helper

    N, K = w.shape
    b = torch.nn.functional.pad(w.detach().float().cpu(), (0, (-K) % GROUP)).reshape(N, -1, GROUP)
    d = (b.abs().amax(-1) / 127).half().float()
    d = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(b / d[..., None]).clamp(-127, 127).to(torch.int16) + 128
    inits += [numpy_helper.from_array(q.to(torch.uint8).numpy(), name + "_B"),
              numpy_helper.from_array(d.reshape(-1).numpy(), name + "_S")]


class _Graph:
    """One onnxruntime graph, built node by node."""

    def __init__(self):
        self.nodes, self.inits, self.n = [], [], 0

    def tmp(self) -> str:
        self.n += 1
        return f"t{self.n}"

    def node(self, op, ins, domain="", **attrs) -> str:
        from onnx import helper

        out = self.tmp()
        self.nodes.append(helper.make_node(op, ins, [out], domain=domain, **attrs))
        return out

    def const(self, name, arr) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def norm(self, x, weight, eps: float, name: str) -> str:
        self.const(name, weight.detach().float().cpu().numpy())
        return self.node("SimplifiedLayerNormalization", [x, name], axis=-1, epsilon=float(eps))

    def q4(self, x, w, name: str, bias=None) -> str:
        N, K = w.shape
        _q4_init(w, name, self.inits)
        y = self.node("MatMulNBits", [x, name + "_B", name + "_S"], domain="com.microsoft", K=K, N=N, bits=4,
                      block_size=GROUP, accuracy_level=ACCURACY)
        kb = -(-K // GROUP)
        if K % GROUP:
            x = self.node("Pad", [x, self.const(name + "_pad", np.array([0, 0, 0, (-K) % GROUP], np.int64))])
        blocks = self.node("Reshape", [x, self.const(name + "_shape", np.array([-1, kb, GROUP], np.int64))])
        bsum = self.node("ReduceSum", [blocks, self.const(name + "_axis", np.array([-1], np.int64))], keepdims=0)
        y = self.node("Add", [y, self.node("MatMul", [bsum, name + "_C"])])
        if bias is not None:
            y = self.node("Add", [y, self.const(name + "_bias", bias.detach().float().cpu().numpy())])
        return y

    def session(self, inputs: List[tuple], outputs: List[tuple], threads: int):
        import onnxruntime as ort

        from onnx import TensorProto, helper

        vi = lambda n, d: helper.make_tensor_value_info(n, TensorProto.FLOAT, ["M", d])  # noqa: E731
        g = helper.make_graph(self.nodes, "zeroedge_serve", [vi(n, d) for n, d in inputs],
                              [vi(n, d) for n, d in outputs], self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        # L + 2 sessions keep a pool each: spinning, their idle threads would take the cores from the
        # others (and from torch's attention between calls)
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


class Q4Linears:
    min_rows = 2            # MatMulNBits computes a row alike for any M >= 2 (M = 1 takes another kernel)

    def __init__(self, model, threads: int):
        import torch

        cfg = model.cfg
        self.D, self.L = cfg.dim, cfg.n_layers
        self.qkv_dim = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.o_dim = cfg.n_heads * cfg.head_dim
        layers = model.layers
        self.sessions = []
        for li in range(self.L + 1):
            g = _Graph()
            ins = [("x", self.D)] if li == 0 else [("x", self.D), ("o", self.o_dim)]
            x = "x"
            if li > 0:                           # layer li-1's output side
                p = layers[li - 1]
                mlp = p.mlp
                x = g.node("Add", ["x", g.q4("o", p.self_attn.o_proj.weight, f"l{li - 1}_o")])
                h = g.norm(x, p.post_attention_layernorm.weight, p.post_attention_layernorm.eps, f"l{li - 1}_ln2")
                w13 = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0)
                gu = g.q4(h, w13, f"l{li - 1}_w13")
                gate = g.node("Slice", [gu, g.const(f"l{li}_s0", np.array([0], np.int64)),
                                        g.const(f"l{li}_s1", np.array([cfg.ffn_dim], np.int64)),
                                        g.const(f"l{li}_ax", np.array([-1], np.int64))])
                up = g.node("Slice", [gu, f"l{li}_s1", g.const(f"l{li}_s2", np.array([2 * cfg.ffn_dim], np.int64)),
                                      f"l{li}_ax"])
                act = g.node("Mul", [g.node("Mul", [gate, g.node("Sigmoid", [gate])]), up])
                x = g.node("Add", [x, g.q4(act, mlp.down_proj.weight, f"l{li - 1}_w2")])
            outs = [("x_out", self.D)]
            g.nodes.append(_identity(x, "x_out"))
            if li < self.L:                      # layer li's input side
                a = layers[li].self_attn
                h = g.norm(x, layers[li].input_layernorm.weight, layers[li].input_layernorm.eps, f"l{li}_ln1")
                w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0)
                b = (torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None)
                g.nodes.append(_identity(g.q4(h, w, f"l{li}_qkv", b), "qkv"))
                outs.append(("qkv", self.qkv_dim))
            self.sessions.append(g.session(ins, outs, threads))
        g = _Graph()
        h = g.norm("x", model.norm.weight, model.norm.eps, "final_norm")
        W = model.lm_head.weight
        _q8_init(W, "head", g.inits)
        y = g.node("MatMulNBits", [h, "head_B", "head_S"], domain="com.microsoft", K=W.shape[1], N=W.shape[0],
                   bits=8, block_size=GROUP, accuracy_level=ACCURACY)
        g.nodes.append(_identity(y, "logits"))
        self.head_session = g.session([("x", self.D)], [("logits", W.shape[0])], threads)

    def boundary(self, li: int, x: np.ndarray, o=None):
        """li = 0: layer 0's input side; 1..L-1: layer li-1's output side and li's input side;
        L: layer L-1's output side. -> (x, qkv or None)."""
        feeds = {"x": x} if li == 0 else {"x": x, "o": o}
        out = self.sessions[li].run(None, feeds)
        return out[0], (out[1] if len(out) > 1 else None)

    def head(self, x: np.ndarray) -> np.ndarray:
        return self.head_session.run(None, {"x": x})[0]


def _identity(src: str, dst: str):
    from onnx import helper

    return helper.make_node("Identity", [src], [dst])
