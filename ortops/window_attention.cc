// WindowAttention: one decode step's attention for one layer over a window of float16 K / V slots,
// plus the new token's own K / V, as zeroedge's decode graph computes it (export/onnx_export Decode),
// from the q / k / v product to the input of o_proj:
//   qkv    float [B, Hkv * (g + 2) * hd]   per kv head: its g query heads, its key, its value
//   rot    float [B, 1, hd, hd]  the step's RoPE rotation (q and k rotated as x @ rot)
//   past_k, past_v  float16 [B, Hkv, S, hd]   the window
//   bias   float [B, 1, 1, S]      0 for a filled slot, -inf for an empty one
//   attr kv_heads (Hkv), scale (the scores' factor, 1 / sqrt(hd))
// -> out    float [B, Hkv * g * hd]   softmax over the S slots and the new token, times the values
//    k, v   float [B, Hkv, 1, hd]     the new token's key (rotated) and value, for the window
//    mass   float [B, 1, S]           each slot's probability, averaged over the Hkv * g heads
// The window is read once, as float16 (the graph of stock operators reads an fp32 K and casts V to
// fp32 every step). Work is split over (kv head, block of slots): each block keeps its own max,
// sum and partial output (softmax's rescaling), combined at the end.
#include "ops.h"

namespace zeroedge_ort {
namespace {

constexpr int64_t kSlots = 256;             // slots a task

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
  if (from >= n) return;                    // the blocked path left no tail
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
    _mm_prefetch((const char*)(K + s * hd) + kPrefetch, _MM_HINT_T0);
    _mm_prefetch((const char*)(K + s * hd) + kPrefetch + 64, _MM_HINT_T0);
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
      _mm_prefetch((const char*)(V + s * hd + d0) + kPrefetch, _MM_HINT_T0);
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
      sum = exp_sum(e, n, m);
    }
    w.bmax[(h * g + j) * w.blocks + c] = m;
    w.bsum[(h * g + j) * w.blocks + c] = sum;
  }
  values(w, w.e + h * g * S + s0, V, out, n);
}

struct WindowAttentionKernel {
  float scale;
  int64_t Hkv;
  WindowAttentionKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    scale = ki.GetAttribute<float>("scale");
    Hkv = ki.GetAttribute<int64_t>("kv_heads");
    if (Hkv < 1) ORT_CXX_API_THROW("WindowAttention: kv_heads must be >= 1", ORT_INVALID_ARGUMENT);
  }
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto QKV = ctx.GetInput(0), Rot = ctx.GetInput(1), PK = ctx.GetInput(2), PV = ctx.GetInput(3), Bias = ctx.GetInput(4);
    const auto xs = QKV.GetTensorTypeAndShapeInfo().GetShape(), ks = PK.GetTensorTypeAndShapeInfo().GetShape();
    if (xs.size() != 2 || ks.size() != 4 || ks[0] != xs[0] || ks[1] != Hkv || ks[3] < 1 || xs[1] % (Hkv * ks[3]) ||
        xs[1] / (Hkv * ks[3]) < 3)
      ORT_CXX_API_THROW("WindowAttention: qkv [B, Hkv * (g + 2) * hd] and past_k [B, Hkv, S, hd] do not match", ORT_INVALID_ARGUMENT);
    const int64_t B = xs[0], hd = ks[3], g = xs[1] / (Hkv * hd) - 2, S = ks[2], H = Hkv * g;
    if (PV.GetTensorTypeAndShapeInfo().GetShape() != ks)
      ORT_CXX_API_THROW("WindowAttention: past_v must be shaped as past_k", ORT_INVALID_ARGUMENT);
    if (Rot.GetTensorTypeAndShapeInfo().GetElementCount() != (size_t)(B * hd * hd))
      ORT_CXX_API_THROW("WindowAttention: rot must be [B, 1, hd, hd]", ORT_INVALID_ARGUMENT);
    const size_t nbias = Bias.GetTensorTypeAndShapeInfo().GetElementCount();
    if (nbias != (size_t)S && nbias != (size_t)(B * S))
      ORT_CXX_API_THROW("WindowAttention: bias must be [B or 1, 1, 1, S]", ORT_INVALID_ARGUMENT);
    float* out = ctx.GetOutput(0, std::vector<int64_t>{B, H * hd}).GetTensorMutableData<float>();
    float* knew = ctx.GetOutput(1, std::vector<int64_t>{B, Hkv, 1, hd}).GetTensorMutableData<float>();
    float* vnew = ctx.GetOutput(2, std::vector<int64_t>{B, Hkv, 1, hd}).GetTensorMutableData<float>();
    float* mass = ctx.GetOutput(3, std::vector<int64_t>{B, 1, S}).GetTensorMutableData<float>();
    const int64_t blocks = std::max<int64_t>(1, (S + kSlots - 1) / kSlots);
    std::vector<float> qrot(H * hd), e(H * S), bmax(H * blocks), bsum(H * blocks), bout(Hkv * blocks * g * hd);
    for (int64_t b = 0; b < B; ++b) {
      // split per kv head and rotate q and k: row @ rot
      const float* x = QKV.GetTensorData<float>() + b * Hkv * (g + 2) * hd;
      const float* rot = Rot.GetTensorData<float>() + b * hd * hd;
      float* kn = knew + b * Hkv * hd;
      const float* vn = vnew + b * Hkv * hd;
      for (int64_t h = 0; h < Hkv; ++h) {
        for (int64_t j = 0; j <= g; ++j) {
          const float* row = x + (h * (g + 2) + j) * hd;
          float* dst = j < g ? qrot.data() + (h * g + j) * hd : kn + h * hd;
          std::fill(dst, dst + hd, 0.f);
          for (int64_t i = 0; i < hd; ++i) {
            const float r = row[i];
            for (int64_t d = 0; d < hd; ++d) dst[d] += r * rot[i * hd + d];
          }
        }
        std::memcpy(vnew + (b * Hkv + h) * hd, x + (h * (g + 2) + g + 1) * hd, hd * sizeof(float));
      }
      const float* q = qrot.data();
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
  size_t GetInputTypeCount() const { return 5; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 2 || i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 4; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

void add_window_attention(Ort::CustomOpDomain& domain) {
  static WindowAttentionOp op;
  domain.Add(&op);
}

}  // namespace zeroedge_ort
