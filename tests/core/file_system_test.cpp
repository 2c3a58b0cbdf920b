// The file layer: the posix implementation carries errno and names the path; install() swaps the
// process-wide one and open files keep theirs; the helpers (write_all, create_directories,
// write_file_atomically, sync_dir) go through whatever is installed.
#include "tier/ext/file_system.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "tier/ext/fault_injecting_file_system.hpp"
#include "core/power_cut.hpp"
#include "core/scratch.hpp"

namespace tier {
namespace {

namespace fs = std::filesystem;
using test::Scratch;
using test::slurp;

TEST(FileSystem, PosixIsTheDefault) {
  EXPECT_EQ(FileSystem::current(), FileSystem::posix());
}

TEST(FileSystem, ErrorsCarryTheErrnoAndNameThePath) {
  Scratch d;
  auto fsys = FileSystem::posix();
  auto r = fsys->open(d.sub("missing/x"), O_RDONLY);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().sys_errno(), ENOENT);
  EXPECT_NE(r.status().message().find(d.sub("missing/x")), std::string::npos) << r.status();
  const Status s = fsys->rename(d.sub("a"), d.sub("b"));
  EXPECT_EQ(s.sys_errno(), ENOENT);
  EXPECT_NE(s.message().find(d.sub("a")), std::string::npos) << s;
  const Status nul = fsys->mkdir(std::string("x\0y", 3), 0700);
  EXPECT_EQ(nul.code(), StatusCode::kInvalidArgument) << nul;
}

TEST(FileSystem, WritesReadsAndSyncsThroughAFile) {
  Scratch d;
  auto fsys = FileSystem::posix();
  auto f = fsys->open(d.sub("f"), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE((*f)->write_all("hello ", 6).ok());
  char a[] = "big ", b[] = "world";
  iovec v[2] = {{a, 4}, {b, 5}};
  ASSERT_TRUE((*f)->write_all(v, 2).ok());
  ASSERT_TRUE((*f)->pwrite_all("H", 1, 0).ok());
  ASSERT_TRUE((*f)->sync().ok());
  ASSERT_TRUE((*f)->data_sync().ok());
  char buf[32] = {};
  auto n = (*f)->pread(buf, sizeof buf, 0);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(std::string(buf, *n), "Hello big world");
  ASSERT_TRUE((*f)->truncate(5).ok());
  EXPECT_EQ((*f)->stat()->st_size, 5);
  ASSERT_TRUE((*f)->allocate(0, 8192).ok() || (*f)->allocate(0, 8192).sys_errno() == EOPNOTSUPP);
  ASSERT_TRUE((*f)->close().ok());
  ASSERT_TRUE((*f)->close().ok()) << "closing twice is a no-op";
  EXPECT_EQ(slurp(d.sub("f")).substr(0, 5), "Hello");
  // O_EXCL refuses an existing name.
  auto again = fsys->open(d.sub("f"), O_WRONLY | O_CREAT | O_EXCL, 0600);
  EXPECT_EQ(again.status().sys_errno(), EEXIST);
}

TEST(FileSystem, NamesOperations) {
  Scratch d;
  auto fsys = FileSystem::posix();
  ASSERT_TRUE(fsys->mkdir(d.sub("dir"), 0700).ok());
  ASSERT_TRUE(fsys->symlink("dir", d.sub("link")).ok());
  EXPECT_EQ(*fsys->readlink(d.sub("link")), "dir");
  EXPECT_TRUE(S_ISLNK(fsys->stat(d.sub("link"), false)->st_mode));
  EXPECT_TRUE(S_ISDIR(fsys->stat(d.sub("link"), true)->st_mode));
  {
    auto f = fsys->open(d.sub("dir/x"), O_WRONLY | O_CREAT, 0644);
    ASSERT_TRUE(f.ok());
  }
  ASSERT_TRUE(fsys->chmod(d.sub("dir/x"), 0600).ok());
  EXPECT_EQ(fsys->stat(d.sub("dir/x"))->st_mode & 0777, 0600u);
  auto names = fsys->list(d.sub("dir"));
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, std::vector<std::string>{"x"});
  // Relative to an open directory.
  auto dir = fsys->open(d.sub("dir"), O_RDONLY | O_DIRECTORY);
  ASSERT_TRUE(dir.ok());
  EXPECT_EQ((*dir)->path(), d.sub("dir"));
  EXPECT_TRUE(fsys->stat("x", false, dir->get()).ok());
  ASSERT_TRUE(fsys->rename(d.sub("dir/x"), d.sub("dir/y")).ok());
  ASSERT_TRUE(fsys->unlink("y", dir->get()).ok());
  EXPECT_TRUE(fsys->list(".", dir->get())->empty());
  ASSERT_TRUE(fsys->sync_dir(d.sub("dir")).ok());
  ASSERT_TRUE(fsys->unlink(d.sub("link")).ok());
  ASSERT_TRUE(fsys->rmdir(d.sub("dir")).ok());
  EXPECT_FALSE(fs::exists(d.path / "dir"));
}

TEST(FileSystem, LockIsExclusiveAcrossOpenFiles) {
  Scratch d;
  auto fsys = FileSystem::posix();
  auto a = fsys->open(d.sub("lock"), O_RDWR | O_CREAT, 0600);
  auto b = fsys->open(d.sub("lock"), O_RDWR, 0600);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->lock(LockMode::kExclusive, false).ok());
  const Status busy = (*b)->lock(LockMode::kExclusive, false);
  EXPECT_EQ(busy.sys_errno(), EWOULDBLOCK) << busy;
  ASSERT_TRUE((*a)->lock(LockMode::kUnlock, false).ok());
  EXPECT_TRUE((*b)->lock(LockMode::kShared, false).ok());
}

TEST(FileSystem, CreateDirectoriesMakesTheMissingOnesOnly) {
  Scratch d;
  auto fsys = FileSystem::posix();
  ASSERT_TRUE(fsys->create_directories(d.sub("a/b/c/"), 0700).ok());
  EXPECT_TRUE(fs::is_directory(d.path / "a/b/c"));
  EXPECT_EQ(fs::status(d.path / "a/b/c").permissions() & fs::perms::all, fs::perms::owner_all);
  ASSERT_TRUE(fsys->create_directories(d.sub("a/b/c"), 0700).ok()) << "existing: nothing to do";
  std::ofstream(d.sub("file")) << "x";
  const Status s = fsys->create_directories(d.sub("file/sub"), 0700);
  EXPECT_EQ(s.sys_errno(), ENOTDIR) << s;
}

TEST(FileSystem, InstalledFileSystemIsUsedAndOpenFilesKeepTheirs) {
  Scratch d;
  auto fault = std::make_shared<FaultInjectingFileSystem>();
  std::unique_ptr<File> before;
  {
    test::InstalledFileSystem use(fault);
    EXPECT_EQ(FileSystem::current(), fault);
    ASSERT_TRUE(write_file_atomically(d.sub("out.json"), "{}", 0644, "config").ok());
    const FileSystemCounters c = fault->counters();
    EXPECT_EQ(c.calls[static_cast<int>(FileOp::kRename)], 1u);
    EXPECT_EQ(c.syncs, 2u) << "the file and its directory";
    auto f = FileSystem::current()->open(d.sub("kept"), O_WRONLY | O_CREAT, 0600);
    ASSERT_TRUE(f.ok());
    before = std::move(f).value();
  }
  EXPECT_EQ(FileSystem::current(), FileSystem::posix());
  EXPECT_EQ(slurp(d.sub("out.json")), "{}");
  // The file opened through the fault layer still goes through it (its model outlives the install).
  fault->cut_power_now();
  EXPECT_EQ(before->write_all("x", 1).sys_errno(), EIO);
  EXPECT_TRUE(FileSystem::current()->sync_dir(d.path.string()).ok()) << "the installed one is posix again";
}

}  // namespace
}  // namespace tier
