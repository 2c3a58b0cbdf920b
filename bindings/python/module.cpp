// tier._tier: the Python module over the C++ engine (nanobind).
//
// Errors arrive as Python exceptions carrying the engine's message: tier.TierError and, per
// status code, subclasses that also derive from the matching built-in (ValueError, KeyError,
// MemoryError, TimeoutError, OSError), so callers can catch either.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cerrno>
#include <cstring>
#include <thread>
#include <unordered_map>

#include "binding_util.hpp"
#include "tier/config.hpp"
#include "tier/cpu_kernels.hpp"
#include "tier/ext/device.hpp"
#include "tier/engine.hpp"
#include "tier/ext/fault_injecting_engine.hpp"
#include "tier/engine_step_io.hpp"
#include "tier/offloaded_optimizer.hpp"
#include "tier/stats.hpp"
#include "tier/units.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace tier::python {
namespace {

nb::object g_errors[16];

// The errno an OSError subclass carries (Python code tests e.errno == errno.ENOSPC): the status's
// own, else the one its code stands for; 0 for none.
int errno_of(const Status& s) {
  if (s.sys_errno() != 0) return s.sys_errno();
  switch (s.code()) {
    case StatusCode::kNoSpace: return ENOSPC;
    case StatusCode::kIoError: return EIO;
    case StatusCode::kTimedOut: return ETIMEDOUT;
    default: return 0;
  }
}

[[noreturn]] void raise(const Status& s) {
  const int code = static_cast<int>(s.code());
  nb::object cls = (code >= 0 && code < 16 && g_errors[code].is_valid()) ? g_errors[code] : g_errors[0];
  nb::object exc = nb::steal(PyObject_CallOneArg(cls.ptr(), nb::str(s.to_string().c_str()).ptr()));
  if (!exc.is_valid()) throw nb::python_error();
  // Only errno is set, not strerror: OSError's str() would then be "[Errno N] strerror" instead of
  // tier's message, which already names the cause.
  if (const int err = errno_of(s); err != 0 && PyObject_IsInstance(exc.ptr(), PyExc_OSError) == 1) {
    if (PyObject_SetAttrString(exc.ptr(), "errno", nb::int_(err).ptr()) != 0) PyErr_Clear();
  }
  PyErr_SetObject(cls.ptr(), exc.ptr());
  throw nb::python_error();
}

template <class E, class F>
E parse_enum(const std::string& text, F parse) {
  return unwrap(parse(text));
}

// A host buffer the caller passes in (numpy array, torch CPU tensor, bytes...): contiguous, and
// exactly `bytes` long.
struct HostView {
  const void* data = nullptr;
  std::size_t bytes = 0;
};

HostView host_view(nb::handle obj, std::uint64_t expected, const char* what) {
  nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu> a;
  if (!nb::try_cast(obj, a)) {
    raise(invalid_argument(str(what, ": expected a C-contiguous CPU array or tensor of ", expected, " bytes")));
  }
  const std::size_t bytes = a.nbytes();
  if (bytes != expected) {
    raise(invalid_argument(str(what, ": the array holds ", bytes, " bytes but the tensor has ", expected)));
  }
  return {a.data(), bytes};
}

nb::dlpack::dtype dl_dtype(DType d) {
  switch (d) {
    case DType::kF32: return nb::dtype<float>();
    case DType::kF64: return nb::dtype<double>();
    case DType::kF16: return {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    case DType::kBF16: return {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
    case DType::kI8: return nb::dtype<std::int8_t>();
    case DType::kU8: return nb::dtype<std::uint8_t>();
    case DType::kI32: return nb::dtype<std::int32_t>();
    case DType::kI64: return nb::dtype<std::int64_t>();
  }
  return nb::dtype<float>();
}

// A lease handed to Python. as_tensor() gives a view (DLPack) that owns the lease from then on:
// the lease ends when the last tensor viewing it is freed, so memory the engine may reuse is never
// reachable from Python.
struct PyLease {
  std::shared_ptr<Lease> lease;
  nb::object engine_ref;  // keeps the Python Engine (and so the engine) alive while the lease lives
  DType dtype = DType::kF32;
  int device_type = nb::device::cpu::value;
  int device_id = 0;

  std::uintptr_t data_ptr() const { return lease ? reinterpret_cast<std::uintptr_t>(lease->data()) : 0; }
  std::uint64_t nbytes() const { return lease ? lease->bytes() : 0; }

  nb::ndarray<nb::array_api> as_tensor(std::vector<std::size_t> shape) {
    if (!lease || !lease->valid()) raise(failed_precondition("lease already released"));
    if (lease->data() == nullptr) raise(failed_precondition("a lease on the NVMe tier has no memory to view"));
    const std::size_t numel = lease->bytes() / dtype_size(dtype);
    if (shape.empty()) shape.push_back(numel);
    std::size_t n = 1;
    for (std::size_t s : shape) n *= s;
    if (n != numel) raise(invalid_argument(str("as_tensor: shape holds ", n, " elements, the tensor ", numel)));
    struct Keep {
      std::shared_ptr<Lease> lease;
      nb::object engine;
    };
    auto* keep = new Keep{lease, engine_ref};
    nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<Keep*>(p); });
    lease.reset();  // the view owns it now
    return nb::ndarray<nb::array_api>(keep->lease->data(), shape.size(), shape.data(), owner, nullptr, dl_dtype(dtype),
                                      device_type, device_id);
  }

  void release() {
    if (lease && lease->valid()) check(lease->release());
    lease.reset();
  }
};

DType dtype_of(const nb::dlpack::dtype& d) {
  if (d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float) && d.bits == 32) return DType::kF32;
  if (d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float) && d.bits == 16) return DType::kF16;
  if (d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat) && d.bits == 16) return DType::kBF16;
  if (d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float) && d.bits == 64) return DType::kF64;
  raise(invalid_argument("expected a float32, float16 or bfloat16 array"));
}

optim::ParamOutput output_of(const std::string& s) {
  if (s == "none") return optim::ParamOutput::kNone;
  if (s == "fp16") return optim::ParamOutput::kF16;
  if (s == "bf16") return optim::ParamOutput::kBF16;
  if (s == "fp32") return optim::ParamOutput::kF32;
  raise(invalid_argument(str("output dtype '", s, "' is not one of: none, fp16, bf16, fp32")));
}

// The gradient norm across ranks through a Python callable (float -> float: this rank's sum of
// squares -> the global one), e.g. a torch.distributed all-reduce. Called without the GIL held.
class PyNormReducer final : public optim::NormReducer {
 public:
  explicit PyNormReducer(nb::object fn) : fn_(std::move(fn)) {}
  ~PyNormReducer() override {
    nb::gil_scoped_acquire locked;  // (dropped where the GIL may be released)
    fn_ = nb::object();
  }
  bool given() const { return fn_.is_valid() && !fn_.is_none(); }
  Status all_reduce_sumsq(double& sumsq) override {
    nb::gil_scoped_acquire locked;
    try {
      sumsq = nb::cast<double>(fn_(sumsq));
      return Status::Ok();
    } catch (nb::python_error& e) {
      std::string what = e.what();
      e.restore();
      PyErr_Clear();
      return Status(StatusCode::kFailedPrecondition, str("reduce_sumsq raised: ", what));
    } catch (std::exception& e) {
      return Status(StatusCode::kFailedPrecondition, str("reduce_sumsq: ", e.what()));
    }
  }

 private:
  nb::object fn_;
};

// What an engine step (step_into, an overlapped or asynchronous one) talks to, held from its start
// to its end: the params' engine tensors (sink), the declared gradients' (grads), the norm across
// ranks (when given).
struct OverlapContext {
  OverlapContext(Engine& e, std::vector<std::int64_t> tensors, std::vector<std::int64_t> grad_tensors,
                 const optim::OffloadedOptimizer& opt, std::vector<std::int64_t> offsets = {},
                 nb::object reduce = nb::none())
      : sink(e, std::move(tensors), std::move(offsets), opt),
        grads(e, std::move(grad_tensors)),
        norm(std::move(reduce)) {}
  step::EngineParamSink sink;
  step::EngineGradSource grads;
  PyNormReducer norm;
};

optim::StepOptions engine_step_options(OverlapContext& ctx) {
  optim::StepOptions so;
  so.sink = &ctx.sink;
  so.grads = &ctx.grads;
  if (ctx.norm.given()) so.norm = &ctx.norm;
  return so;
}

struct OverlapContext;

// An overlapped step started with start_overlap_to: the destination pointers, and the arrays they
// point into, held until the pass has stopped.
struct DestinationOverlap {
  std::vector<void*> dest;
  std::vector<nb::object> keep;
  ~DestinationOverlap() {
    nb::gil_scoped_acquire locked;  // (dropped where the GIL may be released)
    keep.clear();
  }
};

// A step running on a thread of its own (start_step_async .. finish_step_async): the delayed
// parameter update, which runs while the caller computes the next step's gradients.
struct AsyncStep {
  std::thread thread;
  std::shared_ptr<OverlapContext> ctx;
  Result<optim::StepReport> result{Status(StatusCode::kInternal, "no step")};
  Status closed;
  void join() {
    if (thread.joinable()) thread.join();
  }
};

struct PyOptimizer {
  nb::object engine_ref;  // the engine whose Counters the optimizer reports into: must outlive `opt`
  std::unique_ptr<optim::OffloadedOptimizer> opt;
  // An overlapped step's callbacks (start_overlap_into .. finish_overlap): dropped after `opt`'s
  // pass has stopped.
  std::shared_ptr<OverlapContext> overlap;
  std::shared_ptr<DestinationOverlap> overlap_to;  // or one started with start_overlap_to
  std::unique_ptr<AsyncStep> async;                // joined before anything else touches `opt`
  // Tests only (create(..., fault_injection=True)): the I/O engines of the optimizer's swap space,
  // each wrapped in a FaultInjectingEngine. Owned by `opt` and valid while it is.
  std::shared_ptr<std::vector<nvme::FaultInjectingEngine*>> faults;

  PyOptimizer() = default;
  PyOptimizer(PyOptimizer&&) = default;
  PyOptimizer& operator=(PyOptimizer&&) = default;
  ~PyOptimizer() {
    if (async) {
      nb::gil_scoped_release unlocked;
      async->join();
    }
    async.reset();
    opt.reset();
    overlap.reset();
    overlap_to.reset();
  }

  bool overlap_started() const { return overlap != nullptr || overlap_to != nullptr; }

  // Read-only accessors that an asynchronous step does not change (counts, the lr, a loss scale
  // that is not dynamic) may peek while it runs.
  optim::OffloadedOptimizer& peek() {
    if (!opt) raise(failed_precondition("the optimizer was closed"));
    return *opt;
  }

  optim::OffloadedOptimizer& get() {
    if (!opt) raise(failed_precondition("the optimizer was closed"));
    if (async) {
      raise(failed_precondition("an asynchronous step is running; finish_step_async() first"));
    }
    return *opt;
  }
};

optim::StateKind state_kind_of(const std::string& kind) {
  if (kind == "master") return optim::StateKind::kMaster;
  if (kind == "exp_avg") return optim::StateKind::kExpAvg;
  if (kind == "exp_avg_sq") return optim::StateKind::kExpAvgSq;
  raise(invalid_argument(str("state kind '", kind, "' is not one of: master, exp_avg, exp_avg_sq")));
}

// A C-contiguous CPU fp32 array of a partition's numel, as a pointer (the caller holds the array).
void* state_view(PyOptimizer& o, optim::PartitionId id, nb::handle arr, const char* what) {
  if (id >= o.get().partition_count()) raise(invalid_argument(str(what, ": no partition ", id)));
  nb::ndarray<nb::c_contig, nb::device::cpu> a;
  const std::uint64_t want = o.get().partition_numel(id) * sizeof(float);
  if (!nb::try_cast(arr, a) || a.dtype() != nb::dtype<float>() || a.nbytes() != want) {
    raise(invalid_argument(str(what, ": expected a C-contiguous CPU float32 array of ", want / sizeof(float),
                               " elements for partition ", id)));
  }
  return a.data();
}

// step_to's and start_overlap_to's destinations: per partition a writable C-contiguous CPU array of
// its numel in its output dtype, or None.
std::vector<void*> destination_pointers(PyOptimizer& o, const std::vector<nb::object>& destinations, const char* what) {
  std::vector<void*> dest(destinations.size(), nullptr);
  for (std::size_t i = 0; i < destinations.size(); ++i) {
    if (destinations[i].is_none()) continue;
    const auto id = static_cast<optim::PartitionId>(i);
    if (id >= o.get().partition_count()) raise(invalid_argument(str(what, ": no partition ", i)));
    const std::uint64_t want = o.get().partition_numel(id) * optim::param_output_size(o.get().partition_output(id));
    nb::ndarray<nb::c_contig, nb::device::cpu> a;
    if (!nb::try_cast(destinations[i], a) || a.nbytes() != want) {
      raise(invalid_argument(str(what, ": destination ", i, " must be a writable C-contiguous CPU array of ", want,
                                 " bytes (the partition's numel in its output dtype)")));
    }
    dest[i] = a.data();
  }
  return dest;
}

cpu::AdamHyperParams hyper(double lr, double beta1, double beta2, double eps, double wd, bool decoupled,
                           bool bias_correction) {
  cpu::AdamHyperParams hp;
  hp.lr = lr;
  hp.beta1 = beta1;
  hp.beta2 = beta2;
  hp.eps = eps;
  hp.weight_decay = wd;
  hp.decay_mode = decoupled ? cpu::WeightDecayMode::kDecoupled : cpu::WeightDecayMode::kL2;
  hp.bias_correction = bias_correction;
  return hp;
}

}  // namespace

// An optimizer step's report as a dict (binding_util.hpp).
nb::dict report_dict(const optim::StepReport& r) {
  nb::dict d;
  d["step"] = r.step;
  d["applied"] = r.applied;
  d["overflow"] = r.overflow;
  d["grad_norm"] = r.grad_norm;
  d["clip_coefficient"] = r.clip_coefficient;
  d["loss_scale"] = r.loss_scale;
  d["next_loss_scale"] = r.next_loss_scale;
  d["seconds"] = r.seconds;
  d["read_bytes"] = r.read.bytes;
  d["write_bytes"] = r.write.bytes;
  d["read_busy_seconds"] = r.read.busy_seconds;
  d["write_busy_seconds"] = r.write.busy_seconds;
  d["update_busy_seconds"] = r.update.busy_seconds;
  d["io_busy_seconds"] = r.io_busy_seconds;
  d["update_wait_seconds"] = r.update_wait_seconds;
  d["output_seconds"] = r.output_seconds;
  d["overlapped"] = r.overlapped;
  d["speculated_chunks"] = r.speculated_chunks;
  d["redone"] = r.redone;
  d["redo_reason"] = r.redo_reason;
  d["reused_chunks"] = r.reused_chunks;
  d["chunks"] = r.chunks;
  return d;
}

[[noreturn]] void raise_status(const Status& s) {
  raise(s);
}

void bind_file_layer(nb::module_& m);   // file_layer.cpp
void bind_step_driver(nb::module_& m);  // step_driver.cpp

NB_MODULE(_tier, m) {
  m.doc() = "tier: memory-tiering and offload engine (native module)";
  m.def(
      "format_bytes", [](std::uint64_t n) { return format_bytes(n); }, "n"_a,
      "A byte count as tier's messages write it: \"1.50 GiB\".");

  nb::module_ builtins = nb::module_::import_("builtins");
  nb::object base = nb::steal(PyErr_NewException("tier.TierError", PyExc_RuntimeError, nullptr));
  m.attr("TierError") = base;
  struct ErrDef {
    StatusCode code;
    const char* name;
    PyObject* builtin;
  };
  const ErrDef defs[] = {
      {StatusCode::kInvalidArgument, "InvalidArgument", PyExc_ValueError},
      {StatusCode::kNotFound, "NotFound", PyExc_KeyError},
      {StatusCode::kAlreadyExists, "AlreadyExists", PyExc_ValueError},
      {StatusCode::kOutOfRange, "OutOfRange", PyExc_IndexError},
      {StatusCode::kResourceExhausted, "ResourceExhausted", PyExc_MemoryError},
      {StatusCode::kTimedOut, "TimedOut", PyExc_TimeoutError},
      {StatusCode::kCancelled, "Cancelled", PyExc_RuntimeError},
      {StatusCode::kIoError, "IoError", PyExc_OSError},
      {StatusCode::kNoSpace, "NoSpace", PyExc_OSError},
      {StatusCode::kUnsupported, "Unsupported", PyExc_NotImplementedError},
      {StatusCode::kFailedPrecondition, "FailedPrecondition", PyExc_RuntimeError},
      {StatusCode::kDataLoss, "DataLoss", PyExc_OSError},
      {StatusCode::kDeviceError, "DeviceError", PyExc_RuntimeError},
      {StatusCode::kInternal, "InternalError", PyExc_RuntimeError},
  };
  g_errors[0] = base;
  for (const auto& d : defs) {
    nb::object bases = nb::make_tuple(base, nb::handle(d.builtin));
    nb::object cls = nb::steal(PyErr_NewExceptionWithDoc(
        str("tier.", d.name).c_str(), str("tier status ", status_code_name(d.code)).c_str(), bases.ptr(), nullptr));
    m.attr(d.name) = cls;
    g_errors[static_cast<int>(d.code)] = cls;
  }
  bind_file_layer(m);
  bind_step_driver(m);

  nb::class_<EngineConfig>(m, "Config", "An engine configuration (DeepSpeed JSON plus tier's own section).")
      .def_static(
          "from_json",
          [](const std::string& text, bool strict) {
            ConfigOptions o;
            o.strict = strict;
            return unwrap(EngineConfig::from_json(text, o));
          },
          "text"_a, "strict"_a = false)
      .def_static(
          "from_file",
          [](const std::string& path, bool strict) {
            ConfigOptions o;
            o.strict = strict;
            return unwrap(EngineConfig::from_file(path, o));
          },
          "path"_a, "strict"_a = false)
      .def("to_json", &EngineConfig::to_json, "indent"_a = 2)
      .def_ro("notes", &EngineConfig::notes)
      .def_ro("auto_keys", &EngineConfig::auto_keys)
      .def_prop_ro("swap_paths", &EngineConfig::resolved_swap_paths);

  nb::class_<PyLease>(m, "Lease", "A tensor's copy on one tier, pinned until released.")
      .def_prop_ro("data_ptr", &PyLease::data_ptr)
      .def_prop_ro("nbytes", &PyLease::nbytes)
      .def_prop_ro("tier", [](const PyLease& l) { return l.lease ? tier_name(l.lease->tier()) : ""; })
      .def("as_tensor", &PyLease::as_tensor, "shape"_a = std::vector<std::size_t>{},
           "A DLPack array (torch.from_dlpack / numpy.from_dlpack) viewing the copy. The view takes over the "
           "lease: it ends when the last view is freed.")
      .def("release", &PyLease::release);

  nb::class_<Engine>(m, "Engine", "The tiering engine.")
      .def_static(
          "create", [](const EngineConfig& cfg) { return unwrap(Engine::create(cfg)); }, "config"_a)
      .def(
          "register",
          [](Engine& e, const std::string& name, const std::string& dtype, std::uint64_t numel, const std::string& role,
             int group, const std::string& home, nb::handle initial) {
            TensorDesc d;
            d.name = name;
            d.dtype = unwrap(parse_dtype(dtype));
            d.numel = numel;
            d.role = unwrap(parse_role(role));
            d.group = group;
            const Tier h = unwrap(parse_tier(home));
            const void* src = nullptr;
            if (!initial.is_none()) src = host_view(initial, d.bytes(), str("register '", name, "'").c_str()).data;
            Result<TensorId> id{Status(StatusCode::kInternal, "not registered")};
            {
              nb::gil_scoped_release unlocked;
              id = e.register_tensor(d, h, src);
            }
            return unwrap(std::move(id));
          },
          "name"_a, "dtype"_a, "numel"_a, "role"_a = "user", "group"_a = 0, "home"_a = "host", "initial"_a = nb::none())
      .def("unregister", [](Engine& e, TensorId id) { check(e.unregister_tensor(id)); })
      .def(
          "retag",
          [](Engine& e, TensorId id, const std::string& name, const std::string& role, int group) {
            const Role r = unwrap(parse_role(role));
            Status s;
            {
              nb::gil_scoped_release unlocked;
              s = e.retag(id, name, r, group);
            }
            check(s);
          },
          "id"_a, "name"_a, "role"_a = "user", "group"_a = 0,
          "Renames a registered tensor and sets its role and group; its copies stay where they are.")
      .def(
          "acquire",
          [](Engine& e, TensorId id, const std::string& tier, const std::string& access, bool traced) {
            const Tier t = unwrap(parse_tier(tier));
            Access a = Access::kRead;
            if (access == "write") {
              a = Access::kWrite;
            } else if (access == "read_write" || access == "readwrite" || access == "rw") {
              a = Access::kReadWrite;
            } else if (access != "read") {
              raise(invalid_argument(str("access '", access, "' is not one of: read, write, read_write")));
            }
            auto info = unwrap(e.info(id));
            Result<Lease> lease{Status(StatusCode::kInternal, "not acquired")};
            {
              nb::gil_scoped_release unlocked;
              lease = e.acquire_now(id, t, a, traced);
            }
            PyLease out;
            out.lease = std::make_shared<Lease>(unwrap(std::move(lease)));
            out.engine_ref = nb::find(&e);
            out.dtype = info.desc.dtype;
            if (t == Tier::kDevice && e.device().info().kind == DeviceKind::kCuda) {
              out.device_type = nb::device::cuda::value;
              out.device_id = e.device().info().device_id;
            }
            return out;
          },
          "id"_a, "tier"_a, "access"_a = "read", "traced"_a = true)
      .def(
          "read",
          [](Engine& e, TensorId id, nb::handle out) {
            auto info = unwrap(e.info(id));
            nb::ndarray<nb::c_contig, nb::device::cpu> a;
            if (!nb::try_cast(out, a) || a.nbytes() != info.desc.bytes()) {
              raise(
                  invalid_argument(str("read '", info.desc.name, "': out must be a writable C-contiguous CPU array of ",
                                       info.desc.bytes(), " bytes")));
            }
            void* dst = a.data();
            Status s;
            {
              nb::gil_scoped_release unlocked;
              s = e.read(id, dst);
            }
            check(s);
          },
          "id"_a, "out"_a)
      .def(
          "write",
          [](Engine& e, TensorId id, nb::handle src) {
            auto info = unwrap(e.info(id));
            const void* p = host_view(src, info.desc.bytes(), str("write '", info.desc.name, "'").c_str()).data;
            Status s;
            {
              nb::gil_scoped_release unlocked;
              s = e.write(id, p);
            }
            check(s);
          },
          "id"_a, "src"_a)
      .def("flush",
           [](Engine& e) {
             Status s;
             {
               nb::gil_scoped_release unlocked;
               s = e.flush();
             }
             check(s);
           })
      .def("begin_step", &Engine::begin_step)
      .def("end_step", &Engine::end_step)
      .def("find", [](const Engine& e, const std::string& name) { return unwrap(e.find(name)); })
      .def("info",
           [](const Engine& e, TensorId id) {
             auto i = unwrap(e.info(id));
             nb::dict d;
             d["name"] = i.desc.name;
             d["dtype"] = dtype_name(i.desc.dtype);
             d["numel"] = i.desc.numel;
             d["role"] = role_name(i.desc.role);
             d["group"] = i.desc.group;
             d["home"] = tier_name(i.home);
             nb::dict copies;
             for (Tier t : kAllTiers) copies[tier_name(t)] = i.copy_state[static_cast<int>(t)];
             d["copies"] = copies;
             d["readers"] = i.readers;
             d["writer"] = i.writer;
             return d;
           })
      .def("__len__", &Engine::tensor_count)
      .def(
          "stats_json", [](const Engine& e, int indent) { return e.stats().to_json(indent); }, "indent"_a = -1)
      .def("check_invariants", [](const Engine& e) { check(e.check_invariants()); })
      .def(
          "start_trace", [](Engine& e, std::size_t max_events) { e.counters().start_trace(max_events); },
          "max_events"_a = 1'000'000,
          "Starts the timeline: every transfer on every link, stalls and spans, as Chrome trace events.")
      .def_prop_ro("tracing", [](Engine& e) { return e.counters().tracing(); })
      .def(
          "trace_span",
          [](Engine& e, const std::string& lane, const std::string& name, std::int64_t begin_ns, std::int64_t end_ns,
             std::uint64_t bytes) {
            using Clock = std::chrono::steady_clock;
            const auto at = [](std::int64_t ns) {
              return Clock::time_point(std::chrono::duration_cast<Clock::duration>(std::chrono::nanoseconds(ns)));
            };
            e.counters().trace_span(lane, name, at(begin_ns), at(end_ns), bytes);
          },
          "lane"_a, "name"_a, "begin_ns"_a, "end_ns"_a, "bytes"_a = 0,
          "Adds a span to the timeline; times are time.monotonic_ns() values (the same clock as the engine's).")
      .def(
          "write_trace",
          [](Engine& e, const std::string& path) {
            Status s;
            {
              nb::gil_scoped_release unlocked;
              s = e.counters().write_trace(path);
            }
            check(s);
          },
          "path"_a, "Writes the timeline recorded so far (Chrome trace-event JSON) to `path`; recording goes on.")
      .def(
          "note_transfer",
          [](Engine& e, const std::string& link, std::uint64_t bytes, double seconds) {
            Link l;
            if (link == "device_to_host") {
              l = Link::kDeviceToHost;
            } else if (link == "host_to_device") {
              l = Link::kHostToDevice;
            } else if (link == "nvme_to_host") {
              l = Link::kNvmeToHost;
            } else if (link == "host_to_nvme") {
              l = Link::kHostToNvme;
            } else {
              raise(invalid_argument(str("link '", link,
                                         "' is not one of: device_to_host, host_to_device, "
                                         "nvme_to_host, host_to_nvme")));
            }
            e.counters().record(l, bytes, seconds);
          },
          "link"_a, "bytes"_a, "seconds"_a)
      .def_prop_ro("device_id", [](Engine& e) { return e.device().info().device_id; })
      .def_prop_ro("device_name", [](Engine& e) { return e.device().info().name; })
      .def_prop_ro("device_kind", [](Engine& e) { return device_kind_name(e.device().info().kind); });

  // An optimizer checkpoint read alone (tier.torch.zero_to_fp32): its partitions, then its masters
  // into one float32 array per partition; both verify as load_checkpoint does (tier.DataLoss).
  m.def(
      "checkpoint_partitions",
      [](const std::string& path) {
        Result<optim::CheckpointInfo> r{Status(StatusCode::kInternal, "not read")};
        {
          nb::gil_scoped_release unlocked;
          r = optim::read_checkpoint_info(path);
        }
        nb::list out;
        for (const optim::CheckpointPartition& p : unwrap(std::move(r)).partitions) {
          out.append(nb::make_tuple(p.name, p.numel, p.group));
        }
        return out;
      },
      "path"_a,
      "The partitions of the optimizer checkpoint at path, in id order, as (name, numel, group), from its "
      "header and metadata (checked; the records are not read).");
  m.def(
      "read_checkpoint_masters",
      [](const std::string& path, const std::vector<nb::object>& out) {
        Result<optim::CheckpointInfo> info{Status(StatusCode::kInternal, "not read")};
        {
          nb::gil_scoped_release unlocked;
          info = optim::read_checkpoint_info(path);
        }
        const std::vector<optim::CheckpointPartition> parts = unwrap(std::move(info)).partitions;
        if (out.size() != parts.size()) {
          raise(invalid_argument(
              str("read_checkpoint_masters: ", out.size(), " arrays for the ", parts.size(), " partitions of ", path)));
        }
        // The arrays stay referenced (held here) while the GIL is released.
        std::vector<nb::ndarray<nb::c_contig, nb::device::cpu>> arrays(out.size());
        std::vector<float*> dst(out.size(), nullptr);
        for (std::size_t i = 0; i < out.size(); ++i) {
          if (out[i].is_none()) continue;
          if (!nb::try_cast(out[i], arrays[i]) || arrays[i].dtype() != nb::dtype<float>() ||
              arrays[i].nbytes() != parts[i].numel * sizeof(float)) {
            raise(invalid_argument(str("read_checkpoint_masters: out[", i, "] must be None or a writable C-contiguous ",
                                       "CPU float32 array of ", parts[i].numel, " elements (partition '", parts[i].name,
                                       "')")));
          }
          dst[i] = static_cast<float*>(arrays[i].data());
        }
        Status s;
        {
          nb::gil_scoped_release unlocked;
          s = optim::read_checkpoint_masters(
              path,
              [&](const optim::CheckpointPartition& part, std::uint64_t offset, const float* values,
                  std::uint64_t count) -> Status {
                if (part.id >= parts.size() || part.numel != parts[part.id].numel) {
                  return data_loss(str("checkpoint ", path, ": its partitions changed while it was read"));
                }
                if (dst[part.id] != nullptr) std::memcpy(dst[part.id] + offset, values, count * sizeof(float));
                return {};
              });
        }
        check(s);
      },
      "path"_a, "out"_a,
      "Fills out[i] (None, or a float32 array of partition i's numel) with the fp32 master params of the "
      "optimizer checkpoint at path, verifying every record and the trailer (tier.DataLoss when damaged). On an "
      "error the arrays may hold part of the values: keep none of them.");

  nb::class_<PyOptimizer>(m, "Optimizer", "The offloaded Adam/AdamW optimizer (state on NVMe or in host memory).")
      .def_static(
          "create",
          [](const EngineConfig& cfg, std::uint64_t max_elements, nb::object engine, std::uint64_t max_partitions,
             bool fault_injection) {
            Engine* e = engine.is_none() ? nullptr : &nb::cast<Engine&>(engine);
            auto options =
                unwrap(optim::OffloadedOptimizerOptions::from_config(cfg, max_elements, e ? &e->counters() : nullptr));
            options.max_partitions = max_partitions;
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
              // The pipeline buffers count against the engine's host budget (the engine outlives
              // the optimizer: PyOptimizer keeps a reference and drops the optimizer first).
              options.pinned_source = [e](std::uint64_t bytes, const std::string& name) {
                return e->reserve_host(name, bytes);
              };
              // The optimizer's swap space registers the engine's arena as fixed buffers too: whole
              // at start under an explicit budget, extent by extent as it is committed under the
              // auto budget (a lazy arena), so its buffers' I/O is on fixed buffers either way.
              options.arena = &e->host_arena();
            }
            PyOptimizer out;
            Result<std::unique_ptr<optim::OffloadedOptimizer>> r{Status(StatusCode::kInternal, "not created")};
            {
              nb::gil_scoped_release unlocked;
              r = optim::OffloadedOptimizer::create(options);
            }
            out.opt = unwrap(std::move(r));
            out.engine_ref = engine;
            out.faults = std::move(faults);
            return out;
          },
          "config"_a, "max_elements"_a, "engine"_a = nb::none(), "max_partitions"_a = 0, "fault_injection"_a = false)
      .def(
          "_inject_io_fault",
          [](PyOptimizer& o, const std::string& op, int err, std::uint64_t nth, std::uint64_t count,
             std::uint64_t after_bytes) {
            if (!o.faults) {
              raise(failed_precondition("the optimizer was not created with fault_injection=True"));
            }
            if (op != "read" && op != "write" && op != "any") {
              raise(invalid_argument(str("op '", op, "' is not one of: read, write, any")));
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
          [](PyOptimizer& o) {
            if (!o.faults) return;
            for (nvme::FaultInjectingEngine* f : *o.faults) f->clear_faults();
          },
          "Tests only: removes the faults _inject_io_fault added (the disk has room again).")
      .def(
          "add_partition",
          [](PyOptimizer& o, std::uint64_t numel, int group, const std::string& output, nb::handle initial,
             const std::string& name) {
            optim::PartitionSpec spec;
            spec.numel = numel;
            spec.group = group;
            spec.output = output_of(output);
            spec.name = name;
            if (!initial.is_none()) {
              spec.initial = static_cast<const float*>(host_view(initial, numel * 4, "add_partition").data);
            }
            Result<optim::PartitionId> id{Status(StatusCode::kInternal, "not added")};
            {
              nb::gil_scoped_release unlocked;
              id = o.get().add_partition(spec);
            }
            return unwrap(std::move(id));
          },
          "numel"_a, "group"_a = 0, "output"_a = "none", "initial"_a = nb::none(), "name"_a = "")
      .def("finish_registration",
           [](PyOptimizer& o) {
             Status s;
             {
               nb::gil_scoped_release unlocked;
               s = o.get().finish_registration();
             }
             check(s);
           })
      .def(
          "add_group",
          [](PyOptimizer& o, double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
             bool bias_correction) {
            cpu::AdamHyperParams hp = hyper(lr, beta1, beta2, eps, weight_decay, decoupled, bias_correction);
            // A new group runs the same kind as group 0 (the config's optimizer type), with its clamp.
            const cpu::AdamHyperParams first = unwrap(o.get().hyper_params(0));
            hp.kind = first.kind;
            hp.max_coeff = first.max_coeff;
            hp.min_coeff = first.min_coeff;
            if (hp.kind == cpu::OptimizerKind::kAdagrad) hp.decay_mode = cpu::WeightDecayMode::kL2;
            if (hp.kind == cpu::OptimizerKind::kLion) hp.decay_mode = cpu::WeightDecayMode::kDecoupled;
            return unwrap(o.get().add_group(hp));
          },
          "lr"_a, "beta1"_a = 0.9, "beta2"_a = 0.999, "eps"_a = 1e-8, "weight_decay"_a = 0.0, "decoupled"_a = true,
          "bias_correction"_a = true,
          "Adds a parameter group of the same kind (adam, adagrad, lion, lamb) as group 0; returns its index.")
      .def(
          "kind",
          [](PyOptimizer& o, int group) { return cpu::optimizer_kind_name(unwrap(o.get().hyper_params(group)).kind); },
          "group"_a = 0, "The update rule of a group: 'adam' (Adam or AdamW), 'adagrad', 'lion' or 'lamb'.")
      .def(
          "set_group",
          [](PyOptimizer& o, int group, double lr, double beta1, double beta2, double eps, double weight_decay) {
            auto hp = unwrap(o.get().hyper_params(group));
            hp.lr = lr;
            hp.beta1 = beta1;
            hp.beta2 = beta2;
            hp.eps = eps;
            hp.weight_decay = weight_decay;
            check(o.get().set_hyper_params(group, hp));
          },
          "group"_a, "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a)
      .def(
          "add_grad",
          [](PyOptimizer& o, optim::PartitionId id, nb::handle grad, bool borrow) {
            nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu> a;
            if (!nb::try_cast(grad, a))
              raise(invalid_argument("add_grad: expected a C-contiguous CPU array or tensor"));
            const DType d = dtype_of(a.dtype());
            cpu::ConstTensorRef ref(a.data(), d, a.nbytes() / dtype_size(d));
            Status s;
            {
              nb::gil_scoped_release unlocked;
              s = o.get().add_grad(id, ref, borrow ? optim::GradMode::kBorrow : optim::GradMode::kCopy);
            }
            check(s);
          },
          "partition"_a, "grad"_a, "borrow"_a = false,
          "Takes a gradient; borrow=True keeps a pointer instead of copying: the caller keeps the array alive "
          "and unchanged until step() or clear_grads() returns.")
      .def("clear_grads", [](PyOptimizer& o) { o.get().clear_grads(); })
      .def(
          "step_into",
          [](PyOptimizer& o, Engine& engine, const std::vector<std::int64_t>& tensors,
             const std::vector<std::int64_t>& grad_tensors, const std::vector<std::int64_t>& offsets,
             nb::object reduce_sumsq) {
            OverlapContext ctx(engine, tensors, grad_tensors, o.get(), offsets, std::move(reduce_sumsq));
            const optim::StepOptions so = engine_step_options(ctx);
            Result<optim::StepReport> r{Status(StatusCode::kInternal, "no step")};
            Status closed;
            {
              nb::gil_scoped_release unlocked;
              r = o.get().step(so);
              closed = ctx.sink.close();
            }
            auto report = unwrap(std::move(r));
            check(closed);
            return report_dict(report);
          },
          "engine"_a, "tensors"_a, "grad_tensors"_a = std::vector<std::int64_t>{},
          "offsets"_a = std::vector<std::int64_t>{}, "reduce_sumsq"_a = nb::none(),
          "One optimizer step; the updated params of partition i go into engine tensor tensors[i] (-1: none), "
          "from element offsets[i] (default 0); a gradient declared with declare_grad is read from engine tensor "
          "grad_tensors[i]. reduce_sumsq (data-parallel ranks): a callable taking this rank's sum of squares of "
          "its gradients and returning the sum over all ranks, called once per step on every rank.")
      .def(
          "start_overlap_into",
          [](PyOptimizer& o, Engine& engine, const std::vector<std::int64_t>& tensors,
             const std::vector<std::int64_t>& grad_tensors, const std::vector<std::int64_t>& offsets,
             nb::object reduce_sumsq) {
            if (o.overlap_started() && o.get().overlapped_step_running()) {
              raise(failed_precondition("start_overlap_into: an overlapped step is already running"));
            }
            o.overlap.reset();  // one that clear_grads() cancelled
            o.overlap_to.reset();
            auto ctx = std::make_shared<OverlapContext>(engine, tensors, grad_tensors, o.get(), offsets,
                                                        std::move(reduce_sumsq));
            check(o.get().start_overlapped_step(engine_step_options(*ctx)));
            o.overlap = std::move(ctx);
          },
          "engine"_a, "tensors"_a, "grad_tensors"_a = std::vector<std::int64_t>{},
          "offsets"_a = std::vector<std::int64_t>{}, "reduce_sumsq"_a = nb::none(),
          "Starts the step of this accumulation boundary while backward runs (step_into's arguments): its "
          "pass updates chunks, in reverse, as their gradients become final; finish_overlap() validates.")
      .def(
          "start_overlap_to",
          [](PyOptimizer& o, const std::vector<nb::object>& destinations, bool skip_missing_grads) {
            if (o.overlap_started() && o.get().overlapped_step_running()) {
              raise(failed_precondition("start_overlap_to: an overlapped step is already running"));
            }
            o.overlap.reset();  // one that clear_grads() cancelled
            o.overlap_to.reset();
            auto ctx = std::make_shared<DestinationOverlap>();
            ctx->dest = destination_pointers(o, destinations, "start_overlap_to");
            ctx->keep.assign(destinations.begin(), destinations.end());
            optim::StepOptions so;
            so.skip_missing_grads = skip_missing_grads;
            so.redeliver_abandoned_outputs = false;  // the destinations are the caller's staging
            so.destinations = ctx->dest;             // (held by the context until the pass is done)
            check(o.get().start_overlapped_step(so));
            o.overlap_to = std::move(ctx);
          },
          "destinations"_a, "skip_missing_grads"_a = false,
          "Starts an overlapped step (step_to's arguments) whose gradients come through add_grad(borrow=True) "
          "as they become final, in any order; the pass updates chunks in reverse as theirs are in. The "
          "destinations are the caller's staging: they hold the speculative update until finish_overlap() "
          "validates it, and are not put back if the pass is abandoned. finish_overlap() returns step_to's "
          "report (the step redone serially when clipped or skipped).")
      .def(
          "finish_overlap",
          [](PyOptimizer& o) {
            if (!o.overlap_started() || !o.get().overlapped_step_running()) {
              o.overlap.reset();
              o.overlap_to.reset();
              raise(failed_precondition("finish_overlap: no overlapped step is running"));
            }
            std::shared_ptr<OverlapContext> ctx = std::move(o.overlap);
            std::shared_ptr<DestinationOverlap> to = std::move(o.overlap_to);
            Result<optim::StepReport> r{Status(StatusCode::kInternal, "no step")};
            Status closed;
            {
              nb::gil_scoped_release unlocked;
              r = o.get().finish_overlapped_step();
              if (ctx) closed = ctx->sink.close();
            }
            auto report = unwrap(std::move(r));
            check(closed);
            return report_dict(report);
          },
          "Every gradient of the step is in: validates the overlapped step (committed as is, or redone "
          "serially when clipped or skipped) and returns step_into's report.")
      .def(
          "cancel_overlap",
          [](PyOptimizer& o) {
            if (!o.overlap_started()) return;
            std::shared_ptr<OverlapContext> ctx = std::move(o.overlap);
            std::shared_ptr<DestinationOverlap> to = std::move(o.overlap_to);
            nb::gil_scoped_release unlocked;
            o.get().cancel_overlapped_step();
            if (ctx) ctx->sink.close().ignore();
          },
          "Drops an overlapped step in flight (nothing committed; the gradients are kept).")
      .def_prop_ro("overlap_running",
                   [](PyOptimizer& o) {
                     return o.overlap_started() && o.opt != nullptr && !o.async && o.opt->overlapped_step_running();
                   })
      .def(
          "step_to",
          [](PyOptimizer& o, const std::vector<nb::object>& destinations, bool skip_missing_grads) {
            // Raw pointers taken with the GIL held; the arrays stay referenced by `destinations`.
            const std::vector<void*> dest = destination_pointers(o, destinations, "step_to");
            optim::StepOptions so;
            so.skip_missing_grads = skip_missing_grads;
            so.destinations = dest;
            Result<optim::StepReport> r{Status(StatusCode::kInternal, "no step")};
            {
              nb::gil_scoped_release unlocked;
              r = o.get().step(so);
            }
            return report_dict(unwrap(std::move(r)));
          },
          "destinations"_a, "skip_missing_grads"_a = false,
          "One optimizer step; the updated params of partition i are written into destinations[i] (a CPU array "
          "of its output dtype, or None: not written; read_params() has them). skip_missing_grads: partitions "
          "without a gradient stay untouched, as torch.optim skips a parameter whose grad is None.")
      .def(
          "declare_grad",
          [](PyOptimizer& o, optim::PartitionId id, double sumsq) { check(o.get().declare_grad(id, sumsq)); },
          "partition"_a, "sumsq"_a,
          "Partition `partition` has its final gradient of this step in an engine tensor (step_into's "
          "grad_tensors), with sum of squares `sumsq`.")
      .def("set_lr", [](PyOptimizer& o, int group, double lr) { check(o.get().set_lr(group, lr)); })
      .def("lr", [](PyOptimizer& o, int group) { return unwrap(o.peek().hyper_params(group)).lr; })
      .def("group_step", [](PyOptimizer& o, int group) { return unwrap(o.get().group_step(group)); })
      .def("set_group_step",
           [](PyOptimizer& o, int group, std::int64_t step) { check(o.get().set_group_step(group, step)); })
      .def(
          "read_state",
          [](PyOptimizer& o, optim::PartitionId id, const std::string& kind, nb::handle out) {
            const optim::StateKind k = state_kind_of(kind);
            float* dst = static_cast<float*>(state_view(o, id, out, "read_state"));
            Status s;
            {
              nb::gil_scoped_release unlocked;
              s = o.get().read_state(id, k, dst, 0, o.get().partition_numel(id));
            }
            check(s);
          },
          "partition"_a, "kind"_a, "out"_a,
          "Copies a partition's committed state ('master', 'exp_avg' or 'exp_avg_sq': numel fp32) into out.")
      .def(
          "write_state",
          [](PyOptimizer& o, optim::PartitionId id, const std::string& kind, nb::handle src) {
            const optim::StateKind k = state_kind_of(kind);
            const float* from = static_cast<const float*>(state_view(o, id, src, "write_state"));
            Status s;
            {
              nb::gil_scoped_release unlocked;
              s = o.get().write_state(id, k, from, 0, o.get().partition_numel(id));
            }
            check(s);
          },
          "partition"_a, "kind"_a, "src"_a,
          "Overwrites a partition's state ('master', 'exp_avg' or 'exp_avg_sq') with numel fp32 values.")
      .def_prop_ro("group_count", [](PyOptimizer& o) { return o.peek().group_count(); })
      .def_prop_ro("partition_count", [](PyOptimizer& o) { return o.peek().partition_count(); })
      .def_prop_ro("loss_scale", [](PyOptimizer& o) { return o.peek().loss_scale(); })
      .def(
          "read_params",
          [](PyOptimizer& o, optim::PartitionId id, const std::string& dtype, nb::handle out) {
            const DType d = unwrap(parse_dtype(dtype));
            nb::ndarray<nb::c_contig, nb::device::cpu> a;
            if (!nb::try_cast(out, a) || a.nbytes() != o.get().partition_numel(id) * dtype_size(d)) {
              raise(invalid_argument(str("read_params: out must be a writable C-contiguous CPU array of ",
                                         o.get().partition_numel(id) * dtype_size(d), " bytes")));
            }
            void* dst = a.data();
            Status s;
            {
              nb::gil_scoped_release unlocked;
              s = o.get().read_params(id, d, dst);
            }
            check(s);
          },
          "partition"_a, "dtype"_a, "out"_a)
      .def("save_checkpoint",
           [](PyOptimizer& o, const std::string& path) {
             Status s;
             {
               nb::gil_scoped_release unlocked;
               s = o.get().save_checkpoint(path);
             }
             check(s);
           })
      .def("load_checkpoint",
           [](PyOptimizer& o, const std::string& path) {
             Status s;
             {
               nb::gil_scoped_release unlocked;
               s = o.get().load_checkpoint(path);
             }
             check(s);
           })
      .def("stats",
           [](PyOptimizer& o) {
             const auto st = o.get().stats();
             nb::dict d;
             d["home"] = optim::state_home_name(st.home);
             d["partitions"] = st.partitions;
             d["elements"] = st.elements;
             d["state_dtype"] = cpu::state_dtype_name(st.state_dtype);
             d["record_bytes"] = st.record_bytes;
             d["chunks"] = st.chunks;
             d["chunk_elements"] = st.chunk_elements;
             d["buffer_count"] = st.buffer_count;
             d["pinned_bytes"] = st.pinned_bytes;
             d["accumulator_bytes"] = st.accumulator_bytes;
             d["host_state_bytes"] = st.host_state_bytes;
             d["nvme_bytes"] = st.nvme_bytes;
             d["nvme_capacity_bytes"] = st.nvme_capacity_bytes;
             d["nvme_allocated_bytes"] = st.nvme_allocated_bytes;
             d["io_registered_bytes"] = st.io_registered_bytes;
             d["step"] = st.step;
             d["steps_skipped"] = st.steps_skipped;
             d["steps_failed"] = st.steps_failed;
             d["steps_applied"] = st.steps_applied;
             return d;
           })
      .def(
          "start_step_async",
          [](PyOptimizer& o, Engine& engine, const std::vector<std::int64_t>& tensors,
             const std::vector<std::int64_t>& grad_tensors) {
            optim::OffloadedOptimizer& opt = o.get();  // (refuses while one runs)
            auto a = std::make_unique<AsyncStep>();
            a->ctx = std::make_shared<OverlapContext>(engine, tensors, grad_tensors, opt);
            AsyncStep* raw = a.get();
            const optim::StepOptions so = engine_step_options(*a->ctx);
            o.async = std::move(a);
            raw->thread = std::thread([raw, &opt, so] {
              raw->result = opt.step(so);
              raw->closed = raw->ctx->sink.close();
            });
          },
          "engine"_a, "tensors"_a, "grad_tensors"_a = std::vector<std::int64_t>{},
          "step_into on a thread of its own, returning at once: nothing else may use the optimizer (nor the "
          "gradients it reads) until finish_step_async() returns its report.")
      .def(
          "finish_step_async",
          [](PyOptimizer& o) {
            if (!o.async) raise(failed_precondition("finish_step_async: no asynchronous step is running"));
            {
              nb::gil_scoped_release unlocked;
              o.async->join();
            }
            std::unique_ptr<AsyncStep> a = std::move(o.async);
            auto report = unwrap(std::move(a->result));
            check(a->closed);
            return report_dict(report);
          },
          "Waits for the step start_step_async() began and returns its report (or raises its error).")
      .def_prop_ro("step_async_running", [](PyOptimizer& o) { return o.async != nullptr; })
      .def(
          "outputs_rewritten", [](PyOptimizer& o) { o.get().outputs_rewritten(); },
          "Every partition's params were rewritten from read_params(): outputs_stale is false again.")
      .def_prop_ro(
          "outputs_stale", [](PyOptimizer& o) { return o.peek().outputs_stale(); },
          "Whether params a step delivered may be ahead of the committed state (a failed step could not "
          "put them back, or an applied step's outputs failed): read_params() has the committed ones.")
      .def("close", [](PyOptimizer& o) {
        nb::gil_scoped_release unlocked;
        if (o.async) o.async->join();
        o.async.reset();
        o.opt.reset();  // stops an overlapped pass first
        o.overlap.reset();
        o.overlap_to.reset();
      });
}

}  // namespace tier::python
