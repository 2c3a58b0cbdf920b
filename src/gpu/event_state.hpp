// The shared state behind a DeviceEvent: a once-only completion with a status, waiters and
// callbacks, plus the implementation's native event (a cudaEvent_t on CUDA).
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tier/ext/device_event.hpp"
#include "tier/status.hpp"

namespace tier::detail {

// Who made an event's native handle, i.e. who can order GPU work on it.
enum class EventDomain : std::uint8_t { kHost = 0, kCuda = 1 };

struct EventState {
  EventState() = default;
  EventState(const EventState&) = delete;
  EventState& operator=(const EventState&) = delete;
  ~EventState();

  // Completes the event: stores `s`, wakes waiters and runs the callbacks on this thread, in the
  // order they were added. Only the first call counts; it returns false for later ones.
  bool complete(Status s);

  // A new incomplete event, or one already complete with `s`.
  static std::shared_ptr<EventState> pending(EventDomain domain = EventDomain::kHost);
  static std::shared_ptr<EventState> done_with(Status s);

  mutable std::mutex mu;
  std::condition_variable cv;
  bool done = false;  // guarded by mu
  Status status;      // guarded by mu; final once done
  std::vector<DeviceEvent::Callback> callbacks;
  std::atomic<bool> ready{false};  // mirrors done for lock-free polling

  EventDomain domain = EventDomain::kHost;
  void* native = nullptr;                            // e.g. cudaEvent_t; owned
  void (*destroy_native)(void*) noexcept = nullptr;  // frees `native` with the state
};

// Runs one callback; an exception escaping it is logged and swallowed (no exception leaves tier).
void run_event_callback(const DeviceEvent::Callback& fn, const Status& s) noexcept;
// Runs a host function queued in a stream's order (Device::enqueue_host); an exception escaping it
// is logged, naming `where`, and swallowed.
void run_host_function(const std::function<void()>& fn, const std::string& where) noexcept;

}  // namespace tier::detail
