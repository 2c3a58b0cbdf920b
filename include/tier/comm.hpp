// tier/comm.hpp — collectives across data-parallel ranks: the Communicator interface, the shard
// layout every rank agrees on (ShardMap), and the two implementations tier ships: NCCL (on GPUs,
// built when NCCL is found) and a table of callbacks through which a host framework (e.g.
// torch.distributed, MPI, Gloo) supplies its own collectives.
//
// Partition layout (the same as tier.torch's, so a C++ rank and a Python rank agree): a flat
// tensor of n elements is split over W ranks in shards of ceil(n / W) elements; rank r owns
// elements [r * shard, min(n, (r + 1) * shard)), which is empty for the last ranks when n is
// small. Reduce-scatter and all-gather run on buffers padded to W * shard elements.
//
// Gradient norm across ranks: CommunicatorNorm(comm) is the optim::NormReducer that
// optim::StepOptions::norm takes (an all-reduce sum of one fp64), so clipping uses the global norm
// and an inf/nan on any rank makes every rank skip the step.
//
// Errors: every collective returns a Status. Where the engine can tell (NCCL), a peer that failed
// or did not join within the communicator's timeout comes back as kTimedOut / kDeviceError, and
// the communicator is aborted: later calls fail with kFailedPrecondition (make a new one). A
// collective is a rendezvous: when a rank does not call it (it failed before), the others wait
// for it up to that timeout.
//
// Thread safety: a Communicator is used by one thread at a time, and every rank calls the same
// collectives in the same order with the same counts and dtypes (as with NCCL and MPI). Different
// communicators may be used from different threads at once.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "tier/norm_reducer.hpp"
#include "tier/status.hpp"
#include "tier/types.hpp"

namespace tier {

// ---------------------------------------------------------------------------------------------
// The shard layout

// Where one flat tensor's elements go over `world` ranks. A value; cheap to copy.
class ShardMap {
 public:
  // numel may be 0 (every shard is then empty); world must be at least 1.
  static Result<ShardMap> create(std::uint64_t numel, int world);

  std::uint64_t numel() const noexcept { return numel_; }
  int world() const noexcept { return world_; }
  // ceil(numel / world): the elements each rank's padded shard has.
  std::uint64_t shard_size() const noexcept { return shard_; }
  // world * shard_size(): the length of a reduce-scatter input or an all-gather output.
  std::uint64_t padded_numel() const noexcept { return shard_ * static_cast<std::uint64_t>(world_); }
  // The first element rank r owns (clamped to numel for ranks that own nothing).
  std::uint64_t offset(int rank) const noexcept;
  // The elements rank r owns: shard_size() but fewer (possibly 0) for the last ranks.
  std::uint64_t count(int rank) const noexcept;
  // The rank that owns element i (i < numel).
  int owner(std::uint64_t i) const noexcept;

 private:
  ShardMap(std::uint64_t numel, int world, std::uint64_t shard) noexcept
      : numel_(numel), world_(world), shard_(shard) {}
  std::uint64_t numel_ = 0;
  int world_ = 1;
  std::uint64_t shard_ = 0;
};

// ---------------------------------------------------------------------------------------------
// The interface

enum class ReduceOp : std::uint8_t { kSum = 0, kMax = 1, kMin = 2 };
const char* reduce_op_name(ReduceOp op) noexcept;  // "sum", "max", "min"

// Which memory a communicator's collectives take (bits).
enum CommMemory : std::uint32_t {
  kCommHostMemory = 1u << 0,    // pointers to host memory (pageable or pinned)
  kCommDeviceMemory = 1u << 1,  // pointers to memory on the communicator's CUDA device
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const noexcept = 0;
  virtual int world() const noexcept = 0;
  // CommMemory bits: the memory its collectives accept.
  virtual std::uint32_t memory() const noexcept = 0;
  // "nccl", "callbacks", ...
  virtual const char* name() const noexcept = 0;

  // In place: buf (count elements of dtype) becomes the reduction of every rank's buf.
  virtual Status all_reduce(void* buf, std::uint64_t count, DType dtype, ReduceOp op) = 0;
  // in: world * count elements; out: count elements, the reduction over ranks of this rank's
  // block of in (elements [rank * count, (rank + 1) * count)). in and out must not overlap.
  virtual Status reduce_scatter(const void* in, void* out, std::uint64_t count, DType dtype, ReduceOp op) = 0;
  // in: count elements; out: world * count elements, rank r's in at block r. in may be out's own
  // block (in == out + rank * count * dtype size: in place).
  virtual Status all_gather(const void* in, void* out, std::uint64_t count, DType dtype) = 0;
  // buf (count elements) becomes root's buf on every rank.
  virtual Status broadcast(void* buf, std::uint64_t count, DType dtype, int root) = 0;
  // Returns once every rank has entered it.
  virtual Status barrier() = 0;
};

// The gradient norm across the ranks of `comm` (optim::StepOptions::norm): sums `sumsq` over
// every rank (an fp64 all-reduce, host memory; the NCCL communicator stages it through the
// device). `comm` must outlive it.
class CommunicatorNorm final : public optim::NormReducer {
 public:
  explicit CommunicatorNorm(Communicator& comm) : comm_(comm) {}
  Status all_reduce_sumsq(double& sumsq) override;

 private:
  Communicator& comm_;
};

// ---------------------------------------------------------------------------------------------
// A host framework's collectives, as std::function members (the C ABI's tier_comm_callbacks_t
// becomes one of these). Each returns a Status (ok, or the framework's error); the communicator
// passes it through with the collective named in front.
struct CommCallbacks {
  int rank = 0;
  int world = 1;
  std::uint32_t memory = kCommHostMemory;  // the memory the framework's collectives take
  std::string name = "callbacks";
  std::function<Status(void* buf, std::uint64_t count, DType dtype, ReduceOp op)> all_reduce;  // required
  // (optional) — defaults to an all_reduce of a world * count copy of `in` (host memory only),
  // keeping this rank's block.
  std::function<Status(const void* in, void* out, std::uint64_t count, DType dtype, ReduceOp op)> reduce_scatter;
  // (optional) — defaults to a sum all_reduce of a zeroed world * count buffer holding `in` at
  // this rank's block (host memory only).
  std::function<Status(const void* in, void* out, std::uint64_t count, DType dtype)> all_gather;
  // (optional) — defaults to a sum all_reduce where every rank but root contributes zeros (host
  // memory only).
  std::function<Status(void* buf, std::uint64_t count, DType dtype, int root)> broadcast;
  // (optional) — defaults to an all_reduce of one int32.
  std::function<Status()> barrier;
  // (optional) Called once when the communicator is destroyed (not when make_callback_communicator
  // fails).
  std::function<void()> on_destroy;
};

// A communicator over `callbacks`. Errors: kInvalidArgument (world < 1, rank outside [0, world),
// no all_reduce, no memory bits).
Result<std::unique_ptr<Communicator>> make_callback_communicator(CommCallbacks callbacks);

// ---------------------------------------------------------------------------------------------
// NCCL

// ncclUniqueId's bytes (NCCL_UNIQUE_ID_BYTES): made by one rank, sent to the others by any means
// (the launcher's store, a file, MPI_Bcast), then given to make_nccl_communicator on every rank.
struct NcclUniqueId {
  std::array<std::uint8_t, 128> bytes{};
};

struct NcclOptions {
  NcclUniqueId id;
  int rank = 0;
  int world = 1;
  int device = 0;  // the CUDA device of this rank
  // (optional) The cudaStream_t the collectives run on; null: the communicator creates its own
  // (non-blocking) stream. A given stream must outlive the communicator.
  void* stream = nullptr;
  // How long creation and each collective may take before the communicator is aborted and the
  // call fails with kTimedOut (a peer died, hangs, or never joined). Zero: wait forever.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
};

// Whether this build has the NCCL communicator and libnccl can be loaded here.
// kUnsupported (with why) when not.
Status nccl_available();
// A new unique id (rank 0 calls this). Errors: kUnsupported without NCCL; kDeviceError.
Result<NcclUniqueId> make_nccl_unique_id();
// Joins the communicator of `world` ranks that share options.id, as rank options.rank on CUDA
// device options.device (blocks until every rank joined, up to options.timeout). Collectives take
// device memory of that device; host memory is staged through a device buffer (one copy each way,
// for small things such as CommunicatorNorm's one fp64). Each collective waits for its
// completion on the stream (polling NCCL's asynchronous error and the timeout), so a dead peer
// comes back as an error instead of a hang.
// libnccl.so.2 is loaded at the first call (dlopen; TIER_NCCL_LIBRARY names another file), so
// tier loads where NCCL is not installed. Errors: kUnsupported (built without NCCL: configure
// with -DTIER_WITH_NCCL=ON; or libnccl not found), kInvalidArgument, kTimedOut, kDeviceError.
Result<std::unique_ptr<Communicator>> make_nccl_communicator(const NcclOptions& options);

}  // namespace tier
