/* zeroedge decode paths: gather-GEMV of the predicted FFN channels (issue 5). Plain C API, no
 * TensorRT headers, same launcher style as zeroedge_kernels.h (0 = ok, negative ZE_PATHS_ERR_*
 * for bad arguments with nothing launched, positive = cudaError_t).
 *
 * Layouts (row-major, contiguous, one dtype for every half tensor: fp16; arithmetic fp32):
 *   x [B, D]; z [B, R] (= x @ A, computed by the caller); bg, bu [F, R] (channel-major: the
 *   predictor's Bg^T and (Bu * ||W_down[:, j]||)^T); wg, wu [F, D] (rows of W_gate / W_up); act [B, F]; wd_t [F, D] (= W_down^T);
 *   y [B, D].
 * ze_paths_gateup: channel j is live when max_b |silu(z_b.bg[j]) * (z_b.bu[j])| >= threshold;
 *   live: act[:, j] = silu(x wg[j]) * (x wu[j]); else act[:, j] = 0 and rows j are never read.
 * ze_paths_down: y = act @ wd_t, reading only rows j of wd_t whose act column is nonzero;
 *   `work` is caller scratch of ze_paths_down_work_bytes(B, D) bytes.
 * Limits: 1 <= B <= ZE_PATHS_MAX_BATCH, R <= ZE_PATHS_MAX_RANK, D % 256 == 0.
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

enum ze_paths_error { ZE_PATHS_OK = 0, ZE_PATHS_ERR_ARG = -1, ZE_PATHS_ERR_SHAPE = -3 };

ZE_PATHS_API int ze_paths_gateup(const void* x, const void* z, const void* bg, const void* bu,
                                 const void* wg, const void* wu, void* act, float threshold,
                                 int B, int D, int F, int R, void* stream);
ZE_PATHS_API size_t ze_paths_down_work_bytes(int B, int D);
ZE_PATHS_API int ze_paths_down(const void* act, const void* wd_t, void* y, void* work, int B,
                               int D, int F, void* stream);

#ifdef __cplusplus
}
#endif
#endif
