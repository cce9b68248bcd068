// zeroedge CUDA kernels for SIH and PAD (no TensorRT headers). See include/zeroedge_kernels.h.
//
// SIH runs as 4 launches: prep (weights -> fp32 / concatenated layouts in the workspace), proj (one
// pass over x: the head's first layer and the anchor projection a @ x as one small GEMM, tensor cores
// for fp16, then the rest of the head per row), decide (moving average, threshold, block rule,
// protections) and base (the anchor's up-projection b @ (a @ x) + c for skipped rows, zeros for kept).
// PAD gather is a one-block ballot scan plus a row copy; PAD scatter builds the inverse of idx and
// writes every output row once (from y where kept, from base elsewhere).
#include "zeroedge_kernels.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

namespace {

constexpr int kProjRows = 16;   // rows per block of the tensor-core projection
constexpr int kProjBatch = 4;   // x fragments loaded ahead of their MMAs
constexpr int kProjMaxTiles = (ZE_MAX_SIH_WIDTH + ZE_MAX_ANCHOR_RANK + 15) / 16;
constexpr int kBaseRows = 16;
constexpr int kBaseThreads = 128;

// Benchmark switches: bit 0 forces the generic (CUDA-core) projection for fp16; bit 1 loads the MMA
// fragments of x straight from global memory (no staging); bits 8..11 = N > 0
// stop after stage N (1 prep, 2 projection, 3 decide) to time the stages by differences.
int g_variant = 0;
int stop_after() { return (g_variant >> 8) & 0xF; }

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

__device__ __forceinline__ void store4(float* p, float a, float b, float c, float d)
{
    *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
}
__device__ __forceinline__ void store4(__half* p, float a, float b, float c, float d)
{
    union { __half2 h[2]; uint2 u; } v;
    v.h[0] = __floats2half2_rn(a, b);
    v.h[1] = __floats2half2_rn(c, d);
    *reinterpret_cast<uint2*>(p) = v.u;
}

__device__ __forceinline__ float warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

size_t align256(size_t n) { return (n + 255) & ~size_t(255); }

struct SihLayout {
    size_t scores, ax, wcat, bt, small, total;
    int ncp;
};

SihLayout sih_layout(int64_t T, int64_t D, int32_t W, int32_t R, int dtype)
{
    SihLayout l{};
    size_t esz = dtype == ZE_F16 ? 2 : 4;
    l.ncp = (W + R + 15) / 16 * 16;
    size_t off = 0;
    l.scores = off; off += align256(size_t(T) * 4);
    l.ax = off; off += align256(size_t(T) * (R > 0 ? R : 1) * 4);
    l.wcat = off; off += align256(size_t(l.ncp) * D * esz);
    l.bt = off; off += align256(size_t(R) * D * 4);
    l.small = off; off += align256(size_t(2 * W * W + 4 * W + 1) * 4);
    l.total = off;
    return l;
}

// wcat [ncp, D] (T): rows [0, W) = w1, [W, W+R) = anchor a, the rest zero.
// bt [R, D] fp32 = anchor b transposed. small fp32 = b1[W] w2[W*W] b2[W] w3[W*W] b3[W] w4[W] b4[1].
template <typename T>
__global__ void sih_prep(ze_sih_weights w, int64_t D, int W, int R, int ncp, T* wcat, float* bt, float* small)
{
    const T* w1 = static_cast<const T*>(w.w1);
    const T* a = static_cast<const T*>(w.anchor_a);
    const T* bm = static_cast<const T*>(w.anchor_b);
    int64_t n_wcat = int64_t(ncp) * D, n_bt = int64_t(R) * D, n_small = 2 * W * W + 4 * W + 1;
    int64_t total = n_wcat + n_bt + n_small;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    {
        if (i < n_wcat)
        {
            int64_t j = i / D, k = i % D;
            T v = from_f<T>(0.f);
            if (j < W) v = w1[j * D + k];
            else if (j < W + R) v = a[(j - W) * D + k];
            wcat[i] = v;
        }
        else if (i < n_wcat + n_bt)
        {
            int64_t q = i - n_wcat, j = q / D, d = q % D;
            bt[q] = to_f(bm[d * R + j]);
        }
        else
        {
            int64_t q = i - n_wcat - n_bt;
            const T* src;
            int64_t o;
            if (q < W) { src = static_cast<const T*>(w.b1); o = q; }
            else if (q < W + W * W) { src = static_cast<const T*>(w.w2); o = q - W; }
            else if (q < 2 * W + W * W) { src = static_cast<const T*>(w.b2); o = q - W - W * W; }
            else if (q < 2 * W + 2 * W * W) { src = static_cast<const T*>(w.w3); o = q - 2 * W - W * W; }
            else if (q < 3 * W + 2 * W * W) { src = static_cast<const T*>(w.b3); o = q - 2 * W - 2 * W * W; }
            else if (q < 4 * W + 2 * W * W) { src = static_cast<const T*>(w.w4); o = q - 3 * W - 2 * W * W; }
            else { src = static_cast<const T*>(w.b4); o = 0; }
            small[q] = to_f(src[o]);
        }
    }
}

// The rest of the head for one row: h1pre = w1 @ x (without bias) -> sigmoid score.
__device__ float sih_tail(const float* h1pre, const float* small, int W)
{
    const float* b1 = small;
    const float* w2 = b1 + W;
    const float* b2 = w2 + W * W;
    const float* w3 = b2 + W;
    const float* b3 = w3 + W * W;
    const float* w4 = b3 + W;
    const float* b4 = w4 + W;
    float h1[ZE_MAX_SIH_WIDTH], h2[ZE_MAX_SIH_WIDTH];
    for (int i = 0; i < W; ++i) h1[i] = fmaxf(h1pre[i] + b1[i], 0.f);
    for (int i = 0; i < W; ++i)
    {
        float s = 0.f;
        for (int j = 0; j < W; ++j) s += w2[i * W + j] * h1[j];
        h2[i] = fmaxf(s + b2[i], 0.f);
    }
    for (int i = 0; i < W; ++i)
    {
        float s = 0.f;
        for (int j = 0; j < W; ++j) s += w3[i * W + j] * h2[j];
        h1[i] = fmaxf(s + b3[i], 0.f);
    }
    float s = 0.f;
    for (int j = 0; j < W; ++j) s += w4[j] * h1[j];
    s += b4[0];
    return 1.f / (1.f + expf(-s));
}

// Generic projection (fp32, or fp16 when the tensor-core path does not apply): one warp per row.
template <typename T>
__global__ void sih_proj_generic(const T* __restrict__ x, int64_t Tn, int64_t D, const T* __restrict__ wcat, int nc,
    int W, int R, const float* __restrict__ small, float* __restrict__ scores, float* __restrict__ ax)
{
    extern __shared__ float hs[];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int64_t row = int64_t(blockIdx.x) * (blockDim.x >> 5) + warp;
    if (row >= Tn) return;
    const T* xr = x + row * D;
    float* h = hs + warp * nc;
    for (int j = 0; j < nc; ++j)
    {
        const T* wr = wcat + int64_t(j) * D;
        float acc = 0.f;
        for (int64_t k = lane; k < D; k += 32) acc += to_f(xr[k]) * to_f(wr[k]);
        acc = warp_sum(acc);
        if (lane == 0) h[j] = acc;
    }
    __syncwarp();
    for (int j = lane; j < R; j += 32) ax[row * R + j] = h[W + j];
    if (lane == 0) scores[row] = sih_tail(h, small, W);
}

// Tensor-core projection for fp16: block = WARPS warps x 16 rows; warp w covers 1/WARPS of D and
// issues kProjBatch fragment loads of x before their MMAs (memory-level parallelism: x is streamed
// once and the arithmetic is tiny). Per-warp partial sums meet in dynamic shared memory [WARPS][16][ncp].
template <int WARPS, int NT, bool STAGED>
__global__ void __launch_bounds__(WARPS * 32) sih_proj_wmma(const __half* __restrict__ x, int64_t Tn, int64_t D,
    const __half* __restrict__ wcat, int ncp, int W, int R, const float* __restrict__ small, float* __restrict__ scores,
    float* __restrict__ ax)
{
    using namespace nvcuda;
    extern __shared__ __align__(32) float acc_s[]; // [WARPS][kProjRows][ncp]
    __shared__ __align__(32) __half stage[WARPS][16 * 16];
    __shared__ __align__(32) __half xstage[STAGED ? WARPS * 16 * (16 * kProjBatch + 8) : 1];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int64_t row0 = int64_t(blockIdx.x) * kProjRows;
    int nt = ncp / 16;
    bool tail = row0 + kProjRows > Tn;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) wmma::fill_fragment(c[n], 0.f);
    int64_t kper = D / WARPS;
    int64_t k = warp * kper, k1 = k + kper;
    if (!tail && STAGED)
    {
        // coalesced 16-byte loads of the warp's 16 x 64 slice of x into registers (prefetched one
        // batch ahead), then through shared memory into the MMA fragments
        constexpr int KB = 16 * kProjBatch, LDS = KB + 8;
        __half* xs = xstage + size_t(warp) * 16 * LDS;
        int4 v[4];
        auto gload = [&](int64_t kk) {
#pragma unroll
            for (int q = 0; q < 4; ++q)
            {
                int i = lane + 32 * q, r = i >> 3, c = i & 7;
                v[q] = *reinterpret_cast<const int4*>(x + (row0 + r) * D + kk + c * 8);
            }
        };
        if (k + KB <= k1) gload(k);
        for (; k + KB <= k1; k += KB)
        {
            __syncwarp();
#pragma unroll
            for (int q = 0; q < 4; ++q)
            {
                int i = lane + 32 * q, r = i >> 3, c = i & 7;
                *reinterpret_cast<int4*>(xs + r * LDS + c * 8) = v[q];
            }
            __syncwarp();
            if (k + 2 * KB <= k1) gload(k + KB);
#pragma unroll
            for (int u = 0; u < kProjBatch; ++u)
            {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
                wmma::load_matrix_sync(a, xs + 16 * u, unsigned(LDS));
#pragma unroll
                for (int n = 0; n < NT; ++n)
                {
                    if (n < nt)
                    {
                        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
                        wmma::load_matrix_sync(b, wcat + int64_t(n) * 16 * D + k + 16 * u, unsigned(D));
                        wmma::mma_sync(c[n], a, b, c[n]);
                    }
                }
            }
        }
    }
    if (!tail && !STAGED)
    {
        for (; k + 16 * kProjBatch <= k1; k += 16 * kProjBatch)
        {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a[kProjBatch];
#pragma unroll
            for (int u = 0; u < kProjBatch; ++u) wmma::load_matrix_sync(a[u], x + row0 * D + k + 16 * u, unsigned(D));
#pragma unroll
            for (int u = 0; u < kProjBatch; ++u)
            {
#pragma unroll
                for (int n = 0; n < NT; ++n)
                {
                    if (n < nt)
                    {
                        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
                        wmma::load_matrix_sync(b, wcat + int64_t(n) * 16 * D + k + 16 * u, unsigned(D));
                        wmma::mma_sync(c[n], a[u], b, c[n]);
                    }
                }
            }
        }
    }
    for (; k < k1; k += 16)
    {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
        if (!tail)
        {
            wmma::load_matrix_sync(a, x + row0 * D + k, unsigned(D));
        }
        else
        {
            for (int i = lane; i < 256; i += 32)
            {
                int r = i >> 4, kk = i & 15;
                stage[warp][i] = row0 + r < Tn ? x[(row0 + r) * D + k + kk] : __float2half(0.f);
            }
            __syncwarp();
            wmma::load_matrix_sync(a, stage[warp], 16);
            __syncwarp();
        }
#pragma unroll
        for (int n = 0; n < NT; ++n)
        {
            if (n < nt)
            {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
                wmma::load_matrix_sync(b, wcat + int64_t(n) * 16 * D + k, unsigned(D));
                wmma::mma_sync(c[n], a, b, c[n]);
            }
        }
    }
    float* mine = acc_s + size_t(warp) * kProjRows * ncp;
#pragma unroll
    for (int n = 0; n < NT; ++n)
        if (n < nt) wmma::store_matrix_sync(mine + n * 16, c[n], unsigned(ncp), wmma::mem_row_major);
    __syncthreads();
    int nc = W + R;
    for (int i = threadIdx.x; i < kProjRows * nc; i += blockDim.x)
    {
        int r = i / nc, j = i % nc;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) s += acc_s[(size_t(w) * kProjRows + r) * ncp + j];
        acc_s[size_t(r) * ncp + j] = s;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kProjRows * R; i += blockDim.x)
    {
        int r = i / R, j = i % R;
        if (row0 + r < Tn) ax[(row0 + r) * R + j] = acc_s[size_t(r) * ncp + W + j];
    }
    if (threadIdx.x < kProjRows && row0 + threadIdx.x < Tn)
        scores[row0 + threadIdx.x] = sih_tail(&acc_s[size_t(threadIdx.x) * ncp], small, W);
}

struct DecideArgs {
    float thr, w0, w1, w2, n0, n1, n2, block_frac;
    int32_t min_tokens, protect_first, protect_last, block_size;
};

// Same operation order as the PyTorch reference: (w0*s + w1*s1 + w2*s2) / norm, no contraction.
__device__ __forceinline__ float smoothed(const float* s, int64_t t, const DecideArgs& a)
{
    float num = __fmul_rn(a.w0, s[t]);
    float norm = a.n0;
    if (t >= 1) { num = __fadd_rn(num, __fmul_rn(a.w1, s[t - 1])); norm = a.n1; }
    else num = __fadd_rn(num, 0.f);
    if (t >= 2) { num = __fadd_rn(num, __fmul_rn(a.w2, s[t - 2])); norm = a.n2; }
    return __fdiv_rn(num, norm);
}

__global__ void sih_decide(const float* __restrict__ scores, int64_t Tn, DecideArgs a, int32_t* __restrict__ keep)
{
    int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (t >= Tn) return;
    int k;
    if (Tn < a.min_tokens) k = 1;
    else if (a.block_size > 0)
    {
        int64_t b0 = t / a.block_size * a.block_size;
        int64_t b1 = b0 + a.block_size < Tn ? b0 + a.block_size : Tn;
        int low = 0;
        for (int64_t j = b0; j < b1; ++j) low += !(smoothed(scores, j, a) >= a.thr);
        float frac = __fdiv_rn(float(low), float(b1 - b0));
        k = frac <= a.block_frac;
    }
    else k = smoothed(scores, t, a) >= a.thr;
    if (t < a.protect_first) k = 1;
    if (a.protect_last > 0 && t >= Tn - a.protect_last) k = 1;
    keep[t] = k;
}

template <typename T>
__global__ void __launch_bounds__(kBaseThreads, 4) sih_base(const float* __restrict__ ax, const int32_t* __restrict__ keep,
    int64_t Tn, int64_t D, int R, const float* __restrict__ bt, const T* __restrict__ c, T* __restrict__ base)
{
    __shared__ float axs[kBaseRows][ZE_MAX_ANCHOR_RANK];
    __shared__ int ks[kBaseRows];
    __shared__ int any_skip;
    int64_t r0 = int64_t(blockIdx.x) * kBaseRows;
    if (threadIdx.x == 0) any_skip = 0;
    for (int i = threadIdx.x; i < kBaseRows * R; i += blockDim.x)
    {
        int r = i / R, j = i % R;
        axs[r][j] = r0 + r < Tn ? ax[(r0 + r) * R + j] : 0.f;
    }
    if (threadIdx.x < kBaseRows) ks[threadIdx.x] = r0 + threadIdx.x < Tn ? keep[r0 + threadIdx.x] : 1;
    __syncthreads();
    if (threadIdx.x < kBaseRows && ks[threadIdx.x] == 0) any_skip = 1;
    __syncthreads();
    int64_t d = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * 4;
    if (d >= D) return;
    float acc[kBaseRows][4];
#pragma unroll
    for (int r = 0; r < kBaseRows; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.f;
    if (any_skip)
    {
        int j = 0;
        for (; j + 4 <= R; j += 4)  // four independent loads in flight before their FMAs
        {
            float4 b[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) b[u] = *reinterpret_cast<const float4*>(bt + int64_t(j + u) * D + d);
#pragma unroll
            for (int u = 0; u < 4; ++u)
            {
#pragma unroll
                for (int r = 0; r < kBaseRows; ++r)
                {
                    float v = axs[r][j + u];
                    acc[r][0] += v * b[u].x; acc[r][1] += v * b[u].y; acc[r][2] += v * b[u].z; acc[r][3] += v * b[u].w;
                }
            }
        }
        for (; j < R; ++j)
        {
            float4 b = *reinterpret_cast<const float4*>(bt + int64_t(j) * D + d);
#pragma unroll
            for (int r = 0; r < kBaseRows; ++r)
            {
                float v = axs[r][j];
                acc[r][0] += v * b.x; acc[r][1] += v * b.y; acc[r][2] += v * b.z; acc[r][3] += v * b.w;
            }
        }
    }
    float c0 = to_f(c[d]), c1 = to_f(c[d + 1]), c2 = to_f(c[d + 2]), c3 = to_f(c[d + 3]);
#pragma unroll
    for (int r = 0; r < kBaseRows; ++r)
    {
        if (r0 + r >= Tn) break;
        T* o = base + (r0 + r) * D + d;
        if (ks[r]) store4(o, 0.f, 0.f, 0.f, 0.f);
        else store4(o, acc[r][0] + c0, acc[r][1] + c1, acc[r][2] + c2, acc[r][3] + c3);
    }
}

// One block: stream compaction of keep != 0 into idx (ascending), count = K; 4 tokens per thread.
constexpr int kScanItems = 4;
__global__ void __launch_bounds__(1024) pad_scan(const int32_t* __restrict__ keep, int64_t Tn,
    int32_t* __restrict__ idx, int32_t* __restrict__ count)
{
    __shared__ int wsum[32];
    __shared__ int carry, total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    for (int64_t b = 0; b < Tn; b += int64_t(blockDim.x) * kScanItems)
    {
        int64_t t0 = b + int64_t(threadIdx.x) * kScanItems;
        int f[kScanItems], c = 0;
#pragma unroll
        for (int u = 0; u < kScanItems; ++u)
        {
            f[u] = t0 + u < Tn && keep[t0 + u] != 0;
            c += f[u];
        }
        int incl = c;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1)
        {
            int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        if (lane == 31) wsum[warp] = incl;
        __syncthreads();
        if (warp == 0)
        {
            int v = lane < nw ? wsum[lane] : 0, wi = v;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1)
            {
                int u = __shfl_up_sync(0xffffffffu, wi, o);
                if (lane >= o) wi += u;
            }
            if (lane < nw) wsum[lane] = wi - v;
            if (lane == 31) total = wi;
        }
        __syncthreads();
        int pos = carry + wsum[warp] + incl - c;
#pragma unroll
        for (int u = 0; u < kScanItems; ++u)
            if (f[u]) idx[pos++] = int32_t(t0 + u);
        __syncthreads();
        if (threadIdx.x == 0) carry += total;
        __syncthreads();
    }
    if (threadIdx.x == 0) *count = carry;
}

// One warp moves one row: each lane loads up to kCopyBatch 16-byte vectors before storing them.
constexpr int kCopyBatch = 8;
__device__ __forceinline__ void copy_row(const int4* __restrict__ src, int4* __restrict__ dst, int64_t n, int lane)
{
    for (int64_t b = 0; b < n; b += 32 * kCopyBatch)
    {
        int4 v[kCopyBatch];
#pragma unroll
        for (int u = 0; u < kCopyBatch; ++u)
        {
            int64_t i = b + u * 32 + lane;
            if (i < n) v[u] = src[i];
        }
#pragma unroll
        for (int u = 0; u < kCopyBatch; ++u)
        {
            int64_t i = b + u * 32 + lane;
            if (i < n) dst[i] = v[u];
        }
    }
}

// xs[k] = x[idx[k]] for k < *count.
__global__ void pad_gather_rows(const int4* __restrict__ x, const int32_t* __restrict__ idx,
    const int32_t* __restrict__ count, int64_t Tn, int64_t vec_per_row, int4* __restrict__ xs)
{
    int64_t K = *count;
    int lane = threadIdx.x & 31;
    int64_t nwarps = int64_t(gridDim.x) * (blockDim.x >> 5);
    for (int64_t k = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); k < K; k += nwarps)
    {
        int64_t src = idx[k];
        if (src < 0 || src >= Tn) continue;
        copy_row(x + src * vec_per_row, xs + k * vec_per_row, vec_per_row, lane);
    }
}

__global__ void pad_inverse(const int32_t* __restrict__ idx, int64_t K, int64_t Tn, int32_t* __restrict__ inv)
{
    int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (k >= K) return;
    int64_t t = idx[k];
    if (t >= 0 && t < Tn) inv[t] = int32_t(k);
}

__global__ void pad_merge_rows(const int4* __restrict__ base, const int4* __restrict__ y, const int32_t* __restrict__ inv,
    int64_t Tn, int64_t vec_per_row, int4* __restrict__ out)
{
    int lane = threadIdx.x & 31;
    int64_t nwarps = int64_t(gridDim.x) * (blockDim.x >> 5);
    for (int64_t t = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); t < Tn; t += nwarps)
    {
        int64_t k = inv[t];
        copy_row(k >= 0 ? y + k * vec_per_row : base + t * vec_per_row, out + t * vec_per_row, vec_per_row, lane);
    }
}

bool aligned(const void* p, size_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; }

int last_error()
{
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? 0 : int(e);
}

// blocks of 256 threads, one warp per row
unsigned copy_blocks(int64_t rows)
{
    int64_t b = (rows + 7) / 8;
    return unsigned(b < 1 ? 1 : (b > 65535 * 16 ? 65535 * 16 : b));
}

} // namespace

extern "C" {

const char* ze_strerror(int code)
{
    switch (code)
    {
    case ZE_OK: return "ok";
    case ZE_ERR_ARG: return "zeroedge kernels: null pointer, negative size or workspace too small";
    case ZE_ERR_DTYPE: return "zeroedge kernels: dtype must be ZE_F32 or ZE_F16";
    case ZE_ERR_SHAPE:
        return "zeroedge kernels: unsupported shape (hidden size must be a multiple of 8, SIH width 1..32, "
               "anchor rank 0..64)";
    case ZE_ERR_ALIGN: return "zeroedge kernels: tensors must be 16-byte aligned";
    default: return code > 0 ? cudaGetErrorString(cudaError_t(code)) : "zeroedge kernels: unknown error";
    }
}

int ze_kernels_abi(void) { return ZE_PLUGIN_ABI; }

// For benchmarks: 1 forces the generic projection kernel for fp16 too; 0 restores automatic choice.
void ze_sih_set_variant(int v) { g_variant = v; }

size_t ze_sih_workspace_size(int64_t T, int64_t D, int32_t W, int32_t R, int dtype)
{
    if (T < 0 || D < 0 || W < 1 || R < 0) return 0;
    return sih_layout(T, D, W, R, dtype).total;
}

int ze_sih_forward(int dtype, const void* x, int64_t T, int64_t D, int32_t W, const ze_sih_weights* w,
    const ze_sih_params* p, int32_t* keep, void* base, float* scores_out, void* workspace, size_t workspace_bytes,
    void* stream_)
{
    if (dtype != ZE_F32 && dtype != ZE_F16) return ZE_ERR_DTYPE;
    if (!w || !p || T < 0 || D < 1) return ZE_ERR_ARG;
    int R = p->anchor_rank;
    if (W < 1 || W > ZE_MAX_SIH_WIDTH || R < 0 || R > ZE_MAX_ANCHOR_RANK || D % ZE_HIDDEN_MULTIPLE != 0)
        return ZE_ERR_SHAPE;
    if (T == 0) return 0;
    if (!x || !keep || !base || !workspace || !w->w1 || !w->b1 || !w->w2 || !w->b2 || !w->w3 || !w->b3 || !w->w4
        || !w->b4)
        return ZE_ERR_ARG;
    if (R > 0 && (!w->anchor_a || !w->anchor_b || !w->anchor_c)) return ZE_ERR_ARG;
    if (!aligned(x, 16) || !aligned(base, 16) || !aligned(workspace, 256)) return ZE_ERR_ALIGN;
    SihLayout l = sih_layout(T, D, W, R, dtype);
    if (workspace_bytes < l.total) return ZE_ERR_ARG;
    cudaStream_t stream = static_cast<cudaStream_t>(stream_);
    char* ws = static_cast<char*>(workspace);
    float* scores = scores_out ? scores_out : reinterpret_cast<float*>(ws + l.scores);
    float* ax = reinterpret_cast<float*>(ws + l.ax);
    float* bt = reinterpret_cast<float*>(ws + l.bt);
    float* small = reinterpret_cast<float*>(ws + l.small);
    size_t esz = dtype == ZE_F16 ? 2 : 4;
    ze_sih_weights wz = *w;
    if (R == 0) wz.anchor_a = wz.anchor_b = wz.anchor_c = nullptr;

    int64_t prep_n = int64_t(l.ncp) * D + int64_t(R) * D + 2 * W * W + 4 * W + 1;
    int prep_blocks = int((prep_n + 255) / 256 < 1024 ? (prep_n + 255) / 256 : 1024);
    bool tc = dtype == ZE_F16 && (g_variant & 1) == 0 && D % 64 == 0 && aligned(x, 32);
    if (dtype == ZE_F16)
        sih_prep<__half><<<prep_blocks, 256, 0, stream>>>(wz, D, W, R, l.ncp,
            reinterpret_cast<__half*>(ws + l.wcat), bt, small);
    else
        sih_prep<float><<<prep_blocks, 256, 0, stream>>>(wz, D, W, R, l.ncp,
            reinterpret_cast<float*>(ws + l.wcat), bt, small);
    if (int e = last_error()) return e;
    if (stop_after() == 1) return 0;

    if (tc)
    {
        // 8 warps split D for up to 32 columns (W + R), else 4
        unsigned blocks = unsigned((T + kProjRows - 1) / kProjRows);
        const __half* wc = reinterpret_cast<const __half*>(ws + l.wcat);
        const __half* xh = static_cast<const __half*>(x);
        size_t shm8 = size_t(8) * kProjRows * l.ncp * 4, shm4 = size_t(4) * kProjRows * l.ncp * 4;
        bool staged = (g_variant & 2) == 0;  // bit 1: fragments straight from global memory (run-2 kernel)
        if (D % (16 * 8) == 0 && l.ncp <= 32)
        {
            if (staged) sih_proj_wmma<8, 2, true><<<blocks, 256, shm8, stream>>>(xh, T, D, wc, l.ncp, W, R, small, scores, ax);
            else sih_proj_wmma<8, 2, false><<<blocks, 256, shm8, stream>>>(xh, T, D, wc, l.ncp, W, R, small, scores, ax);
        }
        else  // 4 warps keep static + dynamic shared memory under 48 KB for up to 96 columns
            sih_proj_wmma<4, kProjMaxTiles, true><<<blocks, 128, shm4, stream>>>(
                xh, T, D, wc, l.ncp, W, R, small, scores, ax);
    }
    else
    {
        int warps = 8, nc = W + R;
        unsigned blocks = unsigned((T + warps - 1) / warps);
        size_t shm = size_t(warps) * nc * sizeof(float);
        if (dtype == ZE_F16)
            sih_proj_generic<__half><<<blocks, warps * 32, shm, stream>>>(static_cast<const __half*>(x), T, D,
                reinterpret_cast<const __half*>(ws + l.wcat), nc, W, R, small, scores, ax);
        else
            sih_proj_generic<float><<<blocks, warps * 32, shm, stream>>>(static_cast<const float*>(x), T, D,
                reinterpret_cast<const float*>(ws + l.wcat), nc, W, R, small, scores, ax);
    }
    if (int e = last_error()) return e;
    if (stop_after() == 2) return 0;

    DecideArgs a;
    a.thr = p->threshold;
    a.w0 = p->ma_w0; a.w1 = p->ma_w1; a.w2 = p->ma_w2;
    a.n0 = p->ma_w0;
    a.n1 = float(double(p->ma_w0) + double(p->ma_w1));
    a.n2 = float(double(p->ma_w0) + double(p->ma_w1) + double(p->ma_w2));
    a.block_frac = p->block_frac;
    a.min_tokens = p->min_tokens; a.protect_first = p->protect_first; a.protect_last = p->protect_last;
    a.block_size = p->block_size;
    sih_decide<<<unsigned((T + 255) / 256), 256, 0, stream>>>(scores, T, a, keep);
    if (int e = last_error()) return e;
    if (stop_after() == 3) return 0;

    if (R == 0)
    {
        cudaError_t e = cudaMemsetAsync(base, 0, size_t(T) * D * esz, stream);
        return e == cudaSuccess ? 0 : int(e);
    }
    dim3 grid(unsigned((T + kBaseRows - 1) / kBaseRows), unsigned((D / 4 + kBaseThreads - 1) / kBaseThreads));
    if (dtype == ZE_F16)
        sih_base<__half><<<grid, kBaseThreads, 0, stream>>>(ax, keep, T, D, R, bt,
            static_cast<const __half*>(w->anchor_c), static_cast<__half*>(base));
    else
        sih_base<float><<<grid, kBaseThreads, 0, stream>>>(ax, keep, T, D, R, bt,
            static_cast<const float*>(w->anchor_c), static_cast<float*>(base));
    return last_error();
}

size_t ze_pad_gather_workspace_size(int64_t) { return 0; }

int ze_pad_gather(int dtype, const void* x, const int32_t* keep, int64_t T, int64_t D, void* xs, int32_t* idx,
    int32_t* count, void*, size_t, void* stream_)
{
    if (dtype != ZE_F32 && dtype != ZE_F16) return ZE_ERR_DTYPE;
    if (T < 0 || D < 1 || !count) return ZE_ERR_ARG;
    if (D % ZE_HIDDEN_MULTIPLE != 0) return ZE_ERR_SHAPE;
    cudaStream_t stream = static_cast<cudaStream_t>(stream_);
    if (T == 0)
    {
        cudaError_t e = cudaMemsetAsync(count, 0, sizeof(int32_t), stream);
        return e == cudaSuccess ? 0 : int(e);
    }
    if (!x || !keep || !xs || !idx) return ZE_ERR_ARG;
    if (!aligned(x, 16) || !aligned(xs, 16)) return ZE_ERR_ALIGN;
    pad_scan<<<1, 1024, 0, stream>>>(keep, T, idx, count);
    if (int e = last_error()) return e;
    int64_t vpr = D * (dtype == ZE_F16 ? 2 : 4) / 16;
    pad_gather_rows<<<copy_blocks(T), 256, 0, stream>>>(static_cast<const int4*>(x), idx, count, T, vpr,
        static_cast<int4*>(xs));
    return last_error();
}

size_t ze_pad_scatter_workspace_size(int64_t T) { return T > 0 ? align256(size_t(T) * 4) : 0; }

int ze_pad_scatter(int dtype, const void* base, const void* y, const int32_t* idx, int64_t T, int64_t K, int64_t D,
    void* out, void* workspace, size_t workspace_bytes, void* stream_)
{
    if (dtype != ZE_F32 && dtype != ZE_F16) return ZE_ERR_DTYPE;
    if (T < 0 || K < 0 || D < 1) return ZE_ERR_ARG;
    if (D % ZE_HIDDEN_MULTIPLE != 0) return ZE_ERR_SHAPE;
    if (T == 0) return 0;
    if (!base || !out || !workspace || (K > 0 && (!y || !idx))) return ZE_ERR_ARG;
    if (workspace_bytes < size_t(T) * 4) return ZE_ERR_ARG;
    if (!aligned(base, 16) || !aligned(out, 16) || (K > 0 && !aligned(y, 16))) return ZE_ERR_ALIGN;
    cudaStream_t stream = static_cast<cudaStream_t>(stream_);
    int32_t* inv = static_cast<int32_t*>(workspace);
    cudaError_t e = cudaMemsetAsync(inv, 0xff, size_t(T) * 4, stream);  // -1 everywhere
    if (e != cudaSuccess) return int(e);
    if (K > 0)
    {
        pad_inverse<<<unsigned((K + 255) / 256), 256, 0, stream>>>(idx, K, T, inv);
        if (int err = last_error()) return err;
    }
    int64_t vpr = D * (dtype == ZE_F16 ? 2 : 4) / 16;
    pad_merge_rows<<<copy_blocks(T), 256, 0, stream>>>(static_cast<const int4*>(base),
        static_cast<const int4*>(y), inv, T, vpr, static_cast<int4*>(out));
    return last_error();
}

} // extern "C"
