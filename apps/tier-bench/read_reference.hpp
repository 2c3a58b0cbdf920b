// The NVMe rates a benchmark judges the engine against, measured outside the engine in the same
// run with plain pread/pwrite of fixed-size blocks at a fixed queue depth. A bound derived from
// the engine's own I/O would move with it (a slow request pattern would lower the bar it is
// judged by); these do not depend on anything the engine does.
//
// Thread safety: call from one thread at a time; each call starts and joins its own I/O threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tier/status.hpp"

namespace tier::bench {

struct ReadReference {
  double bytes_per_second = 0;  // read + written, over the wall time of the pass
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::uint64_t block_bytes = 0;
  int depth = 0;
  bool direct = false;  // O_DIRECT; false where the file system refused it (the page cache may serve it)
  int files = 0;
  // "sequential O_DIRECT read, 1 MiB blocks, depth 8" or "... read + write (1:1) ...".
  std::string describe() const;
};

// Reads the first `bytes` of the regular files under `dir` (split evenly over them: the part the
// engine has written, so that reads of unwritten extents, which return zeros without I/O, do not
// flatter the figure) in `block_bytes` blocks, `depth` of them in flight, in file order.
Result<ReadReference> measure_sequential_read(const std::string& dir, std::uint64_t bytes,
                                              std::uint64_t block_bytes = 1ull << 20, int depth = 8);

// A 1:1 mixed pass like an optimizer step's: reads the first `bytes` of the files under `dirs` (as
// above) while writing as many bytes, sequentially, to a scratch file in each directory (written
// once untimed first, so that the timed pass overwrites allocated blocks as the step does; removed
// afterwards). Reads and writes alternate in one sequence of blocks, `depth` in flight in total.
Result<ReadReference> measure_mixed_read_write(const std::vector<std::string>& dirs, std::uint64_t bytes,
                                               std::uint64_t block_bytes = 1ull << 20, int depth = 8);

}  // namespace tier::bench
