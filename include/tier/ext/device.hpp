// tier/ext/device.hpp — the device layer: one interface over the GPU tier, with a CUDA implementation
// and an emulated one that runs every scheduling path on machines without a GPU.
//
// A Device
//  - hands out device memory within a byte budget through a caching allocator with size classes
//    (DeviceBuffer; stats in DeviceMemoryStats);
//  - copies between device memory and pinned host memory (the HostArena, registered once with
//    register_host) asynchronously on two dedicated copy streams, one host-to-device and one
//    device-to-host; each copy returns a DeviceEvent, and copies on one stream complete in
//    submission order;
//  - orders work with events: a copy may be told to start after other events, a caller's compute
//    stream can wait for a copy (stream_wait), and a point on that stream can be recorded as an
//    event (record_event);
//  - reports into Counters: bytes, operations and busy time on Link::kHostToDevice and
//    Link::kDeviceToHost, and the bytes of live buffers as resident on Tier::kDevice.
//
// Implementations:
//  - CudaDevice: the CUDA runtime (linked statically; it loads the driver on first use, so tier
//    loads where there is none), non-blocking copy streams, events, cudaHostRegister.
//  - EmulatedDevice: device memory is host memory under the same budget; copies run on one worker
//    thread per stream in submission order, optionally paced to a bandwidth per direction and a
//    latency per copy, so tests and benchmarks can reproduce a PCIe-bound regime.
// create_device() picks one from the configuration (tier.device: auto|cuda|emulated); auto takes
// CUDA when probe_cuda() finds a usable GPU and says which it took, and why, in the log and in
// Counters::set_info("device", ...).
//
// Thread safety: every Device member may be called from any thread concurrently. DeviceBuffer and
// DeviceEvent say their own contracts. Destroying a Device waits for its copies to complete (and
// their callbacks to run); it must not race with other calls on it.
// Extension interface (include/tier/ext/README.md): stable for backends, tests and tools; not
// the user API.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tier/config.hpp"
#include "tier/ext/device_buffer.hpp"
#include "tier/ext/device_event.hpp"
#include "tier/status.hpp"

namespace tier {

class Counters;

// A caller's stream, opaque: a cudaStream_t on CudaDevice (nullptr is the legacy default
// stream); ignored by devices without GPU streams.
using DeviceStream = void*;

// What a device can do. Test with DeviceInfo::has().
enum class DeviceCap : std::uint32_t {
  kAsyncCopy = 1u << 0,        // copies run in the background of the caller
  kDuplexCopy = 1u << 1,       // host-to-device and device-to-host copies run at the same time
  kGpuStreams = 1u << 2,       // stream_wait/record_event order a GPU stream without blocking the host
  kHostRegister = 1u << 3,     // register_host pins host memory for DMA (a no-op bookkeeping call without)
  kHostAddressable = 1u << 4,  // device memory is host memory: DeviceBuffer::data() may be read by the CPU
  kPacedCopies = 1u << 5,      // copies are paced to a configured bandwidth and latency
};

struct DeviceInfo {
  DeviceKind kind = DeviceKind::kEmulated;  // kCuda or kEmulated, never kAuto
  // "cuda: NVIDIA H200 (139.8 GiB, sm_90), device 0" or "emulated".
  std::string name;
  // One line on how it is set up: budget, limits ("h2d 12.0 GB/s, d2h unlimited, latency 0 us").
  std::string detail;
  int device_id = 0;
  std::uint64_t total_bytes = 0;   // memory of the device (emulated: physical host memory)
  std::uint64_t budget_bytes = 0;  // what the allocator may reserve
  std::uint32_t caps = 0;          // DeviceCap bits

  bool has(DeviceCap c) const noexcept { return (caps & static_cast<std::uint32_t>(c)) != 0; }
};

// Memory statistics of a device's caching allocator.
struct DeviceMemoryStats {
  std::uint64_t budget_bytes = 0;
  std::uint64_t reserved_bytes = 0;      // obtained from the device: live + cached + pending
  std::uint64_t allocated_bytes = 0;     // in live buffers, counted by block (size class)
  std::uint64_t requested_bytes = 0;     // asked for by live buffers
  std::uint64_t cached_bytes = 0;        // free blocks kept for reuse
  std::uint64_t pending_free_bytes = 0;  // freed buffers waiting for copies still in flight
  std::uint64_t peak_allocated_bytes = 0;
  std::uint64_t peak_reserved_bytes = 0;
  std::uint64_t live_buffers = 0;
  std::uint64_t allocations = 0;         // successful allocate() calls
  std::uint64_t cache_hits = 0;          // of those, served from the cache
  std::uint64_t device_allocations = 0;  // blocks obtained from the device (cudaMalloc)
  std::uint64_t device_frees = 0;        // blocks given back to the device (cudaFree)
  std::uint64_t waits = 0;               // allocations that waited for memory to be freed
  std::uint64_t failures = 0;            // allocations refused (over budget, timed out, device OOM)
  // Share of reserved memory that holds no requested byte (size-class rounding, cached and
  // pending blocks): 1 - requested / reserved; 0 when nothing is reserved.
  double fragmentation = 0;
};

struct DeviceOptions {
  DeviceKind kind = DeviceKind::kAuto;
  int device_id = 0;  // CUDA device index
  // Bytes the allocator may reserve. 0: auto (CUDA: half of the free device memory at creation,
  // leaving the rest to the framework's allocator; emulated: a quarter of physical host memory,
  // taken only as buffers are allocated).
  std::uint64_t budget_bytes = 0;
  // How long allocate() waits for buffers to be freed when the budget is full; 0 fails at once.
  std::chrono::milliseconds alloc_timeout{0};
  EmulatedDeviceConfig emulated;  // bandwidth limits and latency of the emulated device
  // Where bytes, busy time, resident bytes and the device name are reported; not owned, must
  // outlive the device. May be null.
  Counters* counters = nullptr;

  // tier.device, tier.device_id, tier.budgets.device, tier.device_alloc_timeout_ms, tier.emulated.
  static DeviceOptions from_config(const EngineConfig& config, Counters* counters = nullptr);
};

namespace detail {
class CachingAllocator;
class RawDeviceMemory;
}  // namespace detail

// Which way a copy goes.
enum class CopyDirection : std::uint8_t { kHostToDevice = 0, kDeviceToHost = 1 };

class Device {
 public:
  virtual ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  const DeviceInfo& info() const noexcept { return info_; }
  bool has(DeviceCap c) const noexcept { return info_.has(c); }

  // ---- memory
  // A buffer of `bytes` (> 0) from the caching allocator, rounded up to its size class. When the
  // budget is full, cached blocks are given back first; then it waits up to the configured
  // alloc_timeout for buffers to be freed (kTimedOut when it expires) or, with no timeout, fails
  // at once with kResourceExhausted. A request larger than the whole budget fails at once. The
  // caller owns the buffer; its memory goes back to the allocator when the buffer is destroyed.
  Result<DeviceBuffer> allocate(std::uint64_t bytes);
  // Same with an explicit wait.
  Result<DeviceBuffer> allocate(std::uint64_t bytes, std::chrono::milliseconds timeout);
  DeviceMemoryStats memory_stats() const;
  // Gives every cached (free) block back to the device; returns the bytes released.
  std::uint64_t release_cached();

  // ---- pinned host memory
  // Makes [base, base + bytes) a DMA source and target: cudaHostRegister on CUDA, unless CUDA
  // allocated or registered it already; bookkeeping only on the emulated device. Registering the
  // same range again is ok; a range overlapping another registration is kAlreadyExists. The memory
  // must stay mapped until unregister_host() or until the device is destroyed, which unregisters
  // whatever is left.
  Status register_host(void* base, std::uint64_t bytes);
  Status unregister_host(void* base);
  // Whether every byte of [p, p + bytes) is registered: inside one registered range, or across
  // ranges that follow each other without a gap.
  bool is_registered(const void* p, std::uint64_t bytes) const;

  // ---- copies
  // Copies `bytes` from host memory `src` to `dst` at `dst_offset`, on the host-to-device stream,
  // after every event in `after` (from this device, or already complete). Returns at once with the
  // event of the copy; `src` must stay valid and unchanged until it completes (`dst` may be
  // dropped earlier: its block is reused only after the copy). Zero bytes give a completed event.
  // Errors (kInvalidArgument, kOutOfRange) name the buffer, offsets and sizes. On the emulated
  // device a copy ordered after an event that failed is not performed: its event completes with
  // kCancelled (on CUDA such failures are the context's, and every later copy reports them).
  Result<DeviceEvent> copy_to_device(const DeviceBuffer& dst, std::uint64_t dst_offset, const void* src,
                                     std::uint64_t bytes, const std::vector<DeviceEvent>& after = {});
  // Copies `bytes` from `src` at `src_offset` to host memory `dst`, on the device-to-host stream;
  // `dst` must stay valid, and unread, until the returned event completes.
  Result<DeviceEvent> copy_to_host(void* dst, const DeviceBuffer& src, std::uint64_t src_offset, std::uint64_t bytes,
                                   const std::vector<DeviceEvent>& after = {});

  // ---- compute streams
  // Makes `stream` wait for `event` before its later work: on the GPU (cudaStreamWaitEvent) when
  // the device has kGpuStreams; otherwise here, blocking the caller until the event completes,
  // and returning the event's failure if it failed.
  Status stream_wait(DeviceStream stream, const DeviceEvent& event);
  // An event that completes when the work submitted to `stream` so far has completed. Without
  // kGpuStreams the caller's thread is the stream, so the event is already complete.
  Result<DeviceEvent> record_event(DeviceStream stream);
  // Runs `fn` on the host in `stream`'s order: after the work queued on `stream` before the call,
  // and before the work queued after it (CUDA: cudaLaunchHostFunc, so `fn` must not call CUDA;
  // the emulated device's delayed streams: on the stream's worker). Without kGpuStreams `fn` runs
  // here, before the call returns. An exception escaping `fn` is logged and swallowed. For
  // consumers that work on the host in stream order, and for tests that stand in for kernels.
  Status enqueue_host(DeviceStream stream, std::function<void()> fn);

  // Waits until every copy submitted so far (and, on the emulated device's delayed streams, the
  // work queued on its compute streams) has completed and its callbacks have run.
  Status synchronize();

  // ---- for tests and debugging: synchronous, after every copy submitted so far, not counted
  // on any link, from/to any host memory.
  Status read_device(const DeviceBuffer& src, std::uint64_t src_offset, void* dst, std::uint64_t bytes);
  Status write_device(const DeviceBuffer& dst, std::uint64_t dst_offset, const void* src, std::uint64_t bytes);

 protected:
  // Implementations fill info_ (kind, name, detail, id, total bytes, caps) and call
  // init_allocator() from their factory, before handing the device out.
  Device() = default;

  // `raw` is the memory behind the size-class blocks (cudaMalloc / host memory); `budget` is
  // already resolved (not 0). Uses counters_, so set it first.
  void init_allocator(std::unique_ptr<detail::RawDeviceMemory> raw, std::uint64_t budget,
                      std::chrono::milliseconds alloc_timeout);

  // Backend hooks. Arguments are validated (in range, non-null, events valid) before the call.
  virtual Result<DeviceEvent> submit_copy(CopyDirection dir, void* dst, const void* src, std::uint64_t bytes,
                                          const std::vector<DeviceEvent>& after) = 0;
  virtual Status do_register_host(void* base, std::uint64_t bytes, bool* owned) = 0;
  virtual Status do_unregister_host(void* base, std::uint64_t bytes) = 0;
  virtual Status do_stream_wait(DeviceStream stream, const DeviceEvent& event) = 0;
  virtual Result<DeviceEvent> do_record_event(DeviceStream stream) = 0;
  virtual Status do_enqueue_host(DeviceStream stream, std::function<void()> fn) = 0;
  virtual Status do_synchronize() = 0;
  virtual Status do_read(void* dst, const void* device_src, std::uint64_t bytes) = 0;
  virtual Status do_write(void* device_dst, const void* src, std::uint64_t bytes) = 0;

  // Implementations call this first in their destructor (the base destructor cannot reach their
  // hooks): waits for copies and callbacks, then gives back the cached blocks and the host
  // registrations the device made. Idempotent.
  void shutdown() noexcept;

  DeviceInfo info_;
  Counters* counters_ = nullptr;

 private:
  Status check_buffer(const DeviceBuffer& b, std::uint64_t offset, std::uint64_t bytes, const char* what) const;
  Status check_after(const std::vector<DeviceEvent>& after) const;

  std::shared_ptr<detail::CachingAllocator> allocator_;
  std::chrono::milliseconds alloc_timeout_{0};
  bool shut_down_ = false;

  struct Registration {
    std::uint64_t bytes = 0;
    bool owned = false;  // registered by this device (to be unregistered by it)
  };
  mutable std::mutex reg_mu_;
  std::map<std::uintptr_t, Registration> registered_;
};

// Creates the device options.kind asks for. kAuto: CUDA when probe_cuda() finds a usable GPU (and
// the device starts), otherwise emulated; the choice and its reason are logged once and set in
// Counters info "device" (the device name) and "device.selection". kCuda without a usable GPU is
// kUnsupported, saying why and how to fall back. The caller owns the device.
Result<std::unique_ptr<Device>> create_device(const DeviceOptions& options);
Result<std::unique_ptr<Device>> create_device(const EngineConfig& config, Counters* counters = nullptr);
// The implementations, for tests and benchmarks that want one in particular.
Result<std::unique_ptr<Device>> create_emulated_device(const DeviceOptions& options);
Result<std::unique_ptr<Device>> create_cuda_device(const DeviceOptions& options);

// "host_to_device" / "device_to_host".
const char* copy_direction_name(CopyDirection d) noexcept;

}  // namespace tier
