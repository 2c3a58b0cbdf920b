// tier/loss_scaler.hpp — fp16 loss scaling: the scale gradients carry, and its dynamic bookkeeping
// (halve on overflow after `hysteresis` overflows, double after `window` clean steps, never below
// `min_scale`), with the meaning DeepSpeed gives to its fp16 config keys.
//
// The training loop multiplies the loss by scale() before backward; the optimizer divides the
// gradients by it (folded into the Adam kernel's grad_scale), checks them for inf/nan, skips the
// step on overflow and calls update(overflow) once per step. Without fp16 (disabled) the scale is
// 1 and never changes.
//
// Dynamic rule, per update(overflow):
//   overflow:  when hysteresis is 1 (or the remaining hysteresis has run down to 1) the scale is
//              divided by `factor` (not below min_scale); otherwise the remaining hysteresis drops
//              by one. The step is remembered as the last overflow.
//   no overflow: with consecutive_hysteresis the remaining hysteresis is refilled; after every
//              `window` clean steps since the last overflow the scale is multiplied by `factor`
//              (and the hysteresis refilled).
// A static scale (dynamic == false) never changes.
//
// Thread safety: a plain value; one owner updates it.
#pragma once

#include <cstdint>

#include "tier/config.hpp"
#include "tier/status.hpp"

namespace tier::optim {

struct LossScaleOptions {
  bool enabled = false;                 // fp16.enabled: scale gradients at all
  bool dynamic = true;                  // fp16.loss_scale == 0
  double static_scale = 1.0;            // fp16.loss_scale when not dynamic
  double initial_scale = 65536;         // 2^fp16.initial_scale_power
  int window = 1000;                    // fp16.loss_scale_window
  int hysteresis = 2;                   // fp16.hysteresis
  bool consecutive_hysteresis = false;  // fp16.consecutive_hysteresis
  double min_scale = 1.0;               // fp16.min_loss_scale
  double factor = 2.0;                  // growth and backoff factor

  // The options DeepSpeed's fp16 section asks for (disabled when fp16.enabled is false).
  static LossScaleOptions from_config(const Fp16Config& fp16);
  // kInvalidArgument naming the field for a non-positive or non-finite scale, window < 1,
  // hysteresis < 1 or factor <= 1.
  Status validate() const;
};

// Everything that changes as steps go by: saved in checkpoints.
struct LossScaleState {
  double scale = 1.0;
  std::int64_t iteration = 0;       // update() calls so far
  std::int64_t last_overflow = -1;  // iteration of the last overflow, -1 for none
  int hysteresis_left = 1;
};

class LossScaler {
 public:
  static Result<LossScaler> create(const LossScaleOptions& options);

  bool enabled() const noexcept { return options_.enabled; }
  bool dynamic() const noexcept { return options_.enabled && options_.dynamic; }
  // The scale the current step's gradients carry (1 when disabled).
  double scale() const noexcept { return state_.scale; }
  // Records one step's outcome; returns the scale for the next step.
  double update(bool overflow) noexcept;

  const LossScaleOptions& options() const noexcept { return options_; }
  const LossScaleState& state() const noexcept { return state_; }
  // Restores the state from a checkpoint. Errors: a non-finite or non-positive scale, a negative
  // iteration or hysteresis.
  Status restore(const LossScaleState& state);

 private:
  explicit LossScaler(const LossScaleOptions& o);
  LossScaleOptions options_;
  LossScaleState state_;
};

}  // namespace tier::optim
