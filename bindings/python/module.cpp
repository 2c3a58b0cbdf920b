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

#include <cstring>

#include "tier/config.hpp"
#include "tier/device.hpp"
#include "tier/engine.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace tier::python {
namespace {

nb::object g_errors[16];

[[noreturn]] void raise(const Status& s) {
  const int code = static_cast<int>(s.code());
  nb::object cls = (code >= 0 && code < 16 && g_errors[code].is_valid()) ? g_errors[code] : g_errors[0];
  PyErr_SetString(cls.ptr(), s.to_string().c_str());
  throw nb::python_error();
}

void check(const Status& s) {
  if (!s.ok()) raise(s);
}

template <class T>
T unwrap(Result<T> r) {
  if (!r.ok()) raise(r.status());
  return std::move(r).value();
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

  nb::ndarray<> as_tensor(std::vector<std::size_t> shape) {
    if (!lease || !lease->valid()) raise(failed_precondition("lease already released"));
    if (lease->data() == nullptr) raise(failed_precondition("a lease on the NVMe tier has no memory to view"));
    std::size_t n = 1;
    for (std::size_t s : shape) n *= s;
    const std::size_t numel = lease->bytes() / dtype_size(dtype);
    if (shape.empty()) shape.push_back(numel);
    if (n != numel) raise(invalid_argument(str("as_tensor: shape holds ", n, " elements, the tensor ", numel)));
    struct Keep {
      std::shared_ptr<Lease> lease;
      nb::object engine;
    };
    auto* keep = new Keep{lease, engine_ref};
    nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<Keep*>(p); });
    lease.reset();  // the view owns it now
    return nb::ndarray<>(keep->lease->data(), shape.size(), shape.data(), owner, nullptr, dl_dtype(dtype), device_type,
                         device_id);
  }

  void release() {
    if (lease && lease->valid()) check(lease->release());
    lease.reset();
  }
};

}  // namespace

NB_MODULE(_tier, m) {
  m.doc() = "tier: memory-tiering and offload engine (native module)";

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
            nb::gil_scoped_release unlocked;
            return unwrap(e.register_tensor(d, h, src));
          },
          "name"_a, "dtype"_a, "numel"_a, "role"_a = "user", "group"_a = 0, "home"_a = "host", "initial"_a = nb::none())
      .def("unregister", [](Engine& e, TensorId id) { check(e.unregister_tensor(id)); })
      .def(
          "acquire",
          [](Engine& e, TensorId id, const std::string& tier, const std::string& access) {
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
              lease = e.acquire_now(id, t, a);
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
          "id"_a, "tier"_a, "access"_a = "read")
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
            nb::gil_scoped_release unlocked;
            check(e.read(id, dst));
          },
          "id"_a, "out"_a)
      .def(
          "write",
          [](Engine& e, TensorId id, nb::handle src) {
            auto info = unwrap(e.info(id));
            const void* p = host_view(src, info.desc.bytes(), str("write '", info.desc.name, "'").c_str()).data;
            nb::gil_scoped_release unlocked;
            check(e.write(id, p));
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
      .def_prop_ro("device_name", [](Engine& e) { return e.device().info().name; })
      .def_prop_ro("device_kind", [](Engine& e) { return device_kind_name(e.device().info().kind); });
}

}  // namespace tier::python
