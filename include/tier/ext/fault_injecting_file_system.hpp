// tier/ext/fault_injecting_file_system.hpp — a FileSystem decorator for tests: it fails chosen
// calls, cuts the power at a chosen sync point and then drops what was not durable, so that crash
// safety is tested against a disk that forgets, not against a page cache that remembers.
//
// Every call passes through to the wrapped file system (the real disk) unless a fault or a power
// cut stops it. Beside that, the decorator keeps a model of what is durable:
//  - file data: for each regular file written through it (and each file it created), the content
//    as of its last sync()/data_sync() (empty for a new file). It keeps a copy of that content in
//    memory, so it is meant for test-sized files.
//  - directory entries: each create (open with O_CREAT of a new name, mkdir, symlink), rename,
//    unlink and rmdir is pending until its directory is synced (a rename: both directories).
// simulate_power_loss() makes the disk what the model says survived: every file written since
// its last sync gets its synced content back (truncated to the synced length), then the pending
// directory changes are undone, newest first (a created name disappears, with everything under
// it; a removed file comes back with its durable content; a rename goes back and what it replaced
// returns). Files and entries that existed before the decorator saw them are durable as they are.
// This is the weakest POSIX promise (what was synced, and only that), stricter than ext4's ordered
// journal: a protocol that holds here holds there.
//
// Power: cut_power_after_syncs(n) lets n more sync calls complete; the next one fails, and from
// then on every call fails with EIO without reaching the disk (a process that dies at a sync point
// does nothing more). cut_power_after_mutations(n) does the same at the n+1-th call that changes
// the disk (create, write, sync, allocate, truncate, rename, unlink, mkdir, rmdir, symlink, chmod).
// After the cut, simulate_power_loss() models the power loss and turns the power back on with a
// clean slate (everything on disk now counts as durable); restore_power() turns it back on without
// losing anything (a killed process: the page cache keeps what it wrote).
//
// For tests of the tests: drop_syncs() makes sync calls succeed without making anything durable,
// as a writer that forgot them would, so a harness can show that it notices.
//
// Thread safety: as for FileSystem; one mutex orders the calls that change the model. Faults and
// power may be set from any thread.
// Extension interface (include/tier/ext/README.md): stable for backends, tests and tools; not
// the user API.
#pragma once

#include <cerrno>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "tier/ext/file_system.hpp"

namespace tier {

struct FileFault {
  std::optional<FileOp> op;  // only calls of this kind; empty: any call
  std::string path_part;     // only calls whose path holds this; empty: any path
  // The first matching call to fail (1 = the next one, counted from when the fault is added) and
  // how many matching calls after it fail too.
  std::uint64_t nth = 1;
  std::uint64_t count = 1;
  int err = EIO;
};

struct FileSystemCounters {
  std::uint64_t calls[kFileOpCount] = {};  // calls that reached the disk, per FileOp
  std::uint64_t syncs = 0;                 // sync points passed (file and directory syncs that completed)
  std::uint64_t mutations = 0;             // calls that changed the disk and completed
  std::uint64_t failed = 0;                // calls failed by a fault or by the power being off
  std::uint64_t pending_entries = 0;       // directory changes not yet durable
  std::uint64_t unsynced_files = 0;        // files written since their last sync
  bool powered_off = false;
};

class FaultInjectingFileSystem final : public FileSystem {
 public:
  explicit FaultInjectingFileSystem(std::shared_ptr<FileSystem> inner = FileSystem::posix());
  ~FaultInjectingFileSystem() override;

  // Faults are checked in the order added; the first that matches a call fails it.
  void add_fault(const FileFault& fault);
  void clear_faults();

  // See the header comment. n counts from now.
  void cut_power_after_syncs(std::uint64_t n);
  void cut_power_after_mutations(std::uint64_t n);
  void cut_power_now();
  bool powered_off() const;
  // Reverts the disk to its durable state, then powers on with nothing pending. An error names
  // what could not be put back (the disk was changed behind the decorator's back).
  Status simulate_power_loss();
  // Powers on again, keeping what was written (durable or not).
  void restore_power();
  // Syncs succeed and count but make nothing durable: file syncs (`files`), directory syncs (`dirs`).
  void drop_syncs(bool files, bool dirs);

  FileSystemCounters counters() const;

  Result<std::unique_ptr<File>> open(const std::string& path, int flags, mode_t mode = 0,
                                     const File* at = nullptr) override;
  Status rename(const std::string& from, const std::string& to) override;
  Status unlink(const std::string& path, const File* at = nullptr) override;
  Status mkdir(const std::string& path, mode_t mode) override;
  Status rmdir(const std::string& path) override;
  Status symlink(const std::string& target, const std::string& link) override;
  Result<std::string> readlink(const std::string& path) override;
  Result<struct stat> stat(const std::string& path, bool follow = true, const File* at = nullptr) override;
  Status chmod(const std::string& path, mode_t mode) override;
  Result<std::vector<std::string>> list(const std::string& dir, const File* at = nullptr) override;

  struct Model;  // the durability model and the counters, shared with the files it opened

 private:
  std::shared_ptr<Model> m_;
};

}  // namespace tier
