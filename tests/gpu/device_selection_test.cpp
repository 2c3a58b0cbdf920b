// create_device(): tier.device auto|cuda|emulated, the options taken from EngineConfig, and how
// the choice is reported.
#include <gtest/gtest.h>

#include "gpu/device_test_util.hpp"
#include "tier/config.hpp"
#include "tier/ext/cuda_probe.hpp"
#include "tier/ext/device.hpp"
#include "tier/stats.hpp"

namespace tier {
namespace {

TEST(DeviceSelection, AutoTakesCudaWhenAGpuIsUsableOtherwiseEmulatedAndSaysWhy) {
  Counters c;
  DeviceOptions o;
  o.kind = DeviceKind::kAuto;
  o.budget_bytes = 64 << 20;
  o.counters = &c;
  auto d = create_device(o);
  ASSERT_TRUE(d.ok()) << d.status();
  const auto info = c.snapshot().info;
  ASSERT_TRUE(info.count("device"));
  ASSERT_TRUE(info.count("device.selection"));
  EXPECT_EQ(info.at("device"), (*d)->info().name);
  if (probe_cuda().usable()) {
    EXPECT_EQ((*d)->info().kind, DeviceKind::kCuda);
    EXPECT_EQ(info.at("device").rfind("cuda: ", 0), 0u);
  } else {
    EXPECT_EQ((*d)->info().kind, DeviceKind::kEmulated);
    EXPECT_EQ(info.at("device"), "emulated");
    EXPECT_NE(info.at("device.selection").find(probe_cuda().status.message()), std::string::npos)
        << info.at("device.selection");
  }
}

TEST(DeviceSelection, CudaWithoutAGpuIsUnsupportedAndSaysHowToFallBack) {
  if (probe_cuda().usable()) GTEST_SKIP() << "a GPU is usable here; this checks the machine without one";
  DeviceOptions o;
  o.kind = DeviceKind::kCuda;
  auto d = create_device(o);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(d.status().message().find(probe_cuda().status.message()), std::string::npos) << d.status();
  EXPECT_NE(d.status().message().find("tier.device to auto or emulated"), std::string::npos) << d.status();
  auto direct = create_cuda_device(o);
  ASSERT_FALSE(direct.ok());
  EXPECT_EQ(direct.status().code(), StatusCode::kUnsupported);
  EXPECT_EQ(direct.status().message().rfind("no CUDA device: ", 0), 0u) << direct.status();
}

TEST(DeviceSelection, EmulatedIsTakenWhenAskedForEvenWithAGpu) {
  Counters c;
  DeviceOptions o;
  o.kind = DeviceKind::kEmulated;
  o.budget_bytes = 1 << 20;
  o.counters = &c;
  auto d = create_device(o);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->info().kind, DeviceKind::kEmulated);
  EXPECT_EQ(c.snapshot().info.at("device"), "emulated");
  EXPECT_EQ(c.snapshot().info.at("device.selection"), "emulated: tier.device=emulated");
}

TEST(DeviceSelection, OptionsComeFromTheTierSectionOfTheConfig) {
  auto cfg = EngineConfig::from_json(R"({"tier": {"device": "emulated", "device_id": 0,
      "budgets": {"device": "64M"}, "device_alloc_timeout_ms": 250,
      "emulated": {"h2d_bytes_per_second": "2GB", "d2h_bytes_per_second": 1000000000, "latency_us": 7.5}}})",
                                     ConfigOptions{false, false});
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  Counters c;
  const DeviceOptions o = DeviceOptions::from_config(*cfg, &c);
  EXPECT_EQ(o.kind, DeviceKind::kEmulated);
  EXPECT_EQ(o.budget_bytes, 64u << 20);
  EXPECT_EQ(o.alloc_timeout.count(), 250);
  EXPECT_EQ(o.emulated.h2d_bytes_per_second, 2'000'000'000u);
  EXPECT_EQ(o.emulated.d2h_bytes_per_second, 1'000'000'000u);
  EXPECT_DOUBLE_EQ(o.emulated.latency_us, 7.5);
  EXPECT_EQ(o.counters, &c);
  auto d = create_device(*cfg, &c);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->info().budget_bytes, 64u << 20);
  EXPECT_TRUE((*d)->has(DeviceCap::kPacedCopies));
  EXPECT_NE((*d)->info().detail.find("h2d 2.00 GB/s"), std::string::npos) << (*d)->info().detail;
  EXPECT_EQ(c.snapshot().tier(Tier::kDevice).budget_bytes, 64u << 20);
}

}  // namespace
}  // namespace tier
