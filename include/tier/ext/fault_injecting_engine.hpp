// tier/ext/fault_injecting_engine.hpp — an IoEngine decorator that makes chosen requests fail, come
// back short or ask to be retried, so that the error paths of everything above the engine (the
// swap space, the engine's residency logic) can be driven on purpose in tests.
//
// Requests are numbered from 1 in submission order as they pass through the decorator (a
// resubmission is a new request with a new number). A fault matches requests by number, by
// operation and, optionally, by file descriptor; a matching request is then:
//  - kError: completed with -err without reaching the wrapped engine, so a failed write changes
//    nothing on disk (EIO, ENOSPC, ...);
//  - kTransient: completed with -err (EAGAIN by default, or EINTR) without reaching the wrapped
//    engine; the caller is expected to submit it again;
//  - kShort: passed down with its length cut, so fewer bytes really move, and completed with the
//    short count. On an O_DIRECT file the cut length is rounded up to 4 KiB for the kernel while
//    the reported count is exactly `short_bytes`, as a kernel may report.
// Byte budgets model a disk filling up: once `fail_writes_after_bytes` bytes were written, every
// further write completes with the given errno (ENOSPC).
//
// Thread safety: as for IoEngine (one driving thread; wake() from anywhere). Faults may be added,
// cleared and counted from any thread while the engine runs.
// Extension interface (include/tier/ext/README.md): stable for backends, tests and tools; not
// the user API.
#pragma once

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "tier/ext/io_engine.hpp"

namespace tier::nvme {

enum class FaultKind : std::uint8_t { kError = 0, kTransient, kShort };

struct FaultSpec {
  FaultKind kind = FaultKind::kError;
  // The first matching request to hit (1 = the next one that matches, counted from when the fault
  // is added) and how many consecutive matching requests after it are hit too.
  std::uint64_t nth = 1;
  std::uint64_t count = 1;
  std::optional<IoOp> op;  // only reads or only writes; empty: both
  int fd = -1;             // only requests on this descriptor (slots are resolved); -1: any
  int err = EIO;           // kError / kTransient: the errno to complete with
  // kShort: bytes reported; 0 picks half the length rounded down to 4 KiB (at least 4 KiB; a
  // request of 4 KiB or less is passed through whole).
  std::uint32_t short_bytes = 0;
};

struct FaultCounters {
  std::uint64_t requests = 0;  // requests seen
  std::uint64_t errors = 0;    // kError faults and byte-budget failures applied
  std::uint64_t transients = 0;
  std::uint64_t shorts = 0;
  std::uint64_t bytes_written = 0;  // bytes the wrapped engine reported written
};

class FaultInjectingEngine final : public IoEngine {
 public:
  explicit FaultInjectingEngine(std::unique_ptr<IoEngine> inner);
  ~FaultInjectingEngine() override;

  // Adds a fault; faults are checked in the order added and the first match applies.
  void add_fault(const FaultSpec& spec);
  // Shorthands.
  void fail_nth(std::uint64_t nth, int err = EIO, std::optional<IoOp> op = std::nullopt);
  void short_nth(std::uint64_t nth, std::uint32_t short_bytes = 0, std::optional<IoOp> op = std::nullopt);
  void transient_nth(std::uint64_t nth, std::uint64_t times = 1, int err = EAGAIN,
                     std::optional<IoOp> op = std::nullopt);
  // Writes fail with -err once `bytes` more bytes were written through this engine.
  void fail_writes_after_bytes(std::uint64_t bytes, int err = ENOSPC);
  void clear_faults();
  FaultCounters counters() const;

  IoEngine& inner() noexcept { return *inner_; }

  IoEngineKind kind() const noexcept override { return inner_->kind(); }
  std::uint32_t capabilities() const noexcept override { return inner_->capabilities(); }
  unsigned queue_depth() const noexcept override { return inner_->queue_depth(); }
  unsigned in_flight() const noexcept override;
  Result<int> register_file(int fd) override;
  Status unregister_file(int index) override;
  Status register_buffers(void* base, std::uint64_t bytes) override;
  void unregister_buffers() noexcept override { inner_->unregister_buffers(); }
  Status reserve_buffers(void* base, std::uint64_t bytes) override { return inner_->reserve_buffers(base, bytes); }
  Status register_buffer_range(void* p, std::uint64_t bytes) override {
    return inner_->register_buffer_range(p, bytes);
  }
  std::uint64_t registered_buffer_bytes() const noexcept override { return inner_->registered_buffer_bytes(); }
  Result<std::size_t> submit(const IoRequest* requests, std::size_t n) override;
  Result<std::size_t> reap(IoCompletion* out, std::size_t max, std::size_t min_complete,
                           std::chrono::nanoseconds timeout) override;
  Status cancel(std::uint64_t tag) override;
  void wake() noexcept override { inner_->wake(); }
  IoEngineStats stats() const noexcept override { return inner_->stats(); }

 private:
  struct Active {
    FaultSpec spec;
    std::uint64_t seen = 0;  // matching requests so far
  };
  struct ShortInfo {
    std::uint64_t tag;
    std::uint32_t report;  // bytes to report at most
  };
  // What to do with one request, decided under mu_.
  struct Decision {
    int complete_with = 0;  // > 0: complete at once with -complete_with
    bool transient = false;
    std::uint32_t pass_length = 0;  // 0: pass unchanged
    std::uint32_t report = 0;
  };
  Decision decide(const IoRequest& r);

  std::unique_ptr<IoEngine> inner_;
  mutable std::mutex mu_;
  std::vector<Active> faults_;
  bool budget_set_ = false;
  std::uint64_t budget_left_ = 0;
  int budget_err_ = ENOSPC;
  FaultCounters counters_;
  std::vector<int> slot_fds_;  // slot -> descriptor, mirrored from register_file()

  // Driving-thread state.
  std::deque<IoCompletion> ready_;         // injected completions not yet reaped
  std::vector<ShortInfo> shorts_;          // requests passed down shortened
  std::vector<std::uint64_t> write_tags_;  // writes in flight (for the byte budget)
};

}  // namespace tier::nvme
