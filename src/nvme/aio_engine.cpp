// The libaio backend. Each request gets an iocb slot; completions are announced on an eventfd
// (io_set_eventfd), which wake() also writes to, so that reap() can wait for either with ppoll.
#include "nvme/backends.hpp"

#ifdef TIER_WITH_AIO

#include <libaio.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <vector>

namespace tier::nvme::detail {

namespace {

class AioEngine final : public IoEngine {
 public:
  static Result<std::unique_ptr<IoEngine>> create(const IoEngineOptions& o) {
    std::unique_ptr<AioEngine> e(new AioEngine());
    TIER_RETURN_IF_ERROR(e->init(o));
    return std::unique_ptr<IoEngine>(std::move(e));
  }

  ~AioEngine() override {
    if (ctx_ != nullptr) {
      // io_destroy cancels what it can and waits for the rest; reaping first keeps the count right.
      io_event events[64];
      while (kernel_in_flight_ > 0) {
        const int n = io_getevents(ctx_, 1, 64, events, nullptr);
        if (n < 0 && n != -EINTR) break;
        for (int i = 0; i < n; ++i) release(slot_of(events[i]));
      }
      io_destroy(ctx_);
    }
    if (efd_ >= 0) ::close(efd_);
  }

  IoEngineKind kind() const noexcept override { return IoEngineKind::kAio; }
  std::uint32_t capabilities() const noexcept override { return kIoCapDirect | kIoCapBatchSubmit; }
  unsigned queue_depth() const noexcept override { return qd_; }
  unsigned in_flight() const noexcept override { return kernel_in_flight_ + static_cast<unsigned>(ready_.size()); }

  Result<std::size_t> submit(const IoRequest* reqs, std::size_t n) override {
    const std::size_t take = std::min<std::size_t>(n, qd_ - in_flight());
    ptrs_.clear();
    for (std::size_t i = 0; i < take; ++i) {
      const IoRequest& r = reqs[i];
      int err = check_request(r);
      const int fd = resolve_fd(r);
      if (!err && fd < 0) err = EBADF;
      if (err) {
        ready_.push_back({r.tag, -err});
        continue;
      }
      const unsigned slot = free_.back();
      free_.pop_back();
      iocb& cb = iocbs_[slot];
      if (r.op == IoOp::kRead) {
        io_prep_pread(&cb, fd, r.buffer, r.length, static_cast<long long>(r.offset));
      } else {
        io_prep_pwrite(&cb, fd, r.buffer, r.length, static_cast<long long>(r.offset));
      }
      io_set_eventfd(&cb, efd_);
      cb.data = reinterpret_cast<void*>(static_cast<std::uintptr_t>(slot));
      tags_[slot] = r.tag;
      ptrs_.push_back(&cb);
    }
    std::size_t i = 0;
    int eintr = 0;
    std::uint64_t calls = 0;
    while (i < ptrs_.size()) {
      const int ret = io_submit(ctx_, static_cast<long>(ptrs_.size() - i), ptrs_.data() + i);
      ++calls;
      if (ret > 0) {
        for (std::size_t k = i; k < i + static_cast<std::size_t>(ret); ++k) busy_[slot_of(ptrs_[k])] = true;
        kernel_in_flight_ += static_cast<unsigned>(ret);
        i += static_cast<std::size_t>(ret);
      } else if (ret == -EINTR && ++eintr < 8) {
        continue;
      } else if (ret == 0 || ret == -EAGAIN || ret == -EINTR) {
        // The kernel is short of resources: the rest complete with -EAGAIN, which callers resubmit.
        for (; i < ptrs_.size(); ++i) {
          const unsigned slot = slot_of(ptrs_[i]);
          ready_.push_back({tags_[slot], -EAGAIN});
          release(slot);
        }
      } else {
        // The first remaining iocb was refused (bad descriptor, misaligned O_DIRECT, ...):
        // complete it with the error and go on with the others.
        const unsigned slot = slot_of(ptrs_[i]);
        ready_.push_back({tags_[slot], ret});
        release(slot);
        ++i;
      }
    }
    count_submit(take, 0, calls);
    return take;
  }

  Result<std::size_t> reap(IoCompletion* out, std::size_t max, std::size_t min_complete,
                           std::chrono::nanoseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::size_t got = 0;
    for (;;) {
      while (got < max && !ready_.empty()) {
        out[got++] = ready_.front();
        ready_.pop_front();
      }
      if (got < max && kernel_in_flight_ > 0) {
        timespec zero{0, 0};
        const long want = static_cast<long>(std::min<std::size_t>(max - got, events_.size()));
        const int n = io_getevents(ctx_, 0, want, events_.data(), &zero);
        if (n < 0 && n != -EINTR) return errno_status(n, "aio engine: io_getevents");
        for (int i = 0; i < n; ++i) {
          const unsigned slot = slot_of(events_[i]);
          out[got++] = {tags_[slot], static_cast<std::int64_t>(static_cast<long>(events_[i].res))};
          release(slot);
        }
      }
      if (got >= min_complete || got >= max || woken_.exchange(false)) return got;

      timespec ts{};
      timespec* tsp = nullptr;
      if (timeout.count() >= 0) {
        const auto left = deadline - std::chrono::steady_clock::now();
        if (left <= std::chrono::nanoseconds(0)) return got;
        const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
        ts.tv_sec = ns / 1'000'000'000;
        ts.tv_nsec = ns % 1'000'000'000;
        tsp = &ts;
      }
      pollfd pfd{efd_, POLLIN, 0};
      const int pr = ppoll(&pfd, 1, tsp, nullptr);
      if (pr < 0 && errno != EINTR) return errno_status(errno, "aio engine: waiting on the completion eventfd");
      std::uint64_t v;
      while (::read(efd_, &v, sizeof v) > 0) {
      }
    }
  }

  Status cancel(std::uint64_t tag) override {
    for (const auto& c : ready_) {
      if (c.tag == tag) return Status::Ok();
    }
    for (unsigned slot = 0; slot < qd_; ++slot) {
      if (!busy_[slot] || tags_[slot] != tag) continue;
      io_event ev{};
      if (io_cancel(ctx_, &iocbs_[slot], &ev) == 0) {
        ready_.push_back({tag, -ECANCELED});
        release(slot);
      }
      // Regular-file aio is rarely cancellable (-EINVAL/-EAGAIN): the request completes normally.
      return Status::Ok();
    }
    return not_found(str("aio engine: no request with tag ", tag, " in flight"));
  }

  void wake() noexcept override {
    woken_.store(true);
    const std::uint64_t one = 1;
    [[maybe_unused]] const ssize_t w = ::write(efd_, &one, sizeof one);
  }

 private:
  AioEngine() = default;

  Status init(const IoEngineOptions& o) {
    qd_ = o.queue_depth;
    const int ret = io_setup(static_cast<int>(qd_), &ctx_);
    if (ret < 0) {
      ctx_ = nullptr;
      if (ret == -EAGAIN) {
        return unsupported(str("libaio: io_setup(", qd_,
                               ") exceeds fs.aio-max-nr; raise it with "
                               "`sysctl fs.aio-max-nr=1048576` or lower aio.queue_depth"));
      }
      return unsupported(str("libaio: io_setup failed: ", std::strerror(-ret)));
    }
    efd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (efd_ < 0) return errno_status(errno, "aio engine: eventfd");
    iocbs_.resize(qd_);
    tags_.resize(qd_);
    busy_.assign(qd_, false);
    events_.resize(qd_);
    for (unsigned i = qd_; i-- > 0;) free_.push_back(i);
    return Status::Ok();
  }

  static unsigned slot_of(const iocb* cb) noexcept {
    return static_cast<unsigned>(reinterpret_cast<std::uintptr_t>(cb->data));
  }
  static unsigned slot_of(const io_event& ev) noexcept { return slot_of(ev.obj); }

  void release(unsigned slot) noexcept {
    if (busy_[slot]) --kernel_in_flight_;
    busy_[slot] = false;
    free_.push_back(slot);
  }

  io_context_t ctx_ = nullptr;
  int efd_ = -1;
  unsigned qd_ = 0;
  unsigned kernel_in_flight_ = 0;
  std::vector<iocb> iocbs_;
  std::vector<std::uint64_t> tags_;
  std::vector<bool> busy_;  // the kernel holds the slot's iocb
  std::vector<unsigned> free_;
  std::vector<iocb*> ptrs_;
  std::vector<io_event> events_;
  std::deque<IoCompletion> ready_;  // refused or cancelled requests not yet reaped
  std::atomic<bool> woken_{false};
};

}  // namespace

Result<std::unique_ptr<IoEngine>> make_aio_engine(const IoEngineOptions& options) {
  return AioEngine::create(options);
}

}  // namespace tier::nvme::detail

#else  // !TIER_WITH_AIO

namespace tier::nvme::detail {

Result<std::unique_ptr<IoEngine>> make_aio_engine(const IoEngineOptions&) {
  return unsupported("libaio: tier was built without it (TIER_WITH_AIO=OFF or libaio-dev missing)");
}

}  // namespace tier::nvme::detail

#endif
