// tier/ext/access_trace.hpp — the order in which a training step touches its tensors, learnt from the
// first step and replayed by the prefetch scheduler in later ones.
//
// A step is bracketed by begin_step()/end_step(). While no trace is known the acquires of a step
// are recorded; at end_step the recording becomes the trace. In later steps each acquire is matched
// against the trace position: a match advances it, a mismatch means the order changed (another
// path, a frozen layer, a training step after an evaluation's forward): the trace is dropped and
// the step is recorded from there on, its matched prefix included, so the next step replays it.
// A step that ends early ran a prefix of the trace (an evaluation's forward): the trace stays.
// When the next step ends at the same place too, that place is the expected end: lookahead
// (span(), upcoming()) wraps there to the next step's start, until a step runs past it. The trace
// is cyclic: after its last entry (or the expected end) comes its first (the next step's start).
//
// Thread safety: none; the engine calls it from its scheduler thread only.
// Extension interface (include/tier/ext/README.md): stable for backends, tests and tools; not
// the user API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "tier/types.hpp"

namespace tier {

struct TraceEntry {
  TensorId tensor = kInvalidTensor;
  Tier tier = Tier::kDevice;
  // The acquire overwrites the whole tensor (Access::kWrite): its old bytes are never read, so
  // there is nothing to prefetch (an optimizer step's updated params). Not part of the match.
  bool write_only = false;
  friend bool operator==(const TraceEntry& a, const TraceEntry& b) { return a.tensor == b.tensor && a.tier == b.tier; }
};

class AccessTrace {
 public:
  static constexpr std::size_t kNever = std::numeric_limits<std::size_t>::max();

  enum class Mode { kIdle, kRecording, kReplaying };

  void begin_step();
  void end_step();
  // Records or matches one acquire. Returns false when it did not match a replayed trace.
  // `write_only`: the acquire is Access::kWrite (see TraceEntry).
  bool on_acquire(TensorId tensor, Tier tier, bool write_only = false);
  // Forgets the trace (e.g. when a tensor it holds is unregistered).
  void reset();
  // Whether the trace or the step being recorded holds an acquire of `tensor`.
  bool touches(TensorId tensor) const;

  Mode mode() const noexcept { return mode_; }
  bool has_trace() const noexcept { return !trace_.empty(); }
  const std::vector<TraceEntry>& entries() const noexcept { return trace_; }
  // Index of the next expected acquire while replaying (0 at the start of a step).
  std::size_t position() const noexcept { return pos_; }

  // Distance (in acquires, counting cyclically from the current position) to the next use of
  // `tensor` on any tier; kNever when the trace does not contain it or there is no trace.
  std::size_t next_use(TensorId tensor) const;
  // The same, restricted to uses on `tier`.
  std::size_t next_use(TensorId tensor, Tier tier) const;
  // How many entries a step is expected to run: the trace's, or the expected end of steps that
  // have been ending early at the same place.
  std::size_t span() const noexcept { return end_hint_ != kNever && pos_ <= end_hint_ ? end_hint_ : trace_.size(); }
  // The entry `ahead` acquires after the current position (cyclic over span()). Requires has_trace().
  const TraceEntry& upcoming(std::size_t ahead) const {
    const std::size_t n = span();
    return trace_[(pos_ + ahead) % n];
  }

  // How many times the replay moved on (each matched acquire, each step begun): equal counts mean
  // that no acquire of the trace happened in between.
  std::uint64_t advances() const noexcept { return advances_; }

  std::uint64_t steps_recorded() const noexcept { return steps_recorded_; }
  std::uint64_t order_changes() const noexcept { return order_changes_; }

 private:
  void rebuild_index();

  Mode mode_ = Mode::kIdle;
  bool in_step_ = false;
  std::vector<TraceEntry> trace_;
  std::vector<TraceEntry> recording_;
  std::size_t pos_ = 0;
  std::size_t short_at_ = kNever;  // where the last step ended early (kNever: it ran the trace whole)
  std::size_t end_hint_ = kNever;  // where steps have been ending early (kNever: at the trace's end)
  // For each tensor, the sorted trace positions that touch it (for next_use in O(log n)).
  std::vector<std::vector<std::uint32_t>> uses_;
  std::uint64_t advances_ = 0;
  std::uint64_t steps_recorded_ = 0;
  std::uint64_t order_changes_ = 0;
};

}  // namespace tier
