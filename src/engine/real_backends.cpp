// Engine::create: the engine over the real tiers — the Device (CUDA or emulated), the pinned
// HostArena and the NVMe SwapSpace — and the Mover that drives their asynchronous copies.
#include <sys/sysinfo.h>

#include <atomic>
#include <cstring>

#include "engine/backend.hpp"
#include "tier/ext/device.hpp"
#include "tier/engine.hpp"
#include "tier/ext/host_arena.hpp"
#include "tier/log.hpp"
#include "tier/ext/swap_space.hpp"
#include "tier/units.hpp"

namespace tier {

namespace detail {
std::uint64_t padded(std::uint64_t bytes) {
  return (bytes + 4095) & ~std::uint64_t{4095};
}
}  // namespace detail

namespace {

using detail::Buffer;

struct Owned {
  std::unique_ptr<HostArena> arena;  // destroyed last: the device and swap space register it
  std::unique_ptr<Device> device;
  std::unique_ptr<nvme::SwapSpace> swap;
  std::uint64_t device_listener = 0;                // the arena's commit listener registering it with the device
  std::atomic<std::uint64_t> device_registered{0};  // arena bytes registered with the device
  ~Owned() {
    swap.reset();
    if (device_listener != 0) arena->remove_commit_listener(device_listener);
    device.reset();
    arena.reset();
  }
};

class DeviceStore : public detail::TierStore {
 public:
  explicit DeviceStore(Device* d) : d_(d) {}
  Result<Buffer> allocate(std::uint64_t bytes) override {
    auto b = d_->allocate(bytes, std::chrono::milliseconds(0));
    if (!b.ok()) {
      if (b.status().code() == StatusCode::kTimedOut) return resource_exhausted(b.status().message());
      return b.status();
    }
    auto holder = std::make_shared<DeviceBuffer>(std::move(b).value());
    Buffer out;
    out.ptr = holder->data();
    out.bytes = bytes;
    out.holder = holder;
    return out;
  }
  std::uint64_t capacity() const override { return d_->memory_stats().budget_bytes; }
  std::string describe() const override { return d_->info().name; }
  bool reports_resident() const override { return true; }  // the caching allocator counts its blocks

 private:
  Device* d_;
};

class HostStore : public detail::TierStore {
 public:
  HostStore(HostArena* a, std::uint64_t capacity) : a_(a), capacity_(capacity) {}
  Result<Buffer> allocate(std::uint64_t bytes) override {
    auto b = a_->try_allocate(bytes);
    if (!b.ok()) return b.status();
    auto holder = std::make_shared<HostBlock>(std::move(b).value());
    Buffer out;
    out.ptr = holder->data();
    out.bytes = bytes;
    out.holder = holder;
    return out;
  }
  std::uint64_t footprint(std::uint64_t bytes) const override { return detail::padded(bytes); }
  std::uint64_t capacity() const override { return capacity_; }
  std::string describe() const override { return str("pinned host arena, ", format_bytes(capacity_)); }

 private:
  HostArena* a_;
  std::uint64_t capacity_;
};

class NvmeStore : public detail::TierStore {
 public:
  NvmeStore(nvme::SwapSpace* s, std::uint64_t capacity) : s_(s), capacity_(capacity) {}
  Result<Buffer> allocate(std::uint64_t bytes) override {
    auto e = s_->allocate(detail::padded(bytes));
    if (!e.ok()) return e.status();
    auto holder = std::make_shared<nvme::SwapExtent>(std::move(e).value());
    Buffer out;
    out.bytes = bytes;
    out.holder = holder;
    return out;
  }
  std::uint64_t footprint(std::uint64_t bytes) const override { return detail::padded(bytes); }
  std::uint64_t capacity() const override { return capacity_; }
  std::string describe() const override { return str("swap space, ", format_bytes(capacity_)); }

 private:
  nvme::SwapSpace* s_;
  std::uint64_t capacity_;
};

class RealMover : public detail::Mover {
 public:
  RealMover(Device* d, HostArena* a, nvme::SwapSpace* s) : d_(d), a_(a), s_(s) {}

  DeviceEvent move(Tier from, const Buffer& src, Tier to, const Buffer& dst, std::uint64_t bytes,
                   detail::Done done) override {
    // The engine keeps both buffers alive until `done`; the extra references here only guard against
    // misuse, and are dropped before `done` so that storage freed by the engine is free at once.
    auto finish = [done, keep_src = src.holder, keep_dst = dst.holder](const Status& s) mutable {
      keep_src.reset();
      keep_dst.reset();
      done(s);
    };
    // NVMe transfers move whole 4 KiB sectors (O_DIRECT): extents and host blocks are both
    // padded to 4 KiB, and the padding carries no tensor bytes.
    if (from == Tier::kNvme && to == Tier::kHost) {
      auto* ext = static_cast<nvme::SwapExtent*>(src.holder.get());
      s_->read(*ext, dst.ptr, detail::padded(bytes)).on_complete(finish);
    } else if (from == Tier::kHost && to == Tier::kNvme) {
      auto* ext = static_cast<nvme::SwapExtent*>(dst.holder.get());
      s_->write(*ext, src.ptr, detail::padded(bytes)).on_complete(finish);
    } else if (from == Tier::kHost && to == Tier::kDevice) {
      auto* buf = static_cast<DeviceBuffer*>(dst.holder.get());
      auto ev = d_->copy_to_device(*buf, 0, src.ptr, bytes);
      if (!ev.ok()) {
        done(ev.status());
        return DeviceEvent{};
      }
      ev->on_complete(finish);
      return *ev;
    } else if (from == Tier::kDevice && to == Tier::kHost) {
      auto* buf = static_cast<DeviceBuffer*>(src.holder.get());
      auto ev = d_->copy_to_host(dst.ptr, *buf, 0, bytes);
      if (!ev.ok()) {
        done(ev.status());
        return DeviceEvent{};
      }
      ev->on_complete(finish);
      return *ev;
    } else {
      done(internal_error(str("no link from ", tier_name(from), " to ", tier_name(to))));
    }
    return DeviceEvent{};
  }

  Status zero(Tier tier, const Buffer& dst, std::uint64_t bytes) override {
    if (tier == Tier::kHost) {
      std::memset(dst.ptr, 0, bytes);
      return Status::Ok();
    }
    if (tier != Tier::kDevice) return internal_error("zero fill is for host and device copies");
    // Through a zeroed staging block, in pieces: device memory is not host-addressable on a GPU.
    auto* buf = static_cast<DeviceBuffer*>(dst.holder.get());
    const std::uint64_t piece = std::min<std::uint64_t>(bytes, 16u << 20);
    TIER_ASSIGN_OR_RETURN(HostBlock zeros, a_->allocate(piece));
    std::memset(zeros.data(), 0, zeros.size());
    for (std::uint64_t off = 0; off < bytes; off += piece) {
      TIER_ASSIGN_OR_RETURN(DeviceEvent ev, d_->copy_to_device(*buf, off, zeros.data(), std::min(piece, bytes - off)));
      TIER_RETURN_IF_ERROR(ev.wait());
    }
    return Status::Ok();
  }

  Status sync() override { return s_ ? s_->flush() : Status::Ok(); }

 private:
  Device* d_;
  HostArena* a_;
  nvme::SwapSpace* s_;
};

std::uint64_t physical_memory() {
  struct sysinfo si {};
  if (sysinfo(&si) != 0) return 8ull << 30;
  return static_cast<std::uint64_t>(si.totalram) * si.mem_unit;
}

bool wants_nvme(const EngineConfig& c) {
  return c.offload_param.device == OffloadDevice::kNvme || c.offload_optimizer.device == OffloadDevice::kNvme ||
         !c.tier.swap_paths.empty() || c.tier.nvme_budget != 0;
}

}  // namespace

Result<std::unique_ptr<Engine>> Engine::create(const EngineConfig& config) {
  return detail::create_engine(config, detail::EngineHooks{});
}

Result<std::unique_ptr<Engine>> detail::create_engine(const EngineConfig& config, const EngineHooks& hooks) {
  TIER_RETURN_IF_ERROR(config.validate());
  set_log_level(config.tier.log_level);
  auto counters = std::make_shared<Counters>();
  if (!config.tier.trace_file.empty()) counters->start_trace();
  auto owned = std::make_shared<Owned>();
  detail::Backends b;

  // Host: the pinned arena holds host copies and staging; auto is a quarter of physical memory.
  // An auto budget is a cap, not a reservation: pinning, faulting in and registering a quarter of
  // the machine's memory at start takes tens of seconds, so that arena is lazy: each 64 MiB extent
  // is locked, faulted in and registered (device, io_uring fixed buffers) the first time a block
  // reaches into it. An explicit budget is a reservation: committed whole at start, so a machine
  // that cannot pin it says so at once, and io_uring gets it as a few large fixed buffers.
  const bool host_auto = config.tier.host_budget == 0;
  const std::uint64_t host_budget = host_auto ? physical_memory() / 4 : config.tier.host_budget;
  HostArenaOptions ao;
  ao.bytes = host_budget;
  ao.huge_pages = config.tier.huge_pages;
  ao.lock = true;
  ao.prefault = true;
  ao.lazy = host_auto;
  auto arena = HostArena::create(ao);
  if (!arena.ok()) return arena.status().with_context("engine: host tier (tier.budgets.host)");
  owned->arena = std::move(arena).value();
  std::string host_info = str("pinned arena ", format_bytes(owned->arena->capacity()));
  if (host_auto) {
    host_info = str("arena ", format_bytes(owned->arena->capacity()), " (auto budget: pinned and registered in ",
                    format_bytes(owned->arena->extent_bytes()), " extents as it fills)");
  } else if (!owned->arena->locked()) {
    host_info += " (not locked: mlock refused)";
  }
  counters->set_info("host", host_info);

  // Device: registers each committed extent of the arena (the whole arena for an explicit budget).
  auto device = create_device(config, counters.get());
  if (!device.ok()) return device.status().with_context("engine: device tier");
  owned->device = std::move(device).value();
  owned->device_listener = owned->arena->add_commit_listener(
      [dev = owned->device.get(), registered = &owned->device_registered](std::byte* p, std::uint64_t n) {
        if (Status s = dev->register_host(p, n); !s.ok()) {
          log_once("engine.register_host", LogLevel::kWarn,
                   str("engine: could not register the host arena with the device (", s.to_string(),
                       "); copies stay correct but may be slower"));
          return;
        }
        registered->fetch_add(n, std::memory_order_relaxed);
      });

  // NVMe, when anything may live there.
  if (wants_nvme(config)) {
    const auto paths = config.resolved_swap_paths();
    if (paths.empty()) {
      return invalid_argument(
          "engine: the NVMe tier needs a directory: set zero_optimization.offload_param.nvme_path "
          "or tier.swap_paths");
    }
    // The budget caps the swap files, which grow with what they hold (tier.io.preallocate
    // reserves it whole up front). Auto: each path's free space, or with preallocation a bounded
    // guess (the model's size is unknown here).
    std::uint64_t total = config.tier.nvme_budget;
    if (total == 0 && config.tier.io.preallocate) total = std::min<std::uint64_t>(64ull << 30, 4 * host_budget);
    const std::uint64_t per_path = total == 0 ? 0 : (total / paths.size() + 4095) & ~std::uint64_t{4095};
    auto so = nvme::SwapSpaceOptions::from_config(config, per_path, owned->arena.get(), counters.get());
    if (hooks.wrap_io_engine) so.wrap_engine = hooks.wrap_io_engine;
    auto swap = nvme::SwapSpace::create(so);
    if (!swap.ok()) return swap.status().with_context("engine: NVMe tier");
    owned->swap = std::move(swap).value();
    b.stores[static_cast<int>(Tier::kNvme)] =
        std::make_unique<NvmeStore>(owned->swap.get(), owned->swap->stats().capacity_bytes);
  }

  b.stores[static_cast<int>(Tier::kDevice)] = std::make_unique<DeviceStore>(owned->device.get());
  b.stores[static_cast<int>(Tier::kHost)] = std::make_unique<HostStore>(owned->arena.get(), owned->arena->capacity());
  b.mover = std::make_unique<RealMover>(owned->device.get(), owned->arena.get(), owned->swap.get());
  b.device = owned->device.get();
  b.arena = owned->arena.get();
  b.swap = owned->swap.get();
  b.host_pinning = [o = owned.get()](TierUsage& u) {
    u.pinned_bytes = o->arena->pinned_bytes();
    u.device_registered_bytes = o->device_registered.load(std::memory_order_relaxed);
    u.io_registered_bytes = o->swap ? o->swap->stats().fixed_buffer_bytes : 0;
  };
  b.owner = owned;
  return detail::make_engine(config, std::move(b), std::move(counters));
}

}  // namespace tier
