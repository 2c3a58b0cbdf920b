// tier/step_driver.hpp — one training step over offloaded optimizer state, for any framework:
// named parameters with their shapes and dtypes, gradients handed in as host tensors, a step that
// checks everything it was given before it touches the state, and the updated parameters written
// straight into the caller's tensors.
//
// The C ABI's tier_optimizer_* functions (include/tier/tier.h), tier.jax,
// tier.torch.OffloadedAdamW and tier.torch's engine (initialize) are this class; see
// docs/design.md "The step driver".
//
// What it adds to OffloadedOptimizer (which it owns, built from a DeepSpeed/tier config):
//  - Parameters by name, each with a shape and a dtype (fp32, bf16 or fp16). The fp32 master is
//    made from the initial values; a bf16/fp16 parameter gets its updated values back in its own
//    dtype after each step (the master stays fp32), an fp32 one in fp32.
//  - Every input is checked against the parameter it is for, before anything changes: a gradient
//    of another shape or dtype, a name given twice, a step while some parameter has no gradient
//    (or fewer micro-steps than gradient_accumulation_steps), a non-finite or negative learning
//    rate, an output tensor of the wrong size or dtype: each is kInvalidArgument (kAlreadyExists
//    for a name, kFailedPrecondition for a missing gradient) with a message naming the parameter,
//    and the state, the gradients taken so far and the step counters are unchanged.
//  - The updated params are written by the update kernel itself into the caller's memory (one
//    pass: no staging copy), or into the caller's engine tensors (EngineTargets: a framework whose
//    params and gradients live in a tier::Engine, as tier.torch's engine's do).
//  - The step's three forms: serial (step), overlapped with backward (start_overlap ..
//    finish_overlap: "exact"), and on a thread of its own while the caller computes the next
//    step's gradients (start_async .. finish_async: "delayed"). What a step reads and writes is
//    held by the driver from its start to its end, whichever form it takes.
//
// Per gradient element on the host, a step costs two passes over host memory: the intake (the
// gradient is read and added into the fp32 accumulator, its sum of squares computed in the same
// pass) and the update's read of the accumulator. `host_passes_per_grad_element()` reports it from
// the counters the driver keeps, and a test checks it.
//
// Thread safety: one thread at a time, as OffloadedOptimizer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "tier/config.hpp"
#include "tier/engine.hpp"
#include "tier/norm_reducer.hpp"
#include "tier/offloaded_optimizer.hpp"
#include "tier/status.hpp"
#include "tier/types.hpp"

namespace tier {
class Communicator;  // tier/comm.hpp
}  // namespace tier

namespace tier::step {

class EngineMasterSource;  // tier/engine_step_io.hpp

// A view of a row-major, contiguous tensor in host memory.
struct HostTensor {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  std::span<const std::int64_t> shape;  // empty: a scalar (one element)
};

struct ParamInfo {
  std::string name;
  std::vector<std::int64_t> shape;
  DType dtype = DType::kF32;  // fp32, bf16 or fp16
  std::uint64_t numel = 0;
  int group = 0;
};

// How add_grad takes a gradient: copied into the parameter's fp32 accumulator at once (the
// caller's memory is free on return), or borrowed (no copy: the update reads the caller's memory,
// which must stay valid and unchanged until the step, or clear_grads, returns; one micro-step
// per step).
enum class GradIntake : std::uint8_t { kCopy, kBorrow };

// A step over engine tensors: where each parameter's updated values go and where its declared
// gradient (declare_grad) is read from. Per parameter, in the order they were added; an empty
// list means none.
struct EngineTargets {
  Engine* engine = nullptr;  // must outlive the step
  // The tensor the updated values are written into (-1: not written), from element offsets[i]
  // (empty: 0; a rank's shard of a whole parameter sits at its offset in the tensor), in the
  // parameter's dtype.
  std::vector<std::int64_t> params;
  std::vector<std::int64_t> offsets;
  // The tensor a declared gradient is read from (fp32, bf16 or fp16, the parameter's numel).
  std::vector<std::int64_t> grads;
};

struct StepArgs {
  // The learning rate of every group for this step and after (a scheduler's value); none: keep.
  std::optional<double> lr;
  // A parameter that got no gradient this step is left as it is (values, moments; no weight
  // decay), as torch's optimizers skip a parameter whose grad is None. Off: such a step is
  // refused (kFailedPrecondition naming the parameter), unless zero_missing.
  bool skip_missing = false;
  // A parameter that got no gradient is updated with a zero one (its moments decay, weight decay
  // applies), as DeepSpeed's flat gradient buffers do. Not with skip_missing.
  bool zero_missing = false;
  // Where each parameter's updated values go: empty, or one pointer per parameter (in the order
  // they were added; null skips that parameter), each to numel elements of the parameter's dtype
  // in host memory that stays valid until step() returns.
  std::vector<void*> outputs;
  // Or into engine tensors (parameters without an output), and declared gradients from them.
  std::optional<EngineTargets> engine;
  // (optional) The data-parallel ranks, each rank's driver holding its shards of the parameters:
  // the gradient's sum of squares is all-reduced over them (CommunicatorNorm, one fp64 per step),
  // so every rank clips by the global norm and skips the step when any rank overflowed. Every
  // rank steps with it, in the same order. Must outlive the step (an overlapped or asynchronous
  // one: until it is finished).
  Communicator* comm = nullptr;
  // (optional) Or any other reduction of the sum of squares across ranks (not with comm); must
  // outlive the step.
  optim::NormReducer* norm = nullptr;
};

// The intake of a gradient the caller sums itself (then hands in with declare_grad), e.g. in an
// engine tensor: acc = grad (`first`) or acc + grad, in fp32, for `numel` elements of grad (fp32,
// bf16 or fp16 host memory), returning the fp64 sum of squares of the result. One pass over host
// memory: the sum comes with the addition (the same value cpu::sum_of_squares gives for acc).
Result<double> accumulate_grad(float* acc, const HostTensor& grad, std::uint64_t numel, bool first);

// The intake of a gradient kept in its own dtype (a bf16/fp16 model's, not summed across
// micro-steps): dst = grad for `numel` elements of grad's dtype, returning its fp64 sum of squares
// from the same pass (the value cpu::sum_of_squares gives for it).
Result<double> copy_grad(void* dst, const HostTensor& grad, std::uint64_t numel);

class StepDriver {
 public:
  // The optimizer from `config` (its "optimizer" section, zero_optimization.offload_optimizer for
  // where the state lives, gradient_clipping, fp16 loss scaling, gradient_accumulation_steps, the
  // tier section). `max_elements`: the parameters' elements together, needed when the state is on
  // NVMe (it sizes the swap files' cap; the files grow as parameters are added); `max_params` the
  // number of parameters, for int8 state's alignment (0: unknown). Errors: those of
  // OffloadedOptimizerOptions::from_config and OffloadedOptimizer::create.
  static Result<std::unique_ptr<StepDriver>> create(const EngineConfig& config, std::uint64_t max_elements,
                                                    std::uint64_t max_params = 0);
  // The optimizer of prepared options: from_config's, with what a host framework adds (the
  // engine's counters, its host budget as the pinned source, its arena, a wrapped I/O engine).
  static Result<std::unique_ptr<StepDriver>> create(const optim::OffloadedOptimizerOptions& options);
  // The same, with the fp32 masters of the parameters added by add_engine_param kept in their
  // engine tensors instead of the optimizer's records (OffloadedOptimizerOptions::master_source:
  // 4 bytes per parameter less on disk and written per step). The options must allow it (state on
  // NVMe, state_copies 1, no speculation_chunks, no Lamb); the engine outlives the driver. Every
  // parameter is then added with add_engine_param, and steps are serial or overlapped (not
  // start_async, whose forward reads the params the step writes).
  static Result<std::unique_ptr<StepDriver>> create(const optim::OffloadedOptimizerOptions& options,
                                                    Engine* engine_masters);
  ~StepDriver();
  StepDriver(const StepDriver&) = delete;
  StepDriver& operator=(const StepDriver&) = delete;

  // Adds a parameter with the shape, dtype and values of `initial` (fp32, bf16 or fp16; copied).
  // Returns its index (0, 1, ... in order). Errors: kAlreadyExists (name taken), kInvalidArgument
  // (empty name, a dtype other than those, a negative dimension, no elements, an unknown group),
  // kFailedPrecondition after the first gradient or step, and the optimizer's (a chunk write).
  Result<std::size_t> add_param(const std::string& name, const HostTensor& initial, int group = 0);
  // The same, for a parameter of dtype `dtype` whose initial values are given in another one
  // (typically the fp32 values a bf16 parameter was made from: the master keeps them exactly).
  Result<std::size_t> add_param(const std::string& name, const HostTensor& initial, int group, DType dtype);
  // (A driver made with engine_masters.) Adds an fp32 parameter of shape `shape` whose values, and
  // fp32 master, are elements [offset, offset + numel) of fp32 engine tensor `tensor`: nothing is
  // copied, and each step updates the tensor in place (the update is committed chunk by chunk,
  // each chunk's values written into the tensor once its state is on disk). Errors: add_param's,
  // and kInvalidArgument for a tensor that is not fp32 or too short, or a driver without
  // engine_masters.
  Result<std::size_t> add_engine_param(const std::string& name, std::span<const std::int64_t> shape, int group,
                                       TensorId tensor, std::uint64_t offset = 0);
  bool engine_masters() const noexcept { return masters_ != nullptr; }
  // Lays the state out now (writes the last chunk) instead of at the first gradient, step or
  // state access, so that its I/O error is met here. Parameters cannot be added afterwards.
  Status finish_registration();
  // A parameter group of the same kind as group 0 (the config's optimizer type), with these
  // hyper-parameters; returns its index.
  Result<int> add_group(double lr, double beta1, double beta2, double eps, double weight_decay);
  // The same with the weight decay's form and bias correction given (the kind and its clamps are
  // group 0's; Adagrad's decay is always L2, Lion's always decoupled).
  Result<int> add_group(double lr, double beta1, double beta2, double eps, double weight_decay,
                        cpu::WeightDecayMode decay, bool bias_correction);

  // One micro-step's gradient of parameter `index`: the parameter's shape, fp32/bf16/fp16,
  // host memory; copied (added to the accumulator) at once, or borrowed (see GradIntake). Errors: kInvalidArgument
  // naming the parameter (shape, dtype, an unknown index), kFailedPrecondition (more micro-steps than
  // gradient_accumulation_steps).
  Status add_grad(std::size_t index, const HostTensor& grad, GradIntake intake = GradIntake::kCopy);
  // The final gradient of parameter `index` for this step is in its engine tensor
  // (EngineTargets::grads, given to the step), with sum of squares `sumsq` (of the values as they
  // are, loss scale included; inf or nan mark an overflow). The step reads it from there: the
  // host memory it takes does not grow with the model. Errors: kInvalidArgument (index, a
  // negative sumsq), kFailedPrecondition (the parameter already has its gradients this step).
  Status declare_grad(std::size_t index, double sumsq);
  // Forgets the gradients taken since the last step (and drops an overlapped step in flight).
  // Does nothing while an asynchronous step runs (its gradients are its own).
  void clear_grads() noexcept;

  // One optimizer step (see the header comment for what is checked first). The report says
  // whether it was applied (an overflow skips it), the norm and the clip coefficient.
  Result<optim::StepReport> step(const StepArgs& args = {});

  // The step overlapped with the gradients' arrival ("exact" overlap): start_overlap checks
  // `args` as step() does (except the gradients, which are still coming) and starts the update on
  // a thread of the optimizer's, which updates each chunk of the state as soon as its gradients
  // are in; add_grad (typically GradIntake::kBorrow, from a backward hook) hands them in in any
  // order. finish_overlap checks that every gradient is in (as step(): nothing is applied on an
  // error, the pass stays running), then computes the global norm and commits the pass when no
  // clipping or overflow says otherwise, or redoes the step serially: the result is step()'s bit
  // for bit. cancel_overlap drops the pass (nothing committed, the gradients kept). `args.outputs`
  // are copied (the pointers must stay valid until finish or cancel); outputs written by a pass
  // that is then dropped are not written again (they are the caller's staging).
  Status start_overlap(const StepArgs& args);
  Result<optim::StepReport> finish_overlap();
  void cancel_overlap() noexcept;
  bool overlap_running() const noexcept;

  // step(args) on a thread of the driver's, returning once it has started (the arguments checked
  // as step() checks them): the "delayed" update, which runs while the caller computes the next
  // step's gradients. Until finish_async() returns its report (or its error, with the state as
  // before, for a retry), every other call that touches the state or the gradients is refused
  // with kFailedPrecondition; the gradients it reads must stay as they are.
  Status start_async(const StepArgs& args);
  Result<optim::StepReport> finish_async();
  bool async_running() const noexcept { return async_ != nullptr; }

  // Whether params a step delivered may be ahead of the committed state (a failed step could not
  // put them back, or an applied step's outputs failed): read_param() has the committed ones.
  bool outputs_stale() const noexcept;
  // The caller has rewritten every parameter from read_param(): outputs_stale() is false again.
  void outputs_rewritten() noexcept;

  // A group's hyper-parameters (from this step on) and their current values.
  Status set_hyper_params(int group, double lr, double beta1, double beta2, double eps, double weight_decay);
  Status set_lr(int group, double lr);
  Result<cpu::AdamHyperParams> hyper_params(int group) const;
  std::size_t group_count() const noexcept;

  // The current values of a parameter (from the fp32 master) as fp32, bf16 or fp16, numel
  // elements into `dst`.
  Status read_param(std::size_t index, DType dtype, void* dst);
  // A parameter's fp32 master, exp_avg or exp_avg_sq (numel floats), read or overwritten; or
  // `count` of its elements from element `offset` (a range past the parameter is kOutOfRange).
  Status read_state(std::size_t index, optim::StateKind kind, float* dst);
  Status write_state(std::size_t index, optim::StateKind kind, const float* src);
  Status read_state(std::size_t index, optim::StateKind kind, float* dst, std::uint64_t offset, std::uint64_t count);
  Status write_state(std::size_t index, optim::StateKind kind, const float* src, std::uint64_t offset,
                     std::uint64_t count);
  // A group's step counter (bias correction), e.g. after write_state from another optimizer.
  Result<std::int64_t> group_step(int group) const;
  Status set_group_step(int group, std::int64_t step);

  // The optimizer's streamed, checksummed checkpoint (docs/optimizer.md); load checks that the
  // parameters are the same (count, sizes, groups, names). `before_commit`: as
  // OffloadedOptimizer::load_checkpoint's (called once the file verified, before anything changes).
  Status save(const std::string& path);
  Status load(const std::string& path, const std::function<Status()>& before_commit = {});

  std::size_t param_count() const noexcept { return params_.size(); }
  const ParamInfo& param(std::size_t index) const { return params_.at(index); }
  Result<std::size_t> find(const std::string& name) const;
  // The loss scale to multiply the loss by (1 without fp16 dynamic scaling).
  double loss_scale() const noexcept;
  // Stats as one JSON object: the optimizer's (bytes, chunks, steps) plus the driver's counts.
  std::string stats_json() const;
  // Host-memory passes per gradient element over the steps applied so far: bytes the intake and
  // the update moved over host memory for gradients, divided by the gradient bytes (2.0 for the
  // CPU path: intake, update read).
  double host_passes_per_grad_element() const noexcept;

  optim::OffloadedOptimizer& optimizer() noexcept { return *opt_; }

 private:
  // What a step reads and writes, held from its start to its end (the engine targets' sink and
  // gradient source, the outputs).
  struct Session;
  struct Async;

  explicit StepDriver(std::unique_ptr<optim::OffloadedOptimizer> opt);
  // add_param's checks of a new parameter's name, dtype and group; its numel.
  Result<std::uint64_t> check_new_param(const std::string& name, std::span<const std::int64_t> shape, DType dtype,
                                        int group) const;
  // Records a parameter the optimizer took as partition `id`.
  Result<std::size_t> note_param(const std::string& name, std::span<const std::int64_t> shape, DType dtype,
                                 std::uint64_t numel, int group, optim::PartitionId id);
  // kFailedPrecondition while an asynchronous step runs.
  Status idle(const char* what) const;
  // kFailedPrecondition while a step that failed part-way is owed (state_copies 1).
  Status not_owed(const char* what) const;
  // The step of `session`: the optimizer's, then its sink closed (the step's error first).
  Result<optim::StepReport> run_step(Session& session);
  // The optimizer's finish_registration, once: parameters are all in at the first gradient, step,
  // state access or checkpoint.
  Status ensure_registered();
  Status check_index(std::size_t index, const char* what) const;
  Status check_grads_complete(const StepArgs& args) const;
  Status check_step_args(const StepArgs& args) const;
  // Registration done, and args.lr (if any) set on every group: what a step does first.
  Status apply_lr(const StepArgs& args);
  // Books the gradient traffic of an applied step and resets the per-step gradient counts.
  void after_step(const optim::StepReport& report);
  // after_step for a step that was applied: one that succeeded, or failed after it was committed
  // (the optimizer's applied count moved past `applied_before`).
  void book(const Result<optim::StepReport>& r, std::uint64_t applied_before);

  // engine_masters: where the masters are (declared first: it outlives the optimizer).
  std::unique_ptr<EngineMasterSource> masters_;
  std::unique_ptr<optim::OffloadedOptimizer> opt_;
  int accumulation_steps_ = 1;
  std::vector<ParamInfo> params_;
  std::unordered_map<std::string, std::size_t> by_name_;
  std::vector<int> grads_in_;  // micro-steps of gradient taken per parameter this step
  bool registered_ = false;    // finish_registration done
  // The running overlapped step's arguments and what it writes to.
  std::unique_ptr<Session> overlap_;
  bool overlap_started_ = false;
  std::unique_ptr<Async> async_;  // a step on its own thread (start_async .. finish_async)
  // Gradient traffic over host memory of the steps applied, in elements: gradients taken, and
  // the passes over them (intakes and update reads); intakes of the step being gathered.
  std::uint64_t grad_elements_ = 0;
  std::uint64_t grad_passes_elements_ = 0;
  std::uint64_t pending_intake_elements_ = 0;
  std::uint64_t pending_grad_elements_ = 0;  // gradient elements taken (copied or borrowed) this step
};

}  // namespace tier::step
