#include "tier/ext/cuda_probe.hpp"
#include "tier/units.hpp"

namespace tier {

std::string CudaProbe::summary() const {
  if (!usable()) return str("none: ", status.message());
  std::string out = str(gpus.size(), gpus.size() == 1 ? " GPU: " : " GPUs: ");
  for (std::size_t i = 0; i < gpus.size(); ++i) {
    const auto& g = gpus[i];
    out += str(i ? ", " : "", g.name, " (", format_bytes(g.total_bytes), ", sm_", g.cc_major, g.cc_minor, ")");
  }
  return out;
}

}  // namespace tier
