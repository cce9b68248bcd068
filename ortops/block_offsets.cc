// BlockOffsets: what a 4-bit product on a float zero point's grid (GGUF Q4_1: w = d * q + m per block
// of 32) adds to MatMulNBits' offset-8 product (w = d * (q - 8)), with the step's next element-wise
// work folded in (zeroedge.serve.cpu_q4):
//   y         float [M, N]           MatMulNBits' product
//   x         float [M, K]           the product's input
//   C         float16|float [kb, N]  per block of 32 inputs c = d * 8 + m (an initializer), kb = ceil(K / 32)
//   residual  float [M, N]           optional, added at the end
//   attr activation "swiglu": y is [gate | up] side by side and the output is silu(gate) * up, [M, N / 2]
// -> out = y + blocksums(x) @ C (+ residual), or its swiglu.
// Work is split by output columns, every row at once, so C is read once a call. Each output element
// sums its blocks in one fixed order whatever M is, so a row computes alike in any batch (the engine's
// batch invariance).
#include "ops.h"

namespace zeroedge_ort {
namespace {

constexpr int kBlock = 32;
constexpr int64_t kCols = 256;          // output columns a task

struct Cols {
  const float *y, *sums, *res;          // sums: [M, kb]
  const void* C;
  bool half, swiglu;
  float* out;
  int64_t M, N, kb, out_n;
};

inline float c_at(const Cols& w, int64_t i) {
  return w.half ? half_to_float(((const uint16_t*)w.C)[i]) : ((const float*)w.C)[i];
}

// acc[m][0..n) = y[m][n0..] + sum_b sums[m][b] * C[b][n0..], blocks in order
void offsets(const Cols& w, int64_t n0, int64_t n, float* acc) {
  for (int64_t m = 0; m < w.M; ++m) std::memcpy(acc + m * n, w.y + m * w.N + n0, n * sizeof(float));
  std::vector<float> c((size_t)n);
  for (int64_t b = 0; b < w.kb; ++b) {
    int64_t j = 0;
#ifdef ZE_AVX2
    if (w.half)
      for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(c.data() + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)w.C + b * w.N + n0 + j))));
#endif
    for (; j < n; ++j) c[j] = c_at(w, b * w.N + n0 + j);
    for (int64_t m = 0; m < w.M; ++m) {
      const float s = w.sums[m * w.kb + b];
      float* a = acc + m * n;
      j = 0;
#ifdef ZE_AVX2
      const __m256 sv = _mm256_set1_ps(s);
      for (; j + 8 <= n; j += 8) _mm256_storeu_ps(a + j, _mm256_fmadd_ps(sv, _mm256_loadu_ps(c.data() + j), _mm256_loadu_ps(a + j)));
#endif
      for (; j < n; ++j) a[j] = std::fma(s, c[j], a[j]);
    }
  }
}

void cols_task(void* arg, size_t t) {
  const Cols& w = *(const Cols*)arg;
  const int64_t n0 = (int64_t)t * kCols, n = std::min(kCols, w.out_n - n0);
  thread_local std::vector<float> acc, up;
  acc.resize((size_t)(w.M * n));
  offsets(w, n0, n, acc.data());
  if (w.swiglu) {
    up.resize((size_t)(w.M * n));
    offsets(w, n0 + w.out_n, n, up.data());
    for (int64_t m = 0; m < w.M; ++m) {
      const float *g = acc.data() + m * n, *u = up.data() + m * n;
      float* o = w.out + m * w.out_n + n0;
      int64_t j = 0;
#ifdef ZE_AVX2
      const __m256 one = _mm256_set1_ps(1.f);
      for (; j + 8 <= n; j += 8) {
        const __m256 gate = _mm256_loadu_ps(g + j);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gate))));
        _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(gate, sig), _mm256_loadu_ps(u + j)));
      }
#endif
      for (; j < n; ++j) o[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
    }
    return;
  }
  for (int64_t m = 0; m < w.M; ++m) {
    const float* a = acc.data() + m * n;
    float* o = w.out + m * w.out_n + n0;
    if (w.res == nullptr) {
      std::memcpy(o, a, n * sizeof(float));
    } else {
      const float* r = w.res + m * w.N + n0;
      for (int64_t j = 0; j < n; ++j) o[j] = a[j] + r[j];
    }
  }
}

struct BlockOffsetsKernel {
  bool swiglu;
  BlockOffsetsKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    std::string act;
    try { act = ki.GetAttribute<std::string>("activation"); } catch (const Ort::Exception&) {}
    if (act != "" && act != "swiglu") ORT_CXX_API_THROW("BlockOffsets: activation must be swiglu or absent", ORT_INVALID_ARGUMENT);
    swiglu = act == "swiglu";
  }
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto Y = ctx.GetInput(0), X = ctx.GetInput(1), C = ctx.GetInput(2);
    const auto ys = Y.GetTensorTypeAndShapeInfo().GetShape(), xs = X.GetTensorTypeAndShapeInfo().GetShape(),
               cs = C.GetTensorTypeAndShapeInfo().GetShape();
    if (ys.size() != 2 || xs.size() != 2 || cs.size() != 2 || xs[0] != ys[0] || cs[1] != ys[1] ||
        cs[0] != (xs[1] + kBlock - 1) / kBlock)
      ORT_CXX_API_THROW("BlockOffsets: y [M, N], x [M, K] and C [ceil(K / 32), N] do not match", ORT_INVALID_ARGUMENT);
    const int64_t M = ys[0], N = ys[1];
    const float* res = nullptr;
    if (ctx.GetInputCount() > 3) {
      auto R = ctx.GetInput(3);
      if (R != nullptr) {
        if (R.GetTensorTypeAndShapeInfo().GetShape() != ys)
          ORT_CXX_API_THROW("BlockOffsets: the residual must be shaped as y", ORT_INVALID_ARGUMENT);
        res = R.GetTensorData<float>();
      }
    }
    if (swiglu && (N % 2 || res != nullptr))
      ORT_CXX_API_THROW("BlockOffsets: swiglu needs an even N and no residual", ORT_INVALID_ARGUMENT);
    const auto ct = C.GetTensorTypeAndShapeInfo().GetElementType();
    if (ct != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 && ct != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
      ORT_CXX_API_THROW("BlockOffsets: C must be float16 or float", ORT_INVALID_ARGUMENT);
    const int64_t K = xs[1], kb = cs[0], out_n = swiglu ? N / 2 : N;
    float* out = ctx.GetOutput(0, std::vector<int64_t>{M, out_n}).GetTensorMutableData<float>();
    if (M == 0 || out_n == 0) return;
    std::vector<float> sums((size_t)(M * kb));
    const float* x = X.GetTensorData<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < kb; ++b) {
        float s = 0.f;
        for (int64_t i = b * kBlock; i < std::min(K, (b + 1) * kBlock); ++i) s += x[m * K + i];
        sums[m * kb + b] = s;
      }
    Cols w{Y.GetTensorData<float>(), sums.data(), res, C.GetTensorRawData(), ct == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16,
           swiglu, out, M, N, kb, out_n};
    run_tasks(ctx, cols_task, (size_t)((out_n + kCols - 1) / kCols), &w, (double)M * kb * N);
  }
};

struct BlockOffsetsOp : Ort::CustomOpBase<BlockOffsetsOp, BlockOffsetsKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new BlockOffsetsKernel(api, info); }
  const char* GetName() const { return "BlockOffsets"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 4; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

void add_block_offsets(Ort::CustomOpDomain& domain) {
  static BlockOffsetsOp op;
  domain.Add(&op);
}

}  // namespace zeroedge_ort
