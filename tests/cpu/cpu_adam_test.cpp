#include "tier/cpu_adam.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "cpu/reference.hpp"

namespace tier::cpu {
namespace {

using testing::bits_of;
using testing::Buffer;
using testing::for_each_simd_target;

// The relative error bound of the issue, measured the way a sum's error is: relative to the
// magnitude of what was summed. For exp_avg that is beta1 * |m| + (1 - beta1) * |g| carried over
// the steps (an exp_avg whose gradients cancel to nearly zero cannot be computed to 1e-6 of itself
// in any fp32 code, only to 1e-6 of its terms); for params, |p| plus the magnitudes of every
// update applied to it; for exp_avg_sq, the same sum over the squared magnitudes of the gradient
// terms (with L2 decay the gradient itself is a sum that can cancel).
constexpr double kRelTol = 1e-6;

struct RefAdam {
  std::vector<double> p, m, v;
  std::vector<double> p_scale, m_scale, v_scale;  // magnitudes of the terms summed into p, m, v

  explicit RefAdam(std::size_t n) : p(n), m(n, 0.0), v(n, 0.0), p_scale(n, 0.0), m_scale(n, 0.0), v_scale(n, 0.0) {}

  void step(const AdamHyperParams& hp, std::int64_t t, double grad_scale, const Buffer& g) {
    const double bc1 = hp.bias_correction ? 1 - std::pow(hp.beta1, static_cast<double>(t)) : 1;
    const double bc2 = hp.bias_correction ? 1 - std::pow(hp.beta2, static_cast<double>(t)) : 1;
    for (std::size_t i = 0; i < p.size(); ++i) {
      double gi = static_cast<double>(g.get(i)) * grad_scale;
      double gi_scale = std::fabs(gi);
      if (hp.decay_mode == WeightDecayMode::kL2) {
        gi += hp.weight_decay * p[i];
        gi_scale += hp.weight_decay * std::fabs(p[i]);
      }
      m[i] = hp.beta1 * m[i] + (1 - hp.beta1) * gi;
      m_scale[i] = hp.beta1 * m_scale[i] + (1 - hp.beta1) * gi_scale;
      v[i] = hp.beta2 * v[i] + (1 - hp.beta2) * gi * gi;
      v_scale[i] = hp.beta2 * v_scale[i] + (1 - hp.beta2) * gi_scale * gi_scale;
      if (hp.decay_mode == WeightDecayMode::kDecoupled) p[i] *= 1 - hp.lr * hp.weight_decay;
      const double delta = hp.lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + hp.eps);
      p_scale[i] = std::max(p_scale[i], std::fabs(p[i])) + std::fabs(delta);
      p[i] -= delta;
    }
  }
};

// Largest relative error of `got` against `want`, relative to max(|want|, scale).
double max_rel_error(const Buffer& got, const std::vector<double>& want, const std::vector<double>* scale,
                     std::size_t* where) {
  double worst = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double s = std::max(std::fabs(want[i]), scale ? (*scale)[i] : 0.0);
    const double e = std::fabs(static_cast<double>(got.get(i)) - want[i]) / s;
    if (!(e <= worst)) {
      worst = e;
      *where = i;
    }
  }
  return worst;
}

// Gradients of many magnitudes (1e-4 .. 1e2) so that every term of the update matters somewhere.
void fill_grads(Buffer& g, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (std::size_t i = 0; i < g.n; ++i) g.set(i, dist(rng) * std::pow(10.0f, static_cast<float>(i % 7) - 4.0f));
}

struct Case {
  DType param = DType::kF32;
  DType grad = DType::kF32;
  DType out = DType::kF32;
  bool has_out = false;
  WeightDecayMode mode = WeightDecayMode::kDecoupled;
  bool bias_correction = true;

  std::string name() const {
    return str("params ", dtype_name(param), ", grads ", dtype_name(grad), ", out ", has_out ? dtype_name(out) : "none",
               mode == WeightDecayMode::kL2 ? ", L2" : ", decoupled", bias_correction ? "" : ", no bias correction");
  }
};

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (DType p : {DType::kF32, DType::kBF16}) {
    for (DType g : {DType::kF32, DType::kF16, DType::kBF16}) {
      for (int o = 0; o < 3; ++o) {
        for (auto mode : {WeightDecayMode::kDecoupled, WeightDecayMode::kL2}) {
          Case c;
          c.param = p;
          c.grad = g;
          c.has_out = o > 0;
          c.out = o == 2 ? DType::kBF16 : DType::kF16;
          c.mode = mode;
          c.bias_correction = !(p == DType::kF32 && g == DType::kF16 && o == 1);
          cases.push_back(c);
        }
      }
    }
  }
  return cases;
}

// Runs `steps` steps of `c` on `n` elements and checks every step against the fp64 reference.
//
// kPerStep: before each step the reference takes the kernel's state (the fp32 values it stored),
// so each step's arithmetic is checked on its own, at 1e-6, over a realistic drift of the state.
// kTrajectory: the reference runs its own fp64 trajectory from the same start. Then the state also
// carry the rounding of their fp32 storage, up to half an ulp (2^-24 relative) per step for any
// fp32 optimizer (torch's included); the bound is 1e-6 plus that. (bf16 params are always checked per step:
// they round to 2^-9 each step.)
enum class Check { kPerStep, kTrajectory };

void check_case(const Case& c, std::size_t n, int steps, const std::string& target, Check check = Check::kPerStep) {
  SCOPED_TRACE(target + ": " + c.name());
  AdamHyperParams hp;
  hp.lr = 1e-3;
  hp.weight_decay = 0.01;
  hp.decay_mode = c.mode;
  hp.bias_correction = c.bias_correction;
  auto group = AdamGroup::create(hp);
  ASSERT_TRUE(group.ok()) << group.status();

  std::mt19937 rng(42);
  std::uniform_real_distribution<float> init(-1.0f, 1.0f);
  Buffer p(c.param, n), m(DType::kF32, n), v(DType::kF32, n), g(c.grad, n), out(c.out, n);
  RefAdam ref(n);
  for (std::size_t i = 0; i < n; ++i) {
    p.set(i, init(rng));
    m.set(i, 0.0f);
    v.set(i, 0.0f);
    ref.p[i] = p.get(i);
  }
  const double grad_scale = 0.5;
  double worst = 0;
  for (int s = 0; s < steps; ++s) {
    fill_grads(g, rng);
    if (check == Check::kPerStep || c.param == DType::kBF16) {
      for (std::size_t i = 0; i < n; ++i) {
        ref.p[i] = p.get(i);
        ref.m[i] = m.get(i);
        ref.v[i] = v.get(i);
        ref.p_scale[i] = 0;
        ref.m_scale[i] = std::fabs(ref.m[i]);
        ref.v_scale[i] = ref.v[i];
      }
    }
    auto step = group->begin_step(grad_scale);
    ASSERT_TRUE(step.ok()) << step.status();
    ASSERT_EQ(step->step(), s + 1);
    ref.step(hp, step->step(), grad_scale, g);
    AdamTensors t{p.ref(), m.ref(), v.ref(), g.cref(), c.has_out ? out.ref() : TensorRef{}};
    const Status st = adam_update_chunk(*step, t);
    ASSERT_TRUE(st.ok()) << st;

    std::size_t where = 0;
    // In a trajectory, every stored fp32 value has been rounded once per step.
    const double storage = check == Check::kTrajectory ? (s + 1) * std::ldexp(1.0, -24) : 0.0;
    double e = max_rel_error(m, ref.m, &ref.m_scale, &where);
    ASSERT_LE(e, kRelTol + storage) << "exp_avg at step " << s + 1 << ", element " << where;
    worst = std::max(worst, e);
    e = max_rel_error(v, ref.v, &ref.v_scale, &where);
    ASSERT_LE(e, kRelTol + storage) << "exp_avg_sq at step " << s + 1 << ", element " << where;
    worst = std::max(worst, e);
    if (c.param == DType::kF32) {
      e = max_rel_error(p, ref.p, &ref.p_scale, &where);
      ASSERT_LE(e, kRelTol + storage) << "params at step " << s + 1 << ", element " << where;
      worst = std::max(worst, e);
    } else {
      // Correctly rounded to bf16 from the exact update, but for values within 1e-6 of a tie.
      for (std::size_t i = 0; i < n; ++i) {
        const float want = testing::ref_round(static_cast<float>(ref.p[i]), DType::kBF16);
        if (bits_of(p.get(i)) == bits_of(want)) continue;
        const double ulp = std::ldexp(1.0, std::ilogb(ref.p[i]) - 7);
        const double dist_to_tie = std::fabs(std::fabs(ref.p[i] - want) - ulp / 2);
        ASSERT_LE(dist_to_tie, kRelTol * std::fabs(ref.p[i])) << "bf16 params at step " << s + 1 << ", element " << i;
      }
    }
    if (c.has_out) {
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(bits_of(out.get(i)), bits_of(testing::ref_round(p.get(i), c.out)))
            << "out must be the updated params rounded to nearest-even, element " << i;
      }
    }
  }
  EXPECT_EQ(group->step(), steps);
  ::testing::Test::RecordProperty(
      str(check == Check::kTrajectory ? "trajectory" : "per_step", "_worst_rel_error_", target), str(worst));
}

TEST(CpuAdam, MatchesFp64ReferenceForEveryDtypeModeAndTarget) {
  const auto cases = all_cases();
  for_each_simd_target([&](const std::string& target) {
    for (const Case& c : cases) {
      check_case(c, 1037, 40, target);  // 1037 = 64 * 16 + 13: a tail on every vector width
      if (HasFatalFailure()) return;
    }
  });
}

TEST(CpuAdam, StaysWithinToleranceOverManySteps) {
  for_each_simd_target([&](const std::string& target) {
    Case c;
    check_case(c, 523, 300, target, Check::kPerStep);
    check_case(c, 523, 300, target, Check::kTrajectory);
    c.grad = DType::kBF16;
    c.has_out = true;
    c.out = DType::kF16;
    c.mode = WeightDecayMode::kL2;
    check_case(c, 523, 300, target, Check::kPerStep);
    check_case(c, 523, 300, target, Check::kTrajectory);
  });
}

TEST(CpuAdam, LengthsShorterThanAVectorWork) {
  for_each_simd_target([&](const std::string& target) {
    for (std::size_t n : {1u, 2u, 3u, 5u, 15u, 17u}) {
      Case c;
      c.grad = DType::kF16;
      c.has_out = true;
      c.out = DType::kBF16;
      check_case(c, n, 3, target + " n=" + std::to_string(n));
    }
  });
}

// The state of one tensor for the determinism tests.
struct State {
  Buffer p, m, v, g, out;
  State(DType pd, DType gd, DType od, std::size_t n, unsigned seed)
      : p(pd, n), m(DType::kF32, n), v(DType::kF32, n), g(gd, n), out(od, n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (std::size_t i = 0; i < n; ++i) {
      p.set(i, d(rng));
      m.set(i, d(rng) * 0.1f);
      v.set(i, std::fabs(d(rng)) * 0.01f);
      g.set(i, d(rng));
    }
  }
  AdamTensors tensors() { return {p.ref(), m.ref(), v.ref(), g.cref(), out.ref()}; }
  AdamTensors slice(std::size_t at, std::size_t len) {
    auto sub = [&](Buffer& b) {
      return TensorRef{static_cast<std::uint8_t*>(b.data()) + at * dtype_size(b.dtype), b.dtype, len};
    };
    return {sub(p), sub(m), sub(v), sub(g), sub(out)};
  }
  bool same(const State& o) const {
    return p.same_bytes(o.p) && m.same_bytes(o.m) && v.same_bytes(o.v) && out.same_bytes(o.out);
  }
};

TEST(CpuAdam, ChunkingAndThreadCountGiveBitIdenticalResults) {
  AdamHyperParams hp;
  hp.weight_decay = 0.1;
  for (auto [pd, gd, od] :
       {std::tuple{DType::kF32, DType::kF32, DType::kF16}, std::tuple{DType::kF32, DType::kBF16, DType::kBF16},
        std::tuple{DType::kBF16, DType::kF16, DType::kF16}}) {
    const std::size_t n = 1'000'003;
    State whole(pd, gd, od, n, 1);
    for (std::int64_t s = 1; s <= 3; ++s) {
      auto step = AdamStep::make(hp, s);
      ASSERT_TRUE(step.ok());
      ASSERT_TRUE(adam_update_chunk(*step, whole.tensors()).ok());
    }
    for (int threads : {0, 2, 3, 4}) {
      State t(pd, gd, od, n, 1);
      for (std::int64_t s = 1; s <= 3; ++s) {
        ASSERT_TRUE(adam_update(AdamStep::make(hp, s).value(), t.tensors(), threads).ok());
      }
      EXPECT_TRUE(t.same(whole)) << threads << " threads, " << dtype_name(pd) << "/" << dtype_name(gd);
    }
    // A pipeline's chunks, of sizes that put boundaries inside vectors.
    State c(pd, gd, od, n, 1);
    for (std::int64_t s = 1; s <= 3; ++s) {
      const auto step = AdamStep::make(hp, s).value();
      std::size_t at = 0;
      const std::size_t lens[] = {1, 3, 17, 4093, 65536 + 5, 250'001};
      for (std::size_t k = 0; at < n; ++k) {
        const std::size_t len = std::min(lens[(k + static_cast<std::size_t>(s)) % 6], n - at);
        ASSERT_TRUE(adam_update_chunk(step, c.slice(at, len)).ok());
        at += len;
      }
    }
    EXPECT_TRUE(c.same(whole)) << "chunked, " << dtype_name(pd) << "/" << dtype_name(gd);
  }
}

TEST(CpuAdam, ChunkingIsInvisibleOnEveryTarget) {
  AdamHyperParams hp;
  for_each_simd_target([&](const std::string& target) {
    const std::size_t n = 4099;
    State whole(DType::kF32, DType::kBF16, DType::kBF16, n, 2);
    State chunked(DType::kF32, DType::kBF16, DType::kBF16, n, 2);
    const auto step = AdamStep::make(hp, 7).value();
    ASSERT_TRUE(adam_update(step, whole.tensors(), 2).ok());
    for (std::size_t at = 0; at < n; at += 5) {
      ASSERT_TRUE(adam_update_chunk(step, chunked.slice(at, std::min<std::size_t>(5, n - at))).ok());
    }
    EXPECT_TRUE(chunked.same(whole)) << target;
  });
}

TEST(CpuAdam, GradScaleEqualsPrescaledGradients) {
  AdamHyperParams hp;
  State a(DType::kF32, DType::kF32, DType::kF16, 999, 3);
  State b(DType::kF32, DType::kF32, DType::kF16, 999, 3);
  ASSERT_TRUE(scale(b.g.ref(), 0.25f).ok());
  ASSERT_TRUE(adam_update(AdamStep::make(hp, 1, 0.25).value(), a.tensors()).ok());
  ASSERT_TRUE(adam_update(AdamStep::make(hp, 1, 1.0).value(), b.tensors()).ok());
  EXPECT_TRUE(a.p.same_bytes(b.p));
  EXPECT_TRUE(a.m.same_bytes(b.m));
}

TEST(CpuAdam, DecoupledAndL2DecayDiffer) {
  AdamHyperParams hp;
  hp.weight_decay = 0.5;
  State a(DType::kF32, DType::kF32, DType::kF32, 64, 4);
  State b(DType::kF32, DType::kF32, DType::kF32, 64, 4);
  ASSERT_TRUE(adam_update(AdamStep::make(hp, 1).value(), a.tensors()).ok());
  hp.decay_mode = WeightDecayMode::kL2;
  ASSERT_TRUE(adam_update(AdamStep::make(hp, 1).value(), b.tensors()).ok());
  EXPECT_FALSE(a.p.same_bytes(b.p));
  EXPECT_TRUE(a.v.get(0) != b.v.get(0)) << "L2 decay enters the second moment";
}

TEST(AdamGroup, CountsStepsAndValidatesChanges) {
  auto g = AdamGroup::create({});
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->step(), 0);
  auto s1 = g->begin_step();
  ASSERT_TRUE(s1.ok());
  EXPECT_EQ(s1->step(), 1);
  EXPECT_EQ(g->begin_step().value().step(), 2);
  EXPECT_EQ(g->step(), 2);
  ASSERT_TRUE(g->set_step(100).ok());
  EXPECT_EQ(g->begin_step().value().step(), 101);
  EXPECT_EQ(g->set_step(-1).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(g->set_lr(0.5).ok());
  EXPECT_EQ(g->hyper_params().lr, 0.5);
  EXPECT_EQ(g->set_lr(std::nan("")).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g->hyper_params().lr, 0.5) << "a rejected change leaves the group as it was";
  // A rejected step does not advance the counter.
  EXPECT_FALSE(g->begin_step(0.0).ok());
  EXPECT_EQ(g->step(), 101);
  // Bias correction constants: step 1 with beta1 0.9 divides lr by 0.1.
  auto s = AdamStep::make({}, 1);
  ASSERT_TRUE(s.ok());
  EXPECT_FLOAT_EQ(s->constants().step_size, 1e-3f / 0.1f);
  EXPECT_FLOAT_EQ(s->constants().inv_sqrt_bc2, static_cast<float>(1 / std::sqrt(0.001)));
}

TEST(CpuAdam, NonFiniteOrOutOfRangeHyperParamsAreRejected) {
  const double inf = std::numeric_limits<double>::infinity();
  struct Bad {
    AdamHyperParams hp;
    const char* field;
  };
  std::vector<Bad> bad;
  auto with = [](auto f) {
    AdamHyperParams hp;
    f(hp);
    return hp;
  };
  bad.push_back({with([](auto& h) { h.lr = std::nan(""); }), "lr"});
  bad.push_back({with([](auto& h) { h.lr = -1; }), "lr"});
  bad.push_back({with([&](auto& h) { h.eps = inf; }), "eps"});
  bad.push_back({with([](auto& h) { h.eps = -1e-8; }), "eps"});
  bad.push_back({with([](auto& h) { h.eps = 0; }), "eps 0"});  // 0/0 wherever a gradient is 0
  bad.push_back({with([](auto& h) {
                   h.eps = 0;
                   h.kind = OptimizerKind::kAdagrad;
                 }),
                 "eps 0"});
  bad.push_back({with([](auto& h) { h.beta1 = 1.0; }), "beta1"});
  bad.push_back({with([](auto& h) { h.beta2 = -0.1; }), "beta2"});
  bad.push_back({with([](auto& h) { h.beta2 = std::nan(""); }), "beta2"});
  bad.push_back({with([](auto& h) { h.weight_decay = -0.01; }), "weight_decay"});
  bad.push_back({with([&](auto& h) { h.weight_decay = inf; }), "weight_decay"});
  for (const auto& b : bad) {
    auto s = AdamStep::make(b.hp, 1);
    ASSERT_FALSE(s.ok()) << b.field;
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(b.field), std::string::npos) << s.status();
    EXPECT_FALSE(AdamGroup::create(b.hp).ok()) << b.field;
  }
  AdamHyperParams lion = default_hyper_params(OptimizerKind::kLion);
  lion.eps = 0;  // Lion takes signs and never reads eps
  EXPECT_TRUE(lion.validate().ok());
  EXPECT_EQ(AdamStep::make({}, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(AdamStep::make({}, 1, inf).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(AdamStep::make({}, 1, -2).status().code(), StatusCode::kInvalidArgument);
}

TEST(CpuAdam, BadTensorsGetClearErrors) {
  const auto step = AdamStep::make({}, 1).value();
  State s(DType::kF32, DType::kF16, DType::kBF16, 64, 5);
  auto expect_error = [&](AdamTensors t, const char* needle) {
    const Status st = adam_update(step, t);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << needle;
    EXPECT_NE(st.message().find(needle), std::string::npos) << st;
    EXPECT_EQ(adam_update_chunk(step, t).code(), StatusCode::kInvalidArgument);
  };
  AdamTensors t = s.tensors();
  t.grads.numel = 63;
  expect_error(t, "63 elements");
  t = s.tensors();
  t.out.numel = 65;
  expect_error(t, "65 elements");
  t = s.tensors();
  t.exp_avg.data = static_cast<std::uint8_t*>(t.exp_avg.data) + 2;
  t.exp_avg.numel = 60;
  t.params.numel = t.exp_avg_sq.numel = t.grads.numel = t.out.numel = 60;
  expect_error(t, "aligned");
  t = s.tensors();
  t.exp_avg_sq.dtype = DType::kF16;
  expect_error(t, "fp32");
  t = s.tensors();
  t.params.dtype = DType::kF16;
  expect_error(t, "params");
  t = s.tensors();
  t.grads = ConstTensorRef(t.grads.data, DType::kI8, 64);
  expect_error(t, "int8");
  t = s.tensors();
  t.out.data = t.params.data;
  t.out.dtype = DType::kF32;
  expect_error(t, "overlap");
  t = s.tensors();
  t.exp_avg.data = nullptr;
  expect_error(t, "null");
  EXPECT_EQ(adam_update(step, s.tensors(), -3).code(), StatusCode::kInvalidArgument);
  // Nothing was touched by the rejected calls.
  State fresh(DType::kF32, DType::kF16, DType::kBF16, 64, 5);
  EXPECT_TRUE(s.same(fresh));
}

TEST(CpuAdam, EmptyRangeIsANoOp) {
  const auto step = AdamStep::make({}, 1).value();
  EXPECT_TRUE(adam_update(step, AdamTensors{}).ok());
}

TEST(CpuAdam, RooflinePassTouchesTheSameStreams) {
  State s(DType::kF32, DType::kBF16, DType::kF16, 1001, 6);
  const State before = s;
  ASSERT_TRUE(adam_roofline_pass(s.tensors(), 2).ok());
  for (std::size_t i : {0u, 500u, 1000u}) {
    const float m = before.m.get(i) + before.g.get(i);
    EXPECT_EQ(s.m.get(i), m);
    EXPECT_EQ(s.v.get(i), before.v.get(i) + before.g.get(i));
    EXPECT_EQ(s.p.get(i), before.p.get(i) + m);
    EXPECT_EQ(s.out.get(i), testing::ref_round(s.p.get(i), DType::kF16));
  }
  EXPECT_TRUE(s.g.same_bytes(before.g)) << "gradients are read only";
}

}  // namespace
}  // namespace tier::cpu
