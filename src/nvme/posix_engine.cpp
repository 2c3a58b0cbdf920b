// The posix backend: a pool of threads running one pread/pwrite per request. It is what works on
// every file system (tmpfs, ramfs, FUSE) and the one to use with buffered files.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "nvme/backends.hpp"

namespace tier::nvme::detail {

namespace {

class PosixEngine final : public IoEngine {
 public:
  explicit PosixEngine(const IoEngineOptions& o) : qd_(o.queue_depth) {
    unsigned threads = o.posix_threads ? o.posix_threads : std::min(o.queue_depth, 8u);
    threads = std::max(1u, std::min(threads, qd_));
    for (unsigned i = 0; i < threads; ++i) pool_.emplace_back([this] { work(); });
  }

  ~PosixEngine() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : pool_) t.join();
  }

  IoEngineKind kind() const noexcept override { return IoEngineKind::kPosix; }
  std::uint32_t capabilities() const noexcept override { return kIoCapDirect | kIoCapBuffered; }
  unsigned queue_depth() const noexcept override { return qd_; }
  unsigned in_flight() const noexcept override { return in_flight_.load(); }

  Result<std::size_t> submit(const IoRequest* reqs, std::size_t n) override {
    const std::size_t take = std::min<std::size_t>(n, qd_ - in_flight_.load());
    bool refused = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (std::size_t i = 0; i < take; ++i) {
        IoRequest r = reqs[i];
        int err = check_request(r);
        r.fd = resolve_fd(r);
        if (!err && r.fd < 0) err = EBADF;
        if (err) {
          done_.push_back({r.tag, -err});
          refused = true;
        } else {
          queue_.push_back(r);
        }
      }
      in_flight_ += static_cast<unsigned>(take);
    }
    if (take == 1) {
      work_cv_.notify_one();
    } else if (take > 1) {
      work_cv_.notify_all();
    }
    if (refused) done_cv_.notify_all();
    count_submit(take, 0, take > 0 ? 1 : 0);
    return take;
  }

  Result<std::size_t> reap(IoCompletion* out, std::size_t max, std::size_t min_complete,
                           std::chrono::nanoseconds timeout) override {
    std::unique_lock<std::mutex> lk(mu_);
    auto enough = [&] { return done_.size() >= std::min(min_complete, max) || woken_; };
    if (timeout.count() < 0) {
      done_cv_.wait(lk, enough);
    } else {
      done_cv_.wait_for(lk, timeout, enough);
    }
    woken_ = false;
    std::size_t got = 0;
    while (got < max && !done_.empty()) {
      out[got++] = done_.front();
      done_.pop_front();
    }
    in_flight_ -= static_cast<unsigned>(got);
    return got;
  }

  Status cancel(std::uint64_t tag) override {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = queue_.begin(); it != queue_.end(); ++it) {
      if (it->tag == tag) {
        queue_.erase(it);
        done_.push_back({tag, -ECANCELED});
        done_cv_.notify_all();
        return Status::Ok();
      }
    }
    if (std::find(running_.begin(), running_.end(), tag) != running_.end()) return Status::Ok();
    for (const auto& c : done_) {
      if (c.tag == tag) return Status::Ok();
    }
    return not_found(str("posix engine: no request with tag ", tag, " in flight"));
  }

  void wake() noexcept override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      woken_ = true;
    }
    done_cv_.notify_all();
  }

 private:
  void work() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      work_cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping with nothing queued
      const IoRequest r = queue_.front();
      queue_.pop_front();
      if (stop_) {
        done_.push_back({r.tag, -ECANCELED});
        continue;
      }
      running_.push_back(r.tag);
      lk.unlock();
      const ssize_t ret = r.op == IoOp::kRead ? ::pread(r.fd, r.buffer, r.length, static_cast<off_t>(r.offset))
                                              : ::pwrite(r.fd, r.buffer, r.length, static_cast<off_t>(r.offset));
      const std::int64_t result = ret < 0 ? -static_cast<std::int64_t>(errno) : static_cast<std::int64_t>(ret);
      lk.lock();
      running_.erase(std::find(running_.begin(), running_.end(), r.tag));
      done_.push_back({r.tag, result});
      done_cv_.notify_all();
    }
  }

  const unsigned qd_;
  std::atomic<unsigned> in_flight_{0};
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<IoRequest> queue_;
  std::deque<IoCompletion> done_;
  std::vector<std::uint64_t> running_;
  bool woken_ = false;
  bool stop_ = false;
  std::vector<std::thread> pool_;
};

}  // namespace

Result<std::unique_ptr<IoEngine>> make_posix_engine(const IoEngineOptions& options) {
  return std::unique_ptr<IoEngine>(new PosixEngine(options));
}

}  // namespace tier::nvme::detail
