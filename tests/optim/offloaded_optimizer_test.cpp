// The offloaded optimizer against the in-RAM CPU Adam: after N steps params, moments and the
// low-precision outputs are bit-identical, for every state home, several chunk sizes and buffer
// counts, mixed partition sizes and groups, fp32/fp16/bf16 gradients, copied and borrowed.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <map>
#include <thread>
#include <tuple>

#include "optim/optim_test_util.hpp"
#include "tier/config.hpp"
#include "tier/stats.hpp"

namespace tier::optim {
namespace {

using test::feed;
using test::Home;
using test::PartDesc;
using test::Reference;
using test::Rig;

struct Layout {
  std::uint64_t chunk_elements;
  unsigned buffers;
};

class OptimizerEquivalence : public testing::TestWithParam<std::tuple<Home, Layout>> {};

TEST_P(OptimizerEquivalence, MatchesInRamAdamBitForBit) {
  const Home home = std::get<0>(GetParam());
  const Layout layout = std::get<1>(GetParam());
  if (auto why = test::home_unavailable(home); !why.empty()) GTEST_SKIP() << why;
  const auto model = test::mixed_model();
  const auto groups = test::three_groups();
  OffloadedOptimizerOptions o;
  o.groups = groups;
  o.chunk_elements = layout.chunk_elements;
  o.buffer_count = layout.buffers;
  o.threads = 2;
  Rig rig(home, o);
  ASSERT_TRUE(rig.status().ok()) << rig.status();
  Reference ref(model, groups, 7);
  ASSERT_TRUE(rig.register_model(ref, 7).ok());
  const auto st = rig.opt().stats();
  EXPECT_EQ(st.elements, test::total_elements(model));
  EXPECT_EQ(st.chunks, (st.elements + layout.chunk_elements - 1) / layout.chunk_elements);
  ASSERT_TRUE(test::state_matches(rig.opt(), ref));

  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kF32, DType::kBF16};
  for (std::uint64_t step = 1; step <= 5; ++step) {
    if (step == 3) {
      ASSERT_TRUE(rig.opt().set_lr(1, 1e-3).ok());
      ref.set_lr(1, 1e-3);
    }
    std::vector<std::vector<std::uint8_t>> keep;
    const GradMode mode = step % 2 ? GradMode::kCopy : GradMode::kBorrow;
    feed(rig.opt(), ref, step, 1, dtypes[step - 1], mode, &keep);
    ASSERT_TRUE(ref.step(1.0, 0.0));

    // Even partitions take their output in place; the others through the sink.
    test::Outputs outs(model);
    std::map<PartitionId, std::uint64_t> delivered;
    const std::vector<void*> dest = outs.pointers([](PartitionId id) { return id % 2 == 0; });
    test::FnSink sink([&](const OutputChunk& c) -> Status {
      EXPECT_NE(c.partition % 2, 0u);
      EXPECT_EQ(c.dtype, model[c.partition].output);
      const std::size_t es = param_output_size(c.dtype);
      std::memcpy(outs.data[c.partition].data() + c.offset * es, c.data, c.numel * es);
      delivered[c.partition] += c.numel;
      return {};
    });
    StepOptions so;
    so.destinations = dest;
    so.sink = &sink;
    auto r = rig.opt().step(so);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->applied);
    EXPECT_EQ(r->step, static_cast<std::int64_t>(step));
    EXPECT_EQ(r->chunks, st.chunks);
    if (home.home == StateHome::kNvme) {
      EXPECT_EQ(r->read.bytes, r->write.bytes);
      EXPECT_EQ(r->read.transfers, st.chunks);
      EXPECT_GE(r->max_transfers_in_flight, 1u);
      EXPECT_LE(r->max_transfers_in_flight, layout.buffers);
    }
    EXPECT_EQ(rig.opt().partitions_with_grads(), 0u);
    ASSERT_TRUE(test::state_matches(rig.opt(), ref)) << "after step " << step;
    for (std::size_t i = 0; i < model.size(); ++i) {
      const std::size_t bytes = model[i].numel * param_output_size(model[i].output);
      if (bytes == 0) continue;
      EXPECT_EQ(std::memcmp(outs.data[i].data(), ref.out(i).data(), bytes), 0) << "output of partition " << i;
      if (i % 2) {
        EXPECT_EQ(delivered[static_cast<PartitionId>(i)], model[i].numel) << "partition " << i;
      }
    }
  }
  EXPECT_EQ(*rig.opt().group_step(2), 5);
}

std::string equivalence_name(const testing::TestParamInfo<std::tuple<Home, Layout>>& info) {
  const Layout l = std::get<1>(info.param);
  return str(std::get<0>(info.param).name, "_chunk", l.chunk_elements, "_buf", l.buffers);
}

INSTANTIATE_TEST_SUITE_P(Layouts, OptimizerEquivalence,
                         testing::Combine(testing::ValuesIn(test::all_homes()),
                                          testing::Values(Layout{1024, 1}, Layout{2048, 2}, Layout{4096, 3},
                                                          Layout{8192, 5})),
                         equivalence_name);

// ------------------------------------------------------------------------------------ per home

class OptimizerHome : public testing::TestWithParam<Home> {
 protected:
  void SetUp() override {
    if (auto why = test::home_unavailable(GetParam()); !why.empty()) GTEST_SKIP() << why;
  }
  std::unique_ptr<Rig> make(OffloadedOptimizerOptions o, const Reference& ref) {
    return test::make_rig(GetParam(), std::move(o), ref);
  }
};

TEST_P(OptimizerHome, AccumulatesMicroStepsAndClips) {
  const auto model = test::mixed_model();
  const auto groups = test::three_groups();
  OffloadedOptimizerOptions o;
  o.groups = groups;
  o.gradient_accumulation_steps = 3;
  o.max_grad_norm = 0.05;  // well below the gradients' norm: every step clips
  Reference ref(model, groups, 11);
  auto rig = make(o, ref);
  ASSERT_TRUE(rig->status().ok());
  for (std::uint64_t step = 1; step <= 3; ++step) {
    feed(rig->opt(), ref, step, 3, step == 2 ? DType::kF16 : DType::kBF16, GradMode::kCopy);
    double norm = 0;
    ASSERT_TRUE(ref.step(1.0, o.max_grad_norm, &norm));
    auto r = rig->opt().step();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->grad_norm, norm);  // same sums in the same order
    EXPECT_LT(r->clip_coefficient, 1.0);
    EXPECT_EQ(r->clip_coefficient, cpu::clip_coefficient(norm, o.max_grad_norm));
    EXPECT_EQ(r->late_norm_partitions, 0u);  // every norm came with the last micro-step
    ASSERT_TRUE(test::state_matches(rig->opt(), ref)) << "after step " << step;
  }
  EXPECT_GT(rig->opt().stats().accumulator_bytes, 0u);
}

TEST_P(OptimizerHome, MissingAndPartialGradients) {
  const auto model = test::mixed_model();
  const auto groups = test::three_groups();
  OffloadedOptimizerOptions o;
  o.groups = groups;
  o.gradient_accumulation_steps = 2;
  Reference ref(model, groups, 11);
  auto rig = make(o, ref);
  ASSERT_TRUE(rig->status().ok());
  // Partition 1 gets one micro-step only (norm computed at step()), partition 3 none (zeros),
  // the others both.
  for (int micro = 0; micro < 2; ++micro) {
    for (std::size_t i = 0; i < model.size(); ++i) {
      if (i == 3 || (i == 1 && micro == 1)) continue;
      auto g = test::make_grad(model[i].numel, DType::kF32, test::grad_seed(1, micro, i));
      ASSERT_TRUE(rig->opt()
                      .add_grad(static_cast<PartitionId>(i), cpu::ConstTensorRef(g.data(), DType::kF32, model[i].numel))
                      .ok());
      ref.add_grad(i, g.data(), DType::kF32);
    }
  }
  EXPECT_EQ(rig->opt().partitions_with_grads(), model.size() - 1);
  ASSERT_TRUE(ref.step(1.0, 0));
  auto r = rig->opt().step();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->late_norm_partitions, 1u);
  EXPECT_EQ(r->zero_grad_partitions, 1u);
  EXPECT_TRUE(test::state_matches(rig->opt(), ref));
}

TEST_P(OptimizerHome, SkipMissingGradsLeavesThosePartitionsUntouched) {
  const auto model = test::mixed_model();
  const auto groups = test::three_groups();
  OffloadedOptimizerOptions o;
  o.groups = groups;
  o.max_grad_norm = 0.05;
  Reference ref(model, groups, 11);
  auto rig = make(o, ref);
  ASSERT_TRUE(rig->status().ok());
  // The untouched partition's params as registered, in its output dtype, to compare the
  // destination against (it must not be written).
  const std::size_t frozen = 2;
  ASSERT_NE(model[frozen].output, ParamOutput::kNone);
  const std::vector<float> before = ref.master(frozen);
  for (std::uint64_t step = 1; step <= 3; ++step) {
    test::Outputs outs(model);
    std::vector<std::uint8_t> sentinel(outs.data[frozen].size(), 0xA5);
    outs.data[frozen] = sentinel;
    for (std::size_t i = 0; i < model.size(); ++i) {
      if (i == frozen && step != 2) continue;  // a gradient in step 2 only
      auto g = test::make_grad(model[i].numel, DType::kBF16, test::grad_seed(step, 0, i));
      ASSERT_TRUE(
          rig->opt()
              .add_grad(static_cast<PartitionId>(i), cpu::ConstTensorRef(g.data(), DType::kBF16, model[i].numel))
              .ok());
      ref.add_grad(i, g.data(), DType::kBF16);
    }
    double norm = 0;
    ASSERT_TRUE(ref.step(1.0, o.max_grad_norm, &norm, true));
    const std::vector<void*> dest = outs.pointers();
    StepOptions so;
    so.skip_missing_grads = true;
    so.destinations = dest;
    auto r = rig->opt().step(so);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->grad_norm, norm);
    EXPECT_EQ(r->zero_grad_partitions, step == 2 ? 0u : 1u);
    ASSERT_TRUE(test::state_matches(rig->opt(), ref)) << "after step " << step;
    if (step == 1) {
      // Never stepped: the master is as registered, the moments zero.
      std::vector<float> got(model[frozen].numel);
      ASSERT_TRUE(rig->opt().read_state(frozen, StateKind::kMaster, got.data(), 0, got.size()).ok());
      EXPECT_TRUE(test::same_bits(got.data(), before.data(), got.size(), "untouched master"));
    }
    if (step != 2) {
      EXPECT_EQ(outs.data[frozen], sentinel) << "the destination of an untouched partition was written";
    } else {
      EXPECT_NE(outs.data[frozen], sentinel);
    }
  }
  // Without the option the same missing gradient means an update with zeros (DeepSpeed's way).
  for (std::size_t i = 0; i < model.size(); ++i) {
    if (i == frozen) continue;
    auto g = test::make_grad(model[i].numel, DType::kBF16, test::grad_seed(4, 0, i));
    ASSERT_TRUE(rig->opt()
                    .add_grad(static_cast<PartitionId>(i), cpu::ConstTensorRef(g.data(), DType::kBF16, model[i].numel))
                    .ok());
    ref.add_grad(i, g.data(), DType::kBF16);
  }
  ASSERT_TRUE(ref.step(1.0, o.max_grad_norm));
  ASSERT_TRUE(rig->opt().step().ok());
  EXPECT_TRUE(test::state_matches(rig->opt(), ref));
}

TEST_P(OptimizerHome, Fp16OverflowSkipsTheStepAndBacksOffTheScale) {
  const std::vector<PartDesc> model = {{3000, 0, ParamOutput::kF16}, {9000, 0, ParamOutput::kF16}};
  const std::vector<cpu::AdamHyperParams> groups = {test::three_groups()[0]};
  OffloadedOptimizerOptions o;
  o.groups = groups;
  o.loss_scale.enabled = true;
  o.loss_scale.dynamic = true;
  o.loss_scale.initial_scale = 256;
  o.loss_scale.hysteresis = 2;
  o.loss_scale.window = 2;
  Reference ref(model, groups, 11);
  auto rig = make(o, ref);
  ASSERT_TRUE(rig->status().ok());
  EXPECT_EQ(rig->opt().loss_scale(), 256);

  auto scaled_step = [&](std::uint64_t step, bool poison) -> Result<StepReport> {
    const double scale = rig->opt().loss_scale();
    for (std::size_t i = 0; i < model.size(); ++i) {
      auto g =
          test::make_grad(model[i].numel, DType::kF16, test::grad_seed(step, 0, i), static_cast<float>(1e-3 * scale));
      if (poison && i == 1) {
        const std::uint16_t inf = 0x7C00;
        std::memcpy(g.data() + 2 * 4321, &inf, 2);
      }
      EXPECT_TRUE(rig->opt()
                      .add_grad(static_cast<PartitionId>(i), cpu::ConstTensorRef(g.data(), DType::kF16, model[i].numel))
                      .ok());
      ref.add_grad(i, g.data(), DType::kF16);
    }
    EXPECT_EQ(ref.step(scale, 0), !poison);
    return rig->opt().step();
  };

  auto r = scaled_step(1, false);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->applied);
  EXPECT_EQ(r->loss_scale, 256);
  ASSERT_TRUE(test::state_matches(rig->opt(), ref));

  // First overflow: skipped; hysteresis 2 -> 1 keeps the scale.
  r = scaled_step(2, true);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->applied);
  EXPECT_TRUE(r->overflow);
  EXPECT_FALSE(std::isfinite(r->grad_norm));
  EXPECT_EQ(r->next_loss_scale, 256);
  EXPECT_EQ(r->step, 1);
  ASSERT_TRUE(test::state_matches(rig->opt(), ref));
  EXPECT_EQ(rig->opt().partitions_with_grads(), 0u);

  // Second overflow: halved.
  r = scaled_step(3, true);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->applied);
  EXPECT_EQ(r->next_loss_scale, 128);
  EXPECT_EQ(rig->opt().stats().steps_skipped, 2u);

  // Clean steps at the new scale; after `window` of them the scale doubles.
  for (std::uint64_t step = 4; step <= 6; ++step) {
    r = scaled_step(step, false);
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(r->applied);
    ASSERT_TRUE(test::state_matches(rig->opt(), ref)) << "step " << step;
  }
  EXPECT_EQ(rig->opt().loss_scale(), 256);
  EXPECT_EQ(*rig->opt().group_step(0), 4);
}

TEST_P(OptimizerHome, SinkErrorStillAppliesTheStep) {
  const auto model = test::mixed_model();
  const auto groups = test::three_groups();
  OffloadedOptimizerOptions o;
  o.groups = groups;
  Reference ref(model, groups, 11);
  auto rig = make(o, ref);
  ASSERT_TRUE(rig->status().ok());
  feed(rig->opt(), ref, 1, 1, DType::kF32, GradMode::kCopy);
  ASSERT_TRUE(ref.step(1.0, 0));
  int calls = 0;
  test::FnSink sink([&](const OutputChunk&) -> Status {
    ++calls;
    return calls == 2 ? Status(StatusCode::kDeviceError, "copy to the device failed") : Status();
  });
  StepOptions so;
  so.sink = &sink;
  auto r = rig->opt().step(so);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDeviceError);
  EXPECT_NE(r.status().message().find("was applied"), std::string::npos) << r.status();
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(*rig->opt().group_step(0), 1);
  EXPECT_TRUE(test::state_matches(rig->opt(), ref));
  // read_params gives what the step would have delivered.
  for (std::size_t i = 0; i < model.size(); ++i) {
    if (model[i].output == ParamOutput::kNone) continue;
    std::vector<std::uint8_t> got(model[i].numel * 4);
    ASSERT_TRUE(
        rig->opt().read_params(static_cast<PartitionId>(i), param_output_dtype(model[i].output), got.data()).ok());
    EXPECT_EQ(std::memcmp(got.data(), ref.out(i).data(), model[i].numel * param_output_size(model[i].output)), 0)
        << "partition " << i;
  }
}

TEST_P(OptimizerHome, WriteStateIsReadBackAndUsedByTheNextStep) {
  const auto model = test::mixed_model();
  const auto groups = test::three_groups();
  OffloadedOptimizerOptions o;
  o.groups = groups;
  o.chunk_elements = 2048;
  Reference ref(model, groups, 11);
  auto rig = make(o, ref);
  ASSERT_TRUE(rig->status().ok());
  // Overwrite part of partition 3 (spans several chunks) in the optimizer and in the reference.
  const std::uint64_t off = 1000, n = 9000;
  std::vector<float> vals = test::initial_values(n, 99);
  for (auto& v : vals) v = std::fabs(v);  // valid as exp_avg_sq too
  for (StateKind k : {StateKind::kMaster, StateKind::kExpAvgSq}) {
    ASSERT_TRUE(rig->opt().write_state(3, k, vals.data(), off, n).ok());
    std::vector<float> back(n);
    ASSERT_TRUE(rig->opt().read_state(3, k, back.data(), off, n).ok());
    EXPECT_TRUE(test::same_bits(back.data(), vals.data(), n, "read back"));
  }
  // Mirror into a reference whose state starts from the same values.
  Reference ref2(model, groups, 11);
  auto* p = const_cast<float*>(ref2.master(3).data());
  auto* v = const_cast<float*>(ref2.exp_avg_sq(3).data());
  std::memcpy(p + off, vals.data(), n * 4);
  std::memcpy(v + off, vals.data(), n * 4);
  feed(rig->opt(), ref2, 1, 1, DType::kBF16, GradMode::kCopy);
  ASSERT_TRUE(ref2.step(1.0, 0));
  ASSERT_TRUE(rig->opt().step().ok());
  EXPECT_TRUE(test::state_matches(rig->opt(), ref2));
  // Out of range is refused.
  EXPECT_EQ(rig->opt().read_state(0, StateKind::kMaster, vals.data(), 0, 2).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(rig->opt().write_state(99, StateKind::kMaster, vals.data(), 0, 1).code(), StatusCode::kInvalidArgument);
}

TEST_P(OptimizerHome, DiagnosticPassesLeaveTheStateAlone) {
  const auto model = test::mixed_model();
  const auto groups = test::three_groups();
  OffloadedOptimizerOptions o;
  o.groups = groups;
  Reference ref(model, groups, 11);
  auto rig = make(o, ref);
  ASSERT_TRUE(rig->status().ok());
  std::vector<std::vector<std::uint8_t>> keep;
  feed(rig->opt(), ref, 1, 1, DType::kBF16, GradMode::kBorrow, &keep);
  auto up = rig->opt().measure_update_seconds();
  ASSERT_TRUE(up.ok()) << up.status();
  EXPECT_GT(up->seconds, 0);
  EXPECT_EQ(up->elements, test::total_elements(model));
  auto io = rig->opt().measure_io_seconds();
  if (GetParam().home == StateHome::kNvme) {
    ASSERT_TRUE(io.ok()) << io.status();
    EXPECT_EQ(io->bytes_read, io->bytes_written);
    EXPECT_GE(io->bytes_read, test::total_elements(model) * 12);
  } else {
    EXPECT_EQ(io.status().code(), StatusCode::kFailedPrecondition);
  }
  EXPECT_EQ(*rig->opt().group_step(0), 0);
  ASSERT_TRUE(test::state_matches(rig->opt(), ref));
  // The gradients are still there for the real step.
  ASSERT_TRUE(ref.step(1.0, 0));
  ASSERT_TRUE(rig->opt().step().ok());
  EXPECT_TRUE(test::state_matches(rig->opt(), ref));
}

TEST_P(OptimizerHome, MisuseIsRefusedWithClearErrors) {
  OffloadedOptimizerOptions o;
  o.gradient_accumulation_steps = 2;
  o.chunk_elements = 1024;
  Rig rig(GetParam(), o);
  ASSERT_TRUE(rig.status().ok()) << rig.status();
  OffloadedOptimizer& opt = rig.opt();
  PartitionSpec ps;
  ps.numel = 100;
  ps.name = "w";
  ASSERT_TRUE(opt.add_partition(ps).ok());
  std::vector<float> g(100, 0.5f);
  const cpu::ConstTensorRef gr(g.data(), DType::kF32, 100);
  EXPECT_EQ(opt.add_grad(0, gr).code(), StatusCode::kFailedPrecondition);  // before finish_registration
  EXPECT_EQ(opt.step().status().code(), StatusCode::kFailedPrecondition);
  ps.group = 3;
  EXPECT_EQ(opt.add_partition(ps).status().code(), StatusCode::kInvalidArgument);
  ps.group = 0;
  ps.numel = 0;
  EXPECT_EQ(opt.add_partition(ps).status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(opt.finish_registration().ok());
  ASSERT_TRUE(opt.finish_registration().ok());  // idempotent
  ps.numel = 5;
  EXPECT_EQ(opt.add_partition(ps).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(opt.add_grad(1, gr).code(), StatusCode::kInvalidArgument);  // no such partition
  EXPECT_EQ(opt.add_grad(0, cpu::ConstTensorRef(g.data(), DType::kF32, 99)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(opt.add_grad(0, cpu::ConstTensorRef(g.data(), DType::kI32, 100)).code(), StatusCode::kInvalidArgument);
  const Status borrow = opt.add_grad(0, gr, GradMode::kBorrow);
  EXPECT_EQ(borrow.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(borrow.message().find("gradient_accumulation_steps"), std::string::npos) << borrow;
  ASSERT_TRUE(opt.add_grad(0, gr).ok());
  ASSERT_TRUE(opt.add_grad(0, gr).ok());
  const Status third = opt.add_grad(0, gr);
  EXPECT_EQ(third.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(third.message().find("'w'"), std::string::npos) << third;
  opt.clear_grads();
  EXPECT_EQ(opt.partitions_with_grads(), 0u);
  EXPECT_EQ(opt.set_lr(4, 0.1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(opt.set_lr(0, -1).code(), StatusCode::kInvalidArgument);
  auto g1 = opt.add_group(cpu::AdamHyperParams{});
  ASSERT_TRUE(g1.ok());
  EXPECT_EQ(*g1, 1);
}

// A ParamSink may start asynchronous transfers from the staging (here: writes of the bf16 params to
// their own NVMe home); the optimizer keeps the staging until they complete. Partition sizes are
// multiples of 2048 so that every piece lands at a 4 KiB-aligned offset of its extent.
TEST_P(OptimizerHome, OutputsGoToAnNvmeHomeInTheSamePass) {
  const std::vector<PartDesc> model = {{2048, 0, ParamOutput::kBF16},
                                       {10240, 0, ParamOutput::kBF16},
                                       {4096, 0, ParamOutput::kNone},
                                       {6144, 0, ParamOutput::kBF16}};
  const std::vector<cpu::AdamHyperParams> groups = {test::three_groups()[0]};
  OffloadedOptimizerOptions o;
  o.groups = groups;
  o.chunk_elements = 4096;
  o.buffer_count = 2;
  Reference ref(model, groups, 11);
  auto rig = make(o, ref);
  ASSERT_TRUE(rig->status().ok());

  test::ScratchDir dir(nvme::test::shm_base(), "optim-params");
  ASSERT_TRUE(dir.ok());
  nvme::SwapSpaceOptions so;
  so.paths = {dir.sub("params")};
  so.bytes_per_path = 1 << 20;
  so.engine = IoEngineKind::kPosix;
  so.use_direct = false;
  auto sp = nvme::SwapSpace::create(so);
  ASSERT_TRUE(sp.ok()) << sp.status();
  std::vector<nvme::SwapExtent> homes;
  for (const auto& p : model) homes.push_back(std::move((*sp)->allocate(p.numel * 2)).value());

  for (std::uint64_t step = 1; step <= 2; ++step) {
    feed(rig->opt(), ref, step, 1, DType::kBF16, GradMode::kCopy);
    ASSERT_TRUE(ref.step(1.0, 0));
    std::uint64_t started = 0;
    test::FnSink sink([&](const OutputChunk& c) -> Status {
      EXPECT_EQ(c.offset * 2 % 4096, 0u);
      c.pending->push_back((*sp)->write(homes[c.partition], c.data, c.numel * 2, c.offset * 2));
      ++started;
      return {};
    });
    StepOptions opts;
    opts.sink = &sink;
    auto r = rig->opt().step(opts);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(started, 6u);  // pieces: partition 0 in one chunk, 1 in three, 3 in two
    ASSERT_TRUE(test::state_matches(rig->opt(), ref));
    for (std::size_t i = 0; i < model.size(); ++i) {
      if (model[i].output == ParamOutput::kNone) continue;
      std::vector<std::uint8_t> back(model[i].numel * 2);
      ASSERT_TRUE((*sp)->read(homes[i], back.data(), back.size()).wait().ok());
      EXPECT_EQ(std::memcmp(back.data(), ref.out(i).data(), back.size()), 0) << "partition " << i << " step " << step;
    }
  }
  homes.clear();
}

// The low-precision copy handed out is exactly the fp32 master rounded to nearest, whatever the
// thread count: partitions straddle the update threads' 32 Ki-element pieces and the chunks, and
// reach the caller both through the sink (packed staging) and in place (destination).
TEST_P(OptimizerHome, LowPrecisionOutputsAreTheRoundedMastersForAnyThreadCount) {
  const std::vector<PartDesc> model = {
      {1, 0, ParamOutput::kBF16},     {100003, 0, ParamOutput::kBF16}, {65537, 0, ParamOutput::kF16},
      {40000, 0, ParamOutput::kBF16}, {32768, 0, ParamOutput::kF16},   {70001, 0, ParamOutput::kBF16},
      {5, 0, ParamOutput::kF16},      {33000, 0, ParamOutput::kNone},  {98304, 0, ParamOutput::kBF16}};
  const std::vector<cpu::AdamHyperParams> groups = {test::three_groups()[0]};
  for (const int threads : {1, 2, 3, 16}) {
    for (const bool in_place : {false, true}) {
      SCOPED_TRACE(str(threads, " threads, ", in_place ? "destination" : "sink"));
      OffloadedOptimizerOptions o;
      o.groups = groups;
      o.chunk_elements = 131072;  // four update pieces per chunk
      o.buffer_count = 2;
      o.threads = threads;
      Reference ref(model, groups, 11);
      auto rig = make(o, ref);
      ASSERT_TRUE(rig->status().ok());
      for (std::uint64_t step = 1; step <= 2; ++step) {
        feed(rig->opt(), ref, step, 1, DType::kBF16, GradMode::kCopy);
        ASSERT_TRUE(ref.step(1.0, 0));
        test::Outputs outs(model);
        for (auto& d : outs.data) std::fill(d.begin(), d.end(), 0xEE);  // no stale zeros can pass
        const std::vector<void*> dest = in_place ? outs.pointers() : std::vector<void*>{};
        test::FnSink sink([&](const OutputChunk& c) -> Status {
          const std::size_t es = param_output_size(c.dtype);
          std::memcpy(outs.data[c.partition].data() + c.offset * es, c.data, c.numel * es);
          return {};
        });
        StepOptions so;
        so.destinations = dest;
        so.sink = &sink;
        auto r = rig->opt().step(so);
        ASSERT_TRUE(r.ok()) << r.status();
        ASSERT_TRUE(test::state_matches(rig->opt(), ref)) << "step " << step;
        for (std::size_t i = 0; i < model.size(); ++i) {
          if (model[i].output == ParamOutput::kNone) continue;
          const std::uint64_t n = model[i].numel;
          const DType od = param_output_dtype(model[i].output);
          std::vector<std::uint8_t> rounded(n * 2);
          ASSERT_TRUE(cpu::convert(cpu::ConstTensorRef(ref.master(i).data(), DType::kF32, n),
                                   cpu::TensorRef{rounded.data(), od, n})
                          .ok());
          for (std::uint64_t k = 0; k < n; ++k) {
            if (std::memcmp(outs.data[i].data() + k * 2, rounded.data() + k * 2, 2) != 0) {
              ADD_FAILURE() << "partition " << i << " (" << dtype_name(od) << ") element " << k << " of " << n
                            << " is not its rounded master after step " << step;
              break;
            }
          }
        }
      }
    }
  }
}

// Gradients may arrive from several threads at once, for different partitions.
TEST_P(OptimizerHome, GradientsFromSeveralThreads) {
  std::vector<PartDesc> model;
  for (int i = 0; i < 64; ++i) model.push_back({static_cast<std::uint64_t>(100 + 37 * i), i % 3, ParamOutput::kBF16});
  model.push_back({300000, 0, ParamOutput::kBF16});  // large enough to use several workers
  const auto groups = test::three_groups();
  OffloadedOptimizerOptions o;
  o.groups = groups;
  o.gradient_accumulation_steps = 2;
  o.chunk_elements = 65536;
  Reference ref(model, groups, 11);
  auto rig = make(o, ref);
  ASSERT_TRUE(rig->status().ok());
  for (std::uint64_t step = 1; step <= 2; ++step) {
    std::vector<std::vector<std::vector<std::uint8_t>>> grads(2);
    for (int micro = 0; micro < 2; ++micro) {
      for (std::size_t i = 0; i < model.size(); ++i) {
        grads[micro].push_back(test::make_grad(model[i].numel, DType::kF16, test::grad_seed(step, micro, i)));
        ref.add_grad(i, grads[micro][i].data(), DType::kF16);
      }
    }
    std::vector<std::thread> pool;
    std::atomic<int> failures{0};
    for (int t = 0; t < 4; ++t) {
      pool.emplace_back([&, t] {
        for (int micro = 0; micro < 2; ++micro) {
          for (std::size_t i = static_cast<std::size_t>(t); i < model.size(); i += 4) {
            const Status s = rig->opt().add_grad(
                static_cast<PartitionId>(i), cpu::ConstTensorRef(grads[micro][i].data(), DType::kF16, model[i].numel));
            if (!s.ok()) ++failures;
          }
        }
      });
    }
    for (auto& th : pool) th.join();
    EXPECT_EQ(failures.load(), 0);
    double norm = 0;
    ASSERT_TRUE(ref.step(1.0, 0, &norm));
    auto r = rig->opt().step();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->grad_norm, norm);
    ASSERT_TRUE(test::state_matches(rig->opt(), ref)) << "step " << step;
  }
}

INSTANTIATE_TEST_SUITE_P(Homes, OptimizerHome, testing::ValuesIn(test::all_homes()), test::home_name);

// ------------------------------------------------------------------------------------ options

TEST(OptimizerOptions, FromConfigReadsDeepSpeedKeys) {
  auto cfg = EngineConfig::from_json(R"({
    "gradient_accumulation_steps": 4, "gradient_clipping": 1.5,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}},
    "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
             "hysteresis": 3, "min_loss_scale": 2},
    "zero_optimization": {"stage": 3, "sub_group_size": 100000,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x", "buffer_count": 6}},
    "tier": {"optimizer_threads": 2, "optimizer": {"buffer_bytes": "64M"}}
  })",
                                     {false, false});
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  auto o = OffloadedOptimizerOptions::from_config(*cfg, 1000000);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->home, StateHome::kNvme);
  EXPECT_EQ(o->buffer_count, 6u);
  EXPECT_EQ(o->buffer_bytes, 64ull << 20);
  EXPECT_EQ(o->chunk_elements, 99328u);  // sub_group_size rounded down to 1024
  EXPECT_EQ(o->max_elements, 1000000u);
  EXPECT_EQ(o->gradient_accumulation_steps, 4);
  EXPECT_EQ(o->max_grad_norm, 1.5);
  EXPECT_EQ(o->threads, 2);
  ASSERT_EQ(o->groups.size(), 1u);
  EXPECT_EQ(o->groups[0].lr, 3e-4);
  EXPECT_EQ(o->groups[0].beta1, 0.8);
  EXPECT_EQ(o->groups[0].decay_mode, cpu::WeightDecayMode::kDecoupled);
  EXPECT_TRUE(o->loss_scale.enabled);
  EXPECT_TRUE(o->loss_scale.dynamic);
  EXPECT_EQ(o->loss_scale.initial_scale, 4096);
  EXPECT_EQ(o->loss_scale.window, 500);
  EXPECT_EQ(o->loss_scale.hysteresis, 3);
  EXPECT_EQ(o->loss_scale.min_scale, 2);
  ASSERT_EQ(o->swap_options.paths.size(), 1u);
  EXPECT_EQ(o->swap_options.paths[0], "/tmp/x");
  // tier.optimizer.state_copies: one copy unless the config asks for two.
  EXPECT_EQ(o->state_copies, 1u);
  EXPECT_EQ(o->speculation_chunks, 0u);
  auto two = EngineConfig::from_json(
      R"({"tier": {"optimizer": {"state_copies": 2, "speculation_chunks": 3}},
          "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"}}})",
      {false, false});
  ASSERT_TRUE(two.ok()) << two.status();
  auto t = OffloadedOptimizerOptions::from_config(*two, 1000);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->state_copies, 2u);
  EXPECT_EQ(t->speculation_chunks, 3u);

  auto host = EngineConfig::from_json(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false}},
                                          "zero_optimization": {"offload_optimizer": {"device": "cpu"}}})",
                                      {false, false});
  ASSERT_TRUE(host.ok()) << host.status();
  auto h = OffloadedOptimizerOptions::from_config(*host);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->home, StateHome::kHost);
  EXPECT_EQ(h->groups[0].decay_mode, cpu::WeightDecayMode::kL2);
  EXPECT_FALSE(h->loss_scale.enabled);
}

// Without tier.optimizer.buffer_bytes the pipeline's buffers take at most an eighth of an explicit
// host budget (they are reserved inside it), so a small budget is not filled by them.
TEST(OptimizerOptions, BuffersAreSizedFromAnExplicitHostBudget) {
  auto small = EngineConfig::from_json(R"({"tier": {"budgets": {"host": "16M"}},
      "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"}}})",
                                       {false, false});
  ASSERT_TRUE(small.ok()) << small.status();
  auto o = OffloadedOptimizerOptions::from_config(*small, 3000000);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->buffer_bytes, 2ull << 20);
  o->home = StateHome::kHost;  // sized without swap files: the pinned buffers are what is checked
  auto opt = OffloadedOptimizer::create(*o);
  ASSERT_TRUE(opt.ok()) << opt.status();
  EXPECT_LE((*opt)->stats().pinned_bytes, 2ull << 20);
  // A large budget keeps the default cap; a given buffer_bytes is kept as given.
  auto large = EngineConfig::from_json(R"({"tier": {"budgets": {"host": "64G"}}})", {false, false});
  ASSERT_TRUE(large.ok());
  EXPECT_EQ(OffloadedOptimizerOptions::from_config(*large)->buffer_bytes, 256ull << 20);
  auto given = EngineConfig::from_json(R"({"tier": {"budgets": {"host": "16M"}, "optimizer": {"buffer_bytes": "8M"}}})",
                                       {false, false});
  ASSERT_TRUE(given.ok());
  EXPECT_EQ(OffloadedOptimizerOptions::from_config(*given)->buffer_bytes, 8ull << 20);
  auto automatic = EngineConfig::from_json("{}", {false, false});
  ASSERT_TRUE(automatic.ok());
  EXPECT_EQ(OffloadedOptimizerOptions::from_config(*automatic)->buffer_bytes, 0u);
}

TEST(OptimizerOptions, BadOptionsAreRefused) {
  OffloadedOptimizerOptions o;
  o.home = StateHome::kHost;
  o.buffer_count = 0;
  EXPECT_EQ(OffloadedOptimizer::create(o).status().code(), StatusCode::kInvalidArgument);
  o.buffer_count = 2;
  o.chunk_elements = 1000;
  EXPECT_EQ(OffloadedOptimizer::create(o).status().code(), StatusCode::kInvalidArgument);
  o.chunk_elements = 1 << 20;
  o.buffer_bytes = 1 << 20;
  const Status tight = OffloadedOptimizer::create(o).status();
  EXPECT_EQ(tight.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(tight.message().find("buffer_bytes"), std::string::npos) << tight;
  o.chunk_elements = 0;
  o.buffer_bytes = 0;
  o.max_grad_norm = -1;
  EXPECT_EQ(OffloadedOptimizer::create(o).status().code(), StatusCode::kInvalidArgument);
  o.max_grad_norm = 0;
  o.groups[0].beta1 = 1.5;
  EXPECT_EQ(OffloadedOptimizer::create(o).status().code(), StatusCode::kInvalidArgument);
  o.groups[0].beta1 = 0.9;
  o.home = StateHome::kNvme;  // no swap space and no max_elements
  EXPECT_EQ(OffloadedOptimizer::create(o).status().code(), StatusCode::kInvalidArgument);
}

// The optimizer makes its own arena and swap space from the options, sized for max_elements,
// keeps the pinned memory within buffer_bytes and reports into the counters.
TEST(OptimizerOptions, CreatesItsOwnSwapSpaceAndReportsResidency) {
  test::ScratchDir dir(nvme::test::shm_base(), "optim-own");
  ASSERT_TRUE(dir.ok());
  const auto model = test::mixed_model();
  const auto groups = test::three_groups();
  Counters counters;
  OffloadedOptimizerOptions o;
  o.home = StateHome::kNvme;
  o.groups = groups;
  o.max_elements = test::total_elements(model);
  o.buffer_bytes = 1 << 20;
  o.buffer_count = 4;
  o.swap_options.paths = {dir.sub("swap")};
  o.swap_options.use_direct = false;
  o.swap_options.engine = IoEngineKind::kPosix;
  o.counters = &counters;
  {
    auto opt = OffloadedOptimizer::create(o);
    ASSERT_TRUE(opt.ok()) << opt.status();
    const auto st0 = (*opt)->stats();
    EXPECT_LE(st0.pinned_bytes, o.buffer_bytes);
    EXPECT_EQ(st0.chunk_elements, 16384u);  // 1 MiB / 4 buffers / 16 bytes per element
    Reference ref(model, groups, 5);
    for (std::size_t i = 0; i < model.size(); ++i) {
      const auto init = test::initial_values(model[i].numel, 5 + i);
      PartitionSpec ps{model[i].numel, model[i].group, model[i].output, init.data(), ""};
      ASSERT_TRUE((*opt)->add_partition(ps).ok());
    }
    PartitionSpec extra{1, 0, ParamOutput::kNone, nullptr, "one too many"};
    // Not yet past max_elements would be accepted; this one is past it.
    EXPECT_EQ((*opt)->add_partition(extra).status().code(), StatusCode::kResourceExhausted);
    ASSERT_TRUE((*opt)->finish_registration().ok());
    feed(**opt, ref, 1, 1, DType::kF32, GradMode::kCopy);
    ASSERT_TRUE(ref.step(1.0, 0));
    ASSERT_TRUE((*opt)->step().ok());
    EXPECT_TRUE(test::state_matches(**opt, ref));
    const auto snap = counters.snapshot();
    EXPECT_GE(snap.tier(Tier::kNvme).resident_bytes, 24 * test::total_elements(model));
    EXPECT_GE(snap.tier(Tier::kHost).resident_bytes, st0.pinned_bytes);
    EXPECT_GT(snap.link(Link::kNvmeToHost).bytes, 0u);
    EXPECT_GT(snap.link(Link::kHostToNvme).bytes, 0u);
    EXPECT_EQ(snap.metrics.at("optim.steps"), 1);
  }
  const auto snap = counters.snapshot();
  EXPECT_EQ(snap.tier(Tier::kNvme).resident_bytes, 0u);
  EXPECT_EQ(snap.tier(Tier::kHost).resident_bytes, 0u);
}

// Many small partitions share chunks: a thousand of them cost a handful of transfers.
TEST(OptimizerPacking, SmallPartitionsShareChunks) {
  test::ScratchDir dir(nvme::test::shm_base(), "optim-pack");
  ASSERT_TRUE(dir.ok());
  std::vector<PartDesc> model;
  for (int i = 0; i < 1000; ++i) model.push_back({static_cast<std::uint64_t>(1 + i % 37), i % 2, ParamOutput::kBF16});
  model.push_back({50000, 0, ParamOutput::kBF16});
  const auto groups = std::vector<cpu::AdamHyperParams>{test::three_groups()[0], test::three_groups()[1]};
  OffloadedOptimizerOptions o;
  o.groups = groups;
  o.chunk_elements = 8192;
  o.buffer_count = 3;
  Rig rig({"nvme_posix_shm", StateHome::kNvme, IoEngineKind::kPosix, false}, o);
  ASSERT_TRUE(rig.status().ok()) << rig.status();
  Reference ref(model, groups, 3);
  ASSERT_TRUE(rig.register_model(ref, 3).ok());
  const auto st = rig.opt().stats();
  EXPECT_EQ(st.partitions, 1001u);
  EXPECT_EQ(st.chunks, (test::total_elements(model) + 8191) / 8192);
  EXPECT_LE(st.chunks, 10u);
  std::vector<std::vector<std::uint8_t>> keep;
  feed(rig.opt(), ref, 1, 1, DType::kBF16, GradMode::kBorrow, &keep);
  ASSERT_TRUE(ref.step(1.0, 0));
  auto r = rig.opt().step();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->read.transfers, st.chunks);
  EXPECT_EQ(r->write.transfers, st.chunks);
  EXPECT_TRUE(test::state_matches(rig.opt(), ref));
}

}  // namespace
}  // namespace tier::optim
