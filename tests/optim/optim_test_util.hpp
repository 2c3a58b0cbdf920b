// Helpers shared by the offloaded optimizer's tests: a small model (partitions of mixed sizes and
// groups), deterministic gradients, the in-RAM reference (cpu::adam_update, or cpu::lamb_update, on whole partitions
// with the norm and grad_scale computed the documented way), and optimizers over each state home.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "nvme/nvme_test_util.hpp"
#include "tier/cpu_adam.hpp"
#include "tier/cpu_kernels.hpp"
#include "tier/ext/fault_injecting_engine.hpp"
#include "tier/ext/host_arena.hpp"
#include "tier/offloaded_optimizer.hpp"
#include "tier/ext/swap_space.hpp"
#include "tier/state_codec.hpp"

namespace tier::optim::test {

using nvme::test::ScratchDir;

struct PartDesc {
  std::uint64_t numel;
  int group;
  ParamOutput output;
};

// Small and large partitions, three groups, every output kind; 1-, 3- and 5-element partitions
// and one that spans several chunks of the sizes the tests use.
inline std::vector<PartDesc> mixed_model() {
  return {{1, 0, ParamOutput::kBF16},    {3000, 0, ParamOutput::kBF16}, {17, 1, ParamOutput::kF16},
          {20000, 0, ParamOutput::kF16}, {5, 2, ParamOutput::kNone},    {1024, 1, ParamOutput::kF32},
          {3, 0, ParamOutput::kBF16},    {7777, 2, ParamOutput::kBF16}, {4096, 0, ParamOutput::kNone},
          {1500, 1, ParamOutput::kF16}};
}

inline std::uint64_t total_elements(const std::vector<PartDesc>& m) {
  std::uint64_t n = 0;
  for (const auto& p : m) n += p.numel;
  return n;
}

inline std::vector<cpu::AdamHyperParams> three_groups() {
  cpu::AdamHyperParams a;
  a.lr = 1e-2;
  a.weight_decay = 0.01;
  cpu::AdamHyperParams b;
  b.lr = 3e-3;
  b.beta1 = 0.8;
  b.beta2 = 0.95;
  b.eps = 1e-6;
  b.weight_decay = 0.1;
  b.decay_mode = cpu::WeightDecayMode::kL2;
  cpu::AdamHyperParams c;
  c.lr = 5e-3;
  c.bias_correction = false;
  return {a, b, c};
}

inline std::vector<float> initial_values(std::uint64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// A gradient of n elements in `dtype` (bytes), deterministic in (seed, step, micro, partition).
inline std::vector<std::uint8_t> make_grad(std::uint64_t n, DType dtype, std::uint64_t seed, float scale = 1e-2f) {
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 12345);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> f(n);
  for (auto& x : f) x = d(rng);
  std::vector<std::uint8_t> out(n * dtype_size(dtype) + 4);
  const Status s = cpu::convert(cpu::ConstTensorRef(f.data(), DType::kF32, n), cpu::TensorRef{out.data(), dtype, n});
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

inline std::uint64_t grad_seed(std::uint64_t step, int micro, std::size_t part) {
  return step * 1000003 + static_cast<std::uint64_t>(micro) * 7919 + part;
}

// The in-RAM reference: whole partitions, cpu::adam_update, the documented norm and grad_scale.
// With compressed state (`sd` bf16 or int8) the moments are kept in that format, blocks counted
// from each partition's first element; exp_avg() and exp_avg_sq() give them decoded.
class Reference {
 public:
  Reference(std::vector<PartDesc> model, std::vector<cpu::AdamHyperParams> groups, std::uint64_t seed,
            cpu::StateDType sd = cpu::StateDType::kF32)
      : model_(std::move(model)), sd_(sd) {
    for (const auto& hp : groups) groups_.push_back(cpu::AdamGroup::create(hp).value());
    for (std::size_t i = 0; i < model_.size(); ++i) {
      p_.push_back(initial_values(model_[i].numel, seed + i));
      m_.emplace_back(model_[i].numel, 0.0f);
      v_.emplace_back(model_[i].numel, 0.0f);
      out_.emplace_back(model_[i].numel * 4 + 4, 0);
      acc_.emplace_back(model_[i].numel, 0.0f);
      count_.push_back(0);
      const std::uint64_t n = model_[i].numel;
      mc_.emplace_back(n * dtype_size(cpu::exp_avg_dtype(sd)) + 4, 0);
      vc_.emplace_back(n * dtype_size(cpu::exp_avg_sq_dtype(sd)) + 4, 0);
      ms_.emplace_back(cpu::state_scale_count(sd, n) + 1, 0.0f);
      vs_.emplace_back(cpu::state_scale_count(sd, n) + 1, 0.0f);
    }
  }

  void add_grad(std::size_t i, const void* g, DType dt) {
    const std::uint64_t n = model_[i].numel;
    std::vector<float> f(n);
    ASSERT_TRUE(cpu::convert(cpu::ConstTensorRef(g, dt, n), cpu::TensorRef{f.data(), DType::kF32, n}).ok());
    if (count_[i] == 0) {
      acc_[i] = f;
    } else {
      for (std::uint64_t k = 0; k < n; ++k) acc_[i][k] = acc_[i][k] + f[k];
    }
    ++count_[i];
  }

  // One step; returns false when skipped for a non-finite gradient. `skip_missing`: partitions
  // without a gradient stay untouched (StepOptions::skip_missing_grads) instead of taking zeros.
  bool step(double loss_scale, double max_norm, double* norm_out = nullptr, bool skip_missing = false) {
    double total = 0;
    for (std::size_t i = 0; i < model_.size(); ++i) {
      if (count_[i] == 0) continue;
      total += cpu::sum_of_squares(cpu::ConstTensorRef(acc_[i].data(), DType::kF32, acc_[i].size())).value();
    }
    const double norm = std::sqrt(total) / loss_scale;
    if (norm_out) *norm_out = norm;
    if (!std::isfinite(total)) {
      clear();
      return false;
    }
    const float clip = max_norm > 0 ? cpu::clip_coefficient(norm, max_norm) : 1.0f;
    const double gs = static_cast<double>(clip) / loss_scale;
    std::vector<cpu::AdamStep> steps;
    for (auto& g : groups_) steps.push_back(g.begin_step(gs).value());
    for (std::size_t i = 0; i < model_.size(); ++i) {
      const std::uint64_t n = model_[i].numel;
      std::vector<float> zeros;
      const float* g = acc_[i].data();
      if (count_[i] == 0 && skip_missing) continue;
      if (count_[i] == 0) {
        zeros.assign(n, 0.0f);
        g = zeros.data();
      }
      cpu::TensorRef out{};
      if (model_[i].output != ParamOutput::kNone) out = {out_[i].data(), param_output_dtype(model_[i].output), n};
      const cpu::AdamStep& st = steps[static_cast<std::size_t>(model_[i].group)];
      cpu::AdamTensors t{{p_[i].data(), DType::kF32, n},
                         {m_[i].data(), DType::kF32, n},
                         {v_[i].data(), DType::kF32, n},
                         cpu::ConstTensorRef(g, DType::kF32, n),
                         out};
      if (sd_ != cpu::StateDType::kF32) {
        t.exp_avg = {mc_[i].data(), cpu::exp_avg_dtype(sd_), n};
        t.exp_avg_sq = {vc_[i].data(), cpu::exp_avg_sq_dtype(sd_), n};
        if (sd_ == cpu::StateDType::kInt8) {
          t.exp_avg_scales = ms_[i].data();
          t.exp_avg_sq_scales = vs_[i].data();
        }
      }
      // Lamb: both passes over the whole partition in RAM.
      const Status s =
          st.hyper_params().kind == cpu::OptimizerKind::kLamb ? cpu::lamb_update(st, t, 1) : cpu::adam_update(st, t, 1);
      EXPECT_TRUE(s.ok()) << s;
      if (sd_ != cpu::StateDType::kF32) {
        const bool q = sd_ == cpu::StateDType::kInt8;
        EXPECT_TRUE(cpu::decode_state(cpu::StateMoment::kExpAvg, t.exp_avg, q ? ms_[i].data() : nullptr,
                                      {m_[i].data(), DType::kF32, n})
                        .ok());
        EXPECT_TRUE(cpu::decode_state(cpu::StateMoment::kExpAvgSq, t.exp_avg_sq, q ? vs_[i].data() : nullptr,
                                      {v_[i].data(), DType::kF32, n})
                        .ok());
      }
    }
    clear();
    return true;
  }

  void clear() {
    for (auto& c : count_) c = 0;
  }
  void set_lr(int g, double lr) { ASSERT_TRUE(groups_[static_cast<std::size_t>(g)].set_lr(lr).ok()); }

  const std::vector<float>& master(std::size_t i) const { return p_[i]; }
  const std::vector<float>& exp_avg(std::size_t i) const { return m_[i]; }
  const std::vector<float>& exp_avg_sq(std::size_t i) const { return v_[i]; }
  const std::vector<std::uint8_t>& out(std::size_t i) const { return out_[i]; }
  const std::vector<PartDesc>& model() const { return model_; }

 private:
  std::vector<PartDesc> model_;
  cpu::StateDType sd_;
  std::vector<cpu::AdamGroup> groups_;
  std::vector<std::vector<float>> p_, m_, v_, acc_, ms_, vs_;
  std::vector<std::vector<std::uint8_t>> mc_, vc_;
  std::vector<std::vector<std::uint8_t>> out_;
  std::vector<int> count_;
};

// Bit-for-bit comparison of floats (so that -0 vs 0 and NaN payloads count).
inline ::testing::AssertionResult same_bits(const float* a, const float* b, std::uint64_t n, const std::string& what) {
  if (std::memcmp(a, b, n * sizeof(float)) == 0) return ::testing::AssertionSuccess();
  for (std::uint64_t i = 0; i < n; ++i) {
    if (std::memcmp(a + i, b + i, sizeof(float)) != 0) {
      return ::testing::AssertionFailure()
             << what << ": element " << i << " is " << a[i] << " but the reference has " << b[i];
    }
  }
  return ::testing::AssertionFailure() << what << ": differs";
}

// Compares every partition's three state arrays with the reference.
inline ::testing::AssertionResult state_matches(OffloadedOptimizer& opt, const Reference& ref) {
  for (std::size_t i = 0; i < ref.model().size(); ++i) {
    const std::uint64_t n = ref.model()[i].numel;
    std::vector<float> got(n);
    const StateKind kinds[3] = {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq};
    const std::vector<float>* want[3] = {&ref.master(i), &ref.exp_avg(i), &ref.exp_avg_sq(i)};
    for (int k = 0; k < 3; ++k) {
      const Status s = opt.read_state(static_cast<PartitionId>(i), kinds[k], got.data(), 0, n);
      if (!s.ok()) return ::testing::AssertionFailure() << "read_state: " << s;
      auto r = same_bits(got.data(), want[k]->data(), n, str("partition ", i, " ", state_kind_name(kinds[k])));
      if (!r) return r;
    }
  }
  return ::testing::AssertionSuccess();
}

// Where a test keeps its state: NVMe through a backend, or host memory.
struct Home {
  const char* name;
  StateHome home;
  IoEngineKind engine;
  bool direct;  // NVMe: O_DIRECT files on the disk, else buffered on /dev/shm
};

inline void PrintTo(const Home& h, std::ostream* os) {
  *os << h.name;
}

inline std::vector<Home> all_homes() {
  return {{"nvme_uring_direct", StateHome::kNvme, IoEngineKind::kUring, true},
          {"nvme_posix_shm", StateHome::kNvme, IoEngineKind::kPosix, false},
          {"host", StateHome::kHost, IoEngineKind::kAuto, false}};
}

// The NVMe homes of all_homes().
inline std::vector<Home> nvme_homes() {
  std::vector<Home> h;
  for (const auto& x : all_homes()) {
    if (x.home == StateHome::kNvme) h.push_back(x);
  }
  return h;
}

inline std::string home_name(const testing::TestParamInfo<Home>& info) {
  return info.param.name;
}

// "" when the home can be used here, otherwise why not.
inline std::string home_unavailable(const Home& h) {
  if (h.home == StateHome::kHost) return {};
  return nvme::test::backend_unavailable({h.engine, h.direct, h.name});
}

// Registers `ref`'s model in `opt` (partitions p0, p1, ... with the reference's initial values)
// and finishes registration.
inline Status register_model(OffloadedOptimizer& opt, const Reference& ref, std::uint64_t seed) {
  for (std::size_t i = 0; i < ref.model().size(); ++i) {
    const auto init = initial_values(ref.model()[i].numel, seed + i);
    PartitionSpec ps;
    ps.numel = ref.model()[i].numel;
    ps.group = ref.model()[i].group;
    ps.output = ref.model()[i].output;
    ps.initial = init.data();
    ps.name = str("p", i);
    auto id = opt.add_partition(ps);
    if (!id.ok()) return id.status();
    if (*id != i) return internal_error("unexpected partition id");
  }
  return opt.finish_registration();
}

// An optimizer with its own scratch directory and, for NVMe, its own swap space wrapped in a
// fault-injecting engine (faults() is null for host home).
class Rig {
 public:
  Rig(const Home& h, OffloadedOptimizerOptions o, std::uint64_t swap_bytes = 32ull << 20) {
    if (h.home == StateHome::kNvme) {
      dir_ = std::make_unique<ScratchDir>(h.direct ? nvme::test::disk_base() : nvme::test::shm_base(), "optim");
      if (!dir_->ok()) {
        status_ = internal_error("no scratch directory");
        return;
      }
      auto a = HostArena::create({8ull << 20});
      if (!a.ok()) {
        status_ = a.status();
        return;
      }
      arena_ = std::move(a).value();
      nvme::SwapSpaceOptions so;
      so.paths = {dir_->sub("swap")};
      so.bytes_per_path = swap_bytes;
      so.engine = h.engine;
      so.use_direct = h.direct;
      so.block_size = 16 << 10;
      so.queue_depth = 8;
      so.arena = arena_.get();
      so.wrap_engine = [this](std::unique_ptr<nvme::IoEngine> inner) -> std::unique_ptr<nvme::IoEngine> {
        auto f = std::make_unique<nvme::FaultInjectingEngine>(std::move(inner));
        faults_ = f.get();
        return f;
      };
      auto sp = nvme::SwapSpace::create(so);
      if (!sp.ok()) {
        status_ = sp.status();
        return;
      }
      swap_ = std::move(sp).value();
      o.swap = swap_.get();
      o.arena = arena_.get();
    }
    o.home = h.home;
    auto opt = OffloadedOptimizer::create(o);
    if (!opt.ok()) {
      status_ = opt.status();
      return;
    }
    opt_ = std::move(opt).value();
  }
  ~Rig() {
    opt_.reset();
    swap_.reset();
    arena_.reset();
  }

  const Status& status() const { return status_; }
  OffloadedOptimizer& opt() { return *opt_; }
  nvme::FaultInjectingEngine* faults() { return faults_; }
  std::string dir() const { return dir_ ? dir_->path() : std::string(); }

  // Registers the model with the reference's initial values and finishes registration.
  Status register_model(const Reference& ref, std::uint64_t seed) { return test::register_model(*opt_, ref, seed); }

 private:
  Status status_;
  std::unique_ptr<ScratchDir> dir_;
  std::unique_ptr<HostArena> arena_;
  std::unique_ptr<nvme::SwapSpace> swap_;
  nvme::FaultInjectingEngine* faults_ = nullptr;
  std::unique_ptr<OffloadedOptimizer> opt_;
};

// Outputs captured from a step: per partition, the bytes of its low-precision params.
struct Outputs {
  std::vector<std::vector<std::uint8_t>> data;
  explicit Outputs(const std::vector<PartDesc>& m) {
    for (const auto& p : m) data.emplace_back(p.numel * 4 + 4, 0);
  }
  // StepOptions::destinations: every partition's buffer, or those `keep` says (others null).
  template <class Keep>
  std::vector<void*> pointers(Keep keep) {
    std::vector<void*> out(data.size(), nullptr);
    for (std::size_t i = 0; i < data.size(); ++i) {
      if (keep(static_cast<PartitionId>(i))) out[i] = data[i].data();
    }
    return out;
  }
  std::vector<void*> pointers() {
    return pointers([](PartitionId) { return true; });
  }
};

// A ParamSink made of a test's lambdas.
struct FnSink final : ParamSink {
  std::function<Status(const OutputChunk&)> fn;
  std::function<void()> on_abandoned;
  explicit FnSink(std::function<Status(const OutputChunk&)> f, std::function<void()> a = {})
      : fn(std::move(f)), on_abandoned(std::move(a)) {}
  Status deliver(const OutputChunk& c) override { return fn(c); }
  void abandoned() override {
    if (on_abandoned) on_abandoned();
  }
};

// Feeds one step's gradients (all micro-steps) to both, in `dtype`, copied or borrowed.
// A rig for `home` with `ref`'s model registered, and (unless `o` sets them) 4096-element chunks
// (several partitions per chunk, and partitions across chunks) and 3 buffers.
inline std::unique_ptr<Rig> make_rig(const Home& home, OffloadedOptimizerOptions o, const Reference& ref) {
  o.chunk_elements = o.chunk_elements ? o.chunk_elements : 4096;
  o.buffer_count = o.buffer_count ? o.buffer_count : 3;
  auto rig = std::make_unique<Rig>(home, o);
  EXPECT_TRUE(rig->status().ok()) << rig->status();
  if (rig->status().ok()) {
    EXPECT_TRUE(rig->register_model(ref, 11).ok());
  }
  return rig;
}

inline void feed(OffloadedOptimizer& opt, Reference& ref, std::uint64_t step, int micro_steps, DType dtype,
                 GradMode mode, std::vector<std::vector<std::uint8_t>>* keep = nullptr, float scale = 1e-2f) {
  for (int micro = 0; micro < micro_steps; ++micro) {
    for (std::size_t i = 0; i < ref.model().size(); ++i) {
      auto g = make_grad(ref.model()[i].numel, dtype, grad_seed(step, micro, i), scale);
      ASSERT_TRUE(
          opt.add_grad(static_cast<PartitionId>(i), cpu::ConstTensorRef(g.data(), dtype, ref.model()[i].numel), mode)
              .ok());
      ref.add_grad(i, g.data(), dtype);
      if (keep) keep->push_back(std::move(g));
    }
  }
}

}  // namespace tier::optim::test
