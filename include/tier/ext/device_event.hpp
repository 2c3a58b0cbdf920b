// tier/ext/device_event.hpp — DeviceEvent: the completion of work a Device was given (a copy, or a
// point recorded on a compute stream), as a small shared handle.
//
// An event behaves like a CUDA event with a host-side future attached: it completes once, with a
// Status; ready() says whether it has, wait() blocks until it has, and on_complete() runs a
// callback exactly once when it does. Events from one copy stream complete in submission order.
// The engine's prefetch scheduler chains stages with callbacks (NVMe read done -> copy to device
// -> acquire ready) instead of parking a thread per transfer.
//
// Callbacks run on the device's worker thread that observed the completion (a copy worker on the
// emulated device, a completion thread on CUDA), or at once on the calling thread when the event
// is already complete. They must be short and must not block on events of the same device: a
// callback that waits holds up every later completion on that stream. They may submit new copies.
//
// Thread safety: a DeviceEvent is a copyable handle to shared state; every member may be called
// from any thread, on the same or on different copies of the handle.
// Extension interface (include/tier/ext/README.md): stable for backends, tests and tools; not
// the user API.
#pragma once

#include <chrono>
#include <functional>
#include <memory>

#include "tier/status.hpp"

namespace tier {

namespace detail {
struct EventState;
}  // namespace detail

class DeviceEvent {
 public:
  using Callback = std::function<void(const Status&)>;

  // An empty handle: valid() is false, ready() is false, wait() fails with kFailedPrecondition.
  // Copies return a real event; use completed() for "nothing to wait for".
  DeviceEvent() = default;
  // An event that is already complete with `status` (ok by default).
  static DeviceEvent completed(Status status = Status());

  bool valid() const noexcept { return state_ != nullptr; }
  // True once the work is complete (successfully or not). Never blocks.
  bool ready() const noexcept;
  // Blocks until the work is complete; returns its status (a device error, or kCancelled for a
  // copy that was not performed because an event it was ordered after failed).
  Status wait() const;
  // Like wait(), giving up after `timeout` with kTimedOut (the work goes on).
  Status wait_for(std::chrono::milliseconds timeout) const;
  // The final status once ready(); kFailedPrecondition before that.
  Status status() const;
  // Runs `fn(status)` exactly once when the event completes: on the device's worker thread, or
  // right here, before on_complete returns, when it is already complete. On an empty handle `fn`
  // runs at once with kFailedPrecondition.
  void on_complete(Callback fn) const;

  // For device implementations: the shared state (nullptr when empty).
  const std::shared_ptr<detail::EventState>& state() const noexcept { return state_; }
  explicit DeviceEvent(std::shared_ptr<detail::EventState> state) noexcept : state_(std::move(state)) {}

  friend bool operator==(const DeviceEvent& a, const DeviceEvent& b) noexcept { return a.state_ == b.state_; }
  friend bool operator!=(const DeviceEvent& a, const DeviceEvent& b) noexcept { return a.state_ != b.state_; }

 private:
  std::shared_ptr<detail::EventState> state_;
};

}  // namespace tier
