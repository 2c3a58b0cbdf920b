// The engine's actor with many registered tensors: one acquire + release on a full device tier
// (every acquire evicts a copy), with 1k, 16k and 128k tensors registered. Placement that
// scans every tensor per eviction makes the per-operation cost grow with the count; from
// per-tier indexes it stays flat. Compare the 131072 figure with the 1024 one (docs/benchmarks.md).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tier/config.hpp"
#include "tier/engine.hpp"
#include "tier/log.hpp"

namespace {

using namespace tier;

constexpr std::uint64_t kTensorBytes = 4096;
constexpr int kDeviceSlots = 64;  // copies the device budget holds
constexpr int kCycle = 96;        // distinct tensors acquired in turn: more than fit, so each evicts

void BM_EngineAcquireEvicting(benchmark::State& state) {
  const auto count = static_cast<std::uint64_t>(state.range(0));
  auto cfg = EngineConfig::from_json(str(R"({"tier": {"device": "emulated", "budgets": {"device": )",
                                         kDeviceSlots * kTensorBytes, R"(}, "log_level": "warn"}})"));
  if (!cfg.ok()) return state.SkipWithError(cfg.status().to_string().c_str());
  auto engine = Engine::create(*cfg);
  if (!engine.ok()) return state.SkipWithError(engine.status().to_string().c_str());
  Engine& e = **engine;
  std::vector<TensorId> ids;
  ids.reserve(count);
  for (std::uint64_t i = 0; i < count; ++i) {
    auto id = e.register_tensor({str("t", i), DType::kF32, kTensorBytes / 4}, Tier::kHost);
    if (!id.ok()) return state.SkipWithError(id.status().to_string().c_str());
    ids.push_back(*id);
  }
  std::uint64_t k = 0;
  for (auto _ : state) {
    // Tensors spread over the registered range, so the ones in use are not all at its start.
    const TensorId id = ids[(k % kCycle) * (count / kCycle)];
    ++k;
    auto lease = e.acquire_now(id, Tier::kDevice, Access::kRead, /*traced=*/false);
    if (!lease.ok()) return state.SkipWithError(lease.status().to_string().c_str());
    Status s = lease->release();
    if (!s.ok()) return state.SkipWithError(s.to_string().c_str());
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["evictions_per_op"] =
      e.stats().metrics["engine.evictions.device"] / static_cast<double>(std::max<std::uint64_t>(k, 1));
}
BENCHMARK(BM_EngineAcquireEvicting)->Arg(1024)->Arg(16384)->Arg(131072)->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace
