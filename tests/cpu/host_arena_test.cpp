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

// ---- lazy commit: the arena of an auto budget pins and announces extent by extent

bool may_pin(std::uint64_t bytes) {
  struct rlimit rl {};
  getrlimit(RLIMIT_MEMLOCK, &rl);
  return geteuid() == 0 || rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= bytes;
}

// VmLck of this process, from /proc/self/status (bytes).
std::uint64_t locked_bytes_of_process() {
  std::ifstream f("/proc/self/status");
  std::string key;
  std::uint64_t kb = 0;
  while (f >> key) {
    if (key == "VmLck:") {
      f >> kb;
      return kb * 1024;
    }
    f.ignore(1 << 10, '\n');
  }
  return 0;
}

std::unique_ptr<HostArena> make_lazy(std::uint64_t bytes, std::uint64_t extent = 0) {
  HostArenaOptions o;
  o.bytes = bytes;
  o.lazy = true;
  o.extent_bytes = extent;
  auto a = HostArena::create(o);
  EXPECT_TRUE(a.ok()) << a.status();
  return a.ok() ? std::move(a).value() : nullptr;
}

// Records the extents announced to a commit listener.
struct Announced {
  std::mutex mu;
  std::vector<std::pair<std::byte*, std::uint64_t>> ranges;
  HostArena::CommitListener listener() {
    return [this](std::byte* p, std::uint64_t n) {
      std::lock_guard<std::mutex> lock(mu);
      ranges.emplace_back(p, n);
    };
  }
  std::size_t size() {
    std::lock_guard<std::mutex> lock(mu);
    return ranges.size();
  }
};

TEST(HostArenaLazy, CreationCommitsAndPinsNothing) {
  const std::uint64_t before = locked_bytes_of_process();
  auto a = make_lazy(4ull << 30);  // a 4 GiB cap: touching it would show in VmLck and in time
  ASSERT_TRUE(a);
  EXPECT_TRUE(a->lazy());
  EXPECT_EQ(a->extent_bytes(), 64u << 20) << "the default extent";
  EXPECT_EQ(a->committed_bytes(), 0u);
  EXPECT_EQ(a->pinned_bytes(), 0u);
  EXPECT_LT(locked_bytes_of_process(), before + (64u << 20));
  const auto s = a->stats();
  EXPECT_TRUE(s.lazy);
  EXPECT_EQ(s.committed_bytes, 0u);
  EXPECT_EQ(s.pinned_bytes, 0u);
}

TEST(HostArenaLazy, OnlyTheExtentsBlocksReachArePinnedAndAnnounced) {
  auto a = make_lazy(64 << 20, 4 << 20);
  ASSERT_TRUE(a);
  Announced seen;
  const std::uint64_t id = a->add_commit_listener(seen.listener());
  EXPECT_EQ(seen.size(), 0u);
  const bool pin = may_pin(64 << 20);

  auto b1 = a->allocate(1 << 20);
  ASSERT_TRUE(b1.ok());
  EXPECT_EQ(a->committed_bytes(), 4u << 20);
  EXPECT_EQ(a->pinned_bytes(), pin ? 4u << 20 : 0u);
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen.ranges[0].first, a->base());
  EXPECT_EQ(seen.ranges[0].second, 4u << 20);

  // A block beyond the first extent and across the next boundary commits the two it reaches.
  auto b2 = a->allocate(6 << 20);
  ASSERT_TRUE(b2.ok());
  const std::uint64_t reach = (b2->offset() + b2->size() - 1) / (4 << 20) + 1;
  EXPECT_EQ(a->committed_bytes(), reach * (4 << 20));
  EXPECT_EQ(a->pinned_bytes(), pin ? reach * (4 << 20) : 0u);
  EXPECT_EQ(seen.size(), reach);
  std::memset(b2->data(), 0x3C, b2->size());

  // Freeing and allocating again in committed extents commits nothing more.
  b1->reset();
  auto b3 = a->allocate(512 << 10);
  ASSERT_TRUE(b3.ok());
  EXPECT_EQ(seen.size(), reach);
  EXPECT_EQ(a->committed_bytes(), reach * (4 << 20));
  const auto s = a->stats();
  EXPECT_EQ(s.committed_bytes, reach * (4 << 20));
  EXPECT_EQ(s.extent_bytes, 4u << 20);
  EXPECT_LT(s.committed_bytes, a->capacity());
  a->remove_commit_listener(id);
}

TEST(HostArenaLazy, ALateListenerHearsOfEarlierExtentsAndARemovedOneOfNothing) {
  auto a = make_lazy(32 << 20, 2 << 20);
  ASSERT_TRUE(a);
  auto b1 = a->allocate(1 << 20, 0ms, 8 << 20);  // the extent at 8 MiB (or wherever 8 MiB alignment falls)
  ASSERT_TRUE(b1.ok());
  Announced late;
  const std::uint64_t id = a->add_commit_listener(late.listener());
  ASSERT_EQ(late.size(), 1u);
  EXPECT_EQ(late.ranges[0].first, b1->data());
  EXPECT_EQ(late.ranges[0].second, 2u << 20);
  a->remove_commit_listener(id);
  auto b2 = a->allocate(1 << 20, 0ms, 16 << 20);
  ASSERT_TRUE(b2.ok());
  EXPECT_EQ(a->committed_bytes(), 4u << 20);
  EXPECT_EQ(late.size(), 1u) << "removed listeners are not called";
}

TEST(HostArenaLazy, AnEagerArenaIsOneExtentCommittedAtCreation) {
  auto a = make_arena(8 << 20);
  ASSERT_TRUE(a);
  EXPECT_FALSE(a->lazy());
  EXPECT_EQ(a->extent_bytes(), a->capacity());
  EXPECT_EQ(a->committed_bytes(), a->capacity());
  if (may_pin(8 << 20)) {
    EXPECT_EQ(a->pinned_bytes(), a->capacity());
  }
  Announced seen;
  const std::uint64_t id = a->add_commit_listener(seen.listener());
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen.ranges[0].first, a->base());
  EXPECT_EQ(seen.ranges[0].second, a->capacity());
  a->remove_commit_listener(id);
}

TEST(HostArenaLazy, ExtentSizeMustBeWholeHugePagesUpToAGiB) {
  HostArenaOptions o;
  o.bytes = 64 << 20;
  o.lazy = true;
  for (std::uint64_t bad : {std::uint64_t{4096}, std::uint64_t{3} << 20, std::uint64_t{2} << 30}) {
    o.extent_bytes = bad;
    auto a = HostArena::create(o);
    ASSERT_FALSE(a.ok()) << bad;
    EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
  }
  o.extent_bytes = 128 << 20;  // larger than the arena: one extent of the arena's size
  auto a = HostArena::create(o);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ((*a)->extent_bytes(), 64u << 20);
}

// Threads allocating at once into extents nobody has committed yet: each extent is committed
// once, by one of them, and every thread gets its block only after the extent is announced.
TEST(HostArenaLazy, ConcurrentAllocationsIntoUncommittedExtentsWaitForOneCommit) {
  constexpr std::uint64_t kExtent = 4 << 20;
  constexpr int kExtents = 16;
  auto a = make_lazy(kExtent * kExtents, kExtent);
  ASSERT_TRUE(a);
  std::atomic<int> calls[kExtents] = {};
  std::atomic<bool> announced[kExtents] = {};
  const std::uint64_t id = a->add_commit_listener([&](std::byte* p, std::uint64_t n) {
    const auto e = static_cast<std::size_t>((p - a->base()) / static_cast<std::ptrdiff_t>(kExtent));
    EXPECT_EQ(n, kExtent);
    calls[e].fetch_add(1);
    std::this_thread::sleep_for(5ms);  // a slow registration: others land in the extent meanwhile
    announced[e].store(true);
  });
  constexpr int kThreads = 8;
  std::atomic<int> ready{0};
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 1);
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      std::vector<HostBlock> mine;
      for (int i = 0; i < 12; ++i) {
        auto b = a->allocate(4096 * (1 + rng() % 128), 10s);
        if (!b.ok()) {
          bad.fetch_add(1);
          continue;
        }
        const std::uint64_t first = b->offset() / kExtent, last = (b->offset() + b->size() - 1) / kExtent;
        for (std::uint64_t e = first; e <= last; ++e) {
          if (!announced[e].load()) bad.fetch_add(1);
        }
        std::memset(b->data(), t + 1, b->size());
        mine.push_back(std::move(b).value());
        if (rng() % 3 == 0) mine.erase(mine.begin());
      }
      for (const HostBlock& b : mine) {
        for (std::uint64_t off = 0; off < b.size(); off += 4096) {
          if (b.data()[off] != static_cast<std::byte>(t + 1)) bad.fetch_add(1);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  a->remove_commit_listener(id);
  EXPECT_EQ(bad.load(), 0) << "a block was handed out before its extent was announced, or was overwritten";
  std::uint64_t committed = 0;
  for (int e = 0; e < kExtents; ++e) {
    EXPECT_LE(calls[e].load(), 1) << "extent " << e << " committed twice";
    committed += calls[e].load() * kExtent;
  }
  EXPECT_GT(committed, 0u);
  EXPECT_EQ(a->committed_bytes(), committed);
  EXPECT_EQ(a->stats().live_blocks, 0u);
}

// Where mlock is refused, a lazy arena says so once and commits its extents unpinned.
TEST(HostArenaLazy, RefusedMlockCommitsExtentsUnpinned) {
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    struct rlimit rl {
      64 << 10, 64 << 10
    };
    if (setrlimit(RLIMIT_MEMLOCK, &rl) != 0) _exit(10);
    if (!drop_ipc_lock_capability()) _exit(11);
    int mlock_lines = 0;
    set_log_sink([&](LogLevel, std::string_view m) {
      if (m.find("mlock") != std::string_view::npos) ++mlock_lines;
    });
    HostArenaOptions o;
    o.bytes = 16 << 20;
    o.lazy = true;
    o.extent_bytes = 2 << 20;
    auto a = HostArena::create(o);
    if (!a.ok()) _exit(12);
    auto b1 = (*a)->allocate(1 << 20);
    auto b2 = (*a)->allocate(3 << 20);
    if (!b1.ok() || !b2.ok()) _exit(14);
    std::memset(b2->data(), 0x5A, b2->size());
    if (static_cast<unsigned char>(b2->data()[b2->size() - 1]) != 0x5A) _exit(15);
    if ((*a)->locked() || (*a)->pinned_bytes() != 0) _exit(13);
    if ((*a)->committed_bytes() < (4u << 20)) _exit(16);
    if (mlock_lines > 1) _exit(19);
    set_log_sink({});
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "child died with signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "see the _exit codes in the child";
}

}  // namespace
}  // namespace tier
