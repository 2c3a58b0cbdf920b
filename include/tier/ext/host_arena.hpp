// tier/ext/host_arena.hpp — the pinned host arena: one large allocation made at start and
// sub-allocated in aligned blocks.
//
// The arena is the staging memory of every transfer: the NVMe tier registers it with io_uring as
// fixed buffers and the device layer registers it with CUDA, so the same bytes are the DMA target
// of the SSD and the DMA source of the GPU. It is mmap'd, backed by 2 MiB huge pages (transparent
// huge pages through madvise, or a hugetlbfs pool when asked) because physically contiguous
// buffers are what let an SSD reach its ceiling, and mlock'd. When mlock is refused
// (RLIMIT_MEMLOCK), the arena says so once and continues unpinned.
//
// Committing. An arena is committed (mlock'd, faulted in, and handed to its commit listeners,
// which register it with the device and with io_uring) either whole at creation, or, with
// `lazy`, extent by extent (64 MiB, 2 MiB aligned): the first allocation that reaches into an
// extent commits it before it returns, and any other allocation landing in that extent meanwhile
// waits for that commit. A lazy arena is for a cap that is mostly never used (the engine's auto
// host budget): creating it touches nothing, and only the extents blocks have used are pinned.
// Every live block lies in committed extents. Registrations are per extent, so a consumer must
// stay correct for memory it has not registered (io_uring falls back to plain requests, CUDA to
// staged copies).
//
// Why not cudaHostAlloc: CUDA's pinned allocator gives no control over the page size, and the
// NVMe path wants 2 MiB pages. The arena is therefore always mmap + mlock; the device layer
// pins it for the GPU with cudaHostRegister of each committed extent and the NVMe tier registers
// those extents with io_uring. Either registration must be undone before the arena is destroyed.
//
// allocate() waits (backpressure) when the arena is momentarily full, up to a timeout; a request
// larger than the arena can ever hold fails at once.
//
// Thread safety: allocate/try_allocate/stats/the commit listener calls and HostBlock destruction
// may run concurrently from any thread. The arena must outlive every block, every registration of
// its memory and every commit listener.
// Extension interface (include/tier/ext/README.md): stable for backends, tests and tools; not
// the user API.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "tier/config.hpp"
#include "tier/status.hpp"

namespace tier {

class HostArena;
class Counters;

struct HostArenaOptions {
  std::uint64_t bytes = 0;  // capacity; rounded up to 2 MiB
  HugePageMode huge_pages = HugePageMode::kAuto;
  bool lock = true;  // mlock the arena (pin it)
  // Fault every page in as it is committed (at creation, or with `lazy` per extent), so that the
  // first transfers do not pay for it.
  bool prefault = true;
  // Commit (lock, fault in, announce to the commit listeners) extent by extent as allocations
  // first reach into each, instead of all at creation.
  bool lazy = false;
  // Lazy: bytes per extent, a multiple of 2 MiB up to 1 GiB; 0 picks 64 MiB (more for an arena
  // over 256 GiB, so that it has at most 4096 extents).
  std::uint64_t extent_bytes = 0;
};

struct HostArenaStats {
  std::uint64_t reserved_bytes = 0;  // capacity
  std::uint64_t used_bytes = 0;      // in live blocks
  std::uint64_t peak_used_bytes = 0;
  std::uint64_t free_extents = 0;
  std::uint64_t largest_free_bytes = 0;
  double fragmentation = 0;  // 1 - largest free extent / free bytes (0: one free run)
  std::uint64_t live_blocks = 0;
  std::uint64_t waits = 0;                       // allocations that had to wait
  std::uint64_t huge_page_bytes = 0;             // bytes backed by huge pages (read from the kernel)
  bool locked = false;                           // mlock is on and was never refused
  HugePageMode huge_pages = HugePageMode::kOff;  // what backs the arena
  bool lazy = false;                             // committed extent by extent
  std::uint64_t extent_bytes = 0;                // bytes per extent (the capacity when not lazy)
  std::uint64_t committed_bytes = 0;             // in committed extents
  std::uint64_t pinned_bytes = 0;                // of which mlock'd
};

// A block of the arena, freed when destroyed. Move-only.
class HostBlock {
 public:
  HostBlock() = default;
  HostBlock(HostBlock&& o) noexcept { *this = std::move(o); }
  HostBlock& operator=(HostBlock&& o) noexcept;
  HostBlock(const HostBlock&) = delete;
  HostBlock& operator=(const HostBlock&) = delete;
  ~HostBlock() { reset(); }

  // Start of the block; valid until the block is destroyed or reset.
  std::byte* data() const noexcept { return data_; }
  std::uint64_t size() const noexcept { return size_; }
  // Offset of data() from the start of the arena (for fixed-buffer indexing).
  std::uint64_t offset() const noexcept;
  HostArena* arena() const noexcept { return arena_; }
  bool empty() const noexcept { return data_ == nullptr; }
  explicit operator bool() const noexcept { return data_ != nullptr; }
  // Returns the block to the arena now.
  void reset() noexcept;

 private:
  friend class HostArena;
  HostBlock(HostArena* a, std::byte* d, std::uint64_t s) : arena_(a), data_(d), size_(s) {}
  HostArena* arena_ = nullptr;
  std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
};

class HostArena {
 public:
  static constexpr std::uint64_t kMinAlignment = 4096;
  static constexpr std::uint64_t kHugePage = 2u << 20;

  // Maps, backs and pins the arena. Errors: kInvalidArgument for 0 bytes, kResourceExhausted when
  // the memory cannot be mapped, kUnsupported when hugetlbfs is asked for and the pool is short
  // (the message says how many pages are needed and how to reserve them).
  static Result<std::unique_ptr<HostArena>> create(const HostArenaOptions& options);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // A block of at least `bytes` (rounded up to 4 KiB) aligned to `alignment` (a power of two,
  // at least 4 KiB). Waits up to `timeout` for space; kTimedOut when it expires,
  // kResourceExhausted at once when `bytes` (with its alignment) can never fit. The block owns
  // its bytes until it is destroyed or reset; the memory stays valid as long as the arena.
  Result<HostBlock> allocate(std::uint64_t bytes, std::chrono::milliseconds timeout = std::chrono::milliseconds(60'000),
                             std::uint64_t alignment = kMinAlignment);
  // Like allocate() with no wait: kResourceExhausted when no free extent fits now.
  Result<HostBlock> try_allocate(std::uint64_t bytes, std::uint64_t alignment = kMinAlignment);

  std::byte* base() const noexcept { return base_; }
  std::uint64_t capacity() const noexcept { return capacity_; }
  bool contains(const void* p, std::uint64_t n) const noexcept {
    auto* b = static_cast<const std::byte*>(p);
    return b >= base_ && n <= capacity_ && b + n <= base_ + capacity_;
  }
  // Whether the arena pins what it commits: mlock is on and was never refused.
  bool locked() const noexcept { return locked_.load(std::memory_order_relaxed); }
  bool lazy() const noexcept { return lazy_; }
  // Bytes per commit extent (the capacity when the arena is not lazy); extents start at base().
  std::uint64_t extent_bytes() const noexcept { return extent_bytes_; }
  // Bytes in committed extents, and of those the mlock'd ones. Cheap: counters.
  std::uint64_t committed_bytes() const noexcept { return committed_bytes_.load(std::memory_order_relaxed); }
  std::uint64_t pinned_bytes() const noexcept { return pinned_bytes_.load(std::memory_order_relaxed); }

  // Called with each committed extent [begin, begin + bytes): first, on the calling thread, for
  // every extent committed so far; then on the committing thread (an allocating one) for each
  // extent committed later, before any block in it is handed out. Calls are serialized, and a
  // listener must not call into the arena. Returns an id for remove_commit_listener().
  using CommitListener = std::function<void(std::byte* begin, std::uint64_t bytes)>;
  std::uint64_t add_commit_listener(CommitListener listener);
  // After it returns the listener is not running and is never called again.
  void remove_commit_listener(std::uint64_t id) noexcept;
  // A snapshot of the counters. Reads /proc/self/smaps for the huge-page coverage, so it costs
  // a few hundred microseconds: for reports, not for every allocation.
  HostArenaStats stats() const;

 private:
  friend class HostBlock;
  HostArena() = default;
  std::byte* carve_locked(std::uint64_t bytes, std::uint64_t alignment);
  void free_block(std::byte* p, std::uint64_t bytes) noexcept;
  // Commits every extent that [p, p + bytes) reaches into, or waits for the thread committing it.
  void ensure_committed(const std::byte* p, std::uint64_t bytes);
  // Pins and faults in extent `e` (this thread set it to kCommitting), announces it, marks it
  // committed and wakes the threads waiting for it.
  void commit_extent(std::size_t e);

  std::byte* map_ = nullptr;  // the whole mapping (may start before base_ for alignment)
  std::uint64_t map_bytes_ = 0;
  std::byte* base_ = nullptr;
  std::uint64_t capacity_ = 0;
  HugePageMode backing_ = HugePageMode::kOff;
  bool lock_ = false;      // mlock committed extents
  bool prefault_ = false;  // fault committed extents in
  bool lazy_ = false;
  std::uint64_t extent_bytes_ = 0;
  std::atomic<bool> locked_{false};
  std::atomic<std::uint64_t> committed_bytes_{0};
  std::atomic<std::uint64_t> pinned_bytes_{0};

  // Per extent: kUncommitted, kCommitting (one thread is at it) or kCommitted. Read without the
  // lock on the fast path; changed under commit_mu_, which also serializes the listener calls.
  enum : std::uint8_t { kUncommitted = 0, kCommitting = 1, kCommitted = 2 };
  std::unique_ptr<std::atomic<std::uint8_t>[]> extent_state_;
  std::size_t extents_ = 0;
  std::mutex commit_mu_;
  std::condition_variable committed_;
  std::map<std::uint64_t, CommitListener> listeners_;
  std::uint64_t next_listener_ = 1;

  mutable std::mutex mu_;
  std::condition_variable freed_;
  std::map<std::uint64_t, std::uint64_t> free_;  // offset -> length, coalesced
  std::uint64_t used_ = 0;
  std::uint64_t peak_ = 0;
  std::uint64_t live_ = 0;
  std::uint64_t waits_ = 0;
};

}  // namespace tier
