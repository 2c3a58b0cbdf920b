// Internal: the state of an OffloadedOptimizer, shared by its source files
// (offloaded_optimizer.cpp: registration, gradients, the step, state access; checkpoint.cpp).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "optim/workers.hpp"
#include "tier/ext/host_arena.hpp"
#include "tier/offloaded_optimizer.hpp"
#include "tier/state_codec.hpp"

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

// The sections of a chunk record of `stride` elements, as byte offsets: master (fp32), exp_avg and
// exp_avg_sq in the state dtype, then (int8 only) one fp32 scale per 256 elements of each. Every
// section starts on a 4 KiB boundary. With fp32 state this is three sections of stride floats
// (the layout of format versions 1 and 2). When the masters are the caller's
// (OffloadedOptimizerOptions::master_source), the master section moves after the others, outside
// the record: `bytes` (what is stored and moved) ends before it, `span` (the memory a buffer gives
// the chunk) holds it too.
enum class Section : std::uint8_t { kMaster = 0, kExpAvg = 1, kExpAvgSq = 2, kExpAvgScales = 3, kExpAvgSqScales = 4 };
struct ChunkLayout {
  std::uint64_t offset[5] = {};
  std::uint64_t bytes = 0;
  std::uint64_t span = 0;
  static ChunkLayout of(std::uint64_t stride, cpu::StateDType d, bool external_master = false) {
    ChunkLayout l;
    const std::uint64_t sizes[5] = {stride * 4, stride * dtype_size(cpu::exp_avg_dtype(d)),
                                    stride * dtype_size(cpu::exp_avg_sq_dtype(d)),
                                    cpu::state_scale_count(d, stride) * 4, cpu::state_scale_count(d, stride) * 4};
    static constexpr int kInRecord[5] = {0, 1, 2, 3, 4};
    static constexpr int kMasterLast[5] = {1, 2, 3, 4, 0};
    for (int s : external_master ? kMasterLast : kInRecord) {
      l.offset[s] = l.span;
      l.span += (sizes[s] + 4095) / 4096 * 4096;
      if (s != 0 || !external_master) l.bytes = l.span;
    }
    return l;
  }
};

// One chunk of the flat element space: [start, start + numel), stored as a record of `stride`
// elements laid out by ChunkLayout. With int8 state every partition starts on a 256-element
// boundary of the flat space (the gaps belong to no partition), so that quantization blocks never
// straddle two partitions and chunk boundaries (multiples of 1024) fall on block boundaries.
struct Chunk {
  std::uint64_t start = 0;
  std::uint64_t numel = 0;
  std::uint64_t stride = 0;
  ChunkLayout layout;
  PartitionId first = 0;  // partitions [first, last] intersect the chunk
  PartitionId last = 0;
  // NVMe home: slot[committed] holds the committed state; with state_copies 2 slot[1 - committed]
  // is the shadow a step writes, with 1 it is empty and `next` (a spare from the pool, taken for
  // the chunk's write and swapped in once the write completed) takes its place.
  nvme::SwapExtent slot[2];
  int committed = 0;
  nvme::SwapExtent next;
  FloatPtr host;  // host home: the record

  std::uint64_t bytes() const noexcept { return layout.bytes; }
};

// A pipeline buffer: one chunk's record, then the low-precision staging (4 bytes per element, so
// any mix of output dtypes fits at the element's own offset).
struct Buffer {
  PinnedRegion mem;  // from the optimizer's arena (keep: the HostBlock) or options.pinned_source
  float* state = nullptr;
  std::byte* staging = nullptr;
  nvme::IoFuture pending;  // registration / write_state: the write still using the buffer
};

// An overlapped step in flight (OffloadedOptimizer::start_overlapped_step): its thread, the
// readiness of each partition's gradient, and what the validation needs.
// A chunk whose committed record sits read in a pipeline buffer and was not processed: what a run
// of the chunk pipeline that stopped early leaves behind (chunk_pipeline.hpp).
struct LeftoverRead {
  std::size_t chunk = 0;
  std::size_t buffer = 0;
};

// state_copies 1: a step that failed after some chunks took their update (OffloadedOptimizer::
// Impl::done). What its finish needs to give the result the step would have had: the constants of
// every group (and partition: Lamb's trust ratios), taken when it began, and the norm it used.
struct Owed {
  std::int64_t step = 0;  // group 0's counter once it is finished
  std::vector<cpu::AdamStep> steps;
  std::vector<cpu::AdamStep> part_steps;
  double total = 0;  // the global sum of squares
  float clip = 1;
  // The failed try's deliveries were dropped (ParamSink::abandoned): the finish delivers every
  // chunk of the partitions it updates, the done ones from their state.
  bool redeliver = true;
};

struct Overlap {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::uint8_t> ready;  // per partition: its final gradient is in (under mu)
  double ready_sumsq = 0;           // over the ready partitions, for the early abort (under mu)
  bool all_in = false;              // no more gradients will come (under mu)
  bool abort = false;               // stop before the next chunk (under mu)
  const char* abort_reason = "";    // (under mu)
  double scale = 1;                 // the loss scale the gradients carry
  StepOptions options;
  std::vector<std::uint8_t> touched;  // per partition: updated by the pass (its thread only)
  std::vector<std::int64_t> old_steps;
  std::uint64_t speculated = 0;  // chunks taken before all gradients were in (under mu)
  // state_copies 1: the pass stopped because no spare slot was left (its thread; read after the
  // join), the chunks whose update it wrote (the pipeline's completions; read after the join),
  // and the constants it used (its thread).
  bool out_of_room = false;
  std::vector<std::uint8_t> written;
  std::vector<cpu::AdamStep> steps;
  // Chunks the pass had read but not updated when it stopped (its thread; read after the join).
  std::vector<LeftoverRead> leftover;
  // master_source: the chunks whose masters the pass filled, with the buffer holding each (its
  // thread; read after the join). Their updated masters wait there until the step commits (the
  // pass updates at most as many chunks as there are buffers, and reads leave that section alone).
  std::vector<LeftoverRead> filled;
  Result<StepReport> result{Status(StatusCode::kInternal, "the overlapped pass has not ended")};
  std::thread thread;
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
  Reservation nvme_reserved;  // a shared swap space's room for this optimizer (options.nvme_reserve)
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
  std::uint64_t numel_total = 0;  // the partitions' elements (elements less the int8 alignment gaps)
  // Own swap space, or a shared one with a reservation: the elements (gaps included) it was sized
  // for; 0: not bounded here (a shared swap space without one refuses what it cannot hold).
  std::uint64_t capacity = 0;
  std::vector<cpu::AdamGroup> groups;
  // Guards the groups' hyper-parameters and step counters: a step running on another thread (an
  // overlapped or asynchronous pass) takes them at its start while the caller's thread may set the
  // next step's lr (a scheduler) or read them.
  mutable std::mutex groups_mu;
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
  // Set when params delivered by a step are not the committed state's and could not be put back
  // (a failed step whose restore failed too, or an applied step whose outputs failed); cleared by
  // the next step that delivers every output.
  bool outputs_stale = false;

  // The overlapped step in flight, if any (see start_overlapped_step).
  std::unique_ptr<detail::Overlap> overlap;
  // add_grad / declare_grad: partition `id` has its final gradient; wakes an overlapped pass.
  void note_ready(PartitionId id);

  std::atomic<std::uint64_t> with_grads{0};
  std::atomic<std::uint64_t> accumulator_bytes{0};
  // Atomic: stats() may read them while an overlapped pass's thread counts.
  std::atomic<std::uint64_t> steps_skipped{0};
  std::atomic<std::uint64_t> steps_failed{0};
  std::atomic<std::uint64_t> steps_applied{0};

  // state_copies 1 (NVMe home): the spare slots not in use (taken by a chunk's write as its
  // `next`), which chunks the step in progress (or the failed one owed) has updated, and the
  // failed step owed, if any.
  std::mutex pool_mu;
  std::vector<nvme::SwapExtent> pool;
  std::uint64_t pool_size = 0;
  // Bytes of every slot and spare (they trade places, the sum stays).
  std::atomic<std::uint64_t> nvme_slot_bytes{0};
  std::vector<std::uint8_t> done;
  std::unique_ptr<detail::Owed> owed;
  std::atomic<bool> owed_flag{false};  // owed != nullptr, for stats() on other threads
  void set_owed(std::unique_ptr<detail::Owed> o) {
    owed = std::move(o);
    owed_flag = owed != nullptr;
  }
  bool once() const noexcept { return nvme() && opt.state_copies == 1; }
  // Takes a spare as chunk c's `next`; false when none is left.
  bool take_spare(detail::Chunk& c);
  // Gives c.next back to the pool (when it holds one).
  void drop_spare(detail::Chunk& c);
  // drop_spare for every chunk: the spares a pass took and did not commit.
  void drop_spares();
  // Chunk c's write to `next` completed: `next` becomes its slot, its old slot a spare.
  void commit_spare(detail::Chunk& c);

  // master_source: the masters are the caller's. Per partition, the lease on its master while
  // chunks hold it (each hold is a chunk, or a state access, using it), and whether anything was
  // written into it. Touched by one thread at a time (a step's, or an overlapped pass's until it
  // is joined).
  struct MasterLease {
    float* data = nullptr;
    std::uint32_t holds = 0;
    bool wrote = false;
  };
  std::vector<MasterLease> masters;
  bool external() const noexcept { return opt.master_source != nullptr; }
  // Chunk layouts. With the masters outside, a chunk's master section sits where a whole chunk's
  // does, past any record a buffer reads (a short last chunk's would otherwise lie inside the next
  // chunk's read into the same buffer, while its updated masters wait there).
  detail::ChunkLayout layout_of(std::uint64_t stride) const {
    detail::ChunkLayout l = detail::ChunkLayout::of(stride, opt.state_dtype, external());
    if (external()) {
      const detail::ChunkLayout whole = detail::ChunkLayout::of(chunk_elems, opt.state_dtype, true);
      l.offset[static_cast<int>(detail::Section::kMaster)] = whole.offset[static_cast<int>(detail::Section::kMaster)];
      l.span = whole.span;
    }
    return l;
  }
  // One hold of partition pid's master (the first acquires it from the source).
  Result<float*> hold_master(PartitionId pid);
  // Gives one hold back (the last releases it, saying whether it was written); the release's error.
  Status let_go_master(PartitionId pid, bool wrote);
  // fn(master) on partition pid's master, held for the call (`wrote`: fn writes into it); fn's
  // error first, else the release's.
  template <class Fn>
  Status with_master(PartitionId pid, bool wrote, Fn&& fn) {
    TIER_ASSIGN_OR_RETURN(float* m, hold_master(pid));
    const Status s = fn(m);
    const Status released = let_go_master(pid, wrote);
    return s.ok() ? released : s;
  }
  // One hold of each of chunk c's partitions' masters (on an error, none).
  Status hold_masters(const detail::Chunk& c);
  // Chunk c's partitions' masters held and copied into the master section at `base` (laid out
  // with c's layout). On an error nothing stays held.
  Status fill_masters(const detail::Chunk& c, void* base);
  // After fill_masters (or hold_masters): the master section at `base` copied back into the partitions' masters
  // (`put_back`; the chunk's update is committed) or not, and the holds given back.
  Status settle_masters(const detail::Chunk& c, void* base, bool put_back);
  bool nvme() const noexcept { return opt.home == StateHome::kNvme; }
  // `finishing`: step() may finish a failed step that is owed; everything else is refused then.
  Status usable(const char* what, bool loading = false, bool finishing = false) const;
  // kFailedPrecondition while an overlapped step runs (the members that touch the state).
  Status idle(const char* what) const;
  PartitionId partition_at(const detail::Chunk& c, std::uint64_t flat) const;
  cpu::StateDType state_dtype() const noexcept { return opt.state_dtype; }
  // A section of chunk c in memory laid out like its record.
  static std::byte* section(void* base, const detail::Chunk& c, detail::Section s) {
    return static_cast<std::byte*>(base) + c.layout.offset[static_cast<int>(s)];
  }
  static float* master(void* base, const detail::Chunk& c) {
    return reinterpret_cast<float*>(section(base, c, detail::Section::kMaster));
  }
  // The state tensors of chunk elements [a, a + n) (a on a block boundary for int8): master,
  // moments in the state dtype and, for int8, their scales.
  cpu::AdamTensors state_at(void* base, const detail::Chunk& c, std::uint64_t a, std::uint64_t n) const;
  void report_resident(std::int64_t host_delta, std::int64_t nvme_delta) const;
};

}  // namespace tier::optim
