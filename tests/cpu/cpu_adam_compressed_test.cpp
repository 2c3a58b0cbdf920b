// The CPU optimizer over compressed state (bf16, block int8): each step is exactly the fp32 kernel
// on the decoded state followed by the codec; over many steps it tracks the fp64 reference within
// bounds that follow from the codec's; the bytes do not depend on threads or block-aligned
// chunking on any target; bad tensors are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <random>

#include "cpu/reference.hpp"
#include "tier/cpu_adam.hpp"
#include "tier/state_codec.hpp"

namespace tier::cpu {
namespace {

using testing::bits_of;
using testing::Buffer;
using testing::for_each_simd_target;

// Compressed state of one tensor: m and v in their format, with scales for int8.
struct CState {
  StateDType fam;
  std::size_t n;
  std::vector<std::uint8_t> m, v;
  std::vector<float> ms, vs;

  CState(StateDType f, std::size_t count)
      : fam(f),
        n(count),
        m(count * dtype_size(exp_avg_dtype(f)) + 16),
        v(count * dtype_size(exp_avg_sq_dtype(f)) + 16),
        ms(state_scale_count(f, count)),
        vs(state_scale_count(f, count)) {}

  TensorRef mref(std::size_t at = 0, std::size_t len = SIZE_MAX) {
    return {m.data() + at * dtype_size(exp_avg_dtype(fam)), exp_avg_dtype(fam), std::min(len, n - at)};
  }
  TensorRef vref(std::size_t at = 0, std::size_t len = SIZE_MAX) {
    return {v.data() + at * dtype_size(exp_avg_sq_dtype(fam)), exp_avg_sq_dtype(fam), std::min(len, n - at)};
  }
  float* mscales(std::size_t at = 0) { return ms.empty() ? nullptr : ms.data() + at / kStateBlock; }
  float* vscales(std::size_t at = 0) { return vs.empty() ? nullptr : vs.data() + at / kStateBlock; }

  void set(const std::vector<float>& mf, const std::vector<float>& vf) {
    ASSERT_TRUE(encode_state(StateMoment::kExpAvg, ConstTensorRef(mf.data(), DType::kF32, n), mref(), mscales()).ok());
    ASSERT_TRUE(
        encode_state(StateMoment::kExpAvgSq, ConstTensorRef(vf.data(), DType::kF32, n), vref(), vscales()).ok());
  }
  std::vector<float> get_m() {
    std::vector<float> x(n);
    EXPECT_TRUE(decode_state(StateMoment::kExpAvg, mref(), mscales(), {x.data(), DType::kF32, n}).ok());
    return x;
  }
  std::vector<float> get_v() {
    std::vector<float> x(n);
    EXPECT_TRUE(decode_state(StateMoment::kExpAvgSq, vref(), vscales(), {x.data(), DType::kF32, n}).ok());
    return x;
  }
  bool operator==(const CState& o) const {
    const std::size_t mb = n * dtype_size(exp_avg_dtype(fam)), vb = n * dtype_size(exp_avg_sq_dtype(fam));
    return n == o.n && std::memcmp(m.data(), o.m.data(), mb) == 0 && std::memcmp(v.data(), o.v.data(), vb) == 0 &&
           ms == o.ms && vs == o.vs;
  }
};

// A tensor: params, grads, out and its compressed state.
struct Rig {
  Buffer p, g, out;
  CState s;
  Rig(StateDType fam, DType pd, DType gd, DType od, std::size_t n, unsigned seed)
      : p(pd, n), g(gd, n), out(od, n), s(fam, n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> m(n), v(n);
    for (std::size_t i = 0; i < n; ++i) {
      p.set(i, d(rng));
      m[i] = d(rng) * 0.1f;
      v[i] = std::fabs(d(rng)) * 0.01f;
      g.set(i, d(rng));
    }
    s.set(m, v);
  }
  AdamTensors tensors(bool with_out = true) {
    return {p.ref(), s.mref(), s.vref(), g.cref(), with_out ? out.ref() : TensorRef{}, s.mscales(), s.vscales()};
  }
  AdamTensors slice(std::size_t at, std::size_t len) {
    auto sub = [&](Buffer& b) {
      return TensorRef{static_cast<std::uint8_t*>(b.data()) + at * dtype_size(b.dtype), b.dtype, len};
    };
    return {sub(p), s.mref(at, len), s.vref(at, len), sub(g), sub(out), s.mscales(at), s.vscales(at)};
  }
  bool same(const Rig& o) const { return p.same_bytes(o.p) && out.same_bytes(o.out) && s == o.s; }
};

struct Kinds {
  DType param, grad, out;
  bool has_out;
};

// One step over compressed state must be, byte for byte, the fp32-state kernel run on the decoded
// state, followed by encode_state of its new moments: for every kind the compressed path
// supports, both decay modes, bias correction on and off, every grad dtype and every `out`.
TEST(CompressedAdam, IsTheFp32KernelOnTheDecodedStateThenTheCodec) {
  const std::size_t n = 5 * kStateBlock + 13;  // a partial last block, tails on every vector width
  std::vector<AdamHyperParams> hps;
  for (auto kind : {OptimizerKind::kAdam, OptimizerKind::kAdagrad, OptimizerKind::kLion}) {
    for (auto mode : {WeightDecayMode::kDecoupled, WeightDecayMode::kL2}) {
      for (bool bc : {true, false}) {
        if (kind != OptimizerKind::kAdam && (mode == WeightDecayMode::kL2 || !bc)) continue;  // ignored by them
        AdamHyperParams hp = default_hyper_params(kind);
        hp.weight_decay = 0.05;
        hp.decay_mode = mode;
        hp.bias_correction = bc;
        hps.push_back(hp);
      }
    }
  }
  std::vector<Kinds> kinds;
  for (DType pd : {DType::kF32, DType::kBF16}) {
    for (DType gd : {DType::kF32, DType::kF16, DType::kBF16}) {
      kinds.push_back({pd, gd, DType::kF16, gd == DType::kF32});
      kinds.push_back({pd, gd, DType::kBF16, gd != DType::kF32});
    }
  }
  for_each_simd_target([&](const std::string& target) {
    for (auto fam : {StateDType::kBF16, StateDType::kInt8}) {
      for (const auto& hp : hps) {
        for (const auto& k : kinds) {
          SCOPED_TRACE(str(target, ", ", state_dtype_name(fam), ", ", optimizer_kind_name(hp.kind),
                           hp.decay_mode == WeightDecayMode::kL2 ? " L2" : " decoupled",
                           hp.bias_correction ? "" : " no bias correction", ", params ", dtype_name(k.param),
                           ", grads ", dtype_name(k.grad), ", out ", k.has_out ? dtype_name(k.out) : "none"));
          Rig r(fam, k.param, k.grad, k.out, n, 21);
          for (std::int64_t t = 1; t <= 3; ++t) {
            const auto step = AdamStep::make(hp, t, 0.5).value();
            // The expected result: fp32 state from the decoded moments.
            Buffer p = r.p, m(DType::kF32, n), v(DType::kF32, n), out(k.out, n);
            const auto md = r.s.get_m(), vd = r.s.get_v();
            for (std::size_t i = 0; i < n; ++i) m.set(i, md[i]), v.set(i, vd[i]);
            ASSERT_TRUE(
                adam_update_chunk(step, {p.ref(), m.ref(), v.ref(), r.g.cref(), k.has_out ? out.ref() : TensorRef{}})
                    .ok());
            CState want = r.s;
            if (hp.kind != OptimizerKind::kAdagrad) {
              ASSERT_TRUE(encode_state(StateMoment::kExpAvg, m.cref(), want.mref(), want.mscales()).ok());
            }
            if (hp.kind != OptimizerKind::kLion) {
              ASSERT_TRUE(encode_state(StateMoment::kExpAvgSq, v.cref(), want.vref(), want.vscales()).ok());
            }
            const Status st = adam_update_chunk(step, r.tensors(k.has_out));
            ASSERT_TRUE(st.ok()) << st;
            ASSERT_TRUE(r.p.same_bytes(p)) << "params at step " << t;
            if (k.has_out) {
              ASSERT_TRUE(r.out.same_bytes(out)) << "out at step " << t;
            }
            ASSERT_TRUE(r.s == want) << "state at step " << t;
          }
        }
      }
    }
  });
}

// The same identity for int8 blocks of every magnitude, which take different paths through the
// fused kernel: zero blocks, fp32-denormal scales (codes held at their largest), scales of 2^16
// and above (the decode with the clamp), and stray -128 codes, on every target.
TEST(CompressedAdam, Int8BlocksOfEveryMagnitudeAreTheFp32KernelThenTheCodec) {
  const float magnitudes[] = {0.0f, 1e-44f, 1e-30f, 1e-3f, 1.0f, 3e5f, 1e18f};
  const std::size_t blocks = std::size(magnitudes);
  const std::size_t n = blocks * kStateBlock + 37;  // and a partial last block
  for_each_simd_target([&](const std::string& target) {
    for (auto kind : {OptimizerKind::kAdam, OptimizerKind::kAdagrad, OptimizerKind::kLion}) {
      SCOPED_TRACE(str(target, ", ", optimizer_kind_name(kind)));
      Rig r(StateDType::kInt8, DType::kF32, DType::kF32, DType::kF32, n, 31);
      std::mt19937 rng(32);
      std::normal_distribution<float> d(0.0f, 1.0f);
      std::vector<float> m(n), v(n);
      for (std::size_t i = 0; i < n; ++i) {
        const float f = magnitudes[std::min(i / kStateBlock, blocks - 1)];
        m[i] = d(rng) * f;
        v[i] = m[i] * m[i] * (1.0f + std::fabs(d(rng)));
        r.g.set(i, d(rng) * f);
      }
      r.s.set(m, v);
      for (std::size_t i = 3 * kStateBlock; i < 3 * kStateBlock + 4; ++i) r.s.m[i] = 0x80;  // -128
      AdamHyperParams hp = default_hyper_params(kind);
      hp.weight_decay = 0.01;
      for (std::int64_t t = 1; t <= 3; ++t) {
        const auto step = AdamStep::make(hp, t).value();
        Buffer p = r.p, mf(DType::kF32, n), vf(DType::kF32, n);
        const auto md = r.s.get_m(), vd = r.s.get_v();
        for (std::size_t i = 0; i < n; ++i) mf.set(i, md[i]), vf.set(i, vd[i]);
        ASSERT_TRUE(adam_update_chunk(step, {p.ref(), mf.ref(), vf.ref(), r.g.cref(), TensorRef{}}).ok());
        CState want = r.s;
        if (kind != OptimizerKind::kAdagrad) {
          ASSERT_TRUE(encode_state(StateMoment::kExpAvg, mf.cref(), want.mref(), want.mscales()).ok());
        }
        if (kind != OptimizerKind::kLion) {
          ASSERT_TRUE(encode_state(StateMoment::kExpAvgSq, vf.cref(), want.vref(), want.vscales()).ok());
        }
        ASSERT_TRUE(adam_update_chunk(step, r.tensors(false)).ok());
        ASSERT_TRUE(r.p.same_bytes(p)) << "params at step " << t;
        ASSERT_TRUE(r.s == want) << "state at step " << t;
      }
    }
  });
}

// fp64 Adam with fp64 state: the trajectory compressed state should follow.
struct RefAdam {
  std::vector<double> p, m, v;
  std::vector<double> m_scale;  // beta1-average of |g|: the size m would have if no gradient cancelled
  std::vector<double> travel;   // sum over the steps of the step size that m_scale would give
  explicit RefAdam(std::size_t n) : p(n), m(n, 0.0), v(n, 0.0), m_scale(n, 0.0), travel(n, 0.0) {}

  void step(const AdamHyperParams& hp, std::int64_t t, const Buffer& g) {
    const double bc1 = hp.bias_correction ? 1 - std::pow(hp.beta1, static_cast<double>(t)) : 1;
    const double bc2 = hp.bias_correction ? 1 - std::pow(hp.beta2, static_cast<double>(t)) : 1;
    for (std::size_t i = 0; i < p.size(); ++i) {
      double gi = g.get(i);
      double gs = std::fabs(gi);
      if (hp.decay_mode == WeightDecayMode::kL2) {
        gi += hp.weight_decay * p[i];
        gs += hp.weight_decay * std::fabs(p[i]);
      }
      m[i] = hp.beta1 * m[i] + (1 - hp.beta1) * gi;
      m_scale[i] = hp.beta1 * m_scale[i] + (1 - hp.beta1) * gs;
      v[i] = hp.beta2 * v[i] + (1 - hp.beta2) * gi * gi;
      if (hp.decay_mode == WeightDecayMode::kDecoupled) p[i] *= 1 - hp.lr * hp.weight_decay;
      const double denom = std::sqrt(v[i]) / std::sqrt(bc2) + hp.eps;
      p[i] -= hp.lr / bc1 * m[i] / denom;
      travel[i] += hp.lr / bc1 * m_scale[i] / denom;
    }
  }
};

// 20 steps of Adam/AdamW over compressed state against the fp64 trajectory. The error of p is
// measured against `travel`, the distance p would move if no gradient cancelled in m.
//
// Why the bounds: each step rounds the stored m and v once (relative error e_m, e_v: 2^-8 both
// for bf16; 2^-4 for m and 2 * 2^-5 for v in int8, plus the small-value terms). An error stored in
// m decays by beta1 per step, so m carries at most e_m * sum(beta1^k) <= 10 e_m of m_scale; v's
// decays by beta2 ~ 1, so over t steps v carries at most t * e_v, and sqrt(v) half that. The
// direction m / sqrt(v) is then off by at most 10 e_m + t e_v / 2 (relative to travel): 0.043
// (bf16, t = 20) and 1.25 (int8) in the worst case, where every rounding goes the same way. They
// do not: round to nearest is unbiased and the errors of successive steps are independent, so the
// root-mean-square of the error over elements is asserted against a 4-sigma version of the same
// sum of independent uniform errors (sqrt of the sum of the squares, each e / sqrt(3)).
struct TrajectoryResult {
  double max_rel = 0;  // max over elements of |p - p_ref| / travel
  double rms_rel = 0;
};

TrajectoryResult run_trajectory(StateDType fam, WeightDecayMode mode, bool bc, DType gd, int steps) {
  const std::size_t n = 4 * kStateBlock + 100;
  AdamHyperParams hp;
  hp.lr = 1e-3;
  hp.weight_decay = 0.01;
  hp.decay_mode = mode;
  hp.bias_correction = bc;
  std::mt19937 rng(77);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Buffer p(DType::kF32, n), g(gd, n);
  CState s(fam, n);
  s.set(std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f));
  RefAdam ref(n);
  for (std::size_t i = 0; i < n; ++i) {
    p.set(i, nd(rng));
    ref.p[i] = p.get(i);
  }
  // Each element keeps its own gradient magnitude (1e-2 .. 10, so every block mixes three
  // decades: m over 2^10, v over 2^20, inside the int8 codes' 2^15 range of m and of sqrt(v)) and
  // a drift that makes m partly persistent, as real gradients are.
  std::vector<float> base(n), mag(n);
  for (std::size_t i = 0; i < n; ++i) {
    mag[i] = std::pow(10.0f, static_cast<float>(i % 7) / 2.0f - 2.0f);
    base[i] = nd(rng);
  }
  for (int t = 1; t <= steps; ++t) {
    for (std::size_t i = 0; i < n; ++i) g.set(i, (base[i] + nd(rng)) * mag[i]);
    ref.step(hp, t, g);
    const Status st = adam_update_chunk(AdamStep::make(hp, t).value(),
                                        {p.ref(), s.mref(), s.vref(), g.cref(), {}, s.mscales(), s.vscales()});
    EXPECT_TRUE(st.ok()) << st;
  }
  TrajectoryResult r;
  double sq = 0;
  for (std::size_t i = 0; i < n; ++i) {
    // Less the rounding of fp32 params themselves (half an ulp per step), which any state has.
    const double storage = steps * std::ldexp(std::fabs(ref.p[i]), -24);
    const double e = std::max(0.0, std::fabs(static_cast<double>(p.get(i)) - ref.p[i]) - storage) / ref.travel[i];
    r.max_rel = std::max(r.max_rel, e);
    sq += e * e;
  }
  r.rms_rel = std::sqrt(sq / static_cast<double>(n));
  return r;
}

// The bounds of the comment above for relative storage errors e_m, e_v over `steps` steps.
double worst_case(double e_m, double e_v, int steps) {
  return 10 * e_m + steps * e_v / 2;
}
double rms_4_sigma(double e_m, double e_v, int steps) {
  double var = 0;
  for (int k = 0; k < steps; ++k) {
    const double a = e_m * std::pow(0.9, k) / std::sqrt(3.0);
    const double b = e_v / 2 / std::sqrt(3.0);
    var += a * a + b * b;
  }
  return 4 * std::sqrt(var);
}

TEST(CompressedAdam, Bf16AndInt8StateTrackTheFp64Trajectory) {
  constexpr int kSteps = 20;
  for (auto fam : {StateDType::kBF16, StateDType::kInt8}) {
    const double e_m = fam == StateDType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -4);
    const double e_v = fam == StateDType::kBF16 ? std::ldexp(1.0, -8) : 2 * std::ldexp(1.0, -5);
    for (auto mode : {WeightDecayMode::kDecoupled, WeightDecayMode::kL2}) {
      for (bool bc : {true, false}) {
        for (DType gd : {DType::kF32, DType::kBF16}) {
          SCOPED_TRACE(str(state_dtype_name(fam), mode == WeightDecayMode::kL2 ? ", L2" : ", decoupled",
                           bc ? "" : ", no bias correction", ", grads ", dtype_name(gd)));
          const auto r = run_trajectory(fam, mode, bc, gd, kSteps);
          EXPECT_LE(r.max_rel, worst_case(e_m, e_v, kSteps));
          EXPECT_LE(r.rms_rel, rms_4_sigma(e_m, e_v, kSteps));
          ::testing::Test::RecordProperty(str(state_dtype_name(fam), "_max_rel"), str(r.max_rel));
          std::printf(
              "%s%s%s grads %s: |p - p_ref| / travel after %d steps: max %.3g (bound %.3g), rms %.3g (bound %.3g)\n",
              state_dtype_name(fam), mode == WeightDecayMode::kL2 ? " L2" : " decoupled", bc ? "" : " no-bc",
              dtype_name(gd), kSteps, r.max_rel, worst_case(e_m, e_v, kSteps), r.rms_rel,
              rms_4_sigma(e_m, e_v, kSteps));
        }
      }
    }
  }
  // fp32 state on the same trajectory: the storage of fp32 alone, far below both.
  const auto f = run_trajectory(StateDType::kF32, WeightDecayMode::kDecoupled, true, DType::kF32, kSteps);
  EXPECT_LE(f.max_rel, 1e-5);
  std::printf("fp32 state: max %.3g, rms %.3g\n", f.max_rel, f.rms_rel);
}

// Threads 1, 2, 3, 16 and block-aligned chunkings give the same bytes, on every target.
TEST(CompressedAdam, ThreadsAndBlockAlignedChunksGiveBitIdenticalResults) {
  const std::size_t n = 300'007;  // ten 32 Ki pieces for the threads, a partial last block
  for_each_simd_target([&](const std::string& target) {
    for (auto fam : {StateDType::kBF16, StateDType::kInt8}) {
      for (auto kind : {OptimizerKind::kAdam, OptimizerKind::kLion}) {
        SCOPED_TRACE(str(target, ", ", state_dtype_name(fam), ", ", optimizer_kind_name(kind)));
        AdamHyperParams hp = default_hyper_params(kind);
        hp.weight_decay = 0.1;
        Rig whole(fam, DType::kF32, DType::kBF16, DType::kBF16, n, 5);
        for (std::int64_t t = 1; t <= 3; ++t)
          ASSERT_TRUE(adam_update_chunk(AdamStep::make(hp, t).value(), whole.tensors()).ok());
        for (int threads : {1, 2, 3, 16}) {
          Rig r(fam, DType::kF32, DType::kBF16, DType::kBF16, n, 5);
          for (std::int64_t t = 1; t <= 3; ++t) {
            ASSERT_TRUE(adam_update(AdamStep::make(hp, t).value(), r.tensors(), threads).ok());
          }
          EXPECT_TRUE(r.same(whole)) << threads << " threads";
        }
        Rig c(fam, DType::kF32, DType::kBF16, DType::kBF16, n, 5);
        for (std::int64_t t = 1; t <= 3; ++t) {
          const auto step = AdamStep::make(hp, t).value();
          const std::size_t lens[] = {kStateBlock, 3 * kStateBlock, 32768 + kStateBlock, 17 * kStateBlock, 4096};
          std::size_t at = 0;
          for (std::size_t k = 0; at < n; ++k) {
            const std::size_t len = std::min(lens[(k + static_cast<std::size_t>(t)) % 5], n - at);
            ASSERT_TRUE(adam_update_chunk(step, c.slice(at, len)).ok());
            at += len;
          }
        }
        EXPECT_TRUE(c.same(whole)) << "chunked";
        // The comparison can fail: chunks that cut blocks (here at 100 and 356, which also gives
        // the second chunk block 0's scales) quantize differently.
        if (fam == StateDType::kInt8) {
          const auto step = AdamStep::make(hp, 1).value();
          Rig w(fam, DType::kF32, DType::kBF16, DType::kBF16, n, 5);
          Rig u = w;
          ASSERT_TRUE(adam_update_chunk(step, w.tensors()).ok());
          ASSERT_TRUE(adam_update_chunk(step, u.slice(0, 100)).ok());
          ASSERT_TRUE(adam_update_chunk(step, u.slice(100, n - 100)).ok());
          EXPECT_FALSE(u.s == w.s) << "block-cutting chunks must show";
        }
      }
    }
  });
}

TEST(CompressedAdam, ZeroStateAndGradientsStayExactlyZero) {
  for (auto fam : {StateDType::kBF16, StateDType::kInt8}) {
    Rig r(fam, DType::kF32, DType::kF32, DType::kF16, 3 * kStateBlock, 6);
    r.s.set(std::vector<float>(r.s.n, 0.0f), std::vector<float>(r.s.n, 0.0f));
    for (std::size_t i = 0; i < r.s.n; ++i) r.g.set(i, 0.0f);
    const Buffer p0 = r.p;
    const AdamHyperParams hp;  // no weight decay
    ASSERT_TRUE(adam_update(AdamStep::make(hp, 1).value(), r.tensors()).ok());
    EXPECT_TRUE(r.p.same_bytes(p0)) << state_dtype_name(fam) << ": zero moments move nothing";
    for (float x : r.s.get_m()) ASSERT_EQ(bits_of(x), 0u);
    for (float x : r.s.get_v()) ASSERT_EQ(bits_of(x), 0u);
    for (float sc : r.s.ms) EXPECT_EQ(sc, 0.0f);
    for (float sc : r.s.vs) EXPECT_EQ(sc, 0.0f);
  }
}

// A non-finite gradient (an fp16 overflow the caller did not skip) turns its own block of int8
// state into NaN, visibly, and leaves the other blocks as they would have been.
TEST(CompressedAdam, ANonFiniteGradientPoisonsOnlyItsBlock) {
  const std::size_t n = 3 * kStateBlock;
  Rig a(StateDType::kInt8, DType::kF32, DType::kF32, DType::kF16, n, 7);
  Rig b = a;
  a.g.set(kStateBlock + 5, INFINITY);
  const auto step = AdamStep::make({}, 1).value();
  ASSERT_TRUE(adam_update(step, a.tensors()).ok());
  ASSERT_TRUE(adam_update(step, b.tensors()).ok());
  EXPECT_TRUE(std::isnan(a.s.ms[1]) || std::isnan(a.s.vs[1]));
  const auto m = a.s.get_m(), v = a.s.get_v();
  for (std::size_t i = kStateBlock; i < 2 * kStateBlock; ++i) ASSERT_TRUE(std::isnan(m[i]) || std::isnan(v[i])) << i;
  EXPECT_EQ(a.s.ms[0], b.s.ms[0]);
  EXPECT_EQ(a.s.ms[2], b.s.ms[2]);
  EXPECT_EQ(a.s.vs[2], b.s.vs[2]);
}

TEST(CompressedAdam, LambAndTheRooflineAreUnsupported) {
  for (auto fam : {StateDType::kBF16, StateDType::kInt8}) {
    Rig r(fam, DType::kF32, DType::kF32, DType::kF16, 300, 8);
    const Rig before = r;
    const auto lamb = AdamStep::make(default_hyper_params(OptimizerKind::kLamb), 1).value();
    EXPECT_EQ(adam_update(lamb, r.tensors()).code(), StatusCode::kUnsupported);
    EXPECT_EQ(lamb_update(lamb, r.tensors()).code(), StatusCode::kUnsupported);
    LambNorms norms(300);
    EXPECT_EQ(lamb_accumulate_norms(lamb, r.tensors(), 0, norms).code(), StatusCode::kUnsupported);
    EXPECT_EQ(adam_roofline_pass(r.tensors()).code(), StatusCode::kUnsupported);
    EXPECT_TRUE(r.same(before)) << "nothing touched";
  }
}

TEST(CompressedAdam, BadStateTensorsAreRejected) {
  const auto step = AdamStep::make({}, 1).value();
  Rig q(StateDType::kInt8, DType::kF32, DType::kF16, DType::kBF16, 600, 9);
  Rig h(StateDType::kBF16, DType::kF32, DType::kF16, DType::kBF16, 600, 9);
  const Rig q0 = q, h0 = h;
  auto expect_error = [&](AdamTensors t, const char* needle) {
    const Status st = adam_update(step, t, 2);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << needle << ": " << st;
    EXPECT_NE(st.message().find(needle), std::string::npos) << st;
    EXPECT_EQ(adam_update_chunk(step, t).code(), StatusCode::kInvalidArgument) << needle;
    EXPECT_EQ(validate(t).code(), StatusCode::kInvalidArgument) << needle;
  };
  // Mixed families.
  AdamTensors t = h.tensors();
  Buffer v32(DType::kF32, 600);
  t.exp_avg_sq = v32.ref();
  expect_error(t, "exp_avg_sq is fp32");
  t = q.tensors();
  t.exp_avg_sq = h.s.vref();
  t.exp_avg_sq_scales = nullptr;
  expect_error(t, "exp_avg is int8 but exp_avg_sq is bf16");
  t = q.tensors();
  t.exp_avg_sq.dtype = DType::kI8;
  expect_error(t, "exp_avg_sq: dtype int8");
  t = q.tensors();
  t.exp_avg.dtype = DType::kU8;
  expect_error(t, "exp_avg: dtype uint8");
  // Scales: missing, given for bf16, misaligned, overlapping.
  t = q.tensors();
  t.exp_avg_scales = nullptr;
  expect_error(t, "exp_avg_scales");
  t = q.tensors();
  t.exp_avg_sq_scales = nullptr;
  expect_error(t, "exp_avg_sq_scales");
  t = h.tensors();
  t.exp_avg_scales = q.s.mscales();
  expect_error(t, "exp_avg_scales");
  t = q.tensors();
  t.exp_avg_sq_scales = reinterpret_cast<float*>(reinterpret_cast<std::uint8_t*>(t.exp_avg_sq_scales) + 2);
  expect_error(t, "aligned");
  t = q.tensors();
  t.exp_avg_sq_scales = t.exp_avg_scales + 1;
  expect_error(t, "overlap");
  t = q.tensors();
  t.exp_avg_scales = static_cast<float*>(t.params.data);
  expect_error(t, "exp_avg_scales and params overlap");
  // Misaligned bf16 state, lengths, overlap of state buffers.
  t = h.tensors();
  t.exp_avg.data = static_cast<std::uint8_t*>(t.exp_avg.data) + 1;
  expect_error(t, "aligned");
  t = q.tensors();
  t.exp_avg_sq.numel = 599;
  expect_error(t, "599");
  t = q.tensors();
  t.exp_avg_sq.data = static_cast<std::uint8_t*>(t.exp_avg.data) + 10;
  expect_error(t, "overlap");
  t = q.tensors();
  t.exp_avg.data = nullptr;
  expect_error(t, "null");
  EXPECT_TRUE(q.same(q0) && h.same(h0)) << "rejected calls touch nothing";
}

}  // namespace
}  // namespace tier::cpu
