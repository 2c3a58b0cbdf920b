#include "gpu/emulated_stream.hpp"

#include <algorithm>
#include <cstring>

#include "gpu/event_state.hpp"
#include "tier/units.hpp"

namespace tier::detail {

EmulatedStream::EmulatedStream(std::string name, Link link, std::uint64_t bytes_per_second, double latency_us,
                               Counters* counters)
    : name_(std::move(name)),
      link_(link),
      rate_(bytes_per_second),
      latency_(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::micro>(latency_us))),
      counters_(counters),
      worker_([this](Task& t) { execute(t); }) {}

DeviceEvent EmulatedStream::submit(void* dst, const void* src, std::uint64_t bytes,
                                   const std::vector<DeviceEvent>& after) {
  Task t;
  t.dst = dst;
  t.src = src;
  t.bytes = bytes;
  t.after = after;
  t.state = EventState::pending(EventDomain::kHost);
  DeviceEvent ev(t.state);
  worker_.push(std::move(t), [&](Task& q, bool idle) {
    q.submitted = Clock::now();
    if (counters_ && q.after.empty() && idle) {
      q.transfer = counters_->begin(link_);
      q.transfer_begun = true;
    }
  });
  return ev;
}

void EmulatedStream::execute(Task& t) {
  // Dependencies first, as a GPU stream waiting on events would; a failed one cancels the copy so
  // that stale bytes are never passed on as if they were the data it was meant to carry.
  Clock::time_point deps_done{};
  for (const auto& e : t.after) {
    const bool was_ready = e.ready();
    Status s = e.wait();
    if (!was_ready) deps_done = Clock::now();
    if (!s.ok()) {
      t.state->complete(cancelled(str(name_, ": copy of ", format_bytes(t.bytes),
                                      " not performed: it was ordered after an event that failed: ", s.to_string())));
      return;
    }
  }
  Counters::Transfer transfer = std::move(t.transfer);
  if (counters_ && !t.transfer_begun) transfer = counters_->begin(link_);
  if (rate_ == 0 && latency_ == Clock::duration::zero()) {
    std::memcpy(t.dst, t.src, t.bytes);
  } else {
    paced_copy(t, std::max({t.submitted, timeline_, deps_done}));
  }
  transfer.finish(t.bytes, true);
  t.state->complete(Status());
}

void EmulatedStream::paced_copy(const Task& t, Clock::time_point start) {
  auto* dst = static_cast<std::byte*>(t.dst);
  const auto* src = static_cast<const std::byte*>(t.src);
  const Clock::time_point data_start = start + latency_;
  auto at = [&](std::uint64_t done) {
    if (rate_ == 0) return data_start;
    return data_start + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(static_cast<double>(done) / static_cast<double>(rate_)));
  };
  // About a millisecond of link time per chunk: fine enough pacing, few wake-ups.
  const std::uint64_t chunk =
      rate_ == 0 ? t.bytes : std::clamp<std::uint64_t>(rate_ / 1000, std::uint64_t{64} << 10, std::uint64_t{16} << 20);
  std::uint64_t done = 0;
  while (done < t.bytes) {
    const std::uint64_t n = std::min(chunk, t.bytes - done);
    std::memcpy(dst + done, src + done, n);
    done += n;
    std::this_thread::sleep_until(at(done));
  }
  timeline_ = at(t.bytes);
}

EmulatedComputeStream::EmulatedComputeStream(std::string name)
    : name_(std::move(name)), worker_([this](Task& t) { execute(t); }) {}

void EmulatedComputeStream::wait(DeviceEvent event) {
  Task t;
  t.after = std::move(event);
  worker_.push(std::move(t));
}

DeviceEvent EmulatedComputeStream::record() {
  Task t;
  t.marker = EventState::pending(EventDomain::kHost);
  DeviceEvent ev(t.marker);
  worker_.push(std::move(t));
  return ev;
}

void EmulatedComputeStream::enqueue(std::function<void()> fn) {
  Task t;
  t.fn = std::move(fn);
  worker_.push(std::move(t));
}

void EmulatedComputeStream::execute(Task& t) {
  if (t.after.valid()) {
    Status s = t.after.wait();
    if (!s.ok() && sticky_.ok()) {
      sticky_ = cancelled(str(name_, ": the stream waited for an event that failed: ", s.to_string()));
    }
  }
  if (t.fn) run_host_function(t.fn, name_);
  if (t.marker) t.marker->complete(sticky_);
}

}  // namespace tier::detail
