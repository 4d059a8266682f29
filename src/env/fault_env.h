// FaultEnv: an in-memory Env for crash and error tests, after LevelDB's
// fault_injection_test. It implements include/nonstop/env.h like the POSIX
// Env (same names checks, same symlink refusals, same lock message) and
// remembers what a power cut would keep:
//
//   - File data: each file is a FaultDisk (src/media/fault_medium.h) created
//     with forget_failed_syncs, so a failed Sync behaves as on Linux (the
//     unsynced writes are lost at a crash but no longer dirty: the next Sync
//     returns OK without making them durable), and with unwritten_extents
//     (a page whose failed writeback fell where no sync had written yet
//     stays stale: a later synced rewrite of it is lost at a crash, as on
//     ext4). Each file keeps its own disk through renames. Media go through
//     the same sticky-sync wrapper as POSIX media.
//   - Directory entries: create, rename, unlink, mkdir and rmdir change what a
//     reader sees at once, but each directory keeps them as pending
//     operations until SyncDir() of that directory makes them durable. A
//     rename inside one directory is one operation (atomic); a rename across
//     two directories is an add in the target and a remove in the source, each
//     durable with its own directory's SyncDir (sync the target first).
//
// Crash(mode, seed): kDropUnsynced drops every pending directory operation
// and every unsynced write. kTornUnsynced keeps, per directory, a prefix of
// its pending operations in issue order (length chosen by the seed), and
// tears file data as FaultDisk does. Every handle (Directory, Medium,
// FileLock) opened before a crash fails with IOError "device crashed"
// afterwards; locks are released.
//
// One counter runs over every fallible Env, Directory and Medium call
// (OpenDirectory, OpenFile, CreateFile, OpenDir, Rename, Unlink, RemoveDir,
// SyncDir, List, Stat, Lock, Write, Read, Sync, Resize), so a test can run a
// workflow once to count its calls, then crash it at each of them:
//   auto env = FaultEnv::Create();
//   env->CrashOnCall(n, CrashMode::kTornUnsynced, seed);  // before call n takes effect
//   RunWorkflow(env.get());                               // fails at call n
//   CheckRecovery(env.get());                             // sees the post-crash state
//
// Thread safety: every call may run concurrently (one mutex for the
// namespace, one per file).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "media/fault_medium.h"
#include "nonstop/env.h"

namespace nonstop {

enum class EnvOp {
  kOpenDirectory = 0,
  kOpenFile,
  kCreateFile,
  kOpenDir,
  kRename,
  kUnlink,
  kRemoveDir,
  kSyncDir,
  kList,
  kStat,
  kLock,
  kWrite,
  kRead,
  kSync,
  kResize,
  kCount  // not an operation
};
const char* EnvOpName(EnvOp op);

struct FaultEnvOptions {
  size_t alignment = 1;  // Alignment() of every medium, enforced as O_DIRECT would
};

class FaultEnv final : public Env {
 public:
  static std::shared_ptr<FaultEnv> Create(FaultEnvOptions opts = {});
  ~FaultEnv() override;

  // `path` names a directory of the in-memory tree ("/job", "job/keep"; ""
  // and "/" are the root). With create, missing components are made and
  // made durable at once (as a test's setup would).
  Result<std::unique_ptr<Directory>> OpenDirectory(const std::string& path,
                                                    bool create) override;

  // A simulated power cut now.
  void Crash(CrashMode mode, uint64_t seed);
  // The nth fallible call from now (1-based, any op) crashes before it takes
  // effect and returns IOError "device crashed".
  void CrashOnCall(uint64_t nth_call, CrashMode mode, uint64_t seed);
  // The nth call of `op` from now fails with errno `err` and no effect (a
  // failed kSync forgets the unsynced writes, as Linux does).
  void InjectError(EnvOp op, uint64_t nth_call, int err);
  // Every call of `op` from the nth one on fails with `err`.
  void InjectErrorFrom(EnvOp op, uint64_t nth_call, int err);
  // Removes pending errors and scheduled crashes.
  void ClearFaults();

  // Fallible calls so far (all ops), crashes so far.
  uint64_t calls() const;
  uint64_t calls(EnvOp op) const;
  uint64_t crashes() const;

  // Puts a symlink `name` -> `target` into directory `dir_path` (durable at
  // once), as an attacker or a careless user would; nonstop must refuse it.
  Status PlantSymlink(const std::string& dir_path, const std::string& name,
                      const std::string& target);
  // Every path in the tree as a reader sees it now, one per line, sorted:
  // "d job", "f job/rank-00000.nsck 4096", "l job/x -> /etc/passwd".
  std::string Dump() const;

  struct State;  // internal

 private:
  explicit FaultEnv(FaultEnvOptions opts);
  std::shared_ptr<State> st_;
};

}  // namespace nonstop
