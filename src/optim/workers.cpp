#include "optim/workers.hpp"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>

#include "core/tsan_edges.hpp"

namespace tier::optim::detail {

struct Workers::Arena {
  explicit Arena(int n) : arena(n) {}
  oneapi::tbb::task_arena arena;
};

Workers::Workers(int threads) {
  threads_ = threads > 0 ? threads : std::max(1, oneapi::tbb::info::default_concurrency());
  if (threads_ > 1) arena_ = std::make_unique<Arena>(threads_);
}

Workers::~Workers() = default;

void Workers::for_ranges(std::uint64_t n, std::uint64_t granule,
                         const std::function<void(std::uint64_t, std::uint64_t)>& fn) const {
  if (n == 0) return;
  granule = std::max<std::uint64_t>(granule, 1);
  const std::uint64_t pieces = (n + granule - 1) / granule;
  if (!arena_ || pieces <= 1) {
    fn(0, n);
    return;
  }
  // One contiguous run per thread: split the pieces into threads_ runs.
  const std::uint64_t runs = std::min<std::uint64_t>(pieces, static_cast<std::uint64_t>(threads_));
  tier::detail::ForkJoinEdges edges;
  arena_->arena.execute([&] {
    oneapi::tbb::parallel_for(
        oneapi::tbb::blocked_range<std::uint64_t>(0, runs, 1),
        [&](const oneapi::tbb::blocked_range<std::uint64_t>& r) {
          edges.enter();
          for (std::uint64_t k = r.begin(); k != r.end(); ++k) {
            const std::uint64_t b = pieces * k / runs * granule;
            const std::uint64_t e = std::min(n, pieces * (k + 1) / runs * granule);
            if (b < e) fn(b, e);
          }
          edges.leave();
        },
        oneapi::tbb::static_partitioner());
  });
  edges.finish();
}

}  // namespace tier::optim::detail
