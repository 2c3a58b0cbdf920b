// fill_uniform / fill_normal: the Philox words against the published answers and a scalar
// reference, independence from threads and length, the distributions, dtypes and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/reference.hpp"
#include "tier/cpu_kernels.hpp"

namespace tier::cpu {
namespace {

using testing::Buffer;
using testing::for_each_simd_target;

// Philox4x32-10 written from the paper, one block at a time.
std::array<std::uint32_t, 4> philox(std::array<std::uint32_t, 4> c, std::uint32_t k0, std::uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = std::uint64_t{0xD2511F53u} * c[0];
    const std::uint64_t p1 = std::uint64_t{0xCD9E8D57u} * c[2];
    c = {static_cast<std::uint32_t>(p1 >> 32) ^ c[1] ^ k0, static_cast<std::uint32_t>(p1),
         static_cast<std::uint32_t>(p0 >> 32) ^ c[3] ^ k1, static_cast<std::uint32_t>(p0)};
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

std::array<std::uint32_t, 4> words(std::uint64_t seed, std::uint64_t stream, std::uint64_t block) {
  return philox({static_cast<std::uint32_t>(block), static_cast<std::uint32_t>(block >> 32),
                 static_cast<std::uint32_t>(stream), static_cast<std::uint32_t>(stream >> 32)},
                static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
}

TEST(RandomFill, TheReferencePhiloxGivesThePublishedAnswers) {
  // Random123's known-answer vectors for philox4x32_10.
  EXPECT_EQ(philox({0, 0, 0, 0}, 0, 0), (std::array<std::uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, 0xffffffff, 0xffffffff),
            (std::array<std::uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, 0xa4093822, 0x299f31d0),
            (std::array<std::uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(RandomFill, UniformElementsAreTheTopBitsOfThePhiloxWordsOnEveryTarget) {
  const std::uint64_t seed = 0x0123456789abcdefull, stream = (std::uint64_t{7} << 32) | 3;
  const std::uint64_t n = 4 * 1000 + 3;  // a partial last block
  for_each_simd_target([&](const std::string& target) {
    Buffer x(DType::kF32, n);
    ASSERT_TRUE(fill_uniform(x.ref(), 0.0f, 1.0f, seed, stream).ok());
    for (std::uint64_t i = 0; i < n; ++i) {
      const auto w = words(seed, stream, i / 4);
      const float want = static_cast<float>(w[i % 4] >> 8) / 16777216.0f;
      ASSERT_EQ(x.get(i), want) << target << " element " << i;
    }
  });
}

TEST(RandomFill, NormalElementsAreTheBoxMullerPairsOfTheWordsOnEveryTarget) {
  const std::uint64_t seed = 42, stream = 9;
  const std::uint64_t n = 4 * 4096 + 2;
  for_each_simd_target([&](const std::string& target) {
    Buffer x(DType::kF32, n);
    ASSERT_TRUE(fill_normal(x.ref(), 0.5f, 2.0f, seed, stream).ok());
    double worst = 0;
    for (std::uint64_t i = 0; i < n; ++i) {
      const auto w = words(seed, stream, i / 4);
      const int j = static_cast<int>(i % 2), second = static_cast<int>((i % 4) / 2);
      const double u = static_cast<double>((w[j] >> 8) + 1) / 16777216.0;
      const double v = static_cast<double>(w[j + 2] >> 8) / 16777216.0;
      const double r = std::sqrt(-2.0 * std::log(u));
      const double theta = 2 * M_PI * v;
      const double want = 0.5 + 2.0 * r * (second ? std::sin(theta) : std::cos(theta));
      worst = std::max(worst, std::abs(x.get(i) - want));
    }
    // fp32 arithmetic on values of |x| < 12: a few units in the last place.
    EXPECT_LT(worst, 1e-5) << target;
  });
}

TEST(RandomFill, ValuesDependOnlyOnSeedStreamAndIndex) {
  const std::uint64_t n = 3 * 64 * 1024 + 77;  // several pieces per thread, a ragged end
  for (const bool normal : {false, true}) {
    auto fill = [&](std::uint64_t count, std::uint64_t seed, std::uint64_t stream, int threads) {
      Buffer x(DType::kF32, count);
      const Status s = normal ? fill_normal(x.ref(), 0, 1, seed, stream, threads)
                              : fill_uniform(x.ref(), -1, 1, seed, stream, threads);
      EXPECT_TRUE(s.ok()) << s;
      return x;
    };
    const Buffer one = fill(n, 5, 1, 1);
    const Buffer all = fill(n, 5, 1, 0);
    const Buffer two = fill(n, 5, 1, 2);
    EXPECT_EQ(0, std::memcmp(one.data(), all.data(), n * 4)) << normal;
    EXPECT_EQ(0, std::memcmp(one.data(), two.data(), n * 4)) << normal;
    const Buffer prefix = fill(1001, 5, 1, 2);
    EXPECT_EQ(0, std::memcmp(one.data(), prefix.data(), 1001 * 4)) << normal;
    // Another stream or seed: other values (a handful of equal elements at most, by chance).
    for (const Buffer& other : {fill(n, 5, 2, 2), fill(n, 6, 1, 2)}) {
      std::uint64_t same = 0;
      for (std::uint64_t i = 0; i < n; ++i) same += one.get(i) == other.get(i);
      EXPECT_LT(same, 8u) << normal;
    }
  }
}

TEST(RandomFill, TheDistributionsHaveTheirMomentsAndQuantiles) {
  const std::uint64_t n = 1 << 20;
  Buffer x(DType::kF32, n);
  ASSERT_TRUE(fill_normal(x.ref(), 1.0f, 0.02f, 11, 0, 0).ok());
  std::vector<double> z(n);
  double sum = 0, sq = 0;
  for (std::uint64_t i = 0; i < n; ++i) {
    z[i] = (x.get(i) - 1.0) / 0.02;
    sum += z[i];
    sq += z[i] * z[i];
  }
  const double mean = sum / n, var = sq / n - mean * mean;
  EXPECT_NEAR(mean, 0.0, 5.0 / std::sqrt(static_cast<double>(n)));
  EXPECT_NEAR(var, 1.0, 5.0 * std::sqrt(2.0 / n));
  // The empirical CDF against the normal's at several points (Kolmogorov-Smirnov at 1e-3).
  std::sort(z.begin(), z.end());
  for (const double q : {-3.0, -2.0, -1.0, -0.3, 0.0, 0.5, 1.0, 2.0, 3.0}) {
    const double cdf = 0.5 * std::erfc(-q / std::sqrt(2.0));
    const double emp = static_cast<double>(std::lower_bound(z.begin(), z.end(), q) - z.begin()) / n;
    EXPECT_NEAR(emp, cdf, 1.95 / std::sqrt(static_cast<double>(n))) << q;
  }
  ASSERT_TRUE(fill_uniform(x.ref(), -3.0f, 5.0f, 11, 1, 0).ok());
  std::vector<int> bins(16, 0);
  for (std::uint64_t i = 0; i < n; ++i) {
    const float v = x.get(i);
    ASSERT_GE(v, -3.0f);
    ASSERT_LT(v, 5.0f);
    ++bins[static_cast<int>((v + 3.0f) * 2.0f)];
  }
  for (const int b : bins) EXPECT_NEAR(b, n / 16.0, 5 * std::sqrt(n / 16.0));
}

TEST(RandomFill, HalfPrecisionElementsAreTheFp32ValuesRounded) {
  const std::uint64_t n = 10007;
  for (const bool normal : {false, true}) {
    Buffer f32(DType::kF32, n);
    ASSERT_TRUE((normal ? fill_normal(f32.ref(), 0, 0.02f, 3, 4) : fill_uniform(f32.ref(), -0.1f, 0.1f, 3, 4)).ok());
    for (const DType d : {DType::kF16, DType::kBF16}) {
      Buffer h(d, n), want(d, n);
      ASSERT_TRUE(
          (normal ? fill_normal(h.ref(), 0, 0.02f, 3, 4, 2) : fill_uniform(h.ref(), -0.1f, 0.1f, 3, 4, 2)).ok());
      ASSERT_TRUE(convert(f32.cref(), want.ref()).ok());
      EXPECT_EQ(0, std::memcmp(h.data(), want.data(), n * 2)) << dtype_name(d) << " normal " << normal;
    }
  }
}

TEST(RandomFill, BadInputIsRefusedAndLeavesTheTensorAlone) {
  Buffer x(DType::kF32, 16);
  std::fill(x.bytes.begin(), x.bytes.end(), std::uint8_t{0x7f});
  const Buffer before = x;
  const float nan = std::nanf("");
  EXPECT_EQ(fill_normal(x.ref(), 0, -1, 0, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fill_normal(x.ref(), nan, 1, 0, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fill_normal(x.ref(), 0, INFINITY, 0, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fill_uniform(x.ref(), 1, 0, 0, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fill_uniform(x.ref(), 0, nan, 0, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fill_uniform(x.ref(), 0, 1, 0, 0, -1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fill_uniform(TensorRef{x.data(), DType::kI32, 4}, 0, 1, 0, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(x.bytes, before.bytes);
  // std 0 and an empty range are values, not errors.
  ASSERT_TRUE(fill_normal(x.ref(), 0.25f, 0, 0, 0).ok());
  ASSERT_TRUE(fill_uniform(TensorRef{x.data(), DType::kF32, 0}, 0, 1, 0, 0).ok());
  for (std::uint64_t i = 0; i < 16; ++i) EXPECT_EQ(x.get(i), 0.25f);
}

}  // namespace
}  // namespace tier::cpu
