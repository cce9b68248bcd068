// Shared by zeroedge's onnxruntime CPU kernels (q4_linear.cc, q8_linear.cc, window_attention.cc,
// paged_attention.cc, block_offsets.cc, ops.cc).
#pragma once
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ZE_AVX2 1
#endif

namespace zeroedge_ort {

// bytes ahead of a weight or window stream to prefetch. Measured on a 2-thread x86 CPU: SmolLM2's 120
// Q4Linear products 1.5-1.8x faster with 8 KB than with none (512 B and 2 KB in between, 16-32 KB no
// better); 30 WindowAttention layers at 2048 slots 3-27 % faster.
constexpr int kPrefetch = 8192;

inline float half_to_float(uint16_t h) {
#ifdef ZE_AVX2
  return _cvtsh_ss(h);
#else
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0) {
    if (man == 0) { bits = sign; }
    else { exp = 127 - 15 + 1; while (!(man & 0x400)) { man <<= 1; --exp; } man &= 0x3FF; bits = sign | (exp << 23) | (man << 13); }
  } else if (exp == 31) { bits = sign | 0x7F800000u | (man << 13); }
  else { bits = sign | ((exp + 127 - 15) << 23) | (man << 13); }
  float f; std::memcpy(&f, &bits, 4); return f;
#endif
}

// A zeroed buffer for a kernel's packed weights, streamed once a step: 2 MB pages for 2 MB or more
// (fewer TLB misses on a long stream; a hint the kernel may ignore), plain 64-byte alignment below.
using PackedBuffer = std::unique_ptr<uint8_t, void (*)(void*)>;
inline PackedBuffer packed_buffer(size_t need, const char* op) {
  const size_t huge = 2u << 20, align = need >= huge ? huge : 64;
  const size_t total = (need + align - 1) / align * align;
  void* p = std::aligned_alloc(align, total);
  if (p == nullptr) ORT_CXX_API_THROW(std::string(op) + ": out of memory for the packed weights", ORT_FAIL);
  if (align == huge) madvise(p, total, MADV_HUGEPAGE);
  std::memset(p, 0, total);
  return PackedBuffer((uint8_t*)p, std::free);
}

// round to nearest even; overflow to inf, underflow through float16's subnormals to 0
inline uint16_t float_to_half(float f) {
#ifdef ZE_AVX2
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7FFFFFFF;
  if (ax >= 0x7F800000) return sign | 0x7C00 | (ax > 0x7F800000 ? 0x200 : 0);      // inf, nan
  if (ax >= 0x477FF000) return sign | 0x7C00;                                      // >= 65520: inf
  if (ax < 0x38800000) {                                                            // subnormal or 0
    float a; std::memcpy(&a, &ax, 4);
    return sign | (uint16_t)std::nearbyint(a * 16777216.f);                         // units of 2^-24
  }
  const uint32_t r = ax + 0x0FFF + ((ax >> 13) & 1);                                // round to nearest even
  return sign | (uint16_t)((r - 0x38000000) >> 13);
#endif
}

#ifdef ZE_AVX2
// e^x, 0 below -87 (and for -inf), clamped at 88: Cody-Waite reduction by ln 2, degree-6 Taylor on |r| <= ln2 / 2
inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.f);
  const __m256 valid = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), valid);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// e[0..n) = exp(e - m) (0 for -inf), m finite -> their sum, in one fixed order for a given n
inline float exp_sum(float* e, int64_t n, float m) {
  int64_t s = 0;
  float sum = 0.f;
#ifdef ZE_AVX2
  __m256 sv = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  for (; s + 8 <= n; s += 8) {
    const __m256 x = exp256(_mm256_sub_ps(_mm256_loadu_ps(e + s), mv));
    _mm256_storeu_ps(e + s, x);
    sv = _mm256_add_ps(sv, x);
  }
  sum = hsum(sv);
#endif
  for (; s < n; ++s) { e[s] = e[s] == -INFINITY ? 0.f : std::exp(e[s] - m); sum += e[s]; }
  return sum;
}

// Runs fn over tasks 0..n-1: on onnxruntime's threads when the work is large enough to pay for waking
// them (a parallel section is a sync point a preempted thread can stall), else in the calling thread.
// Which thread runs a task never changes what it computes.
constexpr double kSerialWork = 1 << 17;      // multiply-adds below which a call runs serially
inline void run_tasks(Ort::KernelContext& ctx, void (*fn)(void*, size_t), size_t n, void* arg, double work) {
  if (work < kSerialWork) {
    for (size_t t = 0; t < n; ++t) fn(arg, t);
  } else {
    ctx.ParallelFor(fn, n, 0, arg);
  }
}

// each kernel file adds its op to the library's domain (ops.cc)
void add_q4_linear(Ort::CustomOpDomain& domain);
void add_q8_linear(Ort::CustomOpDomain& domain);
void add_window_attention(Ort::CustomOpDomain& domain);
void add_paged_attention(Ort::CustomOpDomain& domain);
void add_block_offsets(Ort::CustomOpDomain& domain);

}  // namespace zeroedge_ort
