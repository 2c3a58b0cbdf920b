// The io_uring backend (liburing).
//
// One ring per engine, sized for the queue depth plus a few internal entries: a POLL_ADD on an
// eventfd that wake() writes to, and cancellations. Requests whose buffer lies inside the
// registered region use READ_FIXED/WRITE_FIXED with the index of the <= 1 GiB piece holding it,
// when that piece is registered (a region reserved with reserve_buffers() starts as a sparse table
// whose pieces are registered one by one as a lazy host arena commits them);
// files registered through register_file() live in a sparse kernel file table.
#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <fstream>
#include <vector>

#include "nvme/backends.hpp"
#include "tier/log.hpp"
#include "tier/units.hpp"

namespace tier::nvme::detail {

namespace {

constexpr std::uint64_t kWakeTag = kFirstReservedTag;
constexpr std::uint64_t kCancelTag = kFirstReservedTag + 1;
constexpr unsigned kFileSlots = 64;
constexpr unsigned kSpareEntries = 8;

std::string uring_sysctl_hint() {
  std::ifstream f("/proc/sys/kernel/io_uring_disabled");
  int v = 0;
  if (f >> v && v != 0) return str(" (kernel.io_uring_disabled=", v, ")");
  return {};
}

class UringEngine final : public IoEngine {
 public:
  static Result<std::unique_ptr<IoEngine>> create(const IoEngineOptions& o) {
    std::unique_ptr<UringEngine> e(new UringEngine());
    TIER_RETURN_IF_ERROR(e->init(o));
    return std::unique_ptr<IoEngine>(std::move(e));
  }

  ~UringEngine() override {
    if (!ring_ok_) return;
    drain();
    io_uring_queue_exit(&ring_);
    if (efd_ >= 0) ::close(efd_);
  }

  IoEngineKind kind() const noexcept override { return IoEngineKind::kUring; }
  std::uint32_t capabilities() const noexcept override {
    std::uint32_t c = kIoCapDirect | kIoCapBuffered | kIoCapBatchSubmit | kIoCapCancelInFlight;
    if (sparse_files_) c |= kIoCapRegisteredFiles;
    if (fixed_base_) c |= kIoCapFixedBuffers;
    if (sqpoll_) c |= kIoCapSqPoll;
    return c;
  }
  unsigned queue_depth() const noexcept override { return qd_; }
  unsigned in_flight() const noexcept override { return in_flight_; }

  Result<int> register_file(int fd) override {
    TIER_ASSIGN_OR_RETURN(int slot, IoEngine::register_file(fd));
    if (sparse_files_) {
      if (slot >= static_cast<int>(kFileSlots)) {
        release_file_slot(slot);
        return resource_exhausted(str("io_uring engine: all ", kFileSlots, " registered file slots are in use"));
      }
      const int ret = io_uring_register_files_update(&ring_, static_cast<unsigned>(slot), &fd, 1);
      if (ret < 0) {
        release_file_slot(slot);
        return errno_status(ret, str("io_uring engine: registering file descriptor ", fd));
      }
    }
    return slot;
  }

  Status unregister_file(int index) override {
    TIER_RETURN_IF_ERROR(IoEngine::unregister_file(index));
    if (sparse_files_) {
      int none = -1;
      const int ret = io_uring_register_files_update(&ring_, static_cast<unsigned>(index), &none, 1);
      if (ret < 0) return errno_status(ret, str("io_uring engine: unregistering file slot ", index));
    }
    return Status::Ok();
  }

  Status register_buffers(void* base, std::uint64_t bytes) override {
    if (base == nullptr || bytes == 0) return invalid_argument("io_uring engine: register_buffers of an empty region");
    unregister_buffers();
    std::vector<iovec> iovs = pieces_of(base, bytes);
    const int ret = io_uring_register_buffers(&ring_, iovs.data(), static_cast<unsigned>(iovs.size()));
    if (ret < 0) {
      return errno_status(ret,
                          str("io_uring engine: registering ", format_bytes(bytes), " as fixed buffers (", iovs.size(),
                              " pieces); raise RLIMIT_MEMLOCK (ulimit -l) or set "
                              "tier.io.fixed_buffers=false"));
    }
    fixed_base_ = static_cast<std::byte*>(base);
    fixed_bytes_ = bytes;
    piece_registered_.assign(iovs.size(), true);
    registered_bytes_.store(bytes, std::memory_order_relaxed);
    return Status::Ok();
  }

  Status reserve_buffers(void* base, std::uint64_t bytes) override {
    if (base == nullptr || bytes == 0) return invalid_argument("io_uring engine: reserve_buffers of an empty region");
    unregister_buffers();
    const auto pieces = static_cast<unsigned>((bytes + piece_ - 1) / piece_);
    const int ret = io_uring_register_buffers_sparse(&ring_, pieces);
    if (ret < 0) {
      return errno_status(ret, str("io_uring engine: a sparse table of ", pieces,
                                   " fixed buffers (needs Linux 5.19 or later); set tier.io.fixed_buffers=false"));
    }
    fixed_base_ = static_cast<std::byte*>(base);
    fixed_bytes_ = bytes;
    piece_registered_.assign(pieces, false);
    registered_bytes_.store(0, std::memory_order_relaxed);
    return Status::Ok();
  }

  Status register_buffer_range(void* p, std::uint64_t bytes) override {
    if (!fixed_base_) return failed_precondition("io_uring engine: register_buffer_range before reserve_buffers");
    const auto* b = static_cast<const std::byte*>(p);
    if (b < fixed_base_ || bytes > fixed_bytes_ || b + bytes > fixed_base_ + fixed_bytes_) {
      return invalid_argument(
          str("io_uring engine: range ", p, " + ", format_bytes(bytes), " is outside the reserved buffer region"));
    }
    const std::uint64_t lo = static_cast<std::uint64_t>(b - fixed_base_);
    const std::uint64_t hi = lo + bytes;
    std::uint64_t added = 0;
    for (std::uint64_t i = (lo + piece_ - 1) / piece_; i < piece_registered_.size(); ++i) {
      const std::uint64_t begin = i * piece_;
      const std::uint64_t len = std::min(piece_, fixed_bytes_ - begin);
      if (begin + len > hi) break;
      if (piece_registered_[i]) continue;
      iovec iov{fixed_base_ + begin, static_cast<std::size_t>(len)};
      const int ret = io_uring_register_buffers_update_tag(&ring_, static_cast<unsigned>(i), &iov, nullptr, 1);
      if (ret < 0) {
        return errno_status(ret, str("io_uring engine: registering ", format_bytes(len), " at ",
                                     static_cast<void*>(fixed_base_ + begin),
                                     " as a fixed buffer; raise RLIMIT_MEMLOCK (ulimit -l) or set "
                                     "tier.io.fixed_buffers=false"));
      }
      piece_registered_[i] = true;
      added += len;
    }
    registered_bytes_.fetch_add(added, std::memory_order_relaxed);
    return Status::Ok();
  }

  std::uint64_t registered_buffer_bytes() const noexcept override {
    return registered_bytes_.load(std::memory_order_relaxed);
  }

  void unregister_buffers() noexcept override {
    if (!fixed_base_) return;
    io_uring_unregister_buffers(&ring_);
    fixed_base_ = nullptr;
    fixed_bytes_ = 0;
    piece_registered_.clear();
    registered_bytes_.store(0, std::memory_order_relaxed);
  }

  Result<std::size_t> submit(const IoRequest* reqs, std::size_t n) override {
    const std::size_t take = std::min<std::size_t>(n, qd_ - in_flight_);
    std::uint64_t fixed = 0;
    for (std::size_t i = 0; i < take; ++i) {
      const IoRequest& r = reqs[i];
      ++in_flight_;
      int err = check_request(r);
      if (!err && r.file_index >= 0 && resolve_fd(r) < 0) err = EBADF;
      if (err) {
        ready_.push_back({r.tag, -err});
        continue;
      }
      io_uring_sqe* sqe = get_sqe();
      if (sqe == nullptr) {
        --in_flight_;
        return internal_error("io_uring engine: submission queue full below the queue depth");
      }
      const int fd = r.file_index >= 0 && sparse_files_ ? r.file_index : resolve_fd(r);
      const int piece = fixed_piece(r);
      if (piece >= 0) {
        ++fixed;
        if (r.op == IoOp::kRead) {
          io_uring_prep_read_fixed(sqe, fd, r.buffer, r.length, r.offset, piece);
        } else {
          io_uring_prep_write_fixed(sqe, fd, r.buffer, r.length, r.offset, piece);
        }
      } else if (r.op == IoOp::kRead) {
        io_uring_prep_read(sqe, fd, r.buffer, r.length, r.offset);
      } else {
        io_uring_prep_write(sqe, fd, r.buffer, r.length, r.offset);
      }
      if (r.file_index >= 0 && sparse_files_) sqe->flags |= IOSQE_FIXED_FILE;
      io_uring_sqe_set_data64(sqe, r.tag);
    }
    TIER_RETURN_IF_ERROR(flush_sq());
    count_submit(take, fixed, take > 0 ? 1 : 0);
    return take;
  }

  Result<std::size_t> reap(IoCompletion* out, std::size_t max, std::size_t min_complete,
                           std::chrono::nanoseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::size_t got = 0;
    bool woken = false;
    for (;;) {
      while (got < max && !ready_.empty()) {
        out[got++] = ready_.front();
        ready_.pop_front();
        --in_flight_;
      }
      io_uring_cqe* cqe = nullptr;
      while (got < max && io_uring_peek_cqe(&ring_, &cqe) == 0) {
        const std::uint64_t tag = io_uring_cqe_get_data64(cqe);
        if (tag == kWakeTag) {
          wake_armed_ = false;
          std::uint64_t v;
          while (::read(efd_, &v, sizeof v) > 0) {
          }
          woken = true;
        } else if (tag == kCancelTag) {
          // The cancelled request reports -ECANCELED itself.
        } else {
          out[got++] = {tag, cqe->res};
          --in_flight_;
        }
        io_uring_cqe_seen(&ring_, cqe);
      }
      if (!wake_armed_) TIER_RETURN_IF_ERROR(arm_wake());
      if (got >= min_complete || got >= max || woken) return got;
      if (io_uring_sq_ready(&ring_) > 0) TIER_RETURN_IF_ERROR(flush_sq());

      __kernel_timespec ts{};
      __kernel_timespec* tsp = nullptr;
      if (timeout.count() >= 0) {
        const auto left = deadline - std::chrono::steady_clock::now();
        if (left <= std::chrono::nanoseconds(0)) return got;
        const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
        ts.tv_sec = ns / 1'000'000'000;
        ts.tv_nsec = ns % 1'000'000'000;
        tsp = &ts;
      }
      const int ret = io_uring_wait_cqe_timeout(&ring_, &cqe, tsp);
      if (ret == -ETIME) return got;
      if (ret < 0 && ret != -EINTR && ret != -EAGAIN)
        return errno_status(ret, "io_uring engine: waiting for completions");
    }
  }

  Status cancel(std::uint64_t tag) override {
    for (const auto& c : ready_) {
      if (c.tag == tag) return Status::Ok();  // already complete, about to be reaped
    }
    if (in_flight_ == ready_.size()) return not_found(str("io_uring engine: no request with tag ", tag, " in flight"));
    io_uring_sqe* sqe = get_sqe();
    if (sqe == nullptr) return resource_exhausted("io_uring engine: no submission entry free for a cancel");
    io_uring_prep_cancel64(sqe, tag, 0);
    io_uring_sqe_set_data64(sqe, kCancelTag);
    return flush_sq();
  }

  void wake() noexcept override {
    const std::uint64_t one = 1;
    [[maybe_unused]] const ssize_t w = ::write(efd_, &one, sizeof one);
  }

 private:
  UringEngine() = default;

  Status init(const IoEngineOptions& o) {
    qd_ = o.queue_depth;
    if (o.fixed_buffer_piece == 0 || o.fixed_buffer_piece % 4096 != 0 || o.fixed_buffer_piece > kMaxFixedBufferPiece) {
      return invalid_argument(
          str("io_uring engine: fixed buffer piece ", o.fixed_buffer_piece, " must be a multiple of 4096 up to 1 GiB"));
    }
    piece_ = o.fixed_buffer_piece;
    io_uring_params p{};
    if (o.sqpoll) {
      p.flags |= IORING_SETUP_SQPOLL;
      p.sq_thread_idle = o.sqpoll_idle_ms;
    }
    const int ret = io_uring_queue_init_params(qd_ + kSpareEntries, &ring_, &p);
    if (ret < 0) {
      if (o.sqpoll && (ret == -EPERM || ret == -EINVAL)) {
        return errno_status(ret, "io_uring with SQPOLL could not be set up; set tier.io.sqpoll=false");
      }
      return unsupported(str("io_uring_setup failed: ", std::strerror(-ret), uring_sysctl_hint()));
    }
    ring_ok_ = true;
    sqpoll_ = o.sqpoll;

    io_uring_probe* probe = io_uring_get_probe_ring(&ring_);
    if (probe == nullptr) return unsupported("io_uring: the kernel cannot report its opcodes (older than 5.6)");
    bool ok = true;
    for (int op : {IORING_OP_READ, IORING_OP_WRITE, IORING_OP_READ_FIXED, IORING_OP_WRITE_FIXED, IORING_OP_POLL_ADD,
                   IORING_OP_ASYNC_CANCEL}) {
      ok = ok && io_uring_opcode_supported(probe, op);
    }
    io_uring_free_probe(probe);
    if (!ok) return unsupported("io_uring: the kernel lacks IORING_OP_READ/WRITE (needs Linux 5.6 or later)");

    sparse_files_ = io_uring_register_files_sparse(&ring_, kFileSlots) == 0;
    efd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (efd_ < 0) return errno_status(errno, "io_uring engine: eventfd");
    return arm_wake();
  }

  io_uring_sqe* get_sqe() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    for (int tries = 0; sqe == nullptr && tries < 1000; ++tries) {
      // Only with SQPOLL can the queue hold entries the kernel has not consumed yet.
      if (sqpoll_) {
        io_uring_sqring_wait(&ring_);
      } else if (io_uring_submit(&ring_) < 0) {
        break;
      }
      sqe = io_uring_get_sqe(&ring_);
    }
    return sqe;
  }

  Status arm_wake() {
    io_uring_sqe* sqe = get_sqe();
    if (sqe == nullptr) return internal_error("io_uring engine: no submission entry for the wake-up poll");
    io_uring_prep_poll_add(sqe, efd_, POLLIN);
    io_uring_sqe_set_data64(sqe, kWakeTag);
    wake_armed_ = true;
    return flush_sq();
  }

  Status flush_sq() {
    for (int tries = 0;; ++tries) {
      const int ret = io_uring_submit(&ring_);
      if (ret >= 0) return Status::Ok();
      // EAGAIN/EBUSY: the kernel is short of resources or the completion queue overflowed; the
      // entries stay queued and go with the next submit.
      if (ret == -EAGAIN || ret == -EBUSY || ret == -EINTR) {
        if (tries < 3) continue;
        return Status::Ok();
      }
      return errno_status(ret, "io_uring engine: io_uring_submit");
    }
  }

  std::vector<iovec> pieces_of(void* base, std::uint64_t bytes) const {
    std::vector<iovec> iovs;
    for (std::uint64_t off = 0; off < bytes; off += piece_) {
      iovs.push_back({static_cast<std::byte*>(base) + off, static_cast<std::size_t>(std::min(piece_, bytes - off))});
    }
    return iovs;
  }

  // Index of the registered piece that holds the whole request, or -1.
  int fixed_piece(const IoRequest& r) const noexcept {
    if (!fixed_base_) return -1;
    const auto* b = static_cast<const std::byte*>(r.buffer);
    if (b < fixed_base_ || b + r.length > fixed_base_ + fixed_bytes_) return -1;
    const std::uint64_t first = static_cast<std::uint64_t>(b - fixed_base_) / piece_;
    const std::uint64_t last = static_cast<std::uint64_t>(b + r.length - 1 - fixed_base_) / piece_;
    return first == last && piece_registered_[first] ? static_cast<int>(first) : -1;
  }

  // Cancels whatever is in flight and reaps it, so that no buffer is touched after destruction.
  void drain() noexcept {
    if (in_flight_ > ready_.size()) {
      if (io_uring_sqe* sqe = get_sqe()) {
        io_uring_prep_cancel64(sqe, 0, IORING_ASYNC_CANCEL_ANY | IORING_ASYNC_CANCEL_ALL);
        io_uring_sqe_set_data64(sqe, kCancelTag);
        io_uring_submit(&ring_);
      }
    }
    IoCompletion sink[64];
    while (in_flight_ > 0) {
      auto r = reap(sink, 64, 1, std::chrono::seconds(1));
      if (!r.ok()) break;
    }
  }

  io_uring ring_{};
  bool ring_ok_ = false;
  bool sqpoll_ = false;
  bool sparse_files_ = false;
  unsigned qd_ = 0;
  unsigned in_flight_ = 0;  // user requests submitted and not reaped, including ready_
  int efd_ = -1;
  bool wake_armed_ = false;
  std::byte* fixed_base_ = nullptr;
  std::uint64_t fixed_bytes_ = 0;
  std::vector<bool> piece_registered_;  // per piece of the region: registered with the kernel
  std::atomic<std::uint64_t> registered_bytes_{0};
  std::uint64_t piece_ = kMaxFixedBufferPiece;
  std::deque<IoCompletion> ready_;  // requests refused before reaching the kernel
};

}  // namespace

Result<std::unique_ptr<IoEngine>> make_uring_engine(const IoEngineOptions& options) {
  return UringEngine::create(options);
}

}  // namespace tier::nvme::detail
