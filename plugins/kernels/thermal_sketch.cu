// Thermal KV's page scores from the int4 key sketch (include/zeroedge_thermal.h) on tensor cores.
//
// A warp scores a unit of 8 / HP pages with mma.m16n8k8 (tf32): A (16 x 8) is the query side of
// one k-step, rows 0..7 the high tf32 part of (query head, page) pairs and rows 8..15 the low part
// (qr split so that the pair keeps ~21 bits; the same for every page, made once); B (8 x 8) is the
// codes of one 8-token tile of a page, exact; each token's score is then times its scale. Lane (r = lane / 4, m = lane % 4) loads only its own bytes of a
// token (m * rank / 8 .. ), so the k index of a product is remapped to the dimensions those bytes
// hold, on both sides. C row r then holds the high part and row r + 8 the low part of query head
// r % HP of page r / HP, in the lane that owns both; the lanes of a quad hold a page's 8 tokens (2
// each) and reduce its log-sum-exp with two shuffles. With HP = 4 (groups of <= 4 query heads) one
// A operand serves two pages, and a product for the other page's rows is computed and discarded.
// The sketch kernel in Triton (zeroedge/kv/kernels.py) spends its issue slots unpacking and
// multiplying on CUDA cores (benchmarks/thermal_kv.md 2o); here the multiply is on tensor cores.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "zeroedge_thermal.h"

namespace {

#ifndef ZE_SKETCH_WARPS
#define ZE_SKETCH_WARPS 4
#endif
#ifndef ZE_SKETCH_UNITS
#define ZE_SKETCH_UNITS 2
#endif
constexpr int kWarps = ZE_SKETCH_WARPS;   // warps a block (one share)
constexpr int kUnits = ZE_SKETCH_UNITS;   // units a warp loads before it computes

__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();   // built for an older architecture (e.g. its PTX run on a newer GPU): fail, never score 0
#endif
}

// a 4-bit code stored with +8 offset -> the exact float (code - 8): the bits of 2^23 + nibble
__device__ __forceinline__ uint32_t nibble_f32(uint32_t nib) {
    return __float_as_uint(__uint_as_float(0x4B000000u | nib) - 8388616.0f);
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

__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
    float mx = fmaxf(m, m2);
    if (mx == -INFINITY) return;
    s = s * __expf(m - mx) + s2 * __expf(m2 - mx);
    m = mx;
}

// R: rank; PS: page size; HP: query-head rows a page takes in A (4: two pages a unit, 8: one)
template <int R, int PS, int HP>
__global__ void __launch_bounds__(32 * kWarps)
sketch_lse_kernel(const float* __restrict__ qr, const unsigned char* __restrict__ codes,
                  const __half* __restrict__ scales, float* __restrict__ out, float* __restrict__ pm,
                  float* __restrict__ psum, int grp, int n, int nb, int pps) {
    constexpr int PP = 8 / HP;   // pages a unit
    constexpr int T = PS / 8;    // 8-token tiles a page
    constexpr int KS = R / 8;    // k-steps
    constexpr int D = R / 4;     // dimensions a lane owns
    constexpr int CB = R / 8;    // code bytes a lane owns of a token
    constexpr int CW = (CB + 3) / 4;
    const int h = blockIdx.y, c = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = lane >> 2, m = lane & 3;
    const int g = r % HP, pa = r / HP;
    const int first = c * pps, last = min(n, first + pps);
    const int units = (last - first + PP - 1) / PP;
    const size_t P = (size_t)n * PS;

    // the query side of every k-step: the lane's dimensions 2s + e (e: the low or high nibble of its
    // byte s) as a high and a low tf32 part
    uint32_t a[KS][4];
#pragma unroll
    for (int s = 0; s < KS; ++s) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float x = g < grp ? qr[((size_t)h * grp + g) * R + m * D + 2 * s + e] : 0.0f;
            uint32_t hi = __float_as_uint(x) & 0xFFFFE000u;
            a[s][2 * e] = hi;
            a[s][2 * e + 1] = __float_as_uint(x - __uint_as_float(hi));
        }
    }
    const unsigned char* cbase = codes + (size_t)h * P * (R / 2) + m * CB;
    const __half* sbase = scales + (size_t)h * P + 2 * m;   // this lane's tokens 2m, 2m + 1 of a tile

    float run_m = -INFINITY, run_s = 0.0f;
    // kUnits units a warp at a time: every load of them issued before the first product
    for (int u0 = warp; u0 < units; u0 += kWarps * kUnits) {
        uint32_t sc[kUnits][T];   // the scales of this lane's two tokens of each tile of its page, fp16 pairs
        uint32_t w[kUnits][PP][T][CW];
#pragma unroll
        for (int i = 0; i < kUnits; ++i) {
            const int p0 = first + (u0 + i * kWarps) * PP;
            const int p = p0 + pa;
#pragma unroll
            for (int t = 0; t < T; ++t)
                sc[i][t] = p < last ? __ldg(reinterpret_cast<const unsigned int*>(sbase + (size_t)p * PS + t * 8)) : 0u;
#pragma unroll
            for (int pp = 0; pp < PP; ++pp)
#pragma unroll
                for (int t = 0; t < T; ++t) {
                    if (p0 + pp < last) {
                        load_bytes<CB>(cbase + ((size_t)(p0 + pp) * PS + t * 8 + r) * (R / 2), w[i][pp][t]);
                    } else {
#pragma unroll
                        for (int k = 0; k < CW; ++k) w[i][pp][t][k] = 0x88888888u;   // codes 0
                    }
                }
        }
#pragma unroll
        for (int i = 0; i < kUnits; ++i) {
            const int p0 = first + (u0 + i * kWarps) * PP;
            if (p0 >= last) break;   // the same for the whole warp
            const int p = p0 + pa;   // this lane's page in the result
            float acc[T][4];
#pragma unroll
            for (int t = 0; t < T; ++t) {
                float part[PP][4];
#pragma unroll
                for (int pp = 0; pp < PP; ++pp) {
#pragma unroll
                    for (int k = 0; k < 4; ++k) part[pp][k] = 0.0f;
#pragma unroll
                    for (int s = 0; s < KS; ++s) {
                        uint32_t byte = (w[i][pp][t][s / 4] >> (8 * (s % 4))) & 0xFFu;
                        mma_tf32(part[pp], a[s], nibble_f32(byte & 15u), nibble_f32(byte >> 4));
                    }
                }
#pragma unroll
                for (int k = 0; k < 4; ++k) acc[t][k] = (PP == 1 || pa == 0) ? part[0][k] : part[PP - 1][k];
            }
            // this lane's tokens: 2m, 2m + 1 of every tile; high + low part, times the token's scale
            float v[2 * T];
            float mx = -INFINITY;
#pragma unroll
            for (int t = 0; t < T; ++t) {
                v[2 * t] = (acc[t][0] + acc[t][2]) * half_at(sc[i][t], 0);
                v[2 * t + 1] = (acc[t][1] + acc[t][3]) * half_at(sc[i][t], 1);
                mx = fmaxf(mx, fmaxf(v[2 * t], v[2 * t + 1]));
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
            float sum = 0.0f;
#pragma unroll
            for (int k = 0; k < 2 * T; ++k) sum += __expf(v[k] - mx);
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
            const float l = mx + __logf(sum);
            if (p < last && g < grp) {
                if (m == 0) out[((size_t)h * grp + g) * n + p] = l;
                lse_merge(run_m, run_s, l, 1.0f);
            }
        }
    }
    if (pm == nullptr) return;
    // the block's share: lanes of one query head (rows g, g + HP, ... of every warp) merged
#pragma unroll
    for (int off = 4 * HP; off < 32; off *= 2) {
        float m2 = __shfl_xor_sync(0xFFFFFFFFu, run_m, off);
        float s2 = __shfl_xor_sync(0xFFFFFFFFu, run_s, off);
        lse_merge(run_m, run_s, m2, s2);
    }
    __shared__ float sm[kWarps][8], ss[kWarps][8];
    if (m == 0 && r < HP) {
        sm[warp][g] = run_m;
        ss[warp][g] = run_s;
    }
    __syncthreads();
    if (threadIdx.x < grp) {
        const int gg = threadIdx.x;
        float bm = sm[0][gg], bs = ss[0][gg];
        for (int w = 1; w < kWarps; ++w) lse_merge(bm, bs, sm[w][gg], ss[w][gg]);
        pm[((size_t)h * grp + gg) * nb + c] = bm;
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
