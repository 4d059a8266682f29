// Env: the one seam for every file and directory operation nonstop makes
// (after LevelDB's Env). Nothing in nonstop calls open/rename/unlink/fsync/
// readdir/flock/stat on a path itself; it asks a Directory.
//
// A Directory is an open directory fd. Every name given to it is a single
// path component (no '/', not "." or ".."): InvalidArgument otherwise. The
// POSIX implementation works with openat/renameat/unlinkat/fstatat relative
// to that fd, always with O_NOFOLLOW|O_CLOEXEC, so a symlink planted at any
// name nonstop uses is refused (FailedPrecondition "... is a symlink"), never
// followed. CreateFile always uses O_CREAT|O_EXCL: nonstop never truncates or
// reuses a file it did not create in this call.
//
// The fault-injecting Env (src/env/fault_env.h) implements the same
// interface in memory; it remembers which file bytes and which directory
// entries were made durable (Medium::Sync for data, Directory::SyncDir for
// entries) and at a simulated crash drops or tears the rest.
//
// Thread safety: an Env and its Directories may be used from several threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "nonstop/medium.h"
#include "nonstop/status.h"

namespace nonstop {

enum class EntryType { kFile, kDirectory, kSymlink, kOther };

struct DirEntry {
  std::string name;
  EntryType type = EntryType::kOther;
};

struct FileStat {
  EntryType type = EntryType::kOther;
  uint64_t size = 0;
  uint64_t mtime_unix_ns = 0;
};

// A held lock; released (and its holder record left for the next owner to
// overwrite) when destroyed. The lock is tied to the open file description,
// so it is also released when the process dies.
class FileLock {
 public:
  virtual ~FileLock() = default;
};

class Directory {
 public:
  virtual ~Directory() = default;

  // The path this directory was opened with (for messages only; nonstop never
  // re-resolves it).
  virtual const std::string& path() const = 0;

  // Opens an existing regular file (or block device) as a Medium of `kind`.
  // NotFound when there is none; FailedPrecondition when `name` is a symlink
  // or something else; InvalidArgument with opts.create (use CreateFile).
  // Every medium an Env opens has sticky sync errors: after one failed Sync,
  // every later Write/Resize/Sync fails (IOError "an earlier fsync of ...
  // failed ...: reopen it"); close it, reopen the file and rewrite.
  virtual Result<std::unique_ptr<Medium>> OpenFile(std::string_view name, MediumKind kind,
                                                   const MediumOptions& opts) = 0;
  // Creates a new regular file (O_CREAT|O_EXCL|O_NOFOLLOW). FailedPrecondition
  // "... already exists" when anything (file, symlink, directory) has that
  // name. The new entry is durable only after SyncDir(). opts.create is
  // implied; opts.read_only is InvalidArgument.
  virtual Result<std::unique_ptr<Medium>> CreateFile(std::string_view name, MediumKind kind,
                                                     const MediumOptions& opts) = 0;

  // Opens a subdirectory; with create, makes it first when missing (mkdirat,
  // then SyncDir of this directory). A symlink is refused.
  virtual Result<std::unique_ptr<Directory>> OpenDir(std::string_view name, bool create) = 0;

  // Atomically renames `from` (in this directory) to `to` in `to_dir` (this
  // directory when null), replacing a regular file `to`. Durable only after
  // SyncDir() of both directories.
  virtual Status Rename(std::string_view from, std::string_view to,
                        Directory* to_dir = nullptr) = 0;
  // Removes a file or symlink (never follows it). NotFound when missing.
  virtual Status Unlink(std::string_view name) = 0;
  // Removes an empty subdirectory.
  virtual Status RemoveDir(std::string_view name) = 0;
  // Makes this directory's entries durable (fsync of the directory fd).
  virtual Status SyncDir() = 0;

  // Every entry but "." and "..", sorted by name.
  virtual Result<std::vector<DirEntry>> List() = 0;
  // fstatat(AT_SYMLINK_NOFOLLOW). NotFound when missing.
  virtual Result<FileStat> Stat(std::string_view name) = 0;

  // Bytes free for an unprivileged writer on this directory's file system
  // (fstatvfs on POSIX). Unavailable where the Env cannot tell.
  virtual Result<uint64_t> FreeBytes() {
    return Status::Unavailable("free space of " + path() + " is unknown");
  }

  // Takes an exclusive, non-blocking lock on file `name` (created when
  // missing; flock(LOCK_EX|LOCK_NB) on POSIX), then writes `holder` (one line,
  // e.g. "pid 1234 on host a7") into it. When another process holds it:
  // FailedPrecondition naming the lock file and the holder's line
  // (kNoHolderLine in the moment between the holder's flock and its write).
  virtual Result<std::unique_ptr<FileLock>> Lock(std::string_view name,
                                                 const std::string& holder) = 0;
};

// What Directory::Lock's refusal names as the holder when the holder has
// taken the lock and not yet written its line.
inline constexpr char kNoHolderLine[] = "another process (no holder line yet)";

class Env {
 public:
  virtual ~Env() = default;
  // Opens the directory at `path` (absolute or relative to the working
  // directory; this is the only call that takes a path). With create, missing
  // components are made first. The last component must not be a symlink.
  virtual Result<std::unique_ptr<Directory>> OpenDirectory(const std::string& path,
                                                            bool create) = 0;
};

// The POSIX Env (process-wide, never destroyed).
Env* DefaultEnv();

// Opens the file at `path` as a Medium of the given kind through
// DefaultEnv(): its parent directory, then the file relative to it
// (O_NOFOLLOW; O_CREAT|O_EXCL with opts.create). kAuto tries the fast kinds
// first and falls back; the reason for each fallback is in Describe().
Result<std::unique_ptr<Medium>> OpenMedium(const std::string& path, MediumKind kind,
                                           const MediumOptions& opts);

// Checks that `name` is one path component nonstop may use: non-empty, at
// most 255 bytes, no '/', no NUL, not "." or "..".
Status CheckEntryName(std::string_view name);

// Small-file helpers on top of a Directory, used for records and markers:
// writes `content` to `name` atomically and durably (create `name`.tmp with
// O_EXCL after removing a stale one, write, sync, rename over `name`, SyncDir).
Status WriteFileAtomic(Directory& dir, std::string_view name, std::string_view content);
// Reads a whole file of at most `max_bytes` (Corruption when larger).
Result<std::string> ReadSmallFile(Directory& dir, std::string_view name, uint64_t max_bytes);

// Removes `name` in `dir` and, when it is a directory, everything under it
// (rm -r through the seam): each subdirectory is opened relative to its
// parent's fd with O_NOFOLLOW, a symlink anywhere in the tree is removed as
// a link and never followed, so nothing outside `dir/name` is touched.
// NotFound when `name` is missing; a tree deeper than `max_depth` levels is
// refused (FailedPrecondition) before anything below that depth is removed.
// The removal is durable after dir.SyncDir().
Status RemoveTree(Directory& dir, std::string_view name, int max_depth = 64);

}  // namespace nonstop
