// The engine's state machine on memory backends: placement, leases, eviction, write-back,
// invariants under random and concurrent use, failures, the access trace and prefetching.
#include "tier/engine.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "engine/memory_backends.hpp"
#include "tier/units.hpp"

namespace tier {
namespace {

using testing::make_memory_engine;
using testing::MemoryEngine;
using namespace std::chrono_literals;

constexpr std::uint64_t kKiB = 1024;

EngineConfig config(bool debug_checks = true) {
  EngineConfig c;
  c.tier.debug_checks = debug_checks;
  c.tier.acquire_timeout_ms = 5000;
  return c;
}

std::vector<float> pattern(std::size_t n, float seed) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = seed + static_cast<float>(i) * 0.5f;
  return v;
}

TensorDesc desc(const std::string& name, std::size_t n) {
  return TensorDesc{name, DType::kF32, n, Role::kParam, 0};
}

std::vector<float> read_all(Engine& e, TensorId id, std::size_t n) {
  std::vector<float> out(n, -1.0f);
  EXPECT_TRUE(e.read(id, out.data()).ok());
  return out;
}

MemoryEngine make(std::uint64_t device, std::uint64_t host, std::uint64_t nvme, EngineConfig cfg = config()) {
  auto m = make_memory_engine(cfg, device, host, nvme);
  EXPECT_TRUE(m.ok()) << m.status();
  return std::move(m).value();
}

TEST(Engine, RegisterOnEveryHomeAndReadBack) {
  auto m = make(1 << 20, 1 << 20, 1 << 20);
  for (Tier home : kAllTiers) {
    const auto data = pattern(1000, static_cast<float>(home));
    auto id = m.engine->register_tensor(desc(str("t", tier_name(home)), 1000), home, data.data());
    ASSERT_TRUE(id.ok()) << id.status();
    EXPECT_EQ(read_all(*m.engine, *id, 1000), data);
    auto info = m.engine->info(*id);
    ASSERT_TRUE(info.ok());
    EXPECT_STREQ(info->copy_state[static_cast<int>(home)], "valid_clean");
  }
  EXPECT_TRUE(m.engine->check_invariants().ok());
}

TEST(Engine, UninitializedTensorsReadAsZeros) {
  auto m = make(1 << 20, 1 << 20, 1 << 20);
  for (Tier home : kAllTiers) {
    auto id = m.engine->register_tensor(desc(str("z", tier_name(home)), 777), home);
    ASSERT_TRUE(id.ok());
    auto lease = m.engine->acquire_now(*id, Tier::kDevice, Access::kRead);
    ASSERT_TRUE(lease.ok()) << lease.status();
    const float* f = static_cast<const float*>(lease->data());
    for (int i = 0; i < 777; ++i) ASSERT_EQ(f[i], 0.0f) << tier_name(home) << " element " << i;
  }
  // An NVMe home that was never written costs no read.
  EXPECT_EQ(m.engine->stats().link(Link::kNvmeToHost).bytes, 0u);
}

TEST(Engine, DeviceAcquireStagesThroughHostAndCountsLinks) {
  auto m = make(1 << 20, 1 << 20, 1 << 20);
  const auto data = pattern(4096, 1);
  auto id = m.engine->register_tensor(desc("w", 4096), Tier::kNvme, data.data());
  ASSERT_TRUE(id.ok());
  const auto before = m.engine->stats();
  {
    auto lease = m.engine->acquire_now(*id, Tier::kDevice, Access::kRead);
    ASSERT_TRUE(lease.ok());
    EXPECT_EQ(std::memcmp(lease->data(), data.data(), 4096 * 4), 0);
    EXPECT_EQ(lease->bytes(), 4096u * 4);
    EXPECT_EQ(lease->tier(), Tier::kDevice);
  }
  const auto d = m.engine->stats().since(before);
  // The host copy made at registration is still cached: no NVMe read needed.
  EXPECT_EQ(d.link(Link::kHostToDevice).bytes, 4096u * 4);
  EXPECT_EQ(d.link(Link::kDeviceToHost).bytes, 0u);
}

TEST(Engine, WriteLeaseMakesTheNewestCopyAndFlushWritesHome) {
  auto m = make(1 << 20, 1 << 20, 1 << 20);
  auto id = m.engine->register_tensor(desc("w", 1024), Tier::kNvme, pattern(1024, 0).data());
  ASSERT_TRUE(id.ok());
  const auto fresh = pattern(1024, 100);
  {
    auto lease = m.engine->acquire_now(*id, Tier::kDevice, Access::kWrite);
    ASSERT_TRUE(lease.ok());
    std::memcpy(lease->data(), fresh.data(), 4096);
  }
  auto info = m.engine->info(*id);
  ASSERT_TRUE(info.ok());
  EXPECT_STREQ(info->copy_state[0], "valid_dirty");
  EXPECT_STREQ(info->copy_state[1], "absent") << "the old host copy is dropped";
  EXPECT_STREQ(info->copy_state[2], "stale");
  EXPECT_EQ(read_all(*m.engine, *id, 1024), fresh);
  ASSERT_TRUE(m.engine->flush().ok());
  info = m.engine->info(*id);
  EXPECT_STREQ(info->copy_state[2], "valid_clean");
  EXPECT_GE(m.mover->syncs.load(), 1);
  EXPECT_TRUE(m.engine->check_invariants().ok());
}

TEST(Engine, AbandonedWriteLeaseKeepsTheOldContents) {
  auto m = make(1 << 20, 1 << 20, 1 << 20);
  auto id = m.engine->register_tensor(desc("w", 512), Tier::kNvme, pattern(512, 9).data());
  ASSERT_TRUE(id.ok());
  auto lease = m.engine->acquire_now(*id, Tier::kDevice, Access::kWrite);
  ASSERT_TRUE(lease.ok());
  ASSERT_TRUE(lease->abandon().ok());
  EXPECT_EQ(read_all(*m.engine, *id, 512), pattern(512, 9));
  auto info = m.engine->info(*id);
  EXPECT_STREQ(info->copy_state[0], "absent") << "the fresh reservation held no data";
  EXPECT_STREQ(info->copy_state[2], "valid_clean");
  EXPECT_TRUE(m.engine->check_invariants().ok());
  // The tensor is free for the next writer.
  auto again = m.engine->acquire_now(*id, Tier::kHost, Access::kWrite);
  ASSERT_TRUE(again.ok());
}

TEST(Engine, CancelledWriteAcquireLeavesTheTensorAsItWas) {
  auto m = make(1 << 20, 1 << 20, 1 << 20);
  auto id = m.engine->register_tensor(desc("w", 256), Tier::kNvme, pattern(256, 4).data());
  ASSERT_TRUE(id.ok());
  auto reader = m.engine->acquire_now(*id, Tier::kHost, Access::kRead);
  ASSERT_TRUE(reader.ok());
  auto pending = m.engine->acquire(*id, Tier::kDevice, Access::kWrite);  // waits for the reader
  pending.cancel();
  EXPECT_EQ(pending.wait().status().code(), StatusCode::kCancelled);
  ASSERT_TRUE(reader->release().ok());
  auto granted = m.engine->acquire(*id, Tier::kHost, Access::kWrite);
  ASSERT_TRUE(granted.wait_for(std::chrono::milliseconds(5000)).ok()) << "the cancelled writer let go";
  ASSERT_TRUE(m.engine->check_invariants().ok());
  EXPECT_EQ(read_all(*m.engine, *id, 256), pattern(256, 4));
}

// A write acquire whose future is dropped without wait(): granted then or later, the lease
// nobody took ends unused. Before, it ended as a finished write and published the reserved copy
// (never written) as the tensor's contents.
TEST(Engine, ADroppedWriteFutureLeavesTheContentsAsTheyWere) {
  auto m = make(1 << 20, 1 << 20, 1 << 20);
  auto id = m.engine->register_tensor(desc("w", 512), Tier::kNvme, pattern(512, 9).data());
  ASSERT_TRUE(id.ok());
  {
    auto dropped = m.engine->acquire(*id, Tier::kDevice, Access::kWrite);
    while (!dropped.ready()) std::this_thread::sleep_for(1ms);  // granted, never taken
  }
  EXPECT_EQ(read_all(*m.engine, *id, 512), pattern(512, 9));
  ASSERT_TRUE(m.engine->check_invariants().ok());
  // Dropped while queued behind a reader: granted after the future is gone, then abandoned.
  auto reader = m.engine->acquire_now(*id, Tier::kHost, Access::kRead);
  ASSERT_TRUE(reader.ok());
  { auto queued = m.engine->acquire(*id, Tier::kDevice, Access::kWrite); }
  ASSERT_TRUE(reader->release().ok());
  auto writer = m.engine->acquire(*id, Tier::kHost, Access::kWrite);
  auto lease = writer.wait_for(5000ms);
  ASSERT_TRUE(lease.ok()) << "the dropped writer let go: " << lease.status();
  ASSERT_TRUE(lease->abandon().ok());
  EXPECT_EQ(read_all(*m.engine, *id, 512), pattern(512, 9));
  ASSERT_TRUE(m.engine->check_invariants().ok());
}

TEST(Engine, ReadWriteLeaseSeesOldContents) {
  auto m = make(1 << 20, 1 << 20, 1 << 20);
  auto id = m.engine->register_tensor(desc("w", 256), Tier::kNvme, pattern(256, 3).data());
  ASSERT_TRUE(id.ok());
  {
    auto lease = m.engine->acquire_now(*id, Tier::kDevice, Access::kReadWrite);
    ASSERT_TRUE(lease.ok());
    float* f = static_cast<float*>(lease->data());
    EXPECT_EQ(f[10], 3 + 5.0f);
    for (int i = 0; i < 256; ++i) f[i] += 1;
  }
  auto expect = pattern(256, 4);
  EXPECT_EQ(read_all(*m.engine, *id, 256), expect);
}

TEST(Engine, EvictionKeepsTheDeviceWithinItsBudget) {
  const std::uint64_t n = 16 * kKiB;  // 64 KiB tensors
  auto m = make(3 * n * 4, 16 * n * 4, 16 * n * 4);
  std::vector<TensorId> ids;
  for (int i = 0; i < 8; ++i) {
    auto id = m.engine->register_tensor(desc(str("l", i), n), Tier::kNvme, pattern(n, static_cast<float>(i)).data());
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
  }
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 8; ++i) {
      auto lease = m.engine->acquire_now(ids[i], Tier::kDevice, Access::kRead);
      ASSERT_TRUE(lease.ok()) << lease.status();
      EXPECT_EQ(static_cast<const float*>(lease->data())[7], static_cast<float>(i) + 3.5f);
      const auto s = m.engine->stats();
      EXPECT_LE(s.tier(Tier::kDevice).resident_bytes, 3 * n * 4);
    }
  }
  const auto s = m.engine->stats();
  EXPECT_LE(s.tier(Tier::kDevice).peak_bytes, 3 * n * 4);
  EXPECT_GT(s.metrics.at("engine.evictions.device"), 0);
  EXPECT_TRUE(m.engine->check_invariants().ok());
}

TEST(Engine, DirtyCopiesAreWrittenDownBeforeEviction) {
  const std::uint64_t n = 16 * kKiB;
  auto m = make(2 * n * 4, 2 * n * 4, 16 * n * 4);
  std::vector<TensorId> ids;
  for (int i = 0; i < 6; ++i) {
    auto id = m.engine->register_tensor(desc(str("d", i), n), Tier::kNvme);
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
  }
  // Write each on the device: only two fit there and two on the host, so most must travel all
  // the way home before their space is reused.
  for (int i = 0; i < 6; ++i) {
    auto lease = m.engine->acquire_now(ids[i], Tier::kDevice, Access::kWrite);
    ASSERT_TRUE(lease.ok()) << lease.status();
    auto v = pattern(n, 10.0f * i);
    std::memcpy(lease->data(), v.data(), n * 4);
  }
  for (int i = 0; i < 6; ++i) EXPECT_EQ(read_all(*m.engine, ids[i], n), pattern(n, 10.0f * i)) << i;
  EXPECT_GT(m.engine->stats().metrics.at("engine.writebacks"), 0);
  EXPECT_TRUE(m.engine->check_invariants().ok());
}

// A host copy written (the optimizer's updated param) and then loaded onto the device (prefetched
// for the next forward), with NVMe stale: when the host needs its room, the copy goes home to
// NVMe rather than being dropped as if the device copy backed it. Dropped, it left the device copy
// the only current one, and evicting that later meant device -> host -> NVMe (0.94 B/param of
// device -> host in each forward at 737M).
TEST(Engine, AHostCopyBackedOnlyByTheDeviceIsWrittenHomeNotDropped) {
  const std::uint64_t n = 16 * kKiB;
  auto m = make(2 * n * 4, 2 * n * 4, 16 * n * 4);
  std::vector<TensorId> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(*m.engine->register_tensor(desc(str("h", i), n), Tier::kNvme));
  {
    auto w = m.engine->acquire_now(ids[0], Tier::kHost, Access::kWrite);
    ASSERT_TRUE(w.ok()) << w.status();
    const auto v = pattern(n, 7.0f);
    std::memcpy(w->data(), v.data(), n * 4);
  }
  ASSERT_TRUE(m.engine->acquire_now(ids[0], Tier::kDevice, Access::kRead).ok());
  // The host fills with two others, the first held: ids[0]'s host copy must make room, and the
  // second acquire returns once it has (after its write home, the only way to free it).
  auto held = m.engine->acquire_now(ids[1], Tier::kHost, Access::kRead);
  ASSERT_TRUE(held.ok()) << held.status();
  ASSERT_TRUE(m.engine->acquire_now(ids[2], Tier::kHost, Access::kRead).ok());
  ASSERT_TRUE(held->release().ok());
  auto info = m.engine->info(ids[0]);
  ASSERT_TRUE(info.ok());
  EXPECT_STREQ(info->copy_state[static_cast<int>(Tier::kNvme)], "valid_clean") << "written home";
  // Evicting the device copy now costs nothing: no device -> host transfer.
  for (int i : {2, 3}) ASSERT_TRUE(m.engine->acquire_now(ids[i], Tier::kDevice, Access::kRead).ok());
  EXPECT_EQ(m.engine->stats().link(Link::kDeviceToHost).bytes, 0u);
  EXPECT_EQ(read_all(*m.engine, ids[0], n), pattern(n, 7.0f));
  EXPECT_TRUE(m.engine->check_invariants().ok()) << m.engine->check_invariants();
}

TEST(Engine, AFullStoreWithRoomInTheBudgetWritesDirtyCopiesBack) {
  // Each host allocation takes 64 KiB of the store; the tensors are 40 KiB, so four dirty copies
  // fill the store while the budget (which counts 160 KiB of 256 KiB) still has room. A fifth
  // needs write-backs although the budget alone does not ask for them; it used to wait until the
  // acquire timed out.
  const std::uint64_t n = 10 * kKiB;  // 40 KiB of fp32
  auto cfg = config();
  cfg.tier.acquire_timeout_ms = 20000;
  auto made = make_memory_engine(cfg, 0, 256 * kKiB, 64 * n * 4, 64 * kKiB);
  ASSERT_TRUE(made.ok()) << made.status();
  MemoryEngine m = std::move(made).value();
  std::vector<TensorId> ids;
  for (int i = 0; i < 6; ++i) {
    auto id = m.engine->register_tensor(desc(str("f", i), n), Tier::kNvme);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 6; ++i) {
    auto lease = m.engine->acquire_now(ids[i], Tier::kHost, Access::kWrite);
    ASSERT_TRUE(lease.ok()) << "tensor " << i << ": " << lease.status();
    auto v = pattern(n, 3.0f * i);
    std::memcpy(lease->data(), v.data(), n * 4);
  }
  // Far below the timeout: nothing waited for it.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(read_all(*m.engine, ids[i], n), pattern(n, 3.0f * i)) << i;
  EXPECT_GT(m.engine->stats().metrics.at("engine.writebacks"), 0);
  EXPECT_TRUE(m.engine->check_invariants().ok());
}

TEST(Engine, TooLargeForATierFailsAtOnce) {
  auto m = make(64 * kKiB, 1 << 20, 1 << 20);
  auto id = m.engine->register_tensor(desc("big", 32 * kKiB), Tier::kNvme);  // 128 KiB
  ASSERT_TRUE(id.ok());
  auto lease = m.engine->acquire_now(*id, Tier::kDevice, Access::kRead);
  ASSERT_FALSE(lease.ok());
  EXPECT_EQ(lease.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(lease.status().message().find("tier.budgets.device"), std::string::npos) << lease.status();
  EXPECT_NE(lease.status().message().find("'big'"), std::string::npos);
}

TEST(Engine, UnconfiguredTierAndBadIdsAreClearErrors) {
  auto m = make(0, 1 << 20, 1 << 20);
  auto id = m.engine->register_tensor(desc("w", 16), Tier::kHost);
  ASSERT_TRUE(id.ok());
  auto lease = m.engine->acquire_now(*id, Tier::kDevice, Access::kRead);
  ASSERT_FALSE(lease.ok());
  EXPECT_EQ(lease.status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(m.engine->register_tensor(desc("x", 16), Tier::kDevice).ok());
  EXPECT_EQ(m.engine->register_tensor(desc("w", 16), Tier::kHost).status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(m.engine->acquire_now(12345, Tier::kHost, Access::kRead).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(m.engine->register_tensor(desc("", 16), Tier::kHost).status().code(), StatusCode::kInvalidArgument);
}

TEST(Engine, PinnedTierMakesAcquireWaitUntilARelease) {
  const std::uint64_t n = 16 * kKiB;
  auto m = make(n * 4, 4 * n * 4, 4 * n * 4);
  auto a = m.engine->register_tensor(desc("a", n), Tier::kNvme);
  auto b = m.engine->register_tensor(desc("b", n), Tier::kNvme);
  ASSERT_TRUE(a.ok() && b.ok());
  auto la = m.engine->acquire_now(*a, Tier::kDevice, Access::kRead);
  ASSERT_TRUE(la.ok());
  auto fb = m.engine->acquire(*b, Tier::kDevice, Access::kRead);
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(fb.ready()) << "the device holds only one tensor and it is pinned";
  ASSERT_TRUE(la->release().ok());
  auto lb = fb.wait();
  ASSERT_TRUE(lb.ok()) << lb.status();
  EXPECT_GE(m.engine->stats().metrics.at("engine.room_waits"), 1);
}

TEST(Engine, PinnedTierTimesOutWithAnExplanation) {
  const std::uint64_t n = 16 * kKiB;
  EngineConfig cfg = config();
  cfg.tier.acquire_timeout_ms = 100;
  auto m = make(n * 4, 4 * n * 4, 4 * n * 4, cfg);
  auto a = m.engine->register_tensor(desc("a", n), Tier::kNvme);
  auto b = m.engine->register_tensor(desc("b", n), Tier::kNvme);
  auto la = m.engine->acquire_now(*a, Tier::kDevice, Access::kRead);
  ASSERT_TRUE(la.ok());
  auto lb = m.engine->acquire_now(*b, Tier::kDevice, Access::kRead);
  ASSERT_FALSE(lb.ok());
  EXPECT_EQ(lb.status().code(), StatusCode::kTimedOut);
  EXPECT_NE(lb.status().message().find("pinned"), std::string::npos) << lb.status();
  EXPECT_TRUE(m.engine->check_invariants().ok());
}

// Waiters of one tier that expire together each name the bytes pinned there (the engine counts
// them once per tier, not once per waiter).
TEST(Engine, WaitersExpiringTogetherEachReportThePinnedBytes) {
  const std::uint64_t n = 16 * kKiB;
  EngineConfig cfg = config();
  cfg.tier.acquire_timeout_ms = 100;
  auto m = make(n * 4, 4 * n * 4, 4 * n * 4, cfg);
  auto a = m.engine->register_tensor(desc("a", n), Tier::kNvme);
  auto b = m.engine->register_tensor(desc("b", n), Tier::kNvme);
  auto c = m.engine->register_tensor(desc("c", n), Tier::kNvme);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  auto la = m.engine->acquire_now(*a, Tier::kDevice, Access::kRead);
  ASSERT_TRUE(la.ok());
  auto fb = m.engine->acquire(*b, Tier::kDevice, Access::kRead);
  auto fc = m.engine->acquire(*c, Tier::kDevice, Access::kRead);
  const std::string expect = str(format_bytes(n * 4), " of the ", format_bytes(n * 4), " budget is pinned");
  for (auto* f : {&fb, &fc}) {
    auto l = f->wait();
    ASSERT_FALSE(l.ok());
    EXPECT_EQ(l.status().code(), StatusCode::kTimedOut);
    EXPECT_NE(l.status().message().find(expect), std::string::npos) << l.status();
    EXPECT_NE(l.status().message().find("no room for " + format_bytes(n * 4) + " on device"), std::string::npos)
        << l.status();
  }
  EXPECT_TRUE(m.engine->check_invariants().ok());
}

TEST(Engine, ReadersShareAndAWriterWaitsForThem) {
  auto m = make(1 << 20, 1 << 20, 1 << 20);
  auto id = m.engine->register_tensor(desc("w", 64), Tier::kHost, pattern(64, 1).data());
  ASSERT_TRUE(id.ok());
  auto r1 = m.engine->acquire_now(*id, Tier::kHost, Access::kRead);
  auto r2 = m.engine->acquire_now(*id, Tier::kDevice, Access::kRead);
  ASSERT_TRUE(r1.ok() && r2.ok());
  auto w = m.engine->acquire(*id, Tier::kDevice, Access::kWrite);
  std::this_thread::sleep_for(30ms);
  EXPECT_FALSE(w.ready());
  ASSERT_TRUE(r1->release().ok());
  std::this_thread::sleep_for(30ms);
  EXPECT_FALSE(w.ready());
  ASSERT_TRUE(r2->release().ok());
  auto lw = w.wait();
  ASSERT_TRUE(lw.ok());
  auto r3 = m.engine->acquire(*id, Tier::kHost, Access::kRead);
  std::this_thread::sleep_for(30ms);
  EXPECT_FALSE(r3.ready()) << "a reader waits for the writer";
  ASSERT_TRUE(lw->release().ok());
  EXPECT_TRUE(r3.wait().ok());
}

TEST(Engine, FailedNvmeReadKeepsTheHomeCopyAndReportsTheError) {
  const std::uint64_t n = 4 * kKiB;
  auto m = make(1 << 20, n * 4, 1 << 20);  // host holds one tensor: the second forces the first out
  auto a = m.engine->register_tensor(desc("a", n), Tier::kNvme, pattern(n, 1).data());
  auto b = m.engine->register_tensor(desc("b", n), Tier::kNvme, pattern(n, 2).data());
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(m.engine->flush().ok());
  m.mover->fail_link(Tier::kNvme, Tier::kHost, true);
  // Whichever is not cached on the host needs an NVMe read, which fails.
  auto la = m.engine->acquire_now(*a, Tier::kDevice, Access::kRead);
  auto lb = m.engine->acquire_now(*b, Tier::kDevice, Access::kRead);
  const bool a_failed = !la.ok();
  const bool b_failed = !lb.ok();
  ASSERT_TRUE(a_failed || b_failed);
  const Status& err = a_failed ? la.status() : lb.status();
  EXPECT_EQ(err.code(), StatusCode::kIoError);
  EXPECT_NE(err.message().find("injected failure"), std::string::npos) << err;
  if (la.ok()) {
    ASSERT_TRUE(la->release().ok());
  }
  if (lb.ok()) {
    ASSERT_TRUE(lb->release().ok());
  }
  EXPECT_TRUE(m.engine->check_invariants().ok());
  m.mover->fail_link(Tier::kNvme, Tier::kHost, false);
  EXPECT_EQ(read_all(*m.engine, *a, n), pattern(n, 1));
  EXPECT_EQ(read_all(*m.engine, *b, n), pattern(n, 2));
}

TEST(Engine, FailedWriteBackKeepsTheDirtyCopy) {
  const std::uint64_t n = 4 * kKiB;
  EngineConfig cfg = config();
  cfg.tier.acquire_timeout_ms = 200;
  auto m = make(1 << 20, n * 4, 1 << 20, cfg);
  auto a = m.engine->register_tensor(desc("a", n), Tier::kNvme);
  auto b = m.engine->register_tensor(desc("b", n), Tier::kNvme);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(m.engine->write(*a, pattern(n, 5).data()).ok());  // dirty on host, the only valid copy
  m.mover->fail_link(Tier::kHost, Tier::kNvme, true);
  auto lb = m.engine->acquire_now(*b, Tier::kHost, Access::kRead);  // needs a's room: write-back fails
  ASSERT_FALSE(lb.ok());
  EXPECT_NE(lb.status().message().find("write-back"), std::string::npos) << lb.status();
  EXPECT_FALSE(m.engine->flush().ok()) << "flush reports the failing write";
  m.mover->fail_link(Tier::kHost, Tier::kNvme, false);
  EXPECT_EQ(read_all(*m.engine, *a, n), pattern(n, 5)) << "the dirty copy survived";
  ASSERT_TRUE(m.engine->flush().ok());
  EXPECT_TRUE(m.engine->check_invariants().ok());
}

// A loader's registration that does not wait for the write home (durable = false): it returns
// with the write in flight, the contents are the tensor's at once, flush() makes them durable.
TEST(Engine, ARegistrationThatDoesNotWaitForItsWriteHomeIsMadeDurableByFlush) {
  const std::uint64_t n = 4 * kKiB;
  auto m = make(1 << 20, 1 << 20, 1 << 20);
  m.mover->delay_us = 300000;  // each transfer takes 300 ms
  auto a = m.engine->register_tensor(desc("a", n), Tier::kNvme, pattern(n, 3).data(), /*durable=*/false);
  ASSERT_TRUE(a.ok()) << a.status();
  auto info = m.engine->info(*a);
  ASSERT_TRUE(info.ok());
  EXPECT_STREQ(info->copy_state[static_cast<int>(Tier::kNvme)], "loading");  // the write home, in flight
  m.mover->delay_us = 0;
  EXPECT_EQ(read_all(*m.engine, *a, n), pattern(n, 3));
  ASSERT_TRUE(m.engine->flush().ok());
  info = m.engine->info(*a);
  EXPECT_STREQ(info->copy_state[static_cast<int>(Tier::kNvme)], "valid_clean");
  EXPECT_TRUE(m.engine->check_invariants().ok());
}

TEST(Engine, ARegistrationWhoseWriteHomeFailsKeepsItsContentsAndFlushSaysSo) {
  const std::uint64_t n = 4 * kKiB;
  auto m = make(1 << 20, 1 << 20, 1 << 20);
  m.mover->fail_link(Tier::kHost, Tier::kNvme, true);
  auto a = m.engine->register_tensor(desc("a", n), Tier::kNvme, pattern(n, 4).data(), /*durable=*/false);
  ASSERT_TRUE(a.ok()) << a.status();  // the failure comes after the return
  EXPECT_FALSE(m.engine->flush().ok()) << "flush reports the failing write";
  EXPECT_EQ(read_all(*m.engine, *a, n), pattern(n, 4)) << "the host copy is the tensor's";
  m.mover->fail_link(Tier::kHost, Tier::kNvme, false);
  ASSERT_TRUE(m.engine->flush().ok());
  auto info = m.engine->info(*a);
  ASSERT_TRUE(info.ok());
  EXPECT_STREQ(info->copy_state[static_cast<int>(Tier::kNvme)], "valid_clean");
  // A durable registration over the failing link fails at once, and leaves nothing registered.
  m.mover->fail_link(Tier::kHost, Tier::kNvme, true);
  auto b = m.engine->register_tensor(desc("b", n), Tier::kNvme, pattern(n, 5).data());
  EXPECT_FALSE(b.ok());
  EXPECT_FALSE(m.engine->find("b").ok());
  EXPECT_TRUE(m.engine->check_invariants().ok());
}

// register_filled: the fill writes straight into the host copy (each byte of it: the tensor's
// contents are what it wrote), durable or not as register_tensor; a failing fill registers
// nothing, frees the name and returns its error; a missing fill is refused.
TEST(Engine, ARegistrationFilledInPlaceHoldsWhatTheFillWroteAndAFailedFillLeavesNothing) {
  const std::uint64_t n = 4 * kKiB;
  auto m = make(1 << 20, 1 << 20, 1 << 20);
  const auto want = pattern(n, 7);
  std::uint64_t seen = 0;
  const Engine::Fill fill = [&](void* dst, std::uint64_t bytes) {
    seen = bytes;
    std::memcpy(dst, want.data(), bytes);
    return Status::Ok();
  };
  for (bool durable : {true, false}) {
    auto a = m.engine->register_filled(desc(durable ? "a" : "b", n), Tier::kNvme, fill, durable);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(seen, n * 4);
    ASSERT_TRUE(m.engine->flush().ok());
    auto info = m.engine->info(*a);
    ASSERT_TRUE(info.ok());
    EXPECT_STREQ(info->copy_state[static_cast<int>(Tier::kNvme)], "valid_clean");
    EXPECT_EQ(read_all(*m.engine, *a, n), want);
  }
  const auto before = m.engine->stats().tier(Tier::kNvme).resident_bytes;
  auto bad = m.engine->register_filled(desc("c", n), Tier::kNvme,
                                       [](void*, std::uint64_t) { return data_loss("the file ended early"); });
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(bad.status().message().find("register 'c'"), std::string::npos) << bad.status();
  EXPECT_FALSE(m.engine->find("c").ok());
  EXPECT_EQ(m.engine->stats().tier(Tier::kNvme).resident_bytes, before);
  EXPECT_EQ(m.engine->register_filled(desc("d", n), Tier::kNvme, Engine::Fill{}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(m.engine->register_filled(desc("c", n), Tier::kNvme, fill).ok()) << "the name is free again";
  EXPECT_TRUE(m.engine->check_invariants().ok());
}

TEST(Engine, UnregisterWaitsForIdleAndFreesTheName) {
  auto m = make(1 << 20, 1 << 20, 1 << 20);
  auto id = m.engine->register_tensor(desc("w", 64), Tier::kNvme, pattern(64, 1).data());
  ASSERT_TRUE(id.ok());
  auto lease = m.engine->acquire_now(*id, Tier::kDevice, Access::kRead);
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(m.engine->unregister_tensor(*id).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(lease->release().ok());  // releases are ordered before later calls from this thread
  ASSERT_TRUE(m.engine->unregister_tensor(*id).ok());
  EXPECT_EQ(m.engine->tensor_count(), 0u);
  const auto s = m.engine->stats();
  for (Tier t : kAllTiers) EXPECT_EQ(s.tier(t).resident_bytes, 0u) << tier_name(t);
  EXPECT_TRUE(m.engine->register_tensor(desc("w", 64), Tier::kNvme).ok());
}

// An eviction's write-back of an idle tensor is the engine's business: unregister waits for it
// instead of failing (found by tier.torch.init at 1.5B parameters, where a staged parameter was
// being written back when the engine took it).
TEST(Engine, UnregisterWaitsForTheEnginesOwnWriteBack) {
  const std::size_t n = 1024;
  auto m = make(1 << 20, n * 4, 1 << 20);  // the host holds one tensor
  m.mover->delay_us = 20000;               // each transfer takes 20 ms
  auto a = m.engine->register_tensor(desc("a", n), Tier::kNvme);
  auto b = m.engine->register_tensor(desc("b", n), Tier::kNvme, pattern(n, 2).data());
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(m.engine->write(*a, pattern(n, 5).data()).ok());  // dirty on host, the only valid copy
  auto fb = m.engine->acquire(*b, Tier::kHost, Access::kRead);  // evicts a: its write-back starts
  const Status gone = m.engine->unregister_tensor(*a);
  ASSERT_TRUE(gone.ok()) << gone;
  auto lb = fb.wait();
  ASSERT_TRUE(lb.ok()) << lb.status();
  ASSERT_TRUE(lb->release().ok());
  EXPECT_EQ(m.engine->tensor_count(), 1u);
  EXPECT_FALSE(m.engine->find("a").ok());
  EXPECT_EQ(read_all(*m.engine, *b, n), pattern(n, 2));
  EXPECT_TRUE(m.engine->check_invariants().ok());
}

// Random acquire/release/write sequences from several threads: every read sees the last write,
// budgets hold on every transition (debug checks), and every tensor ends intact at home.
TEST(Engine, RandomConcurrentUseKeepsDataAndInvariants) {
  const std::size_t n = 2048;  // 8 KiB tensors
  auto m = make(6 * n * 4, 10 * n * 4, 64 * n * 4);
  const int kTensors = 16;
  std::vector<TensorId> ids;
  std::vector<std::atomic<int>> version(kTensors);
  for (int i = 0; i < kTensors; ++i) {
    auto id = m.engine->register_tensor(desc(str("r", i), n), i % 3 == 0 ? Tier::kHost : Tier::kNvme,
                                        pattern(n, static_cast<float>(i * 1000)).data());
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
    version[i] = 0;
  }
  std::atomic<int> errors{0};
  auto worker = [&](int seed) {
    std::mt19937 rng(seed);
    for (int op = 0; op < 150; ++op) {
      const int i = static_cast<int>(rng() % kTensors);
      const Tier tier = static_cast<Tier>(rng() % 2);  // device or host
      const bool write = rng() % 4 == 0;
      auto lease = m.engine->acquire_now(ids[i], tier, write ? Access::kReadWrite : Access::kRead);
      if (!lease.ok()) {
        ADD_FAILURE() << lease.status();
        ++errors;
        continue;
      }
      float* f = static_cast<float*>(lease->data());
      // Element 0 holds i*1000 + the number of writes so far; the rest follow the pattern.
      const int v = static_cast<int>(f[0]) - i * 1000;
      if (f[n - 1] != static_cast<float>(i * 1000 + v) + (n - 1) * 0.5f) ++errors;
      if (write) {
        for (std::size_t k = 0; k < n; ++k) f[k] += 1.0f;
        version[i].fetch_add(1);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back(worker, t + 1);
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  ASSERT_TRUE(m.engine->flush().ok());
  for (int i = 0; i < kTensors; ++i) {
    EXPECT_EQ(read_all(*m.engine, ids[i], n), pattern(n, static_cast<float>(i * 1000 + version[i].load()))) << i;
    auto info = m.engine->info(ids[i]);
    EXPECT_STREQ(info->copy_state[static_cast<int>(info->home)], "valid_clean");
  }
  EXPECT_TRUE(m.engine->check_invariants().ok()) << m.engine->check_invariants();
}

// A cyclic access pattern over more tensors than the device holds: LRU evicts exactly the tensor
// needed next, every time; Belady (with the recorded trace) keeps most of them.
TEST(Engine, BeladyMovesFewerBytesThanLruOnALoopLargerThanTheBudget) {
  const std::size_t n = 4096;
  auto run = [&](bool with_trace) -> std::uint64_t {
    EngineConfig cfg = config(false);
    cfg.tier.prefetch.enabled = false;  // isolate the eviction policy
    auto m = make(4 * n * 4, 64 * n * 4, 64 * n * 4, cfg);
    std::vector<TensorId> ids;
    for (int i = 0; i < 6; ++i) ids.push_back(*m.engine->register_tensor(desc(str("p", i), n), Tier::kHost));
    std::uint64_t before = 0;
    for (int step = 0; step < 6; ++step) {
      if (step == 1) before = m.engine->stats().link(Link::kHostToDevice).bytes;
      if (with_trace) m.engine->begin_step();
      for (TensorId id : ids) EXPECT_TRUE(m.engine->acquire_now(id, Tier::kDevice, Access::kRead).ok());
      if (with_trace) m.engine->end_step();
    }
    return m.engine->stats().link(Link::kHostToDevice).bytes - before;
  };
  const std::uint64_t lru = run(false);
  const std::uint64_t belady = run(true);
  EXPECT_EQ(lru, 5u * 6 * n * 4) << "LRU misses every access of the loop";
  EXPECT_LT(belady, lru / 2) << "belady " << belady << " vs lru " << lru;
}

TEST(Engine, PrefetchBringsTensorsInBeforeTheyAreAcquired) {
  const std::size_t n = 16 * 1024;
  EngineConfig cfg = config(false);
  cfg.tier.prefetch.lookahead = 3;
  auto m = make(4 * n * 4, 64 * n * 4, 64 * n * 4, cfg);
  m.mover->delay_us = 2000;  // each transfer takes ~2 ms; "compute" below takes 8 ms per layer
  std::vector<TensorId> ids;
  for (int i = 0; i < 8; ++i) ids.push_back(*m.engine->register_tensor(desc(str("L", i), n), Tier::kNvme));
  ASSERT_TRUE(m.engine->flush().ok());
  double acquires_after_first = 0;
  for (int step = 0; step < 4; ++step) {
    const auto before = m.engine->stats();
    m.engine->begin_step();
    for (TensorId id : ids) {
      auto lease = m.engine->acquire_now(id, Tier::kDevice, Access::kRead);
      ASSERT_TRUE(lease.ok());
      std::this_thread::sleep_for(8ms);
    }
    m.engine->end_step();
    if (step >= 1) {
      const auto d = m.engine->stats().since(before);
      acquires_after_first += d.metrics.at("engine.acquires");
    }
  }
  const auto s = m.engine->stats();
  // Counts, not times: after the first step nearly every acquire finds its tensor already on the
  // device (a prefetch hit) or on its way (late).
  const double covered = s.metrics.at("prefetch.hits") + s.metrics.at("prefetch.late");
  EXPECT_GE(covered, 0.9 * acquires_after_first) << "hits+late " << covered << " of " << acquires_after_first;
  EXPECT_GT(s.metrics.at("prefetch.issued"), 0);
  EXPECT_EQ(s.metrics.at("prefetch.order_changes"), 0);
  EXPECT_LE(s.tier(Tier::kDevice).peak_bytes, 4 * n * 4);
}

// The main job's pattern: an evaluation's forward first (the first step the engine sees, so the
// first trace), then training steps (forward, then backward in reverse). The first training step
// departs from the trace at its backward; the second must be prefetched whole, not run on demand
// while a trace is recorded again (the 7b-lora run's second step took 1.7x the others). Then an
// evaluation between training steps.
TEST(Engine, TheTrainingStepAfterAnEvaluationForwardIsPrefetchedWhole) {
  const std::size_t n = 16 * 1024;
  const int layers = 8;
  EngineConfig cfg = config(false);
  auto m = make(3 * n * 4, 6 * n * 4, 64 * n * 4, cfg);
  m.mover->delay_us = 500;
  std::vector<TensorId> ids;
  for (int i = 0; i < layers; ++i) ids.push_back(*m.engine->register_tensor(desc(str("L", i), n), Tier::kNvme));
  ASSERT_TRUE(m.engine->flush().ok());
  auto pass = [&](bool backward) {
    m.engine->begin_step();
    for (int i = 0; i < layers; ++i) {
      auto lease = m.engine->acquire_now(ids[i], Tier::kDevice, Access::kRead);
      ASSERT_TRUE(lease.ok()) << lease.status();
      std::this_thread::sleep_for(2ms);
    }
    for (int i = backward ? layers - 1 : -1; i >= 0; --i) {
      auto lease = m.engine->acquire_now(ids[i], Tier::kDevice, Access::kRead);
      ASSERT_TRUE(lease.ok()) << lease.status();
      std::this_thread::sleep_for(2ms);
    }
    m.engine->end_step();
  };
  pass(false);  // the evaluation's forward
  pass(true);   // departs from the trace at its backward
  const auto before = m.engine->stats();
  pass(true);
  const auto d = m.engine->stats().since(before);
  // Of its 16 acquires, each finds its layer on the device (kept from before, or prefetched) or
  // on its way there; none waits for a load nobody started.
  const double covered = d.metrics.at("engine.acquire_hits") + d.metrics.at("prefetch.late");
  EXPECT_GE(covered, 0.9 * d.metrics.at("engine.acquires"))
      << "hits " << d.metrics.at("engine.acquire_hits") << " (" << d.metrics.at("prefetch.hits")
      << " prefetched) + late " << d.metrics.at("prefetch.late") << " of " << d.metrics.at("engine.acquires");
  EXPECT_EQ(m.engine->stats().metrics.at("prefetch.order_changes"), 1);
  // An evaluation of three batches between training steps (as the HF Trainer's eval_steps): the
  // training step after it is prefetched whole too, and the evaluation counts one change.
  for (int batch = 0; batch < 3; ++batch) pass(false);
  const auto before_train = m.engine->stats();
  pass(true);
  const auto t = m.engine->stats().since(before_train);
  const double covered_after_eval = t.metrics.at("engine.acquire_hits") + t.metrics.at("prefetch.late");
  EXPECT_GE(covered_after_eval, 0.9 * t.metrics.at("engine.acquires"))
      << "hits " << t.metrics.at("engine.acquire_hits") << " + late " << t.metrics.at("prefetch.late") << " of "
      << t.metrics.at("engine.acquires");
  EXPECT_EQ(m.engine->stats().metrics.at("prefetch.order_changes"), 2);
  EXPECT_TRUE(m.engine->check_invariants().ok()) << m.engine->check_invariants();
}

// NVMe-homed layers read on the device, through a host that holds two: each layer is staged on
// the host ahead of use, its device copy is made from that staged copy, and the staged copy is
// evicted later for the next stagings. A staged copy that served its device copy was used: the
// prefetcher's "dropped unused" count (the room it wasted) stays at 0 in this loop, where
// every prefetch is used, however the stagings come and go.
TEST(Engine, AStagedCopyThatServedItsDeviceCopyIsNotDroppedUnused) {
  const std::size_t n = 16 * 1024;
  EngineConfig cfg = config(false);
  auto m = make(3 * n * 4, 2 * n * 4, 64 * n * 4, cfg);
  m.mover->delay_us = 500;
  std::vector<TensorId> ids;
  for (int i = 0; i < 10; ++i) ids.push_back(*m.engine->register_tensor(desc(str("L", i), n), Tier::kNvme));
  ASSERT_TRUE(m.engine->flush().ok());
  for (int step = 0; step < 4; ++step) {
    m.engine->begin_step();
    for (TensorId id : ids) {
      auto lease = m.engine->acquire_now(id, Tier::kDevice, Access::kRead);
      ASSERT_TRUE(lease.ok()) << lease.status();
      std::this_thread::sleep_for(3ms);
    }
    m.engine->end_step();
  }
  EXPECT_TRUE(m.engine->check_invariants().ok()) << m.engine->check_invariants();
  const auto s = m.engine->stats();
  EXPECT_GT(s.metrics.at("prefetch.issued"), 0);
  EXPECT_GT(s.metrics.at("prefetch.hits") + s.metrics.at("prefetch.late"), 0) << "nothing was prefetched in time";
  EXPECT_EQ(s.metrics.at("prefetch.dropped_unused"), 0);
}

// A training step's pattern (forward over the layers, then backward) with NVMe-homed layers and a
// device and host that hold a few each.
//  - On demand (no prefetch), eviction by next use must count the host copy of a layer whose device
//    copy the device is about to drop as needed: then each pass reads from NVMe only the layers
//    that are on neither the device nor the host at the turn, plus the one staging slot:
//    layers - device - host + 1. (Treating every host copy beside a device copy as spare, as a
//    plain per-tier Belady does, reads 21 per step here instead of 18.)
//  - With prefetching (the automatic window, a small one, and one wider than the host), loads to
//    the device are no more than on demand (no prefetched copy is evicted before its use) and NVMe
//    reads stay within 1.5x: staging ahead takes host slots from the cache, but must not thrash.
TEST(Engine, ForwardBackwardStepMovesFewBytesOnDemandAndWithPrefetch) {
  const std::size_t n = 16 * 1024;
  const int layers = 16, device_layers = 3, host_layers = 5;
  struct Moved {
    std::uint64_t nvme_to_host = 0, host_to_device = 0;
  };
  auto run = [&](bool prefetch, int lookahead) {
    EngineConfig cfg = config(false);
    cfg.tier.prefetch.enabled = prefetch;
    cfg.tier.prefetch.lookahead = lookahead;
    auto m = make(device_layers * n * 4, host_layers * n * 4, 64 * n * 4, cfg);
    m.mover->delay_us = 300;
    std::vector<TensorId> ids;
    for (int i = 0; i < layers; ++i) {
      const auto init = pattern(n, static_cast<float>(i));  // written data: a load is a real copy, not zeros
      ids.push_back(*m.engine->register_tensor(desc(str("L", i), n), Tier::kNvme, init.data()));
    }
    EXPECT_TRUE(m.engine->flush().ok());
    StatsSnapshot before;
    const int steps = 4;
    for (int step = 0; step < steps; ++step) {
      if (step == 1) before = m.engine->stats();
      m.engine->begin_step();
      auto pass = [&](int i) {
        auto lease = m.engine->acquire_now(ids[i], Tier::kDevice, Access::kRead);
        ASSERT_TRUE(lease.ok()) << lease.status();
        std::this_thread::sleep_for(200us);
      };
      for (int i = 0; i < layers; ++i) pass(i);
      for (int i = layers - 1; i >= 0; --i) pass(i);
      m.engine->end_step();
    }
    const auto d = m.engine->stats().since(before);
    EXPECT_TRUE(m.engine->check_invariants().ok()) << m.engine->check_invariants();
    const std::uint64_t layer = n * 4;
    return Moved{d.link(Link::kNvmeToHost).bytes / (steps - 1) / layer,
                 d.link(Link::kHostToDevice).bytes / (steps - 1) / layer};
  };
  const Moved demand = run(false, 0);
  EXPECT_EQ(demand.nvme_to_host, 2u * (layers - device_layers - host_layers + 1)) << "NVMe reads per step, in layers";
  EXPECT_EQ(demand.host_to_device, 2u * (layers - device_layers)) << "device loads per step, in layers";
  for (int lookahead : {0, 4, 12}) {
    const Moved p = run(true, lookahead);
    EXPECT_LE(p.host_to_device, demand.host_to_device) << "lookahead " << lookahead << ": device loads per step";
    EXPECT_LE(p.nvme_to_host * 2, demand.nvme_to_host * 3)
        << "lookahead " << lookahead << ": NVMe reads per step " << p.nvme_to_host << " layers vs "
        << demand.nvme_to_host << " on demand";
  }
}

// Between two steps an optimizer pass (acquires outside the trace) reads each layer's gradient
// and rewrites the layer on a host too small for the pass and the next forward's first layers
// together. The scheduler stages those layers as soon as the host has room, and the pass's
// demands, and the stagings of nearer layers, evict them before their use. A layer whose prefetch
// was dropped unused is not prefetched again until the trace moves on, so each is staged at most
// once per pass: the pass reads from NVMe its gradients and about one set of staged layers, not
// the same layers over and over.
TEST(Engine, APrefetchDroppedUnusedIsNotReloadedUntilTheTraceMovesOn) {
  const std::size_t n = 16 * 1024;
  const int layers = 12;
  EngineConfig cfg = config(false);
  // The device holds one layer, the host five tensors: the pass's two leases and a few stagings.
  auto m = make(1 * n * 4, 5 * n * 4, 64 * n * 4, cfg);
  m.mover->delay_us = 300;
  std::vector<TensorId> params, grads;
  for (int i = 0; i < layers; ++i) {
    const auto init = pattern(n, static_cast<float>(i));
    params.push_back(*m.engine->register_tensor(desc(str("L", i), n), Tier::kNvme, init.data()));
    grads.push_back(*m.engine->register_tensor(desc(str("G", i), n), Tier::kNvme, init.data()));
  }
  ASSERT_TRUE(m.engine->flush().ok());
  auto forward = [&] {
    m.engine->begin_step();
    for (int i = 0; i < layers; ++i) {
      auto lease = m.engine->acquire_now(params[i], Tier::kDevice, Access::kRead);
      ASSERT_TRUE(lease.ok()) << lease.status();
      std::this_thread::sleep_for(200us);
    }
    m.engine->end_step();
  };
  std::vector<double> staged_per_pass;
  for (int step = 0; step < 4; ++step) {
    forward();
    const auto before = m.engine->stats();
    for (int i = layers - 1; i >= 0; --i) {  // the pass, outside the trace
      auto g = m.engine->acquire_now(grads[i], Tier::kHost, Access::kRead);
      ASSERT_TRUE(g.ok()) << g.status();
      auto w = m.engine->acquire_now(params[i], Tier::kHost, Access::kWrite);
      ASSERT_TRUE(w.ok()) << w.status();
      std::this_thread::sleep_for(500us);
      ASSERT_TRUE(w->release().ok());
      ASSERT_TRUE(g->release().ok());
    }
    const auto d = m.engine->stats().since(before);
    // NVMe reads of the pass beyond its gradients, in layers: the next forward's stagings.
    const double reads = static_cast<double>(d.link(Link::kNvmeToHost).bytes) / (n * 4);
    if (step >= 1) staged_per_pass.push_back(reads - layers);
  }
  EXPECT_TRUE(m.engine->check_invariants().ok()) << m.engine->check_invariants();
  // At most once each (1 here; 21 to 40 when a dropped layer was restaged at once).
  for (double s : staged_per_pass) EXPECT_LE(s, static_cast<double>(layers)) << "layers staged during a pass";
  EXPECT_GT(m.engine->stats().metrics.at("prefetch.dropped_unused"), 0) << "the pass did not contend with prefetching";
}

TEST(Engine, OrderChangeIsDetectedAndReRecorded) {
  auto m = make(1 << 20, 1 << 20, 1 << 20, config(false));
  std::vector<TensorId> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(*m.engine->register_tensor(desc(str("o", i), 64), Tier::kHost));
  auto step = [&](std::vector<int> order) {
    m.engine->begin_step();
    for (int i : order) ASSERT_TRUE(m.engine->acquire_now(ids[i], Tier::kDevice, Access::kRead).ok());
    m.engine->end_step();
  };
  step({0, 1, 2, 3});
  step({0, 1, 2, 3});
  EXPECT_EQ(m.engine->stats().metrics.at("prefetch.order_changes"), 0);
  step({0, 2, 1, 3});  // a different path
  EXPECT_EQ(m.engine->stats().metrics.at("prefetch.order_changes"), 1);
  step({0, 2, 1, 3});  // replayed (the changed step was recorded from where it diverged)
  step({0, 2, 1, 3});
  const auto s = m.engine->stats();
  EXPECT_EQ(s.metrics.at("prefetch.order_changes"), 1);
  EXPECT_EQ(s.metrics.at("prefetch.trace_length"), 4);
}

// Untraced acquires (Engine::acquire(..., traced=false): an optimizer pass beside backward) may
// come anywhere inside a step, in any order, without changing the step's recorded order; they
// still count as acquires.
TEST(Engine, UntracedAcquiresInsideAStepLeaveTheTraceAlone) {
  auto m = make(1 << 20, 1 << 20, 1 << 20, config(false));
  std::vector<TensorId> ids;
  for (int i = 0; i < 6; ++i) ids.push_back(*m.engine->register_tensor(desc(str("u", i), 64), Tier::kHost));
  for (int step = 0; step < 4; ++step) {
    m.engine->begin_step();
    for (int i = 0; i < 4; ++i) {
      ASSERT_TRUE(m.engine->acquire_now(ids[i], Tier::kDevice, Access::kRead).ok());
      // A different tensor and access each step, at a different point.
      if (i == step % 4) {
        ASSERT_TRUE(m.engine
                        ->acquire_now(ids[4 + step % 2], Tier::kHost, step % 2 ? Access::kWrite : Access::kRead,
                                      /*traced=*/false)
                        .ok());
      }
    }
    m.engine->end_step();
  }
  const auto s = m.engine->stats();
  EXPECT_EQ(s.metrics.at("prefetch.order_changes"), 0);
  EXPECT_EQ(s.metrics.at("prefetch.trace_length"), 4);
  EXPECT_EQ(s.metrics.at("engine.acquires"), 4 * 5);
}

TEST(Engine, StatsJsonHasTiersLinksAndSchedulerMetrics) {
  auto m = make(1 << 20, 1 << 20, 1 << 20);
  auto id = m.engine->register_tensor(desc("w", 1024), Tier::kNvme, pattern(1024, 0).data());
  ASSERT_TRUE(m.engine->acquire_now(*id, Tier::kDevice, Access::kRead).ok());
  const std::string j = m.engine->stats().to_json();
  for (const char* key : {"\"host_to_device\"", "\"engine.acquires\"", "\"engine.stall_seconds\"",
                          "\"prefetch.overlap\"", "\"engine.evictions.device\"", "\"resident_bytes\""}) {
    EXPECT_NE(j.find(key), std::string::npos) << key;
  }
}

TEST(EngineReserveHost, TwoReservationsAtOnceCannotBothPassTheBudget) {
  // 600 KiB twice in a 1 MiB host: one is granted, the other refused at once (before, both could
  // pass the check, then the second waited for room the first held, until the acquire timeout).
  for (int round = 0; round < 20; ++round) {
    auto m = make(1 << 20, 1 << 20, 1 << 20);
    std::vector<Result<PinnedRegion>> got(2, Status(StatusCode::kCancelled, "not run"));
    std::atomic<int> ready{0};
    auto reserve = [&](int i) {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
      got[i] = m.engine->reserve_host(str("r", i), 600 * kKiB);
    };
    std::thread a(reserve, 0), b(reserve, 1);
    a.join();
    b.join();
    const int ok = static_cast<int>(got[0].ok()) + static_cast<int>(got[1].ok());
    ASSERT_EQ(ok, 1) << got[0].status() << " / " << got[1].status();
    const Status& refused = got[0].ok() ? got[1].status() : got[0].status();
    EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused;
    EXPECT_TRUE(m.engine->check_invariants().ok());
  }
}

TEST(EngineReserveHost, ARegionGivesItsRoomBackAndMayOutliveItsEngine) {
  auto m = make(1 << 20, 1 << 20, 1 << 20);
  {
    auto r = m.engine->reserve_host("r", 600 * kKiB);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  auto again = m.engine->reserve_host("r", 600 * kKiB);  // the room (and the name) came back
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(m.engine->check_invariants().ok());
  // Against the documented order, the engine goes first: the region's end must not touch it (a
  // use after free before, which ASan reports).
  m.engine.reset();
  again = Status(StatusCode::kCancelled, "dropped after its engine");
}

// The recorded order holds only traced tensors: dropping another one (a reserve_host region, an
// unregistered scratch tensor never acquired in a step) keeps it, and the next steps replay it.
TEST(Engine, UnregisteringAnUntracedTensorKeepsTheRecordedOrder) {
  auto m = make(1 << 20, 1 << 20, 1 << 20, config(false));
  std::vector<TensorId> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(*m.engine->register_tensor(desc(str("t", i), 64), Tier::kHost));
  auto step = [&] {
    m.engine->begin_step();
    for (TensorId id : ids) ASSERT_TRUE(m.engine->acquire_now(id, Tier::kDevice, Access::kRead).ok());
    m.engine->end_step();
  };
  step();
  step();
  ASSERT_EQ(m.engine->stats().metrics.at("prefetch.trace_length"), 4);
  { auto region = m.engine->reserve_host("scratch", 4 * kKiB); }
  auto other = m.engine->register_tensor(desc("other", 64), Tier::kHost);
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(m.engine->unregister_tensor(*other).ok());
  EXPECT_EQ(m.engine->stats().metrics.at("prefetch.trace_length"), 4) << "the trace was kept";
  step();
  EXPECT_EQ(m.engine->stats().metrics.at("prefetch.order_changes"), 0);
  // Dropping a traced tensor forgets the order (its id may name another tensor later).
  ASSERT_TRUE(m.engine->unregister_tensor(ids.back()).ok());
  EXPECT_EQ(m.engine->stats().metrics.at("prefetch.trace_length"), 0);
}

}  // namespace
}  // namespace tier
