// Gather-GEMV for decode paths (see include/zeroedge_paths.h). fp16 storage, fp32 arithmetic.
//
// gateup: one warp per channel, 8 warps a block. The warp first scores its channel from the
// predictor (R-long dot products, z in shared memory), and only a live channel reads its rows of
// W_gate and W_up (16-byte loads, x staged in shared memory). down: a block owns a 256-wide
// slice of y and a range of channels; each warp walks channels, skips dead ones (act == 0 for the
// whole batch) before touching their wd_t row, accumulates in registers, and the block reduces
// over warps and atomically adds its slice into an fp32 work buffer; a last small kernel writes y.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "zeroedge_paths.h"

namespace {

constexpr int kWarps = 8;
constexpr int kMaxB = ZE_PATHS_MAX_BATCH;

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }

__global__ void gateup_kernel(const __half* __restrict__ x, const __half* __restrict__ z,
                              const __half* __restrict__ bg, const __half* __restrict__ bu,
                              const __half* __restrict__ wg, const __half* __restrict__ wu,
                              __half* __restrict__ act, float thr, int B, int D, int F, int R) {
    extern __shared__ float smem[];        // x: B*D floats, then z: B*R floats
    float* xs = smem;
    float* zs = smem + B * D;
    for (int i = threadIdx.x; i < B * D; i += blockDim.x) xs[i] = __half2float(x[i]);
    for (int i = threadIdx.x; i < B * R; i += blockDim.x) zs[i] = __half2float(z[i]);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (j >= F) return;
    // predictor score: the batch's max of |silu(g~) * u~|
    float score = 0.f;
    for (int b = 0; b < B; ++b) {
        float g = 0.f, u = 0.f;
        for (int r = lane; r < R; r += 32) {
            g += zs[b * R + r] * __half2float(bg[(size_t)j * R + r]);
            u += zs[b * R + r] * __half2float(bu[(size_t)j * R + r]);
        }
        g = warp_sum(g);
        u = warp_sum(u);
        score = fmaxf(score, fabsf(silu(g) * u));
    }
    if (!(score >= thr)) {                // dead channel: its weight rows are never read
        if (lane < B) act[(size_t)lane * F + j] = __float2half(0.f);
        return;
    }
    float accg[kMaxB], accu[kMaxB];
#pragma unroll
    for (int b = 0; b < kMaxB; ++b) accg[b] = accu[b] = 0.f;
    const uint4* rg = reinterpret_cast<const uint4*>(wg + (size_t)j * D);
    const uint4* ru = reinterpret_cast<const uint4*>(wu + (size_t)j * D);
    for (int v = lane; v < D / 8; v += 32) {
        uint4 pg = __ldg(rg + v), pu = __ldg(ru + v);
        const __half* hg = reinterpret_cast<const __half*>(&pg);
        const __half* hu = reinterpret_cast<const __half*>(&pu);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float fg = __half2float(hg[e]), fu = __half2float(hu[e]);
#pragma unroll
            for (int b = 0; b < kMaxB; ++b) {
                if (b < B) {
                    float xv = xs[b * D + v * 8 + e];
                    accg[b] += fg * xv;
                    accu[b] += fu * xv;
                }
            }
        }
    }
#pragma unroll
    for (int b = 0; b < kMaxB; ++b) {
        if (b < B) {
            float g = warp_sum(accg[b]), u = warp_sum(accu[b]);
            if (lane == 0) act[(size_t)b * F + j] = __float2half(silu(g) * u);
        }
    }
}

constexpr int kSlice = 256;   // y columns per block: 32 lanes x 8 halves
constexpr int kChunk = 256;   // channels per block

__global__ void down_kernel(const __half* __restrict__ act, const __half* __restrict__ wd_t,
                            float* __restrict__ work, int B, int D, int F) {
    __shared__ float red[kWarps][kSlice];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int col0 = blockIdx.x * kSlice + lane * 8;
    const int f0 = blockIdx.y * kChunk;
    const int f1 = min(F, f0 + kChunk);
    float acc[kMaxB][8];
#pragma unroll
    for (int b = 0; b < kMaxB; ++b)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[b][e] = 0.f;
    for (int j = f0 + warp; j < f1; j += kWarps) {
        float a[kMaxB];
        bool live = false;
#pragma unroll
        for (int b = 0; b < kMaxB; ++b) {
            a[b] = b < B ? __half2float(act[(size_t)b * F + j]) : 0.f;
            live |= a[b] != 0.f;
        }
        if (!live) continue;               // dead channel: its wd_t row is never read
        uint4 p = __ldg(reinterpret_cast<const uint4*>(wd_t + (size_t)j * D + col0));
        const __half* h = reinterpret_cast<const __half*>(&p);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float w = __half2float(h[e]);
#pragma unroll
            for (int b = 0; b < kMaxB; ++b) acc[b][e] += a[b] * w;
        }
    }
#pragma unroll
    for (int b = 0; b < kMaxB; ++b) {
        if (b >= B) break;
#pragma unroll
        for (int e = 0; e < 8; ++e) red[warp][lane * 8 + e] = acc[b][e];
        __syncthreads();
        if (threadIdx.x < kSlice) {
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) s += red[w][threadIdx.x];
            atomicAdd(work + (size_t)b * D + blockIdx.x * kSlice + threadIdx.x, s);
        }
        __syncthreads();
    }
}

__global__ void finish_kernel(const float* __restrict__ work, __half* __restrict__ y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2half(work[i]);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

extern "C" int ze_paths_gateup(const void* x, const void* z, const void* bg, const void* bu,
                               const void* wg, const void* wu, void* act, float threshold, int B,
                               int D, int F, int R, void* stream) {
    if (!x || !z || !bg || !bu || !wg || !wu || !act) return ZE_PATHS_ERR_ARG;
    if (B < 1 || B > kMaxB || R < 1 || R > ZE_PATHS_MAX_RANK || D <= 0 || F <= 0 || D % 256)
        return ZE_PATHS_ERR_SHAPE;
    if (!aligned16(wg) || !aligned16(wu)) return ZE_PATHS_ERR_ARG;
    size_t sm = (size_t)B * (D + R) * sizeof(float);
    if (sm > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(gateup_kernel,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm);
        if (e != cudaSuccess) return (int)e;
    }
    dim3 grid((F + kWarps - 1) / kWarps);
    gateup_kernel<<<grid, kWarps * 32, sm, (cudaStream_t)stream>>>(
        (const __half*)x, (const __half*)z, (const __half*)bg, (const __half*)bu,
        (const __half*)wg, (const __half*)wu, (__half*)act, threshold, B, D, F, R);
    return (int)cudaGetLastError();
}

extern "C" size_t ze_paths_down_work_bytes(int B, int D) {
    return (size_t)(B > 0 ? B : 0) * (size_t)(D > 0 ? D : 0) * sizeof(float);
}

extern "C" int ze_paths_down(const void* act, const void* wd_t, void* y, void* work, int B, int D,
                             int F, void* stream) {
    if (!act || !wd_t || !y || !work) return ZE_PATHS_ERR_ARG;
    if (B < 1 || B > kMaxB || D <= 0 || F <= 0 || D % kSlice) return ZE_PATHS_ERR_SHAPE;
    if (!aligned16(wd_t)) return ZE_PATHS_ERR_ARG;
    cudaStream_t s = (cudaStream_t)stream;
    cudaError_t e = cudaMemsetAsync(work, 0, ze_paths_down_work_bytes(B, D), s);
    if (e != cudaSuccess) return (int)e;
    dim3 grid(D / kSlice, (F + kChunk - 1) / kChunk);
    down_kernel<<<grid, kWarps * 32, 0, s>>>((const __half*)act, (const __half*)wd_t, (float*)work,
                                             B, D, F);
    e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;
    int n = B * D;
    finish_kernel<<<(n + 255) / 256, 256, 0, s>>>((const float*)work, (__half*)y, n);
    return (int)cudaGetLastError();
}
