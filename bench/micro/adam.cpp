// The Adam inner loop (cpu::adam_update_chunk) on one thread, on data that fits in L2 (the
// compute-bound case) and on data that does not (memory-bound); bytes are those the update moves.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "tier/cpu_adam.hpp"

namespace {

using tier::DType;

void BM_AdamUpdateChunk(benchmark::State& state, DType grad_dtype, DType out_dtype) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  std::vector<float> p(n, 0.5f), m(n, 0.0f), v(n, 0.0f), g32(n, 1e-3f);
  std::vector<std::uint16_t> g16(n, grad_dtype == DType::kBF16 ? 0x3a83 : 0x1419), out(n);  // ~1e-3
  tier::cpu::AdamTensors t;
  t.params = {p.data(), DType::kF32, n};
  t.exp_avg = {m.data(), DType::kF32, n};
  t.exp_avg_sq = {v.data(), DType::kF32, n};
  t.grads = grad_dtype == DType::kF32 ? tier::cpu::ConstTensorRef(g32.data(), DType::kF32, n)
                                      : tier::cpu::ConstTensorRef(g16.data(), grad_dtype, n);
  if (out_dtype != DType::kF32) t.out = {out.data(), out_dtype, n};
  auto step = tier::cpu::AdamStep::make(tier::cpu::AdamHyperParams{}, 1);
  if (!step.ok()) {
    state.SkipWithError("AdamStep::make failed");
    return;
  }
  for (auto _ : state) {
    if (!tier::cpu::adam_update_chunk(*step, t).ok()) {
      state.SkipWithError("adam_update_chunk failed");
      break;
    }
    benchmark::ClobberMemory();
  }
  // params, exp_avg, exp_avg_sq read and written; grads read; out written.
  const std::uint64_t per = 3 * 8 + (grad_dtype == DType::kF32 ? 4 : 2) + (out_dtype == DType::kF32 ? 0 : 2);
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * n));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n * per));
  state.SetLabel(tier::cpu::simd_target());
}

// 16 Ki elements: 16 B x 16 Ki = 256 KiB of state, in L2 on current cores; 4 Mi: 64 MiB, in DRAM.
BENCHMARK_CAPTURE(BM_AdamUpdateChunk, f32_grads, DType::kF32, DType::kF32)->Arg(16 << 10)->Arg(4 << 20);
BENCHMARK_CAPTURE(BM_AdamUpdateChunk, bf16_grads_bf16_out, DType::kBF16, DType::kBF16)->Arg(16 << 10)->Arg(4 << 20);
BENCHMARK_CAPTURE(BM_AdamUpdateChunk, f16_grads_f16_out, DType::kF16, DType::kF16)->Arg(16 << 10)->Arg(4 << 20);

}  // namespace
