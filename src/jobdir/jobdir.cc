// JobDir (include/nonstop/jobdir.h): the job directory's only owner.
#include "nonstop/jobdir.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <map>
#include <set>

#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "jobdir/records.h"

namespace nonstop {

using jobdir_internal::DecodeAgreed;
using jobdir_internal::DecodeLineage;
using jobdir_internal::EncodeAgreed;
using jobdir_internal::EncodeLineage;
using jobdir_internal::kMaxAbandonedRanges;
using jobdir_internal::kMaxRecordBytes;
using jobdir_internal::kMaxNotDurable;

namespace {

constexpr int kReaderRetries = 32;  // a live writer committing while a reader verifies
constexpr uint64_t kMaxAgreedBytes = 64 << 10;

bool IsNotFound(const Status& s) { return s.code() == StatusCode::kNotFound; }
// Stored bytes that are not what they should be (as opposed to an I/O error,
// which may be transient and is never taken for damage).
bool IsDamage(const Status& s) {
  return s.code() == StatusCode::kCorruption || s.code() == StatusCode::kFailedPrecondition;
}

// Counters a rollback abandons above the restored one when a file of the
// rank cannot be read (its records unknown): far more than any job commits.
constexpr uint64_t kUnknownCounterMargin = uint64_t{1} << 32;

std::string UtcNow() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char b[32];
  std::strftime(b, sizeof(b), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return b;
}

std::string HolderLine() {
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "unknown");
  return "pid " + std::to_string(getpid()) + " on host " + host + " (started " + UtcNow() + ")";
}

std::string Describe(uint64_t counter, int64_t step) {
  return "checkpoint #" + std::to_string(counter) + " (step " + std::to_string(step) + ")";
}

// One file holding checkpoints of a rank: the slot file, a keep copy, or a
// temp slot file, opened read-only and scanned (records and tables only).
struct Source {
  CheckpointLocation loc;
  std::unique_ptr<SlotFile> file;
  ScanReport report;
  uint64_t newest_record = 0;  // newest counter of any record that parsed
};

uint64_t NewestRecord(const ScanReport& r) {
  uint64_t n = 0;
  for (const auto& c : r.checkpoints) n = std::max(n, c.info.counter);
  return n;
}

// A record SlotFile::Scan calls damaged only because a newer checkpoint
// reused its slot: that checkpoint rotated out of the ring (gone, not damage).
bool IsRotated(const ScannedCheckpoint& c) {
  return c.state == CheckpointState::kDamaged && c.reason.rfind("slot ", 0) == 0 &&
         c.reason.find(" was reused by checkpoint #") != std::string::npos;
}

// Whether the planner counts record `c` as a committed, live checkpoint
// (committed and not abandoned by a rollback).
bool Live(const ScannedCheckpoint& c, const LineageRecord& lineage) {
  PlanCandidate pc;
  pc.counter = c.info.counter;
  pc.committed = c.state == CheckpointState::kCommitted;
  return Classify(pc, lineage).state == CandidateState::State::kCommitted;
}

Status VerifyData(SlotFile& f, const CheckpointInfo& info) {
  return f.ReadData(info, 0, nullptr, info.data_bytes, /*verify=*/true);
}

}  // namespace

struct JobDir::Impl {
  Env* env = nullptr;
  std::string path;
  std::unique_ptr<Directory> dir;
  std::unique_ptr<FileLock> lock;
  bool writable = false;
  int rank = 0;
  int world = 1;
  // Serialises every change of the lineage record, the kept copies and the
  // set-aside folders: those live on disk, so it guards the functions that
  // change them (REQUIRES(mu)), which clang checks (make test-tsa).
  Mutex mu;
  // OpenForMaintenance: every rank's lock. Filled before the JobDir is
  // returned, read-only after.
  std::vector<std::unique_ptr<FileLock>> other_locks;

  // A location relative to the job directory (an absolute one, a copy
  // outside it: SelectOptions::extra, as it is).
  std::string Where(const std::string& rel) const {
    return !rel.empty() && rel[0] == '/' ? rel : path + "/" + rel;
  }

  Status CheckWriter(const char* op, int for_rank) const {
    if (!writable) {
      return Status::FailedPrecondition(std::string(op) + " needs the job directory " + path +
                                        " opened for writing");
    }
    if (for_rank != rank) {
      return Status::InvalidArgument(std::string(op) + ": this writer of " + path + " is rank " +
                                     std::to_string(rank) + ", not rank " +
                                     std::to_string(for_rank));
    }
    return Status::OK();
  }

  // Opens `name` in `d` read-only and scans it. NotFound when missing; any
  // other failure is returned (the caller reports it as one skipped file).
  Result<Source> OpenSource(Directory& d, const std::string& name, CheckpointLocation loc) {
    MediumOptions mo;
    mo.read_only = true;
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> m, d.OpenFile(name, MediumKind::kBuffered, mo));
    Result<std::unique_ptr<SlotFile>> sf = SlotFile::Open(std::move(m));
    if (!sf.ok()) return sf.status().Annotate(Where(loc.where));
    Source s;
    s.loc = std::move(loc);
    s.file = std::move(sf).value();
    ScanOptions so;
    so.verify_data = false;
    Result<ScanReport> rep = s.file->Scan(so);
    if (!rep.ok()) return rep.status().Annotate(Where(s.loc.where));
    s.report = std::move(rep).value();
    s.newest_record = NewestRecord(s.report);
    return s;
  }

  // Rank `r`'s files in `d` (prefix: d's name relative to the job dir, with
  // a trailing '/', or empty): the slot file, then keep copies (newest step
  // first), then the temp slot file when asked. Files that cannot be read
  // are reported in `problems`.
  // only_step: of the keep copies, only that step's (a selection of one step).
  Status Sources(Directory& d, const std::string& prefix, int r, bool include_keep,
                 bool include_temp, std::vector<Source>* out, std::vector<std::string>* problems,
                 std::optional<int64_t> only_step = std::nullopt) {
    // A file that is missing is skipped; one whose bytes are not a readable
    // slot file is a problem (reported, recovery goes on); an I/O error stops
    // the selection (a transient error must not look like damage).
    auto add = [&](Directory& in, const std::string& name, const std::string& rel,
                   bool keep) -> Status {
      Result<Source> s = OpenSource(in, name, CheckpointLocation{rel, keep});
      if (s.ok()) {
        // A file cut shorter than its header says, whose commit records are
        // gone with its tail, is damage: never "nothing was committed".
        if (s.value().report.checkpoints.empty()) {
          for (const std::string& note : s.value().file->salvaged()) {
            if (note.rfind("slot file is truncated", 0) == 0) {
              problems->push_back(Where(rel) + ": " + note.substr(0, note.find(';')) +
                                  ": no commit record is left (damage, not a fresh start)");
            }
          }
        }
        out->push_back(std::move(s).value());
      } else if (IsDamage(s.status())) {
        problems->push_back(s.status().message());
      } else if (!IsNotFound(s.status())) {
        return s.status();
      }
      return Status::OK();
    };
    NONSTOP_RETURN_IF_ERROR(add(d, JobDirNames::Slot(r), prefix + JobDirNames::Slot(r), false));
    if (include_keep) {
      Result<std::unique_ptr<Directory>> kd = d.OpenDir(JobDirNames::KeepRoot(), false);
      if (!kd.ok() && !IsNotFound(kd.status())) {
        if (!IsDamage(kd.status())) return kd.status();
        problems->push_back(kd.status().Annotate(Where(prefix + JobDirNames::KeepRoot())).message());
      }
      if (kd.ok()) {
        Directory& keep = *kd.value();
        NONSTOP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, keep.List());
        std::reverse(entries.begin(), entries.end());  // newest step first
        for (const DirEntry& e : entries) {
          if (e.type != EntryType::kDirectory || !JobDirNames::ParseKeepStep(e.name)) continue;
          if (only_step && e.name != JobDirNames::KeepStep(*only_step)) continue;
          Result<std::unique_ptr<Directory>> sd = keep.OpenDir(e.name, false);
          if (!sd.ok()) {
            if (IsNotFound(sd.status())) continue;
            if (!IsDamage(sd.status())) return sd.status();
            problems->push_back(sd.status().message());
            continue;
          }
          NONSTOP_RETURN_IF_ERROR(add(*sd.value(), JobDirNames::Slot(r),
                                      prefix + JobDirNames::KeepRoot() + "/" + e.name + "/" +
                                          JobDirNames::Slot(r),
                                      true));
        }
      }
    }
    if (include_temp) {
      NONSTOP_RETURN_IF_ERROR(add(d, JobDirNames::TempSlot(r), prefix + JobDirNames::TempSlot(r), false));
    }
    return Status::OK();
  }

  Result<LineageRecord> LineageIn(Directory& d, const std::string& prefix, int r) {
    Result<std::string> text = ReadSmallFile(d, JobDirNames::Lineage(r), kMaxRecordBytes);
    if (!text.ok()) {
      if (IsNotFound(text.status())) return LineageRecord{};
      return text.status().Annotate(Where(prefix + JobDirNames::Lineage(r)));
    }
    return DecodeLineage(text.value(), Where(prefix + JobDirNames::Lineage(r)));
  }

  // Newest counter of any record in r's files (temp slot file and keep copies included).
  Result<uint64_t> NewestCounter(int r) {
    std::vector<Source> sources;
    std::vector<std::string> problems;
    NONSTOP_RETURN_IF_ERROR(Sources(*dir, "", r, true, true, &sources, &problems));
    uint64_t n = 0;
    for (const Source& s : sources) {
      n = std::max(n, std::max(s.newest_record, s.file->newest_committed_counter()));
    }
    // A file whose records cannot be read may hold newer counters (a later
    // salvage could find them): count them as far above every known one.
    if (!problems.empty()) n += kUnknownCounterMargin;
    return n;
  }

  Result<Selection> SelectIn(Directory& d, const std::string& prefix, int r,
                             const SelectOptions& opts);
  // The common selection of `world` ranks in `d`; nullopt when none of its
  // rank files holds a checkpoint record. Every error message begins with
  // `head`; reshard: a missing rank file is FailedPrecondition.
  // d: nullptr when only opts.extra holds the world's files (reshard).
  Result<std::optional<CommonSelection>> SelectCommonIn(Directory* d, const std::string& prefix,
                                                        int world, const SelectOptions& opts,
                                                        const std::string& head, bool reshard);
  Status KeepLocked(SlotFile& src, const CheckpointInfo& info) REQUIRES(mu);
  // Replaces rank r's lineage record (temp name, sync, rename).
  Status WriteLineageLocked(int r, const LineageRecord& rec) REQUIRES(mu);
  Status TidyLeftovers() EXCLUDES(mu);
  // Retention (the end of this file).
  Result<std::vector<KeptCopy>> KeptCopiesLocked(int r, const std::string& metric) REQUIRES(mu);
  Result<std::vector<uint64_t>> UndeletableCounters(int r, const std::vector<KeptCopy>& copies)
      REQUIRES(mu);
  Status DeleteKeptLocked(int64_t step) REQUIRES(mu);
  Status DeleteKeptShareLocked(int64_t step) REQUIRES(mu);
  Status RemoveDeletingLeftovers(Directory& keep) REQUIRES(mu);
};

// ---------------------------------------------------------------- open

JobDir::JobDir(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
JobDir::~JobDir() = default;

Result<std::unique_ptr<JobDir>> JobDir::OpenForWrite(const std::string& path, int rank,
                                                     int world_size, Env* env) {
  if (world_size < 1 || rank < 0 || rank >= world_size || world_size > 99999) {
    return Status::InvalidArgument("job directory " + path + ": rank " + std::to_string(rank) +
                                   " is not below world size " + std::to_string(world_size));
  }
  auto impl = std::make_unique<Impl>();
  impl->env = env ? env : DefaultEnv();
  impl->path = path;
  impl->writable = true;
  impl->rank = rank;
  impl->world = world_size;
  Result<std::unique_ptr<Directory>> d = impl->env->OpenDirectory(path, /*create=*/true);
  if (!d.ok()) return d.status().Annotate("cannot open job directory " + path);
  impl->dir = std::move(d).value();
  Result<std::unique_ptr<FileLock>> lock = impl->dir->Lock(JobDirNames::Lock(rank), HolderLine());
  if (!lock.ok()) {
    if (lock.status().code() == StatusCode::kFailedPrecondition) {
      return Status::FailedPrecondition("job directory " + path + " has another writer" +
                                        (world_size > 1 ? " for rank " + std::to_string(rank) : "") +
                                        ": " + lock.status().message());
    }
    return lock.status().Annotate("cannot lock job directory " + path);
  }
  impl->lock = std::move(lock).value();
  NONSTOP_RETURN_IF_ERROR(impl->TidyLeftovers());
  return std::unique_ptr<JobDir>(new JobDir(std::move(impl)));
}

Result<std::unique_ptr<JobDir>> JobDir::OpenForRead(const std::string& path, Env* env) {
  auto impl = std::make_unique<Impl>();
  impl->env = env ? env : DefaultEnv();
  impl->path = path;
  Result<std::unique_ptr<Directory>> d = impl->env->OpenDirectory(path, /*create=*/false);
  if (!d.ok()) {
    if (IsNotFound(d.status())) return Status::NotFound("checkpoint directory " + path + " does not exist");
    return d.status().Annotate("cannot open job directory " + path);
  }
  impl->dir = std::move(d).value();
  return std::unique_ptr<JobDir>(new JobDir(std::move(impl)));
}

// Removes the writer's leftovers and redoes the keep copies a kill interrupted.
Status JobDir::Impl::TidyLeftovers() {
  // Nothing else holds this JobDir yet; taken because the keep copies
  // redone below are changes it serialises.
  MutexLock l(&mu);
  auto unlink_if = [&](Directory& d, const std::string& name) -> Result<bool> {
    Status s = d.Unlink(name);
    if (s.ok()) return true;
    if (IsNotFound(s)) return false;
    return s;
  };
  bool changed = false;
  for (const std::string& name : {JobDirNames::TempSlot(rank), JobDirNames::Lineage(rank) + ".tmp",
                                  JobDirNames::Agreed(rank) + ".tmp",
                                  JobDirNames::Manifest(rank) + ".tmp"}) {
    NONSTOP_ASSIGN_OR_RETURN(bool gone, unlink_if(*dir, name));
    changed = changed || gone;
  }
  if (changed) NONSTOP_RETURN_IF_ERROR(dir->SyncDir());

  Result<std::unique_ptr<Directory>> kd = dir->OpenDir(JobDirNames::KeepRoot(), false);
  if (!kd.ok()) return IsNotFound(kd.status()) ? Status::OK() : kd.status();
  Directory& keep = *kd.value();
  NONSTOP_RETURN_IF_ERROR(RemoveDeletingLeftovers(keep));  // a kill during DeleteKept
  NONSTOP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, keep.List());
  std::vector<int64_t> interrupted;  // steps whose copy for this rank is missing
  bool keep_changed = false;
  for (const DirEntry& e : entries) {
    std::optional<int64_t> step = JobDirNames::ParseKeepStep(e.name);
    if (!step || e.type != EntryType::kDirectory) continue;
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> sd, keep.OpenDir(e.name, false));
    NONSTOP_ASSIGN_OR_RETURN(bool had_tmp, unlink_if(*sd, JobDirNames::TempSlot(rank)));
    if (had_tmp) NONSTOP_RETURN_IF_ERROR(sd->SyncDir());
    NONSTOP_ASSIGN_OR_RETURN(std::vector<DirEntry> files, sd->List());
    bool has_final = false;
    for (const DirEntry& f : files) has_final = has_final || f.name == JobDirNames::Slot(rank);
    if (had_tmp || (!has_final && files.empty())) interrupted.push_back(*step);
  }
  if (interrupted.empty()) return Status::OK();
  // Redo each from this rank's slot file when the step is still committed there.
  std::vector<std::string> problems;
  Result<Source> src = OpenSource(*dir, JobDirNames::Slot(rank),
                                  CheckpointLocation{JobDirNames::Slot(rank), false});
  if (!src.ok() && !IsNotFound(src.status()) && !IsDamage(src.status())) return src.status();
  Result<LineageRecord> lineage = LineageIn(*dir, "", rank);
  if (!lineage.ok() && !IsDamage(lineage.status())) return lineage.status();
  for (int64_t step : interrupted) {
    bool redone = false;
    if (src.ok() && lineage.ok()) {
      for (const ScannedCheckpoint& c : src.value().report.checkpoints) {
        if (c.info.step != step || !Live(c, lineage.value())) {
          continue;
        }
        Status st = KeepLocked(*src.value().file, c.info);
        if (st.ok()) {
          redone = true;
          break;
        }
        if (st.code() != StatusCode::kCorruption) return st;  // damage only is not fatal here
        std::fprintf(stderr, "nonstop: cannot redo the interrupted keep copy of step %lld: %s\n",
                     static_cast<long long>(step), st.message().c_str());
      }
    }
    if (redone || world > 1) continue;
    // Nothing to copy from any more: remove the half-made directory when empty.
    const std::string name = JobDirNames::KeepStep(step);
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> sd, keep.OpenDir(name, false));
    NONSTOP_ASSIGN_OR_RETURN(std::vector<DirEntry> files, sd->List());
    if (files.empty()) {
      Status rs = keep.RemoveDir(name);
      if (!rs.ok() && !IsNotFound(rs)) return rs;
      keep_changed = true;
    }
  }
  if (keep_changed) NONSTOP_RETURN_IF_ERROR(keep.SyncDir());
  return Status::OK();
}

const std::string& JobDir::path() const { return impl_->path; }
bool JobDir::writable() const { return impl_->writable; }
int JobDir::rank() const { return impl_->rank; }
Directory& JobDir::dir() { return *impl_->dir; }
std::string JobDir::SlotPath(int rank) const { return impl_->Where(JobDirNames::Slot(rank)); }

Result<std::vector<std::string>> JobDir::ForeignEntries() {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, impl_->dir->List());
  std::vector<std::string> out;
  for (const DirEntry& e : entries) {
    const std::string& n = e.name;
    if (n.empty() || n[0] == '.') continue;
    const bool file = e.type == EntryType::kFile;
    const bool dir = e.type == EntryType::kDirectory;
    if (file && JobDirNames::IsRankFile(n)) continue;
    if (dir && (n == JobDirNames::KeepRoot() || JobDirNames::ParseWorld(n))) continue;
    out.push_back(n);
  }
  return out;
}

// ---------------------------------------------------------------- slot files

Result<std::unique_ptr<Medium>> JobDir::OpenSlot(int rank, MediumKind kind, bool read_only) {
  if (!read_only) NONSTOP_RETURN_IF_ERROR(impl_->CheckWriter("opening a slot file to write", rank));
  MediumOptions mo;
  mo.read_only = read_only;
  return impl_->dir->OpenFile(JobDirNames::Slot(rank), kind, mo);
}

Result<std::unique_ptr<Medium>> JobDir::CreateTempSlot(MediumKind kind) {
  NONSTOP_RETURN_IF_ERROR(impl_->CheckWriter("creating a slot file", impl_->rank));
  const std::string tmp = JobDirNames::TempSlot(impl_->rank);
  Status s = impl_->dir->Unlink(tmp);
  if (!s.ok() && !IsNotFound(s)) return s;
  return impl_->dir->CreateFile(tmp, kind, MediumOptions{});
}

Status JobDir::PublishTempSlot() {
  NONSTOP_RETURN_IF_ERROR(impl_->CheckWriter("publishing a slot file", impl_->rank));
  NONSTOP_RETURN_IF_ERROR(
      impl_->dir->Rename(JobDirNames::TempSlot(impl_->rank), JobDirNames::Slot(impl_->rank)));
  return impl_->dir->SyncDir();
}

Status JobDir::DiscardTempSlot() {
  NONSTOP_RETURN_IF_ERROR(impl_->CheckWriter("removing a temp slot file", impl_->rank));
  Status s = impl_->dir->Unlink(JobDirNames::TempSlot(impl_->rank));
  return IsNotFound(s) ? Status::OK() : s;
}

// ---------------------------------------------------------------- selection

namespace {

// Every record of `sources` as a planner candidate; handle = index into `at`.
std::vector<PlanCandidate> Candidates(const std::vector<Source>& sources,
                                      std::vector<std::pair<size_t, size_t>>* at) {
  std::vector<PlanCandidate> out;
  for (size_t s = 0; s < sources.size(); ++s) {
    const ScanReport& rep = sources[s].report;
    for (size_t i = 0; i < rep.checkpoints.size(); ++i) {
      const ScannedCheckpoint& c = rep.checkpoints[i];
      PlanCandidate pc;
      pc.tier = sources[s].loc.keep ? Tier::kKeep : Tier::kDisk;
      pc.where = sources[s].loc.where;
      pc.step = c.info.step;
      pc.counter = c.info.counter;
      pc.committed = c.state == CheckpointState::kCommitted;
      pc.damage = c.reason;
      pc.overwritten = IsRotated(c);
      pc.handle = at->size();
      at->emplace_back(s, i);
      out.push_back(std::move(pc));
    }
  }
  return out;
}

}  // namespace

Result<Selection> JobDir::Impl::SelectIn(Directory& d, const std::string& prefix, int r,
                                         const SelectOptions& opts) {
  for (int attempt = 0;; ++attempt) {
    NONSTOP_ASSIGN_OR_RETURN(LineageRecord lineage, LineageIn(d, prefix, r));
    std::vector<Source> sources;
    std::vector<std::string> problems;
    NONSTOP_RETURN_IF_ERROR(Sources(d, prefix, r, opts.include_keep && prefix.empty(), false,
                                    &sources, &problems, opts.step));
    bool any_record = false;
    for (const Source& src : sources) {
      any_record = any_record || !src.report.checkpoints.empty() || !src.report.skipped.empty();
    }
    std::vector<std::pair<size_t, size_t>> at;
    const std::vector<PlanCandidate> cands = Candidates(sources, &at);
    PlanRequest req;
    req.step = opts.step;
    req.max_step = opts.max_step;
    req.exclude = opts.exclude;
    req.verify = opts.verify_data;
    Result<Plan> planned = MakePlan(cands, lineage, req, [&](const PlanCandidate& c) -> Status {
      Source& src = sources[at[c.handle].first];
      const CheckpointInfo& info = src.report.checkpoints[at[c.handle].second].info;
      Status st = VerifyData(*src.file, info);
      if (st.ok()) return st;
      if (!writable && !src.loc.keep && attempt < kReaderRetries) {
        // A reader: a live writer may have committed a newer checkpoint
        // and reused this slot while we verified it. Then look again.
        ScanOptions so;
        so.verify_data = false;
        Result<ScanReport> again = src.file->Scan(so);
        if (again.ok() && NewestRecord(again.value()) > src.newest_record) {
          return Status::Aborted("superseded while verified");
        }
      }
      if (st.code() == StatusCode::kCorruption) return st;
      return st.Annotate(Where(src.loc.where));
    });
    if (!planned.ok()) {
      if (planned.status().code() == StatusCode::kAborted) continue;
      return planned.status();
    }
    Plan& plan = planned.value();
    Selection sel;
    sel.newest_counter = plan.newest_counter;
    sel.skipped = std::move(plan.skipped);
    for (auto& p : problems) sel.skipped.push_back(std::move(p));
    const bool saw_damage = plan.saw_damage || !problems.empty();
    if (!plan.chosen()) {
      if (!any_record && problems.empty() && !opts.step) return sel;  // a fresh start
      std::string why = "no " + (opts.step ? "checkpoint of step " + std::to_string(*opts.step)
                                           : std::string("checkpoint")) +
                        " of rank " + std::to_string(r) + " in " + Where(prefix.empty() ? "" : prefix);
      if (why.back() == '/') why.pop_back();
      why += " can be restored";
      if (sel.skipped.empty()) why += " (none is committed)";
      for (const auto& s : sel.skipped) why += "; " + s;
      return saw_damage ? Status::Corruption(why) : Status::NotFound(why);
    }
    const auto [si, ci] = at[cands[*plan.chosen()].handle];
    Source& src = sources[si];
    Selected out;
    out.info = src.report.checkpoints[ci].info;
    out.location = src.loc;
    out.newest_at_scan = src.newest_record;
    out.file = std::move(src.file);
    sel.fallback = plan.fallback;
    sel.chosen = std::move(out);
    return sel;
  }
}

Result<Selection> JobDir::Select(int rank, const SelectOptions& opts) {
  return impl_->SelectIn(*impl_->dir, "", rank, opts);
}

Result<bool> JobDir::Superseded(Selected& sel) {
  if (!sel.file) return Status::InvalidArgument("Superseded: the selection holds no file");
  if (sel.location.keep) return false;  // keep copies are never rewritten
  ScanOptions so;
  so.verify_data = false;
  NONSTOP_ASSIGN_OR_RETURN(ScanReport rep, sel.file->Scan(so));
  return NewestRecord(rep) > sel.newest_at_scan;
}

Result<std::optional<CommonSelection>> JobDir::Impl::SelectCommonIn(
    Directory* d, const std::string& prefix, int world, const SelectOptions& opts,
    const std::string& head, bool reshard) {
  // (step, run id): checkpoints of one step are common only within one run.
  using Key = std::pair<int64_t, uint64_t>;
  struct PerRank {
    std::vector<Source> sources;
    LineageRecord lineage;
    std::map<Key, std::vector<std::pair<size_t, size_t>>> keys;  // -> (src, idx), newest counter first
    std::vector<std::string> problems;
    std::string damage;     // the first damaged (or unusable) record, when any
    bool any_record = false;
  };
  auto fail = [&](StatusCode code, const std::string& why) { return Status(code, head + ": " + why); };
  std::vector<PerRank> ranks(static_cast<size_t>(world));
  bool any_record = false, saw_damage = false;
  for (int r = 0; r < world; ++r) {
    PerRank& pr = ranks[r];
    if (d != nullptr) {
      NONSTOP_ASSIGN_OR_RETURN(pr.lineage, LineageIn(*d, prefix, r));
      NONSTOP_RETURN_IF_ERROR(Sources(*d, prefix, r, opts.include_keep && prefix.empty(), false,
                                      &pr.sources, &pr.problems));
    }
    if (reshard) {
      // Copies of this old rank's file outside the job directory, by
      // absolute path (opened through the Env, never followed).
      for (const SelectOptions::ExtraFile& e : opts.extra) {
        if (e.world != world || e.rank != r) continue;
        const size_t cut = e.path.rfind('/');
        if (e.path.empty() || e.path[0] != '/' || cut == std::string::npos ||
            cut + 1 == e.path.size()) {
          return Status::InvalidArgument("SelectReshard: extra file '" + e.path +
                                         "' is not an absolute path of a file");
        }
        Result<std::unique_ptr<Directory>> in =
            env->OpenDirectory(cut == 0 ? "/" : e.path.substr(0, cut), false);
        Result<Source> src = in.ok() ? OpenSource(*in.value(), e.path.substr(cut + 1),
                                                  CheckpointLocation{e.path, false})
                                     : Result<Source>(in.status());
        if (src.ok()) {
          pr.sources.push_back(std::move(src).value());
        } else if (IsDamage(src.status()) || IsNotFound(src.status())) {
          pr.problems.push_back(src.status().Annotate(e.path).message());
        } else {
          return src.status().Annotate(e.path);
        }
      }
    }
    if (pr.sources.empty()) {
      std::string why = Where(prefix + JobDirNames::Slot(r)) +
                        (pr.problems.empty() ? " is missing" : " cannot be read");
      for (const auto& p : pr.problems) why += ": " + p;
      if (reshard && pr.problems.empty()) {
        return fail(StatusCode::kFailedPrecondition,
                    why + " (every old rank file must be visible to every rank: use a shared "
                          "file system or copy them there)");
      }
      return fail(pr.problems.empty() ? StatusCode::kNotFound : StatusCode::kCorruption, why);
    }
    for (size_t s = 0; s < pr.sources.size(); ++s) {
      const Source& src = pr.sources[s];
      const StoreGeometry& g = src.file->geometry();
      if (static_cast<int>(g.world_size) != world || static_cast<int>(g.rank) != r) {
        return fail(StatusCode::kFailedPrecondition,
                    Where(src.loc.where) + " was written by rank " + std::to_string(g.rank) +
                        " of world size " + std::to_string(g.world_size) + ", not rank " +
                        std::to_string(r) + " of " + std::to_string(world));
      }
      pr.any_record = pr.any_record || !src.report.checkpoints.empty() || !src.report.skipped.empty();
      for (size_t i = 0; i < src.report.checkpoints.size(); ++i) {
        const ScannedCheckpoint& c = src.report.checkpoints[i];
        PlanCandidate pc;
        pc.counter = c.info.counter;
        pc.committed = c.state == CheckpointState::kCommitted;
        pc.damage = c.reason;
        pc.overwritten = IsRotated(c);
        const CandidateState cs = Classify(pc, pr.lineage);
        if (cs.state == CandidateState::State::kAbandoned ||
            cs.state == CandidateState::State::kOverwritten) {
          continue;
        }
        std::string bad;
        std::optional<uint64_t> run;
        if (cs.state == CandidateState::State::kDamaged) {
          bad = cs.reason;
        } else if (!(run = CheckpointRunId(c.info.meta_json))) {
          bad = "its metadata's run id (\"dist\".\"lineage\") is not an unsigned integer";
        }
        if (!bad.empty()) {
          if (pr.damage.empty()) {
            pr.damage = src.loc.where + ": " + Describe(c.info.counter, c.info.step) + ": " + bad;
          }
          continue;
        }
        pr.keys[Key{c.info.step, *run}].emplace_back(s, i);
      }
    }
    for (auto& [key, v] : pr.keys) {
      std::stable_sort(v.begin(), v.end(), [&](const auto& a, const auto& b) {
        return pr.sources[a.first].report.checkpoints[a.second].info.counter >
               pr.sources[b.first].report.checkpoints[b.second].info.counter;
      });
    }
    any_record = any_record || pr.any_record || !pr.problems.empty();
    saw_damage = saw_damage || !pr.damage.empty() || !pr.problems.empty();
  }
  if (!any_record) return std::optional<CommonSelection>();  // nothing was ever committed here

  auto steps_of = [](const std::vector<Key>& keys) {
    std::vector<int64_t> steps;
    for (const Key& k : keys) steps.push_back(k.first);
    std::sort(steps.begin(), steps.end());
    steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
    if (steps.size() > 5) steps.erase(steps.begin(), steps.end() - 5);
    std::string out = "[";
    for (size_t i = 0; i < steps.size(); ++i) out += (i ? ", " : "") + std::to_string(steps[i]);
    return out + "]";
  };
  auto keys_of = [](const PerRank& pr) {
    std::vector<Key> v;
    for (const auto& [k, _] : pr.keys) v.push_back(k);
    return v;
  };
  // The (step, run)s every rank holds, ignoring opts' step bounds; when there
  // is none, the first rank that breaks it says why.
  std::vector<Key> common = keys_of(ranks[0]);
  for (int r = 0; r < world; ++r) {
    const PerRank& pr = ranks[r];
    const std::string name = Where(prefix + JobDirNames::Slot(r));
    if (pr.keys.empty()) {
      std::string why = name + " holds no committed checkpoint (";
      if (!pr.damage.empty()) {
        why += "damaged: " + pr.damage + ")";
      } else if (!pr.problems.empty()) {
        why += "unreadable: " + pr.problems.front() + ")";
      } else {
        why += "it holds none)";
      }
      const bool damaged = !pr.damage.empty() || !pr.problems.empty();
      return fail(damaged ? StatusCode::kCorruption : StatusCode::kNotFound, why);
    }
    if (r == 0) continue;
    std::vector<Key> both;
    for (const Key& k : common) {
      if (pr.keys.count(k)) both.push_back(k);
    }
    if (both.empty()) {
      bool same_run = false;
      for (const auto& [k, _] : pr.keys) {
        for (const Key& c : common) same_run = same_run || c.second == k.second;
      }
      const std::vector<Key> mine = keys_of(pr);
      if (!same_run) {
        return fail(StatusCode::kFailedPrecondition,
                    name + " is from another job (none of its checkpoints is of the run of " +
                        JobDirNames::Slot(0) + "'s; its steps " + steps_of(mine) + ")");
      }
      return fail(saw_damage ? StatusCode::kCorruption : StatusCode::kNotFound,
                  name + " holds committed steps " + steps_of(mine) +
                      ", none of them of one run committed on every lower rank file (steps " +
                      steps_of(common) + ")");
    }
    common = std::move(both);
  }
  // Newest step first; within a step, the run of rank 0's newest checkpoint first.
  auto newest_of = [&](const Key& k) {
    const auto& [s, i] = ranks[0].keys.at(k).front();
    return ranks[0].sources[s].report.checkpoints[i].info.counter;
  };
  std::stable_sort(common.begin(), common.end(), [&](const Key& a, const Key& b) {
    return a.first != b.first ? a.first > b.first : newest_of(a) > newest_of(b);
  });
  std::vector<Key> tried;
  for (const Key& k : common) {
    if ((!opts.step || k.first == *opts.step) && (!opts.max_step || k.first <= *opts.max_step)) {
      tried.push_back(k);
    }
  }
  CommonSelection out;
  for (const Key& key : tried) {
    std::vector<std::pair<size_t, size_t>> picks(world);
    std::string why;
    for (int r = 0; r < world && why.empty(); ++r) {
      PerRank& pr = ranks[r];
      // This rank's copies of the key (slot file, keep copies), planned:
      // the newest that verifies.
      const std::vector<std::pair<size_t, size_t>>& copies = pr.keys[key];
      std::vector<PlanCandidate> cands;
      for (size_t h = 0; h < copies.size(); ++h) {
        const Source& src = pr.sources[copies[h].first];
        const CheckpointInfo& info = src.report.checkpoints[copies[h].second].info;
        PlanCandidate pc;
        pc.tier = src.loc.keep ? Tier::kKeep : Tier::kDisk;
        pc.where = src.loc.where;
        pc.step = info.step;
        pc.counter = info.counter;
        pc.handle = h;
        cands.push_back(std::move(pc));
      }
      PlanRequest req;
      req.step = key.first;
      req.exclude = opts.exclude;
      req.verify = opts.verify_data;
      NONSTOP_ASSIGN_OR_RETURN(
          Plan plan, MakePlan(cands, pr.lineage, req, [&](const PlanCandidate& c) -> Status {
            const auto& [s, i] = copies[c.handle];
            Status st = VerifyData(*pr.sources[s].file, pr.sources[s].report.checkpoints[i].info);
            if (st.ok() || st.code() == StatusCode::kCorruption) return st;
            return st.Annotate(Where(pr.sources[s].loc.where));
          }));
      if (plan.chosen()) {
        picks[r] = copies[cands[*plan.chosen()].handle];
      } else {
        std::string reasons;
        for (const auto& l : plan.skipped) reasons += (reasons.empty() ? "" : "; ") + l;
        why = "rank " + std::to_string(r) + ": " + reasons;
      }
    }
    if (!why.empty()) {
      out.skipped.push_back("step " + std::to_string(key.first) +
                            (key.second ? " of run " + std::to_string(key.second) : "") + ": " +
                            why);
      continue;
    }
    out.step = key.first;
    out.run_id = key.second;
    for (int r = 0; r < world; ++r) {
      Source& src = ranks[r].sources[picks[r].first];
      Selected sel;
      sel.info = src.report.checkpoints[picks[r].second].info;
      sel.location = src.loc;
      sel.newest_at_scan = src.newest_record;
      // Two picks never share a file: one per rank.
      sel.file = std::move(src.file);
      out.ranks.push_back(std::move(sel));
    }
    return std::optional<CommonSelection>(std::move(out));
  }
  if (!tried.empty()) {
    std::string why = "no committed checkpoint verifies on every rank";
    for (const auto& s : out.skipped) why += "; " + s;
    return fail(StatusCode::kCorruption, why);
  }
  // Common steps exist, none within opts' bounds.
  std::string why = std::string("no ") +
                    (opts.step ? "checkpoint of step " + std::to_string(*opts.step)
                               : "checkpoint at step " + std::to_string(*opts.max_step) +
                                     " or older") +
                    " is committed on every rank (steps " + steps_of(common) + " are)";
  for (int r = 0; r < world; ++r) {
    if (!ranks[r].damage.empty()) why += "; rank " + std::to_string(r) + ": " + ranks[r].damage;
    for (const auto& p : ranks[r].problems) why += "; rank " + std::to_string(r) + ": " + p;
  }
  return fail(saw_damage ? StatusCode::kCorruption : StatusCode::kNotFound, why);
}

Result<CommonSelection> JobDir::SelectCommon(int world_size, const SelectOptions& opts,
                                             std::optional<int> set_aside_world) {
  if (world_size < 1 || world_size > 99999) {
    return Status::InvalidArgument("SelectCommon: bad world size " + std::to_string(world_size));
  }
  Directory* d = impl_->dir.get();
  std::unique_ptr<Directory> sub;
  std::string prefix;
  if (set_aside_world) {
    const std::string name = JobDirNames::World(*set_aside_world);
    Result<std::unique_ptr<Directory>> opened = impl_->dir->OpenDir(name, false);
    if (!opened.ok()) {
      if (IsNotFound(opened.status())) {
        return Status::NotFound("no checkpoint of world size " + std::to_string(*set_aside_world) +
                                " is set aside in " + impl_->path + " (" + impl_->Where(name) +
                                " does not exist)");
      }
      return opened.status();
    }
    sub = std::move(opened).value();
    d = sub.get();
    prefix = name + "/";
  }
  const std::string head = "no checkpoint committed on every rank of " +
                           (prefix.empty() ? impl_->path : impl_->Where(prefix.substr(0, prefix.size() - 1))) +
                           " (world size " + std::to_string(world_size) + ")";
  NONSTOP_ASSIGN_OR_RETURN(std::optional<CommonSelection> cs,
                           impl_->SelectCommonIn(d, prefix, world_size, opts, head, false));
  if (!cs) return Status::NotFound(head + ": no rank file holds a checkpoint");
  return std::move(*cs);
}

Result<std::optional<ReshardSelection>> JobDir::SelectReshard(int world_size,
                                                              const SelectOptions& opts) {
  if (world_size < 1 || world_size > 99999) {
    return Status::InvalidArgument("SelectReshard: bad world size " + std::to_string(world_size));
  }
  NONSTOP_ASSIGN_OR_RETURN(std::vector<int> worlds, SetAsideWorlds());
  std::set<int> only_extra;
  for (const SelectOptions::ExtraFile& e : opts.extra) {
    if (e.world < 1 || e.world > 99999 || e.rank < 0 || e.rank >= e.world) {
      return Status::InvalidArgument("SelectReshard: extra file of rank " +
                                     std::to_string(e.rank) + " of world size " +
                                     std::to_string(e.world));
    }
    if (std::find(worlds.begin(), worlds.end(), e.world) == worlds.end()) {
      only_extra.insert(e.world);
    }
  }
  worlds.insert(worlds.end(), only_extra.begin(), only_extra.end());
  std::sort(worlds.begin(), worlds.end());
  std::optional<ReshardSelection> best;
  std::optional<Status> first_error;
  for (int w : worlds) {
    const std::string name = JobDirNames::World(w);
    Result<std::unique_ptr<Directory>> d = impl_->dir->OpenDir(name, false);
    if (!d.ok() && IsNotFound(d.status()) && only_extra.count(w) != 0) {
      d = std::unique_ptr<Directory>();  // this world's files are all outside the job directory
    } else if (!d.ok()) {
      if (IsNotFound(d.status())) continue;  // removed since it was listed
      if (!IsDamage(d.status())) return d.status();
      if (!first_error) first_error = d.status().Annotate(impl_->Where(name));
      continue;
    }
    const std::string head = "cannot reshard the checkpoint of world size " + std::to_string(w) +
                             " in " + impl_->Where(name) + " to world size " +
                             std::to_string(world_size);
    Result<std::optional<CommonSelection>> cs =
        impl_->SelectCommonIn(d.value().get(), name + "/", w, opts, head, true);
    if (!cs.ok()) {
      const StatusCode c = cs.status().code();
      if (c != StatusCode::kCorruption && c != StatusCode::kFailedPrecondition &&
          c != StatusCode::kNotFound) {
        return cs.status();  // an I/O error is never taken for an unusable world
      }
      if (!first_error) first_error = cs.status();
      continue;
    }
    if (!cs.value()) continue;  // nothing was ever committed there
    if (!best || cs.value()->step > best->common.step) {
      best = ReshardSelection{w, name, std::move(*cs.value())};
    }
  }
  if (best) return best;
  if (first_error) return *first_error;
  return std::optional<ReshardSelection>();
}

Result<std::vector<ListedCheckpoint>> JobDir::List(int rank) {
  NONSTOP_ASSIGN_OR_RETURN(LineageRecord lineage, impl_->LineageIn(*impl_->dir, "", rank));
  std::vector<Source> sources;
  std::vector<std::string> problems;
  NONSTOP_RETURN_IF_ERROR(impl_->Sources(*impl_->dir, "", rank, true, false, &sources, &problems));
  std::vector<ListedCheckpoint> out;
  std::vector<std::pair<size_t, size_t>> at;
  const std::vector<PlanCandidate> cands = Candidates(sources, &at);
  for (const PlanCandidate& pc : cands) {
    const Source& s = sources[at[pc.handle].first];
    const ScannedCheckpoint& c = s.report.checkpoints[at[pc.handle].second];
    ListedCheckpoint l;
    l.counter = c.info.counter;
    l.step = c.info.step;
    l.location = s.loc;
    const CandidateState st = Classify(pc, lineage);
    switch (st.state) {
      case CandidateState::State::kCommitted: l.state = ListedCheckpoint::State::kCommitted; break;
      case CandidateState::State::kAbandoned: l.state = ListedCheckpoint::State::kAbandoned; break;
      case CandidateState::State::kDamaged:
      case CandidateState::State::kOverwritten:
        l.state = ListedCheckpoint::State::kDamaged;
        l.rotated = st.state == CandidateState::State::kOverwritten;
        break;
    }
    l.reason = st.reason;
    if (c.state == CheckpointState::kCommitted) {
      l.commit_unix_ns = c.info.commit_unix_ns;
      l.data_bytes = c.info.data_bytes;
      l.metrics = CheckpointMetrics(c.info.meta_json);
    }
    out.push_back(std::move(l));
  }
  // A file that cannot be read (zeroed, a directory, cut short) is listed
  // as damage, never hidden as "no checkpoint".
  for (const std::string& p : problems) {
    ListedCheckpoint l;
    l.state = ListedCheckpoint::State::kDamaged;
    l.step = -1;
    l.location.where = JobDirNames::Slot(rank);
    l.reason = p;
    out.push_back(std::move(l));
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const auto& a, const auto& b) { return a.counter > b.counter; });
  return out;
}

// ---------------------------------------------------------------- lineage

namespace {

// Adds the abandoned range [lo, hi] to `rec`, merging it with its
// neighbours. FailedPrecondition when the record would hold too many ranges.
Status AddAbandoned(LineageRecord* rec, uint64_t lo, uint64_t hi, const std::string& where) {
  rec->abandoned.emplace_back(lo, hi);
  std::sort(rec->abandoned.begin(), rec->abandoned.end());
  std::vector<std::pair<uint64_t, uint64_t>> merged;
  for (const auto& r : rec->abandoned) {
    if (!merged.empty() && r.first <= merged.back().second + 1) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  if (merged.size() > kMaxAbandonedRanges) {
    return Status::FailedPrecondition(where + " holds " + std::to_string(kMaxAbandonedRanges) +
                                      " abandoned ranges already: use a new directory");
  }
  rec->abandoned = std::move(merged);
  rec->abandoned_through = rec->abandoned.back().second;
  return Status::OK();
}

}  // namespace

Status JobDir::RecordRestore(int rank, uint64_t counter, uint64_t newest_elsewhere) {
  NONSTOP_RETURN_IF_ERROR(impl_->CheckWriter("recording a restore", rank));
  if (counter == 0) return Status::InvalidArgument("RecordRestore: counter 0 is no checkpoint");
  MutexLock l(&impl_->mu);
  NONSTOP_ASSIGN_OR_RETURN(LineageRecord rec, impl_->LineageIn(*impl_->dir, "", rank));
  PlanCandidate asked;
  asked.counter = counter;
  if (Classify(asked, rec).state == CandidateState::State::kAbandoned) {
    return Status::InvalidArgument("checkpoint #" + std::to_string(counter) + " of " +
                                   impl_->path + " was abandoned by an earlier restore");
  }
  NONSTOP_ASSIGN_OR_RETURN(uint64_t newest, impl_->NewestCounter(rank));
  newest = std::max(newest, newest_elsewhere);
  if (newest > counter) {
    NONSTOP_RETURN_IF_ERROR(
        AddAbandoned(&rec, counter + 1, newest, impl_->Where(JobDirNames::Lineage(rank))));
  }
  rec.restored_counter = counter;
  return impl_->WriteLineageLocked(rank, rec)
      .Annotate("recording the restore of checkpoint #" + std::to_string(counter) + " in " +
                impl_->path);
}

Status JobDir::RecordNotDurable(int rank, uint64_t counter) {
  NONSTOP_RETURN_IF_ERROR(impl_->CheckWriter("recording a failed commit", rank));
  if (counter == 0) return Status::InvalidArgument("RecordNotDurable: counter 0 is no checkpoint");
  MutexLock l(&impl_->mu);
  NONSTOP_ASSIGN_OR_RETURN(LineageRecord rec, impl_->LineageIn(*impl_->dir, "", rank));
  if (std::find(rec.not_durable.begin(), rec.not_durable.end(), counter) != rec.not_durable.end()) {
    return Status::OK();
  }
  const std::string where = impl_->Where(JobDirNames::Lineage(rank));
  NONSTOP_RETURN_IF_ERROR(AddAbandoned(&rec, counter, counter, where));
  rec.not_durable.push_back(counter);
  std::sort(rec.not_durable.begin(), rec.not_durable.end());
  // Only the reason text needs the list: the abandoned range is what every
  // selection skips, so the oldest notes may go.
  if (rec.not_durable.size() > kMaxNotDurable) {
    rec.not_durable.erase(rec.not_durable.begin(),
                          rec.not_durable.end() - static_cast<ptrdiff_t>(kMaxNotDurable));
  }
  return impl_->WriteLineageLocked(rank, rec)
      .Annotate("recording in " + where + " that checkpoint #" + std::to_string(counter) +
                " never became durable (its commit's sync failed)");
}

Result<LineageRecord> JobDir::ReadLineage(int rank) {
  return impl_->LineageIn(*impl_->dir, "", rank);
}

Result<uint64_t> JobDir::NextCounter(int rank) {
  NONSTOP_ASSIGN_OR_RETURN(LineageRecord rec, impl_->LineageIn(*impl_->dir, "", rank));
  NONSTOP_ASSIGN_OR_RETURN(uint64_t newest, impl_->NewestCounter(rank));
  return std::max(newest, rec.abandoned_through) + 1;
}

Result<std::optional<uint64_t>> JobDir::ProtectedCounter(int rank) {
  NONSTOP_ASSIGN_OR_RETURN(LineageRecord rec, impl_->LineageIn(*impl_->dir, "", rank));
  if (rec.restored_counter == 0) return std::optional<uint64_t>();
  const uint64_t above = std::max(rec.restored_counter, rec.abandoned_through);
  Result<Source> src = impl_->OpenSource(*impl_->dir, JobDirNames::Slot(rank),
                                         CheckpointLocation{JobDirNames::Slot(rank), false});
  if (!src.ok() && !IsNotFound(src.status())) return src.status();
  if (src.ok()) {
    for (const ScannedCheckpoint& c : src.value().report.checkpoints) {
      if (c.state == CheckpointState::kCommitted && c.info.counter > above) {
        return std::optional<uint64_t>();
      }
    }
  }
  return std::optional<uint64_t>(rec.restored_counter);
}

// ---------------------------------------------------------------- keep copies

Status JobDir::Keep(SlotFile& src, const CheckpointInfo& info) {
  NONSTOP_RETURN_IF_ERROR(impl_->CheckWriter("keeping a checkpoint", impl_->rank));
  MutexLock l(&impl_->mu);
  return impl_->KeepLocked(src, info);
}

Status JobDir::Impl::WriteLineageLocked(int r, const LineageRecord& rec) {
  return WriteFileAtomic(*dir, JobDirNames::Lineage(r), EncodeLineage(rec, r));
}

Status JobDir::Impl::KeepLocked(SlotFile& src, const CheckpointInfo& info) {
  if (static_cast<int>(info.rank) != rank) {
    return Status::InvalidArgument("Keep: checkpoint #" + std::to_string(info.counter) +
                                   " is of rank " + std::to_string(info.rank) + ", this writer of " +
                                   path + " is rank " + std::to_string(rank));
  }
  const std::string step_name = JobDirNames::KeepStep(info.step);
  const std::string rel = JobDirNames::KeepRoot() + "/" + step_name;
  const std::string final_name = JobDirNames::Slot(rank), tmp = JobDirNames::TempSlot(rank);
  auto ctx = [&](const Status& s) {
    return s.Annotate("keeping step " + std::to_string(info.step) + " in " + Where(rel));
  };
  Result<std::unique_ptr<Directory>> kd = dir->OpenDir(JobDirNames::KeepRoot(), true);
  if (!kd.ok()) return ctx(kd.status());
  Result<std::unique_ptr<Directory>> sdr = kd.value()->OpenDir(step_name, true);
  if (!sdr.ok()) return ctx(sdr.status());
  Directory& sd = *sdr.value();
  // Already there (a copy of this very checkpoint)?
  Result<Source> have = OpenSource(sd, final_name, CheckpointLocation{rel + "/" + final_name, true});
  if (have.ok()) {
    for (const ScannedCheckpoint& c : have.value().report.checkpoints) {
      if (c.state == CheckpointState::kCommitted && c.info.counter == info.counter) {
        return Status::OK();
      }
    }
  }
  Status s = sd.Unlink(tmp);
  if (!s.ok() && !IsNotFound(s)) return ctx(s);
  Result<std::unique_ptr<Medium>> m = sd.CreateFile(tmp, MediumKind::kBuffered, MediumOptions{});
  if (!m.ok()) return ctx(m.status());
  s = CopyCheckpoint(src, info, std::move(m).value());
  if (s.ok()) s = sd.Rename(tmp, final_name);
  if (s.ok()) s = sd.SyncDir();
  if (!s.ok()) {
    (void)sd.Unlink(tmp);  // best effort; the next writer's open removes it too
    return ctx(s);
  }
  return Status::OK();
}

// ---------------------------------------------------------------- set-aside

Result<bool> JobDir::NeedsSetAside(int world_size) {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, impl_->dir->List());
  for (const DirEntry& e : entries) {
    std::optional<int> r = JobDirNames::ParseSlot(e.name);
    // Only a readable file of another world size counts: an unreadable one
    // (damaged, being created) is not ours to move (SetAside skips it too).
    if (!r || e.type != EntryType::kFile) continue;
    MediumOptions mo;
    mo.read_only = true;
    Result<std::unique_ptr<Medium>> m = impl_->dir->OpenFile(e.name, MediumKind::kBuffered, mo);
    if (!m.ok()) {
      if (IsNotFound(m.status()) || IsDamage(m.status())) continue;
      return m.status();
    }
    Result<std::unique_ptr<SlotFile>> sf = SlotFile::Open(std::move(m).value());
    if (!sf.ok()) {
      if (IsDamage(sf.status())) continue;  // unreadable: not ours to move
      return sf.status();
    }
    if (static_cast<int>(sf.value()->geometry().world_size) != world_size) return true;
  }
  return false;
}

namespace {

// Moves file `name` of `from` to `target` in `to` so that a durable entry
// holds its bytes at every instant, whatever a crash keeps of either
// directory's pending entries: a copy under a temp name in `to`, synced,
// renamed and made durable there; only then the source is unlinked. A crash
// in between leaves both (the next SetAside moves the source again).
Status MoveDurably(Directory& from, const std::string& name, Directory& to,
                   const std::string& target) {
  MediumOptions ro;
  ro.read_only = true;
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> src, from.OpenFile(name, MediumKind::kBuffered, ro));
  const std::string tmp = target + ".tmp";
  Status s = to.Unlink(tmp);
  if (!s.ok() && !IsNotFound(s)) return s;
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> dst,
                           to.CreateFile(tmp, MediumKind::kBuffered, MediumOptions{}));
  const uint64_t size = src->Size();
  NONSTOP_RETURN_IF_ERROR(dst->Resize(size));
  std::vector<uint8_t> buf(static_cast<size_t>(std::min<uint64_t>(size, 8 << 20)));
  for (uint64_t off = 0; off < size; off += buf.size()) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), size - off));
    NONSTOP_RETURN_IF_ERROR(src->Read(off, buf.data(), n));
    NONSTOP_RETURN_IF_ERROR(dst->Write(off, buf.data(), n));
  }
  NONSTOP_RETURN_IF_ERROR(dst->Sync());
  dst.reset();
  src.reset();
  NONSTOP_RETURN_IF_ERROR(to.Rename(tmp, target));
  NONSTOP_RETURN_IF_ERROR(to.SyncDir());
  s = from.Unlink(name);
  return IsNotFound(s) ? Status::OK() : s;
}

}  // namespace

Result<std::vector<int>> JobDir::SetAside(int world_size) {
  NONSTOP_RETURN_IF_ERROR(impl_->CheckWriter("setting rank files aside", impl_->rank));
  MutexLock l(&impl_->mu);
  Directory& top = *impl_->dir;
  NONSTOP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, top.List());
  std::map<int, std::unique_ptr<Directory>> dests;
  for (const DirEntry& e : entries) {
    std::optional<int> r = JobDirNames::ParseSlot(e.name);
    if (!r || e.type != EntryType::kFile) continue;
    int w = 0;
    bool committed = false;
    {
      MediumOptions mo;
      mo.read_only = true;
      Result<std::unique_ptr<Medium>> m = top.OpenFile(e.name, MediumKind::kBuffered, mo);
      if (!m.ok()) {
        if (IsNotFound(m.status()) || IsDamage(m.status())) continue;
        return m.status();
      }
      Result<std::unique_ptr<SlotFile>> sf = SlotFile::Open(std::move(m).value());
      if (!sf.ok()) {
        if (IsDamage(sf.status())) continue;  // unreadable (damaged, being created): not ours
        return sf.status();
      }
      w = static_cast<int>(sf.value()->geometry().world_size);
      if (w == world_size) continue;
      ScanOptions so;
      so.verify_data = false;
      Result<ScanReport> rep = sf.value()->Scan(so);
      if (!rep.ok() && !IsDamage(rep.status())) return rep.status();
      committed = rep.ok() && std::any_of(rep.value().checkpoints.begin(),
                                            rep.value().checkpoints.end(), [](const auto& c) {
                                              return c.state == CheckpointState::kCommitted;
                                            });
    }
    auto& dest = dests[w];
    if (!dest) {
      Result<std::unique_ptr<Directory>> d = top.OpenDir(JobDirNames::World(w), true);
      if (!d.ok()) return d.status().Annotate("setting " + impl_->Where(e.name) + " aside");
      dest = std::move(d).value();
    }
    std::string target = e.name;
    Result<FileStat> there = dest->Stat(target);
    if (there.ok()) {
      // An older set-aside of world size W: the file here supersedes it
      // unless it holds no committed checkpoint (then it is kept apart).
      if (!committed) {
        target += ".uncommitted";
      } else {
        NONSTOP_RETURN_IF_ERROR(dest->Rename(target, target + ".prev"));
        NONSTOP_RETURN_IF_ERROR(dest->SyncDir());
      }
    } else if (!IsNotFound(there.status())) {
      return there.status();
    }
    // The rank file first, then its records: a lineage record must never be
    // apart from the file whose counters it abandons (a stranded one in the
    // top directory is harmless: NextCounter numbers new checkpoints above it).
    NONSTOP_RETURN_IF_ERROR(
        MoveDurably(top, e.name, *dest, target).Annotate("setting " + impl_->Where(e.name) + " aside"));
    // The job manifest goes along: its counters are the set-aside file's.
    for (const std::string& rec :
         {JobDirNames::Agreed(*r), JobDirNames::Lineage(*r), JobDirNames::Manifest(*r)}) {
      Result<std::string> text = ReadSmallFile(top, rec, kMaxRecordBytes);
      if (!text.ok()) {
        if (IsNotFound(text.status())) continue;
        return text.status();
      }
      NONSTOP_RETURN_IF_ERROR(WriteFileAtomic(*dest, rec, text.value()));
      Status s = top.Unlink(rec);
      if (!s.ok() && !IsNotFound(s)) return s;
    }
  }
  std::vector<int> moved;
  for (auto& [w, d] : dests) moved.push_back(w);
  if (!moved.empty()) NONSTOP_RETURN_IF_ERROR(top.SyncDir());
  return moved;
}

Result<std::vector<int>> JobDir::SetAsideWorlds() {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, impl_->dir->List());
  std::vector<int> out;
  for (const DirEntry& e : entries) {
    std::optional<int> w = JobDirNames::ParseWorld(e.name);
    if (w && e.type == EntryType::kDirectory) out.push_back(*w);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// ---------------------------------------------------------------- agreed records

Status JobDir::WriteAgreed(const AgreedRecord& rec) {
  NONSTOP_RETURN_IF_ERROR(impl_->CheckWriter("writing an agreed record", rec.rank));
  if (!rec.resharded_from.empty()) NONSTOP_RETURN_IF_ERROR(CheckEntryName(rec.resharded_from));
  return WriteFileAtomic(*impl_->dir, JobDirNames::Agreed(rec.rank), EncodeAgreed(rec));
}

Result<std::optional<AgreedRecord>> JobDir::ReadAgreed(int rank) {
  const std::string name = JobDirNames::Agreed(rank);
  Result<std::string> text = ReadSmallFile(*impl_->dir, name, kMaxAgreedBytes);
  if (!text.ok()) {
    if (IsNotFound(text.status())) return std::optional<AgreedRecord>();
    return text.status().Annotate(impl_->Where(name));
  }
  NONSTOP_ASSIGN_OR_RETURN(AgreedRecord rec, DecodeAgreed(text.value(), impl_->Where(name)));
  return std::optional<AgreedRecord>(std::move(rec));
}

// ---------------------------------------------------------------- retention
// Kept copies: which are made and deleted (retention.cc holds the rules).

namespace {

// A kept copy being deleted is renamed to this prefix + its name first.
constexpr std::string_view kDeletingPrefix = ".deleting-";

// Removes subdirectory `name` of `parent` with the files in it (a kept copy
// holds files only), then makes the removal durable.
Status RemoveTree(Directory& parent, const std::string& name) {
  Result<std::unique_ptr<Directory>> d = parent.OpenDir(name, false);
  if (!d.ok()) return IsNotFound(d.status()) ? Status::OK() : d.status();
  NONSTOP_ASSIGN_OR_RETURN(std::vector<DirEntry> files, d.value()->List());
  for (const DirEntry& f : files) {
    if (f.type == EntryType::kDirectory) {
      return Status::FailedPrecondition(d.value()->path() + "/" + f.name +
                                        " is a directory: nonstop did not make it, and leaves it");
    }
    Status s = d.value()->Unlink(f.name);
    if (!s.ok() && !IsNotFound(s)) return s;
  }
  d.value().reset();
  Status s = parent.RemoveDir(name);
  if (!s.ok() && !IsNotFound(s)) return s;
  return parent.SyncDir();
}

std::string StepList(const std::vector<int64_t>& steps) {
  if (steps.empty()) return "none";
  std::string out;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (i == 20) return out + ", ... (" + std::to_string(steps.size()) + " in all)";
    out += (i ? ", " : "") + std::to_string(steps[i]);
  }
  return out;
}

}  // namespace

Status JobDir::Impl::RemoveDeletingLeftovers(Directory& keep) {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, keep.List());
  for (const DirEntry& e : entries) {
    if (e.type != EntryType::kDirectory || e.name.rfind(kDeletingPrefix, 0) != 0) continue;
    NONSTOP_RETURN_IF_ERROR(RemoveTree(keep, e.name).Annotate("removing " + Where(JobDirNames::KeepRoot() + "/" + e.name)));
  }
  return Status::OK();
}

Result<std::vector<KeptCopy>> JobDir::Impl::KeptCopiesLocked(int r, const std::string& metric) {
  NONSTOP_ASSIGN_OR_RETURN(LineageRecord lineage, LineageIn(*dir, "", r));
  std::vector<Source> sources;
  std::vector<std::string> problems;
  NONSTOP_RETURN_IF_ERROR(Sources(*dir, "", r, true, false, &sources, &problems));
  std::vector<KeptCopy> out;
  for (const Source& s : sources) {
    if (!s.loc.keep) continue;
    for (const ScannedCheckpoint& c : s.report.checkpoints) {
      if (!Live(c, lineage)) continue;
      KeptCopy k;
      k.step = c.info.step;
      k.counter = c.info.counter;
      if (!metric.empty()) k.metric = CheckpointMetric(c.info.meta_json, metric);
      out.push_back(std::move(k));
      break;  // one checkpoint per kept copy
    }
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const KeptCopy& a, const KeptCopy& b) { return a.step > b.step; });
  return out;
}

// Counters of `copies` that may not be deleted: at or above the newest
// committed counter of r's slot file (the copy may be the newest committed
// checkpoint there is), and the one a restore protects.
Result<std::vector<uint64_t>> JobDir::Impl::UndeletableCounters(int r,
                                                                const std::vector<KeptCopy>& copies) {
  NONSTOP_ASSIGN_OR_RETURN(LineageRecord lineage, LineageIn(*dir, "", r));
  uint64_t ring_newest = 0, ring_above_restore = 0;
  const uint64_t above = std::max(lineage.restored_counter, lineage.abandoned_through);
  Result<Source> src = OpenSource(*dir, JobDirNames::Slot(r), CheckpointLocation{JobDirNames::Slot(r), false});
  if (!src.ok() && !IsNotFound(src.status()) && !IsDamage(src.status())) return src.status();
  if (src.ok()) {
    for (const ScannedCheckpoint& c : src.value().report.checkpoints) {
      if (Live(c, lineage)) {
        ring_newest = std::max(ring_newest, c.info.counter);
        if (c.info.counter > above) ring_above_restore = c.info.counter;
      }
    }
  }
  std::vector<uint64_t> out;
  for (const KeptCopy& k : copies) {
    // The restored one stays protected until a newer one of its lineage commits.
    const bool restored = lineage.restored_counter != 0 && k.counter == lineage.restored_counter &&
                          ring_above_restore == 0;
    if (k.counter >= ring_newest || restored) out.push_back(k.counter);
  }
  return out;
}

Status JobDir::Impl::DeleteKeptLocked(int64_t step) {
  const std::string name = JobDirNames::KeepStep(step);
  const std::string rel = JobDirNames::KeepRoot() + "/" + name;
  NONSTOP_ASSIGN_OR_RETURN(std::vector<KeptCopy> copies, KeptCopiesLocked(rank, ""));
  std::vector<int64_t> steps;
  for (const KeptCopy& k : copies) steps.push_back(k.step);
  std::sort(steps.begin(), steps.end());
  Result<std::unique_ptr<Directory>> kd = dir->OpenDir(JobDirNames::KeepRoot(), false);
  Result<FileStat> st = kd.ok() ? kd.value()->Stat(name) : Result<FileStat>(kd.status());
  if (!st.ok() || st.value().type != EntryType::kDirectory) {
    if (!st.ok() && !IsNotFound(st.status())) return st.status().Annotate(Where(rel));
    return Status::NotFound("no kept copy of step " + std::to_string(step) + " in " + path +
                            " (kept steps: " + StepList(steps) + ")");
  }
  NONSTOP_ASSIGN_OR_RETURN(std::vector<uint64_t> undeletable, UndeletableCounters(rank, copies));
  for (const KeptCopy& k : copies) {
    if (k.step != step) continue;
    if (std::find(undeletable.begin(), undeletable.end(), k.counter) != undeletable.end()) {
      return Status::FailedPrecondition(
          "the kept copy of step " + std::to_string(step) + " in " + path +
          " is not deleted: it may be the newest committed checkpoint, or the one a restore "
          "protects (nonstop never deletes those)");
    }
  }
  Directory& keep = *kd.value();
  const std::string doomed = std::string(kDeletingPrefix) + name;
  NONSTOP_RETURN_IF_ERROR(RemoveTree(keep, doomed).Annotate("removing " + Where(JobDirNames::KeepRoot() + "/" + doomed)));
  NONSTOP_RETURN_IF_ERROR(keep.Rename(name, doomed).Annotate("deleting " + Where(rel)));
  NONSTOP_RETURN_IF_ERROR(keep.SyncDir().Annotate("deleting " + Where(rel)));
  return RemoveTree(keep, doomed).Annotate("deleting " + Where(rel));
}

// World size > 1: this rank's file of keep/step-N/ only (one unlink, made
// durable), then the step's directory once no rank's file is left in it. A
// kill between two ranks' deletions leaves the step kept on some ranks only:
// distributed recovery never uses it (it needs the step on every rank), and
// the next start with max_to_keep/best deletes what is left (_distributed.py).
Status JobDir::Impl::DeleteKeptShareLocked(int64_t step) {
  const std::string name = JobDirNames::KeepStep(step);
  const std::string rel = JobDirNames::KeepRoot() + "/" + name;
  const std::string file = JobDirNames::Slot(rank);
  const Status missing = Status::NotFound("no kept copy of step " + std::to_string(step) +
                                          " for rank " + std::to_string(rank) + " in " + path);
  NONSTOP_ASSIGN_OR_RETURN(std::vector<KeptCopy> copies, KeptCopiesLocked(rank, ""));
  NONSTOP_ASSIGN_OR_RETURN(std::vector<uint64_t> undeletable, UndeletableCounters(rank, copies));
  for (const KeptCopy& k : copies) {
    if (k.step == step &&
        std::find(undeletable.begin(), undeletable.end(), k.counter) != undeletable.end()) {
      return Status::FailedPrecondition(
          "the kept copy of step " + std::to_string(step) + " in " + path +
          " is not deleted: it may be the newest committed checkpoint, or the one a restore "
          "protects (nonstop never deletes those)");
    }
  }
  Result<std::unique_ptr<Directory>> kd = dir->OpenDir(JobDirNames::KeepRoot(), false);
  if (!kd.ok()) return IsNotFound(kd.status()) ? missing : kd.status().Annotate(Where(rel));
  Directory& keep = *kd.value();
  {
    Result<std::unique_ptr<Directory>> sd = keep.OpenDir(name, false);
    if (!sd.ok()) return IsNotFound(sd.status()) ? missing : sd.status().Annotate(Where(rel));
    Status s = sd.value()->Unlink(file);
    if (!s.ok()) return IsNotFound(s) ? missing : s.Annotate("deleting " + Where(rel + "/" + file));
    NONSTOP_RETURN_IF_ERROR(sd.value()->SyncDir().Annotate("deleting " + Where(rel + "/" + file)));
    NONSTOP_ASSIGN_OR_RETURN(std::vector<DirEntry> left, sd.value()->List());
    if (!left.empty()) return Status::OK();  // another rank's copy is still there
  }
  Status rs = keep.RemoveDir(name);
  if (!rs.ok() && !IsNotFound(rs)) {
    // Not empty any more (another rank of a shared directory is writing its
    // copy) is fine; any other failure is reported.
    Result<std::unique_ptr<Directory>> again = keep.OpenDir(name, false);
    Result<std::vector<DirEntry>> left =
        again.ok() ? again.value()->List() : Result<std::vector<DirEntry>>(again.status());
    if (left.ok() && !left.value().empty()) return Status::OK();
    return rs.Annotate("deleting " + Where(rel));
  }
  return keep.SyncDir().Annotate("deleting " + Where(rel));
}

Status JobDir::DeleteKeptShare(int64_t step) {
  NONSTOP_RETURN_IF_ERROR(impl_->CheckWriter("deleting a kept copy", impl_->rank));
  MutexLock l(&impl_->mu);
  return impl_->DeleteKeptShareLocked(step);
}

Result<std::vector<KeptCopy>> JobDir::KeptCopies(int rank, const std::string& metric) {
  MutexLock l(&impl_->mu);
  return impl_->KeptCopiesLocked(rank, metric);
}

Status JobDir::DeleteKept(int64_t step) {
  NONSTOP_RETURN_IF_ERROR(impl_->CheckWriter("deleting a kept copy", impl_->rank));
  if (impl_->world > 1 && impl_->other_locks.empty()) {
    return Status::FailedPrecondition("deleting a kept copy of " + impl_->path +
                                      " needs every rank's lock: use it while no job runs "
                                      "(nonstop rm, nonstop.delete)");
  }
  MutexLock l(&impl_->mu);
  return impl_->DeleteKeptLocked(step);
}

Status JobDir::Retain(SlotFile& src, const CheckpointInfo& info, const RetentionPolicy& policy) {
  NONSTOP_RETURN_IF_ERROR(impl_->CheckWriter("keeping a checkpoint", impl_->rank));
  if (!policy.MakesCopies()) return Status::OK();
  const bool best = policy.best_k > 0 && !policy.best_metric.empty();
  const std::optional<double> metric =
      best ? CheckpointMetric(info.meta_json, policy.best_metric) : std::nullopt;
  const bool periodic = policy.keep_every > 0 && info.counter % policy.keep_every == 0;
  if (!periodic && !metric) return Status::OK();  // nothing to copy: no scan
  MutexLock l(&impl_->mu);
  const int r = impl_->rank;
  NONSTOP_ASSIGN_OR_RETURN(std::vector<KeptCopy> copies,
                           impl_->KeptCopiesLocked(r, best ? policy.best_metric : ""));
  if (!WantsKeepCopy(info.counter, metric, policy, copies)) return Status::OK();
  NONSTOP_RETURN_IF_ERROR(impl_->KeepLocked(src, info));
  if (!policy.Deletes()) return Status::OK();
  copies.erase(std::remove_if(copies.begin(), copies.end(),
                              [&](const KeptCopy& k) { return k.step == info.step; }),
               copies.end());
  copies.push_back(KeptCopy{info.step, info.counter, metric});
  NONSTOP_ASSIGN_OR_RETURN(std::vector<uint64_t> undeletable, impl_->UndeletableCounters(r, copies));
  for (int64_t victim : RetentionVictims(copies, policy, undeletable)) {
    // World size > 1: this rank's file only; every rank decides the same
    // (the same commits, the same agreed metrics: _checkpointer.py).
    Status s = impl_->world > 1 ? impl_->DeleteKeptShareLocked(victim)
                                : impl_->DeleteKeptLocked(victim);
    if (!s.ok()) {
      return s.Annotate("max_to_keep/best: deleting the kept copy of step " + std::to_string(victim));
    }
  }
  return Status::OK();
}

Result<std::unique_ptr<JobDir>> JobDir::OpenForMaintenance(const std::string& path, Env* env) {
  {
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<JobDir> probe, OpenForRead(path, env));
  }
  // Every rank that has a slot file or a lock file: its lock too.
  Env* e = env ? env : DefaultEnv();
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> d, e->OpenDirectory(path, false));
  NONSTOP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, d->List());
  int world = 1;
  for (const DirEntry& en : entries) {
    if (std::optional<int> r = JobDirNames::ParseSlot(en.name)) world = std::max(world, *r + 1);
    // ".nonstop.rank-RRRRR.lock": a rank whose file may be set aside or not made yet
    const std::string_view n = en.name, pre = ".nonstop.rank-", suf = ".lock";
    if (n.size() == pre.size() + 5 + suf.size() && n.substr(0, pre.size()) == pre &&
        n.substr(pre.size() + 5) == suf) {
      int r = 0;
      bool digits = true;
      for (char c : n.substr(pre.size(), 5)) {
        digits = digits && c >= '0' && c <= '9';
        r = r * 10 + (c - '0');
      }
      if (digits) world = std::max(world, r + 1);
    }
  }
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<JobDir> jd, OpenForWrite(path, 0, world, env));
  for (int r = 1; r < world; ++r) {
    Result<std::unique_ptr<FileLock>> lock = jd->impl_->dir->Lock(JobDirNames::Lock(r), HolderLine());
    if (!lock.ok()) {
      return lock.status().code() == StatusCode::kFailedPrecondition
                 ? Status::FailedPrecondition("job directory " + path + " has another writer for rank " +
                                              std::to_string(r) + ": " + lock.status().message())
                 : lock.status().Annotate("cannot lock job directory " + path);
    }
    jd->impl_->other_locks.push_back(std::move(lock).value());
  }
  return jd;
}

}  // namespace nonstop
