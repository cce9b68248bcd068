"""Packed group-wise weights for the torch decode loop: what the CUDA GEMV (zeroedge.quant.triton_gemv)
reads, with a torch reference that runs anywhere.

One form, `PackedLinear`, for an nn.Linear weight W [N, K] (out, in) quantized per `Scheme`
(zeroedge.quant.groupwise: groups of `group` consecutive inputs per output row, K zero-padded to a
multiple of the group):

  q       uint8 [N, Kp * bits / 8]   row-major; 4 bits: byte j of a row holds input 2j in its low
                                     nibble and 2j + 1 in its high nibble; 8 bits: one a byte
  scale   fp16  [N, Kp / group]      the step s of each group
  offset  fp16  [N, Kp / group]      o, so that the weight is  w = q * s + o   (fp32)

  asymmetric, float zero point  s and o = m are fp16 values by construction (Q4_1's d and m): the
                                weight is fl(q * s) + m, groupwise.dequantize_float's (an ulp apart
                                in a block whose zero point has no exact product)
  asymmetric / symmetric, int   s rounded to fp16 (onnxruntime keeps fp32 scales; llama.cpp fp16
                                ones), o = -zp * s (exact for a symmetric grid): a weight moves by
                                under 2^-10 of its group's largest magnitude, under the bf16
                                rounding of the activations it multiplies

The GEMV computes y_n = sum_g (s_ng * sum_{k in g} q_nk x_k + o_ng * sum_{k in g} x_k) in fp32.
A 4-bit group of 32 costs 4 + 32 / 32 = 5 bits a weight; of 128, 4.25.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zeroedge.quant.groupwise import Scheme, quantize, quantize_float


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes one a byte -> two a byte along the last dim (the first in the low nibble)."""
    return q[..., 0::2] | (q[..., 1::2] << 4)


def _unpack4(q: torch.Tensor) -> torch.Tensor:
    """The inverse of _pack4."""
    return torch.stack((q & 15, q >> 4), -1).flatten(-2)


@dataclass
class PackedLinear:
    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int
    group: int
    k: int                      # the real input size (the packed rows hold Kp >= k)

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def groups(self) -> int:
        return self.scale.shape[1]

    @property
    def device(self):
        return self.q.device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset))

    @classmethod
    def from_weight(cls, w: torch.Tensor, scheme: Scheme) -> "PackedLinear":
        """nn.Linear weight [N, K] -> its packed form (quantized in fp32 on w's device)."""
        n, k = w.shape
        if scheme.zero_point == "float":
            q, s, _, m = quantize_float(w, scheme)
            off = m
        else:
            q, s, zp = quantize(w, scheme)
            s = s.half().float()
            off = -zp.float() * s                       # exact in fp16 for a symmetric grid (zp 2^(b-1))
        q = q.reshape(n, -1)                            # [N, Kp] one code a byte
        if scheme.bits == 4:
            q = _pack4(q)
        return cls(q.contiguous(), s.half().contiguous(), off.half().contiguous(), scheme.bits,
                   scheme.group, k)

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]: q * s + o."""
        q = _unpack4(self.q) if self.bits == 4 else self.q
        w = q.float().view(self.n, self.groups, self.group) * self.scale.float()[..., None] \
            + self.offset.float()[..., None]
        return w.reshape(self.n, -1)[:, : self.k]

    def rows(self, start: int, stop: int) -> "PackedLinear":
        """Output rows start..stop, views of this form's tensors (no copy)."""
        return PackedLinear(self.q[start:stop], self.scale[start:stop], self.offset[start:stop], self.bits,
                            self.group, self.k)

    def select(self, ids: torch.Tensor) -> "PackedLinear":
        """The output rows `ids` (a LongTensor on this form's device), in their order (a copy)."""
        return PackedLinear(self.q.index_select(0, ids), self.scale.index_select(0, ids),
                            self.offset.index_select(0, ids), self.bits, self.group, self.k)

    def to(self, device) -> "PackedLinear":
        return PackedLinear(self.q.to(device), self.scale.to(device), self.offset.to(device), self.bits,
                            self.group, self.k)

    @staticmethod
    def cat(parts) -> "PackedLinear":
        """Stacked along the output rows (fused q/k/v or gate/up): one scheme, one input size."""
        p0 = parts[0]
        if any((p.bits, p.group, p.k) != (p0.bits, p0.group, p0.k) for p in parts):
            raise ValueError("packed weights stacked together need one scheme and one input size")
        return PackedLinear(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                            torch.cat([p.offset for p in parts]), p0.bits, p0.group, p0.k)


@dataclass
class PackedInputs:
    """A PackedLinear transposed for gathers over the inputs (decode paths' magnitude rule: only the
    rows of inputs that survive are read): the same codes and groups, stored input-major.

      q       uint8 [Kp, N * bits / 8]   row k: input k's codes for every output, two outputs a byte
                                         (4 bits: output 2c in the low nibble of byte c, 2c + 1 high)
      scale   fp16  [Kp / group, N]      the step of output n's group g (the PackedLinear's, transposed)
      offset  fp16  [Kp / group, N]
    """
    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int
    group: int
    k: int
    n: int

    @classmethod
    def of(cls, w: PackedLinear) -> "PackedInputs":
        if w.bits == 4 and w.n % 2:
            raise ValueError("input-major 4-bit codes need an even number of outputs")
        q = (_unpack4(w.q) if w.bits == 4 else w.q).t()                  # [Kp, N] one code a byte
        if w.bits == 4:
            q = _pack4(q)
        return cls(q.contiguous(), w.scale.t().contiguous(), w.offset.t().contiguous(), w.bits, w.group,
                   w.k, w.n)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset))

    def dequantize(self) -> torch.Tensor:
        """fp32 [K, N] (= the PackedLinear's dequantized weight, transposed)."""
        q = _unpack4(self.q) if self.bits == 4 else self.q
        w = q.float().view(-1, self.group, self.n) * self.scale.float()[:, None] + self.offset.float()[:, None]
        return w.reshape(-1, self.n)[: self.k]


def gather_inputs(x: torch.Tensor, w: PackedInputs) -> torch.Tensor:
    """x (1, K) @ W^T for W's input-major form, reading only the rows of inputs that are not 0 (on a
    GPU with Triton: zeroedge.quant.triton_gemv.gather_inputs; else the torch reference). x's dtype."""
    if _use_kernel(x):
        from zeroedge.quant import triton_gemv

        return triton_gemv.gather_inputs(x, w)
    return (x.float() @ w.dequantize()).to(x.dtype)


def _use_kernel(x: torch.Tensor) -> bool:
    if x.device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


TINY_INPUTS = 1e-30    # a run of inputs all below this in magnitude rounds to 0 (127 / max would overflow)


def round_inputs_int8(x: torch.Tensor, bits: int) -> torch.Tensor:
    """What the int8-input GEMV multiplies (zeroedge.quant.triton_gemv, int8_inputs): the inputs in
    runs of 32 / bits (one 32-bit word of codes), each run rounded to int8 with the scale max|x| / 127
    (floor(v + 0.5)), as fp32; a run whose largest magnitude is under TINY_INPUTS gives 0."""
    v = 32 // bits
    k = x.shape[-1]
    xf = F.pad(x.float(), (0, (-k) % v)).reshape(*x.shape[:-1], -1, v)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > TINY_INPUTS, 127.0 / amax, torch.zeros_like(amax))
    return (torch.floor(xf * inv + 0.5) * (amax / 127.0)).reshape(*x.shape[:-1], -1)[..., :k]


def linear(x: torch.Tensor, w, bias=None, residual=None, norm=None, int8_inputs: bool = False, inputs=None):
    """x (1, K) @ w^T (+ bias) (+ residual), after RMSNorm when norm = (weight, eps): w a tensor
    (F.linear) or a PackedLinear (the CUDA GEMV on a GPU with Triton, the norm and the residual fused
    into it; else the torch reference). int8_inputs (packed only): the inputs rounded to int8 a word
    at a time first (round_inputs_int8; the dp4a kernel). inputs: x's int8 inputs as the GEMV that
    made x prepared them (swiglu's `then`), or None. Output in x's dtype."""
    if inputs is not None and (not int8_inputs or norm is not None or not isinstance(w, PackedLinear)):
        raise ValueError("linear: prepared inputs go with a packed weight, int8_inputs and no norm")
    if isinstance(w, PackedLinear) and _use_kernel(x):
        from zeroedge.quant import triton_gemv

        y = triton_gemv.gemv(x, w, residual=residual, norm=norm, int8_inputs=int8_inputs, inputs=inputs)
        return y if bias is None else y + bias
    if norm is not None:
        x = F.rms_norm(x, (x.shape[-1],), norm[0], norm[1])
    if isinstance(w, PackedLinear):
        xf = round_inputs_int8(x, w.bits) if int8_inputs else x.float()
        y = F.linear(xf, w.dequantize(), None if bias is None else bias.float()).to(x.dtype)
    else:
        y = F.linear(x, w, bias)
    return y if residual is None else residual + y


def swiglu(x: torch.Tensor, w13, norm=None, int8_inputs: bool = False, predictor=None, then=None):
    """silu(x W_gate^T) * (x W_up^T) with w13 = [W_gate; W_up] (a tensor or a PackedLinear), after
    RMSNorm when norm = (weight, eps); packed on a GPU, one kernel computes the norm, both halves
    and the product. predictor = (z [1, r], bg [r, F], bu [r, F] fp32, threshold): only the channels
    with |silu(z bg) * (z bu)| >= threshold, 0 for the others (packed on a GPU the kernel decides
    and never reads the dead channels' rows). then: the weight the output goes into next (W_down);
    returns (output, its prepared int8 inputs or None: linear's `inputs`)."""
    if isinstance(w13, PackedLinear) and _use_kernel(x):
        from zeroedge.quant import triton_gemv

        nxt = then if isinstance(then, PackedLinear) else None
        out = triton_gemv.gemv(x, w13, swiglu=True, norm=norm, int8_inputs=int8_inputs, predictor=predictor,
                               then=nxt)
        return (out, None) if then is not None and nxt is None else out
    g, u = linear(x, w13, norm=norm, int8_inputs=int8_inputs).chunk(2, -1)
    a = F.silu(g) * u
    if predictor is not None:
        z, bg, bu, thr = predictor
        zf = z.float().reshape(1, -1)
        a = torch.where((F.silu(zf @ bg) * (zf @ bu)).abs() >= thr, a, torch.zeros_like(a))
    return (a, None) if then is not None else a
