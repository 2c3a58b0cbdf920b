#include "tier/stats.hpp"

#include <gtest/gtest.h>

#include <unistd.h>

#include <nlohmann/json.hpp>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <thread>
#include <vector>

namespace tier {
namespace {

using namespace std::chrono_literals;

TEST(Counters, ResidentAndPeakFollowAddsAndRemoves) {
  Counters c;
  c.set_budget(Tier::kDevice, 1000);
  c.add_resident(Tier::kDevice, 600);
  c.add_resident(Tier::kDevice, 300);
  c.add_resident(Tier::kDevice, -800);
  auto s = c.snapshot();
  EXPECT_EQ(s.tier(Tier::kDevice).resident_bytes, 100u);
  EXPECT_EQ(s.tier(Tier::kDevice).peak_bytes, 900u);
  EXPECT_EQ(s.tier(Tier::kDevice).budget_bytes, 1000u);
  EXPECT_EQ(s.tier(Tier::kHost).resident_bytes, 0u);
}

TEST(Counters, TransfersCountBytesOpsAndErrors) {
  Counters c;
  c.begin(Link::kNvmeToHost).finish(4096);
  c.begin(Link::kNvmeToHost).finish(8192);
  c.begin(Link::kNvmeToHost).finish(100, /*ok=*/false);
  { auto abandoned = c.begin(Link::kHostToDevice); }
  auto s = c.snapshot();
  EXPECT_EQ(s.link(Link::kNvmeToHost).bytes, 12288u);
  EXPECT_EQ(s.link(Link::kNvmeToHost).ops, 2u);
  EXPECT_EQ(s.link(Link::kNvmeToHost).errors, 1u);
  EXPECT_EQ(s.link(Link::kHostToDevice).errors, 1u);
  EXPECT_EQ(s.link(Link::kHostToDevice).in_flight, 0u);
}

TEST(Counters, OverlappingTransfersCountBusyTimeOnce) {
  Counters c;
  auto a = c.begin(Link::kHostToNvme);
  auto b = c.begin(Link::kHostToNvme);
  EXPECT_EQ(c.snapshot().link(Link::kHostToNvme).in_flight, 2u);
  std::this_thread::sleep_for(50ms);
  a.finish(1);
  b.finish(1);
  const double busy = c.snapshot().link(Link::kHostToNvme).busy_seconds;
  // Two overlapping 50 ms transfers: about 50 ms busy, never the 100 ms a plain sum would give.
  EXPECT_GE(busy, 0.045);
  EXPECT_LT(busy, 0.095);
}

TEST(Counters, ConcurrentTransfersFromManyThreads) {
  Counters c;
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) c.begin(Link::kDeviceToHost).finish(10);
    });
  }
  for (auto& t : threads) t.join();
  auto s = c.snapshot();
  EXPECT_EQ(s.link(Link::kDeviceToHost).bytes, 80000u);
  EXPECT_EQ(s.link(Link::kDeviceToHost).ops, 8000u);
  EXPECT_EQ(s.link(Link::kDeviceToHost).in_flight, 0u);
}

TEST(Counters, RecordCountsTransfersTimedElsewhere) {
  Counters c;
  c.record(Link::kDeviceToHost, 1000, 0.5);
  c.record(Link::kDeviceToHost, 500, 0.25);
  auto s = c.snapshot();
  EXPECT_EQ(s.link(Link::kDeviceToHost).bytes, 1500u);
  EXPECT_EQ(s.link(Link::kDeviceToHost).ops, 2u);
  EXPECT_NEAR(s.link(Link::kDeviceToHost).busy_seconds, 0.75, 1e-6);
}

TEST(StatsSnapshot, SinceSubtractsLinkCounters) {
  Counters c;
  c.begin(Link::kNvmeToHost).finish(100);
  c.add_metric("stalls", 2);
  auto first = c.snapshot();
  c.begin(Link::kNvmeToHost).finish(50);
  c.add_metric("stalls", 3);
  auto d = c.snapshot().since(first);
  EXPECT_EQ(d.link(Link::kNvmeToHost).bytes, 50u);
  EXPECT_EQ(d.link(Link::kNvmeToHost).ops, 1u);
  EXPECT_DOUBLE_EQ(d.metrics["stalls"], 3.0);
}

TEST(StatsSnapshot, JsonHasEveryTierLinkInfoAndMetric) {
  Counters c;
  c.add_resident(Tier::kHost, 4096);
  c.begin(Link::kHostToDevice).finish(1 << 20);
  c.set_info("device", "emulated");
  c.set_metric("prefetch.stall_seconds", 0.25);
  auto j = nlohmann::json::parse(c.snapshot().to_json());
  for (const char* t : {"device", "host", "nvme"}) EXPECT_TRUE(j["tiers"].contains(t)) << t;
  for (const char* l : {"nvme_to_host", "host_to_nvme", "host_to_device", "device_to_host"}) {
    EXPECT_TRUE(j["links"].contains(l)) << l;
  }
  EXPECT_EQ(j["tiers"]["host"]["resident_bytes"], 4096);
  EXPECT_EQ(j["links"]["host_to_device"]["bytes"], 1 << 20);
  EXPECT_EQ(j["info"]["device"], "emulated");
  EXPECT_DOUBLE_EQ(j["metrics"]["prefetch.stall_seconds"].get<double>(), 0.25);
}

}  // namespace
}  // namespace tier

namespace tier {
namespace {

// The timeline: every transfer between start_trace and now, on its link's lane with its bytes,
// spans on named lanes, a cap with a count of what it dropped, valid Chrome trace JSON.
TEST(CountersTrace, RecordsTransfersAndSpansAsChromeTraceEvents) {
  Counters c;
  {
    auto before = c.begin(Link::kNvmeToHost);
    before.finish(7);  // before start_trace: counted, not traced
  }
  c.start_trace(4);
  auto t = c.begin(Link::kNvmeToHost);
  auto u = c.begin(Link::kHostToDevice);
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  t.finish(4096);
  u.finish(100, false);
  const auto t0 = std::chrono::steady_clock::now();
  c.trace_span("compute", "forward", t0, t0 + std::chrono::milliseconds(3));
  c.trace_span("compute", "backward \"quoted\"", t0 + std::chrono::milliseconds(3), t0 + std::chrono::milliseconds(9));
  c.trace_span("stalls", "dropped: over the cap", t0, t0);

  const auto j = nlohmann::json::parse(c.trace_json());
  std::map<int, std::string> lanes;
  std::vector<nlohmann::json> spans;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") lanes[e["tid"].get<int>()] = e["args"]["name"];
    if (e["ph"] == "X") spans.push_back(e);
  }
  ASSERT_EQ(spans.size(), 4u);
  EXPECT_EQ(j["otherData"]["dropped_events"], 1);
  EXPECT_EQ(lanes.at(spans[0]["tid"].get<int>()), str("link ", link_name(Link::kNvmeToHost)));
  EXPECT_EQ(spans[0]["args"]["bytes"], 4096);
  EXPECT_GE(spans[0]["dur"].get<double>(), 2000.0);  // microseconds: it was in flight for 2 ms
  EXPECT_EQ(spans[1]["args"]["failed"], true);
  EXPECT_EQ(lanes.at(spans[2]["tid"].get<int>()), "compute");
  EXPECT_EQ(spans[2]["name"], "forward");
  EXPECT_NEAR(spans[2]["dur"].get<double>(), 3000.0, 1.0);
  EXPECT_EQ(spans[3]["name"], "backward \"quoted\"");
  EXPECT_EQ(spans[3]["tid"], spans[2]["tid"]);
  EXPECT_NEAR(spans[3]["ts"].get<double>() - spans[2]["ts"].get<double>(), 3000.0, 1.0);
  // The counters are unaffected by tracing.
  EXPECT_EQ(c.snapshot().link(Link::kNvmeToHost).bytes, 4096u + 7u);
}

TEST(CountersTrace, OffByDefaultAndWrittenAtomically) {
  Counters c;
  EXPECT_FALSE(c.tracing());
  c.begin(Link::kHostToNvme).finish(1);
  c.trace_span("compute", "ignored", std::chrono::steady_clock::now(), std::chrono::steady_clock::now());
  auto j = nlohmann::json::parse(c.trace_json());
  for (const auto& e : j["traceEvents"]) EXPECT_NE(e["ph"], "X");
  const std::string path = testing::TempDir() + "tier-trace-test.json";
  ASSERT_TRUE(c.write_trace(path).ok());
  std::ifstream f(path);
  const auto written = nlohmann::json::parse(f, nullptr, false);
  EXPECT_FALSE(written.is_discarded());
  EXPECT_TRUE(written.contains("traceEvents"));
  const Status bad = c.write_trace("/nonexistent-dir/x/trace.json");
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("/nonexistent-dir/x/trace.json"), std::string::npos) << bad;
}

// Another user who can write the folder plants "<trace>.tmp" as a symlink to a file of the user
// running tier: the old writer opened it with O_TRUNC and overwrote that file with the trace.
TEST(CountersTrace, APlantedTmpSymlinkIsNotWrittenThrough) {
  Counters c;
  c.start_trace();
  c.begin(Link::kHostToNvme).finish(4096);
  const std::string dir = testing::TempDir() + "tier-trace-planted-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string victim = dir + "/victim", path = dir + "/trace.json";
  std::ofstream(victim) << "keep me";
  std::filesystem::create_symlink(victim, path + ".tmp");
  ASSERT_TRUE(c.write_trace(path).ok());
  std::ifstream v(victim);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(v), {}), "keep me");
  std::ifstream f(path);
  const auto written = nlohmann::json::parse(f, nullptr, false);
  ASSERT_FALSE(written.is_discarded());
  EXPECT_TRUE(written.contains("traceEvents"));
  EXPECT_FALSE(std::filesystem::is_symlink(path));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tier

namespace tier {
namespace {

TEST(CountersTrace, TransfersRecordedElsewhereAreOnTheTimelineToo) {
  Counters c;
  c.start_trace();
  c.record(Link::kDeviceToHost, 1234, 0.002);
  const auto j = nlohmann::json::parse(c.trace_json());
  int found = 0;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] != "X") continue;
    ++found;
    EXPECT_EQ(e["tid"], static_cast<int>(Link::kDeviceToHost));
    EXPECT_EQ(e["args"]["bytes"], 1234);
    EXPECT_NEAR(e["dur"].get<double>(), 2000.0, 1.0);
  }
  EXPECT_EQ(found, 1);
}

}  // namespace
}  // namespace tier
