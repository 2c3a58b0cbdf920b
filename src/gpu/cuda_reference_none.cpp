// measure_cuda_memcpy() for builds without CUDA (TIER_WITH_CUDA=OFF).
#include "tier/ext/cuda_reference.hpp"
#include "tier/ext/cuda_probe.hpp"

namespace tier {

Result<MemcpyReference> measure_cuda_memcpy(int, std::uint64_t, int) {
  return unsupported(str("no CUDA device: ", probe_cuda().status.message()));
}

}  // namespace tier
