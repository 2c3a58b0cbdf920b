// Internal: what the engine needs from each tier's storage and from the links between tiers.
// The real implementations wrap the emulated/CUDA Device, the HostArena and the SwapSpace
// (real_backends.cpp); tests may supply others to drive the state machine deterministically.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "tier/config.hpp"
#include "tier/ext/device_event.hpp"
#include "tier/stats.hpp"
#include "tier/status.hpp"
#include "tier/types.hpp"

namespace tier::nvme {
class IoEngine;
class SwapSpace;
}  // namespace tier::nvme

namespace tier {
class Device;
class HostArena;
class Engine;
class Counters;
}  // namespace tier

namespace tier::detail {

// The storage of one copy. `ptr` addresses it for host and device copies (null on NVMe);
// `holder` owns the allocation and frees it when the last reference goes.
struct Buffer {
  void* ptr = nullptr;
  std::uint64_t bytes = 0;
  std::shared_ptr<void> holder;
  explicit operator bool() const noexcept { return holder != nullptr; }
};

using Done = std::function<void(Status)>;

class TierStore {
 public:
  virtual ~TierStore() = default;
  // Storage for a copy of `bytes`, without waiting: kResourceExhausted when it does not fit now
  // (the engine then evicts and retries). The engine keeps its own byte budget on top.
  virtual Result<Buffer> allocate(std::uint64_t bytes) = 0;
  // What an allocation of `bytes` really sets aside (the host arena and the swap space round to
  // 4 KiB): what the engine counts against the tier's budget, so that many small tensors cannot
  // hold more than the budget says.
  virtual std::uint64_t footprint(std::uint64_t bytes) const { return bytes; }
  // Bytes this store can hold at most (the engine's budget cannot exceed it).
  virtual std::uint64_t capacity() const = 0;
  virtual std::string describe() const = 0;
  // Whether the store counts its own resident bytes into the engine's Counters (the device does);
  // the engine counts the others.
  virtual bool reports_resident() const { return false; }
};

class Mover {
 public:
  virtual ~Mover() = default;
  // Starts copying `bytes` from `src` on tier `from` to `dst` on the adjacent tier `to`
  // (nvme<->host or host<->device). `done` is called exactly once, from any thread. Returns the
  // copy's device event for a host<->device move once it is queued, which a consumer's GPU stream
  // may wait on instead of the host waiting for `done`; an empty event when there is none (NVMe
  // moves, a copy that failed to start, a mover without device events).
  virtual DeviceEvent move(Tier from, const Buffer& src, Tier to, const Buffer& dst, std::uint64_t bytes,
                           Done done) = 0;
  // Fills a host or device buffer with zeros (synchronously).
  virtual Status zero(Tier tier, const Buffer& dst, std::uint64_t bytes) = 0;
  // Makes every completed NVMe write durable.
  virtual Status sync() = 0;
};

struct Backends {
  std::shared_ptr<void> owner;  // keeps device, arena and swap space alive: declared first, destroyed last
  std::unique_ptr<TierStore> stores[kNumTiers];  // a null store: tier not configured
  std::unique_ptr<Mover> mover;
  Device* device = nullptr;         // owned by `owner` when set
  HostArena* arena = nullptr;       // owned by `owner` when set
  nvme::SwapSpace* swap = nullptr;  // the NVMe store's swap space, owned by `owner`; null: none
  // (optional) Fills the host tier's pinned and registered bytes for the stats; any thread.
  std::function<void(TierUsage&)> host_pinning;
};

// Test hooks of Engine::create: e.g. wrap every NVMe I/O engine in a FaultInjectingEngine.
struct EngineHooks {
  std::function<std::unique_ptr<nvme::IoEngine>(std::unique_ptr<nvme::IoEngine>)> wrap_io_engine;
};
Result<std::unique_ptr<Engine>> create_engine(const EngineConfig& config, const EngineHooks& hooks);

// Builds an engine over the given backends (real ones come from Engine::create).
Result<std::unique_ptr<Engine>> make_engine(const EngineConfig& config, Backends backends,
                                            std::shared_ptr<Counters> counters);

}  // namespace tier::detail
