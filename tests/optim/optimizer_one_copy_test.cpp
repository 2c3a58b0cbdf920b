// state_copies 1: the NVMe-homed state kept once, plus a few spare chunks. Steps give the in-RAM
// reference's state and outputs bit for bit; the files hold one copy; a step that fails after some
// chunks took their update is owed (everything but step() and load_checkpoint is refused, the
// gradients stay) and the next step() finishes it to the reference's result, delivering again
// whole every partition the failed try left half delivered; an overlapped pass runs ahead only
// as far as its spares allow; checkpoints are verified before they overwrite the one copy.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "optim/optim_test_util.hpp"

namespace tier::optim {
namespace {

using test::feed;
using test::Home;
using test::PartDesc;
using test::Reference;
using test::Rig;

constexpr std::uint64_t kChunk = 2048;
constexpr unsigned kBuffers = 3;
constexpr unsigned kSpeculation = 2;

OffloadedOptimizerOptions once_options(double max_norm) {
  OffloadedOptimizerOptions o;
  o.groups = test::three_groups();
  o.chunk_elements = kChunk;  // ~19 chunks of 24 KiB
  o.buffer_count = kBuffers;
  o.max_grad_norm = max_norm;
  o.state_copies = 1;
  o.speculation_chunks = kSpeculation;
  return o;
}

// Gathers each partition's pieces as the engine's sink does: a partition that is half delivered
// when the step is abandoned is lost (its memory holds garbage), so only a whole delivery again
// repairs it.
class GatheringSink final : public ParamSink {
 public:
  explicit GatheringSink(const std::vector<PartDesc>& m) : model_(m) {
    for (const PartDesc& p : m) {
      buf.emplace_back(p.numel * 4 + 4, 0);
      open.push_back(0);
    }
  }
  Status deliver(const OutputChunk& c) override {
    const std::size_t es = param_output_size(c.dtype);
    std::memcpy(buf[c.partition].data() + c.offset * es, c.data, c.numel * es);
    open[c.partition] += c.numel;
    if (open[c.partition] >= model_[c.partition].numel) open[c.partition] = 0;  // whole
    return {};
  }
  void abandoned() override {
    ++abandons;
    for (std::size_t i = 0; i < buf.size(); ++i) {
      if (open[i] == 0) continue;
      std::memset(buf[i].data(), 0xA5, buf[i].size());
      open[i] = 0;
    }
  }
  ::testing::AssertionResult matches(const Reference& ref) const {
    for (std::size_t i = 0; i < model_.size(); ++i) {
      const std::size_t es = param_output_size(model_[i].output);
      if (es == 0) continue;
      if (open[i] != 0) return ::testing::AssertionFailure() << "partition " << i << " is half delivered";
      if (std::memcmp(buf[i].data(), ref.out(i).data(), model_[i].numel * es) != 0) {
        return ::testing::AssertionFailure() << "partition " << i << "'s delivered params differ from the reference's";
      }
    }
    return ::testing::AssertionSuccess();
  }
  std::vector<std::vector<std::uint8_t>> buf;
  std::vector<std::uint64_t> open;
  int abandons = 0;

 private:
  std::vector<PartDesc> model_;
};

class OneCopy : public testing::TestWithParam<Home> {
 protected:
  void SetUp() override {
    if (auto why = test::home_unavailable(GetParam()); !why.empty()) GTEST_SKIP() << why;
  }
  void make(double max_norm, std::uint64_t seed = 21) {
    rig_ = std::make_unique<Rig>(GetParam(), once_options(max_norm));
    ASSERT_TRUE(rig_->status().ok()) << rig_->status();
    ref_ = std::make_unique<Reference>(test::mixed_model(), test::three_groups(), seed);
    ASSERT_TRUE(rig_->register_model(*ref_, seed).ok());
    sink_ = std::make_unique<GatheringSink>(test::mixed_model());
    max_norm_ = max_norm;
  }
  StepOptions with_sink() {
    StepOptions so;
    so.sink = sink_.get();
    return so;
  }
  void good_step(std::uint64_t step) {
    feed(opt(), *ref_, step, 1, DType::kBF16, GradMode::kCopy);
    ASSERT_TRUE(ref_->step(1.0, max_norm_));
    auto r = opt().step(with_sink());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(r->finished_failed);
    EXPECT_EQ(r->updated_chunks, opt().stats().chunks);
    ASSERT_TRUE(test::state_matches(opt(), *ref_));
    ASSERT_TRUE(sink_->matches(*ref_));
  }
  // A step that fails part-way: owed, everything else refused, gradients kept.
  void fails_part_way(std::uint64_t step, StatusCode code) {
    feed(opt(), *ref_, step, 1, DType::kBF16, GradMode::kCopy);
    const std::int64_t before = *opt().group_step(0);
    auto r = opt().step(with_sink());
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_NE(r.status().message().find("chunks took their update"), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("call step() to finish it"), std::string::npos) << r.status();
    EXPECT_EQ(*opt().group_step(0), before);
    EXPECT_TRUE(opt().stats().failed_step_owed);
    EXPECT_GE(sink_->abandons, 1);
    check_refusals();
  }
  void check_refusals() {
    auto refused = [](const Status& s, const char* what) {
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << what << ": " << s;
      EXPECT_NE(s.message().find("call step() to finish it"), std::string::npos) << what << ": " << s;
    };
    std::vector<float> one(1, 0.5f);
    refused(opt().add_grad(0, cpu::ConstTensorRef(one.data(), DType::kF32, 1)), "add_grad");
    refused(opt().declare_grad(0, 1.0), "declare_grad");
    refused(opt().read_state(1, StateKind::kMaster, one.data(), 0, 1), "read_state");
    refused(opt().write_state(1, StateKind::kMaster, one.data(), 0, 1), "write_state");
    refused(opt().save_checkpoint(rig_->dir() + "/owed.ckpt"), "save_checkpoint");
    refused(opt().start_overlapped_step(StepOptions{}), "start_overlapped_step");
    EXPECT_FALSE(std::filesystem::exists(rig_->dir() + "/owed.ckpt"));
    opt().clear_grads();  // kept: the owed step needs them
    EXPECT_EQ(opt().partitions_with_grads(), ref_->model().size());
  }
  // The step owed is finished: the reference's step, outputs whole.
  void finishes(std::uint64_t step) {
    ASSERT_TRUE(ref_->step(1.0, max_norm_));
    auto r = opt().step(with_sink());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->finished_failed);
    EXPECT_EQ(r->step, static_cast<std::int64_t>(step));
    EXPECT_GT(r->updated_chunks, 0u);
    EXPECT_LT(r->updated_chunks, opt().stats().chunks);  // only the chunks left
    EXPECT_FALSE(opt().stats().failed_step_owed);
    EXPECT_EQ(opt().partitions_with_grads(), 0u);
    ASSERT_TRUE(test::state_matches(opt(), *ref_));
    ASSERT_TRUE(sink_->matches(*ref_));
  }
  OffloadedOptimizer& opt() { return rig_->opt(); }

  std::unique_ptr<Rig> rig_;
  std::unique_ptr<Reference> ref_;
  std::unique_ptr<GatheringSink> sink_;
  double max_norm_ = 0;
};

TEST_P(OneCopy, StepsMatchTheReferenceWithOneCopyOfTheStateOnDisk) {
  make(1.0);  // the gradients' norm is ~2: every step is clipped
  for (std::uint64_t step = 1; step <= 3; ++step) good_step(step);
  const OptimizerStats s = opt().stats();
  EXPECT_EQ(s.state_copies, 1u);
  EXPECT_EQ(s.spare_slots, kBuffers + kSpeculation);
  // Beside the same model with two copies: half the chunks' bytes, plus the spares.
  Rig two(GetParam(), [] {
    OffloadedOptimizerOptions o = once_options(1.0);
    o.state_copies = 2;
    return o;
  }());
  ASSERT_TRUE(two.status().ok()) << two.status();
  ASSERT_TRUE(two.register_model(*ref_, 21).ok());
  // (Slots and spares trade places, so each holds a whole chunk's record, the short last one too.)
  const std::uint64_t record = kChunk * 12;  // three 8 KiB sections
  EXPECT_EQ(two.opt().stats().state_copies, 2u);
  EXPECT_EQ(two.opt().stats().spare_slots, 0u);
  EXPECT_EQ(s.nvme_bytes, (s.chunks + kBuffers + kSpeculation) * record);
  EXPECT_LE(s.nvme_bytes, two.opt().stats().nvme_bytes / 2 + (kBuffers + kSpeculation + 1) * record);
  EXPECT_LT(s.nvme_bytes, two.opt().stats().nvme_bytes);
}

TEST_P(OneCopy, AWriteErrorMidStepIsFinishedByTheNextStep) {
  make(1.0);
  good_step(1);
  rig_->faults()->fail_nth(9, EIO, nvme::IoOp::kWrite);  // chunk 4's: chunks 0-3 took the update
  fails_part_way(2, StatusCode::kIoError);
  rig_->faults()->clear_faults();
  finishes(2);
  good_step(3);
}

TEST_P(OneCopy, AReadErrorMidStepIsFinishedByTheNextStep) {
  make(0);
  good_step(1);
  // Chunk 6's read is issued once chunk 3's write completed (3 buffers).
  rig_->faults()->fail_nth(12, EIO, nvme::IoOp::kRead);
  fails_part_way(2, StatusCode::kIoError);
  rig_->faults()->clear_faults();
  finishes(2);
  good_step(3);
}

TEST_P(OneCopy, AFullDiskMidStepIsFinishedByTheNextStep) {
  make(1.0);
  good_step(1);
  rig_->faults()->fail_writes_after_bytes(100 << 10, ENOSPC);
  fails_part_way(2, StatusCode::kNoSpace);
  rig_->faults()->clear_faults();
  finishes(2);
  good_step(3);
}

TEST_P(OneCopy, AFinishThatFailsTooIsFinishedLater) {
  make(1.0);
  good_step(1);
  rig_->faults()->fail_nth(9, EIO, nvme::IoOp::kWrite);
  fails_part_way(2, StatusCode::kIoError);
  rig_->faults()->clear_faults();
  rig_->faults()->fail_nth(5, EIO, nvme::IoOp::kWrite);
  auto r = opt().step(with_sink());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("chunks took their update"), std::string::npos) << r.status();
  EXPECT_EQ(opt().stats().steps_failed, 2u);
  check_refusals();
  rig_->faults()->clear_faults();
  finishes(2);
  good_step(3);
}

TEST_P(OneCopy, AFailureBeforeAnyChunkTookItsUpdateAppliesNothing) {
  make(1.0);
  good_step(1);
  feed(opt(), *ref_, 2, 1, DType::kBF16, GradMode::kCopy);
  rig_->faults()->fail_nth(1, EIO, nvme::IoOp::kRead);
  auto r = opt().step(with_sink());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("was not applied"), std::string::npos) << r.status();
  EXPECT_FALSE(opt().stats().failed_step_owed);
  rig_->faults()->clear_faults();
  ASSERT_TRUE(test::state_matches(opt(), *ref_));  // the reference has not stepped
  ASSERT_TRUE(ref_->step(1.0, 1.0));
  auto again = opt().step(with_sink());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->finished_failed);
  ASSERT_TRUE(test::state_matches(opt(), *ref_));
  ASSERT_TRUE(sink_->matches(*ref_));
}

// The owed step keeps the constants it began with: a learning rate set before it is finished is
// the next step's.
TEST_P(OneCopy, TheFinishUsesTheFailedStepsLearningRate) {
  make(0);
  good_step(1);
  rig_->faults()->fail_nth(9, EIO, nvme::IoOp::kWrite);
  fails_part_way(2, StatusCode::kIoError);
  rig_->faults()->clear_faults();
  ASSERT_TRUE(opt().set_lr(0, 0.5).ok());
  finishes(2);
  ref_->set_lr(0, 0.5);
  good_step(3);
}

// An overlapped pass holds a spare for every chunk it updated until the norm is known: with
// buffer_count + speculation_chunks spares it stops there, and finish_overlapped_step updates the
// rest; the result is the serial step's. A clipped step drops what the pass wrote and is redone.
TEST_P(OneCopy, AnOverlappedPassRunsAheadAsFarAsItsSparesAllow) {
  make(0);
  good_step(1);
  const std::uint64_t chunks = opt().stats().chunks;
  ASSERT_GT(chunks, kBuffers + kSpeculation + 2u);
  const std::uint64_t nvme = opt().stats().nvme_bytes;
  ASSERT_TRUE(opt().start_overlapped_step(with_sink()).ok());
  feed(opt(), *ref_, 2, 1, DType::kBF16, GradMode::kCopy);
  ASSERT_TRUE(ref_->step(1.0, 0));
  auto r = opt().finish_overlapped_step();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->overlapped);
  EXPECT_FALSE(r->redone);
  EXPECT_EQ(r->updated_chunks, chunks);
  EXPECT_LE(r->speculated_chunks, kBuffers + kSpeculation);
  EXPECT_EQ(r->step, 2);
  EXPECT_EQ(opt().stats().nvme_bytes, nvme);
  EXPECT_EQ(opt().stats().spare_slots, kBuffers + kSpeculation);
  ASSERT_TRUE(test::state_matches(opt(), *ref_));
  ASSERT_TRUE(sink_->matches(*ref_));
  good_step(3);
}

// The pass's chunks are committed at finish; a failure in the rest leaves the step owed like a
// serial one, and step() finishes it.
TEST_P(OneCopy, AFailureAfterThePassIsFinishedByTheNextStep) {
  make(0);
  good_step(1);
  // Two 16 KiB requests per 24 KiB chunk: the pass writes its 5 chunks, the rest fails at its third.
  rig_->faults()->fail_nth(2 * (kBuffers + kSpeculation) + 6, EIO, nvme::IoOp::kWrite);
  ASSERT_TRUE(opt().start_overlapped_step(with_sink()).ok());
  feed(opt(), *ref_, 2, 1, DType::kBF16, GradMode::kCopy);
  auto r = opt().finish_overlapped_step();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kIoError) << r.status();
  EXPECT_NE(r.status().message().find("chunks took their update"), std::string::npos) << r.status();
  EXPECT_TRUE(opt().stats().failed_step_owed);
  check_refusals();
  rig_->faults()->clear_faults();
  finishes(2);
  good_step(3);
}

TEST_P(OneCopy, AClippedOverlappedStepDropsThePassAndIsRedone) {
  make(1.0);
  good_step(1);
  ASSERT_TRUE(opt().start_overlapped_step(with_sink()).ok());
  feed(opt(), *ref_, 2, 1, DType::kBF16, GradMode::kCopy);
  ASSERT_TRUE(ref_->step(1.0, 1.0));
  auto r = opt().finish_overlapped_step();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->redone);
  ASSERT_TRUE(test::state_matches(opt(), *ref_));
  ASSERT_TRUE(sink_->matches(*ref_));
  good_step(3);
}

TEST_P(OneCopy, ACheckpointIsVerifiedBeforeItOverwritesTheOneCopy) {
  make(1.0);
  good_step(1);
  const std::string path = rig_->dir() + "/state.ckpt";
  ASSERT_TRUE(opt().save_checkpoint(path).ok());
  Reference at1 = *ref_;
  good_step(2);
  // A damaged copy is refused with the state of step 2 untouched.
  const std::string bad = rig_->dir() + "/bad.ckpt";
  std::filesystem::copy_file(path, bad);
  {
    std::fstream f(bad, std::ios::in | std::ios::out | std::ios::binary);
    const auto size = static_cast<std::streamoff>(std::filesystem::file_size(bad));
    f.seekp(size * 3 / 4);
    const char flip = 0x5A;
    f.write(&flip, 1);
  }
  const Status s = opt().load_checkpoint(bad);
  EXPECT_FALSE(s.ok());
  ASSERT_TRUE(test::state_matches(opt(), *ref_));
  // The good one brings step 1 back, and steps on from it as the reference does.
  ASSERT_TRUE(opt().load_checkpoint(path).ok());
  *ref_ = at1;
  ASSERT_TRUE(test::state_matches(opt(), *ref_));
  EXPECT_EQ(*opt().group_step(0), 1);
  good_step(2);
}

TEST_P(OneCopy, ALoadClearsAStepOwed) {
  make(1.0);
  good_step(1);
  const std::string path = rig_->dir() + "/state.ckpt";
  ASSERT_TRUE(opt().save_checkpoint(path).ok());
  Reference at1 = *ref_;
  rig_->faults()->fail_nth(9, EIO, nvme::IoOp::kWrite);
  fails_part_way(2, StatusCode::kIoError);
  rig_->faults()->clear_faults();
  ASSERT_TRUE(opt().load_checkpoint(path).ok());
  EXPECT_FALSE(opt().stats().failed_step_owed);
  EXPECT_EQ(opt().partitions_with_grads(), 0u);
  *ref_ = at1;
  ref_->clear();
  ASSERT_TRUE(test::state_matches(opt(), *ref_));
  good_step(2);
}

// Lamb: the finish keeps the trust ratios pass 1 took over the state the step began with.
TEST_P(OneCopy, ALambStepFinishedAfterAFailureMatchesTheReference) {
  cpu::AdamHyperParams lamb = cpu::default_hyper_params(cpu::OptimizerKind::kLamb);
  lamb.lr = 1e-2;
  lamb.weight_decay = 0.01;
  OffloadedOptimizerOptions o = once_options(0.5);
  o.groups = {lamb, lamb, lamb};
  rig_ = std::make_unique<Rig>(GetParam(), o);
  ASSERT_TRUE(rig_->status().ok()) << rig_->status();
  ref_ = std::make_unique<Reference>(test::mixed_model(), o.groups, 5);
  ASSERT_TRUE(rig_->register_model(*ref_, 5).ok());
  sink_ = std::make_unique<GatheringSink>(test::mixed_model());
  max_norm_ = 0.5;
  good_step(1);
  rig_->faults()->fail_nth(9, EIO, nvme::IoOp::kWrite);  // pass 1 only reads
  fails_part_way(2, StatusCode::kIoError);
  rig_->faults()->clear_faults();
  finishes(2);
  good_step(3);
}

TEST(OneCopyOptions, StateCopiesOtherThanOneOrTwoAreRefused) {
  OffloadedOptimizerOptions o;
  o.home = StateHome::kHost;
  o.state_copies = 3;
  auto r = OffloadedOptimizer::create(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("state_copies 3"), std::string::npos) << r.status();
}

INSTANTIATE_TEST_SUITE_P(Homes, OneCopy, testing::ValuesIn(test::nvme_homes()), test::home_name);

}  // namespace
}  // namespace tier::optim
