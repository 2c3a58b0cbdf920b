// tier/step_driver.hpp — one training step over offloaded optimizer state, for any framework:
// named parameters with their shapes and dtypes, gradients handed in as host tensors, a step that
// checks everything it was given before it touches the state, and the updated parameters written
// straight into the caller's tensors.
//
// The C ABI's tier_optimizer_* functions (include/tier/tier.h), tier.jax and
// tier.torch.OffloadedAdamW are this class; tier.torch's engine (initialize) still drives
// tier::optim::OffloadedOptimizer itself (its engine tensors), see docs/design.md "The step
// driver".
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
//    pass: no staging copy).
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
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "tier/config.hpp"
#include "tier/offloaded_optimizer.hpp"
#include "tier/status.hpp"
#include "tier/types.hpp"

namespace tier::step {

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

struct StepArgs {
  // The learning rate of every group for this step and after (a scheduler's value); none: keep.
  std::optional<double> lr;
  // A parameter that got no gradient this step is left as it is (values, moments; no weight
  // decay), as torch's optimizers skip a parameter whose grad is None. Off: such a step is
  // refused (kFailedPrecondition naming the parameter).
  bool skip_missing = false;
  // Where each parameter's updated values go: empty, or one pointer per parameter (in the order
  // they were added; null skips that parameter), each to numel elements of the parameter's dtype
  // in host memory that stays valid until step() returns.
  std::vector<void*> outputs;
};

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
  ~StepDriver();
  StepDriver(const StepDriver&) = delete;
  StepDriver& operator=(const StepDriver&) = delete;

  // Adds a parameter with the shape, dtype and values of `initial` (fp32, bf16 or fp16; copied).
  // Returns its index (0, 1, ... in order). Errors: kAlreadyExists (name taken), kInvalidArgument
  // (empty name, a dtype other than those, a negative dimension, no elements, an unknown group),
  // kFailedPrecondition after the first gradient or step, and the optimizer's (a chunk write).
  Result<std::size_t> add_param(const std::string& name, const HostTensor& initial, int group = 0);
  // A parameter group of the same kind as group 0 (the config's optimizer type), with these
  // hyper-parameters; returns its index.
  Result<int> add_group(double lr, double beta1, double beta2, double eps, double weight_decay);

  // One micro-step's gradient of parameter `index`: the parameter's shape, fp32/bf16/fp16,
  // host memory; copied (added to the accumulator) at once, or borrowed (see GradIntake). Errors: kInvalidArgument
  // naming the parameter (shape, dtype, an unknown index), kFailedPrecondition (more micro-steps than
  // gradient_accumulation_steps).
  Status add_grad(std::size_t index, const HostTensor& grad, GradIntake intake = GradIntake::kCopy);
  // Forgets the gradients taken since the last step (and drops an overlapped step in flight).
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

  // A group's hyper-parameters (from this step on) and their current values.
  Status set_hyper_params(int group, double lr, double beta1, double beta2, double eps, double weight_decay);
  Result<cpu::AdamHyperParams> hyper_params(int group) const;
  std::size_t group_count() const noexcept;

  // The current values of a parameter (from the fp32 master) as fp32, bf16 or fp16, numel
  // elements into `dst`.
  Status read_param(std::size_t index, DType dtype, void* dst);
  // A parameter's fp32 master, exp_avg or exp_avg_sq (numel floats), read or overwritten.
  Status read_state(std::size_t index, optim::StateKind kind, float* dst);
  Status write_state(std::size_t index, optim::StateKind kind, const float* src);
  // A group's step counter (bias correction), e.g. after write_state from another optimizer.
  Result<std::int64_t> group_step(int group) const;
  Status set_group_step(int group, std::int64_t step);

  // The optimizer's streamed, checksummed checkpoint (docs/optimizer.md); load checks that the
  // parameters are the same (count, sizes, groups, names).
  Status save(const std::string& path);
  Status load(const std::string& path);

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
  explicit StepDriver(std::unique_ptr<optim::OffloadedOptimizer> opt);
  // The optimizer's finish_registration, once: parameters are all in at the first gradient, step,
  // state access or checkpoint.
  Status ensure_registered();
  Status check_index(std::size_t index, const char* what) const;
  Status check_grads_complete(bool skip_missing) const;
  Status check_step_args(const StepArgs& args) const;
  // Registration done, and args.lr (if any) set on every group: what a step does first.
  Status apply_lr(const StepArgs& args);
  // Books the gradient traffic of an applied step and resets the per-step gradient counts.
  void after_step(const optim::StepReport& report);

  std::unique_ptr<optim::OffloadedOptimizer> opt_;
  int accumulation_steps_ = 1;
  std::vector<ParamInfo> params_;
  std::unordered_map<std::string, std::size_t> by_name_;
  std::vector<int> grads_in_;  // micro-steps of gradient taken per parameter this step
  bool registered_ = false;    // finish_registration done
  // The running overlapped step's arguments (the outputs it writes).
  StepArgs overlap_args_;
  bool overlap_started_ = false;
  // Gradient traffic over host memory of the steps applied, in elements: gradients taken, and
  // the passes over them (intakes and update reads); intakes of the step being gathered.
  std::uint64_t grad_elements_ = 0;
  std::uint64_t grad_passes_elements_ = 0;
  std::uint64_t pending_intake_elements_ = 0;
  std::uint64_t pending_grad_elements_ = 0;  // gradient elements taken (copied or borrowed) this step
};

}  // namespace tier::step
