// `tier-bench step`: the offloaded optimizer step on a model state of --params parameters kept on
// NVMe, beside the two bounds it is judged against, measured in the same run on the same path:
//  - io_bound_seconds: the step's I/O alone (OffloadedOptimizer::measure_io_seconds: every chunk
//    read and written back through the same swap space, engine, buffers and pipeline depth, a
//    mixed read/write pass at the step's 1:1 ratio);
//  - compute_bound_seconds: the step's CPU Adam alone on data in RAM (measure_update_seconds: the
//    same partitions, gradients, outputs and threads, no I/O);
//  - io_reference_seconds: the same bytes at the rate of a plain 1:1 read/write pass measured
//    outside tier (read_reference.hpp: pread/pwrite, the same block size, as many requests in
//    flight), so that the I/O bound is not only the engine's own path judging itself.
// After one untimed I/O pass (first writes of the shadow slots), I/O passes and steps alternate
// (io, step, step, io, io, step, ...) so that both see the same disk (a shared virtual disk drifts)
// and neither always follows the other; the medians are reported.
// Gradients (bf16 by default) and the low-precision outputs live in host memory windows that
// partitions share, so the benchmark's own host memory stays small whatever --params is; every
// element still reads its gradient and writes its output once per step.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "read_reference.hpp"
#include "tier/cpu_kernels.hpp"
#include "tier/offloaded_optimizer.hpp"
#include "tier/state_codec.hpp"
#include "tier/stats.hpp"
#include "tier/units.hpp"

namespace tier::bench {
namespace {

using optim::OffloadedOptimizer;
using optim::OffloadedOptimizerOptions;
using optim::ParamOutput;
using optim::PartitionId;

struct StepBenchSpec {
  std::uint64_t params = 100'000'000;
  std::vector<std::string> paths;
  bool host = false;  // state in host memory instead of NVMe
  unsigned steps = 3;
  unsigned buffer_count = 8;
  std::uint64_t buffer_bytes = 1ull << 30;
  std::uint64_t chunk_elements = 0;
  DType grad = DType::kBF16;
  ParamOutput out = ParamOutput::kBF16;
  cpu::StateDType state_dtype = cpu::StateDType::kF32;
  IoEngineKind engine = IoEngineKind::kAuto;
  std::uint64_t block_size = 1 << 20;
  unsigned queue_depth = 32;
  unsigned parallelism = 1;
  bool direct = true;
  int threads = 0;
  bool progress = true;
};

struct StepBenchResult {
  std::vector<double> step_seconds, io_seconds, update_seconds;
  double step_median = 0, io_median = 0, compute_median = 0;
  double register_seconds = 0;
  double intake_seconds = 0;  // median gradient intake (sum of squares per partition) per step
  optim::StepReport median_report;
  optim::OptimizerStats stats;
  std::string engine;
  bool direct = false;
  std::uint64_t partitions = 0;
  std::uint64_t state_bytes = 0;  // the chunk records: 12 bytes per parameter with fp32 moments
  std::uint64_t max_rss_bytes = 0;
  std::uint64_t swap_requests = 0;
  ReadReference io_reference;       // outside tier, the best request shape (read_reference.hpp)
  double io_reference_seconds = 0;  // the step's bytes (state read and written) at its rate
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A transformer-like mix per "layer": large matrices, small vectors (biases, norms) and odd sizes,
// repeated until the parameter count is reached (the last partition takes the rest).
std::vector<std::uint64_t> partition_sizes(std::uint64_t params) {
  static const std::uint64_t kLayer[] = {12'582'912, 4096, 4'194'304, 4096, 4096, 16'777'216, 16'384,
                                         16'777'216, 4096, 4096,      1000, 77,   3'000'000};
  std::vector<std::uint64_t> sizes;
  std::uint64_t left = params;
  for (std::size_t i = 0; left > 0; ++i) {
    const std::uint64_t n = std::min(left, kLayer[i % std::size(kLayer)]);
    sizes.push_back(n);
    left -= n;
  }
  return sizes;
}

Result<StepBenchResult> run_step_bench(const StepBenchSpec& spec) {
  if (!spec.host && spec.paths.empty())
    return invalid_argument("--nvme: give the directory for the state (on the SSD)");
  if (spec.params < 1024) return invalid_argument("--params must be at least 1024");
  StepBenchResult res;
  const auto sizes = partition_sizes(spec.params);
  res.partitions = sizes.size();
  const double bytes_per_param = 4 + cpu::state_bytes_per_element(spec.state_dtype);
  res.state_bytes = static_cast<std::uint64_t>(bytes_per_param * static_cast<double>(spec.params));

  Counters counters;
  OffloadedOptimizerOptions o;
  o.home = spec.host ? optim::StateHome::kHost : optim::StateHome::kNvme;
  o.max_elements = spec.params;
  o.max_partitions = sizes.size();
  o.state_dtype = spec.state_dtype;
  o.buffer_count = spec.buffer_count;
  o.buffer_bytes = spec.buffer_bytes;
  o.chunk_elements = spec.chunk_elements;
  cpu::AdamHyperParams hp;
  hp.lr = 1e-4;
  hp.weight_decay = 0.01;
  o.groups = {hp};
  o.max_grad_norm = 1.0;
  o.threads = spec.threads;
  o.counters = &counters;
  o.swap_options.paths = spec.paths;
  o.swap_options.engine = spec.engine;
  o.swap_options.block_size = spec.block_size;
  o.swap_options.queue_depth = spec.queue_depth;
  o.swap_options.intra_op_parallelism = spec.parallelism;
  o.swap_options.use_direct = spec.direct;
  o.swap_options.stripe_unit = spec.block_size;
  TIER_ASSIGN_OR_RETURN(auto opt, OffloadedOptimizer::create(o));

  // Initial master values: a pattern window, different per partition.
  constexpr std::uint64_t kPattern = 1 << 20;
  std::vector<float> pattern(kPattern + 16'777'216);
  {
    std::mt19937 rng(7);
    std::normal_distribution<float> d(0.0f, 0.02f);
    for (std::uint64_t i = 0; i < kPattern; ++i) pattern[i] = d(rng);
    for (std::uint64_t i = kPattern; i < pattern.size(); ++i) pattern[i] = pattern[i % kPattern];
  }
  {
    const auto t0 = std::chrono::steady_clock::now();
    Progress prog("writing the initial state", res.state_bytes, true, spec.progress);
    std::uint64_t done = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      optim::PartitionSpec ps;
      ps.numel = sizes[i];
      ps.output = spec.out;
      ps.initial = pattern.data() + (i * 977) % kPattern;
      TIER_RETURN_IF_ERROR(opt->add_partition(ps).status());
      done += static_cast<std::uint64_t>(bytes_per_param * static_cast<double>(sizes[i]));
      prog.update(done);
    }
    TIER_RETURN_IF_ERROR(opt->finish_registration());
    prog.finish();
    res.register_seconds = seconds_since(t0);
  }
  res.state_bytes = opt->stats().record_bytes;  // exact, the sections' page rounding included
  pattern = {};
  pattern.shrink_to_fit();

  // Shared gradient and output windows (see the file comment).
  const std::uint64_t window = std::min<std::uint64_t>(spec.params, 64ull << 20);
  std::vector<std::uint8_t> grads(window * dtype_size(spec.grad) + 64);
  {
    std::mt19937 rng(11);
    std::normal_distribution<float> d(0.0f, 1e-3f);
    std::vector<float> f(1 << 20);
    for (auto& x : f) x = d(rng);
    for (std::uint64_t off = 0; off < window; off += f.size()) {
      const std::uint64_t n = std::min<std::uint64_t>(f.size(), window - off);
      TIER_RETURN_IF_ERROR(cpu::convert(cpu::ConstTensorRef(f.data(), DType::kF32, n),
                                        cpu::TensorRef{grads.data() + off * dtype_size(spec.grad), spec.grad, n}));
    }
  }
  std::vector<std::uint8_t> outputs(window * std::max<std::size_t>(1, optim::param_output_size(spec.out)) + 64);
  std::vector<std::uint64_t> where(sizes.size());
  {
    // Packed one after another, starting over at 0 when the window is full: partitions that share
    // a chunk (far smaller than the window) never share output bytes.
    std::uint64_t cursor = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      if (cursor + sizes[i] > window) cursor = 0;
      where[i] = cursor;
      cursor += sizes[i];
    }
  }
  auto give_grads = [&]() -> Result<double> {
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      TIER_RETURN_IF_ERROR(
          opt->add_grad(static_cast<PartitionId>(i),
                        cpu::ConstTensorRef(grads.data() + where[i] * dtype_size(spec.grad), spec.grad, sizes[i]),
                        optim::GradMode::kBorrow));
    }
    return seconds_since(t0);
  };
  const std::size_t os = optim::param_output_size(spec.out);
  std::vector<void*> dest(sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) dest[i] = outputs.data() + where[i] * os;
  optim::StepOptions so;
  so.destinations = dest;

  // The compute bound first (it needs the gradients, and leaves everything as it was).
  TIER_ASSIGN_OR_RETURN(const double intake0, give_grads());
  (void)intake0;
  for (int k = 0; k < 2; ++k) {
    TIER_ASSIGN_OR_RETURN(auto up, opt->measure_update_seconds());
    res.update_seconds.push_back(up.seconds);
  }
  opt->clear_grads();

  std::vector<double> intake;
  std::vector<optim::StepReport> reports;
  auto io_pass = [&](bool timed) -> Status {
    if (spec.host) return {};
    if (spec.progress) std::fprintf(stderr, "%s ...\n", timed ? "io bound pass" : "warm-up pass (untimed)");
    TIER_ASSIGN_OR_RETURN(auto io, opt->measure_io_seconds());
    if (timed) res.io_seconds.push_back(io.seconds);
    if (spec.progress) std::fprintf(stderr, "  %s\n", format_seconds(io.seconds).c_str());
    return {};
  };
  auto one_step = [&](unsigned s) -> Status {
    TIER_ASSIGN_OR_RETURN(const double in, give_grads());
    intake.push_back(in);
    if (spec.progress) std::fprintf(stderr, "step %u/%u ...\n", s + 1, spec.steps);
    TIER_ASSIGN_OR_RETURN(auto r, opt->step(so));
    res.step_seconds.push_back(r.seconds);
    reports.push_back(r);
    if (spec.progress) std::fprintf(stderr, "  %s\n", format_seconds(r.seconds).c_str());
    return {};
  };
  // One untimed pass writes every shadow slot once (a file system may convert preallocated
  // extents on their first write); then I/O passes and steps alternate in the order io, step,
  // step, io, io, step, ... so that neither always runs right after the other.
  TIER_RETURN_IF_ERROR(io_pass(false));
  // Outside reference for the mixed pass, moving the step's own bytes (the whole state each way,
  // not a sample: a virtual disk's write-back cache takes a burst of 1 GiB faster than it sustains
  // several, which made the reference flatter the disk): the best over request shapes around the
  // engine's (read_reference.hpp), so that it is the disk's rate for these bytes and not one shape's.
  const std::uint64_t sample = res.state_bytes;
  // What the reference reads: a file of its own in each path, not whatever else the paths hold.
  std::optional<ReferenceFolders> folders;
  if (!spec.host) {
    TIER_ASSIGN_OR_RETURN(ReferenceFolders made, ReferenceFolders::create(spec.paths, sample, "step reference"));
    folders.emplace(std::move(made));
    const int depth = static_cast<int>(std::clamp(spec.queue_depth * spec.parallelism, 1u, 64u));
    const ReferenceShapes shapes = reference_shapes(spec.block_size, depth);
    if (spec.progress) {
      std::fprintf(stderr, "outside reference (read + write %s each, %zu request shapes x %d) ...\n",
                   format_bytes(sample).c_str(), shapes.count(), shapes.passes);
    }
    TIER_ASSIGN_OR_RETURN(res.io_reference, best_mixed_read_write(folders->dirs(), sample, shapes,
                                                                  spec.progress ? print_reference : nullptr));
  }
  // The disk's rate drifts over a run: the best shape is measured again beside every step (after
  // it, or before, alternating as the I/O passes do), and the best of all is the reference.
  auto reference_again = [&]() -> Status {
    if (spec.host) return Status::Ok();
    TIER_ASSIGN_OR_RETURN(res.io_reference, measure_again(res.io_reference, folders->dirs(), sample));
    return Status::Ok();
  };
  for (unsigned s = 0; s < spec.steps; ++s) {
    if (s % 2 == 0) {
      TIER_RETURN_IF_ERROR(io_pass(true));
      TIER_RETURN_IF_ERROR(reference_again());
      TIER_RETURN_IF_ERROR(one_step(s));
    } else {
      TIER_RETURN_IF_ERROR(one_step(s));
      TIER_RETURN_IF_ERROR(reference_again());
      TIER_RETURN_IF_ERROR(io_pass(true));
    }
  }
  res.io_reference_seconds = res.io_reference.bytes_per_second > 0
                                 ? 2.0 * static_cast<double>(res.state_bytes) / res.io_reference.bytes_per_second
                                 : 0;
  res.step_median = median(res.step_seconds);
  res.io_median = median(res.io_seconds);
  res.compute_median = median(res.update_seconds);
  res.intake_seconds = median(intake);
  // The report of the step closest to the median.
  std::size_t best = 0;
  for (std::size_t i = 1; i < reports.size(); ++i) {
    if (std::fabs(reports[i].seconds - res.step_median) < std::fabs(reports[best].seconds - res.step_median)) best = i;
  }
  res.median_report = reports[best];
  res.stats = opt->stats();
  const auto snap = counters.snapshot();
  res.engine = snap.info.count("io_engine") ? snap.info.at("io_engine") : (spec.host ? "none" : "?");
  res.direct = snap.info.count("nvme.direct_io") && snap.info.at("nvme.direct_io") == "true";
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  res.max_rss_bytes = static_cast<std::uint64_t>(ru.ru_maxrss) * 1024;
  return res;
}

double bound(const StepBenchResult& r) {
  return std::max(r.io_median, r.compute_median);
}

// The same judged against the outside I/O reference instead of tier's own I/O pass.
double reference_bound(const StepBenchResult& r) {
  return std::max(r.io_reference_seconds, r.compute_median);
}

int run_step(Args& args) {
  StepBenchSpec spec;
  Status s;
  auto take = [&](auto r, auto& into) { take_option(s, std::move(r), into); };
  take(args.count("params", 100'000'000), spec.params);
  spec.paths = split_list(args.get("nvme", ""));
  std::string home = "nvme", grad = "bf16", out = "bf16", engine = "auto", state_dtype = "fp32";
  take(args.choice("home", {"nvme", "host"}, "nvme"), home);
  take(args.integer("steps", 3), spec.steps);
  take(args.integer("buffer-count", 8), spec.buffer_count);
  take(args.size("buffer-bytes", 1ull << 30), spec.buffer_bytes);
  take(args.count("chunk-elements", 0), spec.chunk_elements);
  take(args.choice("grad-dtype", {"fp32", "fp16", "bf16"}, "bf16"), grad);
  take(args.choice("out-dtype", {"none", "fp16", "bf16", "fp32"}, "bf16"), out);
  take(args.choice("state-dtype", {"fp32", "bf16", "int8"}, "fp32"), state_dtype);
  take(args.choice("engine", {"auto", "uring", "aio", "posix"}, "auto"), engine);
  take(args.size("block-size", 1 << 20), spec.block_size);
  take(args.integer("queue-depth", 32), spec.queue_depth);
  take(args.integer("parallelism", 1), spec.parallelism);
  take(args.integer("threads", 0), spec.threads);
  spec.direct = !args.flag("buffered");
  const bool json_out = args.flag("json");
  spec.progress = !args.flag("quiet") && !json_out;
  if (Status f = args.finish(); s.ok() && !f.ok()) s = f;
  spec.host = home == "host";
  spec.grad = parse_dtype(grad).value();
  spec.state_dtype = cpu::parse_state_dtype(state_dtype).value();
  spec.out = out == "none"   ? ParamOutput::kNone
             : out == "fp16" ? ParamOutput::kF16
             : out == "fp32" ? ParamOutput::kF32
                             : ParamOutput::kBF16;
  spec.engine = engine == "uring"   ? IoEngineKind::kUring
                : engine == "aio"   ? IoEngineKind::kAio
                : engine == "posix" ? IoEngineKind::kPosix
                                    : IoEngineKind::kAuto;
  if (s.ok() && (spec.steps < 1 || spec.steps > 100)) s = invalid_argument("--steps: 1 to 100");
  if (s.ok() && spec.chunk_elements % 1024 != 0) s = invalid_argument("--chunk-elements must be a multiple of 1024");
  if (!s.ok()) {
    std::fprintf(stderr, "tier-bench step: %s\n", s.message().c_str());
    return 2;
  }
  auto r = run_step_bench(spec);
  if (!r.ok()) {
    std::fprintf(stderr, "tier-bench step: %s\n", r.status().to_string().c_str());
    return 1;
  }
  const auto& m = r->median_report;
  const double ratio = bound(*r) > 0 ? r->step_median / bound(*r) : 0;
  const double ref_ratio = reference_bound(*r) > 0 ? r->step_median / reference_bound(*r) : 0;
  if (json_out) {
    nlohmann::ordered_json j = {
        {"params", spec.params},
        {"partitions", r->partitions},
        {"home", spec.host ? "host" : "nvme"},
        {"paths", spec.paths},
        {"nvme_path_is_tmpfs", !spec.host && !in_memory_paths(spec.paths).empty()},
        {"engine", r->engine},
        {"direct", r->direct},
        {"state_dtype", cpu::state_dtype_name(spec.state_dtype)},
        {"state_bytes", r->state_bytes},
        {"bytes_per_param_io", static_cast<double>(m.read.bytes + m.write.bytes) / static_cast<double>(spec.params)},
        {"chunk_elements", r->stats.chunk_elements},
        {"chunks", r->stats.chunks},
        {"buffer_count", r->stats.buffer_count},
        {"pinned_bytes", r->stats.pinned_bytes},
        {"max_rss_bytes", r->max_rss_bytes},
        {"grad_dtype", dtype_name(spec.grad)},
        {"out_dtype", optim::param_output_name(spec.out)},
        {"step_seconds", r->step_median},
        {"io_bound_seconds", r->io_median},
        {"compute_bound_seconds", r->compute_median},
        {"ratio_to_bound", ratio},
        {"io_reference_seconds", r->io_reference_seconds},
        {"io_reference_bytes_per_second", r->io_reference.bytes_per_second},
        {"io_reference_bytes_read", r->io_reference.bytes_read},
        {"io_reference_bytes_written", r->io_reference.bytes_written},
        {"io_reference", r->io_reference.describe()},
        {"ratio_to_reference_bound", ref_ratio},
        {"target_ratio", 1.15},
        {"step_seconds_all", r->step_seconds},
        {"io_bound_seconds_all", r->io_seconds},
        {"compute_bound_seconds_all", r->update_seconds},
        {"register_seconds", r->register_seconds},
        {"grad_intake_seconds", r->intake_seconds},
        {"median_step",
         {{"read_busy_seconds", m.read.busy_seconds},
          {"write_busy_seconds", m.write.busy_seconds},
          {"update_busy_seconds", m.update.busy_seconds},
          {"io_busy_seconds", m.io_busy_seconds},
          {"update_wait_seconds", m.update_wait_seconds},
          {"output_seconds", m.output_seconds},
          {"bytes_read", m.read.bytes},
          {"bytes_written", m.write.bytes},
          {"max_transfers_in_flight", m.max_transfers_in_flight},
          {"grad_norm", m.grad_norm},
          {"clip_coefficient", m.clip_coefficient}}}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  const std::string where =
      spec.host ? std::string("host home") : str("nvme ", r->engine, r->direct ? " O_DIRECT" : " buffered");
  std::printf("%s\n", str("optimizer step: ", fmt(static_cast<double>(spec.params) / 1e6, 0), "M params (",
                          r->partitions, " partitions, ", format_bytes(r->state_bytes), " of state with ",
                          cpu::state_dtype_name(spec.state_dtype), " moments), ", where, ", ", r->stats.chunks,
                          " chunks x ", r->stats.chunk_elements, " elements, ", r->stats.buffer_count, " buffers, ",
                          format_bytes(r->stats.pinned_bytes), " pinned")
                          .c_str());
  Table t({"what", "seconds (median)", "all", "note"});
  auto all = [](const std::vector<double>& v) {
    std::string s;
    for (double x : v) s += str(s.empty() ? "" : " ", fmt(x, 2));
    return s;
  };
  t.add({"step", fmt(r->step_median, 3), all(r->step_seconds),
         str("read busy ", fmt(m.read.busy_seconds, 2), " s, write busy ", fmt(m.write.busy_seconds, 2), " s, update ",
             fmt(m.update.busy_seconds, 2), " s, update waited ", fmt(m.update_wait_seconds, 2), " s")});
  if (!spec.host) {
    t.add({"io bound (mixed r/w pass)", fmt(r->io_median, 3), all(r->io_seconds),
           str(format_rate(2.0 * static_cast<double>(m.read.bytes) / std::max(r->io_median, 1e-9)), " read+write")});
  }
  t.add({"compute bound (adam in RAM)", fmt(r->compute_median, 3), all(r->update_seconds),
         str(fmt(static_cast<double>(spec.params) / std::max(r->compute_median, 1e-9) / 1e9, 3), " G params/s")});
  if (!spec.host) {
    t.add({"io reference (outside tier)", fmt(r->io_reference_seconds, 3), "",
           str(format_rate(r->io_reference.bytes_per_second), " read+write: ", r->io_reference.describe(), " of ",
               format_bytes(r->io_reference.bytes_read), " each way, best of the shapes tried")});
  }
  t.add({"step / max(bounds)", fmt(ratio, 3), "", "target <= 1.15"});
  if (!spec.host)
    t.add({"step / max(io reference, compute)", fmt(ref_ratio, 3), "", "the I/O bound from outside tier"});
  t.print();
  std::printf("gradient intake %s per step; NVMe traffic %s bytes per parameter per step; peak RSS %s\n",
              format_seconds(r->intake_seconds).c_str(),
              fmt(static_cast<double>(m.read.bytes + m.write.bytes) / static_cast<double>(spec.params), 2).c_str(),
              format_bytes(r->max_rss_bytes).c_str());
  if (!spec.host) warn_in_memory_paths(spec.paths);
  return 0;
}

const CommandRegistrar kRegister(
    {"step", "offloaded optimizer step on NVMe-resident Adam state, beside its I/O and compute bounds",
     "  --params N            parameters (default 100M; K/M/G = 1e3/1e6/1e9)\n"
     "  --nvme DIR[,DIR...]   directories for the state (on the SSD); several stripe (required for --home nvme)\n"
     "  --home nvme|host      where the state lives (default nvme)\n"
     "  --steps N             timed steps, alternating with as many I/O-bound passes; medians (default 3)\n"
     "  --buffer-count N      pinned chunk buffers (default 8)\n"
     "  --buffer-bytes N      pinned bytes for all buffers (default 1G)\n"
     "  --chunk-elements N    elements per chunk (default: from the buffers and the model size)\n"
     "  --grad-dtype T        fp32 | fp16 | bf16 (default bf16)\n"
     "  --out-dtype T         none | fp16 | bf16 | fp32: the params' low-precision copy (default bf16)\n"
     "  --state-dtype T       fp32 | bf16 | int8: the format of Adam's moments (default fp32)\n"
     "  --engine E            auto|uring|aio|posix (default auto)\n"
     "  --block-size N        bytes per request (default 1M)\n"
     "  --queue-depth N       requests in flight per I/O thread (default 32)\n"
     "  --parallelism N       I/O threads (default 1)\n"
     "  --threads N           update threads (default 0: all cores)\n"
     "  --buffered            no O_DIRECT\n"
     "  --quiet               no progress\n"
     "  --json                print one JSON object",
     run_step});

// `tier-bench summary`: a small state in the system's temporary directory.
Result<std::vector<SummaryRow>> summary_step(bool quick) {
  StepBenchSpec spec;
  spec.params = quick ? 16'000'000 : 64'000'000;
  spec.paths = {std::filesystem::temp_directory_path().string()};
  spec.steps = quick ? 1 : 3;
  spec.progress = false;
  TIER_ASSIGN_OR_RETURN(StepBenchResult r, run_step_bench(spec));
  const double b = bound(r);
  return std::vector<SummaryRow>{
      {str("optimizer step (", fmt(static_cast<double>(spec.params) / 1e6, 0), "M params on NVMe, ", r.engine, ")"),
       format_seconds(r.step_median),
       str("max(io ", format_seconds(r.io_median), ", adam ", format_seconds(r.compute_median), ")"),
       b > 0 ? b / r.step_median : 0,
       str(format_bytes(r.state_bytes), " state, ", format_bytes(r.stats.pinned_bytes),
           " pinned, target ratio >= 0.87")}};
}

const SummaryRegistrar kSummary({40, "optimizer step", summary_step});

}  // namespace
}  // namespace tier::bench
