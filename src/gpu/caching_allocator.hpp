// The caching allocator behind Device::allocate: size classes over a raw device allocator
// (cudaMalloc or host memory), a byte budget, reuse of freed blocks, and deferred reuse of blocks
// that copies still use.
//
// Why cache: cudaMalloc and cudaFree are slow and cudaFree synchronizes the whole device, so a
// training step that frees and re-allocates the same shapes every layer must not reach them.
// Why size classes: a freed block serves any later request of the same class. Classes are 512 B
// up to 512 B, then four per power of two (n rounded up to a quarter of the power of two below
// it), so a block wastes less than 25% of itself (12.5% on average for uniform sizes).
//
// Budget: reserved bytes (live + cached + pending blocks) never exceed it. When a new block would
// pass it, cached blocks are given back first (largest first), then the call waits for frees up to
// its timeout or fails. A request whose class alone exceeds the budget fails at once.
//
// Thread safety: every member may be called from any thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tier/ext/device.hpp"
#include "tier/ext/device_buffer.hpp"
#include "tier/ext/device_event.hpp"
#include "tier/status.hpp"

namespace tier {
class Counters;
}

namespace tier::detail {

// The memory behind size-class blocks.
class RawDeviceMemory {
 public:
  virtual ~RawDeviceMemory() = default;
  // `bytes` of device memory aligned to at least 256 bytes. kResourceExhausted when the device
  // has none left (the message names the device and its error).
  virtual Result<void*> allocate(std::uint64_t bytes) = 0;
  virtual void free(void* p, std::uint64_t bytes) noexcept = 0;
};

// Smallest block size (and the granularity of the smallest classes).
inline constexpr std::uint64_t kMinDeviceBlock = 512;
// The size class of a request: the block size that serves it (0 for 0).
std::uint64_t device_size_class(std::uint64_t bytes) noexcept;

struct DeviceBlock {
  void* ptr = nullptr;
  std::uint64_t size = 0;       // block size (its class, or larger when reused oversize)
  std::uint64_t requested = 0;  // bytes asked for by the live buffer
  // Events of copies (and retain_until) that use the block; it is reused only after they complete.
  std::mutex uses_mu;
  std::vector<DeviceEvent> uses;
};

class CachingAllocator : public std::enable_shared_from_this<CachingAllocator> {
 public:
  // `name` appears in messages ("cuda device 0", "emulated device").
  CachingAllocator(std::unique_ptr<RawDeviceMemory> raw, std::uint64_t budget, std::string name, Counters* counters);
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  Result<DeviceBuffer> allocate(std::uint64_t bytes, std::chrono::milliseconds timeout);
  // The buffer's owner gave it up: the block goes back to the cache once its uses complete.
  void release(DeviceBlock* block) noexcept;
  // Records that `event` uses the block (a copy to or from it).
  static void note_use(DeviceBlock* block, const DeviceEvent& event);
  // Gives every cached block back to the raw allocator; returns the bytes.
  std::uint64_t release_cached() noexcept;
  DeviceMemoryStats stats() const;
  std::uint64_t budget() const noexcept { return budget_; }

 private:
  void recycle(DeviceBlock* block) noexcept;  // pending -> cached
  // Frees cached blocks, largest first, until `need` more bytes fit the budget. Caller holds mu_.
  bool make_room_locked(std::uint64_t need) noexcept;
  void free_block_locked(DeviceBlock* block) noexcept;
  Status budget_error(StatusCode code, std::uint64_t bytes, std::uint64_t cls, const char* why) const;

  std::unique_ptr<RawDeviceMemory> raw_;
  const std::uint64_t budget_;
  const std::string name_;
  Counters* counters_;

  mutable std::mutex mu_;
  std::condition_variable freed_;
  std::multimap<std::uint64_t, DeviceBlock*> cache_;  // block size -> free block
  std::uint64_t reserved_ = 0;
  std::uint64_t allocated_ = 0;
  std::uint64_t requested_ = 0;
  std::uint64_t cached_ = 0;
  std::uint64_t pending_ = 0;
  std::uint64_t peak_allocated_ = 0;
  std::uint64_t peak_reserved_ = 0;
  std::uint64_t live_ = 0;
  std::uint64_t allocations_ = 0;
  std::uint64_t cache_hits_ = 0;
  std::uint64_t device_allocations_ = 0;
  std::uint64_t device_frees_ = 0;
  std::uint64_t waits_ = 0;
  std::uint64_t failures_ = 0;
};

}  // namespace tier::detail
