// tier/ext/io_engine.hpp — the NVMe tier's I/O engine: submit batches of file reads and writes, reap
// one completion per request.
//
// Three backends sit behind one small interface:
//  - io_uring (liburing): batched submission, registered files, fixed (registered) buffers for
//    requests whose buffer lies in the registered region (the pinned host arena), optional SQPOLL;
//  - libaio: batched io_submit, completions signalled through an eventfd;
//  - posix: a pool of threads running pread/pwrite, for file systems without O_DIRECT (tmpfs,
//    ramfs) and for buffered files.
// `IoEngineKind::kAuto` probes io_uring first, then libaio, then posix; the fallback is logged once
// and the engine reports what it is (kind(), name()).
//
// A completion carries what the kernel said, with nothing smoothed over: the bytes transferred
// (possibly fewer than asked: a short transfer, whose rest the caller resubmits), or -errno.
// -EAGAIN and -EINTR mean "submit it again"; -ECANCELED follows cancel(). Problems with one request
// (a bad file, a misaligned O_DIRECT buffer, a length of 0) complete that request with -errno; a
// failing submit() means the engine itself is broken.
//
// Thread safety: an engine is driven by one thread at a time. submit(), reap(), cancel() and the
// register_*() calls must not run concurrently with each other (an io_uring ring is single-issuer).
// wake() is the exception: any thread may call it at any time. The buffers of a request belong to
// the caller and must stay valid, and unread/unwritten by anyone else, until its completion is
// reaped. Destroy an engine only with nothing in flight; a destructor that finds requests in flight
// cancels them and waits for them, so a buffer is never written after the engine is gone.
// Extension interface (include/tier/ext/README.md): stable for backends, tests and tools; not
// the user API.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "tier/config.hpp"
#include "tier/status.hpp"

namespace tier::nvme {

enum class IoOp : std::uint8_t { kRead = 0, kWrite = 1 };
const char* io_op_name(IoOp op) noexcept;  // "read", "write"

// One request. Any tag below kFirstReservedTag is the caller's; keep the tags of requests in
// flight distinct if cancel() is to find the right one.
struct IoRequest {
  IoOp op = IoOp::kRead;
  int fd = -1;               // an open file descriptor; ignored when file_index >= 0
  int file_index = -1;       // a slot returned by register_file(), or -1 to use fd
  std::uint64_t offset = 0;  // byte offset in the file
  std::uint32_t length = 0;  // bytes, 1..kMaxRequestBytes
  void* buffer = nullptr;    // source of a write, destination of a read
  std::uint64_t tag = 0;     // returned in the completion; cancel() finds requests by it
};

struct IoCompletion {
  std::uint64_t tag = 0;
  std::int64_t result = 0;  // bytes transferred (>= 0), or -errno
};

// The largest single request. The kernel caps one read or write at just under 2 GiB; tier's
// block sizes stop at 1 GiB (aio.block_size).
inline constexpr std::uint32_t kMaxRequestBytes = 1u << 30;
// Tags from here up are used by the engines themselves.
inline constexpr std::uint64_t kFirstReservedTag = ~std::uint64_t{0} - 255;
// io_uring refuses to register one buffer larger than this, so a region is registered in pieces of
// at most this size; a request that crosses a piece boundary is sent without the fixed-buffer
// opcode (still correct, only without the pre-registration of its pages).
inline constexpr std::uint64_t kMaxFixedBufferPiece = 1ull << 30;

// Capability bits, see IoEngine::capabilities().
enum IoCapability : std::uint32_t {
  kIoCapDirect = 1u << 0,           // asynchronous on O_DIRECT files (uring, aio)
  kIoCapBuffered = 1u << 1,         // asynchronous on page-cache files (uring, posix); aio blocks
  kIoCapBatchSubmit = 1u << 2,      // one system call submits a whole batch (uring, aio)
  kIoCapFixedBuffers = 1u << 3,     // register_buffers() works: requests in the region skip pinning
  kIoCapRegisteredFiles = 1u << 4,  // register_file() gives a kernel-side slot (uring)
  kIoCapSqPoll = 1u << 5,           // a kernel thread polls the submission queue (uring + sqpoll)
  kIoCapCancelInFlight = 1u << 6,   // cancel() can stop a request the kernel already has (uring)
};

// What an engine has done so far (counted with relaxed atomics: read them from any thread).
struct IoEngineStats {
  std::uint64_t requests = 0;               // requests taken by submit()
  std::uint64_t fixed_buffer_requests = 0;  // of which sent with fixed-buffer opcodes
  std::uint64_t submit_calls = 0;           // system calls (or pool hand-offs) that submitted requests
};

struct IoEngineOptions {
  IoEngineKind kind = IoEngineKind::kAuto;
  unsigned queue_depth = 32;       // requests in flight at most, 1..4096
  bool sqpoll = false;             // io_uring: kernel submission-polling thread
  unsigned sqpoll_idle_ms = 1000;  // io_uring: the polling thread sleeps after this much idle time
  unsigned posix_threads = 0;      // posix: worker threads; 0 picks min(queue_depth, 8)
  // io_uring: bytes per registered buffer piece (a multiple of 4 KiB, at most the kernel's 1 GiB).
  // Smaller pieces only serve tests of requests that cross a piece boundary.
  std::uint64_t fixed_buffer_piece = kMaxFixedBufferPiece;
};

class IoEngine {
 public:
  virtual ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  virtual IoEngineKind kind() const noexcept = 0;
  // "uring", "aio" or "posix" (a decorator names what it wraps).
  const char* name() const noexcept { return io_engine_kind_name(kind()); }
  // IoCapability bits that hold for this engine now (e.g. kIoCapFixedBuffers only after a
  // successful register_buffers()).
  virtual std::uint32_t capabilities() const noexcept = 0;
  bool has(IoCapability c) const noexcept { return (capabilities() & c) != 0; }
  // Requests this engine keeps in flight at most.
  virtual unsigned queue_depth() const noexcept = 0;
  // Requests submitted and not yet reaped.
  virtual unsigned in_flight() const noexcept = 0;

  // (optional) Registers a file and returns its slot for IoRequest::file_index. The engine keeps
  // no reference to the descriptor beyond the slot: unregister before closing it. Defaults to a
  // table in the engine (no kernel registration).
  virtual Result<int> register_file(int fd);
  // (optional) Frees a slot. Requests in flight on it must have completed.
  virtual Status unregister_file(int index);
  // (optional) Registers [base, base + bytes) so requests inside it use fixed-buffer opcodes. The
  // memory must stay mapped until unregister_buffers() or the engine's destruction. Engines without
  // fixed buffers return kUnsupported and keep working with plain requests.
  virtual Status register_buffers(void* base, std::uint64_t bytes);
  virtual void unregister_buffers() noexcept {}
  // (optional) Like register_buffers() but registers nothing yet: a sparse table of one slot per
  // piece of [base, base + bytes), filled by register_buffer_range() as the memory is committed
  // (a lazily pinned host arena). Requests in pieces not registered use plain opcodes. Engines
  // without fixed buffers, or kernels without sparse buffer tables, return kUnsupported.
  virtual Status reserve_buffers(void* base, std::uint64_t bytes);
  // (optional) Registers the pieces of the reserved region that lie whole inside [p, p + bytes).
  virtual Status register_buffer_range(void* p, std::uint64_t bytes);
  // (optional) Bytes registered as fixed buffers now; safe from any thread. Defaults to 0.
  virtual std::uint64_t registered_buffer_bytes() const noexcept { return 0; }

  // Submits up to n requests; returns how many were taken (fewer than n when the queue is full:
  // reap and submit the rest). An invalid request is taken and completes with -errno.
  virtual Result<std::size_t> submit(const IoRequest* requests, std::size_t n) = 0;
  // Writes up to `max` completions to `out`. Waits until at least `min_complete` are available,
  // wake() is called, or `timeout` passes (a negative timeout waits without limit); returns how
  // many it wrote (possibly fewer than min_complete, possibly 0).
  virtual Result<std::size_t> reap(IoCompletion* out, std::size_t max, std::size_t min_complete,
                                   std::chrono::nanoseconds timeout) = 0;
  // Asks that the request with `tag` stop. Best effort: a request still queued completes with
  // -ECANCELED; one the kernel already has stops only with kIoCapCancelInFlight, otherwise it
  // completes normally. kNotFound when no request with that tag is in flight.
  virtual Status cancel(std::uint64_t tag) = 0;
  // Makes a reap() that is waiting (or the next one) return promptly. Safe from any thread.
  virtual void wake() noexcept = 0;

  // (optional) Counters of this engine; safe from any thread. Defaults to the counters below.
  virtual IoEngineStats stats() const noexcept;

 protected:
  IoEngine() = default;
  void count_submit(std::uint64_t requests, std::uint64_t fixed, std::uint64_t calls) noexcept;
  // The descriptor a request addresses (its slot's descriptor, or fd), or -1 for a bad slot.
  int resolve_fd(const IoRequest& r) const noexcept;
  // Frees a slot of the default file table (a subclass whose own registration of it failed).
  void release_file_slot(int slot) noexcept;

 private:
  std::vector<int> files_;  // slot -> descriptor, -1 when free (the default file table)
  std::atomic<std::uint64_t> requests_{0};
  std::atomic<std::uint64_t> fixed_requests_{0};
  std::atomic<std::uint64_t> submit_calls_{0};
};

// Creates an engine. kAuto tries io_uring, then libaio, then posix, logging once why a faster one
// was passed over. Errors: kInvalidArgument for a bad queue depth; kUnsupported when the asked
// backend is unavailable (the message says why: kernel, sysctl, build option).
Result<std::unique_ptr<IoEngine>> make_io_engine(const IoEngineOptions& options);

// Whether `kind` can be created here (ok) or why not (kUnsupported). kAuto always works.
Status probe_io_engine(IoEngineKind kind);

}  // namespace tier::nvme
