// JobDir: the only owner of a job directory (docs/FORMAT.md "The job
// directory", docs/ARCHITECTURE.md "Job directory"). Nothing else in nonstop
// spells a file name of the directory, takes its lock, chooses which
// checkpoint to recover, records lineage, sets rank files aside or makes keep
// copies. Every file operation goes through the Env (env.h).
//
// Layout of DIR (all names come from the functions below):
//   .nonstop.lock                      rank 0's writer lock (the job's lock)
//   .nonstop.rank-RRRRR.lock           rank R's writer lock (R > 0)
//   rank-RRRRR.nsck                    rank R's slot file (store.h)
//   rank-RRRRR.nsck.tmp                a slot file being created or resized
//   lineage-rank-RRRRR.json            rank R's lineage record (abandoned counters)
//   agreed-rank-RRRRR.json             rank R's last globally agreed checkpoint
//   manifest-rank-RRRRR.json           rank R's job manifest: what the remote and peer
//                                      tiers noted they hold (jobdir/manifest.h)
//   keep/step-NNNNNNNNNNNN/rank-RRRRR.nsck   a kept copy (one-slot file)
//   world-W/                           rank files of a job of world size W, set aside
//
// Writers and readers:
//   - OpenForWrite(rank R) takes R's lock (a second writer of the same rank
//     gets FailedPrecondition naming the lock file and the holder's line
//     "pid P on host H (started <UTC>)"), removes R's leftovers (stale temp
//     slot file, keep/*/rank-R.nsck.tmp, R's empty half-made keep dirs) and
//     redoes every keep copy a kill interrupted while its source checkpoint is
//     still committed in R's slot file. The lock is held until the JobDir is
//     destroyed.
//   - OpenForRead takes no lock and changes nothing. Its selections never
//     report a live writer's reused slot as damage: when a checkpoint fails to
//     verify and the file has committed a newer checkpoint since the scan
//     began, the selection rescans and retries.
//
// Lineage (invariant 9): RecordRestore(rank, C) durably records that counters
// above C, up to the newest counter present in rank R's files, are abandoned.
// Every selection skips abandoned counters forever (a rollback is final).
// NextCounter() is above every abandoned counter: a writer must number new
// checkpoints from it. ProtectedCounter() is C until a newer checkpoint of the
// new lineage commits: the engine keeps C's slot until then.
//
// Python (src/python/jobdir_bindings.cc, module nonstop._core):
//   JobDir.open_for_write(path, rank=0, world_size=1) / JobDir.open_for_read(path)
//   jd.select(rank=0, step=None, verify_data=True) -> dict(step, counter, where,
//       slot, skipped=[...]) or None when no checkpoint file exists
//   jd.select_common(world_size, step=None, set_aside_world=None, verify_data=True,
//       max_step=None) -> dict(step, run_id, ranks=[SelectedCheckpoint...], skipped=[...]);
//       raises when none is common
//   jd.select_reshard(world_size, step=None, max_step=None, verify_data=True)
//       -> dict(old_world, dir, step, run_id, ranks, skipped) or None
//   jd.list(rank=0) -> [dict(step, counter, where, keep, state, reason,
//       commit_unix_ns, data_bytes, metrics)]
//   jd.kept(rank=0, metric="") -> [dict(step, counter, metric)]; jd.delete_kept(step)
//   JobDir.open_for_maintenance(path)
//   jd.record_restore(rank, counter), jd.lineage(rank) -> dict, jd.next_counter(rank)
//   jd.needs_set_aside(world_size), jd.set_aside(world_size) -> [W...],
//   jd.set_aside_worlds() -> [W...]
//   jd.write_agreed(dict), jd.read_agreed(rank) -> dict or None
//   jd.slot_path(rank), jd.path, jd.foreign_entries()
// Errors map to nonstop.errors through the StatusError translator.
//
// Thread safety: a JobDir may be used from several threads; Keep() and the
// selections of different ranks may run concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/medium.h"
#include "nonstop/plan.h"
#include "nonstop/status.h"
#include "nonstop/store.h"

namespace nonstop {

// ---- Names (the only place they are spelled) ----
struct JobDirNames {
  static std::string Slot(int rank);           // "rank-00003.nsck"
  static std::string TempSlot(int rank);       // "rank-00003.nsck.tmp"
  static std::string Lock(int rank);           // ".nonstop.lock" (rank 0), ".nonstop.rank-00003.lock"
  static std::string Lineage(int rank);        // "lineage-rank-00003.json"
  static std::string Agreed(int rank);         // "agreed-rank-00003.json"
  static std::string Manifest(int rank);       // "manifest-rank-00003.json" (jobdir/manifest.h)
  static std::string KeepRoot();               // "keep"
  static std::string KeepStep(int64_t step);   // "step-000000000042"
  static std::string World(int world_size);    // "world-4"
  // The memory tier's record of rank r's segment name (memory_tier.h):
  // ".nonstop.memory-rank-00003"
  static std::string MemoryRecord(int rank);
  // Parsers: the rank/step/world of a name, or nullopt when it is not one.
  static std::optional<int> ParseSlot(std::string_view name);
  static std::optional<int64_t> ParseKeepStep(std::string_view name);
  static std::optional<int> ParseWorld(std::string_view name);
  // Whether `name` is one of a rank's files of the job's top directory: its
  // slot file, the records above and the temp names each is written under
  // ("rank-00003.nsck.tmp", "manifest-rank-00003.json.tmp"; a kill may
  // leave one behind).
  static bool IsRankFile(std::string_view name);
};

// Where a checkpoint lives, relative to the job directory.
struct CheckpointLocation {
  std::string where;  // "rank-00000.nsck", "keep/step-000000000008/rank-00000.nsck",
                      // "world-2/rank-00001.nsck"
  bool keep = false;  // a kept copy
};

// One committed or damaged checkpoint as List() reports it.
struct ListedCheckpoint {
  uint64_t counter = 0;
  int64_t step = 0;
  CheckpointLocation location;
  enum class State { kCommitted, kDamaged, kAbandoned } state = State::kDamaged;
  std::string reason;  // why damaged/abandoned; empty when committed
  uint64_t commit_unix_ns = 0;  // committed ones: when
  uint64_t data_bytes = 0;      // committed ones: bytes of tensor data
  std::vector<std::pair<std::string, double>> metrics;  // CheckpointMetrics of its metadata
  bool rotated = false;  // damaged only because a newer checkpoint reused its slot (gone, not damage)
};

struct SelectOptions {
  std::optional<int64_t> step;         // only this step (restore(step=s))
  std::optional<int64_t> max_step;     // only steps at most this (a fallback below a step
                                       // some rank could not use)
  bool verify_data = true;             // verify every data chunk crc of the chosen one
  bool include_keep = true;            // consider keep/ copies too
  std::vector<uint64_t> exclude;       // counters the caller found damaged while reading
  // SelectReshard only: more copies of old ranks' files outside the job
  // directory (the peer tier's: a replica or memory segment in this host's
  // memory directory, a copy fetched from another host or the object store
  // into it), each an absolute path of a slot file of rank `rank` of world
  // size `world`; a world named only here is considered too.
  struct ExtraFile {
    int world = 0;
    int rank = 0;
    std::string path;
  };
  std::vector<ExtraFile> extra;
};

// The checkpoint recovery chose, with its file open read-only for reading it.
struct Selected {
  CheckpointInfo info;
  CheckpointLocation location;
  std::unique_ptr<SlotFile> file;
  uint64_t newest_at_scan = 0;  // newest record counter of `file` when it was scanned
};

struct Selection {
  std::optional<Selected> chosen;      // empty: no checkpoint file exists at all
  std::vector<std::string> skipped;    // one line per newer checkpoint not chosen, and why
  bool fallback = false;               // chosen is not the newest non-abandoned committed one
  uint64_t newest_counter = 0;         // newest counter present in the rank's files
};

// The newest step committed (and verified) on every rank file of a world,
// by checkpoints of one run.
struct CommonSelection {
  int64_t step = 0;
  uint64_t run_id = 0;                 // CheckpointRunId of every rank's checkpoint
  std::vector<Selected> ranks;         // index = rank
  std::vector<std::string> skipped;    // newer (step, run)s not chosen, and why
};

// The checkpoint a job reshards from (SelectReshard): a common selection in
// the set-aside directory of the old world size.
struct ReshardSelection {
  int old_world = 0;
  std::string dir;                     // "world-2", relative to the job directory
  CommonSelection common;              // ranks[r].location.where: "world-2/rank-0000r.nsck"
};

// The run a checkpoint belongs to: the unsigned integer "lineage" of the
// top-level "dist" object of its metadata (the Python front end draws a new
// one whenever a distributed job starts or restores, and every rank writes
// the same one). 0 when the metadata has no such field (a job of one
// process, or not written by nonstop's front end); nullopt when the field is
// there but not an unsigned 64-bit integer (such a checkpoint is never part
// of a common selection). Bounded, never recursive (hostile bytes).
std::optional<uint64_t> CheckpointRunId(std::string_view meta_json);

// LineageRecord (the abandoned counters of a rank) is the planner's input: plan.h.

struct AgreedRecord {
  int64_t step = 0;
  int64_t counter = -1;                // -1: resharded (no counter of this world)
  uint64_t lineage = 0;
  int rank = 0;
  int world_size = 1;
  double unix_s = 0;
  std::string resharded_from;          // set-aside dir ("world-2"), empty when not resharded
  int resharded_from_world = 0;
};

// ---- Retention of kept copies (keep/step-N/) ----
// Which kept copies a writer makes after a commit, and which it deletes.
// - Periodic copies: every keep_every-th checkpoint (counter % keep_every == 0).
// - Best copies: a checkpoint whose metadata carries `best_metric` (a
//   top-level "metrics" object of name -> number in its meta_json) is copied
//   when it ranks among the best_k of the kept copies that carry the metric
//   (lower is better unless best_higher; a tie keeps the newer).
// After a copy is made, every kept copy that no rule holds is deleted:
// held are the best_k copies by the metric, and the newest max_to_keep of the
// others (periodic ones and those without the metric; all of them when
// max_to_keep is 0). Never deleted: a copy at or above the slot file's newest
// committed counter (it may be the newest committed checkpoint) and the copy
// a restore is protecting (ProtectedCounter).
struct RetentionPolicy {
  uint64_t keep_every = 0;   // 0: no periodic copies
  uint64_t max_to_keep = 0;  // 0: no limit on the copies not held as best
  std::string best_metric;   // empty: no best-k rule
  bool best_higher = false;  // "max": higher is better; "min" otherwise
  uint64_t best_k = 0;       // 0: no best-k rule
  bool MakesCopies() const { return keep_every > 0 || (best_k > 0 && !best_metric.empty()); }
  bool Deletes() const { return max_to_keep > 0 || (best_k > 0 && !best_metric.empty()); }
};

// One committed kept copy, as the retention rules see it.
struct KeptCopy {
  int64_t step = 0;
  uint64_t counter = 0;
  std::optional<double> metric;  // the policy's metric, when the copy carries it
};

// The metrics of a checkpoint: the top-level "metrics" object of its
// meta_json, name -> finite number (other values skipped). Bounded and never
// recursive (hostile bytes); empty when absent or malformed.
std::vector<std::pair<std::string, double>> CheckpointMetrics(std::string_view meta_json);
std::optional<double> CheckpointMetric(std::string_view meta_json, std::string_view name);

// Pure rules (above): whether a new committed checkpoint (counter, metric) is
// copied, given the copies there are; and which steps of `copies` are
// deleted, never one whose counter is in `keep_counters`. Ascending.
bool WantsKeepCopy(uint64_t counter, std::optional<double> metric, const RetentionPolicy& policy,
                   const std::vector<KeptCopy>& copies);
std::vector<int64_t> RetentionVictims(const std::vector<KeptCopy>& copies,
                                      const RetentionPolicy& policy,
                                      const std::vector<uint64_t>& keep_counters);

class JobDir {
 public:
  // Opens (creating when missing) `path` for rank `rank` of `world_size`,
  // takes the rank's lock and tidies leftovers (see above). `env` null:
  // DefaultEnv().
  static Result<std::unique_ptr<JobDir>> OpenForWrite(const std::string& path, int rank = 0,
                                                      int world_size = 1, Env* env = nullptr);
  // Opens an existing directory for reading: NotFound when it is missing.
  static Result<std::unique_ptr<JobDir>> OpenForRead(const std::string& path, Env* env = nullptr);

  ~JobDir();

  const std::string& path() const;
  bool writable() const;
  int rank() const;  // the writer's rank (0 for readers)
  Directory& dir();
  // "DIR/rank-00003.nsck", for messages.
  std::string SlotPath(int rank) const;
  // Entries that are not part of a job directory (hidden names excepted).
  Result<std::vector<std::string>> ForeignEntries();

  // ---- Slot files (writer: only its own rank) ----
  // Opens rank R's slot file; NotFound when missing.
  Result<std::unique_ptr<Medium>> OpenSlot(int rank, MediumKind kind, bool read_only);
  // Creates R's temp slot file (a stale one is removed first); the caller
  // lays it out (SlotFile::Create), then PublishTempSlot renames it over the
  // slot file and syncs the directory, or DiscardTempSlot removes it.
  Result<std::unique_ptr<Medium>> CreateTempSlot(MediumKind kind);
  Status PublishTempSlot();
  Status DiscardTempSlot();

  // ---- Recovery selection (the job directory's candidates, planned by MakePlan) ----
  // Newest committed, non-abandoned checkpoint of rank R (its slot file and
  // keep copies) that verifies; else older ones, each skipped with a reason.
  // A Selection without `chosen` when R's files hold no checkpoint record at
  // all (a fresh start; never with opts.step). Otherwise, when nothing is
  // usable: Corruption when damage was seen, else NotFound, with every reason.
  Result<Selection> Select(int rank, const SelectOptions& opts = {});
  // Readers: whether a live writer may have reused `sel`'s slot since it was
  // selected (its file has committed a newer checkpoint). On a read error
  // that returns true, Select again instead of reporting damage.
  Result<bool> Superseded(Selected& sel);
  // Newest step committed, not abandoned and verified on every rank
  // 0..world_size-1 (in world-W/ when set_aside_world is given) by
  // checkpoints of one run (CheckpointRunId): checkpoints of one step from
  // different runs are never mixed. A step (or run) that fails to verify on
  // some rank is skipped (a line in `skipped`) and older ones are tried.
  // Never "nothing"; when no step qualifies, one line naming the first rank
  // file that breaks it:
  //   NotFound            a rank file is missing, or no step is common (no damage seen);
  //   FailedPrecondition  a rank file was written by another rank or world
  //                       size, or none of its checkpoints is of a run of the
  //                       lower ranks' ("... is from another job");
  //   Corruption          a rank holds no committed checkpoint because of
  //                       damage, or every common step fails to verify.
  Result<CommonSelection> SelectCommon(int world_size, const SelectOptions& opts = {},
                                       std::optional<int> set_aside_world = std::nullopt);
  // The reshard choice of a job of world size `world_size`: of every
  // set-aside world-W/ (SetAsideWorlds), the common selection (SelectCommon
  // in world-W/ with W ranks) whose step is newest; on a tie the smaller W.
  // A world that fails is passed over when another one has a common step.
  // nullopt when no set-aside rank file holds any checkpoint record (nothing
  // committed can be lost). Otherwise, when no world qualifies, the first
  // world's error, beginning "cannot reshard the checkpoint of world size W
  // in DIR/world-W to world size N: ", with SelectCommon's codes except that
  // a missing old rank file is FailedPrecondition (every old rank file must
  // be visible to every new rank). I/O errors are returned at once.
  // opts.extra adds copies of old rank files from outside the job directory.
  Result<std::optional<ReshardSelection>> SelectReshard(int world_size,
                                                        const SelectOptions& opts = {});
  // Every checkpoint record of rank R (slot file, then keep copies), newest first.
  Result<std::vector<ListedCheckpoint>> List(int rank);

  // ---- Lineage (writer) ----
  // Durably records that rank R restored `counter`: every counter above it
  // present in R's files is abandoned. Call before writing anything new.
  // `newest_elsewhere`: the newest counter another tier holds (the memory
  // tier's segment of the tiered cadence), abandoned with the slot file's.
  Status RecordRestore(int rank, uint64_t counter, uint64_t newest_elsewhere = 0);
  Result<LineageRecord> ReadLineage(int rank);
  // Durably notes that checkpoint `counter` of rank R must never be chosen:
  // its commit failed after its record may have reached the slot file (a
  // failed sync: the record can still be read back from the page cache, and
  // a power cut may or may not keep it). It becomes an abandoned counter
  // (every selection, the engine's open and Restore skip it), listed with
  // the reason "never durable". The engine calls it after every failed
  // commit, before any later checkpoint commits.
  Status RecordNotDurable(int rank, uint64_t counter);
  // First counter a writer of rank R may use (above every record and every
  // abandoned counter).
  Result<uint64_t> NextCounter(int rank);
  // The restored counter while no newer checkpoint of its lineage has
  // committed in R's slot file; nullopt otherwise.
  Result<std::optional<uint64_t>> ProtectedCounter(int rank);

  // ---- Keep copies (writer) ----
  // Copies committed `info` of `src` to keep/step-N/rank-R.nsck: temp name,
  // CopyCheckpoint (verifies every chunk), sync, rename, SyncDir. OK at once
  // when that copy already holds `info.counter`. The caller keeps `info`'s
  // slot from being reused during the copy.
  Status Keep(SlotFile& src, const CheckpointInfo& info);

  // ---- Retention and deletion of kept copies (writer) ----
  // After `info` of `src` committed: makes its keep copy when `policy` wants
  // one (Keep), then deletes the kept copies the policy no longer holds
  // (DeleteKept). The caller keeps `info`'s slot from being reused meanwhile.
  // With world_size > 1 each rank deletes its own file only (DeleteKeptShare).
  Status Retain(SlotFile& src, const CheckpointInfo& info, const RetentionPolicy& policy);
  // The committed, non-abandoned kept copies of rank R, newest step first,
  // with `metric` when given.
  Result<std::vector<KeptCopy>> KeptCopies(int rank, const std::string& metric = "");
  // Deletes keep/step-N/ with every rank's copy in it: renamed to a hidden
  // temp name first (a reader sees the whole copy or none; a kill leaves the
  // temp, which the next writer's open removes), then its files and itself,
  // each step made durable. NotFound listing the kept steps when there is no
  // such copy; FailedPrecondition when it may be the newest committed
  // checkpoint or a restore protects it. A writer of world size > 1 must
  // hold every rank's lock (OpenForMaintenance).
  Status DeleteKept(int64_t step);
  // World size > 1, while the job runs: deletes this rank's file of
  // keep/step-N/ (one unlink, made durable), and the directory once it holds
  // no rank's file. The same NotFound/FailedPrecondition rules as DeleteKept.
  Status DeleteKeptShare(int64_t step);
  // Opens an existing job directory to change it while no job runs: takes
  // every rank's lock (a running job: FailedPrecondition naming the holder)
  // and tidies rank 0's leftovers like OpenForWrite. NotFound when missing.
  static Result<std::unique_ptr<JobDir>> OpenForMaintenance(const std::string& path,
                                                            Env* env = nullptr);

  // ---- Set-aside for resharding (writer) ----
  // Whether readable rank files of another world size than `world_size` are
  // here (the ones SetAside would move; unreadable ones are left alone).
  Result<bool> NeedsSetAside(int world_size);
  // Moves them (with their agreed and lineage records) into world-W/ by
  // rename + SyncDir; returns the W's moved. A file already set aside there
  // is kept as ".prev" when the new one has a committed checkpoint.
  Result<std::vector<int>> SetAside(int world_size);
  // The W of every world-W/ directory, ascending.
  Result<std::vector<int>> SetAsideWorlds();

  // ---- Agreed records (distributed) ----
  Status WriteAgreed(const AgreedRecord& rec);  // rec.rank's record, atomically
  // nullopt when missing; Corruption when unparsable or over 64 KiB.
  Result<std::optional<AgreedRecord>> ReadAgreed(int rank);

  struct Impl;

 private:
  explicit JobDir(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace nonstop
