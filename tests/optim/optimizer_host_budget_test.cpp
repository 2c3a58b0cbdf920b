// The offloaded optimizer's pipeline buffers inside an engine's host budget (pinned_source =
// Engine::reserve_host, as tier.torch wires them): they count in the host tier's resident bytes,
// leave that much less room for tensors, come back when the optimizer goes, and a step through
// them is bit-identical to the reference. A budget that cannot hold them is a clear error.
#include <gtest/gtest.h>

#include "optim/optim_test_util.hpp"
#include "tier/engine.hpp"

namespace tier::optim {
namespace {

using test::Home;
using test::Reference;

std::unique_ptr<Engine> make_engine(std::uint64_t host_budget) {
  EngineConfig c;
  c.tier.device = DeviceKind::kEmulated;
  c.tier.device_budget = 1u << 20;
  c.tier.host_budget = host_budget;
  c.tier.debug_checks = true;
  c.tier.acquire_timeout_ms = 300;
  auto e = Engine::create(c);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(e).value() : nullptr;
}

std::uint64_t host_resident(Engine& e) {
  return e.stats().tier(Tier::kHost).resident_bytes;
}

class OptimizerHostBudget : public testing::TestWithParam<Home> {
 protected:
  void SetUp() override {
    if (auto why = test::home_unavailable(GetParam()); !why.empty()) GTEST_SKIP() << why;
  }
  static OffloadedOptimizerOptions options(Engine& e) {
    OffloadedOptimizerOptions o;
    o.groups = test::three_groups();
    o.max_grad_norm = 0.5;
    o.gradient_accumulation_steps = 2;
    o.pinned_source = [&e](std::uint64_t bytes, const std::string& name) { return e.reserve_host(name, bytes); };
    return o;
  }
};

TEST_P(OptimizerHostBudget, StepsThroughEngineBuffersBitForBitAndCountsThem) {
  auto engine = make_engine(4u << 20);
  ASSERT_NE(engine, nullptr);
  const auto model = test::mixed_model();
  auto o = options(*engine);
  Reference ref(model, o.groups, 11);
  auto rig = test::make_rig(GetParam(), o, ref);
  ASSERT_TRUE(rig->status().ok());
  const std::uint64_t pinned = rig->opt().stats().pinned_bytes;
  ASSERT_GT(pinned, 0u);
  // The engine counts the buffers (and nothing else is resident); the optimizer does not count
  // them a second time in the engine's counters.
  EXPECT_EQ(host_resident(*engine), pinned);
  EXPECT_TRUE(engine->find("tier/optimizer/buffer0").ok());
  for (std::uint64_t step = 1; step <= 3; ++step) {
    test::feed(rig->opt(), ref, step, 2, DType::kBF16, GradMode::kCopy);
    ASSERT_TRUE(ref.step(1.0, o.max_grad_norm));
    auto r = rig->opt().step();
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(test::state_matches(rig->opt(), ref)) << "after step " << step;
    EXPECT_TRUE(engine->check_invariants().ok());
  }
  rig.reset();
  EXPECT_EQ(host_resident(*engine), 0u);
  EXPECT_FALSE(engine->find("tier/optimizer/buffer0").ok());
  EXPECT_EQ(engine->tensor_count(), 0u);
  EXPECT_TRUE(engine->check_invariants().ok());
}

TEST_P(OptimizerHostBudget, BuffersLeaveThatMuchLessRoomAndGiveItBack) {
  const std::uint64_t budget = 2u << 20;
  auto engine = make_engine(budget);
  ASSERT_NE(engine, nullptr);
  auto o = options(*engine);
  Reference ref(test::mixed_model(), o.groups, 11);
  auto rig = test::make_rig(GetParam(), o, ref);
  ASSERT_TRUE(rig->status().ok());
  const std::uint64_t pinned = rig->opt().stats().pinned_bytes;
  ASSERT_LT(pinned, budget);

  // Host-homed tensors fill exactly what the buffers left; one page more does not fit.
  TensorDesc rest{.name = "rest", .dtype = DType::kU8, .numel = budget - pinned};
  ASSERT_TRUE(engine->register_tensor(rest, Tier::kHost).ok());
  TensorDesc page{.name = "page", .dtype = DType::kU8, .numel = 4096};
  auto over = engine->register_tensor(page, Tier::kHost);
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.status().message().find("tier.budgets.host"), std::string::npos) << over.status();
  EXPECT_TRUE(engine->check_invariants().ok());

  rig.reset();  // the optimizer's room comes back
  auto now = engine->register_tensor(page, Tier::kHost);
  EXPECT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(host_resident(*engine), budget - pinned + 4096);
}

TEST_P(OptimizerHostBudget, ABudgetTooSmallForTheBuffersIsAClearError) {
  auto engine = make_engine(128u << 10);
  ASSERT_NE(engine, nullptr);
  auto o = options(*engine);
  o.chunk_elements = 16384;  // 256 KiB per buffer: more than the whole budget
  o.buffer_count = 3;
  test::Rig rig(GetParam(), o);
  ASSERT_FALSE(rig.status().ok());
  const std::string msg = rig.status().to_string();
  EXPECT_NE(msg.find("optimizer: pinned buffer 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tier.budgets.host"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tier.optimizer.buffer_bytes"), std::string::npos) << msg;
  // Nothing is left behind.
  EXPECT_EQ(host_resident(*engine), 0u);
  EXPECT_EQ(engine->tensor_count(), 0u);
}

// Each buffer fits the budget but not all of them together: the last one fails at once (reserved
// memory never comes back to make room), not after the acquire timeout, here a minute.
TEST_P(OptimizerHostBudget, BuffersThatFitOneByOneButNotTogetherFailAtOnce) {
  EngineConfig c;
  c.tier.device = DeviceKind::kEmulated;
  c.tier.device_budget = 1u << 20;
  c.tier.host_budget = 640u << 10;
  c.tier.acquire_timeout_ms = 60000;
  auto engine = Engine::create(c);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto o = options(**engine);
  o.chunk_elements = 16384;  // 256 KiB per buffer: two fit, three do not
  o.buffer_count = 3;
  test::Rig rig(GetParam(), o);
  if (GetParam().home == StateHome::kHost) {  // one buffer only: it fits
    EXPECT_TRUE(rig.status().ok()) << rig.status();
    return;
  }
  ASSERT_FALSE(rig.status().ok());
  const std::string msg = rig.status().to_string();
  EXPECT_NE(msg.find("optimizer: pinned buffer 3 of 3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the reservations already made hold"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tier.budgets.host"), std::string::npos) << msg;
  EXPECT_EQ((*engine)->tensor_count(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Homes, OptimizerHostBudget, testing::ValuesIn(test::all_homes()), test::home_name);

}  // namespace
}  // namespace tier::optim
