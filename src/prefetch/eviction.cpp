#include "prefetch/eviction.hpp"

#include <algorithm>

namespace tier::prefetch {

std::size_t EvictionPolicy::rank(const EvictionCandidate& c, Tier tier, std::uint64_t clock) const {
  if (trace_.has_trace() && trace_.mode() == AccessTrace::Mode::kReplaying) {
    std::size_t next = trace_.next_use(c.tensor, tier);
    if (tier == Tier::kHost) {
      // A host copy is also the source of the tensor's next device load, unless the device copy
      // is there and will stay until that use (then the host copy is redundant).
      const std::size_t on_device = trace_.next_use(c.tensor, Tier::kDevice);
      if (on_device != kNever && (!c.device_copy_valid || !device_keeps(c.tensor, on_device))) {
        next = std::min(next, on_device);
      }
    }
    return next;
  }
  // LRU: the older the last use, the higher the rank.
  return static_cast<std::size_t>(clock - c.last_use);
}

bool EvictionPolicy::device_keeps(TensorId tensor, std::size_t ahead) const {
  const std::uint64_t room = device_budget_;
  std::uint64_t need = tensor_bytes_(tensor);
  if (need > room) return false;
  const std::uint64_t walk = ++seen_walk_;
  const std::size_t n = std::min(ahead, trace_.span());
  for (std::size_t k = 0; k < n; ++k) {
    const TraceEntry& e = trace_.upcoming(k);
    if (e.tier != Tier::kDevice || e.tensor == tensor) continue;
    if (e.tensor >= seen_mark_.size()) seen_mark_.resize(static_cast<std::size_t>(e.tensor) + 1, 0);
    if (seen_mark_[e.tensor] == walk) continue;
    seen_mark_[e.tensor] = walk;
    need += tensor_bytes_(e.tensor);
    if (need > room) return false;
  }
  return true;
}

std::vector<Victim> EvictionPolicy::choose(std::span<const EvictionCandidate> cands, Tier tier, TensorId for_tensor,
                                           std::size_t horizon, std::uint64_t clock) const {
  const bool prefetch = horizon != kNever;
  std::vector<Victim> out;
  for (const EvictionCandidate& c : cands) {
    if (c.tensor == for_tensor || c.home) continue;
    if (!c.valid || c.pinned || c.writing_back) continue;
    const std::size_t r = rank(c, tier, clock);
    if (prefetch && r != kNever && r <= horizon) continue;  // needed before the prefetch target
    out.push_back({c.tensor, r});
  }
  std::sort(out.begin(), out.end(), [](const Victim& a, const Victim& b) { return a.rank > b.rank; });
  return out;
}

}  // namespace tier::prefetch
