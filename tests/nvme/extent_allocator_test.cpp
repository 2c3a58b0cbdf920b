#include "nvme/extent_allocator.hpp"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace tier::nvme::detail {
namespace {

constexpr std::uint64_t K4 = 4096;

TEST(ExtentAllocator, StartsAsOneFreeRun) {
  ExtentAllocator a(1 << 20);
  EXPECT_EQ(a.capacity(), 1u << 20);
  EXPECT_EQ(a.free_bytes(), 1u << 20);
  EXPECT_EQ(a.free_runs(), 1u);
  EXPECT_EQ(a.fragmentation(), 0.0);
}

TEST(ExtentAllocator, RefusesUnalignedAndOversizedRequests) {
  ExtentAllocator a(64 * K4);
  EXPECT_FALSE(a.allocate(0));
  EXPECT_FALSE(a.allocate(100));
  EXPECT_FALSE(a.allocate(65 * K4));
  EXPECT_EQ(a.free_bytes(), 64 * K4);
}

TEST(ExtentAllocator, PacksFromTheFrontAndReusesFreedRuns) {
  ExtentAllocator a(64 * K4);
  auto x = a.allocate(4 * K4);
  auto y = a.allocate(8 * K4);
  auto z = a.allocate(4 * K4);
  ASSERT_TRUE(x && y && z);
  EXPECT_EQ(*x, 0u);
  EXPECT_EQ(*y, 4 * K4);
  EXPECT_EQ(*z, 12 * K4);
  a.release(*y, 8 * K4);
  EXPECT_EQ(a.free_runs(), 2u);
  EXPECT_GT(a.fragmentation(), 0.0);
  // Best fit: the 8-granule hole, not the big tail.
  auto w = a.allocate(6 * K4);
  ASSERT_TRUE(w);
  EXPECT_EQ(*w, 4 * K4);
}

TEST(ExtentAllocator, CoalescesNeighboursOnRelease) {
  ExtentAllocator a(16 * K4);
  std::vector<std::uint64_t> offs;
  for (int i = 0; i < 16; ++i) offs.push_back(*a.allocate(K4));
  EXPECT_EQ(a.free_bytes(), 0u);
  EXPECT_FALSE(a.allocate(K4));
  for (int i : {1, 3, 2, 0, 5, 4, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6}) a.release(offs[i], K4);
  EXPECT_EQ(a.free_runs(), 1u);
  EXPECT_EQ(a.largest_free(), 16 * K4);
  EXPECT_EQ(a.fragmentation(), 0.0);
}

TEST(ExtentAllocator, RandomChurnKeepsTheBooksStraight) {
  ExtentAllocator a(1024 * K4);
  std::mt19937 rng(7);
  std::vector<std::pair<std::uint64_t, std::uint64_t>> live;
  std::vector<bool> used(1024, false);
  for (int step = 0; step < 5000; ++step) {
    if (live.empty() || rng() % 2) {
      const std::uint64_t n = K4 * (1 + rng() % 16);
      if (auto off = a.allocate(n)) {
        for (std::uint64_t g = *off / K4; g < (*off + n) / K4; ++g) {
          ASSERT_FALSE(used[g]) << "granule " << g << " handed out twice";
          used[g] = true;
        }
        live.emplace_back(*off, n);
      }
    } else {
      const std::size_t i = rng() % live.size();
      for (std::uint64_t g = live[i].first / K4; g < (live[i].first + live[i].second) / K4; ++g) used[g] = false;
      a.release(live[i].first, live[i].second);
      live.erase(live.begin() + static_cast<long>(i));
    }
    std::uint64_t in_use = 0;
    for (auto& l : live) in_use += l.second;
    ASSERT_EQ(a.used_bytes(), in_use);
  }
  for (auto& l : live) a.release(l.first, l.second);
  EXPECT_EQ(a.free_runs(), 1u);
  EXPECT_EQ(a.free_bytes(), 1024 * K4);
}

}  // namespace
}  // namespace tier::nvme::detail
