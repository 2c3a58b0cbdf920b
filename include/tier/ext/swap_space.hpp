// tier/ext/swap_space.hpp — the NVMe tier's store: swap files on one or more paths (one per SSD),
// an extent allocator over them, and asynchronous reads and writes of extents.
//
// Each path gets one file, created fresh (O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600, so it is never
// someone else's file nor a symlink's target), grown with fallocate as extents are allocated (so
// it holds what they need, up to the path's capacity; a full disk fails that allocation with
// kNoSpace naming the path and the bytes needed and free) or, with `preallocate`, reserved whole at
// creation (a full disk fails there, naming any other engine's swap files still present), and
// removed when the swap space closes. A file's name records its owner (pid, process start time,
// boot), and the owner holds an flock on it; at creation, swap files of owners that are gone (a
// killed process) are removed with one log line; nothing else in the directory is touched. A swap
// path that is a symlink to a directory is followed; a dangling symlink, a file or another
// non-directory is refused saying what it is. Files are
// opened with O_DIRECT when tier.io.use_direct is set; a file system that refuses it (ramfs, some
// network and FUSE file systems) gets buffered I/O through the posix engine, with one log line.
//
// Extents start at 4 KiB-aligned file offsets and are 4 KiB multiples. An extent of at least
// `stripe_threshold` bytes is striped RAID-0 style in `stripe_unit` pieces over all paths so that
// several SSDs add up; smaller ones go whole to the path with the most free space. Freed space is
// coalesced and reused (best fit); fragmentation is reported in stats().
//
// A transfer (read or write of an extent) is split into requests of at most `block_size` bytes,
// cut at stripe boundaries, and spread over `intra_op_parallelism` I/O threads, each keeping up to
// `queue_depth` requests in flight and submitting them in batches. Short transfers are resubmitted
// for the rest, EAGAIN/EINTR are retried, and any other error fails the transfer with the path,
// the file offset and the errno. A failed read reports failure (never partial success); a failed
// write leaves the extent's content undefined but no other extent is touched.
//
// O_DIRECT needs aligned buffers: buffers from the pinned host arena (or any 4 KiB-aligned buffer)
// and sizes that are multiples of 512 bytes go straight to the kernel (arena buffers through
// io_uring fixed buffers). Anything else is an error, or goes through a bounce buffer when
// `bounce_unaligned` is set.
//
// Thread safety: every member may be called from any thread concurrently. The caller must not
// touch a transfer's buffer until its future is ready, nor run two transfers that overlap on the
// same extent bytes at once when one of them writes. The SwapSpace must outlive its extents;
// destroying it waits for transfers in flight.
// Extension interface (include/tier/ext/README.md): stable for backends, tests and tools; not
// the user API.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tier/config.hpp"
#include "tier/ext/io_engine.hpp"
#include "tier/ext/io_future.hpp"
#include "tier/status.hpp"

namespace tier {
class Counters;
class HostArena;
}  // namespace tier

namespace tier::nvme {

class SwapSpace;

struct SwapSpaceOptions {
  std::vector<std::string> paths;  // directories, one per SSD; created (0700) when missing
  // Each path's capacity, rounded up to 4 KiB. Its file grows as extents are allocated (fallocate
  // in steps, up to this cap), so it holds on disk what the extents need; 0: the free space of the
  // path's file system at creation. With `preallocate` the whole capacity is reserved at creation
  // (a disk that lacks it fails there).
  std::uint64_t bytes_per_path = 0;
  bool preallocate = false;
  IoEngineKind engine = IoEngineKind::kAuto;
  std::uint64_t block_size = 1u << 20;       // bytes per request; a multiple of 4 KiB, at most 1 GiB
  unsigned queue_depth = 8;                  // requests in flight per I/O thread
  unsigned intra_op_parallelism = 1;         // I/O threads, each with its own engine
  bool single_submit = false;                // one system call per request instead of per batch
  bool use_direct = true;                    // O_DIRECT (falls back per path when refused)
  bool sqpoll = false;                       // io_uring submission polling
  bool fixed_buffers = true;                 // register the arena with io_uring
  bool bounce_unaligned = false;             // copy misaligned buffers/sizes through bounce buffers
  std::uint64_t stripe_unit = 0;             // bytes per stripe piece; 0: block_size
  std::uint64_t stripe_threshold = 0;        // extents at least this large are striped; 0: 2 stripe units
  HostArena* arena = nullptr;                // fixed buffers when given (lazy: per committed extent); outlives this
  Counters* counters = nullptr;              // nvme<->host link counters, info and metrics; may be null
  std::string metrics_prefix = "nvme.swap";  // <prefix>.used_bytes, .allocated_bytes, .capacity_bytes, ...
  // Wraps each I/O thread's engine (e.g. in a FaultInjectingEngine for tests); may be empty.
  std::function<std::unique_ptr<IoEngine>(std::unique_ptr<IoEngine>)> wrap_engine;

  // The options an EngineConfig asks for: tier.swap_paths or the offload nvme_paths, the aio
  // section (block size, queue depth, intra-op parallelism, single submit) and tier.io.*.
  static SwapSpaceOptions from_config(const EngineConfig& config, std::uint64_t bytes_per_path,
                                      HostArena* arena = nullptr, Counters* counters = nullptr);
};

// A reserved range of the swap space, freed when destroyed (space in use by a transfer is reused
// only after the transfer finishes). Move-only.
class SwapExtent {
 public:
  SwapExtent() = default;
  SwapExtent(SwapExtent&& o) noexcept { *this = std::move(o); }
  SwapExtent& operator=(SwapExtent&& o) noexcept;
  SwapExtent(const SwapExtent&) = delete;
  SwapExtent& operator=(const SwapExtent&) = delete;
  ~SwapExtent() { reset(); }

  // Bytes asked for; transfers address [0, bytes()).
  std::uint64_t bytes() const noexcept { return bytes_; }
  // Bytes held on disk (bytes() rounded up to 4 KiB).
  std::uint64_t reserved_bytes() const noexcept { return (bytes_ + 4095) & ~std::uint64_t{4095}; }
  std::uint64_t id() const noexcept { return id_; }
  // Number of paths the extent is striped over (1 when not striped).
  unsigned stripes() const noexcept { return stripes_; }
  bool empty() const noexcept { return space_ == nullptr; }
  explicit operator bool() const noexcept { return space_ != nullptr; }
  // Returns the space to the swap space now.
  void reset() noexcept;

 private:
  friend class SwapSpace;
  SwapExtent(SwapSpace* s, std::uint64_t id, std::uint64_t bytes, unsigned stripes)
      : space_(s), id_(id), bytes_(bytes), stripes_(stripes) {}
  SwapSpace* space_ = nullptr;
  std::uint64_t id_ = 0;
  std::uint64_t bytes_ = 0;
  unsigned stripes_ = 0;
};

struct SwapPathStats {
  std::string dir;
  std::string file;  // the swap file in dir
  bool direct_io = false;
  std::uint64_t capacity_bytes = 0;
  std::uint64_t allocated_bytes = 0;  // reserved on disk by the file (grows with the extents)
  std::uint64_t used_bytes = 0;
  std::uint64_t largest_free_bytes = 0;
  std::uint64_t free_extents = 0;  // free runs
  double fragmentation = 0;        // 1 - largest free run / free bytes (0: one free run)
};

struct SwapSpaceStats {
  std::vector<SwapPathStats> paths;
  std::string engine;  // the backend the I/O threads use, e.g. "uring"
  std::uint32_t engine_capabilities = 0;
  bool fixed_buffers = false;  // the arena is registered with the engine
  // Bytes of the arena registered as fixed buffers with every I/O thread's engine: the whole
  // arena, or with a lazy one the extents committed so far (each thread registers them before its
  // next submission).
  std::uint64_t fixed_buffer_bytes = 0;
  std::uint64_t capacity_bytes = 0;
  std::uint64_t allocated_bytes = 0;  // reserved on disk by the files: the peak of what was needed
  std::uint64_t used_bytes = 0;
  std::uint64_t peak_used_bytes = 0;
  std::uint64_t live_extents = 0;
  std::uint64_t striped_extents = 0;  // live extents over more than one path
  double fragmentation = 0;           // 1 - largest free run / free bytes, over all paths
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::uint64_t reads = 0;                  // read transfers finished
  std::uint64_t writes = 0;                 // write transfers finished
  std::uint64_t failed = 0;                 // transfers that finished with an error or were cancelled
  std::uint64_t requests = 0;               // requests sent to the engines
  std::uint64_t fixed_buffer_requests = 0;  // of which sent with io_uring fixed-buffer opcodes
  std::uint64_t submit_calls = 0;           // engine submissions (system calls) that carried them
  std::uint64_t retries = 0;                // EAGAIN/EINTR resubmissions
  std::uint64_t short_transfers = 0;        // short completions whose rest was resubmitted
  std::uint64_t bounced_requests = 0;       // requests copied through a bounce buffer
};

class SwapSpace {
 public:
  // Creates and preallocates the files and starts the I/O threads. Errors: kInvalidArgument for
  // bad options; kNoSpace when a path lacks the space (the message names the path and the bytes
  // needed and free); kAlreadyExists/kIoError when a file cannot be created; kUnsupported when the
  // asked engine is unavailable.
  static Result<std::unique_ptr<SwapSpace>> create(const SwapSpaceOptions& options);
  ~SwapSpace();
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  // Reserves `bytes` (rounded up to 4 KiB), growing the files when they do not reach that far yet.
  // kResourceExhausted when no path (or set of paths, for a striped extent) has the room within its
  // capacity; the message says how much is free. kNoSpace when a file cannot grow (the disk is
  // full): the message names the path and the bytes needed and free; nothing is reserved.
  Result<SwapExtent> allocate(std::uint64_t bytes);

  // Writes `bytes` from `src` to the extent at `offset` (a multiple of 4 KiB), asynchronously.
  // `src` is read until the future is ready. Invalid arguments give a future that is already
  // failed; nothing is written then.
  IoFuture write(const SwapExtent& extent, const void* src, std::uint64_t bytes, std::uint64_t offset = 0);
  // Reads `bytes` of the extent at `offset` into `dst`, asynchronously. `dst` is written until the
  // future is ready; its content counts only when the future reports ok.
  IoFuture read(const SwapExtent& extent, void* dst, std::uint64_t bytes, std::uint64_t offset = 0);

  // Makes every write whose future has completed durable (fdatasync of each swap file).
  Status flush();

  // Alignment a buffer (and a size) needs to go to the kernel without a bounce buffer: 1 when no
  // file uses O_DIRECT.
  std::uint64_t buffer_alignment() const noexcept { return mem_align_; }
  std::uint64_t size_alignment() const noexcept { return size_align_; }
  IoEngineKind engine_kind() const noexcept { return engine_kind_; }
  const SwapSpaceOptions& options() const noexcept { return options_; }
  SwapSpaceStats stats() const;

 private:
  friend class SwapExtent;
  struct Impl;
  explicit SwapSpace(const SwapSpaceOptions& options);
  void free_extent(std::uint64_t id) noexcept;
  IoFuture transfer(IoOp op, const SwapExtent& extent, void* buf, std::uint64_t bytes, std::uint64_t offset);

  SwapSpaceOptions options_;
  std::uint64_t mem_align_ = 1;
  std::uint64_t size_align_ = 1;
  IoEngineKind engine_kind_ = IoEngineKind::kPosix;
  std::unique_ptr<Impl> impl_;
};

// Whether the directory `path` is on a file system held in memory (tmpfs or ramfs). Swap files
// there keep the "NVMe" tier in RAM: it works (tests use it), but its figures are not NVMe
// figures. SwapSpace::create warns once per such path; tools print it beside their figures.
// Errors: the errno of statfs (e.g. kNotFound for a missing path).
Result<bool> path_is_in_memory(const std::string& path);

}  // namespace tier::nvme
