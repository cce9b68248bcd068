// 4-bit decode GEMV (include/zeroedge_q4.h) for one token on int8-rounded inputs.
//
// A block of 8 warps first asks for its warps' first weight bytes (16-byte loads, `unroll` of them
// a lane and row), then waits for the previous kernel (PDL), then rounds the inputs (after the
// RMSNorm when ln is given) into shared memory: for each word of 8 inputs the two packed int8
// halves that meet its even / odd codes, its step, and the sum over each run of 4 words. A warp
// owns `rows_per_warp` output rows (swiglu: the gate row and its up row); each lane walks 16-byte
// chunks (4 words: 32 codes, all in one group) of its rows, 32 chunks apart, multiplies them with
// dp4a and applies the group's step and offset, and the warp adds its lanes at the end.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "zeroedge_q4.h"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxWords = ZE_Q4_MAX_K / 8;
constexpr float kTiny = 1e-30f;   // zeroedge.quant.packed.TINY_INPUTS: such a run of inputs rounds to 0

template <typename T> __device__ __forceinline__ float tof(T v);
template <> __device__ __forceinline__ float tof<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float tof<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T fromf(float v);
template <> __device__ __forceinline__ __half fromf<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 fromf<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

__device__ __forceinline__ int dp4a_us(unsigned a, int b, int c) {   // unsigned codes x signed inputs
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ void pdl_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

struct Inputs {
    int4 pa[kMaxWords / 4];     // per word: its 4 even inputs as int8 bytes (low nibbles' partners)
    int4 pb[kMaxWords / 4];     // its 4 odd inputs (high nibbles')
    float4 dx[kMaxWords / 4];   // the word's step (times 1 / RMS)
    float w4[kMaxWords / 4];    // sum over 4 words of (sum of rounded inputs) x step: the offsets' input
    float red[kWarps];
};

template <typename T>
__device__ void stage_inputs(const T* __restrict__ x, const T* __restrict__ ln, float eps, int K, Inputs& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = K / 8;
    float rstd = 1.f;
    if (ln) {
        float ss = 0.f;
        for (int k = threadIdx.x; k < K; k += kThreads) {
            float v = tof(x[k]);
            ss += v * v;
        }
        ss = warp_sum(ss);
        if (lane == 0) s.red[warp] = ss;
        __syncthreads();
        rstd = 1.f / sqrtf(warp_sum(lane < kWarps ? s.red[lane] : 0.f) / K + eps);
    }
    int* pa = reinterpret_cast<int*>(s.pa);
    int* pb = reinterpret_cast<int*>(s.pb);
    float* dxs = reinterpret_cast<float*>(s.dx);
    for (int w = threadIdx.x; w < W; w += kThreads) {
        uint4 raw = *reinterpret_cast<const uint4*>(x + 8 * w);
        const T* xv = reinterpret_cast<const T*>(&raw);
        float v[8], amax = 0.f;
        if (ln) {
            uint4 lr = *reinterpret_cast<const uint4*>(ln + 8 * w);
            const T* lv = reinterpret_cast<const T*>(&lr);
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = tof(xv[e]) * tof(lv[e]);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = tof(xv[e]);
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e]));
        const float inv = amax > kTiny ? 127.f / amax : 0.f;
        int qv[8], sum = 0;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            qv[e] = static_cast<int>(floorf(v[e] * inv + 0.5f));
            sum += qv[e];
        }
        unsigned ea = 0, ob = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            ea |= (static_cast<unsigned>(qv[2 * j]) & 255u) << (8 * j);
            ob |= (static_cast<unsigned>(qv[2 * j + 1]) & 255u) << (8 * j);
        }
        pa[w] = static_cast<int>(ea);
        pb[w] = static_cast<int>(ob);
        const float dx = amax / 127.f * rstd;
        dxs[w] = dx;
        float ws = static_cast<float>(sum) * dx;   // the 4 words of a run are 4 adjacent lanes (W % 4 == 0)
        const unsigned act = __activemask();
        ws += __shfl_xor_sync(act, ws, 1);
        ws += __shfl_xor_sync(act, ws, 2);
        if ((w & 3) == 0) s.w4[w >> 2] = ws;
    }
    __syncthreads();
}

__device__ __forceinline__ float chunk_dot(uint4 q, int4 pa, int4 pb, float4 dx) {
    const unsigned m = 0x0F0F0F0Fu;
    float f = static_cast<float>(dp4a_us((q.x >> 4) & m, pb.x, dp4a_us(q.x & m, pa.x, 0))) * dx.x;
    f += static_cast<float>(dp4a_us((q.y >> 4) & m, pb.y, dp4a_us(q.y & m, pa.y, 0))) * dx.y;
    f += static_cast<float>(dp4a_us((q.z >> 4) & m, pb.z, dp4a_us(q.z & m, pa.z, 0))) * dx.z;
    f += static_cast<float>(dp4a_us((q.w >> 4) & m, pb.w, dp4a_us(q.w & m, pa.w, 0))) * dx.w;
    return f;
}

// H = 2: swiglu (row n of the output from W rows n and n + N)
template <typename T, int H, int R, int U>
__global__ void __launch_bounds__(kThreads) q4_gemv(const T* __restrict__ x, const T* __restrict__ ln, float eps,
                                                    const uint4* __restrict__ q, const __half* __restrict__ scale,
                                                    const __half* __restrict__ offset, const T* __restrict__ res,
                                                    T* __restrict__ y, int N, int K, int group) {
    __shared__ Inputs s;
    pdl_launch();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int C = K / 32, G = K / group, cpg = group / 32;
    const int row0 = (blockIdx.x * kWarps + warp) * R;
    uint4 qv[R][H][U];
    float sc[R][H][U], of[R][H][U];
    auto load = [&](int c0) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int h = 0; h < H; ++h)
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int c = c0 + lane + 32 * u;
                    const bool ok = c < C && row0 + r < N;
                    const size_t row = static_cast<size_t>(row0 + r + h * N);
                    qv[r][h][u] = ok ? __ldg(q + row * C + c) : make_uint4(0, 0, 0, 0);
                    sc[r][h][u] = ok ? __half2float(scale[row * G + c / cpg]) : 0.f;
                    of[r][h][u] = ok ? __half2float(offset[row * G + c / cpg]) : 0.f;
                }
    };
    load(0);        // weights: no earlier kernel writes them
    pdl_wait();
    stage_inputs(x, ln, eps, K, s);
    float acc[R][H];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int h = 0; h < H; ++h) acc[r][h] = 0.f;
    for (int c0 = 0; c0 < C; c0 += 32 * U) {
        if (c0 > 0) load(c0);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + lane + 32 * u;
            if (c >= C) continue;
            const int4 pa = s.pa[c], pb = s.pb[c];
            const float4 dx = s.dx[c];
            const float w4 = s.w4[c];
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int h = 0; h < H; ++h)
                    acc[r][h] += chunk_dot(qv[r][h][u], pa, pb, dx) * sc[r][h][u] + of[r][h][u] * w4;
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        float v = warp_sum(acc[r][0]);
        if (H == 2) {
            const float u = warp_sum(acc[r][H - 1]);
            v = v / (1.f + __expf(-v)) * u;
        }
        const int n = row0 + r;
        if (lane == 0 && n < N) {
            if (res) v += tof(res[n]);
            y[n] = fromf<T>(v);
        }
    }
}

template <typename T, int H, int R, int U>
cudaError_t launch(const void* x, const void* ln, float eps, const void* q, const void* scale, const void* offset,
                   const void* res, void* y, int n, int k, int group, bool pdl, cudaStream_t st) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((n + kWarps * R - 1) / (kWarps * R));
    cfg.blockDim = dim3(kThreads);
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, q4_gemv<T, H, R, U>, static_cast<const T*>(x), static_cast<const T*>(ln), eps,
                              static_cast<const uint4*>(q), static_cast<const __half*>(scale),
                              static_cast<const __half*>(offset), static_cast<const T*>(res), static_cast<T*>(y), n,
                              k, group);
}

template <typename T, int H>
cudaError_t pick(int rpw, int unroll, const void* x, const void* ln, float eps, const void* q, const void* scale,
                 const void* offset, const void* res, void* y, int n, int k, int group, bool pdl, cudaStream_t st) {
    if (rpw == 1)
        return unroll == 2 ? launch<T, H, 1, 2>(x, ln, eps, q, scale, offset, res, y, n, k, group, pdl, st)
                           : launch<T, H, 1, 4>(x, ln, eps, q, scale, offset, res, y, n, k, group, pdl, st);
    return unroll == 2 ? launch<T, H, 2, 2>(x, ln, eps, q, scale, offset, res, y, n, k, group, pdl, st)
                       : launch<T, H, 2, 4>(x, ln, eps, q, scale, offset, res, y, n, k, group, pdl, st);
}

bool aligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

extern "C" int ze_q4_gemv(int dtype, const void* x, const void* ln, float eps, const void* q, const void* scale,
                          const void* offset, const void* res, void* y, int n, int k, int group, int swiglu,
                          int rows_per_warp, int unroll, int pdl, void* stream) {
    if (!x || !q || !scale || !offset || !y) return ZE_Q4_ERR_NULL;
    if (dtype != ZE_Q4_F16 && dtype != ZE_Q4_BF16) return ZE_Q4_ERR_DTYPE;
    if (n < 1 || k < 32 || k % 32 || k > ZE_Q4_MAX_K || group < 32 || group % 32 || k % group ||
        (rows_per_warp != 1 && rows_per_warp != 2) || (unroll != 2 && unroll != 4) || (swiglu && res))
        return ZE_Q4_ERR_SHAPE;
    if (!aligned(x) || !aligned(q) || (ln && !aligned(ln))) return ZE_Q4_ERR_ALIGN;
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    const bool p = pdl != 0;
    cudaError_t e;
    if (dtype == ZE_Q4_F16)
        e = swiglu ? pick<__half, 2>(rows_per_warp, unroll, x, ln, eps, q, scale, offset, res, y, n, k, group, p, st)
                   : pick<__half, 1>(rows_per_warp, unroll, x, ln, eps, q, scale, offset, res, y, n, k, group, p, st);
    else
        e = swiglu ? pick<__nv_bfloat16, 2>(rows_per_warp, unroll, x, ln, eps, q, scale, offset, res, y, n, k, group,
                                            p, st)
                   : pick<__nv_bfloat16, 1>(rows_per_warp, unroll, x, ln, eps, q, scale, offset, res, y, n, k, group,
                                            p, st);
    return static_cast<int>(e);
}
