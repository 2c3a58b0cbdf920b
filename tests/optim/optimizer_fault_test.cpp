// A failed NVMe read or write in the middle of a step is reported, leaves the previous step's
// state intact and keeps the gradients, so that a retry gives exactly the step that failed; the
// same holds for state writes and checkpoints. Faults come from the FaultInjectingEngine under the
// optimizer's swap space.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <set>

#include "optim/optim_test_util.hpp"

namespace tier::optim {
namespace {

using test::feed;
using test::Home;
using test::Reference;
using test::Rig;

class OptimizerFaults : public testing::TestWithParam<Home> {
 protected:
  void SetUp() override {
    if (auto why = test::home_unavailable(GetParam()); !why.empty()) GTEST_SKIP() << why;
    o_.groups = test::three_groups();
    o_.chunk_elements = 2048;  // ~19 chunks of 24 KiB: several requests each at 16 KiB blocks
    o_.buffer_count = 3;
    rig_ = std::make_unique<Rig>(GetParam(), o_);
    ASSERT_TRUE(rig_->status().ok()) << rig_->status();
    ref_ = std::make_unique<Reference>(test::mixed_model(), o_.groups, 21);
    ASSERT_TRUE(rig_->register_model(*ref_, 21).ok());
    ASSERT_NE(rig_->faults(), nullptr);
  }

  void good_step(std::uint64_t step) {
    feed(rig_->opt(), *ref_, step, 1, DType::kBF16, GradMode::kCopy);
    ASSERT_TRUE(ref_->step(1.0, 0));
    auto r = rig_->opt().step();
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(test::state_matches(rig_->opt(), *ref_));
  }

  // A step that fails with `code`: the state stays that of the last good step, the gradients
  // stay; after the fault is gone, the retry equals the reference's step.
  void failing_step_then_retry(std::uint64_t step, StatusCode code) {
    feed(rig_->opt(), *ref_, step, 1, DType::kBF16, GradMode::kCopy);
    const std::int64_t before = *rig_->opt().group_step(0);
    auto r = rig_->opt().step();
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_NE(r.status().message().find("was not applied"), std::string::npos) << r.status();
    EXPECT_EQ(*rig_->opt().group_step(0), before);
    EXPECT_EQ(*rig_->opt().group_step(1), before);
    EXPECT_EQ(rig_->opt().stats().steps_failed, 1u);
    EXPECT_EQ(rig_->opt().partitions_with_grads(), ref_->model().size());
    rig_->faults()->clear_faults();
    // Previous state intact (the reference has not stepped yet).
    ASSERT_TRUE(test::state_matches(rig_->opt(), *ref_));
    ASSERT_TRUE(ref_->step(1.0, 0));
    auto again = rig_->opt().step();
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->step, before + 1);
    ASSERT_TRUE(test::state_matches(rig_->opt(), *ref_));
  }

  OffloadedOptimizerOptions o_;
  std::unique_ptr<Rig> rig_;
  std::unique_ptr<Reference> ref_;
};

TEST_P(OptimizerFaults, WriteErrorMidStep) {
  good_step(1);
  good_step(2);
  rig_->faults()->fail_nth(9, EIO, nvme::IoOp::kWrite);
  failing_step_then_retry(3, StatusCode::kIoError);
  good_step(4);
}

TEST_P(OptimizerFaults, ReadErrorMidStep) {
  good_step(1);
  rig_->faults()->fail_nth(12, EIO, nvme::IoOp::kRead);
  failing_step_then_retry(2, StatusCode::kIoError);
}

TEST_P(OptimizerFaults, DiskFullMidStep) {
  good_step(1);
  rig_->faults()->fail_writes_after_bytes(100 << 10, ENOSPC);
  failing_step_then_retry(2, StatusCode::kNoSpace);
}

TEST_P(OptimizerFaults, LastWriteOfTheStepFails) {
  good_step(1);
  // The step writes every chunk once; fail a request of the last one.
  const std::uint64_t chunks = rig_->opt().stats().chunks;
  const std::uint64_t last_chunk_bytes =
      (test::total_elements(ref_->model()) - (chunks - 1) * 2048 + 1023) / 1024 * 1024 * 12;
  const std::uint64_t requests =
      (chunks - 1) * (2048 * 12 / (16 << 10) + 1) + (last_chunk_bytes + (16 << 10) - 1) / (16 << 10);
  rig_->faults()->fail_nth(requests, EIO, nvme::IoOp::kWrite);
  failing_step_then_retry(2, StatusCode::kIoError);
}

TEST_P(OptimizerFaults, TransientAndShortTransfersAreAbsorbed) {
  rig_->faults()->transient_nth(3, 2, EAGAIN, nvme::IoOp::kWrite);
  rig_->faults()->short_nth(5, 0, nvme::IoOp::kRead);
  good_step(1);
  EXPECT_GE(rig_->faults()->counters().transients, 2u);
  EXPECT_GE(rig_->faults()->counters().shorts, 1u);
}

TEST_P(OptimizerFaults, WriteStateFailureLeavesTheChunk) {
  good_step(1);
  std::vector<float> vals(5000, 0.25f);
  rig_->faults()->fail_nth(1, EIO, nvme::IoOp::kWrite);
  EXPECT_EQ(rig_->opt().write_state(3, StateKind::kMaster, vals.data(), 100, 5000).code(), StatusCode::kIoError);
  rig_->faults()->clear_faults();
  // The first chunk's write failed: it was not switched over and the call stopped there.
  std::vector<float> got(20000);
  ASSERT_TRUE(rig_->opt().read_state(3, StateKind::kMaster, got.data(), 0, 20000).ok());
  EXPECT_TRUE(test::same_bits(got.data(), ref_->master(3).data(), 20000, "partition 3 after a failed write_state"));
}

TEST_P(OptimizerFaults, FailedCheckpointSaveKeepsTheOldFile) {
  good_step(1);
  const std::string path = rig_->dir() + "/ckpt.bin";
  ASSERT_TRUE(rig_->opt().save_checkpoint(path).ok());
  const auto size = std::filesystem::file_size(path);
  good_step(2);
  rig_->faults()->fail_nth(4, EIO, nvme::IoOp::kRead);
  const Status s = rig_->opt().save_checkpoint(path);
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s;
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  EXPECT_EQ(std::filesystem::file_size(path), size);
  rig_->faults()->clear_faults();
  // The old file still loads: back to step 1's state.
  ASSERT_TRUE(rig_->opt().load_checkpoint(path).ok());
  EXPECT_EQ(*rig_->opt().group_step(0), 1);
}

TEST_P(OptimizerFaults, FailedCheckpointLoadKeepsTheState) {
  good_step(1);
  const std::string path = rig_->dir() + "/ckpt.bin";
  ASSERT_TRUE(rig_->opt().save_checkpoint(path).ok());
  good_step(2);
  rig_->faults()->fail_nth(6, EIO, nvme::IoOp::kWrite);
  EXPECT_EQ(rig_->opt().load_checkpoint(path).code(), StatusCode::kIoError);
  rig_->faults()->clear_faults();
  EXPECT_EQ(*rig_->opt().group_step(0), 2);
  ASSERT_TRUE(test::state_matches(rig_->opt(), *ref_));
}

// A sink that delivers the updated params piece by piece (as the engine's param sink does) into
// `out`, counting the pieces.
test::FnSink deliver_into(test::Outputs& out, int& pieces) {
  return test::FnSink([&out, &pieces](const OutputChunk& c) -> Status {
    const std::size_t esize = param_output_size(c.dtype);
    std::memcpy(out.data[c.partition].data() + c.offset * esize, c.data, c.numel * esize);
    ++pieces;
    return Status::Ok();
  });
}

// Every delivered param equals the reference's output after its last step.
::testing::AssertionResult params_match(const test::Outputs& out, const test::Reference& ref) {
  for (std::size_t i = 0; i < ref.model().size(); ++i) {
    const std::size_t bytes = ref.model()[i].numel * param_output_size(ref.model()[i].output);
    if (std::memcmp(out.data[i].data(), ref.out(i).data(), bytes) != 0) {
      return ::testing::AssertionFailure() << "partition " << i << "'s delivered params differ";
    }
  }
  return ::testing::AssertionSuccess();
}

// A step that fails part-way had delivered the params of the chunks it updated before the fault:
// they are put back to the committed state's, so that the params the training reads (the next
// forward) are the state's whatever comes next, not half a step ahead of it.
TEST_P(OptimizerFaults, AFailedStepPutsBackTheParamsItHadDelivered) {
  test::Outputs out(ref_->model());
  int pieces = 0;
  test::FnSink sink = deliver_into(out, pieces);
  StepOptions so;
  so.sink = &sink;
  feed(rig_->opt(), *ref_, 1, 1, DType::kBF16, GradMode::kCopy);
  ASSERT_TRUE(ref_->step(1.0, 0));
  ASSERT_TRUE(rig_->opt().step(so).ok());
  ASSERT_TRUE(params_match(out, *ref_));

  feed(rig_->opt(), *ref_, 2, 1, DType::kBF16, GradMode::kCopy);
  rig_->faults()->fail_nth(9, EIO, nvme::IoOp::kWrite);  // a few chunks in
  pieces = 0;
  auto r = rig_->opt().step(so);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("put back"), std::string::npos) << r.status();
  EXPECT_GT(pieces, 0) << "the step must have delivered some params before failing";
  EXPECT_FALSE(rig_->opt().outputs_stale());
  EXPECT_TRUE(params_match(out, *ref_)) << "the params are step 1's again";

  rig_->faults()->clear_faults();
  ASSERT_TRUE(ref_->step(1.0, 0));
  ASSERT_TRUE(rig_->opt().step(so).ok());
  EXPECT_TRUE(params_match(out, *ref_));
  ASSERT_TRUE(test::state_matches(rig_->opt(), *ref_));
}

// When putting them back fails too (here the sink refuses a piece it was given already, as a
// full disk would refuse the write), the error says so and the optimizer reports its outputs stale
// until a step delivers every one of them again.
TEST_P(OptimizerFaults, ParamsThatCannotBePutBackAreReportedStale) {
  test::Outputs out(ref_->model());
  int pieces = 0;
  test::FnSink good_sink = deliver_into(out, pieces);
  StepOptions good;
  good.sink = &good_sink;
  std::set<std::pair<PartitionId, std::uint64_t>> seen;
  test::FnSink refusing_sink([&](const OutputChunk& c) -> Status {
    if (!seen.insert({c.partition, c.offset}).second) return Status(StatusCode::kIoError, "the sink is full");
    return good_sink.deliver(c);
  });
  StepOptions refusing;
  refusing.sink = &refusing_sink;
  feed(rig_->opt(), *ref_, 1, 1, DType::kBF16, GradMode::kCopy);
  ASSERT_TRUE(ref_->step(1.0, 0));
  ASSERT_TRUE(rig_->opt().step(good).ok());
  feed(rig_->opt(), *ref_, 2, 1, DType::kBF16, GradMode::kCopy);
  rig_->faults()->fail_nth(9, EIO, nvme::IoOp::kWrite);
  auto r = rig_->opt().step(refusing);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("could not be put back"), std::string::npos) << r.status();
  EXPECT_TRUE(rig_->opt().outputs_stale());
  rig_->faults()->clear_faults();
  ASSERT_TRUE(ref_->step(1.0, 0));
  ASSERT_TRUE(rig_->opt().step(good).ok());
  EXPECT_FALSE(rig_->opt().outputs_stale());
  EXPECT_TRUE(params_match(out, *ref_));
}

INSTANTIATE_TEST_SUITE_P(Nvme, OptimizerFaults, testing::ValuesIn(test::nvme_homes()), test::home_name);

TEST(OptimizerRegistration, FailedInitialWriteMakesTheOptimizerUnusable) {
  OffloadedOptimizerOptions o;
  o.chunk_elements = 1024;
  o.buffer_count = 2;
  Rig rig({"nvme_posix_shm", StateHome::kNvme, IoEngineKind::kPosix, false}, o);
  ASSERT_TRUE(rig.status().ok()) << rig.status();
  rig.faults()->fail_nth(1, EIO, nvme::IoOp::kWrite);
  PartitionSpec ps;
  ps.numel = 10000;
  Status s = rig.opt().add_partition(ps).status();
  if (s.ok()) s = rig.opt().finish_registration();
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s;
  EXPECT_EQ(rig.opt().finish_registration().code(), StatusCode::kIoError);
  EXPECT_FALSE(rig.opt().step().ok());
}

}  // namespace
}  // namespace tier::optim
