// zeroedge CUDA kernels for SIH and PAD (no TensorRT headers). See include/zeroedge_kernels.h.
//
// SIH runs as 3 launches: prep (the concatenated [w1; anchor a] operand), proj (one pass over x:
// the head's first layer and the anchor projection a @ x as one small GEMM on tensor cores for
// fp16, the whole [32, D] tile of x staged with cp.async, then the rest of the head per row), and
// decide + base (moving average, threshold, block rule, protections; then the anchor's
// up-projection b @ (a @ x) + c for skipped rows, zeros for kept, on tensor cores for fp16). On
// sm_90 the second and third launch with programmatic dependent launch, so each starts while its
// predecessor drains. PAD gather is a one-block ballot scan plus a row copy; PAD scatter builds the
// inverse of idx and writes every output row once (from y where kept, from base elsewhere).
#include "zeroedge_kernels.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

namespace {

constexpr int kProjRows = 32;   // rows per block of the tensor-core projection (two MMA row tiles)
constexpr int kProjWarps = 16;  // warps of that block; they split the hidden dimension
constexpr int kProjMaxTiles = (ZE_MAX_SIH_WIDTH + ZE_MAX_ANCHOR_RANK + 15) / 16;
constexpr int kBaseRows = 32;   // rows per block of decide + base
constexpr int kBaseWarps = 4;   // each warp writes 128 columns, 64 at a time
constexpr int kBaseCols = kBaseWarps * 128;
constexpr int kCcRows = 16;     // rows per block of the CUDA-core base (fp32, or R not a multiple of 16)
constexpr int kCcThreads = 128;

// Benchmark switches: bit 0 forces the generic (CUDA-core) projection for fp16; bit 1 launches
// without programmatic dependent launch; bit 2 forces the CUDA-core base for fp16; bits 8..11 = N > 0
// stop after stage N (1 prep, 2 projection) to time the stages by differences.
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

__device__ __forceinline__ int warp_sum_int(int v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// cp.async (sm_80+): 16 bytes global -> shared without registers; src_bytes 0 writes zeros.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes)
{
    unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Programmatic dependent launch (sm_90): a kernel launched with the attribute may start while its
// predecessor runs; pdl_wait() returns once the predecessor has finished and its writes are
// visible. Without the attribute (or below sm_90) both are no-ops.
__device__ __forceinline__ void pdl_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}

__host__ __device__ inline size_t align256(size_t n) { return (n + 255) & ~size_t(255); }

struct SihLayout {
    size_t scores, ax, wcat, total;
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
    l.total = off;
    return l;
}

int small_count(int W) { return 2 * W * W + 4 * W + 1; }

// wcat [ncp, D] (T): rows [0, W) = w1, [W, W+R) = anchor a, the rest zero.
template <typename T>
__global__ void sih_prep(ze_sih_weights w, int64_t D, int W, int R, int ncp, T* wcat)
{
    pdl_launch();
    const T* w1 = static_cast<const T*>(w.w1);
    const T* a = static_cast<const T*>(w.anchor_a);
    int64_t n = int64_t(ncp) * D;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    {
        int64_t j = i / D, k = i % D;
        T v = from_f<T>(0.f);
        if (j < W) v = w1[j * D + k];
        else if (j < W + R) v = a[(j - W) * D + k];
        wcat[i] = v;
    }
}

// The head's small weights as fp32 in shared memory: b1[W] w2[W*W] b2[W] w3[W*W] b3[W] w4[W] b4[1].
// Every thread of the block takes part; the caller synchronises.
template <typename T>
__device__ void load_small(const ze_sih_weights& w, int W, float* small)
{
    int n = 2 * W * W + 4 * W + 1;
    for (int q = threadIdx.x; q < n; q += blockDim.x)
    {
        const T* src;
        int o;
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
// Dynamic shared memory: [warps][nc] sums, then the head's small weights.
template <typename T>
__global__ void sih_proj_generic(const T* __restrict__ x, int64_t Tn, int64_t D, const T* __restrict__ wcat, int nc,
    int W, int R, ze_sih_weights hw, float* __restrict__ scores, float* __restrict__ ax)
{
    extern __shared__ float hs[];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    float* small = hs + nw * nc;
    pdl_launch();
    load_small<T>(hw, W, small);
    __syncthreads();
    pdl_wait();  // wcat comes from sih_prep
    int64_t row = int64_t(blockIdx.x) * nw + warp;
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

// Bytes of dynamic shared memory of sih_proj_tc: the x tile (later reused for the per-warp partial
// sums), then the head's small weights.
__host__ __device__ inline size_t proj_tc_region(int64_t D, int ncp)
{
    size_t xt = size_t(kProjRows) * size_t(D + 8) * 2, part = size_t(kProjWarps) * kProjRows * ncp * 4;
    return align256(xt > part ? xt : part);
}
size_t proj_tc_smem(int64_t D, int ncp, int W) { return proj_tc_region(D, ncp) + size_t(small_count(W)) * 4; }

// Tensor-core projection for fp16. A block owns 32 rows: the whole [32, D] tile of x goes into
// shared memory with cp.async at once (in two groups per warp, so the MMAs on the first half of a
// warp's k range overlap the arrival of the second), then 8 warps each multiply their 1/8 of D
// against the [ncp, D] weights (B fragments from L2, each used for both row tiles); partial sums
// meet in shared memory, then the head's tail runs per row.
template <int NT>
__global__ void __launch_bounds__(kProjWarps * 32, 1) sih_proj_tc(const __half* __restrict__ x, int64_t Tn, int64_t D,
    const __half* __restrict__ wcat, int ncp, int W, int R, ze_sih_weights hw, float* __restrict__ scores,
    float* __restrict__ ax)
{
    using namespace nvcuda;
    extern __shared__ __align__(128) unsigned char smem[];
    const int64_t ldx = D + 8;  // +16 bytes a row: consecutive rows start in different banks
    __half* xs = reinterpret_cast<__half*>(smem);
    float* small = reinterpret_cast<float*>(smem + proj_tc_region(D, ncp));
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int64_t row0 = int64_t(blockIdx.x) * kProjRows;
    int ks = int(D / 16);
    int s0 = warp * ks / kProjWarps, s1 = (warp + 1) * ks / kProjWarps, sm = (s0 + s1) / 2;
    auto issue = [&](int a, int b) {
        // the warp's [32, 16 * (b - a)] slice as 16-byte vectors; (r, c) stepped without divisions
        int nv = 2 * (b - a), r = lane / nv, c = lane % nv, dr = 32 / nv, dc = 32 % nv;
        const __half* src = x + row0 * D + 16 * a;
        while (r < kProjRows)
        {
            bool ok = row0 + r < Tn;
            cp_async16(xs + r * ldx + 16 * a + 8 * c, ok ? static_cast<const void*>(src + int64_t(r) * D + 8 * c) : x,
                       ok ? 16 : 0);
            c += dc;
            r += dr;
            if (c >= nv) { c -= nv; ++r; }
        }
        cp_async_commit();
    };
    issue(s0, sm);
    issue(sm, s1);
    pdl_launch();
    load_small<__half>(hw, W, small);
    pdl_wait();  // wcat comes from sih_prep

    int nt = ncp / 16;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c[2][NT];
#pragma unroll
    for (int n = 0; n < NT; ++n)
    {
        wmma::fill_fragment(c[0][n], 0.f);
        wmma::fill_fragment(c[1][n], 0.f);
    }
    auto mma_steps = [&](int a, int b) {
#pragma unroll 2
        for (int s = a; s < b; ++s)
        {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> f0, f1;
            wmma::load_matrix_sync(f0, xs + 16 * s, unsigned(ldx));
            wmma::load_matrix_sync(f1, xs + 16 * ldx + 16 * s, unsigned(ldx));
#pragma unroll
            for (int n = 0; n < NT; ++n)
            {
                if (n < nt)
                {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
                    wmma::load_matrix_sync(b, wcat + int64_t(n) * 16 * D + 16 * s, unsigned(D));
                    wmma::mma_sync(c[0][n], f0, b, c[0][n]);
                    wmma::mma_sync(c[1][n], f1, b, c[1][n]);
                }
            }
        }
    };
    cp_async_wait<1>();
    __syncwarp();
    mma_steps(s0, sm);
    cp_async_wait<0>();
    __syncwarp();
    mma_steps(sm, s1);
    __syncthreads();  // every warp is done with the x tile: its space takes the partial sums

    float* part = reinterpret_cast<float*>(smem);  // [warps][kProjRows][ncp]
    float* mine = part + size_t(warp) * kProjRows * ncp;
#pragma unroll
    for (int n = 0; n < NT; ++n)
    {
        if (n < nt)
        {
            wmma::store_matrix_sync(mine + n * 16, c[0][n], unsigned(ncp), wmma::mem_row_major);
            wmma::store_matrix_sync(mine + 16 * ncp + n * 16, c[1][n], unsigned(ncp), wmma::mem_row_major);
        }
    }
    __syncthreads();
    int nc = W + R;
    for (int i = threadIdx.x; i < kProjRows * nc; i += blockDim.x)
    {
        int r = i / nc, j = i % nc;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < kProjWarps; ++w) s += part[(size_t(w) * kProjRows + r) * ncp + j];
        part[size_t(r) * ncp + j] = s;  // row r of warp 0's area: only this thread reads or writes it now
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kProjRows * R; i += blockDim.x)
    {
        int r = i / R, j = i % R;
        if (row0 + r < Tn) ax[(row0 + r) * R + j] = part[size_t(r) * ncp + W + j];
    }
    if (threadIdx.x < kProjRows && row0 + threadIdx.x < Tn)
        scores[row0 + threadIdx.x] = sih_tail(&part[size_t(threadIdx.x) * ncp], small, W);
}

struct DecideArgs {
    float thr, w0, w1, w2, n0, n1, n2, block_frac, rate;
    int32_t min_tokens, protect_first, protect_last, block_size, rank_block;
    const int32_t* span;  // a chunk (ZeroEdgeSIHChunk): (first position, prompt length); nullptr: one pass
    const float* carry;   // ... and the raw scores of the two positions before it
};

// Where the rows sit in the prompt: row t is position start + t of an n-token prompt.
struct Place {
    int64_t start, n;
    const float* carry;
};

__device__ __forceinline__ Place place_of(const DecideArgs& a, int64_t Tn)
{
    if (!a.span) return Place{0, Tn, nullptr};
    return Place{int64_t(a.span[0]), int64_t(a.span[1]), a.carry};
}

// the raw score of row t (t >= -2): rows before the chunk come from the carry
__device__ __forceinline__ float score_at(const float* s, int64_t t, const Place& c)
{
    return t >= 0 ? s[t] : c.carry[2 + t];
}

// Same operation order as the PyTorch reference: (w0*s + w1*s1 + w2*s2) / norm, no contraction.
__device__ __forceinline__ float smoothed(const float* s, int64_t t, const DecideArgs& a, const Place& c)
{
    int64_t p = c.start + t;
    float num = __fmul_rn(a.w0, s[t]);
    float norm = a.n0;
    if (p >= 1) { num = __fadd_rn(num, __fmul_rn(a.w1, score_at(s, t - 1, c))); norm = a.n1; }
    else num = __fadd_rn(num, 0.f);
    if (p >= 2) { num = __fadd_rn(num, __fmul_rn(a.w2, score_at(s, t - 2, c))); norm = a.n2; }
    return __fdiv_rn(num, norm);
}

__device__ __forceinline__ int protect(int k, int64_t t, const DecideArgs& a, const Place& c)
{
    int64_t p = c.start + t;
    if (p < a.protect_first) k = 1;
    if (a.protect_last > 0 && p >= c.n - a.protect_last) k = 1;
    if (p >= c.n) k = 1;
    return k;
}

// a position the rank rule may skip: in the prompt and not protected
__device__ __forceinline__ bool skippable(int64_t t, const DecideArgs& a, const Place& c)
{
    int64_t p = c.start + t;
    return p >= a.protect_first && p < c.n - a.protect_last && p < c.n;
}

// The rank rule for row t: keep unless it ranks below its rank block's quota, floor(rate * n + 0.5) of
// the block's n skippable rows (rank: rows of the block scoring lower, or equal and earlier). The chunk
// starts on a rank block, so the block's rows are in it. O(rank_block) per row, from L2.
__device__ int rank_keep(const float* __restrict__ scores, int64_t Tn, int64_t t, const DecideArgs& a, const Place& c)
{
    if (!skippable(t, a, c)) return 1;
    int64_t first = (c.start + t) / a.rank_block * a.rank_block - c.start;
    int64_t b0 = first > 0 ? first : 0;
    int64_t b1 = first + a.rank_block < Tn ? first + a.rank_block : Tn;
    float si = smoothed(scores, t, a, c);
    int n = 0, below = 0;
    for (int64_t j = b0; j < b1; ++j)
    {
        if (!skippable(j, a, c)) continue;
        float sj = smoothed(scores, j, a, c);
        ++n;
        below += (sj < si) || (sj == si && j < t);
    }
    float quota = floorf(__fadd_rn(__fmul_rn(a.rate, float(n)), 0.5f));
    return float(below) >= quota ? 1 : 0;
}

// keep for rows [r0, r0 + nrows) into ks (shared; 1 past Tn), and into keep_out when given.
// Token and rank rules: a thread a row. Block rule: warp 0 counts each block's low tokens once.
__device__ void decide_rows(const float* __restrict__ scores, int64_t Tn, int64_t r0, int nrows, const DecideArgs& a,
    int* ks, int32_t* __restrict__ keep_out)
{
    Place c = place_of(a, Tn);
    if (a.rate >= 0.f && c.n >= a.min_tokens)
    {
        for (int r = threadIdx.x; r < nrows; r += blockDim.x)
        {
            int64_t t = r0 + r;
            int k = 1;
            if (t < Tn)
            {
                k = rank_keep(scores, Tn, t, a, c);
                if (keep_out) keep_out[t] = k;
            }
            ks[r] = k;
        }
        return;
    }
    if (a.block_size <= 0 || c.n < a.min_tokens)
    {
        for (int r = threadIdx.x; r < nrows; r += blockDim.x)
        {
            int64_t t = r0 + r;
            int k = 1;
            if (t < Tn)
            {
                k = c.n < a.min_tokens ? 1 : int(smoothed(scores, t, a, c) >= a.thr);
                k = protect(k, t, a, c);
                if (keep_out) keep_out[t] = k;
            }
            ks[r] = k;
        }
        return;
    }
    if (threadIdx.x >= 32) return;
    int lane = threadIdx.x;
    int64_t prev = -1;
    int low = 0;
    for (int r = 0; r < nrows; ++r)
    {
        int64_t t = r0 + r;
        if (t >= Tn)
        {
            if (lane == 0) ks[r] = 1;
            continue;
        }
        int64_t b0 = t / a.block_size * a.block_size;
        int64_t b1 = b0 + a.block_size < Tn ? b0 + a.block_size : Tn;
        if (b0 != prev)
        {
            int cnt = 0;
            for (int64_t j = b0 + lane; j < b1; j += 32) cnt += !(smoothed(scores, j, a, c) >= a.thr);
            low = warp_sum_int(cnt);
            prev = b0;
        }
        float frac = __fdiv_rn(float(low), float(b1 - b0));
        int k = protect(int(frac <= a.block_frac), t, a, c);
        if (lane == 0)
        {
            ks[r] = k;
            if (keep_out) keep_out[t] = k;
        }
    }
}

// Decide + base on tensor cores (fp16, R a multiple of 16): block = 32 rows x 512 columns.
// base = keep ? 0 : b @ ax + c. ax (fp32) is split into fp16 hi + lo parts, two MMAs each, so the
// product keeps ~fp32 accuracy; anchor b [D, R] is the col-major B operand (ld = R).
__global__ void __launch_bounds__(kBaseWarps * 32) sih_decide_base_tc(const float* __restrict__ scores,
    const float* __restrict__ ax, int64_t Tn, int64_t D, int R, DecideArgs a, const __half* __restrict__ bmat,
    const __half* __restrict__ cvec, int32_t* __restrict__ keep, __half* __restrict__ base)
{
    using namespace nvcuda;
    constexpr int LDA = ZE_MAX_ANCHOR_RANK + 8, LDS = 64 + 4;
    __shared__ __align__(32) __half ahi[kBaseRows * LDA];
    __shared__ __align__(32) __half alo[kBaseRows * LDA];
    __shared__ __align__(32) float stg[kBaseWarps][kBaseRows * LDS];
    __shared__ int ks[kBaseRows];
    __shared__ int any_skip;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int64_t r0 = int64_t(blockIdx.x) * kBaseRows;
    pdl_launch();
    pdl_wait();  // scores and ax come from the projection
    decide_rows(scores, Tn, r0, kBaseRows, a, ks, blockIdx.y == 0 ? keep : nullptr);
    for (int i = threadIdx.x; i < kBaseRows * R; i += blockDim.x)
    {
        int r = i / R, j = i % R;
        float v = r0 + r < Tn ? ax[(r0 + r) * R + j] : 0.f;
        __half h = __float2half_rn(v);
        ahi[r * LDA + j] = h;
        alo[r * LDA + j] = __float2half_rn(v - __half2float(h));
    }
    if (threadIdx.x == 0) any_skip = 0;
    __syncthreads();
    if (threadIdx.x < kBaseRows && ks[threadIdx.x] == 0) any_skip = 1;
    __syncthreads();
    float* st = stg[warp];
    for (int g = 0; g < 2; ++g)
    {
        int64_t cg = int64_t(blockIdx.y) * kBaseCols + warp * 128 + g * 64;
        if (cg >= D) break;
        if (any_skip)
        {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][4];
#pragma unroll
            for (int n = 0; n < 4; ++n)
            {
                wmma::fill_fragment(acc[0][n], 0.f);
                wmma::fill_fragment(acc[1][n], 0.f);
            }
            for (int kk = 0; kk < R; kk += 16)
            {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> h0, h1, l0, l1;
                wmma::load_matrix_sync(h0, ahi + kk, LDA);
                wmma::load_matrix_sync(h1, ahi + 16 * LDA + kk, LDA);
                wmma::load_matrix_sync(l0, alo + kk, LDA);
                wmma::load_matrix_sync(l1, alo + 16 * LDA + kk, LDA);
#pragma unroll
                for (int n = 0; n < 4; ++n)
                {
                    if (cg + 16 * n < D)
                    {
                        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
                        wmma::load_matrix_sync(b, bmat + (cg + 16 * n) * R + kk, unsigned(R));
                        wmma::mma_sync(acc[0][n], h0, b, acc[0][n]);
                        wmma::mma_sync(acc[0][n], l0, b, acc[0][n]);
                        wmma::mma_sync(acc[1][n], h1, b, acc[1][n]);
                        wmma::mma_sync(acc[1][n], l1, b, acc[1][n]);
                    }
                }
            }
#pragma unroll
            for (int n = 0; n < 4; ++n)
            {
                wmma::store_matrix_sync(st + n * 16, acc[0][n], LDS, wmma::mem_row_major);
                wmma::store_matrix_sync(st + 16 * LDS + n * 16, acc[1][n], LDS, wmma::mem_row_major);
            }
            __syncwarp();
        }
        // 32 rows x 64 columns as 8-column (16-byte) pieces, a row's 8 pieces from 8 neighbouring lanes
        for (int i = lane; i < kBaseRows * 8; i += 32)
        {
            int r = i >> 3, cc = (i & 7) * 8;
            int64_t t = r0 + r, d = cg + cc;
            if (t >= Tn || d >= D) continue;
            union { __half2 h[4]; int4 v; } o;
            if (!any_skip || ks[r])
                o.v = make_int4(0, 0, 0, 0);
            else
            {
                union { __half2 h[4]; int4 v; } cv;
                cv.v = *reinterpret_cast<const int4*>(cvec + d);
                float4 s0 = *reinterpret_cast<const float4*>(st + r * LDS + cc);
                float4 s1 = *reinterpret_cast<const float4*>(st + r * LDS + cc + 4);
                float2 c0 = __half22float2(cv.h[0]), c1 = __half22float2(cv.h[1]);
                float2 c2 = __half22float2(cv.h[2]), c3 = __half22float2(cv.h[3]);
                o.h[0] = __floats2half2_rn(s0.x + c0.x, s0.y + c0.y);
                o.h[1] = __floats2half2_rn(s0.z + c1.x, s0.w + c1.y);
                o.h[2] = __floats2half2_rn(s1.x + c2.x, s1.y + c2.y);
                o.h[3] = __floats2half2_rn(s1.z + c3.x, s1.w + c3.y);
            }
            *reinterpret_cast<int4*>(base + t * D + d) = o.v;
        }
        __syncwarp();
    }
}

// Decide + base on CUDA cores (fp32, or fp16 shapes the tensor-core kernel does not take):
// block = kCcRows rows x 4 * kCcThreads columns; a thread 4 columns of every row.
template <typename T>
__global__ void __launch_bounds__(kCcThreads) sih_decide_base_cc(const float* __restrict__ scores,
    const float* __restrict__ ax, int64_t Tn, int64_t D, int R, DecideArgs a, const T* __restrict__ bmat,
    const T* __restrict__ cvec, int32_t* __restrict__ keep, T* __restrict__ base)
{
    __shared__ float axs[kCcRows][ZE_MAX_ANCHOR_RANK];
    __shared__ int ks[kCcRows];
    __shared__ int any_skip;
    int64_t r0 = int64_t(blockIdx.x) * kCcRows;
    pdl_launch();
    pdl_wait();
    decide_rows(scores, Tn, r0, kCcRows, a, ks, blockIdx.y == 0 ? keep : nullptr);
    for (int i = threadIdx.x; i < kCcRows * R; i += blockDim.x)
    {
        int r = i / R, j = i % R;
        axs[r][j] = r0 + r < Tn ? ax[(r0 + r) * R + j] : 0.f;
    }
    if (threadIdx.x == 0) any_skip = 0;
    __syncthreads();
    if (threadIdx.x < kCcRows && ks[threadIdx.x] == 0) any_skip = 1;
    __syncthreads();
    int64_t d = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * 4;
    if (d >= D) return;
    float acc[kCcRows][4];
#pragma unroll
    for (int r = 0; r < kCcRows; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.f;
    if (any_skip && R > 0)
    {
        for (int j = 0; j < R; ++j)
        {
            float b0 = to_f(bmat[d * R + j]), b1 = to_f(bmat[(d + 1) * R + j]);
            float b2 = to_f(bmat[(d + 2) * R + j]), b3 = to_f(bmat[(d + 3) * R + j]);
#pragma unroll
            for (int r = 0; r < kCcRows; ++r)
            {
                float v = axs[r][j];
                acc[r][0] += v * b0; acc[r][1] += v * b1; acc[r][2] += v * b2; acc[r][3] += v * b3;
            }
        }
    }
    float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
    if (R > 0) { c0 = to_f(cvec[d]); c1 = to_f(cvec[d + 1]); c2 = to_f(cvec[d + 2]); c3 = to_f(cvec[d + 3]); }
#pragma unroll
    for (int r = 0; r < kCcRows; ++r)
    {
        if (r0 + r >= Tn) break;
        T* o = base + (r0 + r) * D + d;
        if (ks[r] || R == 0) store4(o, 0.f, 0.f, 0.f, 0.f);
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
    pdl_launch();
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
    pdl_wait();  // idx and count come from pad_scan
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

__global__ void pad_fill(int32_t* __restrict__ inv, int64_t Tn, int32_t v)
{
    pdl_launch();
    for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < Tn; t += int64_t(gridDim.x) * blockDim.x)
        inv[t] = v;
}

__global__ void pad_inverse(const int32_t* __restrict__ idx, int64_t K, int64_t Tn, int32_t* __restrict__ inv)
{
    pdl_launch();
    pdl_wait();  // inv is filled with -1 first
    int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (k >= K) return;
    int64_t t = idx[k];
    if (t >= 0 && t < Tn) inv[t] = int32_t(k);
}

__global__ void pad_merge_rows(const int4* __restrict__ base, const int4* __restrict__ y, const int32_t* __restrict__ inv,
    int64_t Tn, int64_t vec_per_row, int4* __restrict__ out)
{
    pdl_wait();  // inv is complete
    int lane = threadIdx.x & 31;
    int64_t nwarps = int64_t(gridDim.x) * (blockDim.x >> 5);
    for (int64_t t = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); t < Tn; t += nwarps)
    {
        int64_t k = inv[t];
        copy_row(k >= 0 ? y + k * vec_per_row : base + t * vec_per_row, out + t * vec_per_row, vec_per_row, lane);
    }
}

bool aligned(const void* p, size_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; }

// Launch with or without programmatic dependent launch (the kernel's pdl_wait guards its inputs).
template <typename... KArgs, typename... Args>
cudaError_t launch(void (*kern)(KArgs...), dim3 grid, dim3 block, size_t shm, cudaStream_t s, bool pdl, Args... args)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = shm;
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    cudaError_t e = cudaLaunchKernelEx(&cfg, kern, static_cast<KArgs>(args)...);
    return e != cudaSuccess ? e : cudaGetLastError();
}

int device_major()
{
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    return major;
}

size_t max_smem_optin()
{
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 0;
    cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    return size_t(v);
}

// blocks of 256 threads, one warp per row
unsigned copy_blocks(int64_t rows)
{
    int64_t b = (rows + 7) / 8;
    return unsigned(b < 1 ? 1 : (b > 65535 * 16 ? 65535 * 16 : b));
}

// carry_out = the raw scores of the chunk's last two rows (rows before it from the carry)
__global__ void sih_carry_out(const float* __restrict__ scores, int64_t Tn, const float* __restrict__ carry,
    float* __restrict__ carry_out)
{
    if (threadIdx.x < 2)
    {
        int64_t t = Tn - 2 + threadIdx.x;
        carry_out[threadIdx.x] = t >= 0 ? scores[t] : carry[2 + t];
    }
}

int sih_forward(int dtype, const void* x, int64_t T, int64_t D, int32_t W, const ze_sih_weights* w,
    const ze_sih_params* p, const float* carry, const int32_t* span, int32_t* keep, void* base, float* carry_out,
    float* scores_out, void* workspace, size_t workspace_bytes, void* stream_);

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

// For benchmarks: bit 0 generic projection for fp16 too, bit 1 no programmatic dependent launch,
// bit 2 CUDA-core base for fp16, bits 8..11 stop after stage N; 0 restores the automatic choice.
void ze_sih_set_variant(int v) { g_variant = v; }

size_t ze_sih_workspace_size(int64_t T, int64_t D, int32_t W, int32_t R, int dtype)
{
    if (T < 0 || D < 0 || W < 1 || R < 0) return 0;
    return sih_layout(T, D, W, R, dtype).total;
}

int ze_sih_forward(int dtype, const void* x, int64_t T, int64_t D, int32_t W, const ze_sih_weights* w,
    const ze_sih_params* p, int32_t* keep, void* base, float* scores_out, void* workspace, size_t workspace_bytes,
    void* stream)
{
    return sih_forward(dtype, x, T, D, W, w, p, nullptr, nullptr, keep, base, nullptr, scores_out, workspace,
        workspace_bytes, stream);
}

int ze_sih_chunk_forward(int dtype, const void* x, int64_t T, int64_t D, int32_t W, const ze_sih_weights* w,
    const ze_sih_params* p, const float* carry, const int32_t* span, int32_t* keep, void* base, float* carry_out,
    float* scores_out, void* workspace, size_t workspace_bytes, void* stream)
{
    if (!carry || !span || !carry_out) return ZE_ERR_ARG;
    return sih_forward(dtype, x, T, D, W, w, p, carry, span, keep, base, carry_out, scores_out, workspace,
        workspace_bytes, stream);
}

} // extern "C"

namespace
{

int sih_forward(int dtype, const void* x, int64_t T, int64_t D, int32_t W, const ze_sih_weights* w,
    const ze_sih_params* p, const float* carry, const int32_t* span, int32_t* keep, void* base, float* carry_out,
    float* scores_out, void* workspace, size_t workspace_bytes, void* stream_)
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
    ze_sih_weights wz = *w;
    if (R == 0) wz.anchor_a = wz.anchor_b = wz.anchor_c = nullptr;
    bool pdl = (g_variant & 2) == 0 && device_major() >= 9;

    // 1. prep: the concatenated [w1; a] operand of the projection
    int64_t prep_n = int64_t(l.ncp) * D;
    unsigned prep_blocks = unsigned((prep_n + 255) / 256 < 1024 ? (prep_n + 255) / 256 : 1024);
    cudaError_t e;
    if (dtype == ZE_F16)
        e = launch(sih_prep<__half>, dim3(prep_blocks), dim3(256), 0, stream, false, wz, D, W, R, l.ncp,
                   reinterpret_cast<__half*>(ws + l.wcat));
    else
        e = launch(sih_prep<float>, dim3(prep_blocks), dim3(256), 0, stream, false, wz, D, W, R, l.ncp,
                   reinterpret_cast<float*>(ws + l.wcat));
    if (e != cudaSuccess) return int(e);
    if (stop_after() == 1) return 0;

    // 2. projection and the head: scores [T], ax [T, R]
    size_t tc_smem = proj_tc_smem(D, l.ncp, W);
    bool tc = dtype == ZE_F16 && (g_variant & 1) == 0 && D % 16 == 0 && D / 16 >= 2 * kProjWarps
        && tc_smem <= max_smem_optin();
    if (tc)
    {
        dim3 grid(unsigned((T + kProjRows - 1) / kProjRows));
        const __half* wc = reinterpret_cast<const __half*>(ws + l.wcat);
        const __half* xh = static_cast<const __half*>(x);
        if (l.ncp <= 32)
        {
            cudaFuncSetAttribute(sih_proj_tc<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(tc_smem));
            e = launch(sih_proj_tc<2>, grid, dim3(kProjWarps * 32), tc_smem, stream, pdl, xh, T, D, wc, l.ncp, W, R,
                       wz, scores, ax);
        }
        else
        {
            cudaFuncSetAttribute(sih_proj_tc<kProjMaxTiles>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(tc_smem));
            e = launch(sih_proj_tc<kProjMaxTiles>, grid, dim3(kProjWarps * 32), tc_smem, stream, pdl, xh, T, D, wc,
                       l.ncp, W, R, wz, scores, ax);
        }
    }
    else
    {
        int warps = 8, nc = W + R;
        dim3 grid(unsigned((T + warps - 1) / warps));
        size_t shm = size_t(warps) * nc * 4 + size_t(small_count(W)) * 4;
        if (dtype == ZE_F16)
            e = launch(sih_proj_generic<__half>, grid, dim3(warps * 32), shm, stream, pdl,
                       static_cast<const __half*>(x), T, D, reinterpret_cast<const __half*>(ws + l.wcat), nc, W, R,
                       wz, scores, ax);
        else
            e = launch(sih_proj_generic<float>, grid, dim3(warps * 32), shm, stream, pdl,
                       static_cast<const float*>(x), T, D, reinterpret_cast<const float*>(ws + l.wcat), nc, W, R,
                       wz, scores, ax);
    }
    if (e != cudaSuccess) return int(e);
    if (stop_after() == 2) return 0;

    // 3. decide (keep) and base
    DecideArgs a;
    a.thr = p->threshold;
    a.w0 = p->ma_w0; a.w1 = p->ma_w1; a.w2 = p->ma_w2;
    a.n0 = p->ma_w0;
    a.n1 = float(double(p->ma_w0) + double(p->ma_w1));
    a.n2 = float(double(p->ma_w0) + double(p->ma_w1) + double(p->ma_w2));
    a.block_frac = p->block_frac;
    a.rate = p->rate;
    a.rank_block = p->rank_block > 0 ? p->rank_block : 1;
    a.min_tokens = p->min_tokens; a.protect_first = p->protect_first; a.protect_last = p->protect_last;
    a.block_size = p->block_size;
    a.span = span;
    a.carry = carry;
    bool tc_base = dtype == ZE_F16 && (g_variant & 4) == 0 && R > 0 && R % 16 == 0 && D % 16 == 0
        && aligned(w->anchor_b, 32) && aligned(w->anchor_c, 16);
    if (tc_base)
    {
        dim3 grid(unsigned((T + kBaseRows - 1) / kBaseRows), unsigned((D + kBaseCols - 1) / kBaseCols));
        e = launch(sih_decide_base_tc, grid, dim3(kBaseWarps * 32), 0, stream, pdl, static_cast<const float*>(scores),
                   static_cast<const float*>(ax), T, D, R, a, static_cast<const __half*>(wz.anchor_b),
                   static_cast<const __half*>(wz.anchor_c), keep, static_cast<__half*>(base));
    }
    else
    {
        dim3 grid(unsigned((T + kCcRows - 1) / kCcRows), unsigned((D / 4 + kCcThreads - 1) / kCcThreads));
        if (dtype == ZE_F16)
            e = launch(sih_decide_base_cc<__half>, grid, dim3(kCcThreads), 0, stream, pdl,
                       static_cast<const float*>(scores), static_cast<const float*>(ax), T, D, R, a,
                       static_cast<const __half*>(wz.anchor_b), static_cast<const __half*>(wz.anchor_c), keep,
                       static_cast<__half*>(base));
        else
            e = launch(sih_decide_base_cc<float>, grid, dim3(kCcThreads), 0, stream, pdl,
                       static_cast<const float*>(scores), static_cast<const float*>(ax), T, D, R, a,
                       static_cast<const float*>(wz.anchor_b), static_cast<const float*>(wz.anchor_c), keep,
                       static_cast<float*>(base));
    }
    if (e == cudaSuccess && carry_out)
        e = launch(sih_carry_out, dim3(1), dim3(32), 0, stream, false, static_cast<const float*>(scores), T, carry,
                   carry_out);
    return e == cudaSuccess ? 0 : int(e);
}

} // namespace

extern "C" {

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
    bool pdl = (g_variant & 2) == 0 && device_major() >= 9;
    cudaError_t e = launch(pad_scan, dim3(1), dim3(1024), 0, stream, false, keep, T, idx, count);
    if (e != cudaSuccess) return int(e);
    int64_t vpr = D * (dtype == ZE_F16 ? 2 : 4) / 16;
    e = launch(pad_gather_rows, dim3(copy_blocks(T)), dim3(256), 0, stream, pdl, static_cast<const int4*>(x),
               static_cast<const int32_t*>(idx), static_cast<const int32_t*>(count), T, vpr, static_cast<int4*>(xs));
    return e == cudaSuccess ? 0 : int(e);
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
    bool pdl = (g_variant & 2) == 0 && device_major() >= 9;
    int64_t fb = (T + 255) / 256;
    cudaError_t e = launch(pad_fill, dim3(unsigned(fb < 1024 ? fb : 1024)), dim3(256), 0, stream, false, inv, T,
                           int32_t(-1));
    if (e != cudaSuccess) return int(e);
    if (K > 0)
    {
        e = launch(pad_inverse, dim3(unsigned((K + 255) / 256)), dim3(256), 0, stream, pdl, idx, K, T, inv);
        if (e != cudaSuccess) return int(e);
    }
    int64_t vpr = D * (dtype == ZE_F16 ? 2 : 4) / 16;
    e = launch(pad_merge_rows, dim3(copy_blocks(T)), dim3(256), 0, stream, pdl, static_cast<const int4*>(base),
               static_cast<const int4*>(y), static_cast<const int32_t*>(inv), T, vpr, static_cast<int4*>(out));
    return e == cudaSuccess ? 0 : int(e);
}

} // extern "C"
