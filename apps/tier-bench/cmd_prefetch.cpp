// `tier-bench prefetch`: a synthetic training step over N layers whose params live on NVMe, with
// a device that holds only a few layers and a paced host-to-device link, run through the engine's
// prefetch scheduler. It reports how much of the transfer time compute hides.
#include <algorithm>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "read_reference.hpp"
#include "tier/engine.hpp"
#include "tier/units.hpp"

namespace tier::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct PrefetchResult {
  double step_seconds = 0;    // mean over the steps after the first
  double stall_fraction = 0;  // stall time / compute time over the steps after the first
  double stall_seconds_per_step = 0;
  double compute_bound_seconds = 0;   // compute per step
  double transfer_bound_seconds = 0;  // slowest link's busy-at-its-rate time per step
  double h2d_bytes_per_step = 0;
  double nvme_bytes_per_step = 0;
  double nvme_read_bytes_per_second = 0;  // the engine's own: bytes over the link's busy time
  ReadReference nvme_reference;           // measured outside the engine: what the bound uses
  double first_step_seconds = 0;
  double nvme_busy_per_step = 0, h2d_busy_per_step = 0;
  double prefetch_hits = 0, late_prefetches = 0, acquires = 0;
  std::string io_engine;
};

struct PrefetchOptions {
  std::string path;
  int layers = 32;
  std::uint64_t layer_bytes = 64ull << 20;
  double compute_ms = 20;
  double h2d_gbps = 4;
  int steps = 4;
  int device_layers = 4;
  int host_layers = 8;
  int lookahead = 0;
  bool prefetch = true;
  bool progress = true;
};

Result<PrefetchResult> run_prefetch(const PrefetchOptions& o) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(o.path) / str("tier-bench-prefetch-", ::getpid());
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return invalid_argument(str("--path ", o.path, ": cannot create ", dir.string(), ": ", ec.message()));
  struct Cleanup {
    fs::path p;
    ~Cleanup() {
      std::error_code e;
      fs::remove_all(p, e);
    }
  } cleanup{dir};

  EngineConfig cfg;
  cfg.tier.device = DeviceKind::kEmulated;
  cfg.tier.emulated.h2d_bytes_per_second = static_cast<std::uint64_t>(o.h2d_gbps * 1e9);
  cfg.tier.device_budget = o.layer_bytes * static_cast<std::uint64_t>(o.device_layers);
  cfg.tier.host_budget = o.layer_bytes * static_cast<std::uint64_t>(o.host_layers);
  cfg.tier.nvme_budget = o.layer_bytes * static_cast<std::uint64_t>(o.layers) + (64ull << 20);
  cfg.tier.swap_paths = {dir.string()};
  cfg.tier.prefetch.enabled = o.prefetch;
  cfg.tier.prefetch.lookahead = o.lookahead;
  cfg.offload_param.device = OffloadDevice::kNvme;
  TIER_ASSIGN_OR_RETURN(auto engine, Engine::create(cfg));

  std::vector<TensorId> ids;
  for (int i = 0; i < o.layers; ++i) {
    TIER_ASSIGN_OR_RETURN(TensorId id, engine->register_tensor(
                                           {str("layer", i), DType::kU8, o.layer_bytes, Role::kParam, i}, Tier::kNvme));
    ids.push_back(id);
  }
  // Give every layer real bytes on disk (a never-written tensor would read as zeros without I/O).
  {
    Progress fill("writing layers to NVMe", static_cast<std::uint64_t>(o.layers) * o.layer_bytes, true, o.progress);
    std::vector<std::uint8_t> bytes(o.layer_bytes);
    for (int i = 0; i < o.layers; ++i) {
      for (std::uint64_t k = 0; k < o.layer_bytes; k += 4096) bytes[k] = static_cast<std::uint8_t>(i + k);
      TIER_RETURN_IF_ERROR(engine->write(ids[i], bytes.data()));
      fill.update(static_cast<std::uint64_t>(i + 1) * o.layer_bytes);
    }
    TIER_RETURN_IF_ERROR(engine->flush());
  }

  PrefetchResult r;
  // The NVMe bound is judged against the disk's own sequential read rate over the bytes just
  // written, measured here with nothing of the engine in flight, not against the engine's reads:
  // the best over request shapes around the engine's (blocks of aio.block_size, 1 MiB and 4 MiB,
  // at aio.queue_depth and 4x and 16x that depth: the engine keeps several tensors' requests in
  // flight at once, so its own shape is a floor, not the disk's ceiling), best of 2 passes each.
  // The best shape is measured again after the steps (the disk may still be absorbing the writes
  // that filled the layers when the search runs, and its rate drifts), and the best of all is the
  // reference.
  const std::uint64_t layers_bytes = static_cast<std::uint64_t>(o.layers) * o.layer_bytes;
  TIER_ASSIGN_OR_RETURN(
      r.nvme_reference,
      best_sequential_read(dir.string(), layers_bytes, reference_shapes(cfg.aio.block_size, cfg.aio.queue_depth)));
  const auto compute = std::chrono::duration<double, std::milli>(o.compute_ms);
  Progress prog("training steps", static_cast<std::uint64_t>(o.steps), false, o.progress);
  StatsSnapshot after_first;
  Clock::time_point t_after_first;
  for (int step = 0; step < o.steps; ++step) {
    const auto t0 = Clock::now();
    engine->begin_step();
    auto pass = [&](int i) -> Status {
      TIER_ASSIGN_OR_RETURN(Lease lease, engine->acquire_now(ids[i], Tier::kDevice, Access::kRead));
      std::this_thread::sleep_for(compute);  // the layer's compute
      return lease.release();
    };
    for (int i = 0; i < o.layers; ++i) TIER_RETURN_IF_ERROR(pass(i));       // forward
    for (int i = o.layers - 1; i >= 0; --i) TIER_RETURN_IF_ERROR(pass(i));  // backward
    engine->end_step();
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    if (step == 0) {
      r.first_step_seconds = secs;
      after_first = engine->stats();
      t_after_first = Clock::now();
    }
    prog.update(static_cast<std::uint64_t>(step + 1));
  }
  prog.finish();
  const int measured = o.steps - 1;
  const auto d = engine->stats().since(after_first);
  const double compute_total = 2.0 * o.layers * o.compute_ms / 1000.0 * measured;
  r.step_seconds = std::chrono::duration<double>(Clock::now() - t_after_first).count() / measured;
  TIER_ASSIGN_OR_RETURN(r.nvme_reference, measure_again(r.nvme_reference, dir.string(), layers_bytes));
  r.stall_seconds_per_step = d.metrics.at("engine.stall_seconds") / measured;
  r.stall_fraction = d.metrics.at("engine.stall_seconds") / compute_total;
  r.compute_bound_seconds = compute_total / measured;
  r.h2d_bytes_per_step = static_cast<double>(d.link(Link::kHostToDevice).bytes) / measured;
  r.nvme_bytes_per_step = static_cast<double>(d.link(Link::kNvmeToHost).bytes) / measured;
  r.nvme_busy_per_step = d.link(Link::kNvmeToHost).busy_seconds / measured;
  r.h2d_busy_per_step = d.link(Link::kHostToDevice).busy_seconds / measured;
  const LinkUsage nvme = engine->stats().link(Link::kNvmeToHost);
  r.nvme_read_bytes_per_second = nvme.bytes_per_second();
  const double h2d_time = r.h2d_bytes_per_step / (o.h2d_gbps * 1e9);
  const double nvme_rate = r.nvme_reference.bytes_per_second;
  const double nvme_time = nvme_rate > 0 ? r.nvme_bytes_per_step / nvme_rate : 0;
  r.transfer_bound_seconds = std::max(h2d_time, nvme_time);
  r.prefetch_hits = d.metrics.at("prefetch.hits");
  r.late_prefetches = d.metrics.at("prefetch.late");
  r.acquires = d.metrics.at("engine.acquires");
  auto io = d.info.find("io_engine");
  r.io_engine = io == d.info.end() ? "" : io->second;
  return r;
}

int run_prefetch_cmd(Args& args) {
  PrefetchOptions o;
  o.path = args.get("path", ".");
  auto layers = args.integer("layers", o.layers);
  auto layer_bytes = args.size("layer-bytes", o.layer_bytes);
  auto compute_ms = args.number("compute-ms", o.compute_ms);
  auto h2d = args.number("h2d-gbps", o.h2d_gbps);
  auto steps = args.integer("steps", o.steps);
  auto device_layers = args.integer("device-layers", o.device_layers);
  auto host_layers = args.integer("host-layers", o.host_layers);
  auto lookahead = args.integer("lookahead", 0);
  o.prefetch = !args.flag("no-prefetch");
  const bool json_out = args.flag("json");
  o.progress = !json_out && !args.flag("quiet");
  Status s = args.finish();
  for (const Status& e : {layers.status(), layer_bytes.status(), compute_ms.status(), h2d.status(), steps.status(),
                          device_layers.status(), host_layers.status(), lookahead.status()}) {
    if (s.ok() && !e.ok()) s = e;
  }
  if (s.ok()) {
    o.layers = static_cast<int>(*layers);
    o.layer_bytes = *layer_bytes;
    o.compute_ms = *compute_ms;
    o.h2d_gbps = *h2d;
    o.steps = static_cast<int>(*steps);
    o.device_layers = static_cast<int>(*device_layers);
    o.host_layers = static_cast<int>(*host_layers);
    o.lookahead = static_cast<int>(*lookahead);
    if (o.layers < 2) s = invalid_argument("--layers must be at least 2");
    if (o.steps < 2) s = invalid_argument("--steps must be at least 2 (the first one records the trace)");
    if (o.device_layers < 2 || o.device_layers > o.layers) s = invalid_argument("--device-layers must be 2..layers");
    if (o.host_layers < 2) s = invalid_argument("--host-layers must be at least 2");
    if (!(o.h2d_gbps > 0) || !(o.compute_ms >= 0)) s = invalid_argument("--h2d-gbps must be > 0, --compute-ms >= 0");
    if (o.layer_bytes < 4096) s = invalid_argument("--layer-bytes must be at least 4K");
  }
  if (!s.ok()) {
    std::fprintf(stderr, "tier-bench prefetch: %s\n", s.message().c_str());
    return 2;
  }
  auto r = run_prefetch(o);
  if (!r.ok()) {
    std::fprintf(stderr, "tier-bench prefetch: %s\n", r.status().to_string().c_str());
    return 1;
  }
  const double bound = std::max(r->transfer_bound_seconds, r->compute_bound_seconds);
  if (json_out) {
    nlohmann::ordered_json j = {{"layers", o.layers},
                                {"layer_bytes", o.layer_bytes},
                                {"compute_ms", o.compute_ms},
                                {"h2d_gbps", o.h2d_gbps},
                                {"device_layers", o.device_layers},
                                {"host_layers", o.host_layers},
                                {"steps", o.steps},
                                {"prefetch", o.prefetch},
                                {"io_engine", r->io_engine},
                                {"nvme_path_is_tmpfs", !in_memory_paths({o.path}).empty()},
                                {"step_seconds", r->step_seconds},
                                {"first_step_seconds", r->first_step_seconds},
                                {"stall_fraction", r->stall_fraction},
                                {"stall_seconds_per_step", r->stall_seconds_per_step},
                                {"transfer_bound_seconds", r->transfer_bound_seconds},
                                {"compute_bound_seconds", r->compute_bound_seconds},
                                {"step_over_bound", r->step_seconds / bound},
                                {"h2d_bytes_per_step", r->h2d_bytes_per_step},
                                {"nvme_bytes_per_step", r->nvme_bytes_per_step},
                                {"nvme_read_bytes_per_step", r->nvme_bytes_per_step},
                                {"nvme_read_bytes_per_second", r->nvme_read_bytes_per_second},
                                {"reference_nvme_read_bytes_per_second", r->nvme_reference.bytes_per_second},
                                {"nvme_reference_bytes_per_second", r->nvme_reference.bytes_per_second},
                                {"reference_nvme_read", r->nvme_reference.describe()},
                                {"nvme_busy_seconds_per_step", r->nvme_busy_per_step},
                                {"h2d_busy_seconds_per_step", r->h2d_busy_per_step},
                                {"acquires", r->acquires},
                                {"prefetch_hits", r->prefetch_hits},
                                {"late_prefetches", r->late_prefetches}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  Table t({"figure", "value", "note"});
  t.add({"step", format_seconds(r->step_seconds),
         str("mean of steps 2..", o.steps, "; first ", format_seconds(r->first_step_seconds), " (recording)")});
  t.add({"compute bound", format_seconds(r->compute_bound_seconds),
         str(2 * o.layers, " layer passes x ", o.compute_ms, " ms")});
  t.add({"transfer bound", format_seconds(r->transfer_bound_seconds),
         str(format_bytes(static_cast<std::uint64_t>(r->h2d_bytes_per_step)), " h2d at ", o.h2d_gbps, " GB/s, ",
             format_bytes(static_cast<std::uint64_t>(r->nvme_bytes_per_step)), " from NVMe at ",
             format_rate(r->nvme_reference.bytes_per_second), " (reference)")});
  t.add({"NVMe read reference", format_rate(r->nvme_reference.bytes_per_second),
         str(r->nvme_reference.describe(), " of ", format_bytes(r->nvme_reference.bytes_read),
             ", best of the request shapes tried, outside the engine; the engine's own reads ran at ",
             format_rate(r->nvme_read_bytes_per_second))});
  t.add({"step / max(bounds)", fmt(r->step_seconds / bound, 3), "1.0 is perfect overlap"});
  t.add({"stall fraction", fmt(r->stall_fraction, 3), "stall time / compute time"});
  t.add({"prefetch hits", str(static_cast<int>(r->prefetch_hits), " of ", static_cast<int>(r->acquires)),
         str(static_cast<int>(r->late_prefetches), " late (in flight when acquired)")});
  t.print();
  warn_in_memory_paths({o.path});
  return 0;
}

const CommandRegistrar kRegister(
    {"prefetch", "synthetic training step through the prefetch scheduler (params on NVMe, small device)",
     "  --path DIR          where the swap file goes (default .)\n"
     "  --layers N          layers (default 32)\n"
     "  --layer-bytes N     bytes per layer (default 64M)\n"
     "  --compute-ms X      simulated compute per layer and pass (default 20)\n"
     "  --h2d-gbps X        emulated host-to-device bandwidth (default 4)\n"
     "  --steps N           steps, the first records the access order (default 4)\n"
     "  --device-layers N   device budget in layers (default 4)\n"
     "  --host-layers N     host budget in layers (default 8)\n"
     "  --lookahead N       prefetch window in acquires (default: engine's)\n"
     "  --no-prefetch       disable the prefetcher (for comparison)\n"
     "  --json              print one JSON object",
     run_prefetch_cmd});

const SummaryRegistrar kSummary({40, "prefetch scheduler", [](bool quick) -> Result<std::vector<SummaryRow>> {
                                   PrefetchOptions o;
                                   o.path = std::filesystem::temp_directory_path().string();
                                   o.layers = 12;
                                   o.layer_bytes = quick ? (8ull << 20) : (32ull << 20);
                                   o.compute_ms = quick ? 6 : 10;
                                   o.h2d_gbps = 4;
                                   o.steps = 3;
                                   o.progress = false;
                                   TIER_ASSIGN_OR_RETURN(PrefetchResult r, run_prefetch(o));
                                   const double bound = std::max(r.transfer_bound_seconds, r.compute_bound_seconds);
                                   return std::vector<SummaryRow>{
                                       {"prefetch: step vs max(compute, transfer)", format_seconds(r.step_seconds),
                                        str("bound ", format_seconds(bound)), bound / r.step_seconds,
                                        str("stall fraction ", fmt(r.stall_fraction, 3), ", ", o.layers, " x ",
                                            format_bytes(o.layer_bytes), " layers, device holds 4")}};
                                 }});

}  // namespace
}  // namespace tier::bench
