// Data-parallel optimizer steps: W ranks (threads), each with its own OffloadedOptimizer holding
// only its shards (tier::ShardMap) of every parameter, take the rank's slice of a known full
// gradient and combine the gradient norm through a callback communicator
// (StepOptions::norm = a CommunicatorNorm over comm). Their masters, put back together, must
// equal one optimizer's over the full parameters after clipped steps, every rank must skip a step
// whose gradient has an inf on one rank, and a failing collective fails the step with nothing
// changed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <random>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "comm/thread_group.hpp"
#include "optim/optim_test_util.hpp"
#include "tier/comm.hpp"
#include "tier/offloaded_optimizer.hpp"

namespace tier {
namespace {

using optim::OffloadedOptimizer;
using optim::OffloadedOptimizerOptions;
using optim::PartitionId;
using optim::PartitionSpec;
using optim::StateHome;
using optim::StateKind;
using optim::StepOptions;
using optim::StepReport;
using optim::test::Home;
using optim::test::Rig;
using test::ThreadGroup;
using test::ThreadRank;

// Parameter sizes: some smaller than the world (empty shards on the last ranks), some not a
// multiple of it, one spanning several chunks.
const std::vector<std::uint64_t> kSizes = {1, 3, 4097, 1000, 7, 20011, 2050};

std::vector<float> initial(std::size_t p) {
  std::mt19937_64 rng(1000 + p);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(kSizes[p]);
  for (auto& x : v) x = d(rng);
  return v;
}

std::vector<float> full_grad(std::size_t p, int step) {
  std::mt19937_64 rng(77 + p * 131 + static_cast<std::uint64_t>(step) * 7919);
  std::normal_distribution<float> d(0.0f, 2e-2f);
  std::vector<float> v(kSizes[p]);
  for (auto& x : v) x = d(rng);
  return v;
}

OffloadedOptimizerOptions options() {
  OffloadedOptimizerOptions o;
  cpu::AdamHyperParams hp;
  hp.lr = 1e-2;
  hp.weight_decay = 0.01;
  o.groups = {hp};
  o.max_grad_norm = 0.5;  // the gradients' norm is about 3: every step is clipped
  o.threads = 1;
  o.buffer_bytes = 4 << 20;
  o.chunk_elements = 8192;
  o.max_elements = 40000;
  return o;
}

template <class F>
void on_ranks(int world, F&& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&fn, r] { fn(r); });
  for (auto& t : threads) t.join();
}

// One rank: its optimizer over its shards, and which parameter each partition is.
struct Rank {
  std::unique_ptr<Rig> rig;
  std::vector<int> partition_of;  // parameter -> partition id, or -1 (empty shard)
  std::vector<ShardMap> maps;     // per parameter
  std::unique_ptr<Communicator> comm;
  ThreadRank self;
};

struct Params {
  int world;
  Home home;
};

void PrintTo(const Params& p, std::ostream* os) {
  *os << "world " << p.world << ", " << p.home.name;
}

class ShardedOptimizer : public ::testing::TestWithParam<Params> {
 protected:
  void SetUp() override {
    const std::string why = optim::test::home_unavailable(GetParam().home);
    if (!why.empty()) GTEST_SKIP() << why;
    world_ = GetParam().world;
    // The reference: one optimizer over the full parameters.
    full_ = std::make_unique<Rig>(GetParam().home, options());
    ASSERT_TRUE(full_->status().ok()) << full_->status();
    for (std::size_t p = 0; p < kSizes.size(); ++p) {
      const auto init = initial(p);
      ASSERT_TRUE(full_->opt().add_partition({kSizes[p], 0, optim::ParamOutput::kNone, init.data(), ""}).ok());
    }
    ASSERT_TRUE(full_->opt().finish_registration().ok());
    // The ranks: each registers its shard of every parameter that has one.
    ranks_.resize(static_cast<std::size_t>(world_));
    group_ = std::make_unique<ThreadGroup>(world_);
    for (int r = 0; r < world_; ++r) {
      Rank& k = ranks_[static_cast<std::size_t>(r)];
      k.rig = std::make_unique<Rig>(GetParam().home, options());
      ASSERT_TRUE(k.rig->status().ok()) << k.rig->status();
      int next = 0;
      for (std::size_t p = 0; p < kSizes.size(); ++p) {
        k.maps.push_back(ShardMap::create(kSizes[p], world_).value());
        const std::uint64_t count = k.maps[p].count(r);
        if (count == 0) {
          k.partition_of.push_back(-1);
          continue;
        }
        const auto init = initial(p);
        PartitionSpec spec{count, 0, optim::ParamOutput::kNone, init.data() + k.maps[p].offset(r), ""};
        auto id = k.rig->opt().add_partition(spec);
        ASSERT_TRUE(id.ok()) << id.status();
        ASSERT_EQ(*id, static_cast<PartitionId>(next));
        k.partition_of.push_back(next++);
      }
      ASSERT_TRUE(k.rig->opt().finish_registration().ok());
      connect(r);
    }
  }

  // (Re)connects rank r to the current group through a callback communicator (all_reduce only).
  void connect(int r) {
    Rank& k = ranks_[static_cast<std::size_t>(r)];
    k.comm.reset();
    k.self.group = group_.get();
    k.self.rank = r;
    auto c = make_callback_communicator(k.self.callbacks(false));
    ASSERT_TRUE(c.ok()) << c.status();
    k.comm = std::move(c).value();
  }

  // Gives every rank its slice of the step's full gradients (and the reference all of them);
  // `poison`: an inf at one element of parameter 5, which rank `poison_rank` owns.
  void feed(int step, int poison_rank = -1) {
    for (std::size_t p = 0; p < kSizes.size(); ++p) {
      auto g = full_grad(p, step);
      if (poison_rank >= 0 && p == 5) {
        const ShardMap map = ShardMap::create(kSizes[p], world_).value();
        g[map.offset(poison_rank) + 1] = std::numeric_limits<float>::infinity();
      }
      ASSERT_TRUE(full_->opt().add_grad(static_cast<PartitionId>(p), {g.data(), DType::kF32, g.size()}).ok());
      for (int r = 0; r < world_; ++r) {
        Rank& k = ranks_[static_cast<std::size_t>(r)];
        if (k.partition_of[p] < 0) continue;
        const ShardMap& m = k.maps[p];
        ASSERT_TRUE(k.rig->opt()
                        .add_grad(static_cast<PartitionId>(k.partition_of[p]),
                                  {g.data() + m.offset(r), DType::kF32, m.count(r)})
                        .ok());
      }
    }
  }

  // One step on every rank (threads) and on the reference.
  void step_all(std::vector<Result<StepReport>>& reports, Result<StepReport>* reference) {
    reports.clear();
    for (int r = 0; r < world_; ++r) reports.emplace_back(internal_error("not run"));
    on_ranks(world_, [&](int r) {
      Rank& k = ranks_[static_cast<std::size_t>(r)];
      CommunicatorNorm norm(*k.comm);
      StepOptions so;
      so.norm = &norm;
      reports[static_cast<std::size_t>(r)] = k.rig->opt().step(so);
    });
    if (reference) *reference = full_->opt().step();
  }

  // The ranks' masters of parameter p, put back together.
  std::vector<float> gathered(std::size_t p, StateKind kind = StateKind::kMaster) {
    std::vector<float> out(kSizes[p]);
    for (int r = 0; r < world_; ++r) {
      Rank& k = ranks_[static_cast<std::size_t>(r)];
      if (k.partition_of[p] < 0) continue;
      const Status s = k.rig->opt().read_state(static_cast<PartitionId>(k.partition_of[p]), kind,
                                               out.data() + k.maps[p].offset(r), 0, k.maps[p].count(r));
      EXPECT_TRUE(s.ok()) << s;
    }
    return out;
  }

  std::vector<float> reference(std::size_t p, StateKind kind = StateKind::kMaster) {
    std::vector<float> out(kSizes[p]);
    EXPECT_TRUE(full_->opt().read_state(static_cast<PartitionId>(p), kind, out.data(), 0, kSizes[p]).ok());
    return out;
  }

  // Largest relative difference of the ranks' state from the reference; counts bit-equal elements.
  double max_relative_difference(StateKind kind, std::uint64_t* equal, std::uint64_t* total) {
    double worst = 0;
    *equal = *total = 0;
    for (std::size_t p = 0; p < kSizes.size(); ++p) {
      const auto got = gathered(p, kind);
      const auto want = reference(p, kind);
      for (std::size_t i = 0; i < got.size(); ++i) {
        ++*total;
        if (std::memcmp(&got[i], &want[i], sizeof(float)) == 0) {
          ++*equal;
          continue;
        }
        const double d = std::fabs(double(got[i]) - double(want[i])) / std::max(1e-30, std::fabs(double(want[i])));
        worst = std::max(worst, d);
      }
    }
    return worst;
  }

  int world_ = 1;
  std::unique_ptr<Rig> full_;
  std::unique_ptr<ThreadGroup> group_;
  std::vector<Rank> ranks_;
};

TEST_P(ShardedOptimizer, ClippedStepsMatchOneOptimizerOverTheFullParameters) {
  std::vector<Result<StepReport>> reports;
  Result<StepReport> ref = internal_error("not run");
  for (int step = 1; step <= 3; ++step) {
    feed(step);
    step_all(reports, &ref);
    ASSERT_TRUE(ref.ok()) << ref.status();
    ASSERT_TRUE(ref->applied);
    ASSERT_LT(ref->clip_coefficient, 1.0) << "the test means to clip";
    for (int r = 0; r < world_; ++r) {
      const auto& rep = reports[static_cast<std::size_t>(r)];
      ASSERT_TRUE(rep.ok()) << "rank " << r << ": " << rep.status();
      EXPECT_TRUE(rep->applied);
      // The global norm, not the rank's own: equal to the reference's up to the summation order.
      EXPECT_NEAR(rep->grad_norm, ref->grad_norm, 1e-12 * ref->grad_norm) << "rank " << r;
      EXPECT_EQ(rep->clip_coefficient, ref->clip_coefficient) << "rank " << r;
    }
  }
  for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
    std::uint64_t equal = 0, total = 0;
    const double worst = max_relative_difference(kind, &equal, &total);
    std::printf("world %d %s: %llu of %llu elements bit-equal to one optimizer; worst relative difference %.3g\n",
                world_, optim::state_kind_name(kind), static_cast<unsigned long long>(equal),
                static_cast<unsigned long long>(total), worst);
    EXPECT_LE(worst, 1e-6) << optim::state_kind_name(kind);
  }
  EXPECT_EQ(group_->collectives(), 3u);  // one all-reduce of the norm per step
}

TEST_P(ShardedOptimizer, AnInfOnOneRankMakesEveryRankSkip) {
  std::vector<Result<StepReport>> reports;
  Result<StepReport> ref = internal_error("not run");
  feed(1);
  step_all(reports, &ref);
  std::vector<std::vector<float>> before;
  for (std::size_t p = 0; p < kSizes.size(); ++p) before.push_back(gathered(p));

  feed(2, /*poison_rank=*/world_ - 1);
  step_all(reports, &ref);
  ASSERT_TRUE(ref.ok());
  EXPECT_FALSE(ref->applied);
  for (int r = 0; r < world_; ++r) {
    const auto& rep = reports[static_cast<std::size_t>(r)];
    ASSERT_TRUE(rep.ok()) << "rank " << r << ": " << rep.status();
    EXPECT_FALSE(rep->applied) << "rank " << r << " stepped past another rank's inf";
    EXPECT_TRUE(rep->overflow) << "rank " << r;
    EXPECT_EQ(ranks_[static_cast<std::size_t>(r)].rig->opt().stats().steps_skipped, 1u);
  }
  for (std::size_t p = 0; p < kSizes.size(); ++p) EXPECT_EQ(gathered(p), before[p]) << "parameter " << p;

  // And they go on in step with the reference.
  feed(3);
  step_all(reports, &ref);
  for (const auto& rep : reports) ASSERT_TRUE(rep.ok() && rep->applied);
  std::uint64_t equal = 0, total = 0;
  EXPECT_LE(max_relative_difference(StateKind::kMaster, &equal, &total), 1e-6);
}

// A collective that fails on one rank fails the step there with the framework's error, and on its
// peers with theirs; nothing changes and the gradients are kept, so the step can be taken again
// over a working group.
TEST_P(ShardedOptimizer, AFailingCollectiveFailsTheStepAndChangesNothing) {
  std::vector<Result<StepReport>> reports;
  Result<StepReport> ref = internal_error("not run");
  feed(1);
  step_all(reports, &ref);
  for (const auto& rep : reports) ASSERT_TRUE(rep.ok());
  std::vector<std::vector<float>> before;
  for (std::size_t p = 0; p < kSizes.size(); ++p) before.push_back(gathered(p));

  feed(2);
  ranks_[0].self.fail_collectives = true;
  step_all(reports, nullptr);
  const auto& failed = reports[0];
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError) << failed.status();
  EXPECT_NE(failed.status().message().find("injected"), std::string::npos) << failed.status();
  EXPECT_NE(failed.status().message().find("across ranks"), std::string::npos) << failed.status();
  for (int r = 1; r < world_; ++r) {
    const auto& rep = reports[static_cast<std::size_t>(r)];
    ASSERT_FALSE(rep.ok()) << "rank " << r;
    EXPECT_EQ(rep.status().code(), StatusCode::kCancelled) << rep.status();
    EXPECT_NE(rep.status().message().find("peer rank 0 failed"), std::string::npos) << rep.status();
  }
  for (int r = 0; r < world_; ++r) {
    OffloadedOptimizer& o = ranks_[static_cast<std::size_t>(r)].rig->opt();
    EXPECT_EQ(o.group_step(0).value(), 1) << "rank " << r;
  }
  for (std::size_t p = 0; p < kSizes.size(); ++p) EXPECT_EQ(gathered(p), before[p]) << "parameter " << p;

  // A new group; the kept gradients make the same step as the reference's.
  ranks_[0].self.fail_collectives = false;
  group_ = std::make_unique<ThreadGroup>(world_);
  for (int r = 0; r < world_; ++r) connect(r);
  step_all(reports, &ref);
  for (const auto& rep : reports) ASSERT_TRUE(rep.ok()) << rep.status();
  std::uint64_t equal = 0, total = 0;
  EXPECT_LE(max_relative_difference(StateKind::kMaster, &equal, &total), 1e-6);
}

const Home kHostHome{"host", StateHome::kHost, IoEngineKind::kAuto, false};
const Home kNvmeShm{"nvme_posix_shm", StateHome::kNvme, IoEngineKind::kPosix, false};

INSTANTIATE_TEST_SUITE_P(Worlds, ShardedOptimizer,
                         ::testing::Values(Params{2, kHostHome}, Params{4, kHostHome}, Params{2, kNvmeShm},
                                           Params{4, kNvmeShm}),
                         [](const auto& info) {
                           return "world" + std::to_string(info.param.world) + "_" + info.param.home.name;
                         });

}  // namespace
}  // namespace tier
