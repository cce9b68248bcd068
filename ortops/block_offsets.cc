// BlockOffsets: what a 4-bit product on a float zero point's grid (GGUF Q4_1: w = d * q + m per block
// of 32) adds to MatMulNBits' offset-8 product, with the step's next element-wise work folded in
// (zeroedge.serve.cpu_q4):
//   y         float [M, N]     MatMulNBits' product over the codes, w = d * (q - 8)
//   x         float [M, K]     the product's input
//   C         float [kb, N]    per block of 32 inputs, c = d * 8 + m (an initializer), kb = ceil(K / 32)
//   residual  float [M, N]     optional, added at the end
//   attr activation "swiglu": y is [gate | up] side by side and the output is silu(gate) * up, [M, N / 2]
// -> out = y + blocksums(x) @ C (+ residual), or its swiglu.
// Each row's sums run in one fixed order whatever M is (one row a task), so a row computes alike in
// any batch (the engine's batch invariance).
#include "ops.h"

namespace zeroedge_ort {
namespace {

constexpr int kBlock = 32;

struct Rows {
  const float *y, *x, *C, *res;
  float* out;
  int64_t K, N, kb;
  bool swiglu;
};

void row_task(void* arg, size_t m) {
  const Rows& w = *(const Rows*)arg;
  const float* x = w.x + m * w.K;
  const float* y = w.y + m * w.N;
  thread_local std::vector<float> sums, acc;
  sums.assign((size_t)w.kb, 0.f);
  for (int64_t b = 0; b < w.kb; ++b) {
    float s = 0.f;
    for (int64_t i = b * kBlock; i < std::min(w.K, (b + 1) * kBlock); ++i) s += x[i];
    sums[b] = s;
  }
  acc.assign(y, y + w.N);
  for (int64_t b = 0; b < w.kb; ++b) {
    const float s = sums[b];
    const float* c = w.C + b * w.N;
    int64_t n = 0;
#ifdef ZE_AVX2
    const __m256 sv = _mm256_set1_ps(s);
    for (; n + 8 <= w.N; n += 8)
      _mm256_storeu_ps(acc.data() + n, _mm256_fmadd_ps(sv, _mm256_loadu_ps(c + n), _mm256_loadu_ps(acc.data() + n)));
#endif
    for (; n < w.N; ++n) acc[n] += s * c[n];
  }
  if (w.swiglu) {
    const int64_t h = w.N / 2;
    float* o = w.out + m * h;
    int64_t n = 0;
#ifdef ZE_AVX2
    const __m256 one = _mm256_set1_ps(1.f);
    for (; n + 8 <= h; n += 8) {
      const __m256 gate = _mm256_loadu_ps(acc.data() + n);
      const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gate))));
      _mm256_storeu_ps(o + n, _mm256_mul_ps(_mm256_mul_ps(gate, sig), _mm256_loadu_ps(acc.data() + n + h)));
    }
#endif
    for (; n < h; ++n) o[n] = acc[n] / (1.f + std::exp(-acc[n])) * acc[n + h];
    return;
  }
  float* o = w.out + m * w.N;
  if (w.res == nullptr) {
    std::copy(acc.begin(), acc.end(), o);
    return;
  }
  const float* r = w.res + m * w.N;
  for (int64_t n = 0; n < w.N; ++n) o[n] = acc[n] + r[n];
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
    float* out = ctx.GetOutput(0, std::vector<int64_t>{M, swiglu ? N / 2 : N}).GetTensorMutableData<float>();
    Rows w{Y.GetTensorData<float>(), X.GetTensorData<float>(), C.GetTensorData<float>(), res, out, xs[1], N, cs[0], swiglu};
    if (M > 0) ctx.ParallelFor(row_task, (size_t)M, 0, &w);
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
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

void add_block_offsets(Ort::CustomOpDomain& domain) {
  static BlockOffsetsOp op;
  domain.Add(&op);
}

}  // namespace zeroedge_ort
