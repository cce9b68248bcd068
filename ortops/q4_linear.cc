// zeroedge's onnxruntime CPU kernels (custom-op domain "zeroedge.ort"), in one library with
// window_attention.cc: RegisterCustomOps there adds both.
//
// Q4Linear: y = x @ W for a 4-bit weight on a min/max grid with a float offset per block of 32
// (GGUF Q4_1: w = d * q + m), read from the initializers the portable graph already holds for
// MatMulNBits and its side product, in one pass and with no fp32 side-product matrix:
//   x      float [M, K]
//   B      uint8 [N, kb, 16]   MatMulNBits' codes (byte j of a block: element 2j low, 2j+1 high)
//   S      float16|float [N * kb]   d of each block
//   C      float16|float [kb, N]    the offset product's C = d * (8 - z) = m + 8 d
//   y      float [M, N]
// y[n] = sum_b S[n,b] * sum_i (q_i - 8) x_i + C[b,n] * sum_i x_i. x is rounded to int8 per block of
// 32 (as MatMulNBits does at accuracy level 4), the block sums of x stay exact.
// attr activation "swiglu": W is [gate | up] side by side and the output is silu(gate) * up, [M, N / 2].
#include <string>

#include "ops.h"

namespace zeroedge_ort {
namespace {

constexpr int kBlock = 32;

// One row of x: int8 codes per block (even elements first, then odd: the order of B's low and high
// nibbles), the block's step dx, the exact block sum, and 8 * dx * sum(codes) (the "- 8" of every
// weight code, one term a block).
struct QuantRow {
  std::vector<int8_t> q;
  std::vector<float> dx, sum, xs8;
  void fill(const float* x, int64_t K, int64_t kb) {
    q.assign(kb * kBlock, 0);
    dx.assign(kb, 0.f);
    sum.assign(kb, 0.f);
    xs8.assign(kb, 0.f);
    for (int64_t b = 0; b < kb; ++b) {
      float v[kBlock] = {0};
      const int64_t n = std::min<int64_t>(kBlock, K - b * kBlock);
      std::memcpy(v, x + b * kBlock, n * sizeof(float));
      float amax = 0.f, s = 0.f;
      for (int i = 0; i < kBlock; ++i) { amax = std::max(amax, std::fabs(v[i])); s += v[i]; }
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      // blocks in pairs: [b0 even, b1 even, b0 odd, b1 odd] (16 codes each); a last odd block [even, odd]
      const bool paired = (b | 1) < kb;
      int8_t* even = q.data() + (b & ~int64_t(1)) * kBlock + (paired && (b & 1) ? 16 : 0);
      int8_t* odd = even + (paired ? 32 : 16);
      int qs = 0;
      for (int i = 0; i < kBlock / 2; ++i) {
        even[i] = (int8_t)std::lrint(v[2 * i] * inv);
        odd[i] = (int8_t)std::lrint(v[2 * i + 1] * inv);
        qs += even[i] + odd[i];
      }
      dx[b] = d;
      sum[b] = s;
      xs8[b] = 8.f * (float)qs * d;
    }
  }
};

struct Work {
  const QuantRow* row;
  const uint8_t* B;
  const void* S;
  const void* C;
  bool half;
  int64_t N, kb, chunk;
  float* y;
};

template <bool HALF>
inline float load_scalar(const void* p, int64_t i) {
  if (HALF) return half_to_float(((const uint16_t*)p)[i]);
  return ((const float*)p)[i];
}

#ifdef ZE_AVX2
// sum_i q_i * xq_i over one block as 8 int32 lanes
inline __m256i block_dot(const uint8_t* codes, __m256i xq) {
  const __m128i raw = _mm_loadu_si128((const __m128i*)codes);
  const __m128i m = _mm_set1_epi8(0x0F);
  const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m), _mm_and_si128(raw, m));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xq), _mm256_set1_epi16(1));
}
#endif

constexpr int kRows = 4;   // weight rows a pass: one load of x's codes serves four

template <bool HALF>
void rows_chunk_t(const Work& w, size_t c) {
  const int64_t n0 = (int64_t)c * w.chunk, n1 = std::min(w.N, n0 + w.chunk), kb = w.kb;
  const QuantRow& r = *w.row;
  const int8_t* xq = r.q.data();
  const float* dx = r.dx.data();
  const float* xs8 = r.xs8.data();
  std::vector<float> ds(kRows * kb);          // d * dx per row and block
  int64_t n = n0;
  for (; n < n1; n += kRows) {
    const int rows = (int)std::min<int64_t>(kRows, n1 - n);
    float corr[kRows] = {0, 0, 0, 0};
    for (int j = 0; j < rows; ++j) {
      int64_t b = 0;
#ifdef ZE_AVX2
      __m256 cv = _mm256_setzero_ps();
      for (; b + 8 <= kb; b += 8) {
        const __m256 d = HALF ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)w.S + (n + j) * kb + b)))
                              : _mm256_loadu_ps((const float*)w.S + (n + j) * kb + b);
        _mm256_storeu_ps(&ds[j * kb + b], _mm256_mul_ps(d, _mm256_loadu_ps(dx + b)));
        cv = _mm256_fmadd_ps(d, _mm256_loadu_ps(xs8 + b), cv);
      }
      corr[j] = hsum(cv);
#endif
      for (; b < kb; ++b) {
        const float d = load_scalar<HALF>(w.S, (n + j) * kb + b);
        ds[j * kb + b] = d * dx[b];
        corr[j] += d * xs8[b];
      }
    }
#ifdef ZE_AVX2
    if (rows == kRows) {
      __m256 acc[kRows];
      for (int j = 0; j < kRows; ++j) acc[j] = _mm256_setzero_ps();
      const uint8_t* B0 = w.B + n * kb * (kBlock / 2);
      const int64_t stride = kb * (kBlock / 2);
      const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
      const __m256i pick = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
      int64_t b = 0;
      for (; b + 2 <= kb; b += 2) {        // two blocks a row at once: lanes 0-3 block b, 4-7 block b + 1
        const __m256i xe = _mm256_loadu_si256((const __m256i*)(xq + b * kBlock));
        const __m256i xo = _mm256_loadu_si256((const __m256i*)(xq + b * kBlock + 32));
        for (int j = 0; j < kRows; ++j) {
          const uint8_t* p = B0 + j * stride + b * (kBlock / 2);
          #ifdef ZE_PF
          _mm_prefetch((const char*)p + ZE_PF, _MM_HINT_T0);
#endif
          const __m256i raw = _mm256_loadu_si256((const __m256i*)p);
          const __m256i lo = _mm256_and_si256(raw, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
          const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
          const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
          const __m256 sc = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd((const double*)&ds[j * kb + b]))), pick);
          acc[j] = _mm256_fmadd_ps(dot, sc, acc[j]);
        }
      }
      for (; b < kb; ++b) {
        const __m256i x = _mm256_loadu_si256((const __m256i*)(xq + b * kBlock));
        for (int j = 0; j < kRows; ++j)
          acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(B0 + j * stride + b * (kBlock / 2), x)),
                                   _mm256_broadcast_ss(&ds[j * kb + b]), acc[j]);
      }
      __m256 acc0 = acc[0], acc1 = acc[1], acc2 = acc[2], acc3 = acc[3];
      w.y[n] = hsum(acc0) - corr[0];
      w.y[n + 1] = hsum(acc1) - corr[1];
      w.y[n + 2] = hsum(acc2) - corr[2];
      w.y[n + 3] = hsum(acc3) - corr[3];
      continue;
    }
#endif
    for (int j = 0; j < rows; ++j) {
      float acc = 0.f;
      for (int64_t b = 0; b < kb; ++b) {
        const uint8_t* code = w.B + ((n + j) * kb + b) * (kBlock / 2);
        const bool paired = (b | 1) < kb;
        const int8_t* even = xq + (b & ~int64_t(1)) * kBlock + (paired && (b & 1) ? 16 : 0);
        const int8_t* odd = even + (paired ? 32 : 16);
        int s = 0;
        for (int i = 0; i < kBlock / 2; ++i) s += (code[i] & 0x0F) * even[i] + (code[i] >> 4) * odd[i];
        acc += (float)s * ds[j * kb + b];
      }
      w.y[n + j] = acc - corr[j];
    }
  }
  // the offsets: y[n] += sum_b C[b, n] * (block sum b of x), C row-major over n
  for (int64_t b = 0; b < kb; ++b) {
    const float sb = r.sum[b];
    if (sb == 0.f) continue;
    int64_t m = n0;
#ifdef ZE_AVX2
    const __m256 sv = _mm256_set1_ps(sb);
    for (; m + 8 <= n1; m += 8) {
      const __m256 cv = HALF ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)w.C + b * w.N + m)))
                             : _mm256_loadu_ps((const float*)w.C + b * w.N + m);
      _mm256_storeu_ps(w.y + m, _mm256_fmadd_ps(cv, sv, _mm256_loadu_ps(w.y + m)));
    }
#endif
    for (; m < n1; ++m) w.y[m] += load_scalar<HALF>(w.C, b * w.N + m) * sb;
  }
}

void rows_chunk(void* p, size_t c) {
  const Work& w = *(const Work*)p;
  if (w.half) rows_chunk_t<true>(w, c);
  else rows_chunk_t<false>(w, c);
}

struct Q4LinearKernel {
  int64_t K, N;
  bool swiglu;
  Q4LinearKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    K = ki.GetAttribute<int64_t>("K");
    N = ki.GetAttribute<int64_t>("N");
    if (ki.GetAttribute<int64_t>("block_size") != kBlock) ORT_CXX_API_THROW("Q4Linear: block_size must be 32", ORT_INVALID_ARGUMENT);
    std::string act;
    try { act = ki.GetAttribute<std::string>("activation"); } catch (const Ort::Exception&) {}
    if (act != "" && act != "swiglu") ORT_CXX_API_THROW("Q4Linear: activation must be swiglu or absent", ORT_INVALID_ARGUMENT);
    swiglu = act == "swiglu";
    if (swiglu && N % 2) ORT_CXX_API_THROW("Q4Linear: swiglu needs an even N", ORT_INVALID_ARGUMENT);
  }
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto X = ctx.GetInput(0), B = ctx.GetInput(1), S = ctx.GetInput(2), C = ctx.GetInput(3);
    auto xshape = X.GetTensorTypeAndShapeInfo().GetShape();
    if (xshape.empty() || xshape.back() != K) ORT_CXX_API_THROW("Q4Linear: x's last dimension is not K", ORT_INVALID_ARGUMENT);
    const int64_t kb = (K + kBlock - 1) / kBlock;
    const auto st = S.GetTensorTypeAndShapeInfo(), ct = C.GetTensorTypeAndShapeInfo();
    const bool half = st.GetElementType() == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    if (st.GetElementType() != ct.GetElementType() || st.GetElementCount() != (size_t)(N * kb) ||
        ct.GetElementCount() != (size_t)(N * kb) || B.GetTensorTypeAndShapeInfo().GetElementCount() != (size_t)(N * kb * kBlock / 2))
      ORT_CXX_API_THROW("Q4Linear: B / S / C do not match K, N", ORT_INVALID_ARGUMENT);
    const int64_t out_n = swiglu ? N / 2 : N;
    std::vector<int64_t> yshape(xshape);
    yshape.back() = out_n;
    auto Y = ctx.GetOutput(0, yshape);
    const int64_t M = X.GetTensorTypeAndShapeInfo().GetElementCount() / K;
    const float* x = X.GetTensorData<float>();
    float* y = Y.GetTensorMutableData<float>();
    std::vector<float> full(swiglu ? N : 0);
    QuantRow row;
    // a quarter of the rows a chunk (a multiple of 8): long runs of C's rows for the prefetcher
    const int64_t chunk = std::max<int64_t>(64, (N / 4 + 7) / 8 * 8);
    for (int64_t m = 0; m < M; ++m) {
      row.fill(x + m * K, K, kb);
      float* ym = swiglu ? full.data() : y + m * N;
      Work w{&row, B.GetTensorData<uint8_t>(), S.GetTensorRawData(), C.GetTensorRawData(), half, N, kb, chunk, ym};
      ctx.ParallelFor(rows_chunk, (size_t)((N + chunk - 1) / chunk), 0, &w);
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
