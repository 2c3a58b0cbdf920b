// One copy stream of the emulated device: a worker thread that runs copies in submission order,
// optionally paced to a bandwidth and a per-copy latency.
//
// Pacing follows a model of a serial link rather than sleeping a fixed time per copy, so that
// back-to-back copies reach the configured rate however the worker is scheduled: a copy starts,
// in theory, at the latest of its submission, the theoretical end of the copy before it and the
// moment its dependencies completed; it ends latency + bytes / rate later. The worker copies in
// chunks of about a millisecond of link time and sleeps until each chunk's theoretical end, and
// completes the event at the copy's theoretical end. A worker that falls behind (descheduled)
// catches up at memcpy speed, so the long-run rate stays the configured one. A limit above what
// one core's memcpy moves cannot be reached.
//
// Thread safety: submit() and drain() may be called from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gpu/ordered_worker.hpp"
#include "tier/ext/device_event.hpp"
#include "tier/stats.hpp"
#include "tier/types.hpp"

namespace tier::detail {

struct EventState;

class EmulatedStream {
 public:
  // `bytes_per_second` 0: unlimited. `name` appears in messages ("emulated device h2d stream").
  EmulatedStream(std::string name, Link link, std::uint64_t bytes_per_second, double latency_us, Counters* counters);
  // Finishes the queued copies (and their callbacks), then stops the worker.
  ~EmulatedStream() = default;
  EmulatedStream(const EmulatedStream&) = delete;
  EmulatedStream& operator=(const EmulatedStream&) = delete;

  // Queues a copy of `bytes` from `src` to `dst` after the events in `after`; returns its event.
  DeviceEvent submit(void* dst, const void* src, std::uint64_t bytes, const std::vector<DeviceEvent>& after);
  // Waits until every copy submitted before the call has completed and its callbacks have run.
  // Returns false, without waiting, when called from this stream's own worker (a callback), which
  // cannot wait for itself.
  bool drain() { return worker_.drain(); }

 private:
  using Clock = std::chrono::steady_clock;
  struct Task {
    void* dst = nullptr;
    const void* src = nullptr;
    std::uint64_t bytes = 0;
    std::vector<DeviceEvent> after;
    std::shared_ptr<EventState> state;
    Clock::time_point submitted;
    // Begun at submission when the copy starts a busy period of the link (idle stream, no
    // dependencies): the link's busy time then starts where the pacing model starts the copy,
    // however late the worker wakes up.
    Counters::Transfer transfer;
    bool transfer_begun = false;
  };
  void execute(Task& t);
  void paced_copy(const Task& t, Clock::time_point start);

  const std::string name_;
  const Link link_;
  const std::uint64_t rate_;  // bytes per second, 0: unlimited
  const Clock::duration latency_;
  Counters* const counters_;

  Clock::time_point timeline_{};  // theoretical end of the last paced copy (worker only)
  OrderedWorker<Task> worker_;    // last: its thread uses the members above
};

// One compute stream of the emulated device in its delayed mode (tier.emulated.delayed_streams):
// a worker thread that runs the stream's work in the order it was queued, later than the caller
// queued it, as a GPU runs a stream's kernels. Work is a wait for an event (stream_wait), a point
// whose event completes when the worker reaches it (record_event), or a host function
// (enqueue_host). A waited event that failed makes the stream's later points complete with that
// failure (a sticky error, as a CUDA context keeps one), so nothing ordered after it passes as
// done.
//
// Thread safety: every member may be called from any thread.
class EmulatedComputeStream {
 public:
  explicit EmulatedComputeStream(std::string name);
  // Runs what is queued, then stops the worker.
  ~EmulatedComputeStream() = default;
  EmulatedComputeStream(const EmulatedComputeStream&) = delete;
  EmulatedComputeStream& operator=(const EmulatedComputeStream&) = delete;

  void wait(DeviceEvent event);
  DeviceEvent record();
  void enqueue(std::function<void()> fn);
  // Waits until the work queued before the call has run. False, without waiting, from the
  // stream's own worker.
  bool drain() { return worker_.drain(); }

 private:
  struct Task {
    DeviceEvent after;                   // wait for this (if valid)
    std::shared_ptr<EventState> marker;  // complete this (if set)
    std::function<void()> fn;            // run this (if set)
  };
  void execute(Task& t);

  const std::string name_;
  Status sticky_;               // worker only
  OrderedWorker<Task> worker_;  // last: its thread uses the members above
};

}  // namespace tier::detail
