// tier._tier.StepDriver: the step driver (tier/step_driver.hpp) for Python frameworks other than
// torch (tier.jax). Arrays come in as anything nanobind takes as a C-contiguous CPU ndarray (numpy,
// or an object with __dlpack__ such as a jax CPU array), read in place; updated params are
// written into the caller's numpy arrays. A bf16/fp16 parameter's output may also be a uint16
// array of its shape (the raw bits), for numpy without a bfloat16 dtype. Every call releases
// the GIL while the driver runs.
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
  if (!nb::try_cast(obj, a)) {
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
struct PyStepDriver {
  std::vector<nb::object> held;  // (declared first: destroyed after the driver)
  std::unique_ptr<StepDriver> d;
  StepDriver& get() {
    if (!d) raise_status(failed_precondition("the step driver was closed"));
    return *d;
  }
  void close() {
    if (d) {
      nb::gil_scoped_release released;
      d->cancel_overlap();
    }
    d.reset();
    held.clear();
  }
};

// step()'s and start_overlap()'s arguments (pointers taken with the GIL held).
step::StepArgs step_args(StepDriver& d, std::optional<double> lr, const std::optional<std::vector<nb::object>>& outputs,
                         bool skip_missing) {
  step::StepArgs args;
  args.lr = lr;
  args.skip_missing = skip_missing;
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
  nb::class_<PyStepDriver>(m, "StepDriver",
                           "One training step over offloaded optimizer state, by parameter name "
                           "(tier/step_driver.hpp): what tier.jax and the C ABI train with.")
      .def(
          "__init__",
          [](PyStepDriver* self, const EngineConfig& cfg, std::uint64_t max_elements, std::uint64_t max_params) {
            new (self)
                PyStepDriver{{}, unwrap(unlocked([&] { return StepDriver::create(cfg, max_elements, max_params); }))};
          },
          "config"_a, "max_elements"_a, "max_params"_a = 0,
          "The optimizer of `config` (its optimizer section, offload_optimizer, clipping, accumulation); "
          "max_elements: the parameters' elements together (sizes the swap files' cap).")
      .def(
          "close", [](PyStepDriver& o) { o.close(); }, "Frees the driver's buffers and swap files now.")
      .def(
          "add_param",
          [](PyStepDriver& o, const std::string& name, nb::handle initial, int group) {
            StepDriver& d = o.get();
            const InArray in = in_array(initial, str("add_param '", name, "'"));
            const DType dt = unwrap(dtype_from(in.a.dtype(), std::nullopt, str("add_param '", name, "'")));
            return unwrap(unlocked([&] { return d.add_param(name, in.view(dt), group); }));
          },
          "name"_a, "initial"_a, "group"_a = 0,
          "Adds a parameter with the shape, dtype (float32, bfloat16, float16) and values of `initial` (copied); "
          "returns its index.")
      .def(
          "add_group",
          [](PyStepDriver& o, double lr, double beta1, double beta2, double eps, double weight_decay) {
            return unwrap(o.get().add_group(lr, beta1, beta2, eps, weight_decay));
          },
          "lr"_a, "beta1"_a = 0.9, "beta2"_a = 0.999, "eps"_a = 1e-8, "weight_decay"_a = 0.0)
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
            unlocked([&] { d.clear_grads(); });
            o.held.clear();
          },
          "Forgets the gradients taken since the last step (and drops an overlapped step in flight).")
      .def(
          "step",
          [](PyStepDriver& o, std::optional<double> lr, std::optional<std::vector<nb::object>> outputs,
             bool skip_missing) {
            StepDriver& d = o.get();
            const step::StepArgs args = step_args(d, lr, outputs, skip_missing);
            Result<optim::StepReport> r = unlocked([&] { return d.step(args); });
            if (r.ok()) o.held.clear();  // (a refused or failed step keeps its gradients for a retry)
            return report_dict(unwrap(std::move(r)));
          },
          "lr"_a = nb::none(), "outputs"_a = nb::none(), "skip_missing"_a = false,
          "One optimizer step; checks every gradient is in, the lr and the outputs first (nothing is applied "
          "on an error). outputs: None or one array (or None) per parameter, written with the updated values. "
          "skip_missing: a parameter without a gradient is left as it is (as torch skips grad None).")
      .def(
          "start_overlap",
          [](PyStepDriver& o, std::optional<double> lr, std::optional<std::vector<nb::object>> outputs,
             bool skip_missing) {
            StepDriver& d = o.get();
            const step::StepArgs args = step_args(d, lr, outputs, skip_missing);
            check(unlocked([&] { return d.start_overlap(args); }));
            if (outputs) o.held.insert(o.held.end(), outputs->begin(), outputs->end());
          },
          "lr"_a = nb::none(), "outputs"_a = nb::none(), "skip_missing"_a = false,
          "Starts the step's update before its gradients are all in (step()'s arguments); add_grad hands them in "
          "as they become final, finish_overlap() validates and commits (or redoes the step), bit for bit step().")
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
          [](PyStepDriver& o, std::size_t index, const std::string& kind, nb::handle out) {
            StepDriver& d = o.get();
            checked(d, index);
            const optim::StateKind k = kind_of(kind);
            nb::ndarray<float, nb::c_contig, nb::device::cpu> a;
            if (!nb::try_cast(out, a) || a.size() != d.param(index).numel) {
              raise_status(invalid_argument(str("read_state '", d.param(index).name, "': expected a writable float32 ",
                                                "array of ", d.param(index).numel, " elements")));
            }
            float* p = a.data();
            check(unlocked([&] { return d.read_state(index, k, p); }));
          },
          "index"_a, "kind"_a, "out"_a, "A state array (master, exp_avg, exp_avg_sq) into a float32 array.")
      .def(
          "write_state",
          [](PyStepDriver& o, std::size_t index, const std::string& kind, nb::handle src) {
            StepDriver& d = o.get();
            checked(d, index);
            const optim::StateKind k = kind_of(kind);
            nb::ndarray<nb::ro, float, nb::c_contig, nb::device::cpu> a;
            if (!nb::try_cast(src, a) || a.size() != d.param(index).numel) {
              raise_status(invalid_argument(str("write_state '", d.param(index).name, "': expected a float32 array of ",
                                                d.param(index).numel, " elements")));
            }
            const float* p = a.data();
            check(unlocked([&] { return d.write_state(index, k, p); }));
          },
          "index"_a, "kind"_a, "src"_a)
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
          [](PyStepDriver& o, const std::string& path) {
            StepDriver& d = o.get();
            check(unlocked([&] { return d.load(path); }));
            o.held.clear();  // (the load dropped the gradients taken)
          },
          "path"_a)
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
