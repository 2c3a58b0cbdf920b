// The swap space through every backend: round trips of many sizes, striping, concurrency,
// allocation, file safety, alignment, callbacks, cancellation, counters and the O_DIRECT fallback.
#include "tier/ext/swap_space.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <future>
#include <mutex>
#include <random>
#include <thread>

#include "nvme/swap_file.hpp"
#include "nvme_test_util.hpp"
#include "tier/ext/fault_injecting_file_system.hpp"
#include "tier/ext/host_arena.hpp"
#include "tier/log.hpp"
#include "tier/stats.hpp"

namespace tier::nvme {
namespace {

using namespace std::chrono_literals;
using test::Backend;

// Holds an I/O thread inside a completion callback until released, to freeze a moment.
class Latch {
 public:
  // Writes `bytes` to `e` and parks the I/O thread that completes it in the callback, then runs
  // `inside` there once open() is called. A write that finishes before its callback is attached
  // runs the callback here instead; such tries are repeated.
  void hold(SwapSpace& sp, const SwapExtent& e, const void* buf, std::uint64_t bytes,
            std::function<void()> inside = {}) {
    const auto me = std::this_thread::get_id();
    for (int attempt = 0; attempt < 1000; ++attempt) {
      IoFuture f = sp.write(e, buf, bytes);
      bool held = true;
      f.on_complete([this, me, &held, inside](const Status&) {
        if (std::this_thread::get_id() == me) {
          held = false;  // already complete: runs inline on the test thread
          return;
        }
        wait();
        if (inside) inside();
      });
      if (held) {
        wait_entered();
        return;
      }
    }
    ADD_FAILURE() << "could not park an I/O thread";
  }
  void open() {
    std::lock_guard<std::mutex> lk(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  void wait() {
    std::unique_lock<std::mutex> lk(mu_);
    entered_ = true;
    cv_.notify_all();
    cv_.wait(lk, [&] { return open_; });
  }
  void wait_entered() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return entered_; });
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false;
  bool open_ = false;
};

class SwapConformance : public testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    const std::string why = test::backend_unavailable(GetParam());
    if (!why.empty()) GTEST_SKIP() << why;
    dir_ = std::make_unique<test::ScratchDir>(GetParam().direct ? test::disk_base() : test::shm_base(), "swap");
    ASSERT_TRUE(dir_->ok());
    auto a = HostArena::create({64 << 20});
    ASSERT_TRUE(a.ok()) << a.status();
    arena_ = std::move(a).value();
  }

  SwapSpaceOptions options(int paths = 1, std::uint64_t bytes = 32 << 20) {
    SwapSpaceOptions o;
    for (int i = 0; i < paths; ++i) o.paths.push_back(dir_->sub("ssd" + std::to_string(i)));
    o.bytes_per_path = bytes;
    o.engine = GetParam().kind;
    o.use_direct = GetParam().direct;
    o.block_size = 256 << 10;
    o.queue_depth = 8;
    o.arena = arena_.get();
    return o;
  }

  std::unique_ptr<SwapSpace> make(const SwapSpaceOptions& o) {
    auto s = SwapSpace::create(o);
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return nullptr;
    EXPECT_EQ((*s)->engine_kind(), GetParam().kind);
    return std::move(s).value();
  }

  HostBlock block(std::uint64_t bytes) {
    auto b = arena_->allocate(bytes);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? std::move(b).value() : HostBlock();
  }

  std::unique_ptr<test::ScratchDir> dir_;
  std::unique_ptr<HostArena> arena_;
};

TEST_P(SwapConformance, RoundTripsTensorsOfManySizes) {
  auto sp = make(options());
  ASSERT_TRUE(sp);
  const std::vector<std::uint64_t> sizes = {4096, 65536, (1 << 20) + 4096, 3 << 20, 256 << 10, 12288};
  std::vector<SwapExtent> ext;
  std::vector<HostBlock> src, dst;
  std::vector<IoFuture> writes;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    auto e = sp->allocate(sizes[i]);
    ASSERT_TRUE(e.ok()) << e.status();
    ext.push_back(std::move(e).value());
    src.push_back(block(sizes[i]));
    dst.push_back(block(sizes[i]));
    test::fill_pattern(src[i].data(), sizes[i], 100 + i);
    writes.push_back(sp->write(ext[i], src[i].data(), sizes[i]));
  }
  ASSERT_TRUE(wait_all(writes.data(), writes.size()).ok());
  std::vector<IoFuture> reads;
  for (std::size_t i = 0; i < sizes.size(); ++i) reads.push_back(sp->read(ext[i], dst[i].data(), sizes[i]));
  ASSERT_TRUE(wait_all(reads.data(), reads.size()).ok());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(test::check_pattern(dst[i].data(), sizes[i], 100 + i), -1) << "tensor " << i;
  }
  auto st = sp->stats();
  EXPECT_EQ(st.writes, sizes.size());
  EXPECT_EQ(st.reads, sizes.size());
  EXPECT_EQ(st.failed, 0u);
  std::uint64_t total = 0;
  for (auto s : sizes) total += s;
  EXPECT_EQ(st.bytes_written, total);
  EXPECT_EQ(st.bytes_read, total);
  // 3 MiB in 256 KiB blocks is 12 requests: large transfers are split.
  EXPECT_GE(st.requests, 2 * (1 + 1 + 5 + 12 + 1 + 1u));
  if (GetParam().kind == IoEngineKind::kUring) {
    EXPECT_TRUE(st.fixed_buffers);
    EXPECT_EQ(st.fixed_buffer_requests, st.requests) << "arena buffers go through fixed-buffer opcodes";
  }
  EXPECT_LT(st.submit_calls, st.requests) << "requests are submitted in batches";
}

// A lazy arena (the engine's auto host budget): io_uring gets each extent as a fixed buffer once a
// block reaches into it, not the whole cap at start; transfers through blocks in one extent and
// across two give the right bytes.
TEST_P(SwapConformance, LazyArenaExtentsAreRegisteredAsBlocksReachThem) {
  HostArenaOptions ao;
  ao.bytes = 32 << 20;
  ao.lazy = true;
  ao.extent_bytes = 2 << 20;
  auto lazy = HostArena::create(ao);
  ASSERT_TRUE(lazy.ok()) << lazy.status();
  auto o = options();
  o.arena = lazy->get();
  auto sp = make(o);
  ASSERT_TRUE(sp);
  const bool uring = GetParam().kind == IoEngineKind::kUring;
  EXPECT_EQ(sp->stats().fixed_buffer_bytes, 0u);
  EXPECT_EQ((*lazy)->committed_bytes(), 0u);

  const std::uint64_t small = 1 << 20, large = 3 << 20;  // the large block spans two extents
  auto a = (*lazy)->allocate(small);
  auto b = (*lazy)->allocate(large);
  auto c = (*lazy)->allocate(large);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_LE((*lazy)->committed_bytes(), 8u << 20) << "only the extents the blocks reach";
  auto ea = sp->allocate(small);
  auto eb = sp->allocate(large);
  ASSERT_TRUE(ea.ok() && eb.ok());
  test::fill_pattern(a->data(), small, 31);
  test::fill_pattern(b->data(), large, 32);
  IoFuture w[] = {sp->write(*ea, a->data(), small), sp->write(*eb, b->data(), large)};
  ASSERT_TRUE(wait_all(w, 2).ok());
  // Read each back into the other's memory, so both land in other extents than they left.
  IoFuture r[] = {sp->read(*ea, c->data() + large - small, small), sp->read(*eb, c->data(), large - small)};
  ASSERT_TRUE(wait_all(r, 2).ok());
  EXPECT_EQ(test::check_pattern(c->data() + large - small, small, 31), -1);
  EXPECT_EQ(test::check_pattern(c->data(), large - small, 32), -1);
  auto st = sp->stats();
  EXPECT_EQ(st.failed, 0u);
  if (uring) {
    EXPECT_TRUE(st.fixed_buffers);
    EXPECT_EQ(st.fixed_buffer_bytes, (*lazy)->committed_bytes()) << "every committed extent, nothing more";
    EXPECT_GT(st.fixed_buffer_requests, 0u);
  } else {
    EXPECT_EQ(st.fixed_buffer_bytes, 0u);
  }
  // A later extent is registered before the first transfer through it.
  auto d = (*lazy)->allocate(small, std::chrono::milliseconds(0), 16 << 20);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(sp->read(*ea, d->data(), small).wait().ok());
  EXPECT_EQ(test::check_pattern(d->data(), small, 31), -1);
  if (uring) {
    EXPECT_EQ(sp->stats().fixed_buffer_bytes, (*lazy)->committed_bytes());
  }
}

TEST_P(SwapConformance, StripesLargeExtentsOverThePaths) {
  auto o = options(3, 8 << 20);
  o.stripe_unit = 64 << 10;
  auto sp = make(o);
  ASSERT_TRUE(sp);
  const std::uint64_t n = (1 << 20) + (12 << 10);  // 16 full stripes and a partial one
  auto e = sp->allocate(n);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->stripes(), 3u);
  auto small = sp->allocate(64 << 10);  // below the threshold of two stripe units: one path
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->stripes(), 1u);

  HostBlock src = block(n), dst = block(n);
  test::fill_pattern(src.data(), n, 7);
  ASSERT_TRUE(sp->write(*e, src.data(), n).wait().ok());
  ASSERT_TRUE(sp->flush().ok());
  auto st = sp->stats();
  ASSERT_EQ(st.paths.size(), 3u);
  EXPECT_EQ(st.striped_extents, 1u);
  // Stripe s lives on path s % 3 at (s / 3) * unit: check the files themselves.
  const std::uint64_t unit = 64 << 10;
  std::vector<int> fds;
  for (const auto& p : st.paths) {
    EXPECT_GT(p.used_bytes, 0u) << p.dir;
    fds.push_back(::open(p.file.c_str(), O_RDONLY));
    ASSERT_GE(fds.back(), 0);
  }
  test::AlignedBuffer raw(unit);
  for (std::uint64_t s = 0; s * unit < n; ++s) {
    const std::uint64_t len = std::min(unit, n - s * unit);
    ASSERT_EQ(::pread(fds[s % 3], raw.data, len, static_cast<off_t>((s / 3) * unit)), static_cast<ssize_t>(len));
    EXPECT_EQ(test::check_pattern(raw.data, len, 7, s * unit), -1) << "stripe " << s;
  }
  for (int fd : fds) ::close(fd);

  ASSERT_TRUE(sp->read(*e, dst.data(), n).wait().ok());
  EXPECT_EQ(test::check_pattern(dst.data(), n, 7), -1);
  // A read of a middle slice starts in the middle of the stripe pattern.
  ASSERT_TRUE(sp->read(*e, dst.data(), 200 << 10, 128 << 10).wait().ok());
  EXPECT_EQ(test::check_pattern(dst.data(), 200 << 10, 7, 128 << 10), -1);
}

TEST_P(SwapConformance, ConcurrentTransfersFromManyThreads) {
  auto o = options(2, 32 << 20);
  o.intra_op_parallelism = 2;
  auto sp = make(o);
  ASSERT_TRUE(sp);
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      for (int round = 0; round < 6; ++round) {
        const std::uint64_t n = 4096 * (1 + rng() % 300);
        auto e = sp->allocate(n);
        auto src = arena_->allocate(n);
        auto dst = arena_->allocate(n);
        if (!e.ok() || !src.ok() || !dst.ok()) {
          ++bad;
          return;
        }
        const std::uint64_t seed = t * 1000 + round;
        test::fill_pattern(src->data(), n, seed);
        if (!sp->write(*e, src->data(), n).wait().ok()) ++bad;
        if (!sp->read(*e, dst->data(), n).wait().ok()) ++bad;
        if (test::check_pattern(dst->data(), n, seed) != -1) ++bad;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(sp->stats().live_extents, 0u);
  EXPECT_EQ(sp->stats().used_bytes, 0u);
}

TEST_P(SwapConformance, RandomSizesAndOffsetsWithinAnExtent) {
  auto sp = make(options());
  ASSERT_TRUE(sp);
  const std::uint64_t n = 8 << 20;
  auto e = sp->allocate(n);
  ASSERT_TRUE(e.ok());
  HostBlock image = block(n), out = block(n);
  test::fill_pattern(image.data(), n, 9);
  ASSERT_TRUE(sp->write(*e, image.data(), n).wait().ok());
  std::mt19937_64 rng(3);
  std::vector<IoFuture> fs;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> pieces;
  for (int i = 0; i < 40; ++i) {
    const std::uint64_t off = 4096 * (rng() % (n / 4096 - 1));
    const std::uint64_t len = std::min<std::uint64_t>(n - off, 4096 * (1 + rng() % 200));
    test::fill_pattern(image.data() + off, len, 1000 + i);
    fs.push_back(sp->write(*e, image.data() + off, len, off));
    ASSERT_TRUE(fs.back().wait().ok());  // overlapping writes must not race each other
  }
  ASSERT_TRUE(sp->read(*e, out.data(), n).wait().ok());
  EXPECT_EQ(std::memcmp(image.data(), out.data(), n), 0);
}

TEST_P(SwapConformance, FreedExtentsAreReusedAndFragmentationIsReported) {
  auto sp = make(options(1, 8 << 20));
  ASSERT_TRUE(sp);
  std::vector<SwapExtent> ext;
  for (int i = 0; i < 8; ++i) {
    auto e = sp->allocate(1 << 20);
    ASSERT_TRUE(e.ok()) << e.status();
    ext.push_back(std::move(e).value());
  }
  auto full = sp->allocate(4096);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("no room"), std::string::npos);
  ext[2].reset();
  ext[5].reset();
  auto st = sp->stats();
  EXPECT_EQ(st.used_bytes, 6u << 20);
  EXPECT_EQ(st.paths[0].free_extents, 2u);
  EXPECT_DOUBLE_EQ(st.fragmentation, 0.5);
  EXPECT_FALSE(sp->allocate(2 << 20).ok()) << "2 MiB free, but not in one run";
  auto again = sp->allocate(1 << 20);
  ASSERT_TRUE(again.ok()) << "freed space is reused";
  ext.clear();
  again->reset();
  st = sp->stats();
  EXPECT_EQ(st.used_bytes, 0u);
  EXPECT_EQ(st.fragmentation, 0.0);
  EXPECT_EQ(st.peak_used_bytes, 8u << 20);
  EXPECT_TRUE(sp->allocate(8 << 20).ok());
}

TEST_P(SwapConformance, SwapFilesArePrivatePreallocatedAndRemoved) {
  std::string file;
  {
    auto o = options(1, 4 << 20);
    o.preallocate = true;
    auto sp = make(o);
    ASSERT_TRUE(sp);
    file = sp->stats().paths[0].file;
    struct stat st {};
    ASSERT_EQ(::lstat(file.c_str(), &st), 0);
    EXPECT_TRUE(S_ISREG(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_EQ(st.st_uid, ::getuid());
    EXPECT_EQ(static_cast<std::uint64_t>(st.st_size), 4u << 20);
    EXPECT_GE(static_cast<std::uint64_t>(st.st_blocks) * 512, 4u << 20) << "fallocate reserved the blocks";
    EXPECT_EQ(sp->stats().paths[0].direct_io, GetParam().direct);
  }
  EXPECT_FALSE(std::filesystem::exists(file)) << "the swap file is removed at close";
}

TEST_P(SwapConformance, NeverOpensSomeoneElsesFileOrASymlink) {
  const std::string d = dir_->sub("ssd0");
  ASSERT_TRUE(std::filesystem::create_directories(d));
  const std::string victim = dir_->sub("victim");
  {
    FILE* f = std::fopen(victim.c_str(), "w");
    ASSERT_TRUE(f);
    std::fputs("precious", f);
    std::fclose(f);
  }
  // Every name the swap space could pick in this process, taken by symlinks to the victim.
  for (int seq = 0; seq < 1000; ++seq) {
    const std::string name = d + "/" + detail::swap_file_prefix() + std::to_string(seq) + ".bin";
    ASSERT_EQ(::symlink(victim.c_str(), name.c_str()), 0);
  }
  auto sp = SwapSpace::create(options(1, 1 << 20));
  if (sp.ok()) {
    struct stat st {};
    ASSERT_EQ(::lstat((*sp)->stats().paths[0].file.c_str(), &st), 0);
    EXPECT_TRUE(S_ISREG(st.st_mode)) << "a fresh regular file, not a symlink";
  } else {
    EXPECT_EQ(sp.status().code(), StatusCode::kAlreadyExists) << sp.status();
  }
  sp = Status(StatusCode::kCancelled, "closed");
  EXPECT_EQ(std::filesystem::file_size(victim), 8u);
  for (int seq = 0; seq < 1000; ++seq) {
    const std::string name = d + "/" + detail::swap_file_prefix() + std::to_string(seq) + ".bin";
    EXPECT_TRUE(std::filesystem::is_symlink(std::filesystem::symlink_status(name))) << name;
  }
}

TEST_P(SwapConformance, PreallocationFailsEarlyWhenThePathIsTooSmall) {
  struct statvfs vfs {};
  ASSERT_EQ(::statvfs(dir_->path().c_str(), &vfs), 0);
  const std::uint64_t avail = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  auto o = options(1, avail + (std::uint64_t{1} << 40));
  o.preallocate = true;
  auto sp = SwapSpace::create(o);
  ASSERT_FALSE(sp.ok());
  EXPECT_EQ(sp.status().code(), StatusCode::kNoSpace);
  EXPECT_EQ(sp.status().sys_errno(), ENOSPC);
  EXPECT_NE(sp.status().message().find(o.paths[0]), std::string::npos) << sp.status();
  EXPECT_NE(sp.status().message().find(std::to_string(o.bytes_per_path)), std::string::npos) << sp.status();
  // Nothing is left behind.
  std::size_t files = 0;
  for (auto& entry : std::filesystem::directory_iterator(o.paths[0])) files += entry.is_regular_file();
  EXPECT_EQ(files, 0u);
}

// Without preallocation a swap file holds on disk what its extents need (in 32 MiB steps), not
// its capacity: a small model costs megabytes, whatever the budget.
TEST_P(SwapConformance, SwapFilesGrowWithTheirExtents) {
  auto o = options(1, std::uint64_t{1} << 30);
  auto sp = make(o);
  ASSERT_TRUE(sp);
  const std::string file = sp->stats().paths[0].file;
  auto on_disk = [&] {
    struct stat st {};
    EXPECT_EQ(::stat(file.c_str(), &st), 0);
    return static_cast<std::uint64_t>(st.st_blocks) * 512;
  };
  EXPECT_EQ(sp->stats().capacity_bytes, std::uint64_t{1} << 30);
  EXPECT_EQ(sp->stats().allocated_bytes, 0u);
  EXPECT_LT(on_disk(), 1u << 20) << "a fresh swap file reserves nothing";

  auto a = sp->allocate(5 << 20);
  ASSERT_TRUE(a.ok()) << a.status();
  const std::uint64_t after_one = sp->stats().allocated_bytes;
  EXPECT_GE(after_one, 5u << 20);
  EXPECT_LE(after_one, 32u << 20);
  auto b = sp->allocate(40 << 20);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_GE(sp->stats().allocated_bytes, 45u << 20);
  EXPECT_LE(sp->stats().allocated_bytes, 64u << 20);
  EXPECT_EQ(sp->stats().paths[0].allocated_bytes, sp->stats().allocated_bytes);
  EXPECT_GE(on_disk(), 45u << 20) << "fallocate reserved the blocks the extents need";

  // The grown part carries data like the rest.
  const std::uint64_t n = 16 << 20, tail = (40 << 20) - n;  // the extent's last 16 MiB
  HostBlock src = block(n), dst = block(n);
  test::fill_pattern(src.data(), n, 5);
  ASSERT_TRUE(sp->write(*b, src.data(), n, tail).wait().ok());
  ASSERT_TRUE(sp->read(*b, dst.data(), n, tail).wait().ok());
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), n), 0);

  // Freed space is reused below the high-water mark: the file does not grow again.
  const std::uint64_t high = sp->stats().allocated_bytes;
  a->reset();
  auto c = sp->allocate(4 << 20);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(sp->stats().allocated_bytes, high);
}

TEST_P(SwapConformance, AnAutoCapIsThePathsFreeSpace) {
  auto o = options(1, 0);
  auto sp = make(o);
  ASSERT_TRUE(sp);
  struct statvfs vfs {};
  ASSERT_EQ(::statvfs(o.paths[0].c_str(), &vfs), 0);
  if (vfs.f_blocks == 0) GTEST_SKIP() << o.paths[0] << " has no space accounting";
  const std::uint64_t avail = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  const std::uint64_t cap = sp->stats().capacity_bytes;
  EXPECT_GT(cap, 0u);
  // Other processes write to the same disk meanwhile: within 1 GiB of what is free now.
  EXPECT_LE(cap, avail + (std::uint64_t{1} << 30));
  EXPECT_GE(cap + (std::uint64_t{1} << 30), avail);
  EXPECT_EQ(sp->stats().allocated_bytes, 0u);
  o.preallocate = true;
  EXPECT_EQ(SwapSpace::create(o).status().code(), StatusCode::kInvalidArgument) << "a whole free disk is not reserved";
}

// A disk that fills while a file grows: that allocation fails with kNoSpace naming the path and
// the bytes, nothing is reserved, and once there is room again the same allocation succeeds.
TEST_P(SwapConformance, AFullDiskRefusesTheAllocationThatWouldGrowTheFile) {
  auto faults = std::make_shared<FaultInjectingFileSystem>();
  auto previous = FileSystem::install(faults);
  struct Restore {
    std::shared_ptr<FileSystem> fs;
    ~Restore() { FileSystem::install(fs); }
  } restore{previous};
  auto o = options(1, 256 << 20);
  auto sp = make(o);
  ASSERT_TRUE(sp);
  auto first = sp->allocate(1 << 20);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::uint64_t grown = sp->stats().allocated_bytes;
  faults->add_fault({.op = FileOp::kAllocate, .nth = 1, .count = 1000, .err = ENOSPC});
  auto big = sp->allocate(100 << 20);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kNoSpace) << big.status();
  EXPECT_EQ(big.status().sys_errno(), ENOSPC);
  const std::string& m = big.status().message();
  EXPECT_NE(m.find(o.paths[0]), std::string::npos) << m;
  EXPECT_NE(m.find("cannot grow"), std::string::npos) << m;
  EXPECT_NE(m.find("free"), std::string::npos) << m;
  EXPECT_EQ(sp->stats().used_bytes, first->reserved_bytes()) << "the failed allocation holds nothing";
  EXPECT_EQ(sp->stats().allocated_bytes, grown);
  // What fits in the file as it is needs no growth and still works.
  auto small = sp->allocate(4096);
  EXPECT_TRUE(small.ok()) << small.status();
  faults->clear_faults();
  big = sp->allocate(100 << 20);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_GE(sp->stats().allocated_bytes, 101u << 20);
}

TEST_P(SwapConformance, UnalignedTransfersFailClearlyOrGoThroughBounceBuffers) {
  auto sp = make(options());
  ASSERT_TRUE(sp);
  const std::uint64_t n = 300000;  // not a multiple of 512
  auto e = sp->allocate(n);
  ASSERT_TRUE(e.ok());
  HostBlock src = block(n + 4096), dst = block(n + 4096);
  std::byte* odd_src = src.data() + 8;  // misaligned for O_DIRECT
  test::fill_pattern(odd_src, n, 11);
  if (GetParam().direct) {
    EXPECT_EQ(sp->buffer_alignment() % 512, 0u);
    Status s = sp->write(*e, odd_src, n).wait();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("bounce_unaligned"), std::string::npos) << s;
    s = sp->write(*e, src.data(), n).wait();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "the size is ragged";
    auto o = options();
    o.paths = {dir_->sub("bounce")};
    o.bounce_unaligned = true;
    e = Status(StatusCode::kCancelled, "released before its swap space");
    sp = make(o);
    ASSERT_TRUE(sp);
    e = sp->allocate(n);
    ASSERT_TRUE(e.ok());
  } else {
    EXPECT_EQ(sp->buffer_alignment(), 1u);
  }
  // A guard after the destination shows that a padded tail never spills over.
  std::memset(dst.data(), 0xAB, n + 4096);
  ASSERT_TRUE(sp->write(*e, odd_src, n).wait().ok());
  ASSERT_TRUE(sp->read(*e, dst.data() + 8, n).wait().ok());
  EXPECT_EQ(test::check_pattern(dst.data() + 8, n, 11), -1);
  for (std::uint64_t i = n + 8; i < n + 4096; ++i) ASSERT_EQ(static_cast<unsigned>(dst.data()[i]), 0xABu) << i;
  if (GetParam().direct) {
    EXPECT_GT(sp->stats().bounced_requests, 0u);
  }
}

TEST_P(SwapConformance, CallbacksRunOnceAndCanChainTransfers) {
  auto sp = make(options());
  ASSERT_TRUE(sp);
  const std::uint64_t n = 1 << 20;
  auto e = sp->allocate(n);
  ASSERT_TRUE(e.ok());
  HostBlock src = block(n), dst = block(n);
  test::fill_pattern(src.data(), n, 12);
  std::atomic<int> calls{0};
  std::promise<Status> chained;
  IoFuture w = sp->write(*e, src.data(), n);
  w.on_complete([&](const Status& s) {
    ++calls;
    if (!s.ok()) {
      chained.set_value(s);
      return;
    }
    // Called on the I/O thread: chain the read from here.
    IoFuture r = sp->read(*e, dst.data(), n);
    r.on_complete([&](const Status& rs) { chained.set_value(rs); });
  });
  auto fut = chained.get_future();
  ASSERT_EQ(fut.wait_for(30s), std::future_status::ready);
  EXPECT_TRUE(fut.get().ok());
  EXPECT_EQ(test::check_pattern(dst.data(), n, 12), -1);
  EXPECT_TRUE(w.ready());
  EXPECT_EQ(calls.load(), 1);
  // Added after completion: runs at once, on this thread.
  bool now = false;
  w.on_complete([&](const Status& s) { now = s.ok(); });
  EXPECT_TRUE(now);
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(w.bytes(), n);
}

TEST_P(SwapConformance, BadArgumentsGiveFailedFutures) {
  auto sp = make(options());
  ASSERT_TRUE(sp);
  auto e = sp->allocate(64 << 10);
  ASSERT_TRUE(e.ok());
  HostBlock b = block(128 << 10);
  EXPECT_EQ(sp->read(*e, b.data(), 4096, 100).wait().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(sp->read(*e, b.data(), 128 << 10).wait().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(sp->read(*e, b.data(), 4096, 64 << 10).wait().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(sp->write(*e, nullptr, 4096).wait().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(sp->write(SwapExtent(), b.data(), 4096).wait().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(sp->write(*e, b.data(), 0).wait().ok()) << "an empty transfer is done at once";
  EXPECT_EQ(sp->allocate(0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(IoFuture().valid());
  EXPECT_EQ(IoFuture().wait().code(), StatusCode::kFailedPrecondition);
}

TEST_P(SwapConformance, FreeingDuringATransferDefersReuse) {
  auto sp = make(options(1, 4 << 20));
  ASSERT_TRUE(sp);
  auto a = sp->allocate(4096);
  auto b = sp->allocate(2 << 20);
  ASSERT_TRUE(a.ok() && b.ok());
  HostBlock buf = block(2 << 20);
  Latch latch;
  // The I/O thread stops in a's callback, so b's write cannot finish yet.
  latch.hold(*sp, *a, buf.data(), 4096);
  IoFuture fb = sp->write(*b, buf.data(), 2 << 20);
  b->reset();
  EXPECT_FALSE(fb.ready());
  EXPECT_FALSE(sp->allocate(3 << 20).ok()) << "b's space is still in use by its write";
  latch.open();
  ASSERT_TRUE(fb.wait().ok());
  auto c = sp->allocate(3 << 20);
  EXPECT_TRUE(c.ok()) << "b's space came back once its write finished: " << c.status();
}

TEST_P(SwapConformance, CancelDropsRequestsNotYetSent) {
  auto o = options(1, 16 << 20);
  o.block_size = 64 << 10;
  o.queue_depth = 2;
  auto sp = make(o);
  ASSERT_TRUE(sp);
  auto a = sp->allocate(4096);
  auto big = sp->allocate(8 << 20);
  ASSERT_TRUE(a.ok() && big.ok());
  HostBlock buf = block(8 << 20);
  Latch latch;
  latch.hold(*sp, *a, buf.data(), 4096);
  // The latch may take several writes to park a thread (each finished before its callback was
  // attached is one more request): count from here.
  const std::uint64_t before = sp->stats().requests;
  IoFuture fb = sp->write(*big, buf.data(), 8 << 20);
  fb.cancel();
  latch.open();
  Status s = fb.wait();
  EXPECT_EQ(s.code(), StatusCode::kCancelled) << s;
  EXPECT_EQ(sp->stats().failed, 1u);
  EXPECT_LT(sp->stats().requests - before, 1u + (8 << 20) / (64 << 10))
      << "the cancelled write's requests were dropped";
}

TEST_P(SwapConformance, ClosingCancelsQueuedTransfers) {
  auto sp = make(options(1, 16 << 20));
  ASSERT_TRUE(sp);
  SwapSpace* raw = sp.get();
  auto a = sp->allocate(4096);
  auto big = sp->allocate(8 << 20);
  ASSERT_TRUE(a.ok() && big.ok());
  HostBlock buf = block(8 << 20);
  Latch latch;
  IoFuture late;
  latch.hold(*sp, *a, buf.data(), 4096, [&] {
    late = raw->write(*a, buf.data(), 4096);  // issued while the swap space closes
    a->reset();
  });
  IoFuture fb = sp->write(*big, buf.data(), 8 << 20);
  big->reset();
  std::atomic<bool> closing{false};
  std::thread closer([&] {
    closing = true;
    sp.reset();  // waits for the I/O thread held in the latch's callback
  });
  while (!closing) std::this_thread::yield();
  std::this_thread::sleep_for(100ms);
  latch.open();
  closer.join();
  EXPECT_EQ(fb.wait().code(), StatusCode::kCancelled);
  EXPECT_EQ(late.wait().code(), StatusCode::kCancelled);
}

TEST_P(SwapConformance, CountersSeeLinksAndTheEngine) {
  Counters counters;
  auto o = options();
  o.counters = &counters;
  auto sp = make(o);
  ASSERT_TRUE(sp);
  auto e = sp->allocate(1 << 20);
  ASSERT_TRUE(e.ok());
  HostBlock b = block(1 << 20);
  ASSERT_TRUE(sp->write(*e, b.data(), 1 << 20).wait().ok());
  ASSERT_TRUE(sp->read(*e, b.data(), 1 << 20).wait().ok());
  ASSERT_TRUE(sp->flush().ok());
  auto snap = counters.snapshot();
  EXPECT_EQ(snap.link(Link::kHostToNvme).bytes, 1u << 20);
  EXPECT_EQ(snap.link(Link::kHostToNvme).ops, 1u);
  EXPECT_EQ(snap.link(Link::kNvmeToHost).bytes, 1u << 20);
  EXPECT_EQ(snap.link(Link::kNvmeToHost).ops, 1u);
  EXPECT_GT(snap.link(Link::kNvmeToHost).busy_seconds, 0.0);
  EXPECT_EQ(snap.info["io_engine"], io_engine_kind_name(GetParam().kind));
  EXPECT_EQ(snap.info["nvme.direct_io"], GetParam().direct ? "true" : "false");
  EXPECT_EQ(snap.metrics["nvme.swap.used_bytes"], static_cast<double>(1 << 20));
}

INSTANTIATE_TEST_SUITE_P(Backends, SwapConformance, testing::ValuesIn(test::all_backends()), test::backend_name);

// ---------------------------------------------------------------------------------------------

TEST(SwapSpaceOptions, FromConfigTakesTheDeepSpeedAndTierKeys) {
  auto cfg = EngineConfig::from_json(R"({
    "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}},
    "aio": {"block_size": 262144, "queue_depth": 16, "intra_op_parallelism": 2, "single_submit": true},
    "tier": {"swap_paths": ["/nvme0", "/nvme1"], "io_engine": "aio",
             "io": {"use_direct": false, "sqpoll": true, "fixed_buffers": false, "bounce_unaligned": true}}
  })",
                                     {false, true});
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  auto o = SwapSpaceOptions::from_config(*cfg, 1 << 30);
  EXPECT_EQ(o.paths, (std::vector<std::string>{"/nvme0", "/nvme1"}));
  EXPECT_EQ(o.bytes_per_path, 1u << 30);
  EXPECT_EQ(o.block_size, 262144u);
  EXPECT_EQ(o.queue_depth, 16u);
  EXPECT_EQ(o.intra_op_parallelism, 2u);
  EXPECT_TRUE(o.single_submit);
  EXPECT_EQ(o.engine, IoEngineKind::kAio);
  EXPECT_FALSE(o.use_direct);
  EXPECT_TRUE(o.sqpoll);
  EXPECT_FALSE(o.fixed_buffers);
  EXPECT_TRUE(o.bounce_unaligned);
}

TEST(SwapSpaceOptions, BadOptionsAreRejectedWithTheKeyToFix) {
  SwapSpaceOptions o;
  EXPECT_EQ(SwapSpace::create(o).status().code(), StatusCode::kInvalidArgument);
  o.paths = {"/dev/shm/unused"};
  o.bytes_per_path = 1 << 20;
  o.block_size = 1000;
  auto s = SwapSpace::create(o);
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("aio.block_size"), std::string::npos);
  o.block_size = 1 << 20;
  o.queue_depth = 0;
  EXPECT_NE(SwapSpace::create(o).status().message().find("aio.queue_depth"), std::string::npos);
}

// SQPOLL and single_submit are uring/DeepSpeed options; each must still move the bytes.
TEST(SwapSpaceOptions, SqpollAndSingleSubmitMoveTheSameBytes) {
  if (Status s = probe_io_engine(IoEngineKind::kUring); !s.ok()) GTEST_SKIP() << s;
  test::ScratchDir dir(test::disk_base(), "sqpoll");
  ASSERT_TRUE(dir.ok());
  const bool direct = test::direct_refused(dir.path()).empty();
  for (int variant = 0; variant < 2; ++variant) {
    SwapSpaceOptions o;
    o.paths = {dir.sub(variant ? "single" : "sqpoll")};
    o.bytes_per_path = 8 << 20;
    o.engine = IoEngineKind::kUring;
    o.use_direct = direct;
    o.block_size = 128 << 10;
    o.sqpoll = variant == 0;
    o.single_submit = variant == 1;
    auto sp = SwapSpace::create(o);
    if (!sp.ok() && variant == 0 && sp.status().sys_errno() == EPERM) {
      std::printf("SQPOLL refused here (%s); checking single_submit only\n", sp.status().to_string().c_str());
      continue;
    }
    ASSERT_TRUE(sp.ok()) << sp.status();
    if (variant == 0) {
      EXPECT_TRUE((*sp)->stats().engine_capabilities & kIoCapSqPoll);
    }
    auto e = (*sp)->allocate(2 << 20);
    ASSERT_TRUE(e.ok());
    test::AlignedBuffer src(2 << 20), dst(2 << 20);
    test::fill_pattern(src.data, src.size, 60 + variant);
    ASSERT_TRUE((*sp)->write(*e, src.data, src.size).wait().ok());
    ASSERT_TRUE((*sp)->read(*e, dst.data, dst.size).wait().ok());
    EXPECT_EQ(std::memcmp(src.data, dst.data, src.size), 0);
    auto st = (*sp)->stats();
    if (variant == 1) {
      EXPECT_EQ(st.submit_calls, st.requests) << "single_submit: one system call per request";
    }
  }
}

// A directory whose file system refuses O_DIRECT: /dev/shm when tmpfs refuses it, otherwise a
// ramfs mounted in a private mount namespace (root only). Empty when neither is possible.
std::string no_direct_dir(std::string& why_not, std::string& mounted) {
  if (test::direct_refused(test::shm_base()).empty()) {
    why_not = "tmpfs accepts O_DIRECT on this kernel; ";
  } else {
    return test::shm_base();
  }
  if (::unshare(CLONE_NEWNS) != 0) {
    why_not += std::string("cannot make a private mount namespace for ramfs: ") + std::strerror(errno);
    return {};
  }
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    why_not += std::string("cannot make mounts private: ") + std::strerror(errno);
    return {};
  }
  char templ[] = "/tmp/tier-ramfs-XXXXXX";
  if (::mkdtemp(templ) == nullptr) {
    why_not += "mkdtemp failed";
    return {};
  }
  if (::mount("tier-test", templ, "ramfs", 0, "mode=0700") != 0) {
    why_not += std::string("cannot mount ramfs: ") + std::strerror(errno);
    ::rmdir(templ);
    return {};
  }
  mounted = templ;
  if (!test::direct_refused(templ).empty()) return templ;
  why_not += "ramfs accepts O_DIRECT on this kernel";
  return {};
}

TEST(SwapSpaceFallback, AutoUsesPosixWhereODirectIsRefusedAndSaysSoOnce) {
  std::string why, mounted;
  const std::string base = no_direct_dir(why, mounted);
  struct Unmount {
    std::string dir;
    ~Unmount() {
      if (!dir.empty()) {
        ::umount2(dir.c_str(), MNT_DETACH);
        ::rmdir(dir.c_str());
      }
    }
  } unmount{mounted};
  if (base.empty()) GTEST_SKIP() << "no file system here refuses O_DIRECT: " << why;

  test::ScratchDir dir(base, "fallback");
  ASSERT_TRUE(dir.ok());
  std::vector<std::string> lines;
  std::mutex lines_mu;
  set_log_sink([&](LogLevel, std::string_view m) {
    std::lock_guard<std::mutex> lk(lines_mu);
    lines.emplace_back(m);
  });
  SwapSpaceOptions o;
  o.paths = {dir.sub("a"), dir.sub("b")};
  o.bytes_per_path = 4 << 20;
  o.engine = IoEngineKind::kAuto;
  o.use_direct = true;
  auto sp = SwapSpace::create(o);
  auto sp2 = SwapSpace::create(o);
  set_log_sink(nullptr);
  ASSERT_TRUE(sp.ok()) << sp.status();
  ASSERT_TRUE(sp2.ok()) << sp2.status();
  EXPECT_EQ((*sp)->engine_kind(), IoEngineKind::kPosix);
  EXPECT_EQ((*sp)->buffer_alignment(), 1u);
  for (const auto& p : (*sp)->stats().paths) {
    EXPECT_FALSE(p.direct_io);
  }
  std::size_t mentions = 0;
  for (const auto& l : lines) {
    if (l.find("O_DIRECT not supported") != std::string::npos) {
      ++mentions;
      EXPECT_NE(l.find("posix"), std::string::npos) << l;
      EXPECT_NE(l.find("tier.io.use_direct=false"), std::string::npos) << l;
    }
  }
  EXPECT_EQ(mentions, 1u) << "logged once, not per path or per swap space";

  auto e = (*sp)->allocate(1 << 20);
  ASSERT_TRUE(e.ok());
  std::vector<std::uint8_t> src(1 << 20), dst(1 << 20);
  test::fill_pattern(src.data(), src.size(), 5);
  ASSERT_TRUE((*sp)->write(*e, src.data(), src.size()).wait().ok());
  ASSERT_TRUE((*sp)->read(*e, dst.data(), dst.size()).wait().ok());
  EXPECT_EQ(src, dst);

  // Asked for explicitly, O_DIRECT-less paths still work with the asked engine.
  if (probe_io_engine(IoEngineKind::kUring).ok()) {
    o.engine = IoEngineKind::kUring;
    auto su = SwapSpace::create(o);
    ASSERT_TRUE(su.ok()) << su.status();
    EXPECT_EQ((*su)->engine_kind(), IoEngineKind::kUring);
  }
}

}  // namespace
}  // namespace tier::nvme
