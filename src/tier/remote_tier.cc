#include "tier/remote_tier.h"

#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "nonstop/jobdir.h"
#include "nonstop/medium.h"
#include "nonstop/store.h"

namespace nonstop::tier {

namespace rl = nonstop::remote;

namespace {

// A name as Python's repr() writes a str (the JOB refusal quotes both names
// the way the Python front end's messages do).
std::string Quoted(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const char q = has_single && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == '\\' || c == static_cast<unsigned char>(q)) {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char buf[5];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += q;
  return out;
}

// What a fetch writes: the temp file of a one-slot copy being downloaded,
// removed again unless committed.
class FetchFile {
 public:
  FetchFile(Directory* dir, std::string name) : dir_(dir), name_(std::move(name)) {}
  ~FetchFile() {
    if (!done_) {
      medium_.reset();
      if (created_) (void)dir_->Unlink(name_);  // best effort: the next fetch removes it
    }
  }
  Status Create() {
    NONSTOP_ASSIGN_OR_RETURN(medium_, dir_->CreateFile(name_, MediumKind::kBuffered,
                                                       MediumOptions{}));
    created_ = true;
    return Status::OK();
  }
  Status Append(std::string_view b) {
    NONSTOP_RETURN_IF_ERROR(medium_->Write(offset_, b.data(), b.size()));
    offset_ += b.size();
    return Status::OK();
  }
  // fsync, rename over `dest`, directory fsync.
  Status Commit(const std::string& dest) {
    NONSTOP_RETURN_IF_ERROR(medium_->Sync());
    medium_.reset();
    NONSTOP_RETURN_IF_ERROR(dir_->Rename(name_, dest));
    done_ = true;
    return dir_->SyncDir();
  }

 private:
  Directory* dir_;
  std::string name_;
  std::unique_ptr<Medium> medium_;
  uint64_t offset_ = 0;
  bool created_ = false;
  bool done_ = false;
};

// Seconds since the epoch, for the documents' informational unix_s.
double WallNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string PartName(uint32_t rank) {
  const std::string key = rl::PartKey(0, rank);
  return key.substr(key.find('/') + 1);  // rank-RRRRR.nsck
}

}  // namespace

std::string LocalStepDir(const std::string& local_dir, int64_t step) {
  std::string out = local_dir;
  if (out.empty() || out.back() != '/') out += '/';
  return out + kLocalDir + "/" + rl::StepDir(step);
}

Result<std::optional<rl::Doc>> RemoteTier::LoadDoc(const std::string& key) {
  Result<std::string> got = t_->GetBytes(key, rl::kMaxDocBytes);
  if (!got.ok()) {
    if (got.status().code() == StatusCode::kNotFound) return std::optional<rl::Doc>();
    return got.status();
  }
  NONSTOP_ASSIGN_OR_RETURN(rl::Doc doc, rl::DecodeDoc(got.value(), t_->url() + "/" + key));
  return std::optional<rl::Doc>(std::move(doc));
}

Result<std::vector<HeldStep>> RemoteTier::List(uint32_t rank) {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<StoredObject> objects, t_->List(""));
  std::map<int64_t, HeldStep> steps;
  std::set<int64_t> marked;
  for (const StoredObject& o : objects) {
    std::optional<rl::Key> k = rl::ParseKey(o.key);
    if (!k) continue;
    HeldStep& s = steps[k->step];
    s.step = k->step;
    if (k->kind == rl::Key::Kind::kPart && k->rank == rank) s.bytes = o.size;
    if (k->kind == rl::Key::Kind::kPart) s.ranks.push_back(k->rank);
    s.objects += 1;
    s.total_bytes += o.size;
    if (k->kind == rl::Key::Kind::kMarker) marked.insert(k->step);
  }
  std::vector<HeldStep> out;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    HeldStep s = it->second;
    std::sort(s.ranks.begin(), s.ranks.end());
    if (marked.count(s.step) != 0) {
      Result<std::optional<rl::Doc>> doc = LoadDoc(rl::MarkerKey(s.step));
      if (!doc.ok() && doc.status().code() != StatusCode::kCorruption) return doc.status();
      if (!doc.ok()) {
        s.state = StepState::kDamaged;
        s.reason = doc.status().message();
      } else if (!doc.value() || doc.value()->step != s.step) {
        s.state = StepState::kDamaged;  // gone since the listing, or another step's
      } else {
        s.state = StepState::kCommitted;
        s.marker = *doc.value();
      }
    }
    if (s.state == StepState::kDamaged) {
      s.note = "its COMMITTED marker does not parse: never read";
    } else if (s.state == StepState::kUncommitted) {
      s.note = "no COMMITTED marker (an upload under way or given up)";
    } else if (rank >= s.marker->world_size) {
      s.note = "committed by " + std::to_string(s.marker->world_size) +
               " rank(s): no rank " + std::to_string(rank);
    }
    out.push_back(std::move(s));
  }
  return out;
}

Result<std::vector<std::pair<int64_t, rl::Doc>>> RemoteTier::CommittedSteps(
    std::vector<std::string>* damaged) {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<HeldStep> held, List(0));
  std::vector<std::pair<int64_t, rl::Doc>> out;
  for (HeldStep& s : held) {
    if (s.state == StepState::kCommitted) {
      out.emplace_back(s.step, std::move(*s.marker));
    } else if (s.state == StepState::kDamaged && !s.reason.empty() && damaged != nullptr) {
      damaged->push_back(s.reason);
    }
  }
  return out;
}

Result<std::string> RemoteTier::Fetch(int64_t step, uint32_t rank, const std::string& local_dir) {
  const std::string where = t_->url() + "/" + rl::StepDir(step);
  const std::string who = "rank " + std::to_string(rank) + "'s";
  Result<std::string> marker = t_->GetBytes(rl::MarkerKey(step), rl::kMaxDocBytes);
  if (!marker.ok() && marker.status().code() == StatusCode::kNotFound) {
    return Status::Corruption(where + " is not committed (no COMMITTED marker)");
  }
  if (!marker.ok()) return marker.status();
  const std::string man_key = rl::ManifestKey(step, rank);
  Result<std::string> man_text = t_->GetBytes(man_key, rl::kMaxDocBytes);
  if (!man_text.ok() && man_text.status().code() == StatusCode::kNotFound) {
    return Status::Corruption(where + ": " + who + " manifest is missing");
  }
  if (!man_text.ok()) return man_text.status();
  // both decoded, and of this step, rank and lineage
  NONSTOP_ASSIGN_OR_RETURN(rl::Doc doc, rl::DecodeDoc(marker.value(), where + "/COMMITTED"));
  NONSTOP_ASSIGN_OR_RETURN(
      rl::Manifest man,
      rl::DecodeManifest(man_text.value(), where + "/" + man_key.substr(man_key.find('/') + 1)));
  NONSTOP_RETURN_IF_ERROR(rl::CheckFetch(doc, man, step, rank, where));

  // local_dir/remote/step-N: every file in it created O_EXCL|O_NOFOLLOW relative to it
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> job, env_->OpenDirectory(local_dir, true));
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> base, job->OpenDir(kLocalDir, true));
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> dir, base->OpenDir(rl::StepDir(step), true));
  const std::string dest = PartName(rank);
  const std::string tmp = dest + ".fetch";

  std::unique_ptr<FetchFile> out;
  const uint64_t unit = man.part_bytes;
  const std::vector<uint32_t>& crcs = man.part_crc32;
  uint64_t size = 0, got = 0, fill = 0;
  size_t idx = 0;
  uLong crc = crc32_z(0L, Z_NULL, 0);
  auto on_size = [&](uint64_t n) -> Status {
    size = n;
    if (size != man.bytes) {
      return Status::Corruption(where + ": " + who + " part is " + std::to_string(size) +
                                " bytes, the manifest says " + std::to_string(man.bytes));
    }
    Status gone = dir->Unlink(tmp);  // a stale temp of a fetch that died
    if (!gone.ok() && gone.code() != StatusCode::kNotFound) return gone;
    Result<FileStat> st = dir->Stat(dest);
    if (st.ok() && st.value().type != EntryType::kFile) {
      // a link (or folder) planted there: removed as itself, never followed
      NONSTOP_RETURN_IF_ERROR(RemoveTree(*dir, dest));
    } else if (!st.ok() && st.status().code() != StatusCode::kNotFound) {
      return st.status();
    }
    out = std::make_unique<FetchFile>(dir.get(), tmp);
    return out->Create();
  };
  auto on_chunk = [&](std::string_view b) -> Status {
    if (got + b.size() > size) {
      return Status::Corruption(where + ": " + who + " part is longer than stated");
    }
    while (!b.empty()) {
      const uint64_t take = std::min<uint64_t>(b.size(), unit - fill);
      crc = crc32_z(crc, reinterpret_cast<const Bytef*>(b.data()), take);
      fill += take;
      if (fill == unit || got + take == size) {
        if (idx >= crcs.size() || crc != crcs[idx]) {
          return Status::Corruption(where + ": " + who + " part " + std::to_string(idx) +
                                    " (bytes " + std::to_string(idx * unit) +
                                    "..) crc mismatch: damaged in the store");
        }
        ++idx;
        crc = crc32_z(0L, Z_NULL, 0);
        fill = 0;
      }
      NONSTOP_RETURN_IF_ERROR(out->Append(b.substr(0, take)));
      got += take;
      b.remove_prefix(take);
    }
    return Status::OK();
  };
  Status s = t_->GetChunks(rl::PartKey(step, rank), on_size, on_chunk);
  if (s.code() == StatusCode::kNotFound && out == nullptr) {
    return Status::Corruption(where + ": " + who + " part is missing");
  }
  NONSTOP_RETURN_IF_ERROR(s);
  if (out == nullptr || got != size || idx != crcs.size()) {
    return Status::Corruption(where + ": " + who + " part ended at " + std::to_string(got) +
                              " of " + std::to_string(size) + " bytes");
  }
  NONSTOP_RETURN_IF_ERROR(out->Commit(dest));
  return LocalStepDir(local_dir, step);
}

Result<int> RemoteTier::Retain(const rl::Retention& r) {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<StoredObject> objects, t_->List(""));
  std::map<int64_t, std::vector<std::string>> by_step;
  for (const StoredObject& o : objects) {
    std::optional<rl::Key> k = rl::ParseKey(o.key);
    if (k) by_step[k->step].push_back(o.key);
  }
  std::vector<rl::StepState> steps;
  for (const auto& [step, keys] : by_step) {
    const std::string mk = rl::MarkerKey(step);
    const bool committed = std::find(keys.begin(), keys.end(), mk) != keys.end();
    std::optional<uint64_t> counter;
    bool cached = false;
    {
      MutexLock l(&mu_);
      auto it = counters_.find(step);
      if (it != counters_.end()) {
        counter = it->second;
        cached = true;
      }
    }
    if (committed && r.keep_every != 0 && !cached) {
      Result<std::optional<rl::Doc>> doc = LoadDoc(mk);
      if (!doc.ok() && doc.status().code() != StatusCode::kCorruption) return doc.status();
      if (doc.ok() && doc.value()) counter = doc.value()->counter;
      MutexLock l(&mu_);
      counters_[step] = counter;
    }
    steps.push_back({step, committed, counter});
  }
  const std::vector<int64_t> doomed = rl::StepsToDelete(steps, r);
  for (int64_t step : doomed) {
    for (const std::vector<std::string>& batch : rl::DeleteBatches(by_step[step])) {
      if (!batch.empty()) NONSTOP_RETURN_IF_ERROR(t_->Delete(batch));
    }
    MutexLock l(&mu_);
    counters_.erase(step);
  }
  return static_cast<int>(doomed.size());
}

Status RemoteTier::Claim(const std::string& job, bool adopt, double unix_s) {
  const std::string key = rl::JobKey();
  Result<std::string> data = t_->GetBytes(key, rl::kMaxDocBytes);
  if (!data.ok() && data.status().code() != StatusCode::kNotFound) return data.status();
  if (data.ok()) {
    NONSTOP_ASSIGN_OR_RETURN(std::string owner, rl::DecodeJob(data.value(), t_->url() + "/" + key));
    if (owner == job) return Status::OK();
    if (!adopt) {
      return Status::FailedPrecondition(
          "the remote " + t_->url() + " belongs to job " + Quoted(owner) + ", not to this job " +
          Quoted(job) + ": pass remote_options={'adopt': True} to take its checkpoints over, " +
          "or remote_options={'job': " + Quoted(owner) + "} if this is that job");
    }
  }
  return t_->PutBytes(key, rl::EncodeJob(job, unix_s));
}

Result<std::optional<std::string>> RemoteTier::Job() {
  const std::string key = rl::JobKey();
  Result<std::string> data = t_->GetBytes(key, rl::kMaxDocBytes);
  if (!data.ok() && data.status().code() == StatusCode::kNotFound) {
    return std::optional<std::string>();
  }
  if (!data.ok()) return data.status();
  NONSTOP_ASSIGN_OR_RETURN(std::string owner, rl::DecodeJob(data.value(), t_->url() + "/" + key));
  return std::optional<std::string>(std::move(owner));
}

Result<std::string> RemoteTier::FetchAll(int64_t step, const std::string& local_dir) {
  NONSTOP_ASSIGN_OR_RETURN(std::optional<rl::Doc> marker, LoadDoc(rl::MarkerKey(step)));
  if (!marker) {
    return Status::Corruption(t_->url() + "/" + rl::StepDir(step) +
                              " is not committed (no COMMITTED marker)");
  }
  std::string dir;
  for (uint32_t r = 0; r < marker->world_size; ++r) {
    NONSTOP_ASSIGN_OR_RETURN(dir, Fetch(step, r, local_dir));
  }
  return dir;
}

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string RankList(const std::map<uint32_t, rl::Manifest>& mans) {
  std::string out = "[";
  for (const auto& [r, m] : mans) out += (out.size() > 1 ? ", " : "") + std::to_string(r);
  return out + "]";
}

}  // namespace

void RemoteTier::Stop(double wait_s) {
  const auto at = std::chrono::steady_clock::now() +
                  std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::duration<double>(std::max(0.0, wait_s)));
  stop_ns_.store(at.time_since_epoch().count());
}

bool RemoteTier::StopPassed() const {
  return std::chrono::steady_clock::now().time_since_epoch().count() > stop_ns_.load();
}

Result<std::optional<std::pair<uint64_t, int64_t>>> RemoteTier::Follow(
    const std::string& job_dir, uint32_t rank, uint32_t world, int64_t target_step,
    std::optional<int64_t> done_step) {
  using Pick = std::optional<std::pair<uint64_t, int64_t>>;
  NONSTOP_ASSIGN_OR_RETURN(std::vector<StoredObject> objects, t_->List(""));
  std::set<int64_t> led;
  for (const StoredObject& o : objects) {
    std::optional<rl::Key> k = rl::ParseKey(o.key);
    if (k && k->kind == rl::Key::Kind::kLead && k->step <= target_step &&
        (!done_step || k->step > *done_step)) {
      led.insert(k->step);
    }
  }
  if (led.empty()) return Pick();
  // step -> (counter, lineage) of this rank's committed checkpoints, the
  // newest counter of a step
  std::map<int64_t, std::pair<uint64_t, int64_t>> mine;
  {
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> job, env_->OpenDirectory(job_dir, false));
    MediumOptions ro;
    ro.read_only = true;
    NONSTOP_ASSIGN_OR_RETURN(
        std::unique_ptr<Medium> m,
        job->OpenFile(SlotFileName(static_cast<int>(rank)), MediumKind::kBuffered, ro));
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<SlotFile> f, SlotFile::Open(std::move(m)));
    ScanOptions so;
    so.verify_data = false;
    NONSTOP_ASSIGN_OR_RETURN(ScanReport report, f->Scan(so));
    for (const auto& c : report.checkpoints) {  // newest counter first
      if (c.state != CheckpointState::kCommitted) continue;
      std::optional<uint64_t> run = CheckpointRunId(c.info.meta_json);
      if (!run) continue;
      mine.emplace(c.info.step, std::make_pair(c.info.counter, static_cast<int64_t>(*run)));
    }
  }
  // this run's lineage: that of its agreed target
  auto own = mine.find(target_step);
  const bool has_run = own != mine.end();
  const int64_t run = has_run ? own->second.second : 0;
  for (auto it = led.rbegin(); it != led.rend(); ++it) {
    const int64_t step = *it;
    {
      MutexLock l(&mu_);
      if (skipped_.count(step) != 0) continue;
    }
    Result<std::optional<rl::Doc>> lead = LoadDoc(rl::LeadKey(step));
    if (!lead.ok() && lead.status().code() != StatusCode::kCorruption) return lead.status();
    if (!lead.ok()) continue;
    const bool has_lead = lead.value().has_value();
    const int64_t lineage = has_lead ? lead.value()->lineage : 0;
    auto held = mine.find(step);
    if (has_lead && held != mine.end() && lineage == held->second.second) {
      return Pick(std::make_pair(held->second.first, step));
    }
    if (has_lead && has_run && lineage == run && held == mine.end()) {
      // Rank 0 leads a step of this run that this rank's slot ring has
      // already reused (checkpoints come faster than uploads): say so, so
      // that rank 0 gives it up now and leads a newer one.
      rl::Doc skip;
      skip.step = step;
      skip.world_size = world;
      skip.lineage = run;
      skip.rank = rank;
      NONSTOP_RETURN_IF_ERROR(t_->PutBytes(rl::SkipKey(step, rank), rl::EncodeSkip(skip, WallNow())));
      MutexLock l(&mu_);
      skipped_.insert(step);
      skipped_gone_.fetch_add(1);
    }
  }
  return Pick();  // a LEAD of an abandoned run: not followed (rank 0 gives it up in time)
}

Result<PublishReport> RemoteTier::Publish(const PublishRequest& req, const PublishOptions& o) {
  PublishReport rep;
  const int64_t step = req.step;
  // A checkpoint is its counter, not its step: after a rollback the step's
  // old marker names the abandoned checkpoint (one process: the marker's
  // counter is this rank's; distributed: the run's lineage).
  Result<std::optional<rl::Doc>> marker = LoadDoc(rl::MarkerKey(step));
  if (!marker.ok() && marker.status().code() != StatusCode::kCorruption) return marker.status();
  // a damaged marker: uploaded again, the marker rewritten
  std::optional<rl::Doc> old = marker.ok() ? marker.value() : std::nullopt;
  if (old && old->lineage == req.lineage && (req.world_size > 1 || old->counter == req.counter)) {
    rep.outcome = PublishReport::Outcome::kSkippedExisting;
    return rep;
  }
  if (old && req.world_size == 1) NONSTOP_RETURN_IF_ERROR(t_->Delete({rl::MarkerKey(step)}));
  if (req.world_size > 1 && req.rank == 0) {
    rl::Doc lead;
    lead.step = step;
    lead.world_size = req.world_size;
    lead.lineage = req.lineage;
    NONSTOP_RETURN_IF_ERROR(t_->PutBytes(rl::LeadKey(step), rl::EncodeLead(lead, WallNow())));
  }

  // the checksums of the staged copy, read through the seam (a link there is refused)
  const double t0 = Now();
  rl::Manifest man;
  man.step = step;
  man.counter = req.counter;
  man.rank = req.rank;
  man.world_size = req.world_size;
  man.lineage = req.lineage;
  {
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> dir, env_->OpenDirectory(req.dir, false));
    MediumOptions ro;
    ro.read_only = true;
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> f,
                             dir->OpenFile(req.name, MediumKind::kBuffered, ro));
    man.bytes = f->Size();
    man.part_bytes = rl::ChecksumUnit(man.bytes, t_->part_bytes());
    std::string buf(std::min<uint64_t>(man.part_bytes, std::max<uint64_t>(man.bytes, 1)), '\0');
    for (uint64_t at = 0; at < man.bytes; at += man.part_bytes) {
      const uint64_t n = std::min<uint64_t>(man.part_bytes, man.bytes - at);
      NONSTOP_RETURN_IF_ERROR(f->Read(at, buf.data(), n));
      man.part_crc32.push_back(static_cast<uint32_t>(
          crc32_z(crc32_z(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(buf.data()), n)));
    }
  }
  const double t1 = Now();
  rep.crc_s = t1 - t0;
  NONSTOP_RETURN_IF_ERROR(t_->PutFile(rl::PartKey(step, req.rank), req.dir, req.name, o.bps));
  rep.put_s = Now() - t1;
  std::string text = rl::EncodeManifest(man, WallNow());
  NONSTOP_RETURN_IF_ERROR(rl::DecodeManifest(text, "the manifest being written").status());
  NONSTOP_RETURN_IF_ERROR(t_->PutBytes(rl::ManifestKey(step, req.rank), text));
  rep.upload_s = Now() - t0;
  rep.bytes = man.bytes;
  if (req.rank != 0) return rep;

  // Rank 0: COMMITTED once every rank's manifest of this step and lineage is there.
  rl::Doc commit;
  commit.step = step;
  commit.world_size = req.world_size;
  commit.lineage = req.lineage;
  commit.counter = req.counter;
  const double start = Now();
  while (true) {
    NONSTOP_ASSIGN_OR_RETURN(std::vector<StoredObject> listed, t_->List(rl::StepDir(step)));
    std::set<std::string> keys;
    for (const StoredObject& ob : listed) keys.insert(ob.key);
    std::map<uint32_t, rl::Manifest> mans;
    bool gone = false;
    for (uint32_t r = 0; r < req.world_size; ++r) {
      const std::string key = rl::ManifestKey(step, r);
      std::optional<rl::Manifest> m;
      if (keys.count(key) != 0) {
        Result<std::string> got = t_->GetBytes(key, rl::kMaxDocBytes);
        if (!got.ok() && got.status().code() != StatusCode::kNotFound &&
            got.status().code() != StatusCode::kCorruption) {
          return got.status();
        }
        if (got.ok()) {
          Result<rl::Manifest> d = rl::DecodeManifest(got.value(), t_->url() + "/" + key);
          if (d.ok()) m = std::move(d).value();  // not a manifest of ours: as if absent
        }
      }
      if (m && m->step == step && m->lineage == req.lineage) {
        mans[r] = std::move(*m);
      } else if (r > 0 && keys.count(rl::SkipKey(step, r)) != 0) {
        Result<std::optional<rl::Doc>> sk = LoadDoc(rl::SkipKey(step, r));
        if (!sk.ok() && sk.status().code() != StatusCode::kCorruption) return sk.status();
        if (sk.ok() && sk.value() && sk.value()->step == step &&
            sk.value()->lineage == req.lineage) {
          gone = true;
        }
      }
    }
    if (gone) {  // a rank no longer holds the step: it can never commit
      rep.outcome = PublishReport::Outcome::kGivenUp;
      return rep;
    }
    std::vector<rl::Manifest> all;
    for (auto& [r, m] : mans) all.push_back(m);
    if (rl::Committed(commit, all)) {
      NONSTOP_RETURN_IF_ERROR(
          t_->PutBytes(rl::MarkerKey(step), rl::EncodeMarker(commit, all, WallNow())));
      rep.outcome = PublishReport::Outcome::kCommitted;
      return rep;
    }
    if (Now() - start > o.commit_timeout_s || StopPassed()) {
      rep.outcome = PublishReport::Outcome::kNotCommitted;
      rep.error = "step " + std::to_string(step) + ": only ranks " + RankList(mans) + " of " +
                  std::to_string(req.world_size) + " uploaded; not committed";
      return rep;
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(std::max(o.poll_s, 0.1)));
  }
}

}  // namespace nonstop::tier
