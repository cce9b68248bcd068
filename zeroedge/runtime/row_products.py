"""x @ w^T with every row computed alike for any number of rows (a batch-invariant product).

cuBLAS picks its kernel, tiles and split of the inner dimension by the number of rows, so in bf16
a row's result can differ in its last bit between a step of one row and a step of eight: a
speculative check then disagrees with plain decoding at a near-tie, and a request's reply depends on
what else the server batched with it. `linear(x, w, bias)` runs one Triton kernel whose tile sizes and
order of summation depend only on w's shape: each output tile accumulates the inner dimension in
blocks of `BK`, in order, in fp32, with the rows of x as the tile's own rows (masked past M), then
adds the bias in fp32 and rounds once. A row's value therefore does not depend on M or on the other
rows (M is also kept out of Triton's specialisation). Rows of a prompt chunk go through it too, so a
step that mixes a chunk with decode rows computes the decode rows as a step of them alone would.

Imported lazily; CUDA, or Triton's CPU interpreter (tests). fp16 / bf16 products on the tensor cores,
fp32 in full precision (no TF32).
"""
from __future__ import annotations

from typing import Optional

import torch

BM = 64            # rows a tile computes: a decode batch of up to 64 rows is one tile
BK = 128           # the inner dimension's block
BN_NARROW = 32     # output columns a tile computes, for a weight of up to 4096 rows (enough tiles
BN_WIDE = 64       # to fill the GPU at one row), and for wider ones
STAGES = 3         # Triton's software pipeline over the inner dimension


_kernel = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def rows_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, s_x, s_w, s_y,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_B: tl.constexpr,
                    IEEE: tl.constexpr):
        pn = tl.program_id(0)
        pm = tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        mm = rm < M
        nm = rn < N
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            km = kk < K
            a = tl.load(x_ptr + rm[:, None].to(tl.int64) * s_x + kk[None, :], mask=mm[:, None] & km[None, :],
                        other=0.)
            b = tl.load(w_ptr + rn[None, :].to(tl.int64) * s_w + kk[:, None], mask=nm[None, :] & km[:, None],
                        other=0.)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_B:
            acc += tl.load(b_ptr + rn, mask=nm, other=0.).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None].to(tl.int64) * s_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mm[:, None] & nm[None, :])

    return rows_kernel


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (M, K) @ w (N, K)^T (+ bias (N,)) -> (M, N) in x's dtype; x, w and bias of one dtype."""
    global _kernel
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.dtype != w.dtype or (
            bias is not None and (bias.shape != (w.shape[0],) or bias.dtype != w.dtype)):
        raise ValueError("row_products.linear takes x (M, K), w (N, K) and a bias (N,) of one dtype")
    if _kernel is None:
        _kernel = _build()
    M, K = x.shape
    N = w.shape[0]
    x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0:
        return y
    bn = BN_NARROW if N <= 4096 else BN_WIDE        # a function of the weight's shape only
    grid = (-(-N // bn), -(-M // BM))
    _kernel[grid](x, w, bias if bias is not None else w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                  BM=BM, BN=bn, BK=BK, HAS_B=bias is not None, IEEE=x.dtype == torch.float32,
                  num_warps=4, num_stages=STAGES)
    return y
