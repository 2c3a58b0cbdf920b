// tier/offloaded_optimizer.hpp — the offloaded optimizer step: Adam/AdamW (or Adagrad, Lion, Lamb:
// each group's cpu::OptimizerKind) over fp32 master params, exp_avg and exp_avg_sq that live on
// NVMe (or in host memory), updated on the CPU in a pipeline that reads chunk i+1, updates chunk i
// and writes chunk i-1 at once through a bounded set of pinned buffers, so that a step costs about
// as much as its slowest stream.
//
// Model:
//  - A *partition* is a contiguous run of fp32 parameters (typically one model parameter) with its
//    parameter group and the low-precision copy it wants after each step (none, fp16, bf16, fp32).
//    Partitions are packed back to back into one flat element space, cut into *chunks* of
//    `chunk_elements`; a chunk is the unit of I/O and of the pipeline, so thousands of small
//    partitions cost a few large transfers, and a large one spans several chunks.
//  - Each chunk's state (master, exp_avg, exp_avg_sq, and for int8 state the moments' block
//    scales) is stored as one record of 4 KiB-aligned sections in two swap extents (NVMe home): the *committed* slot
//    and a *shadow* slot. A step reads the committed slots and writes the shadow slots; only when every write of the
//    step has completed do the shadows become committed. A failed read or write therefore leaves
//    the previous step's state intact, reports the error, and keeps the gradients so the step can
//    be retried. (Host home updates in place: there is no I/O to fail.)
//  - Gradients arrive per partition while backward runs (add_grad), in fp32, fp16 or bf16, and are
//    accumulated in fp32 over gradient_accumulation_steps micro-steps. The sum of squares of each
//    partition's final gradient is computed as it arrives (fused into the last accumulation), so
//    step() knows the global norm and whether any gradient overflowed without re-reading them.
//  - step() applies loss-scale unscaling and clipping by global norm as one factor folded into the
//    Adam kernel, skips the update when a gradient is inf/nan (fp16 overflow; the dynamic loss
//    scale is updated), and hands the updated low-precision params to the caller in the same pass:
//    straight into a destination the caller names per partition, or piece by piece to a ParamSink.
//  - The moments are kept in the options' state_dtype (fp32, bf16 or block-int8, see
//    tier/state_codec.hpp): the compressed bytes are what NVMe and host memory hold and move, and
//    the update widens and narrows them inside the kernel. Master params are always fp32. With
//    int8 state each partition starts on a 256-element boundary of the flat element space.
//  - Checkpoints are streamed chunk by chunk to a file (write to a temporary name, fsync, rename)
//    with per-record checksums, and loaded the same way; see docs/optimizer.md for the format.
//
// Lamb: when any group is Lamb, step() first makes a read-only pass over the state for each Lamb
// partition's ||p|| and ||u|| (cpu::lamb_accumulate_norms), then the usual pass with each Lamb
// partition's trust ratio: NVMe home reads the state twice per step (see docs/design.md).
//
// Determinism: the update is element-wise (cpu::adam_update_chunk), so the result is bit-identical
// to the in-RAM CPU Adam (Lamb: cpu::lamb_update) on the same inputs for any chunk size, buffer
// count and thread count. The global norm is sqrt of the sum, in partition registration order, of
// each partition's cpu::sum_of_squares of its final fp32 gradient; the Adam grad_scale is
// double(cpu::clip_coefficient(norm, max_grad_norm)) / loss_scale.
//
// Host memory: the pinned buffers (buffer_count of them, each holding one chunk's state plus its
// low-precision staging) and small per-partition metadata, whatever the model size; plus the fp32
// gradient accumulators of partitions whose gradients are copied (4 bytes per element; borrowed
// gradients cost nothing), plus the state itself for host home.
//
// Thread safety: add_grad() may run concurrently from several threads for *different* partitions
// (two calls for the same partition must not overlap); nothing else may run concurrently with
// add_grad() or with any other member. Every other member is called by one thread at a time.
// step() runs its own I/O threads (the swap space's) and a oneTBB arena of `threads` threads; the
// StepOptions interfaces (ParamSink, GradSource, NormReducer) are called on the thread that called
// step(). Between start_overlapped_step() and finish_overlapped_step() the pass's own thread runs
// beside the caller's, which may call add_grad() and declare_grad() (and cancel_overlapped_step(),
// clear_grads()) but nothing else; the pass calls the interfaces on its own thread. The
// hyper-parameter setters and getters and stats() may also be called from another thread (a
// scheduler, a monitor) at any time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tier/config.hpp"
#include "tier/cpu_adam.hpp"
#include "tier/cpu_kernels.hpp"
#include "tier/loss_scaler.hpp"
#include "tier/norm_reducer.hpp"
#include "tier/state_codec.hpp"
#include "tier/status.hpp"
#include "tier/ext/swap_space.hpp"
#include "tier/types.hpp"

namespace tier {
class Counters;
class HostArena;
}  // namespace tier

namespace tier::optim {

using PartitionId = std::uint32_t;

// Where the fp32 master params and the Adam moments live between steps.
enum class StateHome : std::uint8_t { kNvme = 0, kHost = 1 };
const char* state_home_name(StateHome h) noexcept;  // "nvme", "host"

// The low-precision copy of a partition's params produced by each step.
enum class ParamOutput : std::uint8_t { kNone = 0, kF16 = 1, kBF16 = 2, kF32 = 3 };
const char* param_output_name(ParamOutput o) noexcept;  // "none", "fp16", "bf16", "fp32"
std::size_t param_output_size(ParamOutput o) noexcept;  // bytes per element: 0, 2, 2, 4
DType param_output_dtype(ParamOutput o) noexcept;       // kF16, kBF16 or kF32 (kF32 for none)

// One of the three fp32 arrays of a partition's state.
enum class StateKind : std::uint8_t { kMaster = 0, kExpAvg = 1, kExpAvgSq = 2 };
const char* state_kind_name(StateKind k) noexcept;  // "master", "exp_avg", "exp_avg_sq"

// How add_grad takes a gradient.
enum class GradMode : std::uint8_t {
  // Copied (or added) into the partition's fp32 accumulator; the caller's buffer is free at once.
  kCopy = 0,
  // Borrowed: no copy. The caller keeps the buffer valid and unchanged until step() (or
  // clear_grads()) returns. Only for a partition's single gradient of a step
  // (gradient_accumulation_steps == 1).
  kBorrow = 1,
};

class MasterSource;  // below: where the fp32 master params live when the optimizer does not hold them

struct OffloadedOptimizerOptions {
  StateHome home = StateHome::kNvme;

  // NVMe home: the swap space to keep the state in. It must outlive the optimizer. When null, the
  // optimizer creates its own from `swap_options` (paths, engine, request shape), sized for
  // `max_elements`.
  nvme::SwapSpace* swap = nullptr;
  nvme::SwapSpaceOptions swap_options;
  // With a given `swap` shared with its owner (an engine's, Engine::swap_space()): called once at
  // creation with the most bytes the optimizer's extents will take (both slots of every chunk of
  // `max_elements`, which must then be given), to count them in the owner's budget
  // (Engine::reserve_nvme); held as long as the optimizer. A partition past max_elements is then
  // refused, as with an own swap space. Empty: nothing is reserved.
  std::function<Result<Reservation>(std::uint64_t bytes, const std::string& name)> nvme_reserve;
  // Elements the optimizer will hold at most (the sum of the partitions' numel). Needed when the
  // optimizer creates the swap space (it sizes the files: two slots of a record per chunk, 24
  // bytes per element with fp32 state); also caps chunk_elements for small models. 0: unknown.
  std::uint64_t max_elements = 0;
  // int8 state: the most partitions that will be registered, to size the swap space for their
  // 256-element alignment (up to 255 elements of gap each); 0: unknown (a slack of 1/16 of
  // max_elements is reserved instead).
  std::uint64_t max_partitions = 0;

  // Pinned buffers come from this arena (it must outlive the optimizer and have room for them);
  // null: the optimizer maps its own arena of exactly the buffers' size.
  HostArena* arena = nullptr;
  // When set, the pinned buffers come from here instead, one call per buffer (bytes, a name):
  // e.g. Engine::reserve_host of the engine the optimizer serves, so that they count against
  // tier.budgets.host. Regions must be pinned and 4 KiB aligned (O_DIRECT sources); `arena` then
  // only names the arena they lie in, for the swap space's fixed buffers (may be null). The
  // source, not the optimizer, reports them as resident.
  std::function<Result<PinnedRegion>(std::uint64_t bytes, const std::string& name)> pinned_source;
  // (optional) The fp32 master params are the caller's, not the optimizer's: e.g. an fp32 model
  // whose parameters live in engine tensors, which would otherwise hold the same values as the
  // master after every step (4 bytes per element more on disk, written twice per step). Each
  // chunk record then holds the moments only; the step reads a partition's master from the source
  // before updating its first chunk, and writes each chunk's updated values back into it once that
  // chunk's record is committed (a copy in memory), so a step that fails part-way still leaves
  // every chunk whole, before or after the step. read_state / write_state of kMaster, read_params
  // and checkpoints (whose format is unchanged) go through the source too. Partitions deliver no
  // params (the update is their params): their output must be kNone or kF32, and
  // PartitionSpec::initial null. Needs the NVMe home with state_copies 1 and no speculation_chunks
  // (an overlapped pass's updated masters wait in the pipeline buffers until the step commits);
  // not with Lamb. Must outlive the optimizer.
  MasterSource* master_source = nullptr;
  // NVMe home: how many copies of the state the swap space keeps (tier.optimizer.state_copies).
  //  2: every chunk has a committed slot and a shadow slot; a step writes the shadows and switches
  //     over only when every chunk is written, so a failed step leaves the previous state whole
  //     (24 bytes per element with fp32 state).
  //  1: every chunk has one slot, plus a pool of spare slots (buffer_count + speculation_chunks
  //     chunks, whatever the model size). A chunk's update is written to a spare, which becomes
  //     the chunk's slot once the write completed (its old slot joins the pool): each chunk is
  //     always whole, either before or after the step. A step that fails after some chunks were
  //     written is finished, not undone: the gradients, the step's constants and its norm are
  //     kept, everything but step() (and load_checkpoint) is refused until then, and the next
  //     step() updates only the chunks left, to the result the step would have had.
  // The struct's default is 2 (nothing changes for code built against it); from_config gives the
  // configuration's tier.optimizer.state_copies, whose default is 1.
  unsigned state_copies = 2;
  // state_copies 1: spare slots beyond buffer_count, for an overlapped pass: it holds a spare for
  // every chunk it updated before the gradient norm is known (each is given back when
  // finish_overlapped_step commits or drops the pass), so it runs ahead by up to buffer_count +
  // speculation_chunks chunks; then it stops and finish_overlapped_step updates the rest. Each
  // costs one chunk of disk.
  unsigned speculation_chunks = 0;
  // Chunk buffers of the pipeline (offload_optimizer.buffer_count): 3 or more let reads, updates
  // and writes overlap fully; 1 and 2 work but serialize. Host home uses one (output staging).
  unsigned buffer_count = 4;
  // Pinned bytes for all buffers together; chunk_elements is derived from it when 0. 0: 256 MiB.
  // Each buffer holds 12 bytes of state and up to 4 bytes of low-precision staging per element.
  std::uint64_t buffer_bytes = 0;
  // Elements per chunk, a multiple of 1024; 0: buffer_bytes / buffer_count / 16 and, when
  // max_elements is given, at most max_elements / 64 (but not below 256 Ki elements) so that
  // filling and draining the pipeline stay a small part of a step.
  std::uint64_t chunk_elements = 0;

  // The format of exp_avg and exp_avg_sq (tier.optimizer.state_dtype). bf16 halves the moments'
  // bytes, int8 quarters them (2.03 bytes per element for both, scales included); not with Lamb,
  // whose norms pass reads fp32 moments.
  cpu::StateDType state_dtype = cpu::StateDType::kF32;
  // Parameter groups (at least one): hyper-parameters per group; add more with add_group().
  std::vector<cpu::AdamHyperParams> groups{cpu::AdamHyperParams{}};
  // Clip the global gradient norm to this (gradient_clipping); 0: off.
  double max_grad_norm = 0;
  LossScaleOptions loss_scale;
  // Micro-steps whose gradients are summed per step (gradient_accumulation_steps). Like DeepSpeed,
  // the optimizer sums; the training loop divides the loss by this number.
  int gradient_accumulation_steps = 1;
  // Skip the update (and report it) when any gradient is inf/nan, also without fp16: a non-finite
  // gradient would turn the whole state to NaN. With fp16 loss scaling, overflow always skips.
  bool skip_non_finite = true;
  // Threads for the update and for large gradient intakes (tier.optimizer_threads); 0: all cores.
  int threads = 0;
  // nvme<->host link counters (through the swap space it creates), resident bytes, and "optim.*"
  // metrics after each step; may be null. Must outlive the optimizer.
  Counters* counters = nullptr;

  // The options an EngineConfig asks for: home from zero_optimization.offload_optimizer.device
  // (nvme -> kNvme, else kHost), swap options from the aio/tier.io sections and swap paths
  // (sized for max_elements), buffer_count, tier.optimizer.buffer_bytes and chunk_elements
  // (capped by zero_optimization.sub_group_size), the optimizer section as group 0,
  // gradient_clipping, fp16 loss scaling, gradient_accumulation_steps and tier.optimizer_threads.
  static Result<OffloadedOptimizerOptions> from_config(const EngineConfig& config, std::uint64_t max_elements = 0,
                                                       Counters* counters = nullptr);
};

struct PartitionSpec {
  std::uint64_t numel = 0;
  int group = 0;
  ParamOutput output = ParamOutput::kNone;
  // Initial fp32 master values (numel of them), copied during add_partition; null: zeros.
  const float* initial = nullptr;
  std::string name;  // optional; used in messages and checked by load_checkpoint when set
};

// A piece of a partition's updated low-precision params, handed to ParamSink::deliver.
struct OutputChunk {
  PartitionId partition = 0;
  std::uint64_t offset = 0;  // elements from the start of the partition
  std::uint64_t numel = 0;
  ParamOutput dtype = ParamOutput::kNone;
  // Pinned staging memory (the pinned arena: a valid source for NVMe writes and device copies).
  // Valid during the call, and for as long as the transfers the sink adds to `pending`.
  const void* data = nullptr;
  // Asynchronous transfers that read `data` (e.g. a swap-space write of the params to their NVMe
  // home) may be added here: the optimizer leaves the staging untouched until they complete,
  // waits for all of them before step() returns and reports their errors like the sink's.
  std::vector<nvme::IoFuture>* pending = nullptr;
};

// The three things a step talks to besides its own state, as named interfaces (StepOptions holds
// pointers to them; each is optional). They are called on the thread that called step(), or for
// an overlapped step on the pass's own thread; the caller keeps them alive until step() (or
// finish_overlapped_step(), cancel_overlapped_step(), clear_grads()) returns.

// Where the updated params of partitions without a destination go, piece by piece in chunk order
// (e.g. copied to the device, or into engine tensors).
class ParamSink {
 public:
  virtual ~ParamSink() = default;
  // One piece. The first error stops further calls; the state update still completes and is
  // committed, and step() returns that error (the message says the step was applied);
  // read_params() gives the values.
  virtual Status deliver(const OutputChunk& chunk) = 0;
  // Overlapped steps only: the pass was abandoned (redone, skipped or cancelled) after it may
  // have delivered pieces, before the redo or the re-delivery starts over. A sink that gathers
  // each partition's pieces until it has them all drops what it gathered from the pass (a
  // partition left half written is written again whole by the redo, or by the re-delivery when
  // the pass had touched it).
  virtual void abandoned() {}
};

// The gradients of partitions declared with declare_grad (the caller holds them, e.g. in engine
// tensors).
class GradSource {
 public:
  virtual ~GradSource() = default;
  // The gradient of a declared partition: numel elements of fp32, fp16 or bf16, valid and
  // unchanged until release(id). Asked before the partition's first chunk is updated. An error
  // fails the step as an I/O error does: with the NVMe home the state is intact and the gradients
  // are kept; with the host home (updated in place) an error after the first chunk leaves the
  // state invalid until a checkpoint is loaded.
  virtual Result<cpu::ConstTensorRef> acquire(PartitionId id) = 0;
  // The gradient is no longer needed (after the partition's last chunk, or when the step fails);
  // once per acquire.
  virtual void release(PartitionId id) { (void)id; }
  // A hint: acquire(id) will come soon, after the chunk being updated (a serial step names the
  // declared partitions of the next chunk in its walk as it fetches the current one's), so the
  // source may start bringing the gradient in. At most once per partition and step; a hinted
  // partition may still not be asked for (the step fails first), so whatever the hint started
  // must be let go when the step returns.
  virtual void prefetch(PartitionId id) { (void)id; }
};

// The fp32 master params of the partitions, held by the caller (OffloadedOptimizerOptions::
// master_source). Called on the thread that calls into the optimizer, or an overlapped step's pass
// thread (one at a time). The optimizer pairs every acquire with one release and holds at most one
// lease per partition at a time.
class MasterSource {
 public:
  virtual ~MasterSource() = default;
  // Partition id's master: numel floats, readable and writable, valid until release(id). An
  // error fails what asked for it (a step fails as on an I/O error: every chunk stays whole).
  virtual Result<float*> acquire(PartitionId id) = 0;
  // Done with it; `wrote`: values were written into it (the source keeps them, e.g. writes its
  // tensor home). Once per acquire.
  virtual Status release(PartitionId id, bool wrote) = 0;
  // A hint: acquire(id) will come soon (a serial step names the next chunk's partitions while it
  // updates the current one). Whatever it starts must be let go if acquire never comes.
  virtual void prefetch(PartitionId id) { (void)id; }
};

// NormReducer (tier/norm_reducer.hpp): the gradient norm across data-parallel ranks.

struct StepOptions {
  // (optional) Where each partition's updated low-precision params go: empty, or one pointer per
  // partition (null: none, the sink gets it), each to numel elements of its output dtype, written
  // by the update itself (no extra pass), e.g. host memory that is the params' home. The memory
  // (and this array) must stay valid and untouched by others until the step returns.
  std::span<void* const> destinations;
  // (optional) Receives the updated params of partitions without a destination.
  ParamSink* sink = nullptr;
  // (required when a gradient was declared with declare_grad) Where declared gradients come from.
  GradSource* grads = nullptr;
  // (optional) The gradient norm across ranks.
  NormReducer* norm = nullptr;
  // Partitions that got no gradient this step keep their state and params untouched, as
  // torch.optim skips a parameter whose .grad is None (no decay, no momentum step; nothing is
  // written to their destination or handed to the sink). Off: they are updated with zeros (as
  // DeepSpeed does). Either way the group's step counter, which bias correction uses, advances.
  bool skip_missing_grads = false;
  // Overlapped steps only: whether params that an abandoned speculative pass had written (to a
  // destination or through the sink) are delivered again from the committed masters when the
  // pass is cancelled or its step skipped for an overflow. Keep it on when the outputs land where
  // the training reads its params; turn it off when they land in the caller's private staging,
  // which it discards with the pass (it saves reading those masters back from the home).
  bool redeliver_abandoned_outputs = true;

  void* destination(PartitionId id) const noexcept { return id < destinations.size() ? destinations[id] : nullptr; }
};

// One stream of the pipeline.
struct StreamReport {
  std::uint64_t bytes = 0;
  std::uint64_t transfers = 0;
  double busy_seconds = 0;  // wall time with at least one transfer in flight (update: computing)
};

struct StepReport {
  std::int64_t step = 0;        // group 0's step counter afterwards
  bool applied = false;         // false: skipped (non-finite gradient)
  bool overflow = false;        // some gradient was inf/nan
  double grad_norm = 0;         // global L2 norm of the unscaled gradient (inf/nan on overflow)
  double clip_coefficient = 1;  // factor applied for clipping (1: none)
  double loss_scale = 1;        // the scale the gradients carried
  double next_loss_scale = 1;
  double seconds = 0;  // wall time of step()
  StreamReport read, update, write;
  double io_busy_seconds = 0;      // wall time with any transfer (read or write) in flight
  double update_wait_seconds = 0;  // time the updater waited for a chunk to arrive
  double output_seconds = 0;       // time spent in ParamSink::deliver
  unsigned max_transfers_in_flight = 0;
  std::uint64_t chunks = 0;
  std::uint64_t late_norm_partitions = 0;  // accumulated grads whose norm was computed at step()
  std::uint64_t zero_grad_partitions = 0;  // partitions that got no gradient (updated with zeros)
  // Overlapped steps (start_overlapped_step): whether this step was one, the chunks its
  // speculative pass updated before the gradients were all in (of `chunks`), whether the
  // speculation was discarded and the step redone serially (clipping, an overflow or an error),
  // and why.
  bool overlapped = false;
  std::uint64_t speculated_chunks = 0;
  bool redone = false;
  std::string redo_reason;
  // A redone step: the chunks whose committed records the abandoned pass had already read into
  // the pipeline's buffers (it stops when clipping becomes certain), used by the redo as they
  // were instead of being read again.
  std::uint64_t reused_chunks = 0;
  // state_copies 1: the chunks this call updated (a step finished after a failure updates only
  // those left; an overlapped step counts its pass's and the rest's), and the chunks whose
  // outputs it delivered again from the state without updating them (a finished step re-delivers
  // the partitions the failed try left half delivered).
  std::uint64_t updated_chunks = 0;
  std::uint64_t redelivered_chunks = 0;
  // The step finished one that had failed part-way (state_copies 1).
  bool finished_failed = false;
};

// Bytes and timings of a diagnostic pass (measure_io_seconds / measure_update_seconds).
struct PassReport {
  double seconds = 0;
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::uint64_t elements = 0;
};

struct OptimizerStats {
  StateHome home = StateHome::kNvme;
  std::uint64_t partitions = 0;
  std::uint64_t elements = 0;  // the partitions' elements
  cpu::StateDType state_dtype = cpu::StateDType::kF32;
  // Bytes of one copy of every chunk record (what a step reads from NVMe and writes back): 12 per
  // element for fp32 state, 8 for bf16, about 6 for int8, plus page rounding.
  std::uint64_t record_bytes = 0;
  std::uint64_t chunks = 0;
  std::uint64_t chunk_elements = 0;
  unsigned buffer_count = 0;
  std::uint64_t pinned_bytes = 0;       // the pipeline's buffers
  std::uint64_t accumulator_bytes = 0;  // fp32 gradient accumulators
  std::uint64_t host_state_bytes = 0;   // host home: the state
  std::uint64_t nvme_bytes = 0;         // NVMe home: every slot of every chunk and the spares
  // NVMe home: the copies of the state kept (options.state_copies), the spare slots (state_copies
  // 1), and whether a step that failed part-way is owed (step() finishes it).
  unsigned state_copies = 2;
  std::uint64_t spare_slots = 0;
  std::uint64_t spare_bytes = 0;  // of nvme_bytes: the spares' (a whole chunk's record each)
  bool failed_step_owed = false;
  // NVMe home with swap files of its own: their capacity (what its chunks will take once every
  // partition is added; the files grow to it) and what they reserve on disk now. In a shared swap
  // space with a reservation (options.nvme_reserve): the bytes reserved, and 0 allocated (the
  // shared files report theirs).
  std::uint64_t nvme_capacity_bytes = 0;
  // NVMe home: whether the extents are in a swap space the optimizer shares (options.swap).
  bool shared_swap = false;
  std::uint64_t nvme_allocated_bytes = 0;
  // Of the host memory its swap files' I/O reads and writes (the engine's arena when it serves an
  // engine), the bytes registered with io_uring as fixed buffers (a shared swap space's figure).
  std::uint64_t io_registered_bytes = 0;
  std::int64_t step = 0;  // group 0's step counter
  std::uint64_t steps_skipped = 0;
  std::uint64_t steps_failed = 0;
  // Steps whose update was committed, since creation (an overlapped pass in flight moves `step`
  // ahead speculatively; this moves only when a step is applied).
  std::uint64_t steps_applied = 0;
};

class OffloadedOptimizer {
 public:
  // Validates the options, maps the buffers and, for NVMe home without a given swap space, creates
  // one. Errors: kInvalidArgument for bad options; those of HostArena/SwapSpace creation.
  static Result<std::unique_ptr<OffloadedOptimizer>> create(const OffloadedOptimizerOptions& options);
  ~OffloadedOptimizer();
  OffloadedOptimizer(const OffloadedOptimizer&) = delete;
  OffloadedOptimizer& operator=(const OffloadedOptimizer&) = delete;

  // ------------------------------------------------------------------ registration
  // Appends a partition; its initial state (master from spec.initial, zero moments) is written to
  // its chunk as chunks fill. Returns its id (0, 1, 2, ... in order). Errors: kInvalidArgument for
  // numel 0 or an unknown group; kFailedPrecondition after finish_registration(); the I/O error of
  // a chunk write (the optimizer is then unusable: create a new one).
  Result<PartitionId> add_partition(const PartitionSpec& spec);
  // Writes the last chunk and waits for every write; required once before gradients, steps,
  // checkpoints and state reads.
  Status finish_registration();
  // Adds a parameter group (before or after registration); returns its index.
  Result<int> add_group(const cpu::AdamHyperParams& hp);

  // ------------------------------------------------------------------ gradients
  // Takes one micro-step's gradient of partition `id` (grad.numel == the partition's numel; fp32,
  // fp16 or bf16). The gradient_accumulation_steps-th call of a step is the final one: it adds and
  // computes the partition's sum of squares in one pass. See the thread-safety note above.
  // Errors: kInvalidArgument (unknown id, wrong length/dtype, kBorrow with accumulation);
  // kFailedPrecondition (more calls than accumulation steps: call step() or clear_grads()).
  Status add_grad(PartitionId id, cpu::ConstTensorRef grad, GradMode mode = GradMode::kCopy);
  // Declares that partition `id` has its final gradient of this step, kept by the caller (e.g. in
  // an engine tensor homed on NVMe, so that host memory does not grow with the model), and that
  // its sum of squares is `sumsq` (of the values as they will be given, loss scale included).
  // step() asks for it through StepOptions::grads (GradSource::acquire) when it reaches the partition's chunks,
  // in partition order, and hands it back through grad_done after its last chunk. Errors:
  // kInvalidArgument (unknown id, negative sumsq; inf or nan mark an overflow, as a non-finite
  // gradient given to add_grad does);
  // kFailedPrecondition (the partition already has a gradient this step).
  Status declare_grad(PartitionId id, double sumsq);
  // Forgets every gradient taken since the last step (and borrowed buffers).
  void clear_grads() noexcept;
  // Partitions that have at least one gradient this step.
  std::uint64_t partitions_with_grads() const noexcept;

  // ------------------------------------------------------------------ the step
  // One optimizer step over every partition (see the header comment). On success the gradients are
  // consumed. Errors: kFailedPrecondition before finish_registration(); the I/O error of a failed
  // read or write, with the previous state intact and the gradients kept (call step() again, or
  // clear_grads()); a ParamSink error (the step was applied, see StepOptions).
  Result<StepReport> step(const StepOptions& options = {});

  // ------------------------------------------------------------------ the step overlapped with backward
  // (tier.optimizer.overlap = "exact"; NVMe home.) Starts this accumulation boundary's step before
  // its gradients are in: a thread walks the chunks in reverse registration order (the order in
  // which backward finishes gradients) and updates each as soon as every partition in it has its
  // final gradient (the last micro-step's add_grad, or declare_grad), speculating that the step
  // is neither clipped nor skipped: the gradients are unscaled by the loss scale only. Everything
  // goes to the shadow slots; nothing is committed. Gradients keep arriving through add_grad /
  // declare_grad (from any one thread; see the thread-safety note) while it runs; `options` are
  // used as step() would use them, their interfaces called on the pass's thread. The pass stops early
  // once the gradients so far make clipping certain (their norm alone exceeds max_grad_norm) or
  // show an overflow. Errors: kFailedPrecondition (host home, which updates in place and could
  // not redo; Lamb; an overlapped step already running; before finish_registration()).
  Status start_overlapped_step(const StepOptions& options);
  // Every gradient of the step is in: computes the global norm exactly as step() does and
  // validates the speculation. When the step is not clipped and no gradient overflowed, the
  // pass finishes the remaining chunks and the step commits: the result is bit for bit step()'s.
  // Otherwise the speculative shadows are dropped and step() runs with the same options (the
  // clipped update, or the skip of an overflow, after which the params the pass had delivered
  // are delivered again from the committed masters). StepReport::overlapped, speculated_chunks,
  // redone and redo_reason say which. Errors: step()'s; kFailedPrecondition without a start.
  Result<StepReport> finish_overlapped_step();
  // Drops an overlapped step in flight (its thread is stopped and joined, nothing is committed,
  // the step counters are restored); the gradients are kept. No-op without one. Also done by
  // clear_grads() and the destructor.
  void cancel_overlapped_step() noexcept;
  bool overlapped_step_running() const noexcept;
  // Whether params delivered by a step (through the ParamSink or a destination) may be
  // ahead of the committed state: a failed step (NVMe home) puts back the params it had delivered,
  // and this is set only when that failed too, or when an applied step's outputs failed. Cleared
  // by the next step that delivers every output; meanwhile read_params() has the committed ones.
  bool outputs_stale() const noexcept;
  // state_copies 1: a step failed after some chunks took their update and is owed; step()
  // finishes it, everything else but load_checkpoint (and stats, the hyper-parameters) is
  // refused, and clear_grads() keeps the gradients it needs.
  bool failed_step_owed() const noexcept;
  // OptimizerStats::steps_applied, without the rest of stats()' walk over the chunks.
  std::uint64_t steps_applied() const noexcept;
  // The caller has rewritten every partition's params from read_params(): outputs_stale() is false.
  void outputs_rewritten() noexcept;
  // Chunks the running overlapped pass has taken up so far (0 without one).
  std::uint64_t overlapped_chunks_taken() const;

  // ------------------------------------------------------------------ hyper-parameters
  std::size_t group_count() const noexcept;
  Result<cpu::AdamHyperParams> hyper_params(int group) const;
  Status set_hyper_params(int group, const cpu::AdamHyperParams& hp);
  // The learning rate of the next step (for schedulers).
  Status set_lr(int group, double lr);
  // Steps applied so far in a group (0 before the first).
  Result<std::int64_t> group_step(int group) const;
  // Sets a group's step counter (e.g. importing a state dict made elsewhere); the next step is
  // step + 1. Errors: unknown group, a negative step.
  Status set_group_step(int group, std::int64_t step);
  const LossScaler& loss_scaler() const noexcept;
  double loss_scale() const noexcept;  // multiply the loss by this before backward

  // ------------------------------------------------------------------ state access
  // Copies `count` elements of one of a partition's state arrays, from element `offset`, into
  // `dst` (the committed state). Errors: unknown id, a range past the partition, the read's I/O
  // error.
  Status read_state(PartitionId id, StateKind kind, float* dst, std::uint64_t offset, std::uint64_t count);
  // Overwrites part of a state array (e.g. importing a state dict); atomic per chunk: a failed
  // write leaves that chunk as it was.
  Status write_state(PartitionId id, StateKind kind, const float* src, std::uint64_t offset, std::uint64_t count);
  // The master params of a partition converted to `dtype` (fp32, fp16 or bf16) into dst (numel
  // elements): what a step would deliver, e.g. to resynchronise the model's params.
  Status read_params(PartitionId id, DType dtype, void* dst);

  // ------------------------------------------------------------------ checkpoints
  // Streams the committed state, group hyper-parameters and step counters and the loss-scale
  // state to `path` through the pipeline buffers: written to a fresh, unpredictably named file
  // beside it (O_CREAT|O_EXCL|O_NOFOLLOW: nothing planted in the folder is written through),
  // fsync'd and renamed, so `path` is either the previous file or the complete new one. Takes no
  // lock: one writer per path is the caller's to ensure (tier.torch's checkpoints lock their
  // folder). Errors: a path holding a NUL byte, the file's or the swap space's I/O error (the
  // optimizer's state is unaffected).
  Status save_checkpoint(const std::string& path);
  // Loads a checkpoint made by save_checkpoint for the same partitions (count, sizes, groups and,
  // where both have one, names). Every record's checksum and the trailer's chain over the header
  // and the records are verified, and every value of the metadata is range-checked (a crafted
  // file with valid checksums is refused too); truncation, corruption and out-of-range values
  // are kDataLoss and leave the current state as it was (NVMe home: the data goes to the shadow
  // slots, switched over at the end; host home: verified in a first pass before anything is
  // overwritten). Restores hyper-parameters, step counters and the loss scale. Gradients taken
  // so far are dropped. (read_checkpoint_masters, below the class, reads the master params of
  // such a file without an optimizer.)
  // `before_commit`, when given, is called once the whole file has verified and before anything
  // changes (nothing is overwritten before it is called); a non-OK return leaves the state as it
  // was and is returned. Callers that load several files as one (the ranks of a partitioned
  // checkpoint) agree there that every file verified before any of them is applied.
  Status load_checkpoint(const std::string& path, const std::function<Status()>& before_commit = {});

  // ------------------------------------------------------------------ diagnostics
  // The I/O of one step without the update: reads every chunk's committed slot and writes it to
  // the shadow slot through the same buffers, swap space and pipeline depth (a mixed read/write
  // pass at the step's 1:1 ratio). Each written 512-byte sector is stamped first, so that the
  // disk sees new data as in a step (no deduplication of bytes it already holds). The committed
  // state is unchanged. NVMe home only.
  Result<PassReport> measure_io_seconds();
  // The update of one step without I/O: runs the update kernel (Lamb: its second pass only, with a
  // trust ratio of 1) over every chunk's partitions, with their current gradients (zeros where
  // there are none) and outputs, with `threads` threads, on scratch memory in RAM (sane values;
  // 256 MiB of it, or less for a smaller state, so that it streams from memory like the step). The
  // state, the gradients and the step counters are unchanged; outputs go to the scratch, not to
  // destinations.
  Result<PassReport> measure_update_seconds();

  OptimizerStats stats() const;
  const OffloadedOptimizerOptions& options() const noexcept;
  std::uint64_t partition_count() const noexcept;
  // The numel of a partition (0 for an unknown id).
  std::uint64_t partition_numel(PartitionId id) const noexcept;
  // The low-precision output of a partition (kNone for an unknown id).
  ParamOutput partition_output(PartitionId id) const noexcept;

  // The implementation's state (opaque; defined in src/optim).
  struct Impl;

 private:
  explicit OffloadedOptimizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ------------------------------------------------------------------ reading a checkpoint alone
// What offline tools (tier.torch.zero_to_fp32) need from a file save_checkpoint wrote, without an
// optimizer of the same partitions. Free functions: they only read the file, so they may run
// from any thread, beside anything (a save renames its file into place whole).

// A partition as a checkpoint file records it (its metadata's "partitions", in id order).
struct CheckpointPartition {
  PartitionId id = 0;
  std::uint64_t numel = 0;
  int group = 0;
  std::string name;  // as registered; may be empty
};

struct CheckpointInfo {
  std::uint32_t version = 0;  // of the file format
  cpu::StateDType state_dtype = cpu::StateDType::kF32;
  std::uint64_t elements = 0;  // the sum of the partitions' numel
  std::vector<CheckpointPartition> partitions;
};

// The partitions and format of the checkpoint at `path`, from its header and metadata only: both
// checksums and every value of the metadata are checked as load_checkpoint checks them (kDataLoss
// when one fails), the records are not read (read_checkpoint_masters checks them).
Result<CheckpointInfo> read_checkpoint_info(const std::string& path);

// Called with consecutive pieces of each partition's fp32 master params, partition by partition
// in id order, each from element `offset` of `part`; `values` (count of them) is valid during the
// call only. A non-OK return stops the read and is returned.
using CheckpointMasterVisitor = std::function<Status(const CheckpointPartition& part, std::uint64_t offset,
                                                     const float* values, std::uint64_t count)>;

// Called with consecutive pieces of one of a partition's state arrays as fp32 (the moments decoded
// from the file's state dtype), in the file's order: per record, its master piece, then its
// exp_avg, then its exp_avg_sq. `values` is valid during the call only; a non-OK return stops the
// read and is returned.
using CheckpointStateVisitor = std::function<Status(const CheckpointPartition& part, StateKind kind,
                                                    std::uint64_t offset, const float* values, std::uint64_t count)>;

// read_checkpoint_masters with the moments too: every state array of the checkpoint at `path` to
// `visit`, with the same checks and the same memory bound (a few MiB).
Status read_checkpoint_state(const std::string& path, const CheckpointStateVisitor& visit);

// Streams the master params of the checkpoint at `path` to `visit`, verifying what
// load_checkpoint verifies: the header's and the metadata's checksums, every value of the
// metadata, each record's place (the next piece of the next partition), size and section
// checksums, and the trailer's counts and chained checksum; every partition must be covered
// exactly. Truncation, corruption and out-of-range values are kDataLoss. Values are handed over
// before their record's checksums (and the trailer) are checked: only an OK return vouches for
// what `visit` was given, so a caller keeps nothing of a failed read. Memory: one bounded buffer
// (a few MiB) and the record's int8 scales, whatever the file's size.
Status read_checkpoint_masters(const std::string& path, const CheckpointMasterVisitor& visit);

}  // namespace tier::optim
