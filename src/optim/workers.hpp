// Internal: the optimizer's oneTBB arena, used for the update of a chunk and for large gradient
// intakes. Work is split statically into contiguous runs (memory streams; no stealing across a
// range), which also keeps results independent of timing.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

namespace tier::optim::detail {

class Workers {
 public:
  // threads: 0 = all cores.
  explicit Workers(int threads);
  ~Workers();
  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;

  int threads() const noexcept { return threads_; }
  // Calls fn(begin, end) on disjoint pieces covering [0, n), each a run of whole granules (the
  // last one shorter), at most threads() at a time; inline for one thread or one granule. Safe
  // to call from several threads at once. Blocks until every piece is done.
  void for_ranges(std::uint64_t n, std::uint64_t granule,
                  const std::function<void(std::uint64_t, std::uint64_t)>& fn) const;

 private:
  struct Arena;  // a oneTBB task_arena (kept out of this header)
  int threads_ = 1;
  std::unique_ptr<Arena> arena_;
};

}  // namespace tier::optim::detail
