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

// How a reference moves its blocks: `depth` threads each doing blocking pread/pwrite, or one
// io_uring (liburing, called directly: none of tier's I/O code) with `depth` requests in flight.
enum class ReferenceMethod { kThreads, kUring };

struct ReadReference {
  double bytes_per_second = 0;  // read + written, over the wall time of the pass
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::uint64_t block_bytes = 0;
  int depth = 0;
  bool direct = false;  // O_DIRECT; false where the file system refused it (the page cache may serve it)
  int files = 0;
  ReferenceMethod method = ReferenceMethod::kThreads;
  int streams = 1;  // sequential streams over consecutive parts of the bytes, in flight together
  // "sequential O_DIRECT read, 1 MiB blocks, depth 8, io_uring" or "... read + write (1:1) ...".
  std::string describe() const;
};

// Reads the first `bytes` of the regular files under `dir` (split evenly over them: the part the
// engine has written, so that reads of unwritten extents, which return zeros without I/O, do not
// flatter the figure) in `block_bytes` blocks, `depth` of them in flight, in file order.
Result<ReadReference> measure_sequential_read(const std::string& dir, std::uint64_t bytes,
                                              std::uint64_t block_bytes = 1ull << 20, int depth = 8,
                                              ReferenceMethod method = ReferenceMethod::kThreads, int streams = 1);

// A 1:1 mixed pass like an optimizer step's: reads the first `bytes` of the files under `dirs` (as
// above) while writing as many bytes, sequentially, to a scratch file in each directory (written
// once untimed first, so that the timed pass overwrites allocated blocks as the step does; removed
// afterwards). Reads and writes alternate in one sequence of blocks, `depth` in flight in total.
// Both: `streams` > 1 moves the bytes as that many sequential streams over consecutive parts of
// them, a block of each in turn.
Result<ReadReference> measure_mixed_read_write(const std::vector<std::string>& dirs, std::uint64_t bytes,
                                               std::uint64_t block_bytes = 1ull << 20, int depth = 8,
                                               ReferenceMethod method = ReferenceMethod::kThreads, int streams = 1);

// Private folders for a reference to read from: under each path a fresh folder (mkdtemp: an
// unpredictable name, mode 0700) holding one file of that path's share of `bytes`, written once
// here (pseudo-random bytes, fdatasync'ed) and removed with the object. Handed to
// measure_sequential_read / measure_mixed_read_write as their folders, a reference then reads
// exactly those bytes, whatever else the paths hold (a user's folder may hold thousands of other
// files, which the share per file would otherwise be split over).
class ReferenceFolders {
 public:
  static Result<ReferenceFolders> create(const std::vector<std::string>& paths, std::uint64_t bytes,
                                         const std::string& what);
  ReferenceFolders(ReferenceFolders&& o) noexcept : dirs_(std::move(o.dirs_)) { o.dirs_.clear(); }
  ReferenceFolders& operator=(ReferenceFolders&&) = delete;
  ReferenceFolders(const ReferenceFolders&) = delete;
  ReferenceFolders& operator=(const ReferenceFolders&) = delete;
  ~ReferenceFolders();
  const std::vector<std::string>& dirs() const noexcept { return dirs_; }

 private:
  ReferenceFolders() = default;
  std::vector<std::string> dirs_;
};

// The request shapes a reference searches: block sizes and depths (requests in flight).
struct ReferenceShapes {
  std::vector<ReferenceMethod> methods;
  std::vector<std::uint64_t> blocks;
  std::vector<int> depths;
  std::vector<int> streams = {1};
  int passes = 2;  // per shape; the best pass counts (the disk's rate, not its worst moment)
  std::size_t count() const { return methods.size() * blocks.size() * depths.size() * streams.size(); }
};

// The shapes a benchmark's reference tries around the engine's own request shape: its block and
// 1 MiB and 4 MiB blocks, each at its depth and at 4x and 16x that depth (at most 256), as one
// sequential stream and as 4 at once (the engine moves several tensors together), through threads
// and through io_uring; one pass each. A reference at one shape or by one method may sit below what the
// disk does otherwise, and a step could then come out faster than its "bound"; the best over
// these is the disk's rate for the same bytes. (A disk's rate also drifts: a benchmark measures
// the best shape again between its timed runs, see measure_again.)
ReferenceShapes reference_shapes(std::uint64_t engine_block, int engine_depth);

// `best` measured once more at its own shape (method, block, depth); the faster of the two.
Result<ReadReference> measure_again(const ReadReference& best, const std::string& dir, std::uint64_t bytes);
Result<ReadReference> measure_again(const ReadReference& best, const std::vector<std::string>& dirs,
                                    std::uint64_t bytes);

// A progress line on stderr for one measured shape: "  1.93 GB/s: sequential O_DIRECT ...".
void print_reference(const ReadReference& r);

// The best of measure_sequential_read / measure_mixed_read_write over `shapes`. `progress`
// (may be null) hears of each shape as it is measured.
Result<ReadReference> best_sequential_read(const std::string& dir, std::uint64_t bytes, const ReferenceShapes& shapes,
                                           void (*progress)(const ReadReference&) = nullptr);
Result<ReadReference> best_mixed_read_write(const std::vector<std::string>& dirs, std::uint64_t bytes,
                                            const ReferenceShapes& shapes,
                                            void (*progress)(const ReadReference&) = nullptr);

}  // namespace tier::bench
