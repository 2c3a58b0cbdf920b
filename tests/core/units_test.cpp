#include "tier/units.hpp"

#include <gtest/gtest.h>

namespace tier {
namespace {

TEST(ParseSize, PlainAndBinaryUnits) {
  EXPECT_EQ(*parse_size("4096"), 4096u);
  EXPECT_EQ(*parse_size("4K"), 4096u);
  EXPECT_EQ(*parse_size("4k"), 4096u);
  EXPECT_EQ(*parse_size("1M"), 1u << 20);
  EXPECT_EQ(*parse_size("4G"), 4ull << 30);
  EXPECT_EQ(*parse_size("2T"), 2ull << 40);
  EXPECT_EQ(*parse_size("2GiB"), 2ull << 30);
  EXPECT_EQ(*parse_size("512KiB"), 512u << 10);
  EXPECT_EQ(*parse_size("1.5G"), 3ull << 29);
  EXPECT_EQ(*parse_size(" 8 M "), 8u << 20);
  EXPECT_EQ(*parse_size("100B"), 100u);
}

TEST(ParseSize, DecimalUnits) {
  EXPECT_EQ(*parse_size("1KB"), 1000u);
  EXPECT_EQ(*parse_size("4GB"), 4000000000ull);
  EXPECT_EQ(*parse_size("1TB"), 1000000000000ull);
}

TEST(ParseSize, RejectsWithAClearMessage) {
  for (const char* bad : {"", "G", "4X", "-1", "1.5", "0.3K", "1..2G", "4 apples", "99999999999T"}) {
    auto r = parse_size(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("size '"), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("512K"), std::string::npos) << "names what is allowed";
  }
}

TEST(Format, BytesRatesSeconds) {
  EXPECT_EQ(format_bytes(17), "17 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(3ull << 30), "3.00 GiB");
  EXPECT_EQ(format_rate(3.21e9), "3.21 GB/s");
  EXPECT_EQ(format_seconds(2.5), "2.500 s");
  EXPECT_EQ(format_seconds(0.0123), "12.30 ms");
  EXPECT_EQ(format_seconds(0.00085), "850.0 us");
}

}  // namespace
}  // namespace tier
