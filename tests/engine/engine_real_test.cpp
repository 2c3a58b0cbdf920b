// The engine on its real tiers: the emulated device (the GPU with TIER_TEST_DEVICE=cuda, as
// bench/gpu_check.sh runs it), the pinned host arena and a swap space on disk through each I/O
// engine. Data integrity under random concurrent use, injected NVMe
// failures, and the stats of a real run.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include "engine/backend.hpp"
#include "tier/ext/device.hpp"
#include "tier/engine.hpp"
#include "tier/ext/fault_injecting_engine.hpp"
#include "tier/ext/host_arena.hpp"
#include "tier/ext/io_engine.hpp"

namespace tier {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path;
  explicit TempDir(const fs::path& root) {
    path = root / str("tier-engine-test-", getpid(), "-", counter()++);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  static int& counter() {
    static int c = 0;
    return c;
  }
};

// TIER_TEST_DEVICE=cuda: the tests built on real_config run on the GPU, and fail (not skip) where
// there is none, so that a GPU run cannot pass without using it.
DeviceKind test_device() {
  const char* d = std::getenv("TIER_TEST_DEVICE");
  return d != nullptr && std::string(d) == "cuda" ? DeviceKind::kCuda : DeviceKind::kEmulated;
}

EngineConfig real_config(const std::string& swap_dir, IoEngineKind io) {
  EngineConfig c;
  c.tier.device = test_device();
  c.tier.device_budget = 1u << 20;
  c.tier.host_budget = 1u << 20;  // 16 of the 24 test tensors: the rest come from NVMe
  c.tier.nvme_budget = 64u << 20;
  c.tier.swap_paths = {swap_dir};
  c.tier.io.engine = io;
  c.tier.debug_checks = true;
  c.tier.acquire_timeout_ms = 10000;
  c.tier.huge_pages = HugePageMode::kOff;
  c.aio.block_size = 64 * 1024;
  c.aio.queue_depth = 8;
  return c;
}

std::vector<std::uint32_t> words(std::size_t n, std::uint32_t seed) {
  std::vector<std::uint32_t> v(n);
  std::mt19937 rng(seed);
  for (auto& x : v) x = rng();
  return v;
}

// Hooks that wrap each of the engine's I/O engines in a fault injector the test can reach.
struct Injectors {
  std::mutex mu;
  std::vector<nvme::FaultInjectingEngine*> all;
  detail::EngineHooks hooks() {
    detail::EngineHooks h;
    h.wrap_io_engine = [this](std::unique_ptr<nvme::IoEngine> inner) -> std::unique_ptr<nvme::IoEngine> {
      auto f = std::make_unique<nvme::FaultInjectingEngine>(std::move(inner));
      std::lock_guard<std::mutex> lock(mu);
      all.push_back(f.get());
      return f;
    };
    return h;
  }
  // fn(injector) for each, under the lock; false when the engine made none.
  template <class F>
  bool each(F&& fn) {
    std::lock_guard<std::mutex> lock(mu);
    for (auto* f : all) fn(*f);
    return !all.empty();
  }
};

class RealEngine : public testing::TestWithParam<IoEngineKind> {};

TEST_P(RealEngine, RandomConcurrentUseKeepsEveryByte) {
  TempDir dir(fs::temp_directory_path());
  auto engine = Engine::create(real_config(dir.path.string(), GetParam()));
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = **engine;
  const int kTensors = 24;
  const std::size_t n = 16 * 1024;  // 64 KiB each: 16 fit on the device, 16 on the host
  std::vector<TensorId> ids;
  std::vector<std::vector<std::uint32_t>> truth;
  for (int i = 0; i < kTensors; ++i) {
    truth.push_back(words(n, static_cast<std::uint32_t>(i)));
    auto id = e.register_tensor({str("t", i), DType::kI32, n, Role::kParam, i}, i % 4 == 0 ? Tier::kHost : Tier::kNvme,
                                truth.back().data());
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  std::vector<std::mutex> locks(kTensors);  // the test's own record of what each tensor must hold
  std::atomic<int> mismatches{0};
  auto worker = [&](int seed) {
    std::mt19937 rng(seed);
    for (int op = 0; op < 120; ++op) {
      const int i = static_cast<int>(rng() % kTensors);
      const Tier tier = rng() % 3 == 0 ? Tier::kHost : Tier::kDevice;
      const bool write = rng() % 3 == 0;
      std::lock_guard<std::mutex> guard(locks[i]);
      auto lease = e.acquire_now(ids[i], tier, write ? Access::kReadWrite : Access::kRead);
      ASSERT_TRUE(lease.ok()) << lease.status();
      auto* w = static_cast<std::uint32_t*>(lease->data());
      if (std::memcmp(w, truth[i].data(), n * 4) != 0) ++mismatches;
      if (write) {
        for (std::size_t k = 0; k < n; k += 97) truth[i][k] = w[k] = static_cast<std::uint32_t>(rng());
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) threads.emplace_back(worker, 100 + t);
  for (auto& t : threads) t.join();
  EXPECT_EQ(mismatches.load(), 0);
  ASSERT_TRUE(e.flush().ok());
  for (int i = 0; i < kTensors; ++i) {
    std::vector<std::uint32_t> back(n);
    ASSERT_TRUE(e.read(ids[i], back.data()).ok());
    EXPECT_EQ(back, truth[i]) << "tensor " << i;
  }
  EXPECT_TRUE(e.check_invariants().ok()) << e.check_invariants();
  const auto s = e.stats();
  EXPECT_GT(s.link(Link::kHostToNvme).bytes, 0u);
  EXPECT_GT(s.link(Link::kNvmeToHost).bytes, 0u);
  EXPECT_GT(s.link(Link::kHostToDevice).bytes, 0u);
  EXPECT_LE(s.tier(Tier::kDevice).peak_bytes, 1u << 20);
  if (test_device() == DeviceKind::kCuda) {
    EXPECT_EQ(s.info.at("device").rfind("cuda: ", 0), 0u) << s.info.at("device");
  } else {
    EXPECT_EQ(s.info.at("device"), "emulated");
  }
  EXPECT_FALSE(s.info.at("io_engine").empty());
}

// The same on every I/O engine with acquires given up at random points (at once, after a short
// wait, granted and never taken) and NVMe requests failing now and then: every byte of every
// tensor is what its last released write left, and the state machine's invariants hold.
TEST_P(RealEngine, GiveUpsAndInjectedFaultsKeepEveryByte) {
  TempDir dir(fs::temp_directory_path());
  Injectors injectors;
  const detail::EngineHooks hooks = injectors.hooks();
  auto engine = detail::create_engine(real_config(dir.path.string(), GetParam()), hooks);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = **engine;
  const int kTensors = 20;
  const std::size_t n = 16 * 1024;  // 64 KiB each
  std::vector<TensorId> ids;
  std::vector<std::vector<std::uint32_t>> truth;
  for (int i = 0; i < kTensors; ++i) {
    truth.push_back(words(n, static_cast<std::uint32_t>(1000 + i)));
    auto id = e.register_tensor({str("g", i), DType::kI32, n, Role::kParam, i}, i % 5 == 0 ? Tier::kHost : Tier::kNvme,
                                truth.back().data());
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  ASSERT_TRUE(e.flush().ok());
  ASSERT_TRUE(injectors.each([](nvme::FaultInjectingEngine& f) {
    for (std::uint64_t k = 7; k < 400; k += 23) f.fail_nth(k, EIO);  // about one request in 23
  }));
  std::vector<std::mutex> locks(kTensors);
  std::atomic<int> mismatches{0}, gave_up{0}, failed{0};
  auto worker = [&](int seed) {
    std::mt19937 rng(seed);
    for (int op = 0; op < 100; ++op) {
      const int i = static_cast<int>(rng() % kTensors);
      const Tier tier = rng() % 3 == 0 ? Tier::kHost : Tier::kDevice;
      const bool write = rng() % 3 == 0;
      const unsigned how = rng() % 4;
      std::lock_guard<std::mutex> guard(locks[i]);
      AcquireFuture f = e.acquire(ids[i], tier, write ? Access::kReadWrite : Access::kRead);
      if (how == 0) {
        f.cancel();
        ++gave_up;
        continue;
      }
      if (how == 1) {
        std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
        f.cancel();  // granted by now or not: either way nothing changes
        ++gave_up;
        continue;
      }
      auto lease = f.wait();
      if (!lease.ok()) {
        if (lease.status().code() != StatusCode::kIoError) ADD_FAILURE() << lease.status();
        ++failed;
        continue;
      }
      auto* w = static_cast<std::uint32_t*>(lease->data());
      if (std::memcmp(w, truth[i].data(), n * 4) != 0) ++mismatches;
      if (write) {
        for (std::size_t k = 0; k < n; k += 97) truth[i][k] = w[k] = static_cast<std::uint32_t>(rng());
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) threads.emplace_back(worker, 300 + t);
  for (auto& t : threads) t.join();
  std::uint64_t injected = 0;
  injectors.each([&](nvme::FaultInjectingEngine& f) {
    injected += f.counters().errors;
    f.clear_faults();
  });
  EXPECT_GT(injected, 0u);
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_GT(gave_up.load(), 0);
  Status flushed = e.flush();
  if (!flushed.ok()) flushed = e.flush();  // a write-back may have failed just before the faults ended
  ASSERT_TRUE(flushed.ok()) << flushed;
  for (int i = 0; i < kTensors; ++i) {
    std::vector<std::uint32_t> back(n);
    ASSERT_TRUE(e.read(ids[i], back.data()).ok());
    EXPECT_EQ(back, truth[i]) << "tensor " << i;
  }
  EXPECT_TRUE(e.check_invariants().ok()) << e.check_invariants();
}

INSTANTIATE_TEST_SUITE_P(Engines, RealEngine,
                         testing::Values(IoEngineKind::kUring, IoEngineKind::kAio, IoEngineKind::kPosix),
                         [](const testing::TestParamInfo<IoEngineKind>& i) { return io_engine_kind_name(i.param); });

TEST(RealEngine, FailedNvmeReadLeavesTheHomeCopyValidAndReportsTheError) {
  TempDir dir(fs::temp_directory_path());
  Injectors injectors;
  const detail::EngineHooks hooks = injectors.hooks();
  EngineConfig cfg = real_config(dir.path.string(), IoEngineKind::kPosix);
  cfg.tier.host_budget = 1u << 20;  // room for one tensor: the other must come from NVMe
  auto engine = detail::create_engine(cfg, hooks);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = **engine;
  const std::size_t n = 256 * 1024;  // 1 MiB
  auto a_data = words(n, 1), b_data = words(n, 2);
  auto a = e.register_tensor({"a", DType::kI32, n}, Tier::kNvme, a_data.data());
  auto b = e.register_tensor({"b", DType::kI32, n}, Tier::kNvme, b_data.data());
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(e.flush().ok());
  ASSERT_TRUE(injectors.each([](nvme::FaultInjectingEngine& f) { f.fail_nth(1, EIO, nvme::IoOp::kRead); }));
  // "a" was pushed out of the host by "b": reading it needs the NVMe, whose next read fails.
  auto lease = e.acquire_now(*a, Tier::kDevice, Access::kRead);
  ASSERT_FALSE(lease.ok());
  EXPECT_EQ(lease.status().code(), StatusCode::kIoError) << lease.status();
  EXPECT_NE(lease.status().message().find("'a'"), std::string::npos) << lease.status();
  auto info = e.info(*a);
  ASSERT_TRUE(info.ok());
  EXPECT_STREQ(info->copy_state[static_cast<int>(Tier::kNvme)], "valid_clean");
  EXPECT_TRUE(e.check_invariants().ok());
  // The fault was one request: the next attempt reads the intact home copy.
  std::vector<std::uint32_t> back(n);
  ASSERT_TRUE(e.read(*a, back.data()).ok());
  EXPECT_EQ(back, a_data);
}

// A home copy that cannot fit a tier holding only home copies is refused at once, with the
// numbers, instead of waiting out the acquire timeout for room nothing would free.
TEST(RealEngine, AHomeThatCannotFitIsRefusedAtOnce) {
  TempDir dir(fs::temp_directory_path());
  EngineConfig cfg = real_config(dir.path.string(), IoEngineKind::kPosix);
  cfg.tier.nvme_budget = 1u << 20;
  cfg.tier.acquire_timeout_ms = 20000;
  auto engine = Engine::create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = **engine;
  const std::size_t n = 64 * 1024;  // 256 KiB
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(e.register_tensor({str("w", i), DType::kI32, n}, Tier::kNvme).ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto more = e.register_tensor({"one_too_many", DType::kI32, n}, Tier::kNvme);
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(more.ok());
  EXPECT_EQ(more.status().code(), StatusCode::kResourceExhausted) << more.status();
  EXPECT_NE(more.status().message().find("'one_too_many'"), std::string::npos) << more.status();
  EXPECT_NE(more.status().message().find("tier.budgets.nvme"), std::string::npos) << more.status();
  EXPECT_LT(waited, std::chrono::seconds(10));  // not the 20 s acquire timeout
  EXPECT_FALSE(e.find("one_too_many").ok());    // nothing is left of it
  EXPECT_TRUE(e.check_invariants().ok());
  // Room made by an unregister serves the next registration.
  ASSERT_TRUE(e.unregister_tensor(*e.find("w0")).ok());
  EXPECT_TRUE(e.register_tensor({"fits_now", DType::kI32, n}, Tier::kNvme).ok());
}

TEST(RealEngine, OddSizedTensorsRoundTripThroughDirectIo) {
  TempDir dir(fs::temp_directory_path());
  EngineConfig cfg = real_config(dir.path.string(), IoEngineKind::kUring);
  cfg.tier.host_budget = 48 * 1024;  // the largest tensor and little else: the rest come back from NVMe
  auto engine = Engine::create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<TensorId> ids;
  std::vector<std::vector<std::uint32_t>> truth;
  for (std::size_t n : {1u, 3u, 127u, 1000u, 1025u, 4097u, 10000u}) {
    truth.push_back(words(n, static_cast<std::uint32_t>(n)));
    auto id = (*engine)->register_tensor({str("odd", n), DType::kI32, n}, Tier::kNvme, truth.back().data());
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  ASSERT_TRUE((*engine)->flush().ok());
  for (int round = 0; round < 2; ++round) {
    for (std::size_t i = 0; i < ids.size(); ++i) {
      auto lease = (*engine)->acquire_now(ids[i], Tier::kDevice, Access::kRead);
      ASSERT_TRUE(lease.ok()) << lease.status();
      EXPECT_EQ(std::memcmp(lease->data(), truth[i].data(), truth[i].size() * 4), 0) << "tensor " << i;
    }
  }
  EXPECT_GT((*engine)->stats().link(Link::kNvmeToHost).bytes, 0u);
}

TEST(RealEngine, NvmeTierWithoutAPathIsAClearError) {
  EngineConfig c;
  c.tier.device = DeviceKind::kEmulated;
  c.tier.host_budget = 4u << 20;
  c.tier.nvme_budget = 1u << 20;
  auto e = Engine::create(c);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("nvme_path"), std::string::npos) << e.status();
}

TEST(RealEngine, EngineWithoutNvmeServesDeviceAndHost) {
  EngineConfig c;
  c.tier.device = DeviceKind::kEmulated;
  c.tier.device_budget = 1u << 20;
  c.tier.host_budget = 2u << 20;
  auto e = Engine::create(c);
  ASSERT_TRUE(e.ok()) << e.status();
  auto data = words(1000, 7);
  auto id = (*e)->register_tensor({"w", DType::kI32, 1000}, Tier::kHost, data.data());
  ASSERT_TRUE(id.ok());
  auto lease = (*e)->acquire_now(*id, Tier::kDevice, Access::kRead);
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(std::memcmp(lease->data(), data.data(), 4000), 0);
  EXPECT_FALSE((*e)->register_tensor({"x", DType::kI32, 10}, Tier::kNvme).ok());
}

// The host arena and the swap space hand out 4 KiB blocks: a budget counts those, so that many
// small tensors cannot take more memory than the budget says.
TEST(RealEngine, BudgetsCountTheBlocksTheStoresAllocate) {
  EngineConfig c;
  c.tier.device = DeviceKind::kEmulated;
  c.tier.device_budget = 1u << 20;
  c.tier.host_budget = 64u << 10;  // sixteen 4 KiB blocks
  c.tier.acquire_timeout_ms = 100;
  auto e = Engine::create(c);
  ASSERT_TRUE(e.ok()) << e.status();
  auto data = words(25, 3);  // 100 bytes each
  int placed = 0;
  Status refused;
  for (int i = 0; i < 32 && refused.ok(); ++i) {
    auto id = (*e)->register_tensor({str("small", i), DType::kI32, 25}, Tier::kHost, data.data());
    if (id.ok()) {
      ++placed;
    } else {
      refused = id.status();
    }
  }
  EXPECT_EQ(placed, 16);
  EXPECT_FALSE(refused.ok());
  const auto host = (*e)->stats().tiers[static_cast<int>(Tier::kHost)];
  EXPECT_EQ(host.resident_bytes, 16u * 4096u);
  EXPECT_LE(host.resident_bytes, host.budget_bytes);
  EXPECT_TRUE((*e)->check_invariants().ok());
}

// The default (auto) host budget is a cap of a quarter of the machine's memory: creating the
// engine touches none of it, and the extents its blocks reach are pinned and registered (device,
// io_uring fixed buffers) as they are used, which the stats report.
TEST(RealEngine, AutoHostBudgetPinsTheArenaAsItIsUsedAndSaysSo) {
  TempDir dir(fs::temp_directory_path());
  EngineConfig c;
  c.tier.device = test_device();
  c.tier.device_budget = 4u << 20;
  ASSERT_EQ(c.tier.host_budget, 0u) << "the default is the auto budget";
  c.tier.swap_paths = {dir.path.string()};
  c.tier.nvme_budget = 64u << 20;
  c.tier.io.use_direct = false;  // the temporary directory may be tmpfs
  const bool uring = nvme::probe_io_engine(IoEngineKind::kUring).ok();
  if (uring) c.tier.io.engine = IoEngineKind::kUring;
  const auto t0 = std::chrono::steady_clock::now();
  auto e = Engine::create(c);
  const double create_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(e.ok()) << e.status();
  HostArena& arena = (*e)->host_arena();
  EXPECT_TRUE(arena.lazy());
  EXPECT_EQ(arena.committed_bytes(), 0u) << "creation commits nothing of the cap";
  EXPECT_LT(create_s, 2.0) << "Engine::create with the auto host budget must not touch the cap";
  RecordProperty("create_seconds", std::to_string(create_s));

  auto data = words(256 << 10, 11);  // 1 MiB
  std::vector<TensorId> ids;
  for (int i = 0; i < 3; ++i) {
    auto id = (*e)->register_tensor({str("w", i), DType::kI32, data.size()}, Tier::kNvme, data.data());
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  for (TensorId id : ids) {
    auto lease = (*e)->acquire_now(id, Tier::kDevice, Access::kRead);
    ASSERT_TRUE(lease.ok()) << lease.status();
    ASSERT_TRUE(lease->release().ok());
    std::vector<std::uint32_t> back(data.size());
    ASSERT_TRUE((*e)->read(id, back.data()).ok());
    EXPECT_EQ(back, data);
  }
  const std::uint64_t committed = arena.committed_bytes();
  EXPECT_GT(committed, 0u);
  EXPECT_LT(committed, arena.capacity()) << "only what was used";
  const auto host = (*e)->stats().tiers[static_cast<int>(Tier::kHost)];
  if (arena.locked()) {
    EXPECT_EQ(host.pinned_bytes, committed);
  } else {
    EXPECT_EQ(host.pinned_bytes, 0u) << "mlock refused here: nothing is pinned";
  }
  EXPECT_EQ(host.device_registered_bytes, committed);
  const auto swap_fixed = (*e)->stats().info.at("nvme.fixed_buffers");
  if (swap_fixed == "true") {
    EXPECT_EQ(host.io_registered_bytes, committed);
  } else {
    EXPECT_EQ(host.io_registered_bytes, 0u);
  }
  const std::string json = (*e)->stats().to_json();
  EXPECT_NE(json.find("\"pinned_bytes\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"device_registered_bytes\""), std::string::npos);
  EXPECT_NE(json.find("\"io_registered_bytes\""), std::string::npos);
  EXPECT_NE((*e)->stats().info.at("host").find("auto budget: pinned and registered"), std::string::npos)
      << (*e)->stats().info.at("host");
}

// An explicit budget is pinned and registered whole at creation.
TEST(RealEngine, ExplicitHostBudgetIsPinnedAndRegisteredWholeAtStart) {
  EngineConfig c;
  c.tier.device = test_device();
  c.tier.device_budget = 1u << 20;
  c.tier.host_budget = 4u << 20;
  auto e = Engine::create(c);
  ASSERT_TRUE(e.ok()) << e.status();
  HostArena& arena = (*e)->host_arena();
  EXPECT_FALSE(arena.lazy());
  EXPECT_EQ(arena.committed_bytes(), arena.capacity());
  const auto host = (*e)->stats().tiers[static_cast<int>(Tier::kHost)];
  EXPECT_EQ(host.pinned_bytes, arena.locked() ? arena.capacity() : 0u);
  EXPECT_EQ(host.device_registered_bytes, arena.capacity());
  EXPECT_EQ(host.io_registered_bytes, 0u) << "no NVMe tier";
}

}  // namespace
}  // namespace tier
