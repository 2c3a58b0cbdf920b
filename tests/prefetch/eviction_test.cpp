#include "prefetch/eviction.hpp"

#include <gtest/gtest.h>

#include <initializer_list>
#include <vector>

namespace tier::prefetch {
namespace {

constexpr std::size_t kNever = EvictionPolicy::kNever;

// A trace replaying `ids` on the device, positioned at the start of a step.
AccessTrace replaying(std::initializer_list<TensorId> ids, Tier tier = Tier::kDevice) {
  AccessTrace t;
  t.begin_step();
  for (TensorId id : ids) t.on_acquire(id, tier);
  t.end_step();
  t.begin_step();
  return t;
}

EvictionCandidate idle(TensorId id, std::uint64_t last_use = 0) {
  EvictionCandidate c;
  c.tensor = id;
  c.valid = true;
  c.last_use = last_use;
  return c;
}

std::vector<TensorId> order(const std::vector<Victim>& v) {
  std::vector<TensorId> out;
  for (const Victim& x : v) out.push_back(x.tensor);
  return out;
}

EvictionPolicy policy(const AccessTrace& trace, std::uint64_t bytes_each = 100) {
  return EvictionPolicy(trace, [bytes_each](TensorId) { return bytes_each; });
}

TEST(EvictionPolicy, WithoutTraceTheLeastRecentlyUsedGoesFirst) {
  AccessTrace none;
  EvictionPolicy p = policy(none);
  const std::vector<EvictionCandidate> c = {idle(0, 5), idle(1, 2), idle(2, 9)};
  EXPECT_EQ(order(p.choose(c, Tier::kDevice, kInvalidTensor, kNever, 10)), (std::vector<TensorId>{1, 0, 2}));
}

TEST(EvictionPolicy, NeverPicksPinnedWritingBackInvalidHomeOrTheTensorBeingPlaced) {
  AccessTrace none;
  EvictionPolicy p = policy(none);
  std::vector<EvictionCandidate> c = {idle(0), idle(1), idle(2), idle(3), idle(4), idle(5)};
  c[0].pinned = true;
  c[1].writing_back = true;
  c[2].valid = false;
  c[3].home = true;
  const std::vector<Victim> v = p.choose(c, Tier::kDevice, /*for_tensor=*/4, kNever, 1);
  EXPECT_EQ(order(v), (std::vector<TensorId>{5}));
}

TEST(EvictionPolicy, WithTraceTheCopyNeededLatestGoesFirst) {
  const AccessTrace t = replaying({0, 1, 2, 3});
  EvictionPolicy p = policy(t);
  // Recency says nothing once a trace replays: 3 is used last in the step, then 2, 1, 0.
  const std::vector<EvictionCandidate> c = {idle(0, 9), idle(1, 1), idle(2, 5), idle(3, 7)};
  EXPECT_EQ(order(p.choose(c, Tier::kDevice, kInvalidTensor, kNever, 10)), (std::vector<TensorId>{3, 2, 1, 0}));
}

TEST(EvictionPolicy, CopiesTheTraceNeverUsesGoFirst) {
  const AccessTrace t = replaying({0, 1});
  EvictionPolicy p = policy(t);
  const std::vector<Victim> v = p.choose({{idle(1), idle(7), idle(0)}}, Tier::kDevice, kInvalidTensor, kNever, 1);
  ASSERT_EQ(v.size(), 3u);
  EXPECT_EQ(v[0].tensor, 7u);
  EXPECT_EQ(v[0].rank, kNever);
}

TEST(EvictionPolicy, APrefetchTakesOnlyCopiesNeededAfterItsTarget) {
  const AccessTrace t = replaying({0, 1, 2, 3});
  EvictionPolicy p = policy(t);
  const std::vector<EvictionCandidate> c = {idle(0), idle(1), idle(3), idle(9)};
  // The prefetch target is 2 entries ahead: 0 and 1 are needed before it, 3 and 9 (never) after.
  EXPECT_EQ(order(p.choose(c, Tier::kDevice, 2, /*horizon=*/2, 1)), (std::vector<TensorId>{9, 3}));
}

TEST(EvictionPolicy, AHostCopyCountsTheNextDeviceLoadItFeeds) {
  AccessTrace t;
  t.begin_step();
  t.on_acquire(0, Tier::kHost);
  t.on_acquire(1, Tier::kDevice);  // 1's host copy feeds this load
  t.on_acquire(0, Tier::kDevice);
  t.on_acquire(1, Tier::kHost);
  t.end_step();
  t.begin_step();
  // A tiny device: it keeps nothing, so each host copy ranks by the nearer of its host and device uses.
  EvictionPolicy small = policy(t, 100);
  small.set_device_budget(50);
  EXPECT_EQ(small.rank(idle(1), Tier::kHost, 0), 1u);
  EXPECT_EQ(small.rank(idle(0), Tier::kHost, 0), 0u);
  // A device that keeps its valid copy of 1 until that use: the host copy is needed only at 3.
  EvictionPolicy big = policy(t, 100);
  big.set_device_budget(1000);
  EvictionCandidate on_device = idle(1);
  on_device.device_copy_valid = true;
  EXPECT_EQ(big.rank(on_device, Tier::kHost, 0), 3u);
  EXPECT_EQ(big.rank(idle(1), Tier::kHost, 0), 1u) << "no device copy: the host copy feeds the load";
}

TEST(EvictionPolicy, DeviceKeepsOnlyWhatFitsWithTheDistinctTensorsInBetween) {
  const AccessTrace t = replaying({0, 1, 2, 1, 3});
  EvictionPolicy p = policy(t, 100);
  // Until 3's use 4 entries ahead the device holds 0, 1 and 2 (1 counts once) and 3 itself.
  p.set_device_budget(400);
  EXPECT_TRUE(p.device_keeps(3, 4));
  p.set_device_budget(399);
  EXPECT_FALSE(p.device_keeps(3, 4));
  EXPECT_FALSE(p.device_keeps(3, 3)) << "0, 1, 2 and 3: 400 > 399";
  EXPECT_TRUE(p.device_keeps(3, 2)) << "0, 1 and 3: 300";
}

}  // namespace
}  // namespace tier::prefetch
