// Plugin fields and shape rules (no TensorRT headers). See include/zeroedge_fields.h.
#include "zeroedge_fields.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

namespace zeroedge
{

char const* const kSihName = "ZeroEdgeSIH";
char const* const kSihChunkName = "ZeroEdgeSIHChunk";
char const* const kGatherName = "ZeroEdgePADGather";
char const* const kScatterName = "ZeroEdgePADScatter";
char const* const kPathsName = "ZeroEdgePathsFFN";
char const* const kVersion = "1";
char const* const kNamespace = "zeroedge";
char const* const kAbiField = "zeroedge_abi";

namespace
{

double const kNoDefault = std::numeric_limits<double>::quiet_NaN();

std::vector<FieldSpec> const kSihSpecs = {
    {"threshold", FieldKind::kFloat32, true, kNoDefault},
    {"ma_w0", FieldKind::kFloat32, false, 0.5},
    {"ma_w1", FieldKind::kFloat32, false, 0.333333},
    {"ma_w2", FieldKind::kFloat32, false, 0.166667},
    {"min_tokens", FieldKind::kInt32, false, 32},
    {"protect_first", FieldKind::kInt32, false, 4},
    {"protect_last", FieldKind::kInt32, false, 1},
    {"block_size", FieldKind::kInt32, false, 0},
    {"block_frac", FieldKind::kFloat32, false, 0.7},
    {"anchor_rank", FieldKind::kInt32, false, 16},
    {"rate", FieldKind::kFloat32, false, -1.0},
    {"rank_block", FieldKind::kInt32, false, 512},
};
std::vector<FieldSpec> const kPathsSpecs = {
    {"threshold_in", FieldKind::kFloat32, true, kNoDefault},
    {"threshold", FieldKind::kFloat32, true, kNoDefault},
};
std::vector<FieldSpec> const kNoSpecs;

int64_t const kPathsHiddenMultiple = 8; // the kernels' limits (include/zeroedge_paths.h)
int64_t const kPathsMaxHidden = 8192;
int64_t const kPathsFfnMultiple = 8;

char const* kindName(FieldKind k)
{
    return k == FieldKind::kInt32 ? "INT32 (ONNX INT attribute)"
                                  : k == FieldKind::kFloat32 ? "FLOAT32 (ONNX FLOAT attribute)" : "other";
}

std::string shapeStr(Shape const& s)
{
    std::ostringstream o;
    o << "[";
    for (int32_t i = 0; i < s.nbDims && i < 8; ++i) o << (i ? ", " : "") << (s.d[i] < 0 ? std::string("?") : std::to_string(s.d[i]));
    o << "]";
    return o.str();
}

// -1 (unknown) matches anything
bool same(int64_t a, int64_t b) { return a < 0 || b < 0 || a == b; }

std::string checkAbi(char const* op, RawField const& f)
{
    if (f.kind != FieldKind::kInt32 || f.length != 1 || !f.data)
        return std::string(op) + ": field '" + kAbiField + "' must be one INT32";
    int32_t abi = *static_cast<int32_t const*>(f.data);
    if (abi != ZE_PLUGIN_ABI)
        return std::string(op) + ": engine was built with plugin ABI " + std::to_string(abi) + ", this library is ABI "
            + std::to_string(ZE_PLUGIN_ABI) + "; rebuild the engine";
    return "";
}

// The fields of spec found in fields (nullptr where absent, last one wins): zeroedge_abi checked,
// unknown names ignored; wrong type, wrong length and a missing required field are errors.
std::string readFields(char const* op, std::vector<FieldSpec> const& spec, RawField const* fields, int32_t nbFields,
    std::vector<RawField const*>* found)
{
    found->assign(spec.size(), nullptr);
    if (nbFields < 0 || (nbFields > 0 && !fields)) return std::string(op) + ": no field collection";
    for (int32_t i = 0; i < nbFields; ++i)
    {
        RawField const& f = fields[i];
        if (!f.name) return std::string(op) + ": a field without a name";
        if (std::strcmp(f.name, kAbiField) == 0)
        {
            std::string e = checkAbi(op, f);
            if (!e.empty()) return e;
            continue;
        }
        size_t j = 0;
        for (; j < spec.size(); ++j)
            if (std::strcmp(f.name, spec[j].name) == 0) break;
        if (j == spec.size()) continue; // unknown: ignored
        FieldSpec const& s = spec[j];
        if (f.kind != s.kind)
            return std::string(op) + ": field '" + s.name + "' must be " + kindName(s.kind) + ", got "
                + (f.type_name ? f.type_name : "another type");
        if (f.length != 1 || !f.data)
            return std::string(op) + ": field '" + s.name + "' must hold exactly one value, got "
                + std::to_string(f.length);
        (*found)[j] = &f;
    }
    for (size_t j = 0; j < spec.size(); ++j)
        if (spec[j].required && !(*found)[j])
            return std::string(op) + ": required field '" + spec[j].name + "' is missing (" + kindName(spec[j].kind)
                + ")";
    return "";
}

std::string dimStr(int64_t v) { return v < 0 ? std::string("?") : std::to_string(v); }

std::string num(float v)
{
    std::ostringstream o;
    o << v;
    return o.str();
}

} // namespace

std::vector<FieldSpec> const& fieldSpecs(std::string const& op)
{
    return op == kSihName || op == kSihChunkName ? kSihSpecs : op == kPathsName ? kPathsSpecs : kNoSpecs;
}

ze_sih_params sihDefaults()
{
    ze_sih_params p{};
    p.threshold = std::numeric_limits<float>::quiet_NaN();
    p.ma_w0 = 0.5f;
    p.ma_w1 = 0.333333f;
    p.ma_w2 = 0.166667f;
    p.min_tokens = 32;
    p.protect_first = 4;
    p.protect_last = 1;
    p.block_size = 0;
    p.block_frac = 0.7f;
    p.anchor_rank = 16;
    p.rate = -1.f;
    p.rank_block = 512;
    return p;
}

std::string parseSih(RawField const* fields, int32_t nbFields, ze_sih_params* out)
{
    std::vector<RawField const*> found;
    std::string e = readFields(kSihName, kSihSpecs, fields, nbFields, &found);
    if (!e.empty()) return e;
    ze_sih_params p = sihDefaults();
    for (size_t j = 0; j < kSihSpecs.size(); ++j)
    {
        if (!found[j]) continue;
        float fv = kSihSpecs[j].kind == FieldKind::kFloat32 ? *static_cast<float const*>(found[j]->data) : 0.f;
        int32_t iv = kSihSpecs[j].kind == FieldKind::kInt32 ? *static_cast<int32_t const*>(found[j]->data) : 0;
        std::string n = kSihSpecs[j].name;
        if (n == "threshold") p.threshold = fv;
        else if (n == "ma_w0") p.ma_w0 = fv;
        else if (n == "ma_w1") p.ma_w1 = fv;
        else if (n == "ma_w2") p.ma_w2 = fv;
        else if (n == "min_tokens") p.min_tokens = iv;
        else if (n == "protect_first") p.protect_first = iv;
        else if (n == "protect_last") p.protect_last = iv;
        else if (n == "block_size") p.block_size = iv;
        else if (n == "block_frac") p.block_frac = fv;
        else if (n == "anchor_rank") p.anchor_rank = iv;
        else if (n == "rate") p.rate = fv;
        else if (n == "rank_block") p.rank_block = iv;
    }
    e = checkSihParams(p);
    if (!e.empty()) return e;
    *out = p;
    return "";
}

std::string parsePaths(RawField const* fields, int32_t nbFields, PathsParams* out)
{
    std::vector<RawField const*> found;
    std::string e = readFields(kPathsName, kPathsSpecs, fields, nbFields, &found);
    if (!e.empty()) return e;
    // both fields are required, so readFields found them (kPathsSpecs order)
    PathsParams p{*static_cast<float const*>(found[0]->data), *static_cast<float const*>(found[1]->data)};
    e = checkPathsParams(p);
    if (!e.empty()) return e;
    *out = p;
    return "";
}

std::string parsePad(char const* op, RawField const* fields, int32_t nbFields)
{
    if (nbFields < 0 || (nbFields > 0 && !fields)) return std::string(op) + ": no field collection";
    for (int32_t i = 0; i < nbFields; ++i)
        if (fields[i].name && std::strcmp(fields[i].name, kAbiField) == 0)
        {
            std::string e = checkAbi(op, fields[i]);
            if (!e.empty()) return e;
        }
    return "";
}

std::string checkSihParams(ze_sih_params const& p)
{
    std::string n = std::string(kSihName) + ": ";
    if (!std::isfinite(p.threshold)) return n + "field 'threshold' must be a finite number";
    if (!std::isfinite(p.ma_w0) || !std::isfinite(p.ma_w1) || !std::isfinite(p.ma_w2) || !(p.ma_w0 > 0.f)
        || p.ma_w1 < 0.f || p.ma_w2 < 0.f)
        return n + "moving-average weights must be finite with ma_w0 > 0 and ma_w1, ma_w2 >= 0";
    if (p.min_tokens < 0) return n + "field 'min_tokens' must be >= 0";
    if (p.protect_first < 0) return n + "field 'protect_first' must be >= 0";
    if (p.protect_last < 0) return n + "field 'protect_last' must be >= 0";
    if (p.block_size < 0) return n + "field 'block_size' must be >= 0 (0 = token-granular)";
    if (!(p.block_frac >= 0.f && p.block_frac <= 1.f)) return n + "field 'block_frac' must be in [0, 1]";
    if (p.anchor_rank < 0 || p.anchor_rank > ZE_MAX_ANCHOR_RANK)
        return n + "field 'anchor_rank' must be in 0.." + std::to_string(ZE_MAX_ANCHOR_RANK) + ", got "
            + std::to_string(p.anchor_rank);
    if (!(std::isfinite(p.rate) && p.rate <= 1.f))
        return n + "field 'rate' must be a finite number <= 1 (< 0: the threshold rule)";
    if (p.rank_block < 1) return n + "field 'rank_block' must be >= 1";
    if (p.rate >= 0.f && p.block_size > 0) return n + "the rank rule (rate >= 0) takes no block rule (block_size 0)";
    return "";
}

std::string checkSihShapes(Shape const* in, int32_t nbInputs, ze_sih_params const& p, int32_t* width, bool chunk)
{
    static char const* names[] = {"x", "w1", "b1", "w2", "b2", "w3", "b3", "w4", "b4", "anchor_a", "anchor_b", "anchor_c",
        "carry", "span"};
    std::string n = std::string(chunk ? kSihChunkName : kSihName) + ": ";
    if (!chunk && nbInputs != 12)
        return n + "expects 12 inputs (x, w1..b4, anchor_a, anchor_b, anchor_c), got " + std::to_string(nbInputs);
    if (chunk && nbInputs != 14)
        return n + "expects 14 inputs (x, w1..b4, anchor_a, anchor_b, anchor_c, carry, span), got "
            + std::to_string(nbInputs);
    auto bad = [&](int i, char const* want) {
        return n + "input " + std::to_string(i) + " (" + names[i] + ") must be " + want + ", got " + shapeStr(in[i]);
    };
    if (in[0].nbDims != 2) return bad(0, "2-D [T, D] (no batch dimension)");
    int64_t D = in[0].d[1];
    if (D >= 0 && D % ZE_HIDDEN_MULTIPLE != 0)
        return n + "hidden size D = " + std::to_string(D) + " is not supported: it must be a multiple of "
            + std::to_string(ZE_HIDDEN_MULTIPLE);
    if (in[1].nbDims != 2 || !same(in[1].d[1], D)) return bad(1, "[W, D]");
    int64_t W = in[1].d[0];
    if (W < 0) return n + "the head width (w1's first dimension) must be known at build time";
    if (W < 1 || W > ZE_MAX_SIH_WIDTH)
        return n + "head width W = " + std::to_string(W) + " is not supported (1.." + std::to_string(ZE_MAX_SIH_WIDTH) + ")";
    auto vec = [&](int i, int64_t len) { return in[i].nbDims == 1 && same(in[i].d[0], len); };
    auto mat = [&](int i, int64_t r, int64_t c) { return in[i].nbDims == 2 && same(in[i].d[0], r) && same(in[i].d[1], c); };
    if (!vec(2, W)) return bad(2, "[W]");
    if (!mat(3, W, W)) return bad(3, "[W, W]");
    if (!vec(4, W)) return bad(4, "[W]");
    if (!mat(5, W, W)) return bad(5, "[W, W]");
    if (!vec(6, W)) return bad(6, "[W]");
    if (!mat(7, 1, W)) return bad(7, "[1, W]");
    if (!vec(8, 1)) return bad(8, "[1]");
    int64_t R = p.anchor_rank;
    if (R > 0)
    {
        if (!mat(9, R, D)) return bad(9, "[anchor_rank, D]");
        if (!mat(10, D, R)) return bad(10, "[D, anchor_rank]");
        if (!vec(11, D)) return bad(11, "[D]");
    }
    if (chunk && !vec(12, 2)) return bad(12, "[2] (the raw scores of the two positions before the chunk)");
    if (chunk && !vec(13, 2)) return bad(13, "[2] (the chunk's first position, the prompt's length)");
    if (width) *width = int32_t(W);
    return "";
}

std::string checkGatherShapes(Shape const* in, int32_t nbInputs)
{
    std::string n = std::string(kGatherName) + ": ";
    if (nbInputs != 2) return n + "expects 2 inputs (x, keep), got " + std::to_string(nbInputs);
    if (in[0].nbDims != 2) return n + "input 0 (x) must be 2-D [T, D], got " + shapeStr(in[0]);
    if (in[0].d[1] >= 0 && in[0].d[1] % ZE_HIDDEN_MULTIPLE != 0)
        return n + "hidden size D = " + std::to_string(in[0].d[1]) + " is not supported: it must be a multiple of "
            + std::to_string(ZE_HIDDEN_MULTIPLE);
    if (in[1].nbDims != 1 || !same(in[1].d[0], in[0].d[0]))
        return n + "input 1 (keep) must be [T] like x's rows, got " + shapeStr(in[1]);
    return "";
}

std::string checkScatterShapes(Shape const* in, int32_t nbInputs)
{
    std::string n = std::string(kScatterName) + ": ";
    if (nbInputs != 3) return n + "expects 3 inputs (base, y, idx), got " + std::to_string(nbInputs);
    if (in[0].nbDims != 2) return n + "input 0 (base) must be 2-D [T, D], got " + shapeStr(in[0]);
    if (in[0].d[1] >= 0 && in[0].d[1] % ZE_HIDDEN_MULTIPLE != 0)
        return n + "hidden size D = " + std::to_string(in[0].d[1]) + " is not supported: it must be a multiple of "
            + std::to_string(ZE_HIDDEN_MULTIPLE);
    if (in[1].nbDims != 2 || !same(in[1].d[1], in[0].d[1]))
        return n + "input 1 (y) must be [K, D] with base's D, got " + shapeStr(in[1]);
    if (in[2].nbDims != 1 || !same(in[2].d[0], in[1].d[0]))
        return n + "input 2 (idx) must be [K] like y's rows, got " + shapeStr(in[2]);
    return "";
}

std::string checkPathsParams(PathsParams const& p)
{
    std::string n = std::string(kPathsName) + ": ";
    if (!std::isfinite(p.threshold_in) || p.threshold_in < 0.f)
        return n + "field 'threshold_in' must be a finite number >= 0, got " + num(p.threshold_in);
    if (!std::isfinite(p.threshold) || p.threshold < 0.f)
        return n + "field 'threshold' must be a finite number >= 0, got " + num(p.threshold);
    return "";
}

std::string checkPathsShapes(Shape const* in, int32_t nbInputs, int64_t* hidden, int64_t* ffn)
{
    static char const* names[] = {"x", "w13_t", "wd_t"};
    static char const* forms[] = {"[B, D]", "[D, 2F]", "[F, D]"};
    std::string n = std::string(kPathsName) + ": ";
    if (nbInputs != 3) return n + "expects 3 inputs (x, w13_t, wd_t), got " + std::to_string(nbInputs);
    for (int i = 0; i < 3; ++i)
        if (in[i].nbDims != 2)
            return n + "input " + std::to_string(i) + " (" + names[i] + ") must be 2-D " + forms[i] + ", got "
                + shapeStr(in[i]);
    Shape const &x = in[0], &w13 = in[1], &wd = in[2];
    int64_t B = x.d[0];
    if (B >= 0 && (B < 1 || B > ZE_PATHS_MAX_BATCH))
        return n + "input 0 (x) must be [B, D] with B (decode tokens) in 1.." + std::to_string(ZE_PATHS_MAX_BATCH)
            + ", got " + shapeStr(x);
    // D and F from the first input that knows them, then every input must agree
    int64_t D = x.d[1] >= 0 ? x.d[1] : w13.d[0] >= 0 ? w13.d[0] : wd.d[1];
    if (w13.d[1] >= 0 && w13.d[1] % 2 != 0)
        return n + "input 1 (w13_t) must be [D, 2F] (gate columns, then up columns), got an odd width: "
            + shapeStr(w13);
    int64_t F = wd.d[0] >= 0 ? wd.d[0] : w13.d[1] >= 0 ? w13.d[1] / 2 : -1;
    auto bad = [&](int i, std::string const& want) {
        return n + "input " + std::to_string(i) + " (" + names[i] + ") must be " + forms[i] + " = " + want + ", got "
            + shapeStr(in[i]);
    };
    if (!same(w13.d[0], D) || !same(w13.d[1], F < 0 ? -1 : 2 * F))
        return bad(1, "[" + dimStr(D) + ", " + dimStr(F < 0 ? -1 : 2 * F) + "]");
    if (!same(wd.d[0], F) || !same(wd.d[1], D)) return bad(2, "[" + dimStr(F) + ", " + dimStr(D) + "]");
    if (D >= 0 && (D % kPathsHiddenMultiple != 0 || D < kPathsHiddenMultiple || D > kPathsMaxHidden))
        return n + "hidden size D = " + std::to_string(D) + " is not supported: it must be a positive multiple of "
            + std::to_string(kPathsHiddenMultiple) + ", at most " + std::to_string(kPathsMaxHidden);
    if (F >= 0 && (F % kPathsFfnMultiple != 0 || F < kPathsFfnMultiple))
        return n + "FFN width F = " + std::to_string(F) + " is not supported: it must be a positive multiple of "
            + std::to_string(kPathsFfnMultiple);
    if (hidden) *hidden = D;
    if (ffn) *ffn = F;
    return "";
}

std::string specJson()
{
    std::ostringstream o;
    o << "{\"abi\": " << ZE_PLUGIN_ABI << ", \"namespace\": \"" << kNamespace << "\", \"version\": \"" << kVersion
      << "\", \"nodes\": {";
    struct N { char const* name; int ni, no; };
    N nodes[] = {{kSihName, 12, 2}, {kSihChunkName, 14, 3}, {kGatherName, 2, 3}, {kScatterName, 3, 1},
        {kPathsName, 3, 1}};
    for (int k = 0; k < 5; ++k)
    {
        o << (k ? ", " : "") << "\"" << nodes[k].name << "\": {\"inputs\": " << nodes[k].ni << ", \"outputs\": "
          << nodes[k].no << ", \"fields\": {";
        auto const& specs = fieldSpecs(nodes[k].name);
        for (size_t j = 0; j < specs.size(); ++j)
        {
            o << (j ? ", " : "") << "\"" << specs[j].name << "\": [\""
              << (specs[j].kind == FieldKind::kInt32 ? "int" : "float") << "\", ";
            if (specs[j].required) o << "null";
            else o << specs[j].dflt;
            o << "]";
        }
        o << "}}";
    }
    o << "}, \"limits\": {\"hidden_multiple\": " << ZE_HIDDEN_MULTIPLE << ", \"max_sih_width\": " << ZE_MAX_SIH_WIDTH
      << ", \"max_anchor_rank\": " << ZE_MAX_ANCHOR_RANK << ", \"paths_max_batch\": " << ZE_PATHS_MAX_BATCH
      << ", \"paths_hidden_multiple\": " << kPathsHiddenMultiple << ", \"paths_max_hidden\": " << kPathsMaxHidden
      << ", \"paths_ffn_multiple\": " << kPathsFfnMultiple << "}}";
    return o.str();
}

} // namespace zeroedge
