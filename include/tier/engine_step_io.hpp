// tier/engine_step_io.hpp — the optimizer step's interfaces (optim::ParamSink, optim::GradSource)
// over engine tensors: updated params written into their engine tensors, and declared gradients
// read from theirs. What tier.torch's engine steps with, for any C++ caller whose params and
// gradients are engine tensors.
//
// Both are used by the thread that runs the step (or an overlapped step's pass), one at a time,
// and must outlive it (step(), finish_overlapped_step(), cancel_overlapped_step() returning).
// The optimizer's acquires stay out of the engine's access trace: an overlapped pass interleaves
// them with backward's in an order of its own, which would drop the trace every step.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "tier/engine.hpp"
#include "tier/offloaded_optimizer.hpp"

namespace tier::step {

// Writes the updated low-precision params of each partition into its engine tensor: a host write
// lease per partition, opened at its first piece and released once every element has come. Pieces
// of a partition may come in any order and interleaved with other partitions' (an overlapped step
// walks the chunks in reverse), so a partition's lease stays open until it is complete; only
// partitions that span the chunk being walked are open at a time.
class EngineParamSink final : public optim::ParamSink {
 public:
  // tensors[i]: partition i's engine tensor (< 0: none, its pieces are dropped). `offsets` (empty:
  // all 0) places partition i at element offsets[i] of its tensor; a partition that is part of
  // its tensor (a rank's shard) is written in place (read, write back).
  EngineParamSink(Engine& engine, std::vector<std::int64_t> tensors, std::vector<std::int64_t> offsets,
                  const optim::OffloadedOptimizer& opt);
  ~EngineParamSink() override;

  Status deliver(const optim::OutputChunk& chunk) override;
  // An abandoned overlapped pass: the leases of the partitions it left half written are released
  // as they are (their memory was written, so they cannot be abandoned; the redo or the
  // re-delivery that follows writes each of them again whole), and the pieces that follow are
  // counted afresh.
  void abandoned() override;
  // Releases the leases still open (a step that failed part way); the first error.
  Status close();

 private:
  struct Open {
    Lease lease;
    std::uint64_t written = 0;
  };
  Engine& engine_;
  std::vector<std::int64_t> tensors_;
  std::vector<std::int64_t> offsets_;
  const optim::OffloadedOptimizer& opt_;
  std::unordered_map<optim::PartitionId, Open> open_;
};

// Host leases of engine tensors, one per partition, each started ahead on a hint or taken at
// once: what EngineGradSource and EngineMasterSource hold. Used by one thread at a time.
class PartitionLeases {
 public:
  PartitionLeases(Engine& engine, Access access) : engine_(engine), access_(access) {}
  ~PartitionLeases();  // cancels the hints never taken, abandons the leases still held
  // Starts acquiring `tensor` for partition `id` (nothing when one is started or held already).
  void hint(optim::PartitionId id, TensorId tensor);
  // The lease of `tensor` for partition `id`: the hint's, waited for, or acquired now; held until
  // end(id). kInternal when one is held already.
  Result<void*> take(optim::PartitionId id, TensorId tensor);
  // Ends partition `id`'s lease: released, or abandoned (a write lease whose memory was not
  // written keeps the tensor's contents). kInternal when none is held.
  Status end(optim::PartitionId id, bool abandon = false);
  // Cancels the hints never taken.
  void drop_hints();

 private:
  Engine& engine_;
  Access access_;
  std::unordered_map<optim::PartitionId, Lease> leases_;
  std::unordered_map<optim::PartitionId, AcquireFuture> ahead_;  // started by hint
};

// Declared gradients read from their engine tensors: one host read lease per partition while the
// step needs it; a prefetch hint starts the acquire, which acquire() then waits for.
class EngineGradSource final : public optim::GradSource {
 public:
  // tensors[i]: partition i's gradient tensor (< 0: none; asking for it is an error).
  // (Hinted acquires never asked for, as when the step failed, are cancelled when it goes.)
  EngineGradSource(Engine& engine, std::vector<std::int64_t> tensors);

  Result<cpu::ConstTensorRef> acquire(optim::PartitionId id) override;
  void release(optim::PartitionId id) override;
  void prefetch(optim::PartitionId id) override;

 private:
  Engine& engine_;
  std::vector<std::int64_t> tensors_;
  PartitionLeases leases_;
};

// The fp32 masters of partitions whose parameters are engine tensors (an fp32 model: the tensor
// and the master would hold the same values after every step), leased for reading and writing
// while the optimizer holds them (OffloadedOptimizerOptions::master_source). A prefetch hint
// starts the acquire, which acquire() then waits for; drop_hints() lets go of those never asked
// for. Used by one thread at a time, as the optimizer calls it.
class EngineMasterSource final : public optim::MasterSource {
 public:
  explicit EngineMasterSource(Engine& engine);

  // Partition `id`'s master is elements [offset, offset + numel) of fp32 tensor `tensor`.
  // Errors: kInvalidArgument (a tensor that is not fp32 or too short, an id bound already).
  Status bind(optim::PartitionId id, TensorId tensor, std::uint64_t offset, std::uint64_t numel);

  Result<float*> acquire(optim::PartitionId id) override;
  Status release(optim::PartitionId id, bool wrote) override;
  void prefetch(optim::PartitionId id) override;
  // Cancels the hinted acquires not asked for (after a step, which may have failed first).
  void drop_hints();

 private:
  struct Place {
    std::int64_t tensor = -1;
    std::uint64_t offset = 0;
  };
  Engine& engine_;
  std::vector<Place> places_;
  PartitionLeases leases_;
};

// Makes an optimizer serve beside `engine` (tier.torch's and the C ABI's wiring): its pipeline
// buffers are pinned memory inside the engine's host budget (Engine::reserve_host), its I/O
// registers the engine's arena, and, with the state on NVMe and `share_swap`, its chunks are
// extents of the engine's swap space with their room reserved in tier.budgets.nvme
// (Engine::reserve_nvme) when the optimizer's swap paths are the engine's (one set of files and
// I/O threads per set of paths; tier.torch takes both from one config); on other paths it keeps
// files of its own. The engine must outlive the optimizer. `share_swap` false keeps swap
// files of the optimizer's own (e.g. to inject I/O faults into the optimizer's I/O only).
void serve_beside(optim::OffloadedOptimizerOptions& options, Engine& engine, bool share_swap = true);

}  // namespace tier::step
