// CUDA half of probe_cuda(), compiled by nvcc when TIER_WITH_CUDA is on.
#include <cuda_runtime_api.h>

#include <mutex>

#include "gpu/cuda_error.hpp"
#include "tier/ext/cuda_probe.hpp"

namespace tier {

namespace {

Status cuda_status(cudaError_t err, const char* what) {
  return detail::cuda_error_status(err, what);
}

CudaProbe run_probe() {
  CudaProbe p;
  p.compiled_in = true;
  cudaRuntimeGetVersion(&p.runtime_version);
  // Fails cleanly (cudaErrorInsufficientDriver / cudaErrorNoDevice) where there is no driver.
  cudaDriverGetVersion(&p.driver_version);
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    p.status = cuda_status(err, p.driver_version == 0 ? "no CUDA driver" : "cudaGetDeviceCount");
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return p;
  }
  if (count == 0) {
    p.status = Status(StatusCode::kUnsupported, "the CUDA driver reports no GPU");
    return p;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    err = cudaGetDeviceProperties(&prop, i);
    if (err != cudaSuccess) {
      p.status = cuda_status(err, "cudaGetDeviceProperties");
      return p;
    }
    GpuInfo g;
    g.index = i;
    g.name = prop.name;
    g.total_bytes = prop.totalGlobalMem;
    g.cc_major = prop.major;
    g.cc_minor = prop.minor;
    g.multiprocessors = prop.multiProcessorCount;
    // No cudaSetDevice or cudaMemGetInfo here: either would create a context on every GPU (hundreds
    // of MiB each, in every process that merely loads tier) and change the caller's current device.
    p.gpus.push_back(g);
  }
  return p;
}

}  // namespace

const CudaProbe& probe_cuda() {
  static const CudaProbe probe = run_probe();
  return probe;
}

}  // namespace tier
