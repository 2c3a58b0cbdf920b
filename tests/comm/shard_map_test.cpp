// The shard layout: ShardMap and the C ABI's tier_shard_range agree with the definition
// (shard = ceil(n / W), rank r owns [r * shard, min(n, (r + 1) * shard))) for many (n, W).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>

#include "tier/comm.hpp"
#include "tier/tier.h"

namespace tier {
namespace {

TEST(ShardMap, MatchesTheDefinitionForManySizes) {
  for (int world = 1; world <= 9; ++world) {
    for (std::uint64_t n : {0ull, 1ull, 2ull, 3ull, 5ull, 7ull, 8ull, 9ull, 16ull, 17ull, 1000ull, 1023ull, 4097ull}) {
      auto map = ShardMap::create(n, world);
      ASSERT_TRUE(map.ok()) << map.status();
      const std::uint64_t shard = (n + world - 1) / world;
      EXPECT_EQ(map->shard_size(), shard);
      EXPECT_EQ(map->padded_numel(), shard * world);
      EXPECT_GE(map->padded_numel(), n);
      std::uint64_t covered = 0;
      for (int r = 0; r < world; ++r) {
        const std::uint64_t begin = std::min<std::uint64_t>(n, r * shard);
        const std::uint64_t end = std::min<std::uint64_t>(n, (r + 1) * shard);
        EXPECT_EQ(map->offset(r), begin) << "n " << n << " world " << world << " rank " << r;
        EXPECT_EQ(map->count(r), end - begin) << "n " << n << " world " << world << " rank " << r;
        EXPECT_EQ(map->offset(r), covered);  // contiguous, in rank order
        covered += map->count(r);

        std::uint64_t offset = 99, count = 99;
        ASSERT_EQ(tier_shard_range(n, world, r, &offset, &count), TIER_OK) << tier_last_error();
        EXPECT_EQ(offset, map->offset(r));
        EXPECT_EQ(count, map->count(r));
      }
      EXPECT_EQ(covered, n);
      for (std::uint64_t i = 0; i < n; ++i) {
        const int o = map->owner(i);
        EXPECT_GE(i, map->offset(o));
        EXPECT_LT(i, map->offset(o) + map->count(o));
      }
    }
  }
}

TEST(ShardMap, FewerElementsThanRanksLeavesTheLastRanksEmpty) {
  auto map = ShardMap::create(3, 8);
  ASSERT_TRUE(map.ok());
  EXPECT_EQ(map->shard_size(), 1u);
  EXPECT_EQ(map->padded_numel(), 8u);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(map->count(r), 1u);
  for (int r = 3; r < 8; ++r) {
    EXPECT_EQ(map->count(r), 0u);
    EXPECT_EQ(map->offset(r), 3u);
  }
  // 10 over 4: shards of 3, the last rank gets 1.
  auto m2 = ShardMap::create(10, 4);
  ASSERT_TRUE(m2.ok());
  EXPECT_EQ(m2->count(3), 1u);
  EXPECT_EQ(m2->offset(3), 9u);
  // 9 over 4: shards of 3, the last rank gets nothing.
  auto m3 = ShardMap::create(9, 4);
  ASSERT_TRUE(m3.ok());
  EXPECT_EQ(m3->count(3), 0u);
}

TEST(ShardMap, BadArgumentsAreRefused) {
  EXPECT_EQ(ShardMap::create(10, 0).status().code(), StatusCode::kInvalidArgument);
  std::uint64_t offset = 0, count = 0;
  EXPECT_EQ(tier_shard_range(10, 0, 0, &offset, &count), TIER_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(tier_shard_range(10, 2, 2, &offset, &count), TIER_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(tier_last_error()).find("rank 2"), std::string::npos) << tier_last_error();
  EXPECT_EQ(tier_shard_range(10, 2, -1, &offset, &count), TIER_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(tier_shard_range(10, 2, 0, nullptr, &count), TIER_ERROR_INVALID_ARGUMENT);
}

}  // namespace
}  // namespace tier
