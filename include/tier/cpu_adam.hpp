// tier/cpu_adam.hpp — Adam and AdamW (and Adagrad, Lion, Lamb) on the CPU over fp32 master
// parameters and fp32 (or compressed: bf16, block int8) optimizer state, the update ZeRO-Offload
// runs on the host.
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
// The other kinds (AdamHyperParams::kind) use the same tensors, grad dtypes, `out` and guarantees;
// exp_avg and exp_avg_sq hold what each kind keeps (the other one is left untouched):
//   Adagrad (torch.optim.Adagrad with lr_decay = 0, initial_accumulator_value = 0):
//     g = grad * grad_scale + weight_decay * p      (always L2; decay_mode is ignored)
//     exp_avg_sq += g * g
//     p -= lr * g / (sqrt(exp_avg_sq) + eps)        (exp_avg unused; no bias correction)
//   Lion (the Lion paper, lion-pytorch, DeepSpeed's Lion):
//     c = beta1 * m + (1 - beta1) * g               (m is exp_avg; exp_avg_sq unused)
//     p = p * (1 - lr * weight_decay) - lr * sign(c)   (sign(0) = 0; always decoupled)
//     m = beta2 * m + (1 - beta2) * g
//   Lamb (DeepSpeed's FusedLamb), a per-parameter trust ratio over Adam's moments:
//     m, v as Adam (no L2 term);  u = (m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * p
//     trust = clamp(||p|| / ||u||, min_coeff, max_coeff), 1 when either norm is 0
//     p -= lr * trust * u
//   The norms span a whole parameter, so Lamb is two passes: lamb_accumulate_norms() over every
//   piece of the parameter (it writes nothing), then adam_update() with step.with_trust(trust).
//   lamb_update() does both over a parameter held in one buffer. The squared norms are summed in
//   fp64 into fixed (block, lane) slots in element order, so they too are independent of chunking
//   and thread count.
//
// Compressed state (formats, sizes and error bounds in state_codec.hpp). exp_avg and exp_avg_sq
// may instead be both bf16, or exp_avg int8 and exp_avg_sq uint8 with one fp32 scale per block of
// 256 elements each (AdamTensors::exp_avg_scales, exp_avg_sq_scales). The update then reads the
// compressed bytes, widens each block to fp32, runs exactly the fp32 arithmetic above on it (so
// the step uses the fresh fp32 moments, not their rounded copies), and stores the new moments
// compressed: bf16 rounded to nearest-even; int8 re-quantized with a fresh scale per block.
// Adam/AdamW (both decay modes, bias correction on or off), Adagrad and Lion take every grad,
// param and `out` dtype they take with fp32 state; an unused moment (Adagrad's exp_avg, Lion's
// exp_avg_sq) is left untouched. Lamb with compressed state returns kUnsupported for now (its norms
// pass reads fp32 state), as does adam_roofline_pass. Determinism: a block is always handled
// whole, so adam_update splits the range only at block boundaries, and any thread count and any
// chunking whose chunks start on a block boundary (only the last may end inside one) give
// bit-identical results for a given SIMD target.
//
// Thread safety: AdamStep is an immutable value; the update functions may run concurrently on
// disjoint tensors. AdamGroup is not thread-safe (one owner advances it).
#pragma once

#include <cstdint>
#include <vector>

#include "tier/cpu_kernels.hpp"
#include "tier/state_codec.hpp"
#include "tier/status.hpp"

namespace tier::cpu {

enum class WeightDecayMode : std::uint8_t {
  kDecoupled = 0,  // AdamW: p *= 1 - lr * weight_decay
  kL2 = 1,         // Adam with L2 regularisation: grad += weight_decay * p
};

// The update rule of a group. Adam covers Adam and AdamW (decay_mode tells them apart).
enum class OptimizerKind : std::uint8_t { kAdam = 0, kAdagrad = 1, kLion = 2, kLamb = 3 };
const char* optimizer_kind_name(OptimizerKind k) noexcept;  // "adam", "adagrad", "lion", "lamb"

struct AdamHyperParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  WeightDecayMode decay_mode = WeightDecayMode::kDecoupled;
  bool bias_correction = true;  // Adam and Lamb
  OptimizerKind kind = OptimizerKind::kAdam;
  // Lamb: the trust ratio is clamped to [min_coeff, max_coeff] (DeepSpeed's FusedLamb defaults).
  double max_coeff = 10.0;
  double min_coeff = 0.01;

  // kInvalidArgument naming the field for a non-finite value, lr < 0, a beta outside [0, 1),
  // eps < 0 (eps 0 except for Lion, which ignores it), weight_decay < 0, an unknown kind, or min_coeff < 0
  // or > max_coeff.
  Status validate() const;
};

// The usual defaults of each kind (lr, betas, eps as DeepSpeed / torch / lion-pytorch set them):
// Adam lr 1e-3, betas (0.9, 0.999), eps 1e-8; Adagrad lr 1e-2, eps 1e-10; Lion lr 1e-4, betas
// (0.9, 0.99); Lamb lr 1e-3, betas (0.9, 0.999), eps 1e-8, max_coeff 10, min_coeff 0.01.
// weight_decay 0 for all.
AdamHyperParams default_hyper_params(OptimizerKind kind);

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
  // Lamb: the same step with its trust ratio (lr * trust is the step size). Other kinds: itself.
  AdamStep with_trust(double trust) const;

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
    float inv_bc1;       // Lamb: 1 / (1 - beta1^t)
    float weight_decay;  // Lamb: the term of u
    OptimizerKind kind;
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
// place. `exp_avg`, `exp_avg_sq`: the optimizer state, updated in place, in one of the families of
// state_codec.hpp: both fp32, both bf16, or exp_avg kI8 with exp_avg_sq kU8 and their block
// scales. `grads`: fp32, fp16 or bf16, read. `out`: optional (data == nullptr for none), fp16 or
// bf16 (or fp32), receives the updated params. Buffers must not overlap and must be aligned to
// their element size.
struct AdamTensors {
  TensorRef params;
  TensorRef exp_avg;
  TensorRef exp_avg_sq;
  ConstTensorRef grads;
  TensorRef out;
  // int8 state only (null otherwise): one fp32 scale per kStateBlock (256) elements of exp_avg
  // and of exp_avg_sq, ceil(numel / 256) each, read and rewritten by the update. Block b covers
  // elements [256b, 256b + 256) of this range: a chunk must start on a block boundary of the
  // tensor, and only the tensor's last chunk may end inside a block.
  float* exp_avg_scales = nullptr;
  float* exp_avg_sq_scales = nullptr;
};

// Checks dtypes (state: one family), lengths, alignment, scales and overlap; the update functions
// call it. kInvalidArgument naming the tensor or field.
Status validate(const AdamTensors& t);

// Updates one contiguous chunk on the calling thread with the step's kind (for pipelines that run it beside I/O).
Status adam_update_chunk(const AdamStep& step, const AdamTensors& t);

// Updates a whole range with `threads` oneTBB threads (0: all cores, 1: the calling thread),
// each streaming one contiguous stretch. Bit-identical to adam_update_chunk over the same range.
Status adam_update(const AdamStep& step, const AdamTensors& t, int threads = 0);

// Lamb's per-parameter norms: ||p||^2 and ||u||^2 of one parameter of `numel` elements, summed
// in fp64 into 16 lanes (element i into lane i % 16) of fixed 64 Ki-element blocks, in element
// order; the lanes are combined in a fixed tree and the blocks in order. Not thread-safe.
class LambNorms {
 public:
  static constexpr std::uint64_t kBlock = 64 * 1024;
  static constexpr int kLanes = 16;
  explicit LambNorms(std::uint64_t numel = 0) { reset(numel); }
  void reset(std::uint64_t numel);
  std::uint64_t numel() const noexcept { return numel_; }
  double param_sq() const noexcept { return total(0); }
  double update_sq() const noexcept { return total(1); }

 private:
  friend Status lamb_accumulate_norms(const AdamStep&, const AdamTensors&, std::uint64_t, LambNorms&, int);
  double total(int which) const noexcept;
  std::uint64_t numel_ = 0;
  std::vector<double> acc_;  // per block: kLanes lanes of p^2, then kLanes of u^2
};

// Pass 1 of Lamb over elements [offset, offset + t.params.numel) of a parameter: computes the new
// moments and u in registers and adds p^2 and u^2 to `norms`; writes nothing else (t.out is
// ignored). Pieces that share a 64 Ki block must be given in element order; every element once.
// Errors: those of validate(), a step that is not Lamb, a range past norms.numel().
Status lamb_accumulate_norms(const AdamStep& step, const AdamTensors& t, std::uint64_t offset, LambNorms& norms,
                             int threads = 1);
// The trust ratio of a parameter from its squared norms (see the math above).
double lamb_trust_ratio(const AdamHyperParams& hp, double param_sq, double update_sq);
// Both passes of Lamb over one whole parameter.
Status lamb_update(const AdamStep& step, const AdamTensors& t, int threads = 0);

// A kernel with Adam's memory pattern and trivial arithmetic: reads params, grads, exp_avg and
// exp_avg_sq, writes params, exp_avg, exp_avg_sq back in place (and `out` when given), same
// dtypes and vector width as adam_update. Its speed is the honest ceiling of adam_update on this
// machine (an in-place update pays no write-allocate, unlike a STREAM triad). Overwrites the
// tensors with meaningless values.
Status adam_roofline_pass(const AdamTensors& t, int threads = 0);

}  // namespace tier::cpu
