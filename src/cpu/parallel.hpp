// Internal: splits element ranges over oneTBB threads so that each thread streams one contiguous
// stretch, and the argument checks the CPU kernels share.
#pragma once

#include <cstdint>
#include <functional>

#include "tier/cpu_kernels.hpp"
#include "tier/status.hpp"

namespace tier::cpu::detail {

// Threads to use for `threads` (0: all cores). kInvalidArgument when negative.
Result<int> resolve_threads(int threads);

// Calls fn(begin, end) on disjoint pieces covering [0, n). Piece boundaries are multiples of
// `granule`; each of up to `threads` threads gets one contiguous run of pieces (static
// partitioning: memory streams, no stealing across the range). Runs inline when threads == 1 or
// the range is a single piece. Blocks until every piece is done.
void parallel_ranges(std::uint64_t n, int threads, std::uint64_t granule,
                     const std::function<void(std::uint64_t, std::uint64_t)>& fn);

// Checks that `t` holds fp32/fp16/bf16 data (when `float_only`), is aligned to its element size
// and is non-null when it has elements. `what` names the tensor in the message.
// A float tensor (fp32, fp16, bf16) with check_layout's properties.
Status check_tensor(const ConstTensorRef& t, const char* what);
// Any dtype: data for its elements, aligned to the element size, a plausible length.
Status check_layout(const ConstTensorRef& t, const char* what);
// True when the byte ranges of a and b intersect.
bool overlaps(const ConstTensorRef& a, const ConstTensorRef& b) noexcept;

// The kernels' element kind for a float dtype: 0 fp32, 1 fp16, 2 bf16 (see simd_convert-inl.h).
inline int kind_of(DType d) noexcept {
  return d == DType::kF16 ? 1 : (d == DType::kBF16 ? 2 : 0);
}

// Reads TIER_CPU_SIMD once and applies it; every public kernel entry calls it first.
void init_simd_once();

}  // namespace tier::cpu::detail
