// `tier-bench adam`: CPU Adam/AdamW speed in params/s beside its roofline, a kernel with Adam's
// memory pattern and trivial arithmetic, measured in the same run on the same buffers.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "tier/cpu_adam.hpp"
#include "tier/state_codec.hpp"
#include "tier/ext/host_arena.hpp"
#include "tier/log.hpp"
#include "tier/units.hpp"

namespace tier::bench {
namespace {

using cpu::AdamTensors;
using cpu::TensorRef;

struct AdamBenchOptions {
  std::uint64_t params = 100'000'000;
  int threads = 0;  // 0: all cores
  DType grad = DType::kF32;
  DType param = DType::kF32;
  bool has_out = false;
  DType out = DType::kF16;
  int reps = 5;
  bool heap = false;  // plain heap memory instead of the pinned, huge-page host arena
  bool progress = true;
  cpu::OptimizerKind kind = cpu::OptimizerKind::kAdam;  // --optimizer
  // --state-dtype: how exp_avg and exp_avg_sq are stored for the timed update. The roofline
  // always streams fp32 state; its bandwidth is converted to params/s at the compressed byte count.
  cpu::StateDType state = cpu::StateDType::kF32;
};

struct AdamBenchResult {
  double params_per_second = 0;  // median over reps
  double best_params_per_second = 0;
  double roofline_params_per_second = 0;  // median over reps
  double best_roofline_params_per_second = 0;
  double bytes_per_param = 0;           // bytes moved per parameter (reads + writes) by the timed update
  double roofline_bytes_per_param = 0;  // by the roofline pass (fp32 state)
  std::string simd;
  int threads = 0;
  std::uint64_t huge_page_bytes = 0;
  bool locked = false;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// The buffers of one benchmark: five streams carved from one allocation.
class AdamBuffers {
 public:
  static Result<AdamBuffers> create(const AdamBenchOptions& o) {
    AdamBuffers b;
    b.n_ = o.params;
    const std::uint64_t align = HostArena::kHugePage;
    auto round = [&](std::uint64_t bytes) { return (bytes + align - 1) / align * align; };
    const bool packed = o.state != cpu::StateDType::kF32;
    const DType md = cpu::exp_avg_dtype(o.state), vd = cpu::exp_avg_sq_dtype(o.state);
    const std::uint64_t sizes[kStreams] = {o.params * dtype_size(o.param),
                                           o.params * 4,
                                           o.params * 4,
                                           o.params * dtype_size(o.grad),
                                           o.has_out ? o.params * dtype_size(o.out) : 0,
                                           packed ? o.params * dtype_size(md) : 0,
                                           packed ? o.params * dtype_size(vd) : 0};
    std::uint64_t total = 0;
    for (auto s : sizes) total += round(s);
    std::byte* base = nullptr;
    if (o.heap) {
      b.heap_.reset(static_cast<std::byte*>(std::aligned_alloc(align, total)));
      if (!b.heap_) return resource_exhausted(str("adam bench: cannot allocate ", format_bytes(total)));
      base = b.heap_.get();
    } else {
      TIER_ASSIGN_OR_RETURN(b.arena_, HostArena::create({total, HugePageMode::kAuto, true}));
      TIER_ASSIGN_OR_RETURN(b.block_, b.arena_->allocate(total, std::chrono::milliseconds(0), align));
      base = b.block_.data();
    }
    std::uint64_t off = 0;
    for (int i = 0; i < kStreams; ++i) {
      b.ptr_[i] = base + off;
      off += round(sizes[i]);
    }
    b.t_ = AdamTensors{TensorRef{b.ptr_[0], o.param, o.params}, TensorRef{b.ptr_[1], DType::kF32, o.params},
                       TensorRef{b.ptr_[2], DType::kF32, o.params}, cpu::ConstTensorRef(b.ptr_[3], o.grad, o.params),
                       o.has_out ? TensorRef{b.ptr_[4], o.out, o.params} : TensorRef{}};
    b.packed_ = b.t_;
    if (packed) {
      b.packed_.exp_avg = TensorRef{b.ptr_[5], md, o.params};
      b.packed_.exp_avg_sq = TensorRef{b.ptr_[6], vd, o.params};
      const std::uint64_t ns = cpu::state_scale_count(o.state, o.params);
      b.m_scales_.assign(ns, 0.0f);
      b.v_scales_.assign(ns, 0.0f);
      b.packed_.exp_avg_scales = ns ? b.m_scales_.data() : nullptr;
      b.packed_.exp_avg_sq_scales = ns ? b.v_scales_.data() : nullptr;
    }
    b.state_ = o.state;
    return b;
  }

  // Fills the state with sane values (params ~ 1, small moments, gradients ~ 1e-2), in parallel
  // so that pages are touched by the threads that will stream them.
  Status init(int threads) {
    std::vector<float> pattern(4096);
    for (std::size_t i = 0; i < pattern.size(); ++i)
      pattern[i] = static_cast<float>((i * 2654435761u) % 1000) / 1000.0f;
    const unsigned nt = static_cast<unsigned>(std::max(1, threads));
    std::vector<std::thread> pool;
    std::vector<Status> errors(nt);
    for (unsigned t = 0; t < nt; ++t) {
      pool.emplace_back([&, t] {
        const std::uint64_t lo = n_ * t / nt, hi = n_ * (t + 1) / nt;
        std::vector<float> tmp(pattern.size());
        for (std::uint64_t i = lo; i < hi && errors[t].ok(); i += pattern.size()) {
          const std::uint64_t len = std::min<std::uint64_t>(pattern.size(), hi - i);
          auto fill = [&](const TensorRef& dst, float mul, float add) {
            if (dst.data == nullptr) return;
            for (std::uint64_t k = 0; k < len; ++k) tmp[k] = pattern[k] * mul + add;
            const TensorRef piece{static_cast<std::byte*>(dst.data) + i * dtype_size(dst.dtype), dst.dtype, len};
            const Status s = cpu::convert(cpu::ConstTensorRef(tmp.data(), DType::kF32, len), piece);
            if (!s.ok()) errors[t] = s;
          };
          fill(t_.params, 1.0f, 0.5f);
          fill(t_.exp_avg, 1e-3f, -5e-4f);
          fill(t_.exp_avg_sq, 1e-6f, 1e-7f);
          fill(TensorRef{const_cast<void*>(t_.grads.data), t_.grads.dtype, t_.grads.numel}, 2e-2f, -1e-2f);
          fill(t_.out, 0.0f, 0.0f);
        }
      });
    }
    for (auto& th : pool) th.join();
    for (const auto& e : errors) TIER_RETURN_IF_ERROR(e);
    if (state_ != cpu::StateDType::kF32) {
      // The compressed state holds the same values, encoded.
      TIER_RETURN_IF_ERROR(cpu::encode_state(cpu::StateMoment::kExpAvg,
                                             cpu::ConstTensorRef(t_.exp_avg.data, DType::kF32, n_), packed_.exp_avg,
                                             packed_.exp_avg_scales, threads));
      TIER_RETURN_IF_ERROR(cpu::encode_state(cpu::StateMoment::kExpAvgSq,
                                             cpu::ConstTensorRef(t_.exp_avg_sq.data, DType::kF32, n_),
                                             packed_.exp_avg_sq, packed_.exp_avg_sq_scales, threads));
    }
    return {};
  }

  // The fp32-state tensors (the roofline's) and those the timed update runs on.
  const AdamTensors& tensors() const { return t_; }
  const AdamTensors& update_tensors() const { return packed_; }
  const HostArena* arena() const { return arena_.get(); }

 private:
  struct FreeDeleter {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::uint64_t n_ = 0;
  std::unique_ptr<HostArena> arena_;
  HostBlock block_;
  std::unique_ptr<std::byte, FreeDeleter> heap_;
  static constexpr int kStreams = 7;  // p, m, v (fp32), g, out, m, v (compressed)
  std::byte* ptr_[kStreams] = {};
  AdamTensors t_, packed_;
  std::vector<float> m_scales_, v_scales_;
  cpu::StateDType state_ = cpu::StateDType::kF32;
};

Result<AdamBenchResult> measure_adam(const AdamBenchOptions& o) {
  AdamBenchResult r;
  TIER_ASSIGN_OR_RETURN(const int threads, [&]() -> Result<int> {
    if (o.threads < 0) return invalid_argument("--threads must be at least 1");
    return o.threads == 0 ? static_cast<int>(std::max(1u, std::thread::hardware_concurrency())) : o.threads;
  }());
  r.threads = threads;
  r.simd = cpu::simd_target();
  TIER_ASSIGN_OR_RETURN(auto buffers, AdamBuffers::create(o));
  TIER_RETURN_IF_ERROR(buffers.init(threads));
  if (buffers.arena()) {
    const auto s = buffers.arena()->stats();
    r.huge_page_bytes = s.huge_page_bytes;
    r.locked = s.locked;
  }
  r.roofline_bytes_per_param =
      2.0 * dtype_size(o.param) + 8.0 * 2 + dtype_size(o.grad) + (o.has_out ? dtype_size(o.out) : 0);
  // m and v read and written at their stored size (scales included).
  r.bytes_per_param = r.roofline_bytes_per_param - 16.0 + 2.0 * cpu::state_bytes_per_element(o.state);

  cpu::AdamHyperParams hp = cpu::default_hyper_params(o.kind);
  hp.weight_decay = 0.01;
  TIER_ASSIGN_OR_RETURN(auto group, cpu::AdamGroup::create(hp));
  // Lamb: both passes (norms, then the update), as one offloaded step of a parameter makes them.
  auto update = [&](const cpu::AdamStep& st) {
    return o.kind == cpu::OptimizerKind::kLamb ? cpu::lamb_update(st, buffers.update_tensors(), threads)
                                               : cpu::adam_update(st, buffers.update_tensors(), threads);
  };
  const auto n = static_cast<double>(o.params);
  auto timed = [&](auto&& fn) -> Result<double> {
    const auto t0 = std::chrono::steady_clock::now();
    TIER_RETURN_IF_ERROR(fn());
    return n / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  // One untimed pass of each warms caches, page tables and the thread pool.
  TIER_RETURN_IF_ERROR(cpu::adam_roofline_pass(buffers.tensors(), threads));
  TIER_RETURN_IF_ERROR(buffers.init(threads));
  TIER_ASSIGN_OR_RETURN(auto warm, group.begin_step());
  TIER_RETURN_IF_ERROR(update(warm));

  std::vector<double> adam, roof;
  Progress progress("adam", static_cast<std::uint64_t>(o.reps), false, o.progress);
  for (int rep = 0; rep < o.reps; ++rep) {
    // Alternate the two kernels so that both see the same machine; the roofline scribbles over
    // the state, so it is refilled (untimed) before Adam runs on it.
    TIER_ASSIGN_OR_RETURN(const double rf, timed([&] { return cpu::adam_roofline_pass(buffers.tensors(), threads); }));
    roof.push_back(rf);
    TIER_RETURN_IF_ERROR(buffers.init(threads));
    TIER_ASSIGN_OR_RETURN(auto step, group.begin_step());
    TIER_ASSIGN_OR_RETURN(const double ad, timed([&] { return update(step); }));
    adam.push_back(ad);
    progress.update(static_cast<std::uint64_t>(rep + 1));
  }
  progress.finish();
  r.params_per_second = median(adam);
  r.best_params_per_second = *std::max_element(adam.begin(), adam.end());
  // The roofline's bandwidth, in params/s at the timed update's byte count.
  const double scale = r.roofline_bytes_per_param / r.bytes_per_param;
  r.roofline_params_per_second = median(roof) * scale;
  r.best_roofline_params_per_second = *std::max_element(roof.begin(), roof.end()) * scale;
  return r;
}

std::string rate_params(double pps) {
  return fmt(pps / 1e9, 3) + " G params/s";
}

int run_adam(Args& args) {
  AdamBenchOptions o;
  auto params = args.count("params", 100'000'000);
  auto threads = args.integer("threads", 0);
  auto grad = args.choice("grad-dtype", {"fp32", "fp16", "bf16"}, "fp32");
  auto param = args.choice("param-dtype", {"fp32", "bf16"}, "fp32");
  auto out = args.choice("out-dtype", {"none", "fp16", "bf16"}, "none");
  auto reps = args.integer("reps", 5);
  auto memory = args.choice("memory", {"arena", "heap"}, "arena");
  auto kind = args.choice("optimizer", {"adam", "adagrad", "lion", "lamb"}, "adam");
  auto state = args.choice("state-dtype", {"fp32", "bf16", "int8"}, "fp32");
  const std::string simd = args.get("simd", "auto");
  const bool json_out = args.flag("json");
  o.progress = !args.flag("quiet") && !json_out;
  Status s = args.finish();
  for (const Status& e : {params.status(), threads.status(), grad.status(), param.status(), out.status(), reps.status(),
                          memory.status(), kind.status(), state.status()}) {
    if (s.ok() && !e.ok()) s = e;
  }
  if (s.ok() && (*threads < 0 || *threads > 4096))
    s = invalid_argument("--threads must be from 1 to 4096 (0: all cores)");
  if (s.ok() && (*reps < 1 || *reps > 1000)) s = invalid_argument("--reps must be from 1 to 1000");
  if (s.ok()) s = cpu::force_simd_target(simd);
  if (!s.ok()) {
    std::fprintf(stderr, "tier-bench adam: %s\n", s.message().c_str());
    return 2;
  }
  o.params = *params;
  o.threads = static_cast<int>(*threads);
  o.grad = parse_dtype(*grad).value();
  o.param = parse_dtype(*param).value();
  o.has_out = *out != "none";
  if (o.has_out) o.out = parse_dtype(*out).value();
  o.reps = static_cast<int>(*reps);
  o.heap = *memory == "heap";
  o.state = cpu::parse_state_dtype(*state).value();
  for (auto k : {cpu::OptimizerKind::kAdam, cpu::OptimizerKind::kAdagrad, cpu::OptimizerKind::kLion,
                 cpu::OptimizerKind::kLamb}) {
    if (*kind == cpu::optimizer_kind_name(k)) o.kind = k;
  }

  auto r = measure_adam(o);
  if (!r.ok()) {
    std::fprintf(stderr, "tier-bench adam: %s\n", r.status().to_string().c_str());
    return 1;
  }
  const double ratio = r->params_per_second / r->roofline_params_per_second;
  if (json_out) {
    nlohmann::ordered_json j = {{"params", o.params},
                                {"optimizer", cpu::optimizer_kind_name(o.kind)},
                                {"threads", r->threads},
                                {"param_dtype", dtype_name(o.param)},
                                {"grad_dtype", dtype_name(o.grad)},
                                {"out_dtype", o.has_out ? dtype_name(o.out) : "none"},
                                {"state_dtype", cpu::state_dtype_name(o.state)},
                                {"simd_target", r->simd},
                                {"memory", o.heap ? "heap" : "arena"},
                                {"huge_page_bytes", r->huge_page_bytes},
                                {"locked", r->locked},
                                {"reps", o.reps},
                                {"bytes_per_param", r->bytes_per_param},
                                {"params_per_second", r->params_per_second},
                                {"best_params_per_second", r->best_params_per_second},
                                {"roofline_params_per_second", r->roofline_params_per_second},
                                {"best_roofline_params_per_second", r->best_roofline_params_per_second},
                                {"ratio_to_roofline", ratio},
                                {"bytes_per_second", r->params_per_second * r->bytes_per_param}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("%s: %s params, params %s, grads %s, out %s, state %s, %d threads, SIMD %s, %s memory\n",
              cpu::optimizer_kind_name(o.kind), (fmt(static_cast<double>(o.params) / 1e6, 0) + "M").c_str(),
              dtype_name(o.param), dtype_name(o.grad), o.has_out ? dtype_name(o.out) : "none",
              cpu::state_dtype_name(o.state), r->threads, r->simd.c_str(),
              o.heap ? "heap" : (r->locked ? "pinned arena" : "unpinned arena"));
  Table t({"kernel", "params/s (median)", "best", "bandwidth", "vs roofline"});
  t.add({cpu::optimizer_kind_name(o.kind), rate_params(r->params_per_second), rate_params(r->best_params_per_second),
         format_rate(r->params_per_second * r->bytes_per_param), fmt(ratio, 3)});
  t.add({"roofline", rate_params(r->roofline_params_per_second), rate_params(r->best_roofline_params_per_second),
         format_rate(r->roofline_params_per_second * r->bytes_per_param), "1.000"});
  t.print();
  return 0;
}

const CommandRegistrar kRegister(
    {"adam", "CPU Adam/AdamW params/s beside its roofline (Adam's memory pattern, trivial arithmetic)",
     "  --params N            parameters (default 100M)\n"
     "  --optimizer K         adam | adagrad | lion | lamb: the kernel timed (default adam; lamb: both passes)\n"
     "  --threads N           threads (default 0: all cores)\n"
     "  --grad-dtype T        fp32 | fp16 | bf16 (default fp32)\n"
     "  --param-dtype T       fp32 | bf16 (default fp32)\n"
     "  --out-dtype T         none | fp16 | bf16: fused low-precision copy of the params (default none)\n"
     "  --state-dtype T       fp32 | bf16 | int8: how m and v are stored (default fp32); the roofline is\n"
     "                        converted to that byte count\n"
     "  --reps N              timed passes of each kernel; the median is reported (default 5)\n"
     "  --memory M            arena (pinned, huge pages; default) | heap\n"
     "  --simd T              force a SIMD target (e.g. AVX2; default auto)\n"
     "  --json                print one JSON object\n"
     "  --quiet               no progress line",
     run_adam});

const SummaryRegistrar kSummaryAdam({30, "cpu adam", [](bool quick) -> Result<std::vector<SummaryRow>> {
                                       AdamBenchOptions o;
                                       o.params = quick ? 16'000'000 : 64'000'000;
                                       o.reps = quick ? 3 : 5;
                                       o.progress = false;
                                       TIER_ASSIGN_OR_RETURN(const auto r, measure_adam(o));
                                       return std::vector<SummaryRow>{
                                           {"cpu adam fp32, " + std::to_string(r.threads) + " threads, " + r.simd,
                                            rate_params(r.params_per_second),
                                            "roofline " + rate_params(r.roofline_params_per_second),
                                            r.params_per_second / r.roofline_params_per_second,
                                            fmt(static_cast<double>(o.params) / 1e6, 0) + "M params, " +
                                                format_rate(r.params_per_second * r.bytes_per_param)}};
                                     }});

}  // namespace
}  // namespace tier::bench
