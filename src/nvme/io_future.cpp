#include "tier/ext/io_future.hpp"

#include "nvme/io_op_state.hpp"

namespace tier::nvme {

namespace detail {

Status IoOpState::wait() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return done_.load(std::memory_order_relaxed); });
  return status_;
}

bool IoOpState::wait_for(std::chrono::nanoseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  return cv_.wait_for(lk, timeout, [&] { return done_.load(std::memory_order_relaxed); });
}

Status IoOpState::status() const {
  std::lock_guard<std::mutex> lk(mu_);
  if (!done_.load(std::memory_order_relaxed)) return failed_precondition("transfer still in flight");
  return status_;
}

void IoOpState::on_complete(std::function<void(const Status&)> fn) {
  if (!fn) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // Before completion, or while the completing thread still runs the callbacks added before this
    // one: queue it, so that callbacks run one at a time in the order added.
    if (!done_.load(std::memory_order_relaxed) || draining_) {
      callbacks_.push_back(std::move(fn));
      return;
    }
  }
  fn(status_);  // status_ no longer changes once done
}

void IoOpState::complete(Status status) {
  std::vector<std::function<void(const Status&)>> batch;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (done_.load(std::memory_order_relaxed)) return;
    status_ = std::move(status);
    batch.swap(callbacks_);
    draining_ = true;
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
  // Callbacks added meanwhile (by other threads, or by a callback) are run here too, after these.
  for (;;) {
    for (auto& fn : batch) fn(status_);
    batch.clear();
    std::lock_guard<std::mutex> lk(mu_);
    if (callbacks_.empty()) {
      draining_ = false;
      return;
    }
    batch.swap(callbacks_);
  }
}

}  // namespace detail

IoFuture IoFuture::completed(Status status, std::uint64_t bytes) {
  auto s = std::make_shared<detail::IoOpState>(bytes);
  s->complete(std::move(status));
  return IoFuture(std::move(s));
}

bool IoFuture::ready() const noexcept {
  return !state_ || state_->ready();
}

Status IoFuture::wait() const {
  if (!state_) return failed_precondition("wait() on an empty IoFuture");
  return state_->wait();
}

bool IoFuture::wait_for(std::chrono::nanoseconds timeout) const {
  return !state_ || state_->wait_for(timeout);
}

Status IoFuture::status() const {
  if (!state_) return failed_precondition("status() of an empty IoFuture");
  return state_->status();
}

void IoFuture::on_complete(std::function<void(const Status&)> fn) const {
  if (!state_) {
    if (fn) fn(failed_precondition("on_complete() on an empty IoFuture"));
    return;
  }
  state_->on_complete(std::move(fn));
}

void IoFuture::cancel() const noexcept {
  if (state_) state_->request_cancel();
}

std::uint64_t IoFuture::bytes() const noexcept {
  return state_ ? state_->bytes() : 0;
}

Status wait_all(const IoFuture* futures, std::size_t n) {
  Status first;
  for (std::size_t i = 0; i < n; ++i) {
    Status s = futures[i].wait();
    if (first.ok() && !s.ok()) first = std::move(s);
  }
  return first;
}

}  // namespace tier::nvme
