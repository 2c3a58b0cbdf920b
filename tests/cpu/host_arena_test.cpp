#include "tier/ext/host_arena.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <random>
#include <thread>
#include <vector>

#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tier/log.hpp"

namespace tier {
namespace {

using namespace std::chrono_literals;

std::unique_ptr<HostArena> make_arena(std::uint64_t bytes, HugePageMode mode = HugePageMode::kAuto) {
  auto a = HostArena::create({bytes, mode, true});
  EXPECT_TRUE(a.ok()) << a.status();
  return a.ok() ? std::move(a).value() : nullptr;
}

TEST(HostArena, RoundsCapacityToHugePages) {
  auto a = make_arena(3 << 20);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->capacity(), 4u << 20);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a->base()) % HostArena::kHugePage, 0u);
}

TEST(HostArena, ZeroBytesIsAnError) {
  auto a = HostArena::create({0});
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
}

TEST(HostArena, BlocksAreAlignedDisjointAndWritable) {
  auto a = make_arena(8 << 20);
  ASSERT_TRUE(a);
  std::vector<HostBlock> blocks;
  for (std::uint64_t n : {1ull, 4096ull, 5000ull, 65536ull, 1ull << 20}) {
    auto b = a->allocate(n);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b->data()) % 4096, 0u);
    EXPECT_GE(b->size(), n);
    EXPECT_EQ(b->size() % 4096, 0u);
    EXPECT_TRUE(a->contains(b->data(), b->size()));
    std::memset(b->data(), static_cast<int>(blocks.size() + 1), b->size());
    blocks.push_back(std::move(b).value());
  }
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    for (std::uint64_t j = 0; j < blocks[i].size(); j += 512) {
      ASSERT_EQ(static_cast<int>(blocks[i].data()[j]), static_cast<int>(i + 1)) << "block " << i << " overwritten";
    }
  }
  EXPECT_EQ(a->stats().live_blocks, blocks.size());
}

TEST(HostArena, LargerAlignmentsAreHonoured) {
  auto a = make_arena(8 << 20);
  ASSERT_TRUE(a);
  auto small = a->allocate(4096);
  ASSERT_TRUE(small.ok());
  auto big = a->allocate(4096, 1s, 1 << 20);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(big->data()) % (1 << 20), 0u);
  EXPECT_FALSE(a->allocate(4096, 0ms, 3000).ok());
}

TEST(HostArena, FreedBlocksCoalesceIntoOneRun) {
  auto a = make_arena(4 << 20);
  ASSERT_TRUE(a);
  std::vector<HostBlock> blocks;
  for (int i = 0; i < 16; ++i) blocks.push_back(std::move(a->allocate(256 << 10)).value());
  EXPECT_FALSE(a->try_allocate(4096).ok()) << "arena should be full";
  // Free every other block: 8 holes, fragmented.
  for (int i = 0; i < 16; i += 2) blocks[i].reset();
  auto s = a->stats();
  EXPECT_EQ(s.free_extents, 8u);
  EXPECT_GT(s.fragmentation, 0.8);
  EXPECT_FALSE(a->try_allocate(512 << 10).ok()) << "no contiguous 512 KiB run while fragmented";
  for (int i = 1; i < 16; i += 2) blocks[i].reset();
  s = a->stats();
  EXPECT_EQ(s.free_extents, 1u);
  EXPECT_DOUBLE_EQ(s.fragmentation, 0.0);
  EXPECT_EQ(s.used_bytes, 0u);
  EXPECT_EQ(s.peak_used_bytes, 4u << 20);
  EXPECT_TRUE(a->try_allocate(4 << 20).ok());
}

TEST(HostArena, TooLargeFailsAtOnceNamingTheFix) {
  auto a = make_arena(2 << 20);
  ASSERT_TRUE(a);
  const auto t0 = std::chrono::steady_clock::now();
  auto b = a->allocate(4 << 20, 10s);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("tier.budgets.host"), std::string::npos);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s) << "must not wait for what can never fit";
}

TEST(HostArena, FullArenaWaitsForAFreeThenSucceeds) {
  auto a = make_arena(2 << 20);
  ASSERT_TRUE(a);
  auto first = a->allocate(2 << 20);
  ASSERT_TRUE(first.ok());
  std::thread releaser([&] {
    std::this_thread::sleep_for(50ms);
    first->reset();
  });
  auto second = a->allocate(1 << 20, 5s);
  releaser.join();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_GE(a->stats().waits, 1u);
}

TEST(HostArena, FullArenaTimesOut) {
  auto a = make_arena(2 << 20);
  ASSERT_TRUE(a);
  auto first = a->allocate(2 << 20);
  ASSERT_TRUE(first.ok());
  auto second = a->allocate(4096, 30ms);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kTimedOut);
}

TEST(HostArena, ConcurrentAllocateAndFreeKeepBlocksDisjoint) {
  auto a = make_arena(16 << 20);
  ASSERT_TRUE(a);
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int i = 0; i < 300; ++i) {
        auto b = a->allocate((rng() % 64 + 1) * 4096, 5s);
        if (!b.ok()) {
          ++errors;
          continue;
        }
        const auto tag = static_cast<unsigned char>(t * 50 + i % 50);
        std::memset(b->data(), tag, b->size());
        std::this_thread::yield();
        for (std::uint64_t j = 0; j < b->size(); j += 1024) {
          if (static_cast<unsigned char>(b->data()[j]) != tag) ++errors;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(a->stats().used_bytes, 0u);
  EXPECT_EQ(a->stats().free_extents, 1u);
}

TEST(HostArena, MovedBlocksFreeOnce) {
  auto a = make_arena(2 << 20);
  ASSERT_TRUE(a);
  HostBlock outer;
  {
    auto b = a->allocate(8192);
    ASSERT_TRUE(b.ok());
    outer = std::move(b).value();
  }
  EXPECT_EQ(a->stats().live_blocks, 1u);
  EXPECT_EQ(outer.offset() % 4096, 0u);
  outer.reset();
  EXPECT_EQ(a->stats().live_blocks, 0u);
}

TEST(HostArena, IsLockedWhenMlockIsAllowed) {
  auto a = make_arena(4 << 20);
  ASSERT_TRUE(a);
  // As root (CI) or with a large RLIMIT_MEMLOCK, the arena is pinned.
  struct rlimit rl {};
  getrlimit(RLIMIT_MEMLOCK, &rl);
  if (geteuid() != 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < a->capacity()) {
    GTEST_SKIP() << "RLIMIT_MEMLOCK too small to pin 4 MiB here";
  }
  EXPECT_TRUE(a->locked());
  EXPECT_TRUE(a->stats().locked);
}

// Drops CAP_IPC_LOCK from this process's effective and permitted sets (raw capset: no libcap).
bool drop_ipc_lock_capability() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2]{};
  if (syscall(SYS_capget, &header, data) != 0) return false;
  const unsigned word = CAP_IPC_LOCK / 32, bit = 1u << (CAP_IPC_LOCK % 32);
  data[word].effective &= ~bit;
  data[word].permitted &= ~bit;
  data[word].inheritable &= ~bit;
  return syscall(SYS_capset, &header, data) == 0;
}

// In a child process that may not pin (RLIMIT_MEMLOCK of 64 KiB, no CAP_IPC_LOCK), the arena
// is created unpinned, says so once naming the limit, and works.
TEST(HostArena, RefusedMlockIsLoggedOnceAndTheArenaWorksUnpinned) {
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Child: exit codes say which expectation failed (gtest assertions do not cross fork).
    struct rlimit rl {
      64 << 10, 64 << 10
    };
    if (setrlimit(RLIMIT_MEMLOCK, &rl) != 0) _exit(10);
    if (!drop_ipc_lock_capability()) _exit(11);
    std::vector<std::string> lines;
    std::mutex mu;
    set_log_sink([&](LogLevel, std::string_view m) {
      std::lock_guard<std::mutex> lock(mu);
      lines.emplace_back(m);
    });
    auto a = HostArena::create({4 << 20, HugePageMode::kAuto, true});
    if (!a.ok()) _exit(12);
    if ((*a)->locked() || (*a)->stats().locked) _exit(13);
    auto b = (*a)->allocate(1 << 20);
    if (!b.ok()) _exit(14);
    std::memset(b->data(), 0x5A, b->size());
    if (static_cast<unsigned char>(b->data()[12345]) != 0x5A) _exit(15);
    auto second = HostArena::create({2 << 20, HugePageMode::kAuto, true});
    if (!second.ok() || (*second)->locked()) _exit(16);
    int mlock_lines = 0;
    for (const auto& l : lines) {
      if (l.find("mlock") != std::string::npos) {
        ++mlock_lines;
        if (l.find("RLIMIT_MEMLOCK is 64.00 KiB") == std::string::npos) _exit(17);
        if (l.find("continuing with unpinned memory") == std::string::npos) _exit(18);
      }
    }
    if (mlock_lines != 1) _exit(19);
    set_log_sink({});
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "child died with signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "see the _exit codes in the child: 10/11 could not drop the privilege, "
                                       "13 the arena claims to be pinned, 17/18 the log line lacks the limit or "
                                       "the fallback, 19 the refusal was not logged exactly once";
}

TEST(HostArena, AlignmentThatCanNeverFitFailsAtOnce) {
  auto a = make_arena(2 << 20);
  ASSERT_TRUE(a);
  // A 2 MiB block aligned to 64 MiB fits only if the arena happens to start on a 64 MiB boundary.
  const auto base = reinterpret_cast<std::uintptr_t>(a->base());
  const auto t0 = std::chrono::steady_clock::now();
  auto b = a->allocate(2 << 20, 5s, 64 << 20);
  if (base % (64 << 20) == 0) {
    EXPECT_TRUE(b.ok());
  } else {
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  }
}

TEST(HostArena, OffModeKeepsSmallPages) {
  auto a = make_arena(8 << 20, HugePageMode::kOff);
  ASSERT_TRUE(a);
  const auto s = a->stats();
  EXPECT_EQ(s.huge_pages, HugePageMode::kOff);
  EXPECT_EQ(s.huge_page_bytes, 0u);
}

TEST(HostArena, ThpBacksTheArenaWhereTheKernelAllowsIt) {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode;
  std::getline(f, mode);
  if (mode.empty() || mode.find("[never]") != std::string::npos) {
    GTEST_SKIP() << "transparent huge pages are disabled on this kernel";
  }
  auto a = make_arena(32 << 20, HugePageMode::kThp);
  ASSERT_TRUE(a);
  auto s = a->stats();
  EXPECT_EQ(s.huge_pages, HugePageMode::kThp);
  // The kernel may not find free 2 MiB frames for every page, but it must back most of it.
  EXPECT_GE(s.huge_page_bytes, a->capacity() / 2) << "only " << s.huge_page_bytes << " bytes on huge pages";
}

TEST(HostArena, HugetlbfsWithoutAPoolSaysHowToReserveOne) {
  std::ifstream f("/proc/sys/vm/nr_hugepages");
  long pages = 0;
  f >> pages;
  if (pages >= 2) GTEST_SKIP() << "this machine has a hugetlbfs pool";
  auto a = HostArena::create({4 << 20, HugePageMode::kHugetlbfs, true});
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(a.status().message().find("vm.nr_hugepages"), std::string::npos);
}

}  // namespace
}  // namespace tier
