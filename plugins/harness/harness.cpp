// Host harness for libzeroedge_plugins.so, built against the TensorRT headers but not libnvinfer.
//
//   zeroedge_harness LIB.so          dlopen, getCreators, create every plugin from fields, check
//                                    getOutputShapes through its own IExprBuilder, formats, data types,
//                                    workspace, bad fields / shapes (clear errors, no crash), and the
//                                    field round trip (serialize -> create at kRUNTIME -> same fields)
//   zeroedge_harness LIB.so --gpu    also enqueue every plugin on a CUDA device (SIH / PAD fp32,
//                                    ZeroEdgePathsFFN fp16 / bf16) and compare with a CPU reference:
//                                    proves the glue's input/output plumbing
//   zeroedge_harness LIB.so --run CASE.txt
//                                    one plugin, created from the fields and run on the inputs CASE.txt
//                                    names (raw files), its outputs written where it says; Python
//                                    (benchmarks/gpu/plugin_cases.py) writes the cases from the nodes of
//                                    graphs the real TensorRT builder accepted and compares the outputs
//                                    with zeroedge.backends.plugin_reference
//
// Prints one line per group and "harness: N checks passed"; exit code 1 on any failure.
#include "NvInferRuntime.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <sstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

using namespace nvinfer1;

static int gChecks = 0, gFail = 0;
#define CHECK(cond, what)                                                                                             \
    do                                                                                                                \
    {                                                                                                                 \
        ++gChecks;                                                                                                    \
        if (!(cond))                                                                                                  \
        {                                                                                                             \
            ++gFail;                                                                                                  \
            std::fprintf(stderr, "FAIL line %d: %s\n", __LINE__, std::string(what).c_str());                          \
        }                                                                                                             \
    } while (0)

// ------------------------------------------------------------------------- logger capturing messages
class CaptureLogger : public ILogger
{
public:
    void log(Severity sev, AsciiChar const* msg) noexcept override
    {
        if (sev <= Severity::kWARNING) messages.emplace_back(msg);
    }
    std::vector<std::string> messages;
    bool saw(char const* part) const
    {
        for (auto const& m : messages)
            if (m.find(part) != std::string::npos) return true;
        return false;
    }
    std::string last() const { return messages.empty() ? std::string("(no message)") : messages.back(); }
};

class Finder : public ILoggerFinder
{
public:
    ILogger* findLogger() override { return &logger; }
    CaptureLogger logger;
};

// ----------------------------------------------------------------------- the harness's expression builder
struct Node
{
    enum Kind { kConst, kSym, kOp, kSize } kind{kConst};
    Node() = default;
    explicit Node(Kind k)
        : kind(k)
    {
    }
    int64_t value{0};
    std::string sym;
    DimensionOperation op{DimensionOperation::kSUM};
    Node const* a{nullptr};
    Node const* b{nullptr};
    int32_t outIndex{-1};
};

class ExprImpl : public apiv::VDimensionExpr
{
public:
    Node n;
    bool isConstant() const override { return n.kind == Node::kConst; }
    int64_t getConstantValue() const override
    {
        return n.kind == Node::kConst ? n.value : std::numeric_limits<int64_t>::min();
    }
    bool isSizeTensor() const override { return n.kind == Node::kSize; }
};

class Expr : public IDimensionExpr
{
public:
    Expr() { mImpl = &impl; }
    ~Expr() noexcept override = default;
    ExprImpl impl;
};

static Node const& node(IDimensionExpr const& e) { return static_cast<Expr const&>(e).impl.n; }

class BuilderImpl : public apiv::VExprBuilder
{
public:
    Expr* make(Node n)
    {
        pool.emplace_back(new Expr());
        pool.back()->impl.n = n;
        return pool.back().get();
    }
    IDimensionExpr const* constant(int64_t v) override
    {
        Node n(Node::kConst);
        n.value = v;
        return make(n);
    }
    IDimensionExpr const* sym(std::string const& s)
    {
        Node n(Node::kSym);
        n.sym = s;
        return make(n);
    }
    IDimensionExpr const* operation(DimensionOperation op, IDimensionExpr const& a, IDimensionExpr const& b) override
    {
        Node n(Node::kOp);
        n.op = op;
        n.a = &node(a);
        n.b = &node(b);
        return make(n);
    }
    IDimensionExpr const* declareSizeTensor(int32_t outputIndex, IDimensionExpr const& opt, IDimensionExpr const& upper) override
    {
        Node n(Node::kSize);
        n.outIndex = outputIndex;
        n.a = &node(opt);
        n.b = &node(upper);
        sizeTensors.push_back(outputIndex);
        return make(n);
    }
    std::deque<std::unique_ptr<Expr>> pool;
    std::vector<int32_t> sizeTensors;
};

class Builder : public IExprBuilder
{
public:
    Builder() { mImpl = &impl; }
    ~Builder() noexcept override = default;
    BuilderImpl impl;
};

using Env = std::map<std::string, int64_t>;

static int64_t eval(Node const* n, Env const& env)
{
    switch (n->kind)
    {
    case Node::kConst: return n->value;
    case Node::kSym: return env.at(n->sym);
    case Node::kSize: return env.count("K") ? env.at("K") : -1;
    case Node::kOp:
    {
        int64_t a = eval(n->a, env), b = eval(n->b, env);
        switch (n->op)
        {
        case DimensionOperation::kSUM: return a + b;
        case DimensionOperation::kPROD: return a * b;
        case DimensionOperation::kMAX: return a > b ? a : b;
        case DimensionOperation::kMIN: return a < b ? a : b;
        case DimensionOperation::kSUB: return a - b;
        case DimensionOperation::kEQUAL: return a == b;
        case DimensionOperation::kLESS: return a < b;
        case DimensionOperation::kFLOOR_DIV: return a / b;
        case DimensionOperation::kCEIL_DIV: return (a + b - 1) / b;
        }
    }
    }
    return -999;
}

static DimsExprs dims(Builder& b, std::vector<std::string> const& ds)
{
    DimsExprs d{};
    d.nbDims = int32_t(ds.size());
    for (size_t i = 0; i < ds.size(); ++i)
    {
        bool num = !ds[i].empty() && (std::isdigit(static_cast<unsigned char>(ds[i][0])));
        d.d[i] = num ? b.impl.constant(std::stoll(ds[i])) : b.impl.sym(ds[i]);
    }
    return d;
}

static std::vector<int64_t> evalDims(DimsExprs const& d, Env const& env)
{
    std::vector<int64_t> v;
    for (int32_t i = 0; i < d.nbDims; ++i) v.push_back(eval(&node(*d.d[i]), env));
    return v;
}

// ------------------------------------------------------------------------- fields
struct FieldSet
{
    std::deque<float> f;
    std::deque<int32_t> i;
    std::deque<double> d;
    std::vector<PluginField> v;
    FieldSet& fl(char const* n, float x)
    {
        f.push_back(x);
        v.emplace_back(n, &f.back(), PluginFieldType::kFLOAT32, 1);
        return *this;
    }
    FieldSet& in(char const* n, int32_t x)
    {
        i.push_back(x);
        v.emplace_back(n, &i.back(), PluginFieldType::kINT32, 1);
        return *this;
    }
    FieldSet& f64(char const* n, double x)
    {
        d.push_back(x);
        v.emplace_back(n, &d.back(), PluginFieldType::kFLOAT64, 1);
        return *this;
    }
    PluginFieldCollection fc() const { return PluginFieldCollection{int32_t(v.size()), v.data()}; }
};

static std::map<std::string, std::string> fieldValues(PluginFieldCollection const* fc)
{
    std::map<std::string, std::string> m;
    for (int32_t k = 0; k < fc->nbFields; ++k)
    {
        PluginField const& f = fc->fields[k];
        char buf[64];
        if (f.type == PluginFieldType::kFLOAT32) std::snprintf(buf, sizeof buf, "f:%.9g", *static_cast<float const*>(f.data));
        else if (f.type == PluginFieldType::kINT32) std::snprintf(buf, sizeof buf, "i:%d", *static_cast<int32_t const*>(f.data));
        else std::snprintf(buf, sizeof buf, "other");
        m[f.name] = buf;
    }
    return m;
}

static DynamicPluginTensorDesc desc(DataType t, std::vector<int64_t> const& d, std::vector<int64_t> const& maxd = {})
{
    DynamicPluginTensorDesc x{};
    x.desc.type = t;
    x.desc.format = TensorFormat::kLINEAR;
    x.desc.dims.nbDims = int32_t(d.size());
    x.min.nbDims = x.max.nbDims = x.opt.nbDims = int32_t(d.size());
    for (size_t i = 0; i < d.size(); ++i)
    {
        x.desc.dims.d[i] = d[i];
        int64_t m = maxd.empty() ? d[i] : maxd[i];
        x.min.d[i] = d[i] < 0 ? 1 : d[i];
        x.max.d[i] = x.opt.d[i] = m;
    }
    return x;
}

template <class T>
static T* cap(IPluginV3* p, PluginCapabilityType t)
{
    return p ? static_cast<T*>(p->getCapabilityInterface(t)) : nullptr;
}

// ------------------------------------------------------------------------- GPU plumbing check (fp32)
static bool cudaOk(cudaError_t e, char const* what)
{
    if (e != cudaSuccess) std::fprintf(stderr, "CUDA error in %s: %s\n", what, cudaGetErrorString(e));
    return e == cudaSuccess;
}

struct DevBuf
{
    void* p{nullptr};
    size_t n{0};
    explicit DevBuf(size_t bytes)
        : n(bytes)
    {
        cudaOk(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc");
    }
    ~DevBuf() { cudaFree(p); }
    template <class T> void put(std::vector<T> const& v) { cudaOk(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "H2D"); }
    template <class T> std::vector<T> get(size_t count) const
    {
        std::vector<T> v(count);
        cudaOk(cudaMemcpy(v.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost), "D2H");
        return v;
    }
};

static PluginTensorDesc pdesc(DataType t, std::vector<int64_t> const& d)
{
    PluginTensorDesc x{};
    x.type = t;
    x.format = TensorFormat::kLINEAR;
    x.dims.nbDims = int32_t(d.size());
    for (size_t i = 0; i < d.size(); ++i) x.dims.d[i] = d[i];
    return x;
}

// ZeroEdgeSIHChunk over the prompt in chunks (carry_out fed back as the next carry) against ZeroEdgeSIH
// over the whole prompt in one pass: the same keep and base on every row
static void chunkGpuCheck(IPluginCreatorV3One* sihC, IPluginCreatorV3One* chunkC,
    std::vector<std::vector<float>> const& in, std::vector<std::vector<int64_t>> const& shp, float thr, int R,
    int blockSize, int chunk, bool expectMix)
{
    int const T = int(shp[0][0]), D = int(shp[0][1]);
    FieldSet fs;
    fs.fl("threshold", thr).in("anchor_rank", R).in("block_size", blockSize);
    auto fc = fs.fc();
    IPluginV3* one = sihC->createPlugin("sih", &fc, TensorRTPhase::kRUNTIME);
    IPluginV3* chk = chunkC->createPlugin("sih_chunk", &fc, TensorRTPhase::kRUNTIME);
    auto* ort = cap<IPluginV3OneRuntime>(one, PluginCapabilityType::kRUNTIME);
    auto* crt = cap<IPluginV3OneRuntime>(chk, PluginCapabilityType::kRUNTIME);
    auto* cbl = cap<IPluginV3OneBuild>(chk, PluginCapabilityType::kBUILD);
    CHECK(ort && crt && cbl && cbl->getNbOutputs() == 3, "SIH chunk runtime/build interfaces, 3 outputs");
    if (!ort || !crt || !cbl) return;
    std::vector<std::unique_ptr<DevBuf>> bufs;
    std::vector<void const*> ptrs;
    std::vector<DynamicPluginTensorDesc> dyn;
    for (size_t i = 0; i < shp.size(); ++i)
    {
        bufs.emplace_back(new DevBuf(in[i].size() * 4));
        bufs.back()->put(in[i]);
        ptrs.push_back(bufs.back()->p);
        dyn.push_back(desc(DataType::kFLOAT, shp[i]));
    }
    dyn.push_back(desc(DataType::kFLOAT, {2}));
    dyn.push_back(desc(DataType::kINT32, {2}));
    DevBuf ws(cbl->getWorkspaceSize(dyn.data(), 14, nullptr, 3));
    auto run = [&](IPluginV3OneRuntime* rt, int a, int n, bool chunked, DevBuf& keep, DevBuf& base, DevBuf& carry,
                   DevBuf& span, DevBuf& carryOut) {
        std::vector<PluginTensorDesc> ind;
        for (auto const& s : shp) ind.push_back(pdesc(DataType::kFLOAT, s));
        ind[0] = pdesc(DataType::kFLOAT, {n, D});
        std::vector<void const*> ip(ptrs);
        ip[0] = static_cast<float const*>(ptrs[0]) + size_t(a) * D;
        std::vector<PluginTensorDesc> outd = {pdesc(DataType::kINT32, {n}), pdesc(DataType::kFLOAT, {n, D})};
        void* outs[3] = {static_cast<int32_t*>(keep.p) + a, static_cast<float*>(base.p) + size_t(a) * D, carryOut.p};
        if (chunked)
        {
            ind.push_back(pdesc(DataType::kFLOAT, {2}));
            ind.push_back(pdesc(DataType::kINT32, {2}));
            ip.push_back(carry.p);
            ip.push_back(span.p);
            outd.push_back(pdesc(DataType::kFLOAT, {2}));
        }
        return rt->enqueue(ind.data(), outd.data(), ip.data(), outs, ws.p, nullptr);
    };
    DevBuf k1(T * 4), b1(size_t(T) * D * 4), k2(T * 4), b2(size_t(T) * D * 4), carry(8), span(8), carryOut(8);
    cudaMemset(b2.p, 0xff, size_t(T) * D * 4);
    CHECK(run(ort, 0, T, false, k1, b1, carry, span, carryOut) == 0, "SIH one-pass enqueue");
    bool ok = true;
    for (int a = 0; a < T && ok; a += chunk)
    {
        int n = std::min(chunk, T - a);
        span.put(std::vector<int32_t>{a, T});
        ok = run(crt, a, n, true, k2, b2, carry, span, carryOut) == 0;
        cudaOk(cudaMemcpy(carry.p, carryOut.p, 8, cudaMemcpyDeviceToDevice), "carry");
    }
    CHECK(ok, "SIH chunk enqueue");
    cudaOk(cudaDeviceSynchronize(), "SIH chunk sync");
    auto ka = k1.get<int32_t>(T), kb = k2.get<int32_t>(T);
    auto ba = b1.get<float>(size_t(T) * D), bb = b2.get<float>(size_t(T) * D);
    int kept = int(std::count(ka.begin(), ka.end(), 1));
    CHECK(ka == kb, "SIH chunks of " + std::to_string(chunk) + " keep what one pass keeps");
    CHECK(ba == bb, "SIH chunks of " + std::to_string(chunk) + " write one pass's base");
    CHECK(!expectMix || (kept > 0 && kept < T), "the case keeps some rows and skips some");
    std::printf("gpu: SIH chunk fp32 T=%d chunks of %d, block %d: %d/%d kept, keep and base equal one pass\n", T, chunk,
        blockSize, kept, T);
    delete one;
    delete chk;
}

static void gpuChecks(IPluginCreatorV3One* sihC, IPluginCreatorV3One* gatC, IPluginCreatorV3One* scaC,
    IPluginCreatorV3One* chunkC)
{
    std::mt19937 rng(1234);
    std::normal_distribution<float> nd(0.f, 1.f);
    int const T = 300, D = 64, W = 4, R = 8;
    float const thr = 0.5f;
    auto rnd = [&](size_t n, float s, float off = 0.f) {
        std::vector<float> v(n);
        for (auto& x : v) x = nd(rng) * s + off;
        return v;
    };
    std::vector<std::vector<float>> in = {rnd(size_t(T) * D, 1.f), rnd(size_t(W) * D, 2.f / 8), rnd(W, 0.1f, 0.5f),
        rnd(W * W, 0.5f), rnd(W, 0.1f, 0.5f), rnd(W * W, 0.5f), rnd(W, 0.1f, 0.5f), rnd(W, 1.f), rnd(1, 0.1f),
        rnd(size_t(R) * D, 0.125f), rnd(size_t(D) * R, 0.35f), rnd(D, 0.1f)};
    // CPU reference (float64 accumulation)
    std::vector<double> score(T);
    for (int t = 0; t < T; ++t)
    {
        double h1[32], h2[32], h3[32];
        for (int i = 0; i < W; ++i)
        {
            double s = in[2][i];
            for (int k = 0; k < D; ++k) s += double(in[1][i * D + k]) * in[0][size_t(t) * D + k];
            h1[i] = s > 0 ? s : 0;
        }
        for (int i = 0; i < W; ++i)
        {
            double s = in[4][i];
            for (int j = 0; j < W; ++j) s += double(in[3][i * W + j]) * h1[j];
            h2[i] = s > 0 ? s : 0;
        }
        for (int i = 0; i < W; ++i)
        {
            double s = in[6][i];
            for (int j = 0; j < W; ++j) s += double(in[5][i * W + j]) * h2[j];
            h3[i] = s > 0 ? s : 0;
        }
        double s = in[8][0];
        for (int j = 0; j < W; ++j) s += double(in[7][j]) * h3[j];
        score[t] = 1.0 / (1.0 + std::exp(-s));
    }
    std::vector<int32_t> keepRef(T);
    int nearThreshold = 0;
    for (int t = 0; t < T; ++t)
    {
        double w0 = 0.5, w1 = 0.333333, w2 = 0.166667, num = w0 * score[t], nrm = w0;
        if (t >= 1) { num += w1 * score[t - 1]; nrm += w1; }
        if (t >= 2) { num += w2 * score[t - 2]; nrm += w2; }
        double sm = num / nrm;
        if (std::fabs(sm - thr) < 1e-5) ++nearThreshold;
        keepRef[t] = sm >= thr || t < 4 || t >= T - 1;
    }
    FieldSet fs;
    fs.fl("threshold", thr).in("anchor_rank", R);
    auto fc = fs.fc();
    IPluginV3* sih = sihC->createPlugin("sih", &fc, TensorRTPhase::kRUNTIME);
    auto* rt = cap<IPluginV3OneRuntime>(sih, PluginCapabilityType::kRUNTIME);
    auto* bld = cap<IPluginV3OneBuild>(sih, PluginCapabilityType::kBUILD);
    CHECK(rt && bld, "SIH runtime/build interfaces");
    if (!rt || !bld) return;
    std::vector<std::vector<int64_t>> shp = {{T, D}, {W, D}, {W}, {W, W}, {W}, {W, W}, {W}, {1, W}, {1}, {R, D}, {D, R}, {D}};
    std::vector<PluginTensorDesc> ind;
    std::vector<DynamicPluginTensorDesc> dyn;
    std::vector<std::unique_ptr<DevBuf>> bufs;
    std::vector<void const*> ptrs;
    for (size_t i = 0; i < shp.size(); ++i)
    {
        ind.push_back(pdesc(DataType::kFLOAT, shp[i]));
        dyn.push_back(desc(DataType::kFLOAT, shp[i]));
        bufs.emplace_back(new DevBuf(in[i].size() * 4));
        bufs.back()->put(in[i]);
        ptrs.push_back(bufs.back()->p);
    }
    std::vector<PluginTensorDesc> outd = {pdesc(DataType::kINT32, {T}), pdesc(DataType::kFLOAT, {T, D})};
    DevBuf keep(T * 4), base(size_t(T) * D * 4);
    cudaMemset(keep.p, 0xff, T * 4);
    cudaMemset(base.p, 0xff, size_t(T) * D * 4); // NaN poison
    void* outs[2] = {keep.p, base.p};
    size_t wsz = bld->getWorkspaceSize(dyn.data(), 12, nullptr, 2);
    DevBuf ws(wsz);
    CHECK(rt->enqueue(ind.data(), outd.data(), ptrs.data(), outs, ws.p, nullptr) == 0, "SIH enqueue");
    cudaOk(cudaDeviceSynchronize(), "SIH sync");
    auto k = keep.get<int32_t>(T);
    auto bo = base.get<float>(size_t(T) * D);
    int keepDiff = 0;
    double errN = 0, refN = 0;
    for (int t = 0; t < T; ++t)
    {
        keepDiff += k[t] != keepRef[t];
        for (int d = 0; d < D; ++d)
        {
            double ref = 0;
            if (!k[t])
            {
                ref = in[11][d];
                for (int j = 0; j < R; ++j)
                {
                    double ax = 0;
                    for (int q = 0; q < D; ++q) ax += double(in[9][j * D + q]) * in[0][size_t(t) * D + q];
                    ref += double(in[10][d * R + j]) * ax;
                }
            }
            double o = bo[size_t(t) * D + d];
            errN += (o - ref) * (o - ref);
            refN += ref * ref;
        }
    }
    double rel = std::sqrt(errN / (refN > 0 ? refN : 1));
    CHECK(keepDiff <= nearThreshold, "SIH keep differs from the CPU reference at " + std::to_string(keepDiff) + " tokens");
    CHECK(rel <= 1e-5, "SIH base rel err " + std::to_string(rel));
    std::printf("gpu: SIH enqueue fp32 T=%d D=%d: keep %d/%d kept, %d differ; base rel err %.2e\n", T, D,
        int(std::count(k.begin(), k.end(), 1)), T, keepDiff, rel);
    for (int chunk : {64, 100, 1})
        chunkGpuCheck(sihC, chunkC, in, shp, thr, R, 0, chunk, true);
    chunkGpuCheck(sihC, chunkC, in, shp, thr, R, 16, 64, false);

    // gather on the SIH keep, then scatter y = xs * 2 back onto base
    PluginFieldCollection none{0, nullptr};
    IPluginV3* gat = gatC->createPlugin("gather", &none, TensorRTPhase::kRUNTIME);
    IPluginV3* sca = scaC->createPlugin("scatter", &none, TensorRTPhase::kRUNTIME);
    auto* grt = cap<IPluginV3OneRuntime>(gat, PluginCapabilityType::kRUNTIME);
    auto* srt = cap<IPluginV3OneRuntime>(sca, PluginCapabilityType::kRUNTIME);
    auto* sbl = cap<IPluginV3OneBuild>(sca, PluginCapabilityType::kBUILD);
    CHECK(grt && srt && sbl, "PAD interfaces");
    if (!grt || !srt || !sbl) return;
    DevBuf xs(size_t(T) * D * 4), idx(T * 4), cnt(4);
    PluginTensorDesc gin[2] = {pdesc(DataType::kFLOAT, {T, D}), pdesc(DataType::kINT32, {T})};
    PluginTensorDesc gout[3] = {pdesc(DataType::kFLOAT, {T, D}), pdesc(DataType::kINT32, {T}), pdesc(DataType::kINT32, {})};
    void const* gi[2] = {ptrs[0], keep.p};
    void* go[3] = {xs.p, idx.p, cnt.p};
    CHECK(grt->enqueue(gin, gout, gi, go, nullptr, nullptr) == 0, "gather enqueue");
    cudaOk(cudaDeviceSynchronize(), "gather sync");
    int K = cnt.get<int32_t>(1)[0];
    auto ix = idx.get<int32_t>(K);
    auto xv = xs.get<float>(size_t(K) * D);
    int expectK = 0, bad = 0;
    for (int t = 0; t < T; ++t)
        if (k[t])
        {
            bad += expectK >= K || ix[expectK] != t;
            for (int d = 0; d < D && expectK < K; ++d) bad += xv[size_t(expectK) * D + d] != in[0][size_t(t) * D + d];
            ++expectK;
        }
    CHECK(K == expectK && bad == 0, "gather output");
    std::vector<float> y(xv);
    for (auto& v : y) v *= 2.f;
    DevBuf yb(y.size() * 4 + 4), out(size_t(T) * D * 4);
    yb.put(y);
    cudaMemset(out.p, 0xff, size_t(T) * D * 4);
    PluginTensorDesc sin[3] = {pdesc(DataType::kFLOAT, {T, D}), pdesc(DataType::kFLOAT, {K, D}), pdesc(DataType::kINT32, {K})};
    PluginTensorDesc sout[1] = {pdesc(DataType::kFLOAT, {T, D})};
    DynamicPluginTensorDesc sdyn[3] = {desc(DataType::kFLOAT, {T, D}), desc(DataType::kFLOAT, {-1, D}, {T, D}),
        desc(DataType::kINT32, {-1}, {T})};
    DevBuf sws(sbl->getWorkspaceSize(sdyn, 3, nullptr, 1));
    void const* si[3] = {base.p, yb.p, idx.p};
    void* so[1] = {out.p};
    CHECK(srt->enqueue(sin, sout, si, so, sws.p, nullptr) == 0, "scatter enqueue");
    cudaOk(cudaDeviceSynchronize(), "scatter sync");
    auto ov = out.get<float>(size_t(T) * D);
    bad = 0;
    for (int t = 0, kk = 0; t < T; ++t)
    {
        for (int d = 0; d < D; ++d)
        {
            float want = k[t] ? y[size_t(kk) * D + d] : bo[size_t(t) * D + d];
            bad += ov[size_t(t) * D + d] != want;
        }
        kk += k[t] != 0;
    }
    CHECK(bad == 0, "scatter output: " + std::to_string(bad) + " wrong elements");
    std::printf("gpu: gather K=%d exact, scatter exact\n", K);
    // a mismatching idx length is refused, not launched
    PluginTensorDesc sin2[3] = {sin[0], sin[1], pdesc(DataType::kINT32, {K - 1})};
    CHECK(srt->enqueue(sin2, sout, si, so, sws.p, nullptr) != 0, "scatter with |idx| != |y| refused");
    delete sih;
    delete gat;
    delete sca;
}

// ------------------------------------------------------------------------- GPU check of ZeroEdgePathsFFN
// fp16 / bf16 <-> float on the host (the data are small normal numbers)
static float fromHalf(uint16_t h)
{
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float v = e == 0 ? std::ldexp(float(m), -24)
        : e == 31    ? (m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity())
                     : std::ldexp(float(m | 0x400), e - 25);
    return (h & 0x8000) ? -v : v;
}

static uint16_t toHalf(float f)
{
    uint16_t sign = std::signbit(f) ? 0x8000 : 0;
    float a = std::fabs(f);
    if (a < 6.1035156e-05f) return uint16_t(sign | uint16_t(std::nearbyint(a * 16777216.f))); // subnormal
    int e = 0;
    int m = int(std::nearbyint(std::frexp(a, &e) * 2048.f)) - 1024; // a = (1 + m / 1024) * 2^(e - 1)
    if (m == 1024) m = 0, ++e;
    if (e + 14 >= 31) return uint16_t(sign | 0x7c00);
    return uint16_t(sign | ((e + 14) << 10) | m);
}

static float fromBf16(uint16_t h)
{
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

static uint16_t toBf16(float f)
{
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); // round to nearest even
}

// y = ZeroEdgePathsFFN(x, w13_t, wd_t) at B tokens against a double reference on the same rounded
// data; y and the workspace are poisoned first (the plugin passes work_is_zero = 0).
static void pathsGpuCheck(IPluginCreatorV3One* pc, DataType dt, int B)
{
    int const D = 256, F = 64;
    bool const bf = dt == DataType::kBF16;
    char const* tn = bf ? "bf16" : "fp16";
    std::mt19937 rng(777 + B + (bf ? 10 : 0));
    std::normal_distribution<float> nd(0.f, 1.f);
    auto make = [&](size_t n, float scale, std::vector<uint16_t>& h, std::vector<float>& f) {
        h.resize(n);
        f.resize(n);
        for (size_t i = 0; i < n; ++i)
        {
            h[i] = bf ? toBf16(nd(rng) * scale) : toHalf(nd(rng) * scale);
            f[i] = bf ? fromBf16(h[i]) : fromHalf(h[i]);
        }
    };
    std::vector<uint16_t> xh, w13h, wdh;
    std::vector<float> x, w13, wd;
    make(size_t(B) * D, 1.f, xh, x);
    make(size_t(D) * 2 * F, 1.f / 16, w13h, w13); // g, u ~ N(0, 1)
    make(size_t(F) * D, 1.f / 8, wdh, wd);
    float const thrIn = 0.5f;
    // reference: per-token input mask, a = silu(g) * u
    std::vector<double> a(size_t(B) * F);
    int keptIn = 0;
    for (int b = 0; b < B; ++b)
    {
        for (int k = 0; k < D; ++k) keptIn += std::fabs(x[size_t(b) * D + k]) >= thrIn;
        for (int j = 0; j < F; ++j)
        {
            double g = 0, u = 0;
            for (int k = 0; k < D; ++k)
            {
                float v = x[size_t(b) * D + k];
                if (!(std::fabs(v) >= thrIn)) continue;
                g += double(v) * w13[size_t(k) * 2 * F + j];
                u += double(v) * w13[size_t(k) * 2 * F + F + j];
            }
            a[size_t(b) * F + j] = g / (1.0 + std::exp(-g)) * u;
        }
    }
    // channel threshold in the widest gap of the middle half of |a| (robust to summation order)
    std::vector<double> mags;
    for (double v : a) mags.push_back(std::fabs(v));
    std::sort(mags.begin(), mags.end());
    size_t const n = mags.size();
    size_t best = n / 4;
    for (size_t i = n / 4; i + 1 < 3 * n / 4; ++i)
        if (mags[i + 1] - mags[i] > mags[best + 1] - mags[best]) best = i;
    float const thr = float((mags[best] + mags[best + 1]) / 2);
    CHECK(mags[best + 1] - mags[best] > 1e-4, "paths: no clear gap for the channel threshold");
    std::vector<double> ref(size_t(B) * D, 0.0);
    int keptCh = 0;
    for (int b = 0; b < B; ++b)
        for (int j = 0; j < F; ++j)
        {
            double v = a[size_t(b) * F + j];
            if (!(std::fabs(v) >= thr)) continue;
            ++keptCh;
            for (int d = 0; d < D; ++d) ref[size_t(b) * D + d] += v * wd[size_t(j) * D + d];
        }

    FieldSet fs;
    fs.fl("threshold_in", thrIn).fl("threshold", thr);
    auto fc = fs.fc();
    IPluginV3* p = pc->createPlugin("paths", &fc, TensorRTPhase::kRUNTIME);
    auto* rt = cap<IPluginV3OneRuntime>(p, PluginCapabilityType::kRUNTIME);
    auto* bld = cap<IPluginV3OneBuild>(p, PluginCapabilityType::kBUILD);
    CHECK(rt && bld, "paths runtime/build interfaces");
    if (!rt || !bld)
    {
        delete p;
        return;
    }
    std::vector<std::vector<int64_t>> shp = {{B, D}, {D, 2 * F}, {F, D}};
    PluginTensorDesc ind[3], outd = pdesc(dt, {B, D});
    DynamicPluginTensorDesc dyn[3], outDyn = desc(dt, {B, D});
    for (int i = 0; i < 3; ++i)
    {
        ind[i] = pdesc(dt, shp[i]);
        dyn[i] = desc(dt, shp[i]);
    }
    CHECK(bld->configurePlugin(dyn, 3, &outDyn, 1) == 0, "paths configurePlugin");
    size_t wsz = bld->getWorkspaceSize(dyn, 3, &outDyn, 1);
    DevBuf xb(xh.size() * 2), wb(w13h.size() * 2), db(wdh.size() * 2), yb(size_t(B) * D * 2), ws(wsz);
    xb.put(xh);
    wb.put(w13h);
    db.put(wdh);
    cudaMemset(yb.p, 0xff, size_t(B) * D * 2); // NaN poison
    cudaMemset(ws.p, 0xff, wsz);               // garbage: the launcher must clear its work buffer
    void const* ins[3] = {xb.p, wb.p, db.p};
    void* outs[1] = {yb.p};
    CHECK(rt->enqueue(ind, &outd, ins, outs, ws.p, nullptr) == 0, std::string("paths enqueue ") + tn);
    cudaOk(cudaDeviceSynchronize(), "paths sync");
    auto yh = yb.get<uint16_t>(size_t(B) * D);
    double errN = 0, refN = 0;
    for (size_t i = 0; i < yh.size(); ++i)
    {
        double o = bf ? fromBf16(yh[i]) : fromHalf(yh[i]);
        errN += (o - ref[i]) * (o - ref[i]);
        refN += ref[i] * ref[i];
    }
    double rel = std::sqrt(errN / (refN > 0 ? refN : 1));
    CHECK(rel < 1e-2, std::string("paths ") + tn + " B=" + std::to_string(B) + " rel err " + std::to_string(rel));
    CHECK(keptIn > 0 && keptIn < B * D && keptCh > 0 && keptCh < B * F, "paths: the masks keep some, not all");
    std::printf("gpu: ZeroEdgePathsFFN enqueue %s B=%d D=%d F=%d: inputs kept %d/%d, channels kept %d/%d; "
                "rel err %.2e\n",
        tn, B, D, F, keptIn, B * D, keptCh, B * F, rel);
    delete p;
}

static void pathsGpuChecks(IPluginCreatorV3One* pc)
{
    pathsGpuCheck(pc, DataType::kHALF, 2);
    pathsGpuCheck(pc, DataType::kBF16, 2);
    pathsGpuCheck(pc, DataType::kHALF, 1); // the batch-1 kernels
}

// ------------------------------------------------------------------------- --run CASE.txt
// Lines: "op NAME" | "field NAME f|i VALUE" | "in|out DTYPE RANK D0 .. FILE" (DTYPE float32, float16,
// bfloat16 or int32; FILE relative to CASE.txt's folder).
struct CaseTensor
{
    DataType type;
    std::vector<int64_t> dims;
    std::string file;
    size_t bytes() const
    {
        size_t n = type == DataType::kFLOAT || type == DataType::kINT32 ? 4 : 2;
        for (auto d : dims) n *= size_t(d);
        return n;
    }
};

static int runCase(std::map<std::string, IPluginCreatorV3One*>& byName, char const* path)
{
    std::ifstream f(path);
    if (!f)
    {
        std::fprintf(stderr, "--run: cannot read %s\n", path);
        return 2;
    }
    std::string dir(path), line, op;
    dir = dir.find('/') == std::string::npos ? "." : dir.substr(0, dir.rfind('/'));
    FieldSet fs;
    std::vector<CaseTensor> ins, outs;
    std::deque<std::string> names;
    while (std::getline(f, line))
    {
        std::istringstream ls(line);
        std::string kind;
        if (!(ls >> kind)) continue;
        if (kind == "op") ls >> op;
        else if (kind == "field")
        {
            std::string name, t;
            ls >> name >> t;
            names.push_back(name);
            if (t == "f") { float v; ls >> v; fs.fl(names.back().c_str(), v); }
            else { int32_t v; ls >> v; fs.in(names.back().c_str(), v); }
        }
        else if (kind == "in" || kind == "out")
        {
            std::string dt;
            int rank = 0;
            ls >> dt >> rank;
            CaseTensor c;
            c.type = dt == "float32" ? DataType::kFLOAT : dt == "float16" ? DataType::kHALF
                : dt == "bfloat16" ? DataType::kBF16 : DataType::kINT32;
            c.dims.resize(size_t(rank));
            for (auto& d : c.dims) ls >> d;
            ls >> c.file;
            c.file = dir + "/" + c.file;
            (kind == "in" ? ins : outs).push_back(c);
        }
    }
    auto it = byName.find(op);
    if (it == byName.end())
    {
        std::fprintf(stderr, "--run: no creator for op '%s'\n", op.c_str());
        return 2;
    }
    auto fc = fs.fc();
    IPluginV3* p = it->second->createPlugin("case", &fc, TensorRTPhase::kRUNTIME);
    auto* rt = cap<IPluginV3OneRuntime>(p, PluginCapabilityType::kRUNTIME);
    auto* bld = cap<IPluginV3OneBuild>(p, PluginCapabilityType::kBUILD);
    if (!rt || !bld)
    {
        std::fprintf(stderr, "--run: %s refused its fields\n", op.c_str());
        delete p;
        return 1;
    }
    std::vector<PluginTensorDesc> ind, outd;
    std::vector<DynamicPluginTensorDesc> dyn, dynOut;
    std::vector<std::unique_ptr<DevBuf>> bufs;
    std::vector<void const*> inPtrs;
    std::vector<void*> outPtrs;
    for (auto& c : ins)
    {
        std::ifstream in(c.file, std::ios::binary);
        std::vector<char> host(c.bytes());
        if (!in.read(host.data(), std::streamsize(host.size())))
        {
            std::fprintf(stderr, "--run: %s: expected %zu bytes\n", c.file.c_str(), host.size());
            delete p;
            return 2;
        }
        ind.push_back(pdesc(c.type, c.dims));
        dyn.push_back(desc(c.type, c.dims));
        bufs.emplace_back(new DevBuf(host.size()));
        bufs.back()->put(host);
        inPtrs.push_back(bufs.back()->p);
    }
    for (auto& c : outs)
    {
        outd.push_back(pdesc(c.type, c.dims));
        dynOut.push_back(desc(c.type, c.dims));
        bufs.emplace_back(new DevBuf(c.bytes()));
        cudaMemset(bufs.back()->p, 0xff, c.bytes()); // poison: every element must be written
        outPtrs.push_back(bufs.back()->p);
    }
    int rc = 0;
    if (bld->configurePlugin(dyn.data(), int32_t(dyn.size()), dynOut.data(), int32_t(dynOut.size())) != 0)
    {
        std::fprintf(stderr, "--run: %s configurePlugin refused the shapes\n", op.c_str());
        rc = 1;
    }
    else
    {
        DevBuf ws(bld->getWorkspaceSize(dyn.data(), int32_t(dyn.size()), dynOut.data(), int32_t(dynOut.size())));
        cudaMemset(ws.p, 0xff, ws.n);
        if (rt->enqueue(ind.data(), outd.data(), inPtrs.data(), outPtrs.data(), ws.p, nullptr) != 0
            || !cudaOk(cudaDeviceSynchronize(), "enqueue"))
        {
            std::fprintf(stderr, "--run: %s enqueue failed\n", op.c_str());
            rc = 1;
        }
        for (size_t k = 0; k < outs.size() && rc == 0; ++k)
        {
            auto host = bufs[ins.size() + k]->get<char>(outs[k].bytes());
            std::ofstream o(outs[k].file, std::ios::binary);
            o.write(host.data(), std::streamsize(host.size()));
        }
    }
    delete p;
    if (rc == 0) std::printf("run: %s ok\n", op.c_str());
    return rc;
}

// ------------------------------------------------------------------------- main
int main(int argc, char** argv)
{
    if (argc < 2)
    {
        std::fprintf(stderr, "usage: %s libzeroedge_plugins.so [--gpu | --run CASE.txt]\n", argv[0]);
        return 2;
    }
    bool gpu = argc > 2 && std::strcmp(argv[2], "--gpu") == 0;
    char const* runPath = argc > 3 && std::strcmp(argv[2], "--run") == 0 ? argv[3] : nullptr;
    void* h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!h)
    {
        std::fprintf(stderr, "dlopen failed: %s\n", dlerror());
        return 1;
    }
    using GetCreators = IPluginCreatorInterface* const* (*) (int32_t&);
    using SetLoggerFinder = void (*)(ILoggerFinder*);
    auto getCreators = reinterpret_cast<GetCreators>(dlsym(h, "getCreators"));
    auto setLoggerFinder = reinterpret_cast<SetLoggerFinder>(dlsym(h, "setLoggerFinder"));
    CHECK(getCreators && setLoggerFinder, "exports getCreators and setLoggerFinder");
    if (!getCreators || !setLoggerFinder) return 1;
    Finder finder;
    setLoggerFinder(&finder);
    CaptureLogger& log = finder.logger;

    int32_t n = 0;
    IPluginCreatorInterface* const* creators = getCreators(n);
    CHECK(n == 5, "5 creators");
    std::map<std::string, IPluginCreatorV3One*> byName;
    for (int32_t i = 0; i < n; ++i)
    {
        InterfaceInfo info = creators[i]->getInterfaceInfo();
        CHECK(std::strcmp(info.kind, "PLUGIN CREATOR_V3ONE") == 0 && info.major == 1, "creator interface V3One");
        auto* c = static_cast<IPluginCreatorV3One*>(creators[i]);
        CHECK(std::strcmp(c->getPluginVersion(), "1") == 0, "plugin version 1");
        CHECK(std::strcmp(c->getPluginNamespace(), "zeroedge") == 0, "namespace zeroedge");
        byName[c->getPluginName()] = c;
    }
    auto* sihC = byName["ZeroEdgeSIH"];
    auto* gatC = byName["ZeroEdgePADGather"];
    auto* scaC = byName["ZeroEdgePADScatter"];
    auto* pathsC = byName["ZeroEdgePathsFFN"];
    auto* chunkC = byName["ZeroEdgeSIHChunk"];
    CHECK(sihC && gatC && scaC && pathsC && chunkC,
        "creators for ZeroEdgeSIH, ZeroEdgeSIHChunk, ZeroEdgePADGather, ZeroEdgePADScatter, ZeroEdgePathsFFN");
    if (!sihC || !gatC || !scaC || !pathsC || !chunkC) return 1;
    if (runPath)
    {
        int rc = runCase(byName, runPath);
        setLoggerFinder(nullptr);
        return rc;
    }

    // field names advertised
    PluginFieldCollection const* names = sihC->getFieldNames();
    std::map<std::string, PluginFieldType> adv;
    for (int32_t i = 0; i < names->nbFields; ++i) adv[names->fields[i].name] = names->fields[i].type;
    CHECK(adv.size() == 12 && adv["threshold"] == PluginFieldType::kFLOAT32 && adv["min_tokens"] == PluginFieldType::kINT32
            && adv["protect_last"] == PluginFieldType::kINT32 && adv["anchor_rank"] == PluginFieldType::kINT32
            && adv["rate"] == PluginFieldType::kFLOAT32 && adv["rank_block"] == PluginFieldType::kINT32,
        "SIH advertises its 12 fields with types");
    CHECK(gatC->getFieldNames()->nbFields == 0 && scaC->getFieldNames()->nbFields == 0, "PAD nodes take no fields");
    PluginFieldCollection const* pnames = pathsC->getFieldNames();
    CHECK(pnames->nbFields == 2 && std::strcmp(pnames->fields[0].name, "threshold_in") == 0
            && std::strcmp(pnames->fields[1].name, "threshold") == 0 && pnames->fields[0].type == PluginFieldType::kFLOAT32
            && pnames->fields[1].type == PluginFieldType::kFLOAT32,
        "ZeroEdgePathsFFN advertises threshold_in, threshold (FLOAT32)");
    std::printf("creators: %d (ZeroEdgeSIH and ZeroEdgeSIHChunk %d fields, ZeroEdgePADGather, ZeroEdgePADScatter, "
                "ZeroEdgePathsFFN %d fields), "
                "namespace zeroedge, version 1\n",
        n, names->nbFields, pnames->nbFields);

    // bad fields: clear errors, nullptr, no crash
    {
        FieldSet f;
        f.in("min_tokens", 8);
        auto fc = f.fc();
        CHECK(sihC->createPlugin("x", &fc, TensorRTPhase::kBUILD) == nullptr && log.saw("required field 'threshold' is missing"),
            "missing threshold refused: " + log.last());
        FieldSet g;
        g.in("threshold", 1);
        fc = g.fc();
        CHECK(sihC->createPlugin("x", &fc, TensorRTPhase::kBUILD) == nullptr && log.saw("'threshold' must be FLOAT32"),
            "INT threshold refused: " + log.last());
        FieldSet d;
        d.f64("threshold", 0.5);
        fc = d.fc();
        CHECK(sihC->createPlugin("x", &fc, TensorRTPhase::kBUILD) == nullptr && log.saw("got kFLOAT64"),
            "FLOAT64 threshold refused: " + log.last());
        FieldSet r;
        r.fl("threshold", 0.5f).in("anchor_rank", 1000);
        fc = r.fc();
        CHECK(sihC->createPlugin("x", &fc, TensorRTPhase::kBUILD) == nullptr && log.saw("anchor_rank"),
            "anchor_rank 1000 refused: " + log.last());
        FieldSet a;
        a.in("zeroedge_abi", 99);
        fc = a.fc();
        CHECK(gatC->createPlugin("x", &fc, TensorRTPhase::kRUNTIME) == nullptr && log.saw("rebuild the engine"),
            "ABI mismatch refused: " + log.last());
        std::printf("bad fields: missing / wrong-typed / out-of-range / ABI mismatch -> nullptr with a clear error\n");
    }

    // SIH: create, shapes, formats, types, workspace, round trip
    FieldSet sf;
    sf.fl("threshold", 0.37f).in("block_size", 64).fl("block_frac", 0.65f).in("protect_last", 2).in("anchor_rank", 16)
        .in("unrelated_attribute", 5);
    auto sfc = sf.fc();
    IPluginV3* sih = sihC->createPlugin("layer0.sih", &sfc, TensorRTPhase::kBUILD);
    CHECK(sih != nullptr, "SIH created: " + log.last());
    if (!sih) return 1;
    auto* core = cap<IPluginV3OneCore>(sih, PluginCapabilityType::kCORE);
    auto* bld = cap<IPluginV3OneBuild>(sih, PluginCapabilityType::kBUILD);
    auto* rt = cap<IPluginV3OneRuntime>(sih, PluginCapabilityType::kRUNTIME);
    CHECK(core && bld && rt, "SIH capability interfaces");
    CHECK(std::strcmp(core->getPluginName(), "ZeroEdgeSIH") == 0, "SIH name");
    CHECK(bld->getNbOutputs() == 2, "SIH 2 outputs");
    {
        DataType inT[12], outT[2];
        for (auto& t : inT) t = DataType::kHALF;
        CHECK(bld->getOutputDataTypes(outT, 2, inT, 12) == 0 && outT[0] == DataType::kINT32 && outT[1] == DataType::kHALF,
            "SIH output types (int32, half)");
        Builder b;
        std::vector<DimsExprs> in = {dims(b, {"T", "2048"}), dims(b, {"2", "2048"}), dims(b, {"2"}), dims(b, {"2", "2"}),
            dims(b, {"2"}), dims(b, {"2", "2"}), dims(b, {"2"}), dims(b, {"1", "2"}), dims(b, {"1"}),
            dims(b, {"16", "2048"}), dims(b, {"2048", "16"}), dims(b, {"2048"})};
        DimsExprs out[2];
        CHECK(bld->getOutputShapes(in.data(), 12, nullptr, 0, out, 2, b) == 0, "SIH getOutputShapes: " + log.last());
        Env env{{"T", 4096}};
        CHECK(out[0].nbDims == 1 && evalDims(out[0], env) == std::vector<int64_t>({4096}), "keep is [T]");
        CHECK(out[1].nbDims == 2 && evalDims(out[1], env) == std::vector<int64_t>({4096, 2048}), "base is [T, D]");
        std::printf("SIH: getOutputShapes keep [T], base [T, 2048] (T=4096 through the harness IExprBuilder)\n");
        // unsupported shapes: clear error, non-zero
        auto in3 = in;
        in3[0] = dims(b, {"1", "T", "2048"});
        CHECK(bld->getOutputShapes(in3.data(), 12, nullptr, 0, out, 2, b) != 0 && log.saw("no batch dimension"),
            "3-D x refused: " + log.last());
        auto inD = in;
        inD[0] = dims(b, {"T", "100"});
        inD[1] = dims(b, {"2", "100"});
        CHECK(bld->getOutputShapes(inD.data(), 12, nullptr, 0, out, 2, b) != 0 && log.saw("multiple of 8"),
            "D = 100 refused: " + log.last());
        auto inW = in;
        inW[1] = dims(b, {"40", "2048"});
        CHECK(bld->getOutputShapes(inW.data(), 12, nullptr, 0, out, 2, b) != 0 && log.saw("head width W = 40"),
            "W = 40 refused: " + log.last());
        CHECK(bld->getOutputShapes(in.data(), 11, nullptr, 0, out, 2, b) != 0 && log.saw("expects 12 inputs"),
            "11 inputs refused: " + log.last());
        // formats
        std::vector<DynamicPluginTensorDesc> io;
        std::vector<std::vector<int64_t>> shp = {{-1, 2048}, {2, 2048}, {2}, {2, 2}, {2}, {2, 2}, {2}, {1, 2}, {1},
            {16, 2048}, {2048, 16}, {2048}};
        for (auto& s : shp) io.push_back(desc(DataType::kHALF, s, s[0] < 0 ? std::vector<int64_t>{4096, 2048} : s));
        io.push_back(desc(DataType::kINT32, {-1}, {4096}));
        io.push_back(desc(DataType::kHALF, {-1, 2048}, {4096, 2048}));
        CHECK(bld->supportsFormatCombination(0, io.data(), 12, 2), "x half ok");
        CHECK(bld->supportsFormatCombination(5, io.data(), 12, 2), "weights half with x half ok");
        CHECK(bld->supportsFormatCombination(12, io.data(), 12, 2) && bld->supportsFormatCombination(13, io.data(), 12, 2),
            "keep int32, base half ok");
        auto io2 = io;
        io2[5].desc.type = DataType::kFLOAT;
        CHECK(!bld->supportsFormatCombination(5, io2.data(), 12, 2), "mixed weight type refused");
        io2[0].desc.type = DataType::kINT8;
        CHECK(!bld->supportsFormatCombination(0, io2.data(), 12, 2), "int8 x refused");
        io2 = io;
        io2[13].desc.format = TensorFormat::kCHW32;
        CHECK(!bld->supportsFormatCombination(13, io2.data(), 12, 2), "non-linear format refused");
        CHECK(bld->configurePlugin(io.data(), 12, io.data() + 12, 2) == 0, "SIH configurePlugin: " + log.last());
        size_t ws = bld->getWorkspaceSize(io.data(), 12, io.data() + 12, 2);
        CHECK(ws > size_t(4096) * 16 * 4, "SIH workspace sized from the max profile");
        auto ioBad = io;
        ioBad[0] = desc(DataType::kHALF, {-1, 2048}, {4096, 2048});
        ioBad[0].max.d[1] = 2049; // max profile disagrees
        CHECK(bld->configurePlugin(ioBad.data(), 12, io.data() + 12, 2) != 0, "configure with D=2049 refused");
        std::printf("SIH: formats, types, configure, workspace %zu bytes at T<=4096\n", ws);
    }
    {
        PluginFieldCollection const* ser = rt->getFieldsToSerialize();
        auto before = fieldValues(ser);
        CHECK(before["threshold"] == "f:0.370000005" && before["block_size"] == "i:64" && before["protect_last"] == "i:2"
                && before["min_tokens"] == "i:32" && before["rate"] == "f:-1" && before["rank_block"] == "i:512"
                && before["zeroedge_abi"] == "i:2",
            "SIH serialized fields");
        IPluginV3* back = sihC->createPlugin("layer0.sih", ser, TensorRTPhase::kRUNTIME);
        CHECK(back != nullptr, "SIH re-created from serialized fields");
        if (back)
        {
            auto after = fieldValues(cap<IPluginV3OneRuntime>(back, PluginCapabilityType::kRUNTIME)->getFieldsToSerialize());
            CHECK(after == before, "SIH fields round trip");
            delete back;
        }
        IPluginV3* c1 = sih->clone();
        IPluginV3* c2 = rt->attachToContext(nullptr);
        CHECK(c1 && c2, "clone / attachToContext");
        if (c1 && c2)
            CHECK(fieldValues(cap<IPluginV3OneRuntime>(c2, PluginCapabilityType::kRUNTIME)->getFieldsToSerialize()) == before,
                "clone keeps the fields");
        delete c1;
        delete c2;
        std::printf("SIH: %zu fields round-trip through getFieldsToSerialize -> createPlugin(kRUNTIME)\n", before.size());
    }

    // SIH chunk: the same fields, two more inputs (carry float [2], span int32 [2]), carry_out float [2]
    {
        IPluginV3* ch = chunkC->createPlugin("layer0.sih_chunk", &sfc, TensorRTPhase::kBUILD);
        auto* cb = cap<IPluginV3OneBuild>(ch, PluginCapabilityType::kBUILD);
        auto* cc = cap<IPluginV3OneCore>(ch, PluginCapabilityType::kCORE);
        CHECK(cb && cc && std::strcmp(cc->getPluginName(), "ZeroEdgeSIHChunk") == 0 && cb->getNbOutputs() == 3,
            "SIH chunk created with 3 outputs: " + log.last());
        if (cb)
        {
            DataType inT[14], outT[3];
            for (auto& t : inT) t = DataType::kHALF;
            inT[12] = DataType::kFLOAT;
            inT[13] = DataType::kINT32;
            CHECK(cb->getOutputDataTypes(outT, 3, inT, 14) == 0 && outT[0] == DataType::kINT32 && outT[1] == DataType::kHALF
                    && outT[2] == DataType::kFLOAT,
                "SIH chunk output types (int32, half, float)");
            Builder b;
            std::vector<DimsExprs> in = {dims(b, {"T", "2048"}), dims(b, {"2", "2048"}), dims(b, {"2"}), dims(b, {"2", "2"}),
                dims(b, {"2"}), dims(b, {"2", "2"}), dims(b, {"2"}), dims(b, {"1", "2"}), dims(b, {"1"}),
                dims(b, {"16", "2048"}), dims(b, {"2048", "16"}), dims(b, {"2048"}), dims(b, {"2"}), dims(b, {"2"})};
            DimsExprs out[3];
            CHECK(cb->getOutputShapes(in.data(), 14, nullptr, 0, out, 3, b) == 0, "SIH chunk shapes: " + log.last());
            Env env{{"T", 512}};
            CHECK(evalDims(out[0], env) == std::vector<int64_t>({512}) && evalDims(out[2], env) == std::vector<int64_t>({2}),
                "keep [T], carry_out [2]");
            CHECK(cb->getOutputShapes(in.data(), 12, nullptr, 0, out, 3, b) != 0 && log.saw("expects 14 inputs"),
                "12 inputs refused: " + log.last());
            auto inS = in;
            inS[13] = dims(b, {"3"});
            CHECK(cb->getOutputShapes(inS.data(), 14, nullptr, 0, out, 3, b) != 0 && log.saw("(span) must be [2]"),
                "span [3] refused: " + log.last());
            std::vector<DynamicPluginTensorDesc> io;
            std::vector<std::vector<int64_t>> shp = {{-1, 2048}, {2, 2048}, {2}, {2, 2}, {2}, {2, 2}, {2}, {1, 2}, {1},
                {16, 2048}, {2048, 16}, {2048}};
            for (auto& s : shp) io.push_back(desc(DataType::kHALF, s, s[0] < 0 ? std::vector<int64_t>{512, 2048} : s));
            io.push_back(desc(DataType::kFLOAT, {2}));
            io.push_back(desc(DataType::kINT32, {2}));
            io.push_back(desc(DataType::kINT32, {-1}, {512}));
            io.push_back(desc(DataType::kHALF, {-1, 2048}, {512, 2048}));
            io.push_back(desc(DataType::kFLOAT, {2}));
            bool all = true;
            for (int pos = 0; pos < 17; ++pos) all = all && cb->supportsFormatCombination(pos, io.data(), 14, 3);
            CHECK(all, "SIH chunk formats: x / weights half, carry float, span int32, keep int32, carry_out float");
            auto io2 = io;
            io2[13].desc.type = DataType::kFLOAT;
            CHECK(!cb->supportsFormatCombination(13, io2.data(), 14, 3), "float span refused");
            CHECK(cb->configurePlugin(io.data(), 14, io.data() + 14, 3) == 0, "SIH chunk configurePlugin: " + log.last());
            auto before = fieldValues(cap<IPluginV3OneRuntime>(ch, PluginCapabilityType::kRUNTIME)->getFieldsToSerialize());
            CHECK(before["block_size"] == "i:64", "SIH chunk serializes the SIH fields");
            std::printf("SIH chunk: 14 inputs / 3 outputs, carry_out [2], formats, configure, fields\n");
        }
        delete ch;
    }

    // Gather: data-dependent K through a size tensor
    {
        PluginFieldCollection none{0, nullptr};
        IPluginV3* g = gatC->createPlugin("layer0.gather", &none, TensorRTPhase::kBUILD);
        auto* gb = cap<IPluginV3OneBuild>(g, PluginCapabilityType::kBUILD);
        CHECK(gb && gb->getNbOutputs() == 3, "gather created with 3 outputs");
        if (gb)
        {
            DataType inT[2] = {DataType::kHALF, DataType::kINT32}, outT[3];
            CHECK(gb->getOutputDataTypes(outT, 3, inT, 2) == 0 && outT[0] == DataType::kHALF && outT[1] == DataType::kINT32
                    && outT[2] == DataType::kINT32,
                "gather output types");
            Builder b;
            std::vector<DimsExprs> in = {dims(b, {"T", "576"}), dims(b, {"T"})};
            DimsExprs out[3];
            CHECK(gb->getOutputShapes(in.data(), 2, nullptr, 0, out, 3, b) == 0, "gather shapes: " + log.last());
            CHECK(b.impl.sizeTensors == std::vector<int32_t>({2}), "count (output 2) declared as the size tensor");
            CHECK(out[2].nbDims == 0, "count is 0-D");
            CHECK(out[0].nbDims == 2 && out[0].d[0]->isSizeTensor() && out[1].nbDims == 1 && out[1].d[0] == out[0].d[0],
                "xs [K, D] and idx [K] share the size tensor K");
            Node const& K = node(*out[0].d[0]);
            Env env{{"T", 1001}};
            CHECK(eval(K.b, env) == 1001 && eval(K.a, env) == 501, "K: upper bound T, opt ceil(T/2)");
            CHECK(evalDims(out[0], Env{{"T", 1001}, {"K", 7}}) == std::vector<int64_t>({7, 576}), "xs = [K, 576]");
            std::vector<DimsExprs> badc = {dims(b, {"1001", "576"}), dims(b, {"1000"})};
            CHECK(gb->getOutputShapes(badc.data(), 2, nullptr, 0, out, 3, b) != 0 && log.saw("keep"),
                "gather keep length mismatch refused: " + log.last());
            std::printf("gather: xs [K, D], idx [K], count 0-D size tensor (opt ceil(T/2), upper T)\n");
        }
        auto* grt = cap<IPluginV3OneRuntime>(g, PluginCapabilityType::kRUNTIME);
        if (grt)
        {
            auto ser = grt->getFieldsToSerialize();
            IPluginV3* back = gatC->createPlugin("g", ser, TensorRTPhase::kRUNTIME);
            CHECK(back && fieldValues(ser).size() == 1, "gather fields round trip");
            delete back;
        }
        delete g;
    }
    // Scatter
    {
        PluginFieldCollection none{0, nullptr};
        IPluginV3* s = scaC->createPlugin("layer0.scatter", &none, TensorRTPhase::kBUILD);
        auto* sb = cap<IPluginV3OneBuild>(s, PluginCapabilityType::kBUILD);
        CHECK(sb && sb->getNbOutputs() == 1, "scatter created");
        if (sb)
        {
            Builder b;
            std::vector<DimsExprs> in = {dims(b, {"T", "576"}), dims(b, {"K", "576"}), dims(b, {"K"})};
            DimsExprs out[1];
            CHECK(sb->getOutputShapes(in.data(), 3, nullptr, 0, out, 1, b) == 0, "scatter shapes: " + log.last());
            CHECK(evalDims(out[0], Env{{"T", 50}, {"K", 3}}) == std::vector<int64_t>({50, 576}), "out = base's shape");
            std::vector<DimsExprs> bad = {dims(b, {"T", "576"}), dims(b, {"K", "512"}), dims(b, {"K"})};
            CHECK(sb->getOutputShapes(bad.data(), 3, nullptr, 0, out, 1, b) != 0 && log.saw("(y) must be [K, D]"),
                "scatter y width mismatch refused: " + log.last());
            std::printf("scatter: out = base's [T, D]\n");
        }
        delete s;
    }

    // ZeroEdgePathsFFN: fields, shapes, formats, types, workspace, launcher errors, round trip
    {
        FieldSet m;
        m.fl("threshold", 0.1f);
        auto fc = m.fc();
        CHECK(pathsC->createPlugin("p", &fc, TensorRTPhase::kBUILD) == nullptr
                && log.saw("ZeroEdgePathsFFN: required field 'threshold_in' is missing"),
            "paths missing threshold_in refused: " + log.last());
        FieldSet t;
        t.fl("threshold_in", 0.1f).in("threshold", 1);
        fc = t.fc();
        CHECK(pathsC->createPlugin("p", &fc, TensorRTPhase::kBUILD) == nullptr
                && log.saw("ZeroEdgePathsFFN: field 'threshold' must be FLOAT32"),
            "paths INT threshold refused: " + log.last());
        FieldSet d;
        d.f64("threshold_in", 0.1).fl("threshold", 0.1f);
        fc = d.fc();
        CHECK(pathsC->createPlugin("p", &fc, TensorRTPhase::kBUILD) == nullptr && log.saw("'threshold_in' must be FLOAT32"),
            "paths FLOAT64 threshold_in refused: " + log.last());
        FieldSet g;
        g.fl("threshold_in", 0.1f).fl("threshold", -1.f);
        fc = g.fc();
        CHECK(pathsC->createPlugin("p", &fc, TensorRTPhase::kBUILD) == nullptr
                && log.saw("ZeroEdgePathsFFN: field 'threshold' must be a finite number >= 0"),
            "paths negative threshold refused: " + log.last());
        FieldSet nn;
        nn.fl("threshold_in", std::numeric_limits<float>::quiet_NaN()).fl("threshold", 0.1f);
        fc = nn.fc();
        CHECK(pathsC->createPlugin("p", &fc, TensorRTPhase::kBUILD) == nullptr
                && log.saw("'threshold_in' must be a finite number >= 0"),
            "paths NaN threshold_in refused: " + log.last());
        float two[2] = {0.1f, 0.2f};
        FieldSet l;
        l.fl("threshold", 0.1f);
        l.v.emplace_back("threshold_in", two, PluginFieldType::kFLOAT32, 2);
        fc = l.fc();
        CHECK(pathsC->createPlugin("p", &fc, TensorRTPhase::kBUILD) == nullptr && log.saw("must hold exactly one value, got 2"),
            "paths two-valued threshold_in refused: " + log.last());
        FieldSet a;
        a.fl("threshold_in", 0.1f).fl("threshold", 0.1f).in("zeroedge_abi", 99);
        fc = a.fc();
        CHECK(pathsC->createPlugin("p", &fc, TensorRTPhase::kRUNTIME) == nullptr
                && log.saw("ZeroEdgePathsFFN: engine was built with plugin ABI 99"),
            "paths ABI mismatch refused: " + log.last());
    }
    {
        FieldSet pf;
        pf.fl("threshold_in", 0.25f).fl("threshold", 0.0625f).in("unrelated_attribute", 5);
        auto pfc = pf.fc();
        IPluginV3* paths = pathsC->createPlugin("layer0.paths", &pfc, TensorRTPhase::kBUILD);
        CHECK(paths != nullptr, "paths created: " + log.last());
        if (!paths) return 1;
        auto* pcore = cap<IPluginV3OneCore>(paths, PluginCapabilityType::kCORE);
        auto* pb = cap<IPluginV3OneBuild>(paths, PluginCapabilityType::kBUILD);
        auto* prt = cap<IPluginV3OneRuntime>(paths, PluginCapabilityType::kRUNTIME);
        CHECK(pcore && pb && prt, "paths capability interfaces");
        if (!pcore || !pb || !prt) return 1;
        CHECK(std::strcmp(pcore->getPluginName(), "ZeroEdgePathsFFN") == 0 && pb->getNbOutputs() == 1, "paths name, 1 output");
        DataType outT[1];
        for (DataType t : {DataType::kHALF, DataType::kBF16})
        {
            DataType inT[3] = {t, t, t};
            CHECK(pb->getOutputDataTypes(outT, 1, inT, 3) == 0 && outT[0] == t, "paths y has x's type");
        }
        DataType f32[3] = {DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT};
        CHECK(pb->getOutputDataTypes(outT, 1, f32, 3) != 0 && log.saw("x must be float16 or bfloat16"),
            "paths fp32 x refused: " + log.last());
        // shapes (SmolLM2-1.7B-like D = 2048, F = 8192)
        Builder b;
        std::vector<DimsExprs> in = {dims(b, {"B", "2048"}), dims(b, {"2048", "16384"}), dims(b, {"8192", "2048"})};
        DimsExprs out[1];
        CHECK(pb->getOutputShapes(in.data(), 3, nullptr, 0, out, 1, b) == 0, "paths getOutputShapes: " + log.last());
        CHECK(out[0].nbDims == 2 && evalDims(out[0], Env{{"B", 4}}) == std::vector<int64_t>({4, 2048}), "y is [B, D]");
        auto bad = [&](std::vector<DimsExprs> const& v, int32_t nb, char const* part, char const* what) {
            CHECK(pb->getOutputShapes(v.data(), nb, nullptr, 0, out, 1, b) != 0 && log.saw(part),
                std::string(what) + ": " + log.last());
        };
        bad({dims(b, {"9", "2048"}), in[1], in[2]}, 3, "B (decode tokens) in 1..8, got [9, 2048]", "B = 9 refused");
        bad({dims(b, {"B", "2004"}), dims(b, {"2004", "16384"}), dims(b, {"8192", "2004"})}, 3,
            "hidden size D = 2004 is not supported", "D = 2004 refused");
        bad({in[0], dims(b, {"2048", "16000"}), in[2]}, 3, "input 1 (w13_t) must be [D, 2F] = [2048, 16384]",
            "w13_t != [D, 2F] refused");
        bad({in[0], in[1], dims(b, {"8192", "1024"})}, 3, "input 2 (wd_t) must be [F, D] = [8192, 2048]",
            "wd_t != [F, D] refused");
        bad({in[0], dims(b, {"2048", "200"}), dims(b, {"100", "2048"})}, 3, "FFN width F = 100", "F = 100 refused");
        bad({dims(b, {"1", "B", "2048"}), in[1], in[2]}, 3, "input 0 (x) must be 2-D [B, D]", "3-D x refused");
        bad(in, 2, "expects 3 inputs (x, w13_t, wd_t)", "2 inputs refused");
        std::printf("ZeroEdgePathsFFN: getOutputShapes y [B, 2048] (B=4 evaluated); B > 8, D %% 8, [D, 2F] / [F, D] "
                    "mismatches refused\n");
        // formats: linear, all four fp16 or all bf16
        std::vector<DynamicPluginTensorDesc> io = {desc(DataType::kHALF, {-1, 2048}, {8, 2048}),
            desc(DataType::kHALF, {2048, 16384}), desc(DataType::kHALF, {8192, 2048}),
            desc(DataType::kHALF, {-1, 2048}, {8, 2048})};
        bool all = true;
        for (int pos = 0; pos < 4; ++pos) all = all && pb->supportsFormatCombination(pos, io.data(), 3, 1);
        CHECK(all, "paths all fp16 ok");
        auto io2 = io;
        for (auto& d : io2) d.desc.type = DataType::kBF16;
        all = true;
        for (int pos = 0; pos < 4; ++pos) all = all && pb->supportsFormatCombination(pos, io2.data(), 3, 1);
        CHECK(all, "paths all bf16 ok");
        io2 = io;
        for (auto& d : io2) d.desc.type = DataType::kFLOAT;
        CHECK(!pb->supportsFormatCombination(0, io2.data(), 3, 1), "paths fp32 refused (the kernels take fp16 / bf16)");
        io2 = io;
        io2[1].desc.type = DataType::kBF16;
        CHECK(!pb->supportsFormatCombination(1, io2.data(), 3, 1), "paths mixed w13_t type refused");
        io2 = io;
        io2[3].desc.type = DataType::kFLOAT;
        CHECK(!pb->supportsFormatCombination(3, io2.data(), 3, 1), "paths y of another type refused");
        io2 = io;
        io2[2].desc.format = TensorFormat::kCHW32;
        CHECK(!pb->supportsFormatCombination(2, io2.data(), 3, 1), "paths non-linear format refused");
        CHECK(!pb->supportsFormatCombination(4, io.data(), 3, 1), "paths position 4 refused");
        // configure: the max profile must fit too; workspace from the max batch
        CHECK(pb->configurePlugin(io.data(), 3, io.data() + 3, 1) == 0, "paths configurePlugin: " + log.last());
        auto ioBad = io;
        ioBad[0] = desc(DataType::kHALF, {-1, 2048}, {16, 2048});
        CHECK(pb->configurePlugin(ioBad.data(), 3, io.data() + 3, 1) != 0 && log.saw("got [16, 2048]"),
            "paths configure with max B = 16 refused: " + log.last());
        ioBad = io;
        ioBad[2] = desc(DataType::kHALF, {8192, 1024});
        CHECK(pb->configurePlugin(ioBad.data(), 3, io.data() + 3, 1) != 0, "paths configure with wd_t [8192, 1024] refused");
        size_t ws = pb->getWorkspaceSize(io.data(), 3, io.data() + 3, 1);
        size_t want = (size_t(8) * 2048 + size_t(8) * 2 * 8192) * 4; // fp32 sums of y and of gate/up at B = 8
        CHECK(ws >= want + 256 && ws <= want + 1024, "paths workspace " + std::to_string(ws) + " from the max batch");
        std::printf("ZeroEdgePathsFFN: formats (fp16 / bf16, linear), configure, workspace %zu bytes at B<=8\n", ws);
        // enqueue refuses before any launch (no CUDA call): wrong dtype, bad shapes, launcher argument errors
        PluginTensorDesc pin[3] = {pdesc(DataType::kHALF, {2, 2048}), pdesc(DataType::kHALF, {2048, 16384}),
            pdesc(DataType::kHALF, {8192, 2048})};
        PluginTensorDesc pout[1] = {pdesc(DataType::kHALF, {2, 2048})};
        void const* nulls[3] = {nullptr, nullptr, nullptr};
        void* nout[1] = {nullptr};
        PluginTensorDesc fin[3] = {pdesc(DataType::kFLOAT, {2, 2048}), pin[1], pin[2]};
        CHECK(prt->enqueue(fin, pout, nulls, nout, nullptr, nullptr) != 0 && log.saw("must all be float16 or all bfloat16"),
            "paths enqueue fp32 refused: " + log.last());
        PluginTensorDesc bin[3] = {pdesc(DataType::kHALF, {9, 2048}), pin[1], pin[2]};
        CHECK(prt->enqueue(bin, pout, nulls, nout, nullptr, nullptr) != 0 && log.saw("got [9, 2048]"),
            "paths enqueue B = 9 refused: " + log.last());
        CHECK(prt->enqueue(pin, pout, nulls, nout, nullptr, nullptr) == -1 /* ZE_PATHS_ERR_ARG */
                && log.saw("ZeroEdgePathsFFN: zeroedge paths kernels: null pointer"),
            "paths launcher null pointers reported: " + log.last());
        void const* odd[3] = {reinterpret_cast<void const*>(uintptr_t(0x1000)), reinterpret_cast<void const*>(uintptr_t(0x1008)),
            reinterpret_cast<void const*>(uintptr_t(0x2000))};
        void* oout[1] = {reinterpret_cast<void*>(uintptr_t(0x3000))};
        CHECK(prt->enqueue(pin, pout, odd, oout, reinterpret_cast<void*>(uintptr_t(0x4000)), nullptr) == -4 /* ZE_PATHS_ERR_ALIGN */
                && log.saw("16-byte aligned"),
            "paths launcher misaligned w13_t reported: " + log.last());
        std::printf("ZeroEdgePathsFFN: enqueue refuses fp32 / B = 9 and reports launcher errors, nothing launched\n");
        // round trip
        PluginFieldCollection const* ser = prt->getFieldsToSerialize();
        auto before = fieldValues(ser);
        CHECK(before.size() == 3 && before["threshold_in"] == "f:0.25" && before["threshold"] == "f:0.0625"
                && before["zeroedge_abi"] == "i:2",
            "paths serialized fields");
        IPluginV3* back = pathsC->createPlugin("layer0.paths", ser, TensorRTPhase::kRUNTIME);
        CHECK(back != nullptr, "paths re-created from serialized fields: " + log.last());
        if (back)
            CHECK(fieldValues(cap<IPluginV3OneRuntime>(back, PluginCapabilityType::kRUNTIME)->getFieldsToSerialize()) == before,
                "paths fields round trip");
        delete back;
        IPluginV3* c1 = prt->attachToContext(nullptr);
        CHECK(c1 && fieldValues(cap<IPluginV3OneRuntime>(c1, PluginCapabilityType::kRUNTIME)->getFieldsToSerialize()) == before,
            "paths clone keeps the fields");
        delete c1;
        std::printf("ZeroEdgePathsFFN: %zu fields round-trip through getFieldsToSerialize -> createPlugin(kRUNTIME)\n",
            before.size());
        delete paths;
    }
    delete sih;

    if (gpu)
    {
        int dev = 0;
        if (cudaGetDeviceCount(&dev) != cudaSuccess || dev == 0)
        {
            std::fprintf(stderr, "--gpu: no CUDA device\n");
            ++gFail;
        }
        else
        {
            gpuChecks(sihC, gatC, scaC, chunkC);
            pathsGpuChecks(pathsC);
        }
    }
    setLoggerFinder(nullptr);
    if (gFail)
    {
        std::fprintf(stderr, "harness: %d of %d checks failed\n", gFail, gChecks);
        return 1;
    }
    std::printf("harness: %d checks passed\n", gChecks);
    return 0;
}
