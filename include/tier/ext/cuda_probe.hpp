// tier/ext/cuda_probe.hpp — is there a usable CUDA GPU here, and what is it?
//
// tier links the CUDA runtime statically and the runtime loads the driver (libcuda) only when
// first asked, so the library loads and runs on machines with no GPU and no driver; probe_cuda()
// is how the rest of tier finds out which case it is in.
//
// Probing creates no CUDA context and leaves the calling thread's current device as it was: it
// reads only the device count and properties. Free memory needs a context, so it is read by the
// CUDA device tier creates, on the one GPU it uses.
//
// Thread safety: probe_cuda() may be called from any thread; it probes once and caches.
// Extension interface (include/tier/ext/README.md): stable for backends, tests and tools; not
// the user API.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tier/status.hpp"

namespace tier {

struct GpuInfo {
  int index = 0;
  std::string name;
  std::uint64_t total_bytes = 0;
  int cc_major = 0;
  int cc_minor = 0;
  int multiprocessors = 0;
};

struct CudaProbe {
  bool compiled_in = false;  // built with TIER_WITH_CUDA
  int runtime_version = 0;   // e.g. 13000
  int driver_version = 0;    // 0 when no driver is installed
  std::vector<GpuInfo> gpus;
  Status status;  // ok when at least one GPU is usable; otherwise why not ("no CUDA driver", ...)
  bool usable() const noexcept { return status.ok() && !gpus.empty(); }
  // "2 GPUs: NVIDIA H200 (139.8 GiB, sm_90), ..." or "none: <reason>".
  std::string summary() const;
};

const CudaProbe& probe_cuda();

}  // namespace tier
