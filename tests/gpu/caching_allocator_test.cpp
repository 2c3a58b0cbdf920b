// The caching allocator: size classes, reuse under budget pressure, giving memory back. Run on
// the emulated device, whose blocks are real host memory.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "gpu/caching_allocator.hpp"
#include "tier/ext/device.hpp"

namespace tier {
namespace {

constexpr std::uint64_t kMiB = 1ull << 20;
using detail::device_size_class;

std::unique_ptr<Device> emulated(std::uint64_t budget) {
  DeviceOptions o;
  o.kind = DeviceKind::kEmulated;
  o.budget_bytes = budget;
  auto d = create_emulated_device(o);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? std::move(d).value() : nullptr;
}

TEST(DeviceSizeClass, WastesLessThanAQuarterAndIsStable) {
  EXPECT_EQ(device_size_class(0), 0u);
  EXPECT_EQ(device_size_class(1), 512u);
  EXPECT_EQ(device_size_class(512), 512u);
  EXPECT_EQ(device_size_class(513), 640u);
  EXPECT_EQ(device_size_class(1000), 1024u);
  EXPECT_EQ(device_size_class(kMiB), kMiB);
  EXPECT_EQ(device_size_class(kMiB + 1), kMiB + kMiB / 4);
  EXPECT_EQ(device_size_class(3 * kMiB), 3 * kMiB);
  std::mt19937_64 rng(7);
  std::uint64_t prev_n = 0, prev_c = 0;
  std::vector<std::uint64_t> ns;
  for (int i = 0; i < 20000; ++i) ns.push_back(rng() % (std::uint64_t{1} << (1 + i % 40)) + 1);
  std::sort(ns.begin(), ns.end());
  for (std::uint64_t n : ns) {
    const std::uint64_t c = device_size_class(n);
    ASSERT_GE(c, n);
    if (n > 512) {
      ASSERT_LT(static_cast<double>(c), 1.25 * static_cast<double>(n)) << n;
      ASSERT_EQ(c % 128, 0u) << n;
    }
    ASSERT_EQ(device_size_class(c), c) << "a class is its own class: " << n;
    if (n >= prev_n) {
      ASSERT_GE(c, prev_c) << "monotonic at " << n;
    }
    prev_n = n;
    prev_c = c;
  }
  // No overflow at the top: the budget rejects these.
  EXPECT_GE(device_size_class(~std::uint64_t{0} - 5), ~std::uint64_t{0} - 5);
}

TEST(CachingAllocator, UnderPressureReusesALargerCachedBlockInsteadOfFreeing) {
  auto d = emulated(4 * kMiB);
  ASSERT_TRUE(d);
  auto a = d->allocate(3 * kMiB);
  ASSERT_TRUE(a.ok()) << a.status();
  void* p = a->data();
  a->reset();
  auto b = d->allocate(2 * kMiB);  // 3 + 2 > 4: the cached 3 MiB block serves it
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->data(), p);
  EXPECT_EQ(b->size(), 2 * kMiB);
  EXPECT_EQ(b->capacity(), 3 * kMiB);
  const auto s = d->memory_stats();
  EXPECT_EQ(s.device_frees, 0u);
  EXPECT_EQ(s.cache_hits, 1u);
  EXPECT_EQ(s.allocated_bytes, 3 * kMiB);
  EXPECT_EQ(s.requested_bytes, 2 * kMiB);
  EXPECT_NEAR(s.fragmentation, 1.0 / 3.0, 1e-9);
}

TEST(CachingAllocator, GivesCachedBlocksBackWhenTheBudgetNeedsThem) {
  auto d = emulated(4 * kMiB);
  ASSERT_TRUE(d);
  {
    auto a = d->allocate(kMiB);
    auto b = d->allocate(kMiB);
    ASSERT_TRUE(a.ok() && b.ok());
  }
  EXPECT_EQ(d->memory_stats().cached_bytes, 2 * kMiB);
  auto c = d->allocate(3 * kMiB);  // needs one cached block given back
  ASSERT_TRUE(c.ok()) << c.status();
  const auto s = d->memory_stats();
  EXPECT_EQ(s.device_frees, 1u);
  EXPECT_EQ(s.reserved_bytes, 4 * kMiB);
  EXPECT_EQ(s.cached_bytes, kMiB);
  EXPECT_EQ(s.peak_reserved_bytes, 4 * kMiB);
}

TEST(CachingAllocator, KeepsReservedWithinTheBudgetUnderChurn) {
  auto d = emulated(8 * kMiB);
  ASSERT_TRUE(d);
  std::mt19937 rng(3);
  std::vector<DeviceBuffer> live;
  std::uint64_t ok = 0, refused = 0;
  for (int i = 0; i < 2000; ++i) {
    if (!live.empty() && rng() % 3 == 0) {
      live.erase(live.begin() + static_cast<long>(rng() % live.size()));
      continue;
    }
    auto b = d->allocate(1 + rng() % (kMiB + kMiB / 2));
    if (b.ok()) {
      ++ok;
      std::memset(b->data(), 1, b->size());  // host-addressable: the bytes are really there
      live.push_back(std::move(b).value());
    } else {
      ++refused;
      ASSERT_EQ(b.status().code(), StatusCode::kResourceExhausted) << b.status();
    }
    const auto s = d->memory_stats();
    ASSERT_LE(s.reserved_bytes, 8 * kMiB);
    ASSERT_EQ(s.reserved_bytes, s.allocated_bytes + s.cached_bytes + s.pending_free_bytes);
    ASSERT_EQ(s.live_buffers, live.size());
  }
  EXPECT_GT(ok, 100u);
  EXPECT_EQ(d->memory_stats().failures, refused);
  live.clear();
  EXPECT_EQ(d->memory_stats().allocated_bytes, 0u);
  const std::uint64_t cached = d->memory_stats().cached_bytes;
  EXPECT_EQ(d->release_cached(), cached);
  EXPECT_EQ(d->memory_stats().reserved_bytes, 0u);
}

}  // namespace
}  // namespace tier
