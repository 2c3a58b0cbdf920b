// fp32 <-> bf16/fp16 conversions (cpu::convert) on one thread, over sizes from L1 to beyond L3.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "tier/cpu_kernels.hpp"

namespace {

using tier::DType;

std::size_t dtype_bytes(DType d) {
  return d == DType::kF32 ? 4 : 2;
}

void BM_Convert(benchmark::State& state, DType from, DType to) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  std::vector<std::uint8_t> src(n * dtype_bytes(from)), dst(n * dtype_bytes(to));
  // Small finite values in every format: the fp32 bit pattern of 1.0 + i * 2^-10, truncated.
  if (from == DType::kF32) {
    auto* f = reinterpret_cast<float*>(src.data());
    for (std::uint64_t i = 0; i < n; ++i) f[i] = 1.0f + static_cast<float>(i % 1024) / 1024.0f;
  } else {
    auto* h = reinterpret_cast<std::uint16_t*>(src.data());
    for (std::uint64_t i = 0; i < n; ++i) h[i] = from == DType::kBF16 ? 0x3f80 : 0x3c00;  // 1.0
  }
  const tier::cpu::ConstTensorRef s(src.data(), from, n);
  const tier::cpu::TensorRef d{dst.data(), to, n};
  for (auto _ : state) {
    if (!tier::cpu::convert(s, d).ok()) {
      state.SkipWithError("convert failed");
      break;
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * n));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n * (dtype_bytes(from) + dtype_bytes(to))));
  state.SetLabel(tier::cpu::simd_target());
}

#define TIER_CONVERT(name, from, to) \
  BENCHMARK_CAPTURE(BM_Convert, name, from, to)->RangeMultiplier(16)->Range(4 << 10, 16 << 20)

TIER_CONVERT(f32_to_bf16, DType::kF32, DType::kBF16);
TIER_CONVERT(bf16_to_f32, DType::kBF16, DType::kF32);
TIER_CONVERT(f32_to_f16, DType::kF32, DType::kF16);
TIER_CONVERT(f16_to_f32, DType::kF16, DType::kF32);

}  // namespace
