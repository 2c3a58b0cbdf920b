// Power cuts and failed calls against the writers of core (AtomicFile: the trace, tier-bench's
// config) and the config reader: after a power loss at any sync point the file is the old one or
// the new one, and the new one once the write returned; a failed call leaves no temporary file.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "core/power_cut.hpp"
#include "tier/config.hpp"
#include "tier/ext/file_system.hpp"
#include "tier/stats.hpp"
#include "core/scratch.hpp"

namespace tier {
namespace {

namespace fs = std::filesystem;
using test::put;
using test::Scratch;
using test::slurp;

TEST(PowerLoss, AnAtomicRewriteIsOldOrNewAtEverySyncPoint) {
  Scratch d;
  const std::string target = d.sub("config.json");
  int old_seen = 0, new_seen = 0;
  const std::uint64_t syncs = test::cut_power_at_every_sync_point(
      [&] { put(target, "old"); }, [&] { return write_file_atomically(target, "new content", 0644, "config"); },
      [&](const test::PowerCut& cut) {
        const std::string now = slurp(target);
        EXPECT_TRUE(now == "old" || now == "new content") << "after " << cut.after_syncs << " syncs: '" << now << "'";
        if (cut.completed) {
          EXPECT_EQ(now, "new content") << "a write that returned is durable";
        }
        (now == "old" ? old_seen : new_seen)++;
        EXPECT_EQ(d.names(), std::vector<std::string>{"config.json"}) << "no temporary file survives";
      });
  EXPECT_EQ(syncs, 2u) << "the file, then its directory";
  EXPECT_GE(old_seen, 2);
  EXPECT_GE(new_seen, 1);
}

TEST(PowerLoss, ATraceIsOldOrNewAtEverySyncPoint) {
  Scratch d;
  const std::string target = d.sub("trace.json");
  Counters before, after;
  after.start_trace();
  const auto t = std::chrono::steady_clock::now();
  after.trace_span("compute", "forward", t, t + std::chrono::milliseconds(3));
  std::string old_text;
  ASSERT_TRUE(before.write_trace(target).ok());
  old_text = slurp(target);
  const std::string new_text = after.trace_json();
  ASSERT_NE(old_text, new_text);
  test::cut_power_at_every_sync_point([&] { put(target, old_text); }, [&] { return after.write_trace(target); },
                                      [&](const test::PowerCut& cut) {
                                        const std::string now = slurp(target);
                                        EXPECT_TRUE(now == old_text || now == new_text) << cut.after_syncs;
                                        if (cut.completed) {
                                          EXPECT_EQ(now, new_text);
                                        }
                                        EXPECT_EQ(d.names().size(), 1u);
                                      });
}

TEST(PowerLoss, TheHarnessNoticesAWriterThatDoesNotSync) {
  // A file system whose syncs do nothing stands for a writer without fsyncs: the same check must
  // then fail, or the tests above prove nothing.
  Scratch d;
  const std::string target = d.sub("config.json");
  put(target, "old");
  for (const bool files : {true, false}) {
    auto fault = std::make_shared<FaultInjectingFileSystem>();
    fault->drop_syncs(files, !files);
    {
      test::InstalledFileSystem use(fault);
      ASSERT_TRUE(write_file_atomically(target, "new content", 0644, "config").ok());
    }
    ASSERT_TRUE(fault->simulate_power_loss().ok());
    EXPECT_NE(slurp(target), "new content") << (files ? "file" : "directory") << " syncs dropped, yet nothing lost";
    put(target, "old");
  }
}

TEST(PowerLoss, EveryFailedCallOfAnAtomicWriteLeavesTheOldFileAndNoDebris) {
  Scratch d;
  const std::string target = d.sub("trace.json");
  int failures = 0;
  for (std::uint64_t n = 1; n < 100; ++n) {
    put(target, "old");
    auto fault = std::make_shared<FaultInjectingFileSystem>();
    fault->add_fault({std::nullopt, "", n, 1, EIO});
    Status s;
    {
      test::InstalledFileSystem use(fault);
      s = write_file_atomically(target, "new content", 0644, "trace");
    }
    if (s.ok()) break;
    ++failures;
    EXPECT_EQ(s.sys_errno(), EIO) << s;
    EXPECT_NE(s.message().find(target), std::string::npos) << "the error names the file: " << s;
    const std::string now = slurp(target);
    // Only a failure after the rename (closing or syncing the directory) leaves the new content.
    EXPECT_TRUE(now == "old" || now == "new content") << n;
    EXPECT_EQ(d.names(), std::vector<std::string>{"trace.json"}) << "call " << n << ": " << s;
  }
  EXPECT_GE(failures, 6) << "open, write, sync, close, rename, the directory's open and sync";
}

TEST(PowerLoss, ConfigReadErrorsComeThroughTheLayer) {
  Scratch d;
  const std::string path = d.sub("ds_config.json");
  put(path, R"({"train_batch_size": 8})");
  auto fault = std::make_shared<FaultInjectingFileSystem>();
  fault->add_fault({FileOp::kRead, "ds_config", 1, 1, EIO});
  test::InstalledFileSystem use(fault);
  auto bad = EngineConfig::from_file(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().sys_errno(), EIO);
  EXPECT_NE(bad.status().message().find(path), std::string::npos) << bad.status();
  EXPECT_TRUE(EngineConfig::from_file(path).ok()) << "the next read works";
  EXPECT_EQ(fault->counters().calls[static_cast<int>(FileOp::kOpen)], 2u);
}

}  // namespace
}  // namespace tier
