#include "cpu/parallel.hpp"

#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>

#include "core/tsan_edges.hpp"

namespace tier::cpu::detail {

namespace {

// One arena per thread count, made on first use and kept: creating an arena per call would cost
// more than a small kernel.
oneapi::tbb::task_arena& arena_for(int threads) {
  static std::mutex mu;
  static std::map<int, std::unique_ptr<oneapi::tbb::task_arena>> arenas;
  std::lock_guard<std::mutex> lock(mu);
  auto& a = arenas[threads];
  if (!a) a = std::make_unique<oneapi::tbb::task_arena>(threads);
  return *a;
}

}  // namespace

Result<int> resolve_threads(int threads) {
  if (threads < 0)
    return invalid_argument(str("cpu kernel: thread count ", threads, " is negative; use 0 for all cores"));
  if (threads == 0) return std::max(1, oneapi::tbb::info::default_concurrency());
  return threads;
}

void parallel_ranges(std::uint64_t n, int threads, std::uint64_t granule,
                     const std::function<void(std::uint64_t, std::uint64_t)>& fn) {
  if (n == 0) return;
  const std::uint64_t pieces = (n + granule - 1) / granule;
  if (threads <= 1 || pieces <= 1) {
    fn(0, n);
    return;
  }
  tier::detail::ForkJoinEdges edges;
  arena_for(threads).execute([&] {
    oneapi::tbb::parallel_for(
        oneapi::tbb::blocked_range<std::uint64_t>(0, pieces, 1),
        [&](const oneapi::tbb::blocked_range<std::uint64_t>& r) {
          edges.enter();
          const std::uint64_t begin = r.begin() * granule;
          const std::uint64_t end = std::min(n, r.end() * granule);
          fn(begin, end);
          edges.leave();
        },
        oneapi::tbb::static_partitioner());
  });
  edges.finish();
}

Status check_tensor(const ConstTensorRef& t, const char* what) {
  if (!is_float_dtype(t.dtype)) {
    return invalid_argument(str(what, ": dtype ", dtype_name(t.dtype), " is not supported; use fp32, fp16 or bf16"));
  }
  return check_layout(t, what);
}

Status check_layout(const ConstTensorRef& t, const char* what) {
  if (t.numel > 0 && t.data == nullptr) return invalid_argument(str(what, ": null data for ", t.numel, " elements"));
  const auto addr = reinterpret_cast<std::uintptr_t>(t.data);
  if (addr % dtype_size(t.dtype) != 0) {
    return invalid_argument(str(what, ": address 0x", std::hex, addr, std::dec, " is not aligned to its ",
                                dtype_size(t.dtype), "-byte ", dtype_name(t.dtype), " elements"));
  }
  if (t.numel > (std::uint64_t{1} << 60) / dtype_size(t.dtype)) {
    return invalid_argument(str(what, ": ", t.numel, " elements is not a plausible length"));
  }
  return {};
}

bool overlaps(const ConstTensorRef& a, const ConstTensorRef& b) noexcept {
  if (a.data == nullptr || b.data == nullptr || a.numel == 0 || b.numel == 0) return false;
  const auto a0 = reinterpret_cast<std::uintptr_t>(a.data);
  const auto b0 = reinterpret_cast<std::uintptr_t>(b.data);
  const auto a1 = a0 + a.numel * dtype_size(a.dtype);
  const auto b1 = b0 + b.numel * dtype_size(b.dtype);
  return a0 < b1 && b0 < a1;
}

}  // namespace tier::cpu::detail
