// TensorRT IPluginV3 glue for the zeroedge nodes (ZeroEdgeSIH, ZeroEdgeSIHChunk, ZeroEdgePADGather,
// ZeroEdgePADScatter, ZeroEdgePathsFFN).
//
// One shared library that exports only getCreators and setLoggerFinder (exports.map) and is linked
// with -Wl,--no-undefined and without libnvinfer: TensorRT loads it with
// IPluginRegistry::loadLibrary / trtexec --dynamicPlugins, and it can be serialized into a
// version-compatible engine. Field parsing and shape rules live in fields.cpp (no TensorRT headers);
// the kernels in kernels.cu and kernels/paths_gemv.cu. Errors go to TensorRT's logger (found through
// setLoggerFinder) and the failing call returns nullptr / non-zero, never a crash or a silent wrong result.
#include "NvInferRuntime.h"

#include "zeroedge_fields.h"
#include "zeroedge_kernels.h"
#include "zeroedge_paths.h"

#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace zeroedge
{
namespace
{

ILoggerFinder* gLoggerFinder{nullptr};

// Every error also lands here, so that a caller can name it when TensorRT only says "Could not create
// the plugin": TensorRT-RTX 1.7 calls setLoggerFinder with a finder whose findLogger() returns
// nullptr, so there the messages reach no TensorRT logger (they go to stderr). Read and cleared through
// zeroedge_plugin_messages(); the newest 16 KiB are kept.
std::mutex gMessagesMutex;
std::string gMessages;
constexpr size_t kMessagesKept = 16 << 10;

void remember(std::string const& msg) noexcept
{
    try
    {
        std::lock_guard<std::mutex> lock(gMessagesMutex);
        gMessages += msg;
        gMessages += '\n';
        if (gMessages.size() > kMessagesKept) gMessages.erase(0, gMessages.size() - kMessagesKept);
    }
    catch (...)
    {
    }
}

void logMsg(ILogger::Severity sev, std::string const& msg) noexcept
{
    if (sev <= ILogger::Severity::kWARNING) remember(msg);
    ILogger* l = gLoggerFinder ? gLoggerFinder->findLogger() : nullptr;
    if (l) l->log(sev, msg.c_str());
    else std::fprintf(stderr, "[zeroedge plugins] %s\n", msg.c_str());
}

void logError(std::string const& msg) noexcept { logMsg(ILogger::Severity::kERROR, msg); }

char const* typeName(PluginFieldType t)
{
    switch (t)
    {
    case PluginFieldType::kFLOAT16: return "kFLOAT16";
    case PluginFieldType::kFLOAT32: return "kFLOAT32";
    case PluginFieldType::kFLOAT64: return "kFLOAT64";
    case PluginFieldType::kINT8: return "kINT8";
    case PluginFieldType::kINT16: return "kINT16";
    case PluginFieldType::kINT32: return "kINT32";
    case PluginFieldType::kCHAR: return "kCHAR (STRING attribute)";
    case PluginFieldType::kDIMS: return "kDIMS";
    case PluginFieldType::kUNKNOWN: return "kUNKNOWN";
    case PluginFieldType::kBF16: return "kBF16";
    case PluginFieldType::kINT64: return "kINT64";
    case PluginFieldType::kFP8: return "kFP8";
    case PluginFieldType::kINT4: return "kINT4";
    }
    return "an unknown type";
}

std::vector<RawField> toRaw(PluginFieldCollection const* fc)
{
    std::vector<RawField> out;
    if (!fc) return out;
    for (int32_t i = 0; i < fc->nbFields; ++i)
    {
        PluginField const& f = fc->fields[i];
        FieldKind k = f.type == PluginFieldType::kINT32 ? FieldKind::kInt32
            : f.type == PluginFieldType::kFLOAT32       ? FieldKind::kFloat32
                                                        : FieldKind::kOther;
        out.push_back({f.name, f.data, k, f.length, typeName(f.type)});
    }
    return out;
}

Shape toShape(Dims const& d)
{
    Shape s{};
    s.nbDims = d.nbDims;
    for (int32_t i = 0; i < d.nbDims && i < 8; ++i) s.d[i] = d.d[i];
    return s;
}

Shape toShape(DimsExprs const& d)
{
    Shape s{};
    s.nbDims = d.nbDims;
    for (int32_t i = 0; i < d.nbDims && i < 8; ++i)
        s.d[i] = d.d[i] && d.d[i]->isConstant() ? d.d[i]->getConstantValue() : -1;
    return s;
}

std::vector<Shape> shapes(DimsExprs const* in, int32_t n)
{
    std::vector<Shape> v;
    for (int32_t i = 0; i < n; ++i) v.push_back(toShape(in[i]));
    return v;
}

std::vector<Shape> shapes(DynamicPluginTensorDesc const* in, int32_t n, bool useMax)
{
    std::vector<Shape> v;
    for (int32_t i = 0; i < n; ++i) v.push_back(toShape(useMax ? in[i].max : in[i].desc.dims));
    return v;
}

int dtypeCode(DataType t) { return t == DataType::kFLOAT ? ZE_F32 : t == DataType::kHALF ? ZE_F16 : -1; }
bool isFloat(DataType t) { return t == DataType::kFLOAT || t == DataType::kHALF; }
// the decode-path kernels take fp16 / bf16 only
int pathsDtypeCode(DataType t) { return t == DataType::kHALF ? ZE_PATHS_F16 : t == DataType::kBF16 ? ZE_PATHS_BF16 : -1; }

// ze_strerror's texts for -1..-4 describe the SIH / PAD limits; the paths codes mean the same kinds
char const* pathsStrerror(int code)
{
    switch (code)
    {
    case ZE_PATHS_ERR_ARG: return "zeroedge paths kernels: null pointer";
    case ZE_PATHS_ERR_DTYPE: return "zeroedge paths kernels: dtype must be float16 or bfloat16";
    case ZE_PATHS_ERR_SHAPE:
        return "zeroedge paths kernels: unsupported shape (B 1..8, D a multiple of 8 up to 8192, F a multiple of 8)";
    case ZE_PATHS_ERR_ALIGN: return "zeroedge paths kernels: tensors must be 16-byte aligned";
    default: return ze_strerror(code);
    }
}

// TensorRT's workspace is aligned, but the kernels want 256 bytes: ask for slack and align here.
constexpr size_t kSlack = 256;
void* align256(void* p) { return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(p) + 255) & ~uintptr_t(255)); }

class PluginBase : public IPluginV3, public IPluginV3OneCore, public IPluginV3OneBuild, public IPluginV3OneRuntime
{
public:
    IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override
    {
        switch (type)
        {
        case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
        case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
        case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
        }
        return nullptr;
    }
    char const* getPluginVersion() const noexcept override { return kVersion; }
    char const* getPluginNamespace() const noexcept override { return kNamespace; }
    int32_t onShapeChange(PluginTensorDesc const*, int32_t, PluginTensorDesc const*, int32_t) noexcept override
    {
        return 0;
    }
    IPluginV3* attachToContext(IPluginResourceContext*) noexcept override { return clone(); }

protected:
    int32_t mAbi{ZE_PLUGIN_ABI};
    std::vector<PluginField> mSer;
    PluginFieldCollection mFC{0, nullptr};

    int32_t fail(std::string const& msg) const noexcept
    {
        logError(msg);
        return -1;
    }
    int32_t launchResult(int rc, char const* (*strerror)(int) = ze_strerror) const noexcept
    {
        if (rc != 0) logError(std::string(getPluginName()) + ": " + strerror(rc));
        return rc;
    }
};

// ------------------------------------------------------------------------------------------ SIH

// ZeroEdgeSIH, or (chunk) ZeroEdgeSIHChunk: two more inputs (carry float32 [2], span int32 [2]) and one
// more output (carry_out float32 [2]); the same fields and kernels.
class SihPlugin final : public PluginBase
{
public:
    SihPlugin(ze_sih_params const& p, bool chunk)
        : mP(p)
        , mChunk(chunk)
    {
    }
    SihPlugin(SihPlugin const& o)
        : PluginBase()
        , mP(o.mP)
        , mChunk(o.mChunk)
    {
    }
    char const* getPluginName() const noexcept override { return mChunk ? kSihChunkName : kSihName; }
    IPluginV3* clone() noexcept override
    {
        try
        {
            return new SihPlugin(*this);
        }
        catch (std::exception const& e)
        {
            logError(std::string(getPluginName()) + ": clone failed: " + e.what());
            return nullptr;
        }
    }
    int32_t getNbOutputs() const noexcept override { return mChunk ? 3 : 2; }
    int32_t getOutputDataTypes(DataType* out, int32_t nbOutputs, DataType const* in, int32_t nbInputs) const noexcept override
    {
        if (nbInputs != nbIn() || nbOutputs != getNbOutputs())
            return fail(std::string(getPluginName()) + (mChunk ? ": expects 14 inputs and 3 outputs"
                                                               : ": expects 12 inputs and 2 outputs"));
        if (!isFloat(in[0])) return fail(std::string(getPluginName()) + ": x must be float32 or float16");
        out[0] = DataType::kINT32;
        out[1] = in[0];
        if (mChunk) out[2] = DataType::kFLOAT;
        return 0;
    }
    int32_t getOutputShapes(DimsExprs const* in, int32_t nbInputs, DimsExprs const*, int32_t, DimsExprs* out,
        int32_t nbOutputs, IExprBuilder& eb) noexcept override
    {
        try
        {
            if (nbOutputs != getNbOutputs())
                return fail(std::string(getPluginName()) + (mChunk ? ": expects 3 outputs (keep, base, carry_out)"
                                                                   : ": expects 2 outputs (keep, base)"));
            auto s = shapes(in, nbInputs);
            std::string e = checkSihShapes(s.data(), nbInputs, mP, nullptr, mChunk);
            if (!e.empty()) return fail(e);
            out[0].nbDims = 1;
            out[0].d[0] = in[0].d[0];
            out[1] = in[0];
            if (mChunk)
            {
                out[2].nbDims = 1;
                out[2].d[0] = eb.constant(2);
            }
            return 0;
        }
        catch (std::exception const& e)
        {
            return fail(std::string(getPluginName()) + ": " + e.what());
        }
    }
    bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* io, int32_t nbInputs, int32_t nbOutputs) noexcept override
    {
        int32_t ni = nbIn();
        if (nbInputs != ni || nbOutputs != getNbOutputs() || pos < 0 || pos >= ni + nbOutputs) return false;
        PluginTensorDesc const& d = io[pos].desc;
        if (d.format != TensorFormat::kLINEAR) return false;
        if (pos == 0) return isFloat(d.type);
        if (mChunk && (pos == 12 || pos == ni + 2)) return d.type == DataType::kFLOAT;   // carry, carry_out
        if (mChunk && pos == 13) return d.type == DataType::kINT32;                     // span
        if (pos == ni) return d.type == DataType::kINT32;                              // keep
        return d.type == io[0].desc.type;
    }
    int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*,
        int32_t) noexcept override
    {
        try
        {
            for (bool useMax : {false, true})
            {
                auto s = shapes(in, nbInputs, useMax);
                std::string e = checkSihShapes(s.data(), nbInputs, mP, nullptr, mChunk);
                if (!e.empty()) return fail(e);
            }
            return 0;
        }
        catch (std::exception const& e)
        {
            return fail(std::string(getPluginName()) + ": " + e.what());
        }
    }
    size_t getWorkspaceSize(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*,
        int32_t) const noexcept override
    {
        if (nbInputs != nbIn()) return 0;
        int dt = dtypeCode(in[0].desc.type);
        return ze_sih_workspace_size(in[0].max.d[0], in[0].max.d[1], int32_t(in[1].max.d[0]), mP.anchor_rank,
                   dt < 0 ? ZE_F32 : dt)
            + kSlack;
    }
    int32_t enqueue(PluginTensorDesc const* inDesc, PluginTensorDesc const*, void const* const* inputs,
        void* const* outputs, void* workspace, cudaStream_t stream) noexcept override
    {
        int dt = dtypeCode(inDesc[0].type);
        if (dt < 0) return fail(std::string(getPluginName()) + ": x must be float32 or float16");
        int64_t T = inDesc[0].dims.d[0], D = inDesc[0].dims.d[1];
        int32_t W = int32_t(inDesc[1].dims.d[0]);
        ze_sih_weights w{inputs[1], inputs[2], inputs[3], inputs[4], inputs[5], inputs[6], inputs[7], inputs[8],
            inputs[9], inputs[10], inputs[11]};
        size_t ws = ze_sih_workspace_size(T, D, W, mP.anchor_rank, dt);
        if (mChunk)
            return launchResult(ze_sih_chunk_forward(dt, inputs[0], T, D, W, &w, &mP,
                static_cast<float const*>(inputs[12]), static_cast<int32_t const*>(inputs[13]),
                static_cast<int32_t*>(outputs[0]), outputs[1], static_cast<float*>(outputs[2]), nullptr,
                align256(workspace), ws, stream));
        return launchResult(ze_sih_forward(dt, inputs[0], T, D, W, &w, &mP, static_cast<int32_t*>(outputs[0]),
            outputs[1], nullptr, align256(workspace), ws, stream));
    }
    PluginFieldCollection const* getFieldsToSerialize() noexcept override
    {
        mSer.clear();
        mSer.emplace_back("threshold", &mP.threshold, PluginFieldType::kFLOAT32, 1);
        mSer.emplace_back("ma_w0", &mP.ma_w0, PluginFieldType::kFLOAT32, 1);
        mSer.emplace_back("ma_w1", &mP.ma_w1, PluginFieldType::kFLOAT32, 1);
        mSer.emplace_back("ma_w2", &mP.ma_w2, PluginFieldType::kFLOAT32, 1);
        mSer.emplace_back("min_tokens", &mP.min_tokens, PluginFieldType::kINT32, 1);
        mSer.emplace_back("protect_first", &mP.protect_first, PluginFieldType::kINT32, 1);
        mSer.emplace_back("protect_last", &mP.protect_last, PluginFieldType::kINT32, 1);
        mSer.emplace_back("block_size", &mP.block_size, PluginFieldType::kINT32, 1);
        mSer.emplace_back("block_frac", &mP.block_frac, PluginFieldType::kFLOAT32, 1);
        mSer.emplace_back("anchor_rank", &mP.anchor_rank, PluginFieldType::kINT32, 1);
        mSer.emplace_back("rate", &mP.rate, PluginFieldType::kFLOAT32, 1);
        mSer.emplace_back("rank_block", &mP.rank_block, PluginFieldType::kINT32, 1);
        mSer.emplace_back(kAbiField, &mAbi, PluginFieldType::kINT32, 1);
        mFC.nbFields = int32_t(mSer.size());
        mFC.fields = mSer.data();
        return &mFC;
    }

private:
    int32_t nbIn() const { return mChunk ? 14 : 12; }
    ze_sih_params mP;
    bool mChunk;
};

// ------------------------------------------------------------------------------------------ PAD

class GatherPlugin final : public PluginBase
{
public:
    char const* getPluginName() const noexcept override { return kGatherName; }
    IPluginV3* clone() noexcept override
    {
        try
        {
            return new GatherPlugin();
        }
        catch (std::exception const&)
        {
            return nullptr;
        }
    }
    int32_t getNbOutputs() const noexcept override { return 3; }
    int32_t getOutputDataTypes(DataType* out, int32_t nbOutputs, DataType const* in, int32_t nbInputs) const noexcept override
    {
        if (nbInputs != 2 || nbOutputs != 3) return fail(std::string(kGatherName) + ": expects 2 inputs and 3 outputs");
        if (!isFloat(in[0])) return fail(std::string(kGatherName) + ": x must be float32 or float16");
        out[0] = in[0];
        out[1] = DataType::kINT32;
        out[2] = DataType::kINT32; // size tensors are int32
        return 0;
    }
    int32_t getOutputShapes(DimsExprs const* in, int32_t nbInputs, DimsExprs const*, int32_t, DimsExprs* out,
        int32_t nbOutputs, IExprBuilder& b) noexcept override
    {
        try
        {
            if (nbOutputs != 3) return fail(std::string(kGatherName) + ": expects 3 outputs (xs, idx, count)");
            auto s = shapes(in, nbInputs);
            std::string e = checkGatherShapes(s.data(), nbInputs);
            if (!e.empty()) return fail(e);
            // K = count: a size tensor (output 2) with upper bound T, tuned for half of the tokens kept
            auto opt = b.operation(DimensionOperation::kCEIL_DIV, *in[0].d[0], *b.constant(2));
            auto K = opt ? b.declareSizeTensor(2, *opt, *in[0].d[0]) : nullptr;
            if (!K) return fail(std::string(kGatherName) + ": could not declare the size tensor");
            out[0].nbDims = 2;
            out[0].d[0] = K;
            out[0].d[1] = in[0].d[1];
            out[1].nbDims = 1;
            out[1].d[0] = K;
            out[2].nbDims = 0; // size tensors are 0-D in TensorRT
            return 0;
        }
        catch (std::exception const& e)
        {
            return fail(std::string(kGatherName) + ": " + e.what());
        }
    }
    bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* io, int32_t nbInputs, int32_t nbOutputs) noexcept override
    {
        if (nbInputs != 2 || nbOutputs != 3 || pos < 0 || pos >= 5) return false;
        PluginTensorDesc const& d = io[pos].desc;
        if (d.format != TensorFormat::kLINEAR) return false;
        if (pos == 0) return isFloat(d.type);
        if (pos == 2) return d.type == io[0].desc.type;
        return d.type == DataType::kINT32;
    }
    int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*,
        int32_t) noexcept override
    {
        for (bool useMax : {false, true})
        {
            auto s = shapes(in, nbInputs, useMax);
            std::string e = checkGatherShapes(s.data(), nbInputs);
            if (!e.empty()) return fail(e);
        }
        return 0;
    }
    int32_t enqueue(PluginTensorDesc const* inDesc, PluginTensorDesc const*, void const* const* inputs,
        void* const* outputs, void* workspace, cudaStream_t stream) noexcept override
    {
        int dt = dtypeCode(inDesc[0].type);
        if (dt < 0) return fail(std::string(kGatherName) + ": x must be float32 or float16");
        return launchResult(ze_pad_gather(dt, inputs[0], static_cast<int32_t const*>(inputs[1]), inDesc[0].dims.d[0],
            inDesc[0].dims.d[1], outputs[0], static_cast<int32_t*>(outputs[1]), static_cast<int32_t*>(outputs[2]),
            workspace, 0, stream));
    }
    PluginFieldCollection const* getFieldsToSerialize() noexcept override
    {
        mSer.clear();
        mSer.emplace_back(kAbiField, &mAbi, PluginFieldType::kINT32, 1);
        mFC.nbFields = int32_t(mSer.size());
        mFC.fields = mSer.data();
        return &mFC;
    }
};

class ScatterPlugin final : public PluginBase
{
public:
    char const* getPluginName() const noexcept override { return kScatterName; }
    IPluginV3* clone() noexcept override
    {
        try
        {
            return new ScatterPlugin();
        }
        catch (std::exception const&)
        {
            return nullptr;
        }
    }
    int32_t getNbOutputs() const noexcept override { return 1; }
    int32_t getOutputDataTypes(DataType* out, int32_t nbOutputs, DataType const* in, int32_t nbInputs) const noexcept override
    {
        if (nbInputs != 3 || nbOutputs != 1) return fail(std::string(kScatterName) + ": expects 3 inputs and 1 output");
        if (!isFloat(in[0])) return fail(std::string(kScatterName) + ": base must be float32 or float16");
        out[0] = in[0];
        return 0;
    }
    int32_t getOutputShapes(DimsExprs const* in, int32_t nbInputs, DimsExprs const*, int32_t, DimsExprs* out,
        int32_t nbOutputs, IExprBuilder&) noexcept override
    {
        try
        {
            if (nbOutputs != 1) return fail(std::string(kScatterName) + ": expects 1 output");
            auto s = shapes(in, nbInputs);
            std::string e = checkScatterShapes(s.data(), nbInputs);
            if (!e.empty()) return fail(e);
            out[0] = in[0];
            return 0;
        }
        catch (std::exception const& e)
        {
            return fail(std::string(kScatterName) + ": " + e.what());
        }
    }
    bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* io, int32_t nbInputs, int32_t nbOutputs) noexcept override
    {
        if (nbInputs != 3 || nbOutputs != 1 || pos < 0 || pos >= 4) return false;
        PluginTensorDesc const& d = io[pos].desc;
        if (d.format != TensorFormat::kLINEAR) return false;
        if (pos == 0) return isFloat(d.type);
        if (pos == 2) return d.type == DataType::kINT32;
        return d.type == io[0].desc.type;
    }
    int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*,
        int32_t) noexcept override
    {
        for (bool useMax : {false, true})
        {
            auto s = shapes(in, nbInputs, useMax);
            std::string e = checkScatterShapes(s.data(), nbInputs);
            if (!e.empty()) return fail(e);
        }
        return 0;
    }
    size_t getWorkspaceSize(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*,
        int32_t) const noexcept override
    {
        return nbInputs == 3 ? ze_pad_scatter_workspace_size(in[0].max.d[0]) + kSlack : 0;
    }
    int32_t enqueue(PluginTensorDesc const* inDesc, PluginTensorDesc const*, void const* const* inputs,
        void* const* outputs, void* workspace, cudaStream_t stream) noexcept override
    {
        int dt = dtypeCode(inDesc[0].type);
        if (dt < 0) return fail(std::string(kScatterName) + ": base must be float32 or float16");
        int64_t T = inDesc[0].dims.d[0], D = inDesc[0].dims.d[1], K = inDesc[1].dims.d[0];
        if (inDesc[2].dims.d[0] != K)
            return fail(std::string(kScatterName) + ": y has " + std::to_string(K) + " rows but idx has "
                + std::to_string(inDesc[2].dims.d[0]));
        return launchResult(ze_pad_scatter(dt, inputs[0], inputs[1], static_cast<int32_t const*>(inputs[2]), T, K, D,
            outputs[0], align256(workspace), ze_pad_scatter_workspace_size(T), stream));
    }
    PluginFieldCollection const* getFieldsToSerialize() noexcept override
    {
        mSer.clear();
        mSer.emplace_back(kAbiField, &mAbi, PluginFieldType::kINT32, 1);
        mFC.nbFields = int32_t(mSer.size());
        mFC.fields = mSer.data();
        return &mFC;
    }
};

// ------------------------------------------------------------------------------------------ paths

// One FFN of a decode step under the magnitude rule: y = ze_paths_ffn_magnitude(x, w13_t, wd_t).
class PathsPlugin final : public PluginBase
{
public:
    explicit PathsPlugin(PathsParams const& p)
        : mP(p)
    {
    }
    PathsPlugin(PathsPlugin const& o)
        : PluginBase()
        , mP(o.mP)
    {
    }
    char const* getPluginName() const noexcept override { return kPathsName; }
    IPluginV3* clone() noexcept override
    {
        try
        {
            return new PathsPlugin(*this);
        }
        catch (std::exception const& e)
        {
            logError(std::string(kPathsName) + ": clone failed: " + e.what());
            return nullptr;
        }
    }
    int32_t getNbOutputs() const noexcept override { return 1; }
    int32_t getOutputDataTypes(DataType* out, int32_t nbOutputs, DataType const* in, int32_t nbInputs) const noexcept override
    {
        if (nbInputs != 3 || nbOutputs != 1) return fail(std::string(kPathsName) + ": expects 3 inputs and 1 output");
        if (pathsDtypeCode(in[0]) < 0) return fail(std::string(kPathsName) + ": x must be float16 or bfloat16");
        out[0] = in[0];
        return 0;
    }
    int32_t getOutputShapes(DimsExprs const* in, int32_t nbInputs, DimsExprs const*, int32_t, DimsExprs* out,
        int32_t nbOutputs, IExprBuilder&) noexcept override
    {
        try
        {
            if (nbOutputs != 1) return fail(std::string(kPathsName) + ": expects 1 output (y)");
            auto s = shapes(in, nbInputs);
            std::string e = checkPathsShapes(s.data(), nbInputs, nullptr, nullptr);
            if (!e.empty()) return fail(e);
            out[0] = in[0];
            return 0;
        }
        catch (std::exception const& e)
        {
            return fail(std::string(kPathsName) + ": " + e.what());
        }
    }
    bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* io, int32_t nbInputs, int32_t nbOutputs) noexcept override
    {
        if (nbInputs != 3 || nbOutputs != 1 || pos < 0 || pos >= 4) return false;
        PluginTensorDesc const& d = io[pos].desc;
        if (d.format != TensorFormat::kLINEAR) return false;
        if (pos == 0) return pathsDtypeCode(d.type) >= 0;
        return d.type == io[0].desc.type;
    }
    int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*,
        int32_t) noexcept override
    {
        try
        {
            for (bool useMax : {false, true})
            {
                auto s = shapes(in, nbInputs, useMax);
                std::string e = checkPathsShapes(s.data(), nbInputs, nullptr, nullptr);
                if (!e.empty()) return fail(e);
            }
            return 0;
        }
        catch (std::exception const& e)
        {
            return fail(std::string(kPathsName) + ": " + e.what());
        }
    }
    size_t getWorkspaceSize(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*,
        int32_t) const noexcept override
    {
        if (nbInputs != 3) return 0;
        return ze_paths_work_bytes(int(in[0].max.d[0]), int(in[0].max.d[1]), int(in[2].max.d[0])) + kSlack;
    }
    int32_t enqueue(PluginTensorDesc const* inDesc, PluginTensorDesc const*, void const* const* inputs,
        void* const* outputs, void* workspace, cudaStream_t stream) noexcept override
    {
        try
        {
            int dt = pathsDtypeCode(inDesc[0].type);
            if (dt < 0 || inDesc[1].type != inDesc[0].type || inDesc[2].type != inDesc[0].type)
                return fail(std::string(kPathsName) + ": x, w13_t and wd_t must all be float16 or all bfloat16");
            Shape s[3] = {toShape(inDesc[0].dims), toShape(inDesc[1].dims), toShape(inDesc[2].dims)};
            std::string e = checkPathsShapes(s, 3, nullptr, nullptr);
            if (!e.empty()) return fail(e);
            int B = int(inDesc[0].dims.d[0]), D = int(inDesc[0].dims.d[1]), F = int(inDesc[2].dims.d[0]);
            // TensorRT's workspace is not kept between enqueues: work_is_zero = 0 (the launcher clears it)
            return launchResult(ze_paths_ffn_magnitude(dt, inputs[0], inputs[1], inputs[2], outputs[0], mP.threshold_in,
                                    mP.threshold, B, D, F, align256(workspace), 0, stream),
                pathsStrerror);
        }
        catch (std::exception const& e)
        {
            return fail(std::string(kPathsName) + ": " + e.what());
        }
    }
    PluginFieldCollection const* getFieldsToSerialize() noexcept override
    {
        mSer.clear();
        mSer.emplace_back("threshold_in", &mP.threshold_in, PluginFieldType::kFLOAT32, 1);
        mSer.emplace_back("threshold", &mP.threshold, PluginFieldType::kFLOAT32, 1);
        mSer.emplace_back(kAbiField, &mAbi, PluginFieldType::kINT32, 1);
        mFC.nbFields = int32_t(mSer.size());
        mFC.fields = mSer.data();
        return &mFC;
    }

private:
    PathsParams mP;
};

// ------------------------------------------------------------------------------------------ creators

class CreatorBase : public IPluginCreatorV3One
{
public:
    explicit CreatorBase(char const* name)
        : mName(name)
    {
        for (FieldSpec const& s : fieldSpecs(name))
            mFields.emplace_back(s.name, nullptr,
                s.kind == FieldKind::kInt32 ? PluginFieldType::kINT32 : PluginFieldType::kFLOAT32, 1);
        mFC.nbFields = int32_t(mFields.size());
        mFC.fields = mFields.data();
    }
    PluginFieldCollection const* getFieldNames() noexcept override { return &mFC; }
    char const* getPluginName() const noexcept override { return mName; }
    char const* getPluginVersion() const noexcept override { return kVersion; }
    char const* getPluginNamespace() const noexcept override { return kNamespace; }
    IPluginV3* createPlugin(char const* name, PluginFieldCollection const* fc, TensorRTPhase) noexcept override
    {
        try
        {
            auto raw = toRaw(fc);
            IPluginV3* p = make(raw);
            if (!p) return nullptr;
            (void) name;
            return p;
        }
        catch (std::exception const& e)
        {
            logError(std::string(mName) + ": createPlugin failed: " + e.what());
            return nullptr;
        }
    }

protected:
    virtual IPluginV3* make(std::vector<RawField> const& raw) = 0;
    char const* mName;
    std::vector<PluginField> mFields;
    PluginFieldCollection mFC{0, nullptr};
};

class SihCreator final : public CreatorBase
{
public:
    explicit SihCreator(bool chunk)
        : CreatorBase(chunk ? kSihChunkName : kSihName)
        , mChunk(chunk)
    {
    }

protected:
    IPluginV3* make(std::vector<RawField> const& raw) override
    {
        ze_sih_params p{};
        std::string e = parseSih(raw.data(), int32_t(raw.size()), &p);
        if (!e.empty())
        {
            logError(e);
            return nullptr;
        }
        return new SihPlugin(p, mChunk);
    }

private:
    bool mChunk;
};

template <class P>
class PadCreator final : public CreatorBase
{
public:
    explicit PadCreator(char const* name)
        : CreatorBase(name)
    {
    }

protected:
    IPluginV3* make(std::vector<RawField> const& raw) override
    {
        std::string e = parsePad(mName, raw.data(), int32_t(raw.size()));
        if (!e.empty())
        {
            logError(e);
            return nullptr;
        }
        return new P();
    }
};

class PathsCreator final : public CreatorBase
{
public:
    PathsCreator()
        : CreatorBase(kPathsName)
    {
    }

protected:
    IPluginV3* make(std::vector<RawField> const& raw) override
    {
        PathsParams p{};
        std::string e = parsePaths(raw.data(), int32_t(raw.size()), &p);
        if (!e.empty())
        {
            logError(e);
            return nullptr;
        }
        return new PathsPlugin(p);
    }
};

} // namespace
} // namespace zeroedge

extern "C"
{

__attribute__((visibility("default"))) void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    zeroedge::gLoggerFinder = finder;
}

//! The plugin errors and warnings logged since the last call with clear != 0, newline separated: copies
//! at most size - 1 bytes and a NUL into buf (when buf and size > 0) and returns the full length. For
//! callers that load this library with ctypes beside TensorRT (zeroedge.backends.tensorrt).
__attribute__((visibility("default"))) size_t zeroedge_plugin_messages(char* buf, size_t size, int clear)
{
    std::lock_guard<std::mutex> lock(zeroedge::gMessagesMutex);
    size_t n = zeroedge::gMessages.size();
    if (buf && size > 0)
    {
        size_t k = n < size - 1 ? n : size - 1;
        std::memcpy(buf, zeroedge::gMessages.data(), k);
        buf[k] = '\0';
    }
    if (clear) zeroedge::gMessages.clear();
    return n;
}

__attribute__((visibility("default"))) nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static zeroedge::SihCreator sih(false);
    static zeroedge::SihCreator sihChunk(true);
    static zeroedge::PadCreator<zeroedge::GatherPlugin> gather(zeroedge::kGatherName);
    static zeroedge::PadCreator<zeroedge::ScatterPlugin> scatter(zeroedge::kScatterName);
    static zeroedge::PathsCreator paths;
    static nvinfer1::IPluginCreatorInterface* const creators[] = {&sih, &sihChunk, &gather, &scatter, &paths};
    nbCreators = 5;
    return creators;
}

} // extern "C"
