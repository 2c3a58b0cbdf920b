// probe_cuda() for builds without CUDA (TIER_WITH_CUDA=OFF).
#include "tier/ext/cuda_probe.hpp"

namespace tier {

const CudaProbe& probe_cuda() {
  static const CudaProbe probe = [] {
    CudaProbe p;
    p.status = Status(StatusCode::kUnsupported, "tier was built without CUDA (TIER_WITH_CUDA=OFF)");
    return p;
  }();
  return probe;
}

}  // namespace tier
