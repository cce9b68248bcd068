// Host test of the TensorRT-free field parsing and shape rules (runs in CI with a plain C++ compiler).
//   test_fields              run the checks; prints "test_fields: N checks passed" or the failures
//   test_fields --spec-json  print the node contract as this library implements it (for plugin_spec)
#include "zeroedge_fields.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

using namespace zeroedge;

static int g_checks = 0, g_fail = 0;

#define CHECK(cond, what)                                                                                             \
    do                                                                                                                \
    {                                                                                                                 \
        ++g_checks;                                                                                                   \
        if (!(cond))                                                                                                  \
        {                                                                                                             \
            ++g_fail;                                                                                                 \
            std::fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, std::string(what).c_str());                  \
        }                                                                                                             \
    } while (0)

static bool contains(std::string const& s, char const* part) { return s.find(part) != std::string::npos; }

struct Fields
{
    std::vector<RawField> f;
    std::vector<float> floats;
    std::vector<int32_t> ints;
    Fields()
    {
        floats.reserve(64);
        ints.reserve(64);
    }
    Fields& fl(char const* n, float v)
    {
        floats.push_back(v);
        f.push_back({n, &floats.back(), FieldKind::kFloat32, 1, "kFLOAT32"});
        return *this;
    }
    Fields& in(char const* n, int32_t v)
    {
        ints.push_back(v);
        f.push_back({n, &ints.back(), FieldKind::kInt32, 1, "kINT32"});
        return *this;
    }
};

static Shape sh(std::vector<int64_t> d)
{
    Shape s{};
    s.nbDims = int32_t(d.size());
    for (size_t i = 0; i < d.size(); ++i) s.d[i] = d[i];
    return s;
}

static std::vector<Shape> sihShapes(int64_t T, int64_t D, int64_t W, int64_t R)
{
    return {sh({T, D}), sh({W, D}), sh({W}), sh({W, W}), sh({W}), sh({W, W}), sh({W}), sh({1, W}), sh({1}),
        sh({R, D}), sh({D, R}), sh({D})};
}

int main(int argc, char** argv)
{
    if (argc > 1 && std::strcmp(argv[1], "--spec-json") == 0)
    {
        std::printf("%s\n", specJson().c_str());
        return 0;
    }
    ze_sih_params p{};
    {
        Fields f;
        f.fl("threshold", 0.25f);
        std::string e = parseSih(f.f.data(), int32_t(f.f.size()), &p);
        CHECK(e.empty(), "threshold only: " + e);
        CHECK(p.threshold == 0.25f && p.min_tokens == 32 && p.protect_first == 4 && p.protect_last == 1
                && p.block_size == 0 && p.anchor_rank == 16 && p.block_frac == 0.7f && p.ma_w0 == 0.5f,
            "defaults applied");
    }
    {
        Fields f;
        f.fl("threshold", 0.5f).in("min_tokens", 8).in("protect_first", 2).in("protect_last", 3).in("block_size", 64)
            .fl("block_frac", 0.6f).in("anchor_rank", 0).fl("ma_w0", 1.f).fl("ma_w1", 0.f).fl("ma_w2", 0.f)
            .in("unknown_extra", 7).in(kAbiField, ZE_PLUGIN_ABI);
        std::string e = parseSih(f.f.data(), int32_t(f.f.size()), &p);
        CHECK(e.empty(), "all fields: " + e);
        CHECK(p.min_tokens == 8 && p.protect_first == 2 && p.protect_last == 3 && p.block_size == 64
                && p.block_frac == 0.6f && p.anchor_rank == 0 && p.ma_w0 == 1.f,
            "all fields read");
    }
    {
        Fields f;
        f.fl("threshold", 0.f).fl("rate", 0.6f).in("rank_block", 256);
        std::string e = parseSih(f.f.data(), int32_t(f.f.size()), &p);
        CHECK(e.empty() && p.rate == 0.6f && p.rank_block == 256, "rank rule fields read: " + e);
        Fields d;
        d.fl("threshold", 0.f);
        CHECK(parseSih(d.f.data(), 1, &p).empty() && p.rate == -1.f && p.rank_block == 512,
            "threshold rule by default (rate -1, rank_block 512)");
        Fields over;
        over.fl("threshold", 0.f).fl("rate", 1.5f);
        CHECK(contains(parseSih(over.f.data(), 2, &p), "'rate' must be a finite number <= 1"), "rate 1.5 refused");
        Fields nan;
        nan.fl("threshold", 0.f).fl("rate", std::nanf(""));
        CHECK(contains(parseSih(nan.f.data(), 2, &p), "'rate'"), "nan rate refused");
        Fields zero;
        zero.fl("threshold", 0.f).fl("rate", 0.5f).in("rank_block", 0);
        CHECK(contains(parseSih(zero.f.data(), 3, &p), "'rank_block' must be >= 1"), "rank_block 0 refused");
        Fields both;
        both.fl("threshold", 0.f).fl("rate", 0.5f).in("block_size", 64);
        CHECK(contains(parseSih(both.f.data(), 3, &p), "takes no block rule"), "rank rule with a block rule refused");
    }
    {
        Fields f;
        f.in("min_tokens", 8);
        std::string e = parseSih(f.f.data(), int32_t(f.f.size()), &p);
        CHECK(contains(e, "required field 'threshold' is missing"), "missing threshold: " + e);
    }
    {
        Fields f;
        f.in("threshold", 1);
        std::string e = parseSih(f.f.data(), int32_t(f.f.size()), &p);
        CHECK(contains(e, "'threshold' must be FLOAT32"), "int threshold: " + e);
    }
    {
        Fields f;
        f.fl("threshold", 0.5f).fl("min_tokens", 8.f);
        std::string e = parseSih(f.f.data(), int32_t(f.f.size()), &p);
        CHECK(contains(e, "'min_tokens' must be INT32"), "float min_tokens: " + e);
    }
    {
        double d = 0.5;
        RawField r{"threshold", &d, FieldKind::kOther, 1, "kFLOAT64"};
        std::string e = parseSih(&r, 1, &p);
        CHECK(contains(e, "got kFLOAT64"), "float64 threshold: " + e);
    }
    {
        float v[2] = {0.1f, 0.2f};
        RawField r{"threshold", v, FieldKind::kFloat32, 2, "kFLOAT32"};
        std::string e = parseSih(&r, 1, &p);
        CHECK(contains(e, "exactly one value"), "two thresholds: " + e);
    }
    {
        Fields f;
        f.fl("threshold", std::nanf(""));
        CHECK(contains(parseSih(f.f.data(), 1, &p), "finite"), "nan threshold");
        Fields g;
        g.fl("threshold", 0.5f).in("anchor_rank", 65);
        CHECK(contains(parseSih(g.f.data(), 2, &p), "anchor_rank"), "rank 65");
        Fields h;
        h.fl("threshold", 0.5f).fl("block_frac", 1.5f);
        CHECK(contains(parseSih(h.f.data(), 2, &p), "block_frac"), "block_frac 1.5");
        Fields k;
        k.fl("threshold", 0.5f).in("block_size", -1);
        CHECK(contains(parseSih(k.f.data(), 2, &p), "block_size"), "block_size -1");
        Fields m;
        m.fl("threshold", 0.5f).fl("ma_w0", 0.f);
        CHECK(contains(parseSih(m.f.data(), 2, &p), "ma_w0 > 0"), "ma_w0 0");
        Fields a;
        a.fl("threshold", 0.5f).in(kAbiField, ZE_PLUGIN_ABI + 1);
        CHECK(contains(parseSih(a.f.data(), 2, &p), "rebuild the engine"), "abi mismatch");
        CHECK(contains(parsePad(kGatherName, a.f.data() + 1, 1), "rebuild the engine"), "pad abi mismatch");
        CHECK(parsePad(kScatterName, nullptr, 0).empty(), "pad no fields");
    }
    // shapes
    {
        Fields f;
        f.fl("threshold", 0.5f);
        parseSih(f.f.data(), 1, &p);
        int32_t W = 0;
        auto s = sihShapes(4096, 2048, 3, 16);
        CHECK(checkSihShapes(s.data(), 12, p, &W).empty() && W == 3, "good SIH shapes");
        s = sihShapes(-1, 576, 10, 16);
        CHECK(checkSihShapes(s.data(), 12, p, &W).empty() && W == 10, "dynamic T");
        s = sihShapes(100, 100, 3, 16);
        CHECK(contains(checkSihShapes(s.data(), 12, p, &W), "multiple of 8"), "D = 100");
        s = sihShapes(100, 64, 33, 16);
        CHECK(contains(checkSihShapes(s.data(), 12, p, &W), "head width W = 33"), "W = 33");
        s = sihShapes(100, 64, 4, 8);
        CHECK(contains(checkSihShapes(s.data(), 12, p, &W), "anchor_a"), "rank mismatch");
        s = sihShapes(100, 64, 4, 16);
        s[0] = sh({1, 100, 64});
        CHECK(contains(checkSihShapes(s.data(), 12, p, &W), "no batch dimension"), "3-D x");
        s = sihShapes(100, 64, 4, 16);
        s[3] = sh({4, 5});
        CHECK(contains(checkSihShapes(s.data(), 12, p, &W), "(w2) must be [W, W]"), "w2 shape");
        CHECK(contains(checkSihShapes(s.data(), 11, p, &W), "expects 12 inputs"), "11 inputs");
        ze_sih_params p0 = p;
        p0.anchor_rank = 0;
        s = sihShapes(100, 64, 4, 16);
        s[9] = sh({0, 64});
        CHECK(checkSihShapes(s.data(), 12, p0, &W).empty(), "rank 0 ignores anchors");

        std::vector<Shape> g = {sh({100, 64}), sh({100})};
        CHECK(checkGatherShapes(g.data(), 2).empty(), "gather ok");
        g[1] = sh({99});
        CHECK(contains(checkGatherShapes(g.data(), 2), "keep"), "gather keep mismatch");
        g = {sh({100, 60}), sh({100})};
        CHECK(contains(checkGatherShapes(g.data(), 2), "multiple of 8"), "gather D = 60");
        std::vector<Shape> c = {sh({100, 64}), sh({-1, 64}), sh({-1})};
        CHECK(checkScatterShapes(c.data(), 3).empty(), "scatter ok");
        c[1] = sh({-1, 32});
        CHECK(contains(checkScatterShapes(c.data(), 3), "(y) must be [K, D]"), "scatter y mismatch");
        CHECK(contains(checkScatterShapes(c.data(), 2), "expects 3 inputs"), "scatter 2 inputs");
    }
    // ZeroEdgePathsFFN fields
    {
        PathsParams q{};
        Fields f;
        f.fl("threshold_in", 0.05f).fl("threshold", 0.01f).in("unknown_extra", 3).in(kAbiField, ZE_PLUGIN_ABI);
        std::string e = parsePaths(f.f.data(), int32_t(f.f.size()), &q);
        CHECK(e.empty() && q.threshold_in == 0.05f && q.threshold == 0.01f, "paths fields: " + e);
        Fields z;
        z.fl("threshold", 0.f).fl("threshold_in", 0.f);
        CHECK(parsePaths(z.f.data(), 2, &q).empty() && q.threshold_in == 0.f && q.threshold == 0.f, "zero thresholds");
        Fields m;
        m.fl("threshold", 0.1f);
        e = parsePaths(m.f.data(), 1, &q);
        CHECK(contains(e, "ZeroEdgePathsFFN: required field 'threshold_in' is missing"), "missing threshold_in: " + e);
        Fields m2;
        m2.fl("threshold_in", 0.1f);
        CHECK(contains(parsePaths(m2.f.data(), 1, &q), "'threshold' is missing"), "missing threshold");
        Fields t;
        t.fl("threshold_in", 0.1f).in("threshold", 1);
        e = parsePaths(t.f.data(), 2, &q);
        CHECK(contains(e, "ZeroEdgePathsFFN: field 'threshold' must be FLOAT32"), "int threshold: " + e);
        double d = 0.5;
        RawField r[2] = {{"threshold_in", &d, FieldKind::kOther, 1, "kFLOAT64"}, {"threshold", &d, FieldKind::kOther, 1, "kFLOAT64"}};
        CHECK(contains(parsePaths(r, 2, &q), "'threshold_in' must be FLOAT32 (ONNX FLOAT attribute), got kFLOAT64"),
            "float64 threshold_in");
        float v[2] = {0.1f, 0.2f};
        RawField two[2] = {{"threshold_in", v, FieldKind::kFloat32, 2, "kFLOAT32"}, {"threshold", v, FieldKind::kFloat32, 1, "kFLOAT32"}};
        CHECK(contains(parsePaths(two, 2, &q), "'threshold_in' must hold exactly one value, got 2"), "two threshold_in");
        Fields n;
        n.fl("threshold_in", std::nanf("")).fl("threshold", 0.1f);
        CHECK(contains(parsePaths(n.f.data(), 2, &q), "'threshold_in' must be a finite number >= 0"), "nan threshold_in");
        Fields i;
        i.fl("threshold_in", 0.1f).fl("threshold", INFINITY);
        CHECK(contains(parsePaths(i.f.data(), 2, &q), "'threshold' must be a finite number >= 0"), "inf threshold");
        Fields g;
        g.fl("threshold_in", 0.1f).fl("threshold", -0.5f);
        e = parsePaths(g.f.data(), 2, &q);
        CHECK(e == "ZeroEdgePathsFFN: field 'threshold' must be a finite number >= 0, got -0.5", "negative: " + e);
        Fields a;
        a.fl("threshold_in", 0.1f).fl("threshold", 0.1f).in(kAbiField, ZE_PLUGIN_ABI + 1);
        CHECK(contains(parsePaths(a.f.data(), 3, &q), ("ZeroEdgePathsFFN: engine was built with plugin ABI " + std::to_string(ZE_PLUGIN_ABI + 1)).c_str()), "paths abi");
        CHECK(contains(parsePaths(nullptr, 2, &q), "no field collection"), "paths null fields");
        CHECK(fieldSpecs(kPathsName).size() == 2 && fieldSpecs(kPathsName)[0].required, "paths field specs");
    }
    // ZeroEdgePathsFFN shapes: x [B, D], w13_t [D, 2F], wd_t [F, D]
    {
        auto ps = [](int64_t B, int64_t D, int64_t F) {
            return std::vector<Shape>{sh({B, D}), sh({D, F < 0 ? -1 : 2 * F}), sh({F, D})};
        };
        int64_t D = 0, F = 0;
        auto s = ps(4, 2048, 5632);
        CHECK(checkPathsShapes(s.data(), 3, &D, &F).empty() && D == 2048 && F == 5632, "good paths shapes");
        s = ps(-1, 768, 1536);
        CHECK(checkPathsShapes(s.data(), 3, &D, &F).empty() && D == 768 && F == 1536, "dynamic B");
        s = ps(1, 8, 8);
        CHECK(checkPathsShapes(s.data(), 3, nullptr, nullptr).empty(), "smallest sizes");
        s = ps(8, 8192, 64);
        CHECK(checkPathsShapes(s.data(), 3, nullptr, nullptr).empty(), "B = 8, D = 8192");
        s = {sh({2, -1}), sh({-1, -1}), sh({-1, 512})};
        CHECK(checkPathsShapes(s.data(), 3, &D, &F).empty() && D == 512 && F == -1, "D from wd_t, F unknown");
        s = {sh({2, 512}), sh({512, 128}), sh({-1, 512})};
        CHECK(checkPathsShapes(s.data(), 3, &D, &F).empty() && F == 64, "F from w13_t");
        std::string e;
        s = ps(9, 2048, 64);
        e = checkPathsShapes(s.data(), 3, nullptr, nullptr);
        CHECK(contains(e, "input 0 (x) must be [B, D] with B (decode tokens) in 1..8, got [9, 2048]"), "B = 9: " + e);
        s = ps(0, 2048, 64);
        CHECK(contains(checkPathsShapes(s.data(), 3, nullptr, nullptr), "1..8"), "B = 0");
        s = ps(2, 576, 1536);
        CHECK(checkPathsShapes(s.data(), 3, nullptr, nullptr).empty(), "SmolLM2's D = 576");
        s = ps(2, 580, 1536);
        e = checkPathsShapes(s.data(), 3, nullptr, nullptr);
        CHECK(contains(e, "hidden size D = 580 is not supported: it must be a positive multiple of 8, at most 8192"),
            "D = 580: " + e);
        s = ps(2, 8448, 64);
        CHECK(contains(checkPathsShapes(s.data(), 3, nullptr, nullptr), "D = 8448"), "D = 8448");
        s = ps(2, 512, 100);
        e = checkPathsShapes(s.data(), 3, nullptr, nullptr);
        CHECK(contains(e, "FFN width F = 100 is not supported: it must be a positive multiple of 8"), "F = 100: " + e);
        s = ps(2, 512, 64);
        s[1] = sh({512, 130});
        e = checkPathsShapes(s.data(), 3, nullptr, nullptr);
        CHECK(contains(e, "input 1 (w13_t) must be [D, 2F] = [512, 128], got [512, 130]"), "w13_t width: " + e);
        s[1] = sh({512, 129});
        CHECK(contains(checkPathsShapes(s.data(), 3, nullptr, nullptr), "odd width"), "odd w13_t width");
        s = ps(2, 512, 64);
        s[1] = sh({256, 128});
        CHECK(contains(checkPathsShapes(s.data(), 3, nullptr, nullptr), "(w13_t) must be [D, 2F] = [512, 128]"),
            "w13_t rows");
        s = ps(2, 512, 64);
        s[2] = sh({64, 256});
        e = checkPathsShapes(s.data(), 3, nullptr, nullptr);
        CHECK(contains(e, "input 2 (wd_t) must be [F, D] = [64, 512], got [64, 256]"), "wd_t width: " + e);
        s = ps(2, 512, 64);
        s[0] = sh({1, 2, 512});
        CHECK(contains(checkPathsShapes(s.data(), 3, nullptr, nullptr), "input 0 (x) must be 2-D [B, D]"), "3-D x");
        s = ps(2, 512, 64);
        s[2] = sh({64 * 512});
        CHECK(contains(checkPathsShapes(s.data(), 3, nullptr, nullptr), "input 2 (wd_t) must be 2-D [F, D]"), "1-D wd_t");
        CHECK(contains(checkPathsShapes(s.data(), 2, nullptr, nullptr), "expects 3 inputs (x, w13_t, wd_t), got 2"),
            "paths 2 inputs");
    }
    CHECK(contains(specJson(), "\"ZeroEdgePathsFFN\": {\"inputs\": 3, \"outputs\": 1, \"fields\": {\"threshold_in\": "
                               "[\"float\", null], \"threshold\": [\"float\", null]}}"),
        "paths spec json");
    CHECK(contains(specJson(), "\"threshold\": [\"float\", null]"), "spec json");
    if (g_fail)
    {
        std::fprintf(stderr, "test_fields: %d of %d checks failed\n", g_fail, g_checks);
        return 1;
    }
    std::printf("test_fields: %d checks passed\n", g_checks);
    return 0;
}
