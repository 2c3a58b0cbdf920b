// prefetch/scheduler.hpp — the prefetch scheduler: which upcoming acquires of a replayed access
// trace to start loading now.
//
// Policy. The scheduler walks the trace from the current position, at most `lookahead` entries
// (0: 1024) and, after the first, no further than `window_bytes` of tensors (staging further would
// evict copies needed sooner). Two stages run ahead at their own depth:
//  - the final hop (host -> device, or NVMe -> host for host acquires) of the next entries, while
//    the bytes of final-hop prefetches in flight stay within `max_inflight_bytes`. The final stage
//    closes at the first entry that does not fit, finds no room on its tier, or is still waiting
//    for its host copy (a later entry's final hop would take room this one needs first);
//  - beyond it, NVMe -> host staging of device acquires, while staging bytes in flight stay within
//    `max_staging_bytes`, so the NVMe read of k+2 overlaps the device copy of k+1. Staging stops
//    at the first entry over that budget or that finds no room on the host.
// Entries whose copy is already valid or on its way, and tensors that are gone or held by a
// writer, are passed over (their bytes still count toward the window).
//
// The scheduler knows nothing of the engine's records: it asks a PrefetchTarget (the engine) about
// copies and tells it what to start.
//
// Thread safety: none; the engine calls it from its scheduler thread only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tier/ext/access_trace.hpp"
#include "tier/types.hpp"

namespace tier::prefetch {

struct PrefetchLimits {
  std::uint64_t lookahead = 0;           // most entries walked; 0: 1024
  std::uint64_t window_bytes = 0;        // most bytes of the entries walked (after the first)
  std::uint64_t max_inflight_bytes = 0;  // final-hop prefetches in flight
  std::uint64_t max_staging_bytes = 0;   // NVMe -> host staging hops in flight
};

// What the scheduler asks of the engine and tells it to do.
class PrefetchTarget {
 public:
  enum class Started {
    kInFlight,  // the copy is loading (or already valid)
    kWaiting,   // accepted, but waiting for an earlier hop (its host copy) before it loads
    kNoRoom,    // its tier has no room without evicting something needed sooner
  };
  virtual ~PrefetchTarget() = default;
  // Whether the id names a tensor record at all (entries that do not are skipped, uncounted).
  virtual bool known(TensorId tensor) const = 0;
  // Whether the tensor can be prefetched at all (registered and not held by a writer).
  virtual bool prefetchable(TensorId tensor) const = 0;
  virtual std::uint64_t bytes(TensorId tensor) const = 0;
  // (optional) — defaults to false. Tensors whose final hop runs at most one use ahead: of the
  // upcoming entries of such tensors only the first is brought to its tier; later ones are only
  // staged. For data that is large and used once per step in a known order (offloaded activation
  // checkpoints), where bringing two ahead would double what the device holds.
  virtual bool one_ahead(TensorId /*tensor*/) const { return false; }
  // Whether the tensor's copy on `tier` is valid, reserved or loading (nothing to start).
  virtual bool present_or_coming(TensorId tensor, Tier tier) const = 0;
  virtual std::uint64_t inflight_bytes() const = 0;  // final-hop prefetches in flight
  virtual std::uint64_t staging_bytes() const = 0;   // staging hops in flight
  // Starts loading the tensor's copy on `tier`; `distance`: its position ahead in the trace (only
  // copies used later may be evicted for it); `staging`: an intermediate hop toward the device.
  virtual Started start(TensorId tensor, Tier tier, std::size_t distance, bool staging) = 0;
};

class PrefetchScheduler {
 public:
  explicit PrefetchScheduler(PrefetchLimits limits = {}) : limits_(limits) {}
  const PrefetchLimits& limits() const noexcept { return limits_; }

  // Starts the prefetches the trace calls for now. Does nothing unless `trace` is replaying.
  void issue(const AccessTrace& trace, PrefetchTarget& target) const;

 private:
  PrefetchLimits limits_;
};

}  // namespace tier::prefetch
