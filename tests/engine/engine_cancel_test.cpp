// Acquires given up in every state (blocked behind a lock, queued for room, loading, granted and
// not taken), and a randomized model-based test: several threads acquire, release, give up and
// flush on small budgets while a model of every tensor's contents says what each read must see.
// The engine's invariants are checked after every event (tier.debug_checks).
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <random>
#include <thread>

#include "engine/memory_backends.hpp"
#include "tier/engine.hpp"

namespace tier {
namespace {

using testing::make_memory_engine;
using testing::MemoryEngine;
using namespace std::chrono_literals;

constexpr std::uint64_t kKiB = 1024;

EngineConfig config(int timeout_ms = 5000) {
  EngineConfig c;
  c.tier.debug_checks = true;
  c.tier.acquire_timeout_ms = timeout_ms;
  return c;
}

MemoryEngine make(std::uint64_t device, std::uint64_t host, std::uint64_t nvme, EngineConfig cfg = config()) {
  auto m = make_memory_engine(cfg, device, host, nvme);
  EXPECT_TRUE(m.ok()) << m.status();
  return std::move(m).value();
}

// Element 0 of every tensor is its version; the others are version + index, so a torn or stale
// copy is seen at once.
void fill(float* f, std::size_t n, float version) {
  for (std::size_t i = 0; i < n; ++i) f[i] = version + static_cast<float>(i);
}
bool consistent(const float* f, std::size_t n, float* version) {
  *version = f[0];
  for (std::size_t i = 1; i < n; i += 97) {
    if (f[i] != f[0] + static_cast<float>(i)) return false;
  }
  return f[n - 1] == f[0] + static_cast<float>(n - 1);
}

TensorDesc desc(const std::string& name, std::size_t n) {
  return TensorDesc{name, DType::kF32, n, Role::kParam, 0};
}

std::vector<TensorId> register_six(Engine& e, std::size_t n) {
  std::vector<TensorId> ids;
  std::vector<float> v(n);
  for (int i = 0; i < 6; ++i) {
    fill(v.data(), n, static_cast<float>(i * 1000));
    auto id = e.register_tensor(desc(str("t", i), n), Tier::kNvme, v.data());
    EXPECT_TRUE(id.ok()) << id.status();
    ids.push_back(id.ok() ? *id : kInvalidTensor);
  }
  return ids;
}

// Every tensor of register_six still holds what it was registered with (given-up and abandoned
// writes changed nothing).
void expect_registered_contents(Engine& e, const std::vector<TensorId>& ids, std::size_t n) {
  std::vector<float> back(n);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    ASSERT_TRUE(e.read(ids[i], back.data()).ok());
    float v = -1;
    EXPECT_TRUE(consistent(back.data(), n, &v)) << "tensor " << i;
    EXPECT_EQ(v, static_cast<float>(i * 1000)) << "tensor " << i << " changed";
  }
}

// The sequence from the report (through the C ABI, where each ticket is taken and its tensor
// dropped at once): a write acquire that queues for device room while dirty copies are written
// down is given up, then another acquire queues behind it. When room came, the given-up grant was
// released from inside the room waiters' walk, which the release walked again: a crash, or with
// one more write a scheduler spinning forever. Run with slow and instant transfers.
TEST(EngineCancel, GivingUpAnAcquireQueuedForRoomThenAcquiringAgain) {
  const std::size_t n = 64 * kKiB;  // 256 KiB
  for (int extra_writes = 0; extra_writes <= 1; ++extra_writes) {
    for (const int delay_us : {0, 3000}) {
      SCOPED_TRACE(str(extra_writes, " extra device writes, transfers of ", delay_us, " us"));
      auto m = make(600 * kKiB, 1024 * kKiB, 16 << 20, config(3000));
      const auto ids = register_six(*m.engine, n);
      m.mover->delay_us = delay_us;
      std::vector<float> want(6);
      for (int i = 0; i < 6; ++i) want[static_cast<std::size_t>(i)] = static_cast<float>(i * 1000);
      auto use = [&](int i, Tier tier, Access access) {
        auto lease = m.engine->acquire(ids[static_cast<std::size_t>(i)], tier, access).wait_for(10000ms);
        ASSERT_TRUE(lease.ok()) << "tensor " << i << ": " << lease.status();
        float* f = static_cast<float*>(lease->data());
        if (access != Access::kWrite) {
          float v = -1;
          EXPECT_TRUE(consistent(f, n, &v));
          EXPECT_EQ(v, want[static_cast<std::size_t>(i)]) << "tensor " << i;
        }
        if (access != Access::kRead) fill(f, n, ++want[static_cast<std::size_t>(i)]);
        ASSERT_TRUE(lease->release().ok());
      };
      use(2, Tier::kHost, Access::kWrite);
      use(3, Tier::kHost, Access::kWrite);
      use(0, Tier::kDevice, Access::kReadWrite);
      if (extra_writes) use(1, Tier::kDevice, Access::kWrite);
      use(5, Tier::kDevice, Access::kWrite);
      use(0, Tier::kDevice, Access::kRead);
      AcquireFuture given_up = m.engine->acquire(ids[3], Tier::kDevice, Access::kWrite);
      given_up.cancel();
      use(4, Tier::kDevice, Access::kWrite);
      EXPECT_EQ(given_up.wait().status().code(), StatusCode::kCancelled);
      use(3, Tier::kDevice, Access::kReadWrite);  // the given-up writer let go of it
      ASSERT_TRUE(m.engine->check_invariants().ok()) << m.engine->check_invariants();
      ASSERT_TRUE(m.engine->flush().ok());
      std::vector<float> back(n);
      for (int i = 0; i < 6; ++i) {
        ASSERT_TRUE(m.engine->read(ids[static_cast<std::size_t>(i)], back.data()).ok());
        float v = -1;
        EXPECT_TRUE(consistent(back.data(), n, &v)) << "tensor " << i;
        EXPECT_EQ(v, want[static_cast<std::size_t>(i)]) << "tensor " << i;
      }
    }
  }
}

// Threads acquiring device writes with room to spare for only some of them, half of them given
// up at once or after a short wait: the reported crash within 40 ms.
TEST(EngineCancel, ThreadsAcquiringAndGivingUpOnAFullDevice) {
  const std::size_t n = 16 * kKiB;  // 64 KiB
  auto m = make(150 * kKiB, 512 * kKiB, 16 << 20, config(20000));
  const auto ids = register_six(*m.engine, n);
  m.mover->delay_us = 200;
  std::atomic<int> bad{0};
  auto worker = [&](unsigned seed) {
    std::mt19937 rng(seed);
    for (int op = 0; op < 150; ++op) {
      const TensorId id = ids[rng() % 6];
      const Access access = rng() % 2 ? Access::kWrite : Access::kRead;
      AcquireFuture f = m.engine->acquire(id, Tier::kDevice, access);
      switch (rng() % 3) {
        case 0: f.cancel(); break;
        case 1: {
          auto l = f.wait_for(std::chrono::microseconds(rng() % 500) > 250us ? 1ms : 0ms);
          if (l.ok()) {
            if (!l->abandon().ok()) ++bad;
          } else {
            f.cancel();
          }
          break;
        }
        default: {
          auto l = f.wait();
          if (!l.ok() || !l->abandon().ok()) ++bad;
        }
      }
    }
  };
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < 3; ++t) threads.emplace_back(worker, 11 + t);
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  ASSERT_TRUE(m.engine->check_invariants().ok()) << m.engine->check_invariants();
  expect_registered_contents(*m.engine, ids, n);
}

// A write acquire that waits for device room and is given up lets go of the tensor at once: its
// room request leaves the queue, and the next writer of that tensor does not wait for the room.
// A device of room for two of register_six's tensors (64K floats each), both held by read leases,
// and an acquire timeout (60 s) no test waits for.
struct FullDevice {
  static constexpr std::size_t n = 64 * kKiB;
  MemoryEngine m = make(512 * kKiB, 2048 * kKiB, 16 << 20, config(60000));
  std::vector<TensorId> ids = register_six(*m.engine, n);
  Result<Lease> a = m.engine->acquire_now(ids[0], Tier::kDevice, Access::kRead);
  Result<Lease> b = m.engine->acquire_now(ids[1], Tier::kDevice, Access::kRead);
};

TEST(EngineCancel, GivenUpRoomWaiterLeavesTheQueue) {
  FullDevice f;
  auto& m = f.m;
  auto& a = f.a;
  auto& b = f.b;
  const auto& ids = f.ids;
  ASSERT_TRUE(a.ok() && b.ok());
  AcquireFuture waiting = m.engine->acquire(ids[2], Tier::kDevice, Access::kWrite);  // no room: queued
  EXPECT_FALSE(waiting.wait_for(50ms).ok());
  waiting.cancel();
  // The tensor is free again (no 60 s wait for the room request's timeout).
  auto again = m.engine->acquire(ids[2], Tier::kHost, Access::kWrite);
  auto lease = again.wait_for(5000ms);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(lease->abandon().ok());
  ASSERT_TRUE(m.engine->check_invariants().ok()) << m.engine->check_invariants();
  EXPECT_EQ(m.engine->info(ids[2])->writer, false);
  ASSERT_TRUE(a->release().ok());
  ASSERT_TRUE(b->release().ok());
  ASSERT_TRUE(m.engine->check_invariants().ok()) << m.engine->check_invariants();
}

// A read acquire whose load waits for device room, given up, lets go at once too: the load
// leaves the queue and unpins its host copy, so the tensor has no reader left and a flush does not
// wait behind it. (The load kept waiting until its timeout, pinning the host copy, and a flush
// that needed that host room timed out: found by fuzz_engine_ops.) A load another acquire still
// waits for goes on.
TEST(EngineCancel, GivenUpReadLeavesTheRoomQueueUnlessAnotherAcquireWaits) {
  FullDevice f;
  auto& m = f.m;
  auto& a = f.a;
  auto& b = f.b;
  const auto& ids = f.ids;
  const std::size_t n = FullDevice::n;
  ASSERT_TRUE(a.ok() && b.ok());
  AcquireFuture alone = m.engine->acquire(ids[2], Tier::kDevice, Access::kRead);  // no room: queued
  EXPECT_FALSE(alone.wait_for(50ms).ok());
  EXPECT_GT(m.engine->info(ids[2])->readers, 0u);  // the load, and the acquire waiting for it
  alone.cancel();
  ASSERT_TRUE(m.engine->flush().ok());  // no 60 s wait
  EXPECT_EQ(m.engine->info(ids[2])->readers, 0u);
  EXPECT_STREQ(m.engine->info(ids[2])->copy_state[static_cast<int>(Tier::kDevice)], "absent");
  ASSERT_TRUE(m.engine->check_invariants().ok()) << m.engine->check_invariants();

  // Two acquires wait for one load; one gives up, the other gets the tensor when room comes.
  AcquireFuture gives_up = m.engine->acquire(ids[3], Tier::kDevice, Access::kRead);
  AcquireFuture stays = m.engine->acquire(ids[3], Tier::kDevice, Access::kRead);
  EXPECT_FALSE(gives_up.wait_for(50ms).ok());
  gives_up.cancel();
  ASSERT_TRUE(m.engine->check_invariants().ok()) << m.engine->check_invariants();
  EXPECT_FALSE(stays.ready());
  ASSERT_TRUE(a->release().ok());
  auto lease = stays.wait_for(5000ms);
  ASSERT_TRUE(lease.ok()) << lease.status();
  float v = -1;
  EXPECT_TRUE(consistent(static_cast<const float*>(lease->data()), n, &v));
  EXPECT_EQ(v, 3000.0f);
  ASSERT_TRUE(lease->release().ok());
  ASSERT_TRUE(b->release().ok());
  ASSERT_TRUE(m.engine->flush().ok());
  ASSERT_TRUE(m.engine->check_invariants().ok()) << m.engine->check_invariants();
  expect_registered_contents(*m.engine, ids, n);
}

// Giving up in each state: blocked behind a reader, loading from NVMe, granted and never taken.
TEST(EngineCancel, GiveUpInEveryStateKeepsContentsAndInvariants) {
  const std::size_t n = 16 * kKiB;
  auto m = make(256 * kKiB, 512 * kKiB, 16 << 20);
  m.mover->delay_us = 2000;  // loads stay in flight long enough to be given up
  const auto ids = register_six(*m.engine, n);
  for (int round = 0; round < 20; ++round) {
    const TensorId id = ids[static_cast<std::size_t>(round % 6)];
    const Tier tier = round % 2 ? Tier::kDevice : Tier::kHost;
    const Access access = round % 3 == 0 ? Access::kWrite : (round % 3 == 1 ? Access::kReadWrite : Access::kRead);
    AcquireFuture f = m.engine->acquire(id, tier, access);
    if (round % 4 == 1) std::this_thread::sleep_for(5ms);  // granted by now, never taken
    f.cancel();
    EXPECT_EQ(f.wait().status().code(), StatusCode::kCancelled);
  }
  m.mover->delay_us = 0;
  ASSERT_TRUE(m.engine->flush().ok());
  ASSERT_TRUE(m.engine->check_invariants().ok()) << m.engine->check_invariants();
  expect_registered_contents(*m.engine, ids, n);
  for (int i = 0; i < 6; ++i) {
    auto info = m.engine->info(ids[static_cast<std::size_t>(i)]);
    EXPECT_FALSE(info->writer);
    EXPECT_EQ(info->readers, 0u);
  }
}

// Leases and futures may outlive the engine: releasing, abandoning or giving up afterwards does
// nothing (it used to reach into the destroyed engine), and an acquire still blocked behind a
// lease when the engine goes is answered instead of waiting forever.
TEST(EngineLifetime, LeasesAndFuturesOutliveTheEngine) {
  const std::size_t n = 4 * kKiB;
  auto m = make(64 * kKiB, 256 * kKiB, 1 << 20);
  const auto ids = register_six(*m.engine, n);
  auto reader = m.engine->acquire_now(ids[0], Tier::kDevice, Access::kRead);
  ASSERT_TRUE(reader.ok()) << reader.status();
  auto writer = m.engine->acquire_now(ids[1], Tier::kHost, Access::kWrite);
  ASSERT_TRUE(writer.ok()) << writer.status();
  AcquireFuture blocked = m.engine->acquire(ids[0], Tier::kHost, Access::kWrite);  // behind the reader
  AcquireFuture not_taken = m.engine->acquire(ids[2], Tier::kHost, Access::kRead);
  AcquireFuture given_up = m.engine->acquire(ids[1], Tier::kHost, Access::kRead);  // behind the writer
  EXPECT_FALSE(blocked.wait_for(20ms).ok());
  m.engine.reset();
  auto late = blocked.wait_for(5000ms);
  EXPECT_EQ(late.status().code(), StatusCode::kCancelled) << late.status();
  EXPECT_TRUE(reader->release().ok());
  EXPECT_TRUE(writer->abandon().ok());
  given_up.cancel();
  EXPECT_EQ(given_up.wait().status().code(), StatusCode::kCancelled);
  auto granted = not_taken.wait_for(5000ms);  // granted before the engine went: a dead lease
  if (granted.ok()) {
    EXPECT_TRUE(granted->release().ok());
  }
}

// The model-based test. Each thread owns a disjoint set of tensors for writing (so the model knows
// every tensor's version exactly) and reads any tensor; operations are random: acquire and wait,
// acquire and give up at once, acquire and give up after a short wait, write, flush. Budgets are
// small, so acquires queue for room and evict; some runs fail the NVMe links now and then.
struct ModelRun {
  unsigned seed;
  bool faults;
};

class EngineModel : public ::testing::TestWithParam<ModelRun> {};

TEST_P(EngineModel, RandomAcquireReleaseGiveUpAndFlushKeepDataAndInvariants) {
  const ModelRun run = GetParam();
  const std::size_t n = 4 * kKiB;  // 16 KiB tensors
  constexpr int kThreads = 4;
  constexpr int kPerThread = 4;
  constexpr int kTensors = kThreads * kPerThread;
  // The device holds 3 tensors; the host its 4 home tensors and 8 more, so that writers waiting
  // for room (each holds its tensor's writer lock, which keeps that tensor's host copy from being
  // written back) can never fill it: see "Known limits" in docs/design.md.
  auto m = make(3 * n * 4, 12 * n * 4, 64 * n * 4, config(20000));
  m.mover->delay_us = static_cast<int>(run.seed % 3) * 100;  // instant, or transfers that overlap
  std::vector<TensorId> ids;
  std::vector<std::atomic<int>> version(kTensors);
  std::vector<float> v(n);
  for (int i = 0; i < kTensors; ++i) {
    fill(v.data(), n, static_cast<float>(i * 100000));
    auto id = m.engine->register_tensor(desc(str("m", i), n), i % 4 == 0 ? Tier::kHost : Tier::kNvme, v.data());
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
    version[i] = 0;
  }
  std::atomic<int> bad{0}, failed{0}, cancelled_ops{0}, ops_done{0};
  std::atomic<bool> stop_faults{false};
  std::thread faulter;
  if (run.faults) {
    faulter = std::thread([&] {
      std::mt19937 rng(run.seed * 7);
      while (!stop_faults) {
        const bool on = rng() % 3 == 0;
        m.mover->fail_link(Tier::kNvme, Tier::kHost, on);
        m.mover->fail_link(Tier::kHost, Tier::kNvme, on && rng() % 2);
        std::this_thread::sleep_for(std::chrono::microseconds(300 + rng() % 700));
      }
      m.mover->fail_link(Tier::kNvme, Tier::kHost, false);
      m.mover->fail_link(Tier::kHost, Tier::kNvme, false);
    });
  }
  auto worker = [&](int t) {
    std::mt19937 rng(run.seed * 100 + static_cast<unsigned>(t));
    for (int op = 0; op < 250; ++op) {
      const bool write = rng() % 3 == 0;
      const int i = write ? t * kPerThread + static_cast<int>(rng() % kPerThread) : static_cast<int>(rng() % kTensors);
      const Tier tier = rng() % 2 ? Tier::kDevice : Tier::kHost;
      // kWrite skips the load and reserves fresh room: the path where a writer queues for room.
      const Access access = write ? (rng() % 2 ? Access::kReadWrite : Access::kWrite) : Access::kRead;
      const unsigned what = rng() % 10;
      if (what == 0) {
        if (!m.engine->flush().ok()) ++failed;  // may fail while links fail; must not corrupt
        continue;
      }
      AcquireFuture f = m.engine->acquire(ids[static_cast<std::size_t>(i)], tier, access);
      if (what == 1) {  // give up at once
        f.cancel();
        ++cancelled_ops;
        continue;
      }
      if (what == 2) {  // give up after a short wait, unless it came in time
        auto early = f.wait_for(rng() % 2 ? 0ms : 1ms);
        if (!early.ok()) {
          f.cancel();
          ++cancelled_ops;
          continue;
        }
        // Granted in time: give it back unused.
        if (!early->abandon().ok()) ++bad;
        continue;
      }
      auto lease = f.wait();
      if (!lease.ok()) {
        if (!run.faults) ADD_FAILURE() << lease.status();
        ++failed;  // an injected I/O error or a timeout: the data must still be intact
        continue;
      }
      float* p = static_cast<float*>(lease->data());
      if (p == nullptr) {
        auto info = m.engine->info(ids[static_cast<std::size_t>(i)]);
        ADD_FAILURE() << "a granted lease of tensor " << i << " has no memory (lease tier " << tier_name(lease->tier())
                      << ", " << access_name(lease->access()) << ", " << lease->bytes() << " bytes; copies "
                      << info->copy_state[0] << "/" << info->copy_state[1] << "/" << info->copy_state[2] << ")";
        ++bad;
        continue;
      }
      const float base = static_cast<float>(i * 100000);
      if (access != Access::kWrite) {
        float seen = -1;
        if (!consistent(p, n, &seen)) ++bad;
        if (seen < base || (write && seen != base + static_cast<float>(version[i].load()))) ++bad;
      }
      if (write) {
        fill(p, n, base + static_cast<float>(version[i].load() + 1));
        version[i].fetch_add(1);
      }
      if (!lease->release().ok()) ++bad;
      ++ops_done;
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  stop_faults = true;
  if (faulter.joinable()) faulter.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(ops_done.load(), 0);
  EXPECT_GT(cancelled_ops.load(), 0);
  if (!run.faults) {
    EXPECT_EQ(failed.load(), 0);
  }
  ASSERT_TRUE(m.engine->check_invariants().ok()) << m.engine->check_invariants();
  ASSERT_TRUE(m.engine->flush().ok());
  std::vector<float> back(n);
  for (int i = 0; i < kTensors; ++i) {
    ASSERT_TRUE(m.engine->read(ids[static_cast<std::size_t>(i)], back.data()).ok());
    float seen = -1;
    EXPECT_TRUE(consistent(back.data(), n, &seen)) << "tensor " << i;
    EXPECT_EQ(seen, static_cast<float>(i * 100000 + version[i].load())) << "tensor " << i;
    auto info = m.engine->info(ids[static_cast<std::size_t>(i)]);
    EXPECT_STREQ(info->copy_state[static_cast<int>(info->home)], "valid_clean") << "tensor " << i;
    EXPECT_FALSE(info->writer);
    EXPECT_EQ(info->readers, 0u);
  }
  ASSERT_TRUE(m.engine->check_invariants().ok()) << m.engine->check_invariants();
}

std::vector<ModelRun> model_runs() {
  std::vector<ModelRun> runs;
  for (unsigned s = 1; s <= 8; ++s) runs.push_back({s, s % 2 == 0});
  return runs;
}

INSTANTIATE_TEST_SUITE_P(Seeds, EngineModel, ::testing::ValuesIn(model_runs()),
                         [](const ::testing::TestParamInfo<ModelRun>& i) {
                           return str("seed", i.param.seed, i.param.faults ? "_faults" : "");
                         });

}  // namespace
}  // namespace tier
