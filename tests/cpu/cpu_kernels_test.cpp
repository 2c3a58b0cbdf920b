#include "tier/cpu_kernels.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "cpu/reference.hpp"

namespace tier::cpu {
namespace {

using testing::bits_of;
using testing::Buffer;
using testing::float_of;
using testing::for_each_simd_target;

constexpr DType kFloatTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

// fp32 values that exercise every rounding path of fp16 and bf16: zeros, subnormals of all three
// formats, ties, the overflow boundaries, infinities, NaNs and random values of many magnitudes.
std::vector<float> tricky_floats(std::size_t random_count, unsigned seed) {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          65504.0f,
                          65519.0f,
                          65520.0f,
                          -65520.0f,
                          1e6f,
                          5.9604645e-8f,  // smallest fp16 subnormal
                          2.9802322e-8f,  // half of it: ties to zero
                          8.940697e-8f,   // 1.5 fp16 subnormal units: ties to even (2 units)
                          6.097555e-5f,   // largest fp16 subnormal region
                          6.1035156e-5f,  // smallest fp16 normal
                          1e-40f,         // fp32 subnormal
                          std::numeric_limits<float>::max(),
                          -std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          float_of(0x3F808000u),   // bf16 tie, even below
                          float_of(0x3F818000u),   // bf16 tie, odd below: rounds up
                          float_of(0x3F808001u),   // just above a bf16 tie
                          float_of(0x7F7F8000u),   // bf16 tie at the top: rounds to infinity
                          float_of(0x3F801000u),   // fp16 tie (13 dropped bits = 0x1000), even below
                          float_of(0x3F803000u)};  // fp16 tie, odd below
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-30, 20);
  std::uniform_int_distribution<std::uint32_t> any;
  for (std::size_t i = 0; i < random_count; ++i) {
    if (i % 7 == 0) {
      v.push_back(float_of(any(rng)));  // any pattern, NaNs and infinities included
    } else {
      v.push_back(std::ldexp(mant(rng), expo(rng)));
    }
  }
  return v;
}

bool same_value(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || bits_of(a) == bits_of(b);
}

// A 16-bit buffer (fp16 or bf16) holding each of the 65536 bit patterns, element i = pattern i.
Buffer every_16bit_pattern(DType d) {
  Buffer h(d, 65536);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const auto u = static_cast<std::uint16_t>(i);
    std::memcpy(h.bytes.data() + 2 * i, &u, 2);
  }
  return h;
}

TEST(SimdTarget, ListsTargetsAndReportsTheChosenOne) {
  const auto targets = simd_targets();
  ASSERT_FALSE(targets.empty());
  EXPECT_EQ(simd_target(), targets.front()) << "the best target is used by default";
}

TEST(SimdTarget, ForcingEachTargetIsReportedAndAutoRestores) {
  const auto targets = simd_targets();
  for (const auto& t : targets) {
    ASSERT_TRUE(force_simd_target(t).ok()) << t;
    EXPECT_EQ(simd_target(), t);
  }
  ASSERT_TRUE(force_simd_target("auto").ok());
  EXPECT_EQ(simd_target(), targets.front());
}

TEST(SimdTarget, UnknownTargetNamesTheAvailableOnes) {
  const Status s = force_simd_target("mmx");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find(simd_targets().front()), std::string::npos) << s;
  EXPECT_EQ(simd_target(), simd_targets().front()) << "a failed force changes nothing";
}

TEST(Convert, F16ToF32IsExactForEveryPatternOnEveryTarget) {
  const Buffer h = every_16bit_pattern(DType::kF16);
  for_each_simd_target([&](const std::string& t) {
    Buffer f(DType::kF32, 65536);
    ASSERT_TRUE(convert(h.cref(), f.ref()).ok());
    int bad = 0;
    for (std::uint32_t i = 0; i < 65536 && bad < 5; ++i) {
      const float want = testing::ref_f16_to_f32(static_cast<std::uint16_t>(i));
      if (!same_value(f.get(i), want)) {
        ADD_FAILURE() << t << ": fp16 0x" << std::hex << i << " gave " << f.get(i) << " want " << want;
        ++bad;
      }
    }
  });
}

TEST(Convert, Bf16ToF32IsExactForEveryPatternOnEveryTarget) {
  const Buffer h = every_16bit_pattern(DType::kBF16);
  for_each_simd_target([&](const std::string& t) {
    Buffer f(DType::kF32, 65536);
    ASSERT_TRUE(convert(h.cref(), f.ref()).ok());
    for (std::uint32_t i = 0; i < 65536; ++i) {
      ASSERT_EQ(bits_of(f.get(i)), i << 16) << t;
    }
  });
}

TEST(Convert, F32ToF16AndBf16RoundToNearestEvenOnEveryTarget) {
  const auto values = tricky_floats(20000, 1);
  Buffer src(DType::kF32, values.size());
  for (std::size_t i = 0; i < values.size(); ++i) src.set(i, values[i]);
  for (const DType dst_type : {DType::kF16, DType::kBF16}) {
    for_each_simd_target([&](const std::string& t) {
      Buffer dst(dst_type, values.size());
      ASSERT_TRUE(convert(src.cref(), dst.ref()).ok());
      int bad = 0;
      for (std::size_t i = 0; i < values.size() && bad < 5; ++i) {
        const std::uint16_t want =
            dst_type == DType::kF16 ? testing::ref_f32_to_f16(values[i]) : testing::ref_f32_to_bf16(values[i]);
        const std::uint16_t got = dst.raw16(i);
        const bool both_nan = std::isnan(dst.get(i)) && std::isnan(values[i]);
        if (got != want && !both_nan) {
          ADD_FAILURE() << t << " " << dtype_name(dst_type) << ": " << values[i] << " (0x" << std::hex
                        << bits_of(values[i]) << ") gave 0x" << got << " want 0x" << want;
          ++bad;
        }
      }
    });
  }
}

TEST(Convert, Fp16AndBf16ConvertIntoEachOther) {
  const auto values = tricky_floats(3000, 2);
  for (const auto& [from, to] : {std::pair{DType::kF16, DType::kBF16}, std::pair{DType::kBF16, DType::kF16}}) {
    Buffer src(from, values.size());
    for (std::size_t i = 0; i < values.size(); ++i) src.set(i, values[i]);
    Buffer dst(to, values.size());
    ASSERT_TRUE(convert(src.cref(), dst.ref()).ok());
    for (std::size_t i = 0; i < values.size(); ++i) {
      ASSERT_TRUE(same_value(dst.get(i), testing::ref_round(src.get(i), to))) << src.get(i);
    }
  }
}

TEST(Convert, ChunksAndThreadsGiveTheSameBytes) {
  const std::size_t n = 300'001;
  const auto values = tricky_floats(n, 3);
  Buffer src(DType::kF32, n);
  for (std::size_t i = 0; i < n; ++i) src.set(i, values[i]);
  for (const DType to : {DType::kF16, DType::kBF16}) {
    Buffer whole(to, n);
    ASSERT_TRUE(convert(src.cref(), whole.ref(), 1).ok());
    for (int threads : {0, 2, 3}) {
      Buffer t(to, n);
      ASSERT_TRUE(convert(src.cref(), t.ref(), threads).ok());
      EXPECT_TRUE(t.same_bytes(whole)) << threads << " threads";
    }
    Buffer chunked(to, n);
    std::size_t at = 0;
    for (std::size_t len : {1u, 7u, 15u, 17u, 1000u, 65537u}) {
      for (; at + len <= n && at < n / 2; at += len) {
        ASSERT_TRUE(convert(ConstTensorRef(static_cast<const float*>(src.data()) + at, DType::kF32, len),
                            TensorRef{static_cast<std::uint8_t*>(chunked.data()) + 2 * at, to, len})
                        .ok());
      }
    }
    ASSERT_TRUE(convert(ConstTensorRef(static_cast<const float*>(src.data()) + at, DType::kF32, n - at),
                        TensorRef{static_cast<std::uint8_t*>(chunked.data()) + 2 * at, to, n - at})
                    .ok());
    EXPECT_TRUE(chunked.same_bytes(whole)) << dtype_name(to);
  }
}

TEST(Convert, BadInputIsRejectedWithAClearError) {
  Buffer a(DType::kF32, 16), b(DType::kF16, 15), c(DType::kF16, 16);
  Status s = convert(a.cref(), b.ref());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("16 elements"), std::string::npos) << s;
  // Misaligned fp32 data.
  s = convert(ConstTensorRef(a.bytes.data() + 2, DType::kF32, 8), TensorRef{c.data(), DType::kF16, 8});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("aligned"), std::string::npos) << s;
  // Integer dtypes.
  s = convert(ConstTensorRef(a.data(), DType::kI32, 16), c.ref());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("int32"), std::string::npos) << s;
  // Overlap.
  s = convert(ConstTensorRef(a.data(), DType::kF32, 8), TensorRef{a.bytes.data() + 16, DType::kF16, 8});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("overlap"), std::string::npos) << s;
  EXPECT_EQ(convert(a.cref(), c.ref(), -1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(convert(ConstTensorRef(nullptr, DType::kF32, 4), c.ref()).code(), StatusCode::kInvalidArgument);
}

TEST(Convert, SameDtypeIsACopy) {
  Buffer a(DType::kBF16, 1001), b(DType::kBF16, 1001);
  for (int i = 0; i < 1001; ++i) a.set(i, static_cast<float>(i) * 0.25f);
  ASSERT_TRUE(convert(a.cref(), b.ref(), 2).ok());
  EXPECT_TRUE(a.same_bytes(b));
}

Buffer random_buffer(DType d, std::size_t n, unsigned seed, float scale = 1.0f) {
  Buffer b(d, n);
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  for (std::size_t i = 0; i < n; ++i) b.set(i, dist(rng));
  return b;
}

TEST(SumOfSquares, MatchesFp64OnEveryTargetAndDtype) {
  for (const DType d : kFloatTypes) {
    const Buffer x = random_buffer(d, 100'003, 4, 3.0f);
    double want = 0;
    for (std::size_t i = 0; i < x.n; ++i) want += static_cast<double>(x.get(i)) * x.get(i);
    for_each_simd_target([&](const std::string& t) {
      auto got = sum_of_squares(x.cref());
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_NEAR(*got, want, want * 1e-12) << t << " " << dtype_name(d);
    });
  }
}

TEST(SumOfSquares, DoesNotOverflowForLargeFp32) {
  Buffer x(DType::kF32, 33);
  for (int i = 0; i < 33; ++i) x.set(i, 3e38f);
  auto got = sum_of_squares(x.cref());
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(std::isfinite(*got));
  EXPECT_NEAR(*got, 33 * 9e76, 33 * 9e76 * 1e-6);
}

TEST(SumOfSquares, IsBitIdenticalForAnyThreadCount) {
  const Buffer x = random_buffer(DType::kF32, 1'000'037, 5);
  auto one = sum_of_squares(x.cref(), 1);
  ASSERT_TRUE(one.ok());
  for (int threads : {0, 2, 3, 4}) {
    auto t = sum_of_squares(x.cref(), threads);
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(bits_of(static_cast<float>(*t)), bits_of(static_cast<float>(*one)));
    EXPECT_EQ(std::memcmp(&*t, &*one, sizeof(double)), 0) << threads << " threads";
  }
}

TEST(GradNormAccumulator, AccumulatesChunksDeterministically) {
  const Buffer x = random_buffer(DType::kBF16, 500'001, 6);
  auto run = [&](int threads) {
    GradNormAccumulator acc;
    const auto* p = static_cast<const std::uint16_t*>(x.data());
    for (std::size_t at = 0; at < x.n; at += 77'777) {
      const std::size_t len = std::min<std::size_t>(77'777, x.n - at);
      EXPECT_TRUE(acc.add(ConstTensorRef(p + at, DType::kBF16, len), threads).ok());
    }
    return acc;
  };
  const auto a = run(1);
  const auto b = run(2);
  EXPECT_EQ(std::memcmp(&a, &b, sizeof(a)), 0) << "same chunking, different threads: same bits";
  auto whole = sum_of_squares(x.cref());
  ASSERT_TRUE(whole.ok());
  EXPECT_NEAR(a.sum_of_squares(), *whole, *whole * 1e-12);
  EXPECT_NEAR(a.norm(), std::sqrt(*whole), 1e-9 * std::sqrt(*whole));
  EXPECT_TRUE(a.finite());
  GradNormAccumulator merged;
  merged.merge(a);
  merged.merge(a);
  EXPECT_DOUBLE_EQ(merged.sum_of_squares(), 2 * a.sum_of_squares());
}

TEST(HasNonFinite, FindsInfAndNanAnywhereInEveryDtype) {
  const float specials[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()};
  for (const DType d : kFloatTypes) {
    for_each_simd_target([&](const std::string& t) {
      const std::size_t n = 70'001;  // more than one block, odd tail
      Buffer x = random_buffer(d, n, 7, 100.0f);
      auto clean = has_non_finite(x.cref());
      ASSERT_TRUE(clean.ok());
      EXPECT_FALSE(*clean) << t;
      for (const std::size_t at : {std::size_t{0}, std::size_t{17}, n / 2, n - 1}) {
        for (const float s : specials) {
          const float old = x.get(at);
          x.set(at, s);
          for (int threads : {1, 2}) {
            auto r = has_non_finite(x.cref(), threads);
            ASSERT_TRUE(r.ok());
            EXPECT_TRUE(*r) << t << " " << dtype_name(d) << " " << s << " at " << at;
          }
          x.set(at, old);
        }
      }
    });
  }
}

TEST(HasNonFinite, Fp16OverflowIsInfinite) {
  // 70000 is finite in fp32 but infinite once stored as fp16: the check sees what is stored.
  Buffer x(DType::kF16, 9);
  for (int i = 0; i < 9; ++i) x.set(i, 1.0f);
  x.set(4, 70000.0f);
  auto r = has_non_finite(x.cref());
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(*r);
}

TEST(Scale, MultipliesAndRoundsLikeTheReference) {
  for (const DType d : kFloatTypes) {
    for_each_simd_target([&](const std::string& t) {
      Buffer x = random_buffer(d, 10'007, 8, 10.0f);
      const Buffer before = x;
      ASSERT_TRUE(scale(x.ref(), 0.37f, 2).ok());
      for (std::size_t i = 0; i < x.n; ++i) {
        ASSERT_TRUE(same_value(x.get(i), testing::ref_round(before.get(i) * 0.37f, d))) << t << " at " << i;
      }
    });
  }
  Buffer x(DType::kF32, 4);
  EXPECT_EQ(scale(x.ref(), std::numeric_limits<float>::infinity()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(scale(x.ref(), std::nanf("")).code(), StatusCode::kInvalidArgument);
}

TEST(Clip, CoefficientFollowsPyTorch) {
  EXPECT_FLOAT_EQ(clip_coefficient(10.0, 1.0), static_cast<float>(1.0 / (10.0 + 1e-6)));
  EXPECT_EQ(clip_coefficient(0.5, 1.0), 1.0f);
  EXPECT_EQ(clip_coefficient(10.0, 0.0), 1.0f) << "max_norm 0: clipping off";
  EXPECT_EQ(clip_coefficient(std::numeric_limits<double>::infinity(), 1.0), 1.0f);
}

TEST(Clip, ByGlobalNormScalesEveryTensorToTheMaximum) {
  Buffer a = random_buffer(DType::kF32, 1000, 9, 2.0f);
  Buffer b = random_buffer(DType::kBF16, 777, 10, 2.0f);
  TensorRef refs[] = {a.ref(), b.ref()};
  auto norm = clip_by_global_norm(refs, 2, 1.0);
  ASSERT_TRUE(norm.ok()) << norm.status();
  EXPECT_GT(*norm, 10.0);
  GradNormAccumulator acc;
  ASSERT_TRUE(acc.add(a.cref()).ok());
  ASSERT_TRUE(acc.add(b.cref()).ok());
  EXPECT_NEAR(acc.norm(), 1.0, 0.01) << "bf16 rounding allows about 0.4% per element";
  // Below the maximum: unchanged.
  const Buffer a2 = a;
  TensorRef one[] = {a.ref()};
  auto n2 = clip_by_global_norm(one, 1, 100.0);
  ASSERT_TRUE(n2.ok());
  EXPECT_TRUE(a.same_bytes(a2));
}

TEST(Clip, NonFiniteNormLeavesGradientsAlone) {
  Buffer a = random_buffer(DType::kF16, 100, 11);
  a.set(50, std::numeric_limits<float>::infinity());
  const Buffer before = a;
  TensorRef refs[] = {a.ref()};
  auto norm = clip_by_global_norm(refs, 1, 1.0);
  ASSERT_TRUE(norm.ok());
  EXPECT_TRUE(std::isinf(*norm));
  EXPECT_TRUE(a.same_bytes(before));
  EXPECT_EQ(clip_by_global_norm(refs, 1, std::nan("")).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tier::cpu
