#include "tier/ext/access_trace.hpp"

#include <algorithm>

namespace tier {

void AccessTrace::begin_step() {
  in_step_ = true;
  pos_ = 0;
  ++advances_;
  if (trace_.empty()) {
    mode_ = Mode::kRecording;
    recording_.clear();
  } else {
    mode_ = Mode::kReplaying;
  }
}

void AccessTrace::end_step() {
  if (!in_step_) return;
  in_step_ = false;
  if (mode_ == Mode::kRecording) {
    trace_ = std::move(recording_);
    recording_.clear();
    ++steps_recorded_;
    rebuild_index();
  } else if (mode_ == Mode::kReplaying && pos_ != 0 && pos_ != trace_.size()) {
    // The step ended early: it ran a prefix of the trace (an evaluation's forward between
    // training steps, or fewer layers). The trace stays for the steps that run it whole. A second
    // step in a row that ends at the same place makes that the expected end: lookahead wraps
    // there to the next step's start (instead of reading a tail that does not run), until a step
    // runs past it again.
    if (pos_ != end_hint_) {
      if (short_at_ == pos_) {
        end_hint_ = pos_;
      } else {
        ++order_changes_;
        short_at_ = pos_;
      }
    }
  } else if (mode_ == Mode::kReplaying && pos_ == trace_.size()) {
    short_at_ = kNever;
    end_hint_ = kNever;
  }
  pos_ = 0;
  mode_ = trace_.empty() ? Mode::kIdle : Mode::kReplaying;
}

bool AccessTrace::on_acquire(TensorId tensor, Tier tier, bool write_only) {
  if (!in_step_) return true;
  const TraceEntry e{tensor, tier, write_only};
  if (mode_ == Mode::kRecording) {
    recording_.push_back(e);
    return true;
  }
  if (mode_ != Mode::kReplaying) return true;
  if (pos_ < trace_.size() && trace_[pos_] == e) {
    if (pos_ == end_hint_) end_hint_ = kNever;  // a step runs past the expected end: the whole trace again
    ++pos_;
    ++advances_;
    return true;
  }
  // Divergence (another path, or more after the trace's end: a training step after an
  // evaluation's forward). The step so far is the matched prefix: record from there, so that the
  // next step replays this one whole. The rest of this step goes on demand.
  ++order_changes_;
  recording_.assign(trace_.begin(), trace_.begin() + static_cast<std::ptrdiff_t>(pos_));
  recording_.push_back(e);
  trace_.clear();
  uses_.clear();
  pos_ = 0;
  short_at_ = kNever;
  end_hint_ = kNever;
  mode_ = Mode::kRecording;
  return false;
}

void AccessTrace::reset() {
  trace_.clear();
  uses_.clear();
  pos_ = 0;
  short_at_ = kNever;
  end_hint_ = kNever;
  if (mode_ == Mode::kRecording) {
    // What was recorded may name the tensor that goes: this step leaves no trace.
    recording_.clear();
    mode_ = Mode::kIdle;
  }
  if (mode_ == Mode::kReplaying) mode_ = Mode::kIdle;
}

bool AccessTrace::touches(TensorId tensor) const {
  if (tensor < uses_.size() && !uses_[tensor].empty()) return true;
  return std::any_of(recording_.begin(), recording_.end(), [&](const TraceEntry& e) { return e.tensor == tensor; });
}

void AccessTrace::rebuild_index() {
  uses_.clear();
  for (std::uint32_t i = 0; i < trace_.size(); ++i) {
    const TensorId t = trace_[i].tensor;
    if (t >= uses_.size()) uses_.resize(t + 1);
    uses_[t].push_back(i);
  }
}

std::size_t AccessTrace::next_use(TensorId tensor) const {
  if (trace_.empty() || tensor >= uses_.size() || uses_[tensor].empty()) return kNever;
  const auto& u = uses_[tensor];
  auto it = std::lower_bound(u.begin(), u.end(), static_cast<std::uint32_t>(pos_));
  if (it != u.end()) return *it - pos_;
  return trace_.size() - pos_ + u.front();  // wraps into the next step
}

std::size_t AccessTrace::next_use(TensorId tensor, Tier tier) const {
  if (trace_.empty() || tensor >= uses_.size()) return kNever;
  const auto& u = uses_[tensor];
  auto it = std::lower_bound(u.begin(), u.end(), static_cast<std::uint32_t>(pos_));
  for (auto j = it; j != u.end(); ++j) {
    if (trace_[*j].tier == tier) return *j - pos_;
  }
  for (auto j = u.begin(); j != it; ++j) {
    if (trace_[*j].tier == tier) return trace_.size() - pos_ + *j;
  }
  return kNever;
}

}  // namespace tier
