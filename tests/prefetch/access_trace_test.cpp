#include "tier/ext/access_trace.hpp"

#include <gtest/gtest.h>

namespace tier {
namespace {

void step(AccessTrace& t, std::initializer_list<TensorId> ids, Tier tier = Tier::kDevice) {
  t.begin_step();
  for (TensorId id : ids) t.on_acquire(id, tier);
  t.end_step();
}

TEST(AccessTrace, FirstStepIsRecordedThenReplayed) {
  AccessTrace t;
  EXPECT_EQ(t.mode(), AccessTrace::Mode::kIdle);
  step(t, {3, 1, 2});
  ASSERT_TRUE(t.has_trace());
  EXPECT_EQ(t.entries().size(), 3u);
  EXPECT_EQ(t.entries()[0].tensor, 3u);
  t.begin_step();
  EXPECT_EQ(t.mode(), AccessTrace::Mode::kReplaying);
  EXPECT_TRUE(t.on_acquire(3, Tier::kDevice));
  EXPECT_EQ(t.position(), 1u);
  EXPECT_EQ(t.upcoming(0).tensor, 1u);
  EXPECT_EQ(t.upcoming(2).tensor, 3u) << "cyclic: the next step starts again";
}

TEST(AccessTrace, NextUseIsCyclicAndPerTier) {
  AccessTrace t;
  t.begin_step();
  t.on_acquire(0, Tier::kDevice);
  t.on_acquire(1, Tier::kDevice);
  t.on_acquire(2, Tier::kHost);
  t.on_acquire(0, Tier::kHost);
  t.end_step();
  t.begin_step();
  EXPECT_EQ(t.next_use(0), 0u);
  EXPECT_EQ(t.next_use(2), 2u);
  EXPECT_EQ(t.next_use(0, Tier::kHost), 3u);
  EXPECT_EQ(t.next_use(7), AccessTrace::kNever);
  EXPECT_EQ(t.next_use(2, Tier::kDevice), AccessTrace::kNever);
  t.on_acquire(0, Tier::kDevice);
  t.on_acquire(1, Tier::kDevice);
  EXPECT_EQ(t.next_use(1), 3u) << "position 2: tensor 1 comes next at 1 of the next step";
  EXPECT_EQ(t.next_use(0, Tier::kDevice), 2u);
}

TEST(AccessTrace, MismatchDropsTheTraceAndRecordsAgain) {
  AccessTrace t;
  step(t, {0, 1, 2});
  t.begin_step();
  EXPECT_TRUE(t.on_acquire(0, Tier::kDevice));
  EXPECT_FALSE(t.on_acquire(2, Tier::kDevice));
  EXPECT_EQ(t.order_changes(), 1u);
  EXPECT_FALSE(t.has_trace());
  t.end_step();
  step(t, {0, 2, 1});
  ASSERT_TRUE(t.has_trace());
  EXPECT_EQ(t.entries()[1].tensor, 2u);
  EXPECT_EQ(t.steps_recorded(), 2u);
}

TEST(AccessTrace, ShorterStepIsAnOrderChange) {
  AccessTrace t;
  step(t, {0, 1, 2});
  step(t, {0, 1});
  EXPECT_EQ(t.order_changes(), 1u);
  EXPECT_FALSE(t.has_trace());
}

TEST(AccessTrace, AcquiresOutsideAStepAreIgnored) {
  AccessTrace t;
  step(t, {0, 1});
  EXPECT_TRUE(t.on_acquire(9, Tier::kHost));
  EXPECT_TRUE(t.has_trace());
  EXPECT_EQ(t.entries().size(), 2u);
}

// advances() moves with the replay only: each step begun and each matched acquire, never an
// acquire outside a step (an optimizer pass between steps), so the engine can tell whether the
// trace moved on since a prefetched copy was dropped unused.
TEST(AccessTrace, AdvancesCountTheReplayOnly) {
  AccessTrace t;
  step(t, {0, 1});  // recorded
  const std::uint64_t a0 = t.advances();
  t.on_acquire(7, Tier::kHost);  // outside a step
  t.on_acquire(8, Tier::kHost);
  EXPECT_EQ(t.advances(), a0);
  t.begin_step();
  EXPECT_EQ(t.advances(), a0 + 1);
  t.on_acquire(0, Tier::kDevice);
  EXPECT_EQ(t.advances(), a0 + 2);
  t.on_acquire(1, Tier::kDevice);
  EXPECT_EQ(t.advances(), a0 + 3);
  t.end_step();
  t.on_acquire(0, Tier::kDevice);  // between steps again
  EXPECT_EQ(t.advances(), a0 + 3);
}

}  // namespace
}  // namespace tier
