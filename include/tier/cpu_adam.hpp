// tier/cpu_adam.hpp — Adam and AdamW on the CPU over fp32 master parameters and fp32 optimizer
// state, the update ZeRO-Offload runs on the host.
//
// Gradients may be fp32, fp16 or bf16; params fp32 (bf16 is accepted too, updated in fp32
// arithmetic and rounded back). The updated params can be written, in the same pass, as fp16 or
// bf16 into a second buffer: the low-precision copy that goes back to the GPU. The update is
// memory-bound (it reads params, grads, exp_avg and exp_avg_sq and writes three of them back);
// the kernels stream it with SIMD vectors chosen at run time and, in adam_update(), oneTBB threads
// that each own one contiguous stretch.
//
// Usage, one optimizer step of a parameter group:
//     AdamStep s = group.begin_step().value();      // advances the group's step counter
//     for each tensor (or each chunk of it): adam_update(s, {params, exp_avg, exp_avg_sq, grads, out});
// A pipeline that streams state from NVMe calls adam_update_chunk(s, chunk_i) on each chunk as
// it arrives. The math is element-wise with no reduction, so any chunking and any thread count
// give bit-identical results (a tested guarantee) for a given SIMD target.
//
// The math (PyTorch's Adam/AdamW, in fp32, per element; t is the step number):
//     g = grad * grad_scale                         (unscaling and clipping folded in)
//     g += weight_decay * p                         (L2 mode)
//     m = beta1 * m + (1 - beta1) * g
//     v = beta2 * v + (1 - beta2) * g * g
//     p *= 1 - lr * weight_decay                    (decoupled mode: AdamW)
//     p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// without bias correction the two (1 - beta^t) factors are 1.
//
// Thread safety: AdamStep is an immutable value; the update functions may run concurrently on
// disjoint tensors. AdamGroup is not thread-safe (one owner advances it).
#pragma once

#include <cstdint>

#include "tier/cpu_kernels.hpp"
#include "tier/status.hpp"

namespace tier::cpu {

enum class WeightDecayMode : std::uint8_t {
  kDecoupled = 0,  // AdamW: p *= 1 - lr * weight_decay
  kL2 = 1,         // Adam with L2 regularisation: grad += weight_decay * p
};

struct AdamHyperParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  WeightDecayMode decay_mode = WeightDecayMode::kDecoupled;
  bool bias_correction = true;

  // kInvalidArgument naming the field for a non-finite value, lr < 0, a beta outside [0, 1),
  // eps < 0 or weight_decay < 0.
  Status validate() const;
};

// The per-step constants of one optimizer step of one group, the same for every chunk of it.
class AdamStep {
 public:
  // `step` counts from 1. `grad_scale` multiplies every gradient before use (1 / loss scale
  // times the clipping coefficient). Errors: invalid hyper-parameters, step < 1, a non-finite or
  // non-positive grad_scale.
  static Result<AdamStep> make(const AdamHyperParams& hp, std::int64_t step, double grad_scale = 1.0);

  std::int64_t step() const noexcept { return step_; }
  const AdamHyperParams& hyper_params() const noexcept { return hp_; }
  double grad_scale() const noexcept { return grad_scale_; }

  // The fp32 constants the kernels use (public so that other kernels can share them).
  struct Constants {
    float beta1, one_minus_beta1, beta2, one_minus_beta2;
    float step_size;     // lr / (1 - beta1^t)
    float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^t)
    float eps;
    float decay_factor;     // decoupled: 1 - lr * weight_decay; L2: 1
    float l2_weight_decay;  // L2: weight_decay; decoupled: 0
    float grad_scale;
    bool l2;
  };
  const Constants& constants() const noexcept { return c_; }

 private:
  AdamHyperParams hp_;
  std::int64_t step_ = 0;
  double grad_scale_ = 1.0;
  Constants c_{};
};

// A parameter group: its hyper-parameters and its step counter.
class AdamGroup {
 public:
  static Result<AdamGroup> create(const AdamHyperParams& hp);

  const AdamHyperParams& hyper_params() const noexcept { return hp_; }
  // Replaces the hyper-parameters (a learning-rate schedule); validated first.
  Status set_hyper_params(const AdamHyperParams& hp);
  Status set_lr(double lr);

  // Steps taken so far (0 before the first).
  std::int64_t step() const noexcept { return step_; }
  // Restores the counter from a checkpoint. Errors: negative.
  Status set_step(std::int64_t step);

  // Advances the counter and returns the constants of the new step. Do not call it for a step
  // that is skipped (fp16 overflow): the counter must count only applied steps.
  Result<AdamStep> begin_step(double grad_scale = 1.0);

 private:
  explicit AdamGroup(const AdamHyperParams& hp) : hp_(hp) {}
  AdamHyperParams hp_;
  std::int64_t step_ = 0;
};

// The tensors of one update; all have the same numel. `params`: fp32 (or bf16), updated in
// place. `exp_avg`, `exp_avg_sq`: fp32, updated in place. `grads`: fp32, fp16 or bf16, read.
// `out`: optional (data == nullptr for none), fp16 or bf16 (or fp32), receives the updated
// params. Buffers must not overlap and must be aligned to their element size.
struct AdamTensors {
  TensorRef params;
  TensorRef exp_avg;
  TensorRef exp_avg_sq;
  ConstTensorRef grads;
  TensorRef out;
};

// Checks dtypes, lengths, alignment and overlap; the update functions call it.
Status validate(const AdamTensors& t);

// Updates one contiguous chunk on the calling thread (for pipelines that run it beside I/O).
Status adam_update_chunk(const AdamStep& step, const AdamTensors& t);

// Updates a whole range with `threads` oneTBB threads (0: all cores, 1: the calling thread),
// each streaming one contiguous stretch. Bit-identical to adam_update_chunk over the same range.
Status adam_update(const AdamStep& step, const AdamTensors& t, int threads = 0);

// A kernel with Adam's memory pattern and trivial arithmetic: reads params, grads, exp_avg and
// exp_avg_sq, writes params, exp_avg, exp_avg_sq back in place (and `out` when given), same
// dtypes and vector width as adam_update. Its speed is the honest ceiling of adam_update on this
// machine (an in-place update pays no write-allocate, unlike a STREAM triad). Overwrites the
// tensors with meaningless values.
Status adam_roofline_pass(const AdamTensors& t, int threads = 0);

}  // namespace tier::cpu
