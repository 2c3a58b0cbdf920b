// Adagrad, Lion and Lamb on the CPU: each kind against an fp64 scalar reference of its formula,
// and bit-identical results for any chunking and thread count.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "cpu/reference.hpp"
#include "tier/cpu_adam.hpp"

namespace tier::cpu {
namespace {

using testing::Buffer;
using testing::for_each_simd_target;

// Relative to the magnitude of the terms summed (see cpu_adam_test.cpp): a single fp32 step
// rounds a few times; 1e-5 leaves room for that and still catches any wrong term.
constexpr double kRelTol = 1e-5;

// One step of `hp.kind` in fp64 from the kernel's stored fp32 state. Returns the expected
// p, m, v and the magnitude each was summed from.
struct Expect {
  std::vector<double> p, m, v, p_scale, m_scale, v_scale;
};

Expect reference_step(const AdamHyperParams& hp, std::int64_t t, double grad_scale, const Buffer& p, const Buffer& m,
                      const Buffer& v, const Buffer& g) {
  const std::size_t n = p.n;
  Expect e{std::vector<double>(n), std::vector<double>(n), std::vector<double>(n),
           std::vector<double>(n), std::vector<double>(n), std::vector<double>(n)};
  const double wd = hp.weight_decay;
  std::vector<double> u(n);
  double psq = 0, usq = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double pi = p.get(i), mi = m.get(i), vi = v.get(i);
    const double gi = static_cast<double>(g.get(i)) * grad_scale;
    switch (hp.kind) {
      case OptimizerKind::kAdagrad: {
        const double gd = gi + wd * pi;
        e.v[i] = vi + gd * gd;
        e.v_scale[i] = vi + gd * gd + 1e-30;
        const double delta = hp.lr * gd / (std::sqrt(e.v[i]) + hp.eps);
        e.p[i] = pi - delta;
        e.p_scale[i] = std::fabs(pi) + std::fabs(delta);
        e.m[i] = mi;  // untouched
        e.m_scale[i] = std::fabs(mi);
        break;
      }
      case OptimizerKind::kLion: {
        const double c = hp.beta1 * mi + (1 - hp.beta1) * gi;
        const double sign = c > 0 ? 1.0 : (c < 0 ? -1.0 : 0.0);
        e.p[i] = pi * (1 - hp.lr * wd) - hp.lr * sign;
        e.p_scale[i] = std::fabs(pi) + hp.lr;
        // A sign taken of a value within fp32 rounding of zero may go either way.
        if (std::fabs(c) < 1e-6 * (std::fabs(mi) + std::fabs(gi))) e.p_scale[i] = 1e30;
        e.m[i] = hp.beta2 * mi + (1 - hp.beta2) * gi;
        e.m_scale[i] = std::fabs(mi) + std::fabs(gi);
        e.v[i] = vi;
        e.v_scale[i] = std::fabs(vi);
        break;
      }
      case OptimizerKind::kLamb: {
        const double bc1 = hp.bias_correction ? 1 - std::pow(hp.beta1, static_cast<double>(t)) : 1;
        const double bc2 = hp.bias_correction ? 1 - std::pow(hp.beta2, static_cast<double>(t)) : 1;
        e.m[i] = hp.beta1 * mi + (1 - hp.beta1) * gi;
        e.m_scale[i] = std::fabs(mi) + std::fabs(gi);
        e.v[i] = hp.beta2 * vi + (1 - hp.beta2) * gi * gi;
        e.v_scale[i] = vi + gi * gi;
        u[i] = (e.m[i] / bc1) / (std::sqrt(e.v[i] / bc2) + hp.eps) + wd * pi;
        psq += pi * pi;
        usq += u[i] * u[i];
        break;
      }
      case OptimizerKind::kAdam: ADD_FAILURE() << "Adam is tested in cpu_adam_test.cpp"; break;
    }
  }
  if (hp.kind == OptimizerKind::kLamb) {
    double trust = 1;
    if (psq > 0 && usq > 0) trust = std::clamp(std::sqrt(psq) / std::sqrt(usq), hp.min_coeff, hp.max_coeff);
    for (std::size_t i = 0; i < n; ++i) {
      const double pi = p.get(i);
      const double delta = hp.lr * trust * u[i];
      e.p[i] = pi - delta;
      e.p_scale[i] = std::fabs(pi) + std::fabs(delta);
    }
  }
  return e;
}

void expect_close(const Buffer& got, const std::vector<double>& want, const std::vector<double>& scale,
                  const char* what, int step) {
  double worst = 0;
  std::size_t where = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got.get(i)) - want[i]) / std::max(scale[i], 1e-30);
    if (!(err <= worst)) {
      worst = err;
      where = i;
    }
  }
  EXPECT_LE(worst, kRelTol) << what << " at step " << step << ", element " << where << ": got " << got.get(where)
                            << ", want " << want[where];
}

AdamHyperParams params_of(OptimizerKind kind) {
  AdamHyperParams hp = default_hyper_params(kind);
  hp.lr = kind == OptimizerKind::kLion ? 1e-3 : 1e-2;
  hp.weight_decay = 0.05;
  return hp;
}

void run_reference_case(OptimizerKind kind, DType grad, DType out, bool has_out, std::size_t n,
                        const std::string& target) {
  SCOPED_TRACE(str(target, ": ", optimizer_kind_name(kind), ", grads ", dtype_name(grad), ", out ",
                   has_out ? dtype_name(out) : "none", ", n ", n));
  const AdamHyperParams hp = params_of(kind);
  auto group = AdamGroup::create(hp);
  ASSERT_TRUE(group.ok()) << group.status();
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> init(-1.0f, 1.0f);
  std::normal_distribution<float> gd(0.0f, 1.0f);
  Buffer p(DType::kF32, n), m(DType::kF32, n), v(DType::kF32, n), g(grad, n), o(out, n);
  for (std::size_t i = 0; i < n; ++i) {
    p.set(i, init(rng));
    m.set(i, 0.0f);
    v.set(i, 0.0f);
  }
  const double grad_scale = 0.5;
  for (int s = 1; s <= 8; ++s) {
    for (std::size_t i = 0; i < n; ++i) g.set(i, gd(rng) * std::pow(10.0f, static_cast<float>(i % 5) - 3.0f));
    auto step = group->begin_step(grad_scale);
    ASSERT_TRUE(step.ok()) << step.status();
    const Expect e = reference_step(hp, step->step(), grad_scale, p, m, v, g);
    const AdamTensors t{p.ref(), m.ref(), v.ref(), g.cref(), has_out ? o.ref() : TensorRef{}};
    const Status st = kind == OptimizerKind::kLamb ? lamb_update(*step, t, 1) : adam_update_chunk(*step, t);
    ASSERT_TRUE(st.ok()) << st;
    expect_close(p, e.p, e.p_scale, "params", s);
    expect_close(m, e.m, e.m_scale, "exp_avg", s);
    expect_close(v, e.v, e.v_scale, "exp_avg_sq", s);
    if (has_out) {
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(testing::bits_of(o.get(i)), testing::bits_of(testing::ref_round(p.get(i), out))) << "out " << i;
      }
    }
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(CpuOptimizers, EveryKindMatchesItsFp64ReferenceForEveryGradDtypeAndTarget) {
  for_each_simd_target([&](const std::string& target) {
    for (OptimizerKind kind : {OptimizerKind::kAdagrad, OptimizerKind::kLion, OptimizerKind::kLamb}) {
      for (DType g : {DType::kF32, DType::kF16, DType::kBF16}) {
        run_reference_case(kind, g, DType::kBF16, g != DType::kF32, 1037, target);
        run_reference_case(kind, g, DType::kF16, true, 13, target);
        if (::testing::Test::HasFailure()) return;
      }
    }
  });
}

TEST(CpuOptimizers, LambWithoutBiasCorrectionAndClampedTrustMatchesReference) {
  // A large lr * tiny params make ||p|| / ||u|| fall below min_coeff: the clamp is exercised.
  AdamHyperParams hp = default_hyper_params(OptimizerKind::kLamb);
  hp.bias_correction = false;
  hp.min_coeff = 0.5;
  hp.max_coeff = 0.6;
  const std::size_t n = 300;
  Buffer p(DType::kF32, n), m(DType::kF32, n), v(DType::kF32, n), g(DType::kF32, n);
  for (std::size_t i = 0; i < n; ++i) {
    p.set(i, 1e-3f * static_cast<float>(i % 9));
    m.set(i, 0.0f);
    v.set(i, 0.0f);
    g.set(i, std::sin(static_cast<float>(i)));
  }
  LambNorms norms(n);
  auto step = AdamStep::make(hp, 1).value();
  ASSERT_TRUE(lamb_accumulate_norms(step, {p.ref(), m.ref(), v.ref(), g.cref(), {}}, 0, norms).ok());
  EXPECT_EQ(lamb_trust_ratio(hp, norms.param_sq(), norms.update_sq()), 0.5);
  const Expect e = reference_step(hp, 1, 1.0, p, m, v, g);
  ASSERT_TRUE(lamb_update(step, {p.ref(), m.ref(), v.ref(), g.cref(), {}}).ok());
  expect_close(p, e.p, e.p_scale, "params", 1);
}

TEST(CpuOptimizers, LambTrustIsOneWhenANormIsZero) {
  const AdamHyperParams hp = default_hyper_params(OptimizerKind::kLamb);
  EXPECT_EQ(lamb_trust_ratio(hp, 0.0, 4.0), 1.0);
  EXPECT_EQ(lamb_trust_ratio(hp, 4.0, 0.0), 1.0);
  EXPECT_EQ(lamb_trust_ratio(hp, 4.0, 1.0), 2.0);
  EXPECT_EQ(lamb_trust_ratio(hp, 1e6, 1.0), 10.0);
  EXPECT_EQ(lamb_trust_ratio(hp, 1e-12, 1.0), 0.01);
}

TEST(CpuOptimizers, LionSignOfZeroIsZero) {
  AdamHyperParams hp = default_hyper_params(OptimizerKind::kLion);
  hp.weight_decay = 0.5;
  Buffer p(DType::kF32, 5), m(DType::kF32, 5), v(DType::kF32, 5), g(DType::kF32, 5);
  for (std::size_t i = 0; i < 5; ++i) {
    p.set(i, 2.0f);
    m.set(i, 0.0f);
    v.set(i, 0.0f);
    g.set(i, 0.0f);
  }
  ASSERT_TRUE(adam_update_chunk(AdamStep::make(hp, 1).value(), {p.ref(), m.ref(), v.ref(), g.cref(), {}}).ok());
  for (std::size_t i = 0; i < 5; ++i) EXPECT_EQ(p.get(i), static_cast<float>(2.0 * (1 - hp.lr * 0.5)));
}

TEST(CpuOptimizers, BadLambSettingsAreRejected) {
  AdamHyperParams hp = default_hyper_params(OptimizerKind::kLamb);
  hp.min_coeff = 2;
  hp.max_coeff = 1;
  EXPECT_EQ(hp.validate().code(), StatusCode::kInvalidArgument);
  hp.min_coeff = -1;
  EXPECT_EQ(hp.validate().code(), StatusCode::kInvalidArgument);
  hp = default_hyper_params(OptimizerKind::kLamb);
  hp.kind = static_cast<OptimizerKind>(9);
  EXPECT_EQ(hp.validate().code(), StatusCode::kInvalidArgument);
  // Norms of a step that is not Lamb, and past the parameter.
  Buffer p(DType::kF32, 8), m(DType::kF32, 8), v(DType::kF32, 8), g(DType::kF32, 8);
  LambNorms norms(8);
  const AdamTensors t{p.ref(), m.ref(), v.ref(), g.cref(), {}};
  EXPECT_EQ(lamb_accumulate_norms(AdamStep::make(AdamHyperParams{}, 1).value(), t, 0, norms).code(),
            StatusCode::kInvalidArgument);
  const auto lamb = AdamStep::make(default_hyper_params(OptimizerKind::kLamb), 1).value();
  EXPECT_EQ(lamb_accumulate_norms(lamb, t, 1, norms).code(), StatusCode::kInvalidArgument);
}

// The state of one tensor for the determinism test.
struct State {
  Buffer p, m, v, g, out;
  State(DType pd, DType gd, std::size_t n)
      : p(pd, n), m(DType::kF32, n), v(DType::kF32, n), g(gd, n), out(DType::kBF16, n) {
    std::mt19937 rng(3);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (std::size_t i = 0; i < n; ++i) {
      p.set(i, d(rng));
      m.set(i, d(rng) * 0.1f);
      v.set(i, std::fabs(d(rng)) * 0.01f);
      g.set(i, d(rng));
    }
  }
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

// Steps `s` with `threads` threads over chunks of the given lengths (cycled; empty: whole).
void run_steps(State& st, const AdamHyperParams& hp, int threads, const std::vector<std::size_t>& lens) {
  const std::size_t n = st.p.n;
  for (std::int64_t s = 1; s <= 3; ++s) {
    const AdamStep step = AdamStep::make(hp, s).value();
    auto pieces = [&](auto&& fn) {
      std::size_t at = 0;
      for (std::size_t k = 0; at < n; ++k) {
        const std::size_t len =
            lens.empty() ? n : std::min(lens[(k + static_cast<std::size_t>(s)) % lens.size()], n - at);
        fn(at, len);
        at += len;
      }
    };
    AdamStep apply = step;
    if (hp.kind == OptimizerKind::kLamb) {
      LambNorms norms(n);
      pieces([&](std::size_t at, std::size_t len) {
        ASSERT_TRUE(lamb_accumulate_norms(step, st.slice(at, len), at, norms, threads).ok());
      });
      apply = step.with_trust(lamb_trust_ratio(hp, norms.param_sq(), norms.update_sq()));
    }
    pieces([&](std::size_t at, std::size_t len) { ASSERT_TRUE(adam_update(apply, st.slice(at, len), threads).ok()); });
  }
}

TEST(CpuOptimizers, ChunkingAndThreadCountGiveBitIdenticalResults) {
  for (OptimizerKind kind : {OptimizerKind::kAdagrad, OptimizerKind::kLion, OptimizerKind::kLamb}) {
    AdamHyperParams hp = params_of(kind);
    for (auto [pd, gd] : {std::pair{DType::kF32, DType::kF16}, std::pair{DType::kBF16, DType::kBF16}}) {
      SCOPED_TRACE(str(optimizer_kind_name(kind), " params ", dtype_name(pd), " grads ", dtype_name(gd)));
      const std::size_t n = 400'003;  // several 64 Ki norm blocks and a ragged tail
      State whole(pd, gd, n);
      run_steps(whole, hp, 1, {});
      for (int threads : {2, 3, 16}) {
        State t(pd, gd, n);
        run_steps(t, hp, threads, {});
        EXPECT_TRUE(t.same(whole)) << threads << " threads";
      }
      State c(pd, gd, n);
      run_steps(c, hp, 1, {1, 3, 17, 4093, 65536 + 5, 150'001});
      EXPECT_TRUE(c.same(whole)) << "chunked";
      State ct(pd, gd, n);
      run_steps(ct, hp, 3, {70'000, 65536 * 2 + 1, 9});
      EXPECT_TRUE(ct.same(whole)) << "chunked, 3 threads";
    }
  }
}

}  // namespace
}  // namespace tier::cpu
