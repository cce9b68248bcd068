"""Group-wise weight-only quantization with onnxruntime's MatMulNBits numerics.

Layout matched: onnxruntime's `MatMulNBitsQuantizer` (DefaultWeightOnlyQuantizer, QOperator format,
RTN: MLAS `BlockwiseQuantizer<float, block, bits, Columnwise=true>`), for a MatMul weight B [K, N]
(= nn.Linear.weight.T): blocks of `group` consecutive rows of K (the reduction dimension) per output
column n; K is zero-padded to a multiple of the group (zeros change neither the min/max nor the
largest magnitude, so the padded block behaves as a short one). Stored unsigned, q in [0, 2^b - 1]:

  asymmetric  lo = min(block, 0), hi = max(block, 0)          (the range always holds 0)
              scale = (hi - lo) / (2^b - 1)                   fp32
              zp = clamp(roundf(-lo / scale), 0, 2^b - 1)     an integer: 0.0 is on the grid
  symmetric   m = the block's value of largest magnitude (signed; max wins a tie)
              scale = -m / 2^(b-1)  (may be negative),  zp = 2^(b-1)   (8 for int4, 128 for int8)
  both        q = clamp(roundf(w * (1 / scale) + zp), 0, 2^b - 1)     roundf: half away from zero
              dequantized w = (q - zp) * scale;  scale == 0 -> q = zp, w = 0

tests/test_quant.py quantizes random weights with onnxruntime's own tool, runs the MatMulNBits node on
the identity and asserts these functions give the same weights bit for bit. Note what follows for
SmolLM2's Q4_1 GGUF (blocks of 32 along K, w = d * q + m with a float minimum m): onnxruntime's zero
point is an integer, so an asymmetric group-32 grid has the GGUF block's step but is shifted by
frac(-m / d) steps; it does not reproduce Q4_1 exactly (benchmarks/weights.md measures by how much).

Float zero point (Scheme(zero_point="float"), asymmetric, 4-bit): the Q4_1 grid, expressed in what
MatMulNBits takes for a zero point of the scales' type T (contrib op spec: zero_points uint8-packed or
T). Per block of `group` rows of K (the padding of a short last block is left out of its min / max):

  s = fp16((max - min) / 15)           the step, fp16-representable (Q4_1 stores d in fp16);
                                       a constant block: s = 1
  m = fp16(min)                        the block's minimum, fp16-representable (Q4_1's m)
  q = clamp(roundf((w - m) / s), 0, 15)
  z = a float32 with fl(s * z) == -m   (the one nearest -m / s; when no float32 has that product,
                                       which SmolLM2 never needs, the nearest: w then differs from
                                       d * q + m by an ulp)
  dequantized w = fl(q * s) - fl(s * z)   fp32, no fused multiply-add: onnxruntime's CPU kernel for
                                       a float zero point (T = float) computes exactly this
                                       (scale * q + (-scale * zp)); with fl(s * z) = -m it is
                                       fl(fl(d * q) + m), a Q4_1 block dequantized the way llama.cpp /
                                       gguf-py do, so a model born on that grid is reproduced bit for bit.

tests/test_quant.py runs a one-node MatMulNBits with float zero points on the identity and asserts
`dequantize_float` equals its output bit for bit, and that a synthetic Q4_1 weight comes back exactly.
(T = float16: onnxruntime computes in fp32 and rounds the product to fp16; not what zeroedge ships.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (4, 8)
GROUPS = (32, 64, 128)      # power-of-two block sizes MatMulNBits takes (16..256); these are offered


@dataclass(frozen=True)
class Scheme:
    """How a weight is quantized: bits, group along the input dimension, symmetric or not."""
    bits: int = 4
    group: int = 128
    symmetric: bool = False
    zero_point: str = "int"     # asymmetric: "int" (MatMulNBitsQuantizer's uint zero point, 0.0 on the
    #                             grid) or "float" (min/max grid with an fp16 minimum: Q4_1's form)

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits}")
        if self.group < 16 or self.group & (self.group - 1):
            raise ValueError(f"group must be a power of two >= 16, got {self.group}")
        if self.zero_point not in ("int", "float"):
            raise ValueError(f"zero point must be 'int' or 'float', got {self.zero_point!r}")
        if self.zero_point == "float" and self.symmetric:
            raise ValueError("a float zero point is for an asymmetric grid")

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1

    def nbytes(self, k: int, n: int, scale_bytes: int = 4) -> int:
        """Bytes of one [K, N] weight in MatMulNBits' layout: packed q [N, blocks, group*bits/8],
        scales [N, blocks] (fp32 by default: what the quantizer writes for an fp32 weight), zero
        points packed per column (asymmetric only; a float zero point: scale_bytes per block)."""
        blocks = -(-k // self.group)
        data = n * blocks * self.group * self.bits // 8
        if self.zero_point == "float":
            zp = n * blocks * scale_bytes
        else:
            zp = 0 if self.symmetric else n * (-(-blocks * self.bits // 8))
        return data + n * blocks * scale_bytes + zp


def roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero (torch.round rounds them to even)."""
    t = torch.trunc(x)
    return torch.where((x - t).abs() >= 0.5, t + torch.sign(x), t)


def _blocks(w: torch.Tensor, group: int) -> torch.Tensor:
    """nn.Linear weight [N, K] -> fp32 [N, blocks, group], K zero-padded."""
    n, k = w.shape
    pad = (-k) % group
    wf = w.detach().float()
    if pad:
        wf = torch.nn.functional.pad(wf, (0, pad))
    return wf.reshape(n, -1, group)


def _fp16(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to the nearest fp16 value, kept in fp32 (saturating at fp16's largest finite)."""
    return x.clamp(-65504.0, 65504.0).half().float()


def _product_zero_point(s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """A float32 z per block with fl(s * z) == -m where one exists near -m / s (else -m / s)."""
    z0 = -m / s
    best = z0.clone()
    found = (s * z0) == -m
    up, down = z0.clone(), z0.clone()
    for _ in range(4):                                  # a few ulps either side
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.full_like(down, float("-inf")))
        for c in (up, down):
            ok = ~found & ((s * c) == -m)
            best = torch.where(ok, c, best)
            found = found | ok
    return best


def quantize_float(w: torch.Tensor, scheme: Scheme):
    """Float zero point (module docstring): nn.Linear weight [N, K] -> (q uint8 [N, blocks, group],
    scale fp32 [N, blocks] (fp16 values), zero point fp32 [N, blocks], minimum fp32 [N, blocks]
    (fp16 values))."""
    n, k = w.shape
    g = scheme.group
    wf = w.detach().float()
    pad = (-k) % g
    if pad:                                             # repeat the last column: min / max unchanged
        wf = torch.cat([wf, wf[:, -1:].expand(n, pad)], 1)
    b = wf.reshape(n, -1, g)
    lo, hi = b.amin(-1), b.amax(-1)
    s = _fp16((hi - lo) / float(scheme.qmax))
    s = torch.where(s > 0, s, torch.ones_like(s))
    m = _fp16(lo)
    q = roundf((b - m[..., None]) / s[..., None]).clamp(0, scheme.qmax)
    return q.to(torch.uint8), s, _product_zero_point(s, m), m


def dequantize_float(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, k: int) -> torch.Tensor:
    """onnxruntime MatMulNBits with a float zero point (T = float): fl(q * s) - fl(s * z), fp32."""
    w = q.float() * scale[..., None] - (scale * zp)[..., None]
    return w.reshape(w.shape[0], -1)[:, :k]


def quantize(w: torch.Tensor, scheme: Scheme):
    """nn.Linear weight [N, K] (out, in) -> (q uint8 [N, blocks, group], scale fp32 [N, blocks],
    zero point uint8 [N, blocks]); q and zero points unpacked (one value a byte). A float zero point:
    `quantize_float`."""
    if scheme.zero_point == "float":
        raise ValueError("a float zero point: quantize_float")
    b = _blocks(w, scheme.group)
    if scheme.symmetric:
        hi, lo = b.amax(-1), b.amin(-1)
        m = torch.where(hi.abs() > lo.abs(), hi, lo)
        scale = -m / float(1 << (scheme.bits - 1))
        zp = torch.full_like(scale, float(1 << (scheme.bits - 1)))
    else:
        lo, hi = b.amin(-1).clamp(max=0.0), b.amax(-1).clamp(min=0.0)
        scale = (hi - lo) / float(scheme.qmax)
        zfp = torch.where(scale != 0, -lo / torch.where(scale != 0, scale, torch.ones_like(scale)), lo)
        zp = roundf(zfp).clamp(0, scheme.qmax)
    recip = torch.where(scale != 0, 1.0 / torch.where(scale != 0, scale, torch.ones_like(scale)),
                        torch.zeros_like(scale))
    q = roundf(b * recip[..., None] + zp[..., None]).clamp(0, scheme.qmax)
    return q.to(torch.uint8), scale, zp.to(torch.uint8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, k: int) -> torch.Tensor:
    """(q, scale, zp) from `quantize` -> fp32 weight [N, K]: (q - zp) * scale, padding dropped."""
    w = (q.float() - zp.float()[..., None]) * scale[..., None]
    return w.reshape(w.shape[0], -1)[:, :k]


def fake_quantize(w: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """The weight MatMulNBits computes with, in w's dtype and shape."""
    if scheme.zero_point == "float":
        q, s, z, _ = quantize_float(w, scheme)
        return dequantize_float(q, s, z, w.shape[1]).to(w.dtype)
    return dequantize(*quantize(w, scheme), w.shape[1]).to(w.dtype)
