#include "gpu/caching_allocator.hpp"

#include <algorithm>
#include <atomic>
#include <iterator>

#include "tier/stats.hpp"
#include "tier/units.hpp"

namespace tier::detail {

using Clock = std::chrono::steady_clock;

std::uint64_t device_size_class(std::uint64_t bytes) noexcept {
  if (bytes == 0) return 0;
  if (bytes <= kMinDeviceBlock) return kMinDeviceBlock;
  // Past 2^62 no budget can hold it; keep the arithmetic from overflowing and let the budget say no.
  if (bytes > (std::uint64_t{1} << 62)) return bytes;
  const int k = 63 - __builtin_clzll(bytes);
  const std::uint64_t base = std::uint64_t{1} << k;
  if (bytes == base) return base;
  const std::uint64_t step = base / 4;
  return (bytes + step - 1) / step * step;
}

CachingAllocator::CachingAllocator(std::unique_ptr<RawDeviceMemory> raw, std::uint64_t budget, std::string name,
                                   Counters* counters)
    : raw_(std::move(raw)), budget_(budget), name_(std::move(name)), counters_(counters) {
  if (counters_) counters_->set_budget(Tier::kDevice, budget_);
}

CachingAllocator::~CachingAllocator() {
  // Live buffers and pending releases hold a reference to the allocator, so only cached blocks
  // can be left here.
  release_cached();
}

Status CachingAllocator::budget_error(StatusCode code, std::uint64_t bytes, std::uint64_t cls, const char* why) const {
  return Status(code, str(name_, ": cannot allocate ", format_bytes(bytes), " (a ", format_bytes(cls), " block)", why,
                          ": the device budget of ", format_bytes(budget_), " holds ", format_bytes(allocated_), " in ",
                          live_, " live buffer(s), ", format_bytes(pending_), " waiting for copies to finish and ",
                          format_bytes(cached_),
                          " cached; free buffers, raise tier.budgets.device, or set tier.device_alloc_timeout_ms to "
                          "wait for memory"));
}

bool CachingAllocator::make_room_locked(std::uint64_t need) noexcept {
  if (reserved_ - cached_ + need > budget_) return false;  // even an empty cache would not do
  while (reserved_ + need > budget_ && !cache_.empty()) {
    auto it = std::prev(cache_.end());  // largest first: fewest cudaFree calls
    DeviceBlock* b = it->second;
    cache_.erase(it);
    cached_ -= b->size;
    free_block_locked(b);
  }
  return reserved_ + need <= budget_;
}

void CachingAllocator::free_block_locked(DeviceBlock* block) noexcept {
  raw_->free(block->ptr, block->size);
  reserved_ -= block->size;
  ++device_frees_;
  delete block;
}

Result<DeviceBuffer> CachingAllocator::allocate(std::uint64_t bytes, std::chrono::milliseconds timeout) {
  if (bytes == 0) return invalid_argument(str(name_, ": a device buffer of 0 bytes; ask for at least 1 byte"));
  const std::uint64_t cls = device_size_class(bytes);
  std::unique_lock<std::mutex> lock(mu_);
  if (cls > budget_) {
    ++failures_;
    return Status(StatusCode::kResourceExhausted,
                  str(name_, ": cannot allocate ", format_bytes(bytes), " (a ", format_bytes(cls),
                      " block): larger than the whole device budget of ", format_bytes(budget_),
                      " (tier.budgets.device); raise the budget or split the tensor"));
  }
  const auto deadline = Clock::now() + timeout;
  bool waited = false;
  bool expired = false;
  DeviceBlock* block = nullptr;
  bool hit = false;
  for (;;) {
    // 1. A cached block of the same class.
    if (auto it = cache_.find(cls); it != cache_.end()) {
      block = it->second;
      cache_.erase(it);
      hit = true;
      break;
    }
    // 2. A new block, when it fits without giving anything back.
    const bool fits = reserved_ + cls <= budget_;
    // 3. Under pressure, a cached block up to twice the class: wastes memory, but costs no
    //    cudaFree (which synchronizes the device).
    if (!fits) {
      auto it = cache_.lower_bound(cls);
      if (it != cache_.end() && it->first <= 2 * cls) {
        block = it->second;
        cache_.erase(it);
        hit = true;
        break;
      }
    }
    // 4. Give cached blocks back to make room, then a new block.
    if (fits || make_room_locked(cls)) {
      auto p = raw_->allocate(cls);
      if (!p.ok() && !cache_.empty()) {
        // The device itself is short (someone else holds GPU memory): give the cache back, retry.
        while (!cache_.empty()) {
          DeviceBlock* b = cache_.begin()->second;
          cache_.erase(cache_.begin());
          cached_ -= b->size;
          free_block_locked(b);
        }
        p = raw_->allocate(cls);
      }
      if (!p.ok()) {
        ++failures_;
        return p.status().with_context(str(name_, ": allocating a ", format_bytes(cls), " block for ",
                                           format_bytes(bytes), " (within the budget of ", format_bytes(budget_), ", ",
                                           format_bytes(reserved_), " reserved)"));
      }
      block = new DeviceBlock;
      block->ptr = *p;
      block->size = cls;
      reserved_ += cls;
      ++device_allocations_;
      peak_reserved_ = std::max(peak_reserved_, reserved_);
      break;
    }
    // 5. Wait for frees, or fail.
    if (timeout.count() <= 0) {
      ++failures_;
      return budget_error(StatusCode::kResourceExhausted, bytes, cls, "");
    }
    if (expired) {
      ++failures_;
      return budget_error(StatusCode::kTimedOut, bytes, cls,
                          str(" after waiting ", timeout.count(), " ms for memory").c_str());
    }
    if (!waited) {
      ++waits_;
      waited = true;
    }
    if (freed_.wait_until(lock, deadline) == std::cv_status::timeout) expired = true;
  }
  if (hit) {
    cached_ -= block->size;
    ++cache_hits_;
  }
  block->requested = bytes;
  allocated_ += block->size;
  requested_ += bytes;
  ++live_;
  ++allocations_;
  peak_allocated_ = std::max(peak_allocated_, allocated_);
  lock.unlock();
  if (counters_) counters_->add_resident(Tier::kDevice, static_cast<std::int64_t>(block->size));
  return DeviceBuffer(shared_from_this(), block, block->ptr, bytes);
}

void CachingAllocator::note_use(DeviceBlock* block, const DeviceEvent& event) {
  if (!event.valid() || event.ready()) return;
  std::lock_guard<std::mutex> lock(block->uses_mu);
  auto& u = block->uses;
  u.erase(std::remove_if(u.begin(), u.end(), [](const DeviceEvent& e) { return e.ready(); }), u.end());
  u.push_back(event);
}

void CachingAllocator::release(DeviceBlock* block) noexcept {
  std::vector<DeviceEvent> pending;
  {
    std::lock_guard<std::mutex> lock(block->uses_mu);
    for (auto& e : block->uses) {
      if (!e.ready()) pending.push_back(std::move(e));
    }
    block->uses.clear();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    allocated_ -= block->size;
    requested_ -= block->requested;
    --live_;
    if (pending.empty()) {
      cache_.emplace(block->size, block);
      cached_ += block->size;
    } else {
      pending_ += block->size;
    }
  }
  if (counters_) counters_->add_resident(Tier::kDevice, -static_cast<std::int64_t>(block->size));
  if (pending.empty()) {
    freed_.notify_all();
    return;
  }
  // Reusable once the last copy that touches it completes. The callbacks hold the allocator.
  auto remaining = std::make_shared<std::atomic<std::size_t>>(pending.size());
  auto self = shared_from_this();
  for (const auto& e : pending) {
    e.on_complete([self, block, remaining](const Status&) {
      if (remaining->fetch_sub(1) == 1) self->recycle(block);
    });
  }
}

void CachingAllocator::recycle(DeviceBlock* block) noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_ -= block->size;
    cache_.emplace(block->size, block);
    cached_ += block->size;
  }
  freed_.notify_all();
}

std::uint64_t CachingAllocator::release_cached() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  std::uint64_t released = 0;
  for (auto& [size, b] : cache_) {
    released += size;
    free_block_locked(b);
  }
  cache_.clear();
  cached_ = 0;
  return released;
}

DeviceMemoryStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  DeviceMemoryStats s;
  s.budget_bytes = budget_;
  s.reserved_bytes = reserved_;
  s.allocated_bytes = allocated_;
  s.requested_bytes = requested_;
  s.cached_bytes = cached_;
  s.pending_free_bytes = pending_;
  s.peak_allocated_bytes = peak_allocated_;
  s.peak_reserved_bytes = peak_reserved_;
  s.live_buffers = live_;
  s.allocations = allocations_;
  s.cache_hits = cache_hits_;
  s.device_allocations = device_allocations_;
  s.device_frees = device_frees_;
  s.waits = waits_;
  s.failures = failures_;
  s.fragmentation = reserved_ ? 1.0 - static_cast<double>(requested_) / static_cast<double>(reserved_) : 0.0;
  return s;
}

}  // namespace tier::detail
