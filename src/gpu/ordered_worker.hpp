// Internal: a worker thread that runs queued tasks one at a time, in order (the emulated
// device's streams, the CUDA device's event completion queues).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace tier::detail {

// A worker thread that runs queued tasks one at a time, in the order they were queued: the engine
// of each of the emulated device's streams and of the CUDA device's completion queues. The destructor runs what is
// queued, then stops.
template <class Task>
class OrderedWorker {
 public:
  explicit OrderedWorker(std::function<void(Task&)> execute)
      : execute_(std::move(execute)), worker_([this] { run(); }) {}
  ~OrderedWorker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    worker_.join();
  }
  OrderedWorker(const OrderedWorker&) = delete;
  OrderedWorker& operator=(const OrderedWorker&) = delete;

  // Queues `t`; `on_queue(t, idle)` runs first under the queue's lock, `idle` saying whether
  // every task queued before has completed.
  template <class F>
  void push(Task t, F&& on_queue) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      on_queue(t, completed_ == submitted_);
      queue_.push_back(std::move(t));
      ++submitted_;
    }
    work_cv_.notify_one();
  }
  void push(Task t) {
    push(std::move(t), [](Task&, bool) {});
  }
  // Waits until every task queued before the call has run. False, without waiting, from the
  // worker itself (which cannot wait for itself).
  bool drain() {
    if (std::this_thread::get_id() == worker_.get_id()) return false;
    std::unique_lock<std::mutex> lock(mu_);
    const std::uint64_t target = submitted_;
    idle_cv_.wait(lock, [&] { return completed_ >= target; });
    return true;
  }

 private:
  void run() {
    for (;;) {
      Task t;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and nothing left
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      execute_(t);
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++completed_;
      }
      idle_cv_.notify_all();
    }
  }

  const std::function<void(Task&)> execute_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable idle_cv_;
  std::deque<Task> queue_;
  std::uint64_t submitted_ = 0;
  std::uint64_t completed_ = 0;
  bool stop_ = false;
  std::thread worker_;  // last: started once the rest is built, joined before it goes
};

}  // namespace tier::detail
