#include "tier/staging.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "jobdir/remote_layout.h"
#include "nonstop/jobdir.h"
#include "nonstop/medium.h"
#include "nonstop/store.h"
#include "tier/remote_tier.h"

namespace nonstop::tier {

namespace {

namespace rl = nonstop::remote;

// The first checkpoint of a one-slot file, read without its data.
Result<CheckpointInfo> FirstCheckpoint(Directory& dir, const std::string& name) {
  MediumOptions ro;
  ro.read_only = true;
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> m, dir.OpenFile(name, MediumKind::kBuffered, ro));
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<SlotFile> f, SlotFile::Open(std::move(m)));
  ScanOptions so;
  so.verify_data = false;
  NONSTOP_ASSIGN_OR_RETURN(ScanReport report, f->Scan(so));
  for (const auto& c : report.checkpoints) {
    if (c.state == CheckpointState::kCommitted) return c.info;
  }
  return Status::NotFound(dir.path() + "/" + name + " holds no committed checkpoint");
}

Status Ignore(Status s, StatusCode code) {
  return s.code() == code ? Status::OK() : s;
}

}  // namespace

Result<StagedCopy> StageCopy(Env* env, const std::string& job_dir, uint32_t rank, uint64_t counter,
                             int64_t step) {
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> job, env->OpenDirectory(job_dir, true));
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> base, job->OpenDir(kLocalDir, true));
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> sd, base->OpenDir(rl::StepDir(step), true));
  const std::string name = SlotFileName(static_cast<int>(rank));
  std::optional<CheckpointInfo> info;
  Result<FileStat> st = sd->Stat(name);
  if (st.ok() && st.value().type != EntryType::kFile) {
    NONSTOP_RETURN_IF_ERROR(RemoveTree(*sd, name));  // a link (or anything else): as itself
    NONSTOP_RETURN_IF_ERROR(sd->SyncDir());
  } else if (st.ok()) {  // staged before a restart, or fetched: the same checkpoint?
    Result<CheckpointInfo> got = FirstCheckpoint(*sd, name);
    if (got.ok() && got.value().counter == counter) info = std::move(got).value();
    if (!info) NONSTOP_RETURN_IF_ERROR(sd->Unlink(name));  // unreadable or another: again
  } else if (st.status().code() != StatusCode::kNotFound) {
    return st.status();
  }
  if (!info) {
    const std::string tmp = name + ".tmp";
    NONSTOP_RETURN_IF_ERROR(Ignore(sd->Unlink(tmp), StatusCode::kNotFound));
    MediumOptions ro;
    ro.read_only = true;
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> src_m,
                             job->OpenFile(name, MediumKind::kBuffered, ro));
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<SlotFile> src, SlotFile::Open(std::move(src_m)));
    ScanOptions so;
    so.verify_data = false;  // CopyCheckpoint verifies every chunk it copies
    NONSTOP_ASSIGN_OR_RETURN(ScanReport report, src->Scan(so));
    for (const auto& c : report.checkpoints) {
      if (c.state == CheckpointState::kCommitted && c.info.counter == counter) {
        info = c.info;
        break;
      }
    }
    const std::string path = job->path() + "/" + name;
    if (!info) {
      return Status::NotFound("no committed checkpoint with counter " + std::to_string(counter) +
                              " in " + path);
    }
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> out,
                             sd->CreateFile(tmp, MediumKind::kBuffered, MediumOptions{}));
    Status copied = CopyCheckpoint(*src, *info, std::move(out));
    if (!copied.ok()) {
      (void)sd->Unlink(tmp);
      return copied.Annotate("copying to " + sd->path() + "/" + tmp);
    }
    NONSTOP_RETURN_IF_ERROR(sd->Rename(tmp, name));
    NONSTOP_RETURN_IF_ERROR(sd->SyncDir());
  }
  std::optional<uint64_t> run = CheckpointRunId(info->meta_json);
  if (!run) {
    return Status::Corruption(sd->path() + "/" + name +
                              ": its metadata's dist.lineage is not an unsigned integer");
  }
  StagedCopy out;
  out.dir = LocalStepDir(job_dir, step);
  out.name = name;
  out.step = info->step;
  out.counter = info->counter;
  out.lineage = static_cast<int64_t>(*run);
  return out;
}

std::vector<std::string> DropStaged(Env* env, const std::string& job_dir, int64_t keep_step) {
  std::vector<std::string> errors;
  Result<std::unique_ptr<Directory>> job = env->OpenDirectory(job_dir, false);
  if (!job.ok()) return {job.status().message()};
  Result<std::unique_ptr<Directory>> base = job.value()->OpenDir(kLocalDir, true);
  if (!base.ok()) return {base.status().message()};
  Result<std::vector<DirEntry>> names = base.value()->List();
  if (!names.ok()) return {names.status().message()};
  for (const DirEntry& e : names.value()) {
    std::optional<rl::Key> k = e.name.find('/') == std::string::npos
                                   ? rl::ParseKey(e.name + "/COMMITTED")
                                   : std::nullopt;
    if (!k || k->step == keep_step) continue;
    Status s = RemoveTree(*base.value(), e.name);
    if (s.ok()) s = base.value()->SyncDir();
    if (!s.ok() && s.code() != StatusCode::kNotFound) {
      errors.push_back("removing staged " + e.name + ": " + s.message());
    }
  }
  return errors;
}

}  // namespace nonstop::tier
