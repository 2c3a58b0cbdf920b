#include "tier/ext/device.hpp"

#include <utility>

#include "gpu/caching_allocator.hpp"
#include "gpu/event_state.hpp"
#include "tier/ext/cuda_probe.hpp"
#include "tier/log.hpp"
#include "tier/stats.hpp"
#include "tier/units.hpp"

namespace tier {

const char* copy_direction_name(CopyDirection d) noexcept {
  return d == CopyDirection::kHostToDevice ? "host_to_device" : "device_to_host";
}

// ------------------------------------------------------------------------------------ DeviceBuffer

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    allocator_ = std::move(o.allocator_);
    block_ = std::exchange(o.block_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

std::uint64_t DeviceBuffer::capacity() const noexcept {
  return block_ ? block_->size : 0;
}

void DeviceBuffer::retain_until(const DeviceEvent& event) const {
  if (block_) detail::CachingAllocator::note_use(block_, event);
}

void DeviceBuffer::reset() noexcept {
  if (block_) allocator_->release(block_);
  allocator_.reset();
  block_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

// ----------------------------------------------------------------------------------- DeviceOptions

DeviceOptions DeviceOptions::from_config(const EngineConfig& config, Counters* counters) {
  DeviceOptions o;
  o.kind = config.tier.device;
  o.device_id = config.tier.device_id;
  o.budget_bytes = config.tier.device_budget;
  o.alloc_timeout = std::chrono::milliseconds(config.tier.device_alloc_timeout_ms);
  o.emulated = config.tier.emulated;
  o.counters = counters;
  return o;
}

// ------------------------------------------------------------------------------------------ Device

Device::~Device() {
  // Implementations call shutdown() in their own destructor, while their streams still exist.
  if (allocator_) allocator_->release_cached();
}

void Device::init_allocator(std::unique_ptr<detail::RawDeviceMemory> raw, std::uint64_t budget,
                            std::chrono::milliseconds alloc_timeout) {
  info_.budget_bytes = budget;
  alloc_timeout_ = alloc_timeout;
  const std::string name =
      info_.kind == DeviceKind::kCuda ? str("cuda device ", info_.device_id) : std::string("emulated device");
  allocator_ = std::make_shared<detail::CachingAllocator>(std::move(raw), budget, name, counters_);
}

void Device::shutdown() noexcept {
  if (shut_down_) return;
  shut_down_ = true;
  if (Status s = do_synchronize(); !s.ok()) TIER_LOG(kWarn, info_.name, ": copies failed at shutdown: ", s);
  std::lock_guard<std::mutex> lock(reg_mu_);
  for (const auto& [base, r] : registered_) {
    if (!r.owned) continue;
    if (Status s = do_unregister_host(reinterpret_cast<void*>(base), r.bytes); !s.ok()) {
      TIER_LOG(kWarn, info_.name, ": ", s);
    }
  }
  registered_.clear();
  if (allocator_) allocator_->release_cached();
}

Result<DeviceBuffer> Device::allocate(std::uint64_t bytes) {
  return allocator_->allocate(bytes, alloc_timeout_);
}

Result<DeviceBuffer> Device::allocate(std::uint64_t bytes, std::chrono::milliseconds timeout) {
  return allocator_->allocate(bytes, timeout);
}

DeviceMemoryStats Device::memory_stats() const {
  return allocator_->stats();
}

std::uint64_t Device::release_cached() {
  return allocator_->release_cached();
}

Status Device::check_buffer(const DeviceBuffer& b, std::uint64_t offset, std::uint64_t bytes, const char* what) const {
  if (b.empty())
    return invalid_argument(str(info_.name, ": ", what, ": the device buffer is empty (moved from or reset)"));
  if (b.allocator() != allocator_.get()) {
    return invalid_argument(str(info_.name, ": ", what, ": the buffer was allocated by another device"));
  }
  if (offset > b.size() || bytes > b.size() - offset) {
    return out_of_range(str(info_.name, ": ", what, ": bytes [", offset, ", ", offset + bytes, ") lie outside the ",
                            b.size(), "-byte device buffer"));
  }
  return Status();
}

Status Device::check_after(const std::vector<DeviceEvent>& after) const {
  for (const auto& e : after) {
    if (!e.valid()) return invalid_argument(str(info_.name, ": a copy was ordered after an empty DeviceEvent"));
  }
  return Status();
}

Result<DeviceEvent> Device::copy_to_device(const DeviceBuffer& dst, std::uint64_t dst_offset, const void* src,
                                           std::uint64_t bytes, const std::vector<DeviceEvent>& after) {
  TIER_RETURN_IF_ERROR(check_buffer(dst, dst_offset, bytes, "copy to device"));
  if (src == nullptr && bytes > 0)
    return invalid_argument(str(info_.name, ": copy to device from a null host pointer"));
  TIER_RETURN_IF_ERROR(check_after(after));
  if (bytes == 0) return DeviceEvent::completed();
  TIER_ASSIGN_OR_RETURN(
      DeviceEvent ev,
      submit_copy(CopyDirection::kHostToDevice, static_cast<std::byte*>(dst.data()) + dst_offset, src, bytes, after));
  detail::CachingAllocator::note_use(dst.block(), ev);
  return ev;
}

Result<DeviceEvent> Device::copy_to_host(void* dst, const DeviceBuffer& src, std::uint64_t src_offset,
                                         std::uint64_t bytes, const std::vector<DeviceEvent>& after) {
  TIER_RETURN_IF_ERROR(check_buffer(src, src_offset, bytes, "copy to host"));
  if (dst == nullptr && bytes > 0) return invalid_argument(str(info_.name, ": copy to host into a null host pointer"));
  TIER_RETURN_IF_ERROR(check_after(after));
  if (bytes == 0) return DeviceEvent::completed();
  TIER_ASSIGN_OR_RETURN(DeviceEvent ev,
                        submit_copy(CopyDirection::kDeviceToHost, dst,
                                    static_cast<const std::byte*>(src.data()) + src_offset, bytes, after));
  detail::CachingAllocator::note_use(src.block(), ev);
  return ev;
}

Status Device::stream_wait(DeviceStream stream, const DeviceEvent& event) {
  if (!event.valid()) return invalid_argument(str(info_.name, ": stream_wait on an empty DeviceEvent"));
  return do_stream_wait(stream, event);
}

Result<DeviceEvent> Device::record_event(DeviceStream stream) {
  return do_record_event(stream);
}

Status Device::enqueue_host(DeviceStream stream, std::function<void()> fn) {
  if (!fn) return invalid_argument(str(info_.name, ": enqueue_host of an empty function"));
  return do_enqueue_host(stream, std::move(fn));
}

Status Device::synchronize() {
  return do_synchronize();
}

Status Device::read_device(const DeviceBuffer& src, std::uint64_t src_offset, void* dst, std::uint64_t bytes) {
  TIER_RETURN_IF_ERROR(check_buffer(src, src_offset, bytes, "read_device"));
  if (bytes == 0) return Status();
  if (dst == nullptr) return invalid_argument(str(info_.name, ": read_device into a null host pointer"));
  TIER_RETURN_IF_ERROR(do_synchronize());
  return do_read(dst, static_cast<const std::byte*>(src.data()) + src_offset, bytes);
}

Status Device::write_device(const DeviceBuffer& dst, std::uint64_t dst_offset, const void* src, std::uint64_t bytes) {
  TIER_RETURN_IF_ERROR(check_buffer(dst, dst_offset, bytes, "write_device"));
  if (bytes == 0) return Status();
  if (src == nullptr) return invalid_argument(str(info_.name, ": write_device from a null host pointer"));
  TIER_RETURN_IF_ERROR(do_synchronize());
  return do_write(static_cast<std::byte*>(dst.data()) + dst_offset, src, bytes);
}

// ------------------------------------------------------------------------------- host registration

Status Device::register_host(void* base, std::uint64_t bytes) {
  if (base == nullptr || bytes == 0) {
    return invalid_argument(str(info_.name, ": register_host needs a non-null base and a non-zero size"));
  }
  const auto lo = reinterpret_cast<std::uintptr_t>(base);
  const std::uintptr_t hi = lo + bytes;
  std::lock_guard<std::mutex> lock(reg_mu_);
  auto it = registered_.upper_bound(lo);
  if (it != registered_.begin()) {
    auto prev = std::prev(it);
    if (prev->first == lo && prev->second.bytes == bytes) return Status();  // the same range again
    if (prev->first + prev->second.bytes > lo) it = prev;
  }
  if (it != registered_.end() && it->first < hi) {
    return already_exists(str(info_.name, ": host range ", base, " + ", format_bytes(bytes),
                              " overlaps the registered range ", reinterpret_cast<void*>(it->first), " + ",
                              format_bytes(it->second.bytes), "; unregister that one first"));
  }
  bool owned = false;
  TIER_RETURN_IF_ERROR(do_register_host(base, bytes, &owned));
  registered_[lo] = Registration{bytes, owned};
  return Status();
}

Status Device::unregister_host(void* base) {
  std::lock_guard<std::mutex> lock(reg_mu_);
  auto it = registered_.find(reinterpret_cast<std::uintptr_t>(base));
  if (it == registered_.end()) {
    return not_found(str(info_.name, ": unregister_host(", base, "): no range registered at that address"));
  }
  Status s;
  if (it->second.owned) s = do_unregister_host(base, it->second.bytes);
  registered_.erase(it);
  return s;
}

bool Device::is_registered(const void* p, std::uint64_t bytes) const {
  // Covered when registered ranges that follow each other without a gap hold every byte, from the
  // one containing the first byte to the one containing the last.
  std::uintptr_t at = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t end = at + bytes;
  std::lock_guard<std::mutex> lock(reg_mu_);
  auto it = registered_.upper_bound(at);
  if (it == registered_.begin()) return false;
  --it;
  while (true) {
    const std::uintptr_t range_end = it->first + it->second.bytes;
    if (at < it->first || at >= range_end) return false;
    if (end <= range_end) return true;
    at = range_end;
    ++it;
    if (it == registered_.end()) return false;
  }
}

// ---------------------------------------------------------------------------------------- creation

Result<std::unique_ptr<Device>> create_device(const DeviceOptions& options) {
  const CudaProbe& probe = probe_cuda();
  std::string selection;
  Result<std::unique_ptr<Device>> dev = Status(StatusCode::kInternal, "no device kind chosen");
  switch (options.kind) {
    case DeviceKind::kEmulated:
      selection = "emulated: tier.device=emulated";
      dev = create_emulated_device(options);
      break;
    case DeviceKind::kCuda:
      if (!probe.usable()) {
        return unsupported(str("tier.device=cuda, but no CUDA device is usable: ", probe.status.message(),
                               "; set tier.device to auto or emulated to run without a GPU"));
      }
      selection = "cuda: tier.device=cuda";
      dev = create_cuda_device(options);
      break;
    case DeviceKind::kAuto:
      if (probe.usable()) {
        dev = create_cuda_device(options);
        if (dev.ok()) {
          selection = str("cuda: tier.device=auto and a GPU is usable (", probe.summary(), ")");
        } else {
          selection = str("emulated: tier.device=auto, a GPU was found but the CUDA device did not start (",
                          dev.status().message(), ")");
          TIER_LOG(kWarn, "device: ", selection);
          dev = create_emulated_device(options);
        }
      } else {
        selection = str("emulated: tier.device=auto and no CUDA device: ", probe.status.message());
        dev = create_emulated_device(options);
      }
      break;
  }
  if (!dev.ok()) return dev.status();
  const Device& d = **dev;
  log_once(str("device.selection:", selection), LogLevel::kInfo,
           str("device: using ", d.info().name, " (", selection, ")"));
  if (options.counters) {
    options.counters->set_info("device", d.info().name);
    options.counters->set_info("device.selection", selection);
  }
  return dev;
}

Result<std::unique_ptr<Device>> create_device(const EngineConfig& config, Counters* counters) {
  return create_device(DeviceOptions::from_config(config, counters));
}

}  // namespace tier
