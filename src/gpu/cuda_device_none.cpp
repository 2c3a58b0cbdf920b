// create_cuda_device() for builds without CUDA (TIER_WITH_CUDA=OFF).
#include "tier/ext/cuda_probe.hpp"
#include "tier/ext/device.hpp"

namespace tier {

Result<std::unique_ptr<Device>> create_cuda_device(const DeviceOptions&) {
  return unsupported(str("no CUDA device: ", probe_cuda().status.message(),
                         "; use the emulated device (tier.device=emulated or auto)"));
}

}  // namespace tier
