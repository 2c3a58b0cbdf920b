// crc32c of checkpoint records: the dispatched (hardware when available) and the portable path.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "optim/crc32c.hpp"

namespace {

namespace crc = tier::optim::detail;

template <bool kPortable>
void BM_Crc32c(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  std::vector<std::uint8_t> data(n);
  for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<std::uint8_t>(i * 131);
  for (auto _ : state) {
    const std::uint32_t c =
        kPortable ? crc::crc32c_extend_portable(0, data.data(), n) : crc::crc32c_extend(0, data.data(), n);
    benchmark::DoNotOptimize(c);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n));
}
BENCHMARK_TEMPLATE(BM_Crc32c, false)->Name("BM_Crc32c/dispatched")->Arg(4 << 10)->Arg(1 << 20);
BENCHMARK_TEMPLATE(BM_Crc32c, true)->Name("BM_Crc32c/portable")->Arg(4 << 10)->Arg(1 << 20);

}  // namespace
