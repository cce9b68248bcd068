// Thermal KV's page scores from the int4 key sketch (include/zeroedge_thermal.h) on integer tensor cores.
//
// A warp scores pages with mma m16n8k32 (rank 16: m16n8k16), s8 x u8 -> s32: B is one 8-token tile of
// a page's codes as stored (0..15, the +8 offset kept; at rank >= 32 two instructions unpack a lane's
// 4 code bytes to 8 bytes); A is the query in integers. Each query head's row is scaled so its largest
// |value| is 127 * 2^16 steps and split into three signed bytes (hi, mid, lo), ~23 bits: one product
// holds hi (row g) and mid (row g + 8) of the row's query head, a second one lo, and the accumulators
// start at -8 * (the row's digit sum), which removes the code offset exactly. A lane then holds its two
// tokens of the tile: hi * 2^16 + mid * 2^8 + lo, exact in int32, then rounded to float (twice at
// most). Lane (g = lane / 4, t = lane % 4) loads bytes CB t .. CB t + CB - 1 of token g's codes (CB =
// rank / 8), so the k index of a product is remapped to the directions those bytes hold, on both
// sides. With more than 4 query heads a kv head, row g is query head g and a step scores one page;
// with <= 4, rows g and g + 4 are query head g % 4 for two pages (each page's A is zero in the other's
// rows, so the two chain into one accumulator) and a step scores two. The quad of a row (its 4 lanes)
// sums the page's exponentials with two shuffles, in base 2 until the store, against a reference it
// keeps for its share (the largest page maximum so far), so a page needs no maximum of its own while its
// values stay near it; the share's (reference, sum) pair is what pm / psum receive. The tf32 kernel this
// replaced converted each code to a float and discarded half of each product with <= 4 query heads: 295
// instructions for 4 pages against 187, 166 with the reference (benchmarks/thermal_kv.md).
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <float.h>
#include <stdint.h>

#include "zeroedge_thermal.h"

namespace {

#ifndef ZE_SKETCH_WARPS
#define ZE_SKETCH_WARPS 4
#endif
#ifndef ZE_SKETCH_PAGES
#define ZE_SKETCH_PAGES 4
#endif
constexpr int kWarps = ZE_SKETCH_WARPS;   // warps a block (one share)
constexpr int kPages = ZE_SKETCH_PAGES;   // pages a warp loads before it computes
constexpr int kQMax = 127 * 65536;        // a row's largest |query| in steps: three signed-byte digits
constexpr float kLn2 = 0.69314718055994531f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kAbove = 16.0f, kBelow = 32.0f;   // base 2: the fast path's window around a quad's reference

// d = a (16 x 32 s8, row) . b (32 x 8 u8, col) + c: a = {rows 0-7 k 0-15, rows 8-15 k 0-15, rows 0-7
// k 16-31, rows 8-15 k 16-31} (a lane's 4 bytes each), b = {k 0-15, k 16-31}
__device__ __forceinline__ void mma_k32(int (&d)[4], const uint32_t* a, const uint32_t* b, const int* c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c[0]), "r"(c[1]), "r"(c[2]),
          "r"(c[3]));
#else
    __trap();   // built for an older architecture (e.g. its PTX run on a newer GPU): fail, never score 0
#endif
}

// the same with k = 16: a = {rows 0-7, rows 8-15}, b = {k 0-15}
__device__ __forceinline__ void mma_k16(int (&d)[4], const uint32_t* a, const uint32_t* b, const int* c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(b[0]), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]));
#else
    __trap();
#endif
}

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float lg2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// NB bytes at p (NB-aligned) into words
template <int NB> __device__ __forceinline__ void load_bytes(const unsigned char* p, uint32_t* w) {
    if constexpr (NB == 2) {
        w[0] = __ldg(reinterpret_cast<const unsigned short*>(p));
    } else if constexpr (NB == 4) {
        w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
    } else {
        static_assert(NB == 8, "2, 4 or 8 bytes a lane");
        uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
        w[0] = v.x;
        w[1] = v.y;
    }
}

// half i (0 or 1) of a word as fp32
__device__ __forceinline__ float half_at(uint32_t w, int i) {
    return __half2float(__ushort_as_half((unsigned short)(w >> (16 * i))));
}

// (max, sum) of base-2 exponentials merged
__device__ __forceinline__ void lse2_merge(float& m, float& s, float m2, float s2) {
    float mx = fmaxf(m, m2);
    if (mx == -INFINITY) return;
    s = s * ex2(m - mx) + s2 * ex2(m2 - mx);
    m = mx;
}

// The direction of a lane's query element e (0 .. R/4 - 1), the order its code bytes unpack to: for
// rank >= 32 word e / 4 of the unpacked codes is k-step e / 8, low (even e / 4) or high nibbles, of the
// lane's bytes CB t + 4 (e / 8) + (e % 4); for rank 16 one word, bytes (0, 2, 1, 3) of a lane's 4 directions
template <int R> __device__ __forceinline__ int lane_dim(int t, int e) {
    if constexpr (R == 16) return 4 * t + 2 * (e & 1) + (e >> 1);
    return 2 * ((R / 8) * t + 4 * (e / 8) + (e % 4)) + ((e / 4) & 1);
}

// R: rank; PS: page size; HP: rows a query digit set takes (4: two pages a step, 8: one)
template <int R, int PS, int HP>
__global__ void __launch_bounds__(32 * kWarps)
sketch_lse_kernel(const float* __restrict__ qr, const unsigned char* __restrict__ codes,
                  const __half* __restrict__ scales, float* __restrict__ out, float* __restrict__ pm,
                  float* __restrict__ psum, int grp, int n, int nb, int pps) {
    constexpr int PP = 8 / HP;                 // pages a step
    constexpr int T = PS / 8;                  // 8-token tiles a page
    constexpr int CB = R / 8;                  // code bytes a lane owns of a token
    constexpr int CW = (CB + 3) / 4;           // their words
    constexpr int KS = R == 16 ? 1 : R / 32;   // k-steps
    constexpr int NQ = R / 4;                  // query elements a lane owns
    constexpr int AW = NQ / 4;                 // their words a digit
    static_assert(kPages % PP == 0, "whole steps");
    const int h = blockIdx.y, c = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;     // row and position in the quad
    const int head = g % HP, slot = g / HP;    // the lane's query head, and its page of a step
    const bool real = head < grp;
    const int first = c * pps, last = min(n, first + pps);
    const size_t P = (size_t)n * PS;

    // the query in integers: the head's row over the quad's directions, its scale, three digits
    float x[NQ];
    float amax = 0.0f;
    int bad = 0;
#pragma unroll
    for (int e = 0; e < NQ; ++e) {
        x[e] = real ? qr[((size_t)h * grp + head) * R + lane_dim<R>(t, e)] : 0.0f;
        amax = fmaxf(amax, fabsf(x[e]));
        bad |= !isfinite(x[e]);
    }
#pragma unroll
    for (int off = 1; off < 4; off *= 2) {
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
        bad |= __shfl_xor_sync(0xFFFFFFFFu, bad, off);
    }
    // steps a unit; a row below kQMax / FLT_MAX (~2e-32) takes fewer steps rather than an infinite scale
    const float inv = amax > 0.0f ? fminf((float)kQMax / amax, FLT_MAX) : 0.0f;
    const float coef = bad ? __int_as_float(0x7FC00000) : inv > 0.0f ? kLog2e / inv : 0.0f;   // a step, in base 2
    uint32_t hi[AW] = {}, mid[AW] = {}, lo[AW] = {};
    int shi = 0, smid = 0, slo = 0;
#pragma unroll
    for (int e = 0; e < NQ; ++e) {
        const int q = bad ? 0 : __float2int_rn(x[e] * inv);
        const int d0 = (q << 24) >> 24, r = (q - d0) >> 8;
        const int d1 = (r << 24) >> 24, d2 = (r - d1) >> 8;
        hi[e / 4] |= (uint32_t)(d2 & 0xFF) << (8 * (e % 4));
        mid[e / 4] |= (uint32_t)(d1 & 0xFF) << (8 * (e % 4));
        lo[e / 4] |= (uint32_t)(d0 & 0xFF) << (8 * (e % 4));
        shi += d2, smid += d1, slo += d0;
    }
#pragma unroll
    for (int off = 1; off < 4; off *= 2) {
        shi += __shfl_xor_sync(0xFFFFFFFFu, shi, off);
        smid += __shfl_xor_sync(0xFFFFFFFFu, smid, off);
        slo += __shfl_xor_sync(0xFFFFFFFFu, slo, off);
    }
    // A of the two products of page j of a step, k-step s: {hi, mid} and {lo, 0}, nonzero in the lanes
    // whose page it is (so a step's pages chain into one accumulator); the accumulators start at -8 x
    // the digit sums, which removes the codes' +8
    uint32_t a1[PP][KS][4], a2[PP][KS][4];
#pragma unroll
    for (int j = 0; j < PP; ++j) {
        const uint32_t on = slot == j ? 0xFFFFFFFFu : 0u;
#pragma unroll
        for (int s = 0; s < KS; ++s) {
            if constexpr (R == 16) {
                a1[j][s][0] = hi[0] & on, a1[j][s][1] = mid[0] & on, a2[j][s][0] = lo[0] & on, a2[j][s][1] = 0u;
            } else {
                a1[j][s][0] = hi[2 * s] & on, a1[j][s][1] = mid[2 * s] & on;
                a1[j][s][2] = hi[2 * s + 1] & on, a1[j][s][3] = mid[2 * s + 1] & on;
                a2[j][s][0] = lo[2 * s] & on, a2[j][s][1] = 0u, a2[j][s][2] = lo[2 * s + 1] & on, a2[j][s][3] = 0u;
            }
        }
    }
    const int c1[4] = {-8 * shi, -8 * shi, -8 * smid, -8 * smid}, c2[4] = {-8 * slo, -8 * slo, 0, 0};

    const unsigned char* cbase = codes + ((size_t)h * P + g) * (R / 2) + t * CB;   // token g of a tile
    const __half* sbase = scales + (size_t)h * P + 2 * t;                            // tokens 2t, 2t + 1
    // the share so far: the sum of 2^(page lse - ref) over its pages, and the window of the fast path
    float ref = -INFINITY, run_s = 0.0f, lo_b = INFINITY, hi_b = -INFINITY;
    for (int p0 = first + warp * kPages; p0 < last; p0 += kWarps * kPages) {
        uint32_t w[kPages][T][CW], sc[kPages / PP][T];
#pragma unroll
        for (int i = 0; i < kPages; ++i) {
            const int p = p0 + i;
#pragma unroll
            for (int tt = 0; tt < T; ++tt) {
                if (p < last) {
                    load_bytes<CB>(cbase + ((size_t)p * PS + tt * 8) * (R / 2), w[i][tt]);
                } else {
#pragma unroll
                    for (int k = 0; k < CW; ++k) w[i][tt][k] = 0u;
                }
            }
        }
#pragma unroll
        for (int i = 0; i < kPages / PP; ++i) {
            const int p = p0 + i * PP + slot;   // the lane's page
#pragma unroll
            for (int tt = 0; tt < T; ++tt)
                sc[i][tt] = p < last ? __ldg(reinterpret_cast<const unsigned int*>(sbase + (size_t)p * PS + tt * 8)) : 0u;
        }
#pragma unroll
        for (int i = 0; i < kPages / PP; ++i) {
            const int p = p0 + i * PP + slot;
            if (p0 + i * PP >= last) break;   // the same for the whole warp
            float v[2 * T];
#pragma unroll
            for (int tt = 0; tt < T; ++tt) {
                int d1[4], d2[4];
#pragma unroll
                for (int j = 0; j < PP; ++j) {
                    const uint32_t* wj = w[i * PP + j][tt];
#pragma unroll
                    for (int s = 0; s < KS; ++s) {
                        uint32_t b[2];
                        if constexpr (R == 16) {
                            b[0] = (wj[0] & 0x0F0Fu) | ((wj[0] & 0xF0F0u) << 12);
                            b[1] = 0u;
                        } else {
                            b[0] = wj[s] & 0x0F0F0F0Fu;
                            b[1] = (wj[s] >> 4) & 0x0F0F0F0Fu;
                        }
                        const bool fresh = j == 0 && s == 0;
                        if constexpr (R == 16) {
                            mma_k16(d1, a1[j][s], b, fresh ? c1 : d1);
                            mma_k16(d2, a2[j][s], b, fresh ? c2 : d2);
                        } else {
                            mma_k32(d1, a1[j][s], b, fresh ? c1 : d1);
                            mma_k32(d2, a2[j][s], b, fresh ? c2 : d2);
                        }
                    }
                }
                // the lane's tokens 2t, 2t + 1 of the tile: hi * 2^16 + mid * 2^8 + lo, times the token's scale
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float f = __int2float_rn(d1[e]) * 65536.0f + __int2float_rn(d1[2 + e] * 256 + d2[e]);
                    v[2 * tt + e] = f * (coef * half_at(sc[i][tt], e));
                }
            }
            // the page's log-sum-exp (base 2) against the quad's reference `ref`, the largest page maximum
            // its share has taken: while every lane's values lie within [ref - kBelow, ref + kAbove], no
            // exponential over- or underflows, so the page needs no maximum of its own (no shuffles) and
            // the share's sum takes it with one add. Otherwise (a quad's first page, a page far above or
            // below, a page whose maximum is not finite) the warp takes each page's maximum, as the kernel did before,
            // and raises ref to it (the share's sum rescaled)
            const bool counts = real && p < last;   // the same for the quad (one head, one page)
            float lm = v[0];
#pragma unroll
            for (int k = 1; k < 2 * T; ++k) lm = fmaxf(lm, v[k]);
            const bool fast = __all_sync(0xFFFFFFFFu, !counts || (lm <= hi_b && lm >= lo_b));
            float pr = ref, wgt = 1.0f;
            if (!fast) {   // the same for the whole warp
                pr = fmaxf(lm, __shfl_xor_sync(0xFFFFFFFFu, lm, 1));
                pr = fmaxf(pr, __shfl_xor_sync(0xFFFFFFFFu, pr, 2));
                if (counts && isfinite(pr) && pr > ref) {
                    run_s *= ex2(ref - pr);   // 0 while ref is -inf
                    ref = pr;
                    lo_b = ref - kBelow, hi_b = ref + kAbove;
                }
                wgt = isfinite(pr) ? ex2(pr - ref) : 0.0f;   // a page without a finite maximum: not counted
            }
            float sum = 0.0f;
#pragma unroll
            for (int k = 0; k < 2 * T; ++k) sum += ex2(v[k] - pr);
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
            if (counts) {
                if (t == 0) out[((size_t)h * grp + head) * n + p] = (pr + lg2(sum)) * kLn2;
                if (wgt != 0.0f) run_s = fmaf(sum, wgt, run_s);
            }
        }
    }
    if (pm == nullptr) return;
    // the block's share: a quad holds its head's log-sum-exps of its pages; with two pages a step the
    // quads of rows g and g + 4 hold the same head's
    float run_m = run_s > 0.0f ? ref : -INFINITY;
    if constexpr (PP == 2) {
        const float m2 = __shfl_xor_sync(0xFFFFFFFFu, run_m, 16), s2 = __shfl_xor_sync(0xFFFFFFFFu, run_s, 16);
        lse2_merge(run_m, run_s, m2, s2);
    }
    __shared__ float sm[kWarps][8], ss[kWarps][8];
    if (t == 0 && slot == 0) {
        sm[warp][head] = run_m;
        ss[warp][head] = run_s;
    }
    __syncthreads();
    if (threadIdx.x < grp) {
        const int gg = threadIdx.x;
        float bm = sm[0][gg], bs = ss[0][gg];
        for (int k = 1; k < kWarps; ++k) lse2_merge(bm, bs, sm[k][gg], ss[k][gg]);
        pm[((size_t)h * grp + gg) * nb + c] = bm * kLn2;
        psum[((size_t)h * grp + gg) * nb + c] = bs;
    }
}

template <int R, int PS>
cudaError_t launch_rank_page(const float* qr, const unsigned char* codes, const __half* scales, float* out,
                             float* pm, float* psum, int nkv, int grp, int n, int nb, int pps, cudaStream_t s) {
    dim3 grid(nb, nkv), block(32 * kWarps);
    if (grp <= 4)
        sketch_lse_kernel<R, PS, 4><<<grid, block, 0, s>>>(qr, codes, scales, out, pm, psum, grp, n, nb, pps);
    else
        sketch_lse_kernel<R, PS, 8><<<grid, block, 0, s>>>(qr, codes, scales, out, pm, psum, grp, n, nb, pps);
    return cudaGetLastError();
}

template <int R>
cudaError_t launch_rank(const float* qr, const unsigned char* codes, const __half* scales, float* out, float* pm,
                        float* psum, int nkv, int grp, int n, int ps, int nb, int pps, cudaStream_t s) {
    if (ps == 8) return launch_rank_page<R, 8>(qr, codes, scales, out, pm, psum, nkv, grp, n, nb, pps, s);
    return launch_rank_page<R, 16>(qr, codes, scales, out, pm, psum, nkv, grp, n, nb, pps, s);
}

}  // namespace

extern "C" int ze_thermal_sketch_lse(const float* qr, const unsigned char* codes, const void* scales, float* out,
                                     float* pm, float* psum, int nkv, int grp, int n, int page_size, int rank,
                                     int nb, int pages_per_share, void* stream) {
    if (!qr || !codes || !scales || !out || (pm == nullptr) != (psum == nullptr)) return ZE_THERMAL_ERR_ARG;
    if ((rank != 16 && rank != 32 && rank != 64) || (page_size != 8 && page_size != 16) || grp < 1 || grp > 8 ||
        nkv < 1 || nkv > 65535 || n < 1 || pages_per_share < 1 || nb != (n + pages_per_share - 1) / pages_per_share)
        return ZE_THERMAL_ERR_SHAPE;
    if (reinterpret_cast<uintptr_t>(codes) % 8 || reinterpret_cast<uintptr_t>(scales) % 4)
        return ZE_THERMAL_ERR_ALIGN;
    int dev = 0, major = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (e != cudaSuccess) return e;
    if (major < 8) return ZE_THERMAL_ERR_ARCH;
    const __half* sc = static_cast<const __half*>(scales);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (rank == 16) e = launch_rank<16>(qr, codes, sc, out, pm, psum, nkv, grp, n, page_size, nb, pages_per_share, s);
    else if (rank == 32) e = launch_rank<32>(qr, codes, sc, out, pm, psum, nkv, grp, n, page_size, nb, pages_per_share, s);
    else e = launch_rank<64>(qr, codes, sc, out, pm, psum, nkv, grp, n, page_size, nb, pages_per_share, s);
    return e;
}
