// OffloadedOptimizerOptions::from_config: what a DeepSpeed-style EngineConfig asks of the
// offloaded optimizer.
#include <algorithm>

#include "optim/optimizer_impl.hpp"
#include "tier/offloaded_optimizer.hpp"

namespace tier::optim {

Result<OffloadedOptimizerOptions> OffloadedOptimizerOptions::from_config(const EngineConfig& config,
                                                                         std::uint64_t max_elements,
                                                                         Counters* counters) {
  OffloadedOptimizerOptions o;
  const OffloadOptimizerConfig& oo = config.offload_optimizer;
  o.home = oo.device == OffloadDevice::kNvme ? StateHome::kNvme : StateHome::kHost;
  o.max_elements = max_elements;
  o.buffer_count = static_cast<unsigned>(std::max(1, oo.buffer_count));
  o.buffer_bytes = config.tier.optimizer.buffer_bytes;
  // Not given, with an explicit host budget: the buffers take at most an eighth of it (they are
  // reserved inside it when the optimizer serves an engine), so that a small budget still leaves
  // the parameters room; an auto budget keeps the default (256 MiB at most).
  if (o.buffer_bytes == 0 && config.tier.host_budget != 0) {
    o.buffer_bytes = std::min<std::uint64_t>(256ull << 20, config.tier.host_budget / 8);
  }
  o.chunk_elements = config.tier.optimizer.chunk_elements;
  o.state_copies = static_cast<unsigned>(config.tier.optimizer.state_copies);
  o.speculation_chunks = static_cast<unsigned>(config.tier.optimizer.speculation_chunks);
  switch (config.tier.optimizer.state_dtype) {
    case OptimizerStateDType::kFp32: o.state_dtype = cpu::StateDType::kF32; break;
    case OptimizerStateDType::kBf16: o.state_dtype = cpu::StateDType::kBF16; break;
    case OptimizerStateDType::kInt8: o.state_dtype = cpu::StateDType::kInt8; break;
  }
  // zero_optimization.sub_group_size bounds the elements one optimizer pass handles at a time.
  const std::uint64_t cap = std::max<std::uint64_t>(
      detail::kSectionAlign, config.sub_group_size / detail::kSectionAlign * detail::kSectionAlign);
  if (o.chunk_elements == 0) {
    const std::uint64_t budget = o.buffer_bytes ? o.buffer_bytes : (256ull << 20);
    const std::uint64_t auto_chunk = budget / o.buffer_count / 16 / detail::kSectionAlign * detail::kSectionAlign;
    if (auto_chunk > cap) o.chunk_elements = cap;
  } else {
    o.chunk_elements = std::min(o.chunk_elements, cap);
  }

  cpu::AdamHyperParams hp;
  hp.lr = config.optimizer.lr;
  hp.beta1 = config.optimizer.beta1;
  hp.beta2 = config.optimizer.beta2;
  hp.eps = config.optimizer.eps;
  hp.weight_decay = config.optimizer.weight_decay;
  hp.bias_correction = config.optimizer.bias_correction;
  hp.decay_mode = config.optimizer.type == OptimizerType::kAdamW || config.optimizer.decoupled_weight_decay
                      ? cpu::WeightDecayMode::kDecoupled
                      : cpu::WeightDecayMode::kL2;
  switch (config.optimizer.type) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW: hp.kind = cpu::OptimizerKind::kAdam; break;
    case OptimizerType::kAdagrad:
      hp.kind = cpu::OptimizerKind::kAdagrad;
      hp.decay_mode = cpu::WeightDecayMode::kL2;  // Adagrad's decay is always L2
      break;
    case OptimizerType::kLion:
      hp.kind = cpu::OptimizerKind::kLion;
      hp.decay_mode = cpu::WeightDecayMode::kDecoupled;
      break;
    case OptimizerType::kLamb: hp.kind = cpu::OptimizerKind::kLamb; break;
  }
  hp.max_coeff = config.optimizer.max_coeff;
  hp.min_coeff = config.optimizer.min_coeff;
  o.groups = {hp};
  if (hp.kind == cpu::OptimizerKind::kLamb && o.state_dtype != cpu::StateDType::kF32) {
    return invalid_argument(str("optimizer: tier.optimizer.state_dtype ", cpu::state_dtype_name(o.state_dtype),
                                " is not supported with optimizer.type Lamb (its norms pass needs fp32 moments); ",
                                "use fp32"));
  }
  o.max_grad_norm = config.gradient_clipping;
  o.loss_scale = LossScaleOptions::from_config(config.fp16);
  o.gradient_accumulation_steps = config.gradient_accumulation_steps;
  o.threads = config.tier.optimizer_threads;
  o.counters = counters;
  if (o.home == StateHome::kNvme) {
    o.swap_options = nvme::SwapSpaceOptions::from_config(config, 0, nullptr, counters);
    if (o.swap_options.paths.empty()) {
      return invalid_argument(
          "optimizer: zero_optimization.offload_optimizer.device is nvme but no path is given; set "
          "offload_optimizer.nvme_path or tier.swap_paths");
    }
  }
  return o;
}

}  // namespace tier::optim
