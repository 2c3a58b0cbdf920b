// Conformance of every IoEngine backend: the same transfers through uring, aio and posix, on
// O_DIRECT files on the disk and on buffered files in /dev/shm, compared byte for byte.
#include "tier/ext/io_engine.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <random>
#include <thread>

#include "nvme_test_util.hpp"
#include "tier/ext/host_arena.hpp"

namespace tier::nvme {
namespace {

using namespace std::chrono_literals;
using test::AlignedBuffer;
using test::Backend;

constexpr std::uint64_t kFileBytes = 16 << 20;

class EngineConformance : public testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    const std::string why = test::backend_unavailable(GetParam());
    if (!why.empty()) GTEST_SKIP() << why;
    dir_ = std::make_unique<test::ScratchDir>(GetParam().direct ? test::disk_base() : test::shm_base(), "engine");
    ASSERT_TRUE(dir_->ok());
    path_ = dir_->sub("data");
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    ASSERT_GE(fd_, 0) << std::strerror(errno);
    ASSERT_EQ(::fallocate(fd_, 0, 0, kFileBytes), 0) << std::strerror(errno);
    if (GetParam().direct) {
      ASSERT_EQ(::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) | O_DIRECT), 0);
    }
  }
  void TearDown() override {
    if (fd_ >= 0) ::close(fd_);
  }

  std::unique_ptr<IoEngine> make(unsigned qd = 8, unsigned posix_threads = 0, std::uint64_t piece = 0) {
    IoEngineOptions o;
    o.kind = GetParam().kind;
    o.queue_depth = qd;
    o.posix_threads = posix_threads;
    if (piece) o.fixed_buffer_piece = piece;
    auto e = make_io_engine(o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(e).value() : nullptr;
  }

  // Submits every request (more than the queue depth is fine) and reaps them all: tag -> result.
  static std::map<std::uint64_t, std::int64_t> run(IoEngine& e, std::vector<IoRequest> reqs) {
    std::map<std::uint64_t, std::int64_t> results;
    std::vector<IoCompletion> c(64);
    std::size_t next = 0;
    while (results.size() < reqs.size()) {
      if (next < reqs.size()) {
        auto taken = e.submit(reqs.data() + next, reqs.size() - next);
        EXPECT_TRUE(taken.ok()) << taken.status();
        if (!taken.ok()) break;
        next += *taken;
      }
      auto n = e.reap(c.data(), c.size(), 1, 10s);
      EXPECT_TRUE(n.ok()) << n.status();
      if (!n.ok()) break;
      if (*n == 0 && e.in_flight() == 0 && next == reqs.size()) break;
      for (std::size_t i = 0; i < *n; ++i) {
        EXPECT_EQ(results.count(c[i].tag), 0u) << "tag " << c[i].tag << " completed twice";
        results[c[i].tag] = c[i].result;
      }
    }
    EXPECT_EQ(e.in_flight(), 0u);
    return results;
  }

  static IoRequest req(IoOp op, int fd, std::uint64_t off, std::uint32_t len, void* buf, std::uint64_t tag) {
    IoRequest r;
    r.op = op;
    r.fd = fd;
    r.offset = off;
    r.length = len;
    r.buffer = buf;
    r.tag = tag;
    return r;
  }

  std::unique_ptr<test::ScratchDir> dir_;
  std::string path_;
  int fd_ = -1;
};

TEST_P(EngineConformance, ReportsItsKindAndCapabilities) {
  auto e = make();
  ASSERT_TRUE(e);
  EXPECT_EQ(e->kind(), GetParam().kind);
  EXPECT_STREQ(e->name(), io_engine_kind_name(GetParam().kind));
  EXPECT_EQ(e->queue_depth(), 8u);
  EXPECT_EQ(e->in_flight(), 0u);
  EXPECT_TRUE(e->has(kIoCapDirect));
  if (GetParam().kind == IoEngineKind::kPosix) {
    EXPECT_TRUE(e->has(kIoCapBuffered));
  }
  if (GetParam().kind != IoEngineKind::kPosix) {
    EXPECT_TRUE(e->has(kIoCapBatchSubmit));
  }
  EXPECT_FALSE(e->has(kIoCapFixedBuffers)) << "fixed buffers before any registration";
}

TEST_P(EngineConformance, WritesPatternsAndReadsThemBack) {
  auto e = make(8);
  ASSERT_TRUE(e);
  constexpr std::uint32_t kBlock = 256 << 10;
  constexpr int kBlocks = 48;  // six times the queue depth
  AlignedBuffer src(kBlock * kBlocks), dst(kBlock * kBlocks);
  test::fill_pattern(src.data, src.size, 1);
  std::vector<IoRequest> writes, reads;
  for (int i = 0; i < kBlocks; ++i) {
    // Blocks land in a scrambled order in the file.
    const std::uint64_t slot = (static_cast<std::uint64_t>(i) * 7) % kBlocks;
    writes.push_back(req(IoOp::kWrite, fd_, slot * kBlock, kBlock, src.data + i * kBlock, i));
    reads.push_back(req(IoOp::kRead, fd_, slot * kBlock, kBlock, dst.data + i * kBlock, 1000 + i));
  }
  for (const auto& [tag, res] : run(*e, writes)) EXPECT_EQ(res, kBlock) << "write tag " << tag;
  for (const auto& [tag, res] : run(*e, reads)) EXPECT_EQ(res, kBlock) << "read tag " << tag;
  EXPECT_EQ(std::memcmp(src.data, dst.data, src.size), 0);
  EXPECT_EQ(e->stats().requests, 2u * kBlocks);
}

TEST_P(EngineConformance, RandomOffsetsAndSizesRoundTrip) {
  auto e = make(16);
  ASSERT_TRUE(e);
  std::mt19937_64 rng(42);
  // Non-overlapping runs of random 4 KiB multiples at random places in the file.
  std::vector<std::pair<std::uint64_t, std::uint32_t>> runs;
  std::uint64_t pos = 0;
  while (true) {
    pos += 4096 * (rng() % 8);
    const std::uint32_t len = 4096u * static_cast<std::uint32_t>(1 + rng() % 64);
    if (pos + len > kFileBytes) break;
    runs.emplace_back(pos, len);
    pos += len;
  }
  std::shuffle(runs.begin(), runs.end(), rng);
  AlignedBuffer src(kFileBytes), dst(kFileBytes);
  test::fill_pattern(src.data, src.size, 2);
  std::vector<IoRequest> writes, reads;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    writes.push_back(req(IoOp::kWrite, fd_, runs[i].first, runs[i].second, src.data + runs[i].first, i));
    reads.push_back(req(IoOp::kRead, fd_, runs[i].first, runs[i].second, dst.data + runs[i].first, i));
  }
  for (const auto& [tag, res] : run(*e, writes)) EXPECT_EQ(res, runs[tag].second);
  for (const auto& [tag, res] : run(*e, reads)) EXPECT_EQ(res, runs[tag].second);
  for (const auto& r : runs) {
    ASSERT_EQ(std::memcmp(src.data + r.first, dst.data + r.first, r.second), 0) << "run at " << r.first;
  }
}

TEST_P(EngineConformance, RegisteredFileSlotsAddressTheFile) {
  auto e = make(4);
  ASSERT_TRUE(e);
  auto slot = e->register_file(fd_);
  ASSERT_TRUE(slot.ok()) << slot.status();
  if (GetParam().kind == IoEngineKind::kUring) {
    EXPECT_TRUE(e->has(kIoCapRegisteredFiles));
  }
  AlignedBuffer src(64 << 10), dst(64 << 10);
  test::fill_pattern(src.data, src.size, 3);
  IoRequest w = req(IoOp::kWrite, -1, 8192, 64 << 10, src.data, 1);
  w.file_index = *slot;
  IoRequest r = req(IoOp::kRead, -1, 8192, 64 << 10, dst.data, 2);
  r.file_index = *slot;
  EXPECT_EQ(run(*e, {w})[1], 64 << 10);
  EXPECT_EQ(run(*e, {r})[2], 64 << 10);
  EXPECT_EQ(std::memcmp(src.data, dst.data, src.size), 0);
  ASSERT_TRUE(e->unregister_file(*slot).ok());
  EXPECT_EQ(e->unregister_file(*slot).code(), StatusCode::kNotFound);
  // A request on a freed slot fails on its own.
  auto res = run(*e, {r});
  EXPECT_EQ(res[2], -EBADF);
}

TEST_P(EngineConformance, BadRequestsFailAloneWithErrno) {
  auto e = make(8);
  ASSERT_TRUE(e);
  AlignedBuffer buf(8192);
  std::vector<IoRequest> reqs = {
      req(IoOp::kWrite, fd_, 0, 4096, buf.data, 1),
      req(IoOp::kWrite, fd_, 0, 0, buf.data, 2),       // empty
      req(IoOp::kRead, 987654, 0, 4096, buf.data, 3),  // not a descriptor
      req(IoOp::kRead, fd_, 0, 4096, nullptr, 4),      // no buffer
      req(IoOp::kRead, fd_, 4096, 4096, buf.data + 4096, 5),
  };
  auto res = run(*e, reqs);
  EXPECT_EQ(res[1], 4096);
  EXPECT_EQ(res[2], -EINVAL);
  EXPECT_EQ(res[3], -EBADF);
  EXPECT_EQ(res[4], -EINVAL);
  EXPECT_EQ(res[5], 4096);
}

TEST_P(EngineConformance, SubmitStopsAtTheQueueDepth) {
  auto e = make(4, 1);
  ASSERT_TRUE(e);
  AlignedBuffer buf(10 * 4096);
  std::vector<IoRequest> reqs;
  for (int i = 0; i < 10; ++i) reqs.push_back(req(IoOp::kRead, fd_, i * 4096ull, 4096, buf.data + i * 4096, i));
  auto taken = e->submit(reqs.data(), reqs.size());
  ASSERT_TRUE(taken.ok());
  EXPECT_EQ(*taken, 4u);
  EXPECT_LE(e->in_flight(), 4u);
  std::vector<IoCompletion> c(10);
  std::size_t got = 0;
  while (got < 4) {
    auto n = e->reap(c.data() + got, c.size() - got, 4 - got, 10s);
    ASSERT_TRUE(n.ok());
    got += *n;
  }
  EXPECT_EQ(e->in_flight(), 0u);
}

TEST_P(EngineConformance, ReapTimesOutAndWakeReturnsEarly) {
  auto e = make(2);
  ASSERT_TRUE(e);
  IoCompletion c[2];
  auto t0 = std::chrono::steady_clock::now();
  auto n = e->reap(c, 2, 1, 30ms);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 0u);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 25ms);

  std::thread waker([&] {
    std::this_thread::sleep_for(50ms);
    e->wake();
  });
  t0 = std::chrono::steady_clock::now();
  n = e->reap(c, 2, 1, std::chrono::nanoseconds(-1));  // no limit: only wake() ends it
  waker.join();
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 0u);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
}

TEST_P(EngineConformance, CancelCompletesEveryRequestOnce) {
  auto e = make(32, 1);
  ASSERT_TRUE(e);
  constexpr std::uint32_t kBlock = 256 << 10;
  AlignedBuffer buf(32ull * kBlock);
  std::vector<IoRequest> reqs;
  for (int i = 0; i < 32; ++i)
    reqs.push_back(req(IoOp::kWrite, fd_, i * std::uint64_t{kBlock}, kBlock, buf.data + i * kBlock, i));
  auto taken = e->submit(reqs.data(), reqs.size());
  ASSERT_TRUE(taken.ok());
  ASSERT_EQ(*taken, 32u);
  ASSERT_TRUE(e->cancel(31).ok());
  std::map<std::uint64_t, std::int64_t> res;
  std::vector<IoCompletion> c(32);
  while (res.size() < 32) {
    auto n = e->reap(c.data(), c.size(), 1, 10s);
    ASSERT_TRUE(n.ok());
    ASSERT_GT(*n, 0u) << "requests lost after cancel";
    for (std::size_t i = 0; i < *n; ++i) {
      EXPECT_EQ(res.count(c[i].tag), 0u);
      res[c[i].tag] = c[i].result;
    }
  }
  for (const auto& [tag, r] : res) {
    EXPECT_TRUE(r == kBlock || r == -ECANCELED) << "tag " << tag << " result " << r;
  }
  EXPECT_EQ(e->cancel(12345).code(), StatusCode::kNotFound);
}

TEST_P(EngineConformance, FixedBuffersFromTheArena) {
  if (GetParam().kind != IoEngineKind::kUring) {
    auto e = make(2);
    ASSERT_TRUE(e);
    AlignedBuffer buf(4096);
    EXPECT_EQ(e->register_buffers(buf.data, buf.size).code(), StatusCode::kUnsupported);
    EXPECT_FALSE(e->has(kIoCapFixedBuffers));
    return;
  }
  auto arena = HostArena::create({8 << 20});
  ASSERT_TRUE(arena.ok()) << arena.status();
  // 1 MiB pieces so that a request can cross a piece boundary in a small test.
  auto e = make(8, 0, 1 << 20);
  ASSERT_TRUE(e);
  Status s = e->register_buffers((*arena)->base(), (*arena)->capacity());
  if (s.code() == StatusCode::kResourceExhausted || s.sys_errno() == EPERM || s.sys_errno() == ENOMEM) {
    GTEST_SKIP() << "cannot pin buffers here: " << s;
  }
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(e->has(kIoCapFixedBuffers));
  std::byte* base = (*arena)->base();
  test::fill_pattern(base, 4 << 20, 4);
  // Inside piece 0, inside piece 1, and across the 1 MiB boundary (sent without the fixed opcode).
  std::vector<IoRequest> writes = {req(IoOp::kWrite, fd_, 0, 512 << 10, base, 1),
                                   req(IoOp::kWrite, fd_, 1 << 20, 512 << 10, base + (1 << 20), 2),
                                   req(IoOp::kWrite, fd_, 2 << 20, 1 << 20, base + (1 << 20) + (512 << 10), 3)};
  for (const auto& [tag, r] : run(*e, writes)) EXPECT_EQ(r, static_cast<std::int64_t>(writes[tag - 1].length));
  EXPECT_EQ(e->stats().fixed_buffer_requests, 2u);
  std::byte* out = base + (4 << 20);
  std::vector<IoRequest> reads = {req(IoOp::kRead, fd_, 0, 512 << 10, out, 1),
                                  req(IoOp::kRead, fd_, 1 << 20, 512 << 10, out + (1 << 20), 2),
                                  req(IoOp::kRead, fd_, 2 << 20, 1 << 20, out + (1 << 20) + (512 << 10), 3)};
  for (const auto& [tag, r] : run(*e, reads)) EXPECT_EQ(r, static_cast<std::int64_t>(reads[tag - 1].length));
  EXPECT_EQ(std::memcmp(base, out, 512 << 10), 0);
  EXPECT_EQ(std::memcmp(base + (1 << 20), out + (1 << 20), (1 << 20) + (512 << 10)), 0);
  EXPECT_EQ(e->stats().fixed_buffer_requests, 4u);  // the crossing requests used the plain opcodes
  e->unregister_buffers();
  EXPECT_FALSE(e->has(kIoCapFixedBuffers));
}

// A reserved region starts empty: requests use plain opcodes until the piece holding them is
// registered, and the bytes are right either way (a lazy host arena registers its extents so).
TEST_P(EngineConformance, ReservedBuffersRegisterPieceByPiece) {
  if (GetParam().kind != IoEngineKind::kUring) {
    auto e = make(2);
    ASSERT_TRUE(e);
    AlignedBuffer buf(4096);
    EXPECT_EQ(e->reserve_buffers(buf.data, buf.size).code(), StatusCode::kUnsupported);
    EXPECT_EQ(e->register_buffer_range(buf.data, buf.size).code(), StatusCode::kUnsupported);
    EXPECT_EQ(e->registered_buffer_bytes(), 0u);
    return;
  }
  auto arena = HostArena::create({8 << 20});
  ASSERT_TRUE(arena.ok()) << arena.status();
  auto e = make(8, 0, 1 << 20);  // eight 1 MiB pieces
  ASSERT_TRUE(e);
  std::byte* base = (*arena)->base();
  EXPECT_EQ(e->register_buffer_range(base, 1 << 20).code(), StatusCode::kFailedPrecondition);
  Status s = e->reserve_buffers(base, (*arena)->capacity());
  if (s.sys_errno() == EINVAL || s.sys_errno() == EPERM || s.sys_errno() == ENOMEM) {
    GTEST_SKIP() << "no sparse buffer tables here: " << s;
  }
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(e->registered_buffer_bytes(), 0u);
  // Pieces 0 and 1 only; a range that holds no whole piece registers nothing.
  ASSERT_TRUE(e->register_buffer_range(base, 2 << 20).ok());
  ASSERT_TRUE(e->register_buffer_range(base + (3 << 20) + 4096, 1 << 20).ok());
  EXPECT_EQ(e->registered_buffer_bytes(), 2u << 20);
  EXPECT_EQ(e->register_buffer_range(base + (8 << 20), 4096).code(), StatusCode::kInvalidArgument);

  test::fill_pattern(base, 4 << 20, 9);
  // Piece 0 (registered), piece 2 (not yet), piece 3 (not yet).
  std::vector<IoRequest> writes = {req(IoOp::kWrite, fd_, 0, 512 << 10, base, 1),
                                   req(IoOp::kWrite, fd_, 1 << 20, 1 << 20, base + (2 << 20), 2),
                                   req(IoOp::kWrite, fd_, 2 << 20, 1 << 20, base + (3 << 20), 3)};
  for (const auto& [tag, r] : run(*e, writes)) EXPECT_EQ(r, static_cast<std::int64_t>(writes[tag - 1].length));
  EXPECT_EQ(e->stats().fixed_buffer_requests, 1u);
  // Register piece 3 now; read everything back into piece 1 (registered) and pieces 4-5 (not).
  ASSERT_TRUE(e->register_buffer_range(base + (3 << 20), 1 << 20).ok());
  EXPECT_EQ(e->registered_buffer_bytes(), 3u << 20);
  std::byte* out = base + (4 << 20);
  std::vector<IoRequest> reads = {req(IoOp::kRead, fd_, 0, 512 << 10, base + (1 << 20), 1),
                                  req(IoOp::kRead, fd_, 1 << 20, 1 << 20, out, 2),
                                  req(IoOp::kRead, fd_, 2 << 20, 1 << 20, out + (1 << 20), 3),
                                  req(IoOp::kWrite, fd_, 3 << 20, 512 << 10, base + (3 << 20), 4)};
  for (const auto& [tag, r] : run(*e, reads)) EXPECT_EQ(r, static_cast<std::int64_t>(reads[tag - 1].length));
  EXPECT_EQ(std::memcmp(base, base + (1 << 20), 512 << 10), 0);
  EXPECT_EQ(std::memcmp(base + (2 << 20), out, 2 << 20), 0);
  EXPECT_EQ(e->stats().fixed_buffer_requests, 3u) << "the read into piece 1 and the write from piece 3";
  e->unregister_buffers();
  EXPECT_EQ(e->registered_buffer_bytes(), 0u);
  EXPECT_FALSE(e->has(kIoCapFixedBuffers));
}

INSTANTIATE_TEST_SUITE_P(Backends, EngineConformance, testing::ValuesIn(test::all_backends()), test::backend_name);

// Only the posix pool holds requests back in user space; the kernel engines' cancel is covered by
// CancelCompletesEveryRequestOnce.
TEST(PosixEngine, CancelStopsAQueuedRequest) {
  test::ScratchDir dir(test::shm_base(), "cancel");
  ASSERT_TRUE(dir.ok());
  const int fd = ::open(dir.sub("f").c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 1 << 20), 0);
  IoEngineOptions o;
  o.kind = IoEngineKind::kPosix;
  o.queue_depth = 4096;
  o.posix_threads = 1;
  auto made = make_io_engine(o);
  ASSERT_TRUE(made.ok());
  auto& e = *made;
  // One pool thread and 4096 small requests: the last one is still queued when cancel() runs,
  // unless this thread stalls for the whole time the pool needs; a few tries rule that out.
  AlignedBuffer buf(4096);
  std::vector<IoRequest> reqs;
  for (int i = 0; i < 4096; ++i) {
    IoRequest r;
    r.op = IoOp::kRead;
    r.fd = fd;
    r.offset = (i % 256) * 4096ull;
    r.length = 4096;
    r.buffer = buf.data;
    r.tag = static_cast<std::uint64_t>(i);
    reqs.push_back(r);
  }
  bool cancelled = false;
  for (int attempt = 0; attempt < 5 && !cancelled; ++attempt) {
    auto taken = e->submit(reqs.data(), reqs.size());
    ASSERT_TRUE(taken.ok());
    ASSERT_EQ(*taken, reqs.size());
    ASSERT_TRUE(e->cancel(4095).ok());
    std::vector<IoCompletion> c(4096);
    std::size_t got = 0;
    while (got < reqs.size()) {
      auto n = e->reap(c.data() + got, c.size() - got, 1, 10s);
      ASSERT_TRUE(n.ok());
      ASSERT_GT(*n, 0u);
      got += *n;
    }
    for (const auto& x : c) {
      if (x.tag == 4095) cancelled = x.result == -ECANCELED;
      if (x.tag != 4095) {
        EXPECT_EQ(x.result, 4096);
      }
    }
  }
  EXPECT_TRUE(cancelled);
  e.reset();
  ::close(fd);
}

TEST(IoEngineFactory, AutoPicksAWorkingBackendAndSaysWhich) {
  IoEngineOptions o;
  o.kind = IoEngineKind::kAuto;
  o.queue_depth = 4;
  auto e = make_io_engine(o);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_NE((*e)->kind(), IoEngineKind::kAuto);
  if (probe_io_engine(IoEngineKind::kUring).ok()) {
    EXPECT_EQ((*e)->kind(), IoEngineKind::kUring);
  }
}

TEST(IoEngineFactory, QueueDepthOutOfRangeIsAnError) {
  IoEngineOptions o;
  o.queue_depth = 0;
  auto e = make_io_engine(o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("aio.queue_depth"), std::string::npos);
}

TEST(IoEngineFactory, PosixIsAlwaysAvailable) {
  EXPECT_TRUE(probe_io_engine(IoEngineKind::kPosix).ok());
  EXPECT_TRUE(probe_io_engine(IoEngineKind::kAuto).ok());
}

}  // namespace
}  // namespace tier::nvme
