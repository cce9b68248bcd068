/* zeroedge 4-bit decode GEMV: y (1, N) = x (1, K) @ W^T for one token, W packed group-wise as
 * zeroedge.quant.packed.PackedLinear stores it. Plain C API in the launcher style of
 * zeroedge_kernels.h: 0 = ok, a negative ZE_Q4_ERR_* for bad arguments (nothing launched), a
 * positive cudaError_t otherwise.
 *
 * Layouts (contiguous, 16-byte aligned):
 *   x [K], ln [K] (RMSNorm weight, when norm), res [N], y [N]: all fp16 (ZE_Q4_F16) or bf16
 *     (ZE_Q4_BF16); swiglu: y [N] = silu(x W[n]) * (x W[n + N]) from the 2N rows of W
 *   q [rows, K / 8] uint32 words: 8 four-bit codes each, the first input in the low bits
 *   scale, offset [rows, K / group] fp16: w[n, k] = scale[n, g] * code + offset[n, g]
 * The inputs are rounded as the Triton int8-input kernel rounds them (zeroedge.quant.packed.
 * round_inputs_int8: each run of 8 inputs, after the norm, to int8 with the step max|x| / 127) and
 * multiplied with dp4a; sums in fp32 (equal to that kernel up to summation order).
 * Each block rounds the inputs itself into shared memory; with pdl (sm_90) it loads its first weight
 * bytes before waiting for the previous kernel (griddepcontrol.wait), the inputs after.
 * Limits: K % 32 == 0, K <= ZE_Q4_MAX_K, group % 32 == 0, rows_per_warp 1 or 2, unroll 2 or 4.
 */
#ifndef ZEROEDGE_Q4_H
#define ZEROEDGE_Q4_H

#ifdef __cplusplus
extern "C" {
#endif

#define ZE_Q4_API __attribute__((visibility("default")))
#define ZE_Q4_F16 1
#define ZE_Q4_BF16 2
#define ZE_Q4_MAX_K 8192
#define ZE_Q4_ERR_NULL (-1)
#define ZE_Q4_ERR_DTYPE (-2)
#define ZE_Q4_ERR_SHAPE (-3)
#define ZE_Q4_ERR_ALIGN (-4)

ZE_Q4_API int ze_q4_gemv(int dtype, const void* x, const void* ln, float eps, const void* q,
                         const void* scale, const void* offset, const void* res, void* y, int n,
                         int k, int group, int swiglu, int rows_per_warp, int unroll, int pdl,
                         void* stream);

#ifdef __cplusplus
}
#endif
#endif
