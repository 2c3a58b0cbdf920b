// prefetch/eviction.hpp — the eviction policy: which copies on a full tier go first.
//
// Policy. With a replayed access trace the victim is the copy whose next use on that tier is
// furthest ahead (Belady); a host copy also counts the tensor's next device use, because it is the
// source of that load, unless the device copy is valid and the device keeps it until then (the
// distinct tensors the device must hold in between fit in its budget). A copy the trace never uses
// ranks kNever, above everything. Without a replayed trace: least recently used (the rank is the
// age on the engine's use clock). Ties keep no particular order.
//
// The policy knows nothing of the engine's records: the engine describes each copy on the tier
// (EvictionCandidate) and the policy filters and orders them. Copies that are pinned (leases,
// transfers), writing back, not yet valid, home copies or the copy being placed are never chosen.
// A prefetch (horizon != kNever) may only take copies used later than its own target.
//
// Thread safety: none; the engine calls it from its scheduler thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "tier/ext/access_trace.hpp"
#include "tier/types.hpp"

namespace tier::prefetch {

// One tensor's copy on the tier that needs room, as the engine sees it.
struct EvictionCandidate {
  TensorId tensor = kInvalidTensor;
  bool valid = false;          // the copy is complete (not absent, reserved, loading or stale)
  bool pinned = false;         // leases or transfers use it
  bool writing_back = false;   // being copied toward home already
  bool home = false;           // the tensor's home copy: never evicted
  std::uint64_t last_use = 0;  // the engine's use clock at the copy's last use
  // Host tier only: the tensor's device copy is valid (see device_keeps).
  bool device_copy_valid = false;
};

struct Victim {
  TensorId tensor = kInvalidTensor;
  std::size_t rank = 0;  // larger: evicted first
};

class EvictionPolicy {
 public:
  static constexpr std::size_t kNever = AccessTrace::kNever;

  // `trace` must outlive the policy. `tensor_bytes` gives a tensor's size (0 for an id the engine
  // does not know); it decides whether the device keeps a copy until its next use.
  EvictionPolicy(const AccessTrace& trace, std::function<std::uint64_t(TensorId)> tensor_bytes)
      : trace_(trace), tensor_bytes_(std::move(tensor_bytes)) {}

  void set_device_budget(std::uint64_t bytes) noexcept { device_budget_ = bytes; }

  // How evictable `c`'s copy on `tier` is now: larger goes first. `clock`: the engine's use clock.
  std::size_t rank(const EvictionCandidate& c, Tier tier, std::uint64_t clock) const;

  // Whether the device keeps `tensor`'s copy until its next device use `ahead` acquires from now:
  // the distinct tensors the device must hold in between, with it, fit in the device budget.
  bool device_keeps(TensorId tensor, std::size_t ahead) const;

  // The copies of `cands` that may be evicted to place `for_tensor` on `tier`, most evictable
  // first. `horizon`: kNever for a demand; for a prefetch, the trace distance of its target (only
  // copies whose next use is further away, or never, are returned).
  std::vector<Victim> choose(std::span<const EvictionCandidate> cands, Tier tier, TensorId for_tensor,
                             std::size_t horizon, std::uint64_t clock) const;

 private:
  const AccessTrace& trace_;
  std::function<std::uint64_t(TensorId)> tensor_bytes_;
  std::uint64_t device_budget_ = 0;
  mutable std::vector<std::uint64_t> seen_mark_;  // device_keeps' scratch: the walk each tensor was last seen in
  mutable std::uint64_t seen_walk_ = 0;
};

}  // namespace tier::prefetch
