// What tier._tier's source files share: a failed Status raised as the Python exception its code
// maps to (module.cpp's raise_status: tier.TierError and its subclasses, OSError's errno set where
// the status has one), and running native work without the GIL.
#pragma once

#include <nanobind/nanobind.h>

#include <utility>

#include "tier/status.hpp"

namespace tier {
class Communicator;
}
namespace tier::optim {
struct StepReport;
}

namespace tier::python {

[[noreturn]] void raise_status(const Status& s);  // module.cpp

// The tier::Communicator of a _tier.Communicator (comm.cpp); nullptr for None.
Communicator* communicator_of(nanobind::handle h);

// An optimizer step's report (tier::optim::StepReport) as a dict (module.cpp).
nanobind::dict report_dict(const optim::StepReport& r);

inline void check(const Status& s) {
  if (!s.ok()) raise_status(s);
}

template <class T>
T unwrap(Result<T> r) {
  if (!r.ok()) raise_status(r.status());
  return std::move(r).value();
}

// Runs `f` without the GIL and returns what it returns.
template <class F>
auto unlocked(F&& f) {
  nanobind::gil_scoped_release release;
  return f();
}

// Calls into Python from native work that runs without the GIL on the thread that released it (a
// fill, a visitor, a hook): takes the GIL back for `f` (returning a Status). An exception `f`
// raises is kept as the thread's pending Python error and ends the native work with kCancelled;
// check_keeping_python() then raises it as it was.
template <class F>
Status call_python(F&& f, const char* what) {
  nanobind::gil_scoped_acquire locked;
  try {
    return f();
  } catch (nanobind::python_error& e) {
    e.restore();
    return Status(StatusCode::kCancelled, str(what, " raised"));
  }
}

// check(s), except that a Python exception kept by call_python is raised instead, as it was.
inline void check_keeping_python(const Status& s) {
  if (!s.ok() && PyErr_Occurred()) throw nanobind::python_error();
  check(s);
}

}  // namespace tier::python
