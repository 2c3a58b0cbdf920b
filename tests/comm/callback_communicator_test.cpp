// The callback communicator, driven through tier.h's C table (tier_comm_create_callbacks and the
// tier_comm_* collectives) and through tier::CommCallbacks, with a thread-backed test double as
// the host framework: every collective on 2 and 4 ranks, with every callback given or with
// all_reduce alone (tier builds the others from it), errors, and the destroy callback.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "comm/thread_group.hpp"
#include "tier/comm.hpp"
#include "tier/tier.h"

namespace tier {
namespace {

using test::ThreadGroup;
using test::ThreadRank;

// Runs fn(rank) on `world` threads and joins them.
template <class F>
void on_ranks(int world, F&& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&fn, r] { fn(r); });
  for (auto& t : threads) t.join();
}

// A value every rank can predict: rank r's element i.
float value(int r, std::uint64_t i) {
  return static_cast<float>(r + 1) * 0.5f + static_cast<float>(i) * 0.25f;
}

struct Shape {
  int world;
  bool full;  // every callback, or all_reduce alone
};

void PrintTo(const Shape& s, std::ostream* os) {
  *os << "world " << s.world << (s.full ? ", every callback" : ", all_reduce only");
}

class CallbackCollectives : public ::testing::TestWithParam<Shape> {};

TEST_P(CallbackCollectives, EveryCollectiveThroughTheCTable) {
  const auto [world, full] = GetParam();
  ThreadGroup group(world);
  std::vector<ThreadRank> ranks(static_cast<std::size_t>(world));
  constexpr std::uint64_t n = 37;
  on_ranks(world, [&](int r) {
    ThreadRank& me = ranks[static_cast<std::size_t>(r)];
    me.group = &group;
    me.rank = r;
    const tier_comm_callbacks_t table = me.table(full);
    tier_comm_t* comm = nullptr;
    ASSERT_EQ(tier_comm_create_callbacks(&table, &comm), TIER_OK) << tier_last_error();
    int32_t rank = -1, w = -1;
    ASSERT_EQ(tier_comm_rank_world(comm, &rank, &w), TIER_OK);
    EXPECT_EQ(rank, r);
    EXPECT_EQ(w, world);

    // all_reduce: sum and max, fp32 and fp64.
    std::vector<float> buf(n);
    for (std::uint64_t i = 0; i < n; ++i) buf[i] = value(r, i);
    ASSERT_EQ(tier_comm_all_reduce(comm, buf.data(), n, TIER_DTYPE_F32, TIER_REDUCE_SUM), TIER_OK) << tier_last_error();
    for (std::uint64_t i = 0; i < n; ++i) {
      float want = value(0, i);
      for (int q = 1; q < world; ++q) want += value(q, i);
      EXPECT_EQ(buf[i], want) << "rank " << r << " element " << i;
    }
    for (std::uint64_t i = 0; i < n; ++i) buf[i] = value(r, i);
    ASSERT_EQ(tier_comm_all_reduce(comm, buf.data(), n, TIER_DTYPE_F32, TIER_REDUCE_MAX), TIER_OK);
    for (std::uint64_t i = 0; i < n; ++i) EXPECT_EQ(buf[i], value(world - 1, i));
    double d = r + 0.5;
    ASSERT_EQ(tier_comm_all_reduce(comm, &d, 1, TIER_DTYPE_F64, TIER_REDUCE_SUM), TIER_OK);
    EXPECT_EQ(d, world * world / 2.0);

    // reduce_scatter: in world * n, out n (this rank's block, summed).
    std::vector<float> in(n * world), out(n, -1.0f);
    for (std::uint64_t i = 0; i < in.size(); ++i) in[i] = value(r, i);
    ASSERT_EQ(tier_comm_reduce_scatter(comm, in.data(), out.data(), n, TIER_DTYPE_F32, TIER_REDUCE_SUM), TIER_OK)
        << tier_last_error();
    for (std::uint64_t i = 0; i < n; ++i) {
      float want = value(0, r * n + i);
      for (int q = 1; q < world; ++q) want += value(q, r * n + i);
      EXPECT_EQ(out[i], want);
    }

    // all_gather: in n, out world * n; int32 too.
    std::vector<float> mine(n), all(n * world, -1.0f);
    for (std::uint64_t i = 0; i < n; ++i) mine[i] = value(r, i);
    ASSERT_EQ(tier_comm_all_gather(comm, mine.data(), all.data(), n, TIER_DTYPE_F32), TIER_OK) << tier_last_error();
    for (int q = 0; q < world; ++q) {
      for (std::uint64_t i = 0; i < n; ++i) EXPECT_EQ(all[q * n + i], value(q, i));
    }
    std::int32_t id = 100 + r;
    std::vector<std::int32_t> ids(world, -1);
    ASSERT_EQ(tier_comm_all_gather(comm, &id, ids.data(), 1, TIER_DTYPE_I32), TIER_OK);
    for (int q = 0; q < world; ++q) EXPECT_EQ(ids[q], 100 + q);

    // broadcast from the last rank.
    for (std::uint64_t i = 0; i < n; ++i) buf[i] = value(r, i);
    ASSERT_EQ(tier_comm_broadcast(comm, buf.data(), n, TIER_DTYPE_F32, world - 1), TIER_OK) << tier_last_error();
    for (std::uint64_t i = 0; i < n; ++i) EXPECT_EQ(buf[i], value(world - 1, i));

    ASSERT_EQ(tier_comm_barrier(comm), TIER_OK) << tier_last_error();
    // Zero elements: nothing happens, and no rendezvous either.
    ASSERT_EQ(tier_comm_all_reduce(comm, nullptr, 0, TIER_DTYPE_F32, TIER_REDUCE_SUM), TIER_OK);

    tier_comm_destroy(comm);
    EXPECT_EQ(me.destroyed, 1);
  });
}

TEST_P(CallbackCollectives, EveryCollectiveThroughCommCallbacks) {
  const auto [world, full] = GetParam();
  ThreadGroup group(world);
  std::vector<ThreadRank> ranks(static_cast<std::size_t>(world));
  constexpr std::uint64_t n = 11;
  on_ranks(world, [&](int r) {
    ThreadRank& me = ranks[static_cast<std::size_t>(r)];
    me.group = &group;
    me.rank = r;
    auto comm = make_callback_communicator(me.callbacks(full));
    ASSERT_TRUE(comm.ok()) << comm.status();
    Communicator& c = **comm;
    EXPECT_EQ(c.rank(), r);
    EXPECT_EQ(c.world(), world);
    std::vector<std::int64_t> in(n * world), out(n);
    for (std::uint64_t i = 0; i < in.size(); ++i) in[i] = r * 1000 + static_cast<std::int64_t>(i);
    ASSERT_TRUE(c.reduce_scatter(in.data(), out.data(), n, DType::kI64, ReduceOp::kMin).ok());
    for (std::uint64_t i = 0; i < n; ++i) EXPECT_EQ(out[i], static_cast<std::int64_t>(r * n + i));
    std::vector<std::int64_t> all(n * world);
    ASSERT_TRUE(c.all_gather(out.data(), all.data(), n, DType::kI64).ok());
    for (std::uint64_t i = 0; i < all.size(); ++i) EXPECT_EQ(all[i], static_cast<std::int64_t>(i));
    std::uint8_t b = static_cast<std::uint8_t>(7 + r);
    ASSERT_TRUE(c.broadcast(&b, 1, DType::kU8, 1).ok());
    EXPECT_EQ(b, 8);
    ASSERT_TRUE(c.barrier().ok());
    double s = 0.25 * (r + 1);
    ASSERT_TRUE(CommunicatorNorm(c).all_reduce_sumsq(s).ok());
    EXPECT_EQ(s, 0.25 * world * (world + 1) / 2);
  });
}

INSTANTIATE_TEST_SUITE_P(Shapes, CallbackCollectives,
                         ::testing::Values(Shape{2, true}, Shape{2, false}, Shape{4, true}, Shape{4, false}),
                         [](const auto& info) {
                           return "world" + std::to_string(info.param.world) +
                                  (info.param.full ? "_every_callback" : "_all_reduce_only");
                         });

// A framework error reaches the caller with its code and message; the peer's collective fails
// too (the group is broken) instead of waiting forever.
TEST(CallbackCommunicator, AFailingCallbackIsAnErrorOnThatRankAndItsPeer) {
  ThreadGroup group(2);
  std::vector<ThreadRank> ranks(2);
  std::vector<tier_status_t> codes(2, TIER_OK);
  std::vector<std::string> messages(2);
  on_ranks(2, [&](int r) {
    ThreadRank& me = ranks[static_cast<std::size_t>(r)];
    me.group = &group;
    me.rank = r;
    me.fail_collectives = r == 1;
    const tier_comm_callbacks_t table = me.table(true);
    tier_comm_t* comm = nullptr;
    ASSERT_EQ(tier_comm_create_callbacks(&table, &comm), TIER_OK) << tier_last_error();
    float x = 1.0f;
    codes[r] = tier_comm_all_reduce(comm, &x, 1, TIER_DTYPE_F32, TIER_REDUCE_SUM);
    messages[r] = tier_last_error();
    EXPECT_EQ(x, 1.0f);  // untouched
    tier_comm_destroy(comm);
  });
  EXPECT_EQ(codes[1], TIER_ERROR_IO);
  EXPECT_NE(messages[1].find("tier_comm_all_reduce"), std::string::npos) << messages[1];
  EXPECT_NE(messages[1].find("injected"), std::string::npos) << messages[1];
  EXPECT_NE(messages[1].find("rank 1 of 2"), std::string::npos) << messages[1];
  EXPECT_EQ(codes[0], TIER_ERROR_CANCELLED) << messages[0];
  EXPECT_NE(messages[0].find("peer rank 1 failed"), std::string::npos) << messages[0];
}

TEST(CallbackCommunicator, BadTablesAndArgumentsAreRefused) {
  ThreadGroup group(2);
  ThreadRank me;
  me.group = &group;
  me.rank = 0;
  tier_comm_t* comm = reinterpret_cast<tier_comm_t*>(&me);
  tier_comm_callbacks_t t = me.table(true);
  t.all_reduce = nullptr;
  EXPECT_EQ(tier_comm_create_callbacks(&t, &comm), TIER_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(comm, nullptr);
  EXPECT_NE(std::string(tier_last_error()).find("all_reduce"), std::string::npos) << tier_last_error();
  t = me.table(true);
  t.rank = 2;
  EXPECT_EQ(tier_comm_create_callbacks(&t, &comm), TIER_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(tier_last_error()).find("rank 2"), std::string::npos) << tier_last_error();
  t = me.table(true);
  t.world = 0;
  t.rank = 0;
  EXPECT_EQ(tier_comm_create_callbacks(&t, &comm), TIER_ERROR_INVALID_ARGUMENT);
  t = me.table(true);
  t.memory = 0;
  EXPECT_EQ(tier_comm_create_callbacks(&t, &comm), TIER_ERROR_INVALID_ARGUMENT);
  t = me.table(true);
  t.struct_size = 8;
  EXPECT_EQ(tier_comm_create_callbacks(&t, &comm), TIER_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(tier_last_error()).find("TIER_COMM_CALLBACKS_INIT"), std::string::npos);
  EXPECT_EQ(me.destroyed, 0);  // no communicator was made: `user` stays the caller's

  // A one-rank communicator: collectives are local, arguments are checked.
  ThreadGroup solo(1);
  ThreadRank one;
  one.group = &solo;
  one.rank = 0;
  const tier_comm_callbacks_t t1 = one.table(false);
  ASSERT_EQ(tier_comm_create_callbacks(&t1, &comm), TIER_OK) << tier_last_error();
  float x = 2.0f;
  EXPECT_EQ(tier_comm_all_reduce(comm, &x, 1, static_cast<tier_dtype_t>(42), TIER_REDUCE_SUM),
            TIER_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(tier_comm_all_reduce(comm, &x, 1, TIER_DTYPE_F32, static_cast<tier_reduce_op_t>(9)),
            TIER_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(tier_comm_all_reduce(comm, nullptr, 1, TIER_DTYPE_F32, TIER_REDUCE_SUM), TIER_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(tier_comm_broadcast(comm, &x, 1, TIER_DTYPE_F32, 1), TIER_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(tier_comm_all_reduce(comm, &x, 1, TIER_DTYPE_F32, TIER_REDUCE_SUM), TIER_OK);
  EXPECT_EQ(x, 2.0f);
  EXPECT_EQ(tier_comm_all_reduce(nullptr, &x, 1, TIER_DTYPE_F32, TIER_REDUCE_SUM), TIER_ERROR_INVALID_ARGUMENT);
  tier_comm_destroy(comm);
  EXPECT_EQ(one.destroyed, 1);
  tier_comm_destroy(nullptr);
}

// A framework that takes device memory only gets no host-memory fallbacks: a missing callback is
// then a clear kUnsupported rather than a wrong pointer handed on.
TEST(CallbackCommunicator, FallbacksNeedHostMemory) {
  CommCallbacks cb;
  cb.memory = kCommDeviceMemory;
  cb.all_reduce = [](void*, std::uint64_t, DType, ReduceOp) { return Status::Ok(); };
  auto comm = make_callback_communicator(cb);
  ASSERT_TRUE(comm.ok()) << comm.status();
  float in = 1, out = 0;
  const Status s = (*comm)->all_gather(&in, &out, 1, DType::kF32);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported) << s;
  EXPECT_NE(s.message().find("supply the callback"), std::string::npos) << s;
  EXPECT_TRUE((*comm)->all_reduce(&in, 1, DType::kF32, ReduceOp::kSum).ok());
}

}  // namespace
}  // namespace tier
