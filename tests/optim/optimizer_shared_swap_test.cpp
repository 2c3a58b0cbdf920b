// The offloaded optimizer's state in an engine's swap space (options.swap = Engine::swap_space(),
// nvme_reserve = Engine::reserve_nvme, as tier.torch wires them): one set of swap files and I/O
// threads for both. The optimizer's room counts in tier.budgets.nvme, so tensors get that much
// less and get it back when the optimizer goes; a budget without room for the state is refused at
// creation with the numbers; steps through the shared files are bit-identical to the reference.
#include <gtest/gtest.h>

#include <filesystem>
#include <numeric>

#include "engine/backend.hpp"
#include "optim/optim_test_util.hpp"
#include "tier/engine.hpp"
#include "tier/ext/fault_injecting_engine.hpp"
#include "tier/ext/swap_space.hpp"

namespace tier::optim {
namespace {

using nvme::test::ScratchDir;
using test::Reference;

constexpr std::uint64_t kBudget = 8u << 20;

// `injectors` (when given) collects the engine's I/O engines, each wrapped in a fault injector.
std::unique_ptr<Engine> make_engine(const std::string& swap_dir, std::uint64_t nvme_budget,
                                    std::vector<nvme::FaultInjectingEngine*>* injectors = nullptr) {
  EngineConfig c;
  c.tier.device = DeviceKind::kEmulated;
  c.tier.device_budget = 1u << 20;
  c.tier.host_budget = 4u << 20;
  c.tier.nvme_budget = nvme_budget;
  c.tier.swap_paths = {swap_dir};
  c.tier.io.use_direct = false;
  c.tier.huge_pages = HugePageMode::kOff;
  c.tier.debug_checks = true;
  c.tier.acquire_timeout_ms = 300;
  c.aio.block_size = 16 << 10;
  detail::EngineHooks hooks;
  if (injectors != nullptr) {
    hooks.wrap_io_engine = [injectors](std::unique_ptr<nvme::IoEngine> inner) -> std::unique_ptr<nvme::IoEngine> {
      auto f = std::make_unique<nvme::FaultInjectingEngine>(std::move(inner));
      injectors->push_back(f.get());  // (one I/O thread: made at creation, on this thread)
      return f;
    };
  }
  auto e = detail::create_engine(c, hooks);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(e).value() : nullptr;
}

std::uint64_t model_numel(const std::vector<test::PartDesc>& m) {
  return std::accumulate(m.begin(), m.end(), std::uint64_t{0},
                         [](std::uint64_t s, const test::PartDesc& p) { return s + p.numel; });
}

OffloadedOptimizerOptions shared_options(Engine& e, std::uint64_t max_elements) {
  OffloadedOptimizerOptions o;
  o.home = StateHome::kNvme;
  o.groups = test::three_groups();
  o.max_grad_norm = 0.5;
  o.gradient_accumulation_steps = 2;
  o.chunk_elements = 4096;
  o.buffer_count = 3;
  o.max_elements = max_elements;
  o.swap = e.swap_space();
  o.arena = &e.host_arena();
  o.pinned_source = [&e](std::uint64_t bytes, const std::string& name) { return e.reserve_host(name, bytes); };
  o.nvme_reserve = [&e](std::uint64_t bytes, const std::string& name) { return e.reserve_nvme(name, bytes); };
  return o;
}

std::size_t files_under(const std::string& dir) {
  std::size_t n = 0;
  for (const auto& f : std::filesystem::recursive_directory_iterator(dir)) n += f.is_regular_file() ? 1 : 0;
  return n;
}

class OptimizerSharedSwap : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::make_unique<ScratchDir>(nvme::test::shm_base(), "shared-swap");
    ASSERT_TRUE(dir_->ok());
  }
  std::string swap_dir() const { return dir_->sub("swap"); }
  std::unique_ptr<ScratchDir> dir_;
};

TEST_F(OptimizerSharedSwap, StepsBitForBitInTheEnginesFilesInsideItsBudget) {
  auto engine = make_engine(swap_dir(), kBudget);
  ASSERT_NE(engine, nullptr);
  ASSERT_NE(engine->swap_space(), nullptr);
  const auto model = test::mixed_model();
  auto o = shared_options(*engine, model_numel(model));
  Reference ref(model, o.groups, 11);
  auto opt = OffloadedOptimizer::create(o);
  ASSERT_TRUE(opt.ok()) << opt.status();
  ASSERT_TRUE(test::register_model(**opt, ref, 11).ok());

  const OptimizerStats s = (*opt)->stats();
  EXPECT_TRUE(s.shared_swap);
  EXPECT_EQ(s.nvme_allocated_bytes, 0u);  // no files of its own
  const std::uint64_t reserved = s.nvme_capacity_bytes;
  ASSERT_GT(reserved, 0u);
  ASSERT_EQ(reserved % 4096, 0u);
  // Both slots of every chunk are extents of the engine's swap space, within the reservation.
  EXPECT_EQ(engine->swap_space()->stats().live_extents, 2 * s.chunks);
  EXPECT_LE(s.nvme_bytes, reserved);
  EXPECT_EQ(files_under(swap_dir()), 1u);  // one file on the one path: the engine's

  // Tensors homed on NVMe fill exactly what the reservation left; one page more is refused at once
  // (nothing there could be evicted), naming the budget and the reservation.
  TensorDesc rest{.name = "rest", .dtype = DType::kU8, .numel = kBudget - reserved};
  auto rest_id = engine->register_tensor(rest, Tier::kNvme);
  ASSERT_TRUE(rest_id.ok()) << rest_id.status();
  TensorDesc page{.name = "page", .dtype = DType::kU8, .numel = 4096};
  auto over = engine->register_tensor(page, Tier::kNvme);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status();
  EXPECT_NE(over.status().message().find("tier.budgets.nvme"), std::string::npos) << over.status();
  EXPECT_NE(over.status().message().find("reserved by components sharing the swap space"), std::string::npos)
      << over.status();
  EXPECT_TRUE(engine->check_invariants().ok());

  const std::uint64_t read_before = engine->swap_space()->stats().bytes_read;
  for (std::uint64_t step = 1; step <= 3; ++step) {
    test::feed(**opt, ref, step, 2, DType::kBF16, GradMode::kCopy);
    ASSERT_TRUE(ref.step(1.0, o.max_grad_norm));
    auto r = (*opt)->step();
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(test::state_matches(**opt, ref)) << "after step " << step;
    EXPECT_TRUE(engine->check_invariants().ok());
  }
  // The steps read their chunks through the engine's I/O threads.
  EXPECT_GE(engine->swap_space()->stats().bytes_read - read_before, 3 * s.nvme_bytes / 2);

  opt->reset();  // the extents and the reservation come back
  EXPECT_EQ(engine->swap_space()->stats().live_extents, 1u);
  auto now = engine->register_tensor(page, Tier::kNvme);
  EXPECT_TRUE(now.ok()) << now.status();
  EXPECT_TRUE(engine->check_invariants().ok());
}

// The failed-step contract through the shared stack: an I/O error or a full disk in the engine's
// files mid-step applies nothing and keeps the gradients, and the retry is the step that failed.
TEST_F(OptimizerSharedSwap, AFailedStepInTheEnginesFilesAppliesNothingAndTheRetryMatches) {
  std::vector<nvme::FaultInjectingEngine*> injectors;
  auto engine = make_engine(swap_dir(), kBudget, &injectors);
  ASSERT_NE(engine, nullptr);
  ASSERT_EQ(injectors.size(), 1u);
  const auto model = test::mixed_model();
  auto o = shared_options(*engine, model_numel(model));
  o.chunk_elements = 2048;  // ~19 chunks of 24 KiB: several 16 KiB requests each
  o.gradient_accumulation_steps = 1;
  o.max_grad_norm = 0;
  Reference ref(model, o.groups, 21);
  auto opt = OffloadedOptimizer::create(o);
  ASSERT_TRUE(opt.ok()) << opt.status();
  ASSERT_TRUE(test::register_model(**opt, ref, 21).ok());
  ASSERT_TRUE((*opt)->stats().shared_swap);
  const struct {
    const char* what;
    std::function<void(nvme::FaultInjectingEngine&)> inject;
    StatusCode code;
  } faults[] = {
      {"a failed write", [](nvme::FaultInjectingEngine& f) { f.fail_nth(9, EIO, nvme::IoOp::kWrite); },
       StatusCode::kIoError},
      {"a failed read", [](nvme::FaultInjectingEngine& f) { f.fail_nth(12, EIO, nvme::IoOp::kRead); },
       StatusCode::kIoError},
      {"a full disk", [](nvme::FaultInjectingEngine& f) { f.fail_writes_after_bytes(100 << 10, ENOSPC); },
       StatusCode::kNoSpace},
  };
  std::uint64_t step = 0;
  for (const auto& fault : faults) {
    SCOPED_TRACE(fault.what);
    test::feed(**opt, ref, ++step, 1, DType::kBF16, GradMode::kCopy);
    const std::int64_t before = *(*opt)->group_step(0);
    fault.inject(*injectors[0]);
    auto r = (*opt)->step();
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), fault.code) << r.status();
    EXPECT_EQ(*(*opt)->group_step(0), before);
    EXPECT_EQ((*opt)->partitions_with_grads(), model.size());
    injectors[0]->clear_faults();
    ASSERT_TRUE(test::state_matches(**opt, ref));  // the last good step's state
    ASSERT_TRUE(ref.step(1.0, 0));
    auto again = (*opt)->step();
    ASSERT_TRUE(again.ok()) << again.status();
    ASSERT_TRUE(test::state_matches(**opt, ref));
    EXPECT_TRUE(engine->check_invariants().ok());
  }
}

TEST_F(OptimizerSharedSwap, ABudgetWithoutRoomForTheStateIsRefusedAtCreation) {
  auto engine = make_engine(swap_dir(), 256u << 10);
  ASSERT_NE(engine, nullptr);
  const auto model = test::mixed_model();
  auto opt = OffloadedOptimizer::create(shared_options(*engine, model_numel(model)));
  ASSERT_FALSE(opt.ok());
  EXPECT_EQ(opt.status().code(), StatusCode::kResourceExhausted);
  const std::string msg = opt.status().to_string();
  EXPECT_NE(msg.find("tier.budgets.nvme"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tier/optimizer/state"), std::string::npos) << msg;
  // Nothing is held: the whole budget is there for tensors, and the host buffers came back.
  TensorDesc all{.name = "all", .dtype = DType::kU8, .numel = 256u << 10};
  EXPECT_TRUE(engine->register_tensor(all, Tier::kNvme).ok());
  EXPECT_EQ(engine->stats().tier(Tier::kHost).resident_bytes, 0u);
  EXPECT_TRUE(engine->check_invariants().ok());
}

TEST_F(OptimizerSharedSwap, APartitionPastMaxElementsIsRefused) {
  auto engine = make_engine(swap_dir(), kBudget);
  ASSERT_NE(engine, nullptr);
  auto opt = OffloadedOptimizer::create(shared_options(*engine, 5000));
  ASSERT_TRUE(opt.ok()) << opt.status();
  PartitionSpec a;
  a.name = "a";
  a.numel = 4000;
  ASSERT_TRUE((*opt)->add_partition(a).ok());
  PartitionSpec b;
  b.name = "b";
  b.numel = 4200;  // 8200 elements: past 5000 and past the two chunks reserved
  auto id = (*opt)->add_partition(b);
  ASSERT_FALSE(id.ok());
  EXPECT_NE(id.status().message().find("max_elements 5000"), std::string::npos) << id.status();
  // A shared swap space with a reservation needs to know the size.
  opt->reset();
  auto unsized = OffloadedOptimizer::create(shared_options(*engine, 0));
  ASSERT_FALSE(unsized.ok());
  EXPECT_NE(unsized.status().message().find("max_elements"), std::string::npos) << unsized.status();
}

TEST(EngineReserveNvme, WithoutAnNvmeTierThereIsNoSwapSpaceToShare) {
  EngineConfig c;
  c.tier.device = DeviceKind::kEmulated;
  c.tier.device_budget = 1u << 20;
  c.tier.host_budget = 1u << 20;
  auto e = Engine::create(c);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ((*e)->swap_space(), nullptr);
  auto r = (*e)->reserve_nvme("x", 4096);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("no NVMe tier"), std::string::npos) << r.status();
}

TEST_F(OptimizerSharedSwap, ReservationsAddUpAndComeBack) {
  auto engine = make_engine(swap_dir(), 1u << 20);
  ASSERT_NE(engine, nullptr);
  auto a = engine->reserve_nvme("a", 600u << 10);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = engine->reserve_nvme("b", 600u << 10);  // 1200 KiB of 1024: refused, nothing held
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("600.00 KiB are in use (600.00 KiB of them reserved)"), std::string::npos)
      << b.status();
  EXPECT_TRUE(engine->check_invariants().ok());
  *a = Reservation{};  // given back
  auto again = engine->reserve_nvme("b", 1u << 20);
  EXPECT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(engine->check_invariants().ok());
}

}  // namespace
}  // namespace tier::optim
