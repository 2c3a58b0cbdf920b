#include "tier/ext/fault_injecting_engine.hpp"

#include <fcntl.h>

#include <algorithm>

namespace tier::nvme {

FaultInjectingEngine::FaultInjectingEngine(std::unique_ptr<IoEngine> inner) : inner_(std::move(inner)) {}

FaultInjectingEngine::~FaultInjectingEngine() = default;

void FaultInjectingEngine::add_fault(const FaultSpec& spec) {
  std::lock_guard<std::mutex> lk(mu_);
  faults_.push_back({spec, 0});
}

void FaultInjectingEngine::fail_nth(std::uint64_t nth, int err, std::optional<IoOp> op) {
  FaultSpec f;
  f.kind = FaultKind::kError;
  f.nth = nth;
  f.err = err;
  f.op = op;
  add_fault(f);
}

void FaultInjectingEngine::short_nth(std::uint64_t nth, std::uint32_t short_bytes, std::optional<IoOp> op) {
  FaultSpec f;
  f.kind = FaultKind::kShort;
  f.nth = nth;
  f.short_bytes = short_bytes;
  f.op = op;
  add_fault(f);
}

void FaultInjectingEngine::transient_nth(std::uint64_t nth, std::uint64_t times, int err, std::optional<IoOp> op) {
  FaultSpec f;
  f.kind = FaultKind::kTransient;
  f.nth = nth;
  f.count = times;
  f.err = err;
  f.op = op;
  add_fault(f);
}

void FaultInjectingEngine::fail_writes_after_bytes(std::uint64_t bytes, int err) {
  std::lock_guard<std::mutex> lk(mu_);
  budget_set_ = true;
  budget_left_ = bytes;
  budget_err_ = err;
}

void FaultInjectingEngine::clear_faults() {
  std::lock_guard<std::mutex> lk(mu_);
  faults_.clear();
  budget_set_ = false;
}

FaultCounters FaultInjectingEngine::counters() const {
  std::lock_guard<std::mutex> lk(mu_);
  return counters_;
}

unsigned FaultInjectingEngine::in_flight() const noexcept {
  return inner_->in_flight() + static_cast<unsigned>(ready_.size());
}

Result<int> FaultInjectingEngine::register_file(int fd) {
  TIER_ASSIGN_OR_RETURN(int slot, inner_->register_file(fd));
  std::lock_guard<std::mutex> lk(mu_);
  if (slot_fds_.size() <= static_cast<std::size_t>(slot)) slot_fds_.resize(static_cast<std::size_t>(slot) + 1, -1);
  slot_fds_[static_cast<std::size_t>(slot)] = fd;
  return slot;
}

Status FaultInjectingEngine::unregister_file(int index) {
  TIER_RETURN_IF_ERROR(inner_->unregister_file(index));
  std::lock_guard<std::mutex> lk(mu_);
  if (index >= 0 && static_cast<std::size_t>(index) < slot_fds_.size()) slot_fds_[static_cast<std::size_t>(index)] = -1;
  return Status::Ok();
}

Status FaultInjectingEngine::register_buffers(void* base, std::uint64_t bytes) {
  return inner_->register_buffers(base, bytes);
}

FaultInjectingEngine::Decision FaultInjectingEngine::decide(const IoRequest& r) {
  std::lock_guard<std::mutex> lk(mu_);
  ++counters_.requests;
  int fd = r.fd;
  if (r.file_index >= 0) {
    fd = static_cast<std::size_t>(r.file_index) < slot_fds_.size() ? slot_fds_[static_cast<std::size_t>(r.file_index)]
                                                                   : -1;
  }
  Decision d;
  bool applied = false;
  for (Active& a : faults_) {
    const FaultSpec& f = a.spec;
    if (f.op && *f.op != r.op) continue;
    if (f.fd >= 0 && f.fd != fd) continue;
    ++a.seen;
    if (applied || a.seen < f.nth || a.seen - f.nth >= f.count) continue;
    switch (f.kind) {
      case FaultKind::kError:
        d.complete_with = f.err;
        ++counters_.errors;
        applied = true;
        break;
      case FaultKind::kTransient:
        d.complete_with = f.err;
        d.transient = true;
        ++counters_.transients;
        applied = true;
        break;
      case FaultKind::kShort: {
        std::uint32_t report = f.short_bytes ? f.short_bytes : (r.length / 2) & ~4095u;
        if (report == 0 && r.length > 4096) report = 4096;
        if (report == 0 || report >= r.length) break;  // nothing to cut: the request passes whole
        std::uint32_t pass = report;
        const int flags = fd >= 0 ? ::fcntl(fd, F_GETFL) : 0;
        if (flags > 0 && (flags & O_DIRECT)) pass = std::min(r.length, (report + 4095u) & ~4095u);
        d.pass_length = pass;
        d.report = report;
        ++counters_.shorts;
        applied = true;
        break;
      }
    }
  }
  if (!applied && r.op == IoOp::kWrite && budget_set_) {
    if (r.length > budget_left_) {
      d.complete_with = budget_err_;
      ++counters_.errors;
    } else {
      budget_left_ -= r.length;
    }
  }
  return d;
}

Result<std::size_t> FaultInjectingEngine::submit(const IoRequest* requests, std::size_t n) {
  const std::size_t take = std::min<std::size_t>(n, queue_depth() - std::min(queue_depth(), in_flight()));
  std::vector<IoRequest> pass;
  pass.reserve(take);
  for (std::size_t i = 0; i < take; ++i) {
    IoRequest r = requests[i];
    const Decision d = decide(r);
    if (d.complete_with) {
      ready_.push_back({r.tag, -static_cast<std::int64_t>(d.complete_with)});
      continue;
    }
    if (d.pass_length) {
      r.length = d.pass_length;
      shorts_.push_back({r.tag, d.report});
    }
    if (r.op == IoOp::kWrite) write_tags_.push_back(r.tag);
    pass.push_back(r);
  }
  std::size_t sent = 0;
  while (sent < pass.size()) {
    auto taken = inner_->submit(pass.data() + sent, pass.size() - sent);
    if (!taken.ok()) return taken.status();
    if (*taken == 0) break;
    sent += *taken;
  }
  for (std::size_t i = sent; i < pass.size(); ++i) ready_.push_back({pass[i].tag, -EAGAIN});
  return take;
}

Result<std::size_t> FaultInjectingEngine::reap(IoCompletion* out, std::size_t max, std::size_t min_complete,
                                               std::chrono::nanoseconds timeout) {
  std::size_t got = 0;
  while (got < max && !ready_.empty()) {
    out[got++] = ready_.front();
    ready_.pop_front();
  }
  if (got >= max) return got;
  if (got > 0 && got >= min_complete) timeout = std::chrono::nanoseconds(0);
  const std::size_t want = got >= min_complete ? 0 : min_complete - got;
  if (inner_->in_flight() == 0 && got > 0) return got;
  auto more = inner_->reap(out + got, max - got, want, timeout);
  if (!more.ok()) return more.status();
  for (std::size_t i = got; i < got + *more; ++i) {
    IoCompletion& c = out[i];
    auto s = std::find_if(shorts_.begin(), shorts_.end(), [&](const ShortInfo& x) { return x.tag == c.tag; });
    if (s != shorts_.end()) {
      if (c.result > static_cast<std::int64_t>(s->report)) c.result = s->report;
      shorts_.erase(s);
    }
    auto w = std::find(write_tags_.begin(), write_tags_.end(), c.tag);
    if (w != write_tags_.end()) {
      if (c.result > 0) {
        std::lock_guard<std::mutex> lk(mu_);
        counters_.bytes_written += static_cast<std::uint64_t>(c.result);
      }
      write_tags_.erase(w);
    }
  }
  return got + *more;
}

Status FaultInjectingEngine::cancel(std::uint64_t tag) {
  for (const auto& c : ready_) {
    if (c.tag == tag) return Status::Ok();
  }
  return inner_->cancel(tag);
}

}  // namespace tier::nvme
