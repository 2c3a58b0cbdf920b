// The NVMe read rate a benchmark judges the engine against, measured outside the engine in the
// same run: plain sequential reads of the swap files with a fixed block size and queue depth.
// A bound derived from the engine's own reads would move with them (a slow read pattern would
// lower the bar it is judged by); this one does not depend on anything the engine does.
//
// Thread safety: call from one thread at a time; it starts and joins its own reader threads.
#pragma once

#include <cstdint>
#include <string>

#include "tier/status.hpp"

namespace tier::bench {

struct ReadReference {
  double bytes_per_second = 0;
  std::uint64_t bytes = 0;
  std::uint64_t block_bytes = 0;
  int depth = 0;
  bool direct = false;  // O_DIRECT; false where the file system refused it (the page cache may serve reads)
  int files = 0;
  std::string describe() const;  // "sequential O_DIRECT read, 1 MiB blocks, depth 8"
};

// Reads the first `bytes` of the regular files under `dir` (split evenly over them; the part the
// engine has written, so that reads of unwritten extents, which return zeros without I/O, do not
// flatter the figure) in `block_bytes` blocks, `depth` of them in flight, in file order.
Result<ReadReference> measure_sequential_read(const std::string& dir, std::uint64_t bytes,
                                              std::uint64_t block_bytes = 1ull << 20, int depth = 8);

}  // namespace tier::bench
