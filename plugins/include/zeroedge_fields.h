// Plugin fields and shape rules of the zeroedge nodes, with no TensorRT headers, so that CI can test
// them with a plain C++ compiler. The TensorRT glue (src/plugin.cpp) converts PluginField to RawField
// and shapes to Shape and calls these; every function returns "" when fine, else one line that names
// the node, the field or input, what was expected and what was found.
#ifndef ZEROEDGE_FIELDS_H
#define ZEROEDGE_FIELDS_H

#include "zeroedge_kernels.h"
#include "zeroedge_paths.h"

#include <cstdint>
#include <string>
#include <vector>

namespace zeroedge
{

extern char const* const kSihName;     // "ZeroEdgeSIH"
extern char const* const kSihChunkName; // "ZeroEdgeSIHChunk": ZeroEdgeSIH for one chunk of a prompt
extern char const* const kGatherName;  // "ZeroEdgePADGather"
extern char const* const kScatterName; // "ZeroEdgePADScatter"
extern char const* const kPathsName;   // "ZeroEdgePathsFFN"
extern char const* const kVersion;     // "1"
extern char const* const kNamespace;   // "zeroedge"
extern char const* const kAbiField;    // "zeroedge_abi": written when serialized, checked when present

enum class FieldKind
{
    kInt32,
    kFloat32,
    kOther
};

struct RawField
{
    char const* name;
    void const* data;
    FieldKind kind;
    int32_t length;
    char const* type_name; // how the caller names the type, for messages ("kFLOAT64", ...)
};

struct FieldSpec
{
    char const* name;
    FieldKind kind;
    bool required;
    double dflt;
};

//! Fields of a node (empty for the PAD nodes). Throws nothing; unknown op -> empty.
std::vector<FieldSpec> const& fieldSpecs(std::string const& op);

//! Default SIH parameters (threshold = NaN: it is required).
ze_sih_params sihDefaults();

//! Parse the SIH fields: missing required, wrong type, wrong length and bad values are errors;
//! unknown fields are ignored (the ONNX parser may pass extra attributes).
std::string parseSih(RawField const* fields, int32_t nbFields, ze_sih_params* out);
//! The PAD nodes take no fields; only a mismatching zeroedge_abi is an error.
std::string parsePad(char const* op, RawField const* fields, int32_t nbFields);
std::string checkSihParams(ze_sih_params const& p);

//! ZeroEdgePathsFFN (magnitude rule, include/zeroedge_paths.h): both thresholds required.
struct PathsParams
{
    float threshold_in; // keep input k of a token when |x[b, k]| >= threshold_in
    float threshold;    // keep channel j of a token when |silu(g) * u| >= threshold
};
std::string parsePaths(RawField const* fields, int32_t nbFields, PathsParams* out);
//! Both thresholds finite and >= 0.
std::string checkPathsParams(PathsParams const& p);

struct Shape
{
    int32_t nbDims;
    int64_t d[8]; // -1: not known at build time
};

//! Input counts and shapes. On success checkSihShapes stores the head width W in *width if given;
//! chunk: ZeroEdgeSIHChunk's inputs (two more: carry [2], span [2]).
std::string checkSihShapes(Shape const* in, int32_t nbInputs, ze_sih_params const& p, int32_t* width,
    bool chunk = false);
std::string checkGatherShapes(Shape const* in, int32_t nbInputs);
std::string checkScatterShapes(Shape const* in, int32_t nbInputs);
//! x [B, D], w13_t [D, 2F], wd_t [F, D]: B in 1..ZE_PATHS_MAX_BATCH, D % 256 == 0 and D <= 8192,
//! F % 8 == 0; unknown (-1) dims are not checked. On success stores D and F (-1 if unknown) if given.
std::string checkPathsShapes(Shape const* in, int32_t nbInputs, int64_t* hidden, int64_t* ffn);

//! {"abi": 1, "namespace": ..., "version": ..., "nodes": {"ZeroEdgeSIH": {"inputs": n, "outputs": n,
//! "fields": {"threshold": ["float", null], ...}}, ...}} for the Python cross-check with plugin_spec.
std::string specJson();

} // namespace zeroedge

#endif
