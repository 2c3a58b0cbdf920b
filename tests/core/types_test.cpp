#include "tier/types.hpp"

#include <gtest/gtest.h>

namespace tier {
namespace {

TEST(Types, TierNamesRoundTrip) {
  for (Tier t : kAllTiers) {
    auto p = parse_tier(tier_name(t));
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(*p, t);
  }
  EXPECT_EQ(*parse_tier("GPU"), Tier::kDevice);
  EXPECT_EQ(*parse_tier("cpu"), Tier::kHost);
  auto bad = parse_tier("tape");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'tape'"), std::string::npos);
  EXPECT_NE(bad.status().message().find("device, host, nvme"), std::string::npos);
}

TEST(Types, DTypeSizesAndNames) {
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kF16), 2u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF64), 8u);
  EXPECT_EQ(dtype_size(DType::kI8), 1u);
  for (int i = 0; i < kNumDTypes; ++i) {
    const auto d = static_cast<DType>(i);
    auto p = parse_dtype(dtype_name(d));
    ASSERT_TRUE(p.ok()) << dtype_name(d);
    EXPECT_EQ(*p, d);
  }
  EXPECT_EQ(*parse_dtype("bfloat16"), DType::kBF16);
  EXPECT_EQ(*parse_dtype("Half"), DType::kF16);
  EXPECT_EQ(*parse_dtype("float"), DType::kF32);
  EXPECT_FALSE(parse_dtype("fp8").ok());
}

TEST(Types, RoleNamesRoundTrip) {
  for (int i = 0; i < kNumRoles; ++i) {
    const auto r = static_cast<Role>(i);
    auto p = parse_role(role_name(r));
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(*p, r);
  }
  EXPECT_FALSE(parse_role("momentum").ok());
}

TEST(Types, LinkNames) {
  EXPECT_STREQ(link_name(Link::kNvmeToHost), "nvme_to_host");
  EXPECT_STREQ(link_name(Link::kDeviceToHost), "device_to_host");
}

TEST(TensorDesc, BytesFollowDType) {
  TensorDesc d{"w", DType::kBF16, 1000, Role::kParam, 3};
  EXPECT_EQ(d.bytes(), 2000u);
  EXPECT_TRUE(d.validate().ok());
}

TEST(TensorDesc, ValidateRejectsBadDescriptors) {
  EXPECT_EQ(TensorDesc({"", DType::kF32, 1}).validate().code(), StatusCode::kInvalidArgument);
  auto zero = TensorDesc({"w", DType::kF32, 0}).validate();
  EXPECT_EQ(zero.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(zero.message().find("'w'"), std::string::npos);
  EXPECT_FALSE(TensorDesc({"a\nb", DType::kF32, 1}).validate().ok());
  EXPECT_FALSE(TensorDesc({"huge", DType::kF64, 1ull << 62}).validate().ok());
}

}  // namespace
}  // namespace tier
