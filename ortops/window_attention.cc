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

// scale * q_j . K_s + bias_s for the g heads of kv head h over slots [s0, s0 + n), into w.e
void scores_generic(const Step& w, int64_t h, int64_t s0, int64_t from, int64_t n) {
  const int64_t g = w.g, hd = w.hd, S = w.S;
  const float* q = w.q + h * g * hd;
  std::vector<float> kf(hd);
  for (int64_t s = from; s < n; ++s) {
    const uint16_t* ks = w.pk + (h * S + s0 + s) * hd;
    for (int64_t d = 0; d < hd; ++d) kf[d] = half_to_float(ks[d]);
    for (int64_t j = 0; j < g; ++j) {
      float dot = 0.f;
      for (int64_t d = 0; d < hd; ++d) dot += q[j * hd + d] * kf[d];
      w.e[(h * g + j) * S + s0 + s] = dot * w.scale + w.bias[s0 + s];
    }
  }
}

#ifdef ZE_AVX2
// NS slots at a time, G heads: G * NS accumulators stay in registers, each slot's K converted once
template <int G, int NS>
void scores_blocked(const Step& w, int64_t h, int64_t s0, int64_t n) {
  const int64_t hd = w.hd, S = w.S;
  const float* q = w.q + h * G * hd;
  const uint16_t* K = w.pk + (h * S + s0) * hd;
  int64_t s = 0;
  for (; s + NS <= n; s += NS) {
    __m256 acc[G][NS];
    for (int j = 0; j < G; ++j)
      for (int i = 0; i < NS; ++i) acc[j][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) {
      __m256 k[NS];
      for (int i = 0; i < NS; ++i) k[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(K + (s + i) * hd + d)));
      for (int j = 0; j < G; ++j) {
        const __m256 qv = _mm256_loadu_ps(q + j * hd + d);
        for (int i = 0; i < NS; ++i) acc[j][i] = _mm256_fmadd_ps(qv, k[i], acc[j][i]);
      }
    }
    const __m128 bias = NS == 4 ? _mm_loadu_ps(w.bias + s0 + s) : _mm_setzero_ps();
    for (int j = 0; j < G; ++j) {
      float* out = w.e + (h * G + j) * S + s0 + s;
      if (NS == 4) {          // lanes: slot 0..3 sums
        const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[j][0], acc[j][1]), _mm256_hadd_ps(acc[j][2], acc[j][3]));
        const __m128 r = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
        _mm_storeu_ps(out, _mm_add_ps(_mm_mul_ps(r, _mm_set1_ps(w.scale)), bias));
      } else {
        for (int i = 0; i < NS; ++i) out[i] = hsum(acc[j][i]) * w.scale + w.bias[s0 + s + i];
      }
    }
  }
  scores_generic(w, h, s0, s, n);
}
#endif

void scores(const Step& w, int64_t h, int64_t s0, int64_t n) {
#ifdef ZE_AVX2
  if (w.hd % 8 == 0) {
    switch (w.g) {
      case 1: return scores_blocked<1, 4>(w, h, s0, n);
      case 2: return scores_blocked<2, 4>(w, h, s0, n);
      case 3: return scores_blocked<3, 4>(w, h, s0, n);
      case 4: return scores_blocked<4, 2>(w, h, s0, n);
      case 5: return scores_blocked<5, 2>(w, h, s0, n);
      case 6: return scores_blocked<6, 2>(w, h, s0, n);
      default: break;
    }
  }
#endif
  scores_generic(w, h, s0, 0, n);
}

// out[j] = sum_s e[j][s] * V[s] over n slots (e rows S apart), the g heads of one kv head
void values_generic(const Step& w, const float* e, const uint16_t* V, float* out, int64_t n, int64_t d0) {
  const int64_t g = w.g, hd = w.hd, S = w.S;
  for (int64_t d = d0; d < hd; ++d)
    for (int64_t s = 0; s < n; ++s) {
      const float v = half_to_float(V[s * hd + d]);
      for (int64_t j = 0; j < g; ++j) out[j * hd + d] += e[j * S + s] * v;
    }
}

#ifdef ZE_AVX2
// R registers (8 dims each) a head stay in place over the slots: G * R accumulators
template <int G, int R>
void values_blocked(const Step& w, const float* e, const uint16_t* V, float* out, int64_t n) {
  const int64_t hd = w.hd, S = w.S;
  int64_t d0 = 0;
  for (; d0 + 8 * R <= hd; d0 += 8 * R) {
    __m256 acc[G][R];
    for (int j = 0; j < G; ++j)
      for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < n; ++s) {
      __m256 v[R];
      for (int r = 0; r < R; ++r) v[r] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(V + s * hd + d0 + 8 * r)));
      for (int j = 0; j < G; ++j) {
        const __m256 p = _mm256_broadcast_ss(e + j * S + s);
        for (int r = 0; r < R; ++r) acc[j][r] = _mm256_fmadd_ps(p, v[r], acc[j][r]);
      }
    }
    for (int j = 0; j < G; ++j)
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + j * hd + d0 + 8 * r, acc[j][r]);
  }
  values_generic(w, e, V, out, n, d0);
}
#endif

void values(const Step& w, const float* e, const uint16_t* V, float* out, int64_t n) {
  std::fill(out, out + w.g * w.hd, 0.f);
#ifdef ZE_AVX2
  switch (w.g) {
    case 1: return values_blocked<1, 8>(w, e, V, out, n);
    case 2: return values_blocked<2, 4>(w, e, V, out, n);
    case 3: return values_blocked<3, 4>(w, e, V, out, n);
    case 4: return values_blocked<4, 2>(w, e, V, out, n);
    case 5: return values_blocked<5, 2>(w, e, V, out, n);
    case 6: return values_blocked<6, 2>(w, e, V, out, n);
    default: break;
  }
#endif
  values_generic(w, e, V, out, n, 0);
}

// scores of one block for the g heads of kv head h, then their exponentials and e @ V
void block_task(void* p, size_t t) {
  const Step& w = *(const Step*)p;
  const int64_t h = (int64_t)t / w.blocks, c = (int64_t)t % w.blocks, g = w.g, hd = w.hd, S = w.S;
  const int64_t s0 = c * kSlots, s1 = std::min(S, s0 + kSlots), n = s1 - s0;
  const uint16_t* V = w.pv + (h * S + s0) * hd;
  float* out = w.bout + (h * w.blocks + c) * g * hd;
  scores(w, h, s0, n);
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
  values(w, w.e + h * g * S + s0, V, out, n);
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
