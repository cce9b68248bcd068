// Q8Linear: y = x @ W for an 8-bit weight on MatMulNBits' symmetric grid, w = d * (q - 128), from the
// initializers the portable graph holds for its 8-bit MatMulNBits (the tied embedding's LM head):
//   x      float [M, K]
//   B      uint8 [N, kb, 32]    codes, one a byte (block_size 32), kb = ceil(K / 32)
//   S      float16|float [N * kb]   d of each block
//   y      float [M, N]
// y[n] = sum_b d[n,b] * sum_i (q_i - 128) x_i, x rounded per block of 32 to int16 (step = the block's
// largest value / 32767: as good as exact), the "- 128" taken from the rounded block sums.
//
// B and S must be constant (initializers). At kernel creation they are copied once into the product's
// order: rows in groups of 4, per group every block as [4 rows x 32 code bytes], then the blocks' d
// as [block][4 rows] in S's dtype; a step streams one contiguous buffer.
#include <cfloat>
#include <cstdlib>
#include <memory>
#include <string>

#include "ops.h"

namespace zeroedge_ort {
namespace {

constexpr int kBlock = 32, kRows = 4;

struct Packed8 {
  int64_t N = 0, kb = 0, groups = 0;
  bool half = true;
  size_t group_bytes = 0, codes_bytes = 0, elt = 2;
  PackedBuffer buf{nullptr, std::free};

  const uint8_t* codes(int64_t g) const { return buf.get() + g * group_bytes; }
  const uint8_t* scales(int64_t g) const { return codes(g) + codes_bytes; }   // d [kb][4]

  void pack(const uint8_t* B, const void* S, int64_t n_, int64_t kb_, bool half_) {
    N = n_, kb = kb_, half = half_, elt = half ? 2 : 4;
    groups = (N + kRows - 1) / kRows;
    codes_bytes = kb * kRows * kBlock;
    group_bytes = (codes_bytes + kb * kRows * elt + 63) / 64 * 64;
    buf = packed_buffer(groups * group_bytes, "Q8Linear");
    for (int64_t n = 0; n < N; ++n) {
      uint8_t* c = buf.get() + (n / kRows) * group_bytes;
      const int64_t j = n % kRows;
      for (int64_t b = 0; b < kb; ++b) {
        std::memcpy(c + (b * kRows + j) * kBlock, B + (n * kb + b) * kBlock, kBlock);
        std::memcpy(c + codes_bytes + (b * kRows + j) * elt, (const uint8_t*)S + (n * kb + b) * elt, elt);
      }
    }
  }
};

// One row of x rounded to int16 per block (natural order), each block's step and 128 * step * sum(codes)
struct Row16 {
  std::vector<int16_t> q;
  std::vector<float> dx, xs128;
  void fill(const float* x, int64_t K, int64_t kb) {
    q.assign(kb * kBlock, 0);
    dx.assign(kb, 0.f);
    xs128.assign(kb, 0.f);
    for (int64_t b = 0; b < kb; ++b) {
      const int64_t n = std::min<int64_t>(kBlock, K - b * kBlock);
      float amax = 0.f;
      for (int64_t i = 0; i < n; ++i) {                  // a NaN makes the step, and so the outputs, NaN
        const float a = std::fabs(x[b * kBlock + i]);
        amax = std::isnan(a) ? a : std::max(amax, a);
        if (std::isnan(amax)) break;
      }
      float d = amax / 32767.f, inv = d > 0.f ? 1.f / d : 0.f;
      if (!(inv <= FLT_MAX)) d = inv = 0.f;       // a step below float's range: the block rounds to 0
      int64_t s = 0;
      for (int64_t i = 0; i < n; ++i) s += q[b * kBlock + i] = (int16_t)std::lrint(x[b * kBlock + i] * inv);
      dx[b] = d;
      xs128[b] = 128.f * (float)s * d;
    }
  }
};

struct Work8 {
  const Row16* row;
  const Packed8* w;
  int64_t chunk;
  float* y;
};

#ifdef ZE_AVX2
template <bool HALF>
inline __m128 load4(const uint8_t* p) {
  if (HALF) return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)p));
  return _mm_loadu_ps((const float*)p);
}
#endif

template <bool HALF>
void groups8(const Work8& t, size_t c) {
  const Packed8& w = *t.w;
  const Row16& r = *t.row;
  const int64_t g0 = (int64_t)c * t.chunk, g1 = std::min(w.groups, g0 + t.chunk);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t *codes = w.codes(g), *sc = w.scales(g);
    float y4[kRows] = {0.f, 0.f, 0.f, 0.f};
#ifdef ZE_AVX2
    // per row: lanes of sum (codes x rounded x) * d * dx, and apart the "- 128" terms d * xs128
    __m256 acc[kRows] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m128 corr = _mm_setzero_ps();
    for (int64_t b = 0; b < w.kb; ++b) {
      const uint8_t* cb = codes + b * kRows * kBlock;
      const int16_t* xb = r.q.data() + b * kBlock;
      _mm_prefetch((const char*)cb + kPrefetch, _MM_HINT_T0);
      _mm_prefetch((const char*)cb + kPrefetch + 64, _MM_HINT_T0);
      const __m256i x0 = _mm256_loadu_si256((const __m256i*)xb), x1 = _mm256_loadu_si256((const __m256i*)(xb + 16));
      const __m128 d4 = load4<HALF>(sc + b * kRows * w.elt);
      corr = _mm_fmadd_ps(d4, _mm_set1_ps(r.xs128[b]), corr);
      const __m256 dd = _mm256_castps128_ps256(_mm_mul_ps(d4, _mm_set1_ps(r.dx[b])));   // lanes 0-3 used
      for (int j = 0; j < kRows; ++j) {
        const __m128i* raw = (const __m128i*)(cb + j * kBlock);
        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(raw)), x0),
                                           _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(raw + 1)), x1));
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(j)), acc[j]);
      }
    }
    float cv[4];
    _mm_storeu_ps(cv, corr);
    for (int j = 0; j < kRows; ++j) y4[j] = hsum(acc[j]) - cv[j];
#else
    for (int64_t b = 0; b < w.kb; ++b) {
      const uint8_t* cb = codes + b * kRows * kBlock;
      const int16_t* xb = r.q.data() + b * kBlock;
      for (int j = 0; j < kRows; ++j) {
        int32_t s = 0;
        for (int i = 0; i < kBlock; ++i) s += (int32_t)cb[j * kBlock + i] * xb[i];
        const float d = HALF ? half_to_float(((const uint16_t*)sc)[b * kRows + j]) : ((const float*)sc)[b * kRows + j];
        y4[j] += d * ((float)s * r.dx[b] - r.xs128[b]);
      }
    }
#endif
    const int64_t rows = std::min<int64_t>(kRows, w.N - g * kRows);
    for (int j = 0; j < rows; ++j) t.y[g * kRows + j] = y4[j];
  }
}

void groups8_any(void* p, size_t c) {
  const Work8& t = *(const Work8*)p;
  if (t.w->half) groups8<true>(t, c);
  else groups8<false>(t, c);
}

struct Q8LinearKernel {
  int64_t K, N;
  Packed8 packed;
  Q8LinearKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    K = ki.GetAttribute<int64_t>("K");
    N = ki.GetAttribute<int64_t>("N");
    if (K < 1 || N < 1) ORT_CXX_API_THROW("Q8Linear: K and N must be >= 1", ORT_INVALID_ARGUMENT);
    if (ki.GetAttribute<int64_t>("block_size") != kBlock) ORT_CXX_API_THROW("Q8Linear: block_size must be 32", ORT_INVALID_ARGUMENT);
    int constant[2] = {0, 0};
    Ort::ConstValue B = ki.GetTensorConstantInput(1, &constant[0]), S = ki.GetTensorConstantInput(2, &constant[1]);
    if (!constant[0] || !constant[1]) ORT_CXX_API_THROW("Q8Linear: B and S must be initializers", ORT_INVALID_ARGUMENT);
    const int64_t kb = (K + kBlock - 1) / kBlock;
    const auto st = S.GetTensorTypeAndShapeInfo(), bt = B.GetTensorTypeAndShapeInfo();
    const auto et = st.GetElementType();
    if ((et != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 && et != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) ||
        bt.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 || st.GetElementCount() != (size_t)(N * kb) ||
        bt.GetElementCount() != (size_t)(N * kb * kBlock))
      ORT_CXX_API_THROW("Q8Linear: B / S do not match K, N", ORT_INVALID_ARGUMENT);
    packed.pack(B.GetTensorData<uint8_t>(), S.GetTensorRawData(), N, kb, et == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16);
  }
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto X = ctx.GetInput(0);
    auto xshape = X.GetTensorTypeAndShapeInfo().GetShape();
    if (xshape.empty() || xshape.back() != K) ORT_CXX_API_THROW("Q8Linear: x's last dimension is not K", ORT_INVALID_ARGUMENT);
    std::vector<int64_t> yshape(xshape);
    yshape.back() = N;
    auto Y = ctx.GetOutput(0, yshape);
    const int64_t M = X.GetTensorTypeAndShapeInfo().GetElementCount() / K;
    const float* x = X.GetTensorData<float>();
    float* y = Y.GetTensorMutableData<float>();
    Row16 row;
    const int64_t chunk = std::max<int64_t>(16, (packed.groups + 3) / 4);   // a quarter of the rows a task
    for (int64_t m = 0; m < M; ++m) {
      row.fill(x + m * K, K, packed.kb);
      Work8 w{&row, &packed, chunk, y + m * N};
      ctx.ParallelFor(groups8_any, (size_t)((packed.groups + chunk - 1) / chunk), 0, &w);
    }
  }
};

struct Q8LinearOp : Ort::CustomOpBase<Q8LinearOp, Q8LinearKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Q8LinearKernel(api, info); }
  const char* GetName() const { return "Q8Linear"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
         : i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

void add_q8_linear(Ort::CustomOpDomain& domain) {
  static Q8LinearOp op;
  domain.Add(&op);
}

}  // namespace zeroedge_ort
