// The library's entry point: onnxruntime calls RegisterCustomOps when a session registers it
// (SessionOptions.register_custom_ops_library); it adds the "zeroedge.ort" domain with every op.
#include <mutex>

#include "ops.h"

extern "C" __attribute__((visibility("default")))
OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  static std::mutex lock;
  std::lock_guard<std::mutex> guard(lock);
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr)   // an onnxruntime older than the headers: say so with the oldest API there is
    return api_base->GetApi(1)->CreateStatus(ORT_FAIL, "libzeroedge_ortops needs onnxruntime 1.21 or later");
  Ort::InitApi(api);
  try {
    // a domain must outlive the sessions that use it: kept until the process ends
    static std::vector<Ort::CustomOpDomain> domains;
    Ort::CustomOpDomain domain{"zeroedge.ort"};
    zeroedge_ort::add_q4_linear(domain);
    zeroedge_ort::add_q8_linear(domain);
    zeroedge_ort::add_window_attention(domain);
    zeroedge_ort::add_paged_attention(domain);
    zeroedge_ort::add_block_offsets(domain);
    Ort::UnownedSessionOptions(options).Add(domain);
    domains.push_back(std::move(domain));
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
