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

TEST(AccessTrace, AMismatchRecordsTheStepFromItsMatchedPrefix) {
  AccessTrace t;
  step(t, {0, 1, 2});
  t.begin_step();
  EXPECT_TRUE(t.on_acquire(0, Tier::kDevice));
  EXPECT_FALSE(t.on_acquire(2, Tier::kDevice));
  EXPECT_EQ(t.order_changes(), 1u);
  EXPECT_FALSE(t.has_trace()) << "the rest of the step is not prefetched";
  EXPECT_EQ(t.mode(), AccessTrace::Mode::kRecording);
  EXPECT_TRUE(t.on_acquire(1, Tier::kDevice));
  t.end_step();
  // The step as it ran, its matched beginning included, is the trace: the next step replays it.
  ASSERT_EQ(t.entries().size(), 3u);
  EXPECT_EQ(t.entries()[0].tensor, 0u);
  EXPECT_EQ(t.entries()[1].tensor, 2u);
  EXPECT_EQ(t.entries()[2].tensor, 1u);
  EXPECT_EQ(t.steps_recorded(), 2u);
  step(t, {0, 2, 1});
  EXPECT_EQ(t.order_changes(), 1u);
}

// An evaluation's forward first (recorded), then training steps: the first training step replays
// the forward, records on from its backward, and the second replays the whole step.
TEST(AccessTrace, ATrainingStepAfterAForwardOnlyStepIsRecordedWhole) {
  AccessTrace t;
  step(t, {0, 1, 2});  // forward only
  t.begin_step();
  for (TensorId id : {0, 1, 2}) EXPECT_TRUE(t.on_acquire(id, Tier::kDevice));
  EXPECT_FALSE(t.on_acquire(2, Tier::kHost));  // backward, past the trace's end
  for (TensorId id : {1, 0}) t.on_acquire(id, Tier::kHost);
  t.end_step();
  ASSERT_EQ(t.entries().size(), 6u);
  step(t, {0, 1, 2});
  t.begin_step();
  for (TensorId id : {0, 1, 2}) EXPECT_TRUE(t.on_acquire(id, Tier::kDevice));
  for (TensorId id : {2, 1, 0}) EXPECT_TRUE(t.on_acquire(id, Tier::kHost)) << "tensor " << id;
  t.end_step();
  EXPECT_EQ(t.order_changes(), 2u) << "the first training step, then the forward-only step";
}

// A step that ends early (an evaluation's forward between training steps) leaves the trace for the
// training steps. From the second in a row that ends at the same place (an evaluation's batches),
// lookahead wraps there to the next step's start, not into the tail that does not run; a step that
// runs past it has the whole trace again.
TEST(AccessTrace, ShortStepsInARowAreLookedAheadAsTheirPrefix) {
  AccessTrace t;
  step(t, {0, 1, 2});
  step(t, {0, 1});
  EXPECT_EQ(t.order_changes(), 1u);
  ASSERT_TRUE(t.has_trace());
  t.begin_step();
  EXPECT_EQ(t.span(), 3u) << "one short step: the trace as it is";
  t.end_step();
  step(t, {0, 1});  // (the step just begun and ended ran nothing: it changes nothing)
  t.begin_step();
  EXPECT_EQ(t.span(), 2u);
  EXPECT_TRUE(t.on_acquire(0, Tier::kDevice));
  EXPECT_TRUE(t.on_acquire(1, Tier::kDevice));
  EXPECT_EQ(t.upcoming(0).tensor, 0u) << "at the expected end the next step's start comes next";
  EXPECT_EQ(t.upcoming(1).tensor, 1u);
  t.end_step();
  step(t, {0, 1});
  EXPECT_EQ(t.order_changes(), 1u) << "the steps that end where expected are no change";
  EXPECT_EQ(t.entries().size(), 3u) << "the tail stays for the training steps";
  // A training step again: replayed whole, the tail included, and the whole trace is ahead again.
  t.begin_step();
  EXPECT_TRUE(t.on_acquire(0, Tier::kDevice));
  EXPECT_TRUE(t.on_acquire(1, Tier::kDevice));
  EXPECT_TRUE(t.on_acquire(2, Tier::kDevice));
  EXPECT_EQ(t.span(), 3u);
  t.end_step();
  EXPECT_EQ(t.order_changes(), 1u);
  t.begin_step();
  EXPECT_EQ(t.span(), 3u);
  t.end_step();
}

// Forgetting the trace in the middle of a recording (a tensor it names is unregistered) drops
// what the step recorded too: the id may come back for another tensor.
TEST(AccessTrace, AResetWhileRecordingLeavesNoTrace) {
  AccessTrace t;
  t.begin_step();
  t.on_acquire(0, Tier::kDevice);
  EXPECT_TRUE(t.touches(0));
  t.reset();
  EXPECT_FALSE(t.touches(0));
  t.on_acquire(1, Tier::kDevice);
  t.end_step();
  EXPECT_FALSE(t.has_trace());
  step(t, {1, 2});
  EXPECT_TRUE(t.has_trace());
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
