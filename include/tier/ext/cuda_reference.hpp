// The reference the device's copies are measured against: plain cudaMemcpyAsync between a
// cudaHostAlloc'd buffer and a cudaMalloc'd one, the best a program can get from pinned memory.
// Used by tier-bench copy and bench/gpu_check.sh.
#pragma once

#include <cstdint>
// Extension interface (include/tier/ext/README.md): stable for backends, tests and tools; not
// the user API.

#include "tier/status.hpp"

namespace tier {

struct MemcpyReference {
  double h2d_bytes_per_second = 0;
  double d2h_bytes_per_second = 0;
};

// Best of `reps` (after one warm-up) single cudaMemcpyAsync calls of `bytes` in each direction on
// a fresh non-blocking stream, each timed on the host from submission to cudaStreamSynchronize —
// the way tier-bench times the device's own copies. kUnsupported without CUDA or a GPU.
Result<MemcpyReference> measure_cuda_memcpy(int device_id, std::uint64_t bytes, int reps);

}  // namespace tier
