// The memory tier; memory_tier.h says what it keeps and when recovery uses it.
#include "engine/memory_tier.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>

#include <unistd.h>

namespace nonstop {
namespace {

constexpr uint64_t kMaxRecordBytes = 4096;
constexpr char kRecordHead[] = "nonstop memory segment v1\n";

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double NowS() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string Rank5(int rank) {
  char b[16];
  std::snprintf(b, sizeof(b), "%05d", rank);
  return b;
}

// "<16 lowercase hex>-rank-RRRRR.nsck" for this rank, exactly.
bool ValidSegmentName(const std::string& name, int rank) {
  const std::string tail = "-rank-" + Rank5(rank) + ".nsck";
  if (name.size() != 16 + tail.size() || name.compare(16, std::string::npos, tail) != 0) {
    return false;
  }
  for (size_t i = 0; i < 16; ++i) {
    const char c = name[i];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// A segment name of any rank: its rank, or -1.
int SegmentRank(const std::string& name) {
  constexpr size_t kLen = 16 + 6 + 5 + 5;  // "<16 hex>-rank-RRRRR.nsck"
  if (name.size() != kLen) return -1;
  int rank = 0;
  for (size_t i = 22; i < 27; ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    rank = rank * 10 + (name[i] - '0');
  }
  return ValidSegmentName(name, rank) ? rank : -1;
}

// "<16 hex>-rank-RRRRR.lock" for segment `name`.
std::string LockName(const std::string& name) { return name.substr(0, name.size() - 5) + ".lock"; }

constexpr char kHolderHead[] = "nonstop memory tier: pid ";

// The holder line of a writer's lock: pid, a nonce (to recognise its own
// lock file by name afterwards) and its job directory's absolute path.
std::string HolderLine(const std::string& job_dir) {
  std::random_device rd;
  char b[128];
  std::snprintf(b, sizeof(b), "%s%ld nonce %08x%08x job ", kHolderHead, static_cast<long>(::getpid()),
                rd(), rd());
  std::string line = b + job_dir;
  std::replace(line.begin(), line.end(), '\n', '?');  // one line
  return line;
}

// The job directory of a holder line, or "".
std::string HolderJobDir(const std::string& line) {
  if (line.compare(0, sizeof(kHolderHead) - 1, kHolderHead) != 0) return "";
  const size_t p = line.find(" job /");
  if (p == std::string::npos) return "";
  std::string dir = line.substr(p + 5);
  while (!dir.empty() && dir.back() == '\n') dir.pop_back();
  return dir;
}

std::string NewSegmentName(int rank) {
  std::random_device rd;
  const uint64_t id = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                      static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  char b[24];
  std::snprintf(b, sizeof(b), "%016llx", static_cast<unsigned long long>(id));
  return std::string(b) + "-rank-" + Rank5(rank) + ".nsck";
}

// The segment name recorded in the job directory; NotFound when there is no
// record, Corruption when it is not one.
Result<std::string> ReadRecord(Directory& jd, int rank) {
  const std::string rec = JobDirNames::MemoryRecord(rank);
  NONSTOP_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(jd, rec, kMaxRecordBytes));
  const std::string head = kRecordHead;
  if (text.compare(0, head.size(), head) != 0 || text.back() != '\n') {
    return Status::Corruption(jd.path() + "/" + rec + " is not a memory segment record");
  }
  std::string name = text.substr(head.size(), text.size() - head.size() - 1);
  if (!ValidSegmentName(name, rank)) {
    return Status::Corruption(jd.path() + "/" + rec + " names no valid segment");
  }
  return name;
}

bool SameCheckpoint(const CheckpointInfo& a, const CheckpointInfo& b, std::string* why) {
  auto differ = [&](const char* what) {
    *why = std::string("its ") + what + " differs from the disk's checkpoint";
    return false;
  };
  if (a.counter != b.counter) {
    *why = "it holds checkpoint " + std::to_string(a.counter) + ", the disk's newest is " +
           std::to_string(b.counter);
    return false;
  }
  if (a.step != b.step) return differ("step");
  if (a.rank != b.rank || a.world_size != b.world_size) return differ("rank");
  if (a.data_bytes != b.data_bytes) return differ("data size");
  if (a.crc_chunk_bytes != b.crc_chunk_bytes || a.chunk_crcs != b.chunk_crcs) {
    return differ("data (chunk checksums)");
  }
  if (a.meta_json != b.meta_json) return differ("metadata");
  if (a.tensors.size() != b.tensors.size()) return differ("tensor table");
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const TensorEntry &x = a.tensors[i], &y = b.tensors[i];
    if (x.data_offset != y.data_offset || x.spec.name != y.spec.name ||
        x.spec.dtype != y.spec.dtype || x.spec.shape != y.spec.shape ||
        x.spec.nbytes != y.spec.nbytes) {
      return differ("tensor table");
    }
  }
  return true;
}

}  // namespace

bool ParseMemoryTierMode(std::string_view name, MemoryTierMode* out) {
  if (name == "auto") *out = MemoryTierMode::kAuto;
  else if (name == "memory") *out = MemoryTierMode::kMemory;
  else if (name == "disk") *out = MemoryTierMode::kDisk;
  else return false;
  return true;
}

const char* MemoryTierModeName(MemoryTierMode m) {
  switch (m) {
    case MemoryTierMode::kAuto: return "auto";
    case MemoryTierMode::kMemory: return "memory";
    case MemoryTierMode::kDisk: return "disk";
  }
  return "?";
}

std::string MemorySegmentDir(const std::string& configured) {
  if (!configured.empty()) return configured;
  const char* env = std::getenv("NONSTOP_SHM_DIR");
  if (env != nullptr && env[0] != '\0') return env;
  return "/dev/shm/nonstop";
}

std::unique_ptr<MemoryTierWriter> MemoryTierWriter::Open(JobDir& jd, Env* env, int rank,
                                                         MemoryTierMode mode,
                                                         const std::string& shm_dir,
                                                         double fit_factor, double share,
                                                         double orphan_after_s) {
  std::unique_ptr<MemoryTierWriter> w(new MemoryTierWriter());
  w->mode_ = mode;
  w->fit_factor_ = fit_factor;
  w->pacer_ = MirrorPacer(mode == MemoryTierMode::kAuto ? share : 1);
  w->stats_.mode = MemoryTierModeName(mode);
  if (mode == MemoryTierMode::kDisk) return w;
  if (env == nullptr) env = DefaultEnv();
  const std::string where = MemorySegmentDir(shm_dir);
  auto off = [&](const Status& s) {
    w->stats_.last_error = "memory tier off: " + s.ToString();
    w->stats_.failures = 1;
    if (mode == MemoryTierMode::kMemory) {
      std::fprintf(stderr, "nonstop: %s; checkpoints go to disk only\n", w->stats_.last_error.c_str());
    }
    w->reported_ = true;
    return std::move(w);
  };
  Result<std::unique_ptr<Directory>> d = env->OpenDirectory(where, /*create=*/true);
  if (!d.ok()) return off(d.status().Annotate("segment directory " + where));
  Result<std::string> name = ReadRecord(jd.dir(), rank);
  if (!name.ok()) {
    if (name.status().code() != StatusCode::kNotFound && name.status().code() != StatusCode::kCorruption) {
      return off(name.status());
    }
    // None yet (or a damaged one): a new private name, recorded durably
    // before any segment is written under it.
    name = NewSegmentName(rank);
    Status ws = WriteFileAtomic(jd.dir(), JobDirNames::MemoryRecord(rank),
                                std::string(kRecordHead) + name.value() + "\n");
    if (!ws.ok()) return off(ws);
  }
  // Own the name: hold its lock file, and check that the file at the lock's
  // name is the one locked (a sweeper may have removed it in between). When
  // that fails (a sweeper holds it now), a fresh name.
  std::error_code ec;
  std::string job_abs = std::filesystem::absolute(jd.dir().path(), ec).lexically_normal().string();
  if (ec) job_abs = jd.dir().path();
  while (!job_abs.empty() && job_abs.size() > 1 && job_abs.back() == '/') job_abs.pop_back();
  auto own = [&](const std::string& seg) -> Result<std::unique_ptr<FileLock>> {
    const std::string line = HolderLine(job_abs);
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<FileLock> lock, d.value()->Lock(LockName(seg), line));
    Result<std::string> back = ReadSmallFile(*d.value(), LockName(seg), kMaxRecordBytes);
    if (!back.ok() || back.value() != line + "\n") {
      return Status::FailedPrecondition(d.value()->path() + "/" + LockName(seg) +
                                        " was replaced while it was taken");
    }
    return lock;
  };
  Result<std::unique_ptr<FileLock>> lock = own(name.value());
  if (!lock.ok()) {
    name = NewSegmentName(rank);
    Status ws = WriteFileAtomic(jd.dir(), JobDirNames::MemoryRecord(rank),
                                std::string(kRecordHead) + name.value() + "\n");
    if (!ws.ok()) return off(ws);
    lock = own(name.value());
    if (!lock.ok()) return off(lock.status());
  }
  w->lock_ = std::move(lock).value();
  w->stats_.swept = SweepMemorySegments(
      *d.value(), env, name.value(), orphan_after_s,
      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count()),
      job_abs);
  w->dir_ = std::move(d).value();
  w->name_ = std::move(name).value();
  w->stats_.segment = w->dir_->path() + "/" + w->name_;
  w->thread_ = std::thread([p = w.get()] { p->Loop(); });
  return w;
}

MemoryTierWriter::~MemoryTierWriter() { Close(false); }

bool MemoryTierWriter::Submit(std::shared_ptr<SlotFile> file, const CheckpointInfo& info) {
  if (!on()) return false;
  std::shared_ptr<SlotFile> replaced_file;
  uint32_t replaced_slot = 0;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (stop_) return false;
    if (mode_ == MemoryTierMode::kAuto) {
      // Skip, never queue: while a copy runs, or until the copies' share of
      // the time allows the next one (MirrorPacer).
      if (!pacer_.Admit(NowS(), busy_ || next_.has_value())) {
        ++stats_.skipped;
        if (busy_) superseded_ = true;
        return false;
      }
    } else if (next_) {
      ++stats_.skipped;  // superseded before its copy started
      replaced_file = std::move(next_file_);
      replaced_slot = next_->slot;
    }
    if (busy_) superseded_ = true;
    next_file_ = std::move(file);
    next_ = info;
  }
  cv_.notify_all();
  if (replaced_file && release_) release_(replaced_file, replaced_slot);
  return true;
}

void MemoryTierWriter::Drain() {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return stop_ || (!next_ && !busy_); });
}

void MemoryTierWriter::Close(bool remove_segment) {
  std::shared_ptr<SlotFile> dropped_file;
  uint32_t dropped_slot = 0;
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
    if (next_) dropped_slot = next_->slot;
    dropped_file = std::move(next_file_);
    next_.reset();
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (dropped_file && release_) release_(dropped_file, dropped_slot);
  if (remove_segment && dir_) {
    (void)dir_->Unlink(name_);
    (void)dir_->Unlink(name_ + ".tmp");
    if (lock_) (void)dir_->Unlink(LockName(name_));  // still held: no one else has it
  }
  lock_.reset();
}

MemoryTierStats MemoryTierWriter::stats() const {
  std::lock_guard<std::mutex> l(mu_);
  return stats_;
}

void MemoryTierWriter::Failed(const Status& s) {
  ++stats_.failures;
  stats_.last_error = s.ToString();
  if (!reported_) {  // once until the tier works again
    std::fprintf(stderr, "nonstop: memory tier: %s; checkpoints go on to disk\n",
                 stats_.last_error.c_str());
    reported_ = true;
  }
}

void MemoryTierWriter::Loop() {
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    cv_.wait(l, [&] { return stop_ || next_.has_value(); });
    if (stop_) break;
    CheckpointInfo info = std::move(*next_);
    std::shared_ptr<SlotFile> file = std::move(next_file_);
    next_.reset();
    busy_ = true;
    superseded_ = false;
    l.unlock();
    const auto t0 = std::chrono::steady_clock::now();
    const double start = NowS();
    bool did_not_fit = false;
    Status s = CopyOne(*file, info, &did_not_fit);
    const double secs = Since(t0);
    // Done reading the slot: the engine may reuse it now.
    if (release_) release_(file, info.slot);
    file.reset();
    l.lock();
    busy_ = false;
    pacer_.Done(start, NowS());
    if (s.ok()) {
      ++stats_.mirrored;
      stats_.mirrored_counter = info.counter;
      stats_.copy_s_total += secs;
      reported_ = false;
    } else if (did_not_fit) {
      ++stats_.skipped;  // auto: does not fit; the stale segment is gone
      stats_.mirrored_counter = 0;
      stats_.last_error = s.ToString();
    } else if (next_.has_value() || superseded_) {
      // A newer commit came during the copy: the segment is stale either
      // way. (Its slot was not reused during the copy: it was held.)
      ++stats_.skipped;
      stats_.mirrored_counter = 0;
    } else {
      stats_.mirrored_counter = 0;
      Failed(s);
    }
    cv_.notify_all();
  }
  cv_.notify_all();
}

Status MemoryTierWriter::CopyOne(SlotFile& file, const CheckpointInfo& info, bool* did_not_fit) {
  *did_not_fit = false;
  const std::string tmp = name_ + ".tmp";
  Status us = dir_->Unlink(tmp);
  if (!us.ok() && us.code() != StatusCode::kNotFound) return us;
  SlotLayout layout;
  layout.tensors = info.tensors;
  layout.data_bytes = info.data_bytes;
  const uint64_t need = 4 * kStoreAlign * (kRingRecords + 2) +
                        StoreGeometry::SlotBytesFor(layout, info.meta_json.size() + kStoreAlign);
  if (mode_ == MemoryTierMode::kAuto) {
    Result<uint64_t> free_bytes = dir_->FreeBytes();
    uint64_t have = free_bytes.ok() ? free_bytes.value() : 0;
    Result<FileStat> old = dir_->Stat(name_);
    if (old.ok()) have += old.value().size;  // replaced by the new one
    if (!free_bytes.ok() || static_cast<double>(have) < fit_factor_ * static_cast<double>(need)) {
      // A segment older than the disk is of no use: give its memory back.
      (void)dir_->Unlink(name_);
      *did_not_fit = true;
      return Status::Unavailable(
          "memory tier (auto): " + std::to_string(need >> 20) + " MiB segment does not fit " +
          std::to_string(fit_factor_) + "x into " + std::to_string(have >> 20) + " MiB free in " +
          dir_->path());
    }
  }
  Result<std::unique_ptr<Medium>> m = dir_->CreateFile(tmp, MediumKind::kBuffered, MediumOptions{});
  if (!m.ok()) return m.status();
  Status s = CopyCheckpoint(file, info, std::move(m).value());
  if (s.ok()) s = dir_->Rename(tmp, name_);
  if (!s.ok()) {
    (void)dir_->Unlink(tmp);
    // The old segment is older than the disk now; it would never be chosen,
    // so its memory goes back.
    (void)dir_->Unlink(name_);
    return s.Annotate("copying checkpoint " + std::to_string(info.counter) + " to " +
                      dir_->path() + "/" + name_);
  }
  return Status::OK();
}

Result<std::shared_ptr<SlotFile>> MemoryTierWriter::CreateTierFile(const StoreGeometry& g) {
  if (!on()) return Status::FailedPrecondition("the memory tier is off");
  const std::string tmp = name_ + ".tmp";
  Status us = dir_->Unlink(tmp);
  if (!us.ok() && us.code() != StatusCode::kNotFound) return us;
  const uint64_t need = 4 * kStoreAlign * (kRingRecords + 2) + uint64_t{g.slots} * g.slot_bytes;
  if (mode_ == MemoryTierMode::kAuto) {
    Result<uint64_t> free_bytes = dir_->FreeBytes();
    const uint64_t have = free_bytes.ok() ? free_bytes.value() : 0;
    if (static_cast<double>(have) < 1.1 * static_cast<double>(need)) {
      return Status::Unavailable("memory tier (auto): the " + std::to_string(need >> 20) +
                                 " MiB segment does not fit into " + std::to_string(have >> 20) +
                                 " MiB free in " + dir_->path());
    }
  }
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> m,
                           dir_->CreateFile(tmp, MediumKind::kBuffered, MediumOptions{}));
  Result<std::unique_ptr<SlotFile>> f = SlotFile::Create(std::move(m), g);
  if (!f.ok()) {
    (void)dir_->Unlink(tmp);
    return f.status().Annotate("creating the segment " + dir_->path() + "/" + tmp);
  }
  return std::shared_ptr<SlotFile>(std::move(f).value());
}

Status MemoryTierWriter::PublishTierFile() {
  if (!on()) return Status::FailedPrecondition("the memory tier is off");
  return dir_->Rename(name_ + ".tmp", name_);
}

uint64_t SweepMemorySegments(Directory& dir, Env* env, const std::string& keep,
                             double orphan_after_s, uint64_t now_unix_ns,
                             const std::string& own_job) {
  if (env == nullptr) env = DefaultEnv();
  Result<std::vector<DirEntry>> entries = dir.List();
  if (!entries.ok()) return 0;
  // Every segment name that has a segment, temp or lock file here.
  std::vector<std::string> names;
  for (const DirEntry& e : entries.value()) {
    std::string n = e.name;
    if (n.size() > 5 && n.compare(n.size() - 5, 5, ".lock") == 0) {
      n = n.substr(0, n.size() - 5) + ".nsck";
    } else if (n.size() > 4 && n.compare(n.size() - 4, 4, ".tmp") == 0) {
      n = n.substr(0, n.size() - 4);
    }
    if (n == keep || SegmentRank(n) < 0) continue;
    if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
  }
  uint64_t removed = 0;
  for (const std::string& seg : names) {
    const int rank = SegmentRank(seg);
    const std::string lock_name = LockName(seg);
    // The owner's line, read before taking the lock (taking it rewrites it).
    Result<std::string> holder = ReadSmallFile(dir, lock_name, kMaxRecordBytes);
    const std::string line = holder.ok() ? holder.value() : "";
    if (!own_job.empty() && HolderJobDir(line) == own_job) {
      // Another rank's segment of this same job (a distributed job restarts
      // all its ranks at once): that rank takes its lock when its engine
      // opens, perhaps right now. Taking it here would make that rank
      // record a fresh name and restart from the disk. Left to its rank
      // while the job directory names it; a name it no longer names is
      // swept as any other.
      Result<std::unique_ptr<Directory>> jd = env->OpenDirectory(own_job, /*create=*/false);
      if (jd.ok()) {
        Result<std::string> named = ReadRecord(*jd.value(), rank);
        if (named.ok() && named.value() == seg) continue;
      }
    }
    Result<std::unique_ptr<FileLock>> lock =
        dir.Lock(lock_name, line.empty() ? std::string(kHolderHead) + std::to_string(::getpid()) +
                                               " sweeping"
                                         : line);
    if (!lock.ok()) continue;  // a live owner (or another sweeper): never touched
    bool orphan = false;
    const std::string job = HolderJobDir(line);
    if (!job.empty()) {
      Result<std::unique_ptr<Directory>> jd = env->OpenDirectory(job, /*create=*/false);
      if (!jd.ok()) {
        orphan = jd.status().code() == StatusCode::kNotFound;  // its job directory is gone
      } else {
        Result<std::string> named = ReadRecord(*jd.value(), rank);
        // The job directory names another segment, or none: this one is never read again.
        orphan = named.ok() ? named.value() != seg
                            : named.status().code() == StatusCode::kNotFound ||
                                  named.status().code() == StatusCode::kCorruption;
      }
    }
    if (!orphan) {
      // The owner is gone but its job may restart: kept until it is old.
      uint64_t newest_ns = 0;
      bool any = false;
      for (const std::string& n : {seg, seg + ".tmp"}) {
        Result<FileStat> st = dir.Stat(n);
        if (!st.ok()) continue;
        any = true;
        newest_ns = std::max(newest_ns, st.value().mtime_unix_ns);
      }
      const double age_s =
          now_unix_ns > newest_ns ? static_cast<double>(now_unix_ns - newest_ns) / 1e9 : 0;
      orphan = !any || age_s >= orphan_after_s;
    }
    (void)dir.Unlink(seg + ".tmp");  // a copy its dead owner never finished
    if (orphan) {
      const bool had = dir.Stat(seg).ok();
      (void)dir.Unlink(seg);
      (void)dir.Unlink(lock_name);  // while holding it
      if (had) ++removed;
    }
  }
  return removed;
}

Result<std::optional<MemorySegment>> OpenMemorySegment(const std::string& job_dir, int rank,
                                                       const std::string& shm_dir, Env* env,
                                                       const CheckpointInfo* disk_newest,
                                                       std::string* why_not,
                                                       std::optional<int64_t> step) {
  std::string ignored;
  if (why_not == nullptr) why_not = &ignored;
  if (env == nullptr) env = DefaultEnv();
  auto no = [&](const std::string& why) -> Result<std::optional<MemorySegment>> {
    *why_not = why;
    return std::optional<MemorySegment>();
  };
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<JobDir> jd, JobDir::OpenForRead(job_dir, env));
  Result<std::string> name = ReadRecord(jd->dir(), rank);
  if (!name.ok()) return no("no memory segment record: " + name.status().message());
  // What the disk holds: the caller's checkpoint (disk_newest: the segment
  // must hold exactly it), or every record of the rank's slot file, planned
  // below with the segment's records and the lineage.
  std::unique_ptr<SlotFile> disk;
  ScanReport disk_report;
  if (disk_newest == nullptr) {
    Result<std::unique_ptr<Medium>> dm = jd->OpenSlot(rank, MediumKind::kBuffered, true);
    if (dm.ok()) {
      Result<std::unique_ptr<SlotFile>> df = SlotFile::Open(std::move(dm).value());
      if (!df.ok()) return no("disk: " + df.status().message());
      ScanOptions so;
      so.verify_data = false;
      Result<ScanReport> dr = df.value()->Scan(so);
      if (!dr.ok()) return no("disk: " + dr.status().message());
      disk_report = std::move(dr).value();
      disk = std::move(df).value();
    } else if (dm.status().code() != StatusCode::kNotFound) {
      return no("disk: " + dm.status().message());
    }
  }
  const std::string where = MemorySegmentDir(shm_dir);
  Result<std::unique_ptr<Directory>> d = env->OpenDirectory(where, /*create=*/false);
  if (!d.ok()) return no("segment directory: " + d.status().message());
  const std::string path = where + "/" + name.value();
  // Only a regular file no larger than the rank's slot file plus one slot
  // (the tiered cadence's segment has one slot more than the disk file;
  // the mirror's holds one) is opened at all.
  Result<FileStat> st = d.value()->Stat(name.value());
  if (!st.ok()) return no(path + ": " + st.status().message());
  if (st.value().type != EntryType::kFile) return no(path + " is not a regular file");
  uint64_t max_size = 0;
  if (disk_newest != nullptr) {
    SlotLayout layout;
    layout.tensors = disk_newest->tensors;
    layout.data_bytes = disk_newest->data_bytes;
    max_size = 4 * kStoreAlign * (kRingRecords + 2) +
               StoreGeometry::SlotBytesFor(layout, disk_newest->meta_json.size() + kStoreAlign);
  } else if (disk) {
    const StoreGeometry& dg = disk->geometry();
    max_size = 4 * kStoreAlign * (kRingRecords + 2) + (uint64_t{dg.slots} + 1) * dg.slot_bytes;
  }
  if (max_size != 0 && st.value().size > max_size) {
    return no(path + " is larger than the checkpoints it should hold");
  }
  MediumOptions ro;
  ro.read_only = true;
  Result<std::unique_ptr<Medium>> m = d.value()->OpenFile(name.value(), MediumKind::kBuffered, ro);
  if (!m.ok()) return no(path + ": " + m.status().message());
  Result<std::unique_ptr<SlotFile>> f = SlotFile::Open(std::move(m).value());
  if (!f.ok()) return no(path + ": " + f.status().message());
  const StoreGeometry& g = f.value()->geometry();
  const uint32_t world = disk_newest != nullptr ? disk_newest->world_size
                         : disk                 ? disk->geometry().world_size
                                                : g.world_size;
  if (static_cast<int>(g.rank) != rank || g.world_size != world) {
    return no(path + " is not a segment of rank " + std::to_string(rank));
  }
  ScanOptions so;
  // The table, the record and the chunk crcs are checked here; the data
  // chunks are verified once, by the read that restores from the segment
  // (ReadCheckpointInto or the engine's ReadCheckpoint, which fall back to
  // the disk on a mismatch), not here as well.
  so.verify_data = false;
  Result<ScanReport> rep = f.value()->Scan(so);
  if (!rep.ok()) return no(path + ": " + rep.status().message());
  // The candidates: the segment's records (the memory tier) and, without
  // disk_newest, the slot file's; planned with the lineage, so a segment
  // record a rollback abandoned, or one older than the disk's newest, is
  // never the answer.
  std::vector<PlanCandidate> cands;
  std::vector<const CheckpointInfo*> infos;
  for (const ScannedCheckpoint& c : rep.value().checkpoints) {
    cands.push_back(PlanCandidate{Tier::kMemory, path, c.info.step, c.info.counter,
                                  c.state == CheckpointState::kCommitted, c.reason, false,
                                  infos.size()});
    infos.push_back(&c.info);
  }
  for (const ScannedCheckpoint& c : disk_report.checkpoints) {
    cands.push_back(PlanCandidate{Tier::kDisk, jd->SlotPath(rank), c.info.step, c.info.counter,
                                  c.state == CheckpointState::kCommitted, c.reason, false,
                                  infos.size()});
    infos.push_back(&c.info);
  }
  LineageRecord lineage;
  if (disk_newest == nullptr) {
    NONSTOP_ASSIGN_OR_RETURN(lineage, jd->ReadLineage(rank));
  }
  // The segment, holding `info` (one of its records), as the answer.
  auto use = [&](const CheckpointInfo& info) -> Result<std::optional<MemorySegment>> {
    MemorySegment seg;
    seg.info = info;
    seg.report = std::move(rep).value();
    seg.file = std::move(f).value();
    seg.path = path;
    return std::optional<MemorySegment>(std::move(seg));
  };
  PlanRequest req;
  req.verify = false;
  if (disk_newest == nullptr) req.step = step;
  Result<Plan> plan = MakePlan(cands, lineage, req);
  if (!plan.ok()) return no(path + ": " + plan.status().message());
  if (disk_newest == nullptr) {
    // Find the first memory candidate in the plan's order (a disk one
    // before it: the disk holds a newer checkpoint).
    if (!plan.value().chosen()) {
      std::string why = path + " holds no checkpoint to restore";
      for (const std::string& s : plan.value().skipped) why += "; " + s;
      return no(why);
    }
    const PlanCandidate& first = cands[*plan.value().chosen()];
    if (first.tier != Tier::kMemory) {
      uint64_t held = 0;
      for (const PlanCandidate& c : cands) {
        if (c.tier == Tier::kMemory && c.committed) held = std::max(held, c.counter);
      }
      return no(path + ": it holds checkpoint " + std::to_string(held) + ", the disk's newest is " +
                std::to_string(first.counter) + " (" + DescribeCheckpoint(first.counter, first.step) +
                ", newer)");
    }
    const CheckpointInfo& info = *infos[first.handle];
    // The same counter on disk must be the same checkpoint (a segment of
    // another lineage never is).
    for (const PlanCandidate& c : cands) {
      if (c.tier != Tier::kDisk || c.counter != info.counter || !c.committed) continue;
      std::string why;
      if (!SameCheckpoint(info, *infos[c.handle], &why)) return no(path + ": " + why);
    }
    return use(info);
  }
  if (!plan.value().chosen()) return no(path + " holds no valid checkpoint");
  const CheckpointInfo& info = *infos[cands[*plan.value().chosen()].handle];
  std::string why;
  if (!SameCheckpoint(info, *disk_newest, &why)) return no(path + ": " + why);
  return use(info);
}

uint64_t MemorySegmentNewestCounter(const std::string& job_dir, int rank,
                                    const std::string& shm_dir, Env* env) {
  if (env == nullptr) env = DefaultEnv();
  Result<std::unique_ptr<Directory>> jd = env->OpenDirectory(job_dir, /*create=*/false);
  if (!jd.ok()) return 0;
  Result<std::string> name = ReadRecord(*jd.value(), rank);
  if (!name.ok()) return 0;
  Result<std::unique_ptr<Directory>> d = env->OpenDirectory(MemorySegmentDir(shm_dir), false);
  if (!d.ok()) return 0;
  MediumOptions ro;
  ro.read_only = true;
  Result<std::unique_ptr<Medium>> m = d.value()->OpenFile(name.value(), MediumKind::kBuffered, ro);
  if (!m.ok()) return 0;
  Result<std::unique_ptr<SlotFile>> f = SlotFile::Open(std::move(m).value());
  if (!f.ok()) return 0;
  ScanOptions so;
  so.verify_data = false;
  Result<ScanReport> rep = f.value()->Scan(so);
  uint64_t newest = f.value()->newest_committed_counter();
  if (rep.ok()) {
    for (const ScannedCheckpoint& c : rep.value().checkpoints) newest = std::max(newest, c.info.counter);
  }
  return newest;
}

std::vector<std::pair<int, std::string>> RecordedMemorySegments(const std::string& job_dir,
                                                                const std::string& shm_dir,
                                                                Env* env) {
  if (env == nullptr) env = DefaultEnv();
  std::vector<std::pair<int, std::string>> out;
  Result<std::unique_ptr<Directory>> jd = env->OpenDirectory(job_dir, /*create=*/false);
  if (!jd.ok()) return out;
  Result<std::unique_ptr<Directory>> d = env->OpenDirectory(MemorySegmentDir(shm_dir), false);
  if (!d.ok()) return out;
  Result<std::vector<DirEntry>> entries = jd.value()->List();
  if (!entries.ok()) return out;
  for (const DirEntry& e : entries.value()) {
    // JobDirNames::MemoryRecord(rank): the prefix of rank 0's name, 5 digits.
    const std::string head = JobDirNames::MemoryRecord(0);
    const size_t pre = head.size() - 5;
    if (e.name.size() != head.size() || e.name.compare(0, pre, head, 0, pre) != 0) continue;
    int rank = 0;
    bool digits = true;
    for (size_t i = pre; i < e.name.size(); ++i) {
      if (e.name[i] < '0' || e.name[i] > '9') digits = false;
      rank = rank * 10 + (e.name[i] - '0');
    }
    if (!digits) continue;
    Result<std::string> name = ReadRecord(*jd.value(), rank);
    if (!name.ok()) continue;
    Result<FileStat> st = d.value()->Stat(name.value());
    if (!st.ok() || st.value().type != EntryType::kFile) continue;
    out.emplace_back(rank, name.value());
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace nonstop
