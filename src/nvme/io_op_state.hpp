// The shared state behind an IoFuture: the final status, waiters and completion callbacks.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <vector>

#include "tier/ext/io_future.hpp"

namespace tier::nvme::detail {

class IoOpState {
 public:
  explicit IoOpState(std::uint64_t bytes) : bytes_(bytes) {}

  bool ready() const noexcept { return done_.load(std::memory_order_acquire); }
  Status wait();
  bool wait_for(std::chrono::nanoseconds timeout);
  Status status() const;
  void on_complete(std::function<void(const Status&)> fn);
  // Sets the final status and runs the callbacks, on the calling thread, in the order added: also
  // those added (from any thread, or from a callback) before the last of them has returned.
  // Only the first call counts.
  void complete(Status status);

  void request_cancel() noexcept { cancel_.store(true, std::memory_order_release); }
  bool cancel_requested() const noexcept { return cancel_.load(std::memory_order_acquire); }
  std::uint64_t bytes() const noexcept { return bytes_; }

 private:
  const std::uint64_t bytes_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  std::atomic<bool> cancel_{false};
  Status status_;
  std::vector<std::function<void(const Status&)>> callbacks_;
  bool draining_ = false;  // complete() is still running callbacks (guarded by mu_)
};

}  // namespace tier::nvme::detail
