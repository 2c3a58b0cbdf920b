// Compressed optimizer state in the offloaded optimizer (OffloadedOptimizerOptions::state_dtype):
// steps over bf16 and int8 moments on every state home give the same bytes as the in-RAM kernel on
// whole partitions; the records shrink accordingly; state access decodes and encodes; checkpoints
// keep the compressed bytes as they are and convert between formats on load; Lamb and bad values
// are refused.
#include <gtest/gtest.h>

#include <tuple>

#include "optim/optim_test_util.hpp"
#include "tier/config.hpp"

namespace tier::optim {
namespace {

using cpu::StateDType;
using test::feed;
using test::Home;
using test::Reference;
using test::Rig;

OffloadedOptimizerOptions opts(StateDType sd, std::uint64_t chunk = 4096) {
  OffloadedOptimizerOptions o;
  o.groups = test::three_groups();
  o.chunk_elements = chunk;
  o.buffer_count = 3;
  o.max_grad_norm = 0.05;  // clips: the grad_scale reaches the compressed kernel
  o.state_dtype = sd;
  return o;
}

// One step on both, bf16 gradients; the outputs go to per-partition destinations.
void step_both(OffloadedOptimizer& opt, Reference& ref, std::uint64_t step, test::Outputs* outs = nullptr) {
  feed(opt, ref, step, 1, DType::kBF16, GradMode::kCopy);
  ASSERT_TRUE(ref.step(1.0, 0.05));
  const std::vector<void*> dest = outs ? outs->pointers() : std::vector<void*>{};
  StepOptions so;
  so.destinations = dest;
  auto r = opt.step(so);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->applied);
}

class StateDTypes : public testing::TestWithParam<std::tuple<Home, StateDType>> {
 protected:
  void SetUp() override {
    const std::string why = test::home_unavailable(home());
    if (!why.empty()) GTEST_SKIP() << why;
  }
  const Home& home() const { return std::get<0>(GetParam()); }
  StateDType sd() const { return std::get<1>(GetParam()); }
};

TEST_P(StateDTypes, StepsMatchTheInRamKernelBitForBit) {
  Reference ref(test::mixed_model(), test::three_groups(), 11, sd());
  auto rig = test::make_rig(home(), opts(sd()), ref);
  ASSERT_TRUE(rig->status().ok());
  test::Outputs outs(ref.model());
  for (std::uint64_t step = 1; step <= 4; ++step) {
    step_both(rig->opt(), ref, step, &outs);
    if (HasFatalFailure()) return;
    ASSERT_TRUE(test::state_matches(rig->opt(), ref)) << "after step " << step;
  }
  for (std::size_t i = 0; i < ref.model().size(); ++i) {
    const std::size_t bytes = ref.model()[i].numel * param_output_size(ref.model()[i].output);
    EXPECT_EQ(std::memcmp(outs.data[i].data(), ref.out(i).data(), bytes), 0) << "outputs of partition " << i;
  }
  // The moments really are compressed: some m differs from its fp32 counterpart in a reference
  // that keeps fp32 state.
  Reference fp32(test::mixed_model(), test::three_groups(), 11);
  auto plain = test::make_rig(home(), opts(StateDType::kF32), fp32);
  for (std::uint64_t step = 1; step <= 4; ++step) {
    step_both(plain->opt(), fp32, step);
    if (HasFatalFailure()) return;
  }
  EXPECT_NE(std::memcmp(fp32.exp_avg(3).data(), ref.exp_avg(3).data(), ref.model()[3].numel * 4), 0);
}

TEST_P(StateDTypes, CheckpointsKeepTheCompressedBytesAndContinue) {
  Reference ref(test::mixed_model(), test::three_groups(), 11, sd());
  auto a = test::make_rig(home(), opts(sd()), ref);
  ASSERT_TRUE(a->status().ok());
  for (std::uint64_t step = 1; step <= 2; ++step) step_both(a->opt(), ref, step);
  if (HasFatalFailure()) return;
  test::ScratchDir dir(nvme::test::shm_base(), "ckpt-sd");
  ASSERT_TRUE(dir.ok());
  const std::string file = dir.sub("opt.ckpt");
  ASSERT_TRUE(a->opt().save_checkpoint(file).ok());
  // Into another chunk size (the records are cut differently from the chunks that read them).
  Reference fresh(test::mixed_model(), test::three_groups(), 99, sd());
  auto b = test::make_rig(home(), opts(sd(), 3072), fresh);
  ASSERT_TRUE(b->status().ok());
  const Status s = b->opt().load_checkpoint(file);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(test::state_matches(b->opt(), ref));
  step_both(b->opt(), ref, 3);
  if (HasFatalFailure()) return;
  ASSERT_TRUE(test::state_matches(b->opt(), ref));
}

// The fp32 moments `v` of a partition as the optimizer's format holds them: encoded and decoded.
std::vector<float> through(StateDType sd, cpu::StateMoment m, const std::vector<float>& v) {
  const std::uint64_t n = v.size();
  if (sd == StateDType::kF32) return v;
  const DType dt = m == cpu::StateMoment::kExpAvg ? cpu::exp_avg_dtype(sd) : cpu::exp_avg_sq_dtype(sd);
  std::vector<std::uint8_t> enc(n * dtype_size(dt) + 4);
  std::vector<float> scales(cpu::state_scale_count(sd, n) + 1);
  float* sc = sd == StateDType::kInt8 ? scales.data() : nullptr;
  EXPECT_TRUE(cpu::encode_state(m, {v.data(), DType::kF32, n}, {enc.data(), dt, n}, sc).ok());
  std::vector<float> out(n);
  EXPECT_TRUE(cpu::decode_state(m, {enc.data(), dt, n}, sc, {out.data(), DType::kF32, n}).ok());
  return out;
}

TEST_P(StateDTypes, CheckpointsConvertFromAndToEveryOtherFormat) {
  test::ScratchDir dir(nvme::test::shm_base(), "ckpt-conv");
  ASSERT_TRUE(dir.ok());
  for (StateDType other : {StateDType::kF32, StateDType::kBF16, StateDType::kInt8}) {
    if (other == sd()) continue;
    for (int way = 0; way < 2; ++way) {
      const StateDType from = way == 0 ? other : sd();
      const StateDType to = way == 0 ? sd() : other;
      SCOPED_TRACE(str(cpu::state_dtype_name(from), " -> ", cpu::state_dtype_name(to)));
      Reference ref(test::mixed_model(), test::three_groups(), 11, from);
      auto a = test::make_rig(home(), opts(from), ref);
      ASSERT_TRUE(a->status().ok());
      for (std::uint64_t step = 1; step <= 2; ++step) step_both(a->opt(), ref, step);
      if (HasFatalFailure()) return;
      const std::string file = dir.sub(str("opt-", way, "-", cpu::state_dtype_name(other), ".ckpt"));
      ASSERT_TRUE(a->opt().save_checkpoint(file).ok());
      Reference fresh(test::mixed_model(), test::three_groups(), 99, to);
      auto b = test::make_rig(home(), opts(to, 3072), fresh);
      ASSERT_TRUE(b->status().ok());
      const Status s = b->opt().load_checkpoint(file);
      ASSERT_TRUE(s.ok()) << s;
      for (std::size_t i = 0; i < ref.model().size(); ++i) {
        const std::uint64_t n = ref.model()[i].numel;
        std::vector<float> got(n);
        const auto id = static_cast<PartitionId>(i);
        ASSERT_TRUE(b->opt().read_state(id, StateKind::kMaster, got.data(), 0, n).ok());
        ASSERT_TRUE(test::same_bits(got.data(), ref.master(i).data(), n, str("master ", i)));
        ASSERT_TRUE(b->opt().read_state(id, StateKind::kExpAvg, got.data(), 0, n).ok());
        const auto m = through(to, cpu::StateMoment::kExpAvg, ref.exp_avg(i));
        ASSERT_TRUE(test::same_bits(got.data(), m.data(), n, str("exp_avg ", i)));
        ASSERT_TRUE(b->opt().read_state(id, StateKind::kExpAvgSq, got.data(), 0, n).ok());
        const auto v = through(to, cpu::StateMoment::kExpAvgSq, ref.exp_avg_sq(i));
        ASSERT_TRUE(test::same_bits(got.data(), v.data(), n, str("exp_avg_sq ", i)));
      }
      feed(b->opt(), fresh, 3, 1, DType::kBF16, GradMode::kCopy);
      auto r = b->opt().step();
      ASSERT_TRUE(r.ok()) << r.status();
    }
  }
}

TEST_P(StateDTypes, WriteStateEncodesAndReadStateDecodes) {
  Reference ref(test::mixed_model(), test::three_groups(), 11, sd());
  auto rig = test::make_rig(home(), opts(sd()), ref);
  ASSERT_TRUE(rig->status().ok());
  step_both(rig->opt(), ref, 1);
  if (HasFatalFailure()) return;
  OffloadedOptimizer& opt = rig->opt();
  // Partition 3 (20000 elements) spans chunks; a stretch from inside one block to inside another.
  const std::uint64_t off = 300, count = 9000;
  std::vector<float> m(count), v(count);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(0.5f, 1.0f);
  for (std::uint64_t i = 0; i < count; ++i) {
    m[i] = (i % 3 == 0 ? -1.0f : 1.0f) * u(rng) * 1e-3f;
    v[i] = u(rng) * 1e-6f;
  }
  ASSERT_TRUE(opt.write_state(3, StateKind::kExpAvg, m.data(), off, count).ok());
  ASSERT_TRUE(opt.write_state(3, StateKind::kExpAvgSq, v.data(), off, count).ok());
  std::vector<float> got(count);
  // Within the formats' documented error (the values lie within a factor 2 of their block's
  // largest, so int8's absolute term is below its relative one).
  const double m_tol = sd() == StateDType::kBF16 ? 1.0 / 256 : 1.0 / 16 + 1e-3;
  const double v_tol = sd() == StateDType::kBF16 ? 1.0 / 256 : 2 * (1.0 / 32 + 1e-3) + 1e-3;
  ASSERT_TRUE(opt.read_state(3, StateKind::kExpAvg, got.data(), off, count).ok());
  for (std::uint64_t i = 0; i < count; ++i) ASSERT_NEAR(got[i], m[i], m_tol * std::fabs(m[i])) << "exp_avg " << i;
  ASSERT_TRUE(opt.read_state(3, StateKind::kExpAvgSq, got.data(), off, count).ok());
  for (std::uint64_t i = 0; i < count; ++i) ASSERT_NEAR(got[i], v[i], v_tol * v[i]) << "exp_avg_sq " << i;

  // A value the format cannot hold is refused and changes nothing, also in the blocks before it.
  const std::uint64_t n = ref.model()[3].numel;
  std::vector<float> before(n), after(n);
  ASSERT_TRUE(opt.read_state(3, StateKind::kExpAvgSq, before.data(), 0, n).ok());
  v[7000] = -1.0f;
  const Status s = opt.write_state(3, StateKind::kExpAvgSq, v.data(), off, count);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  ASSERT_TRUE(opt.read_state(3, StateKind::kExpAvgSq, after.data(), 0, n).ok());
  ASSERT_TRUE(test::same_bits(after.data(), before.data(), n, "exp_avg_sq after a refused write"));
  m[10] = std::nanf("");
  EXPECT_EQ(opt.write_state(3, StateKind::kExpAvg, m.data(), off, count).code(), StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Homes, StateDTypes,
                         testing::Combine(testing::ValuesIn(test::all_homes()),
                                          testing::Values(StateDType::kBF16, StateDType::kInt8)),
                         [](const testing::TestParamInfo<std::tuple<Home, StateDType>>& info) {
                           return str(std::get<0>(info.param).name, "_",
                                      cpu::state_dtype_name(std::get<1>(info.param)));
                         });

TEST(StateDTypeOptions, RecordsShrinkWithTheFormat) {
  const Home host{"host", StateHome::kHost, IoEngineKind::kAuto, false};
  std::uint64_t bytes[3] = {};
  for (StateDType sd : {StateDType::kF32, StateDType::kBF16, StateDType::kInt8}) {
    Reference ref(test::mixed_model(), test::three_groups(), 11, sd);
    auto rig = test::make_rig(host, opts(sd, 65536), ref);
    ASSERT_TRUE(rig->status().ok());
    const OptimizerStats st = rig->opt().stats();
    EXPECT_EQ(st.state_dtype, sd);
    EXPECT_EQ(st.elements, test::total_elements(ref.model()));
    bytes[static_cast<int>(sd)] = st.record_bytes;
  }
  // 12, 8 and about 6 bytes per element, plus each section's page rounding.
  EXPECT_LT(static_cast<double>(bytes[1]) / static_cast<double>(bytes[0]), 0.7);
  EXPECT_LT(static_cast<double>(bytes[2]) / static_cast<double>(bytes[0]), 0.55);
}

TEST(StateDTypeOptions, LambIsRefusedWithCompressedState) {
  OffloadedOptimizerOptions o = opts(StateDType::kInt8);
  o.home = StateHome::kHost;
  o.groups = {cpu::default_hyper_params(cpu::OptimizerKind::kLamb)};
  auto r = OffloadedOptimizer::create(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("Lamb"), std::string::npos) << r.status();
  o.groups = test::three_groups();
  auto ok = OffloadedOptimizer::create(o);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_FALSE((*ok)->add_group(cpu::default_hyper_params(cpu::OptimizerKind::kLamb)).ok());
  EXPECT_TRUE((*ok)->add_group(cpu::default_hyper_params(cpu::OptimizerKind::kLion)).ok());
}

TEST(StateDTypeOptions, TheConfigKeySelectsTheFormat) {
  for (const char* name : {"fp32", "bf16", "int8"}) {
    auto cfg =
        EngineConfig::from_json(str(R"({"tier": {"optimizer": {"state_dtype": ")", name, R"("}}})"), {false, false});
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    auto o = OffloadedOptimizerOptions::from_config(*cfg);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_STREQ(cpu::state_dtype_name(o->state_dtype), name);
  }
  auto bad = EngineConfig::from_json(R"({"tier": {"optimizer": {"state_dtype": "fp8"}}})", {false, false});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("tier.optimizer.state_dtype"), std::string::npos) << bad.status();
  auto lamb = EngineConfig::from_json(
      R"({"optimizer": {"type": "Lamb"}, "tier": {"optimizer": {"state_dtype": "bf16"}}})", {false, false});
  ASSERT_TRUE(lamb.ok()) << lamb.status();
  EXPECT_FALSE(OffloadedOptimizerOptions::from_config(*lamb).ok());
}

}  // namespace
}  // namespace tier::optim
