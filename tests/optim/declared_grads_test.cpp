// Declared gradients (declare_grad + a GradSource in StepOptions::grads): the caller keeps each partition's
// gradient and the step asks for it chunk by chunk. The result must be the add_grad result, bit
// for bit; every fetched gradient is handed back once; a failed fetch or a failed step keeps the
// state and the declarations for a retry.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include "optim/optim_test_util.hpp"

namespace tier::optim {
namespace {

using test::Home;
using test::Reference;
using test::Rig;

class DeclaredGrads : public testing::TestWithParam<Home> {
 protected:
  void SetUp() override {
    if (auto why = test::home_unavailable(GetParam()); !why.empty()) GTEST_SKIP() << why;
  }
  std::unique_ptr<Rig> make(OffloadedOptimizerOptions o, const Reference& ref) {
    return test::make_rig(GetParam(), std::move(o), ref);
  }
};

// The caller's side: gradients kept per partition, and a record of what the step asked for.
struct Source final : GradSource {
  std::map<PartitionId, std::vector<std::uint8_t>> grads;
  const std::vector<test::PartDesc>* model = nullptr;
  std::function<void(PartitionId)> on_prefetch;  // (a test's record of the hints)
  DType dtype = DType::kBF16;
  std::vector<PartitionId> fetched, returned;
  PartitionId fail_at = ~PartitionId{0};

  // Makes step `step`'s gradient of every partition but `skip`, gives it to the reference and
  // declares it with its sum of squares.
  void declare(OffloadedOptimizer& opt, Reference& ref, std::uint64_t step, std::size_t skip = ~std::size_t{0}) {
    const auto& model = ref.model();
    for (std::size_t i = 0; i < model.size(); ++i) {
      if (i == skip) continue;
      auto g = test::make_grad(model[i].numel, dtype, test::grad_seed(step, 0, i));
      ref.add_grad(i, g.data(), dtype);
      const double sumsq = cpu::sum_of_squares(cpu::ConstTensorRef(g.data(), dtype, model[i].numel)).value();
      ASSERT_TRUE(opt.declare_grad(static_cast<PartitionId>(i), sumsq).ok());
      grads[static_cast<PartitionId>(i)] = std::move(g);
    }
  }

  Result<cpu::ConstTensorRef> acquire(PartitionId id) override {
    if (id == fail_at) return Status(StatusCode::kIoError, "the gradient's tier could not be read (injected)");
    fetched.push_back(id);
    return cpu::ConstTensorRef(grads.at(id).data(), dtype, (*model)[id].numel);
  }
  void release(PartitionId id) override { returned.push_back(id); }
  void prefetch(PartitionId id) override {
    if (on_prefetch) on_prefetch(id);
  }

  StepOptions options(const std::vector<test::PartDesc>& m) {
    model = &m;
    StepOptions so;
    so.grads = this;
    return so;
  }
};

TEST_P(DeclaredGrads, MatchAddGradBitForBitAndAreFetchedInOrderOnce) {
  const auto model = test::mixed_model();
  const auto groups = test::three_groups();
  OffloadedOptimizerOptions o;
  o.groups = groups;
  o.max_grad_norm = 0.05;  // clipping uses the declared sums
  Reference ref(model, groups, 11);
  auto rig = make(o, ref);
  ASSERT_TRUE(rig->status().ok());
  for (std::uint64_t step = 1; step <= 3; ++step) {
    Source src;
    src.declare(rig->opt(), ref, step, 2);  // partition 2: no gradient, updated with zeros, never fetched
    double norm = 0;
    ASSERT_TRUE(ref.step(1.0, o.max_grad_norm, &norm));
    auto r = rig->opt().step(src.options(model));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->grad_norm, norm);
    EXPECT_EQ(r->zero_grad_partitions, 1u);
    ASSERT_TRUE(test::state_matches(rig->opt(), ref)) << "after step " << step;
    // In partition order, each once, and each handed back.
    std::vector<PartitionId> expected;
    for (std::size_t i = 0; i < model.size(); ++i) {
      if (i != 2) expected.push_back(static_cast<PartitionId>(i));
    }
    EXPECT_EQ(src.fetched, expected);
    EXPECT_EQ(std::multiset<PartitionId>(src.returned.begin(), src.returned.end()),
              std::multiset<PartitionId>(expected.begin(), expected.end()));
    EXPECT_EQ(rig->opt().partitions_with_grads(), 0u);
  }
}

// GradSource::prefetch: a serial step names each declared gradient once, while updating the chunk before
// the one that first needs it, so every hinted partition is fetched after its hint; partitions
// without a gradient are never named, and the result is the same bytes.
TEST_P(DeclaredGrads, TheNextChunksGradientsAreHintedBeforeTheyAreFetched) {
  const auto model = test::mixed_model();
  const auto groups = test::three_groups();
  OffloadedOptimizerOptions o;
  o.groups = groups;
  o.chunk_elements = 4096;  // several chunks
  Reference ref(model, groups, 11);
  auto rig = make(o, ref);
  ASSERT_TRUE(rig->status().ok());
  ASSERT_GT(rig->opt().stats().chunks, 2u);
  for (std::uint64_t step = 1; step <= 2; ++step) {
    Source src;
    src.declare(rig->opt(), ref, step, 2);
    ASSERT_TRUE(ref.step(1.0, 0));
    StepOptions so = src.options(model);
    std::vector<PartitionId> hinted;
    std::vector<std::size_t> fetched_when_hinted;  // how many fetches had happened at each hint
    src.on_prefetch = [&](PartitionId id) {
      hinted.push_back(id);
      fetched_when_hinted.push_back(src.fetched.size());
    };
    auto r = rig->opt().step(so);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(test::state_matches(rig->opt(), ref)) << "after step " << step;
    ASSERT_FALSE(hinted.empty());
    EXPECT_EQ(std::set<PartitionId>(hinted.begin(), hinted.end()).size(), hinted.size()) << "a partition hinted twice";
    for (std::size_t k = 0; k < hinted.size(); ++k) {
      EXPECT_NE(hinted[k], 2u) << "a partition without a gradient was hinted";
      auto at = std::find(src.fetched.begin(), src.fetched.end(), hinted[k]);
      ASSERT_NE(at, src.fetched.end()) << "partition " << hinted[k] << " hinted but never fetched";
      EXPECT_GE(static_cast<std::size_t>(at - src.fetched.begin()), fetched_when_hinted[k])
          << "partition " << hinted[k] << " was hinted after its fetch";
    }
    EXPECT_NE(hinted.front(), src.fetched.front());  // the first chunk's are fetched without a hint
  }
}

TEST_P(DeclaredGrads, LambFetchesThemForBothOfItsPasses) {
  const auto model = test::mixed_model();
  auto groups = test::three_groups();
  groups[1].kind = cpu::OptimizerKind::kLamb;  // one Lamb group among Adam ones
  OffloadedOptimizerOptions o;
  o.groups = groups;
  Reference ref(model, groups, 11);
  auto rig = make(o, ref);
  ASSERT_TRUE(rig->status().ok());
  for (std::uint64_t step = 1; step <= 2; ++step) {
    Source src;
    src.declare(rig->opt(), ref, step);
    ASSERT_TRUE(ref.step(1.0, 0));
    auto r = rig->opt().step(src.options(model));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(test::state_matches(rig->opt(), ref)) << "after step " << step;
    EXPECT_EQ(src.fetched.size(), 2 * model.size());  // once per pass
    EXPECT_EQ(std::multiset<PartitionId>(src.fetched.begin(), src.fetched.end()),
              std::multiset<PartitionId>(src.returned.begin(), src.returned.end()));
  }
}

TEST_P(DeclaredGrads, AFailedFetchKeepsTheStateAndTheDeclarationsForARetry) {
  const auto model = test::mixed_model();
  const auto groups = test::three_groups();
  OffloadedOptimizerOptions o;
  o.groups = groups;
  Reference ref(model, groups, 11);
  auto rig = make(o, ref);
  ASSERT_TRUE(rig->status().ok());
  Source src;
  src.declare(rig->opt(), ref, 1);
  src.fail_at = static_cast<PartitionId>(model.size() - 1);
  auto failed = rig->opt().step(src.options(model));
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("injected"), std::string::npos) << failed.status();
  // Everything fetched was handed back.
  EXPECT_EQ(std::multiset<PartitionId>(src.fetched.begin(), src.fetched.end()),
            std::multiset<PartitionId>(src.returned.begin(), src.returned.end()));
  if (GetParam().home == StateHome::kHost) {
    // Updated in place up to the failure: the state says so loudly until a checkpoint is loaded.
    EXPECT_FALSE(rig->opt().step(src.options(model)).ok());
    return;
  }
  // NVMe home: nothing was applied.
  EXPECT_EQ(rig->opt().partitions_with_grads(), model.size());
  auto before = rig->opt().group_step(0);
  ASSERT_TRUE(before.ok());
  EXPECT_EQ(*before, 0);

  src.fail_at = ~PartitionId{0};
  ASSERT_TRUE(ref.step(1.0, 0));
  auto r = rig->opt().step(src.options(model));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(test::state_matches(rig->opt(), ref));
}

TEST_P(DeclaredGrads, MisuseIsRefused) {
  const auto model = test::mixed_model();
  const auto groups = test::three_groups();
  OffloadedOptimizerOptions o;
  o.groups = groups;
  Reference ref(model, groups, 11);
  auto rig = make(o, ref);
  ASSERT_TRUE(rig->status().ok());
  EXPECT_EQ(rig->opt().declare_grad(static_cast<PartitionId>(model.size()), 1.0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rig->opt().declare_grad(0, -1.0).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(rig->opt().declare_grad(0, 1.0).ok());
  EXPECT_EQ(rig->opt().declare_grad(0, 1.0).code(), StatusCode::kFailedPrecondition);
  // Declared but no source: refused before anything changes.
  auto r = rig->opt().step();
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(*rig->opt().group_step(0), 0);
  // A source that gives the wrong length fails the step and keeps the state.
  std::vector<float> short_grad(3, 0.0f);
  struct Short final : GradSource {
    std::vector<float>* grad = nullptr;
    int returned = 0;
    Result<cpu::ConstTensorRef> acquire(PartitionId) override {
      return cpu::ConstTensorRef(grad->data(), DType::kF32, grad->size());
    }
    void release(PartitionId) override { ++returned; }
  } short_source;
  short_source.grad = &short_grad;
  StepOptions so;
  so.grads = &short_source;
  r = rig->opt().step(so);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
  EXPECT_EQ(short_source.returned, 1);
  EXPECT_EQ(*rig->opt().group_step(0), 0);
  EXPECT_TRUE(test::state_matches(rig->opt(), ref));
  rig->opt().clear_grads();
  EXPECT_EQ(rig->opt().partitions_with_grads(), 0u);
}

TEST_P(DeclaredGrads, ANonFiniteSumIsAnOverflowAndSkipsTheStep) {
  const auto model = test::mixed_model();
  const auto groups = test::three_groups();
  OffloadedOptimizerOptions o;
  o.groups = groups;
  o.skip_non_finite = true;
  Reference ref(model, groups, 11);
  auto rig = make(o, ref);
  ASSERT_TRUE(rig->status().ok());
  Source src;
  for (std::size_t i = 0; i < model.size(); ++i) {
    src.grads[static_cast<PartitionId>(i)] = test::make_grad(model[i].numel, src.dtype, test::grad_seed(1, 0, i));
    const double sumsq = i == 1 ? std::nan("") : 1.0;
    ASSERT_TRUE(rig->opt().declare_grad(static_cast<PartitionId>(i), sumsq).ok());
  }
  auto r = rig->opt().step(src.options(model));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->overflow);
  EXPECT_FALSE(r->applied);
  EXPECT_TRUE(src.fetched.empty());  // nothing was read for a skipped step
  EXPECT_TRUE(test::state_matches(rig->opt(), ref));
  EXPECT_EQ(rig->opt().partitions_with_grads(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Homes, DeclaredGrads, testing::ValuesIn(test::all_homes()), test::home_name);

}  // namespace
}  // namespace tier::optim
