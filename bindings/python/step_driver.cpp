// tier._tier.StepDriver: the step driver (tier/step_driver.hpp) for Python: tier.jax,
// tier.torch.OffloadedAdamW and tier.torch's engine. Arrays come in as anything nanobind takes as
// a C-contiguous CPU ndarray (numpy, a torch CPU tensor, or an object with __dlpack__ such as a
// jax CPU array), read in place; updated params are written into the caller's arrays, or into
// engine tensors (the engine's steps). A bf16/fp16 parameter's output may also be a uint16 array
// of its shape (the raw bits), for numpy without a bfloat16 dtype. Every call releases the GIL
// while the driver runs.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "binding_util.hpp"
#include "tier/cpu_kernels.hpp"
#include "tier/engine.hpp"
#include "tier/engine_step_io.hpp"
#include "tier/ext/fault_injecting_engine.hpp"
#include "tier/step_driver.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace tier::python {

namespace {

using step::StepDriver;

// The dtype of an array: float32, float16, bfloat16; uint16 as `bits_of` (a bf16/fp16 param's
// raw bits) when given; anything else is reported as the code and bits it has.
Result<DType> dtype_from(const nb::dlpack::dtype& d, std::optional<DType> bits_of, const std::string& what) {
  using Code = nb::dlpack::dtype_code;
  if (d.lanes == 1 && d.code == static_cast<std::uint8_t>(Code::Float) && d.bits == 32) return DType::kF32;
  if (d.lanes == 1 && d.code == static_cast<std::uint8_t>(Code::Float) && d.bits == 16) return DType::kF16;
  if (d.lanes == 1 && d.code == static_cast<std::uint8_t>(Code::Bfloat) && d.bits == 16) return DType::kBF16;
  if (bits_of && d.lanes == 1 && d.code == static_cast<std::uint8_t>(Code::UInt) && d.bits == 16) return *bits_of;
  const char* kinds[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
  const char* kind = d.code < 7 ? kinds[d.code] : "unknown";
  return invalid_argument(
      str(what, ": dtype ", kind, static_cast<int>(d.bits), " is not float32, bfloat16 or float16"));
}

struct InArray {
  nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu> a;
  std::vector<std::int64_t> shape;
  step::HostTensor view(DType dtype) const { return {a.data(), dtype, {shape.data(), shape.size()}}; }
};

InArray in_array(nb::handle obj, const std::string& what) {
  InArray in;
  if (!nb::try_cast(obj, in.a)) {
    raise_status(invalid_argument(str(what, ": expected a C-contiguous CPU array (numpy, or a CPU jax/torch array)")));
  }
  for (std::size_t i = 0; i < in.a.ndim(); ++i) in.shape.push_back(static_cast<std::int64_t>(in.a.shape(i)));
  return in;
}

// A writable array for parameter `index`: its shape, and `want` (or raw uint16 bits of it when the
// param is 16-bit); returns the data pointer.
void* out_array(StepDriver& d, std::size_t index, nb::handle obj, std::optional<DType> want, const char* what,
                DType* got = nullptr) {
  const step::ParamInfo& p = d.param(index);
  nb::ndarray<nb::c_contig, nb::device::cpu> a;
  if (!nb::try_cast(obj, a, /*convert=*/false)) {  // (a converted copy would take the values, not `obj`)
    raise_status(invalid_argument(str(what, " of '", p.name, "': expected a writable C-contiguous CPU numpy array")));
  }
  std::vector<std::int64_t> shape;
  for (std::size_t i = 0; i < a.ndim(); ++i) shape.push_back(static_cast<std::int64_t>(a.shape(i)));
  if (shape != p.shape) {
    raise_status(invalid_argument(str(what, " of '", p.name, "': ", shape.size(), " dimensions / ", a.size(),
                                      " elements; the parameter's shape has ", p.shape.size(), " / ", p.numel)));
  }
  const std::optional<DType> bits =
      (want ? *want : p.dtype) == DType::kF32 ? std::nullopt : std::optional<DType>(want ? *want : p.dtype);
  const DType dt = unwrap(dtype_from(a.dtype(), bits, str(what, " of '", p.name, "'")));
  if (want && dt != *want) {
    raise_status(
        invalid_argument(str(what, " of '", p.name, "' is ", dtype_name(dt), "; it must be ", dtype_name(*want))));
  }
  if (got != nullptr) *got = dt;
  return a.data();
}

std::size_t checked(StepDriver& d, std::size_t index) {
  if (index >= d.param_count()) {
    raise_status(
        invalid_argument(str("parameter index ", index, " is out of range (", d.param_count(), " parameters)")));
  }
  return index;
}

// read_state/write_state's range: the whole parameter without `at`, else `size` elements from
// element *at, inside it; raises InvalidArgument (naming the call) when the array is not one
// (`cast` false) or does not fit. Returns the offset.
std::uint64_t state_range(StepDriver& d, std::size_t index, bool cast, std::uint64_t size,
                          std::optional<std::uint64_t> at, const char* call, const char* array) {
  const std::uint64_t numel = d.param(index).numel;
  const std::uint64_t offset = at.value_or(0);
  if (!cast || offset > numel || size > numel - offset || (!at && size != numel)) {
    raise_status(invalid_argument(str(call, " '", d.param(index).name, "': expected ", array, " float32 array of ",
                                      numel, " elements (with an offset, of at most ", numel, " - offset)")));
  }
  return offset;
}

optim::StateKind kind_of(const std::string& k) {
  if (k == "master") return optim::StateKind::kMaster;
  if (k == "exp_avg") return optim::StateKind::kExpAvg;
  if (k == "exp_avg_sq") return optim::StateKind::kExpAvgSq;
  raise_status(invalid_argument(str("state kind '", k, "' is not one of: master, exp_avg, exp_avg_sq")));
}

nb::object parse_json(const std::string& text) {
  return nb::module_::import_("json").attr("loads")(text);
}

}  // namespace

// The Python object: owns the driver (which is neither copyable nor movable), and the arrays a
// step reads or writes in place until it is done with them: borrowed gradients, and the outputs
// of an overlapped step.
// With an engine (tier.torch's), the engine object is held too, and the driver goes first: its
// optimizer reports into the engine's counters and its buffers are the engine's host memory.
struct PyStepDriver {
  // (Declared before the driver: destroyed after it.)
  nb::object engine_ref;
  std::vector<nb::object> held;
  nb::object comm;  // the running overlapped step's communicator
  // Tests only (fault_injection=True): the I/O engines of the optimizer's swap space, each wrapped
  // in a FaultInjectingEngine; owned by the driver's optimizer and valid while it is.
  std::shared_ptr<std::vector<nvme::FaultInjectingEngine*>> faults;
  std::unique_ptr<StepDriver> d;

  PyStepDriver() = default;
  PyStepDriver(const PyStepDriver&) = delete;
  PyStepDriver& operator=(const PyStepDriver&) = delete;
  ~PyStepDriver() { close(); }

  StepDriver& get() {
    if (!d) raise_status(failed_precondition("the step driver was closed"));
    return *d;
  }
  // A step on the driver's thread may still run: joined (without the GIL) before anything goes.
  void close() {
    if (d) {
      nb::gil_scoped_release released;
      d.reset();  // joins an asynchronous step, stops an overlapped pass
    }
    comm = nb::object();
    held.clear();
  }
};

// The engine a step writes into and reads declared gradients from (tier.torch's engine).
std::optional<step::EngineTargets> engine_targets(nb::handle engine, const std::vector<std::int64_t>& tensors,
                                                  const std::vector<std::int64_t>& grad_tensors,
                                                  const std::vector<std::int64_t>& offsets) {
  if (engine.is_none()) {
    if (!tensors.empty() || !grad_tensors.empty() || !offsets.empty()) {
      raise_status(invalid_argument("step: tensors, grad_tensors and offsets are engine tensors: give the engine"));
    }
    return std::nullopt;
  }
  step::EngineTargets t;
  t.engine = &nb::cast<Engine&>(engine);
  t.params = tensors;
  t.offsets = offsets;
  t.grads = grad_tensors;
  return t;
}

// What step(), start_overlap() and start_async() take beyond the lr and the outputs: how a missing
// gradient counts, and the engine's targets.
struct Targets {
  bool skip_missing = false;
  bool zero_missing = false;
  nb::object engine;
  std::vector<std::int64_t> tensors, grad_tensors, offsets;
  nb::object comm;  // a _tier.Communicator, or None
};

// step()'s, start_overlap()'s and start_async()'s arguments (pointers taken with the GIL held; the
// caller holds t.comm for as long as the step runs).
step::StepArgs step_args(StepDriver& d, std::optional<double> lr, const std::optional<std::vector<nb::object>>& outputs,
                         const Targets& t) {
  step::StepArgs args;
  args.lr = lr;
  args.skip_missing = t.skip_missing;
  args.zero_missing = t.zero_missing;
  args.engine = engine_targets(t.engine, t.tensors, t.grad_tensors, t.offsets);
  args.comm = communicator_of(t.comm);
  if (outputs) {
    if (outputs->size() != d.param_count()) {
      raise_status(invalid_argument(str("step: ", outputs->size(), " outputs for ", d.param_count(),
                                        " parameters (one per parameter, None to skip one)")));
    }
    args.outputs.resize(d.param_count(), nullptr);
    for (std::size_t i = 0; i < outputs->size(); ++i) {
      if ((*outputs)[i].is_none()) continue;
      args.outputs[i] = out_array(d, i, (*outputs)[i], d.param(i).dtype, "step output");
    }
  }
  return args;
}

nb::dict hyper_dict(const cpu::AdamHyperParams& hp) {
  nb::dict out;
  out["lr"] = hp.lr;
  out["beta1"] = hp.beta1;
  out["beta2"] = hp.beta2;
  out["eps"] = hp.eps;
  out["weight_decay"] = hp.weight_decay;
  return out;
}

void bind_step_driver(nb::module_& m) {
  m.def(
      "accumulate_grad",
      [](nb::handle acc, nb::handle grad, bool first) {
        nb::ndarray<float, nb::c_contig, nb::device::cpu> a;
        if (!nb::try_cast(acc, a, /*convert=*/false)) {  // (not a converted copy: it is written)
          raise_status(invalid_argument("accumulate_grad: acc must be a writable C-contiguous CPU float32 array"));
        }
        const InArray g = in_array(grad, "accumulate_grad");
        const DType dt = unwrap(dtype_from(g.a.dtype(), std::nullopt, "accumulate_grad"));
        if (g.a.size() != a.size()) {
          raise_status(
              invalid_argument(str("accumulate_grad: the gradient has ", g.a.size(), " elements, the sum ", a.size())));
        }
        float* dst = a.data();
        const std::uint64_t n = a.size();
        return unwrap(unlocked([&] { return step::accumulate_grad(dst, g.view(dt), n, first); }));
      },
      "acc"_a, "grad"_a, "first"_a,
      "acc = grad (first) or acc + grad, in float32, in one pass that also returns the float64 sum of squares "
      "of the result (the intake of a gradient summed outside the driver, then declared).");
  m.def(
      "copy_grad",
      [](nb::handle dst, nb::handle grad) {
        nb::ndarray<nb::c_contig, nb::device::cpu> d;
        if (!nb::try_cast(dst, d, /*convert=*/false)) {  // (not a converted copy: it is written)
          raise_status(invalid_argument("copy_grad: dst must be a writable C-contiguous CPU array"));
        }
        const InArray g = in_array(grad, "copy_grad");
        const DType dt = unwrap(dtype_from(g.a.dtype(), std::nullopt, "copy_grad"));
        if (d.dtype() != g.a.dtype() || d.size() != g.a.size()) {
          raise_status(invalid_argument(str("copy_grad: dst must have the gradient's dtype and its ", g.a.size(),
                                            " elements (it has ", d.size(), ")")));
        }
        void* out = d.data();
        const std::uint64_t n = g.a.size();
        return unwrap(unlocked([&] { return step::copy_grad(out, g.view(dt), n); }));
      },
      "dst"_a, "grad"_a,
      "dst = grad (the same dtype: float32, bfloat16 or float16) in one pass that also returns the float64 sum "
      "of squares of it (the intake of a gradient kept in its own dtype, then declared).");
  m.def(
      "sum_of_squares",
      [](nb::handle x) {
        const InArray in = in_array(x, "sum_of_squares");
        const DType dt = unwrap(dtype_from(in.a.dtype(), std::nullopt, "sum_of_squares"));
        const cpu::ConstTensorRef ref(in.a.data(), dt, in.a.size());
        return unwrap(unlocked([&] { return cpu::sum_of_squares(ref); }));
      },
      "x"_a, "The float64 sum of squares of a float32/bfloat16/float16 CPU array (accumulate_grad's).");
  m.def(
      "fill_random",
      [](nb::handle x, const std::string& distribution, float a, float b, std::uint64_t seed, std::uint64_t stream,
         int threads) {
        nb::ndarray<nb::c_contig, nb::device::cpu> d;
        if (!nb::try_cast(x, d, /*convert=*/false)) {  // (not a converted copy: it is written)
          raise_status(invalid_argument("fill_random: x must be a writable C-contiguous CPU array"));
        }
        const DType dt = unwrap(dtype_from(d.dtype(), std::nullopt, "fill_random"));
        if (distribution != "normal" && distribution != "uniform") {
          raise_status(
              invalid_argument(str("fill_random: distribution '", distribution, "' is not normal or uniform")));
        }
        const cpu::TensorRef ref{d.data(), dt, d.size()};
        const bool normal = distribution == "normal";
        check(unlocked([&] {
          return normal ? cpu::fill_normal(ref, a, b, seed, stream, threads)
                        : cpu::fill_uniform(ref, a, b, seed, stream, threads);
        }));
      },
      "x"_a, "distribution"_a, "a"_a, "b"_a, "seed"_a, "stream"_a, "threads"_a = 0,
      "Fills a float32/bfloat16/float16 CPU array from tier's counter-based generator (tier/cpu_kernels.hpp "
      "fill_normal, fill_uniform): 'normal' with mean a and std b, or 'uniform' in [a, b). Element i depends on "
      "(seed, stream, i) only, whatever `threads` (0: all cores).");
  nb::class_<PyStepDriver>(m, "StepDriver",
                           "One training step over offloaded optimizer state, by parameter name "
                           "(tier/step_driver.hpp): what tier.jax and the C ABI train with.")
      .def(
          "__init__",
          [](PyStepDriver* self, const EngineConfig& cfg, std::uint64_t max_elements, std::uint64_t max_params,
             nb::object engine, bool fault_injection, bool engine_masters) {
            Engine* e = engine.is_none() ? nullptr : &nb::cast<Engine&>(engine);
            auto options =
                unwrap(optim::OffloadedOptimizerOptions::from_config(cfg, max_elements, e ? &e->counters() : nullptr));
            options.max_partitions = max_params;
            std::shared_ptr<std::vector<nvme::FaultInjectingEngine*>> faults;
            if (fault_injection) {
              faults = std::make_shared<std::vector<nvme::FaultInjectingEngine*>>();
              options.swap_options.wrap_engine = [faults](std::unique_ptr<nvme::IoEngine> inner) {
                auto wrapped = std::make_unique<nvme::FaultInjectingEngine>(std::move(inner));
                faults->push_back(wrapped.get());
                return std::unique_ptr<nvme::IoEngine>(std::move(wrapped));
              };
            }
            if (e != nullptr) {
              // Buffers in the engine's host budget, state in its swap space and NVMe budget (the
              // engine outlives the driver: it is held, and the driver goes first). Fault injection
              // wraps the optimizer's own I/O engines, so that the engine's transfers stay sound.
              step::serve_beside(options, *e, /*share_swap=*/!fault_injection);
            }
            if (engine_masters && e == nullptr) {
              raise_status(invalid_argument("engine_masters: the masters are engine tensors; give the engine"));
            }
            std::unique_ptr<StepDriver> d =
                unwrap(unlocked([&] { return StepDriver::create(options, engine_masters ? e : nullptr); }));
            new (self) PyStepDriver();
            self->engine_ref = engine;
            self->faults = std::move(faults);
            self->d = std::move(d);
          },
          "config"_a, "max_elements"_a, "max_params"_a = 0, "engine"_a = nb::none(), "fault_injection"_a = false,
          "engine_masters"_a = false,
          "The optimizer of `config` (its optimizer section, offload_optimizer, clipping, accumulation); "
          "max_elements: the parameters' elements together (sizes the swap files' cap). engine: a tier Engine "
          "whose host budget holds the optimizer's buffers, whose swap space (with an NVMe tier) holds its state "
          "inside tier.budgets.nvme, and whose counters it reports into (tier.torch's). "
          "fault_injection (tests only): _inject_io_fault can make the optimizer's I/O fail. engine_masters: the "
          "fp32 parameters' masters are their engine tensors (add_engine_param), not kept a second time.")
      .def(
          "_inject_io_fault",
          [](PyStepDriver& o, const std::string& op, int err, std::uint64_t nth, std::uint64_t count,
             std::uint64_t after_bytes) {
            if (!o.faults) raise_status(failed_precondition("the driver was not created with fault_injection=True"));
            if (op != "read" && op != "write" && op != "any") {
              raise_status(invalid_argument(str("op '", op, "' is not one of: read, write, any")));
            }
            for (nvme::FaultInjectingEngine* f : *o.faults) {
              if (after_bytes > 0) {
                f->fail_writes_after_bytes(after_bytes, err);
                continue;
              }
              nvme::FaultSpec spec;
              spec.err = err;
              spec.nth = nth;
              spec.count = count;
              if (op == "read") spec.op = nvme::IoOp::kRead;
              if (op == "write") spec.op = nvme::IoOp::kWrite;
              f->add_fault(spec);
            }
          },
          "op"_a, "err"_a, "nth"_a = 1, "count"_a = 1, "after_bytes"_a = 0,
          "Tests only: makes the optimizer's I/O fail. Each of its I/O engines fails the nth matching request "
          "from now (and `count` after it) with -err; with after_bytes, every write once that many more bytes "
          "were written (a disk filling up).")
      .def(
          "_clear_io_faults",
          [](PyStepDriver& o) {
            if (!o.faults) return;
            for (nvme::FaultInjectingEngine* f : *o.faults) f->clear_faults();
          },
          "Tests only: removes the faults _inject_io_fault added (the disk has room again).")
      .def(
          "close", [](PyStepDriver& o) { o.close(); }, "Frees the driver's buffers and swap files now.")
      .def(
          "add_param",
          [](PyStepDriver& o, const std::string& name, nb::handle initial, int group,
             std::optional<std::string> dtype) {
            StepDriver& d = o.get();
            const InArray in = in_array(initial, str("add_param '", name, "'"));
            const DType dt = unwrap(dtype_from(in.a.dtype(), std::nullopt, str("add_param '", name, "'")));
            const DType param_dtype = dtype ? unwrap(parse_dtype(*dtype)) : dt;
            return unwrap(unlocked([&] { return d.add_param(name, in.view(dt), group, param_dtype); }));
          },
          "name"_a, "initial"_a, "group"_a = 0, "dtype"_a = nb::none(),
          "Adds a parameter with the shape, dtype (float32, bfloat16, float16) and values of `initial` (copied); "
          "returns its index. dtype ('fp32', 'bf16', 'fp16'): the parameter's, when `initial` is another (the fp32 "
          "values a bf16 parameter was made from: the master keeps them).")
      .def(
          "add_engine_param",
          [](PyStepDriver& o, const std::string& name, const std::vector<std::int64_t>& shape, std::uint64_t tensor,
             int group, std::uint64_t offset) {
            StepDriver& d = o.get();
            return unwrap(unlocked(
                [&] { return d.add_engine_param(name, shape, group, static_cast<TensorId>(tensor), offset); }));
          },
          "name"_a, "shape"_a, "tensor"_a, "group"_a = 0, "offset"_a = 0,
          "(engine_masters) Adds an fp32 parameter whose values and master are elements [offset, offset + numel) "
          "of fp32 engine tensor `tensor`, updated in place by each step; returns its index.")
      .def_prop_ro(
          "engine_masters", [](PyStepDriver& o) { return o.get().engine_masters(); },
          "Whether the masters are the engine's parameter tensors.")
      .def(
          "finish_registration",
          [](PyStepDriver& o) { check(unlocked([&] { return o.get().finish_registration(); })); },
          "Lays the state out now (else at the first gradient, step or state access).")
      .def(
          "add_group",
          [](PyStepDriver& o, double lr, double beta1, double beta2, double eps, double weight_decay,
             std::optional<bool> decoupled, std::optional<bool> bias_correction) {
            StepDriver& d = o.get();
            if (!decoupled && !bias_correction) return unwrap(d.add_group(lr, beta1, beta2, eps, weight_decay));
            const cpu::AdamHyperParams first = unwrap(d.hyper_params(0));
            const cpu::WeightDecayMode mode =
                decoupled ? (*decoupled ? cpu::WeightDecayMode::kDecoupled : cpu::WeightDecayMode::kL2)
                          : first.decay_mode;
            return unwrap(d.add_group(lr, beta1, beta2, eps, weight_decay, mode,
                                      bias_correction ? *bias_correction : first.bias_correction));
          },
          "lr"_a, "beta1"_a = 0.9, "beta2"_a = 0.999, "eps"_a = 1e-8, "weight_decay"_a = 0.0,
          "decoupled"_a = nb::none(), "bias_correction"_a = nb::none(),
          "Adds a parameter group of group 0's kind (adam, adagrad, lion, lamb); decoupled (AdamW's decay, "
          "else L2) and bias_correction default to group 0's. Returns its index.")
      .def(
          "kind",
          [](PyStepDriver& o, int group) { return cpu::optimizer_kind_name(unwrap(o.get().hyper_params(group)).kind); },
          "group"_a = 0, "The update rule of a group: 'adam' (Adam or AdamW), 'adagrad', 'lion' or 'lamb'.")
      .def(
          "lr", [](PyStepDriver& o, int group) { return unwrap(o.get().hyper_params(group)).lr; }, "group"_a = 0)
      .def(
          "set_lr", [](PyStepDriver& o, int group, double lr) { check(o.get().set_lr(group, lr)); }, "group"_a, "lr"_a,
          "A group's learning rate from the next step on.")
      .def(
          "declare_grad",
          [](PyStepDriver& o, std::size_t index, double sumsq) {
            StepDriver& d = o.get();
            check(unlocked([&] { return d.declare_grad(index, sumsq); }));
          },
          "index"_a, "sumsq"_a,
          "The parameter's final gradient of this step is in its engine tensor (the step's grad_tensors), with "
          "sum of squares `sumsq`.")
      .def(
          "add_grad",
          [](PyStepDriver& o, std::size_t index, nb::handle grad, bool borrow) {
            StepDriver& d = o.get();
            checked(d, index);
            const std::string what = str("add_grad '", d.param(index).name, "'");
            const InArray in = in_array(grad, what);
            const DType dt = unwrap(dtype_from(in.a.dtype(), std::nullopt, what));
            const step::GradIntake intake = borrow ? step::GradIntake::kBorrow : step::GradIntake::kCopy;
            check(unlocked([&] { return d.add_grad(index, in.view(dt), intake); }));
            if (borrow) o.held.push_back(nb::borrow(grad));
          },
          "index"_a, "grad"_a, "borrow"_a = false,
          "One micro-step's gradient of a parameter (its shape): added into the accumulator, or with borrow=True "
          "read in place by the update (the array is held, and must not change, until the step is done).")
      .def(
          "clear_grads",
          [](PyStepDriver& o) {
            StepDriver& d = o.get();
            if (d.async_running()) {
              raise_status(failed_precondition("clear_grads: an asynchronous step is running; finish_async() first"));
            }
            unlocked([&] { d.clear_grads(); });
            o.held.clear();
          },
          "Forgets the gradients taken since the last step (and drops an overlapped step in flight).")
      .def(
          "step",
          [](PyStepDriver& o, std::optional<double> lr, std::optional<std::vector<nb::object>> outputs,
             bool skip_missing, bool zero_missing, nb::object engine, std::vector<std::int64_t> tensors,
             std::vector<std::int64_t> grad_tensors, std::vector<std::int64_t> offsets, nb::object comm) {
            StepDriver& d = o.get();
            const Targets t{skip_missing, zero_missing, engine, tensors, grad_tensors, offsets, comm};
            const step::StepArgs args = step_args(d, lr, outputs, t);
            Result<optim::StepReport> r = unlocked([&] { return d.step(args); });
            if (r.ok()) o.held.clear();  // (a refused or failed step keeps its gradients for a retry)
            return report_dict(unwrap(std::move(r)));
          },
          "lr"_a = nb::none(), "outputs"_a = nb::none(), "skip_missing"_a = false, "zero_missing"_a = false,
          "engine"_a = nb::none(), "tensors"_a = std::vector<std::int64_t>{},
          "grad_tensors"_a = std::vector<std::int64_t>{}, "offsets"_a = std::vector<std::int64_t>{},
          "comm"_a = nb::none(),
          "One optimizer step; checks every gradient is in, the lr and the outputs first (nothing is applied "
          "on an error). outputs: None or one array (or None) per parameter, written with the updated values. "
          "skip_missing: a parameter without a gradient is left as it is (as torch skips grad None); "
          "zero_missing: it is updated with a zero gradient (as DeepSpeed does). engine: the updated values of "
          "parameter i go into engine tensor tensors[i] (-1: none) from element offsets[i], and a declared "
          "gradient is read from grad_tensors[i]. comm (data-parallel ranks, each driver holding its shards): a "
          "_tier.Communicator over which the gradient's sum of squares is all-reduced, once per step on every "
          "rank, so that every rank clips by the global norm and skips on any rank's overflow.")
      .def(
          "start_overlap",
          [](PyStepDriver& o, std::optional<double> lr, std::optional<std::vector<nb::object>> outputs,
             bool skip_missing, bool zero_missing, nb::object engine, std::vector<std::int64_t> tensors,
             std::vector<std::int64_t> grad_tensors, std::vector<std::int64_t> offsets, nb::object comm) {
            StepDriver& d = o.get();
            const Targets t{skip_missing, zero_missing, engine, tensors, grad_tensors, offsets, comm};
            const step::StepArgs args = step_args(d, lr, outputs, t);
            check(unlocked([&] { return d.start_overlap(args); }));
            o.comm = comm;  // (the last one's pass has stopped: start refuses while one runs)
            if (outputs) o.held.insert(o.held.end(), outputs->begin(), outputs->end());
          },
          "lr"_a = nb::none(), "outputs"_a = nb::none(), "skip_missing"_a = false, "zero_missing"_a = false,
          "engine"_a = nb::none(), "tensors"_a = std::vector<std::int64_t>{},
          "grad_tensors"_a = std::vector<std::int64_t>{}, "offsets"_a = std::vector<std::int64_t>{},
          "comm"_a = nb::none(),
          "Starts the step's update before its gradients are all in (step()'s arguments); add_grad or "
          "declare_grad hand them in as they become final, finish_overlap() validates and commits (or redoes "
          "the step), bit for bit step().")
      .def(
          "finish_overlap",
          [](PyStepDriver& o) {
            StepDriver& d = o.get();
            Result<optim::StepReport> r = unlocked([&] { return d.finish_overlap(); });
            if (r.ok()) o.held.clear();
            return report_dict(unwrap(std::move(r)));
          },
          "Every gradient is in: validates the overlapped step and returns its report (redone: it ran again "
          "serially, e.g. clipped). A missing gradient is refused with the pass still running.")
      .def(
          "start_async",
          [](PyStepDriver& o, std::optional<double> lr, bool skip_missing, bool zero_missing, nb::object engine,
             std::vector<std::int64_t> tensors, std::vector<std::int64_t> grad_tensors,
             std::vector<std::int64_t> offsets) {
            StepDriver& d = o.get();
            const Targets t{skip_missing, zero_missing, engine, tensors, grad_tensors, offsets, nb::none()};
            const step::StepArgs args = step_args(d, lr, std::nullopt, t);
            check(unlocked([&] { return d.start_async(args); }));
          },
          "lr"_a = nb::none(), "skip_missing"_a = false, "zero_missing"_a = false, "engine"_a = nb::none(),
          "tensors"_a = std::vector<std::int64_t>{}, "grad_tensors"_a = std::vector<std::int64_t>{},
          "offsets"_a = std::vector<std::int64_t>{},
          "step() on a thread of the driver's, returning at once (its arguments checked first): nothing else may "
          "use the driver (nor change the gradients it reads) until finish_async() returns its report.")
      .def(
          "finish_async",
          [](PyStepDriver& o) {
            StepDriver& d = o.get();
            Result<optim::StepReport> r = unlocked([&] { return d.finish_async(); });
            if (r.ok()) o.held.clear();
            return report_dict(unwrap(std::move(r)));
          },
          "Waits for the step start_async() began and returns its report (or raises its error: the state is as "
          "before and its gradients are kept, so start_async() may run it again).")
      .def_prop_ro("async_running", [](PyStepDriver& o) { return o.d != nullptr && o.d->async_running(); })
      .def_prop_ro(
          "outputs_stale", [](PyStepDriver& o) { return o.get().outputs_stale(); },
          "Whether params a step delivered may be ahead of the committed state (a failed step could not put "
          "them back, or an applied step's outputs failed): read_param() has the committed ones.")
      .def(
          "outputs_rewritten", [](PyStepDriver& o) { o.get().outputs_rewritten(); },
          "Every parameter was rewritten from read_param(): outputs_stale is false again.")
      .def(
          "cancel_overlap",
          [](PyStepDriver& o) {
            StepDriver& d = o.get();
            unlocked([&] { d.cancel_overlap(); });
          },
          "Drops an overlapped step in flight: nothing committed, the gradients kept.")
      .def_prop_ro("overlap_running", [](PyStepDriver& o) { return o.d != nullptr && o.d->overlap_running(); })
      .def(
          "set_group",
          [](PyStepDriver& o, int group, double lr, double beta1, double beta2, double eps, double weight_decay) {
            check(o.get().set_hyper_params(group, lr, beta1, beta2, eps, weight_decay));
          },
          "group"_a, "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a,
          "A group's hyper-parameters, from the next step on.")
      .def(
          "hyper_params", [](PyStepDriver& o, int group) { return hyper_dict(unwrap(o.get().hyper_params(group))); },
          "group"_a = 0)
      .def_prop_ro("group_count", [](PyStepDriver& o) { return o.get().group_count(); })
      .def(
          "read_param",
          [](PyStepDriver& o, std::size_t index, nb::handle out) {
            StepDriver& d = o.get();
            checked(d, index);
            DType dt = DType::kF32;
            void* p = out_array(d, index, out, std::nullopt, "read_param", &dt);
            check(unlocked([&] { return d.read_param(index, dt, p); }));
          },
          "index"_a, "out"_a,
          "The parameter's values from its fp32 master into `out` (its shape; float32, float16, bfloat16, or "
          "uint16 for the parameter's own 16-bit dtype).")
      .def(
          "read_state",
          [](PyStepDriver& o, std::size_t index, const std::string& kind, nb::handle out,
             std::optional<std::uint64_t> at) {
            StepDriver& d = o.get();
            checked(d, index);
            const optim::StateKind k = kind_of(kind);
            nb::ndarray<float, nb::c_contig, nb::device::cpu> a;
            const bool cast = nb::try_cast(out, a, /*convert=*/false);
            const std::uint64_t offset = state_range(d, index, cast, a.size(), at, "read_state", "a writable");
            float* p = a.data();
            const std::uint64_t n = a.size();
            check(unlocked([&] { return d.read_state(index, k, p, offset, n); }));
          },
          "index"_a, "kind"_a, "out"_a, "offset"_a = nb::none(),
          "A state array (master, exp_avg, exp_avg_sq) into a float32 array: all of it, or with `offset`, "
          "len(out) elements from element `offset`.")
      .def(
          "write_state",
          [](PyStepDriver& o, std::size_t index, const std::string& kind, nb::handle src,
             std::optional<std::uint64_t> at) {
            StepDriver& d = o.get();
            checked(d, index);
            const optim::StateKind k = kind_of(kind);
            nb::ndarray<nb::ro, float, nb::c_contig, nb::device::cpu> a;
            const bool cast = nb::try_cast(src, a);
            const std::uint64_t offset = state_range(d, index, cast, a.size(), at, "write_state", "a");
            const float* p = a.data();
            const std::uint64_t n = a.size();
            check(unlocked([&] { return d.write_state(index, k, p, offset, n); }));
          },
          "index"_a, "kind"_a, "src"_a, "offset"_a = nb::none(),
          "Overwrites a state array: all of it, or with `offset`, len(src) elements from element `offset`.")
      .def(
          "group_step", [](PyStepDriver& o, int group) { return unwrap(o.get().group_step(group)); }, "group"_a = 0)
      .def(
          "set_group_step", [](PyStepDriver& o, int group, std::int64_t v) { check(o.get().set_group_step(group, v)); },
          "group"_a, "step"_a)
      .def(
          "save",
          [](PyStepDriver& o, const std::string& path) {
            StepDriver& d = o.get();
            check(unlocked([&] { return d.save(path); }));
          },
          "path"_a, "The streamed, checksummed optimizer checkpoint (written beside `path` and renamed).")
      .def(
          "load",
          [](PyStepDriver& o, const std::string& path, nb::object before_commit) {
            StepDriver& d = o.get();
            std::function<Status()> hook;
            if (!before_commit.is_none()) {
              // True commits; false, or an exception (raised as it was), leaves the state as it was.
              hook = [&before_commit] {
                return call_python(
                    [&] {
                      return nb::cast<bool>(before_commit())
                                 ? Status::Ok()
                                 : Status(StatusCode::kCancelled, "load: before_commit declined; nothing was changed");
                    },
                    "load: before_commit");
              };
            }
            check_keeping_python(unlocked([&] { return d.load(path, hook); }));
            o.held.clear();  // (the load dropped the gradients taken)
          },
          "path"_a, "before_commit"_a = nb::none(),
          "Loads the optimizer checkpoint at path. `before_commit`: a callable, called once the whole file has "
          "verified and before anything changes; unless it returns True nothing changes: tier.Cancelled is raised, "
          "or the exception it raised (the ranks of a partitioned checkpoint agree there that all of them "
          "verified).")
      .def_prop_ro("param_count", [](PyStepDriver& o) { return o.get().param_count(); })
      .def(
          "find", [](PyStepDriver& o, const std::string& name) { return unwrap(o.get().find(name)); }, "name"_a)
      .def("param_name", [](PyStepDriver& o, std::size_t i) { return o.get().param(checked(o.get(), i)).name; })
      .def("param_shape",
           [](PyStepDriver& o, std::size_t i) {
             const auto& shape = o.get().param(checked(o.get(), i)).shape;
             nb::list l;
             for (std::int64_t v : shape) l.append(v);
             return nb::tuple(l);
           })
      .def("param_dtype",
           [](PyStepDriver& o, std::size_t i) {
             switch (o.get().param(checked(o.get(), i)).dtype) {
               case DType::kBF16: return "bfloat16";
               case DType::kF16: return "float16";
               default: return "float32";
             }
           })
      .def_prop_ro("loss_scale", [](PyStepDriver& o) { return o.get().loss_scale(); })
      .def("stats", [](PyStepDriver& o) { return parse_json(o.get().stats_json()); })
      .def_prop_ro("host_passes_per_grad_element",
                   [](PyStepDriver& o) { return o.get().host_passes_per_grad_element(); });
}

}  // namespace tier::python
