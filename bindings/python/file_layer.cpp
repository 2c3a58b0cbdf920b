// tier._tier's file layer (tier/ext/file_system.hpp) for Python: tier.fs writes the checkpoints,
// the safetensors shards and every other durable file through these, so that one installed
// FileSystem (a fault-injecting one in tests) sees every file operation of a save, C++ and Python.
//
// A failed system call raises OSError with its errno (FileExistsError, FileNotFoundError, ... as
// Python picks the subclass) and tier's message; other errors raise tier's exceptions. Every call
// releases the GIL while it runs.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <fcntl.h>

#include <cerrno>
#include <memory>
#include <optional>
#include <utility>

#include "binding_util.hpp"
#include "tier/ext/fault_injecting_file_system.hpp"
#include "tier/ext/file_system.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace tier::python {

namespace {

[[noreturn]] void raise_os(const Status& s) {
  if (s.sys_errno() == 0) raise_status(s);
  nb::object exc = nb::steal(PyObject_CallFunction(PyExc_OSError, "is", s.sys_errno(), s.message().c_str()));
  if (!exc.is_valid()) throw nb::python_error();
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw nb::python_error();
}

void check_os(const Status& s) {
  if (!s.ok()) raise_os(s);
}

template <class T>
T unwrap_os(Result<T> r) {
  if (!r.ok()) raise_os(r.status());
  return std::move(r).value();
}

// A contiguous byte view of any buffer (bytes, bytearray, memoryview, numpy), for as long as it lives.
class Bytes {
 public:
  explicit Bytes(nb::handle obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_SIMPLE) != 0) throw nb::python_error();
  }
  ~Bytes() { PyBuffer_Release(&view_); }
  Bytes(const Bytes&) = delete;
  Bytes& operator=(const Bytes&) = delete;
  const void* data() const { return view_.buf; }
  std::size_t size() const { return static_cast<std::size_t>(view_.len); }

 private:
  Py_buffer view_{};
};

struct PyFile {
  std::unique_ptr<File> file;
  std::string path;

  File& get() {
    if (!file) raise_os(errno_status(EBADF, str("file ", path, ": closed")));
    return *file;
  }
};

// The fault-injecting layer installed process-wide, for tests (tier._tier._install_fault_fs()).
struct PyFaultFs {
  std::shared_ptr<FaultInjectingFileSystem> fs;
  std::shared_ptr<FileSystem> previous;
  bool installed = true;

  PyFaultFs(std::shared_ptr<FaultInjectingFileSystem> f, std::shared_ptr<FileSystem> p)
      : fs(std::move(f)), previous(std::move(p)) {}
  PyFaultFs(PyFaultFs&& o) noexcept
      : fs(std::move(o.fs)), previous(std::move(o.previous)), installed(std::exchange(o.installed, false)) {}
  PyFaultFs(const PyFaultFs&) = delete;
  PyFaultFs& operator=(const PyFaultFs&) = delete;
  PyFaultFs& operator=(PyFaultFs&&) = delete;
  // A controller dropped without uninstall() (a test that failed half way) still puts the
  // previous layer back: a fault layer must never outlive its test.
  ~PyFaultFs() { uninstall(); }

  void uninstall() {
    if (!installed) return;
    installed = false;
    // Only if it is still the installed one: a later install stays.
    std::shared_ptr<FileSystem> now = FileSystem::install(previous);
    if (now != fs) FileSystem::install(now);
  }
};

std::optional<FileOp> parse_op(const std::optional<std::string>& name) {
  if (!name) return std::nullopt;
  for (int i = 0; i < kFileOpCount; ++i) {
    if (*name == file_op_name(static_cast<FileOp>(i))) return static_cast<FileOp>(i);
  }
  raise_status(invalid_argument(str("file operation '", *name, "': not one of open, close, read, write, sync, ",
                                    "allocate, truncate, stat, lock, rename, unlink, mkdir, rmdir, symlink, readlink, ",
                                    "chmod, list")));
}

}  // namespace

void bind_file_layer(nb::module_& m) {
  nb::class_<PyFile>(m, "FsFile", "A file opened through tier's file layer (tier.fs wraps it).")
      .def_prop_ro("path", [](const PyFile& f) { return f.path; })
      .def_prop_ro("closed", [](const PyFile& f) { return !f.file; })
      .def("fileno",
           [](PyFile& f) {
             File& file = f.get();
             return file.fd();
           })
      .def(
          "write",
          [](PyFile& f, nb::handle data) {
            File& file = f.get();
            Bytes b(data);
            check_os(unlocked([&] { return file.write_all(b.data(), b.size()); }));
            return b.size();
          },
          "data"_a, "Writes all of a bytes-like object at the file's offset; returns its length.")
      .def(
          "pwrite",
          [](PyFile& f, nb::handle data, std::uint64_t offset) {
            File& file = f.get();
            Bytes b(data);
            check_os(unlocked([&] { return file.pwrite_all(b.data(), b.size(), offset); }));
            return b.size();
          },
          "data"_a, "offset"_a)
      .def("sync",
           [](PyFile& f) {
             File& file = f.get();
             check_os(unlocked([&] { return file.sync(); }));
           })
      .def("datasync",
           [](PyFile& f) {
             File& file = f.get();
             check_os(unlocked([&] { return file.data_sync(); }));
           })
      .def(
          "truncate",
          [](PyFile& f, std::uint64_t bytes) {
            File& file = f.get();
            check_os(unlocked([&] { return file.truncate(bytes); }));
          },
          "bytes"_a)
      .def(
          "allocate",
          [](PyFile& f, std::uint64_t offset, std::uint64_t bytes) {
            File& file = f.get();
            check_os(unlocked([&] { return file.allocate(offset, bytes); }));
          },
          "offset"_a, "bytes"_a)
      .def(
          "lock",
          [](PyFile& f, bool exclusive, bool wait) {
            File& file = f.get();
            check_os(unlocked([&] { return file.lock(exclusive ? LockMode::kExclusive : LockMode::kShared, wait); }));
          },
          "exclusive"_a = true, "wait"_a = false, "flock; without wait, BlockingIOError when another holder has it.")
      .def("unlock",
           [](PyFile& f) {
             File& file = f.get();
             check_os(unlocked([&] { return file.lock(LockMode::kUnlock, false); }));
           })
      .def("close", [](PyFile& f) {
        if (!f.file) return;
        std::unique_ptr<File> file = std::move(f.file);
        check_os(unlocked([&] { return file->close(); }));
      });

  m.def(
      "fs_open",
      [](const std::string& path, int flags, int mode) {
        auto fs = FileSystem::current();
        auto file = unwrap_os(unlocked([&] { return fs->open(path, flags, static_cast<mode_t>(mode)); }));
        return PyFile{std::move(file), path};
      },
      "path"_a, "flags"_a, "mode"_a = 0666, "open(2) through the file layer; O_CLOEXEC is added.");
  m.def(
      "fs_rename",
      [](const std::string& from, const std::string& to) {
        auto fs = FileSystem::current();
        check_os(unlocked([&] { return fs->rename(from, to); }));
      },
      "src"_a, "dst"_a);
  m.def(
      "fs_unlink",
      [](const std::string& path) {
        auto fs = FileSystem::current();
        check_os(unlocked([&] { return fs->unlink(path); }));
      },
      "path"_a);
  m.def(
      "fs_mkdir",
      [](const std::string& path, int mode) {
        auto fs = FileSystem::current();
        check_os(unlocked([&] { return fs->mkdir(path, static_cast<mode_t>(mode)); }));
      },
      "path"_a, "mode"_a = 0777);
  m.def(
      "fs_rmdir",
      [](const std::string& path) {
        auto fs = FileSystem::current();
        check_os(unlocked([&] { return fs->rmdir(path); }));
      },
      "path"_a);
  m.def(
      "fs_symlink",
      [](const std::string& target, const std::string& link) {
        auto fs = FileSystem::current();
        check_os(unlocked([&] { return fs->symlink(target, link); }));
      },
      "target"_a, "link"_a);
  m.def(
      "fs_readlink",
      [](const std::string& path) {
        auto fs = FileSystem::current();
        return unwrap_os(unlocked([&] { return fs->readlink(path); }));
      },
      "path"_a);
  m.def(
      "fs_chmod",
      [](const std::string& path, int mode) {
        auto fs = FileSystem::current();
        check_os(unlocked([&] { return fs->chmod(path, static_cast<mode_t>(mode)); }));
      },
      "path"_a, "mode"_a);
  m.def(
      "fs_sync_dir",
      [](const std::string& path) {
        auto fs = FileSystem::current();
        check_os(unlocked([&] { return fs->sync_dir(path); }));
      },
      "path"_a, "Opens directory `path` and fsyncs it.");

  nb::class_<PyFaultFs>(m, "FaultFileSystem",
                        "Test hook: the fault-injecting file layer (tier/ext/fault_injecting_file_system.hpp), "
                        "installed process-wide until uninstall().")
      .def(
          "cut_power_after_syncs", [](PyFaultFs& f, std::uint64_t n) { f.fs->cut_power_after_syncs(n); }, "n"_a,
          "n more sync points complete; at the next one the power goes off and every later call fails (EIO).")
      .def(
          "cut_power_after_mutations", [](PyFaultFs& f, std::uint64_t n) { f.fs->cut_power_after_mutations(n); }, "n"_a,
          "As cut_power_after_syncs, counting every call that changes the disk.")
      .def("cut_power_now", [](PyFaultFs& f) { f.fs->cut_power_now(); })
      .def(
          "restore_power", [](PyFaultFs& f) { f.fs->restore_power(); },
          "Power on again keeping everything written (a killed process: the page cache survives).")
      .def(
          "simulate_power_loss", [](PyFaultFs& f) { check_os(unlocked([&] { return f.fs->simulate_power_loss(); })); },
          "Reverts the disk to what was synced, then powers on with nothing pending.")
      .def(
          "drop_syncs", [](PyFaultFs& f, bool files, bool dirs) { f.fs->drop_syncs(files, dirs); }, "files"_a, "dirs"_a,
          "Syncs succeed but make nothing durable (a writer that forgot them).")
      .def(
          "fail",
          [](PyFaultFs& f, std::optional<std::string> op, std::uint64_t nth, std::uint64_t count, int err,
             const std::string& path_part) {
            f.fs->add_fault({parse_op(op), path_part, nth, count, err});
          },
          "op"_a.none() = nb::none(), "nth"_a = 1, "count"_a = 1, "errno"_a = EIO, "path_part"_a = "",
          "Fails the nth matching call (op: 'rename', 'sync', ...; None: any) and `count` after it.")
      .def("clear_faults", [](PyFaultFs& f) { f.fs->clear_faults(); })
      .def_prop_ro("powered_off", [](PyFaultFs& f) { return f.fs->powered_off(); })
      .def_prop_ro(
          "sync_points", [](PyFaultFs& f) { return f.fs->counters().syncs; },
          "Sync points passed (file and directory syncs that completed).")
      .def_prop_ro("mutations", [](PyFaultFs& f) { return f.fs->counters().mutations; })
      .def("counters",
           [](PyFaultFs& f) {
             const FileSystemCounters c = f.fs->counters();
             nb::dict d, calls;
             for (int i = 0; i < kFileOpCount; ++i) calls[file_op_name(static_cast<FileOp>(i))] = c.calls[i];
             d["calls"] = calls;
             d["syncs"] = c.syncs;
             d["mutations"] = c.mutations;
             d["failed"] = c.failed;
             d["pending_entries"] = c.pending_entries;
             d["unsynced_files"] = c.unsynced_files;
             d["powered_off"] = c.powered_off;
             return d;
           })
      .def_prop_ro("installed", [](PyFaultFs& f) { return f.installed; })
      .def("uninstall", &PyFaultFs::uninstall, "Puts back the file layer that was installed before.");

  m.def(
      "_install_fault_fs",
      []() {
        auto fs = std::make_shared<FaultInjectingFileSystem>(FileSystem::posix());
        auto previous = FileSystem::install(fs);
        return PyFaultFs(fs, previous);
      },
      "Test hook: installs a fresh fault-injecting file layer process-wide; returns its controller.");
}

}  // namespace tier::python
