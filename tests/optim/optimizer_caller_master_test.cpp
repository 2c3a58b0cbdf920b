// Masters held by the caller (OffloadedOptimizerOptions::master_source): the records on disk hold
// the moments only, the step reads each partition's fp32 master from the source and writes the
// updated values back once the chunk's record is committed. Steps (serial, overlapped, clipped
// and redone, skipped) give the in-RAM reference's state bit for bit; a step that fails part-way
// leaves every chunk whole (its master in the source agrees with its record, before or after the
// step) and the next step finishes it to the reference's result; a source that fails applies
// nothing; checkpoints keep their format (a file saved this way loads into an optimizer that holds
// its masters, and back); what cannot work this way is refused.
#include <gtest/gtest.h>

#include <map>

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
constexpr std::uint64_t kSeed = 21;

// mixed_model's sizes (one partition spans several chunks, several share one), as an fp32 model
// whose params are the masters.
std::vector<PartDesc> fp32_model() {
  std::vector<PartDesc> m = test::mixed_model();
  for (PartDesc& p : m) p.output = p.output == ParamOutput::kNone ? ParamOutput::kNone : ParamOutput::kF32;
  return m;
}

// The masters in memory, as an engine's tensors would hold them; every lease is checked.
class Masters final : public MasterSource {
 public:
  explicit Masters(const std::vector<PartDesc>& m) {
    for (std::size_t i = 0; i < m.size(); ++i) values.push_back(test::initial_values(m[i].numel, kSeed + i));
    held.assign(m.size(), 0);
  }
  Result<float*> acquire(PartitionId id) override {
    if (id >= values.size()) return invalid_argument("no such partition");
    if (held[id]) return internal_error(str("partition ", id, " acquired twice"));
    if (fail_id == static_cast<std::int64_t>(id)) return Status(StatusCode::kIoError, "the source failed");
    held[id] = 1;
    ++acquires;
    return values[id].data();
  }
  Status release(PartitionId id, bool wrote) override {
    if (id >= values.size() || !held[id]) return internal_error(str("partition ", id, " released but not held"));
    held[id] = 0;
    writes += wrote ? 1 : 0;
    return {};
  }
  void prefetch(PartitionId id) override { hints[id] += 1; }
  std::uint64_t outstanding() const {
    std::uint64_t n = 0;
    for (std::uint8_t h : held) n += h;
    return n;
  }
  ::testing::AssertionResult match(const Reference& ref) const {
    for (std::size_t i = 0; i < values.size(); ++i) {
      auto r = test::same_bits(values[i].data(), ref.master(i).data(), values[i].size(), str("source master ", i));
      if (!r) return r;
    }
    return ::testing::AssertionSuccess();
  }

  std::vector<std::vector<float>> values;
  std::vector<std::uint8_t> held;
  std::map<PartitionId, int> hints;
  std::int64_t fail_id = -1;
  std::uint64_t acquires = 0, writes = 0;
};

OffloadedOptimizerOptions options(MasterSource* src, double max_norm, cpu::StateDType sd = cpu::StateDType::kF32) {
  OffloadedOptimizerOptions o;
  o.groups = test::three_groups();
  o.chunk_elements = kChunk;
  o.buffer_count = kBuffers;
  o.max_grad_norm = max_norm;
  o.state_copies = 1;
  o.state_dtype = sd;
  o.master_source = src;
  return o;
}

// Registers `model` without initial values: the source holds them.
Status register_without_initial(OffloadedOptimizer& opt, const std::vector<PartDesc>& model) {
  for (std::size_t i = 0; i < model.size(); ++i) {
    PartitionSpec ps;
    ps.numel = model[i].numel;
    ps.group = model[i].group;
    ps.output = model[i].output;
    ps.name = str("p", i);
    TIER_ASSIGN_OR_RETURN(PartitionId id, opt.add_partition(ps));
    if (id != i) return internal_error("unexpected partition id");
  }
  return opt.finish_registration();
}

struct Case {
  Home home;
  cpu::StateDType sd;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.home.name << "_" << cpu::state_dtype_name(c.sd);
}

class CallerMasters : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (auto why = test::home_unavailable(GetParam().home); !why.empty()) GTEST_SKIP() << why;
  }
  void make(double max_norm) {
    masters_ = std::make_unique<Masters>(fp32_model());
    rig_ = std::make_unique<Rig>(GetParam().home, options(masters_.get(), max_norm, GetParam().sd));
    ASSERT_TRUE(rig_->status().ok()) << rig_->status();
    ref_ = std::make_unique<Reference>(fp32_model(), test::three_groups(), kSeed, GetParam().sd);
    ASSERT_TRUE(register_without_initial(opt(), fp32_model()).ok());
    max_norm_ = max_norm;
    ASSERT_TRUE(matches());
  }
  ::testing::AssertionResult matches() {
    if (masters_->outstanding() != 0) {
      return ::testing::AssertionFailure() << masters_->outstanding() << " masters still held";
    }
    auto r = masters_->match(*ref_);
    if (!r) return r;
    return test::state_matches(opt(), *ref_);  // (its masters read through the source)
  }
  void good_step(std::uint64_t step) {
    feed(opt(), *ref_, step, 1, DType::kBF16, GradMode::kCopy);
    ASSERT_TRUE(ref_->step(1.0, max_norm_));
    auto r = opt().step();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->updated_chunks, opt().stats().chunks);
    ASSERT_TRUE(matches());
  }
  // Every chunk is whole after a failure: its master in the source is the reference's before the
  // step (`before`) or after it (`after`), all of its partitions' pieces alike.
  ::testing::AssertionResult chunks_whole(const std::vector<std::vector<float>>& before,
                                          const std::vector<std::vector<float>>& after, std::uint64_t* updated) {
    *updated = 0;
    std::uint64_t flat = 0;
    const std::vector<PartDesc> model = fp32_model();
    std::vector<int> chunk_state;  // per chunk: -1 unknown, 0 before, 1 after
    for (std::size_t i = 0; i < model.size(); ++i) {
      // (int8 state starts each partition on a 256-element block)
      if (GetParam().sd == cpu::StateDType::kInt8)
        flat = (flat + cpu::kStateBlock - 1) / cpu::kStateBlock * cpu::kStateBlock;
      for (std::uint64_t k = 0; k < model[i].numel; ++k, ++flat) {
        const float v = masters_->values[i][k];
        const bool is_before = std::memcmp(&v, &before[i][k], 4) == 0;
        const bool is_after = std::memcmp(&v, &after[i][k], 4) == 0;
        if (!is_before && !is_after) {
          return ::testing::AssertionFailure() << "partition " << i << " element " << k << " is neither";
        }
        const std::size_t c = static_cast<std::size_t>(flat / kChunk);
        if (chunk_state.size() <= c) chunk_state.resize(c + 1, -1);
        if (is_before == is_after) continue;  // unchanged by the step
        const int s = is_after ? 1 : 0;
        if (chunk_state[c] >= 0 && chunk_state[c] != s) {
          return ::testing::AssertionFailure() << "chunk " << c << " is half updated";
        }
        chunk_state[c] = s;
      }
    }
    for (int s : chunk_state) *updated += s == 1 ? 1 : 0;
    return ::testing::AssertionSuccess();
  }
  OffloadedOptimizer& opt() { return rig_->opt(); }

  std::unique_ptr<Masters> masters_;
  std::unique_ptr<Rig> rig_;
  std::unique_ptr<Reference> ref_;
  double max_norm_ = 0;
};

TEST_P(CallerMasters, StepsMatchTheReferenceAndTheRecordsHoldTheMomentsOnly) {
  make(0);
  for (std::uint64_t step = 1; step <= 3; ++step) good_step(step);
  // The source was read and written once per partition and step (held across its chunks), and
  // the serial step hinted the masters it was about to ask for.
  const std::uint64_t parts = fp32_model().size();
  EXPECT_EQ(masters_->writes, 3 * parts);
  EXPECT_FALSE(masters_->hints.empty());
  // Beside the same model whose masters are in the records: the master section is gone.
  Rig own(GetParam().home, options(nullptr, 0, GetParam().sd));
  ASSERT_TRUE(own.status().ok()) << own.status();
  ASSERT_TRUE(own.register_model(*ref_, kSeed).ok());
  const OptimizerStats a = opt().stats(), b = own.opt().stats();
  const std::uint64_t master_section = kChunk * 4;  // 8 KiB for a whole chunk
  EXPECT_EQ(a.chunks, b.chunks);
  if (GetParam().sd == cpu::StateDType::kF32) {
    EXPECT_EQ(a.record_bytes * 3, b.record_bytes * 2);  // 8 bytes per element instead of 12
  }
  EXPECT_GE(b.record_bytes - a.record_bytes, (a.chunks - 1) * master_section);
  // Every slot and spare holds a whole chunk's record.
  EXPECT_EQ(a.nvme_bytes + (a.chunks + kBuffers) * master_section, b.nvme_bytes);
  // No params are delivered: the update is the params. read_params converts the source's.
  EXPECT_EQ(opt().partition_output(5), ParamOutput::kNone);
  for (PartitionId id : {PartitionId{3}, PartitionId{7}}) {
    const std::uint64_t n = fp32_model()[id].numel;
    std::vector<std::uint16_t> got(n), want(n);
    ASSERT_TRUE(opt().read_params(id, DType::kBF16, got.data()).ok());
    ASSERT_TRUE(cpu::convert(cpu::ConstTensorRef(ref_->master(id).data(), DType::kF32, n),
                             cpu::TensorRef{want.data(), DType::kBF16, n})
                    .ok());
    EXPECT_EQ(got, want) << "partition " << id;
  }
  EXPECT_EQ(masters_->outstanding(), 0u);
}

TEST_P(CallerMasters, OverlappedStepsMatchTheReferenceWhetherThePassHoldsIsRedoneOrSkipped) {
  make(0);
  good_step(1);
  const std::uint64_t chunks = opt().stats().chunks;
  ASSERT_GT(chunks, kBuffers + 2u);
  // Held: the pass updates as many chunks as it has spares (buffers), the rest follows at finish.
  ASSERT_TRUE(opt().start_overlapped_step(StepOptions{}).ok());
  feed(opt(), *ref_, 2, 1, DType::kBF16, GradMode::kCopy);
  ASSERT_TRUE(ref_->step(1.0, 0));
  auto r = opt().finish_overlapped_step();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->overlapped);
  EXPECT_FALSE(r->redone);
  EXPECT_EQ(r->updated_chunks, chunks);
  ASSERT_TRUE(matches());
  // Clipped: the pass is dropped (nothing it computed reaches the source) and the step redone.
  rig_.reset();
  ref_.reset();
  make(1.0);
  good_step(1);
  ASSERT_TRUE(opt().start_overlapped_step(StepOptions{}).ok());
  feed(opt(), *ref_, 2, 1, DType::kBF16, GradMode::kCopy);
  ASSERT_TRUE(ref_->step(1.0, 1.0));
  r = opt().finish_overlapped_step();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->redone);
  ASSERT_TRUE(matches());
  // Skipped (a non-finite gradient): the masters stay as they were.
  ASSERT_TRUE(opt().start_overlapped_step(StepOptions{}).ok());
  std::vector<std::vector<std::uint8_t>> keep;
  feed(opt(), *ref_, 3, 1, DType::kBF16, GradMode::kCopy, &keep);
  opt().cancel_overlapped_step();  // (cancelled: nothing changes either)
  ASSERT_TRUE(matches());
  opt().clear_grads();
  ref_->clear();
  std::vector<float> bad(fp32_model()[1].numel, 1e-3f);
  bad[7] = std::numeric_limits<float>::infinity();
  ASSERT_TRUE(opt().start_overlapped_step(StepOptions{}).ok());
  for (std::size_t i = 0; i < fp32_model().size(); ++i) {
    std::vector<float> g(fp32_model()[i].numel, 1e-3f);
    ASSERT_TRUE(opt()
                    .add_grad(static_cast<PartitionId>(i),
                              cpu::ConstTensorRef(i == 1 ? bad.data() : g.data(), DType::kF32, g.size()))
                    .ok());
  }
  r = opt().finish_overlapped_step();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->applied);
  ASSERT_TRUE(matches());
  good_step(3);
}

// A write fails part-way: the chunks written before it took their update, and their masters (in
// the source) with them; the others are as before. The next step finishes it.
TEST_P(CallerMasters, AStepThatFailsPartWayLeavesEveryChunkWholeAndIsFinished) {
  make(1.0);
  good_step(1);
  const std::vector<std::vector<float>> before = masters_->values;
  feed(opt(), *ref_, 2, 1, DType::kBF16, GradMode::kCopy);
  ASSERT_TRUE(ref_->step(1.0, 1.0));
  std::vector<std::vector<float>> after;
  for (std::size_t i = 0; i < fp32_model().size(); ++i) after.push_back(ref_->master(i));
  rig_->faults()->fail_nth(7, EIO, nvme::IoOp::kWrite);
  auto r = opt().step();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("chunks took their update"), std::string::npos) << r.status();
  EXPECT_EQ(masters_->outstanding(), 0u);
  std::uint64_t updated = 0;
  ASSERT_TRUE(chunks_whole(before, after, &updated));
  EXPECT_GT(updated, 0u);
  EXPECT_LT(updated, opt().stats().chunks);
  rig_->faults()->clear_faults();
  auto fin = opt().step();
  ASSERT_TRUE(fin.ok()) << fin.status();
  EXPECT_TRUE(fin->finished_failed);
  ASSERT_TRUE(matches());
  good_step(3);
}

// The source fails for one partition: the step stops there, nothing after it is updated, and a
// retry gives the reference's step.
TEST_P(CallerMasters, ASourceThatFailsIsRetriedToTheSameResult) {
  make(0);
  good_step(1);
  feed(opt(), *ref_, 2, 1, DType::kBF16, GradMode::kCopy);
  masters_->fail_id = 0;  // the first partition: no chunk can take its update
  auto r = opt().step();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kIoError) << r.status();
  EXPECT_NE(r.status().message().find("master params of partition 0"), std::string::npos) << r.status();
  EXPECT_FALSE(opt().failed_step_owed());
  EXPECT_EQ(masters_->outstanding(), 0u);
  masters_->fail_id = -1;
  ASSERT_TRUE(matches());  // the reference has not stepped
  masters_->fail_id = 7;   // part-way: owed, then finished
  r = opt().step();
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(opt().failed_step_owed());
  EXPECT_EQ(masters_->outstanding(), 0u);
  masters_->fail_id = -1;
  ASSERT_TRUE(ref_->step(1.0, 0));
  auto fin = opt().step();
  ASSERT_TRUE(fin.ok()) << fin.status();
  ASSERT_TRUE(matches());
}

// The checkpoint's format is the same: the masters come from the source into the file, and a
// file loads into an optimizer holding its own masters, or back into the source.
TEST_P(CallerMasters, CheckpointsKeepTheirFormatAndCrossLoad) {
  make(0);
  good_step(1);
  const std::string path = rig_->dir() + "/caller.ckpt";
  ASSERT_TRUE(opt().save_checkpoint(path).ok());
  EXPECT_EQ(masters_->outstanding(), 0u);
  std::vector<std::vector<float>> saved = masters_->values;
  // Its masters as read without an optimizer.
  std::vector<std::vector<float>> read(saved.size());
  ASSERT_TRUE(read_checkpoint_masters(
                  path,
                  [&](const CheckpointPartition& p, std::uint64_t off, const float* v, std::uint64_t n) -> Status {
                    read[p.id].resize(saved[p.id].size());
                    std::memcpy(read[p.id].data() + off, v, n * 4);
                    return {};
                  })
                  .ok());
  for (std::size_t i = 0; i < saved.size(); ++i)
    ASSERT_TRUE(test::same_bits(read[i].data(), saved[i].data(), saved[i].size(), "file master"));
  // Into an optimizer with its masters in the records.
  Rig own(GetParam().home, options(nullptr, 0, GetParam().sd));
  ASSERT_TRUE(own.status().ok()) << own.status();
  ASSERT_TRUE(own.register_model(*ref_, 99).ok());  // other initial values, overwritten by the load
  ASSERT_TRUE(own.opt().load_checkpoint(path).ok());
  ASSERT_TRUE(test::state_matches(own.opt(), *ref_));
  // Back into the source after two more steps: the masters and moments of step 1 again.
  const Reference at_one = *ref_;
  good_step(2);
  good_step(3);
  ASSERT_TRUE(opt().load_checkpoint(path).ok());
  *ref_ = at_one;
  ASSERT_TRUE(matches());
  good_step(2);
}

INSTANTIATE_TEST_SUITE_P(Homes, CallerMasters,
                         testing::Values(Case{test::nvme_homes()[0], cpu::StateDType::kF32},
                                         Case{test::nvme_homes()[1], cpu::StateDType::kF32},
                                         Case{test::nvme_homes()[1], cpu::StateDType::kInt8}),
                         [](const testing::TestParamInfo<Case>& i) {
                           return str(i.param.home.name, "_", cpu::state_dtype_name(i.param.sd));
                         });

TEST(CallerMastersOptions, WhatCannotKeepTheMastersOutsideIsRefused) {
  Masters src(fp32_model());
  auto refused = [&](OffloadedOptimizerOptions o, const char* needle) {
    o.swap_options.paths = {"/nonexistent"};
    o.max_elements = 1 << 20;
    auto opt = OffloadedOptimizer::create(o);
    ASSERT_FALSE(opt.ok()) << needle;
    EXPECT_EQ(opt.status().code(), StatusCode::kInvalidArgument) << opt.status();
    EXPECT_NE(opt.status().message().find(needle), std::string::npos) << opt.status();
  };
  OffloadedOptimizerOptions o = options(&src, 0);
  o.home = StateHome::kHost;
  refused(o, "the state on NVMe");
  o = options(&src, 0);
  o.state_copies = 2;
  refused(o, "state_copies 1");
  o = options(&src, 0);
  o.speculation_chunks = 2;
  refused(o, "speculation_chunks 0");
  o = options(&src, 0);
  o.groups[1].kind = cpu::OptimizerKind::kLamb;
  refused(o, "Lamb");
}

TEST(CallerMastersOptions, APartitionAskingForLowPrecisionParamsIsRefused) {
  const Home home = test::nvme_homes()[1];
  if (auto why = test::home_unavailable(home); !why.empty()) GTEST_SKIP() << why;
  Masters src(fp32_model());
  Rig rig(home, options(&src, 0));
  ASSERT_TRUE(rig.status().ok()) << rig.status();
  PartitionSpec ps;
  ps.numel = 10;
  ps.output = ParamOutput::kBF16;
  ps.name = "w";
  auto id = rig.opt().add_partition(ps);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(id.status().message().find("master_source"), std::string::npos) << id.status();
}

}  // namespace
}  // namespace tier::optim
