#include "tier/ext/host_arena.hpp"

#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

#include "tier/log.hpp"
#include "tier/units.hpp"

namespace tier {

namespace {

std::uint64_t round_up(std::uint64_t v, std::uint64_t a) {
  return (v + a - 1) / a * a;
}

bool thp_available() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (!std::getline(f, line)) return false;
  return line.find("[never]") == std::string::npos;
}

std::uint64_t free_hugetlb_pages() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  std::uint64_t value = 0;
  while (f >> key >> value) {
    if (key == "HugePages_Free:") return value;
    f.ignore(256, '\n');
  }
  return 0;
}

// Bytes of [begin, begin+len) backed by huge pages, from /proc/self/smaps.
std::uint64_t huge_bytes_in(const std::byte* begin, std::uint64_t len, bool hugetlb) {
  std::ifstream f("/proc/self/smaps");
  std::string line;
  const auto lo = reinterpret_cast<std::uintptr_t>(begin);
  const auto hi = lo + len;
  bool inside = false;
  std::uint64_t total = 0;
  while (std::getline(f, line)) {
    if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) && line.find('-') != std::string::npos &&
        line.find(':') > line.find(' ')) {
      std::uintptr_t a = 0, b = 0;
      std::sscanf(line.c_str(), "%lx-%lx", &a, &b);
      inside = a < hi && b > lo;
      continue;
    }
    if (!inside) continue;
    std::istringstream ls(line);
    std::string key;
    std::uint64_t kb = 0;
    ls >> key >> kb;
    if (key == "AnonHugePages:" || (hugetlb && (key == "Private_Hugetlb:" || key == "Shared_Hugetlb:"))) {
      total += kb * 1024;
    }
  }
  return total;
}

// mlock/munlock through the system call itself: sanitizer runtimes intercept the libc wrappers
// and turn them into no-ops that return 0, which would make the arena report memory as pinned
// that is not.
int sys_mlock(const void* p, std::size_t n) {
  return static_cast<int>(syscall(SYS_mlock, p, n));
}
int sys_munlock(const void* p, std::size_t n) {
  return static_cast<int>(syscall(SYS_munlock, p, n));
}

}  // namespace

HostBlock& HostBlock::operator=(HostBlock&& o) noexcept {
  if (this != &o) {
    reset();
    arena_ = o.arena_;
    data_ = o.data_;
    size_ = o.size_;
    o.arena_ = nullptr;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

std::uint64_t HostBlock::offset() const noexcept {
  return arena_ ? static_cast<std::uint64_t>(data_ - arena_->base()) : 0;
}

void HostBlock::reset() noexcept {
  if (arena_ && data_) arena_->free_block(data_, size_);
  arena_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

Result<std::unique_ptr<HostArena>> HostArena::create(const HostArenaOptions& options) {
  if (options.bytes == 0) return invalid_argument("host arena: size is 0; give the arena at least 2 MiB");
  if (options.lazy && (options.extent_bytes % kHugePage != 0 || options.extent_bytes > (1ull << 30))) {
    return invalid_argument(str("host arena: extent size ", options.extent_bytes,
                                " must be a multiple of 2 MiB up to 1 GiB (or 0 for the default)"));
  }
  std::unique_ptr<HostArena> a(new HostArena());
  a->capacity_ = round_up(options.bytes, kHugePage);

  HugePageMode mode = options.huge_pages;
  if (mode == HugePageMode::kHugetlbfs) {
    const std::uint64_t need = a->capacity_ / kHugePage;
    const std::uint64_t have = free_hugetlb_pages();
    if (have < need) {
      return unsupported(str("host arena: hugetlbfs needs ", need, " free 2 MiB pages for ", format_bytes(a->capacity_),
                             " but the pool has ", have, "; reserve them with `sysctl vm.nr_hugepages=", need,
                             "` or set tier.huge_pages to \"thp\""));
    }
    void* p = mmap(nullptr, a->capacity_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | (21 << MAP_HUGE_SHIFT), -1, 0);
    if (p == MAP_FAILED) {
      return errno_status(errno, str("host arena: mmap of ", format_bytes(a->capacity_), " from hugetlbfs"));
    }
    a->map_ = a->base_ = static_cast<std::byte*>(p);
    a->map_bytes_ = a->capacity_;
    a->backing_ = HugePageMode::kHugetlbfs;
  } else {
    // Over-map by one huge page so that the arena can start on a 2 MiB boundary: THP backs only
    // aligned 2 MiB ranges.
    a->map_bytes_ = a->capacity_ + kHugePage;
    void* p = mmap(nullptr, a->map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      return errno_status(errno, str("host arena: mmap of ", format_bytes(a->map_bytes_)))
          .with_context("lower tier.budgets.host (the engine's host arena) or free host memory");
    }
    a->map_ = static_cast<std::byte*>(p);
    a->base_ = reinterpret_cast<std::byte*>(round_up(reinterpret_cast<std::uintptr_t>(a->map_), kHugePage));
    a->backing_ = HugePageMode::kOff;
    if (mode == HugePageMode::kOff) {
      // Asked for small pages: keep THP off even where the system enables it for everything.
      madvise(a->base_, a->capacity_, MADV_NOHUGEPAGE);
    } else if (mode == HugePageMode::kAuto || mode == HugePageMode::kThp) {
      if (thp_available() && madvise(a->base_, a->capacity_, MADV_HUGEPAGE) == 0) {
        a->backing_ = HugePageMode::kThp;
      } else {
        log_once("arena.thp", LogLevel::kWarn,
                 "host arena: transparent huge pages are unavailable (/sys/kernel/mm/transparent_hugepage/enabled "
                 "is [never] or madvise failed); staging buffers use 4 KiB pages, which can cut NVMe bandwidth");
      }
    }
  }

  a->lock_ = options.lock;
  a->prefault_ = options.prefault;
  a->locked_.store(options.lock, std::memory_order_relaxed);
  a->lazy_ = options.lazy;
  if (options.lazy) {
    // 64 MiB: pinning and registering one costs milliseconds, and a handful cover a small run.
    std::uint64_t extent = options.extent_bytes;
    if (extent == 0) extent = std::max<std::uint64_t>(64ull << 20, round_up(a->capacity_ / 4096, kHugePage));
    a->extent_bytes_ = std::min(extent, a->capacity_);
  } else {
    a->extent_bytes_ = a->capacity_;
  }
  a->extents_ = static_cast<std::size_t>((a->capacity_ + a->extent_bytes_ - 1) / a->extent_bytes_);
  a->extent_state_ = std::make_unique<std::atomic<std::uint8_t>[]>(a->extents_);
  for (std::size_t e = 0; e < a->extents_; ++e) a->extent_state_[e].store(kUncommitted, std::memory_order_relaxed);
  if (!a->lazy_) {
    a->extent_state_[0].store(kCommitting, std::memory_order_relaxed);
    a->commit_extent(0);
  }
  a->free_[0] = a->capacity_;
  return a;
}

void HostArena::commit_extent(std::size_t e) {
  std::byte* begin = base_ + e * extent_bytes_;
  const std::uint64_t len = std::min(extent_bytes_, capacity_ - e * extent_bytes_);
  bool pinned = false;
  if (lock_ && locked_.load(std::memory_order_relaxed)) {
    if (sys_mlock(begin, len) == 0) {
      pinned = true;
    } else {
      // Once refused, the arena stops asking: the limit does not grow while the process runs.
      const int err = errno;
      locked_.store(false, std::memory_order_relaxed);
      struct rlimit rl {};
      getrlimit(RLIMIT_MEMLOCK, &rl);
      log_once("arena.mlock", LogLevel::kWarn,
               str("host arena: mlock of ", format_bytes(len), " refused (", std::strerror(err), "; RLIMIT_MEMLOCK is ",
                   rl.rlim_cur == RLIM_INFINITY ? std::string("unlimited") : format_bytes(rl.rlim_cur),
                   "); continuing with unpinned memory. Raise the limit (ulimit -l, or memlock in "
                   "/etc/security/limits.conf) to pin it"));
    }
  }
  // Fault every page in now (mlock has when it succeeded, not when it was refused) so that the
  // first transfers do not pay for it and THP gets its chance to back each 2 MiB run. Writing is
  // safe: no block lies in an extent before it is committed.
  if (prefault_ && !pinned) {
    for (std::uint64_t off = 0; off < len; off += 4096) begin[off] = std::byte{0};
  }
  {
    std::lock_guard<std::mutex> lock(commit_mu_);
    for (auto& [id, listener] : listeners_) {
      try {
        listener(begin, len);
      } catch (const std::exception& ex) {
        TIER_LOG(kWarn, "host arena: a commit listener failed: ", ex.what());
      }
    }
    committed_bytes_.fetch_add(len, std::memory_order_relaxed);
    if (pinned) pinned_bytes_.fetch_add(len, std::memory_order_relaxed);
    extent_state_[e].store(kCommitted, std::memory_order_release);
  }
  committed_.notify_all();
}

void HostArena::ensure_committed(const std::byte* p, std::uint64_t bytes) {
  const auto first = static_cast<std::size_t>(static_cast<std::uint64_t>(p - base_) / extent_bytes_);
  const auto last = static_cast<std::size_t>(static_cast<std::uint64_t>(p + bytes - 1 - base_) / extent_bytes_);
  for (std::size_t e = first; e <= last; ++e) {
    if (extent_state_[e].load(std::memory_order_acquire) == kCommitted) continue;
    std::unique_lock<std::mutex> lock(commit_mu_);
    for (;;) {
      const std::uint8_t s = extent_state_[e].load(std::memory_order_acquire);
      if (s == kCommitted) break;
      if (s == kUncommitted) {
        extent_state_[e].store(kCommitting, std::memory_order_relaxed);
        lock.unlock();
        commit_extent(e);
        break;
      }
      committed_.wait(lock);  // another allocation is committing it
    }
  }
}

std::uint64_t HostArena::add_commit_listener(CommitListener listener) {
  std::lock_guard<std::mutex> lock(commit_mu_);
  // An extent still being committed is not announced here: its committer calls this listener too,
  // since it takes commit_mu_ only after this returns.
  for (std::size_t e = 0; e < extents_; ++e) {
    if (extent_state_[e].load(std::memory_order_acquire) != kCommitted) continue;
    listener(base_ + e * extent_bytes_, std::min(extent_bytes_, capacity_ - e * extent_bytes_));
  }
  const std::uint64_t id = next_listener_++;
  listeners_.emplace(id, std::move(listener));
  return id;
}

void HostArena::remove_commit_listener(std::uint64_t id) noexcept {
  std::lock_guard<std::mutex> lock(commit_mu_);
  listeners_.erase(id);
}

HostArena::~HostArena() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (live_ != 0) {
      TIER_LOG(kError, "host arena destroyed with ", live_, " live blocks (", format_bytes(used_),
               "); their memory is unmapped now");
    }
  }
  {
    std::lock_guard<std::mutex> lock(commit_mu_);
    if (!listeners_.empty()) {
      TIER_LOG(kError, "host arena destroyed with ", listeners_.size(),
               " commit listeners left; whoever registered its memory must unregister first");
    }
  }
  if (pinned_bytes_.load() != 0) sys_munlock(base_, capacity_);
  if (map_) munmap(map_, map_bytes_);
}

std::byte* HostArena::carve_locked(std::uint64_t bytes, std::uint64_t alignment) {
  // Best fit: the smallest extent that holds the aligned request keeps large runs intact.
  auto best = free_.end();
  std::uint64_t best_len = ~0ull;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    const std::uint64_t start = round_up(reinterpret_cast<std::uintptr_t>(base_ + it->first), alignment) -
                                reinterpret_cast<std::uintptr_t>(base_);
    const std::uint64_t pad = start - it->first;
    if (it->second >= pad + bytes && it->second < best_len) {
      best = it;
      best_len = it->second;
    }
  }
  if (best == free_.end()) return nullptr;
  const std::uint64_t ext_off = best->first;
  const std::uint64_t ext_len = best->second;
  const std::uint64_t start =
      round_up(reinterpret_cast<std::uintptr_t>(base_ + ext_off), alignment) - reinterpret_cast<std::uintptr_t>(base_);
  free_.erase(best);
  if (start > ext_off) free_[ext_off] = start - ext_off;
  if (ext_off + ext_len > start + bytes) free_[start + bytes] = ext_off + ext_len - (start + bytes);
  used_ += bytes;
  peak_ = std::max(peak_, used_);
  ++live_;
  return base_ + start;
}

Result<HostBlock> HostArena::try_allocate(std::uint64_t bytes, std::uint64_t alignment) {
  return allocate(bytes, std::chrono::milliseconds(0), alignment);
}

Result<HostBlock> HostArena::allocate(std::uint64_t bytes, std::chrono::milliseconds timeout, std::uint64_t alignment) {
  if (bytes == 0) return invalid_argument("host arena: allocation of 0 bytes");
  if (alignment < kMinAlignment || (alignment & (alignment - 1)) != 0) {
    return invalid_argument(str("host arena: alignment ", alignment, " is not a power of two of at least 4096"));
  }
  const std::uint64_t size = round_up(bytes, kMinAlignment);
  if (size > capacity_) {
    return resource_exhausted(str("host arena: ", format_bytes(size), " requested but the arena holds only ",
                                  format_bytes(capacity_),
                                  "; raise tier.budgets.host (the engine's host arena) or use smaller buffers"));
  }
  // Where the alignment exceeds the arena's own (2 MiB), the padding before the first aligned
  // address counts too: a request that can never fit must not wait for a free that cannot help.
  const std::uint64_t lead =
      round_up(reinterpret_cast<std::uintptr_t>(base_), alignment) - reinterpret_cast<std::uintptr_t>(base_);
  if (lead + size > capacity_) {
    return resource_exhausted(
        str("host arena: ", format_bytes(size), " aligned to ", format_bytes(alignment), " can never fit in the ",
            format_bytes(capacity_),
            " arena; raise tier.budgets.host (the engine's host arena) or ask for a smaller alignment"));
  }
  std::unique_lock<std::mutex> lock(mu_);
  std::byte* p = carve_locked(size, alignment);
  if (p == nullptr && timeout.count() > 0) {
    ++waits_;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (p == nullptr) {
      if (freed_.wait_until(lock, deadline) == std::cv_status::timeout) {
        p = carve_locked(size, alignment);
        break;
      }
      p = carve_locked(size, alignment);
    }
  }
  if (p == nullptr) {
    const auto msg = str("host arena: no free run of ", format_bytes(size), " (", format_bytes(capacity_ - used_),
                         " free of ", format_bytes(capacity_), " in ", free_.size(), " pieces)");
    if (timeout.count() > 0) return timed_out(str(msg, " after waiting ", timeout.count(), " ms"));
    return resource_exhausted(msg);
  }
  lock.unlock();
  // Outside mu_: a commit takes milliseconds, and allocations elsewhere in the arena go on.
  HostBlock block(this, p, size);
  if (lazy_) ensure_committed(p, size);
  return block;
}

void HostArena::free_block(std::byte* p, std::uint64_t bytes) noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::uint64_t off = static_cast<std::uint64_t>(p - base_);
    std::uint64_t len = bytes;
    auto next = free_.lower_bound(off);
    if (next != free_.end() && off + len == next->first) {
      len += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        off = prev->first;
        len += prev->second;
        free_.erase(prev);
      }
    }
    free_[off] = len;
    used_ -= bytes;
    --live_;
  }
  freed_.notify_all();
}

HostArenaStats HostArena::stats() const {
  HostArenaStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.reserved_bytes = capacity_;
    s.used_bytes = used_;
    s.peak_used_bytes = peak_;
    s.free_extents = free_.size();
    std::uint64_t free_total = 0;
    for (const auto& [off, len] : free_) {
      free_total += len;
      s.largest_free_bytes = std::max(s.largest_free_bytes, len);
    }
    s.fragmentation =
        free_total ? 1.0 - static_cast<double>(s.largest_free_bytes) / static_cast<double>(free_total) : 0;
    s.live_blocks = live_;
    s.waits = waits_;
    s.locked = locked_.load(std::memory_order_relaxed);
    s.huge_pages = backing_;
    s.lazy = lazy_;
    s.extent_bytes = extent_bytes_;
    s.committed_bytes = committed_bytes_.load(std::memory_order_relaxed);
    s.pinned_bytes = pinned_bytes_.load(std::memory_order_relaxed);
  }
  s.huge_page_bytes = backing_ == HugePageMode::kHugetlbfs ? capacity_ : huge_bytes_in(base_, capacity_, false);
  return s;
}

}  // namespace tier
