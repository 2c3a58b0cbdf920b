// The step overlapped with backward (start_overlapped_step / finish_overlapped_step): with
// gradients arriving while its pass runs, in backward's order, the result is bit for bit the
// serial step's, whether the speculation holds (no clipping), is redone (clipping), or the step
// is skipped (fp16 overflow, the params delivered again from the committed masters); with
// accumulation and declared gradients; cancelled, nothing changes. Host home and Lamb are
// refused.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <thread>

#include "optim/optim_test_util.hpp"

namespace tier::optim {
namespace {

using test::Home;
using test::Reference;
using test::Rig;

OffloadedOptimizerOptions opts(double max_norm, int gas = 1) {
  OffloadedOptimizerOptions o;
  o.groups = test::three_groups();
  o.chunk_elements = 4096;
  o.buffer_count = 3;
  o.max_grad_norm = max_norm;
  o.gradient_accumulation_steps = gas;
  return o;
}

class Overlap : public testing::TestWithParam<Home> {
 protected:
  void SetUp() override {
    const std::string why = test::home_unavailable(GetParam());
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

// The gradients of one micro-step, made once for both optimizers.
std::vector<std::vector<std::uint8_t>> grads_for(const Reference& ref, std::uint64_t step, int micro, float scale) {
  std::vector<std::vector<std::uint8_t>> g;
  for (std::size_t i = 0; i < ref.model().size(); ++i) {
    g.push_back(test::make_grad(ref.model()[i].numel, DType::kBF16, test::grad_seed(step, micro, i), scale));
  }
  return g;
}

Status give(OffloadedOptimizer& opt, const Reference& ref, const std::vector<std::vector<std::uint8_t>>& g,
            std::size_t i) {
  return opt.add_grad(static_cast<PartitionId>(i),
                      cpu::ConstTensorRef(g[i].data(), DType::kBF16, ref.model()[i].numel));
}

// Waits (bounded) until the running pass has taken `n` chunks.
void wait_taken(const OffloadedOptimizer& opt, std::uint64_t n) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (opt.overlapped_chunks_taken() < n && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Runs `steps` steps on a serial and an overlapped optimizer with the same gradients (fed to the
// overlapped one in reverse partition order after the start, as backward finishes them) and
// checks after each that their state and delivered params are identical. Returns the reports of
// the overlapped steps.
std::vector<StepReport> run_both(const Home& home, const OffloadedOptimizerOptions& o, int steps, float grad_scale,
                                 bool wait_for_speculation) {
  Reference ref(test::mixed_model(), o.groups, 11);
  auto serial = test::make_rig(home, o, ref);
  auto over = test::make_rig(home, o, ref);
  std::vector<StepReport> reports;
  test::Outputs out_serial(ref.model()), out_over(ref.model());
  const std::uint64_t chunks = over->opt().stats().chunks;  // (stats() may not run beside a pass)
  for (int step = 1; step <= steps; ++step) {
    StepOptions ss, so;
    const std::vector<void*> out_serial_dest = out_serial.pointers();
    ss.destinations = out_serial_dest;
    const std::vector<void*> out_over_dest = out_over.pointers();
    so.destinations = out_over_dest;
    for (int micro = 0; micro < o.gradient_accumulation_steps; ++micro) {
      const auto g = grads_for(ref, step, micro, grad_scale);
      const bool boundary = micro + 1 == o.gradient_accumulation_steps;
      if (boundary) {
        EXPECT_TRUE(over->opt().start_overlapped_step(so).ok());
      }
      for (std::size_t i = ref.model().size(); i-- > 0;) {
        EXPECT_TRUE(give(serial->opt(), ref, g, i).ok());
        EXPECT_TRUE(give(over->opt(), ref, g, i).ok());
      }
    }
    if (wait_for_speculation) wait_taken(over->opt(), chunks);
    auto a = serial->opt().step(ss);
    auto b = over->opt().finish_overlapped_step();
    EXPECT_TRUE(a.ok()) << a.status();
    EXPECT_TRUE(b.ok()) << b.status();
    if (!a.ok() || !b.ok()) return reports;
    EXPECT_EQ(a->applied, b->applied);
    EXPECT_EQ(a->grad_norm, b->grad_norm);
    EXPECT_EQ(a->clip_coefficient, b->clip_coefficient);
    EXPECT_TRUE(b->overlapped);
    reports.push_back(*b);
    for (std::size_t i = 0; i < ref.model().size(); ++i) {
      const std::uint64_t n = ref.model()[i].numel;
      for (StateKind k : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
        std::vector<float> x(n), y(n);
        EXPECT_TRUE(serial->opt().read_state(static_cast<PartitionId>(i), k, x.data(), 0, n).ok());
        EXPECT_TRUE(over->opt().read_state(static_cast<PartitionId>(i), k, y.data(), 0, n).ok());
        EXPECT_TRUE(
            test::same_bits(y.data(), x.data(), n, str("step ", step, " partition ", i, " ", state_kind_name(k))));
      }
      const std::size_t bytes = n * param_output_size(ref.model()[i].output);
      EXPECT_EQ(std::memcmp(out_over.data[i].data(), out_serial.data[i].data(), bytes), 0)
          << "step " << step << ": params of partition " << i;
    }
  }
  return reports;
}

TEST_P(Overlap, UnclippedStepsCommitTheSpeculationBitForBit) {
  const auto reports = run_both(GetParam(), opts(1e6), 3, 1e-2f, true);
  ASSERT_EQ(reports.size(), 3u);
  for (const StepReport& r : reports) {
    EXPECT_FALSE(r.redone) << r.redo_reason;
    EXPECT_EQ(r.speculated_chunks, r.chunks);  // every chunk was updated before finish
  }
}

TEST_P(Overlap, ClippedStepsAreRedoneAndMatchTheSerialStep) {
  const auto reports = run_both(GetParam(), opts(0.05), 3, 1e-2f, false);
  ASSERT_EQ(reports.size(), 3u);
  for (const StepReport& r : reports) {
    EXPECT_TRUE(r.redone);
    EXPECT_NE(r.redo_reason.find("gradient_clipping"), std::string::npos) << r.redo_reason;
    EXPECT_LT(r.clip_coefficient, 1.0);
    // The pass stops at its first chunk, with a read in each of the 3 buffers: the redo starts
    // from those (bit for bit the serial step all the same, as run_both checks) and reads the rest.
    EXPECT_EQ(r.reused_chunks, std::min<std::uint64_t>(3, r.chunks));
    EXPECT_EQ(r.read.transfers, r.chunks - r.reused_chunks);
  }
}

TEST_P(Overlap, AccumulatedGradientsMatchTheSerialStep) {
  const auto reports = run_both(GetParam(), opts(0, 3), 2, 1e-2f, true);
  ASSERT_EQ(reports.size(), 2u);
  for (const StepReport& r : reports) EXPECT_FALSE(r.redone) << r.redo_reason;
}

// A scheduler on the caller's thread sets the next step's lr (and reads the groups) while the
// overlapped pass, on its own thread, takes the step's constants: the groups are shared under a
// lock (TSan reported the race before), and the step is committed with one lr or the other.
TEST_P(Overlap, SettingTheLrWhileAPassRunsIsSafe) {
  OffloadedOptimizerOptions o = opts(0);
  Reference ref(test::mixed_model(), o.groups, 12);
  auto rig = test::make_rig(GetParam(), o, ref);
  OffloadedOptimizer& opt = rig->opt();
  test::Outputs out(ref.model());
  StepOptions so;
  const std::vector<void*> out_dest = out.pointers();
  so.destinations = out_dest;
  std::atomic<bool> stop{false};
  std::thread scheduler([&] {
    for (int i = 0; !stop.load(); ++i) {
      EXPECT_TRUE(opt.set_lr(0, (i % 2) ? 1e-3 : 2e-3).ok());
      EXPECT_TRUE(opt.hyper_params(0).ok());
      EXPECT_TRUE(opt.group_step(0).ok());
      // A monitor reading the stats while the pass's thread commits (TSan checks the counters).
      const OptimizerStats st = opt.stats();
      EXPECT_LE(st.steps_applied, 3u);
      EXPECT_EQ(st.steps_failed, 0u);
    }
  });
  for (int step = 1; step <= 3; ++step) {
    auto g = grads_for(ref, step, 0, 1.0f);
    ASSERT_TRUE(opt.start_overlapped_step(so).ok());
    for (std::size_t i = ref.model().size(); i-- > 0;) ASSERT_TRUE(give(opt, ref, g, i).ok());
    auto r = opt.finish_overlapped_step();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->applied);
  }
  stop = true;
  scheduler.join();
  EXPECT_EQ(*opt.group_step(0), 3);
}

TEST_P(Overlap, AnOverflowSkipsTheStepAndDeliversTheCommittedParamsAgain) {
  OffloadedOptimizerOptions o = opts(0);
  o.loss_scale.enabled = true;
  o.loss_scale.initial_scale = 1024;
  Reference ref(test::mixed_model(), o.groups, 11);
  auto rig = test::make_rig(GetParam(), o, ref);
  OffloadedOptimizer& opt = rig->opt();
  test::Outputs out(ref.model());
  StepOptions so;
  const std::vector<void*> out_dest = out.pointers();
  so.destinations = out_dest;
  // One good step, so that the params differ from the initial masters' conversion.
  auto g = grads_for(ref, 1, 0, 1.0f);
  ASSERT_TRUE(opt.start_overlapped_step(so).ok());
  for (std::size_t i = ref.model().size(); i-- > 0;) ASSERT_TRUE(give(opt, ref, g, i).ok());
  auto first = opt.finish_overlapped_step();
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(first->applied);
  const auto committed = out.data;
  std::vector<std::vector<float>> master(ref.model().size());
  for (std::size_t i = 0; i < ref.model().size(); ++i) {
    master[i].resize(ref.model()[i].numel);
    ASSERT_TRUE(
        opt.read_state(static_cast<PartitionId>(i), StateKind::kMaster, master[i].data(), 0, ref.model()[i].numel)
            .ok());
  }
  // The second step's last gradient (partition 0, what backward finishes last) overflows, after
  // the pass has updated and delivered every other chunk.
  g = grads_for(ref, 2, 0, 1.0f);
  std::vector<std::uint8_t> inf(g[0].size());
  const float infinity = std::numeric_limits<float>::infinity();
  ASSERT_TRUE(
      cpu::convert(cpu::ConstTensorRef(&infinity, DType::kF32, 1), cpu::TensorRef{inf.data(), DType::kBF16, 1}).ok());
  g[0] = inf;
  const std::uint64_t chunks = opt.stats().chunks;
  ASSERT_TRUE(opt.start_overlapped_step(so).ok());
  for (std::size_t i = ref.model().size(); i-- > 1;) ASSERT_TRUE(give(opt, ref, g, i).ok());
  wait_taken(opt, chunks - 1);  // the first chunk holds partition 0
  EXPECT_GT(opt.overlapped_chunks_taken(), 0u);
  ASSERT_TRUE(give(opt, ref, g, 0).ok());
  auto second = opt.finish_overlapped_step();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_FALSE(second->applied);
  EXPECT_TRUE(second->overflow);
  EXPECT_TRUE(second->redone);
  EXPECT_LE(second->next_loss_scale, second->loss_scale);
  EXPECT_EQ(*opt.group_step(0), 1);
  for (std::size_t i = 0; i < ref.model().size(); ++i) {
    const std::uint64_t n = ref.model()[i].numel;
    std::vector<float> now(n);
    ASSERT_TRUE(opt.read_state(static_cast<PartitionId>(i), StateKind::kMaster, now.data(), 0, n).ok());
    ASSERT_TRUE(test::same_bits(now.data(), master[i].data(), n, str("master ", i, " after the skipped step")));
    const std::size_t bytes = n * param_output_size(ref.model()[i].output);
    EXPECT_EQ(std::memcmp(out.data[i].data(), committed[i].data(), bytes), 0) << "params of partition " << i;
  }
}

// Unclipped (the pass takes them as declared) and clipped (the redo walks the buffers' chunks
// first, then the rest, and hands each gradient back after its partition's last chunk).
class OverlapDeclared : public testing::TestWithParam<std::tuple<Home, double>> {
 protected:
  void SetUp() override {
    const std::string why = test::home_unavailable(std::get<0>(GetParam()));
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

// A GradSource over the test's gradients that records when each is held, and checks that no
// gradient is held while another partition, sharing no chunk with it, is fetched and handed back
// (which a walk visiting a partition's chunks with a gap between them would do: its gradient held
// across the gap).
struct RecordingSource final : GradSource {
  const std::vector<std::vector<std::uint8_t>>* grads = nullptr;
  std::vector<test::PartDesc> model;
  std::uint64_t chunk_elements = 0;
  int fetched = 0, done = 0;
  std::map<PartitionId, int> held;  // partition -> the fetch that took it (its order)
  std::vector<std::string> gaps;    // what was fetched and handed back while another was held
  std::pair<std::uint64_t, std::uint64_t> chunks_of(PartitionId id) const {
    std::uint64_t start = 0;
    for (PartitionId i = 0; i < id; ++i) start += model[i].numel;
    return {start / chunk_elements, (start + model[id].numel - 1) / chunk_elements};
  }
  Result<cpu::ConstTensorRef> acquire(PartitionId id) override {
    held[id] = ++fetched;
    return cpu::ConstTensorRef((*grads)[id].data(), DType::kBF16, model[id].numel);
  }
  void release(PartitionId id) override {
    ++done;
    const auto [lo, hi] = chunks_of(id);
    for (const auto& [other, order] : held) {
      if (other == id || order > held[id]) continue;
      const auto [olo, ohi] = chunks_of(other);
      if (ohi < lo || hi < olo) gaps.push_back(str("partition ", id, " while ", other, " was held"));
    }
    held.erase(id);
  }
};

// One overlapped step of `model` with declared gradients beside a serial one; the masters must
// be the same bits. Returns the overlapped step's report.
StepReport declared_step(const Home& home, double max_norm, const std::vector<test::PartDesc>& model,
                         RecordingSource& source) {
  Reference ref(model, test::three_groups(), 11);
  OffloadedOptimizerOptions o = opts(max_norm);
  auto serial = test::make_rig(home, o, ref);
  auto over = test::make_rig(home, o, ref);
  const auto g = grads_for(ref, 1, 0, 1e-2f);
  source.grads = &g;
  source.model = model;
  source.chunk_elements = o.chunk_elements;
  StepOptions so;
  so.grads = &source;
  EXPECT_TRUE(over->opt().start_overlapped_step(so).ok());
  for (std::size_t i = model.size(); i-- > 0;) {
    const auto sumsq = cpu::sum_of_squares(cpu::ConstTensorRef(g[i].data(), DType::kBF16, model[i].numel));
    EXPECT_TRUE(over->opt().declare_grad(static_cast<PartitionId>(i), *sumsq).ok());
    EXPECT_TRUE(give(serial->opt(), ref, g, i).ok());
  }
  auto b = over->opt().finish_overlapped_step();
  EXPECT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(serial->opt().step().ok());
  for (std::size_t i = 0; i < model.size(); ++i) {
    const std::uint64_t n = model[i].numel;
    std::vector<float> x(n), y(n);
    EXPECT_TRUE(serial->opt().read_state(static_cast<PartitionId>(i), StateKind::kMaster, x.data(), 0, n).ok());
    EXPECT_TRUE(over->opt().read_state(static_cast<PartitionId>(i), StateKind::kMaster, y.data(), 0, n).ok());
    EXPECT_TRUE(test::same_bits(y.data(), x.data(), n, str("master ", i)));
  }
  return b.ok() ? *b : StepReport{};
}

TEST_P(OverlapDeclared, DeclaredGradientsComeThroughTheGradSource) {
  RecordingSource source;
  const StepReport b = declared_step(std::get<0>(GetParam()), std::get<1>(GetParam()), test::mixed_model(), source);
  EXPECT_EQ(b.redone, std::get<1>(GetParam()) > 0);
  // Once each: the clipped pass stops before its first chunk (the first gradient declared already
  // exceeds the norm), and the redo's walk keeps each partition's gradient (20000 elements span
  // five chunks) until its last chunk.
  EXPECT_EQ(source.fetched, static_cast<int>(test::mixed_model().size()));
  EXPECT_EQ(source.done, source.fetched);
  // The buffers the pass left read hold a piece of partition 7 (7777 elements over chunks 6-8):
  // a redo starting with them would hold its gradient while it walks chunks 0-5. It reads them
  // again instead, in order.
  EXPECT_TRUE(source.gaps.empty()) << source.gaps.front() << " (" << source.gaps.size() << " in all)";
}

// When the chunks the pass left read hold whole partitions, the redo starts with them (no read
// again), and still holds no gradient across another partition.
TEST_P(OverlapDeclared, TheRedoReusesTheBuffersThatHoldWholePartitions) {
  if (std::get<1>(GetParam()) == 0) GTEST_SKIP() << "unclipped: nothing is redone";
  const std::vector<test::PartDesc> whole(5, test::PartDesc{4096, 0, ParamOutput::kBF16});  // one chunk each
  RecordingSource source;
  const StepReport b = declared_step(std::get<0>(GetParam()), std::get<1>(GetParam()), whole, source);
  EXPECT_TRUE(b.redone);
  EXPECT_GT(b.reused_chunks, 0u);
  EXPECT_EQ(b.read.transfers, b.chunks - b.reused_chunks);
  EXPECT_TRUE(source.gaps.empty()) << source.gaps.front();
}

// A sink that gathers each partition's pieces and publishes the partition once it has numel
// elements (as tier.torch's engine sink does). A pass that delivers pieces and is then redone
// (clipping found late) must tell it to start over (ParamSink::abandoned): otherwise its counts
// include the pass's pieces, and a partition is published half made of them.
TEST_P(Overlap, ARedoneStepRestartsAGatheringSink) {
  for (bool tell : {true, false}) {
    SCOPED_TRACE(tell ? "the sink hears of abandoned passes" : "the sink does not hear of abandoned passes");
    Reference ref(test::mixed_model(), test::three_groups(), 11);
    const OffloadedOptimizerOptions o = opts(0.5);
    auto serial = test::make_rig(GetParam(), o, ref);
    auto over = test::make_rig(GetParam(), o, ref);
    const std::size_t parts = ref.model().size();
    std::vector<std::vector<std::uint8_t>> gathering(parts), published(parts);
    std::vector<std::uint64_t> count(parts, 0);
    test::FnSink sink([&](const OutputChunk& c) -> Status {
      const std::size_t es = param_output_size(c.dtype);
      auto& g = gathering[c.partition];
      g.resize(ref.model()[c.partition].numel * es);
      std::memcpy(g.data() + c.offset * es, c.data, c.numel * es);
      count[c.partition] += c.numel;
      if (count[c.partition] >= ref.model()[c.partition].numel) {
        published[c.partition] = g;
        count[c.partition] = 0;
      }
      return {};
    });
    if (tell) sink.on_abandoned = [&] { std::fill(count.begin(), count.end(), 0); };
    StepOptions so;
    so.sink = &sink;
    // Small gradients everywhere but in partition 0 (what backward finishes last), whose large
    // one makes the step clipped only once the pass has updated the other chunks.
    auto g = grads_for(ref, 1, 0, 1e-4f);
    g[0] = test::make_grad(ref.model()[0].numel, DType::kBF16, 99, 100.0f);
    const std::uint64_t chunks = over->opt().stats().chunks;
    ASSERT_TRUE(over->opt().start_overlapped_step(so).ok());
    for (std::size_t i = parts; i-- > 1;) ASSERT_TRUE(give(over->opt(), ref, g, i).ok());
    wait_taken(over->opt(), chunks - 1);
    ASSERT_TRUE(give(over->opt(), ref, g, 0).ok());
    auto b = over->opt().finish_overlapped_step();
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_TRUE(b->redone);
    EXPECT_GT(b->speculated_chunks, 0u);
    test::Outputs expect(ref.model());
    StepOptions ss;
    const std::vector<void*> expect_dest = expect.pointers();
    ss.destinations = expect_dest;
    for (std::size_t i = parts; i-- > 0;) ASSERT_TRUE(give(serial->opt(), ref, g, i).ok());
    ASSERT_TRUE(serial->opt().step(ss).ok());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < parts; ++i) {
      const std::size_t bytes = ref.model()[i].numel * param_output_size(ref.model()[i].output);
      if (bytes == 0) continue;
      if (published[i].size() != bytes || std::memcmp(published[i].data(), expect.data[i].data(), bytes) != 0) {
        ++wrong;
      }
    }
    if (tell) {
      EXPECT_EQ(wrong, 0u);
    } else {
      EXPECT_GT(wrong, 0u) << "the stale counts did not show: the test no longer covers the restart";
    }
  }
}

TEST_P(Overlap, ACancelledStepChangesNothing) {
  Reference ref(test::mixed_model(), test::three_groups(), 11);
  auto rig = test::make_rig(GetParam(), opts(0), ref);
  OffloadedOptimizer& opt = rig->opt();
  test::Outputs out(ref.model());
  StepOptions so;
  const std::vector<void*> out_dest = out.pointers();
  so.destinations = out_dest;
  // Params as the committed state has them.
  for (std::size_t i = 0; i < ref.model().size(); ++i) {
    if (ref.model()[i].output == ParamOutput::kNone) continue;
    ASSERT_TRUE(
        opt.read_params(static_cast<PartitionId>(i), param_output_dtype(ref.model()[i].output), out.data[i].data())
            .ok());
  }
  const auto before = out.data;
  const auto g = grads_for(ref, 1, 0, 1e-2f);
  ASSERT_TRUE(opt.start_overlapped_step(so).ok());
  EXPECT_EQ(opt.step().status().code(), StatusCode::kFailedPrecondition);  // one step at a time
  for (std::size_t i = ref.model().size(); i-- > 5;) ASSERT_TRUE(give(opt, ref, g, i).ok());
  wait_taken(opt, 1);
  EXPECT_GT(opt.overlapped_chunks_taken(), 0u);
  opt.clear_grads();  // cancels
  EXPECT_FALSE(opt.overlapped_step_running());
  EXPECT_EQ(*opt.group_step(0), 0);
  EXPECT_TRUE(test::state_matches(opt, ref));  // the reference has taken no step
  for (std::size_t i = 0; i < ref.model().size(); ++i) {
    const std::size_t bytes = ref.model()[i].numel * param_output_size(ref.model()[i].output);
    EXPECT_EQ(std::memcmp(out.data[i].data(), before[i].data(), bytes), 0) << "params of partition " << i;
  }
  // A serial step afterwards is the reference's first.
  test::feed(opt, ref, 1, 1, DType::kBF16, GradMode::kCopy);
  ASSERT_TRUE(ref.step(1.0, 0));
  ASSERT_TRUE(opt.step().ok());
  EXPECT_TRUE(test::state_matches(opt, ref));
}

// With redeliver_abandoned_outputs off (outputs into the caller's private staging), a cancel
// leaves what the pass wrote there (ACancelledStepChangesNothing: with it on, the committed params
// are delivered again); the state is untouched all the same.
TEST_P(Overlap, WithoutRedeliveryACancelLeavesThePassOutputsAlone) {
  Reference ref(test::mixed_model(), test::three_groups(), 11);
  auto rig = test::make_rig(GetParam(), opts(0), ref);
  OffloadedOptimizer& opt = rig->opt();
  test::Outputs out(ref.model());
  StepOptions so;
  so.redeliver_abandoned_outputs = false;
  const std::vector<void*> out_dest = out.pointers();
  so.destinations = out_dest;
  const auto g = grads_for(ref, 1, 0, 1e-2f);
  const std::uint64_t chunks = opt.stats().chunks;
  ASSERT_TRUE(opt.start_overlapped_step(so).ok());
  for (std::size_t i = ref.model().size(); i-- > 1;) ASSERT_TRUE(give(opt, ref, g, i).ok());
  wait_taken(opt, chunks - 1);  // all but the chunk that holds partition 0
  ASSERT_GT(opt.overlapped_chunks_taken(), 0u);
  opt.cancel_overlapped_step();
  EXPECT_FALSE(opt.overlapped_step_running());
  EXPECT_EQ(*opt.group_step(0), 0);
  EXPECT_TRUE(test::state_matches(opt, ref));
  // The outputs still hold the speculative update: they differ from the committed params.
  std::size_t ahead = 0;
  for (std::size_t i = 0; i < ref.model().size(); ++i) {
    if (ref.model()[i].output == ParamOutput::kNone) continue;
    const std::size_t bytes = ref.model()[i].numel * param_output_size(ref.model()[i].output);
    std::vector<std::uint8_t> committed(bytes);
    ASSERT_TRUE(
        opt.read_params(static_cast<PartitionId>(i), param_output_dtype(ref.model()[i].output), committed.data()).ok());
    if (std::memcmp(out.data[i].data(), committed.data(), bytes) != 0) ++ahead;
  }
  EXPECT_GT(ahead, 0u) << "every output was put back to the committed params";
}

TEST_P(Overlap, PartitionsWithoutGradientsAreLeftAloneAsStepLeavesThem) {
  for (double clip : {1e6, 0.05}) {  // speculation kept, then dropped early
    SCOPED_TRACE(str("max_grad_norm ", clip));
    Reference ref(test::mixed_model(), test::three_groups(), 11);
    auto serial = test::make_rig(GetParam(), opts(clip), ref);
    auto over = test::make_rig(GetParam(), opts(clip), ref);
    const auto g = grads_for(ref, 1, 0, 1e-2f);
    StepOptions ss, so;
    ss.skip_missing_grads = so.skip_missing_grads = true;
    ASSERT_TRUE(over->opt().start_overlapped_step(so).ok());
    for (std::size_t i = ref.model().size(); i-- > 0;) {
      if (i == 4) continue;  // no gradient: untouched by the step
      ASSERT_TRUE(give(serial->opt(), ref, g, i).ok());
      ASSERT_TRUE(give(over->opt(), ref, g, i).ok());
    }
    auto a = serial->opt().step(ss);
    auto b = over->opt().finish_overlapped_step();
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->redone, clip < 1);
    for (std::size_t i = 0; i < ref.model().size(); ++i) {
      const std::uint64_t n = ref.model()[i].numel;
      for (StateKind k : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
        std::vector<float> x(n), y(n);
        ASSERT_TRUE(serial->opt().read_state(static_cast<PartitionId>(i), k, x.data(), 0, n).ok());
        ASSERT_TRUE(over->opt().read_state(static_cast<PartitionId>(i), k, y.data(), 0, n).ok());
        ASSERT_TRUE(test::same_bits(y.data(), x.data(), n, str("partition ", i, " ", state_kind_name(k))));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Homes, Overlap, testing::ValuesIn(test::nvme_homes()), test::home_name);
INSTANTIATE_TEST_SUITE_P(Homes, OverlapDeclared,
                         testing::Combine(testing::ValuesIn(test::nvme_homes()), testing::Values(0.0, 0.05)),
                         [](const testing::TestParamInfo<std::tuple<Home, double>>& info) {
                           return test::home_name(testing::TestParamInfo<Home>(std::get<0>(info.param), info.index)) +
                                  (std::get<1>(info.param) > 0 ? "_clipped" : "_unclipped");
                         });

TEST(OverlapOptions, HostHomeAndLambAreRefused) {
  const Home host{"host", StateHome::kHost, IoEngineKind::kAuto, false};
  Reference ref(test::mixed_model(), test::three_groups(), 11);
  auto rig = test::make_rig(host, opts(0), ref);
  EXPECT_EQ(rig->opt().start_overlapped_step({}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(rig->opt().finish_overlapped_step().status().code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tier::optim
