// The optimizer state codec (tier/state_codec.hpp): names and sizes, the 8-bit codes checked
// exhaustively and against an independent nearest-value search, round trips within the documented
// error bounds on every SIMD target, and argument checks.
#include "tier/state_codec.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/reference.hpp"

namespace tier::cpu {
namespace {

using testing::bits_of;
using testing::for_each_simd_target;

// The documented bounds (state_codec.hpp), as functions of the input and its block.
double bound_bf16(double x) {
  return std::ldexp(std::fabs(x), -8) + std::ldexp(1.0, -134);
}
double bound_m8(double x, double absmax) {
  return std::ldexp(std::fabs(x), -4) * (1 + std::ldexp(1.0, -20)) + std::ldexp(absmax, -18) + std::ldexp(1.0, -149);
}
// On sqrt(v).
double bound_v8(double s, double smax) {
  return std::ldexp(s, -5) * (1 + std::ldexp(1.0, -20)) + std::ldexp(smax, -18) + std::ldexp(1.0, -75);
}

struct Encoded {
  std::vector<std::uint8_t> bytes;
  std::vector<float> scales;
};

DType format_of(StateDType fam, StateMoment mo) {
  return mo == StateMoment::kExpAvg ? exp_avg_dtype(fam) : exp_avg_sq_dtype(fam);
}

Encoded encode(StateDType fam, StateMoment mo, const std::vector<float>& x, int threads = 1) {
  const DType d = format_of(fam, mo);
  Encoded e;
  e.bytes.assign(x.size() * dtype_size(d) + 8, 0xAB);
  e.scales.assign(state_scale_count(fam, x.size()), -1.0f);
  const Status s =
      encode_state(mo, ConstTensorRef(x.data(), DType::kF32, x.size()), TensorRef{e.bytes.data(), d, x.size()},
                   e.scales.empty() ? nullptr : e.scales.data(), threads);
  EXPECT_TRUE(s.ok()) << s;
  return e;
}

std::vector<float> decode(StateDType fam, StateMoment mo, const Encoded& e, std::size_t n, int threads = 1) {
  std::vector<float> out(n, -7.0f);
  const Status s =
      decode_state(mo, ConstTensorRef(e.bytes.data(), format_of(fam, mo), n),
                   e.scales.empty() ? nullptr : e.scales.data(), TensorRef{out.data(), DType::kF32, n}, threads);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

TEST(StateCodec, NamesParsingAndSizes) {
  for (auto d : {StateDType::kF32, StateDType::kBF16, StateDType::kInt8}) {
    auto p = parse_state_dtype(state_dtype_name(d));
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(*p, d);
    auto f = state_dtype_of(exp_avg_dtype(d), exp_avg_sq_dtype(d));
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(*f, d);
  }
  EXPECT_EQ(parse_state_dtype("BFloat16").value(), StateDType::kBF16);
  EXPECT_EQ(parse_state_dtype("FP32").value(), StateDType::kF32);
  const auto bad = parse_state_dtype("int4");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("int4"), std::string::npos);
  EXPECT_EQ(exp_avg_dtype(StateDType::kInt8), DType::kI8);
  EXPECT_EQ(exp_avg_sq_dtype(StateDType::kInt8), DType::kU8);
  EXPECT_EQ(state_bytes(StateDType::kF32, 1000), 8000u);
  EXPECT_EQ(state_bytes(StateDType::kBF16, 1000), 4000u);
  EXPECT_EQ(state_bytes(StateDType::kInt8, 1000), 2000u + 2u * 4u * 4u);  // 4 blocks, the last partial
  EXPECT_EQ(state_bytes(StateDType::kInt8, 1), 2u + 8u);
  EXPECT_EQ(state_scale_count(StateDType::kInt8, 512), 2u);
  EXPECT_EQ(state_scale_count(StateDType::kBF16, 512), 0u);
  EXPECT_EQ(state_bytes_per_element(StateDType::kF32), 8.0);
  EXPECT_EQ(state_bytes_per_element(StateDType::kBF16), 4.0);
  EXPECT_EQ(state_bytes_per_element(StateDType::kInt8), 2.03125);
  // Mixed families are refused, naming both dtypes.
  for (auto [a, b] : {std::pair{DType::kBF16, DType::kF32}, std::pair{DType::kI8, DType::kI8},
                      std::pair{DType::kF32, DType::kU8}, std::pair{DType::kI8, DType::kBF16}}) {
    const auto r = state_dtype_of(a, b);
    ASSERT_FALSE(r.ok()) << dtype_name(a) << "/" << dtype_name(b);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_NE(state_dtype_of(DType::kBF16, DType::kF32).status().message().find("exp_avg_sq is fp32"), std::string::npos);
}

// Every code decodes to a value that encodes back to the same code; values strictly increase with
// the code; -128 (never written) decodes like -127.
TEST(StateCodec, ExpAvgCodeRoundTripsExhaustively) {
  float prev = -INFINITY;
  for (int q = -127; q <= 127; ++q) {
    const float v = exp_avg_code_value(static_cast<std::int8_t>(q));
    EXPECT_GT(v, prev) << "code " << q;
    prev = v;
    EXPECT_EQ(exp_avg_code_of(v), q) << "value " << v;
  }
  EXPECT_EQ(exp_avg_code_value(127), 1.875f);
  EXPECT_EQ(exp_avg_code_value(8), std::ldexp(1.0f, -14));
  EXPECT_EQ(exp_avg_code_value(1), std::ldexp(1.0f, -17));
  EXPECT_EQ(bits_of(exp_avg_code_value(0)), 0u) << "code 0 is +0";
  EXPECT_EQ(exp_avg_code_value(-128), exp_avg_code_value(-127));
  // The vector codec on every target: a block holding each code's value (absmax 1.875, so the
  // scale is exactly 1) encodes to exactly those codes and decodes to exactly those values.
  std::vector<float> x(kStateBlock, 0.0f);
  for (int q = -127; q <= 127; ++q)
    x[static_cast<std::size_t>(q + 127)] = exp_avg_code_value(static_cast<std::int8_t>(q));
  for_each_simd_target([&](const std::string& target) {
    const Encoded e = encode(StateDType::kInt8, StateMoment::kExpAvg, x);
    ASSERT_EQ(e.scales[0], 1.0f) << target;
    for (int q = -127; q <= 127; ++q) {
      ASSERT_EQ(static_cast<std::int8_t>(e.bytes[static_cast<std::size_t>(q + 127)]), q) << target;
    }
    const auto y = decode(StateDType::kInt8, StateMoment::kExpAvg, e, x.size());
    for (std::size_t i = 0; i < x.size(); ++i) ASSERT_EQ(bits_of(y[i]), bits_of(x[i])) << target << " " << i;
    // -128 written by someone else decodes like -127.
    Encoded f = e;
    f.bytes[0] = static_cast<std::uint8_t>(-128);
    EXPECT_EQ(decode(StateDType::kInt8, StateMoment::kExpAvg, f, 1)[0], -1.875f) << target;
  });
}

TEST(StateCodec, ExpAvgSqCodeRoundTripsExhaustively) {
  float prev = -1;
  for (int k = 0; k <= 255; ++k) {
    const float v = exp_avg_sq_code_value(static_cast<std::uint8_t>(k));
    EXPECT_GT(v, prev) << "code " << k;
    prev = v;
    EXPECT_EQ(exp_avg_sq_code_of(v), k) << "value " << v;
  }
  EXPECT_EQ(exp_avg_sq_code_value(255), 1.9375f);
  EXPECT_EQ(exp_avg_sq_code_value(16), std::ldexp(1.0f, -14));
  EXPECT_EQ(exp_avg_sq_code_of(1e-30f), 1) << "a positive value never encodes to 0";
  EXPECT_EQ(exp_avg_sq_code_of(0.0f), 0);
  // The vector codec: v = value(k)^2 is exact (at most 5 significant bits squared), and so is its
  // root, so every code comes back.
  std::vector<float> x(kStateBlock);
  for (int k = 0; k <= 255; ++k) {
    const float s = exp_avg_sq_code_value(static_cast<std::uint8_t>(k));
    x[static_cast<std::size_t>(k)] = s * s;
  }
  for_each_simd_target([&](const std::string& target) {
    const Encoded e = encode(StateDType::kInt8, StateMoment::kExpAvgSq, x);
    ASSERT_EQ(e.scales[0], 1.0f) << target;
    for (int k = 0; k <= 255; ++k) ASSERT_EQ(e.bytes[static_cast<std::size_t>(k)], k) << target;
    const auto y = decode(StateDType::kInt8, StateMoment::kExpAvgSq, e, x.size());
    for (std::size_t i = 0; i < x.size(); ++i) ASSERT_EQ(bits_of(y[i]), bits_of(x[i])) << target << " " << i;
  });
}

// An independent reference: the nearest code value by exhaustive search in fp64, ties to the even
// code (v: and never 0 for a positive value).
int nearest_m_code(double y) {
  int best = 0;
  double best_d = INFINITY;
  for (int k = 0; k <= 127; ++k) {
    const double d = std::fabs(static_cast<double>(exp_avg_code_value(static_cast<std::int8_t>(k))) - y);
    if (d < best_d || (d == best_d && k % 2 == 0)) {
      best = k;
      best_d = d;
    }
  }
  return best;
}
int nearest_v_code(double y) {
  int best = 0;
  double best_d = INFINITY;
  for (int k = 0; k <= 255; ++k) {
    const double d = std::fabs(static_cast<double>(exp_avg_sq_code_value(static_cast<std::uint8_t>(k))) - y);
    if (d < best_d || (d == best_d && k % 2 == 0)) {
      best = k;
      best_d = d;
    }
  }
  return y > 0 ? std::max(best, 1) : best;
}

TEST(StateCodec, CodesAreTheNearestValue) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> expo(-22.0, 1.0);
  std::vector<float> ys;
  for (int i = 0; i < 20000; ++i) ys.push_back(static_cast<float>(std::exp2(expo(rng))));
  // Every midpoint between neighbouring codes (exact in fp32): ties go to the even code.
  for (int k = 0; k < 127; ++k) {
    ys.push_back(
        0.5f * (exp_avg_code_value(static_cast<std::int8_t>(k)) + exp_avg_code_value(static_cast<std::int8_t>(k + 1))));
  }
  for (int k = 0; k < 255; ++k) {
    ys.push_back(0.5f * (exp_avg_sq_code_value(static_cast<std::uint8_t>(k)) +
                         exp_avg_sq_code_value(static_cast<std::uint8_t>(k + 1))));
  }
  for (const float y : ys) {
    if (y <= 1.875f) {
      ASSERT_EQ(exp_avg_code_of(y), nearest_m_code(y)) << y;
      ASSERT_EQ(exp_avg_code_of(-y), -nearest_m_code(y)) << -y;
    }
    if (y <= 1.9375f) {
      ASSERT_EQ(exp_avg_sq_code_of(y), nearest_v_code(y)) << y;
    }
  }
  // Past the largest code: the largest code.
  EXPECT_EQ(exp_avg_code_of(1.95f), 127);
  EXPECT_EQ(exp_avg_sq_code_of(2.5f), 255);
}

// The vector codec gives the scalar codes for the scale it chose (every target).
TEST(StateCodec, VectorCodesMatchTheScalarCodes) {
  std::mt19937 rng(12);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> expo(-12.0f, 4.0f);
  const std::size_t n = 10 * kStateBlock + 77;
  std::vector<float> m(n), v(n);
  for (std::size_t i = 0; i < n; ++i) {
    m[i] = nd(rng) * std::exp2(expo(rng));
    v[i] = m[i] * m[i] * std::exp2(expo(rng));
  }
  for_each_simd_target([&](const std::string& target) {
    const Encoded em = encode(StateDType::kInt8, StateMoment::kExpAvg, m);
    const Encoded ev = encode(StateDType::kInt8, StateMoment::kExpAvgSq, v);
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t b = i / kStateBlock;
      ASSERT_EQ(static_cast<std::int8_t>(em.bytes[i]), exp_avg_code_of(m[i] / em.scales[b])) << target << " m " << i;
      ASSERT_EQ(ev.bytes[i], exp_avg_sq_code_of(std::sqrt(v[i]) / ev.scales[b])) << target << " v " << i;
    }
    for (std::size_t b = 0; b < em.scales.size(); ++b) {
      float absmax = 0, smax = 0;
      for (std::size_t i = b * kStateBlock; i < std::min(n, (b + 1) * kStateBlock); ++i) {
        absmax = std::max(absmax, std::fabs(m[i]));
        smax = std::max(smax, std::sqrt(v[i]));
      }
      ASSERT_EQ(em.scales[b], absmax / 1.875f) << target << " block " << b;
      ASSERT_EQ(ev.scales[b], smax / 1.9375f) << target << " block " << b;
    }
  });
}

// The same where the codes are hardest to get right: blocks whose scales have every kind of
// mantissa (all ones among them) over a wide range of exponents, and values at the midpoints between
// two codes and a few ulps either side, where a quotient off by one ulp would change the code (any
// faster way to take x / scale must give exactly its bits).
TEST(StateCodec, VectorCodesMatchTheScalarCodesAtTheirMidpoints) {
  std::mt19937 rng(21);
  std::uniform_int_distribution<std::uint32_t> any_mantissa(0, 0x7FFFFF);
  std::vector<float> m, v;
  for (int e : {-90, -70, -65, -64, -63, -40, -20, -10, -2, -1, 0, 1, 8}) {
    for (std::uint32_t mant : {0u, 1u, 0x7FFFFFu, 0x7FFFFEu, 0x400000u, any_mantissa(rng), any_mantissa(rng)}) {
      const float scale = std::ldexp(testing::float_of(0x3F800000u | mant), e);  // in [2^e, 2^(e+1))
      std::vector<float> ym;  // quotients aimed at: m's midpoints (3 mantissa bits), then v's (4)
      std::vector<float> yv;
      for (int k = -14; k <= 0; ++k) {
        for (int j = 0; j < 16; ++j) {
          ym.push_back(std::ldexp(1.0f + static_cast<float>(2 * j + 1) / 16.0f, k));
          yv.push_back(std::ldexp(1.0f + static_cast<float>(2 * j + 1) / 32.0f, k));
        }
      }
      for (int j = 0; j < 16; ++j) {  // below 2^-14: whole units of 2^-17 (m) and 2^-18 (v)
        ym.push_back(static_cast<float>(2 * j + 1) * 0x1p-18f);
        yv.push_back(static_cast<float>(2 * j + 1) * 0x1p-19f);
      }
      for (float y : {0x1p-19f, 0x1p-20f, 0x1p-21f, 0x1p-30f}) ym.push_back(y), yv.push_back(y);
      std::shuffle(ym.begin(), ym.end(), rng);
      std::shuffle(yv.begin(), yv.end(), rng);
      for (std::size_t b = 0; b < 2; ++b) {  // two blocks per scale: every value +-2 ulps
        m.push_back(scale * 1.875f);         // sets the block's scale (to about `scale`)
        v.push_back((scale * 1.9375f) * (scale * 1.9375f));
        for (std::size_t i = 1; i < kStateBlock; ++i) {
          const std::size_t at = (b * (kStateBlock - 1) + i) % ym.size();
          const int ulps = static_cast<int>((b * kStateBlock + i) % 5) - 2;
          const float xm = testing::float_of(testing::bits_of(ym[at] * scale) + ulps);
          const float xs = testing::float_of(testing::bits_of(yv[at] * scale) + ulps);
          m.push_back(i % 2 ? -xm : xm);
          v.push_back(xs * xs);
        }
      }
    }
  }
  for_each_simd_target([&](const std::string& target) {
    const Encoded em = encode(StateDType::kInt8, StateMoment::kExpAvg, m);
    const Encoded ev = encode(StateDType::kInt8, StateMoment::kExpAvgSq, v);
    for (std::size_t i = 0; i < m.size(); ++i) {
      const std::size_t b = i / kStateBlock;
      ASSERT_EQ(static_cast<std::int8_t>(em.bytes[i]), exp_avg_code_of(m[i] / em.scales[b]))
          << target << " m " << i << " = " << m[i] << ", scale " << em.scales[b];
      ASSERT_EQ(ev.bytes[i], exp_avg_sq_code_of(std::sqrt(v[i]) / ev.scales[b]))
          << target << " v " << i << " = " << v[i] << ", scale " << ev.scales[b];
    }
  });
}

// The data sets of the round-trip test: name and values (exp_avg_sq takes their absolute values).
std::vector<std::pair<std::string, std::vector<float>>> datasets() {
  std::vector<std::pair<std::string, std::vector<float>>> sets;
  std::mt19937 rng(13);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float scale : {1e-30f, 1e-8f, 1e-3f, 1.0f, 1e3f, 1e30f}) {
    std::vector<float> x(4 * kStateBlock);
    for (float& f : x) f = nd(rng) * scale;
    sets.emplace_back(str("normal*", scale), x);
  }
  {
    std::vector<float> x(3 * kStateBlock, 0.0f);  // a zero block between two others
    for (std::size_t i = 0; i < kStateBlock; ++i) x[i] = nd(rng), x[2 * kStateBlock + i] = nd(rng);
    sets.emplace_back("zero block", x);
    sets.emplace_back("all zero", std::vector<float>(700, 0.0f));
  }
  {
    std::vector<float> x(2 * kStateBlock);
    std::uniform_int_distribution<std::uint32_t> mant(1, 0x7FFFFF);
    for (float& f : x) f = testing::float_of(mant(rng)) * (nd(rng) < 0 ? -1.0f : 1.0f);  // denormals
    sets.emplace_back("denormals", x);
    x[5] = 1e-30f;  // denormals beside a normal value
    sets.emplace_back("denormals with a normal", x);
  }
  {
    std::vector<float> x(kStateBlock);
    for (std::size_t i = 0; i < x.size(); ++i)
      x[i] = FLT_MAX * (1.0f - static_cast<float>(i) / 512.0f) * (i % 2 ? -1.0f : 1.0f);
    sets.emplace_back("near FLT_MAX", x);
  }
  {
    std::vector<float> x(2 * kStateBlock);
    std::uniform_real_distribution<float> expo(-40.0f, 40.0f);
    for (float& f : x) f = nd(rng) * std::pow(10.0f, expo(rng) / 2.0f);  // 1e-20 .. 1e20 in one block
    sets.emplace_back("mixed magnitudes", x);
  }
  {
    std::vector<float> x(3 * kStateBlock + 45);  // a partial last block
    for (float& f : x) f = nd(rng) * 0.01f;
    sets.emplace_back("partial last block", x);
    sets.emplace_back("single element", std::vector<float>{-3.25e-4f});
    sets.emplace_back("single zero", std::vector<float>{0.0f});
  }
  return sets;
}

TEST(StateCodec, RoundTripsWithinTheDocumentedBoundsOnEveryTarget) {
  const auto sets = datasets();
  for_each_simd_target([&](const std::string& target) {
    double worst_bf16 = 0, worst_m8 = 0, worst_v8 = 0;  // measured relative errors, |x| >= 2^-14 of the block's max
    for (const auto& [name, values] : sets) {
      SCOPED_TRACE(target + ", " + name);
      const std::size_t n = values.size();
      std::vector<float> vs(n);
      for (std::size_t i = 0; i < n; ++i) vs[i] = std::fabs(values[i]);
      for (auto mo : {StateMoment::kExpAvg, StateMoment::kExpAvgSq}) {
        const std::vector<float>& x = mo == StateMoment::kExpAvg ? values : vs;
        // fp32: a copy.
        EXPECT_EQ(decode(StateDType::kF32, mo, encode(StateDType::kF32, mo, x), n), x);
        // bf16: within 2^-8 relative; past the largest bf16 an infinity, as documented.
        const auto b = decode(StateDType::kBF16, mo, encode(StateDType::kBF16, mo, x), n);
        for (std::size_t i = 0; i < n; ++i) {
          if (std::fabs(x[i]) >= testing::float_of(0x7F7F8000u)) {  // halfway past the largest bf16: ties to even, inf
            ASSERT_TRUE(std::isinf(b[i])) << i;
            continue;
          }
          const double err = std::fabs(static_cast<double>(b[i]) - x[i]);
          ASSERT_LE(err, bound_bf16(x[i])) << i << ": " << x[i] << " -> " << b[i];
          ASSERT_EQ(bits_of(b[i]), bits_of(testing::ref_round(x[i], DType::kBF16))) << "round to nearest-even, " << i;
          if (std::fabs(x[i]) >= FLT_MIN) worst_bf16 = std::max(worst_bf16, err / std::fabs(x[i]));
        }
        // int8.
        const Encoded e = encode(StateDType::kInt8, mo, x);
        const auto y = decode(StateDType::kInt8, mo, e, n);
        for (std::size_t blk = 0; blk * kStateBlock < n; ++blk) {
          const std::size_t lo = blk * kStateBlock, hi = std::min(n, lo + kStateBlock);
          double mx = 0;
          for (std::size_t i = lo; i < hi; ++i) {
            mx = std::max(mx, mo == StateMoment::kExpAvg ? std::fabs(static_cast<double>(x[i]))
                                                         : std::sqrt(static_cast<double>(x[i])));
          }
          ASSERT_TRUE(std::isfinite(e.scales[blk])) << "block " << blk;
          if (mx == 0) {
            EXPECT_EQ(e.scales[blk], 0.0f) << "block " << blk;
            for (std::size_t i = lo; i < hi; ++i) ASSERT_EQ(bits_of(y[i]), 0u) << "a zero block decodes to +0, " << i;
          }
          for (std::size_t i = lo; i < hi; ++i) {
            ASSERT_TRUE(std::isfinite(y[i])) << i;
            if (mo == StateMoment::kExpAvg) {
              const double err = std::fabs(static_cast<double>(y[i]) - x[i]);
              ASSERT_LE(err, bound_m8(x[i], mx)) << i << ": " << x[i] << " -> " << y[i] << ", absmax " << mx;
              if (std::fabs(x[i]) >= std::ldexp(mx, -14) && std::fabs(x[i]) >= FLT_MIN) {
                worst_m8 = std::max(worst_m8, err / std::fabs(x[i]));
              }
            } else {
              const double s = std::sqrt(static_cast<double>(x[i]));
              const double err = std::fabs(std::sqrt(static_cast<double>(y[i])) - s);
              ASSERT_LE(err, bound_v8(s, mx)) << i << ": " << x[i] << " -> " << y[i] << ", max sqrt " << mx;
              if (x[i] > 0 && mx > 1e-16) {
                ASSERT_GT(y[i], 0.0f) << "a positive v decodes positive, " << i;
              }
              if (s >= std::ldexp(mx, -14) && x[i] >= FLT_MIN) worst_v8 = std::max(worst_v8, err / s);
            }
          }
        }
      }
    }
    // The bounds are not slack: the measured worst cases come close to them.
    EXPECT_GT(worst_bf16, std::ldexp(1.0, -8) * 0.9);
    EXPECT_GT(worst_m8, std::ldexp(1.0, -4) * 0.9);
    EXPECT_GT(worst_v8, std::ldexp(1.0, -5) * 0.9);
    ::testing::Test::RecordProperty(str("worst_rel_bf16_", target), str(worst_bf16));
    ::testing::Test::RecordProperty(str("worst_rel_m8_", target), str(worst_m8));
    ::testing::Test::RecordProperty(str("worst_rel_sqrt_v8_", target), str(worst_v8));
    std::printf("%s: worst relative error bf16 %.4g, int8 m %.4g, int8 sqrt(v) %.4g\n", target.c_str(), worst_bf16,
                worst_m8, worst_v8);
  });
}

TEST(StateCodec, ThreadCountDoesNotChangeTheBytes) {
  std::mt19937 rng(14);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(300'007);
  for (float& f : x) f = nd(rng) * 1e-3f;
  for (auto fam : {StateDType::kBF16, StateDType::kInt8}) {
    const Encoded one = encode(fam, StateMoment::kExpAvg, x, 1);
    for (int threads : {2, 3, 16}) {
      const Encoded many = encode(fam, StateMoment::kExpAvg, x, threads);
      EXPECT_EQ(many.bytes, one.bytes) << state_dtype_name(fam) << " " << threads;
      EXPECT_EQ(many.scales, one.scales) << state_dtype_name(fam) << " " << threads;
      EXPECT_EQ(decode(fam, StateMoment::kExpAvg, many, x.size(), threads),
                decode(fam, StateMoment::kExpAvg, one, x.size(), 1));
    }
  }
}

TEST(StateCodec, BadArgumentsAreRejected) {
  std::vector<float> x(600, 1.0f);
  std::vector<std::uint8_t> bytes(2000);
  std::vector<float> scales(8);
  const ConstTensorRef in(x.data(), DType::kF32, x.size());
  auto expect = [](const Status& s, const char* needle) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << needle << ": " << s;
    EXPECT_NE(s.message().find(needle), std::string::npos) << s;
  };
  // Formats that are not the moment's.
  expect(encode_state(StateMoment::kExpAvgSq, in, {bytes.data(), DType::kI8, 600}, scales.data()), "exp_avg_sq");
  expect(encode_state(StateMoment::kExpAvg, in, {bytes.data(), DType::kU8, 600}, scales.data()), "exp_avg");
  expect(encode_state(StateMoment::kExpAvg, in, {bytes.data(), DType::kF16, 600}, nullptr), "fp16");
  // Scales: missing for int8, present for bf16, misaligned.
  expect(encode_state(StateMoment::kExpAvg, in, {bytes.data(), DType::kI8, 600}, nullptr), "scales");
  expect(encode_state(StateMoment::kExpAvg, in, {bytes.data(), DType::kBF16, 600}, scales.data()), "scales");
  expect(encode_state(StateMoment::kExpAvg, in, {bytes.data(), DType::kI8, 600},
                      reinterpret_cast<float*>(reinterpret_cast<std::uint8_t*>(scales.data()) + 1)),
         "aligned");
  // Misaligned bf16, lengths, overlap, non-fp32 input.
  expect(encode_state(StateMoment::kExpAvg, in, {bytes.data() + 1, DType::kBF16, 600}, nullptr), "aligned");
  expect(encode_state(StateMoment::kExpAvg, in, {bytes.data(), DType::kBF16, 599}, nullptr), "599");
  expect(encode_state(StateMoment::kExpAvg, in, {x.data(), DType::kBF16, 600}, nullptr), "overlap");
  expect(encode_state(StateMoment::kExpAvg, ConstTensorRef(bytes.data(), DType::kBF16, 600),
                      {bytes.data() + 1200, DType::kBF16, 600}, nullptr),
         "fp32");
  expect(decode_state(StateMoment::kExpAvg, ConstTensorRef(bytes.data(), DType::kI8, 600), nullptr,
                      {x.data(), DType::kF32, 600}),
         "scales");
  expect(decode_state(StateMoment::kExpAvg, ConstTensorRef(bytes.data(), DType::kI8, 600), scales.data(),
                      {bytes.data() + 1000, DType::kBF16, 600}),
         "fp32");
  // Values that are not state.
  x[17] = NAN;
  expect(encode_state(StateMoment::kExpAvg, in, {bytes.data(), DType::kBF16, 600}, nullptr), "element 17");
  x[17] = -1.0f;
  EXPECT_TRUE(encode_state(StateMoment::kExpAvg, in, {bytes.data(), DType::kBF16, 600}, nullptr).ok());
  expect(encode_state(StateMoment::kExpAvgSq, in, {bytes.data(), DType::kU8, 600}, scales.data()), "negative");
  x[17] = INFINITY;
  expect(encode_state(StateMoment::kExpAvg, in, {bytes.data(), DType::kI8, 600}, scales.data()), "finite");
}

}  // namespace
}  // namespace tier::cpu
