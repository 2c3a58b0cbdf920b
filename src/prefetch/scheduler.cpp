#include "prefetch/scheduler.hpp"

#include <algorithm>

namespace tier::prefetch {

void PrefetchScheduler::issue(const AccessTrace& trace, PrefetchTarget& target) const {
  if (!trace.has_trace() || trace.mode() != AccessTrace::Mode::kReplaying) return;
  const std::size_t n = std::min<std::size_t>(limits_.lookahead ? limits_.lookahead : 1024, trace.span());
  std::uint64_t window = 0;  // bytes of the entries walked so far
  bool final_open = true;
  bool one_ahead_seen = false;  // an upcoming one_ahead entry was passed: later ones only stage
  for (std::size_t k = 0; k < n; ++k) {
    const TraceEntry& e = trace.upcoming(k);
    if (!target.known(e.tensor)) continue;
    const std::uint64_t bytes = target.bytes(e.tensor);
    window += bytes;
    if (k > 0 && window > limits_.window_bytes) break;  // staging further would evict copies needed sooner
    // A write-only acquire reads nothing: fetching the old bytes would only cost a read (and the
    // room of copies needed sooner). Its bytes still count in the window: it will take room.
    if (e.write_only) continue;
    if (!target.prefetchable(e.tensor)) continue;
    const bool one_ahead = target.one_ahead(e.tensor);
    const bool first_of_its_kind = !(one_ahead && one_ahead_seen);
    if (one_ahead) one_ahead_seen = true;
    if (target.present_or_coming(e.tensor, e.tier)) continue;
    if (final_open && first_of_its_kind && target.inflight_bytes() + bytes <= limits_.max_inflight_bytes) {
      const PrefetchTarget::Started s = target.start(e.tensor, e.tier, k, /*staging=*/false);
      if (s == PrefetchTarget::Started::kInFlight) continue;
      // kWaiting: a later entry's final hop would take target room this one needs first (and be
      // evicted again for it), so later entries only stage. kNoRoom: no room on the target tier
      // without evicting something needed sooner.
      final_open = false;
      if (s == PrefetchTarget::Started::kWaiting) continue;
    } else if (first_of_its_kind) {
      final_open = false;
    }
    // Stage toward the device through the host.
    if (e.tier != Tier::kDevice) continue;
    if (target.present_or_coming(e.tensor, Tier::kHost)) continue;
    if (target.staging_bytes() + bytes > limits_.max_staging_bytes) break;
    if (target.start(e.tensor, Tier::kHost, k, /*staging=*/true) == PrefetchTarget::Started::kNoRoom) break;
  }
}

}  // namespace tier::prefetch
