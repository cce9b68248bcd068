// Decode paths (include/zeroedge_paths.h): FFN gather-GEMV for batch <= 8, fp16 / bf16 storage,
// fp32 arithmetic.
//
// Every kernel here has the same shape: a block owns a set of rows of one weight matrix, first
// decides which of its rows are live (smem list of row index + per-token coefficient), then walks
// only the live rows with 16-byte loads (a thread owns 8 consecutive output columns and keeps 8 rows
// in flight; at batch 1 up to 4 thread groups split the rows and meet in shared memory) and adds the
// block's fp32 sums into a work buffer with atomic adds (float4 atomics on sm_90). A block with no
// live row issues no atomics. The last block of the down step (a ticket counter) converts the sums
// to the output dtype and zeroes the sums and the ticket for the next call, and the down step zeroes
// the gate/up entries it reads, so no memset runs between steps.
//
//   predictor gate/up: one warp per channel scores it from the predictor and, when live, computes
//                      silu(x wg[j]) * (x wu[j]) into the work buffer.
//   magnitude gate/up: block = (2048 columns of w13_t, a chunk of input rows k); live k: some
//                      token has |x[b,k]| >= thr_in; sums of x' w13_t into the work buffer.
//   down:              block = a chunk of channels; reads a (or silu(g) * u), keeps the live
//                      channels, accumulates their wd_t rows into y.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "zeroedge_paths.h"

namespace {

constexpr int kMaxB = ZE_PATHS_MAX_BATCH;
constexpr int kGateupThreads = 256;   // magnitude gate/up block: 256 threads x 8 columns
constexpr int kMaxChunk = 1024;

int g_pred_chunk = 8, g_down_chunk = 64, g_gateup_rows = 64;

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

template <typename T> __device__ __forceinline__ void unpack8(const uint4& p, float* f) {
    const T* h = reinterpret_cast<const T*>(&p);
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = to_f<T>(h[e]);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }

struct Work {
    float* yacc;      // [B, D] sums of the output
    float* gu;        // [B, 2F] sums of the magnitude gate/up step
    unsigned* ticket; // [2]: blocks done, per kernel kind
};

__host__ __device__ inline Work split_work(void* w, int B, int D, int F) {
    Work k;
    k.yacc = static_cast<float*>(w);
    k.gu = k.yacc + (size_t)B * D;
    k.ticket = reinterpret_cast<unsigned*>(k.gu + (size_t)B * 2 * F);
    return k;
}

// acc[b][0..8) += sum over listed rows i = first, first + step, ... < n of
// coef[i][b] * w[rows[i]][col0 .. col0 + 8); 8 rows in flight per thread
template <typename T, int MB>
__device__ __forceinline__ void accumulate_rows(const T* __restrict__ w, size_t stride, int col0,
                                                const int* rows, const float* coef, int first,
                                                int step, int n, int B, float (&acc)[MB][8]) {
    constexpr int U = 8;
    int i = first;
    for (; i + (U - 1) * step < n; i += U * step) {
        uint4 p[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            p[u] = __ldg(reinterpret_cast<const uint4*>(w + (size_t)rows[i + u * step] * stride + col0));
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float f[8];
            unpack8<T>(p[u], f);
#pragma unroll
            for (int b = 0; b < MB; ++b) {
                if (b < B) {
                    const float c = coef[(i + u * step) * MB + b];
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[b][e] += c * f[e];
                }
            }
        }
    }
    for (; i < n; i += step) {
        float f[8];
        unpack8<T>(__ldg(reinterpret_cast<const uint4*>(w + (size_t)rows[i] * stride + col0)), f);
#pragma unroll
        for (int b = 0; b < MB; ++b) {
            if (b < B) {
                const float c = coef[i * MB + b];
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[b][e] += c * f[e];
            }
        }
    }
}

// A block of G groups x CT threads: group g walks live rows g, g + G, ...; the groups' sums meet
// in shared memory (red: (G - 1) * CT * 8 * MB floats) and group 0 holds the block's sums.
// Returns true for the threads of group 0.
template <typename T, int MB>
__device__ __forceinline__ bool accumulate_block(const T* __restrict__ w, size_t stride, int colbase,
                                                 int CT, const int* rows, const float* coef, int n,
                                                 int B, float* red, float (&acc)[MB][8]) {
    const int G = blockDim.x / CT, g = threadIdx.x / CT, ct = threadIdx.x % CT;
    accumulate_rows<T, MB>(w, stride, colbase + ct * 8, rows, coef, g, G, n, B, acc);
    if (G == 1) return true;
    if (g > 0) {
#pragma unroll
        for (int b = 0; b < MB; ++b)
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (b < B) red[(((size_t)(g - 1) * MB + b) * 8 + e) * CT + ct] = acc[b][e];
    }
    __syncthreads();
    if (g > 0) return false;
    for (int h = 1; h < G; ++h)
#pragma unroll
        for (int b = 0; b < MB; ++b)
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (b < B) acc[b][e] += red[(((size_t)(h - 1) * MB + b) * 8 + e) * CT + ct];
    return true;
}

__device__ __forceinline__ void atomic_add8(float* dst, const float* v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float4*>(dst), make_float4(v[0], v[1], v[2], v[3]));
    atomicAdd(reinterpret_cast<float4*>(dst + 4), make_float4(v[4], v[5], v[6], v[7]));
#else
#pragma unroll
    for (int e = 0; e < 8; ++e) atomicAdd(dst + e, v[e]);
#endif
}

template <int MB>
__device__ __forceinline__ void add_partials(float* dst, size_t stride, int col0, int B,
                                             const float (&acc)[MB][8]) {
#pragma unroll
    for (int b = 0; b < MB; ++b)
        if (b < B) atomic_add8(dst + (size_t)b * stride + col0, acc[b]);
}

// The last block of the grid to get here writes y = yacc in T and zeroes yacc and the ticket.
template <typename T>
__device__ void finish_if_last(float* yacc, unsigned* ticket, T* __restrict__ y, int n) {
    __shared__ bool last;
    __threadfence();            // this thread's atomic adds are visible before the ticket
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x * gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int i = threadIdx.x * 4; i < n; i += blockDim.x * 4) {
        float4 v = __ldcg(reinterpret_cast<const float4*>(yacc + i));
        y[i] = from_f<T>(v.x);
        y[i + 1] = from_f<T>(v.y);
        y[i + 2] = from_f<T>(v.z);
        y[i + 3] = from_f<T>(v.w);
        __stcg(reinterpret_cast<float4*>(yacc + i), make_float4(0.f, 0.f, 0.f, 0.f));
    }
    if (threadIdx.x == 0) *ticket = 0u;
}

// ---- predictor: score and gate/up of the live channels -----------------------------------------
// one warp per channel (C channels a block, warps loop); writes act[b, j] (fp32) into work.gu for
// live channels only: dead channels keep the zero the down step left there.
template <typename T, int MB>
__global__ void pred_gateup_kernel(const T* __restrict__ x, const T* __restrict__ z,
                                   const T* __restrict__ bg, const T* __restrict__ bu,
                                   const T* __restrict__ wg, const T* __restrict__ wu, float thr,
                                   int B, int D, int F, int R, int C, Work work) {
    extern __shared__ __align__(16) unsigned char smem[];
    T* xs = reinterpret_cast<T*>(smem);
    float* zs = reinterpret_cast<float*>(smem + (size_t)B * D * sizeof(T));
    {
        const uint4* src = reinterpret_cast<const uint4*>(x);
        uint4* dst = reinterpret_cast<uint4*>(xs);
        for (int i = threadIdx.x; i < B * D / 8; i += blockDim.x) dst[i] = __ldg(src + i);
        for (int i = threadIdx.x; i < B * R; i += blockDim.x) zs[i] = to_f<T>(z[i]);
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int j0 = blockIdx.x * C;
    for (int c = warp; c < C && j0 + c < F; c += nwarps) {
        const int j = j0 + c;
        float score = 0.f;
        for (int b = 0; b < B; ++b) {
            float g = 0.f, u = 0.f;
            for (int r = lane; r < R; r += 32) {
                g += zs[b * R + r] * to_f<T>(bg[(size_t)j * R + r]);
                u += zs[b * R + r] * to_f<T>(bu[(size_t)j * R + r]);
            }
            score = fmaxf(score, fabsf(silu(warp_sum(g)) * warp_sum(u)));
        }
        if (!(score >= thr)) continue;    // warp-uniform: dead channel, no row of it is read
        float ag[MB], au[MB];
#pragma unroll
        for (int b = 0; b < MB; ++b) ag[b] = au[b] = 0.f;
        const uint4* rg = reinterpret_cast<const uint4*>(wg + (size_t)j * D);
        const uint4* ru = reinterpret_cast<const uint4*>(wu + (size_t)j * D);
        const uint4* xv = reinterpret_cast<const uint4*>(xs);
#pragma unroll 4
        for (int v = lane; v < D / 8; v += 32) {
            float fg[8], fu[8];
            unpack8<T>(__ldg(rg + v), fg);
            unpack8<T>(__ldg(ru + v), fu);
#pragma unroll
            for (int b = 0; b < MB; ++b) {
                if (b < B) {
                    float fx[8];
                    unpack8<T>(xv[b * (D / 8) + v], fx);
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        ag[b] += fg[e] * fx[e];
                        au[b] += fu[e] * fx[e];
                    }
                }
            }
        }
#pragma unroll
        for (int b = 0; b < MB; ++b) {
            const float g = warp_sum(ag[b]), u = warp_sum(au[b]);
            if (lane == 0 && b < B) work.gu[(size_t)b * F + j] = silu(g) * u;
        }
    }
}

// ---- magnitude rule: gate/up over the kept input rows -----------------------------------------
// grid (ceil(2F / (8 CT)), ceil(D / KC)), G x CT threads; smem: rows [KC], coefficients
// [KC, MB], group sums
template <typename T, int MB>
__global__ void mag_gateup_kernel(const T* __restrict__ x, const T* __restrict__ w13_t,
                                  float thr_in, int B, int D, int N2, int KC, int CT, Work work) {
    extern __shared__ __align__(16) unsigned char smem[];
    int* rows = reinterpret_cast<int*>(smem);
    float* coef = reinterpret_cast<float*>(rows + KC);
    float* red = coef + KC * MB;
    __shared__ int nlive;
    if (threadIdx.x == 0) nlive = 0;
    __syncthreads();
    const int k0 = blockIdx.y * KC;
    for (int i = threadIdx.x; i < KC && k0 + i < D; i += blockDim.x) {
        const int k = k0 + i;
        float c[MB];
        bool live = false;
#pragma unroll
        for (int b = 0; b < MB; ++b) {
            const float v = b < B ? to_f<T>(x[(size_t)b * D + k]) : 0.f;
            const bool keep = fabsf(v) >= thr_in;
            c[b] = keep ? v : 0.f;
            live |= keep && b < B;
        }
        if (live) {
            const int s = atomicAdd(&nlive, 1);
            rows[s] = k;
#pragma unroll
            for (int b = 0; b < MB; ++b) coef[s * MB + b] = c[b];
        }
    }
    __syncthreads();
    const int n = nlive;
    if (n == 0) return;                    // block-uniform
    const int colbase = blockIdx.x * CT * 8;
    const int ncols = min(CT * 8, N2 - colbase);
    float acc[MB][8] = {};
    // columns past N2 (last block) read row 0 clamped: computed, never stored
    const int ct = threadIdx.x % CT;
    const int cb = ct * 8 < ncols ? colbase : colbase - ct * 8;
    if (accumulate_block<T, MB>(w13_t, (size_t)N2, cb, CT, rows, coef, n, B, red, acc) && ct * 8 < ncols)
        add_partials<MB>(work.gu, (size_t)N2, colbase + ct * 8, B, acc);
}

// ---- down over the live channels (both rules) -------------------------------------------------
// block: G x (D / 8) threads, C channels; smem: rows [C], coefficients [C, MB], group sums.
// FROM_GU: a = silu(g) * u from the magnitude gate/up sums (stride 2F), live when some |a| >= thr;
// else: a = act written by pred_gateup (stride F), live when some a != 0. Either way this block is
// the only reader of its channels' entries and zeroes them.
template <typename T, int MB, bool FROM_GU>
__global__ void down_kernel(const T* __restrict__ wd_t, T* __restrict__ y, float thr, int B, int D,
                            int F, int C, Work work) {
    extern __shared__ __align__(16) unsigned char smem[];
    int* rows = reinterpret_cast<int*>(smem);
    float* coef = reinterpret_cast<float*>(rows + C);
    float* red = coef + C * MB;
    __shared__ int nlive;
    if (threadIdx.x == 0) nlive = 0;
    __syncthreads();
    const int j0 = blockIdx.x * C;
    for (int i = threadIdx.x; i < C && j0 + i < F; i += blockDim.x) {
        const int j = j0 + i;
        float c[MB];
        bool live = false;
#pragma unroll
        for (int b = 0; b < MB; ++b) {
            float a = 0.f;
            bool keep = false;
            if (b < B) {
                if (FROM_GU) {
                    float* g = work.gu + (size_t)b * 2 * F + j;
                    a = silu(__ldcg(g)) * __ldcg(g + F);
                    __stcg(g, 0.f);
                    __stcg(g + F, 0.f);
                    keep = fabsf(a) >= thr;
                } else {
                    float* g = work.gu + (size_t)b * F + j;
                    a = __ldcg(g);
                    __stcg(g, 0.f);
                    keep = a != 0.f;
                }
            }
            c[b] = keep ? a : 0.f;
            live |= keep;
        }
        if (live) {
            const int s = atomicAdd(&nlive, 1);
            rows[s] = j;
#pragma unroll
            for (int b = 0; b < MB; ++b) coef[s * MB + b] = c[b];
        }
    }
    __syncthreads();
    const int n = nlive;
    if (n > 0) {                           // block-uniform
        float acc[MB][8] = {};
        if (accumulate_block<T, MB>(wd_t, (size_t)D, 0, D / 8, rows, coef, n, B, red, acc))
            add_partials<MB>(work.yacc, (size_t)D, (threadIdx.x % (D / 8)) * 8, B, acc);
    }
    finish_if_last<T>(work.yacc, work.ticket, y, B * D);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

int check_common(int dtype, int B, int D, int F) {
    if (dtype != ZE_PATHS_F16 && dtype != ZE_PATHS_BF16) return ZE_PATHS_ERR_DTYPE;
    if (B < 1 || B > kMaxB || D < 8 || D % 8 || D > 8192 || F < 8 || F % 8)
        return ZE_PATHS_ERR_SHAPE;
    return ZE_PATHS_OK;
}

cudaError_t smem_attr(const void* fn, size_t bytes) {
    if (bytes <= 48 * 1024) return cudaSuccess;
    return cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

// groups of a block whose rows are CT threads wide: up to 4 (1024 threads) at batch 1, where the
// group sums fit shared memory; 1 for larger batches
int groups(int CT, int MB) { return MB == 1 ? (1024 / CT < 4 ? 1024 / CT : 4) : 1; }

template <typename T, int MB, bool FROM_GU>
int launch_down(void* y, const void* wd_t, float thr, int B, int D, int F, Work w, cudaStream_t s) {
    const int C = g_down_chunk, CT = D / 8, G = groups(CT, MB);
    const size_t sm = (size_t)C * (1 + MB) * 4 + (size_t)(G - 1) * CT * 8 * MB * 4;
    auto fn = down_kernel<T, MB, FROM_GU>;
    cudaError_t e = smem_attr((const void*)fn, sm);
    if (e != cudaSuccess) return (int)e;
    fn<<<(F + C - 1) / C, G * CT, sm, s>>>((const T*)wd_t, (T*)y, thr, B, D, F, C, w);
    return (int)cudaGetLastError();
}

template <typename T, int MB>
int launch_ffn(const void* x, const void* z, const void* bg, const void* bu, const void* wg,
               const void* wu, const void* wd_t, void* y, float thr, int B, int D, int F, int R,
               Work w, cudaStream_t s) {
    const int C = g_pred_chunk;
    const size_t sm = (size_t)B * D * sizeof(T) + (size_t)B * R * 4;
    auto fn = pred_gateup_kernel<T, MB>;
    cudaError_t e = smem_attr((const void*)fn, sm);
    if (e != cudaSuccess) return (int)e;
    const int warps = C < 8 ? C : 8;
    fn<<<(F + C - 1) / C, warps * 32, sm, s>>>((const T*)x, (const T*)z, (const T*)bg, (const T*)bu,
                                               (const T*)wg, (const T*)wu, thr, B, D, F, R, C, w);
    e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;
    return launch_down<T, MB, false>(y, wd_t, 0.f, B, D, F, w, s);
}

template <typename T, int MB>
int launch_magnitude(const void* x, const void* w13_t, const void* wd_t, void* y, float thr_in,
                     float thr, int B, int D, int F, Work w, cudaStream_t s) {
    const int KC = g_gateup_rows, N2 = 2 * F, CT = kGateupThreads, G = groups(CT, MB);
    const size_t sm = (size_t)KC * (1 + MB) * 4 + (size_t)(G - 1) * CT * 8 * MB * 4;
    auto fn = mag_gateup_kernel<T, MB>;
    cudaError_t e = smem_attr((const void*)fn, sm);
    if (e != cudaSuccess) return (int)e;
    dim3 g1((N2 + CT * 8 - 1) / (CT * 8), (D + KC - 1) / KC);
    fn<<<g1, G * CT, sm, s>>>((const T*)x, (const T*)w13_t, thr_in, B, D, N2, KC, CT, w);
    e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;
    return launch_down<T, MB, true>(y, wd_t, thr, B, D, F, w, s);
}

}  // namespace

extern "C" size_t ze_paths_work_bytes(int B, int D, int F) {
    if (B < 1 || D < 1 || F < 1) return 0;
    return ((size_t)B * D + (size_t)B * 2 * F) * sizeof(float) + 16;
}

extern "C" void ze_paths_set_config(int pred_chunk, int down_chunk, int gateup_rows) {
    auto clamp = [](int v) { return v < 1 ? 1 : (v > kMaxChunk ? kMaxChunk : v); };
    if (pred_chunk > 0) g_pred_chunk = clamp(pred_chunk);
    if (down_chunk > 0) g_down_chunk = clamp(down_chunk);
    if (gateup_rows > 0) g_gateup_rows = clamp(gateup_rows);
}

static cudaError_t prepare_work(void* work, int B, int D, int F, int work_is_zero, cudaStream_t s) {
    return work_is_zero ? cudaSuccess : cudaMemsetAsync(work, 0, ze_paths_work_bytes(B, D, F), s);
}

extern "C" int ze_paths_ffn(int dtype, const void* x, const void* z, const void* bg,
                            const void* bu, const void* wg, const void* wu, const void* wd_t,
                            void* y, float thr, int B, int D, int F, int R, void* work,
                            int work_is_zero, void* stream) {
    int rc = check_common(dtype, B, D, F);
    if (rc) return rc;
    if (R < 1 || R > ZE_PATHS_MAX_RANK) return ZE_PATHS_ERR_SHAPE;
    if (!x || !z || !bg || !bu || !wg || !wu || !wd_t || !y || !work) return ZE_PATHS_ERR_ARG;
    if (!aligned16(x) || !aligned16(wg) || !aligned16(wu) || !aligned16(wd_t) || !aligned16(work))
        return ZE_PATHS_ERR_ALIGN;
    cudaStream_t s = (cudaStream_t)stream;
    cudaError_t e = prepare_work(work, B, D, F, work_is_zero, s);
    if (e != cudaSuccess) return (int)e;
    Work w = split_work(work, B, D, F);
    if (dtype == ZE_PATHS_F16)
        return B == 1 ? launch_ffn<__half, 1>(x, z, bg, bu, wg, wu, wd_t, y, thr, B, D, F, R, w, s)
                      : launch_ffn<__half, kMaxB>(x, z, bg, bu, wg, wu, wd_t, y, thr, B, D, F, R, w, s);
    return B == 1 ? launch_ffn<__nv_bfloat16, 1>(x, z, bg, bu, wg, wu, wd_t, y, thr, B, D, F, R, w, s)
                  : launch_ffn<__nv_bfloat16, kMaxB>(x, z, bg, bu, wg, wu, wd_t, y, thr, B, D, F, R, w, s);
}

extern "C" int ze_paths_ffn_magnitude(int dtype, const void* x, const void* w13_t,
                                      const void* wd_t, void* y, float thr_in, float thr, int B,
                                      int D, int F, void* work, int work_is_zero, void* stream) {
    int rc = check_common(dtype, B, D, F);
    if (rc) return rc;
    if (!x || !w13_t || !wd_t || !y || !work) return ZE_PATHS_ERR_ARG;
    if (!aligned16(w13_t) || !aligned16(wd_t) || !aligned16(work)) return ZE_PATHS_ERR_ALIGN;
    cudaStream_t s = (cudaStream_t)stream;
    cudaError_t e = prepare_work(work, B, D, F, work_is_zero, s);
    if (e != cudaSuccess) return (int)e;
    Work w = split_work(work, B, D, F);
    if (dtype == ZE_PATHS_F16)
        return B == 1 ? launch_magnitude<__half, 1>(x, w13_t, wd_t, y, thr_in, thr, B, D, F, w, s)
                      : launch_magnitude<__half, kMaxB>(x, w13_t, wd_t, y, thr_in, thr, B, D, F, w, s);
    return B == 1 ? launch_magnitude<__nv_bfloat16, 1>(x, w13_t, wd_t, y, thr_in, thr, B, D, F, w, s)
                  : launch_magnitude<__nv_bfloat16, kMaxB>(x, w13_t, wd_t, y, thr_in, thr, B, D, F, w, s);
}
