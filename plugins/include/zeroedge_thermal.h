/* zeroedge thermal KV: every prefix page's score from the int4 key sketch, on tensor cores.
 * Plain C API, no TensorRT headers, the launcher style of zeroedge_kernels.h: 0 = ok, a negative
 * ZE_THERMAL_ERR_* for bad arguments (nothing launched), a positive cudaError_t otherwise.
 *
 * For kv head h, query head g of its group and page p, out[h, g, p] is the log-sum-exp over the
 * page's tokens t of (qr[h, g] . code[h, t]) * scale[h, t] (zeroedge.kv.kernels.sketch_page_lse).
 * Layouts (row-major, contiguous):
 *   qr     [nkv, grp, rank] fp32      the queries in the sketch's basis (already / sqrt(head dim))
 *   codes  [nkv, n * page_size, rank / 2] uint8: two signed 4-bit codes a byte, +8 offset, the low
 *          nibble the even direction
 *   scales [nkv, n * page_size] fp16  one scale a token
 *   out    [nkv, grp, n] fp32
 * pm, psum (both or neither): [nkv, grp, nb] fp32 with nb = ceil(n / pages_per_share). Share c of
 *   query head g is its log-sum-exp over pages c * pages_per_share .. + pages_per_share - 1, as
 *   a reference pm and the sum psum of exp(out - pm): the share's log-sum-exp is pm + ln(psum), pm at
 *   most that (pm = -inf and psum = 0 for a share of no page).
 * The products run on integer tensor cores: each query head's row scaled to 127 * 2^16 steps at its
 * largest |value| and split into three signed-byte digits (about 23 bits), codes exact, sums exact in
 * int32, then rounded to float. A query row holding NaN or inf scores NaN pages, and its shares count
 * no page (pm = -inf, psum = 0).
 * Limits: rank 16, 32 or 64; page_size 8 or 16; 1 <= grp <= 8; compute capability 8.0 or newer;
 * codes 8-byte and scales 4-byte aligned.
 */
#ifndef ZEROEDGE_THERMAL_H
#define ZEROEDGE_THERMAL_H

#ifdef __cplusplus
extern "C" {
#endif

#define ZE_THERMAL_API __attribute__((visibility("default")))

enum ze_thermal_error {
    ZE_THERMAL_OK = 0,
    ZE_THERMAL_ERR_ARG = -1,   /* null pointer, or only one of pm / psum */
    ZE_THERMAL_ERR_SHAPE = -2, /* rank, page_size, grp, n, nb or pages_per_share outside the limits */
    ZE_THERMAL_ERR_ALIGN = -3, /* codes or scales misaligned */
    ZE_THERMAL_ERR_ARCH = -4   /* the current device is older than compute capability 8.0 */
};

ZE_THERMAL_API int ze_thermal_sketch_lse(const float* qr, const unsigned char* codes, const void* scales,
                                         float* out, float* pm, float* psum, int nkv, int grp, int n,
                                         int page_size, int rank, int nb, int pages_per_share, void* stream);

#ifdef __cplusplus
}
#endif

#endif
