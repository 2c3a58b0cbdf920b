// cuda_copy.hpp for builds without CUDA (TIER_WITH_CUDA=OFF).
#include "cuda_copy.hpp"

namespace tier::capi {

namespace {
Status no_cuda() {
  return unsupported(
      "this libtier was built without CUDA (TIER_WITH_CUDA=OFF), so it cannot read a CUDA tensor or order a copy "
      "after a CUDA stream; synchronize and pass a kDLCPU tensor, or build tier with CUDA");
}
}  // namespace

bool cuda_built() noexcept {
  return false;
}

Status copy_from_cuda(void*, const void*, std::uint64_t, int, void*) {
  return no_cuda();
}

Status sync_cuda_stream(int, void*) {
  return no_cuda();
}

}  // namespace tier::capi
