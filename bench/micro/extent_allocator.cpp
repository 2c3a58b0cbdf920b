// The swap space's extent allocator (best fit over 4 KiB granules, coalescing on free): the cost
// of one allocate + release, in an empty map and in a fragmented one.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "nvme/extent_allocator.hpp"

namespace {

using tier::nvme::detail::ExtentAllocator;

constexpr std::uint64_t kGranule = 4096;

void BM_ExtentAllocateRelease(benchmark::State& state) {
  ExtentAllocator a(std::uint64_t{1} << 40);
  const std::uint64_t bytes = static_cast<std::uint64_t>(state.range(0)) * kGranule;
  for (auto _ : state) {
    auto off = a.allocate(bytes);
    benchmark::DoNotOptimize(off);
    a.release(*off, bytes);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_ExtentAllocateRelease)->Arg(1)->Arg(256);

// A map with `range(0)` free holes of assorted sizes (every other extent of a full file freed):
// allocations search the by-size index, releases coalesce with neighbours.
void BM_ExtentFragmented(benchmark::State& state) {
  const auto holes = static_cast<std::uint64_t>(state.range(0));
  std::mt19937_64 rng(42);
  std::vector<std::uint64_t> sizes(2 * holes);
  std::uint64_t total = 0;
  for (auto& s : sizes) {
    s = (1 + rng() % 64) * kGranule;
    total += s;
  }
  ExtentAllocator a(total);
  std::vector<std::uint64_t> offs;
  for (std::uint64_t s : sizes) offs.push_back(*a.allocate(s));
  for (std::size_t i = 0; i < sizes.size(); i += 2) a.release(offs[i], sizes[i]);
  std::size_t k = 0;
  for (auto _ : state) {
    const std::uint64_t bytes = sizes[k];
    k = (k + 2) % sizes.size();
    auto off = a.allocate(bytes);
    benchmark::DoNotOptimize(off);
    if (off) a.release(*off, bytes);
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["free_runs"] = static_cast<double>(a.free_runs());
}
BENCHMARK(BM_ExtentFragmented)->Arg(1 << 10)->Arg(64 << 10);

}  // namespace
