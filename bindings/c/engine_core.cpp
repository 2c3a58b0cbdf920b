#include "engine_core.hpp"

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "tier/ext/device.hpp"
#include "tier/log.hpp"

namespace tier::capi {

namespace {

std::uint32_t next_generation() {
  static std::atomic<std::uint32_t> counter{0};
  std::uint32_t g;
  do {
    g = counter.fetch_add(1, std::memory_order_relaxed) + 1;
  } while (g == 0);  // id 0 is never a tensor
  return g;
}

}  // namespace

EngineCore::~EngineCore() {
  {
    std::unique_lock<std::mutex> lock(release_mu_);
    release_cv_.wait(lock, [&] { return pending_releases_ == 0; });
  }
  engine_.reset();
}

std::uint64_t EngineCore::add_tensor(TensorId id, TensorMeta meta) {
  meta.generation = next_generation();
  const std::uint64_t handle = (static_cast<std::uint64_t>(meta.generation) << 32) | id;
  std::lock_guard<std::mutex> lock(mu_);
  meta_[id] = meta;
  return handle;
}

Result<const TensorMeta*> EngineCore::lookup(std::uint64_t handle) const {
  const auto id = static_cast<TensorId>(handle & 0xffffffffu);
  const auto gen = static_cast<std::uint32_t>(handle >> 32);
  auto it = meta_.find(id);
  if (handle == 0 || it == meta_.end() || it->second.generation != gen) {
    return not_found(str("tensor handle 0x", std::hex, handle,
                         " names no registered tensor of this engine (unregistered, never registered, or from "
                         "another engine)"));
  }
  return &it->second;
}

Status EngineCore::remove_tensor(std::uint64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  TIER_ASSIGN_OR_RETURN(const TensorMeta* meta, lookup(handle));
  (void)meta;
  const auto id = static_cast<TensorId>(handle & 0xffffffffu);
  TIER_RETURN_IF_ERROR(engine_->unregister_tensor(id));
  meta_.erase(id);
  return Status::Ok();
}

Result<std::uint64_t> EngineCore::find(std::string_view name) {
  TIER_ASSIGN_OR_RETURN(TensorId id, engine_->find(name));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = meta_.find(id);
  if (it == meta_.end()) return not_found(str("no tensor named '", name, "' (its registration has not completed)"));
  return (static_cast<std::uint64_t>(it->second.generation) << 32) | id;
}

void EngineCore::release_after(Lease lease, DeviceStream stream) noexcept {
  try {
    Device& device = engine_->device();
    auto event = device.record_event(stream);
    if (!event.ok()) {
      // The consumer's stream is unusable (a bad handle or a failed context): nothing can be
      // ordered after it. End the lease now rather than never; say so loudly.
      TIER_LOG(kError, "DLPack deleter: could not record an event on the consumer's stream (",
               event.status().to_string(), "); the lease ends without waiting for that stream's work");
      lease.release().ignore();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(release_mu_);
      ++pending_releases_;
    }
    // The lease's end runs first, then this count: the engine outlives every deferred end.
    if (Status s = lease.release_after(*event); !s.ok()) lease.release().ignore();
    try {
      event->on_complete([this](const Status&) {
        std::lock_guard<std::mutex> lock(release_mu_);
        --pending_releases_;
        release_cv_.notify_all();
      });
    } catch (...) {
      std::lock_guard<std::mutex> lock(release_mu_);
      --pending_releases_;
      release_cv_.notify_all();
      throw;
    }
  } catch (...) {
    // Out of memory while deferring: the lease ends as `lease` goes out of scope, i.e. now.
    // Nothing may escape a DLPack deleter.
  }
}

}  // namespace tier::capi
