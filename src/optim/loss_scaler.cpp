// fp16 loss scaling with DeepSpeed's dynamic rule (see tier/loss_scaler.hpp).
#include "tier/loss_scaler.hpp"

#include <algorithm>
#include <cmath>

namespace tier::optim {

LossScaleOptions LossScaleOptions::from_config(const Fp16Config& fp16) {
  LossScaleOptions o;
  o.enabled = fp16.enabled;
  o.dynamic = fp16.loss_scale == 0;
  o.static_scale = fp16.loss_scale > 0 ? fp16.loss_scale : 1.0;
  o.initial_scale = std::ldexp(1.0, fp16.initial_scale_power);
  o.window = fp16.loss_scale_window;
  o.hysteresis = fp16.hysteresis;
  o.consecutive_hysteresis = fp16.consecutive_hysteresis;
  o.min_scale = fp16.min_loss_scale;
  return o;
}

Status LossScaleOptions::validate() const {
  auto positive = [](double v, const char* name) -> Status {
    if (!std::isfinite(v) || v <= 0) {
      return invalid_argument(str("loss scale: ", name, " ", v, " must be finite and positive"));
    }
    return {};
  };
  TIER_RETURN_IF_ERROR(positive(static_scale, "static_scale (fp16.loss_scale)"));
  TIER_RETURN_IF_ERROR(positive(initial_scale, "initial_scale (2^fp16.initial_scale_power)"));
  TIER_RETURN_IF_ERROR(positive(min_scale, "min_scale (fp16.min_loss_scale)"));
  if (window < 1)
    return invalid_argument(str("loss scale: window ", window, " must be at least 1 (fp16.loss_scale_window)"));
  if (hysteresis < 1) {
    return invalid_argument(str("loss scale: hysteresis ", hysteresis, " must be at least 1 (fp16.hysteresis)"));
  }
  if (!std::isfinite(factor) || factor <= 1) {
    return invalid_argument(str("loss scale: factor ", factor, " must be finite and above 1"));
  }
  return {};
}

LossScaler::LossScaler(const LossScaleOptions& o) : options_(o) {
  state_.scale = !o.enabled ? 1.0 : (o.dynamic ? o.initial_scale : o.static_scale);
  state_.hysteresis_left = o.hysteresis;
}

Result<LossScaler> LossScaler::create(const LossScaleOptions& options) {
  TIER_RETURN_IF_ERROR(options.validate());
  return LossScaler(options);
}

double LossScaler::update(bool overflow) noexcept {
  if (!dynamic()) {
    ++state_.iteration;
    return state_.scale;
  }
  const LossScaleOptions& o = options_;
  LossScaleState& s = state_;
  if (overflow) {
    if (o.hysteresis == 1 || s.hysteresis_left <= 1) {
      s.scale = std::max(s.scale / o.factor, o.min_scale);
    } else {
      --s.hysteresis_left;
    }
    s.last_overflow = s.iteration;
  } else {
    if (o.consecutive_hysteresis) s.hysteresis_left = o.hysteresis;
    // Clean steps since the last overflow, this one excluded: grow after every full window.
    const std::int64_t clean = s.iteration - s.last_overflow - 1;
    if (clean > 0 && clean % o.window == 0) {
      if (!o.consecutive_hysteresis) s.hysteresis_left = o.hysteresis;
      s.scale *= o.factor;
    }
  }
  ++s.iteration;
  return s.scale;
}

Status LossScaler::restore(const LossScaleState& state) {
  if (!std::isfinite(state.scale) || state.scale <= 0) {
    return invalid_argument(str("loss scale state: scale ", state.scale, " must be finite and positive"));
  }
  if (state.iteration < 0 || state.last_overflow < -1 || state.hysteresis_left < 0) {
    return invalid_argument(str("loss scale state: iteration ", state.iteration, ", last overflow ",
                                state.last_overflow, " and hysteresis ", state.hysteresis_left,
                                " must not be negative"));
  }
  state_ = state;
  return {};
}

}  // namespace tier::optim
