// PagedAttention: one layer's attention for the serving engine's rows (zeroedge.serve.cpu_q4), from the
// q / k / v product to the input of o_proj, over a KV pool of pages:
//   qkv    float [M, (H + 2 Hkv) * hd]   per row: its H query heads, then Hkv keys, then Hkv values
//   cos, sin  float [M, hd / 2]           the row's RoPE angles (rotate-half pairs i, i + hd / 2)
//   pool_k, pool_v  float [P, hd]         every layer's K / V, (layers, Hkv, slots, hd) flattened
//   table  int64 [G, S]                  group g's slot of each position 0..S-1 (a head's slot axis)
//   rows   int64 [M, 4]                  per row: its group, its position p, and its segment's first
//                                        position in this step (start) and that position's row
//   attr heads (H), kv_heads (Hkv), layer, layers, scale
// -> out   float [M, H * hd]
// Row r attends to positions 0..p: those before start are read from the pool through the table,
// start..p are this step's rows (their rotated K, their V). The rows' own K / V are written into the
// pool at table[g][p], in place: the pool is bound by address and only these ops read it, each its
// own layer, the slots it writes never among those it reads.
// A row's arithmetic depends only on its own inputs and positions (one task a row and kv head, the
// same order of sums whatever else is in the step), so a row computes alike alone, in any batch, as a
// prompt chunk's row or as a verify row: the engine's batch invariance.
#include "ops.h"

namespace zeroedge_ort {
namespace {

struct Step {
  const float* q;            // [M, H, hd] rotated
  const float* knew;         // [M, Hkv, hd] rotated
  const float* vnew;         // [M, Hkv, hd]
  const float *pk, *pv;      // this layer's pool: [Hkv, slots, hd]
  const int64_t *table, *rows;
  int64_t H, Hkv, g, hd, S, slots;
  float scale;
  float* out;                // [M, H, hd]
};

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  float s = 0.f;
#ifdef ZE_AVX2
  if (n >= 8) {
    __m256 acc = _mm256_setzero_ps();
    for (; d + 8 <= n; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    s = hsum(acc);
  }
#endif
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// o += p * v over n
inline void axpy(float p, const float* v, float* o, int64_t n) {
  int64_t d = 0;
#ifdef ZE_AVX2
  const __m256 pv = _mm256_set1_ps(p);
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(o + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + d), _mm256_loadu_ps(o + d)));
#endif
  for (; d < n; ++d) o[d] += p * v[d];
}

// row r, kv head h: its g query heads over positions 0..p
void row_task(void* arg, size_t t) {
  const Step& w = *(const Step*)arg;
  const int64_t r = (int64_t)t / w.Hkv, h = (int64_t)t % w.Hkv, g = w.g, hd = w.hd;
  const int64_t* row = w.rows + r * 4;
  const int64_t grp = row[0], p = row[1], start = row[2], row0 = row[3], n = p + 1;
  const int64_t* slot = w.table + grp * w.S;
  thread_local std::vector<float> e;
  e.resize((size_t)(g * n));
  auto key = [&](int64_t s) {
    return s < start ? w.pk + (h * w.slots + slot[s]) * hd : w.knew + ((row0 + s - start) * w.Hkv + h) * hd;
  };
  auto value = [&](int64_t s) {
    return s < start ? w.pv + (h * w.slots + slot[s]) * hd : w.vnew + ((row0 + s - start) * w.Hkv + h) * hd;
  };
  const float* q = w.q + (r * w.H + h * g) * hd;
  for (int64_t s = 0; s < n; ++s) {
    const float* k = key(s);
    for (int64_t j = 0; j < g; ++j) e[j * n + s] = dot(q + j * hd, k, hd) * w.scale;
  }
  float* out = w.out + (r * w.H + h * g) * hd;
  std::fill(out, out + g * hd, 0.f);
  std::vector<float> sums(g);
  for (int64_t j = 0; j < g; ++j) {
    float* ej = e.data() + j * n;
    float m = -INFINITY;
    for (int64_t s = 0; s < n; ++s) m = std::max(m, ej[s]);
    sums[j] = exp_sum(ej, n, m);
  }
  for (int64_t s = 0; s < n; ++s) {
    const float* v = value(s);
    for (int64_t j = 0; j < g; ++j) axpy(e[j * n + s], v, out + j * hd, hd);
  }
  for (int64_t j = 0; j < g; ++j) {
    const float inv = 1.f / sums[j];
    for (int64_t d = 0; d < hd; ++d) out[j * hd + d] *= inv;
  }
}

// rotate-half RoPE of one head: x [hd] -> y
inline void rope(const float* x, const float* c, const float* s, float* y, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    y[i] = a * c[i] - b * s[i];
    y[i + half] = b * c[i] + a * s[i];
  }
}

struct PagedAttentionKernel {
  int64_t H, Hkv, layer, layers;
  float scale;
  PagedAttentionKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    H = ki.GetAttribute<int64_t>("heads");
    Hkv = ki.GetAttribute<int64_t>("kv_heads");
    layer = ki.GetAttribute<int64_t>("layer");
    layers = ki.GetAttribute<int64_t>("layers");
    scale = ki.GetAttribute<float>("scale");
    if (H < 1 || Hkv < 1 || H % Hkv || layers < 1 || layer < 0 || layer >= layers)
      ORT_CXX_API_THROW("PagedAttention: heads must be a multiple of kv_heads >= 1, and 0 <= layer < layers",
                        ORT_INVALID_ARGUMENT);
  }
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto QKV = ctx.GetInput(0), Cos = ctx.GetInput(1), Sin = ctx.GetInput(2), PK = ctx.GetInput(3), PV = ctx.GetInput(4),
         Table = ctx.GetInput(5), Rows = ctx.GetInput(6);
    const auto xs = QKV.GetTensorTypeAndShapeInfo().GetShape(), ps = PK.GetTensorTypeAndShapeInfo().GetShape(),
               ts = Table.GetTensorTypeAndShapeInfo().GetShape(), rs = Rows.GetTensorTypeAndShapeInfo().GetShape();
    if (xs.size() != 2 || ps.size() != 2 || ps[1] < 2 || ps[1] % 2 || xs[1] != (H + 2 * Hkv) * ps[1])
      ORT_CXX_API_THROW("PagedAttention: qkv [M, (H + 2 Hkv) hd] and the pool [P, hd] do not match", ORT_INVALID_ARGUMENT);
    const int64_t M = xs[0], hd = ps[1], half = hd / 2, g = H / Hkv;
    if (PV.GetTensorTypeAndShapeInfo().GetShape() != ps || ps[0] % (layers * Hkv))
      ORT_CXX_API_THROW("PagedAttention: pool_v must be shaped as pool_k, (layers x kv heads x slots) rows", ORT_INVALID_ARGUMENT);
    if (Cos.GetTensorTypeAndShapeInfo().GetElementCount() != (size_t)(M * half) ||
        Sin.GetTensorTypeAndShapeInfo().GetElementCount() != (size_t)(M * half))
      ORT_CXX_API_THROW("PagedAttention: cos and sin must be [M, hd / 2]", ORT_INVALID_ARGUMENT);
    if (ts.size() != 2 || rs.size() != 2 || rs[0] != M || rs[1] != 4)
      ORT_CXX_API_THROW("PagedAttention: table must be [G, S] and rows [M, 4]", ORT_INVALID_ARGUMENT);
    const int64_t G = ts[0], S = ts[1], slots = ps[0] / (layers * Hkv);
    const int64_t *table = Table.GetTensorData<int64_t>(), *rows = Rows.GetTensorData<int64_t>();
    for (int64_t i = 0; i < G * S; ++i)
      if (table[i] < 0 || table[i] >= slots) ORT_CXX_API_THROW("PagedAttention: a table entry is not a slot of the pool", ORT_INVALID_ARGUMENT);
    for (int64_t r = 0; r < M; ++r) {
      const int64_t* w = rows + r * 4;   // group, position, start, start's row
      if (w[0] < 0 || w[0] >= G || w[1] < 0 || w[1] >= S || w[2] < 0 || w[2] > w[1] || w[3] < 0 || w[3] + w[1] - w[2] >= M)
        ORT_CXX_API_THROW("PagedAttention: a row's group, position or segment is out of range", ORT_INVALID_ARGUMENT);
    }
    float* out = ctx.GetOutput(0, std::vector<int64_t>{M, H * hd}).GetTensorMutableData<float>();
    if (M == 0) return;
    const float *x = QKV.GetTensorData<float>(), *cs = Cos.GetTensorData<float>(), *sn = Sin.GetTensorData<float>();
    std::vector<float> q((size_t)(M * H * hd)), k((size_t)(M * Hkv * hd)), v((size_t)(M * Hkv * hd));
    // the pool is written in place (see the top of the file)
    float* pk = const_cast<float*>(PK.GetTensorData<float>()) + layer * Hkv * slots * hd;
    float* pv = const_cast<float*>(PV.GetTensorData<float>()) + layer * Hkv * slots * hd;
    for (int64_t r = 0; r < M; ++r) {
      const float* xr = x + r * (H + 2 * Hkv) * hd;
      const float *c = cs + r * half, *s = sn + r * half;
      for (int64_t j = 0; j < H; ++j) rope(xr + j * hd, c, s, q.data() + (r * H + j) * hd, half);
      const int64_t at = table[rows[r * 4] * S + rows[r * 4 + 1]];
      for (int64_t h = 0; h < Hkv; ++h) {
        float* kr = k.data() + (r * Hkv + h) * hd;
        rope(xr + (H + h) * hd, c, s, kr, half);
        std::memcpy(v.data() + (r * Hkv + h) * hd, xr + (H + Hkv + h) * hd, hd * sizeof(float));
      }
      for (int64_t h = 0; h < Hkv; ++h) {
        std::memcpy(pk + (h * slots + at) * hd, k.data() + (r * Hkv + h) * hd, hd * sizeof(float));
        std::memcpy(pv + (h * slots + at) * hd, v.data() + (r * Hkv + h) * hd, hd * sizeof(float));
      }
    }
    Step w{q.data(), k.data(), v.data(), pk, pv, table, rows, H, Hkv, g, hd, S, slots, scale, out};
    double work = 0;                          // multiply-adds: scores and values
    for (int64_t r = 0; r < M; ++r) work += 2.0 * (rows[r * 4 + 1] + 1) * H * hd;
    run_tasks(ctx, row_task, (size_t)(M * Hkv), &w, work);
  }
};

struct PagedAttentionOp : Ort::CustomOpBase<PagedAttentionOp, PagedAttentionKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new PagedAttentionKernel(api, info); }
  const char* GetName() const { return "PagedAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 7; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i >= 5 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

void add_paged_attention(Ort::CustomOpDomain& domain) {
  static PagedAttentionOp op;
  domain.Add(&op);
}

}  // namespace zeroedge_ort
