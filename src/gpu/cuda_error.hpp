// CUDA runtime error codes as tier Status values. CUDA builds only.
#pragma once

#include <string_view>

#include "tier/status.hpp"

namespace tier::detail {

// "what: cudaErrorMemoryAllocation (out of memory)". Out-of-memory errors are
// kResourceExhausted, everything else kDeviceError. `err` is a cudaError_t; int keeps this header
// free of CUDA's.
Status cuda_error_status(int err, std::string_view what);

}  // namespace tier::detail
