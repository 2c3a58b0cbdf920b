// A scope guard that makes a CUDA device current and then puts the caller's back. CUDA builds
// only (header-only: users outside tier_gpu, such as the C ABI's copies and the NCCL
// communicator, include it without linking tier_gpu).
#pragma once

#include <cuda_runtime_api.h>

namespace tier::detail {

class CurrentDevice {
 public:
  explicit CurrentDevice(int id) : id_(id) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    err_ = prev_ == id ? cudaSuccess : cudaSetDevice(id);
  }
  ~CurrentDevice() {
    if (prev_ >= 0 && prev_ != id_ && err_ == cudaSuccess) cudaSetDevice(prev_);
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;
  cudaError_t status() const noexcept { return err_; }

 private:
  int id_;
  int prev_ = -1;
  cudaError_t err_ = cudaSuccess;
};

}  // namespace tier::detail
