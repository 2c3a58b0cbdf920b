#include <cuda_runtime_api.h>

#include "gpu/cuda_error.hpp"

namespace tier::detail {

Status cuda_error_status(int err, std::string_view what) {
  const auto e = static_cast<cudaError_t>(err);
  const StatusCode code = e == cudaErrorMemoryAllocation ? StatusCode::kResourceExhausted : StatusCode::kDeviceError;
  return Status(code, str(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

}  // namespace tier::detail
