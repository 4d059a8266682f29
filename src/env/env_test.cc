// Tests of the POSIX Env: names, O_EXCL, symlink refusal, the lock across
// processes, WriteFileAtomic and ReadSmallFile, on real directories in /tmp.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "env/write_folder.h"
#include "nonstop/env.h"

namespace nonstop {
namespace {

namespace fs = std::filesystem;

class PosixEnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "nonstop-env-test-XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    root_ = tmpl;
    fs::create_directory(root_ / "job");
    fs::create_directory(root_ / "outside");
    WriteText(root_ / "outside" / "precious", "precious bytes");
    auto d = DefaultEnv()->OpenDirectory((root_ / "job").string(), false);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    dir_ = std::move(d).value();
  }
  void TearDown() override {
    dir_.reset();
    std::error_code ec;
    fs::remove_all(root_, ec);
  }

  static void WriteText(const fs::path& p, const std::string& s) {
    std::ofstream(p, std::ios::binary) << s;
  }
  static std::string ReadText(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  // The file outside the job directory that planted links point to.
  fs::path Precious() const { return root_ / "outside" / "precious"; }
  void Plant(const std::string& name, const fs::path& target) {
    fs::create_symlink(target, root_ / "job" / name);
  }
  static void ExpectSymlinkRefused(const Status& st) {
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
    EXPECT_NE(st.message().find("is a symlink"), std::string::npos) << st.message();
    EXPECT_EQ(st.message().find('\n'), std::string::npos);
  }

  fs::path root_;
  std::unique_ptr<Directory> dir_;
};

TEST_F(PosixEnvTest, CreateWriteSyncReopenRead) {
  auto m = dir_->CreateFile("a", MediumKind::kBuffered, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_TRUE((*m)->Write(0, "hello", 5).ok());
  ASSERT_TRUE((*m)->Sync().ok());
  m.value().reset();
  ASSERT_TRUE(dir_->SyncDir().ok());
  auto r = dir_->OpenFile("a", MediumKind::kBuffered, {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  char buf[5];
  ASSERT_TRUE((*r)->Read(0, buf, 5).ok());
  EXPECT_EQ(std::string(buf, 5), "hello");
  EXPECT_EQ(ReadText(root_ / "job" / "a"), "hello");
}

TEST_F(PosixEnvTest, EveryKindCanBeCreatedAndOpenedThroughTheEnv) {
  for (MediumKind k : {MediumKind::kAuto, MediumKind::kBuffered, MediumKind::kDirect,
                       MediumKind::kUring, MediumKind::kMmap, MediumKind::kPmem}) {
    const std::string name = std::string("k-") + MediumKindName(k);
    auto m = dir_->CreateFile(name, k, {});
    if (!m.ok() && m.status().code() == StatusCode::kUnavailable) {
      // The kind cannot work here (tmpfs, no io_uring): the failed create
      // must not have left a half-made medium, and a buffered open works.
      auto b = dir_->OpenFile(name, MediumKind::kBuffered, {});
      EXPECT_TRUE(b.ok()) << name << ": " << b.status().ToString();
      continue;
    }
    ASSERT_TRUE(m.ok()) << name << ": " << m.status().ToString();
    ASSERT_TRUE((*m)->Resize(8192).ok());
    alignas(4096) static char buf[4096];
    std::memset(buf, 0x5a, sizeof(buf));
    ASSERT_TRUE((*m)->Write(4096, buf, sizeof(buf)).ok()) << name;
    ASSERT_TRUE((*m)->Sync().ok()) << name;
    m.value().reset();
    auto r = dir_->OpenFile(name, k, {});
    ASSERT_TRUE(r.ok()) << name << ": " << r.status().ToString();
    alignas(4096) static char back[4096];
    ASSERT_TRUE((*r)->Read(4096, back, sizeof(back)).ok()) << name;
    EXPECT_EQ(std::memcmp(buf, back, sizeof(buf)), 0) << name;
  }
}

TEST_F(PosixEnvTest, CreateFileOnAnExistingNameFails) {
  WriteText(root_ / "job" / "taken", "old");
  auto m = dir_->CreateFile("taken", MediumKind::kBuffered, {});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kFailedPrecondition) << m.status().ToString();
  EXPECT_NE(m.status().message().find("already exists"), std::string::npos);
  EXPECT_EQ(ReadText(root_ / "job" / "taken"), "old");  // not truncated
  fs::create_directory(root_ / "job" / "adir");
  EXPECT_EQ(dir_->CreateFile("adir", MediumKind::kBuffered, {}).status().code(),
            StatusCode::kFailedPrecondition);
  // OpenMedium(create) goes through the Env: exclusive too.
  MediumOptions mo;
  mo.create = true;
  EXPECT_EQ(OpenMedium((root_ / "job" / "taken").string(), MediumKind::kBuffered, mo)
                .status()
                .code(),
            StatusCode::kFailedPrecondition);
  EXPECT_TRUE(OpenMedium((root_ / "job" / "fresh").string(), MediumKind::kBuffered, mo).ok());
}

TEST_F(PosixEnvTest, OpenFileOnAMissingNameIsNotFound) {
  EXPECT_EQ(dir_->OpenFile("nope", MediumKind::kBuffered, {}).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(dir_->OpenDir("nope", false).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(dir_->Stat("nope").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(dir_->Unlink("nope").code(), StatusCode::kNotFound);
  EXPECT_EQ(DefaultEnv()->OpenDirectory((root_ / "nope").string(), false).status().code(),
            StatusCode::kNotFound);
}

TEST_F(PosixEnvTest, BadNamesAreRefused) {
  const std::vector<std::string> bad = {"", ".", "..", "a/b", "/abs", std::string("a\0b", 3),
                                        std::string(256, 'x')};
  for (const std::string& n : bad) {
    EXPECT_EQ(CheckEntryName(n).code(), StatusCode::kInvalidArgument) << n;
    EXPECT_EQ(dir_->CreateFile(n, MediumKind::kBuffered, {}).status().code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(dir_->OpenFile(n, MediumKind::kBuffered, {}).status().code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(dir_->OpenDir(n, true).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(dir_->Rename("x", n).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(dir_->Unlink(n).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(dir_->Stat(n).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(dir_->Lock(n, "me").status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(CheckEntryName(std::string(255, 'x')).ok());
  EXPECT_TRUE(CheckEntryName("rank-00000.nsck.tmp").ok());
  // Nothing was made by any of the refused calls.
  EXPECT_TRUE(fs::is_empty(root_ / "job"));
}

TEST_F(PosixEnvTest, ASymlinkAtAFileNameIsRefusedAndItsTargetUntouched) {
  Plant("rank-00000.nsck.tmp", Precious());
  ExpectSymlinkRefused(dir_->CreateFile("rank-00000.nsck.tmp", MediumKind::kBuffered, {}).status());
  ExpectSymlinkRefused(dir_->OpenFile("rank-00000.nsck.tmp", MediumKind::kBuffered, {}).status());
  MediumOptions ro;
  ro.read_only = true;
  ExpectSymlinkRefused(dir_->OpenFile("rank-00000.nsck.tmp", MediumKind::kMmap, ro).status());
  ExpectSymlinkRefused(dir_->Lock("rank-00000.nsck.tmp", "me").status());
  ExpectSymlinkRefused(
      ReadSmallFile(*dir_, "rank-00000.nsck.tmp", 1 << 20).status());
  // OpenMedium on such a path is refused the same way.
  MediumOptions mo;
  mo.create = true;
  ExpectSymlinkRefused(OpenMedium((root_ / "job" / "rank-00000.nsck.tmp").string(),
                                  MediumKind::kBuffered, mo)
                           .status());
  EXPECT_EQ(ReadText(Precious()), "precious bytes");
  auto st = dir_->Stat("rank-00000.nsck.tmp");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->type, EntryType::kSymlink);
  // Unlink removes the link itself, never its target.
  EXPECT_TRUE(dir_->Unlink("rank-00000.nsck.tmp").ok());
  EXPECT_EQ(ReadText(Precious()), "precious bytes");
}

TEST_F(PosixEnvTest, ASymlinkAtASubdirectoryNameIsRefused) {
  Plant("keep", root_ / "outside");
  ExpectSymlinkRefused(dir_->OpenDir("keep", false).status());
  ExpectSymlinkRefused(dir_->OpenDir("keep", true).status());
  ExpectSymlinkRefused(
      DefaultEnv()->OpenDirectory((root_ / "job" / "keep").string(), false).status());
  ExpectSymlinkRefused(
      DefaultEnv()->OpenDirectory((root_ / "job" / "keep").string() + "/", true).status());
  // Nothing was created through the link.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root_ / "outside")) {
    names.push_back(e.path().filename().string());
  }
  EXPECT_EQ(names, std::vector<std::string>{"precious"});
  EXPECT_EQ(ReadText(Precious()), "precious bytes");
}

TEST_F(PosixEnvTest, ASymlinkAsTheRenameTargetOrSourceIsRefused) {
  {
    auto m = dir_->CreateFile("new", MediumKind::kBuffered, {});
    ASSERT_TRUE(m.ok());
    ASSERT_TRUE((*m)->Write(0, "new", 3).ok());
  }
  Plant("OUT", Precious());
  ExpectSymlinkRefused(dir_->Rename("new", "OUT"));
  EXPECT_EQ(ReadText(Precious()), "precious bytes");
  EXPECT_TRUE(fs::is_symlink(root_ / "job" / "OUT"));
  EXPECT_EQ(ReadText(root_ / "job" / "new"), "new");  // the source stays
  Plant("link-src", Precious());
  ExpectSymlinkRefused(dir_->Rename("link-src", "plain"));
  EXPECT_FALSE(fs::exists(root_ / "job" / "plain"));
  // WriteFileAtomic over a planted link is refused the same way.
  ExpectSymlinkRefused(WriteFileAtomic(*dir_, "OUT", "overwritten?"));
  EXPECT_EQ(ReadText(Precious()), "precious bytes");
  EXPECT_FALSE(fs::exists(root_ / "job" / "OUT.tmp"));
}

TEST_F(PosixEnvTest, RenameAcrossDirectoriesListStatRemoveDir) {
  auto sub = dir_->OpenDir("keep", true);
  ASSERT_TRUE(sub.ok()) << sub.status().ToString();
  ASSERT_TRUE(dir_->CreateFile("b", MediumKind::kBuffered, {}).ok());
  ASSERT_TRUE(dir_->CreateFile("a", MediumKind::kBuffered, {}).ok());
  ASSERT_TRUE(dir_->Rename("b", "moved", sub->get()).ok());
  ASSERT_TRUE((*sub)->SyncDir().ok());
  ASSERT_TRUE(dir_->SyncDir().ok());
  EXPECT_TRUE(fs::exists(root_ / "job" / "keep" / "moved"));
  auto list = dir_->List();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[0].name, "a");
  EXPECT_EQ((*list)[0].type, EntryType::kFile);
  EXPECT_EQ((*list)[1].name, "keep");
  EXPECT_EQ((*list)[1].type, EntryType::kDirectory);
  auto st = dir_->Stat("keep");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->type, EntryType::kDirectory);
  // Not empty yet.
  EXPECT_FALSE(dir_->RemoveDir("keep").ok());
  ASSERT_TRUE((*sub)->Unlink("moved").ok());
  EXPECT_TRUE(dir_->RemoveDir("keep").ok());
  EXPECT_FALSE(fs::exists(root_ / "job" / "keep"));
  // Renaming over an existing regular file replaces it.
  ASSERT_TRUE(dir_->CreateFile("c", MediumKind::kBuffered, {}).ok());
  EXPECT_TRUE(dir_->Rename("a", "c").ok());
  EXPECT_FALSE(fs::exists(root_ / "job" / "a"));
}

TEST_F(PosixEnvTest, OpenDirectoryCreatesMissingComponents) {
  const std::string p = (root_ / "x" / "y" / "z").string();
  auto d = DefaultEnv()->OpenDirectory(p, true);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ((*d)->path(), p);
  EXPECT_TRUE(fs::is_directory(p));
  ASSERT_TRUE(DefaultEnv()->OpenDirectory(p, true).ok());  // again: exists
  // A file where the directory should be.
  WriteText(root_ / "afile", "x");
  EXPECT_FALSE(DefaultEnv()->OpenDirectory((root_ / "afile").string(), false).ok());
}

TEST_F(PosixEnvTest, WriteFileAtomicReplacesContentAndLeavesNoTemp) {
  ASSERT_TRUE(WriteFileAtomic(*dir_, "record", "first").ok());
  EXPECT_EQ(ReadText(root_ / "job" / "record"), "first");
  // A stale temp file from a killed writer is replaced, not a blocker.
  WriteText(root_ / "job" / "record.tmp", "stale junk from a kill");
  ASSERT_TRUE(WriteFileAtomic(*dir_, "record", "second, longer").ok());
  EXPECT_EQ(ReadText(root_ / "job" / "record"), "second, longer");
  ASSERT_TRUE(WriteFileAtomic(*dir_, "record", "3").ok());
  auto r = ReadSmallFile(*dir_, "record", 100);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, "3");
  auto list = dir_->List();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].name, "record");
  // Too large for the caller's bound: Corruption, nothing allocated for it.
  ASSERT_TRUE(WriteFileAtomic(*dir_, "big", std::string(1000, 'b')).ok());
  EXPECT_EQ(ReadSmallFile(*dir_, "big", 999).status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(ReadSmallFile(*dir_, "big", 1000).ok());
  EXPECT_TRUE(WriteFileAtomic(*dir_, "empty", "").ok());
  EXPECT_EQ(ReadSmallFile(*dir_, "empty", 10).value(), "");
}

TEST_F(PosixEnvTest, RemoveTreeRemovesLinksNeverWhatTheyName) {
  // job/staged/{a, sub/{b, deep/c}, link-file -> precious, link-dir -> outside}
  fs::create_directories(root_ / "job" / "staged" / "sub" / "deep");
  WriteText(root_ / "job" / "staged" / "a", "a");
  WriteText(root_ / "job" / "staged" / "sub" / "b", "b");
  WriteText(root_ / "job" / "staged" / "sub" / "deep" / "c", "c");
  fs::create_symlink(Precious(), root_ / "job" / "staged" / "link-file");
  fs::create_directory_symlink(root_ / "outside", root_ / "job" / "staged" / "sub" / "link-dir");
  WriteText(root_ / "job" / "other", "stays");
  ASSERT_TRUE(RemoveTree(*dir_, "staged").ok());
  EXPECT_FALSE(fs::exists(fs::symlink_status(root_ / "job" / "staged")));
  EXPECT_EQ(ReadText(Precious()), "precious bytes");  // nothing outside touched
  EXPECT_TRUE(fs::is_directory(root_ / "outside"));
  EXPECT_EQ(ReadText(root_ / "job" / "other"), "stays");
  EXPECT_EQ(RemoveTree(*dir_, "staged").code(), StatusCode::kNotFound);
  // The name itself a link to a directory: the link goes, the directory stays.
  fs::create_directory_symlink(root_ / "outside", root_ / "job" / "linked");
  ASSERT_TRUE(RemoveTree(*dir_, "linked").ok());
  EXPECT_EQ(ReadText(Precious()), "precious bytes");
  // A plain file.
  EXPECT_TRUE(RemoveTree(*dir_, "other").ok());
  EXPECT_FALSE(fs::exists(root_ / "job" / "other"));
  // Bounded depth: refused in one line, nothing below the bound removed.
  fs::create_directories(root_ / "job" / "d1" / "d2" / "d3");
  WriteText(root_ / "job" / "d1" / "d2" / "d3" / "f", "f");
  const Status deep = RemoveTree(*dir_, "d1", 2);
  EXPECT_EQ(deep.code(), StatusCode::kFailedPrecondition) << deep.ToString();
  EXPECT_EQ(deep.message().find('\n'), std::string::npos);
  EXPECT_TRUE(fs::exists(root_ / "job" / "d1" / "d2" / "d3" / "f"));
  EXPECT_TRUE(RemoveTree(*dir_, "d1").ok());
  EXPECT_FALSE(fs::exists(root_ / "job" / "d1"));
}

TEST_F(PosixEnvTest, WriteFolderReplacesTheFolderAndNeverFollowsALink) {
  // A kill's leftover at folder.tmp is a link to a directory outside, and
  // the old folder holds a link to a file outside and a subdirectory.
  fs::create_directories(root_ / "job" / "ck" / "sub");
  fs::create_symlink(Precious(), root_ / "job" / "ck" / "model");
  fs::create_directory_symlink(root_ / "outside", root_ / "job" / "ck.tmp");
  ASSERT_TRUE(WriteFolder(*dir_, "ck", {{"model", "weights"}, {"state", "{}"}}).ok());
  EXPECT_EQ(ReadText(Precious()), "precious bytes");
  EXPECT_EQ(std::vector<fs::path>(fs::directory_iterator(root_ / "outside"), {}),
            std::vector<fs::path>{Precious()});
  EXPECT_FALSE(fs::exists(fs::symlink_status(root_ / "job" / "ck.tmp")));
  EXPECT_FALSE(fs::is_symlink(root_ / "job" / "ck" / "model"));
  EXPECT_EQ(ReadText(root_ / "job" / "ck" / "model"), "weights");
  EXPECT_EQ(ReadText(root_ / "job" / "ck" / "state"), "{}");
  EXPECT_EQ(std::distance(fs::directory_iterator(root_ / "job" / "ck"), {}), 2);
  // Written afresh; a bad file name fails before the old folder goes.
  ASSERT_TRUE(WriteFolder(*dir_, "ck", {{"only", "1"}}).ok());
  EXPECT_EQ(std::distance(fs::directory_iterator(root_ / "job" / "ck"), {}), 1);
  EXPECT_FALSE(WriteFolder(*dir_, "ck", {{"a/b", "x"}}).ok());
  EXPECT_EQ(ReadText(root_ / "job" / "ck" / "only"), "1");
  EXPECT_FALSE(WriteFolder(*dir_, "..", {}).ok());
}

// Runs `fn` in a forked child that reports on `ready` and then waits to be
// killed; alarm() bounds its life whatever the parent does.
pid_t ForkHolder(const std::string& dir, const std::string& holder_line, int* ready_fd) {
  int p[2];
  if (::pipe(p) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(p[0]);
    ::alarm(60);
    auto d = DefaultEnv()->OpenDirectory(dir, false);
    char c = 'n';
    std::unique_ptr<FileLock> lock;
    if (d.ok()) {
      auto l = (*d)->Lock("LOCK", holder_line);
      if (l.ok()) {
        lock = std::move(l).value();
        c = 'y';
      }
    }
    if (::write(p[1], &c, 1) != 1) ::_exit(3);
    for (;;) ::pause();
  }
  ::close(p[1]);
  *ready_fd = p[0];
  return pid;
}

TEST_F(PosixEnvTest, TheLockRefusesASecondHolderInAnotherProcessAndDiesWithItsHolder) {
  const std::string dir = (root_ / "job").string();
  const std::string line = "pid " + std::to_string(::getpid() + 1) + " on host testhost";
  int ready = -1;
  const pid_t child = ForkHolder(dir, line, &ready);
  ASSERT_GT(child, 0);
  char c = 0;
  ASSERT_EQ(::read(ready, &c, 1), 1);
  ::close(ready);
  ASSERT_EQ(c, 'y');

  auto second = dir_->Lock("LOCK", "pid 1 on host other");
  ASSERT_FALSE(second.ok());
  const std::string msg = second.status().message();
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(msg, dir + "/LOCK is locked by " + line +
                     ": another nonstop job writes to this directory");
  // The refused attempt did not overwrite the holder's line.
  EXPECT_EQ(ReadText(root_ / "job" / "LOCK"), line + "\n");

  ASSERT_EQ(::kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));

  auto mine = dir_->Lock("LOCK", "pid 2 on host mine");
  ASSERT_TRUE(mine.ok()) << mine.status().ToString();
  EXPECT_EQ(ReadText(root_ / "job" / "LOCK"), "pid 2 on host mine\n");
  // Held by this process now: another open of it (a second Checkpointer in
  // the same process) is refused too, and released when the lock goes.
  auto again = dir_->Lock("LOCK", "pid 3");
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("locked by pid 2 on host mine"), std::string::npos);
  mine.value().reset();
  EXPECT_TRUE(dir_->Lock("LOCK", "pid 3").ok());
}

}  // namespace
}  // namespace nonstop
