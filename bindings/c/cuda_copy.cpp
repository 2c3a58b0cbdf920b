#include "cuda_copy.hpp"

#include <cuda_runtime_api.h>

#include "gpu/cuda_current_device.hpp"

namespace tier::capi {

namespace {

Status cuda_failure(cudaError_t err, const char* what) {
  cudaGetLastError();  // clear a non-sticky error so the caller's next CUDA call starts clean
  return device_error(str(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

using detail::CurrentDevice;

}  // namespace

bool cuda_built() noexcept {
  return true;
}

Status copy_from_cuda(void* dst, const void* src, std::uint64_t bytes, int device_id, void* stream) {
  CurrentDevice guard(device_id);
  if (cudaError_t err = guard.status(); err != cudaSuccess) {
    return cuda_failure(err, str("cudaSetDevice(", device_id, ") for the source tensor").c_str());
  }
  auto s = static_cast<cudaStream_t>(stream);
  if (cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s); err != cudaSuccess) {
    return cuda_failure(
        err, str("cudaMemcpyAsync of ", bytes, " bytes from the source tensor on device ", device_id).c_str());
  }
  if (cudaError_t err = cudaStreamSynchronize(s); err != cudaSuccess) {
    return cuda_failure(err, "cudaStreamSynchronize of the source tensor's stream");
  }
  return Status::Ok();
}

Status sync_cuda_stream(int device_id, void* stream) {
  // The null stream means the current device's: make it the tensor's, as for a copy.
  CurrentDevice guard(device_id);
  if (cudaError_t err = guard.status(); err != cudaSuccess) {
    return cuda_failure(err, str("cudaSetDevice(", device_id, ") for the source tensor's stream").c_str());
  }
  if (cudaError_t err = cudaStreamSynchronize(static_cast<cudaStream_t>(stream)); err != cudaSuccess) {
    return cuda_failure(err, "cudaStreamSynchronize of the source tensor's stream");
  }
  return Status::Ok();
}

}  // namespace tier::capi
