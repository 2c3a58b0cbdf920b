// Internal: the state of an OffloadedOptimizer, shared by its source files
// (offloaded_optimizer.cpp: registration, gradients, the step, state access; checkpoint.cpp).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "optim/workers.hpp"
#include "tier/ext/host_arena.hpp"
#include "tier/offloaded_optimizer.hpp"

namespace tier::optim::detail {

struct FreeDeleter {
  void operator()(void* p) const noexcept { std::free(p); }
};
using FloatPtr = std::unique_ptr<float, FreeDeleter>;

// Elements per section are a multiple of this, so every section (and chunk) is a multiple of
// 4 KiB on disk and in the buffers.
inline constexpr std::uint64_t kSectionAlign = 1024;

inline std::uint64_t round_up(std::uint64_t v, std::uint64_t a) {
  return (v + a - 1) / a * a;
}

struct Partition {
  std::uint64_t start = 0;  // index of its first element in the flat element space
  std::uint64_t numel = 0;
  int group = 0;
  ParamOutput output = ParamOutput::kNone;
  std::string name;

  // Gradient of the current step; touched only by add_grad() for this partition (and by step()).
  const void* grad = nullptr;  // the borrowed buffer or acc
  DType grad_dtype = DType::kF32;
  FloatPtr acc;  // fp32 accumulator, allocated at the first copied gradient and kept
  int contributions = 0;
  bool declared = false;  // the caller keeps the gradient; step() asks StepOptions::grad_source
  bool norm_known = false;
  double sumsq = 0;
};

// One chunk of the flat element space: [start, start + numel), stored as three sections (master,
// exp_avg, exp_avg_sq) of `stride` elements each.
struct Chunk {
  std::uint64_t start = 0;
  std::uint64_t numel = 0;
  std::uint64_t stride = 0;
  PartitionId first = 0;  // partitions [first, last] intersect the chunk
  PartitionId last = 0;
  nvme::SwapExtent slot[2];  // NVMe home
  int committed = 0;         // which slot holds the committed state
  FloatPtr host;             // host home: the three sections

  std::uint64_t bytes() const noexcept { return 3 * stride * sizeof(float); }
};

// A pipeline buffer: one chunk's three sections, then the low-precision staging (4 bytes per
// element, so any mix of output dtypes fits at the element's own offset).
struct Buffer {
  PinnedRegion mem;  // from the optimizer's arena (keep: the HostBlock) or options.pinned_source
  float* state = nullptr;
  std::byte* staging = nullptr;
  nvme::IoFuture pending;  // registration / write_state: the write still using the buffer
};

}  // namespace tier::optim::detail

namespace tier::optim {

struct OffloadedOptimizer::Impl {
  OffloadedOptimizerOptions opt;
  std::uint64_t chunk_elems = 0;

  std::unique_ptr<HostArena> own_arena;
  HostArena* arena = nullptr;
  std::unique_ptr<nvme::SwapSpace> own_swap;
  nvme::SwapSpace* swap = nullptr;
  std::vector<detail::Buffer> bufs;
  // Pinned bytes of the buffers this optimizer reports as its own (none when they came from
  // options.pinned_source, which counts them).
  std::int64_t own_pinned_bytes() const {
    if (opt.pinned_source) return 0;
    std::int64_t n = 0;
    for (const detail::Buffer& b : bufs) n += static_cast<std::int64_t>(b.mem.bytes);
    return n;
  }
  std::unique_ptr<detail::Workers> workers;

  std::vector<detail::Partition> parts;
  std::vector<detail::Chunk> chunks;
  std::uint64_t elements = 0;
  std::vector<cpu::AdamGroup> groups;
  std::unique_ptr<LossScaler> scaler;

  // Registration: the chunk being filled (its state lives in `open_base`).
  bool registered = false;
  bool chunk_open = false;
  float* open_base = nullptr;
  std::uint64_t open_fill = 0;
  // During a step with StepOptions::skip_missing_grads: per partition, 1 to leave it untouched.
  std::vector<std::uint8_t> skipping;
  // Set when registration failed (a chunk write): every later call reports it.
  Status poisoned;
  // Set when the host-resident state was left half-updated (a failed load after verification, a
  // step that failed mid-way): everything but load_checkpoint reports it; a good load clears it.
  Status state_invalid;

  std::atomic<std::uint64_t> with_grads{0};
  std::atomic<std::uint64_t> accumulator_bytes{0};
  std::uint64_t steps_skipped = 0;
  std::uint64_t steps_failed = 0;

  bool nvme() const noexcept { return opt.home == StateHome::kNvme; }
  Status usable(const char* what, bool loading = false) const;
  PartitionId partition_at(const detail::Chunk& c, std::uint64_t flat) const;
  // Elements of chunk c's section `kind` in memory laid out like a chunk record.
  static float* section(float* base, const detail::Chunk& c, StateKind kind) {
    return base + static_cast<std::uint64_t>(kind) * c.stride;
  }
  void report_resident(std::int64_t host_delta, std::int64_t nvme_delta) const;
};

}  // namespace tier::optim
