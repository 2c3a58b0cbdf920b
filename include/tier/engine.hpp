// tier/engine.hpp — the Engine: owns every registered tensor, keeps each tier within its budget and
// moves copies between GPU memory, pinned host memory and NVMe just in time.
//
// Model of a tensor. A tensor is registered once with a descriptor and a home tier, where its
// durable copy lives. It has at most one copy per tier; each copy is absent, loading, valid (clean
// when the home copy holds the same bytes, dirty when it is newer than home) or writing back. The
// invariant that protects user data: a tensor always has at least one complete, valid copy, and a
// copy is dropped only after another one is complete.
//
// Leases. acquire(tensor, tier, access) returns a future of a Lease: a view of the tensor's copy
// on that tier, pinned in place until the lease is released. Several readers may hold leases at
// once; a writer is exclusive (its acquire waits for the readers to finish). A kWrite lease does
// not load the old contents (the caller overwrites all of them); kReadWrite does. Releasing a
// write lease makes that copy the only valid one (dirty until written home); flush() writes every
// dirty tensor home and makes NVMe durable.
//
// Budgets and eviction. Each tier has a byte budget. When a copy must be placed on a full tier,
// unpinned copies are evicted: a copy with another valid copy is dropped; the only valid copy is
// first written one tier toward home. With a recorded access trace the victim is the copy used
// furthest in the future (Belady); without one, the least recently used. A request larger than a
// tier's budget fails at once; one that cannot be placed because everything is pinned waits (up to
// the acquire timeout) for releases.
//
// Prefetch. Between begin_step() and end_step() the engine records the order of acquires; in later
// steps it keeps a window of upcoming acquires in flight (NVMe -> host -> device), bounded by
// tier.prefetch.lookahead, tier.prefetch.max_inflight_bytes and the budgets, so transfers overlap
// compute. A change of order is detected and the trace is re-recorded.
//
// Thread safety. Every Engine member may be called from any thread. Leases and futures may be
// used and destroyed on any thread, but each one by one thread at a time. State changes run on the
// engine's scheduler thread; transfer completions arrive from I/O and copy threads.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tier/config.hpp"
#include "tier/ext/device_event.hpp"
#include "tier/stats.hpp"
#include "tier/status.hpp"
#include "tier/types.hpp"

namespace tier {

enum class Access : std::uint8_t { kRead = 0, kWrite, kReadWrite };
const char* access_name(Access a) noexcept;  // "read", "write", "read_write"

class Engine;
class Device;
class HostArena;
// A caller's GPU stream (a cudaStream_t; nullptr: the legacy default stream), as in tier/ext/device.hpp.
using DeviceStream = void*;

namespace nvme {
class SwapSpace;
}  // namespace nvme

namespace detail {
struct LeaseState;
struct AcquireState;
struct EngineFactory;
}  // namespace detail

// A tensor's copy on one tier, pinned in place until released. Move-only. On the device tier,
// data() is a device pointer (host memory on the emulated device); on the host tier a pinned host
// pointer. Leases on the NVMe tier give no pointer (data() is null): they pin the home copy only.
class Lease {
 public:
  Lease() = default;
  Lease(Lease&&) noexcept;
  Lease& operator=(Lease&&) noexcept;
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  ~Lease();

  void* data() const noexcept;
  std::uint64_t bytes() const noexcept;
  DType dtype() const noexcept;  // the tensor's, as registered
  Tier tier() const noexcept;
  Access access() const noexcept;
  TensorId tensor() const noexcept;
  bool valid() const noexcept { return state_ != nullptr; }
  explicit operator bool() const noexcept { return valid(); }

  // Ends the lease. For a write lease the copy becomes the tensor's newest contents. The caller
  // must have finished using data() (on a GPU: synchronized the stream that used it). Errors:
  // kFailedPrecondition for an empty lease.
  Status release();
  // Ends the lease once `done` has completed, and returns at once (this Lease is empty after).
  // For a consumer that used data() on a GPU stream: `done` is an event recorded on that stream
  // after its last use (Device::record_event). Until it completes the copy stays pinned: it is not
  // evicted, its memory is not handed to another copy, and a write lease's contents are neither
  // published nor copied anywhere. If `done` fails (the stream's work failed), a read lease ends
  // and a write lease is abandoned, since its memory may hold partial writes (the tensor keeps the
  // contents it had), and the log says so. Errors: kFailedPrecondition for an empty lease,
  // kInvalidArgument for an empty event; the lease is kept on error.
  Status release_after(const DeviceEvent& done);
  // Records an event on `stream` with the engine's device and ends the lease after it, as above.
  // Work on other streams is the caller's to order before `stream`. On a device without GPU
  // streams (the emulated device, unless tier.emulated.delayed_streams) the event is complete at
  // once: the same as release(). A lease that outlived its engine ends at once. Errors: those of
  // release_after(event), and the device's when the event cannot be recorded (the lease is kept).
  Status release_after(DeviceStream stream);
  // Ends a write lease without publishing it: the tensor keeps the contents it had before the
  // acquire. Only for a lease whose memory was not written (e.g. a consumer that never used it);
  // for a read lease it is the same as release().
  Status abandon();

 private:
  friend class Engine;
  friend class AcquireFuture;
  explicit Lease(std::shared_ptr<detail::LeaseState> s) : state_(std::move(s)) {}
  std::shared_ptr<detail::LeaseState> state_;
};

// The future of an acquire. wait() hands the lease out once.
class AcquireFuture {
 public:
  AcquireFuture() = default;
  bool valid() const noexcept { return state_ != nullptr; }
  bool ready() const;
  // Blocks until the copy is in place (or the acquire failed); the time spent here is the
  // acquire's stall, counted in the stats. A second call returns kFailedPrecondition.
  Result<Lease> wait();
  // As wait(), but gives up after `timeout` with kTimedOut (the acquire stays pending).
  Result<Lease> wait_for(std::chrono::milliseconds timeout);
  // Gives the acquire up: once it is granted (or now, if it was), its lease ends unused — a write
  // lease is abandoned (Lease::abandon), so the tensor keeps its contents. A later wait() reports
  // kCancelled.
  void cancel();

 private:
  friend class Engine;
  explicit AcquireFuture(std::shared_ptr<detail::AcquireState> s) : state_(std::move(s)) {}
  std::shared_ptr<detail::AcquireState> state_;
};

struct TensorInfo {
  TensorDesc desc;
  Tier home = Tier::kHost;
  // Per tier: "absent", "loading", "valid_clean", "valid_dirty", "writing_back".
  std::array<const char*, kNumTiers> copy_state{};
  std::uint32_t readers = 0;
  bool writer = false;
};

class Engine {
 public:
  // Builds the tiers from `config`: the device (tier.device), the pinned host arena
  // (tier.budgets.host), the swap space on the swap paths (tier.budgets.nvme) when any tensor may
  // live on NVMe, and the scheduler thread.
  static Result<std::unique_ptr<Engine>> create(const EngineConfig& config);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Registers a tensor homed on `home`. `initial` (desc.bytes() bytes, host memory) is copied in;
  // without it the tensor reads as zeros. Errors: kInvalidArgument (bad descriptor, home tier not
  // configured), kAlreadyExists (name taken), kResourceExhausted (the home tier's budget cannot
  // hold it).
  // `durable` (with `initial`, on a home other than the host): true returns once the contents are
  // written home; false returns once they are copied into the host tier, with the write home
  // started and not waited for, so that a loader registering many tensors prepares the next one
  // while this one is written (the host budget bounds what is in flight). Its contents are the
  // tensor's either way; a failed write home is logged and leaves the host copy the valid one,
  // which flush() writes home again (and reports). Call flush() after the last such registration
  // for durability.
  Result<TensorId> register_tensor(const TensorDesc& desc, Tier home, const void* initial = nullptr,
                                   bool durable = true);
  // register_tensor whose contents `fill` writes straight into the tensor's host copy (desc.bytes()
  // bytes at dst, on the calling thread; e.g. read from a file into it), instead of being copied
  // from a caller's buffer: a loader saves that copy. `durable` as above. A non-OK return from
  // fill leaves nothing registered and is returned (with the tensor's name).
  using Fill = std::function<Status(void* dst, std::uint64_t bytes)>;
  Result<TensorId> register_filled(const TensorDesc& desc, Tier home, const Fill& fill, bool durable = true);
  // Drops every copy of an idle tensor. kFailedPrecondition while leases are held. The engine's
  // own transfers of it (a prefetch, an eviction's write-back) are waited for, up to
  // tier.acquire_timeout_ms (then kTimedOut).
  Status unregister_tensor(TensorId id);
  // Gives a registered tensor another name, role and group, keeping its copies where they are
  // (an adapter adopting tensors staged under other names: no byte moves). Errors: kNotFound,
  // kAlreadyExists (the name is taken), kFailedPrecondition (leases are held).
  Status retag(TensorId id, const std::string& name, Role role, int group);

  // `traced` false: the acquire is neither recorded in the step's access trace nor matched against
  // it (it still counts in the stats). For work beside the step whose order is not the step's own,
  // such as an optimizer pass overlapped with backward: traced, its acquires would interleave with
  // backward's differently each step, and each step would drop the trace as a new order.
  AcquireFuture acquire(TensorId id, Tier tier, Access access, bool traced = true);
  // A read lease of the device copy for a consumer that uses it on the GPU stream `stream`:
  // granted once the copy's transfer to the device is queued, not once it is done, with `stream`
  // made to wait for that transfer (Device::stream_wait). Work queued on `stream` after the grant
  // sees the tensor's bytes; the host must not read data() itself, and other streams are the
  // caller's to order after `stream`. So the host runs ahead of the transfers, as with a GPU's own
  // copies; end the lease with release_after(stream). If the transfer fails, `stream` fails too
  // (a GPU: the copy's error; the emulated device: the stream's later events) and the engine keeps
  // the tensor's other copies. A copy already in place is granted as acquire() grants it. On a
  // device without GPU streams (the emulated device, unless tier.emulated.delayed_streams) the host
  // is the stream: this is acquire(id, Tier::kDevice, Access::kRead, traced).
  AcquireFuture acquire_on_stream(TensorId id, DeviceStream stream, bool traced = true);
  // acquire(...).wait().
  Result<Lease> acquire_now(TensorId id, Tier tier, Access access, bool traced = true) {
    return acquire(id, tier, access, traced).wait();
  }

  // Copies the tensor's current contents into `dst` (host memory, desc.bytes()), or replaces them
  // from `src`. Convenience over a host-tier lease.
  Status read(TensorId id, void* dst);
  Status write(TensorId id, const void* src);

  // Writes every dirty tensor to its home tier and makes NVMe durable (fdatasync).
  Status flush();

  // Pinned host memory inside the host tier's budget, for a component beside the engine (an
  // offloaded optimizer's pipeline buffers): a host-homed uint8 tensor named `name`, held by a
  // write lease until the region's `keep` is destroyed, then unregistered. It counts in the host
  // tier's resident bytes (stats, check_invariants) and leaves that much less room for copies.
  // The engine must outlive the region. Errors: those of register_tensor and acquire, with a
  // message that names tier.budgets.host.
  Result<PinnedRegion> reserve_host(const std::string& name, std::uint64_t bytes);

  // Room in the NVMe tier's budget (tier.budgets.nvme) for a component that allocates its own
  // extents from swap_space() (an offloaded optimizer's state): `bytes` count in the tier's used
  // bytes until the reservation is destroyed, so tensors get that much less room and the budget
  // caps both together. The component reports the bytes it actually allocates in the counters'
  // NVMe resident bytes itself. Errors: kFailedPrecondition (no NVMe tier), kResourceExhausted
  // (the budget lacks the room, with the numbers; nothing is reserved).
  Result<Reservation> reserve_nvme(const std::string& name, std::uint64_t bytes);
  // The NVMe tier's swap space (its files and I/O threads), for components that share them; null
  // when the engine has no NVMe tier. It lives as long as the engine.
  nvme::SwapSpace* swap_space();

  // Bracket one training step: the access order of the first step is recorded and prefetched in
  // the following ones.
  void begin_step();
  void end_step();

  Result<TensorId> find(std::string_view name) const;
  Result<TensorInfo> info(TensorId id) const;
  std::size_t tensor_count() const;

  // Resident/peak bytes per tier, bytes/ops/busy time per link, backend names and scheduler
  // metrics (acquires, stalls, stall_seconds, late prefetches, evictions per tier, overlap).
  StatsSnapshot stats() const;

  // Checks every invariant (at least one valid copy per tensor, budgets respected, resident bytes
  // equal to the sum of the copies, lease counts); kInternal naming the first violation. Also run
  // after every state change when tier.debug_checks is set.
  Status check_invariants() const;

  Device& device();
  HostArena& host_arena();
  // The counters every tier and link of this engine reports into; other components (an offloaded
  // optimizer, an adapter's own copies) may report into it too, so one snapshot shows everything.
  Counters& counters();
  const EngineConfig& config() const;

  // Opaque: the state machine lives in the library (pimpl).
  struct Impl;

 private:
  friend struct detail::EngineFactory;
  explicit Engine(std::unique_ptr<Impl> impl);
  // register_tensor and register_filled: `fill` null registers zeros.
  Result<TensorId> register_filled_impl(const TensorDesc& desc, Tier home, const Fill* fill, bool durable);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tier
