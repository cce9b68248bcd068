"""The serving engine's step on 4-bit weights, for batched serving on a CPU: the whole step, every
layer and its attention, is one onnxruntime graph (`Q4Step`).

Each weight is stored on its min/max grid of blocks of 32 along the input (zeroedge.quant.groupwise.
quantize_float: w = s * q + m, the grid of a Q4_1 GGUF, so the bundled SmolLM2 keeps its own weights
bit for bit), the LM head on a symmetric 8-bit grid of blocks of 32 (w = d * q: a Q8_0 embedding's own
grid). onnxruntime's MatMulNBits runs them with int8-rounded inputs (accuracy level 4, what llama.cpp
does for these types); its fast path takes no float zero point, so a product is the offset-8 one plus
`blocksums(x) @ C`, C = s * 8 + m, over exact x.

With zeroedge's onnxruntime kernels (ortops/, built by scripts/build_ortops) a layer's attention is
one PagedAttention op, and each product's `blocksums(x) @ C` with the residual or SwiGLU after it one
BlockOffsets op (C rounded to float16, as a 4-bit bundle's Q4Linear holds it: half the bytes a step
reads for it); without them the same step runs on onnxruntime's own operators (C in float32).
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from zeroedge.errors import UserError

GROUP = 32
ACCURACY = 4            # MatMulNBits: int8 inputs, int32 accumulation


def _q4_init(w, name: str, inits: list, offsets_dtype=np.float32):
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
              numpy_helper.from_array(np.ascontiguousarray(c.astype(offsets_dtype)), name + "_C")]


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

    def __init__(self, kernels: bool):
        self.nodes, self.inits, self.n = [], [], 0
        self.kernels = kernels          # zeroedge's onnxruntime kernels (BlockOffsets) where they apply

    def tmp(self) -> str:
        self.n += 1
        return f"t{self.n}"

    def node(self, op, ins, domain="", outputs: int = 1, **attrs):
        """-> the output's name (a list of them for outputs > 1)."""
        from onnx import helper

        outs = [self.tmp() for _ in range(outputs)]
        self.nodes.append(helper.make_node(op, ins, outs, domain=domain, **attrs))
        return outs[0] if outputs == 1 else outs

    def const(self, name, arr) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def norm(self, x, weight, eps: float, name: str) -> str:
        self.const(name, weight.detach().float().cpu().numpy())
        return self.node("SimplifiedLayerNormalization", [x, name], axis=-1, epsilon=float(eps))

    def q4(self, x, w, name: str, bias=None, residual=None, swiglu: bool = False) -> str:
        """x @ w.T on w's 4-bit grid (+ bias) (+ residual); swiglu: w is [gate; up] and the output
        silu(gate) * up. With zeroedge's kernels the offsets and what follows are one BlockOffsets."""
        N, K = w.shape
        fused = self.kernels and bias is None
        _q4_init(w, name, self.inits, np.float16 if fused else np.float32)
        y = self.node("MatMulNBits", [x, name + "_B", name + "_S"], domain="com.microsoft", K=K, N=N, bits=4,
                      block_size=GROUP, accuracy_level=ACCURACY)
        if fused:
            return self.node("BlockOffsets", [y, x, name + "_C"] + ([residual] if residual is not None else []),
                             domain="zeroedge.ort", **({"activation": "swiglu"} if swiglu else {}))
        kb = -(-K // GROUP)
        if K % GROUP:
            x = self.node("Pad", [x, self.const(name + "_pad", np.array([0, 0, 0, (-K) % GROUP], np.int64))])
        blocks = self.node("Reshape", [x, self.const(name + "_shape", np.array([-1, kb, GROUP], np.int64))])
        bsum = self.node("ReduceSum", [blocks, self.const(name + "_axis", np.array([-1], np.int64))], keepdims=0)
        y = self.node("Add", [y, self.node("MatMul", [bsum, name + "_C"])])        # y + blocksums(x) @ C
        if bias is not None:
            y = self.node("Add", [y, self.const(name + "_bias", bias.detach().float().cpu().numpy())])
        if residual is not None:
            y = self.node("Add", [residual, y])
        if swiglu:
            gate, up = self.node("Split", [y], axis=-1, outputs=2)
            y = self.node("Mul", [self.node("Mul", [gate, self.node("Sigmoid", [gate])]), up])
        return y

    def when(self, cond: str, build, width: int) -> str:
        """An If on the bool `cond`: the float output of the nodes build() adds, else (0, width)."""
        from onnx import TensorProto, helper

        outer, self.nodes = self.nodes, []
        out = build()
        then = helper.make_graph(self.nodes, self.tmp(), [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)])
        self.nodes, empty = outer, self.tmp()
        skip = helper.make_graph([helper.make_node("Constant", [], [empty], value=helper.make_tensor(
            empty, TensorProto.FLOAT, [0, width], []))], self.tmp(), [],
            [helper.make_tensor_value_info(empty, TensorProto.FLOAT, [0, width])])
        return self.node("If", [cond], then_branch=then, else_branch=skip)

    def session(self, inputs: List[tuple], outputs: List[tuple], threads: int, library=None):
        """inputs, outputs: [(name, onnx element type, shape)]; library: zeroedge's onnxruntime kernels."""
        import onnxruntime as ort

        from onnx import helper

        g = helper.make_graph(self.nodes, "zeroedge_serve", [helper.make_tensor_value_info(*t) for t in inputs],
                              [helper.make_tensor_value_info(*t) for t in outputs], self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
                              + ([helper.make_opsetid("zeroedge.ort", 1)] if library is not None else []))
        so = ort.SessionOptions()
        if library is not None:
            so.register_custom_ops_library(str(library))
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        # one session runs the whole step (~1,500 small operators): its threads spin between them
        # rather than sleep and wake (5-10 % of a step on two cores)
        so.add_session_config_entry("session.intra_op.allow_spinning", "1")
        return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _empty_linears(module, keep) -> None:
    """Empty the float weights of module's linear layers (all but the tensor `keep`)."""
    import torch

    empty = lambda: torch.nn.Parameter(torch.empty(0), requires_grad=False)   # noqa: E731
    for mod in module.modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight is not keep:
            mod.weight = empty()
            if mod.bias is not None:
                mod.bias = empty()


class Q4Step:
    """The whole engine step on 4-bit weights as one onnxruntime graph (`forward(pool, segments)`, the
    interface of zeroedge.serve.batch.BatchStep.forward). Attention reads the KV pool in place: the
    pool (heads-first: a kv head's slots in a row) is an input bound by address.

    With zeroedge's kernels a layer's PagedAttention rotates the rows' q and k, writes their K / V into
    the pool at their slots and attends each row over its sequence's earlier slots (through a table)
    and its segment's rows up to it, one task a row and kv head. On onnxruntime's own operators each
    sequence's slots are gathered layer by layer and this step's K / V scattered into the gathered copy;
    the new K / V of every layer come back as outputs and are written into the pool after the call. Two
    attention blocks run there, alike but for their sizes: decode rows (a sequence's one row, or a
    verify segment's rows) and prompt chunks (a chunk's rows, causally; only in steps with some), so
    that a step's few long chunks do not pad its many short decode groups; every row attends in
    products of its own: the softmax's max is exact and its sum is a matrix product over the slots,
    whose padding adds exact zeros at the end.

    Either way a row gives the same logits alone, in any batch, or as a row of a verify segment (the
    engine's batch invariance, zeroedge.serve.batch)."""

    description = "4-bit blocks of 32 (the Q4_1 grid), 8-bit LM head, onnxruntime MatMulNBits"
    min_rows = 2            # MatMulNBits computes a row alike for any M >= 2 (M = 1 takes another kernel)

    def __init__(self, model, threads: int, kernels: Optional[str] = None, release_float: bool = False):
        """kernels: "zeroedge" (attention in one op a layer from zeroedge's onnxruntime library,
        zeroedge.backends.ortops), "stock" (onnxruntime's own operators only) or None: zeroedge's
        where the library is built. release_float: empty the model's float linears layer by layer as
        their 4-bit copies are made (~400 MiB of fp32 on SmolLM2-135M, off the build's peak too), for a
        model that then serves through this step only; the embedding stays (the step reads its rows),
        and so does a head tied to it."""
        import torch

        from zeroedge.backends import ortops

        if kernels is None:
            kernels = "zeroedge" if ortops.library_path().is_file() else "stock"
        if kernels not in ("zeroedge", "stock"):
            raise ValueError(f"kernels must be 'zeroedge' or 'stock' (got {kernels!r})")
        self.library = ortops.library_path() if kernels == "zeroedge" else None
        if self.library is not None and not self.library.is_file():
            raise UserError(f"the 4-bit step's attention runs zeroedge's onnxruntime kernels, and {self.library} "
                            "is not built: run scripts/build_ortops")
        self.kernels = kernels
        cfg = model.cfg
        D, L, H, nkv, hd = cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.L, self.H, self.nkv, self.hd = L, H, nkv, hd
        self.embed, self.inv_freq = model.embed_tokens, model.inv_freq.float()
        self._embed_rows = model.embed_tokens.weight.detach().float().numpy()      # rows read as numpy
        g = _Graph(kernels=self.library is not None)
        from onnx import TensorProto

        f, i = TensorProto.FLOAT, TensorProto.INT64
        x, kv_new = "x", []
        for li in range(L):
            lay, a = model.layers[li], model.layers[li].self_attn
            h = g.norm(x, lay.input_layernorm.weight, lay.input_layernorm.eps, f"l{li}_ln1")
            w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0)
            b_ = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None
            qkv = g.q4(h, w, f"l{li}_qkv", b_)                                      # (M, (H + 2 nkv) hd)
            if self.library is not None:            # rotation, the pool's update and attention: one op
                o = g.node("PagedAttention", [qkv, "cos", "sin", "pool_k", "pool_v", "table", "rows"],
                           domain="zeroedge.ort", heads=H, kv_heads=nkv, layer=li, layers=L, scale=float(hd ** -0.5))
            else:
                o = _stock_attention(g, qkv, li, H, nkv, hd, kv_new)
            x = g.q4(o, a.o_proj.weight, f"l{li}_o", residual=x)
            mlp = lay.mlp
            h = g.norm(x, lay.post_attention_layernorm.weight, lay.post_attention_layernorm.eps, f"l{li}_ln2")
            act = g.q4(h, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0), f"l{li}_w13", swiglu=True)
            x = g.q4(act, mlp.down_proj.weight, f"l{li}_w2", residual=x)
            if release_float:
                _empty_linears(lay, model.embed_tokens.weight)
        h = g.norm(g.node("Gather", [x, "out_rows"]), model.norm.weight, model.norm.eps, "final_norm")
        V, K = model.lm_head.weight.shape
        _q8_init(model.lm_head.weight, "head", g.inits)
        if release_float:
            _empty_linears(model.lm_head, model.embed_tokens.weight)
        y = g.node("MatMulNBits", [h, "head_B", "head_S"], domain="com.microsoft", K=K, N=V,
                   bits=8, block_size=GROUP, accuracy_level=ACCURACY)
        g.nodes.append(_identity(y, "logits"))
        ins = [("x", f, ["M", D]), ("cos", f, ["M", hd // 2]), ("sin", f, ["M", hd // 2]), ("pool_k", f, ["P", hd]),
               ("pool_v", f, ["P", hd]), ("out_rows", i, ["R"])]
        outs = [("logits", f, ["R", V])]
        if self.library is not None:
            ins += [("table", i, ["G", "S"]), ("rows", i, ["M", 4])]
        else:
            g.nodes += [_identity(g.node("Concat", kv_new[0::2], axis=0), "k_new"),
                        _identity(g.node("Concat", kv_new[1::2], axis=0), "v_new")]
            ins += [("rope_rows", i, [1, "M"]), ("layer_stride", i, []), ("head_offsets", i, [1, nkv, 1]),
                    ("has_chunks", TensorProto.BOOL, [])]
            for b in ("d", "c"):
                G, S, n = b + "G", b + "S", b + "n"          # a block's sizes are its own
                ins += [(b + "_table", i, [G, 1, S]), (b + "_idx", i, [n, 3]), (b + "_src", i, [n]),
                        (b + "_q", i, [b + "Q"])]
                ins += [(f"{b}_{k}", i, [len(shape)]) for k, shape in _shapes(0, 0, H, nkv, hd).items()]
                ins += [(b + "_out", i, [b + "rows"]), (b + "_mask", f, [G, b + "T", 1, 1, S]),
                        (b + "_ones", f, [G, b + "T", nkv, S, 1])]
            outs += [("k_new", f, [L, "M", nkv, hd]), ("v_new", f, [L, "M", nkv, hd])]
        # what the step holds: its graph's weights, and the float embedding it reads rows of
        self.weight_bytes = sum(len(t.raw_data) for t in g.inits) + self.embed.weight.numel() * 4
        self.session = g.session(ins, outs, threads, self.library)

    def forward(self, pool, segments):
        """-> (rows, vocab) float32 logits: each segment's last position, or all of a verify segment's, in
        segment order (BatchStep.forward). The pool's pages for the segments' positions get their K / V.
        A sequence appears at most once in a step."""
        import torch

        if self.library is not None:
            return self._forward_kernels(pool, segments)

        scratch = pool.scratch * pool.page_size
        chunks = [s for s in segments if len(s.tokens) > 1 and not s.verify]
        single = [s for s in segments if not (len(s.tokens) > 1 and not s.verify)]
        pad = max(0, self.min_rows - sum(len(s.tokens) for s in segments))
        first, ids, pos, slots = {}, [], [], []
        for s in single + [None] * pad + chunks:   # padding rows: token 0 at position 0, on the scratch page
            first[id(s)] = len(ids)
            toks, a = (s.tokens, s.start) if s is not None else ([0], 0)
            ids += toks
            pos += range(a, a + len(toks))
            slots += pool.slots(s.pages, a, a + len(toks)) if s is not None else [scratch + len(ids) - 1]
        out_rows = []
        for s in segments:
            r0 = first[id(s)]
            out_rows += range(r0, r0 + len(s.tokens)) if s.verify else [r0 + len(s.tokens) - 1]
        n_out = len(out_rows)
        out_rows += [0] * (self.min_rows - n_out)
        dec = [(s.pages, [(s.start + j, first[id(s)] + j) for j in range(len(s.tokens))]) for s in single]
        dec += [(None, [(0, first[id(None)] + j)]) for j in range(pad)]      # alone: no slots to gather
        chunk = [(s.pages, [(s.start + j, first[id(s)] + j) for j in range(len(s.tokens))]) for s in chunks]
        f = np.outer(np.asarray(pos, np.float32), self.inv_freq.numpy())     # row r's angles, at "position" r
        slots_total = pool.k.shape[2]
        feeds = {"x": self._embed_rows[np.asarray(ids, np.int64)], "cos": np.cos(f), "sin": np.sin(f),
                 "rope_rows": np.arange(len(ids), dtype=np.int64)[None],
                 "has_chunks": np.array(bool(chunks)),
                 "out_rows": np.asarray(out_rows, np.int64), "layer_stride": np.array(self.nkv * slots_total, np.int64),
                 "head_offsets": (np.arange(self.nkv, dtype=np.int64) * slots_total).reshape(1, -1, 1)}
        feeds.update(self._block_feeds("d", dec, pool))
        feeds.update(self._block_feeds("c", chunk, pool))
        io = self.session.io_binding()
        for name, a in feeds.items():
            io.bind_cpu_input(name, a)
        shape = (self.L * self.nkv * slots_total, self.hd)
        for name, t in (("pool_k", pool.k), ("pool_v", pool.v)):
            io.bind_input(name, "cpu", 0, np.float32, shape, t.data_ptr())
        for name in ("logits", "k_new", "v_new"):
            io.bind_output(name, "cpu")
        self.session.run_with_iobinding(io)
        logits, k_new, v_new = io.copy_outputs_to_cpu()
        slot_t = torch.tensor(slots)
        pool.k.index_copy_(2, slot_t, torch.from_numpy(k_new).transpose(1, 2))
        pool.v.index_copy_(2, slot_t, torch.from_numpy(v_new).transpose(1, 2))
        return torch.from_numpy(logits[:n_out])

    def _forward_kernels(self, pool, segments):
        """forward with zeroedge's PagedAttention: rows in segment order, then padding rows (each its
        own group on the scratch page, attending to itself); the op writes the rows' K / V."""
        import torch

        ids, pos, rows, out_rows, groups = [], [], [], [], []
        for gi, s in enumerate(segments):
            r0 = len(ids)
            ids += s.tokens
            pos += range(s.start, s.start + len(s.tokens))
            rows += [(gi, s.start + j, s.start, r0) for j in range(len(s.tokens))]
            out_rows += range(r0, r0 + len(s.tokens)) if s.verify else [r0 + len(s.tokens) - 1]
            groups.append(s.pages)
        n_out = len(out_rows)
        for _ in range(self.min_rows - len(ids)):
            rows.append((len(groups), 0, 0, len(ids)))
            groups.append(None)
            ids.append(0)
            pos.append(0)
        out_rows += [0] * (self.min_rows - n_out)
        ps = pool.page_size
        S = -(-(max(pos) + 1) // ps) * ps
        f = np.outer(np.asarray(pos, np.float32), self.inv_freq.numpy())
        feeds = {"x": self._embed_rows[np.asarray(ids, np.int64)], "cos": np.cos(f), "sin": np.sin(f),
                 "table": np.stack([self._slot_table(pool, pages, S) for pages in groups]),
                 "rows": np.asarray(rows, np.int64), "out_rows": np.asarray(out_rows, np.int64)}
        io = self.session.io_binding()
        for name, a in feeds.items():
            io.bind_cpu_input(name, a)
        shape = (self.L * self.nkv * pool.k.shape[2], self.hd)
        for name, t in (("pool_k", pool.k), ("pool_v", pool.v)):
            io.bind_input(name, "cpu", 0, np.float32, shape, t.data_ptr())
        io.bind_output("logits", "cpu")
        self.session.run_with_iobinding(io)
        return torch.from_numpy(io.copy_outputs_to_cpu()[0][:n_out])

    @staticmethod
    def _slot_table(pool, pages, S: int) -> np.ndarray:
        """Slots of positions 0..S-1 (past the pages, the scratch page's)."""
        ps, cols = pool.page_size, np.arange(S)
        table = pool.scratch * ps + cols % ps
        if pages is not None:
            n = min(S, len(pages) * ps)
            table[:n] = np.repeat(np.asarray(pages, np.int64), ps)[:n] * ps + cols[:n] % ps
        return table

    def _block_feeds(self, b: str, groups, pool) -> dict:
        """Attention block b's feeds for groups [(pages or None: the scratch page, [(position, row)] of
        this step)]: each group's slots, where its rows' K / V go, its queries on a (G, T) grid (T: the
        most rows of a group), each seeing positions up to its own."""
        ps, G, nkv = pool.page_size, len(groups), self.nkv
        T = max((len(rows) for _, rows in groups), default=1)
        S = max((-(-(p + 1) // ps) * ps for _, rows in groups for p, _ in rows), default=ps)
        table = np.empty((G, 1, S), np.int64)
        mask = np.full((G, T, S), -np.inf, np.float32)
        idx, src, q, out = [], [], np.zeros(G * T, np.int64), []
        for gi, (pages, rows) in enumerate(groups):
            table[gi, 0] = self._slot_table(pool, pages, S)
            idx += [(gi, n, p) for p, _ in rows for n in range(nkv)]
            src += [r * nkv + n for _, r in rows for n in range(nkv)]
            for t, (p, r) in enumerate(rows):
                mask[gi, t, : p + 1] = 0.0
                q[gi * T + t] = r
                out.append(gi * T + t)
            mask[gi, len(rows):, 0] = 0.0                 # padding queries see position 0 alone
        feeds = {f"{b}_{k}": np.array(v, np.int64) for k, v in _shapes(G, T, self.H, nkv, self.hd).items()}
        return {**feeds, f"{b}_table": table, f"{b}_idx": np.asarray(idx, np.int64).reshape(-1, 3),
                f"{b}_src": np.asarray(src, np.int64), f"{b}_q": q, f"{b}_mask": mask.reshape(G, T, 1, 1, S),
                f"{b}_ones": np.ones((G, T, nkv, S, 1), np.float32), f"{b}_out": np.asarray(out, np.int64)}


def _shapes(G: int, T: int, H: int, nkv: int, hd: int) -> dict:
    """The shapes an attention block reshapes to: G groups of T rows."""
    return {"grid_shape": [G, T, nkv, H // nkv, hd], "rows_shape": [G * T, H * hd]}


def _gathered(g: _Graph, new: str, pool: str, table: str, b: str) -> str:
    """(G, kv heads, S, head dim): block b's groups' slots of one layer, this step's K or V (rows x kv
    heads, head dim) at their positions."""
    return g.node("ScatterND", [g.node("Gather", [pool, table]), b + "_idx", g.node("Gather", [new, b + "_src"])])


def _attention(g: _Graph, q: str, k: str, v: str, table: str, b: str) -> str:
    """Attention block b: each group's rows (a sequence's decode row, verify rows or prompt chunk) over
    its slots, each up to its own position, one product per row and kv head: a row's products have
    the same shape whatever else runs (a product over several rows may take a row to another kernel
    by its place among them), so it computes alike alone, beside other groups or as a verify row; the
    group's gathered K / V are shared by its rows (broadcast) -> (the block's rows, H * head dim)."""
    ks, vs = (g.node("Unsqueeze", [_gathered(g, t, pool, table, b), "ax1"])                      # (G, 1, nkv, S, hd)
              for t, pool in ((k, "pool_k"), (v, "pool_v")))
    qg = g.node("Reshape", [g.node("Gather", [q, b + "_q"]), b + "_grid_shape"], allowzero=1)   # (G, T, nkv, rep, hd)
    sc = g.node("MatMul", [g.node("Mul", [qg, "scale"]), g.node("Transpose", [ks], perm=[0, 1, 2, 4, 3])])
    sc = g.node("Add", [sc, b + "_mask"])                                                       # (G, T, nkv, rep, S)
    e = g.node("Exp", [g.node("Sub", [sc, g.node("ReduceMax", [sc], axes=[-1], keepdims=1)])])
    o = g.node("Div", [g.node("MatMul", [e, vs]), g.node("MatMul", [e, b + "_ones"])])       # (G, T, nkv, rep, hd)
    return g.node("Gather", [g.node("Reshape", [o, b + "_rows_shape"], allowzero=1), b + "_out"])


def _stock_attention(g: _Graph, qkv: str, li: int, H: int, nkv: int, hd: int, kv_new: list) -> str:
    """Layer li's attention in onnxruntime's own operators: RoPE, then the decode block and, in steps
    with prompt chunks, the chunk block (their rows in that order) -> (M, H * hd); the rows' rotated K
    and V go to kv_new (written into the pool after the call)."""
    i64 = np.int64
    if li == 0:
        for name, v in (("rows_qkv", [-1, H + 2 * nkv, hd]), ("rows_heads", [-1, hd]), ("rows_qk", [-1, H + nkv, hd]),
                        ("rope_in", [1, -1, (H + nkv) * hd]), ("ax0", [0]), ("ax1", [1]), ("cut0", [0]), ("cut1", [H]),
                        ("cut2", [H + nkv]), ("cut3", [H + 2 * nkv])):
            g.const(name, np.array(v, i64))
        g.const("scale", np.array(1.0 / np.sqrt(hd), np.float32))
    qkv = g.node("Reshape", [qkv, "rows_qkv"])                                     # (M, H + 2 nkv, hd)
    qk = g.node("Reshape", [g.node("Slice", [qkv, "cut0", "cut2", "ax1"]), "rope_in"])  # (1, M, (H + nkv) hd)
    qk = g.node("RotaryEmbedding", [qk, "rope_rows", "cos", "sin"], domain="com.microsoft", num_heads=H + nkv,
                interleaved=0)
    qk = g.node("Reshape", [qk, "rows_qk"])                                        # (M, H + nkv, hd)
    q = g.node("Slice", [qk, "cut0", "cut1", "ax1"])
    k = g.node("Slice", [qk, "cut1", "cut2", "ax1"])
    v = g.node("Slice", [qkv, "cut2", "cut3", "ax1"])
    kv_new += [g.node("Unsqueeze", [k, "ax0"]), g.node("Unsqueeze", [v, "ax0"])]
    # the pool is (layers, kv heads, slots, head dim): this layer's rows, a kv head's slots in a row
    off = g.node("Add", [g.node("Mul", [g.const(f"l{li}_index", np.array(li, i64)), "layer_stride"]), "head_offsets"])
    k, v = (g.node("Reshape", [t, "rows_heads"]) for t in (k, v))                   # (M nkv, hd)
    o = [_attention(g, q, k, v, g.node("Add", ["d_table", off]), "d"),
         g.when("has_chunks", lambda: _attention(g, q, k, v, g.node("Add", ["c_table", off]), "c"), H * hd)]
    return g.node("Concat", o, axis=0)


def _identity(src: str, dst: str):
    from onnx import helper

    return helper.make_node("Identity", [src], [dst])
