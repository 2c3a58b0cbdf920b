// Internal: the chunk pipeline of the NVMe home. Chunks go through the pinned buffers in order:
// read chunk k from its committed slot into buffer k % B, process it on the calling thread, write
// it to its shadow slot; a buffer whose write completed takes the next chunk's read at once (from
// the I/O thread's completion callback), so reads run ahead of the update by up to B chunks while
// earlier writes drain. Reads, the update and writes of different chunks overlap; each stream is
// timed (busy time = union of in-flight intervals).
//
// The read-only form (checkpoint save) frees a buffer after processing; the write-only form
// (checkpoint load) fills buffers on the calling thread. On the first error no new transfer is
// issued; run() returns only when nothing is in flight, with that error.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "optim/optimizer_impl.hpp"

namespace tier::optim::detail {

struct PipelineStats {
  StreamReport read, update, write;
  double io_busy_seconds = 0;
  double update_wait_seconds = 0;
  unsigned max_in_flight = 0;
};

// process(i, buffer) handles chunk i in `buffer` (laid out with chunk i's stride). `order`, when
// given, is the sequence of chunk indices to go through instead of 0, 1, ... (e.g. reversed).
// `preloaded` (read-write form), when given: for the first min(B, n) positions k, whether buffer k
// already holds the committed record of the chunk at position k (a LeftoverRead of an earlier run,
// nothing written since); those reads are not issued again. `leftover`, when given, receives the
// chunks read but not processed when the run stops early (after an error from `process`; one that
// returns kCancelled promises it left its buffer untouched, so its chunk counts as not processed).
// `order` may name fewer chunks than there are (a step finished after a failure).
// A chunk's write goes to its `next` extent when it holds one (state_copies 1: `process` takes a
// spare), else to its shadow slot; `written`, when given, is called with the chunk index when its
// write completed successfully (on an I/O thread, one call at a time).
Status run_pipeline(nvme::SwapSpace& swap, std::vector<Chunk>& chunks, std::vector<Buffer>& bufs, bool read, bool write,
                    const std::function<Status(std::size_t, Buffer&)>& process, PipelineStats* stats,
                    const std::vector<std::size_t>* order = nullptr,
                    const std::vector<std::uint8_t>* preloaded = nullptr, std::vector<LeftoverRead>* leftover = nullptr,
                    const std::function<void(std::size_t)>* written = nullptr);

}  // namespace tier::optim::detail
