// The step driver (include/tier/step_driver.hpp): named parameters over an OffloadedOptimizer,
// every input checked against its parameter before the optimizer sees it.
#include "tier/step_driver.hpp"

#include <cmath>
#include <nlohmann/json.hpp>
#include <thread>
#include <utility>

#include "optim/grad_accumulate.hpp"
#include "tier/comm.hpp"
#include "tier/cpu_kernels.hpp"
#include "tier/engine_step_io.hpp"
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

struct StepDriver::Session {
  StepArgs args;
  std::unique_ptr<EngineParamSink> sink;
  std::unique_ptr<EngineGradSource> grads;

  std::unique_ptr<CommunicatorNorm> comm_norm;

  Session(StepArgs a, const optim::OffloadedOptimizer& opt) : args(std::move(a)) {
    if (args.comm) comm_norm = std::make_unique<CommunicatorNorm>(*args.comm);
    if (args.engine) {
      sink = std::make_unique<EngineParamSink>(*args.engine->engine, args.engine->params, args.engine->offsets, opt);
      grads = std::make_unique<EngineGradSource>(*args.engine->engine, args.engine->grads);
    }
  }
  optim::StepOptions options() const {
    optim::StepOptions so;
    so.skip_missing_grads = args.skip_missing;
    so.destinations = args.outputs;
    so.sink = sink.get();
    so.grads = grads.get();
    so.norm = args.norm ? args.norm : comm_norm.get();
    return so;
  }
  // Releases the engine tensors a step left open (one that failed part way); the first error.
  Status close() { return sink ? sink->close() : Status::Ok(); }
};

struct StepDriver::Async {
  std::thread thread;
  std::unique_ptr<Session> session;
  Result<optim::StepReport> result{Status(StatusCode::kInternal, "no step")};
  Status closed;
  std::uint64_t applied_before = 0;  // the optimizer's steps applied when it started
  ~Async() {
    if (thread.joinable()) thread.join();
  }
};

Result<double> copy_grad(void* dst, const HostTensor& grad, std::uint64_t numel) {
  if (!is_param_dtype(grad.dtype)) {
    return invalid_argument(
        str("copy_grad: dtype ", dtype_name(grad.dtype), "; gradients are float32, bfloat16 or float16"));
  }
  return optim::detail::copy_grad(dst, cpu::ConstTensorRef(grad.data, grad.dtype, numel), nullptr);
}

Result<double> accumulate_grad(float* acc, const HostTensor& grad, std::uint64_t numel, bool first) {
  if (!is_param_dtype(grad.dtype)) {
    return invalid_argument(
        str("accumulate_grad: dtype ", dtype_name(grad.dtype), "; gradients are float32, bfloat16 or float16"));
  }
  double sumsq = 0;
  TIER_RETURN_IF_ERROR(
      optim::detail::accumulate_grad(acc, cpu::ConstTensorRef(grad.data, grad.dtype, numel), first, &sumsq, nullptr));
  return sumsq;
}

StepDriver::StepDriver(std::unique_ptr<optim::OffloadedOptimizer> opt) : opt_(std::move(opt)) {
  accumulation_steps_ = std::max(1, opt_->options().gradient_accumulation_steps);
}

StepDriver::~StepDriver() {
  async_.reset();    // joins a step on its thread
  cancel_overlap();  // stops a pass before what it writes to goes
}

Status StepDriver::idle(const char* what) const {
  if (async_) return failed_precondition(str(what, ": an asynchronous step is running; finish_async() first"));
  return Status::Ok();
}

Status StepDriver::not_owed(const char* what) const {
  if (!opt_->failed_step_owed()) return Status::Ok();
  return failed_precondition(str(what,
                                 ": the last step failed after part of the state took its update (state_copies 1 "
                                 "keeps one copy, so it is finished, not undone); call step() to finish it with the "
                                 "gradients it kept"));
}

Result<std::unique_ptr<StepDriver>> StepDriver::create(const EngineConfig& config, std::uint64_t max_elements,
                                                       std::uint64_t max_params) {
  TIER_ASSIGN_OR_RETURN(optim::OffloadedOptimizerOptions options,
                        optim::OffloadedOptimizerOptions::from_config(config, max_elements));
  options.max_partitions = max_params;
  return create(options);
}

Result<std::unique_ptr<StepDriver>> StepDriver::create(const optim::OffloadedOptimizerOptions& options) {
  return create(options, nullptr);
}

Result<std::unique_ptr<StepDriver>> StepDriver::create(const optim::OffloadedOptimizerOptions& options,
                                                       Engine* engine_masters) {
  optim::OffloadedOptimizerOptions o = options;
  std::unique_ptr<EngineMasterSource> masters;
  if (engine_masters != nullptr) {
    masters = std::make_unique<EngineMasterSource>(*engine_masters);
    o.master_source = masters.get();
  }
  TIER_ASSIGN_OR_RETURN(std::unique_ptr<optim::OffloadedOptimizer> opt, optim::OffloadedOptimizer::create(o));
  std::unique_ptr<StepDriver> d(new StepDriver(std::move(opt)));
  d->masters_ = std::move(masters);
  return d;
}

Status StepDriver::ensure_registered() {
  if (registered_) return Status::Ok();
  TIER_RETURN_IF_ERROR(opt_->finish_registration());
  registered_ = true;
  return Status::Ok();
}

Status StepDriver::finish_registration() {
  TIER_RETURN_IF_ERROR(idle("finish_registration"));
  return ensure_registered();
}

Status StepDriver::check_index(std::size_t index, const char* what) const {
  if (index >= params_.size()) {
    return invalid_argument(
        str(what, ": parameter index ", index, " is out of range (", params_.size(), " parameters were added)"));
  }
  return Status::Ok();
}

Result<std::size_t> StepDriver::add_param(const std::string& name, const HostTensor& initial, int group) {
  return add_param(name, initial, group, initial.dtype);
}

Result<std::uint64_t> StepDriver::check_new_param(const std::string& name, std::span<const std::int64_t> shape,
                                                  DType dtype, int group) const {
  TIER_RETURN_IF_ERROR(idle("add_param"));
  if (name.empty()) return invalid_argument("add_param: the name is empty");
  if (registered_) {
    return failed_precondition(str("add_param '", name,
                                   "': parameters are added before the first gradient or step (the state is laid "
                                   "out by then)"));
  }
  if (by_name_.count(name) != 0) {
    return Status(StatusCode::kAlreadyExists, str("add_param: a parameter named '", name, "' was already added"));
  }
  if (!is_param_dtype(dtype)) {
    return invalid_argument(
        str("add_param '", name, "': dtype ", dtype_name(dtype), "; parameters are float32, bfloat16 or float16"));
  }
  TIER_ASSIGN_OR_RETURN(std::uint64_t numel, numel_of(shape, str("add_param '", name, "'")));
  if (numel == 0) return invalid_argument(str("add_param '", name, "': shape ", shape_text(shape), " has no elements"));
  if (group < 0 || static_cast<std::size_t>(group) >= opt_->group_count()) {
    return invalid_argument(str("add_param '", name, "': group ", group, " does not exist (", opt_->group_count(),
                                " groups; add_group adds one)"));
  }
  return numel;
}

Result<std::size_t> StepDriver::note_param(const std::string& name, std::span<const std::int64_t> shape, DType dtype,
                                           std::uint64_t numel, int group, optim::PartitionId id) {
  if (id != params_.size()) return internal_error(str("add_param '", name, "': partition id ", id, " out of order"));
  params_.push_back(ParamInfo{name, std::vector<std::int64_t>(shape.begin(), shape.end()), dtype, numel, group});
  by_name_.emplace(name, params_.size() - 1);
  grads_in_.push_back(0);
  return params_.size() - 1;
}

Result<std::size_t> StepDriver::add_param(const std::string& name, const HostTensor& initial, int group, DType dtype) {
  if (masters_) {
    return invalid_argument(str("add_param '", name,
                                "': this driver keeps the masters in engine tensors (engine_masters); add the "
                                "parameter with add_engine_param"));
  }
  TIER_ASSIGN_OR_RETURN(std::uint64_t numel, check_new_param(name, initial.shape, dtype, group));
  if (!is_param_dtype(initial.dtype)) {
    return invalid_argument(str("add_param '", name, "': dtype ", dtype_name(initial.dtype),
                                "; parameters are float32, bfloat16 or float16"));
  }
  if (initial.data == nullptr) return invalid_argument(str("add_param '", name, "': no data"));
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
  spec.output = output_for(dtype);
  spec.initial = values;
  spec.name = name;
  TIER_ASSIGN_OR_RETURN(optim::PartitionId id, opt_->add_partition(spec));
  return note_param(name, initial.shape, dtype, numel, group, id);
}

Result<std::size_t> StepDriver::add_engine_param(const std::string& name, std::span<const std::int64_t> shape,
                                                 int group, TensorId tensor, std::uint64_t offset) {
  if (!masters_) {
    return invalid_argument(
        str("add_engine_param '", name, "': this driver keeps the masters itself (create it with engine_masters)"));
  }
  TIER_ASSIGN_OR_RETURN(std::uint64_t numel, check_new_param(name, shape, DType::kF32, group));
  TIER_RETURN_IF_ERROR(masters_->bind(static_cast<optim::PartitionId>(params_.size()), tensor, offset, numel)
                           .with_context(str("add_engine_param '", name, "'")));
  optim::PartitionSpec spec;
  spec.numel = numel;
  spec.group = group;
  spec.output = optim::ParamOutput::kF32;  // (the update is the params: nothing is delivered)
  spec.name = name;
  TIER_ASSIGN_OR_RETURN(optim::PartitionId id, opt_->add_partition(spec));
  return note_param(name, shape, DType::kF32, numel, group, id);
}

Result<int> StepDriver::add_group(double lr, double beta1, double beta2, double eps, double weight_decay) {
  TIER_ASSIGN_OR_RETURN(cpu::AdamHyperParams first, opt_->hyper_params(0));
  return add_group(lr, beta1, beta2, eps, weight_decay, first.decay_mode, first.bias_correction);
}

Result<int> StepDriver::add_group(double lr, double beta1, double beta2, double eps, double weight_decay,
                                  cpu::WeightDecayMode decay, bool bias_correction) {
  TIER_RETURN_IF_ERROR(idle("add_group"));
  TIER_ASSIGN_OR_RETURN(cpu::AdamHyperParams hp, opt_->hyper_params(0));  // the kind and its clamps
  hp.lr = lr;
  hp.beta1 = beta1;
  hp.beta2 = beta2;
  hp.eps = eps;
  hp.weight_decay = weight_decay;
  hp.decay_mode = decay;
  hp.bias_correction = bias_correction;
  if (hp.kind == cpu::OptimizerKind::kAdagrad) hp.decay_mode = cpu::WeightDecayMode::kL2;
  if (hp.kind == cpu::OptimizerKind::kLion) hp.decay_mode = cpu::WeightDecayMode::kDecoupled;
  TIER_RETURN_IF_ERROR(hp.validate());
  return opt_->add_group(hp);
}

Result<std::size_t> StepDriver::find(const std::string& name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return Status(StatusCode::kNotFound, str("no parameter named '", name, "'"));
  return it->second;
}

Status StepDriver::add_grad(std::size_t index, const HostTensor& grad, GradIntake intake) {
  TIER_RETURN_IF_ERROR(idle("add_grad"));
  TIER_RETURN_IF_ERROR(not_owed("add_grad"));
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

Status StepDriver::declare_grad(std::size_t index, double sumsq) {
  TIER_RETURN_IF_ERROR(idle("declare_grad"));
  TIER_RETURN_IF_ERROR(not_owed("declare_grad"));
  TIER_RETURN_IF_ERROR(check_index(index, "declare_grad"));
  const ParamInfo& p = params_[index];
  if (grads_in_[index] != 0) {
    return failed_precondition(str("declare_grad '", p.name, "': the parameter already has ", grads_in_[index],
                                   " gradient(s) this step; step() or clear_grads() first"));
  }
  TIER_RETURN_IF_ERROR(ensure_registered());
  TIER_RETURN_IF_ERROR(
      opt_->declare_grad(static_cast<optim::PartitionId>(index), sumsq).with_context(str("parameter '", p.name, "'")));
  // Its accumulation was the caller's: the whole step's worth at once, read once by the update.
  grads_in_[index] = accumulation_steps_;
  pending_grad_elements_ += p.numel;
  return Status::Ok();
}

void StepDriver::clear_grads() noexcept {
  if (async_) return;                    // (the asynchronous step's gradients are its own)
  if (opt_->failed_step_owed()) return;  // (state_copies 1: the step owed needs them; step() finishes it)
  opt_->clear_grads();                   // (cancels an overlapped step: its pass stops before what it writes to goes)
  overlap_started_ = false;
  overlap_.reset();
  pending_intake_elements_ = 0;
  pending_grad_elements_ = 0;
  std::fill(grads_in_.begin(), grads_in_.end(), 0);
}

Status StepDriver::check_grads_complete(const StepArgs& args) const {
  const bool none_is_fine = args.skip_missing || args.zero_missing;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (grads_in_[i] == accumulation_steps_ || (none_is_fine && grads_in_[i] == 0)) continue;
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
  if (args.comm && args.norm) {
    return invalid_argument("step: comm and norm together (the norm across ranks is reduced one way)");
  }
  if (args.skip_missing && args.zero_missing) {
    return invalid_argument("step: skip_missing and zero_missing together (a missing gradient is one or the other)");
  }
  if (args.engine) {
    const EngineTargets& t = *args.engine;
    if (t.engine == nullptr) return invalid_argument("step: engine targets without an engine");
    const std::pair<const char*, std::size_t> lists[] = {
        {"params", t.params.size()}, {"offsets", t.offsets.size()}, {"grads", t.grads.size()}};
    for (const auto& [what, n] : lists) {
      if (n != 0 && n != params_.size()) {
        return invalid_argument(str("step: engine targets: ", n, " ", what, " for ", params_.size(),
                                    " parameters (one per parameter, or none)"));
      }
    }
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

Result<optim::StepReport> StepDriver::run_step(Session& session) {
  Result<optim::StepReport> r = opt_->step(session.options());
  Status closed = session.close();
  if (!r.ok()) return r;
  if (!closed.ok()) return closed;  // (applied, its outputs not all delivered: outputs_stale says so)
  return r;
}

Result<optim::StepReport> StepDriver::step(const StepArgs& args) {
  TIER_RETURN_IF_ERROR(idle("step"));
  if (overlap_started_ && opt_->overlapped_step_running()) {
    return failed_precondition("step: an overlapped step is running; finish_overlap() or cancel_overlap() first");
  }
  TIER_RETURN_IF_ERROR(check_step_args(args));
  TIER_RETURN_IF_ERROR(check_grads_complete(args));
  TIER_RETURN_IF_ERROR(apply_lr(args));
  Session session(args, *opt_);
  const std::uint64_t applied_before = opt_->steps_applied();
  Result<optim::StepReport> r = run_step(session);
  book(r, applied_before);
  return r;
}

void StepDriver::book(const Result<optim::StepReport>& r, std::uint64_t applied_before) {
  if (masters_) masters_->drop_hints();  // (a step that failed may not have taken what it hinted)
  // An error after the update was committed (its outputs not all delivered) consumed the
  // gradients all the same.
  if (r.ok() || opt_->steps_applied() != applied_before) after_step(r.ok() ? *r : optim::StepReport{});
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
  TIER_RETURN_IF_ERROR(idle("start_overlap"));
  if (overlap_started_ && opt_->overlapped_step_running()) {
    return failed_precondition("start_overlap: an overlapped step is already running");
  }
  TIER_RETURN_IF_ERROR(check_step_args(args));
  TIER_RETURN_IF_ERROR(apply_lr(args));
  overlap_.reset();  // one that clear_grads() or an error stopped
  auto session = std::make_unique<Session>(args, *opt_);
  optim::StepOptions so = session->options();
  // Host outputs of a dropped pass are the caller's staging, which it discards with the pass;
  // engine tensors are where the training reads its params, so the committed ones go back.
  so.redeliver_abandoned_outputs = args.engine.has_value();
  TIER_RETURN_IF_ERROR(opt_->start_overlapped_step(so));
  overlap_ = std::move(session);  // (kept until the pass is finished or cancelled)
  overlap_started_ = true;
  return Status::Ok();
}

Result<optim::StepReport> StepDriver::finish_overlap() {
  TIER_RETURN_IF_ERROR(idle("finish_overlap"));
  if (!overlap_started_ || !opt_->overlapped_step_running()) {
    overlap_started_ = false;
    overlap_.reset();
    return failed_precondition("finish_overlap: no overlapped step is running");
  }
  TIER_RETURN_IF_ERROR(check_grads_complete(overlap_->args));
  const std::uint64_t applied_before = opt_->steps_applied();
  Result<optim::StepReport> r = opt_->finish_overlapped_step();
  std::unique_ptr<Session> session = std::move(overlap_);
  overlap_started_ = false;
  const Status closed = session->close();
  book(r, applied_before);
  if (r.ok() && !closed.ok()) return closed;
  return r;
}

void StepDriver::cancel_overlap() noexcept {
  if (!overlap_started_ || async_) return;
  opt_->cancel_overlapped_step();  // (its pass has stopped when this returns)
  overlap_started_ = false;
  if (overlap_) overlap_->close().ignore();
  overlap_.reset();
}

Status StepDriver::start_async(const StepArgs& args) {
  TIER_RETURN_IF_ERROR(idle("start_async"));
  if (masters_) {
    return failed_precondition(
        "start_async: the masters are the engine's parameter tensors (engine_masters), which the next forward reads "
        "while an asynchronous step would write them; use step() or start_overlap()");
  }
  if (overlap_started_ && opt_->overlapped_step_running()) {
    return failed_precondition(
        "start_async: an overlapped step is running; finish_overlap() or cancel_overlap() first");
  }
  TIER_RETURN_IF_ERROR(check_step_args(args));
  TIER_RETURN_IF_ERROR(check_grads_complete(args));
  TIER_RETURN_IF_ERROR(apply_lr(args));
  auto a = std::make_unique<Async>();
  a->session = std::make_unique<Session>(args, *opt_);
  a->applied_before = opt_->steps_applied();
  Async* raw = a.get();
  optim::OffloadedOptimizer* opt = opt_.get();
  // The thread runs the optimizer's step alone: the driver's own books are kept by
  // finish_async, on the caller's thread.
  raw->thread = std::thread([raw, opt] {
    raw->result = opt->step(raw->session->options());
    raw->closed = raw->session->close();
  });
  async_ = std::move(a);
  return Status::Ok();
}

Result<optim::StepReport> StepDriver::finish_async() {
  if (!async_) return failed_precondition("finish_async: no asynchronous step is running");
  std::unique_ptr<Async> a = std::move(async_);
  a->thread.join();
  book(a->result, a->applied_before);
  if (a->result.ok() && !a->closed.ok()) return a->closed;
  return std::move(a->result);
}

bool StepDriver::outputs_stale() const noexcept {
  return opt_->outputs_stale();
}

void StepDriver::outputs_rewritten() noexcept {
  if (!async_) opt_->outputs_rewritten();
}

bool StepDriver::overlap_running() const noexcept {
  return overlap_started_ && opt_->overlapped_step_running();
}

Status StepDriver::set_hyper_params(int group, double lr, double beta1, double beta2, double eps, double weight_decay) {
  TIER_RETURN_IF_ERROR(idle("set_hyper_params"));
  TIER_ASSIGN_OR_RETURN(cpu::AdamHyperParams hp, opt_->hyper_params(group));
  hp.lr = lr;
  hp.beta1 = beta1;
  hp.beta2 = beta2;
  hp.eps = eps;
  hp.weight_decay = weight_decay;
  TIER_RETURN_IF_ERROR(hp.validate().with_context(str("optimizer group ", group)));
  return opt_->set_hyper_params(group, hp);
}

Status StepDriver::set_lr(int group, double lr) {
  TIER_RETURN_IF_ERROR(idle("set_lr"));
  return opt_->set_lr(group, lr);
}

Result<cpu::AdamHyperParams> StepDriver::hyper_params(int group) const {
  return opt_->hyper_params(group);
}

std::size_t StepDriver::group_count() const noexcept {
  return opt_->group_count();
}

Status StepDriver::read_param(std::size_t index, DType dtype, void* dst) {
  TIER_RETURN_IF_ERROR(idle("read_param"));
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
  return read_state(index, kind, dst, 0, params_[index].numel);
}

Status StepDriver::write_state(std::size_t index, optim::StateKind kind, const float* src) {
  TIER_RETURN_IF_ERROR(check_index(index, "write_state"));
  return write_state(index, kind, src, 0, params_[index].numel);
}

Status StepDriver::read_state(std::size_t index, optim::StateKind kind, float* dst, std::uint64_t offset,
                              std::uint64_t count) {
  TIER_RETURN_IF_ERROR(idle("read_state"));
  TIER_RETURN_IF_ERROR(check_index(index, "read_state"));
  TIER_RETURN_IF_ERROR(ensure_registered());
  return opt_->read_state(static_cast<optim::PartitionId>(index), kind, dst, offset, count);
}

Status StepDriver::write_state(std::size_t index, optim::StateKind kind, const float* src, std::uint64_t offset,
                               std::uint64_t count) {
  TIER_RETURN_IF_ERROR(idle("write_state"));
  TIER_RETURN_IF_ERROR(check_index(index, "write_state"));
  TIER_RETURN_IF_ERROR(ensure_registered());
  return opt_->write_state(static_cast<optim::PartitionId>(index), kind, src, offset, count);
}

Result<std::int64_t> StepDriver::group_step(int group) const {
  TIER_RETURN_IF_ERROR(idle("group_step"));
  return opt_->group_step(group);
}

Status StepDriver::set_group_step(int group, std::int64_t step) {
  TIER_RETURN_IF_ERROR(idle("set_group_step"));
  return opt_->set_group_step(group, step);
}

Status StepDriver::save(const std::string& path) {
  TIER_RETURN_IF_ERROR(idle("save"));
  TIER_RETURN_IF_ERROR(ensure_registered());
  return opt_->save_checkpoint(path);
}

Status StepDriver::load(const std::string& path, const std::function<Status()>& before_commit) {
  TIER_RETURN_IF_ERROR(idle("load"));
  TIER_RETURN_IF_ERROR(ensure_registered());
  TIER_RETURN_IF_ERROR(opt_->load_checkpoint(path, before_commit));
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
  j["shared_swap"] = s.shared_swap;
  j["io_registered_bytes"] = s.io_registered_bytes;
  j["step"] = s.step;
  j["steps_applied"] = s.steps_applied;
  j["steps_skipped"] = s.steps_skipped;
  j["steps_failed"] = s.steps_failed;
  j["state_copies"] = s.state_copies;
  j["spare_slots"] = s.spare_slots;
  j["spare_bytes"] = s.spare_bytes;
  j["failed_step_owed"] = s.failed_step_owed;
  j["loss_scale"] = opt_->loss_scale();
  j["gradient_accumulation_steps"] = accumulation_steps_;
  j["host_passes_per_grad_element"] = host_passes_per_grad_element();
  return j.dump();
}

}  // namespace tier::step
