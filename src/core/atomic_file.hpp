// A file written whole or not at all, through no path another user controls.
//
// Every file tier writes outside its private swap files (the trace, the optimizer's checkpoint)
// goes through AtomicFile: the bytes go to a fresh temporary file in the target's directory,
// created with O_CREAT|O_EXCL|O_NOFOLLOW under an unpredictable name (".<name>.<pid>.<random>.tmp"),
// so a symlink or file that someone planted under a predictable name ("<name>.tmp") can neither
// redirect the write nor be truncated; commit() fsyncs it, renames it over the target (rename
// replaces a symlink at the target, it does not follow it) and fsyncs the directory. A crash
// leaves the old file or the new one under the target's name, never half of one. Every call goes
// through the file layer (FileSystem::current() when the file is created; tier/ext/file_system.hpp),
// so tests can fail any of them or cut the power between them.
//
// Thread safety: an AtomicFile is used by one thread at a time; distinct ones are independent.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "tier/ext/file_system.hpp"
#include "tier/status.hpp"

namespace tier::detail {

class AtomicFile {
 public:
  // Creates the temporary file for `path` with permission bits `mode` (less the umask). `what`
  // names the file in messages ("trace", "checkpoint"). Errors: a path that is empty or holds a
  // NUL byte (kInvalidArgument), the directory's errors (missing, not writable).
  static Result<AtomicFile> create(const std::string& path, mode_t mode, std::string_view what);

  AtomicFile(AtomicFile&& other) noexcept;
  AtomicFile& operator=(AtomicFile&& other) noexcept;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  // Without commit(): closes and removes the temporary file; the target is untouched.
  ~AtomicFile();

  // The temporary file, for writes; valid until commit() or destruction.
  File& file() noexcept { return *file_; }
  const std::string& path() const noexcept { return path_; }
  const std::string& temp_path() const noexcept { return temp_; }

  // Writes all of `data` at the current offset (retrying short writes and EINTR).
  Status write(const void* data, std::size_t bytes);
  // fsyncs and closes the temporary file, renames it over the target and fsyncs the directory.
  // On an error before the rename the temporary file is removed and the target is untouched.
  Status commit();

 private:
  AtomicFile() = default;
  void discard() noexcept;

  std::shared_ptr<FileSystem> fs_;
  std::unique_ptr<File> file_;
  std::string path_;
  std::string temp_;
  std::string dir_;
  std::string what_;
};

// Whether `path` holds a NUL byte (which a system call would silently cut the path at).
inline bool has_nul(std::string_view path) noexcept {
  return path.find('\0') != std::string_view::npos;
}

}  // namespace tier::detail
