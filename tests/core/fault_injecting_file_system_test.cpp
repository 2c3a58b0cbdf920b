// FaultInjectingFileSystem: a power loss keeps exactly what was synced (file data by a file sync,
// names by a sync of their directory) and puts back what unsynced removals and renames took;
// power cuts stop every call after the chosen sync point; faults fail the chosen call.
#include "tier/ext/fault_injecting_file_system.hpp"
#include "core/scratch.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

namespace tier {
namespace {

namespace fs = std::filesystem;
using test::put;
using test::Scratch;
using test::slurp;

// Creates `path` through `fsys` with `text`; syncs the file when `sync`.
void create(FileSystem& fsys, const std::string& path, const std::string& text, bool sync) {
  auto f = fsys.open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0600);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE((*f)->write_all(text.data(), text.size()).ok());
  if (sync) {
    ASSERT_TRUE((*f)->sync().ok());
  }
  ASSERT_TRUE((*f)->close().ok());
}

TEST(FaultInjectingFileSystem, UnsyncedDataIsDroppedAndSyncedDataSurvives) {
  Scratch d;
  FaultInjectingFileSystem fsys;
  auto f = fsys.open(d.sub("log"), O_WRONLY | O_CREAT | O_EXCL, 0600);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->write_all("synced.", 7).ok());
  ASSERT_TRUE((*f)->sync().ok());
  ASSERT_TRUE(fsys.sync_dir(d.path.string()).ok());
  ASSERT_TRUE((*f)->write_all(" lost", 5).ok());
  ASSERT_TRUE((*f)->pwrite_all("S", 1, 0).ok());
  EXPECT_EQ(slurp(d.sub("log")), "Synced. lost") << "the page cache has everything";
  EXPECT_EQ(fsys.counters().unsynced_files, 1u);
  ASSERT_TRUE(fsys.simulate_power_loss().ok());
  EXPECT_EQ(slurp(d.sub("log")), "synced.");
  EXPECT_EQ(fsys.counters().unsynced_files, 0u);
}

TEST(FaultInjectingFileSystem, ANewFileNeedsItsDirectorySynced) {
  Scratch d;
  FaultInjectingFileSystem fsys;
  create(fsys, d.sub("unnamed"), "data", /*sync=*/true);  // data durable, name not
  EXPECT_EQ(fsys.counters().pending_entries, 1u);
  ASSERT_TRUE(fsys.simulate_power_loss().ok());
  EXPECT_FALSE(fs::exists(d.sub("unnamed")));

  create(fsys, d.sub("named"), "data", /*sync=*/false);  // name durable, data not
  ASSERT_TRUE(fsys.sync_dir(d.path.string()).ok());
  EXPECT_EQ(fsys.counters().pending_entries, 0u);
  ASSERT_TRUE(fsys.simulate_power_loss().ok());
  ASSERT_TRUE(fs::exists(d.sub("named")));
  EXPECT_EQ(slurp(d.sub("named")), "") << "an unsynced new file comes back empty";
}

TEST(FaultInjectingFileSystem, AnUnsyncedRenameGoesBackAndWhatItReplacedReturns) {
  Scratch d;
  put(d.sub("target"), "old");  // before the layer saw it: durable as it is
  FaultInjectingFileSystem fsys;
  create(fsys, d.sub(".tmp"), "new", /*sync=*/true);
  ASSERT_TRUE(fsys.rename(d.sub(".tmp"), d.sub("target")).ok());
  EXPECT_EQ(slurp(d.sub("target")), "new");
  ASSERT_TRUE(fsys.simulate_power_loss().ok());
  EXPECT_EQ(slurp(d.sub("target")), "old");
  EXPECT_FALSE(fs::exists(d.sub(".tmp"))) << "its creation was not durable either";

  // The same with the directory synced after the rename: the new file stays.
  create(fsys, d.sub(".tmp"), "new", /*sync=*/true);
  ASSERT_TRUE(fsys.rename(d.sub(".tmp"), d.sub("target")).ok());
  ASSERT_TRUE(fsys.sync_dir(d.path.string()).ok());
  ASSERT_TRUE(fsys.simulate_power_loss().ok());
  EXPECT_EQ(slurp(d.sub("target")), "new");
  EXPECT_FALSE(fs::exists(d.sub(".tmp")));
}

TEST(FaultInjectingFileSystem, AnUnsyncedRenameOfASyncedButUnrenamedFileLosesNothingSynced) {
  Scratch d;
  FaultInjectingFileSystem fsys;
  create(fsys, d.sub("a"), "v1", /*sync=*/true);
  ASSERT_TRUE(fsys.sync_dir(d.path.string()).ok());
  ASSERT_TRUE(fsys.rename(d.sub("a"), d.sub("b")).ok());
  ASSERT_TRUE(fsys.simulate_power_loss().ok());
  EXPECT_EQ(slurp(d.sub("a")), "v1");
  EXPECT_FALSE(fs::exists(d.sub("b")));
}

TEST(FaultInjectingFileSystem, UnsyncedRemovalsComeBack) {
  Scratch d;
  fs::create_directories(d.path / "dir");
  put(d.sub("dir/file"), "kept");
  fs::create_symlink("dir", d.path / "link");
  FaultInjectingFileSystem fsys;
  ASSERT_TRUE(fsys.unlink(d.sub("dir/file")).ok());
  ASSERT_TRUE(fsys.rmdir(d.sub("dir")).ok());
  ASSERT_TRUE(fsys.unlink(d.sub("link")).ok());
  EXPECT_FALSE(fs::exists(d.path / "dir"));
  ASSERT_TRUE(fsys.simulate_power_loss().ok());
  EXPECT_EQ(slurp(d.sub("dir/file")), "kept");
  EXPECT_EQ(fs::read_symlink(d.path / "link"), "dir");

  // Removals made durable stay removed, even though the directory they were in is gone.
  ASSERT_TRUE(fsys.unlink(d.sub("dir/file")).ok());
  ASSERT_TRUE(fsys.rmdir(d.sub("dir")).ok());
  ASSERT_TRUE(fsys.sync_dir(d.path.string()).ok());
  ASSERT_TRUE(fsys.simulate_power_loss().ok());
  EXPECT_FALSE(fs::exists(d.path / "dir"));
}

TEST(FaultInjectingFileSystem, AnUnsyncedNewDirectoryGoesWithEverythingInIt) {
  Scratch d;
  FaultInjectingFileSystem fsys;
  ASSERT_TRUE(fsys.mkdir(d.sub("v"), 0700).ok());
  create(fsys, d.sub("v/f"), "data", /*sync=*/true);
  ASSERT_TRUE(fsys.sync_dir(d.sub("v")).ok());  // v's entries are durable, v itself is not
  ASSERT_TRUE(fsys.symlink("v", d.sub("tag")).ok());
  ASSERT_TRUE(fsys.simulate_power_loss().ok());
  EXPECT_FALSE(fs::exists(d.path / "v"));
  EXPECT_FALSE(fs::is_symlink(d.path / "tag"));
}

TEST(FaultInjectingFileSystem, AMovedDirectoryComesBackWithItsFiles) {
  Scratch d;
  fs::create_directories(d.path / "t");
  put(d.sub("t/meta.json"), "old format");
  FaultInjectingFileSystem fsys;
  ASSERT_TRUE(fsys.rename(d.sub("t"), d.sub("t~1")).ok());
  create(fsys, d.sub("t~1/note"), "x", /*sync=*/true);
  ASSERT_TRUE(fsys.symlink("t~2", d.sub("t")).ok());
  ASSERT_TRUE(fsys.simulate_power_loss().ok());
  ASSERT_TRUE(fs::is_directory(d.path / "t"));
  EXPECT_FALSE(fs::is_symlink(d.path / "t"));
  EXPECT_EQ(slurp(d.sub("t/meta.json")), "old format");
  EXPECT_FALSE(fs::exists(d.path / "t/note"));
  EXPECT_FALSE(fs::exists(d.path / "t~1"));
}

TEST(FaultInjectingFileSystem, AnExistingFileRewrittenInPlaceGetsItsContentBack) {
  Scratch d;
  put(d.sub("lock"), "{\"pid\": 1}");
  FaultInjectingFileSystem fsys;
  auto f = fsys.open(d.sub("lock"), O_RDWR | O_CREAT | O_NOFOLLOW, 0600);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->truncate(0).ok());
  ASSERT_TRUE((*f)->pwrite_all("{\"pid\": 22}", 11, 0).ok());
  ASSERT_TRUE(fsys.simulate_power_loss().ok());
  EXPECT_EQ(slurp(d.sub("lock")), "{\"pid\": 1}");
}

TEST(FaultInjectingFileSystem, PowerCutAfterNSyncsStopsEveryLaterCall) {
  Scratch d;
  FaultInjectingFileSystem fsys;
  fsys.cut_power_after_syncs(1);
  auto f = fsys.open(d.sub("a"), O_WRONLY | O_CREAT | O_EXCL, 0600);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->write_all("x", 1).ok());
  ASSERT_TRUE((*f)->sync().ok());  // sync point 1
  EXPECT_FALSE(fsys.powered_off());
  const Status cut = fsys.sync_dir(d.path.string());  // sync point 2: the power goes
  EXPECT_EQ(cut.sys_errno(), EIO) << cut;
  EXPECT_TRUE(fsys.powered_off());
  EXPECT_EQ(fsys.mkdir(d.sub("later"), 0700).sys_errno(), EIO);
  EXPECT_EQ((*f)->write_all("y", 1).sys_errno(), EIO);
  EXPECT_FALSE(fs::exists(d.path / "later")) << "nothing reaches the disk after the cut";
  const FileSystemCounters c = fsys.counters();
  EXPECT_EQ(c.syncs, 1u);
  EXPECT_GE(c.failed, 3u);
  ASSERT_TRUE(fsys.simulate_power_loss().ok());
  EXPECT_FALSE(fsys.powered_off());
  EXPECT_FALSE(fs::exists(d.path / "a")) << "the directory sync never happened";
  EXPECT_TRUE(fsys.mkdir(d.sub("later"), 0700).ok()) << "on again after the loss";
}

TEST(FaultInjectingFileSystem, PowerCutAfterNMutationsAndRestoreKeepsThePageCache) {
  Scratch d;
  FaultInjectingFileSystem fsys;
  fsys.cut_power_after_mutations(2);
  create(fsys, d.sub("a"), "1", /*sync=*/false);  // open(O_CREAT) and one write
  EXPECT_EQ(fsys.mkdir(d.sub("b"), 0700).sys_errno(), EIO);
  EXPECT_TRUE(fsys.stat(d.sub("a")).status().sys_errno() == EIO) << "reads stop too";
  fsys.restore_power();  // a killed process: what it wrote stays
  EXPECT_EQ(slurp(d.sub("a")), "1");
  EXPECT_TRUE(fsys.mkdir(d.sub("b"), 0700).ok());
  // Still not durable: a later power loss takes it.
  ASSERT_TRUE(fsys.simulate_power_loss().ok());
  EXPECT_FALSE(fs::exists(d.path / "a"));
  EXPECT_FALSE(fs::exists(d.path / "b"));
}

TEST(FaultInjectingFileSystem, FaultsFailTheChosenCall) {
  Scratch d;
  FaultInjectingFileSystem fsys;
  fsys.add_fault({FileOp::kRename, "", 2, 1, ENOSPC});
  fsys.add_fault({FileOp::kMkdir, "only-here", 1, 2, EACCES});
  create(fsys, d.sub("a"), "x", false);
  EXPECT_TRUE(fsys.rename(d.sub("a"), d.sub("b")).ok());
  const Status second = fsys.rename(d.sub("b"), d.sub("c"));
  EXPECT_EQ(second.sys_errno(), ENOSPC) << second;
  EXPECT_EQ(second.code(), StatusCode::kNoSpace);
  EXPECT_NE(second.message().find(d.sub("b")), std::string::npos) << second;
  EXPECT_TRUE(fs::exists(d.path / "b")) << "a failed call changes nothing";
  EXPECT_TRUE(fsys.rename(d.sub("b"), d.sub("c")).ok());
  EXPECT_TRUE(fsys.mkdir(d.sub("elsewhere"), 0700).ok());
  EXPECT_EQ(fsys.mkdir(d.sub("only-here"), 0700).sys_errno(), EACCES);
  EXPECT_EQ(fsys.mkdir(d.sub("only-here"), 0700).sys_errno(), EACCES);
  EXPECT_TRUE(fsys.mkdir(d.sub("only-here"), 0700).ok());
  EXPECT_EQ(fsys.counters().failed, 3u);
  fsys.clear_faults();
  EXPECT_TRUE(fsys.rename(d.sub("c"), d.sub("d")).ok());
}

TEST(FaultInjectingFileSystem, DroppedSyncsMakeNothingDurable) {
  Scratch d;
  FaultInjectingFileSystem fsys;
  fsys.drop_syncs(/*files=*/true, /*dirs=*/false);
  create(fsys, d.sub("a"), "data", /*sync=*/true);
  ASSERT_TRUE(fsys.sync_dir(d.path.string()).ok());
  ASSERT_TRUE(fsys.simulate_power_loss().ok());
  EXPECT_EQ(slurp(d.sub("a")), "") << "the file's sync was dropped";

  fsys.drop_syncs(false, true);
  create(fsys, d.sub("b"), "data", /*sync=*/true);
  ASSERT_TRUE(fsys.sync_dir(d.path.string()).ok());
  ASSERT_TRUE(fsys.simulate_power_loss().ok());
  EXPECT_FALSE(fs::exists(d.path / "b")) << "the directory's sync was dropped";
  EXPECT_EQ(fsys.counters().syncs, 4u) << "dropped syncs still count as sync points";
}

TEST(FaultInjectingFileSystem, FilesRelativeToAnOpenDirectoryAreModelled) {
  Scratch d;
  FaultInjectingFileSystem fsys;
  auto dir = fsys.open(d.path.string(), O_RDONLY | O_DIRECTORY);
  ASSERT_TRUE(dir.ok());
  auto f = fsys.open("swap.bin", O_RDWR | O_CREAT | O_EXCL, 0600, dir->get());
  ASSERT_TRUE(f.ok());
  EXPECT_EQ((*f)->path(), d.sub("swap.bin"));
  ASSERT_TRUE((*f)->allocate(0, 4096).ok() || (*f)->truncate(4096).ok());
  ASSERT_TRUE((*dir)->sync().ok());
  ASSERT_TRUE(fsys.simulate_power_loss().ok());
  ASSERT_TRUE(fs::exists(d.sub("swap.bin")));
  EXPECT_EQ(fs::file_size(d.sub("swap.bin")), 0u) << "the preallocation was never synced";
  ASSERT_TRUE(fsys.unlink("swap.bin", dir->get()).ok());
  EXPECT_FALSE(fs::exists(d.sub("swap.bin")));
}

}  // namespace
}  // namespace tier
