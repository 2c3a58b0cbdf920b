// EmulatedDevice: the device of machines without a GPU. Device memory is host memory under the
// same budget and caching allocator as on CUDA; copies run on one worker thread per direction, in
// submission order, optionally paced (see emulated_stream.hpp); events complete like CUDA events.
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <map>
#include <new>

#include "gpu/caching_allocator.hpp"
#include "gpu/emulated_stream.hpp"
#include "gpu/event_state.hpp"
#include "tier/ext/device.hpp"
#include "tier/units.hpp"

namespace tier {

namespace {

constexpr std::size_t kEmulatedAlignment = 256;  // what cudaMalloc guarantees
constexpr std::uint64_t kHugePage = 2ull << 20;

// Small blocks come from the heap (where AddressSanitizer watches their bounds). Blocks of 2 MiB
// and more are mapped on their own, 2 MiB aligned and backed by transparent huge pages, as GPU
// memory is by large pages: without them a copy worker spends its time in TLB misses and page
// faults instead of moving bytes, and the emulated link would look slower than memcpy.
class HostRawMemory final : public detail::RawDeviceMemory {
 public:
  Result<void*> allocate(std::uint64_t bytes) override {
    if (bytes < kHugePage) {
      void* p = ::operator new(bytes, std::align_val_t(kEmulatedAlignment), std::nothrow);
      if (p == nullptr) return exhausted(bytes);
      prefault(p, bytes);
      return p;
    }
    const std::uint64_t len = round_up(bytes);
    void* m =
        mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return exhausted(bytes);
    auto* raw = static_cast<std::byte*>(m);
    auto* p = reinterpret_cast<std::byte*>(round_up(reinterpret_cast<std::uintptr_t>(raw)));
    if (p > raw) munmap(raw, static_cast<std::size_t>(p - raw));
    if (std::byte* tail = p + len; tail < raw + len + kHugePage) {
      munmap(tail, static_cast<std::size_t>(raw + len + kHugePage - tail));
    }
    madvise(p, len, MADV_HUGEPAGE);  // a hint: without THP the block still works
    prefault(p, len);
    return static_cast<void*>(p);
  }
  void free(void* p, std::uint64_t bytes) noexcept override {
    if (bytes < kHugePage) {
      ::operator delete(p, std::align_val_t(kEmulatedAlignment));
    } else {
      munmap(p, round_up(bytes));
    }
  }

 private:
  // Device memory is there once allocated: fault every page in now, as cudaMalloc commits, so
  // that first-touch faults (and huge-page compaction) never land inside a paced copy.
  static void prefault(void* p, std::uint64_t bytes) {
    auto* b = static_cast<volatile std::byte*>(p);
    for (std::uint64_t off = 0; off < bytes; off += 4096) b[off] = std::byte{0};
  }
  static std::uint64_t round_up(std::uint64_t v) { return (v + kHugePage - 1) / kHugePage * kHugePage; }
  static Status exhausted(std::uint64_t bytes) {
    return resource_exhausted(str("emulated device: the host has no memory left for a ", format_bytes(bytes),
                                  " block; lower tier.budgets.device"));
  }
};

std::uint64_t physical_memory() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
}

std::string rate_text(std::uint64_t bps) {
  return bps ? format_rate(static_cast<double>(bps)) : std::string("unlimited");
}

class EmulatedDevice final : public Device {
 public:
  explicit EmulatedDevice(const DeviceOptions& o) {
    counters_ = o.counters;
    const std::uint64_t total = physical_memory();
    const std::uint64_t budget = o.budget_bytes ? o.budget_bytes : std::max<std::uint64_t>(total / 4, 64ull << 20);
    const bool paced = o.emulated.h2d_bytes_per_second || o.emulated.d2h_bytes_per_second || o.emulated.latency_us > 0;
    delayed_ = o.emulated.delayed_streams;
    info_.kind = DeviceKind::kEmulated;
    info_.name = "emulated";
    info_.device_id = 0;
    info_.total_bytes = total;
    info_.caps = static_cast<std::uint32_t>(DeviceCap::kAsyncCopy) |
                 static_cast<std::uint32_t>(DeviceCap::kDuplexCopy) |
                 static_cast<std::uint32_t>(DeviceCap::kHostAddressable) |
                 (paced ? static_cast<std::uint32_t>(DeviceCap::kPacedCopies) : 0u) |
                 (delayed_ ? static_cast<std::uint32_t>(DeviceCap::kGpuStreams) : 0u);
    info_.detail = str("host memory as device memory, budget ", format_bytes(budget), ", h2d ",
                       rate_text(o.emulated.h2d_bytes_per_second), ", d2h ", rate_text(o.emulated.d2h_bytes_per_second),
                       ", latency ", o.emulated.latency_us, " us", delayed_ ? ", delayed streams" : "");
    init_allocator(std::make_unique<HostRawMemory>(), budget, o.alloc_timeout);
    h2d_ = std::make_unique<detail::EmulatedStream>("emulated device h2d stream", Link::kHostToDevice,
                                                    o.emulated.h2d_bytes_per_second, o.emulated.latency_us, counters_);
    d2h_ = std::make_unique<detail::EmulatedStream>("emulated device d2h stream", Link::kDeviceToHost,
                                                    o.emulated.d2h_bytes_per_second, o.emulated.latency_us, counters_);
  }
  // shutdown() synchronizes: the compute streams' queued work (which may still read or write
  // device memory and post copies) runs to its end before the copies drain and the memory goes.
  ~EmulatedDevice() override { shutdown(); }

 protected:
  Result<DeviceEvent> submit_copy(CopyDirection dir, void* dst, const void* src, std::uint64_t bytes,
                                  const std::vector<DeviceEvent>& after) override {
    return (dir == CopyDirection::kHostToDevice ? h2d_ : d2h_)->submit(dst, src, bytes, after);
  }
  Status do_register_host(void*, std::uint64_t, bool* owned) override {
    *owned = false;  // host memory is already what the emulated device copies from
    return Status();
  }
  Status do_unregister_host(void*, std::uint64_t) override { return Status(); }
  // Without delayed streams the caller's thread is the compute stream; with them each handle is a
  // worker (EmulatedComputeStream), made on first use.
  Status do_stream_wait(DeviceStream stream, const DeviceEvent& event) override {
    if (!delayed_) return event.wait();
    compute(stream).wait(event);
    return Status();
  }
  Result<DeviceEvent> do_record_event(DeviceStream stream) override {
    if (!delayed_) return DeviceEvent::completed();
    return compute(stream).record();
  }
  Status do_enqueue_host(DeviceStream stream, std::function<void()> fn) override {
    if (delayed_) {
      compute(stream).enqueue(std::move(fn));
    } else {
      detail::run_host_function(fn, "emulated device");
    }
    return Status();
  }
  Status do_synchronize() override {
    bool ok = true;
    std::vector<detail::EmulatedComputeStream*> streams;
    {
      std::lock_guard<std::mutex> lock(streams_mu_);
      for (auto& [handle, stream] : streams_) streams.push_back(stream.get());
    }
    for (auto* c : streams) ok = c->drain() && ok;  // streams are never removed before the destructor
    const bool a = h2d_->drain();
    const bool b = d2h_->drain();
    if (!a || !b || !ok) {
      return failed_precondition(
          "emulated device: synchronize() (or read_device/write_device) called from a copy callback or a "
          "stream's host function, which cannot wait for its own stream; callbacks must not block");
    }
    return Status();
  }
  Status do_read(void* dst, const void* device_src, std::uint64_t bytes) override {
    std::memcpy(dst, device_src, bytes);
    return Status();
  }
  Status do_write(void* device_dst, const void* src, std::uint64_t bytes) override {
    std::memcpy(device_dst, src, bytes);
    return Status();
  }

 private:
  detail::EmulatedComputeStream& compute(DeviceStream handle) {
    std::lock_guard<std::mutex> lock(streams_mu_);
    auto& s = streams_[handle];
    if (!s) {
      s = std::make_unique<detail::EmulatedComputeStream>(handle ? str("emulated device stream ", handle)
                                                                 : std::string("emulated device default stream"));
    }
    return *s;
  }

  bool delayed_ = false;
  std::unique_ptr<detail::EmulatedStream> h2d_;
  std::unique_ptr<detail::EmulatedStream> d2h_;
  std::mutex streams_mu_;
  std::map<DeviceStream, std::unique_ptr<detail::EmulatedComputeStream>> streams_;
};

}  // namespace

Result<std::unique_ptr<Device>> create_emulated_device(const DeviceOptions& options) {
  const double lat = options.emulated.latency_us;
  if (!std::isfinite(lat) || lat < 0 || lat > 1e9) {
    return invalid_argument(str("tier.emulated.latency_us must be from 0 to 1e9 microseconds (got ", lat, ")"));
  }
  if (options.alloc_timeout.count() < 0) {
    return invalid_argument(
        str("tier.device_alloc_timeout_ms must not be negative (got ", options.alloc_timeout.count(), ")"));
  }
  return std::unique_ptr<Device>(new EmulatedDevice(options));
}

}  // namespace tier
