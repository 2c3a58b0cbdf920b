#include "tier/ext/device_event.hpp"

#include <exception>

#include "gpu/event_state.hpp"
#include "tier/log.hpp"

namespace tier {

namespace detail {

EventState::~EventState() {
  if (native && destroy_native) destroy_native(native);
}

std::shared_ptr<EventState> EventState::pending(EventDomain d) {
  auto s = std::make_shared<EventState>();
  s->domain = d;
  return s;
}

std::shared_ptr<EventState> EventState::done_with(Status st) {
  auto s = std::make_shared<EventState>();
  s->done = true;
  s->status = std::move(st);
  s->ready.store(true, std::memory_order_release);
  return s;
}

bool EventState::complete(Status s) {
  std::vector<DeviceEvent::Callback> run;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (done) return false;
    done = true;
    status = std::move(s);
    ready.store(true, std::memory_order_release);
    run.swap(callbacks);
  }
  cv.notify_all();
  // `status` is final and only read from now on.
  for (const auto& fn : run) run_event_callback(fn, status);
  return true;
}

void run_event_callback(const DeviceEvent::Callback& fn, const Status& s) noexcept {
  try {
    fn(s);
  } catch (const std::exception& e) {
    TIER_LOG(kError, "device event callback threw (ignored): ", e.what());
  } catch (...) {
    TIER_LOG(kError, "device event callback threw a non-standard exception (ignored)");
  }
}

void run_host_function(const std::function<void()>& fn, const std::string& where) noexcept {
  try {
    fn();
  } catch (const std::exception& e) {
    TIER_LOG(kError, where, ": a host function threw (ignored): ", e.what());
  } catch (...) {
    TIER_LOG(kError, where, ": a host function threw a non-standard exception (ignored)");
  }
}

}  // namespace detail

namespace {
Status empty_event_status() {
  return failed_precondition(
      "an empty DeviceEvent (default-constructed, never returned by a device) has no work to "
      "wait for; use DeviceEvent::completed() for that");
}
}  // namespace

DeviceEvent DeviceEvent::completed(Status status) {
  return DeviceEvent(detail::EventState::done_with(std::move(status)));
}

bool DeviceEvent::ready() const noexcept {
  return state_ && state_->ready.load(std::memory_order_acquire);
}

Status DeviceEvent::wait() const {
  if (!state_) return empty_event_status();
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  return state_->status;
}

Status DeviceEvent::wait_for(std::chrono::milliseconds timeout) const {
  if (!state_) return empty_event_status();
  std::unique_lock<std::mutex> lock(state_->mu);
  if (!state_->cv.wait_for(lock, timeout, [&] { return state_->done; })) {
    return timed_out(str("device event not complete after ", timeout.count(), " ms"));
  }
  return state_->status;
}

Status DeviceEvent::status() const {
  if (!state_) return empty_event_status();
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!state_->done) return failed_precondition("device event not complete yet; wait() for it first");
  return state_->status;
}

void DeviceEvent::on_complete(Callback fn) const {
  if (!fn) return;
  if (!state_) {
    detail::run_event_callback(fn, empty_event_status());
    return;
  }
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->done) {
      state_->callbacks.push_back(std::move(fn));
      return;
    }
  }
  detail::run_event_callback(fn, state_->status);
}

}  // namespace tier
