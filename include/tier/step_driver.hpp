// tier/step_driver.hpp — one training step over offloaded optimizer state, for any framework:
// named parameters with their shapes and dtypes, gradients handed in as host tensors, a step that
// checks everything it was given before it touches the state, and the updated parameters written
// straight into the caller's tensors.
//
// The C ABI's tier_optimizer_* functions (include/tier/tier.h) and tier.jax are this class; the
// PyTorch adapter still drives tier::optim::OffloadedOptimizer itself (its engine tensors, hooks
// and overlap policy), see docs/design.md "The step driver".
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

struct StepArgs {
  // The learning rate of every group for this step and after (a scheduler's value); none: keep.
  std::optional<double> lr;
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
  // host memory; copied (added to the accumulator) at once. Errors: kInvalidArgument naming the
  // parameter (shape, dtype, an unknown index), kFailedPrecondition (more micro-steps than
  // gradient_accumulation_steps).
  Status add_grad(std::size_t index, const HostTensor& grad);
  // Forgets the gradients taken since the last step.
  void clear_grads() noexcept;

  // One optimizer step (see the header comment for what is checked first). The report says
  // whether it was applied (an overflow skips it), the norm and the clip coefficient.
  Result<optim::StepReport> step(const StepArgs& args = {});

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
  Status check_grads_complete() const;

  std::unique_ptr<optim::OffloadedOptimizer> opt_;
  int accumulation_steps_ = 1;
  std::vector<ParamInfo> params_;
  std::unordered_map<std::string, std::size_t> by_name_;
  std::vector<int> grads_in_;  // micro-steps of gradient taken per parameter this step
  bool registered_ = false;    // finish_registration done
  // Gradient traffic over host memory of the steps applied, in elements: gradients taken, and
  // the passes over them (intakes and update reads); intakes of the step being gathered.
  std::uint64_t grad_elements_ = 0;
  std::uint64_t grad_passes_elements_ = 0;
  std::uint64_t pending_intake_elements_ = 0;
};

}  // namespace tier::step
