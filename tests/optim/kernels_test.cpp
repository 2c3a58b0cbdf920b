// The optimizer module's own kernels: CRC-32C (hardware and table paths agree with the standard
// check value and with each other) and the gradient accumulation whose fused sum of squares must
// equal cpu::sum_of_squares bit for bit, on every SIMD target this CPU runs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "optim/crc32c.hpp"
#include "optim/grad_accumulate.hpp"
#include "optim/workers.hpp"
#include "tier/cpu_kernels.hpp"

namespace tier::optim::detail {
namespace {

TEST(Crc32c, CheckValueAndBothPaths) {
  const char* s = "123456789";
  EXPECT_EQ(crc32c(s, 9), 0xE3069283u);
  EXPECT_EQ(crc32c_extend_portable(0, s, 9), 0xE3069283u);
  EXPECT_EQ(crc32c(s, 0), 0u);
  std::vector<std::uint8_t> data(100003);
  std::mt19937 rng(1);
  for (auto& b : data) b = static_cast<std::uint8_t>(rng());
  const std::uint32_t whole = crc32c(data.data(), data.size());
  EXPECT_EQ(whole, crc32c_extend_portable(0, data.data(), data.size()));
  // Extending piece by piece gives the checksum of the whole.
  for (std::size_t cut : {std::size_t{1}, std::size_t{7}, std::size_t{4096}, std::size_t{99999}}) {
    EXPECT_EQ(crc32c_extend(crc32c(data.data(), cut), data.data() + cut, data.size() - cut), whole) << cut;
  }
  data[5000] ^= 1;
  EXPECT_NE(crc32c(data.data(), data.size()), whole);
}

class GradAccumulate : public testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { ASSERT_TRUE(cpu::force_simd_target(GetParam()).ok()); }
  void TearDown() override { ASSERT_TRUE(cpu::force_simd_target("auto").ok()); }
};

std::vector<std::uint8_t> random_grad(std::uint64_t n, DType dt, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<float> f(n);
  for (auto& x : f) x = d(rng);
  std::vector<std::uint8_t> out(n * dtype_size(dt) + 8);
  EXPECT_TRUE(cpu::convert(cpu::ConstTensorRef(f.data(), DType::kF32, n), cpu::TensorRef{out.data(), dt, n}).ok());
  return out;
}

TEST_P(GradAccumulate, FusedSumEqualsSumOfSquaresBitForBit) {
  Workers two(2);
  for (std::uint64_t n : {1ull, 7ull, 64ull, 1000ull, 65536ull, 65537ull, 300001ull}) {
    for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
      const auto g1 = random_grad(n, dt, n + 1);
      const auto g2 = random_grad(n, dt, n + 2);
      std::vector<float> acc(n, 123.0f);  // overwritten by the first micro-step
      double s1 = -1;
      ASSERT_TRUE(accumulate_grad(acc.data(), cpu::ConstTensorRef(g1.data(), dt, n), true, &s1, &two).ok());
      // First micro-step: acc is g converted; its sum is sum_of_squares of g itself.
      std::vector<float> ref(n);
      ASSERT_TRUE(cpu::convert(cpu::ConstTensorRef(g1.data(), dt, n), cpu::TensorRef{ref.data(), DType::kF32, n}).ok());
      ASSERT_EQ(std::memcmp(acc.data(), ref.data(), n * 4), 0) << n;
      EXPECT_EQ(s1, cpu::sum_of_squares(cpu::ConstTensorRef(g1.data(), dt, n)).value()) << n << dtype_name(dt);
      // Second: acc += g2, fused sum on the result; on one thread as well as two.
      std::vector<float> f2(n);
      ASSERT_TRUE(cpu::convert(cpu::ConstTensorRef(g2.data(), dt, n), cpu::TensorRef{f2.data(), DType::kF32, n}).ok());
      for (std::uint64_t i = 0; i < n; ++i) ref[i] = ref[i] + f2[i];
      std::vector<float> acc1 = acc;
      double s2 = -1, s2one = -2;
      ASSERT_TRUE(accumulate_grad(acc.data(), cpu::ConstTensorRef(g2.data(), dt, n), false, &s2, &two).ok());
      ASSERT_TRUE(accumulate_grad(acc1.data(), cpu::ConstTensorRef(g2.data(), dt, n), false, &s2one, nullptr).ok());
      ASSERT_EQ(std::memcmp(acc.data(), ref.data(), n * 4), 0) << n;
      const double want = cpu::sum_of_squares(cpu::ConstTensorRef(ref.data(), DType::kF32, n)).value();
      EXPECT_EQ(s2, want) << n << dtype_name(dt);
      EXPECT_EQ(s2one, want) << n << dtype_name(dt);
      // Without the sum.
      ASSERT_TRUE(accumulate_grad(acc1.data(), cpu::ConstTensorRef(g2.data(), dt, n), false, nullptr, nullptr).ok());
      for (std::uint64_t i = 0; i < n; ++i) ref[i] = ref[i] + f2[i];
      ASSERT_EQ(std::memcmp(acc1.data(), ref.data(), n * 4), 0) << n;
    }
  }
}

TEST_P(GradAccumulate, NonFiniteShowsInTheSum) {
  std::vector<std::uint16_t> g(1000, 0x3C00);  // fp16 1.0
  g[777] = 0x7C00;                             // +inf
  std::vector<float> acc(1000);
  double s = 0;
  ASSERT_TRUE(accumulate_grad(acc.data(), cpu::ConstTensorRef(g.data(), DType::kF16, 1000), true, &s, nullptr).ok());
  EXPECT_TRUE(std::isinf(s));
  g[777] = 0x7E00;  // NaN
  ASSERT_TRUE(accumulate_grad(acc.data(), cpu::ConstTensorRef(g.data(), DType::kF16, 1000), true, &s, nullptr).ok());
  EXPECT_TRUE(std::isnan(s));
  EXPECT_EQ(accumulate_grad(acc.data(), cpu::ConstTensorRef(g.data(), DType::kI32, 10), true, &s, nullptr).code(),
            StatusCode::kInvalidArgument);
}

// A gradient kept in its own dtype: copied as is, with cpu::sum_of_squares' value for it, on one
// thread or two, across block boundaries; bad calls are refused with the destination untouched.
TEST_P(GradAccumulate, CopyInItsOwnDtypeGivesTheSumOfSquaresBitForBit) {
  Workers two(2);
  for (std::uint64_t n : {1ull, 7ull, 1000ull, 65536ull, 65537ull, 300001ull}) {
    for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
      const auto g = random_grad(n, dt, n + 5);
      const std::size_t bytes = n * dtype_size(dt);
      const double want = cpu::sum_of_squares(cpu::ConstTensorRef(g.data(), dt, n)).value();
      for (const Workers* w : {static_cast<const Workers*>(nullptr), static_cast<const Workers*>(&two)}) {
        std::vector<std::uint8_t> dst(bytes, 0xAB);
        const Result<double> s = copy_grad(dst.data(), cpu::ConstTensorRef(g.data(), dt, n), w);
        ASSERT_TRUE(s.ok()) << s.status().to_string();
        EXPECT_EQ(*s, want) << n << dtype_name(dt) << (w ? " two threads" : " one");
        ASSERT_EQ(std::memcmp(dst.data(), g.data(), bytes), 0) << n << dtype_name(dt);
      }
    }
  }
  std::vector<std::uint16_t> g(1000, 0x3C00);  // fp16 1.0
  g[500] = 0x7E00;                             // NaN shows in the sum
  std::vector<std::uint16_t> dst(1000);
  EXPECT_TRUE(std::isnan(copy_grad(dst.data(), cpu::ConstTensorRef(g.data(), DType::kF16, 1000), nullptr).value()));
  std::vector<std::uint16_t> kept(1000, 7);
  EXPECT_EQ(copy_grad(kept.data(), cpu::ConstTensorRef(g.data(), DType::kI32, 10), nullptr).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(copy_grad(g.data() + 10, cpu::ConstTensorRef(g.data(), DType::kF16, 1000), nullptr).status().code(),
            StatusCode::kInvalidArgument);  // overlapping
  EXPECT_EQ(kept, std::vector<std::uint16_t>(1000, 7));
}

INSTANTIATE_TEST_SUITE_P(Targets, GradAccumulate, testing::ValuesIn(cpu::simd_targets()),
                         [](const testing::TestParamInfo<std::string>& i) { return i.param; });

TEST(Workers, CoverTheRangeInGranules) {
  for (int threads : {1, 2, 3}) {
    Workers w(threads);
    for (std::uint64_t n : {0ull, 1ull, 100ull, 1000ull, 12345ull}) {
      std::vector<int> hit(n, 0);
      w.for_ranges(n, 100, [&](std::uint64_t b, std::uint64_t e) {
        EXPECT_EQ(b % 100, 0u);
        for (std::uint64_t i = b; i < e; ++i) ++hit[i];
      });
      for (std::uint64_t i = 0; i < n; ++i) ASSERT_EQ(hit[i], 1) << i;
    }
  }
}

}  // namespace
}  // namespace tier::optim::detail
