// Internal: what a C engine handle, its tickets and the DLPack tensors it hands out share — the
// engine itself, the C-side record of each registered tensor (shape, generation) and the leases
// whose end waits for a consumer's stream.
//
// Lifetime. The engine handle, every ticket and every exported DLPack tensor hold a
// shared_ptr<EngineCore>; the engine goes with the last of them. Its destructor first waits for
// the deferred lease releases still pending (their callbacks hold a plain pointer to the core), so
// it must not run on a device completion thread — it never does: the last reference is dropped by
// a C call or a DLPack deleter, on the caller's thread.
//
// Handles. A tier_tensor_t id is (generation << 32) | engine TensorId. Generations come from one
// process-wide counter, so a handle that was unregistered, or that belongs to another engine, is
// recognised as stale instead of naming whichever tensor now has that TensorId.
//
// Thread safety: every member may be called from any thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string_view>
#include <unordered_map>

#include "dlpack_convert.hpp"
#include "tier/ext/device.hpp"
#include "tier/engine.hpp"

namespace tier::capi {

// What the C layer remembers of a registered tensor beyond the engine's descriptor.
struct TensorMeta {
  std::uint32_t generation = 0;
  DType dtype = DType::kF32;
  int ndim = 0;
  Shape shape{};
};

class EngineCore {
 public:
  explicit EngineCore(std::unique_ptr<Engine> engine) : engine_(std::move(engine)) {}
  ~EngineCore();
  EngineCore(const EngineCore&) = delete;
  EngineCore& operator=(const EngineCore&) = delete;

  Engine& engine() noexcept { return *engine_; }

  // Records a tensor the engine has just registered and returns its handle id.
  std::uint64_t add_tensor(TensorId id, TensorMeta meta);
  // Runs fn(id, meta) with the record of a live handle, under the record lock, so that the tensor
  // cannot be unregistered (and its TensorId reused) meanwhile: fn must be quick (post, not wait).
  // kNotFound for a stale or foreign handle.
  template <class F>
  Status with_tensor(std::uint64_t handle, F&& fn) {
    std::lock_guard<std::mutex> lock(mu_);
    TIER_ASSIGN_OR_RETURN(const TensorMeta* meta, lookup(handle));
    return fn(static_cast<TensorId>(handle & 0xffffffffu), *meta);
  }
  // Unregisters the tensor from the engine and forgets its record.
  Status remove_tensor(std::uint64_t handle);
  // The handle of the tensor registered as `name`.
  Result<std::uint64_t> find(std::string_view name);

  // Ends `lease` once the work queued on `stream` so far has completed: through an event on the
  // stream and its completion callback when the device has GPU streams, here and now otherwise.
  void release_after(Lease lease, DeviceStream stream) noexcept;

 private:
  Result<const TensorMeta*> lookup(std::uint64_t handle) const;

  std::unique_ptr<Engine> engine_;
  std::mutex mu_;
  std::unordered_map<TensorId, TensorMeta> meta_;

  std::mutex release_mu_;
  std::condition_variable release_cv_;
  std::uint64_t pending_releases_ = 0;
};

// A DLPack tensor handed out by a ticket: the DLManagedTensor, the lease behind it and the storage
// its shape and strides point into. manager_ctx points here.
struct ExportedTensor {
  DLManagedTensor managed{};
  std::shared_ptr<EngineCore> core;  // declared before the lease: the lease ends first
  Lease lease;
  DeviceStream stream = nullptr;
  Shape shape{};
  Shape strides{};
};

}  // namespace tier::capi

// The opaque C handles.
struct tier_engine {
  std::shared_ptr<tier::capi::EngineCore> core;
};

struct tier_ticket {
  std::shared_ptr<tier::capi::EngineCore> core;  // declared before the future: the future goes first
  tier::AcquireFuture future;
  tier::capi::TensorMeta meta;
  tier::Tier where = tier::Tier::kHost;
  tier::Access access = tier::Access::kRead;
  tier::DeviceStream stream = nullptr;
  bool handed_out = false;
};
