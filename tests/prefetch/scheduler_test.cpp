#include "prefetch/scheduler.hpp"

#include <gtest/gtest.h>

#include <initializer_list>
#include <map>
#include <set>
#include <utility>
#include <vector>

namespace tier::prefetch {
namespace {

// The engine as the scheduler sees it: tensors of given sizes; start() records the request and,
// unless told otherwise, puts the copy in flight.
struct FakeTarget final : PrefetchTarget {
  std::map<TensorId, std::uint64_t> sizes;
  std::set<std::pair<TensorId, Tier>> present;
  std::set<TensorId> held_by_writer;
  std::set<TensorId> one_ahead_ids;
  std::set<std::pair<TensorId, Tier>> no_room, waiting;
  std::uint64_t inflight = 0, staging = 0;
  struct Start {
    TensorId tensor;
    Tier tier;
    std::size_t distance;
    bool staging;
  };
  std::vector<Start> started;

  bool known(TensorId id) const override { return sizes.count(id) != 0; }
  bool prefetchable(TensorId id) const override { return held_by_writer.count(id) == 0; }
  std::uint64_t bytes(TensorId id) const override { return sizes.at(id); }
  bool one_ahead(TensorId id) const override { return one_ahead_ids.count(id) != 0; }
  bool present_or_coming(TensorId id, Tier tier) const override { return present.count({id, tier}) != 0; }
  std::uint64_t inflight_bytes() const override { return inflight; }
  std::uint64_t staging_bytes() const override { return staging; }
  Started start(TensorId id, Tier tier, std::size_t distance, bool is_staging) override {
    started.push_back({id, tier, distance, is_staging});
    if (no_room.count({id, tier})) return Started::kNoRoom;
    present.insert({id, tier});
    (is_staging ? staging : inflight) += sizes.at(id);
    return waiting.count({id, tier}) ? Started::kWaiting : Started::kInFlight;
  }
  std::vector<TensorId> final_hops() const {
    std::vector<TensorId> out;
    for (const Start& s : started) {
      if (!s.staging) out.push_back(s.tensor);
    }
    return out;
  }
  std::vector<TensorId> staged() const {
    std::vector<TensorId> out;
    for (const Start& s : started) {
      if (s.staging) out.push_back(s.tensor);
    }
    return out;
  }
};

AccessTrace recorded(std::initializer_list<TensorId> ids, Tier tier = Tier::kDevice) {
  AccessTrace t;
  t.begin_step();
  for (TensorId id : ids) t.on_acquire(id, tier);
  t.end_step();
  return t;
}

FakeTarget tensors(std::initializer_list<TensorId> ids, std::uint64_t bytes = 100) {
  FakeTarget f;
  for (TensorId id : ids) f.sizes[id] = bytes;
  return f;
}

PrefetchLimits roomy() {
  PrefetchLimits l;
  l.window_bytes = 1 << 20;
  l.max_inflight_bytes = 1 << 20;
  l.max_staging_bytes = 1 << 20;
  return l;
}

TEST(PrefetchScheduler, DoesNothingUntilATraceReplays) {
  FakeTarget f = tensors({0, 1});
  AccessTrace t;
  PrefetchScheduler(roomy()).issue(t, f);
  t.begin_step();
  t.on_acquire(0, Tier::kDevice);
  PrefetchScheduler(roomy()).issue(t, f);  // recording
  EXPECT_TRUE(f.started.empty());
}

TEST(PrefetchScheduler, FollowsTheTraceOrderWithDistances) {
  AccessTrace t = recorded({2, 0, 1});
  t.begin_step();
  FakeTarget f = tensors({0, 1, 2});
  PrefetchScheduler(roomy()).issue(t, f);
  EXPECT_EQ(f.final_hops(), (std::vector<TensorId>{2, 0, 1}));
  for (std::size_t k = 0; k < f.started.size(); ++k) EXPECT_EQ(f.started[k].distance, k);
  // Once the step has moved on, the walk starts at the current position and wraps around.
  f = tensors({0, 1, 2});
  ASSERT_TRUE(t.on_acquire(2, Tier::kDevice));
  PrefetchScheduler(roomy()).issue(t, f);
  EXPECT_EQ(f.final_hops(), (std::vector<TensorId>{0, 1, 2}));
}

// Offloaded activation checkpoints: of the upcoming ones only the next is brought to the device,
// later ones are staged in host memory; other tensors between them are brought as usual.
TEST(PrefetchScheduler, OneAheadTensorsGetTheirFinalHopOnlyForTheNextUse) {
  AccessTrace t = recorded({10, 0, 11, 1, 12, 2});
  t.begin_step();
  FakeTarget f = tensors({0, 1, 2, 10, 11, 12});
  f.one_ahead_ids = {10, 11, 12};
  PrefetchScheduler(roomy()).issue(t, f);
  EXPECT_EQ(f.final_hops(), (std::vector<TensorId>{10, 0, 1, 2}));
  EXPECT_EQ(f.staged(), (std::vector<TensorId>{11, 12}));
  // The next one already there counts as the one ahead: nothing more reaches the device.
  f = tensors({0, 1, 2, 10, 11, 12});
  f.one_ahead_ids = {10, 11, 12};
  f.present.insert({10, Tier::kDevice});
  PrefetchScheduler(roomy()).issue(t, f);
  EXPECT_EQ(f.final_hops(), (std::vector<TensorId>{0, 1, 2}));
}

TEST(PrefetchScheduler, SkipsWhatIsThereOrHeldAndKeepsCountingItsBytes) {
  AccessTrace t = recorded({0, 1, 2, 3});
  t.begin_step();
  FakeTarget f = tensors({0, 1, 2, 3});
  f.present.insert({0, Tier::kDevice});
  f.held_by_writer.insert(1);
  PrefetchLimits l = roomy();
  l.window_bytes = 300;  // 0, 1, 2 fit; 3 does not, although 0 and 1 were not started
  PrefetchScheduler(l).issue(t, f);
  EXPECT_EQ(f.final_hops(), (std::vector<TensorId>{2}));
}

TEST(PrefetchScheduler, SkipsWriteOnlyAcquiresAndKeepsCountingTheirBytes) {
  // 1 is overwritten whole when acquired (an optimizer step's updated params): nothing to read.
  AccessTrace t;
  t.begin_step();
  t.on_acquire(0, Tier::kHost);
  t.on_acquire(1, Tier::kHost, /*write_only=*/true);
  t.on_acquire(2, Tier::kHost);
  t.on_acquire(3, Tier::kHost);
  t.end_step();
  t.begin_step();
  FakeTarget f = tensors({0, 1, 2, 3});
  PrefetchLimits l = roomy();
  l.window_bytes = 300;  // 0, 1, 2 fit; 3 does not
  PrefetchScheduler(l).issue(t, f);
  EXPECT_EQ(f.final_hops(), (std::vector<TensorId>{0, 2}));
}

TEST(PrefetchScheduler, StopsAtTheInflightBudgetAndStagesBeyondIt) {
  AccessTrace t = recorded({0, 1, 2, 3, 4});
  t.begin_step();
  FakeTarget f = tensors({0, 1, 2, 3, 4});
  PrefetchLimits l = roomy();
  l.max_inflight_bytes = 200;  // two final hops
  l.max_staging_bytes = 200;   // two staging hops after them
  PrefetchScheduler(l).issue(t, f);
  EXPECT_EQ(f.final_hops(), (std::vector<TensorId>{0, 1}));
  EXPECT_EQ(f.staged(), (std::vector<TensorId>{2, 3}));
  for (const auto& s : f.started) {
    if (s.staging) {
      EXPECT_EQ(s.tier, Tier::kHost);
    }
  }
}

TEST(PrefetchScheduler, LookaheadBoundsTheWalk) {
  AccessTrace t = recorded({0, 1, 2, 3});
  t.begin_step();
  FakeTarget f = tensors({0, 1, 2, 3});
  PrefetchLimits l = roomy();
  l.lookahead = 2;
  PrefetchScheduler(l).issue(t, f);
  EXPECT_EQ(f.final_hops(), (std::vector<TensorId>{0, 1}));
}

TEST(PrefetchScheduler, NoRoomClosesTheFinalStageAndAWaitingEntryToo) {
  AccessTrace t = recorded({0, 1, 2});
  t.begin_step();
  FakeTarget f = tensors({0, 1, 2});
  f.no_room.insert({0, Tier::kDevice});
  PrefetchScheduler(roomy()).issue(t, f);
  EXPECT_TRUE(f.final_hops() == (std::vector<TensorId>{0})) << "after no room, later entries only stage";
  EXPECT_EQ(f.staged(), (std::vector<TensorId>{0, 1, 2}));

  f = tensors({0, 1, 2});
  f.waiting.insert({0, Tier::kDevice});
  PrefetchScheduler(roomy()).issue(t, f);
  EXPECT_EQ(f.final_hops(), (std::vector<TensorId>{0}));
  EXPECT_EQ(f.staged(), (std::vector<TensorId>{1, 2})) << "the waiting entry stages through its own request";
}

TEST(PrefetchScheduler, StagingStopsWhenTheHostHasNoRoom) {
  AccessTrace t = recorded({0, 1, 2});
  t.begin_step();
  FakeTarget f = tensors({0, 1, 2});
  PrefetchLimits l = roomy();
  l.max_inflight_bytes = 0;
  f.no_room.insert({1, Tier::kHost});
  PrefetchScheduler(l).issue(t, f);
  EXPECT_EQ(f.staged(), (std::vector<TensorId>{0, 1}));
}

TEST(PrefetchScheduler, HostAcquiresAreNotStaged) {
  AccessTrace t = recorded({0, 1}, Tier::kHost);
  t.begin_step();
  FakeTarget f = tensors({0, 1});
  PrefetchLimits l = roomy();
  l.max_inflight_bytes = 100;
  PrefetchScheduler(l).issue(t, f);
  EXPECT_EQ(f.final_hops(), (std::vector<TensorId>{0}));
  EXPECT_TRUE(f.staged().empty());
}

TEST(PrefetchScheduler, FollowsANewOrderAfterTheTraceChanges) {
  AccessTrace t = recorded({0, 1, 2});
  t.begin_step();
  ASSERT_FALSE(t.on_acquire(2, Tier::kDevice));  // the order changed: the trace is dropped
  FakeTarget f = tensors({0, 1, 2});
  PrefetchScheduler(roomy()).issue(t, f);
  EXPECT_TRUE(f.started.empty()) << "nothing to replay while the new order is unknown";
  t.end_step();
  t.begin_step();  // records the new order
  for (TensorId id : {2, 1, 0}) t.on_acquire(id, Tier::kDevice);
  t.end_step();
  t.begin_step();
  PrefetchScheduler(roomy()).issue(t, f);
  EXPECT_EQ(f.final_hops(), (std::vector<TensorId>{2, 1, 0}));
}

TEST(PrefetchScheduler, SkipsEntriesOfUnknownTensors) {
  AccessTrace t = recorded({0, 7, 1});
  t.begin_step();
  FakeTarget f = tensors({0, 1});
  PrefetchScheduler(roomy()).issue(t, f);
  EXPECT_EQ(f.final_hops(), (std::vector<TensorId>{0, 1}));
}

}  // namespace
}  // namespace tier::prefetch
