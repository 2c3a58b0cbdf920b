// The decorator itself: which requests it hits and what it reports.
#include "tier/ext/fault_injecting_engine.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <map>

#include "nvme_test_util.hpp"

namespace tier::nvme {
namespace {

using namespace std::chrono_literals;

class FaultEngine : public testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    for (int i = 0; i < 2; ++i) {
      fds_[i] = ::open(dir_.sub("f" + std::to_string(i)).c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
      ASSERT_GE(fds_[i], 0);
      ASSERT_EQ(::ftruncate(fds_[i], 1 << 20), 0);
    }
    IoEngineOptions o;
    o.kind = IoEngineKind::kPosix;
    o.queue_depth = 8;
    auto inner = make_io_engine(o);
    ASSERT_TRUE(inner.ok());
    engine_ = std::make_unique<FaultInjectingEngine>(std::move(inner).value());
  }
  void TearDown() override {
    engine_.reset();
    for (int fd : fds_) {
      if (fd >= 0) ::close(fd);
    }
  }

  // Runs requests one at a time, in order: results by position.
  std::vector<std::int64_t> run_each(const std::vector<IoRequest>& reqs) {
    std::vector<std::int64_t> out;
    for (const IoRequest& r : reqs) {
      auto t = engine_->submit(&r, 1);
      EXPECT_TRUE(t.ok() && *t == 1);
      IoCompletion c;
      auto n = engine_->reap(&c, 1, 1, 10s);
      EXPECT_TRUE(n.ok() && *n == 1);
      EXPECT_EQ(c.tag, r.tag);
      out.push_back(c.result);
    }
    return out;
  }

  IoRequest rq(IoOp op, int fd, std::uint64_t tag, std::uint32_t len = 8192, std::uint64_t off = 0) {
    IoRequest r;
    r.op = op;
    r.fd = fd;
    r.offset = off;
    r.length = len;
    r.buffer = buf_.data;
    r.tag = tag;
    return r;
  }

  test::ScratchDir dir_{test::shm_base(), "fault"};
  int fds_[2] = {-1, -1};
  test::AlignedBuffer buf_{64 << 10};
  std::unique_ptr<FaultInjectingEngine> engine_;
};

TEST_F(FaultEngine, PassesEverythingThroughWithoutFaults) {
  EXPECT_EQ(engine_->kind(), IoEngineKind::kPosix);
  EXPECT_EQ(engine_->queue_depth(), 8u);
  auto r = run_each({rq(IoOp::kWrite, fds_[0], 1), rq(IoOp::kRead, fds_[0], 2)});
  EXPECT_EQ(r, (std::vector<std::int64_t>{8192, 8192}));
  EXPECT_EQ(engine_->counters().requests, 2u);
  EXPECT_EQ(engine_->counters().bytes_written, 8192u);
}

TEST_F(FaultEngine, FailsTheNthMatchingRequestOnly) {
  engine_->fail_nth(2, EIO, IoOp::kWrite);
  auto r = run_each({rq(IoOp::kWrite, fds_[0], 1), rq(IoOp::kRead, fds_[0], 2), rq(IoOp::kWrite, fds_[0], 3),
                     rq(IoOp::kWrite, fds_[0], 4)});
  EXPECT_EQ(r, (std::vector<std::int64_t>{8192, 8192, -EIO, 8192}));
  EXPECT_EQ(engine_->counters().errors, 1u);
  EXPECT_EQ(engine_->counters().bytes_written, 2u * 8192) << "the failed write reached no file";
}

TEST_F(FaultEngine, AnInjectedWriteErrorChangesNothingOnDisk) {
  std::memset(buf_.data, 'A', 8192);
  ASSERT_EQ(run_each({rq(IoOp::kWrite, fds_[0], 1)})[0], 8192);
  engine_->fail_nth(1, EIO);
  std::memset(buf_.data, 'B', 8192);
  ASSERT_EQ(run_each({rq(IoOp::kWrite, fds_[0], 2)})[0], -EIO);
  char c = 0;
  ASSERT_EQ(::pread(fds_[0], &c, 1, 100), 1);
  EXPECT_EQ(c, 'A');
}

TEST_F(FaultEngine, MatchesByFileDescriptorAndSlot) {
  auto slot = engine_->register_file(fds_[1]);
  ASSERT_TRUE(slot.ok());
  FaultSpec f;
  f.fd = fds_[1];
  f.count = 100;
  f.err = ENOSPC;
  engine_->add_fault(f);
  IoRequest via_slot = rq(IoOp::kWrite, -1, 3);
  via_slot.file_index = *slot;
  auto r = run_each({rq(IoOp::kWrite, fds_[0], 1), rq(IoOp::kWrite, fds_[1], 2), via_slot});
  EXPECT_EQ(r, (std::vector<std::int64_t>{8192, -ENOSPC, -ENOSPC}));
}

TEST_F(FaultEngine, ShortRequestsReallyMoveFewerBytes) {
  std::memset(buf_.data, 'x', 16384);
  ASSERT_EQ(run_each({rq(IoOp::kWrite, fds_[0], 1, 16384)})[0], 16384);
  engine_->short_nth(1, 0, IoOp::kWrite);  // half, rounded down to 4 KiB
  std::memset(buf_.data, 'y', 16384);
  EXPECT_EQ(run_each({rq(IoOp::kWrite, fds_[0], 2, 16384)})[0], 8192);
  char c[2] = {};
  ASSERT_EQ(::pread(fds_[0], &c[0], 1, 8191), 1);
  ASSERT_EQ(::pread(fds_[0], &c[1], 1, 8192), 1);
  EXPECT_EQ(c[0], 'y');
  EXPECT_EQ(c[1], 'x') << "the bytes after the short count were not written";
  engine_->short_nth(1, 1000);
  EXPECT_EQ(run_each({rq(IoOp::kRead, fds_[0], 3, 16384)})[0], 1000);
  EXPECT_EQ(engine_->counters().shorts, 2u);
}

TEST_F(FaultEngine, TransientErrorsRepeatTheAskedNumberOfTimes) {
  engine_->transient_nth(1, 2, EINTR);
  auto r = run_each({rq(IoOp::kRead, fds_[0], 1), rq(IoOp::kRead, fds_[0], 2), rq(IoOp::kRead, fds_[0], 3)});
  EXPECT_EQ(r, (std::vector<std::int64_t>{-EINTR, -EINTR, 8192}));
  EXPECT_EQ(engine_->counters().transients, 2u);
}

TEST_F(FaultEngine, ByteBudgetFailsWritesOnceUsedUp) {
  engine_->fail_writes_after_bytes(20000);
  auto r = run_each({rq(IoOp::kWrite, fds_[0], 1), rq(IoOp::kWrite, fds_[0], 2), rq(IoOp::kRead, fds_[0], 3),
                     rq(IoOp::kWrite, fds_[0], 4), rq(IoOp::kWrite, fds_[0], 5, 2048)});
  EXPECT_EQ(r, (std::vector<std::int64_t>{8192, 8192, 8192, -ENOSPC, 2048}));
}

TEST_F(FaultEngine, InjectedCompletionsCountAgainstTheQueueDepth) {
  engine_->add_fault({FaultKind::kError, 1, 100, std::nullopt, -1, EIO, 0});
  std::vector<IoRequest> reqs;
  for (int i = 0; i < 12; ++i) reqs.push_back(rq(IoOp::kRead, fds_[0], i));
  auto t = engine_->submit(reqs.data(), reqs.size());
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(*t, 8u);
  EXPECT_EQ(engine_->in_flight(), 8u);
  IoCompletion c[12];
  auto n = engine_->reap(c, 12, 8, 1s);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 8u);
  for (std::size_t i = 0; i < *n; ++i) {
    EXPECT_EQ(c[i].result, -EIO);
  }
  EXPECT_EQ(engine_->in_flight(), 0u);
}

}  // namespace
}  // namespace tier::nvme
