// Error paths of the swap space, driven by the fault-injecting engine under every backend: EIO,
// short transfers, EAGAIN/EINTR, ENOSPC. Whatever happens, nothing reported as written is lost and
// no failed read reports success.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "nvme_test_util.hpp"
#include "tier/ext/fault_injecting_engine.hpp"
#include "tier/ext/host_arena.hpp"
#include "tier/ext/swap_space.hpp"

namespace tier::nvme {
namespace {

using test::Backend;

class SwapFaults : public testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    const std::string why = test::backend_unavailable(GetParam());
    if (!why.empty()) GTEST_SKIP() << why;
    dir_ = std::make_unique<test::ScratchDir>(GetParam().direct ? test::disk_base() : test::shm_base(), "faults");
    ASSERT_TRUE(dir_->ok());
    auto a = HostArena::create({32 << 20});
    ASSERT_TRUE(a.ok()) << a.status();
    arena_ = std::move(a).value();
    SwapSpaceOptions o;
    o.paths = {dir_->sub("p0"), dir_->sub("p1")};
    o.bytes_per_path = 16 << 20;
    o.engine = GetParam().kind;
    o.use_direct = GetParam().direct;
    o.block_size = 64 << 10;
    o.queue_depth = 4;
    o.stripe_unit = 64 << 10;
    o.arena = arena_.get();
    o.wrap_engine = [this](std::unique_ptr<IoEngine> inner) -> std::unique_ptr<IoEngine> {
      auto f = std::make_unique<FaultInjectingEngine>(std::move(inner));
      faults_ = f.get();
      return f;
    };
    auto sp = SwapSpace::create(o);
    ASSERT_TRUE(sp.ok()) << sp.status();
    sp_ = std::move(sp).value();
    ASSERT_NE(faults_, nullptr);
  }

  HostBlock block(std::uint64_t n) {
    auto b = arena_->allocate(n);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? std::move(b).value() : HostBlock();
  }

  SwapExtent extent(std::uint64_t n) {
    auto e = sp_->allocate(n);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(e).value() : SwapExtent();
  }

  // Writes `seed`'s pattern into e through a fresh buffer; returns the status.
  Status put(const SwapExtent& e, std::uint64_t seed) {
    HostBlock b = block(e.bytes());
    test::fill_pattern(b.data(), e.bytes(), seed);
    return sp_->write(e, b.data(), e.bytes()).wait();
  }

  // Reads e and checks it holds `seed`'s pattern.
  ::testing::AssertionResult holds(const SwapExtent& e, std::uint64_t seed) {
    HostBlock b = block(e.bytes());
    Status s = sp_->read(e, b.data(), e.bytes()).wait();
    if (!s.ok()) return ::testing::AssertionFailure() << "read failed: " << s;
    const auto bad = test::check_pattern(b.data(), e.bytes(), seed);
    if (bad >= 0) return ::testing::AssertionFailure() << "byte " << bad << " differs";
    return ::testing::AssertionSuccess();
  }

  std::unique_ptr<test::ScratchDir> dir_;
  std::unique_ptr<HostArena> arena_;
  FaultInjectingEngine* faults_ = nullptr;  // owned by the swap space
  std::unique_ptr<SwapSpace> sp_;
};

TEST_P(SwapFaults, EioOnAReadFailsTheWholeReadWithThePlace) {
  SwapExtent e = extent(1 << 20);  // 16 requests of 64 KiB, striped over both paths
  ASSERT_TRUE(put(e, 1).ok());
  faults_->fail_nth(5, EIO, IoOp::kRead);
  HostBlock b = block(1 << 20);
  Status s = sp_->read(e, b.data(), 1 << 20).wait();
  ASSERT_FALSE(s.ok()) << "a read with a failed request must not report success";
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.sys_errno(), EIO);
  EXPECT_NE(s.message().find("tier-swap-"), std::string::npos) << s;
  EXPECT_NE(s.message().find("offset"), std::string::npos) << s;
  EXPECT_NE(s.message().find("extent #"), std::string::npos) << s;
  EXPECT_EQ(sp_->stats().failed, 1u);
  EXPECT_EQ(faults_->counters().errors, 1u);
  // The data on disk is fine; the next read succeeds.
  EXPECT_TRUE(holds(e, 1));
}

TEST_P(SwapFaults, FailedWritesLeaveOtherExtentsIntact) {
  SwapExtent a = extent(512 << 10), b = extent(200 << 10), c = extent(1 << 20);
  ASSERT_TRUE(put(a, 10).ok());
  ASSERT_TRUE(put(b, 11).ok());
  FaultSpec f;
  f.kind = FaultKind::kError;
  f.op = IoOp::kWrite;
  f.nth = 3;
  f.count = 1000;
  faults_->add_fault(f);
  Status s = put(c, 12);
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s;
  EXPECT_EQ(put(a, 13).code(), StatusCode::kIoError) << "the overwrite of a fails too";
  faults_->clear_faults();
  EXPECT_TRUE(holds(b, 11)) << "b was never touched";
  // a's overwrite failed from its first request on, so its old content is still whole.
  EXPECT_TRUE(holds(a, 10));
  ASSERT_TRUE(put(c, 14).ok());
  EXPECT_TRUE(holds(c, 14));
}

TEST_P(SwapFaults, ShortTransfersAreResubmittedForTheRest) {
  SwapExtent e = extent((1 << 20) + 4096);
  FaultSpec f;
  f.kind = FaultKind::kShort;
  f.count = 1000;  // every request comes back short at first
  faults_->add_fault(f);
  ASSERT_TRUE(put(e, 20).ok());
  EXPECT_TRUE(holds(e, 20));
  EXPECT_GT(sp_->stats().short_transfers, 10u);
  EXPECT_GT(faults_->counters().shorts, 10u);

  // A short count that is not sector-aligned: the rest resumes at an aligned position.
  faults_->clear_faults();
  f.short_bytes = 6000;
  faults_->add_fault(f);
  ASSERT_TRUE(put(e, 21).ok());
  EXPECT_TRUE(holds(e, 21));
}

TEST_P(SwapFaults, EagainAndEintrAreRetried) {
  SwapExtent e = extent(256 << 10);
  faults_->transient_nth(1, 3, EAGAIN, IoOp::kWrite);
  faults_->transient_nth(2, 2, EINTR, IoOp::kRead);
  ASSERT_TRUE(put(e, 30).ok());
  EXPECT_TRUE(holds(e, 30));
  EXPECT_EQ(sp_->stats().retries, 5u);
  EXPECT_EQ(sp_->stats().failed, 0u);
}

TEST_P(SwapFaults, EndlessEagainGivesUpWithAnError) {
  SwapExtent e = extent(64 << 10);
  faults_->transient_nth(1, 1000000, EAGAIN);
  Status s = put(e, 31);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.sys_errno(), EAGAIN) << s;
}

TEST_P(SwapFaults, FullDiskIsReportedAsNoSpace) {
  SwapExtent small = extent(256 << 10), big = extent(4 << 20);
  faults_->fail_writes_after_bytes(1 << 20, ENOSPC);
  ASSERT_TRUE(put(small, 40).ok());
  Status s = put(big, 41);
  EXPECT_EQ(s.code(), StatusCode::kNoSpace) << s;
  EXPECT_EQ(s.sys_errno(), ENOSPC);
  faults_->clear_faults();
  EXPECT_TRUE(holds(small, 40));
}

TEST_P(SwapFaults, RandomFaultsNeverLoseAcknowledgedWrites) {
  std::mt19937_64 rng(99);
  std::vector<SwapExtent> ext;
  for (int i = 0; i < 24; ++i) ext.push_back(extent(4096 * (1 + rng() % 96)));
  // Every seventh request fails, every fifth comes back short, every eleventh asks for a retry.
  FaultSpec f;
  f.count = 1;
  for (std::uint64_t n = 7; n < 4000; n += 7) {
    f.kind = FaultKind::kError;
    f.nth = n;
    faults_->add_fault(f);
  }
  for (std::uint64_t n = 5; n < 4000; n += 5) {
    f.kind = FaultKind::kShort;
    f.nth = n;
    faults_->add_fault(f);
  }
  for (std::uint64_t n = 11; n < 4000; n += 11) {
    f.kind = FaultKind::kTransient;
    f.err = EINTR;
    f.nth = n;
    faults_->add_fault(f);
  }
  std::map<std::size_t, std::uint64_t> acknowledged;  // extent -> seed last reported written
  int failures = 0;
  for (int round = 0; round < 3; ++round) {
    std::vector<HostBlock> bufs;
    std::vector<IoFuture> fs;
    for (std::size_t i = 0; i < ext.size(); ++i) {
      bufs.push_back(block(ext[i].bytes()));
      test::fill_pattern(bufs.back().data(), ext[i].bytes(), round * 100 + i);
      fs.push_back(sp_->write(ext[i], bufs.back().data(), ext[i].bytes()));
    }
    for (std::size_t i = 0; i < ext.size(); ++i) {
      if (fs[i].wait().ok()) {
        acknowledged[i] = round * 100 + i;
      } else {
        acknowledged.erase(i);  // a failed overwrite leaves the extent undefined
        ++failures;
      }
    }
  }
  EXPECT_GT(failures, 0) << "the faults did hit";
  EXPECT_GT(acknowledged.size(), 0u);
  // Reads under the same faults: a read either fails or returns exactly what was acknowledged.
  for (const auto& [i, seed] : acknowledged) {
    HostBlock b = block(ext[i].bytes());
    Status s = sp_->read(ext[i], b.data(), ext[i].bytes()).wait();
    if (s.ok()) {
      EXPECT_EQ(test::check_pattern(b.data(), ext[i].bytes(), seed), -1) << "extent " << i;
    }
  }
  faults_->clear_faults();
  for (const auto& [i, seed] : acknowledged) EXPECT_TRUE(holds(ext[i], seed)) << "extent " << i;
}

INSTANTIATE_TEST_SUITE_P(Backends, SwapFaults, testing::ValuesIn(test::all_backends()), test::backend_name);

}  // namespace
}  // namespace tier::nvme
