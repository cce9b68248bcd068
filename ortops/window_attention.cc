// WindowAttention: one decode step's attention for one layer over a window of float16 K / V slots,
// plus the new token's own K / V, as zeroedge's decode graph computes it (export/onnx_export Decode):
//   q      float [B, Hkv, g, hd]   the step's queries after RoPE, g query heads per kv head
//   k, v   float [B, Hkv, 1, hd]   the new token's key (after RoPE) and value
//   past_k, past_v  float16 [B, Hkv, S, hd]   the window
//   bias   float [B, 1, 1, S]      0 for a filled slot, -inf for an empty one
//   attr scale                     the scores' factor (1 / sqrt(hd))
// -> out  float [B, Hkv, g, hd]   softmax over the S slots and the new token, times the values
//    mass float [B, 1, S]         each slot's probability, averaged over the Hkv * g heads
// The window is read once, as float16 (the graph of stock operators reads an fp32 K and casts V to
// fp32 every step). Work is split over (kv head, block of slots): each block keeps its own max,
// sum and partial output (softmax's rescaling), combined at the end.
#include "ops.h"

namespace zeroedge_ort {
namespace {

constexpr int64_t kSlots = 256;             // slots a task

#ifdef ZE_AVX2
// e^x for x <= 0; 0 below -87 (and for -inf). Cody-Waite reduction by ln 2, degree-6 Taylor on |r| <= ln2 / 2
inline __m256 exp_neg(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.f);
  const __m256 valid = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lo);
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
#endif

struct Step {
  const float *q, *bias;
  const uint16_t *pk, *pv;
  int64_t Hkv, g, hd, S, blocks;
  float scale;
  float* e;        // [Hkv, g, S]: exp(score - the block's max)
  float* bmax;     // [Hkv, g, blocks]
  float* bsum;     // [Hkv, g, blocks]
  float* bout;     // [Hkv, blocks, g, hd]: sum of e * V over the block
};

// scores of one block for the g heads of kv head h, then their exponentials and e @ V
void block_task(void* p, size_t t) {
  const Step& w = *(const Step*)p;
  const int64_t h = (int64_t)t / w.blocks, c = (int64_t)t % w.blocks, g = w.g, hd = w.hd, S = w.S;
  const int64_t s0 = c * kSlots, s1 = std::min(S, s0 + kSlots), n = s1 - s0;
  const float* q = w.q + h * g * hd;
  const uint16_t* K = w.pk + (h * S + s0) * hd;
  const uint16_t* V = w.pv + (h * S + s0) * hd;
  float* out = w.bout + (h * w.blocks + c) * g * hd;
  std::vector<float> kf(hd);
  for (int64_t s = 0; s < n; ++s) {
    const uint16_t* ks = K + s * hd;
    int64_t d = 0;
#ifdef ZE_AVX2
    for (; d + 8 <= hd; d += 8) _mm256_storeu_ps(&kf[d], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ks + d))));
#endif
    for (; d < hd; ++d) kf[d] = half_to_float(ks[d]);
    const float b = w.bias[s0 + s];
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = q + j * hd;
      float dot = 0.f;
      d = 0;
#ifdef ZE_AVX2
      __m256 acc = _mm256_setzero_ps();
      for (; d + 8 <= hd; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qj + d), _mm256_loadu_ps(&kf[d]), acc);
      dot = hsum(acc);
#endif
      for (; d < hd; ++d) dot += qj[d] * kf[d];
      w.e[(h * g + j) * S + s0 + s] = dot * w.scale + b;
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    float* e = w.e + (h * g + j) * S + s0;
    float m = -INFINITY;
    for (int64_t s = 0; s < n; ++s) m = std::max(m, e[s]);
    float sum = 0.f;
    if (m == -INFINITY) {
      std::fill(e, e + n, 0.f);
    } else {
      int64_t s = 0;
#ifdef ZE_AVX2
      __m256 sv = _mm256_setzero_ps();
      const __m256 mv = _mm256_set1_ps(m);
      for (; s + 8 <= n; s += 8) {
        const __m256 x = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(e + s), mv));
        _mm256_storeu_ps(e + s, x);
        sv = _mm256_add_ps(sv, x);
      }
      sum = hsum(sv);
#endif
      for (; s < n; ++s) { e[s] = e[s] == -INFINITY ? 0.f : std::exp(e[s] - m); sum += e[s]; }
    }
    w.bmax[(h * g + j) * w.blocks + c] = m;
    w.bsum[(h * g + j) * w.blocks + c] = sum;
  }
  // out[j] = sum_s e[j][s] * V[s], 16 dims at a time: 2 registers per head stay in place over the slots
  std::fill(out, out + g * hd, 0.f);
  const float* e0 = w.e + h * g * S + s0;
  int64_t d0 = 0;
#ifdef ZE_AVX2
  if (g <= 6) {
    for (; d0 + 16 <= hd; d0 += 16) {
      __m256 acc[12];
      for (int64_t j = 0; j < 2 * g; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t s = 0; s < n; ++s) {
        const uint16_t* vs = V + s * hd + d0;
        const __m256 v0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)vs));
        const __m256 v1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(vs + 8)));
        for (int64_t j = 0; j < g; ++j) {
          const __m256 pj = _mm256_broadcast_ss(e0 + j * S + s);
          acc[2 * j] = _mm256_fmadd_ps(pj, v0, acc[2 * j]);
          acc[2 * j + 1] = _mm256_fmadd_ps(pj, v1, acc[2 * j + 1]);
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        _mm256_storeu_ps(out + j * hd + d0, acc[2 * j]);
        _mm256_storeu_ps(out + j * hd + d0 + 8, acc[2 * j + 1]);
      }
    }
  }
#endif
  for (; d0 < hd; ++d0)
    for (int64_t s = 0; s < n; ++s) {
      const float v = half_to_float(V[s * hd + d0]);
      for (int64_t j = 0; j < g; ++j) out[j * hd + d0] += e0[j * S + s] * v;
    }
}

struct WindowAttentionKernel {
  float scale;
  WindowAttentionKernel(const OrtApi&, const OrtKernelInfo* info) {
    scale = Ort::ConstKernelInfo(info).GetAttribute<float>("scale");
  }
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto Q = ctx.GetInput(0), Kn = ctx.GetInput(1), Vn = ctx.GetInput(2), PK = ctx.GetInput(3), PV = ctx.GetInput(4),
         Bias = ctx.GetInput(5);
    const auto qs = Q.GetTensorTypeAndShapeInfo().GetShape(), ks = PK.GetTensorTypeAndShapeInfo().GetShape();
    if (qs.size() != 4 || ks.size() != 4 || ks[0] != qs[0] || ks[1] != qs[1] || ks[3] != qs[3])
      ORT_CXX_API_THROW("WindowAttention: q [B, Hkv, g, hd] and past_k [B, Hkv, S, hd] do not match", ORT_INVALID_ARGUMENT);
    const int64_t B = qs[0], Hkv = qs[1], g = qs[2], hd = qs[3], S = ks[2];
    if (PK.GetTensorTypeAndShapeInfo().GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ||
        PV.GetTensorTypeAndShapeInfo().GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ||
        PV.GetTensorTypeAndShapeInfo().GetShape() != ks)
      ORT_CXX_API_THROW("WindowAttention: past_k and past_v must be float16 [B, Hkv, S, hd]", ORT_INVALID_ARGUMENT);
    if (Kn.GetTensorTypeAndShapeInfo().GetElementCount() != (size_t)(B * Hkv * hd) ||
        Vn.GetTensorTypeAndShapeInfo().GetElementCount() != (size_t)(B * Hkv * hd))
      ORT_CXX_API_THROW("WindowAttention: k and v must be [B, Hkv, 1, hd]", ORT_INVALID_ARGUMENT);
    const size_t nbias = Bias.GetTensorTypeAndShapeInfo().GetElementCount();
    if (nbias != (size_t)S && nbias != (size_t)(B * S))
      ORT_CXX_API_THROW("WindowAttention: bias must be [B or 1, 1, 1, S]", ORT_INVALID_ARGUMENT);
    auto Out = ctx.GetOutput(0, qs);
    auto Mass = ctx.GetOutput(1, std::vector<int64_t>{B, 1, S});
    float* out = Out.GetTensorMutableData<float>();
    float* mass = Mass.GetTensorMutableData<float>();
    const int64_t blocks = std::max<int64_t>(1, (S + kSlots - 1) / kSlots), H = Hkv * g;
    std::vector<float> e(H * S), bmax(H * blocks), bsum(H * blocks), bout(Hkv * blocks * g * hd);
    for (int64_t b = 0; b < B; ++b) {
      const float* q = Q.GetTensorData<float>() + b * H * hd;
      const float* kn = Kn.GetTensorData<float>() + b * Hkv * hd;
      const float* vn = Vn.GetTensorData<float>() + b * Hkv * hd;
      Step w{q, Bias.GetTensorData<float>() + (nbias == (size_t)S ? 0 : b * S),
             (const uint16_t*)PK.GetTensorRawData() + b * Hkv * S * hd, (const uint16_t*)PV.GetTensorRawData() + b * Hkv * S * hd,
             Hkv, g, hd, S, blocks, scale, e.data(), bmax.data(), bsum.data(), bout.data()};
      if (S > 0) ctx.ParallelFor(block_task, (size_t)(Hkv * blocks), 0, &w);
      // combine the blocks with the new token's own score: one max, one sum a head
      float* ob = out + b * H * hd;
      float* mb = mass + b * S;
      std::fill(mb, mb + S, 0.f);
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t j = 0; j < g; ++j) {
          const float* qj = q + (h * g + j) * hd;
          float self = 0.f;
          for (int64_t d = 0; d < hd; ++d) self += qj[d] * kn[h * hd + d];
          self *= scale;
          float M = self;
          const int64_t r = (h * g + j) * blocks;
          for (int64_t c = 0; c < blocks && S > 0; ++c) M = std::max(M, bmax[r + c]);
          float Z = std::exp(self - M);
          std::vector<float> f(blocks, 0.f);
          for (int64_t c = 0; c < blocks && S > 0; ++c)
            if (bmax[r + c] != -INFINITY) { f[c] = std::exp(bmax[r + c] - M); Z += f[c] * bsum[r + c]; }
          const float inv = 1.f / Z, wself = std::exp(self - M) * inv;
          float* o = ob + (h * g + j) * hd;
          for (int64_t d = 0; d < hd; ++d) o[d] = wself * vn[h * hd + d];
          for (int64_t c = 0; c < blocks && S > 0; ++c) {
            if (f[c] == 0.f) continue;
            const float fc = f[c] * inv, fm = fc / (float)H;
            const float* pb = bout.data() + ((h * blocks + c) * g + j) * hd;
            for (int64_t d = 0; d < hd; ++d) o[d] += fc * pb[d];
            const float* ej = e.data() + (h * g + j) * S;
            for (int64_t s = c * kSlots; s < std::min(S, (c + 1) * kSlots); ++s) mb[s] += fm * ej[s];
          }
        }
    }
  }
};

struct WindowAttentionOp : Ort::CustomOpBase<WindowAttentionOp, WindowAttentionKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new WindowAttentionKernel(api, info); }
  const char* GetName() const { return "WindowAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 6; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 3 || i == 4 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

void add_window_attention(Ort::CustomOpDomain& domain) {
  static WindowAttentionOp op;
  domain.Add(&op);
}

}  // namespace zeroedge_ort
