// tier._tier: the Python module over the C++ engine (nanobind).
//
// Errors arrive as Python exceptions carrying the engine's message: tier.TierError and, per
// status code, subclasses that also derive from the matching built-in (ValueError, KeyError,
// MemoryError, TimeoutError, OSError), so callers can catch either.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "binding_util.hpp"
#include "tier/comm.hpp"
#include "tier/config.hpp"
#include "tier/cpu_kernels.hpp"
#include "tier/ext/device.hpp"
#include "tier/engine.hpp"
#include "tier/log.hpp"
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

  // `stream`: the consumer's GPU stream (a cudaStream_t as an integer, as torch's
  // Stream.cuda_stream gives it). With one, the lease ends in stream order when the last view is
  // freed: after an event recorded on `stream` then has completed (Lease::release_after), so
  // kernels queued before the view died still read (or write) this memory, not a reused block.
  nb::ndarray<nb::array_api> as_tensor(std::vector<std::size_t> shape, std::optional<std::uintptr_t> stream) {
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
      bool ordered = false;
      DeviceStream stream = nullptr;
      ~Keep() {
        if (!ordered || !lease || !lease->valid()) return;
        if (Status s = lease->release_after(stream); !s.ok()) {
          TIER_LOG(kError, "tier: a view's lease could not end in stream order (", s.to_string(),
                   "); it ends now, without waiting for that stream's work");
          lease->release().ignore();
        }
      }
    };
    auto* keep =
        new Keep{lease, engine_ref, stream.has_value(), stream ? reinterpret_cast<DeviceStream>(*stream) : nullptr};
    nb::capsule owner(keep, [](void* p) noexcept {
      try {
        delete static_cast<Keep*>(p);
      } catch (...) {
        // Only logging can throw; the lease has ended with `keep`.
      }
    });
    lease.reset();  // the view owns it now
    return nb::ndarray<nb::array_api>(keep->lease->data(), shape.size(), shape.data(), owner, nullptr, dl_dtype(dtype),
                                      device_type, device_id);
  }

  void release_after(std::uintptr_t stream) {
    if (!lease || !lease->valid()) raise(failed_precondition("lease already released"));
    check(lease->release_after(reinterpret_cast<DeviceStream>(stream)));
    lease.reset();
  }

  void release() {
    if (lease && lease->valid()) check(lease->release());
    lease.reset();
  }
};

// For tests of stream order on the emulated device's delayed streams: holds a stream (its worker
// waits in a host function) until open() or until the gate is freed, so work queued behind it
// provably runs later than the caller's next steps.
struct StreamGate {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool open = false;
  };
  std::shared_ptr<State> state = std::make_shared<State>();
  void open() {
    {
      std::lock_guard<std::mutex> lock(state->mu);
      state->open = true;
    }
    state->cv.notify_all();
  }
  ~StreamGate() { open(); }
};

Access parse_access(const std::string& access) {
  if (access == "read") return Access::kRead;
  if (access == "write") return Access::kWrite;
  if (access == "read_write" || access == "readwrite" || access == "rw") return Access::kReadWrite;
  raise(invalid_argument(str("access '", access, "' is not one of: read, write, read_write")));
}

// A stream-ordered acquire (`stream` given) is a device read.
Status stream_ordered_read(Tier t, Access a, const std::optional<std::uintptr_t>& stream) {
  if (!stream || (t == Tier::kDevice && a == Access::kRead)) return Status();
  const char* access = a == Access::kRead ? "read" : a == Access::kWrite ? "write" : "read_write";
  return invalid_argument(
      str("acquire with a stream is for reading the device copy (tier 'device', access 'read'), "
          "not tier '",
          tier_name(t), "', access '", access, "'"));
}

AcquireFuture start_acquire(Engine& e, TensorId id, Tier t, Access a, bool traced,
                            const std::optional<std::uintptr_t>& stream) {
  if (stream) return e.acquire_on_stream(id, reinterpret_cast<DeviceStream>(*stream), traced);
  return e.acquire(id, t, a, traced);
}

// A granted lease as Python's Lease: the dtype comes with the lease, so an acquire costs one call
// into the engine.
PyLease py_lease(Engine& e, Lease lease) {
  PyLease out;
  const Tier t = lease.tier();
  out.dtype = lease.dtype();
  out.lease = std::make_shared<Lease>(std::move(lease));
  out.engine_ref = nb::find(&e);
  if (t == Tier::kDevice && e.device().info().kind == DeviceKind::kCuda) {
    out.device_type = nb::device::cuda::value;
    out.device_id = e.device().info().device_id;
  }
  return out;
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
void bind_comm(nb::module_& m);         // comm.cpp

NB_MODULE(_tier, m) {
  m.doc() = "tier: memory-tiering and offload engine (native module)";
  m.def(
      "format_bytes", [](std::uint64_t n) { return format_bytes(n); }, "n"_a,
      "A byte count as tier's messages write it: \"1.50 GiB\".");
  m.def(
      "shard_range",
      [](std::uint64_t numel, int world, int rank) {
        const ShardMap map = unwrap(ShardMap::create(numel, world));
        if (rank < 0 || rank >= world) {
          raise(invalid_argument(str("shard_range: rank ", rank, " is not in [0, ", world, ")")));
        }
        return nb::make_tuple(map.shard_size(), map.offset(rank), map.count(rank));
      },
      "numel"_a, "world"_a, "rank"_a,
      "(shard, start, count): the ZeRO layout of a flat tensor of numel elements over world ranks "
      "(tier::ShardMap, the C ABI's tier_shard_range): shards of ceil(numel / world) elements, rank `rank` "
      "owning [start, start + count).");

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
  bind_comm(m);
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
      .def("as_tensor", &PyLease::as_tensor, "shape"_a = std::vector<std::size_t>{}, "stream"_a = nb::none(),
           "A DLPack array (torch.from_dlpack / numpy.from_dlpack) viewing the copy. The view takes over the "
           "lease: it ends when the last view is freed, or, with `stream` (the consumer's cudaStream_t as an "
           "integer), once the work queued on that stream by then has completed.")
      .def("release", &PyLease::release)
      .def("release_after", &PyLease::release_after, "stream"_a,
           "Ends the lease once the work queued on `stream` (a cudaStream_t as an integer) so far has completed.");

  nb::class_<StreamGate>(m, "StreamGate", "A held device stream (tests); open() lets its work run.")
      .def("open", &StreamGate::open);

  nb::class_<Engine>(m, "Engine", "The tiering engine.")
      .def_static(
          "create", [](const EngineConfig& cfg) { return unwrap(Engine::create(cfg)); }, "config"_a)
      .def(
          "_hold_stream",
          [](Engine& e, std::uintptr_t stream) {
            Device& d = e.device();
            if (d.info().kind != DeviceKind::kEmulated || !d.has(DeviceCap::kGpuStreams)) {
              raise(failed_precondition(
                  "_hold_stream is for the emulated device with tier.emulated.delayed_streams: true"));
            }
            auto gate = std::make_unique<StreamGate>();
            check(d.enqueue_host(reinterpret_cast<DeviceStream>(stream), [st = gate->state] {
              std::unique_lock<std::mutex> lock(st->mu);
              st->cv.wait(lock, [&] { return st->open; });
            }));
            return gate;
          },
          "stream"_a,
          "Tests: holds `stream` of the emulated device's delayed streams until the returned gate is opened "
          "(or freed).")
      .def(
          "register",
          [](Engine& e, const std::string& name, const std::string& dtype, std::uint64_t numel, const std::string& role,
             int group, const std::string& home, nb::handle initial, bool durable, nb::handle fill) {
            TensorDesc d;
            d.name = name;
            d.dtype = unwrap(parse_dtype(dtype));
            d.numel = numel;
            d.role = unwrap(parse_role(role));
            d.group = group;
            const Tier h = unwrap(parse_tier(home));
            Result<TensorId> id{Status(StatusCode::kInternal, "not registered")};
            if (!fill.is_none()) {
              if (!initial.is_none()) {
                raise_status(invalid_argument(str("register '", name, "': give `initial` or `fill`, not both")));
              }
              // Called on this thread with the GIL taken back, with a writable uint8 view of the
              // tensor's host copy (valid during the call only). Its exception is raised as it was.
              const Engine::Fill fn = [&fill](void* dst, std::uint64_t bytes) {
                return call_python(
                    [&] {
                      const std::size_t shape[1] = {static_cast<std::size_t>(bytes)};
                      nb::ndarray<nb::numpy, std::uint8_t> view(dst, 1, shape, nb::handle());
                      fill(nb::cast(view, nb::rv_policy::reference));
                      return Status::Ok();
                    },
                    "the fill function");
              };
              id = unlocked([&] { return e.register_filled(d, h, fn, durable); });
              check_keeping_python(id.status());
              return *id;
            }
            const void* src = nullptr;
            if (!initial.is_none()) src = host_view(initial, d.bytes(), str("register '", name, "'").c_str()).data;
            {
              nb::gil_scoped_release unlocked;
              id = e.register_tensor(d, h, src, durable);
            }
            return unwrap(std::move(id));
          },
          "name"_a, "dtype"_a, "numel"_a, "role"_a = "user", "group"_a = 0, "home"_a = "host", "initial"_a = nb::none(),
          "durable"_a = true, "fill"_a = nb::none(),
          "Registers a tensor. With `initial` and durable=False it returns once the contents are in the host tier, "
          "their write home started (flush() makes them durable). `fill` instead of `initial`: a callable given a "
          "writable uint8 numpy array over the tensor's host copy (valid during the call only) that writes all of "
          "its bytes, e.g. os.preadv from a file: the contents without a copy from another buffer; an exception "
          "from it registers nothing and is raised.")
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
          [](Engine& e, TensorId id, const std::string& tier, const std::string& access, bool traced,
             std::optional<std::uintptr_t> stream) {
            const Tier t = unwrap(parse_tier(tier));
            const Access a = parse_access(access);
            check(stream_ordered_read(t, a, stream));
            Result<Lease> lease{Status(StatusCode::kInternal, "not acquired")};
            {
              nb::gil_scoped_release unlocked;
              lease = start_acquire(e, id, t, a, traced, stream).wait();
            }
            return py_lease(e, unwrap(std::move(lease)));
          },
          "id"_a, "tier"_a, "access"_a = "read", "traced"_a = true, "stream"_a = nb::none(),
          "A lease of the tensor's copy on `tier`. With `stream` (a device read only; the consumer's cudaStream_t "
          "as an integer) it is granted once the copy's transfer is queued, with the stream made to wait for it "
          "(Engine::acquire_on_stream): use the memory on that stream only.")
      .def(
          "acquire_many",
          [](Engine& e, const std::vector<TensorId>& ids, const std::string& tier, const std::string& access,
             bool traced, std::optional<std::uintptr_t> stream) {
            const Tier t = unwrap(parse_tier(tier));
            const Access a = parse_access(access);
            check(stream_ordered_read(t, a, stream));
            std::vector<Lease> leases;
            Status failed;
            {
              nb::gil_scoped_release unlocked;
              // Every acquire is started before any is waited for, so their loads overlap.
              std::vector<AcquireFuture> futures;
              futures.reserve(ids.size());
              for (TensorId id : ids) futures.push_back(start_acquire(e, id, t, a, traced, stream));
              leases.reserve(ids.size());
              for (auto& f : futures) {
                if (!failed.ok()) {
                  f.cancel();  // its lease, once granted, ends unused
                  continue;
                }
                auto l = f.wait();
                if (l.ok()) {
                  leases.push_back(std::move(l).value());
                } else {
                  failed = l.status();
                }
              }
              if (!failed.ok()) leases.clear();  // all or nothing: the granted ones end here
            }
            check(failed);
            std::vector<PyLease> out;
            out.reserve(leases.size());
            for (auto& l : leases) out.push_back(py_lease(e, std::move(l)));
            return out;
          },
          "ids"_a, "tier"_a, "access"_a = "read", "traced"_a = true, "stream"_a = nb::none(),
          "acquire() of several tensors in one call: every acquire starts before any is waited for; all or none "
          "are granted (on an error the granted ones end and the rest are given up). `stream` as for acquire().")
      .def(
          "read",
          [](Engine& e, TensorId id, nb::handle out) {
            auto info = unwrap(e.info(id));
            nb::ndarray<nb::c_contig, nb::device::cpu> a;
            if (!nb::try_cast(out, a, /*convert=*/false) || a.nbytes() != info.desc.bytes()) {
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
          if (!nb::try_cast(out[i], arrays[i], /*convert=*/false) || arrays[i].dtype() != nb::dtype<float>() ||
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
  m.def(
      "read_checkpoint_state",
      [](const std::string& path, nb::object visit) {
        const Status s = unlocked([&] {
          return optim::read_checkpoint_state(
              path, [&](const optim::CheckpointPartition& part, optim::StateKind kind, std::uint64_t offset,
                        const float* values, std::uint64_t count) {
                return call_python(
                    [&] {
                      const std::size_t shape[1] = {static_cast<std::size_t>(count)};
                      // Read-only, and valid during the call only: the visitor copies what it keeps.
                      nb::ndarray<nb::numpy, nb::ro, float> view(const_cast<float*>(values), 1, shape, nb::handle());
                      visit(part.id, optim::state_kind_name(kind), offset, nb::cast(view, nb::rv_policy::reference));
                      return Status::Ok();
                    },
                    "read_checkpoint_state: the visitor");
              });
        });
        check_keeping_python(s);
      },
      "path"_a, "visit"_a,
      "Calls visit(partition, kind, offset, values) with consecutive pieces of every state array (kind "
      "'master', 'exp_avg' or 'exp_avg_sq', as float32 whatever the file's state dtype) of the optimizer "
      "checkpoint at path, per record its master, then its moments; `values` is a read-only float32 numpy "
      "array valid during the call only. Every record and the trailer are verified (tier.DataLoss when "
      "damaged); only a call that returns vouches for what visit was given. An exception from visit stops the "
      "read and is raised.");
}

}  // namespace tier::python
