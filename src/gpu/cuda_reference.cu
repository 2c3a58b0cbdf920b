#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "gpu/cuda_error.hpp"
#include "tier/ext/cuda_reference.hpp"
#include "tier/ext/cuda_probe.hpp"
#include "tier/units.hpp"

namespace tier {

namespace {

// Frees what it holds on every path out.
struct Resources {
  int prev_device = -1;
  void* host = nullptr;
  void* device = nullptr;
  cudaStream_t stream = nullptr;
  ~Resources() {
    if (stream) cudaStreamDestroy(stream);
    if (device) cudaFree(device);
    if (host) cudaFreeHost(host);
    if (prev_device >= 0) cudaSetDevice(prev_device);
  }
};

Status check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status();
  cudaGetLastError();
  return detail::cuda_error_status(err, str("cudaMemcpy reference: ", what));
}

}  // namespace

Result<MemcpyReference> measure_cuda_memcpy(int device_id, std::uint64_t bytes, int reps) {
  const CudaProbe& probe = probe_cuda();
  if (!probe.usable()) return unsupported(str("no CUDA device: ", probe.status.message()));
  if (bytes == 0 || reps < 1) return invalid_argument("cudaMemcpy reference: bytes and reps must be positive");
  Resources r;
  if (cudaGetDevice(&r.prev_device) != cudaSuccess) r.prev_device = -1;
  TIER_RETURN_IF_ERROR(check(cudaSetDevice(device_id), "cudaSetDevice"));
  TIER_RETURN_IF_ERROR(check(cudaHostAlloc(&r.host, bytes, cudaHostAllocDefault), "cudaHostAlloc"));
  TIER_RETURN_IF_ERROR(check(cudaMalloc(&r.device, bytes), "cudaMalloc"));
  TIER_RETURN_IF_ERROR(check(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  std::memset(r.host, 0x5a, bytes);  // touch every page before timing

  auto best = [&](cudaMemcpyKind kind, double* out) -> Status {
    void* dst = kind == cudaMemcpyHostToDevice ? r.device : r.host;
    const void* src = kind == cudaMemcpyHostToDevice ? r.host : r.device;
    double best_bps = 0;
    for (int i = 0; i <= reps; ++i) {  // i == 0 warms up
      const auto t0 = std::chrono::steady_clock::now();
      TIER_RETURN_IF_ERROR(check(cudaMemcpyAsync(dst, src, bytes, kind, r.stream), "cudaMemcpyAsync"));
      TIER_RETURN_IF_ERROR(check(cudaStreamSynchronize(r.stream), "cudaStreamSynchronize"));
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (i > 0 && s > 0) best_bps = std::max(best_bps, static_cast<double>(bytes) / s);
    }
    *out = best_bps;
    return Status();
  };
  MemcpyReference ref;
  TIER_RETURN_IF_ERROR(best(cudaMemcpyHostToDevice, &ref.h2d_bytes_per_second));
  TIER_RETURN_IF_ERROR(best(cudaMemcpyDeviceToHost, &ref.d2h_bytes_per_second));
  return ref;
}

}  // namespace tier
