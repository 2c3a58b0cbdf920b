// The step driver (tier/step_driver.hpp): AdamW by parameter name against a reference written
// here, in host memory and on NVMe; every bad input refused with the parameter's name and nothing
// applied; bf16 params with fp32 masters; accumulation; checkpoints; the host passes per gradient
// element; borrowed gradients, skipped parameters, per-group hyper-parameters and the step
// overlapped with the gradients' arrival.
#include "tier/step_driver.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "nvme/nvme_test_util.hpp"
#include "optim/step_driver_test_util.hpp"
#include "tier/cpu_kernels.hpp"

namespace tier::step {
namespace {

using nvme::test::ScratchDir;

using test::kLr;
using test::kWd;
using test::RefAdamW;
using test::values;

std::string config_json(const std::string& nvme_dir, int accumulation = 1, const std::string& tier_extra = "") {
  std::string offload =
      nvme_dir.empty() ? R"({"device": "cpu"})" : R"({"device": "nvme", "nvme_path": ")" + nvme_dir + R"("})";
  return R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8,
            "weight_decay": 0.01}}, "gradient_accumulation_steps": )" +
         std::to_string(accumulation) + R"(, "zero_optimization": {"stage": 3, "offload_optimizer": )" + offload +
         R"(}, "tier": {"io": {"use_direct": false})" + tier_extra + "}}";
}

std::unique_ptr<StepDriver> make_driver(const std::string& nvme_dir, std::uint64_t elements, int accumulation = 1,
                                        const std::string& tier_extra = "") {
  auto cfg = EngineConfig::from_json(config_json(nvme_dir, accumulation, tier_extra));
  EXPECT_TRUE(cfg.ok()) << cfg.status().to_string();
  auto d = StepDriver::create(*cfg, elements);
  EXPECT_TRUE(d.ok()) << d.status().to_string();
  return d.ok() ? std::move(d).value() : nullptr;
}

struct Model {
  std::vector<std::vector<std::int64_t>> shapes{{16, 8}, {8}, {4, 16}};
  std::vector<std::vector<float>> params;
  Model() {
    for (std::size_t k = 0; k < shapes.size(); ++k) {
      std::size_t n = 1;
      for (auto d : shapes[k]) n *= std::size_t(d);
      params.push_back(values(n, 0.5f, float(k)));
    }
  }
  HostTensor tensor(std::size_t k, const void* data, DType dt = DType::kF32) const {
    return {data, dt, {shapes[k].data(), shapes[k].size()}};
  }
};

::testing::AssertionResult near(const std::vector<float>& got, const std::vector<double>& want, double tol) {
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::abs(double(got[i]) - want[i]) > tol * (1 + std::abs(want[i]))) {
      return ::testing::AssertionFailure() << "element " << i << ": " << got[i] << " vs " << want[i];
    }
  }
  return ::testing::AssertionSuccess();
}

class StepDriverHomes : public ::testing::TestWithParam<bool> {};  // true: NVMe

TEST_P(StepDriverHomes, TrainsAsAdamWAndWritesParamsInPlace) {
  std::unique_ptr<ScratchDir> dir;
  if (GetParam()) {
    dir = std::make_unique<ScratchDir>(nvme::test::shm_base(), "step-driver");
    ASSERT_TRUE(dir->ok());
  }
  Model m;
  auto d = make_driver(dir ? dir->sub("swap") : "", 16 * 8 + 8 + 4 * 16);
  ASSERT_NE(d, nullptr);
  std::vector<RefAdamW> ref;
  for (std::size_t k = 0; k < m.shapes.size(); ++k) {
    auto idx = d->add_param("p" + std::to_string(k), m.tensor(k, m.params[k].data()));
    ASSERT_TRUE(idx.ok()) << idx.status().to_string();
    EXPECT_EQ(*idx, k);
    ref.emplace_back(m.params[k]);
  }
  for (int step = 1; step <= 6; ++step) {
    StepArgs args;
    const double lr = kLr * (step <= 3 ? 1.0 : 0.5);  // a schedule: the lr changes at step 4
    args.lr = lr;
    for (std::size_t k = 0; k < m.shapes.size(); ++k) {
      const auto g = values(m.params[k].size(), 0.1f, float(step * 7 + k));
      ASSERT_TRUE(d->add_grad(k, m.tensor(k, g.data())).ok());
      ref[k].step(g, lr);
      args.outputs.push_back(m.params[k].data());
    }
    auto r = d->step(args);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_TRUE(r->applied);
    EXPECT_EQ(r->step, step);
    for (std::size_t k = 0; k < m.shapes.size(); ++k) EXPECT_TRUE(near(m.params[k], ref[k].p, 1e-5)) << "step " << step;
  }
  std::vector<float> exp_avg(m.params[0].size());
  ASSERT_TRUE(d->read_state(0, optim::StateKind::kExpAvg, exp_avg.data()).ok());
  std::vector<double> m_ref(ref[0].m.begin(), ref[0].m.end());
  EXPECT_TRUE(near(exp_avg, m_ref, 1e-5));
  // Intake plus the update's read: two host passes per gradient element, no more.
  EXPECT_DOUBLE_EQ(d->host_passes_per_grad_element(), 2.0);
}

INSTANTIATE_TEST_SUITE_P(Homes, StepDriverHomes, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "nvme" : "host"; });

// Every bad input fails with the parameter's name, and the step that follows equals the reference
// (nothing of the refused input was applied).
TEST(StepDriver, BadInputIsRefusedByNameAndNothingIsApplied) {
  Model m;
  auto d = make_driver("", 16 * 8 + 8 + 4 * 16);
  ASSERT_NE(d, nullptr);
  std::vector<RefAdamW> ref;
  for (std::size_t k = 0; k < m.shapes.size(); ++k) {
    ASSERT_TRUE(d->add_param("layer" + std::to_string(k), m.tensor(k, m.params[k].data())).ok());
    ref.emplace_back(m.params[k]);
  }
  // A name given twice, a group that does not exist, an integer dtype.
  auto twice = d->add_param("layer1", m.tensor(1, m.params[1].data()));
  EXPECT_EQ(twice.status().code(), StatusCode::kAlreadyExists);
  EXPECT_NE(twice.status().message().find("layer1"), std::string::npos);
  EXPECT_EQ(d->add_param("x", m.tensor(1, m.params[1].data()), 5).status().code(), StatusCode::kInvalidArgument);
  std::vector<std::int32_t> ints(8);
  EXPECT_EQ(d->add_param("y", m.tensor(1, ints.data(), DType::kI32)).status().code(), StatusCode::kInvalidArgument);

  const auto g0 = values(m.params[0].size(), 0.1f, 1);
  const auto g1 = values(m.params[1].size(), 0.1f, 2);
  const auto g2 = values(m.params[2].size(), 0.1f, 3);
  // A gradient of the wrong shape (the right count, transposed) and of an integer dtype.
  const std::vector<std::int64_t> transposed{8, 16};
  Status s = d->add_grad(0, {g0.data(), DType::kF32, {transposed.data(), 2}});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("layer0"), std::string::npos) << s.to_string();
  EXPECT_EQ(d->add_grad(1, m.tensor(1, ints.data(), DType::kI32)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(d->add_grad(7, m.tensor(1, g1.data())).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(d->add_grad(0, m.tensor(0, g0.data())).ok());
  ASSERT_TRUE(d->add_grad(2, m.tensor(2, g2.data())).ok());
  // A step while layer1 has no gradient.
  auto missing = d->step();
  EXPECT_EQ(missing.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(missing.status().message().find("layer1"), std::string::npos) << missing.status().to_string();
  // A second gradient for layer0 in a step without accumulation.
  EXPECT_EQ(d->add_grad(0, m.tensor(0, g0.data())).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(d->add_grad(1, m.tensor(1, g1.data())).ok());
  // Non-finite and negative learning rates; an output list of the wrong length.
  for (double lr : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(), -1.0}) {
    StepArgs bad;
    bad.lr = lr;
    EXPECT_EQ(d->step(bad).status().code(), StatusCode::kInvalidArgument) << lr;
  }
  StepArgs short_outputs;
  short_outputs.outputs = {m.params[0].data()};
  EXPECT_EQ(d->step(short_outputs).status().code(), StatusCode::kInvalidArgument);
  // Parameters are added before the first gradient.
  EXPECT_EQ(d->add_param("late", m.tensor(1, g1.data())).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(*d->group_step(0), 0);

  // Gradients cleared are forgotten (and their intake is not a pass of any step).
  d->clear_grads();
  EXPECT_EQ(d->step().status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(d->add_grad(0, m.tensor(0, g0.data())).ok());
  ASSERT_TRUE(d->add_grad(1, m.tensor(1, g1.data())).ok());
  ASSERT_TRUE(d->add_grad(2, m.tensor(2, g2.data())).ok());
  StepArgs args;
  for (auto& p : m.params) args.outputs.push_back(p.data());
  auto r = d->step(args);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_DOUBLE_EQ(d->host_passes_per_grad_element(), 2.0);
  ref[0].step(g0);
  ref[1].step(g1);
  ref[2].step(g2);
  for (std::size_t k = 0; k < m.shapes.size(); ++k) EXPECT_TRUE(near(m.params[k], ref[k].p, 1e-6)) << k;
}

TEST(StepDriver, Bf16ParamsKeepFp32Masters) {
  auto d = make_driver("", 64);
  ASSERT_NE(d, nullptr);
  const std::vector<std::int64_t> shape{64};
  auto init = values(64, 1.0f, 0.3f);
  std::vector<std::uint16_t> bf(64);
  ASSERT_TRUE(
      cpu::convert(cpu::ConstTensorRef(init.data(), DType::kF32, 64), cpu::TensorRef{bf.data(), DType::kBF16, 64})
          .ok());
  ASSERT_TRUE(d->add_param("w", {bf.data(), DType::kBF16, {shape.data(), 1}}).ok());
  std::vector<float> widened(64);
  ASSERT_TRUE(
      cpu::convert(cpu::ConstTensorRef(bf.data(), DType::kBF16, 64), cpu::TensorRef{widened.data(), DType::kF32, 64})
          .ok());
  RefAdamW ref(widened);
  for (int step = 0; step < 5; ++step) {
    const auto g = values(64, 1e-3f, float(step));
    std::vector<std::uint16_t> gb(64);
    ASSERT_TRUE(
        cpu::convert(cpu::ConstTensorRef(g.data(), DType::kF32, 64), cpu::TensorRef{gb.data(), DType::kBF16, 64}).ok());
    std::vector<float> gw(64);
    ASSERT_TRUE(
        cpu::convert(cpu::ConstTensorRef(gb.data(), DType::kBF16, 64), cpu::TensorRef{gw.data(), DType::kF32, 64})
            .ok());
    ASSERT_TRUE(d->add_grad(0, {gb.data(), DType::kBF16, {shape.data(), 1}}).ok());
    ref.step(gw);
    StepArgs args;
    args.outputs = {bf.data()};
    ASSERT_TRUE(d->step(args).ok());
  }
  // The master followed the fp32 reference; the bf16 output is the master rounded (and, with
  // steps of 1e-2 on values near 1, differs from it).
  std::vector<float> master(64), rounded(64);
  ASSERT_TRUE(d->read_state(0, optim::StateKind::kMaster, master.data()).ok());
  EXPECT_TRUE(near(master, ref.p, 1e-5));
  ASSERT_TRUE(
      cpu::convert(cpu::ConstTensorRef(bf.data(), DType::kBF16, 64), cpu::TensorRef{rounded.data(), DType::kF32, 64})
          .ok());
  int differ = 0;
  for (int i = 0; i < 64; ++i) {
    EXPECT_LE(std::abs(rounded[i] - master[i]), std::abs(master[i]) / 128 + 1e-7f) << i;
    differ += rounded[i] != master[i];
  }
  EXPECT_GT(differ, 0);
}

TEST(StepDriver, AccumulatesMicroStepsAndRefusesAnIncompleteStep) {
  auto d = make_driver("", 32, 2);
  ASSERT_NE(d, nullptr);
  const std::vector<std::int64_t> shape{32};
  auto w = values(32, 0.5f, 0);
  ASSERT_TRUE(d->add_param("w", {w.data(), DType::kF32, {shape.data(), 1}}).ok());
  RefAdamW ref(w);
  const auto a = values(32, 0.1f, 1), b = values(32, 0.1f, 2);
  ASSERT_TRUE(d->add_grad(0, {a.data(), DType::kF32, {shape.data(), 1}}).ok());
  auto early = d->step();
  EXPECT_EQ(early.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(early.status().message().find("1 gradient(s) of the 2"), std::string::npos) << early.status().to_string();
  ASSERT_TRUE(d->add_grad(0, {b.data(), DType::kF32, {shape.data(), 1}}).ok());
  EXPECT_EQ(d->add_grad(0, {b.data(), DType::kF32, {shape.data(), 1}}).code(), StatusCode::kFailedPrecondition);
  StepArgs args;
  args.outputs = {w.data()};
  ASSERT_TRUE(d->step(args).ok());
  std::vector<float> sum(32);
  for (int i = 0; i < 32; ++i) sum[i] = a[i] + b[i];
  ref.step(sum);
  EXPECT_TRUE(near(w, ref.p, 1e-6));
  // Two intakes and one update read per two gradient elements.
  EXPECT_LE(d->host_passes_per_grad_element(), 2.0);
}

TEST(StepDriver, SaveAndLoadReplayTheSameStep) {
  ScratchDir dir(nvme::test::shm_base(), "step-driver-ckpt");
  ASSERT_TRUE(dir.ok());
  auto d = make_driver(dir.sub("swap"), 128);
  ASSERT_NE(d, nullptr);
  const std::vector<std::int64_t> shape{128};
  auto w = values(128, 0.5f, 0);
  ASSERT_TRUE(d->add_param("w", {w.data(), DType::kF32, {shape.data(), 1}}).ok());
  auto feed_and_step = [&](float phase) {
    const auto g = values(128, 0.1f, phase);
    EXPECT_TRUE(d->add_grad(0, {g.data(), DType::kF32, {shape.data(), 1}}).ok());
    StepArgs args;
    args.outputs = {w.data()};
    EXPECT_TRUE(d->step(args).ok());
  };
  feed_and_step(1);
  const std::string ckpt = dir.sub("opt.ckpt");
  ASSERT_TRUE(d->save(ckpt).ok());
  const std::vector<float> saved = w;
  feed_and_step(2);
  const std::vector<float> first = w;
  ASSERT_TRUE(d->load(ckpt).ok());
  std::vector<float> restored(128);
  ASSERT_TRUE(d->read_param(0, DType::kF32, restored.data()).ok());
  EXPECT_EQ(0, std::memcmp(restored.data(), saved.data(), 128 * sizeof(float)));
  EXPECT_EQ(*d->group_step(0), 1);
  feed_and_step(2);
  EXPECT_EQ(0, std::memcmp(w.data(), first.data(), 128 * sizeof(float)));
}

// Three parameters of 3 x 1024 elements over chunks of 1024: an overlapped pass has chunks to
// take one by one.
struct OverlapCase {
  ScratchDir dir{nvme::test::shm_base(), "step-driver-overlap"};
  std::vector<std::int64_t> shape{3, 1024};
  std::vector<std::vector<float>> params;
  std::unique_ptr<StepDriver> d;
  explicit OverlapCase(const std::string& name) {
    EXPECT_TRUE(dir.ok());
    // Clipping at 1.0: step 3's large gradients are clipped, so its speculative pass is redone.
    const std::string base = config_json(dir.sub(name), 1, R"(, "optimizer": {"chunk_elements": 1024})");
    auto cfg = EngineConfig::from_json(std::string(R"({"gradient_clipping": 1.0, )") + base.substr(1));
    EXPECT_TRUE(cfg.ok()) << cfg.status().to_string();
    auto made = StepDriver::create(*cfg, 3 * 3072);
    EXPECT_TRUE(made.ok()) << made.status().to_string();
    d = std::move(made).value();
    for (int k = 0; k < 3; ++k) {
      params.push_back(values(3072, 0.5f, float(k)));
      EXPECT_TRUE(d->add_param("p" + std::to_string(k), tensor(params[k].data())).ok());
    }
  }
  HostTensor tensor(const float* data) const { return {data, DType::kF32, {shape.data(), shape.size()}}; }
  StepArgs outputs(double lr) {
    StepArgs args;
    args.lr = lr;
    for (auto& p : params) args.outputs.push_back(p.data());
    return args;
  }
};

TEST(StepDriver, OverlappedStepIsTheSerialStepBitForBit) {
  OverlapCase serial("serial"), overlapped("overlapped");
  ASSERT_TRUE(serial.d && overlapped.d);
  for (int step = 1; step <= 4; ++step) {
    std::vector<std::vector<float>> grads;
    for (int k = 0; k < 3; ++k)
      grads.push_back(values(3072, step == 3 ? 40.f : 0.005f, float(step * 5 + k)));  // norm 0.34 or 2700
    const double lr = kLr / step;
    for (int k = 0; k < 3; ++k) {
      ASSERT_TRUE(serial.d->add_grad(k, serial.tensor(grads[k].data()), GradIntake::kBorrow).ok());
    }
    auto rs = serial.d->step(serial.outputs(lr));
    ASSERT_TRUE(rs.ok()) << rs.status().to_string();

    ASSERT_TRUE(overlapped.d->start_overlap(overlapped.outputs(lr)).ok());
    EXPECT_TRUE(overlapped.d->overlap_running());
    EXPECT_EQ(overlapped.d->step().status().code(), StatusCode::kFailedPrecondition);  // one step at a time
    // Gradients arrive as backward finishes them: last parameter first.
    for (int k = 2; k >= 1; --k) {
      ASSERT_TRUE(overlapped.d->add_grad(k, overlapped.tensor(grads[k].data()), GradIntake::kBorrow).ok());
    }
    // One missing: refused by name, the pass still running.
    auto early = overlapped.d->finish_overlap();
    EXPECT_EQ(early.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(early.status().message().find("'p0'"), std::string::npos) << early.status().to_string();
    EXPECT_TRUE(overlapped.d->overlap_running());
    ASSERT_TRUE(overlapped.d->add_grad(0, overlapped.tensor(grads[0].data()), GradIntake::kBorrow).ok());
    auto ro = overlapped.d->finish_overlap();
    ASSERT_TRUE(ro.ok()) << ro.status().to_string();
    EXPECT_FALSE(overlapped.d->overlap_running());
    EXPECT_TRUE(ro->overlapped);
    // The clipped step is redone serially, the others commit as they are; either way the
    // results are the serial step's, bit for bit.
    EXPECT_EQ(ro->redone, step == 3) << ro->redo_reason;
    EXPECT_EQ(rs->clip_coefficient < 1, step == 3);
    EXPECT_EQ(ro->step, rs->step);
    for (int k = 0; k < 3; ++k) {
      EXPECT_EQ(0, std::memcmp(serial.params[k].data(), overlapped.params[k].data(), 3072 * sizeof(float)))
          << "step " << step << " param " << k;
    }
  }
  // Borrowed gradients are read once, by the update.
  EXPECT_DOUBLE_EQ(serial.d->host_passes_per_grad_element(), 1.0);
  EXPECT_DOUBLE_EQ(overlapped.d->host_passes_per_grad_element(), 1.0);
}

TEST(StepDriver, ACancelledOverlapKeepsTheGradientsAndTheStepRunsSerially) {
  OverlapCase serial("serial"), cancelled("cancelled");
  ASSERT_TRUE(serial.d && cancelled.d);
  std::vector<std::vector<float>> grads;
  for (int k = 0; k < 3; ++k) grads.push_back(values(3072, 0.1f, float(k + 11)));
  for (int k = 0; k < 3; ++k) ASSERT_TRUE(serial.d->add_grad(k, serial.tensor(grads[k].data())).ok());
  ASSERT_TRUE(serial.d->step(serial.outputs(kLr)).ok());

  const std::vector<std::vector<float>> before = cancelled.params;
  ASSERT_TRUE(cancelled.d->start_overlap(cancelled.outputs(kLr)).ok());
  for (int k = 2; k >= 0; --k) ASSERT_TRUE(cancelled.d->add_grad(k, cancelled.tensor(grads[k].data())).ok());
  cancelled.d->cancel_overlap();
  EXPECT_FALSE(cancelled.d->overlap_running());
  EXPECT_EQ(*cancelled.d->group_step(0), 0);  // nothing committed
  std::vector<float> master(3072);
  ASSERT_TRUE(cancelled.d->read_param(1, DType::kF32, master.data()).ok());
  EXPECT_EQ(0, std::memcmp(master.data(), before[1].data(), 3072 * sizeof(float)));
  EXPECT_EQ(cancelled.d->finish_overlap().status().code(), StatusCode::kFailedPrecondition);
  auto r = cancelled.d->step(cancelled.outputs(kLr));  // the kept gradients
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(0, std::memcmp(serial.params[k].data(), cancelled.params[k].data(), 3072 * sizeof(float))) << k;
  }
}

TEST(StepDriver, SkipMissingLeavesAParameterWithoutAGradientAsItIs) {
  Model m;
  auto d = make_driver("", 16 * 8 + 8 + 4 * 16);
  ASSERT_NE(d, nullptr);
  for (std::size_t k = 0; k < m.shapes.size(); ++k) {
    ASSERT_TRUE(
        d->add_param(std::string(1, char('p')).append(std::to_string(k)), m.tensor(k, m.params[k].data())).ok());
  }
  RefAdamW ref0(m.params[0]), ref2(m.params[2]);
  const std::vector<float> frozen = m.params[1];
  const auto g0 = values(m.params[0].size(), 0.1f, 3), g2 = values(m.params[2].size(), 0.1f, 4);
  ASSERT_TRUE(d->add_grad(0, m.tensor(0, g0.data())).ok());
  ASSERT_TRUE(d->add_grad(2, m.tensor(2, g2.data()), GradIntake::kBorrow).ok());
  StepArgs args;
  for (auto& p : m.params) args.outputs.push_back(p.data());
  auto refused = d->step(args);  // without skip_missing, p1's missing gradient is an error
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("'p1'"), std::string::npos) << refused.status().to_string();
  args.skip_missing = true;
  ASSERT_TRUE(d->step(args).ok());
  ref0.step(g0);
  ref2.step(g2);
  EXPECT_TRUE(near(m.params[0], ref0.p, 1e-6));
  EXPECT_TRUE(near(m.params[2], ref2.p, 1e-6));
  EXPECT_EQ(0, std::memcmp(m.params[1].data(), frozen.data(), frozen.size() * sizeof(float)));  // no weight decay
  std::vector<float> exp_avg(frozen.size(), 1.f);
  ASSERT_TRUE(d->read_state(1, optim::StateKind::kExpAvg, exp_avg.data()).ok());
  for (float v : exp_avg) ASSERT_EQ(v, 0.f);
  // One copied intake (p0) and one borrowed (p2): passes (2 * 128 + 64) / (128 + 64).
  EXPECT_NEAR(d->host_passes_per_grad_element(), (2.0 * 128 + 64) / (128 + 64), 1e-12);
}

TEST(StepDriver, GroupHyperParamsAreSetCheckedAndBorrowingNeedsOneMicroStep) {
  auto d = make_driver("", 64, 2);
  ASSERT_NE(d, nullptr);
  const std::vector<std::int64_t> shape{64};
  auto w = values(64, 0.5f, 0);
  ASSERT_TRUE(d->add_param("w", {w.data(), DType::kF32, {shape.data(), 1}}).ok());
  ASSERT_TRUE(d->set_hyper_params(0, 0.5, 0.8, 0.99, 1e-6, 0.0).ok());
  auto hp = d->hyper_params(0);
  ASSERT_TRUE(hp.ok());
  EXPECT_EQ(hp->lr, 0.5);
  EXPECT_EQ(hp->beta1, 0.8);
  EXPECT_EQ(hp->beta2, 0.99);
  EXPECT_EQ(hp->weight_decay, 0.0);
  EXPECT_EQ(d->set_hyper_params(0, 0.1, 1.5, 0.99, 1e-6, 0.0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(d->hyper_params(0)->beta1, 0.8);  // the refused values changed nothing
  EXPECT_FALSE(d->set_hyper_params(3, 0.1, 0.9, 0.99, 1e-6, 0.0).ok());
  EXPECT_EQ(d->group_count(), 1u);
  const auto g = values(64, 0.1f, 1);
  auto s = d->add_grad(0, {g.data(), DType::kF32, {shape.data(), 1}}, GradIntake::kBorrow);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'w'"), std::string::npos) << s.to_string();
}

}  // namespace
}  // namespace tier::step
