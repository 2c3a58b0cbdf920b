// `tier-bench memory`: host memory bandwidth, the ceiling for every CPU-side kernel, and the
// CUDA probe line of the summary.
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "tier/ext/cuda_probe.hpp"
#include "tier/units.hpp"

namespace tier::bench {
namespace {

struct CopyResult {
  double bytes_per_second = 0;  // counted as bytes read + bytes written
  double seconds = 0;
};

// Multi-threaded memcpy between two buffers, best of `reps`.
CopyResult measure_copy(std::uint64_t bytes, unsigned threads, int reps) {
  std::unique_ptr<char[]> src(new char[bytes]);
  std::unique_ptr<char[]> dst(new char[bytes]);
  std::memset(src.get(), 1, bytes);
  std::memset(dst.get(), 2, bytes);
  CopyResult best;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    const std::uint64_t per = (bytes / threads) & ~std::uint64_t{63};
    for (unsigned t = 0; t < threads; ++t) {
      const std::uint64_t off = per * t;
      const std::uint64_t len = t + 1 == threads ? bytes - off : per;
      pool.emplace_back([&, off, len] { std::memcpy(dst.get() + off, src.get() + off, len); });
    }
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double bps = 2.0 * static_cast<double>(bytes) / s;
    if (bps > best.bytes_per_second) best = {bps, s};
  }
  return best;
}

int run_memory(Args& args) {
  auto size = args.size("size", 1ull << 30);
  auto threads = args.integer("threads", std::max(1u, std::thread::hardware_concurrency()));
  const bool json_out = args.flag("json");
  Status s = args.finish();
  if (s.ok() && !size.ok()) s = size.status();
  if (s.ok() && !threads.ok()) s = threads.status();
  if (s.ok() && (*threads < 1 || *threads > 4096)) s = invalid_argument("--threads must be from 1 to 4096");
  if (s.ok() && *size < 4096) s = invalid_argument("--size must be at least 4K");
  if (!s.ok()) {
    std::fprintf(stderr, "tier-bench memory: %s\n", s.message().c_str());
    return 2;
  }
  const auto one = measure_copy(*size, 1, 3);
  const auto all = measure_copy(*size, static_cast<unsigned>(*threads), 3);
  if (json_out) {
    nlohmann::ordered_json j = {{"bytes", *size},
                                {"threads", *threads},
                                {"copy_bytes_per_second_1_thread", one.bytes_per_second},
                                {"copy_bytes_per_second", all.bytes_per_second}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    Table t({"kernel", "threads", "bandwidth (read+write)"});
    t.add({"memcpy", "1", format_rate(one.bytes_per_second)});
    t.add({"memcpy", std::to_string(*threads), format_rate(all.bytes_per_second)});
    t.print();
  }
  return 0;
}

const CommandRegistrar kRegister({"memory", "host memory bandwidth (memcpy, counted as read + write)",
                                  "  --size N      buffer size (default 1G)\n"
                                  "  --threads N   threads (default: all cores)\n"
                                  "  --json        print one JSON object",
                                  run_memory});

const SummaryRegistrar kSummaryCuda(
    {0, "cuda probe", [](bool) -> Result<std::vector<SummaryRow>> {
       const auto& p = probe_cuda();
       return std::vector<SummaryRow>{{"cuda devices", p.usable() ? "usable" : "none", "", 0, p.summary()}};
     }});

const SummaryRegistrar kSummaryMemory({10, "host memory", [](bool quick) -> Result<std::vector<SummaryRow>> {
                                         const std::uint64_t bytes = quick ? (256ull << 20) : (1ull << 30);
                                         const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
                                         const auto one = measure_copy(bytes, 1, 3);
                                         const auto all = measure_copy(bytes, threads, 3);
                                         return std::vector<SummaryRow>{
                                             {"host memory memcpy, " + std::to_string(threads) + " threads",
                                              format_rate(all.bytes_per_second),
                                              "1 thread " + format_rate(one.bytes_per_second),
                                              all.bytes_per_second / one.bytes_per_second,
                                              "read + write bytes, " + format_bytes(bytes)}};
                                       }});

}  // namespace
}  // namespace tier::bench
