/* zeroedge CUDA kernels: a plain C API with no TensorRT headers.
 *
 * The TensorRT glue (src/plugin.cpp) calls these launchers from IPluginV3OneRuntime::enqueue; the
 * device tests call the same launchers through ctypes (libzeroedge_kernels.so). Semantics are those
 * of zeroedge/plugin_spec.py; the PyTorch reference is zeroedge/backends/plugin_reference.py.
 *
 * Layouts (row-major, contiguous):
 *   x [T, D]; SIH head: w1 [W, D], b1 [W], w2 [W, W], b2 [W], w3 [W, W], b3 [W], w4 [1, W], b4 [1]
 *   anchor: a [R, D], b [D, R], c [D]  (R = anchor_rank; 0 = plain skipping, a/b/c are not read)
 *   keep int32 [T] (1 = compute the FFN), base [T, D]; gather: xs [K, D], idx int32 [K], count int32
 * Every float tensor of one call has the same dtype (ZE_F32 or ZE_F16); arithmetic is fp32.
 * Every launcher returns 0 on success, a negative ZE_ERR_* for bad arguments (nothing launched), or
 * a positive cudaError_t value.
 */
#ifndef ZEROEDGE_KERNELS_H
#define ZEROEDGE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* default visibility even when compiled with -fvisibility=hidden; the plugin library's version
 * script (exports.map) still hides these, libzeroedge_kernels.so (kernels.map) exports them */
#define ZE_API __attribute__((visibility("default")))

#define ZE_PLUGIN_ABI 2 /* must equal zeroedge.plugin_spec.PLUGIN_ABI */

#define ZE_MAX_SIH_WIDTH 32 /* W: width of the SIH head's hidden layers */
#define ZE_MAX_ANCHOR_RANK 64
#define ZE_HIDDEN_MULTIPLE 8 /* D must be a multiple of this (16-byte vector rows in fp16) */

enum ze_dtype { ZE_F32 = 0, ZE_F16 = 1 };

enum ze_error {
    ZE_OK = 0,
    ZE_ERR_ARG = -1,       /* null pointer or negative size */
    ZE_ERR_DTYPE = -2,     /* dtype is neither ZE_F32 nor ZE_F16 */
    ZE_ERR_SHAPE = -3,     /* a size the kernels do not support (see ze_strerror) */
    ZE_ERR_ALIGN = -4,     /* a pointer not aligned to 16 bytes */
};

typedef struct ze_sih_params {
    float threshold;       /* threshold rule: keep a token when its smoothed score >= threshold */
    float ma_w0, ma_w1, ma_w2; /* weights of positions t, t-1, t-2 (renormalised at the start) */
    int32_t min_tokens;    /* T < min_tokens: keep every token */
    int32_t protect_first; /* positions [0, protect_first) always kept */
    int32_t protect_last;  /* positions [T - protect_last, T) always kept */
    int32_t block_size;    /* 0: token-granular; N: the block rule on N-token blocks */
    float block_frac;      /* a block skips when more than this fraction of it is low */
    int32_t anchor_rank;   /* R */
    float rate;            /* < 0: the threshold rule; in [0, 1]: the rank rule (zeroedge.plugin_spec): in
                              each rank_block block of positions (counted from position 0), the
                              floor(rate * n + 0.5) lowest-scored of its n skippable positions skip, ties
                              to the earlier position; threshold and block_size unused */
    int32_t rank_block;    /* the rank rule's blocks (a chunk starts on one) */
} ze_sih_params;

typedef struct ze_sih_weights {
    const void *w1, *b1, *w2, *b2, *w3, *b3, *w4, *b4, *anchor_a, *anchor_b, *anchor_c;
} ze_sih_weights;

ZE_API const char* ze_strerror(int code);
ZE_API int ze_kernels_abi(void);

/* SIH: scores every token with the head, smooths, decides (threshold rule, block rule or rank rule,
 * protections, min_tokens bypass) into keep, and writes base = keep ? 0 : anchor_b @ (anchor_a @ x) + anchor_c.
 * scores_out (optional, may be NULL): the raw sigmoid scores, float32 [T]. */
ZE_API size_t ze_sih_workspace_size(int64_t T, int64_t D, int32_t W, int32_t R, int dtype);
ZE_API int ze_sih_forward(int dtype, const void* x, int64_t T, int64_t D, int32_t W, const ze_sih_weights* w,
    const ze_sih_params* p, int32_t* keep, void* base, float* scores_out, void* workspace, size_t workspace_bytes,
    void* stream);

/* SIH for one chunk of a prompt (ZeroEdgeSIHChunk): the T rows are positions span[0].. of a prompt of
 * span[1] tokens; carry [2] holds the raw scores of positions span[0]-2, span[0]-1 (read only where
 * those exist). Protections and min_tokens take absolute positions and the prompt's length; block-rule
 * blocks are counted from the chunk's first row and rank-rule blocks from position 0 (a chunk starts on
 * a block boundary of either). carry_out [2]:
 * the raw scores of the chunk's last two positions (from carry where T < 2). span, carry and carry_out
 * are device memory, read and written by the kernels (no host synchronisation). */
ZE_API int ze_sih_chunk_forward(int dtype, const void* x, int64_t T, int64_t D, int32_t W, const ze_sih_weights* w,
    const ze_sih_params* p, const float* carry, const int32_t* span, int32_t* keep, void* base, float* carry_out,
    float* scores_out, void* workspace, size_t workspace_bytes, void* stream);

/* PAD gather: idx[k] = k-th position with keep != 0 (ascending), count = K, xs[k] = x[idx[k]].
 * xs and idx must have room for T rows; rows >= K are not written. */
ZE_API size_t ze_pad_gather_workspace_size(int64_t T);
ZE_API int ze_pad_gather(int dtype, const void* x, const int32_t* keep, int64_t T, int64_t D, void* xs, int32_t* idx,
    int32_t* count, void* workspace, size_t workspace_bytes, void* stream);

/* PAD scatter: out = base; out[idx[k]] = y[k] for k < K. idx entries outside [0, T) are ignored. */
ZE_API size_t ze_pad_scatter_workspace_size(int64_t T);
ZE_API int ze_pad_scatter(int dtype, const void* base, const void* y, const int32_t* idx, int64_t T, int64_t K, int64_t D,
    void* out, void* workspace, size_t workspace_bytes, void* stream);

/* Benchmarks only: bit 0 forces the generic (CUDA-core) SIH projection for fp16, bit 1 the
 * unstaged tensor-core one; bits 8..11 = N > 0 stop ze_sih_forward after stage N (1 prep,
 * 2 projection, 3 decide). 0 (the default) is what the plugins run. Not thread-safe. */
ZE_API void ze_sih_set_variant(int variant);

#ifdef __cplusplus
}
#endif
#endif
