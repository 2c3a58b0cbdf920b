// The optimizer's checkpoint under power cuts (tier/ext/fault_injecting_file_system.hpp): with
// checkpoint A saved and the state moved on to B, a save of B cut off at any of its sync points
// and followed by a power loss leaves a file that loads and is exactly A or exactly B (B once the
// save returned), with no temporary file beside it; a save whose file calls fail one by one
// reports the error and leaves A (or B) loadable; a load whose reads fail changes nothing.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/power_cut.hpp"
#include "optim/optim_test_util.hpp"

namespace tier::optim {
namespace {

using test::Home;
using test::Reference;
using test::Rig;

OffloadedOptimizerOptions opts() {
  OffloadedOptimizerOptions o;
  o.groups = test::three_groups();
  o.chunk_elements = 2048;
  o.buffer_count = 2;
  o.loss_scale.enabled = true;
  o.loss_scale.initial_scale = 1024;
  o.loss_scale.window = 2;
  return o;
}

void run_steps(OffloadedOptimizer& opt, Reference& ref, std::uint64_t first, std::uint64_t last) {
  for (std::uint64_t step = first; step <= last; ++step) {
    const double scale = opt.loss_scale();
    test::feed(opt, ref, step, 1, DType::kF16, GradMode::kCopy, nullptr, static_cast<float>(1e-4 * scale));
    ASSERT_TRUE(ref.step(scale, 0));
    auto r = opt.step();
    ASSERT_TRUE(r.ok()) << r.status();
  }
}

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void put(const std::string& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

std::vector<std::string> names(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.push_back(e.path().filename().string());
  return out;
}

class OptimizerPowerLoss : public testing::TestWithParam<Home> {
 protected:
  void SetUp() override {
    if (auto why = test::home_unavailable(GetParam()); !why.empty()) GTEST_SKIP() << why;
    model_ = test::mixed_model();
    a_ = std::make_unique<Rig>(GetParam(), opts());
    ASSERT_TRUE(a_->status().ok()) << a_->status();
    ref_a_ = std::make_unique<Reference>(model_, test::three_groups(), 17);
    ASSERT_TRUE(a_->register_model(*ref_a_, 17).ok());
    run_steps(a_->opt(), *ref_a_, 1, 2);
    ASSERT_TRUE(dir_.ok());
    file_ = dir_.sub("optimizer.bin");
    ASSERT_TRUE(a_->opt().save_checkpoint(file_).ok());  // A, durable (outside the fault layer)
    bytes_a_ = slurp(file_);
    ref_b_ = std::make_unique<Reference>(*ref_a_);
    run_steps(a_->opt(), *ref_b_, 3, 3);  // the optimizer now holds B
    // The verifier: another optimizer of the same model, with other initial values.
    b_ = std::make_unique<Rig>(GetParam(), opts());
    ASSERT_TRUE(b_->status().ok()) << b_->status();
    Reference other(model_, test::three_groups(), 99);
    ASSERT_TRUE(b_->register_model(other, 99).ok());
  }

  // Loads the checkpoint into the verifier; returns 'A' or 'B' for the state it holds then, or
  // records a failure.
  char load_and_identify(const std::string& context) {
    const Status s = b_->opt().load_checkpoint(file_);
    EXPECT_TRUE(s.ok()) << context << ": the checkpoint does not load: " << s;
    if (!s.ok()) return '?';
    const std::int64_t step = *b_->opt().group_step(0);
    const Reference& want = step == 2 ? *ref_a_ : *ref_b_;
    EXPECT_TRUE(step == 2 || step == 3) << context << ": step " << step;
    EXPECT_TRUE(test::state_matches(b_->opt(), want)) << context << ": not exactly the saved state";
    return step == 2 ? 'A' : 'B';
  }

  std::vector<test::PartDesc> model_;
  std::unique_ptr<Rig> a_, b_;
  std::unique_ptr<Reference> ref_a_, ref_b_;
  test::ScratchDir dir_{nvme::test::shm_base(), "ckpt-power"};
  std::string file_;
  std::string bytes_a_;
};

TEST_P(OptimizerPowerLoss, ACutAtEverySyncPointOfASaveLeavesAOrB) {
  std::string seen;
  const std::uint64_t syncs = tier::test::cut_power_at_every_sync_point(
      [&] { put(file_, bytes_a_); }, [&] { return a_->opt().save_checkpoint(file_); },
      [&](const tier::test::PowerCut& cut) {
        const std::string context = str("power cut after ", cut.after_syncs, " sync points");
        const char got = load_and_identify(context);
        if (cut.completed) {
          EXPECT_EQ(got, 'B') << context << ": the save had returned";
        }
        EXPECT_EQ(names(dir_.path()), std::vector<std::string>{"optimizer.bin"}) << context;
        seen += got;
      });
  EXPECT_EQ(syncs, 2u) << "the file's fsync and its directory's";
  EXPECT_EQ(seen, "AAB");
  // And the optimizer that saved goes on as the reference does.
  run_steps(a_->opt(), *ref_b_, 4, 4);
  EXPECT_TRUE(test::state_matches(a_->opt(), *ref_b_));
}

TEST_P(OptimizerPowerLoss, EveryFailedCallOfASaveIsReportedAndLeavesALoadableCheckpoint) {
  int failures = 0;
  for (std::uint64_t n = 1; n < 10000; ++n) {
    put(file_, bytes_a_);
    auto fault = std::make_shared<FaultInjectingFileSystem>();
    fault->add_fault({std::nullopt, "", n, 1, EIO});
    Status s;
    {
      tier::test::InstalledFileSystem use(fault);
      s = a_->opt().save_checkpoint(file_);
    }
    if (s.ok()) break;
    ++failures;
    EXPECT_EQ(s.sys_errno(), EIO) << "call " << n << ": " << s;
    EXPECT_NE(s.message().find("checkpoint"), std::string::npos) << s;
    load_and_identify(str("call ", n, " failed"));
    EXPECT_EQ(names(dir_.path()), std::vector<std::string>{"optimizer.bin"}) << "call " << n << ": " << s;
  }
  EXPECT_GE(failures, 8) << "open, the header, the records, the trailer, sync, close, rename, the directory";
  // The optimizer is unharmed by the failed saves.
  run_steps(a_->opt(), *ref_b_, 4, 4);
  EXPECT_TRUE(test::state_matches(a_->opt(), *ref_b_));
}

TEST_P(OptimizerPowerLoss, ALoadWhoseReadFailsChangesNothing) {
  ASSERT_EQ(load_and_identify("before"), 'A');
  ASSERT_TRUE(a_->opt().save_checkpoint(file_).ok());  // B on disk; the verifier holds A
  int refused = 0;
  for (std::uint64_t n = 1; n < 10000; ++n) {
    auto fault = std::make_shared<FaultInjectingFileSystem>();
    fault->add_fault({FileOp::kRead, "", n, 1, EIO});
    Status s;
    {
      tier::test::InstalledFileSystem use(fault);
      s = b_->opt().load_checkpoint(file_);
    }
    if (s.ok()) {
      EXPECT_TRUE(test::state_matches(b_->opt(), *ref_b_));
      EXPECT_GE(refused, 3) << "the header, the metadata and the records are read";
      return;
    }
    ++refused;
    EXPECT_EQ(s.sys_errno(), EIO) << s;
    if (s.message().find("after it verified") != std::string::npos) {
      // Host state is copied in place once the whole file verified; a read failing in that copy
      // marks the state unusable until a good load (OffloadedOptimizer::load_checkpoint says so).
      EXPECT_EQ(GetParam().home, StateHome::kHost) << s;
      put(file_, bytes_a_);
      ASSERT_EQ(load_and_identify("reloading A"), 'A');
      ASSERT_TRUE(a_->opt().save_checkpoint(file_).ok());
      continue;
    }
    EXPECT_TRUE(test::state_matches(b_->opt(), *ref_a_)) << "read " << n << " failed: the state must be A still";
  }
  ADD_FAILURE() << "the load never succeeded";
}

INSTANTIATE_TEST_SUITE_P(Homes, OptimizerPowerLoss, testing::ValuesIn(test::all_homes()), test::home_name);

}  // namespace
}  // namespace tier::optim
