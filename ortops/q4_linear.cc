// Q4Linear: y = x @ W for a 4-bit weight on MatMulNBits' grid, w = d * (q - 8) + c per block, from
// the initializers the portable graph already holds for MatMulNBits (and its side product):
//   x      float [M, K]
//   B      uint8 [N, kbB, bs / 2]   MatMulNBits' codes, bs = block_size (32, 64, 128 or 256; byte j of
//                                   a block: element 2j low, 2j+1 high), kbB = ceil(K / bs)
//   S      float16|float [N * kbB]  d of each block
//   3rd    optional, one of:
//          C float16|float [kbB, N]   the float zero point's offsets c = d * (8 - z) = m + 8 d (GGUF
//                                     Q4_1: w = d * q + m);
//          zero_points uint8 [N, ceil(kbB / 2)]   MatMulNBits' integer zero points z, two a byte, low
//                                     nibble first: c = d * (8 - z), computed once here;
//          absent: a symmetric grid (z = 8, c = 0).
//   y      float [M, N]
// y[n] = sum_b d[n,b] * sum_i (q_i - 8) x_i + c[b,n] * sum_i x_i. x is rounded per block of 32 to
// int16 (attr input_bits 16: 2^-15 of the block's largest value, as good as exact for perplexity) or
// to int8 (input_bits 8, the default for bundles that do not say: what MatMulNBits does at accuracy
// level 4, per block of 32 here, and llama.cpp's Q4_1 x Q8_1; ~1 % perplexity on SmolLM2); the block
// sums of x stay exact. c from integer zero points is rounded to S's dtype: with float16 S that is
// ~1e-4 of the output against MatMulNBits' exact d * (q - z), far below the 4-bit grid's own error.
// attr activation "swiglu": W is [gate | up] side by side and the output is silu(gate) * up, [M, N / 2].
//
// The weights must be constant (initializers). The kernel copies them once, when onnxruntime creates
// it, into one buffer laid out for the product (Packed), in blocks of 32 whatever bs is (a larger
// block's d and c repeated): rows in groups of 4, and per group every pair of blocks as [4 rows x 32
// code bytes], then the pairs' d and c as [block][4 rows], in S's dtype (c from integer zero points
// is rounded to it). A step then streams one contiguous buffer; the copy costs the weights' bytes
// once more in RAM (the graph's own copy, mapped from weights.bin, is not read again).
#include <cfloat>
#include <cstdlib>
#include <memory>
#include <string>

#include "ops.h"

namespace zeroedge_ort {
namespace {

constexpr int kBlock = 32, kRows = 4;

// One row of x, rounded per block, and per block, four times over (lane layout of a pair of blocks:
// b0 x4, b1 x4): the step dx, 8 * dx * sum(codes) (the "- 8" of every weight code) and the exact
// block sum. The codes' order follows the packed weights' (blocks in pairs; a last odd block alone):
//  - int8 (q8): per pair [b0 even, b1 even, b0 odd, b1 odd] elements, 16 each (B's low and high
//    nibbles); a last block [even, odd];
//  - int16 (q16): per pair four vectors k = 0..3 of [b0 elements 4i + k, b1 elements 4i + k], 8 each
//    (the four nibbles of a 16-bit word of B); a last block four vectors of 8.
struct QuantRow {
  bool wide = false;
  std::vector<int8_t> q8;
  std::vector<int16_t> q16;
  std::vector<float> dx4, xs84, sum4;

  // where element e of block b goes
  static int64_t at8(int64_t b, int64_t e, int64_t kb) {
    const bool paired = (b | 1) < kb;
    return (b & ~int64_t(1)) * kBlock + (paired && (b & 1) ? 16 : 0) + (e & 1) * (paired ? 32 : 16) + e / 2;
  }
  static int64_t at16(int64_t b, int64_t e, int64_t kb) {
    const bool paired = (b | 1) < kb;
    return (b & ~int64_t(1)) * kBlock + (paired ? (e & 3) * 16 + (b & 1) * 8 : (e & 3) * 8) + e / 4;
  }
  void fill(const float* x, int64_t K, int64_t kb, bool wide_) {
    wide = wide_;
    if (wide) q16.assign(kb * kBlock, 0);
    else q8.assign(kb * kBlock, 0);
    dx4.assign(kb * 4, 0.f);
    xs84.assign(kb * 4, 0.f);
    sum4.assign(kb * 4, 0.f);
    const float top = wide ? 32767.f : 127.f;
    for (int64_t b = 0; b < kb; ++b) {
      float v[kBlock] = {0};
      const int64_t n = std::min<int64_t>(kBlock, K - b * kBlock);
      std::memcpy(v, x + b * kBlock, n * sizeof(float));
      float amax = 0.f, s = 0.f;
      for (int i = 0; i < kBlock; ++i) { amax = std::max(amax, std::fabs(v[i])); s += v[i]; }
      float d = amax / top, inv = d > 0.f ? 1.f / d : 0.f;
      if (!(inv <= FLT_MAX)) d = inv = 0.f;       // a step below float's range: the block rounds to 0
      int64_t qs = 0;
      for (int e = 0; e < kBlock; ++e) {
        const int c = (int)std::lrint(v[e] * inv);
        if (wide) qs += q16[at16(b, e, kb)] = (int16_t)c;
        else qs += q8[at8(b, e, kb)] = (int8_t)c;
      }
      for (int j = 0; j < 4; ++j) {
        dx4[b * 4 + j] = d;
        xs84[b * 4 + j] = 8.f * (float)qs * d;
        sum4[b * 4 + j] = s;
      }
    }
  }
  // sum of codes x rounded x over block b, for one row's 16 code bytes of that block
  int32_t dot(const uint8_t* code, int64_t b, int64_t kb) const {
    int32_t s = 0;
    if (wide) {
      const int16_t* x = q16.data() + at16(b, 0, kb);
      const int64_t stride = at16(b, 1, kb) - at16(b, 0, kb);        // between elements 4i and 4i + 1
      for (int i = 0; i < kBlock / 4; ++i) {
        const int w = code[2 * i] | code[2 * i + 1] << 8;
        for (int k = 0; k < 4; ++k) s += ((w >> 4 * k) & 0x0F) * x[k * stride + i];
      }
    } else {
      const int8_t *even = q8.data() + at8(b, 0, kb), *odd = q8.data() + at8(b, 1, kb);
      for (int i = 0; i < kBlock / 2; ++i) s += (code[i] & 0x0F) * even[i] + (code[i] >> 4) * odd[i];
    }
    return s;
  }
};

// The weights in the product's order (see the file's comment); d and C stay in the graph's dtype.
struct Packed {
  int64_t N = 0, kb = 0, groups = 0;
  bool half = true;
  PackedBuffer buf{nullptr, std::free};
  size_t group_bytes = 0, codes_bytes = 0, elt = 2;

  const uint8_t* codes(int64_t g) const { return buf.get() + g * group_bytes; }
  const uint8_t* scales(int64_t g) const { return codes(g) + codes_bytes; }               // d [kb][4]
  const uint8_t* offsets(int64_t g) const { return scales(g) + kb * kRows * elt; }        // C [kb][4]

  // Where the weights come from: MatMulNBits' B and S with blocks of bs, and c as given (C [kbB, N]),
  // from integer zero points (zp [N, ceil(kbB / 2)]), or 0.
  struct Source {
    const uint8_t* B;
    const void* S;
    const void* C = nullptr;
    const uint8_t* zp = nullptr;
    int64_t bs = 32, kbB = 0;
  };

  void pack(const Source& src, int64_t n_, int64_t kb_, bool half_) {
    N = n_, kb = kb_, half = half_, elt = half ? 2 : 4;
    groups = (N + kRows - 1) / kRows;
    codes_bytes = kb * kRows * 16;
    group_bytes = codes_bytes + 2 * kb * kRows * elt;
    group_bytes = (group_bytes + 63) / 64 * 64;
    buf = packed_buffer(groups * group_bytes, "Q4Linear");
    const int64_t pairs = kb / 2, per = src.bs / kBlock, zrow = (src.kbB + 1) / 2;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t g = n / kRows, j = n % kRows;
      uint8_t* c = buf.get() + g * group_bytes;
      for (int64_t b = 0; b < kb; ++b) {
        const int64_t sb = b / per;          // the source block
        const int64_t at = b < 2 * pairs ? (b / 2) * kRows * 32 + j * 32 + (b % 2) * 16 : pairs * kRows * 32 + j * 16;
        std::memcpy(c + at, src.B + (n * src.kbB + sb) * (src.bs / 2) + (b % per) * 16, 16);
        uint8_t* d_at = c + codes_bytes + (b * kRows + j) * elt;
        uint8_t* c_at = c + codes_bytes + (kb * kRows + b * kRows + j) * elt;
        std::memcpy(d_at, (const uint8_t*)src.S + (n * src.kbB + sb) * elt, elt);
        if (src.C != nullptr) {
          std::memcpy(c_at, (const uint8_t*)src.C + (sb * N + n) * elt, elt);
        } else if (src.zp != nullptr) {
          const int z = (src.zp[n * zrow + sb / 2] >> (4 * (sb % 2))) & 0x0F;
          const float off = (half ? half_to_float(*(const uint16_t*)d_at) : *(const float*)d_at) * (float)(8 - z);
          if (half) { const uint16_t h = float_to_half(off); std::memcpy(c_at, &h, 2); }
          else std::memcpy(c_at, &off, 4);
        }                                     // else c = 0 (the buffer is zeroed)
      }
    }
  }
};

struct Work {
  const QuantRow* row;
  const Packed* w;
  int64_t chunk;        // groups a task
  float* y;
};

template <bool HALF>
inline float load_scalar(const uint8_t* p, int64_t i) {
  if (HALF) return half_to_float(((const uint16_t*)p)[i]);
  return ((const float*)p)[i];
}

#ifdef ZE_AVX2
// eight values of d or C (HALF: float16) as floats
template <bool HALF>
inline __m256 load8(const uint8_t* p) {
  if (HALF) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
  return _mm256_loadu_ps((const float*)p);
}
template <bool HALF>
inline __m128 load4(const uint8_t* p) {
  if (HALF) return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)p));
  return _mm_loadu_ps((const float*)p);
}
#endif

#ifdef ZE_AVX2
// one row's 32 code bytes of a pair of blocks times the pair's rounded x: 8 int32 partial sums, lanes
// 0-3 block b0's, 4-7 block b1's
inline __m256i pair_dot8(__m256i raw, const __m256i* x) {       // x: [even, odd] int8
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(raw, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
  const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x[0]), _mm256_maddubs_epi16(hi, x[1]));
  return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
}
inline __m256i pair_dot16(__m256i raw, const __m256i* x) {      // x: the four int16 vectors
  const __m256i m = _mm256_set1_epi16(0x000F);
  const __m256i n0 = _mm256_and_si256(raw, m), n1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m),
                n2 = _mm256_and_si256(_mm256_srli_epi16(raw, 8), m), n3 = _mm256_srli_epi16(raw, 12);
  return _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(n0, x[0]), _mm256_madd_epi16(n1, x[1])),
                          _mm256_add_epi32(_mm256_madd_epi16(n2, x[2]), _mm256_madd_epi16(n3, x[3])));
}
// the same for a last block alone (16 code bytes): 4 int32 partial sums of that block
inline __m128i block_dot8(__m128i raw, const __m256i* x) {      // x: [even | odd] in one vector
  const __m128i m = _mm_set1_epi8(0x0F);
  const __m256i wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m), _mm_and_si128(raw, m));
  const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, x[0]), _mm256_set1_epi16(1));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}
inline __m128i block_dot16(__m128i raw, const __m128i* x) {
  const __m128i m = _mm_set1_epi16(0x000F);
  const __m128i n0 = _mm_and_si128(raw, m), n1 = _mm_and_si128(_mm_srli_epi16(raw, 4), m),
                n2 = _mm_and_si128(_mm_srli_epi16(raw, 8), m), n3 = _mm_srli_epi16(raw, 12);
  return _mm_add_epi32(_mm_add_epi32(_mm_madd_epi16(n0, x[0]), _mm_madd_epi16(n1, x[1])),
                       _mm_add_epi32(_mm_madd_epi16(n2, x[2]), _mm_madd_epi16(n3, x[3])));
}
#endif

template <bool HALF, bool WIDE>
void groups_task(const Work& t, size_t c) {
  const Packed& w = *t.w;
  const QuantRow& r = *t.row;
  const int64_t kb = w.kb, pairs = kb / 2;
  const int64_t g0 = (int64_t)c * t.chunk, g1 = std::min(w.groups, g0 + t.chunk);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t *codes = w.codes(g), *sc = w.scales(g), *off = w.offsets(g);
    float y4[kRows];
    int64_t b = 0;
#ifdef ZE_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0, corr = acc0, offs = acc0;
    const __m256i p0 = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4), p1 = _mm256_setr_epi32(1, 1, 1, 1, 5, 5, 5, 5),
                  p2 = _mm256_setr_epi32(2, 2, 2, 2, 6, 6, 6, 6), p3 = _mm256_setr_epi32(3, 3, 3, 3, 7, 7, 7, 7);
    for (int64_t p = 0; p < pairs; ++p, b += 2) {
      __m256i x[4];
      for (int k = 0; k < (WIDE ? 4 : 2); ++k)
        x[k] = WIDE ? _mm256_loadu_si256((const __m256i*)(r.q16.data() + b * kBlock + k * 16))
                    : _mm256_loadu_si256((const __m256i*)(r.q8.data() + b * kBlock + k * 32));
      const __m256 d = load8<HALF>(sc + b * kRows * w.elt);                 // [b: rows 0-3, b + 1: rows 0-3]
      const __m256 dd = _mm256_mul_ps(d, _mm256_loadu_ps(&r.dx4[b * 4]));
      corr = _mm256_fmadd_ps(d, _mm256_loadu_ps(&r.xs84[b * 4]), corr);
      offs = _mm256_fmadd_ps(load8<HALF>(off + b * kRows * w.elt), _mm256_loadu_ps(&r.sum4[b * 4]), offs);
      const uint8_t* cp = codes + p * kRows * 32;
      _mm_prefetch((const char*)cp + kPrefetch, _MM_HINT_T0);
      _mm_prefetch((const char*)cp + kPrefetch + 64, _MM_HINT_T0);
#define ZE_ROW(J, ACC, PERM)                                                                              \
      {                                                                                                     \
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(cp + J * 32));                              \
        const __m256i s = WIDE ? pair_dot16(raw, x) : pair_dot8(raw, x);                                   \
        ACC = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_permutevar8x32_ps(dd, PERM), ACC);             \
      }
      ZE_ROW(0, acc0, p0) ZE_ROW(1, acc1, p1) ZE_ROW(2, acc2, p2) ZE_ROW(3, acc3, p3)
#undef ZE_ROW
    }
    if (b < kb) {                            // a last block of its own: [4 rows x 16 bytes]
      __m256i x8[1];
      __m128i x16[4];
      if (WIDE) for (int k = 0; k < 4; ++k) x16[k] = _mm_loadu_si128((const __m128i*)(r.q16.data() + b * kBlock + k * 8));
      else x8[0] = _mm256_loadu_si256((const __m256i*)(r.q8.data() + b * kBlock));
      const __m128 d = load4<HALF>(sc + b * kRows * w.elt);
      const __m128 dd = _mm_mul_ps(d, _mm_set1_ps(r.dx4[b * 4]));
      float ddv[4];
      _mm_storeu_ps(ddv, dd);
      corr = _mm256_add_ps(corr, _mm256_zextps128_ps256(_mm_mul_ps(d, _mm_set1_ps(r.xs84[b * 4]))));
      offs = _mm256_add_ps(offs, _mm256_zextps128_ps256(_mm_mul_ps(load4<HALF>(off + b * kRows * w.elt), _mm_set1_ps(r.sum4[b * 4]))));
      const uint8_t* cp = codes + pairs * kRows * 32;
      __m256* accs[4] = {&acc0, &acc1, &acc2, &acc3};
      for (int j = 0; j < kRows; ++j) {
        const __m128i raw = _mm_loadu_si128((const __m128i*)(cp + j * 16));
        const __m128i s = WIDE ? block_dot16(raw, x16) : block_dot8(raw, x8);
        *accs[j] = _mm256_add_ps(*accs[j], _mm256_zextps128_ps256(_mm_mul_ps(_mm_cvtepi32_ps(s), _mm_set1_ps(ddv[j]))));
      }
      b = kb;
    }
    // per row: the codes' sum, minus the "- 8" terms, plus the offsets (lanes j and 4 + j of corr / offs)
    const __m128 rest = _mm_sub_ps(_mm_add_ps(_mm256_castps256_ps128(offs), _mm256_extractf128_ps(offs, 1)),
                                   _mm_add_ps(_mm256_castps256_ps128(corr), _mm256_extractf128_ps(corr, 1)));
    float rv[4];
    _mm_storeu_ps(rv, rest);
    y4[0] = hsum(acc0) + rv[0], y4[1] = hsum(acc1) + rv[1], y4[2] = hsum(acc2) + rv[2], y4[3] = hsum(acc3) + rv[3];
#else
    for (int j = 0; j < kRows; ++j) y4[j] = 0.f;
#endif
    for (; b < kb; ++b) {                    // the portable path (all blocks where there is no AVX2)
      const bool paired = (b | 1) < kb;
      for (int j = 0; j < kRows; ++j) {
        const uint8_t* code = codes + (paired ? (b / 2) * kRows * 32 + j * 32 + (b % 2) * 16 : pairs * kRows * 32 + j * 16);
        const float d = load_scalar<HALF>(sc, b * kRows + j);
        y4[j] += d * ((float)r.dot(code, b, kb) * r.dx4[b * 4] - r.xs84[b * 4]) + load_scalar<HALF>(off, b * kRows + j) * r.sum4[b * 4];
      }
    }
    const int64_t rows = std::min<int64_t>(kRows, w.N - g * kRows);
    for (int j = 0; j < rows; ++j) t.y[g * kRows + j] = y4[j];
  }
}

void groups_task_any(void* p, size_t c) {
  const Work& t = *(const Work*)p;
  if (t.w->half) t.row->wide ? groups_task<true, true>(t, c) : groups_task<true, false>(t, c);
  else t.row->wide ? groups_task<false, true>(t, c) : groups_task<false, false>(t, c);
}

struct Q4LinearKernel {
  int64_t K, N;
  bool swiglu, wide;
  Packed packed;
  Q4LinearKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    K = ki.GetAttribute<int64_t>("K");
    N = ki.GetAttribute<int64_t>("N");
    if (K < 1 || N < 1) ORT_CXX_API_THROW("Q4Linear: K and N must be >= 1", ORT_INVALID_ARGUMENT);
    const int64_t bs = ki.GetAttribute<int64_t>("block_size");
    if (bs != 32 && bs != 64 && bs != 128 && bs != 256)
      ORT_CXX_API_THROW("Q4Linear: block_size must be 32, 64, 128 or 256", ORT_INVALID_ARGUMENT);
    std::string act;
    try { act = ki.GetAttribute<std::string>("activation"); } catch (const Ort::Exception&) {}
    if (act != "" && act != "swiglu") ORT_CXX_API_THROW("Q4Linear: activation must be swiglu or absent", ORT_INVALID_ARGUMENT);
    swiglu = act == "swiglu";
    int64_t bits = 8;
    try { bits = ki.GetAttribute<int64_t>("input_bits"); } catch (const Ort::Exception&) {}
    if (bits != 8 && bits != 16) ORT_CXX_API_THROW("Q4Linear: input_bits must be 8 or 16", ORT_INVALID_ARGUMENT);
    wide = bits == 16;
    if (swiglu && N % 2) ORT_CXX_API_THROW("Q4Linear: swiglu needs an even N", ORT_INVALID_ARGUMENT);
    const bool has_offsets = ki.GetInputCount() > 3;
    int constant[3] = {0, 0, 1};
    Ort::ConstValue B = ki.GetTensorConstantInput(1, &constant[0]), S = ki.GetTensorConstantInput(2, &constant[1]);
    Ort::ConstValue O{nullptr};
    if (has_offsets) O = ki.GetTensorConstantInput(3, &constant[2]);
    if (!constant[0] || !constant[1] || !constant[2])
      ORT_CXX_API_THROW("Q4Linear: B, S and the offsets must be initializers", ORT_INVALID_ARGUMENT);
    Packed::Source src{B.GetTensorData<uint8_t>(), S.GetTensorRawData()};
    src.bs = bs, src.kbB = (K + bs - 1) / bs;
    const auto st = S.GetTensorTypeAndShapeInfo(), bt = B.GetTensorTypeAndShapeInfo();
    const auto et = st.GetElementType();
    bool ok = (et == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 || et == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) &&
              bt.GetElementType() == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 &&
              st.GetElementCount() == (size_t)(N * src.kbB) && bt.GetElementCount() == (size_t)(N * src.kbB * bs / 2);
    if (has_offsets) {
      const auto ot = O.GetTensorTypeAndShapeInfo();
      if (ot.GetElementType() == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8) {
        ok = ok && ot.GetElementCount() == (size_t)(N * ((src.kbB + 1) / 2));
        src.zp = O.GetTensorData<uint8_t>();
      } else {
        ok = ok && ot.GetElementType() == et && ot.GetElementCount() == (size_t)(N * src.kbB);
        src.C = O.GetTensorRawData();
      }
    }
    if (!ok) ORT_CXX_API_THROW("Q4Linear: B / S / offsets do not match K, N, block_size", ORT_INVALID_ARGUMENT);
    packed.pack(src, N, (K + kBlock - 1) / kBlock, et == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16);
  }
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto X = ctx.GetInput(0);
    auto xshape = X.GetTensorTypeAndShapeInfo().GetShape();
    if (xshape.empty() || xshape.back() != K) ORT_CXX_API_THROW("Q4Linear: x's last dimension is not K", ORT_INVALID_ARGUMENT);
    const int64_t out_n = swiglu ? N / 2 : N;
    std::vector<int64_t> yshape(xshape);
    yshape.back() = out_n;
    auto Y = ctx.GetOutput(0, yshape);
    const int64_t M = X.GetTensorTypeAndShapeInfo().GetElementCount() / K;
    const float* x = X.GetTensorData<float>();
    float* y = Y.GetTensorMutableData<float>();
    std::vector<float> full(swiglu ? N : 0);
    QuantRow row;
    const int64_t chunk = std::max<int64_t>(16, (packed.groups + 3) / 4);   // a quarter of the rows a task
    for (int64_t m = 0; m < M; ++m) {
      row.fill(x + m * K, K, packed.kb, wide);
      float* ym = swiglu ? full.data() : y + m * N;
      Work w{&row, &packed, chunk, ym};
      ctx.ParallelFor(groups_task_any, (size_t)((packed.groups + chunk - 1) / chunk), 0, &w);
      if (swiglu) {
        float* o = y + m * out_n;
        int64_t n = 0;
#ifdef ZE_AVX2
        const __m256 one = _mm256_set1_ps(1.f);
        for (; n + 8 <= out_n; n += 8) {
          const __m256 gate = _mm256_loadu_ps(ym + n);
          const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gate))));
          _mm256_storeu_ps(o + n, _mm256_mul_ps(_mm256_mul_ps(gate, sig), _mm256_loadu_ps(ym + n + out_n)));
        }
#endif
        for (; n < out_n; ++n) o[n] = ym[n] / (1.f + std::exp(-ym[n])) * ym[n + out_n];
      }
    }
  }
};

struct Q4LinearOp : Ort::CustomOpBase<Q4LinearOp, Q4LinearKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Q4LinearKernel(api, info); }
  const char* GetName() const { return "Q4Linear"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 4; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
         : i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

void add_q4_linear(Ort::CustomOpDomain& domain) {
  static Q4LinearOp op;
  domain.Add(&op);
}

}  // namespace zeroedge_ort
