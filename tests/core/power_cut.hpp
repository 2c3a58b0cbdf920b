// A power cut at every sync point of an operation, for crash tests (see
// tier/ext/fault_injecting_file_system.hpp).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>

#include "tier/ext/fault_injecting_file_system.hpp"

namespace tier::test {

// Installs `fs` as the process-wide file system for the scope, and puts the previous one back.
class InstalledFileSystem {
 public:
  explicit InstalledFileSystem(std::shared_ptr<FileSystem> fs) : previous_(FileSystem::install(std::move(fs))) {}
  ~InstalledFileSystem() { FileSystem::install(previous_); }
  InstalledFileSystem(const InstalledFileSystem&) = delete;
  InstalledFileSystem& operator=(const InstalledFileSystem&) = delete;

 private:
  std::shared_ptr<FileSystem> previous_;
};

struct PowerCut {
  std::uint64_t after_syncs;  // sync points that completed before the cut
  bool completed;             // the operation returned success (the cut came after it)
  Status result;              // what the operation returned
};

// For k = 0, 1, 2, ...: `prepare()` puts the disk in the starting state (outside the layer: that
// state counts as durable), then `op()` runs under a fresh FaultInjectingFileSystem that cuts the
// power after k sync points; the power loss is simulated and `check(cut)` judges the disk. Ends
// after the first k at which `op` completed (that case is checked too: the loss comes right after
// it returned). Returns the number of sync points of one complete `op` (the cases checked less one).
inline std::uint64_t cut_power_at_every_sync_point(const std::function<void()>& prepare,
                                                   const std::function<Status()>& op,
                                                   const std::function<void(const PowerCut&)>& check,
                                                   std::uint64_t limit = 1000) {
  for (std::uint64_t k = 0; k < limit; ++k) {
    prepare();
    if (::testing::Test::HasFatalFailure()) return k;
    auto fault = std::make_shared<FaultInjectingFileSystem>();
    fault->cut_power_after_syncs(k);
    Status result;
    {
      InstalledFileSystem use(fault);
      result = op();
    }
    const bool completed = result.ok();
    if (completed) {
      EXPECT_FALSE(fault->powered_off());
      EXPECT_EQ(fault->counters().syncs, k) << "a completed operation passed exactly the sync points before it";
    } else {
      EXPECT_TRUE(fault->powered_off()) << "the operation failed before the power cut: " << result;
    }
    const Status lost = fault->simulate_power_loss();
    EXPECT_TRUE(lost.ok()) << lost;
    check(PowerCut{k, completed, result});
    if (completed || ::testing::Test::HasFatalFailure()) return k;
  }
  ADD_FAILURE() << "the operation did not complete within " << limit << " sync points";
  return limit;
}

}  // namespace tier::test
