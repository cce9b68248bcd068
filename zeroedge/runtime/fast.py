"""The decode loop over the reference model's weights: static shapes, one CUDA graph a step.

`Decoder(model, attention, ffn, graph)` runs one token through every layer: q/k/v and gate/up
weights fused into one matrix each (one GEMV instead of three / two); RMSNorm through F.rms_norm;
RoPE for q and k in one roll + multiply-add from a table indexed by a device position; the whole
step captured in one CUDA graph per attention flag and replayed. Two strategies compose:

  attention   DenseAttention (here: a static KV cache of max_len positions, GQA by SDPA with an
              additive mask built once a step, or two batched matmuls) or
              zeroedge.kv.attention.ThermalAttention (a hot window over paged prefix KV with a
              cold store and in-graph page swaps)
  ffn         None (the dense FFN) or zeroedge.paths.ffn.PathsFFN (gather-GEMVs on sparse layers)

DenseDecoder, ThermalDecoder, PathsDecoder and ThermalPathsDecoder are the four compositions. They
take a `zeroedge.model.Transformer` (cast it with `.to(device, dtype)` first) and read its weights;
on CPU they run eagerly (tests), on CUDA `graph=True` captures. A model with packed 4-bit weights
(zeroedge.quant.apply, pack=True) is read through the packed GEMVs on CUDA (`packed`; RMSNorm,
SwiGLU and the residuals fused into them; `int8_inputs`: the dp4a kernel), as fp weights elsewhere.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from zeroedge.kv.attention import ThermalAttention, additive_mask
from zeroedge.kv.decode_attention import choose as choose_attention
from zeroedge.kv.tiers import shared_stream
from zeroedge.paths.ffn import PathsFFN
from zeroedge.quant import packed
from zeroedge.quant.packed import PackedLinear


class _Weights:
    """Per-layer fused weights, built once per model: q/k/v and gate/up concatenated, and the model's
    own Linear weights re-pointed at row slices of them, so the model holds one copy (on a 1B model
    in bf16, 1.3 GB less than keeping both). A model whose weights section was applied with packing
    (zeroedge.quant.apply, pack=True) also has packed 4- / 8-bit forms: `packed()` fuses them the
    same way, on the model's device, once."""

    def __init__(self, model):
        self.model = model
        self.layers = []
        self._packed = None
        for blk in model.layers:
            a, mlp = blk.self_attn, blk.mlp
            wqkv = _fuse(a.q_proj, a.k_proj, a.v_proj)
            bqkv = (_fuse(a.q_proj, a.k_proj, a.v_proj, name="bias") if a.q_proj.bias is not None else None)
            w13 = _fuse(mlp.gate_proj, mlp.up_proj)
            self.layers.append(dict(
                ln1=blk.input_layernorm.weight, eps1=blk.input_layernorm.eps, wqkv=wqkv, bqkv=bqkv,
                wo=a.o_proj.weight, ln2=blk.post_attention_layernorm.weight,
                eps2=blk.post_attention_layernorm.eps, w13=w13, w2=mlp.down_proj.weight))

    def has_packed(self) -> bool:
        return getattr(self.model.layers[0].self_attn.q_proj, "packed", None) is not None

    def packed(self):
        """(per layer {wqkv, wo, w13, w2: PackedLinear}, the LM head's PackedLinear or None)."""
        if self._packed is None:
            dev = next(self.model.parameters()).device
            layers = []
            for blk in self.model.layers:
                a, mlp = blk.self_attn, blk.mlp
                a.o_proj.packed, mlp.down_proj.packed = a.o_proj.packed.to(dev), mlp.down_proj.packed.to(dev)
                layers.append(dict(wqkv=_fuse_packed(a.q_proj, a.k_proj, a.v_proj, dev=dev), wo=a.o_proj.packed,
                                   w13=_fuse_packed(mlp.gate_proj, mlp.up_proj, dev=dev), w2=mlp.down_proj.packed))
            head = getattr(self.model.lm_head, "packed", None)
            self._packed = (layers, head.to(dev) if head is not None else None)
        return self._packed


def _fuse(*linears, name: str = "weight"):
    """The linears' `name` tensors stacked along rows; each linear's own becomes a view of its rows."""
    parts = [getattr(lin, name) for lin in linears]
    fused = torch.cat([p.detach() for p in parts], 0)
    row = 0
    for lin, p in zip(linears, parts):
        setattr(lin, name, torch.nn.Parameter(fused[row:row + p.shape[0]], requires_grad=p.requires_grad))
        row += p.shape[0]
    return fused


def _fuse_packed(*linears, dev):
    """The linears' packed forms stacked along rows on `dev`; each linear's own becomes a view of its
    rows (one copy, as _fuse for the fp weights)."""
    fused = PackedLinear.cat([lin.packed.to(dev) for lin in linears])
    row = 0
    for lin in linears:
        n = lin.packed.n
        lin.packed = fused.rows(row, row + n)
        row += n
    return fused


def packed_forms(model, bits: int = 4, group: int = 128, head_bits: int = 8) -> tuple:
    """The model's weights quantized (symmetric, in groups along the input) into new packed forms, its
    own left as they are: (per layer {wqkv, wo, w13, w2}, LM head) for Decoder's packed_forms. The head
    takes `head_bits` in groups of zeroedge.quant.apply.embedding_group (as a weights section's)."""
    from zeroedge.quant.apply import embedding_group
    from zeroedge.quant.groupwise import Scheme

    scheme, head = Scheme(bits, group, True), Scheme(head_bits, embedding_group(model.cfg.dim), True)
    with torch.no_grad():
        layers = [{n: PackedLinear.from_weight(w[n].detach(), scheme) for n in ("wqkv", "wo", "w13", "w2")}
                  for w in fused_weights(model).layers]
        return layers, PackedLinear.from_weight(model.lm_head.weight.detach(), head)


def forget_fused_weights(model) -> None:
    """Drop the model's fused-weight cache (its weights changed: the next decoder fuses them anew)."""
    model.__dict__.pop("_zeroedge_fused", None)


def fused_weights(model) -> _Weights:
    w = getattr(model, "_zeroedge_fused", None)
    if w is None:
        with torch.no_grad():
            w = _Weights(model)
        object.__setattr__(model, "_zeroedge_fused", w)
    return w


class TorchLinears:
    """The model's fused weights over rows of tokens (a batch, or a draft being checked): between two
    attentions, `boundary(l, x, o) -> (x, qkv)` runs layer l-1's o_proj, residual and SwiGLU FFN
    (with `o`, l > 0) and layer l's RMSNorm and q/k/v projection (l < L); `head(x)` the final norm and
    the LM head. columns: each product as W @ x^T, which MKL runs on some CPUs reading W about once
    for a few rows where x @ W^T costs about a one-row product per row, and on others the other way
    round (columns_pay; benchmarks/verify_cost_cpu.py); its rows are computed alike only from 12 rows
    up, so the batched engine keeps x @ W^T."""

    MIN_ROWS = 4            # torch's float products compute a row alike from this many rows up (on a
    #                         CPU measured: min_rows)

    def __init__(self, model, columns: bool = False):
        self.m, self.W, self.L = model, fused_weights(model).layers, len(model.layers)
        self.columns = columns
        self._min_rows = None

    @property
    def min_rows(self) -> int:
        """Rows a batched step computes at the least, so that a row's products are the same whatever
        the step's rows (measured on a CPU in float32, on first use: rows_alike_from)."""
        if self._min_rows is None:
            head = self.m.lm_head.weight
            self._min_rows = self.MIN_ROWS
            if head.device.type == "cpu" and head.dtype == torch.float32:
                w = self.W[0]
                self._min_rows = max(self.MIN_ROWS, rows_alike_from([w["wqkv"], w["wo"], w["w13"], w["w2"], head]))
        return self._min_rows

    def _linear(self, x, w, b=None):
        if not self.columns or x.shape[0] < 2:
            return F.linear(x, w, b)
        y = torch.mm(w, x.contiguous().t()).t().contiguous()    # x^T as a transposed view: MKL's fast operand
        return y if b is None else y + b

    @staticmethod
    def _norm(x, weight, eps):
        return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight

    def boundary(self, li: int, x, o=None):
        if li > 0:                               # layer li-1's output side
            w = self.W[li - 1]
            x = x + self._linear(o, w["wo"])
            g, u = self._linear(self._norm(x, w["ln2"], w["eps2"]), w["w13"]).chunk(2, -1)
            x = x + self._linear(F.silu(g) * u, w["w2"])
        if li == self.L:
            return x, None
        w = self.W[li]
        return x, self._linear(self._norm(x, w["ln1"], w["eps1"]), w["wqkv"], w["bqkv"])

    def head(self, x):
        if not self.columns:
            return self.m.lm_head(self.m.norm(x))
        return self._linear(self.m.norm(x), self.m.lm_head.weight, self.m.lm_head.bias)


_ROWS_ALIKE: dict = {}      # (weight shapes, threads) -> rows_alike_from's answer
_COLUMNS_PAY: dict = {}     # (weight shapes, threads) -> whether W @ x^T was the faster form here


@torch.no_grad()
def rows_alike_from(weights, most: int = 32) -> int:
    """The fewest rows from which torch's float product x @ W^T gives each row the same bits whatever
    the number of rows, for each of `weights`, at one thread and at torch's current thread count (the
    CPU's matrix library picks its kernel by the rows, the threads and the instruction set: 4 rows on
    an AVX2 CPU; at one thread 16 on an AVX-512 Xeon). Checked once a process; 2 * most when even
    `most` rows differ."""
    threads = torch.get_num_threads()
    key = (tuple(tuple(w.shape) for w in weights), threads)
    if key not in _ROWS_ALIKE:
        gen = torch.Generator().manual_seed(0)
        need = 1
        try:
            for t in sorted({1, threads}):
                torch.set_num_threads(t)
                for w in weights:
                    x = torch.randn(2 * most, w.shape[1], generator=gen, dtype=w.dtype)
                    ref = F.linear(x, w)
                    differ = [m for m in range(1, most + 1) if not torch.equal(F.linear(x[:m], w), ref[:m])]
                    need = max(need, differ[-1] + 1 if differ else 1)
        finally:
            torch.set_num_threads(threads)
        _ROWS_ALIKE[key] = need if need <= most else 2 * most
    return _ROWS_ALIKE[key]


@torch.no_grad()
def columns_pay(model, rows=(2, 4), repeats: int = 3) -> bool:
    """Does a check of a few rows run faster as W @ x^T than as x @ W^T on the host CPU? Which of MKL's
    kernels is faster depends on the CPU (a 2-row check of SmolLM2: 1.04 plain steps as W @ x^T
    against 1.84 on an AVX2 CPU, 2.06 against 1.04 on an AVX-512 Xeon): timed once a process on the
    LM head and a layer's fused FFN weight (most of a check's bytes), best of `repeats` at each row
    count."""
    import time

    ws = [model.lm_head.weight, fused_weights(model).layers[0]["w13"]]
    key = (tuple(tuple(w.shape) for w in ws), torch.get_num_threads())
    if key not in _COLUMNS_PAY:
        def best(fn):
            fn()
            t = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                t.append(time.perf_counter() - t0)
            return min(t)

        by_rows = by_columns = 0.0
        for w in ws:
            for r in rows:
                x = torch.randn(r, w.shape[1], dtype=w.dtype)
                by_rows += best(lambda: F.linear(x, w))
                by_columns += best(lambda: torch.mm(w, x.t()).t().contiguous())
        _COLUMNS_PAY[key] = by_columns < by_rows
    return _COLUMNS_PAY[key]


def _layer_qkv_fn(x, ln1, eps: float, wqkv, bqkv):
    """RMSNorm and the fused q/k/v projection of one token (before RoPE)."""
    return packed.linear(x, wqkv, bqkv, norm=(ln1, eps))


def _layer_in_fn(x, ln1, eps: float, wqkv, bqkv, cos, sin, H: int, nkv: int, hd: int):
    """zeroedge.model.Attention.project for one token on fused weights (RMSNorm first):
    -> q (H, hd) after RoPE, kv (2, nkv, hd): the new token's key (after RoPE) and value stacked,
    so the cache takes them in one write (and compiled, the stack fuses into the RoPE kernel)."""
    return _rope_fn(_layer_qkv_fn(x, ln1, eps, wqkv, bqkv), cos, sin, H, nkv, hd)


def _rope_fn(qkv, cos, sin, H: int, nkv: int, hd: int):
    qkv = qkv.view(H + 2 * nkv, hd)
    qk = qkv[: H + nkv]
    qk = torch.addcmul(qk * cos, qk.roll(hd // 2, -1), sin)
    return qk[:H], torch.stack((qk[H:], qkv[H + nkv:]))


def _layer_out_fn(x, o, wo, ln2, eps: float, w13, w2, i8: bool = False):
    """The rest of zeroedge.model.Block.forward for one token: o_proj, residual, RMSNorm, SwiGLU FFN
    (weights fp or packed: zeroedge.quant.packed fuses the norm, the residuals and the SwiGLU into
    its GEMVs; i8: packed GEMVs on int8-rounded inputs)."""
    x = packed.linear(o.reshape(1, -1), wo, residual=x, int8_inputs=i8)
    a, a8 = packed.swiglu(x, w13, norm=(ln2, eps), int8_inputs=i8, then=w2)   # a8: w2's inputs, made in its epilogue
    return packed.linear(a, w2, residual=x, int8_inputs=i8, inputs=a8)


_COMPILED = {}


def _compiled(fn):
    """torch.compile'd once per process (shapes are the same for every layer and context)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False, fullgraph=True)
    return _COMPILED[fn]


class Decoder:
    """One decode step through `attention` (a strategy with bind / load_prefix / before / flag /
    per_step / attend or attend_qkv / finish, and optionally layer_input, called with each layer's
    input) and `ffn` (None: dense; else a strategy with bind / out / kept)."""

    compile = False

    def __init__(self, model, attention, ffn=None, graph: bool = True, packed: Optional[bool] = None,
                 int8_inputs: bool = False, packed_forms: Optional[tuple] = None, invariant: bool = False):
        """packed_forms: (per layer {wqkv, wo, w13, w2}, LM head) PackedLinears this decoder's step reads
        instead of the model's own (a drafter's, from packed_forms(); its fp weights stay the model's).
        invariant (the dense cache with the Triton attention, fp weights): a step is a check of
        one token, and every check's products go through zeroedge.runtime.row_products, so a row is
        computed alike in a step and in a check of any length: speculative decoding gives plain
        decoding's tokens bit for bit (without it, a check's cuBLAS products round otherwise than the
        step's GEMV in bf16)."""
        self.m = model
        cfg = model.cfg
        self.cfg = cfg
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.hd, self.nkv, self.H = cfg.head_dim, cfg.n_kv_heads, cfg.n_heads
        if model.layers[0].self_attn.kept_heads.numel() != self.H:
            raise ValueError("the fast decoders need unpruned attention heads")
        self.max_len = max_len = attention.max_len
        self.W = fused_weights(model)
        # packed weights (zeroedge.quant.packed) where the GEMV kernel runs: a CUDA device. Elsewhere
        # the fp weights, which apply(pack=True) made equal to the packed ones (packed=True forces
        # them: the torch reference dequantizes every step, for tests)
        if packed_forms is not None:
            packed = True
        elif packed is None:
            packed = self.W.has_packed() and self.device.type == "cuda"
        if packed and packed_forms is None and not self.W.has_packed():
            raise ValueError("packed=True needs a model with packed weights (zeroedge.quant.apply, pack=True)")
        self.packed_layers, self.packed_head = (packed_forms if packed_forms is not None
                                                else self.W.packed() if packed else (None, None))
        self.head_ids = None                    # restrict_head: the vocabulary ids the step's logits are for
        self._head_rows = None
        if int8_inputs and not packed:
            raise ValueError("int8_inputs is an option of the packed GEMV (a model with packed weights)")
        self.int8_inputs = int8_inputs          # dp4a on int8-rounded inputs (zeroedge.quant.triton_gemv)
        pos = torch.arange(max_len, device=self.device, dtype=torch.float32)
        f = torch.outer(pos, model.inv_freq.to(self.device).float())
        self.cos = torch.cat((f, f), -1).cos().to(self.dtype)
        s = f.sin()
        self.sin_signed = torch.cat((-s, s), -1).to(self.dtype)      # rotate_half folded into sign
        self.sin = torch.cat((s, s), -1).to(self.dtype)
        self.tok = torch.zeros(1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.graph_wanted = graph and self.device.type == "cuda"
        self._verify_tok = {}                   # number of tokens -> the verify graph's input buffer
        self.graphs = {}
        self.outs = {}
        self.attention, self.ffn = attention, ffn
        attention.bind(len(model.layers), self.nkv, self.H, self.hd, self.device, self.dtype)
        # the model's fp weights over a draft's rows: with the Triton attention, the serving engine's
        # fused elementwise kernels (runtime.fused); float32 on a CPU with MKL, products as W @ x^T where
        # that is the faster form there (columns_pay; in bf16 / fp16 it is no faster)
        self.verify_fused = isinstance(attention, DenseAttention) and attention.attn == "triton" and not attention.ring
        self.invariant = invariant
        if invariant and not (self.verify_fused and ffn is None and self.packed_layers is None):
            raise ValueError("invariant decoding runs over the dense cache with the Triton attention, on fp "
                             "weights (no window, no decode paths, no packed weights)")
        if self.verify_fused:
            from zeroedge.runtime.fused import FusedLinears

            self.verify_linears = FusedLinears(model, invariant=invariant)
        else:
            columns = (self.device.type == "cpu" and self.dtype == torch.float32
                       and torch.backends.mkl.is_available() and columns_pay(model))
            self.verify_linears = TorchLinears(model, columns=columns)
        if ffn is not None:
            ffn.bind(self.W.layers, cfg, self.device, self.dtype, self.packed_layers, int8_inputs)

    def load_prefix(self, ks, vs, qcovs=None):
        """ks, vs: per layer (nkv, P, hd) keys (rope applied) and values; qcovs: per layer query
        covariances, for an attention that uses them."""
        if qcovs is None:
            return self.attention.load_prefix(ks, vs)
        return self.attention.load_prefix(ks, vs, qcovs)

    def kv_bytes(self, n_tokens: Optional[int] = None) -> int:
        return self.attention.kv_bytes(n_tokens) if n_tokens is not None else self.attention.kv_bytes()

    def device_kv_bytes(self) -> dict:
        return self.attention.device_kv_bytes()

    def kept(self) -> dict:
        """Fraction of channels the last step computed, per sparse layer ({} without paths)."""
        return self.ffn.kept() if self.ffn is not None else {}

    def _forward(self, flag):
        m = self.m
        rope_inside = getattr(self.attention, "takes_qkv", False)   # RoPE and the cache write in its kernel
        if not rope_inside:
            cos = self.cos.index_select(0, self.pos)
            sin = self.sin_signed.index_select(0, self.pos)
        x = m.embed_tokens(self.tok)                     # (1, dim)
        self.attention.per_step(self.pos)
        if self.packed_layers is None:
            f_in = _compiled(_layer_in_fn) if self.compile else _layer_in_fn
            f_qkv = _compiled(_layer_qkv_fn) if self.compile else _layer_qkv_fn
            f_out = _compiled(_layer_out_fn) if self.compile else _layer_out_fn
        else:                                   # packed: the GEMVs run as they are, RoPE compiled
            rope = _compiled(_rope_fn) if self.compile else _rope_fn
            i8 = self.int8_inputs

            def f_qkv(x, ln1, eps, wqkv, bqkv):
                return packed.linear(x, wqkv, bqkv, norm=(ln1, eps), int8_inputs=i8)

            def f_in(x, ln1, eps, wqkv, bqkv, cos, sin, H, nkv, hd):
                return rope(f_qkv(x, ln1, eps, wqkv, bqkv), cos, sin, H, nkv, hd)

            def f_out(*args):
                return _layer_out_fn(*args, i8=i8)
        hook = getattr(self.attention, "layer_input", None)

        def predict(t, xx):
            return self._predicted_query(t, xx, self.pos)

        for li, w in enumerate(self.W.layers):
            pw = w if self.packed_layers is None else self.packed_layers[li]
            if hook is not None:
                hook(li, x, predict, flag)
            if rope_inside:
                qkv = f_qkv(x, w["ln1"], w["eps1"], pw["wqkv"], w["bqkv"])
                o = self.attention.attend_qkv(li, qkv, self.cos, self.sin_signed, flag)
            else:
                q, kv = f_in(x, w["ln1"], w["eps1"], pw["wqkv"], w["bqkv"], cos, sin, self.H, self.nkv, self.hd)
                o = self.attention.attend(li, q, kv, flag)   # (H, hd)
            y = self.ffn.out(li, w, pw["wo"], x, o) if self.ffn is not None else None
            x = f_out(x, o, pw["wo"], w["ln2"], w["eps2"], pw["w13"], pw["w2"]) if y is None else y
        head = self.packed_head if self._head_rows is None else self._head_rows
        if isinstance(head, PackedLinear):
            logits = packed.linear(x, head, norm=(m.norm.weight, m.norm.eps), int8_inputs=self.int8_inputs)[0]
        else:
            logits = F.linear(m.norm(x), m.lm_head.weight if head is None else head)[0]
        self.attention.finish()
        return logits

    def _predicted_query(self, t, x, at, fp: bool = False):
        """Layer t's query (before RoPE) from input x (thermal ahead), and the RoPE to apply at
        position `at` (a one-element device tensor): the query's rows of the fused q/k/v weights
        (views), packed where the step reads packed weights and not `fp`."""
        wt = self.W.layers[t]
        rows, b = self.H * self.hd, wt["bqkv"]
        use_packed = self.packed_layers is not None and not fp
        w = self.packed_layers[t]["wqkv"].rows(0, rows) if use_packed else wt["wqkv"][:rows]
        b = None if b is None else b[:rows]
        q = packed.linear(x, w, b, norm=(wt["ln1"], wt["eps1"]), int8_inputs=self.int8_inputs and use_packed)
        return q.view(-1, self.hd)[:self.H], (self.cos, self.sin_signed, at)

    def restrict_head(self, ids) -> None:
        """From now on the step's logits are for these vocabulary ids only, in their order (a drafter's
        head: zeroedge.speculative.draft_vocabulary; most of an LM head's rows are tokens no draft
        needs: at the llama-3.2-1b shape an int8 head is a third of a 4-bit step's weight bytes, and
        16384 of its rows made the step 0.70 -> 0.64 ms on an H100). Their number is fixed by
        the first call (the captured step reads the rows where they are; later calls copy new rows in);
        verify keeps the whole vocabulary."""
        if self.invariant:
            raise ValueError("an invariant decoder keeps the whole vocabulary (a drafter restricts its head)")
        ids = torch.as_tensor(ids, dtype=torch.long).to(self.device)
        head = self.packed_head if self.packed_head is not None else self.m.lm_head.weight.detach()
        if self.head_ids is None:
            self.head_ids = ids
            self._head_rows = head.select(ids) if isinstance(head, PackedLinear) else head.index_select(0, ids)
            self.graphs.clear()                 # a step captured before read the whole head
            self.outs.clear()
            return
        if ids.numel() != self.head_ids.numel():
            raise ValueError(f"the head was restricted to {self.head_ids.numel()} ids, not {ids.numel()}")
        self.head_ids.copy_(ids)
        pairs = ([(head.q, self._head_rows.q), (head.scale, self._head_rows.scale),
                  (head.offset, self._head_rows.offset)] if isinstance(head, PackedLinear)
                 else [(head, self._head_rows)])
        for src, dst in pairs:                  # the rows gathered into the buffers the step reads
            torch.index_select(src, 0, ids, out=dst)

    def step(self, token: int, pos: int):
        """One decode step at position `pos`; returns logits (vocab,) (a static buffer on CUDA), or over
        the ids of restrict_head."""
        if self.invariant:                      # the check's kernels, so a check's rows equal steps
            return self.verify([token], pos)[0]
        self.tok.fill_(int(token))
        self.pos.fill_(int(pos))
        self.attention.before(pos)
        flag = self.attention.flag(pos)
        if not self.graph_wanted:
            with torch.no_grad():
                return self._forward(flag)
        # a refresh whose pages the host reads (a cold store in a file) is captured in pieces
        pieces = bool(flag) and getattr(self.attention, "host_refresh", False)
        if flag not in self.graphs:
            # captured on the attention's own stream where it has one (thermal lag 1 / ahead: a high priority)
            s = getattr(self.attention, "main_stream", None) or shared_stream(self.device, "capture")
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s), torch.no_grad():
                for _ in range(2):
                    self._forward(flag)
            torch.cuda.current_stream().wait_stream(s)
            if pieces:
                self.graphs[flag] = self._capture_pieces(flag)
            else:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=getattr(self.attention, "main_stream", None)), torch.no_grad():
                    self.outs[flag] = self._forward(flag)
                self.graphs[flag] = g
        if pieces:
            for g, li in self.graphs[flag]:
                g.replay()
                if li is not None:
                    self.attention.host_read(li)
        else:
            self.graphs[flag].replay()
        return self.outs[flag]

    def verify(self, tokens, pos: int) -> torch.Tensor:
        """tokens at positions pos.. in one forward over len(tokens) rows (the model's fp weights)
        against this decoder's dense cache, which takes their K/V; -> (len(tokens), vocab) logits,
        one row per position: the check of a speculative draft (zeroedge.speculative). On CUDA one
        graph per number of tokens, captured at first use and replayed at any position. Positions
        past the ones kept are written again by the next step. On the thermal decoder each row's
        refresh runs as its plain step's would (ThermalAttention.verify_attend; eager, no graph), and
        the next step or check undoes the rows it does not keep (ThermalAttention.settle)."""
        att = self.attention
        thermal = isinstance(att, ThermalAttention)
        if self.ffn is not None or not (thermal or (isinstance(att, DenseAttention) and not att.ring)):
            raise ValueError("verify runs on the dense and thermal decoders (no window, no decode paths)")
        T = len(tokens)
        if T < 1 or pos < 0 or pos + T > self.max_len:
            raise ValueError(f"positions {pos}..{pos + T} are outside the cache of {self.max_len}")
        buf = self._verify_tok.get(T)
        if buf is None:
            buf = self._verify_tok[T] = torch.zeros(T, dtype=torch.long, device=self.device)
        buf.copy_(torch.tensor(list(tokens)))
        if thermal:
            att.verify_begin(pos, T)
            with torch.no_grad():
                return self._verify_thermal(buf, pos)
        self.pos.fill_(int(pos))
        key = ("verify", T)
        if not self.graph_wanted:
            with torch.no_grad():
                return self._verify_forward(buf)
        if key not in self.graphs:
            s = shared_stream(self.device, "capture")
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s), torch.no_grad():
                for _ in range(2):
                    self._verify_forward(buf)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g), torch.no_grad():
                self.outs[key] = self._verify_forward(buf)
            self.graphs[key] = g
        self.graphs[key].replay()
        return self.outs[key]

    def _verify_forward(self, tok):
        att, T, H, nkv, hd = self.attention, tok.numel(), self.H, self.nkv, self.hd
        lin = self.verify_linears
        p = self.pos + torch.arange(T, device=self.device)
        if self.verify_fused:                   # the cache as one page: each row reads 0..its position
            from zeroedge.kv.paged_attention import paged_attend
            from zeroedge.runtime.fused import rope_store

            cos, sin = self.cos.index_select(0, p), self.sin.index_select(0, p)
            one_page = torch.zeros(T, 1, dtype=torch.int32, device=self.device)
            lens = (p + 1).to(torch.int32)
        else:
            cos, sin = self.cos.index_select(0, p)[:, None], self.sin_signed.index_select(0, p)[:, None]
            mask = additive_mask(att.kpos[None, :] <= p[:, None], self.dtype).view(1, 1, T, -1)
        x, qkv = lin.boundary(0, self.m.embed_tokens(tok))
        for li in range(att.L):
            if self.verify_fused:               # RoPE, and k and v written at p, in one kernel
                K, V = att.k[li].transpose(0, 1), att.v[li].transpose(0, 1)
                o = paged_attend(rope_store(qkv, cos, sin, K, V, p, H, nkv), K, V, one_page, lens, self.max_len)
                x, qkv = lin.boundary(li + 1, x, o.reshape(T, H * hd))
                continue
            qkv = qkv.view(T, H + 2 * nkv, hd)
            qk = torch.addcmul(qkv[:, :H + nkv] * cos, qkv[:, :H + nkv].roll(hd // 2, -1), sin)
            att.kv[li].index_copy_(2, p, torch.stack((qk[:, H:], qkv[:, H + nkv:])).transpose(1, 2))
            o = F.scaled_dot_product_attention(qk[:, :H].transpose(0, 1)[None], att.k[li][None],
                                               att.v[li][None], attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
            x, qkv = lin.boundary(li + 1, x, o.reshape(T, H * hd))
        return lin.head(x).float()

    def _verify_thermal(self, tok, pos: int):
        """Decoder.verify's rows on the thermal window: the linears over all rows at once, the
        attention (and the refreshes) row by row (ThermalAttention.verify_attend)."""
        att, T, H, nkv, hd = self.attention, tok.numel(), self.H, self.nkv, self.hd
        lin = self.verify_linears
        p = pos + torch.arange(T, device=self.device)
        cos, sin = self.cos.index_select(0, p)[:, None], self.sin_signed.index_select(0, p)[:, None]

        def predict(t, row, at):                # the check's linears are the fp weights
            return self._predicted_query(t, row, at, fp=True)

        x, qkv = lin.boundary(0, self.m.embed_tokens(tok))
        for li in range(att.L):
            att.verify_predict(li, x, predict, p)
            qkv = qkv.view(T, H + 2 * nkv, hd)
            qk = torch.addcmul(qkv[:, :H + nkv] * cos, qkv[:, :H + nkv].roll(hd // 2, -1), sin)
            o = att.verify_attend(li, qk[:, :H], torch.stack((qk[:, H:], qkv[:, H + nkv:])), p)
            x, qkv = lin.boundary(li + 1, x, o.reshape(T, H * hd))
        return lin.head(x).float()

    def _capture_pieces(self, flag) -> list:
        """The step as graphs cut at each host read (attention.on_host_read): [(graph, layer whose
        pages the host reads after it, or None for the last)], captured in order into one memory
        pool and replayed in that order."""
        pool = torch.cuda.graph_pool_handle()
        pieces = []
        graph = torch.cuda.CUDAGraph()

        def cut(li):
            nonlocal graph
            graph.capture_end()
            pieces.append((graph, li))
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool)

        torch.cuda.synchronize()
        with torch.cuda.stream(shared_stream(self.device, "capture")), torch.no_grad():
            graph.capture_begin(pool=pool)
            self.attention.on_host_read = cut
            try:
                self.outs[flag] = self._forward(flag)
            finally:
                self.attention.on_host_read = None
                graph.capture_end()
        pieces.append((graph, None))
        return pieces


class DenseAttention:
    """A static KV cache; attention over every position up to the current one, or with `window`
    over the first `sinks` positions and the last `window` (a drafter's cache: its step reads
    sinks + window positions of K/V at any context; keys keep their true RoPE positions, and
    position p >= sinks takes slot sinks + (p - sinks) % window of a ring).
    attn: "sdpa" (RoPE, the cache write, an additive mask and SDPA in torch), "bmm" (two batched
    matmuls), "triton" (RoPE, the cache write and split attention in two kernels:
    zeroedge.kv.decode_attention; CUDA with Triton) or "auto" (triton where it runs, else sdpa)."""

    def __init__(self, max_len: int, attn: str = "auto", window: Optional[int] = None, sinks: int = 4):
        if attn not in ("auto", "bmm", "sdpa", "triton"):
            raise ValueError("attn must be 'auto', 'bmm', 'sdpa' or 'triton'")
        if window is not None and (window < 1 or sinks < 0):
            raise ValueError("the window needs at least one position and sinks >= 0")
        self.max_len, self.attn = max_len, attn
        self.ring = window is not None and sinks + window < max_len
        self.sinks, self.window = (sinks, window) if self.ring else (0, max_len)
        self.slots = self.sinks + self.window   # cache indices

    def bind(self, L: int, nkv: int, H: int, hd: int, device, dtype):
        self.L, self.nkv, self.H, self.hd, self.dtype = L, nkv, H, hd, dtype
        self.attn = choose_attention(self.attn, nkv, self.slots, hd, device, dtype)
        self.takes_qkv = self.attn == "triton"
        # K and V of a layer side by side, so one index_copy writes the new token's pair
        self.kv = torch.zeros((L, 2, nkv, self.slots, hd), device=device, dtype=dtype)
        self.k, self.v = self.kv[:, 0], self.kv[:, 1]
        self.kpos = torch.arange(self.slots, device=device)
        if self.takes_qkv:
            from zeroedge.kv.decode_attention import Shares

            self.shares = Shares(H, hd, device, max_len=self.slots)
            self.o = torch.empty(H, hd, device=device, dtype=dtype)

    def kv_bytes(self, n_tokens: Optional[int] = None) -> int:
        n = self.slots if n_tokens is None else min(n_tokens, self.slots)
        return 2 * self.L * self.nkv * n * self.hd * self.k.element_size()

    def slot_of(self, pos: torch.Tensor) -> torch.Tensor:
        """The cache index of each position."""
        if not self.ring:
            return pos
        return torch.where(pos < self.sinks, pos, self.sinks + (pos - self.sinks) % self.window)

    def load_prefix(self, ks, vs):
        """ks, vs: per layer (nkv, P, hd) keys (RoPE applied) and values of positions 0..P-1."""
        for li, (k, v) in enumerate(zip(ks, vs)):       # a layer at a time: no copy of the whole prefix
            self._store(self.k[li], self.v[li], k, v, 0)

    def load_positions(self, k, v, start: int) -> None:
        """k, v (layers, kv heads, n, head dim): the keys (RoPE applied) and values of positions
        start..start+n-1 (a position whose slot a later one of them takes is skipped)."""
        self._store(self.k, self.v, k, v, start)

    def _store(self, K, V, k, v, start: int) -> None:
        """k, v into caches K, V (their positions on the next-to-last axis)."""
        n = k.shape[-2]
        if start < 0 or start + n > self.max_len:
            raise ValueError(f"positions {start}..{start + n} are outside the cache of {self.max_len}")
        pos = torch.arange(start, start + n)
        idx = ((pos < self.sinks) | (pos >= start + n - self.window)).nonzero().squeeze(1)
        dst = self.slot_of(pos[idx]).to(self.kv.device)
        for cache, src in ((K, k), (V, v)):
            cache.index_copy_(-2, dst, src.index_select(-2, idx.to(src.device)).to(self.kv.device, self.dtype))

    def before(self, pos: int):
        if not 0 <= pos < self.max_len:     # the Triton kernel would write outside the cache
            raise ValueError(f"position {pos} is outside the cache of {self.max_len} positions")

    def flag(self, pos: int) -> int:
        return 0

    def per_step(self, pos: torch.Tensor):
        self.pos = pos
        self.at = self.slot_of(pos)             # where the new token's K/V go
        self.n = (pos + 1).clamp(max=self.slots) if self.ring else None   # slots attended, ring only
        if self.takes_qkv:
            return
        self.mask = (self.kpos < self.n) if self.ring else (self.kpos <= pos)
        if self.attn == "sdpa":  # additive, built once a step (SDPA would convert a bool mask per layer)
            self.amask = additive_mask(self.mask, self.dtype).view(1, 1, 1, -1)

    def attend(self, li, q, kv, flag):
        """q (H, hd), kv (2, nkv, hd) of the new token -> (H, hd)."""
        self.kv[li].index_copy_(2, self.at, kv[:, :, None])
        K, V = self.k[li], self.v[li]
        if self.attn == "sdpa":
            o = F.scaled_dot_product_attention(q.view(1, self.H, 1, self.hd), K[None], V[None],
                                               attn_mask=self.amask, enable_gqa=True)
            return o.view(self.H, self.hd)
        grp = self.H // self.nkv
        qg = q.view(self.nkv, grp, self.hd)
        s = torch.bmm(qg, K.transpose(1, 2)).float() / math.sqrt(self.hd)
        s = s.masked_fill(~self.mask, float("-inf"))
        return torch.bmm(s.softmax(-1).to(self.dtype), V).view(self.H, self.hd)

    def finish(self):
        pass

    def attend_qkv(self, li, qkv, cos, sin, flag=0):
        """The new token's raw q/k/v projection -> (H, hd): RoPE, the cache write and the attention
        in zeroedge.kv.decode_attention's kernels (cos / sin: the decoder's whole tables)."""
        from zeroedge.kv.decode_attention import rope_attend

        if self.ring:
            return rope_attend(qkv, cos, sin, self.pos, self.kv[li], self.H, self.shares, self.o, at=self.at,
                               n=self.n)
        return rope_attend(qkv, cos, sin, self.pos, self.kv[li], self.H, self.shares, self.o)


class DenseDecoder(Decoder):
    """The dense cache (window: DenseAttention's window over the last positions, a drafter's)."""

    def __init__(self, model, max_len: int, graph: bool = True, attn: str = "auto", packed: Optional[bool] = None,
                 int8_inputs: bool = False, packed_forms: Optional[tuple] = None, window: Optional[int] = None,
                 invariant: bool = False):
        if invariant and attn == "auto":        # a step is a check, whose fused path takes the Triton attention
            attn = "triton"
        super().__init__(model, DenseAttention(max_len, attn, window), None, graph, packed, int8_inputs,
                         packed_forms, invariant)


class ThermalDecoder(Decoder):
    """Decode over a prefix of P tokens with a thermal cache (zeroedge.kv.attention)."""

    def __init__(self, model, prefix_len: int, gen_len: int, graph: bool = True, packed: Optional[bool] = None,
                 int8_inputs: bool = False, **thermal):
        super().__init__(model, ThermalAttention(prefix_len, gen_len, **thermal), None, graph, packed, int8_inputs)


class PathsDecoder(Decoder):
    """The dense cache with decode paths on the policies' layers (zeroedge.paths.ffn)."""

    def __init__(self, model, max_len: int, policies: dict, graph: bool = True, attn: str = "auto",
                 kernels: str = "auto", kernels_lib=None, packed: Optional[bool] = None, int8_inputs: bool = False):
        super().__init__(model, DenseAttention(max_len, attn), PathsFFN(policies, kernels, kernels_lib), graph,
                         packed, int8_inputs)


class ThermalPathsDecoder(Decoder):
    """Thermal KV and decode paths in one step."""

    def __init__(self, model, prefix_len: int, gen_len: int, policies: dict, graph: bool = True,
                 kernels: str = "auto", packed: Optional[bool] = None, int8_inputs: bool = False, **thermal):
        super().__init__(model, ThermalAttention(prefix_len, gen_len, **thermal), PathsFFN(policies, kernels),
                         graph, packed, int8_inputs)
