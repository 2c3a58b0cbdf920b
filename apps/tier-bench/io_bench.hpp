// The swap-space I/O benchmark behind `tier-bench io` (and `tier-bench tune`, which runs it over a
// search space): one extent streamed in block-size requests at a queue depth, or a batch of
// tensor-sized extents, through the engine every NVMe byte of tier takes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tier/config.hpp"
#include "tier/status.hpp"

namespace tier::bench {

struct IoBenchSpec {
  std::vector<std::string> paths;
  std::uint64_t size = 1ull << 30;
  std::uint64_t block_size = 1 << 20;
  unsigned queue_depth = 32;
  unsigned parallelism = 1;
  IoEngineKind engine = IoEngineKind::kAuto;
  bool write = false;
  bool direct = true;
  bool sqpoll = false;
  bool fixed_buffers = true;
  bool single_submit = false;
  bool heap_buffers = false;  // ordinary 4 KiB-page buffers instead of the arena (a reference)
  bool prefill = true;
  HugePageMode huge_pages = HugePageMode::kAuto;
  unsigned tensors = 0;  // > 0: tensor mode
  std::uint64_t min_tensor = 64 << 10;
  std::uint64_t max_tensor = 4 << 20;
  std::uint64_t seed = 1;
  std::string device;   // /proc/diskstats name; empty: the device holding the first path
  unsigned passes = 1;  // timed passes; the median is reported
  bool progress = true;
};

struct IoBenchResult {
  std::string engine;
  std::uint64_t bytes = 0;      // per pass
  double seconds = 0;           // mean per pass
  double bytes_per_second = 0;  // the median pass
  std::vector<double> passes;   // bytes per second of each pass
  std::string device;
  double avg_request_bytes = 0;  // 0 when unknown
  std::uint64_t device_requests = 0;
  bool direct = false;
  bool fixed_buffers = false;
  double huge_page_fraction = 0;
  std::uint64_t requests = 0;
  std::uint64_t submit_calls = 0;
};

// Runs the benchmark `spec` describes (prefill, then `passes` timed passes).
Result<IoBenchResult> run_io_bench(const IoBenchSpec& spec);
// "auto", "uring", "aio" or "posix"; an error names --engine and the choices.
Result<IoEngineKind> parse_engine(const std::string& s);

}  // namespace tier::bench
