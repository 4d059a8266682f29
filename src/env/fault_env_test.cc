// Tests of the fault-injecting Env: what survives a crash (directory entries
// and file data), crash points over a whole workflow, injected errors,
// Linux's fsync-failure semantics, sticky sync errors, locks and symlinks.
#include "env/fault_env.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace nonstop {
namespace {

std::unique_ptr<Directory> Open(FaultEnv& env, const std::string& path, bool create = false) {
  auto d = env.OpenDirectory(path, create);
  EXPECT_TRUE(d.ok()) << d.status().ToString();
  return d.ok() ? std::move(d).value() : nullptr;
}

// Creates `name` holding `text`, synced; the entry is durable only with sync_dir.
void MakeFile(Directory& d, const std::string& name, const std::string& text, bool sync_dir) {
  auto m = d.CreateFile(name, MediumKind::kBuffered, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_TRUE((*m)->Write(0, text.data(), text.size()).ok());
  ASSERT_TRUE((*m)->Sync().ok());
  if (sync_dir) {
    ASSERT_TRUE(d.SyncDir().ok());
  }
}

std::string Read(Directory& d, const std::string& name) {
  auto r = ReadSmallFile(d, name, 1 << 20);
  return r.ok() ? *r : "<" + r.status().ToString() + ">";
}

std::set<std::string> Names(Directory& d) {
  std::set<std::string> out;
  auto l = d.List();
  EXPECT_TRUE(l.ok());
  if (l.ok()) {
    for (const DirEntry& e : *l) out.insert(e.name);
  }
  return out;
}

TEST(FaultEnvTest, SyncedFileInASyncedDirectorySurvives) {
  auto env = FaultEnv::Create();
  auto d = Open(*env, "/job", true);
  MakeFile(*d, "a", "alpha", /*sync_dir=*/true);
  env->Crash(CrashMode::kDropUnsynced, 1);
  auto after = Open(*env, "/job");
  EXPECT_EQ(Read(*after, "a"), "alpha");
}

TEST(FaultEnvTest, AnEntryIsDurableOnlyAfterSyncDir) {
  auto env = FaultEnv::Create();
  auto d = Open(*env, "/job", true);
  MakeFile(*d, "synced-data-only", "x", /*sync_dir=*/false);
  EXPECT_EQ(Names(*d), std::set<std::string>{"synced-data-only"});  // visible before the crash
  env->Crash(CrashMode::kDropUnsynced, 1);
  auto after = Open(*env, "/job");
  EXPECT_TRUE(Names(*after).empty());
}

TEST(FaultEnvTest, FileDataIsDurableOnlyAfterSync) {
  auto env = FaultEnv::Create();
  auto d = Open(*env, "/job", true);
  {
    auto m = d->CreateFile("f", MediumKind::kBuffered, {});
    ASSERT_TRUE(m.ok());
    ASSERT_TRUE((*m)->Write(0, "durable", 7).ok());
    ASSERT_TRUE((*m)->Sync().ok());
    ASSERT_TRUE((*m)->Write(0, "VOLATILE", 8).ok());
  }
  ASSERT_TRUE(d->SyncDir().ok());
  env->Crash(CrashMode::kDropUnsynced, 1);
  auto after = Open(*env, "/job");
  EXPECT_EQ(Read(*after, "f"), "durable");
}

TEST(FaultEnvTest, UnsyncedRenameAndUnlinkAreUndoneByACrash) {
  auto env = FaultEnv::Create();
  auto d = Open(*env, "/job", true);
  MakeFile(*d, "old", "old content", true);
  MakeFile(*d, "gone", "still here", true);
  MakeFile(*d, "new.tmp", "new content", true);
  ASSERT_TRUE(d->Rename("new.tmp", "old").ok());
  ASSERT_TRUE(d->Unlink("gone").ok());
  EXPECT_EQ(Read(*d, "old"), "new content");
  EXPECT_EQ(Names(*d), std::set<std::string>{"old"});
  env->Crash(CrashMode::kDropUnsynced, 1);
  auto after = Open(*env, "/job");
  EXPECT_EQ(Read(*after, "old"), "old content");
  EXPECT_EQ(Read(*after, "gone"), "still here");
  EXPECT_EQ(Names(*after), (std::set<std::string>{"gone", "new.tmp", "old"}));

  // And with SyncDir they stay.
  ASSERT_TRUE(after->Rename("new.tmp", "old").ok());
  ASSERT_TRUE(after->SyncDir().ok());
  env->Crash(CrashMode::kTornUnsynced, 2);
  EXPECT_EQ(Read(*Open(*env, "/job"), "old"), "new content");
}

TEST(FaultEnvTest, TornCrashKeepsAPrefixOfEachDirectorysPendingOperations) {
  std::set<size_t> kept_counts;
  for (uint64_t seed = 0; seed < 200; ++seed) {
    auto env = FaultEnv::Create();
    auto d = Open(*env, "/job", true);
    const std::vector<std::string> order = {"a", "b", "c", "d"};
    for (const std::string& n : order) MakeFile(*d, n, n, false);
    env->Crash(CrashMode::kTornUnsynced, seed);
    auto after = Open(*env, "/job");
    std::set<std::string> names = Names(*after);
    // A prefix of the issue order, never a later op without an earlier one.
    size_t k = 0;
    while (k < order.size() && names.count(order[k]) != 0) ++k;
    EXPECT_EQ(names.size(), k) << "seed " << seed;
    kept_counts.insert(k);
    // Same seed, same outcome.
    if (seed == 7) {
      auto env2 = FaultEnv::Create();
      auto d2 = Open(*env2, "/job", true);
      for (const std::string& n : order) MakeFile(*d2, n, n, false);
      env2->Crash(CrashMode::kTornUnsynced, seed);
      EXPECT_EQ(Names(*Open(*env2, "/job")), names);
    }
  }
  EXPECT_EQ(kept_counts, (std::set<size_t>{0, 1, 2, 3, 4}));
}

TEST(FaultEnvTest, SubdirectoriesAndCrossDirectoryRenames) {
  auto env = FaultEnv::Create();
  auto d = Open(*env, "/job", true);
  auto keep = d->OpenDir("keep", true);  // mkdir + SyncDir of /job: durable
  ASSERT_TRUE(keep.ok());
  MakeFile(*d, "x", "x", true);
  ASSERT_TRUE(d->Rename("x", "x-moved", keep->get()).ok());
  ASSERT_TRUE((*keep)->SyncDir().ok());  // the target first ...
  env->Crash(CrashMode::kDropUnsynced, 1);  // ... before the source: in both
  auto after = Open(*env, "/job");
  auto keep2 = after->OpenDir("keep", false);
  ASSERT_TRUE(keep2.ok());
  EXPECT_EQ(Read(**keep2, "x-moved"), "x");
  EXPECT_EQ(Read(*after, "x"), "x");
  EXPECT_EQ(env->Dump(), "d job\nd job/keep\nf job/keep/x-moved 1\nf job/x 1\n");
  // A directory cannot move into itself; RemoveDir wants it empty.
  EXPECT_FALSE(after->Rename("keep", "inner", keep2->get()).ok());
  EXPECT_FALSE(after->RemoveDir("keep").ok());
  ASSERT_TRUE((*keep2)->Unlink("x-moved").ok());
  EXPECT_TRUE(after->RemoveDir("keep").ok());
  EXPECT_EQ(after->OpenDir("keep", false).status().code(), StatusCode::kNotFound);
}

TEST(FaultEnvTest, HandlesOpenedBeforeACrashFailAfterIt) {
  auto env = FaultEnv::Create();
  auto d = Open(*env, "/job", true);
  MakeFile(*d, "a", "a", true);
  auto m = d->OpenFile("a", MediumKind::kBuffered, {});
  ASSERT_TRUE(m.ok());
  env->Crash(CrashMode::kDropUnsynced, 1);
  char c;
  EXPECT_EQ((*m)->Write(0, "b", 1).code(), StatusCode::kIOError);
  EXPECT_EQ((*m)->Read(0, &c, 1).code(), StatusCode::kIOError);
  EXPECT_NE(d->SyncDir().message().find("device crashed"), std::string::npos);
  EXPECT_EQ(d->CreateFile("b", MediumKind::kBuffered, {}).status().code(), StatusCode::kIOError);
  EXPECT_EQ(d->List().status().code(), StatusCode::kIOError);
  auto fresh = Open(*env, "/job");
  EXPECT_EQ(Read(*fresh, "a"), "a");
}

TEST(FaultEnvTest, CreateFileOnAnExistingNameFailsAndBadNamesAreRefused) {
  auto env = FaultEnv::Create();
  auto d = Open(*env, "/job", true);
  MakeFile(*d, "a", "a", true);
  auto again = d->CreateFile("a", MediumKind::kBuffered, {});
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(again.status().message().find("already exists"), std::string::npos);
  EXPECT_EQ(Read(*d, "a"), "a");
  for (const std::string& n : {std::string(""), std::string(".."), std::string("a/b")}) {
    EXPECT_EQ(d->CreateFile(n, MediumKind::kBuffered, {}).status().code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(d->Rename("a", n).code(), StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(env->OpenDirectory("/job/../etc", false).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(FaultEnvTest, PlantedSymlinksAreRefusedEverywhere) {
  auto env = FaultEnv::Create();
  auto d = Open(*env, "/job", true);
  ASSERT_TRUE(env->PlantSymlink("/job", "rank-00000.nsck.tmp", "/etc/passwd").ok());
  ASSERT_TRUE(env->PlantSymlink("/job", "keep", "/elsewhere").ok());
  ASSERT_TRUE(env->PlantSymlink("/job", "OUT", "/precious").ok());
  MakeFile(*d, "src", "s", true);
  auto refused = [](const Status& st) {
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
    EXPECT_NE(st.message().find("is a symlink"), std::string::npos) << st.message();
  };
  refused(d->CreateFile("rank-00000.nsck.tmp", MediumKind::kBuffered, {}).status());
  refused(d->OpenFile("rank-00000.nsck.tmp", MediumKind::kBuffered, {}).status());
  refused(d->Lock("rank-00000.nsck.tmp", "me").status());
  refused(d->OpenDir("keep", true).status());
  refused(env->OpenDirectory("/job/keep", true).status());
  refused(d->Rename("src", "OUT"));
  refused(d->Rename("OUT", "other"));
  refused(WriteFileAtomic(*d, "OUT", "x"));
  EXPECT_EQ(d->Stat("OUT")->type, EntryType::kSymlink);
  EXPECT_EQ(Read(*d, "src"), "s");
  EXPECT_TRUE(d->Unlink("OUT").ok());  // the link itself
  EXPECT_TRUE(d->Rename("src", "OUT").ok());
}

TEST(FaultEnvTest, LocksAreExclusiveAndReleasedByDestructionAndByACrash) {
  auto env = FaultEnv::Create();
  auto d = Open(*env, "/job", true);
  auto first = d->Lock("LOCK", "pid 11 on host a");
  ASSERT_TRUE(first.ok());
  auto second = d->Lock("LOCK", "pid 12 on host b");
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().message(),
            "/job/LOCK is locked by pid 11 on host a: another nonstop job writes to this "
            "directory");
  EXPECT_EQ(Read(*d, "LOCK"), "pid 11 on host a\n");
  first.value().reset();
  auto third = d->Lock("LOCK", "pid 13 on host c");
  ASSERT_TRUE(third.ok());
  ASSERT_TRUE(d->SyncDir().ok());
  env->Crash(CrashMode::kDropUnsynced, 1);  // the holder "died"
  auto after = Open(*env, "/job");
  auto fourth = after->Lock("LOCK", "pid 14 on host d");
  ASSERT_TRUE(fourth.ok()) << fourth.status().ToString();
  third.value().reset();  // a pre-crash lock going away releases nothing now
  EXPECT_FALSE(after->Lock("LOCK", "pid 15").ok());
}

TEST(FaultEnvTest, InjectedErrorsFailOneCallWithoutEffect) {
  auto env = FaultEnv::Create();
  auto d = Open(*env, "/job", true);
  ASSERT_TRUE(WriteFileAtomic(*d, "record", "v1").ok());
  for (EnvOp op : {EnvOp::kCreateFile, EnvOp::kWrite, EnvOp::kSync, EnvOp::kRename,
                   EnvOp::kSyncDir}) {
    SCOPED_TRACE(EnvOpName(op));
    env->InjectError(op, 1, op == EnvOp::kWrite ? ENOSPC : EIO);
    Status st = WriteFileAtomic(*d, "record", "v2");
    EXPECT_EQ(st.code(), StatusCode::kIOError) << st.ToString();
    EXPECT_NE(st.message().find("fault-injected"), std::string::npos) << st.message();
    if (op != EnvOp::kSyncDir) {
      EXPECT_EQ(Read(*d, "record"), "v1");
      EXPECT_EQ(Names(*d), std::set<std::string>{"record"});  // the temp file is cleaned up
    } else {
      EXPECT_EQ(Read(*d, "record"), "v2");  // renamed, not yet durable
      ASSERT_TRUE(WriteFileAtomic(*d, "record", "v1").ok());
    }
  }
  env->InjectErrorFrom(EnvOp::kStat, 2, EIO);
  EXPECT_TRUE(d->Stat("record").ok());
  EXPECT_FALSE(d->Stat("record").ok());
  EXPECT_FALSE(d->Stat("record").ok());
  env->ClearFaults();
  EXPECT_TRUE(d->Stat("record").ok());
}

// The crash test of WriteFileAtomic: at every call of the workflow and in
// both crash modes, the record reads as the old or the new content, never
// anything else, and once WriteFileAtomic returned OK it is the new one.
TEST(FaultEnvTest, WriteFileAtomicIsAtomicAtEveryCrashPoint) {
  auto workflow = [](FaultEnv& env) -> Status {
    NONSTOP_ASSIGN_OR_RETURN(auto d, env.OpenDirectory("/job", false));
    NONSTOP_RETURN_IF_ERROR(WriteFileAtomic(*d, "record", std::string(1500, 'n')));
    return WriteFileAtomic(*d, "other", "second record");
  };
  auto setup = [] {
    auto env = FaultEnv::Create();
    auto d = env->OpenDirectory("/job", true).value();
    EXPECT_TRUE(WriteFileAtomic(*d, "record", std::string(1000, 'o')).ok());
    return env;
  };
  uint64_t calls;
  {
    auto env = setup();
    const uint64_t before = env->calls();
    ASSERT_TRUE(workflow(*env).ok());
    calls = env->calls() - before;
  }
  ASSERT_GT(calls, 10u);
  int points = 0, recovered = 0;
  for (uint64_t n = 1; n <= calls + 1; ++n) {
    for (CrashMode mode : {CrashMode::kDropUnsynced, CrashMode::kTornUnsynced}) {
      for (uint64_t seed = 0; seed < 40; ++seed) {
        auto env = setup();
        env->CrashOnCall(n, mode, seed * 1000 + n);
        Status st = workflow(*env);
        ++points;
        if (n <= calls) {
          ASSERT_FALSE(st.ok()) << "crash at call " << n;
          EXPECT_EQ(env->crashes(), 1u);
        } else {
          ASSERT_TRUE(st.ok());
          env->ClearFaults();      // call n never came
          env->Crash(mode, seed);  // after everything returned OK
        }
        auto dr = env->OpenDirectory("/job", false);
        ASSERT_TRUE(dr.ok()) << "crash at call " << n << ": " << dr.status().ToString();
        auto d = std::move(dr).value();
        const std::string r = Read(*d, "record");
        const bool old_v = r == std::string(1000, 'o');
        const bool new_v = r == std::string(1500, 'n');
        ASSERT_TRUE(old_v || new_v) << "crash at call " << n << " seed " << seed << ": " << r;
        if (n > calls) {
          ASSERT_TRUE(new_v);
          ASSERT_EQ(Read(*d, "other"), "second record");
        }
        ++recovered;
      }
    }
  }
  std::printf("crash points: %d, recovered: %d, corrupt: 0, committed lost: 0\n", points,
              recovered);
}

// ---- Linux fsync-failure semantics and sticky sync errors ---------------

TEST(FaultDiskLinuxSyncTest, AFailedSyncForgetsTheWritesAndTheRetrySaysOK) {
  FaultDiskOptions o;
  o.forget_failed_syncs = true;
  auto disk = FaultDisk::Create(o);
  auto m = disk->Open();  // raw FaultDisk medium: no sticky guard
  ASSERT_TRUE(m->Write(0, "data", 4).ok());
  disk->InjectError(FaultOp::kSync, 1, EIO);
  EXPECT_FALSE(m->Sync().ok());
  EXPECT_TRUE(m->Sync().ok());  // what Linux says, too
  EXPECT_EQ(disk->Snapshot().size(), 4u);  // the page cache still shows it
  disk->Crash(CrashMode::kTornUnsynced, 3);
  EXPECT_EQ(disk->size(), 0u);  // but it never reached the disk

  // Without the option, the retry makes the writes durable (the old model).
  auto disk2 = FaultDisk::Create();
  auto m2 = disk2->Open();
  ASSERT_TRUE(m2->Write(0, "data", 4).ok());
  disk2->InjectError(FaultOp::kSync, 1, EIO);
  EXPECT_FALSE(m2->Sync().ok());
  EXPECT_TRUE(m2->Sync().ok());
  disk2->Crash(CrashMode::kDropUnsynced, 3);
  EXPECT_EQ(disk2->size(), 4u);
}

TEST(StickySyncTest, FaultDiskMediaCanBeStickyToo) {
  FaultDiskOptions o;
  o.forget_failed_syncs = true;
  o.sticky_sync = true;
  auto disk = FaultDisk::Create(o);
  auto m = disk->Open();
  ASSERT_TRUE(m->Write(0, "data", 4).ok());
  disk->InjectError(FaultOp::kSync, 1, ENOSPC);
  EXPECT_FALSE(m->Sync().ok());
  Status again = m->Sync();  // Linux would say OK here; the data is gone
  EXPECT_EQ(again.code(), StatusCode::kIOError);
  EXPECT_NE(again.message().find("an earlier fsync of fault-injecting device failed (No space "
                                 "left on device)"),
            std::string::npos)
      << again.message();
  auto fresh = disk->Open();  // a reopened medium works
  ASSERT_TRUE(fresh->Write(0, "data", 4).ok());
  ASSERT_TRUE(fresh->Sync().ok());
  disk->Crash(CrashMode::kDropUnsynced, 1);
  EXPECT_EQ(disk->size(), 4u);
}

TEST(StickySyncTest, AFailedSyncFailsEveryLaterWriteAndSyncUntilReopened) {
  for (int err : {EIO, ENOSPC}) {
    auto env = FaultEnv::Create();
    auto d = Open(*env, "/job", true);
    auto m = std::move(d->CreateFile("slot", MediumKind::kBuffered, {})).value();
    ASSERT_TRUE(d->SyncDir().ok());
    ASSERT_TRUE(m->Write(0, "AAAA", 4).ok());
    ASSERT_TRUE(m->Sync().ok());
    ASSERT_TRUE(m->Write(4, "BBBB", 4).ok());
    env->InjectError(EnvOp::kSync, 1, err);
    Status first = m->Sync();
    ASSERT_FALSE(first.ok());
    // On Linux a write and a sync now both succeed, and the BBBB is lost.
    // Here they fail, and say why in one line.
    Status w = m->Write(8, "CCCC", 4);
    Status s = m->Sync();
    for (const Status& st : {w, s}) {
      EXPECT_EQ(st.code(), StatusCode::kIOError);
      EXPECT_EQ(st.message(), "an earlier fsync of /job/slot failed (" +
                                  std::string(std::strerror(err)) +
                                  "); nothing written to it since it was opened is trusted "
                                  "any more: reopen it");
    }
    EXPECT_FALSE(m->Resize(4096).ok());
    char buf[4];
    EXPECT_TRUE(m->Read(0, buf, 4).ok());  // reads still work
    m.reset();
    // A reopened medium works: rewrite what must be durable, sync, and it is.
    auto again = std::move(d->OpenFile("slot", MediumKind::kBuffered, {})).value();
    ASSERT_TRUE(again->Write(4, "BBBB", 4).ok());
    ASSERT_TRUE(again->Sync().ok());
    env->Crash(CrashMode::kDropUnsynced, 1);
    EXPECT_EQ(Read(*Open(*env, "/job"), "slot"), "AAAABBBB");
  }
}

// Writers on several threads while a crash lands: every call either works
// or fails with IOError, nothing hangs, and what was synced (data and
// entries) before the crash began is there afterwards.
TEST(FaultEnvConcurrencyTest, ThreadsWritingWhileACrashLands) {
  auto env = FaultEnv::Create();
  {
    auto root = Open(*env, "/job", true);
    for (int t = 0; t < 4; ++t) ASSERT_TRUE(root->OpenDir("t" + std::to_string(t), true).ok());
  }
  std::atomic<int> done_before{0};
  std::vector<std::thread> threads;
  std::vector<int> synced(4, 0);
  env->CrashOnCall(400, CrashMode::kTornUnsynced, 99);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto d = env->OpenDirectory("/job/t" + std::to_string(t), false);
      if (!d.ok()) return;
      for (int i = 0; i < 1000; ++i) {
        const std::string name = "f" + std::to_string(i);
        auto m = (*d)->CreateFile(name, MediumKind::kBuffered, {});
        if (!m.ok()) return;
        if (!(*m)->Write(0, name.data(), name.size()).ok()) return;
        if (!(*m)->Sync().ok()) return;
        if (!(*d)->SyncDir().ok()) return;
        synced[t] = i + 1;
      }
      done_before.fetch_add(1);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(env->crashes(), 1u);
  for (int t = 0; t < 4; ++t) {
    auto d = Open(*env, "/job/t" + std::to_string(t));
    ASSERT_NE(d, nullptr);
    for (int i = 0; i < synced[t]; ++i) {
      const std::string name = "f" + std::to_string(i);
      EXPECT_EQ(Read(*d, name), name);
    }
  }
}

}  // namespace
}  // namespace nonstop
