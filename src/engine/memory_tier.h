// The memory tier (issue #19; docs/ARCHITECTURE.md "Memory tier"): the
// newest committed checkpoint of a rank is also kept in shared memory
// (a tmpfs such as /dev/shm), so that a process that crashed and restarts on
// the same node restores at memory speed.
//
// A segment is a one-slot slot file (same format, checksums and commit
// record as the job directory's files; docs/FORMAT.md), so the same store
// code reads it. It lives in the segment directory (NONSTOP_SHM_DIR, default
// /dev/shm/nonstop) under a name private to one job directory and rank,
// "<16 hex digits>-rank-00003.nsck". The name is recorded in the job
// directory (JobDirNames::MemoryRecord), so a segment is found only through
// the job directory it belongs to.
//
// Writing (MemoryTierWriter, one per engine): after a commit on disk, a
// background thread copies the newest committed checkpoint from the slot
// file into "<name>.tmp" (O_CREAT|O_EXCL|O_NOFOLLOW at the segment
// directory's fd, every chunk's crc verified as it is read), commits it there
// and renames it over the segment. A crash at any point leaves the previous
// segment or the new one, never a torn one under the segment's name. The
// disk checkpoint never depends on it: a failure here (a full tmpfs, no
// segment directory) is reported once on stderr and in the stats, and
// checkpoints go on to disk.
//
// Which commits are copied (MirrorPacer): in "auto", a commit is copied only
// when no copy is running (a commit arriving during a copy is skipped, never
// queued) and only when the copies so far took at most `share` of the wall
// time: after a copy of d seconds, the next commit is skipped until
// d * (1/share - 1) seconds have passed since it ended. So the copy thread
// is busy at most `share` of the time, whatever the checkpoint interval;
// when checkpoints are further apart than d/share, every one is copied. In
// "memory", every commit is offered: one that arrives during a copy waits
// (replacing an older waiting one) and is copied next. Skipping never
// weakens recovery: a segment that does not hold exactly the disk's newest
// committed checkpoint is never read (below), so after a skipped commit the
// disk is read until the next copy completes.
//
// Ownership and leftovers: a writer holds "<name>.lock" in the segment
// directory (Directory::Lock: flock, released by the kernel when the process
// dies) for its life; the lock file's holder line names its pid and its job
// directory's absolute path. When a writer opens, it sweeps the segment
// directory for leftovers of other jobs (SweepMemorySegments): a segment whose
// lock it can take (so no live process owns it) is removed, with its temp and
// lock files, when its job directory no longer exists, when that directory's
// record names another segment (or none), or when it was last written more
// than `orphan_after_s` ago (a job that crashed and never restarted; a job
// that restarts sooner finds it). A segment whose owner lives is never
// touched. A writer that cannot take its own lock (a sweeper holds it right
// now) records a fresh name instead.
//
// The tiered cadence (EngineOptions::disk_every != 1; engine_tiered.cc):
// instead of mirrored copies, the engine commits its checkpoints into the
// segment itself, a multi-slot slot file (CreateTierFile, PublishTierFile),
// and persists them to disk later, so the segment may hold a checkpoint
// newer than the disk's.
//
// Reading (OpenMemorySegment): the segment is used only when it verifies
// (header, record and table here; every data chunk crc as it is read) and
// the recovery planner (MakePlan), given its records, the slot file's and
// the lineage, puts one of its records first: the newest live checkpoint,
// never one a rollback abandoned, never older than the disk's newest; where
// the disk holds the same counter, only when it is exactly that checkpoint
// (same step, tensor table, metadata and chunk crcs): never another job's.
// Anything else (no record, no segment, a foreign or garbage file, a stale
// one) is reported in `why_not` and the caller reads the disk. The data is read and
// checksummed once: OpenMemorySegment does not read it, and every reader of
// a segment (ReadCheckpointInto, Engine::Restore) verifies each chunk as it
// reads it and falls back to the disk on a mismatch.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/jobdir.h"
#include "nonstop/status.h"
#include "nonstop/store.h"

namespace nonstop {

enum class MemoryTierMode {
  kAuto,    // on where the segment fits: free space >= fit_factor * segment size
  kMemory,  // always (a failure is still only reported)
  kDisk,    // off
};
bool ParseMemoryTierMode(std::string_view name, MemoryTierMode* out);
const char* MemoryTierModeName(MemoryTierMode m);

// The segment directory: `configured` when not empty, else $NONSTOP_SHM_DIR,
// else /dev/shm/nonstop.
std::string MemorySegmentDir(const std::string& configured);

struct MemoryTierStats {
  std::string mode;             // "auto", "memory", "disk"
  std::string segment;          // full path of the segment ("" when off)
  uint64_t mirrored = 0;        // checkpoints copied into the segment
  uint64_t mirrored_counter = 0;  // counter the segment holds now (0 = none)
  uint64_t skipped = 0;         // commits not copied: a copy ran, the time share
                                // was spent (auto), did not fit (auto), superseded
  uint64_t failures = 0;
  double copy_s_total = 0;
  uint64_t swept = 0;           // other jobs' leftover segments removed at open
  std::string last_error;       // the last failure, one line
};

// Removes the leftover segments in segment directory `dir` (see the top of
// this file) except `keep` (a segment name); returns how many it removed.
// `now_unix_ns`: the wall clock. Errors on single entries are skipped.
// `own_job`: the sweeping writer's job directory (absolute): a segment of
// another rank of that job which its record still names is left to that
// rank, whose engine may be opening at the same moment.
uint64_t SweepMemorySegments(Directory& dir, Env* env, const std::string& keep,
                             double orphan_after_s, uint64_t now_unix_ns,
                             const std::string& own_job = "");

// The rule above for "auto", apart from the clock and threads (times in
// seconds on any monotonic clock).
class MirrorPacer {
 public:
  explicit MirrorPacer(double share) : share_(share > 0 && share <= 1 ? share : 1) {}
  // Whether a commit arriving at `now` is copied, given whether a copy runs
  // (or waits) now.
  bool Admit(double now, bool copying) const { return !copying && now >= next_allowed_; }
  // A copy ran from `start` to `end`.
  void Done(double start, double end) {
    const double d = end > start ? end - start : 0;
    next_allowed_ = end + d * (1 / share_ - 1);
  }
  double next_allowed() const { return next_allowed_; }
  double share() const { return share_; }

 private:
  double share_;
  double next_allowed_ = -1e300;
};

class MemoryTierWriter {
 public:
  // Prepares the tier for rank `rank` of the job directory `jd` (its writer):
  // opens (creating) the segment directory and reads or writes the job
  // directory's record of the segment name. Never fails the engine: on any
  // error it returns a writer that is off and says why (stats().last_error).
  // `share`: the most of the wall time copies may take in "auto" (0 < share
  // <= 1; see MirrorPacer). `orphan_after_s`: see SweepMemorySegments.
  static std::unique_ptr<MemoryTierWriter> Open(JobDir& jd, Env* env, int rank,
                                                MemoryTierMode mode, const std::string& shm_dir,
                                                double fit_factor, double share = 1,
                                                double orphan_after_s = 3600);
  ~MemoryTierWriter();

  // Offers committed checkpoint `info` of `file` to the background copy:
  // "auto" copies it or skips it (MirrorPacer), "memory" copies it or, while
  // a copy runs, keeps it as the next (replacing one not yet started). Never
  // blocks on the copy.
  //
  // The copy reads the checkpoint's slot while it runs, so the slot must not
  // be reused before it ends: Submit returns true when it took the
  // checkpoint, and then the writer calls the release callback
  // (SetRelease) with (file, info.slot) exactly once, when it is done with
  // it: copied, failed, skipped, or replaced by a newer one before its copy
  // began. The engine keeps the slot out of its free queue until then
  // (EngineImpl::ReleaseSlot). false: it was not taken (off, stopped, or
  // skipped at once), and no callback comes. The callback runs on the copy
  // thread or inside Submit, never under the writer's lock.
  bool Submit(std::shared_ptr<SlotFile> file, const CheckpointInfo& info);
  using Release = std::function<void(const std::shared_ptr<SlotFile>& file, uint32_t slot)>;
  // Set before the first Submit.
  void SetRelease(Release release) { release_ = std::move(release); }
  // Waits until everything submitted is copied or failed (tests, benches).
  void Drain();
  // Stops the thread; with remove_segment also removes the segment (a clean
  // shutdown: the disk holds everything, and the memory goes back).
  void Close(bool remove_segment);
  MemoryTierStats stats() const;
  bool on() const { return dir_ != nullptr; }

  // The tiered cadence (EngineOptions::disk_every != 1; docs/ARCHITECTURE.md
  // "Tiered cadence"): the engine commits checkpoints into the segment
  // itself, a slot file of geometry `g` (slots alternate; its commit
  // record is the commit), and the disk persists them later. A new one is
  // made under "<name>.tmp" (the segment under <name> still holds the
  // newest memory checkpoint of before) and renamed over the segment by
  // PublishTierFile after its first commit, so a committed checkpoint
  // exists under the segment's name at every instant. "auto": only when it
  // fits into the free space (with a tenth to spare).
  Result<std::shared_ptr<SlotFile>> CreateTierFile(const StoreGeometry& g);
  Status PublishTierFile();

 private:
  MemoryTierWriter() = default;
  void Loop();
  Status CopyOne(SlotFile& file, const CheckpointInfo& info, bool* did_not_fit);
  void Failed(const Status& s);  // REQUIRES(mu_)

  MemoryTierMode mode_ = MemoryTierMode::kDisk;
  double fit_factor_ = 4;
  std::unique_ptr<Directory> dir_;  // the segment directory (null: off)
  std::string name_;                // the segment's entry name
  std::unique_ptr<FileLock> lock_;  // "<name_ stem>.lock", held for the writer's life

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<SlotFile> next_file_;        // GUARDED_BY(mu_)
  std::optional<CheckpointInfo> next_;         // GUARDED_BY(mu_)
  bool busy_ = false;                          // GUARDED_BY(mu_)
  bool superseded_ = false;                    // GUARDED_BY(mu_): a commit came during the copy
  MirrorPacer pacer_{1};                       // GUARDED_BY(mu_)
  bool stop_ = false;                          // GUARDED_BY(mu_)
  bool reported_ = false;                      // GUARDED_BY(mu_): a failure printed since the last success
  MemoryTierStats stats_;                      // GUARDED_BY(mu_)
  Release release_;
  std::thread thread_;
};

// A memory segment chosen for recovery, open read-only.
struct MemorySegment {
  std::unique_ptr<SlotFile> file;
  ScanReport report;     // one committed checkpoint (data not read yet: verify as you read)
  CheckpointInfo info;   // that checkpoint (as the segment holds it)
  std::string path;      // for messages
};

// The segment of rank `rank` of job directory `job_dir`, when it may be used
// for recovery instead of the disk (see the top of this file); nullopt with
// the reason in *why_not otherwise. `disk_newest`: the segment must hold
// exactly this checkpoint (the caller's choice; table read, data not
// verified); nullptr: planned here with the slot file's records and the
// lineage (a segment newer than the disk is then the answer). `step` (with
// disk_newest == nullptr): the checkpoint the segment must hold is the one
// the job directory selects for that step instead of the newest: the step
// the ranks of a distributed job agreed to restore, which may be older than
// this rank's newest (a peer had not committed it yet). The segment must
// still hold exactly that checkpoint (same counter, table and crcs).
Result<std::optional<MemorySegment>> OpenMemorySegment(
    const std::string& job_dir, int rank, const std::string& shm_dir, Env* env,
    const CheckpointInfo* disk_newest, std::string* why_not,
    std::optional<int64_t> step = std::nullopt);

// The newest counter of any record (committed or not) in the segment that
// job directory `job_dir` names for rank `rank`; 0 when there is none or it
// cannot be read. Not a choice: the engine numbers its checkpoints above it
// and abandons it on a rollback (a restore of an older checkpoint).
uint64_t MemorySegmentNewestCounter(const std::string& job_dir, int rank,
                                    const std::string& shm_dir, Env* env);

// The segments (entry names in the segment directory, by rank) that job
// directory `job_dir`'s memory records name and that exist there as files,
// whatever world size wrote them: what this host's peer server may serve of
// its own memory (tier/peer.h; a restart of another world size reads the old
// ranks' segments). Damaged records and missing segments are left out.
std::vector<std::pair<int, std::string>> RecordedMemorySegments(const std::string& job_dir,
                                                                const std::string& shm_dir,
                                                                Env* env);

}  // namespace nonstop
