// tier/ext/device_buffer.hpp — DeviceBuffer: a block of device memory handed out by a Device's
// caching allocator, returned to it when the handle is destroyed.
//
// The memory is not initialised. It is returned to the allocator's cache (not to the device) when
// the handle dies, and becomes reusable only after every copy that touched it has completed: the
// allocator remembers the last event of each copy to or from the block, so dropping a buffer with a
// copy still in flight cannot hand its bytes to someone else early. Work the device does not know
// about (a kernel on the caller's compute stream) is covered the same way by retain_until().
//
// Thread safety: one owner at a time (move-only). Copies may read a buffer through a const
// reference from several threads at once; retain_until() may be called concurrently with them.
// A buffer may outlive its Device; its memory is then freed when the buffer is.
// Extension interface (include/tier/ext/README.md): stable for backends, tests and tools; not
// the user API.
#pragma once

#include <cstdint>
#include <memory>

namespace tier {

class DeviceEvent;

namespace detail {
class CachingAllocator;
struct DeviceBlock;
}  // namespace detail

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  // Device address of the first byte: a CUDA device pointer on CudaDevice, host memory on the
  // emulated device. Valid until the buffer is destroyed or reset; owned by the buffer.
  void* data() const noexcept { return data_; }
  // Bytes asked for; copies are bounds-checked against it.
  std::uint64_t size() const noexcept { return size_; }
  // Bytes of the block that holds it (its size class, at least size()).
  std::uint64_t capacity() const noexcept;
  bool empty() const noexcept { return data_ == nullptr; }
  explicit operator bool() const noexcept { return data_ != nullptr; }

  // Keeps the memory from being reused after this buffer is freed until `event` completes, e.g.
  // an event recorded on the compute stream after the last kernel that reads the buffer.
  void retain_until(const DeviceEvent& event) const;

  // Returns the block to the allocator now (reused once pending copies complete).
  void reset() noexcept;

  // For device implementations.
  DeviceBuffer(std::shared_ptr<detail::CachingAllocator> allocator, detail::DeviceBlock* block, void* data,
               std::uint64_t size) noexcept
      : allocator_(std::move(allocator)), block_(block), data_(data), size_(size) {}
  detail::DeviceBlock* block() const noexcept { return block_; }
  const detail::CachingAllocator* allocator() const noexcept { return allocator_.get(); }

 private:
  std::shared_ptr<detail::CachingAllocator> allocator_;
  detail::DeviceBlock* block_ = nullptr;
  void* data_ = nullptr;
  std::uint64_t size_ = 0;
};

}  // namespace tier
