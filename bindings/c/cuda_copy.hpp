// Internal: the little CUDA the C ABI needs of its own — reading a producer's CUDA tensor, ordered
// after the work on the producer's stream. cuda_copy.cpp uses the CUDA runtime (linked statically
// with tier's gpu module); cuda_copy_none.cpp answers kUnsupported in builds without CUDA.
//
// Thread safety: any thread. The caller's current CUDA device is restored before returning.
#pragma once

#include <cstdint>

#include "tier/status.hpp"

namespace tier::capi {

// Whether this library was built with CUDA (the functions below do something).
bool cuda_built() noexcept;

// Copies `bytes` from CUDA memory `src` (on device `device_id`) to host memory `dst`, queued on
// `stream` (a cudaStream_t; null is the legacy default stream) after the work already there, and
// waits for the copy. Errors: kDeviceError naming the CUDA error; kUnsupported without CUDA.
Status copy_from_cuda(void* dst, const void* src, std::uint64_t bytes, int device_id, void* stream);

// Waits for the work queued on `stream` (of device `device_id`; null is that device's legacy
// default stream) so far. kUnsupported without CUDA.
Status sync_cuda_stream(int device_id, void* stream);

}  // namespace tier::capi
