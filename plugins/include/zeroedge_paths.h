/* zeroedge decode paths: one FFN of a decode step (batch 1..8) reading only the weight
 * rows of the channels that matter. Plain C API, no TensorRT headers, the launcher style of
 * zeroedge_kernels.h: 0 = ok, a negative ZE_PATHS_ERR_* for bad arguments (nothing launched), a
 * positive cudaError_t otherwise.
 *
 * Layouts (row-major, contiguous, 16-byte aligned; every weight/activation tensor of one call has
 * the same dtype, ZE_PATHS_F16 or ZE_PATHS_BF16; arithmetic is fp32):
 *   x [B, D] (the normalised FFN input), y [B, D] (the FFN output, written, not added)
 *   predictor: z [B, R] (= x A, computed by the caller); bg, bu [F, R] (channel-major: Bg^T and
 *     (Bu * ||W_down[:, j]||)^T); wg, wu [F, D] (rows of W_gate / W_up); wd_t [F, D] (= W_down^T)
 *   magnitude: w13_t [D, 2F] (= [W_gate; W_up]^T: columns 0..F-1 gate, F..2F-1 up); wd_t [F, D]
 *
 * ze_paths_ffn (predictor): channel j is live when max_b |silu(z_b.bg[j]) * (z_b.bu[j])| >= thr;
 *   y = sum over live j of silu(x wg[j]) * (x wu[j]) * wd_t[j]. Rows j of wg, wu, wd_t of dead
 *   channels are never read. Two launches (gate/up, down).
 * ze_paths_ffn_magnitude (TEAL-style): x'[b,k] = x[b,k] when |x[b,k]| >= thr_in, else 0 (rows k of
 *   w13_t are read when any token keeps k); g|u = x' w13_t; a = silu(g) * u, a'[b,j] = a when
 *   |a| >= thr, else 0 (rows j of wd_t read when any token keeps j); y = a' wd_t. Two launches.
 *
 * work: scratch of ze_paths_work_bytes(B, D, F) bytes. The kernels leave it zeroed, so a caller
 * that keeps one buffer (zeroed once, e.g. with cudaMemset) passes work_is_zero = 1 and saves a
 * memset node; TensorRT's per-enqueue workspace passes 0 and the launcher clears it first.
 * Results are reduced with fp32 atomic adds: equal to the reference up to summation order.
 * Limits: 1 <= B <= ZE_PATHS_MAX_BATCH, R <= ZE_PATHS_MAX_RANK, D % 8 == 0, D <= 8192,
 * F % 8 == 0.
 */
#ifndef ZEROEDGE_PATHS_H
#define ZEROEDGE_PATHS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ZE_PATHS_API __attribute__((visibility("default")))
#define ZE_PATHS_MAX_BATCH 8
#define ZE_PATHS_MAX_RANK 128

enum ze_paths_dtype { ZE_PATHS_F16 = 1, ZE_PATHS_BF16 = 2 };
enum ze_paths_error {
    ZE_PATHS_OK = 0,
    ZE_PATHS_ERR_ARG = -1,   /* null pointer */
    ZE_PATHS_ERR_DTYPE = -2, /* neither ZE_PATHS_F16 nor ZE_PATHS_BF16 */
    ZE_PATHS_ERR_SHAPE = -3, /* B, D, F or R outside the limits above */
    ZE_PATHS_ERR_ALIGN = -4  /* a tensor not 16-byte aligned */
};

ZE_PATHS_API size_t ze_paths_work_bytes(int B, int D, int F);

ZE_PATHS_API int ze_paths_ffn(int dtype, const void* x, const void* z, const void* bg,
                              const void* bu, const void* wg, const void* wu, const void* wd_t,
                              void* y, float thr, int B, int D, int F, int R, void* work,
                              int work_is_zero, void* stream);

ZE_PATHS_API int ze_paths_ffn_magnitude(int dtype, const void* x, const void* w13_t,
                                        const void* wd_t, void* y, float thr_in, float thr, int B,
                                        int D, int F, void* work, int work_is_zero, void* stream);

/* Tuning (0 keeps a value): channels per block of the predictor gate/up step, channels per block
 * of the down step (both rules), input rows per block of the magnitude gate/up step. */
ZE_PATHS_API void ze_paths_set_config(int pred_chunk, int down_chunk, int gateup_rows);

#ifdef __cplusplus
}
#endif
#endif
