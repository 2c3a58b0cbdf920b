// The step driver (include/tier/step_driver.hpp): named parameters over an OffloadedOptimizer,
// every input checked against its parameter before the optimizer sees it.
#include "tier/step_driver.hpp"

#include <cmath>
#include <nlohmann/json.hpp>
#include <utility>

#include "tier/cpu_kernels.hpp"
#include "tier/log.hpp"

namespace tier::step {

namespace {

bool is_param_dtype(DType d) noexcept {
  return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16;
}

optim::ParamOutput output_for(DType d) noexcept {
  switch (d) {
    case DType::kBF16: return optim::ParamOutput::kBF16;
    case DType::kF16: return optim::ParamOutput::kF16;
    default: return optim::ParamOutput::kF32;
  }
}

std::string shape_text(std::span<const std::int64_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

// The elements of a shape; kInvalidArgument for a negative dimension.
Result<std::uint64_t> numel_of(std::span<const std::int64_t> shape, const std::string& what) {
  std::uint64_t n = 1;
  for (std::int64_t d : shape) {
    if (d < 0) return invalid_argument(str(what, ": shape ", shape_text(shape), " has a negative dimension"));
    n *= static_cast<std::uint64_t>(d);
  }
  return n;
}

}  // namespace

StepDriver::StepDriver(std::unique_ptr<optim::OffloadedOptimizer> opt) : opt_(std::move(opt)) {
  accumulation_steps_ = std::max(1, opt_->options().gradient_accumulation_steps);
}

StepDriver::~StepDriver() = default;

Result<std::unique_ptr<StepDriver>> StepDriver::create(const EngineConfig& config, std::uint64_t max_elements,
                                                       std::uint64_t max_params) {
  TIER_ASSIGN_OR_RETURN(optim::OffloadedOptimizerOptions options,
                        optim::OffloadedOptimizerOptions::from_config(config, max_elements));
  options.max_partitions = max_params;
  TIER_ASSIGN_OR_RETURN(std::unique_ptr<optim::OffloadedOptimizer> opt, optim::OffloadedOptimizer::create(options));
  return std::unique_ptr<StepDriver>(new StepDriver(std::move(opt)));
}

Status StepDriver::ensure_registered() {
  if (registered_) return Status::Ok();
  TIER_RETURN_IF_ERROR(opt_->finish_registration());
  registered_ = true;
  return Status::Ok();
}

Status StepDriver::check_index(std::size_t index, const char* what) const {
  if (index >= params_.size()) {
    return invalid_argument(
        str(what, ": parameter index ", index, " is out of range (", params_.size(), " parameters were added)"));
  }
  return Status::Ok();
}

Result<std::size_t> StepDriver::add_param(const std::string& name, const HostTensor& initial, int group) {
  if (name.empty()) return invalid_argument("add_param: the name is empty");
  if (registered_) {
    return failed_precondition(str("add_param '", name,
                                   "': parameters are added before the first gradient or step (the state is laid "
                                   "out by then)"));
  }
  if (by_name_.count(name) != 0) {
    return Status(StatusCode::kAlreadyExists, str("add_param: a parameter named '", name, "' was already added"));
  }
  if (!is_param_dtype(initial.dtype)) {
    return invalid_argument(str("add_param '", name, "': dtype ", dtype_name(initial.dtype),
                                "; parameters are float32, bfloat16 or float16"));
  }
  TIER_ASSIGN_OR_RETURN(std::uint64_t numel, numel_of(initial.shape, str("add_param '", name, "'")));
  if (numel == 0)
    return invalid_argument(str("add_param '", name, "': shape ", shape_text(initial.shape), " has no elements"));
  if (initial.data == nullptr) return invalid_argument(str("add_param '", name, "': no data"));
  if (group < 0 || static_cast<std::size_t>(group) >= opt_->group_count()) {
    return invalid_argument(str("add_param '", name, "': group ", group, " does not exist (", opt_->group_count(),
                                " groups; add_group adds one)"));
  }
  std::vector<float> widened;
  const float* values = static_cast<const float*>(initial.data);
  if (initial.dtype != DType::kF32) {
    widened.resize(numel);
    TIER_RETURN_IF_ERROR(cpu::convert(cpu::ConstTensorRef(initial.data, initial.dtype, numel),
                                      cpu::TensorRef{widened.data(), DType::kF32, numel}));
    values = widened.data();
  }
  optim::PartitionSpec spec;
  spec.numel = numel;
  spec.group = group;
  spec.output = output_for(initial.dtype);
  spec.initial = values;
  spec.name = name;
  TIER_ASSIGN_OR_RETURN(optim::PartitionId id, opt_->add_partition(spec));
  if (id != params_.size()) return internal_error(str("add_param '", name, "': partition id ", id, " out of order"));
  params_.push_back(ParamInfo{name, std::vector<std::int64_t>(initial.shape.begin(), initial.shape.end()),
                              initial.dtype, numel, group});
  by_name_.emplace(name, params_.size() - 1);
  grads_in_.push_back(0);
  return params_.size() - 1;
}

Result<int> StepDriver::add_group(double lr, double beta1, double beta2, double eps, double weight_decay) {
  TIER_ASSIGN_OR_RETURN(cpu::AdamHyperParams hp, opt_->hyper_params(0));
  hp.lr = lr;
  hp.beta1 = beta1;
  hp.beta2 = beta2;
  hp.eps = eps;
  hp.weight_decay = weight_decay;
  TIER_RETURN_IF_ERROR(hp.validate());
  return opt_->add_group(hp);
}

Result<std::size_t> StepDriver::find(const std::string& name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return Status(StatusCode::kNotFound, str("no parameter named '", name, "'"));
  return it->second;
}

Status StepDriver::add_grad(std::size_t index, const HostTensor& grad, GradIntake intake) {
  TIER_RETURN_IF_ERROR(check_index(index, "add_grad"));
  const ParamInfo& p = params_[index];
  if (!is_param_dtype(grad.dtype)) {
    return invalid_argument(str("add_grad '", p.name, "': gradient dtype ", dtype_name(grad.dtype),
                                "; gradients are float32, bfloat16 or float16"));
  }
  const bool same_shape =
      grad.shape.size() == p.shape.size() && std::equal(grad.shape.begin(), grad.shape.end(), p.shape.begin());
  if (!same_shape) {
    return invalid_argument(str("add_grad '", p.name, "': gradient shape ", shape_text(grad.shape),
                                " is not the parameter's ", shape_text(p.shape)));
  }
  if (grad.data == nullptr) return invalid_argument(str("add_grad '", p.name, "': no data"));
  if (grads_in_[index] >= accumulation_steps_) {
    return failed_precondition(str("add_grad '", p.name, "': already has ", grads_in_[index],
                                   " gradient(s) this step, gradient_accumulation_steps is ", accumulation_steps_,
                                   "; step() or clear_grads() first"));
  }
  if (intake == GradIntake::kBorrow && accumulation_steps_ != 1) {
    return invalid_argument(str("add_grad '", p.name,
                                "': a borrowed gradient is the step's whole gradient; with "
                                "gradient_accumulation_steps ",
                                accumulation_steps_, " hand micro-steps in as copies"));
  }
  TIER_RETURN_IF_ERROR(ensure_registered());
  const optim::GradMode mode = intake == GradIntake::kBorrow ? optim::GradMode::kBorrow : optim::GradMode::kCopy;
  TIER_RETURN_IF_ERROR(opt_->add_grad(static_cast<optim::PartitionId>(index),
                                      cpu::ConstTensorRef(grad.data, grad.dtype, p.numel), mode));
  ++grads_in_[index];
  pending_grad_elements_ += p.numel;
  // A copy reads the gradient and adds it into the accumulator (sum of squares fused): one pass.
  // A borrowed one is read by the update alone.
  if (intake == GradIntake::kCopy) pending_intake_elements_ += p.numel;
  return Status::Ok();
}

void StepDriver::clear_grads() noexcept {
  opt_->clear_grads();  // (cancels an overlapped step)
  overlap_started_ = false;
  overlap_args_ = {};
  pending_intake_elements_ = 0;
  pending_grad_elements_ = 0;
  std::fill(grads_in_.begin(), grads_in_.end(), 0);
}

Status StepDriver::check_grads_complete(bool skip_missing) const {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (grads_in_[i] == accumulation_steps_ || (skip_missing && grads_in_[i] == 0)) continue;
    return failed_precondition(str("step: parameter '", params_[i].name, "' has ", grads_in_[i], " gradient(s) of the ",
                                   accumulation_steps_,
                                   " this step needs (gradient_accumulation_steps); nothing was applied"));
  }
  return Status::Ok();
}

Status StepDriver::check_step_args(const StepArgs& args) const {
  if (params_.empty()) return failed_precondition("step: no parameters were added");
  if (args.lr && (!std::isfinite(*args.lr) || *args.lr < 0)) {
    return invalid_argument(str("step: lr ", *args.lr, " is not a finite number >= 0; nothing was applied"));
  }
  if (!args.outputs.empty() && args.outputs.size() != params_.size()) {
    return invalid_argument(str("step: ", args.outputs.size(), " outputs for ", params_.size(),
                                " parameters (give one per parameter, null to skip one, or none)"));
  }
  return Status::Ok();
}

Status StepDriver::apply_lr(const StepArgs& args) {
  TIER_RETURN_IF_ERROR(ensure_registered());
  if (!args.lr) return Status::Ok();
  for (std::size_t g = 0; g < opt_->group_count(); ++g) {
    TIER_RETURN_IF_ERROR(opt_->set_lr(static_cast<int>(g), *args.lr));
  }
  return Status::Ok();
}

Result<optim::StepReport> StepDriver::step(const StepArgs& args) {
  if (overlap_started_ && opt_->overlapped_step_running()) {
    return failed_precondition("step: an overlapped step is running; finish_overlap() or cancel_overlap() first");
  }
  TIER_RETURN_IF_ERROR(check_step_args(args));
  TIER_RETURN_IF_ERROR(check_grads_complete(args.skip_missing));
  TIER_RETURN_IF_ERROR(apply_lr(args));
  optim::StepOptions so;
  so.skip_missing_grads = args.skip_missing;
  so.destinations = args.outputs;
  TIER_ASSIGN_OR_RETURN(optim::StepReport report, opt_->step(so));
  after_step(report);
  return report;
}

void StepDriver::after_step(const optim::StepReport& report) {
  std::uint64_t stepped = 0;  // elements of the parameters that had gradients (the update read theirs)
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (grads_in_[i] > 0) stepped += params_[i].numel;
  }
  grad_elements_ += pending_grad_elements_;
  grad_passes_elements_ += pending_intake_elements_ + stepped;  // the intakes; the update reads each once
  // A norm computed at step() is one more pass over those accumulators; count it (as the whole
  // step: the report gives partitions, not elements) so that the figure never understates.
  if (report.late_norm_partitions != 0) grad_passes_elements_ += stepped;
  pending_intake_elements_ = 0;
  pending_grad_elements_ = 0;
  std::fill(grads_in_.begin(), grads_in_.end(), 0);
}

Status StepDriver::start_overlap(const StepArgs& args) {
  if (overlap_started_ && opt_->overlapped_step_running()) {
    return failed_precondition("start_overlap: an overlapped step is already running");
  }
  TIER_RETURN_IF_ERROR(check_step_args(args));
  TIER_RETURN_IF_ERROR(apply_lr(args));
  overlap_args_ = args;
  optim::StepOptions so;
  so.skip_missing_grads = args.skip_missing;
  so.redeliver_abandoned_outputs = false;   // the outputs of a dropped pass are the caller's staging
  so.destinations = overlap_args_.outputs;  // (kept until the pass is finished or cancelled)
  if (Status s = opt_->start_overlapped_step(so); !s.ok()) {
    overlap_args_ = {};
    return s;
  }
  overlap_started_ = true;
  return Status::Ok();
}

Result<optim::StepReport> StepDriver::finish_overlap() {
  if (!overlap_started_ || !opt_->overlapped_step_running()) {
    overlap_started_ = false;
    return failed_precondition("finish_overlap: no overlapped step is running");
  }
  TIER_RETURN_IF_ERROR(check_grads_complete(overlap_args_.skip_missing));
  Result<optim::StepReport> r = opt_->finish_overlapped_step();
  overlap_started_ = false;
  overlap_args_ = {};
  if (r.ok()) after_step(*r);
  return r;
}

void StepDriver::cancel_overlap() noexcept {
  if (!overlap_started_) return;
  opt_->cancel_overlapped_step();
  overlap_started_ = false;
  overlap_args_ = {};
}

bool StepDriver::overlap_running() const noexcept {
  return overlap_started_ && opt_->overlapped_step_running();
}

Status StepDriver::set_hyper_params(int group, double lr, double beta1, double beta2, double eps, double weight_decay) {
  TIER_ASSIGN_OR_RETURN(cpu::AdamHyperParams hp, opt_->hyper_params(group));
  hp.lr = lr;
  hp.beta1 = beta1;
  hp.beta2 = beta2;
  hp.eps = eps;
  hp.weight_decay = weight_decay;
  TIER_RETURN_IF_ERROR(hp.validate().with_context(str("optimizer group ", group)));
  return opt_->set_hyper_params(group, hp);
}

Result<cpu::AdamHyperParams> StepDriver::hyper_params(int group) const {
  return opt_->hyper_params(group);
}

std::size_t StepDriver::group_count() const noexcept {
  return opt_->group_count();
}

Status StepDriver::read_param(std::size_t index, DType dtype, void* dst) {
  TIER_RETURN_IF_ERROR(check_index(index, "read_param"));
  if (!is_param_dtype(dtype)) {
    return invalid_argument(
        str("read_param '", params_[index].name, "': dtype ", dtype_name(dtype), "; use float32, bfloat16 or float16"));
  }
  TIER_RETURN_IF_ERROR(ensure_registered());
  return opt_->read_params(static_cast<optim::PartitionId>(index), dtype, dst);
}

Status StepDriver::read_state(std::size_t index, optim::StateKind kind, float* dst) {
  TIER_RETURN_IF_ERROR(check_index(index, "read_state"));
  TIER_RETURN_IF_ERROR(ensure_registered());
  return opt_->read_state(static_cast<optim::PartitionId>(index), kind, dst, 0, params_[index].numel);
}

Status StepDriver::write_state(std::size_t index, optim::StateKind kind, const float* src) {
  TIER_RETURN_IF_ERROR(check_index(index, "write_state"));
  TIER_RETURN_IF_ERROR(ensure_registered());
  return opt_->write_state(static_cast<optim::PartitionId>(index), kind, src, 0, params_[index].numel);
}

Result<std::int64_t> StepDriver::group_step(int group) const {
  return opt_->group_step(group);
}

Status StepDriver::set_group_step(int group, std::int64_t step) {
  return opt_->set_group_step(group, step);
}

Status StepDriver::save(const std::string& path) {
  TIER_RETURN_IF_ERROR(ensure_registered());
  return opt_->save_checkpoint(path);
}

Status StepDriver::load(const std::string& path) {
  TIER_RETURN_IF_ERROR(ensure_registered());
  TIER_RETURN_IF_ERROR(opt_->load_checkpoint(path));
  clear_grads();  // a load drops the gradients taken so far
  return Status::Ok();
}

double StepDriver::loss_scale() const noexcept {
  return opt_->loss_scale();
}

double StepDriver::host_passes_per_grad_element() const noexcept {
  return grad_elements_ == 0 ? 0.0 : static_cast<double>(grad_passes_elements_) / static_cast<double>(grad_elements_);
}

std::string StepDriver::stats_json() const {
  const optim::OptimizerStats s = opt_->stats();
  nlohmann::json j;
  j["home"] = optim::state_home_name(s.home);
  j["params"] = params_.size();
  j["partitions"] = params_.size();
  j["elements"] = s.elements;
  j["state_dtype"] = cpu::state_dtype_name(s.state_dtype);
  j["record_bytes"] = s.record_bytes;
  j["chunks"] = s.chunks;
  j["chunk_elements"] = s.chunk_elements;
  j["buffer_count"] = s.buffer_count;
  j["pinned_bytes"] = s.pinned_bytes;
  j["accumulator_bytes"] = s.accumulator_bytes;
  j["host_state_bytes"] = s.host_state_bytes;
  j["nvme_bytes"] = s.nvme_bytes;
  j["nvme_capacity_bytes"] = s.nvme_capacity_bytes;
  j["nvme_allocated_bytes"] = s.nvme_allocated_bytes;
  j["io_registered_bytes"] = s.io_registered_bytes;
  j["step"] = s.step;
  j["steps_applied"] = s.steps_applied;
  j["steps_skipped"] = s.steps_skipped;
  j["steps_failed"] = s.steps_failed;
  j["loss_scale"] = opt_->loss_scale();
  j["gradient_accumulation_steps"] = accumulation_steps_;
  j["host_passes_per_grad_element"] = host_passes_per_grad_element();
  return j.dump();
}

}  // namespace tier::step
