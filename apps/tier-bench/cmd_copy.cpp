// `tier-bench copy`: host-to-device and device-to-host bandwidth through the device layer, from
// and to the pinned host arena, each beside its reference measured in the same run:
//  - CUDA: plain cudaMemcpyAsync of the whole size between cudaHostAlloc'd and cudaMalloc'd
//    memory (the target: the device layer reaches at least 0.9 of it);
//  - emulated with a bandwidth limit: the limit (target: within 5%);
//  - emulated without one: a one-thread memcpy of the same size (what a copy worker can do).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "tier/ext/cuda_reference.hpp"
#include "tier/ext/cuda_probe.hpp"
#include "tier/ext/device.hpp"
#include "tier/ext/host_arena.hpp"
#include "tier/stats.hpp"
#include "tier/units.hpp"

namespace tier::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct CopyOptions {
  DeviceKind kind = DeviceKind::kAuto;
  std::uint64_t bytes = 256ull << 20;
  std::uint64_t chunk = 64ull << 20;
  int reps = 3;
  EmulatedDeviceConfig emulated;
  bool progress = true;
};

struct CopyFigures {
  std::string device;
  std::string detail;
  DeviceKind kind = DeviceKind::kEmulated;
  double h2d = 0;  // bytes per second, best of reps, wall clock from first submit to last completion
  double d2h = 0;
  double h2d_busy = 0;  // bytes / link busy time over all reps (Counters)
  double d2h_busy = 0;
  std::string reference;  // "cudaMemcpyAsync", "limit" or "memcpy (1 thread)"
  double ref_h2d = 0;
  double ref_d2h = 0;
  double h2d_ratio() const { return ref_h2d > 0 ? h2d / ref_h2d : 0; }
  double d2h_ratio() const { return ref_d2h > 0 ? d2h / ref_d2h : 0; }
};

// Best of `reps` one-thread memcpy calls of `bytes` between the two blocks.
double memcpy_rate(std::byte* dst, const std::byte* src, std::uint64_t bytes, int reps) {
  double best = 0;
  for (int i = 0; i <= reps; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(dst, src, bytes);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (i > 0 && s > 0) best = std::max(best, static_cast<double>(bytes) / s);
  }
  return best;
}

Result<CopyFigures> measure(const CopyOptions& o) {
  Counters counters;
  DeviceOptions dopt;
  dopt.kind = o.kind;
  dopt.budget_bytes = 0;  // auto: the device's own
  dopt.emulated = o.emulated;
  dopt.counters = &counters;
  // The arena first: it must outlive the device, which unregisters it when destroyed.
  TIER_ASSIGN_OR_RETURN(auto arena, HostArena::create({2 * o.bytes, HugePageMode::kAuto, true}));
  TIER_ASSIGN_OR_RETURN(std::unique_ptr<Device> dev, create_device(dopt));
  TIER_RETURN_IF_ERROR(dev->register_host(arena->base(), arena->capacity()));
  TIER_ASSIGN_OR_RETURN(HostBlock in, arena->allocate(o.bytes));
  TIER_ASSIGN_OR_RETURN(HostBlock out, arena->allocate(o.bytes));
  TIER_ASSIGN_OR_RETURN(DeviceBuffer buf, dev->allocate(o.bytes));
  auto* words = reinterpret_cast<std::uint64_t*>(in.data());
  for (std::uint64_t i = 0; i < o.bytes / 8; ++i) words[i] = i * 0x9e3779b97f4a7c15ull;
  std::memset(out.data(), 0, o.bytes);

  Progress progress("copy " + dev->info().name, 2 * o.bytes * static_cast<std::uint64_t>(o.reps + 1), true, o.progress);
  std::uint64_t moved = 0;
  // One pass over the buffer in chunks, submitted back to back; timed to the last completion.
  auto pass = [&](CopyDirection dir) -> Result<double> {
    const auto t0 = Clock::now();
    DeviceEvent last;
    for (std::uint64_t off = 0; off < o.bytes; off += o.chunk) {
      const std::uint64_t n = std::min(o.chunk, o.bytes - off);
      Result<DeviceEvent> e = dir == CopyDirection::kHostToDevice ? dev->copy_to_device(buf, off, in.data() + off, n)
                                                                  : dev->copy_to_host(out.data() + off, buf, off, n);
      if (!e.ok()) return e.status();
      last = *e;
    }
    TIER_RETURN_IF_ERROR(last.wait());
    moved += o.bytes;
    progress.update(moved);
    return static_cast<double>(o.bytes) / std::chrono::duration<double>(Clock::now() - t0).count();
  };
  CopyFigures f;
  f.device = dev->info().name;
  f.detail = dev->info().detail;
  f.kind = dev->info().kind;
  for (CopyDirection dir : {CopyDirection::kHostToDevice, CopyDirection::kDeviceToHost}) {
    const bool h2d = dir == CopyDirection::kHostToDevice;
    double& best = h2d ? f.h2d : f.d2h;
    TIER_RETURN_IF_ERROR(pass(dir).status());  // warm-up: page faults, first touch of device memory
    const StatsSnapshot before = counters.snapshot();
    for (int i = 0; i < o.reps; ++i) {
      TIER_ASSIGN_OR_RETURN(double bps, pass(dir));
      best = std::max(best, bps);
    }
    const LinkUsage timed = counters.snapshot().since(before).link(h2d ? Link::kHostToDevice : Link::kDeviceToHost);
    (h2d ? f.h2d_busy : f.d2h_busy) = timed.bytes_per_second();
  }
  progress.finish();
  if (std::memcmp(in.data(), out.data(), o.bytes) != 0) {
    return data_loss(str(f.device, ": bytes copied to the device and back differ from the original"));
  }

  if (f.kind == DeviceKind::kCuda) {
    TIER_ASSIGN_OR_RETURN(auto ref, measure_cuda_memcpy(dev->info().device_id, o.bytes, o.reps));
    f.reference = "cudaMemcpyAsync";
    f.ref_h2d = ref.h2d_bytes_per_second;
    f.ref_d2h = ref.d2h_bytes_per_second;
  } else if (o.emulated.h2d_bytes_per_second || o.emulated.d2h_bytes_per_second) {
    f.reference = "limit";
    f.ref_h2d = static_cast<double>(o.emulated.h2d_bytes_per_second);
    f.ref_d2h = static_cast<double>(o.emulated.d2h_bytes_per_second);
  } else {
    f.reference = "memcpy (1 thread)";
    f.ref_h2d = memcpy_rate(out.data(), in.data(), o.bytes, o.reps);
    f.ref_d2h = f.ref_h2d;
  }
  return f;
}

std::string reference_text(const CopyFigures& f, double ref) {
  if (ref <= 0) return f.reference == "limit" ? "unlimited" : "";
  return f.reference + " " + format_rate(ref);
}

int run_copy(Args& args) {
  CopyOptions o;
  auto kind = args.choice("device", {"auto", "cuda", "emulated"}, "auto");
  auto bytes = args.size("size", o.bytes);
  auto chunk = args.size("chunk", o.chunk);
  auto reps = args.integer("reps", o.reps);
  auto h2d = args.number("h2d-gbps", 0);
  auto d2h = args.number("d2h-gbps", 0);
  auto latency = args.number("latency-us", 0);
  const bool json_out = args.flag("json");
  const bool quiet = args.flag("quiet");
  Status s = args.finish();
  for (const Status& e :
       {kind.status(), bytes.status(), chunk.status(), reps.status(), h2d.status(), d2h.status(), latency.status()}) {
    if (s.ok() && !e.ok()) s = e;
  }
  if (s.ok() && (*bytes < 4096 || *chunk < 1)) s = invalid_argument("--size must be at least 4K and --chunk positive");
  if (s.ok() && (*reps < 1 || *reps > 1000)) s = invalid_argument("--reps must be from 1 to 1000");
  if (s.ok() && (*h2d < 0 || *d2h < 0 || *latency < 0)) {
    s = invalid_argument("--h2d-gbps, --d2h-gbps and --latency-us must not be negative");
  }
  const bool limited = s.ok() && (*h2d > 0 || *d2h > 0 || *latency > 0);
  if (s.ok() && limited && *kind == "cuda") {
    s = invalid_argument(
        "--h2d-gbps, --d2h-gbps and --latency-us pace the emulated device; drop them or use "
        "--device emulated");
  }
  if (!s.ok()) {
    std::fprintf(stderr, "tier-bench copy: %s\n", s.message().c_str());
    return 2;
  }
  o.kind = *kind == "cuda"                  ? DeviceKind::kCuda
           : *kind == "emulated" || limited ? DeviceKind::kEmulated
                                            : DeviceKind::kAuto;
  o.bytes = *bytes;
  o.chunk = std::min(*chunk, *bytes);
  o.reps = static_cast<int>(*reps);
  o.emulated.h2d_bytes_per_second = static_cast<std::uint64_t>(*h2d * 1e9);
  o.emulated.d2h_bytes_per_second = static_cast<std::uint64_t>(*d2h * 1e9);
  o.emulated.latency_us = *latency;
  o.progress = !quiet && !json_out;
  auto f = measure(o);
  if (!f.ok()) {
    std::fprintf(stderr, "tier-bench copy: %s\n", f.status().to_string().c_str());
    return 1;
  }
  if (json_out) {
    nlohmann::ordered_json j = {{"device", f->device},
                                {"device_detail", f->detail},
                                {"bytes", o.bytes},
                                {"chunk_bytes", o.chunk},
                                {"reps", o.reps},
                                {"bytes_per_second", f->h2d},
                                {"h2d_bytes_per_second", f->h2d},
                                {"d2h_bytes_per_second", f->d2h},
                                {"h2d_busy_bytes_per_second", f->h2d_busy},
                                {"d2h_busy_bytes_per_second", f->d2h_busy},
                                {"reference", f->reference},
                                {"reference_h2d_bytes_per_second", f->ref_h2d},
                                {"reference_d2h_bytes_per_second", f->ref_d2h},
                                {"h2d_ratio", f->h2d_ratio()},
                                {"d2h_ratio", f->d2h_ratio()},
                                {"verified", true}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("device: %s\n        %s\n\n", f->device.c_str(), f->detail.c_str());
  Table t({"direction", "size / chunk", "achieved (best of " + std::to_string(o.reps) + ")", "link busy rate",
           "reference (same run)", "ratio"});
  t.add({"host -> device", format_bytes(o.bytes) + " / " + format_bytes(o.chunk), format_rate(f->h2d),
         format_rate(f->h2d_busy), reference_text(*f, f->ref_h2d), f->ref_h2d > 0 ? fmt(f->h2d_ratio(), 3) : ""});
  t.add({"device -> host", format_bytes(o.bytes) + " / " + format_bytes(o.chunk), format_rate(f->d2h),
         format_rate(f->d2h_busy), reference_text(*f, f->ref_d2h), f->ref_d2h > 0 ? fmt(f->d2h_ratio(), 3) : ""});
  t.print();
  return 0;
}

const CommandRegistrar kRegister(
    {"copy", "host<->device copy bandwidth from the pinned arena, beside cudaMemcpyAsync or the emulated limit",
     "  --device D       auto (default), cuda or emulated\n"
     "  --size N         bytes per pass (default 256M)\n"
     "  --chunk N        bytes per copy, submitted back to back (default 64M)\n"
     "  --reps N         timed passes per direction, best taken (default 3)\n"
     "  --h2d-gbps X     emulated device: host-to-device limit in GB/s (implies --device emulated)\n"
     "  --d2h-gbps X     emulated device: device-to-host limit in GB/s\n"
     "  --latency-us X   emulated device: latency added to every copy\n"
     "  --quiet          no progress line\n"
     "  --json           print one JSON object (bytes_per_second: host-to-device)",
     run_copy});

SummaryRow row(const char* dir, const CopyFigures& f, double got, double ref, std::uint64_t bytes) {
  return {std::string(dir) + " copy (" + f.device + ")", format_rate(got), reference_text(f, ref),
          ref > 0 ? got / ref : 0, format_bytes(bytes) + " from the pinned arena"};
}

const SummaryRegistrar kSummary({50, "device copies", [](bool quick) -> Result<std::vector<SummaryRow>> {
                                   CopyOptions o;
                                   o.progress = false;
                                   const bool cuda = probe_cuda().usable();
                                   o.bytes = cuda ? (quick ? 256ull << 20 : 1ull << 30)
                                                  : (quick ? 64ull << 20 : 256ull << 20);
                                   o.chunk = cuda ? 64ull << 20 : 16ull << 20;
                                   o.reps = quick ? 2 : 3;
                                   TIER_ASSIGN_OR_RETURN(CopyFigures f, measure(o));
                                   std::vector<SummaryRow> rows = {row("host->device", f, f.h2d, f.ref_h2d, o.bytes),
                                                                   row("device->host", f, f.d2h, f.ref_d2h, o.bytes)};
                                   return rows;
                                 }});

}  // namespace
}  // namespace tier::bench
