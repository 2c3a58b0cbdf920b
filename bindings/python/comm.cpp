// tier._tier.Communicator: tier::Communicator (tier/comm.hpp) over a host framework's all-reduce,
// a Python callable (make_callback_communicator builds the other collectives from it). tier.torch
// gives torch.distributed's; the step driver takes it (step(comm=...), start_overlap(comm=...))
// for the gradient norm across data-parallel ranks, as the C ABI's tier_step_options_t::comm.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <string>

#include "binding_util.hpp"
#include "tier/comm.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace tier::python {

namespace {

// The numpy dtype a collective's buffer is shown to Python with (bf16 has none).
bool numpy_dtype(DType d, nb::dlpack::dtype& out) {
  switch (d) {
    case DType::kF32: out = nb::dtype<float>(); return true;
    case DType::kF64: out = nb::dtype<double>(); return true;
    case DType::kF16: out = {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1}; return true;
    case DType::kI8: out = nb::dtype<std::int8_t>(); return true;
    case DType::kU8: out = nb::dtype<std::uint8_t>(); return true;
    case DType::kI32: out = nb::dtype<std::int32_t>(); return true;
    case DType::kI64: out = nb::dtype<std::int64_t>(); return true;
    case DType::kBF16: return false;
  }
  return false;
}

// Calls fn(array, op) with the GIL held: `array` a numpy view of buf (count elements, valid only
// during the call), to be reduced in place. An exception becomes the collective's error.
Status call_all_reduce(nb::handle fn, void* buf, std::uint64_t count, DType dtype, ReduceOp op) {
  nb::dlpack::dtype dt;
  if (!numpy_dtype(dtype, dt)) {
    return Status(StatusCode::kUnsupported, str("all_reduce of ", dtype_name(dtype), ": numpy has no such dtype"));
  }
  nb::gil_scoped_acquire locked;
  try {
    const std::size_t shape[1] = {static_cast<std::size_t>(count)};
    nb::ndarray<nb::numpy> view(buf, 1, shape, nb::handle(), nullptr, dt);
    fn(nb::cast(view, nb::rv_policy::reference), reduce_op_name(op));
    return Status::Ok();
  } catch (nb::python_error& e) {
    std::string what = e.what();
    return Status(StatusCode::kFailedPrecondition, str("the all_reduce callable raised: ", what));
  } catch (std::exception& e) {
    return Status(StatusCode::kFailedPrecondition, str("the all_reduce callable: ", e.what()));
  }
}

// Owns the communicator and the callable its all-reduce calls (declared first: the communicator,
// whose callbacks borrow it, goes before it). Both are shown to the garbage collector: a callable
// that refers back to its communicator (through a closure or its module) is a cycle it can break.
struct PyCommunicator {
  nb::object fn;
  std::unique_ptr<Communicator> comm;

  Communicator& get() {
    if (!comm) raise_status(failed_precondition("the communicator was cleared (garbage-collected)"));
    return *comm;
  }
};

int comm_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  Py_VISIT(nb::inst_ptr<PyCommunicator>(self)->fn.ptr());
  return 0;
}

int comm_clear(PyObject* self) {
  PyCommunicator* c = nb::inst_ptr<PyCommunicator>(self);
  c->comm.reset();
  c->fn = nb::object();
  return 0;
}

PyType_Slot comm_slots[] = {{Py_tp_traverse, reinterpret_cast<void*>(comm_traverse)},
                            {Py_tp_clear, reinterpret_cast<void*>(comm_clear)},
                            {0, nullptr}};

}  // namespace

Communicator* communicator_of(nb::handle h) {
  if (!h.is_valid() || h.is_none()) return nullptr;
  if (!nb::isinstance<PyCommunicator>(h)) {
    const std::string type = nb::cast<std::string>(nb::str(h.type().attr("__name__")));
    throw nb::type_error(str("comm must be a tier._tier.Communicator or None, not ", type).c_str());
  }
  return &nb::cast<PyCommunicator&>(h).get();
}

void bind_comm(nb::module_& m) {
  nb::class_<PyCommunicator>(m, "Communicator", nb::type_slots(comm_slots),
                             "tier::Communicator over a host framework's all-reduce (a Python callable).")
      .def(
          "__init__",
          [](PyCommunicator* self, int rank, int world, nb::object all_reduce, std::string name) {
            if (!PyCallable_Check(all_reduce.ptr())) {
              raise_status(invalid_argument("Communicator: all_reduce must be callable (array, op) -> None"));
            }
            CommCallbacks cb;
            cb.rank = rank;
            cb.world = world;
            cb.name = std::move(name);
            const nb::handle borrowed = all_reduce;  // (owned by the PyCommunicator, which outlives comm)
            cb.all_reduce = [borrowed](void* buf, std::uint64_t count, DType dtype, ReduceOp op) {
              return call_all_reduce(borrowed, buf, count, dtype, op);
            };
            auto comm = unwrap(make_callback_communicator(std::move(cb)));
            new (self) PyCommunicator{std::move(all_reduce), std::move(comm)};
          },
          "rank"_a, "world"_a, "all_reduce"_a, "name"_a = "python",
          "all_reduce(array, op): reduces the numpy array in place over every rank (op 'sum', 'max' or 'min'); "
          "called with the GIL held, in the same order on every rank. An exception fails the collective (and "
          "a step that needed it, with nothing applied).")
      .def_prop_ro("rank", [](PyCommunicator& c) { return c.get().rank(); })
      .def_prop_ro("world", [](PyCommunicator& c) { return c.get().world(); })
      .def_prop_ro("name", [](PyCommunicator& c) { return std::string(c.get().name()); })
      .def(
          "all_reduce_f64",
          [](PyCommunicator& c, double v) {
            Communicator& comm = c.get();
            check(unlocked([&] { return comm.all_reduce(&v, 1, DType::kF64, ReduceOp::kSum); }));
            return v;
          },
          "v"_a, "The sum of v over the ranks (one fp64 all-reduce, as the step's gradient norm makes).");
}

}  // namespace tier::python
