// The engine: opening (Init), registration, slot files, closing, and the
// Engine interface's defaults. engine_impl.h describes the threads and the
// state; the pipeline's stages live in engine_dispatch.cc (dispatcher),
// engine_writers.cc (the one write path), engine_commit.cc (committer),
// engine_restore.cc, engine_stats.cc and engine_staging.cc; the layer-wise
// schedule in layerwise_schedule.cc.
#include <algorithm>
#include <cstdio>

#include "engine/engine_impl.h"

namespace nonstop::engine_detail {

Status EngineImpl::Init() {
  // No other thread runs yet; held so that the analysis sees every field
  // guarded (the threads started at the end wait for it).
  MutexLock lock(&mu_);
  if (opts_.dir.empty()) return Status::InvalidArgument("engine: empty checkpoint dir");
  if (opts_.max_in_flight < 1) {
    return Status::InvalidArgument("max_in_flight must be >= 1, got " +
                                   std::to_string(opts_.max_in_flight));
  }
  if (opts_.world_size < 1 || opts_.rank >= opts_.world_size) {
    return Status::InvalidArgument("rank " + std::to_string(opts_.rank) +
                                   " is not below world_size " +
                                   std::to_string(opts_.world_size));
  }
  if (opts_.global_agreement && opts_.extra_slots < 1) {
    return Status::InvalidArgument("global_agreement needs extra_slots >= 1 (the pinned slot)");
  }
  chunk_bytes_ = opts_.chunk_bytes ? opts_.chunk_bytes : kDefaultChunkBytes;
  if (chunk_bytes_ % kStoreAlign != 0 || chunk_bytes_ > (1u << 30)) {
    return Status::InvalidArgument("chunk_bytes " + std::to_string(chunk_bytes_) +
                                   " must be a multiple of 4096 and at most 1 GiB");
  }
  NONSTOP_ASSIGN_OR_RETURN(jd_, JobDir::OpenForWrite(opts_.dir, rank(),
                                                     static_cast<int>(opts_.world_size), opts_.env));
  MemoryTierMode tier = MemoryTierMode::kAuto;
  if (!ParseMemoryTierMode(opts_.memory_tier, &tier)) {
    return Status::InvalidArgument("memory_tier must be \"auto\", \"memory\" or \"disk\", got \"" +
                                   opts_.memory_tier + "\"");
  }
  if (!(opts_.memory_tier_share > 0 && opts_.memory_tier_share <= 1)) {
    return Status::InvalidArgument("memory_tier_share must be in (0, 1], got " +
                                   std::to_string(opts_.memory_tier_share));
  }
  memory_ = MemoryTierWriter::Open(*jd_, opts_.env, rank(), tier, opts_.shm_dir,
                                   opts_.memory_tier_fit, opts_.memory_tier_share,
                                   opts_.memory_tier_orphan_s);
  memory_->SetRelease([this](const std::shared_ptr<SlotFile>& file, uint32_t slot) {
    MirrorDone(file, slot);
  });
  if (opts_.disk_every < 0) {
    return Status::InvalidArgument("disk_every must be >= 0 (0: whenever the disk is free), got " +
                                   std::to_string(opts_.disk_every));
  }
  if (opts_.disk_every != 1 && opts_.global_agreement) {
    return Status::InvalidArgument("disk_every != 1 (the tiered cadence) is not supported with "
                                   "global_agreement (a distributed job): use disk_every=1");
  }
  // The tiered cadence needs the memory tier: without it every checkpoint
  // goes to disk (EngineStats::disk_every says 1).
  tiered_ = opts_.disk_every != 1 && memory_->on();
  // Checkpoints are numbered above every record of the segment too: one
  // committed only to memory by an earlier process is never renumbered.
  next_counter_ = std::max(next_counter_, SegmentNewestCounter() + 1);

  const int writers = opts_.writers > 0 ? opts_.writers : kDefaultWriters;
  const int copy_threads = std::max(0, opts_.copy_threads);
  copy_ = media_.copy ? media_.copy(copy_threads) : MakeBestCopyEngine(copy_threads, nullptr);
  window_ = std::max(2, 2 * copy_threads);
  // Enough chunks for every writer to hold one while the dispatcher fills a window.
  const uint32_t min_chunks = static_cast<uint32_t>(writers + window_);
  min_chunks_ = min_chunks;
  // Without staging_bytes the pool starts at the floor and grows to the
  // state's size at Register (DefaultStagingSize).
  uint64_t staging = opts_.staging_bytes;
  if (staging == 0 && opts_.small_initial_staging) {
    staging = uint64_t{min_chunks} * chunk_bytes_;  // PrepareStaging follows (EngineOptions)
  } else if (staging == 0) {
    staging = DefaultStagingSize(0, chunk_bytes_, min_chunks, PhysicalMemoryBytes(),
                                 copy_->PinsHostMemory())
                  .bytes;
  }
  NONSTOP_ASSIGN_OR_RETURN(staging_,
                           StagingPool::Create(copy_.get(), staging, chunk_bytes_, min_chunks));
  writers_ = std::make_unique<TaskPool>(writers);

  // JobDir::OpenForWrite removed a temp file left by a crash during a slot
  // resize: it holds no committed checkpoint the final file lacks (the rename
  // is the commit point).
  NONSTOP_ASSIGN_OR_RETURN(uint64_t next_on_disk, jd_->NextCounter(rank()));
  next_counter_ = std::max(next_counter_, next_on_disk);
  NONSTOP_ASSIGN_OR_RETURN(LineageRecord lineage, jd_->ReadLineage(rank()));
  Result<std::unique_ptr<Medium>> existing = OpenSlotMedium(false);
  if (!existing.ok() && existing.status().code() != StatusCode::kNotFound) return existing.status();
  if (existing.ok()) {
    // A file cut shorter than its header says whose commit records went with
    // its tail is damage, never a fresh start: refused before the repair
    // below would restore its length and hide it.
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<SlotFile> pf,
                             SlotFile::Open(std::move(existing).value()));  // no repair
    ScanOptions quick;
    quick.verify_data = false;
    NONSTOP_ASSIGN_OR_RETURN(ScanReport pr, pf->Scan(quick));
    for (const std::string& note : pf->salvaged()) {
      if (pr.checkpoints.empty() && note.rfind("slot file is truncated", 0) == 0) {
        return Status::Corruption(jd_->SlotPath(rank()) + ": " + note.substr(0, note.find(';')) +
                                  ": no commit record is left (damage, not a fresh start); move "
                                  "the file aside to start afresh");
      }
    }
    pf.reset();
    existing = OpenSlotMedium(false);
    if (!existing.ok()) return existing.status();
    // The writer repairs a damaged header copy or a truncated length (the
    // store salvages them; DESIGN.md invariant 10).
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<SlotFile> sf,
                             SlotFile::Open(std::move(existing).value(), {.repair = true}));
    const StoreGeometry& g = sf->geometry();
    if (g.world_size != opts_.world_size || g.rank != opts_.rank) {
      return Status::FailedPrecondition(
          jd_->SlotPath(rank()) + " was written by rank " + std::to_string(g.rank) +
          " of world size " + std::to_string(g.world_size) + ", not rank " + std::to_string(opts_.rank) + " of " +
          std::to_string(opts_.world_size) + ": use another dir or the matching world size");
    }
    ScanOptions so;
    so.verify_data = false;  // Restore verifies what it reads; Open stays cheap
    NONSTOP_ASSIGN_OR_RETURN(ScanReport report, sf->Scan(so));
    uint64_t max_counter = sf->newest_committed_counter();
    for (const auto& c : report.checkpoints) max_counter = std::max(max_counter, c.info.counter);
    next_counter_ = std::max(next_counter_, max_counter + 1);
    free_slots_ = std::make_unique<SlotQueue>(g.slots);
    // The newest committed checkpoint of the current lineage: one a restore
    // rolled back from is never resumed (DESIGN.md invariant 9).
    const CheckpointInfo* newest = nullptr;
    std::vector<PlanCandidate> cands;
    for (size_t i = 0; i < report.checkpoints.size(); ++i) {
      const ScannedCheckpoint& c = report.checkpoints[i];
      cands.push_back(PlanCandidate{Tier::kDisk, jd_->SlotPath(rank()), c.info.step, c.info.counter,
                                    c.state == CheckpointState::kCommitted, c.reason, false, i});
    }
    PlanRequest unverified;
    unverified.verify = false;  // Restore verifies what it reads
    NONSTOP_ASSIGN_OR_RETURN(Plan plan, MakePlan(cands, lineage, unverified));
    if (plan.chosen()) newest = &report.checkpoints[cands[*plan.chosen()].handle].info;
    if (newest != nullptr) {
      const CheckpointInfo& info = *newest;
      retained_slot_ = info.slot;
      latest_ = CommittedCheckpoint{info.counter, info.step};
      if (opts_.global_agreement) candidate_ = latest_;
      committed_counter_ = info.counter;
    }
    claimed_.store(committed_counter_);
    disk_counter_ = committed_counter_;
    for (uint32_t s = 0; s < g.slots; ++s) {
      if (!retained_slot_ || *retained_slot_ != s) free_slots_->Push(s);
    }
    medium_desc_ = sf->medium().Describe();
    file_ = std::move(sf);
  }

  stats_.staging_bytes = staging_->total_bytes();
  stats_.chunk_bytes = chunk_bytes_;
  stats_.writers = writers;
  stats_.max_in_flight = opts_.max_in_flight;
  stats_.copy_engine = copy_->Describe();
  stats_.layer_copy = LayerCopyName(opts_.layer_copy);
  stats_.disk_every = tiered_ ? opts_.disk_every : 1;
  stats_.persisted_counter = disk_counter_;
  dispatcher_ = std::thread([this] { DispatchLoop(); });
  committer_ = std::thread([this] { CommitLoop(); });
  if (tiered_) persister_ = std::thread([this] { PersistLoop(); });
  return Status::OK();
}

Status EngineImpl::TakePendingError() {
  if (pending_errors_.empty()) return Status::OK();
  Status s = pending_errors_.front().second;
  pending_errors_.pop_front();
  return s;
}

Status EngineImpl::RecordRollback() {
  if (!rollback_from_) return Status::OK();
  // Counters above it in the memory tier's segment are abandoned too.
  NONSTOP_RETURN_IF_ERROR(jd_->RecordRestore(rank(), *rollback_from_, SegmentNewestCounter()));
  NONSTOP_ASSIGN_OR_RETURN(uint64_t next, jd_->NextCounter(rank()));
  next_counter_ = std::max(next_counter_, next);
  rollback_from_.reset();
  return Status::OK();
}

Status EngineImpl::TakeError() {
  MutexLock lock(&mu_);
  return TakePendingError();
}

Status EngineImpl::CheckOpen() {
  if (closed_) return Status::FailedPrecondition("engine is closed");
  return Status::OK();
}

void EngineImpl::AddStall(double s) { stats_.stall_s_total += s; }

Status EngineImpl::WaitAllFinished() {
  cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return in_flight_ == 0; });
  // The tiered cadence: a persist not begun is dropped (the memory tier
  // keeps its checkpoint; the next commit is offered again), one running
  // ends first (it reads a slot and writes file_).
  persist_next_.reset();
  cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return !persist_busy_; });
  return Status::OK();
}

// Creates a new slot file with slot_bytes per slot, always under the temp
// name first (JobDir::CreateTempSlot: O_EXCL|O_NOFOLLOW, a stale one
// removed): a crash while the header is written never leaves a torn file at
// the slot file's name (the next open removes a stale temp file). With
// keep_old the new file stays there until its first commit renames it over the old one, so a
// committed checkpoint exists at every instant; without, nothing committed
// is lost by renaming it over at once. Called with nothing in flight.
Status EngineImpl::SwitchFile(uint64_t slot_bytes, bool keep_old) {
  StoreGeometry g;
  g.slots = WantedSlots();
  g.slot_bytes = slot_bytes;
  g.rank = opts_.rank;
  g.world_size = opts_.world_size;
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<SlotFile> sf, CreateSlotFile(g, /*publish=*/!keep_old, /*never_replace=*/false));
  medium_desc_ = sf->medium().Describe();
  free_slots_ = std::make_unique<SlotQueue>(g.slots);
  for (uint32_t s = 0; s < g.slots; ++s) free_slots_->Push(s);
  retained_slot_.reset();
  candidate_.reset();  // the pinned checkpoint stays in the old file until a new one is pinned
  if (keep_old) {
    if (!pending_rename_) old_file_ = file_;
    pending_rename_ = true;
  } else {
    old_file_.reset();
    pending_rename_ = false;
  }
  file_ = std::move(sf);
  return Status::OK();
}

Result<std::unique_ptr<SlotFile>> EngineImpl::CreateSlotFile(const StoreGeometry& g, bool publish,
                                                              bool never_replace) {
  if (never_replace) {
    // In the background (PrepareStaging): never over a slot file, even one
    // that appeared after Init looked (the writer lock makes that a bug).
    Result<FileStat> there = jd_->dir().Stat(JobDirNames::Slot(rank()));
    if (there.ok()) {
      return Status::FailedPrecondition(jd_->SlotPath(rank()) + " exists: not replaced");
    }
    if (there.status().code() != StatusCode::kNotFound) return there.status();
  }
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> medium, OpenSlotMedium(true));
  SlotMedium* sm = static_cast<SlotMedium*>(medium.get());
  Result<std::unique_ptr<SlotFile>> created = SlotFile::Create(std::move(medium), g);
  if (created.ok() && publish) {
    if (Status rs = jd_->PublishTempSlot(); !rs.ok()) {
      created = rs;
    } else {
      sm->Renamed(JobDirNames::Slot(rank()));
    }
  }
  if (!created.ok()) {
    (void)jd_->DiscardTempSlot();  // best effort: the next open removes it too
  }
  return created;
}

Status EngineImpl::AdoptPreparedFile(uint64_t slot_bytes, bool* adopted) {
  *adopted = false;
  std::shared_ptr<PreparedFile> fp = std::move(file_prep_);
  file_prep_.reset();
  if (!fp) return Status::OK();
  double waited_s = 0;
  Result<std::unique_ptr<SlotFile>> got = TakeBackground(*fp, file_prep_thread_, &waited_s);
  stats_.slot_file_wait_s += waited_s;
  if (!got.ok()) {
    return Status(got.status().code(),
                  "creating the slot file in the background: " + got.status().message());
  }
  std::unique_ptr<SlotFile> sf = std::move(got).value();
  const StoreGeometry& g = sf->geometry();
  if (!PreparedSlotFits(g.slot_bytes, slot_bytes) || g.slots < WantedSlots()) {
    return Status::OK();  // empty, at the slot file's name: SwitchFile replaces it
  }
  stats_.slot_file_prepared_bytes = sf->medium().Size();
  medium_desc_ = sf->medium().Describe();
  free_slots_ = std::make_unique<SlotQueue>(g.slots);
  for (uint32_t s = 0; s < g.slots; ++s) free_slots_->Push(s);
  retained_slot_.reset();
  candidate_.reset();
  old_file_.reset();
  pending_rename_ = false;
  file_ = std::move(sf);
  *adopted = true;
  return Status::OK();
}

std::unique_ptr<Medium> EngineImpl::Wrap(std::unique_ptr<Medium> m, const std::string& name) {
  // A reopen after a failed fsync: the same name in the same directory fd.
  auto reopen = [this](const std::string& n, MediumKind kind) -> Result<std::unique_ptr<Medium>> {
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> fresh,
                             jd_->dir().OpenFile(n, kind, MediumOptions{}));
    if (media_.wrap) return media_.wrap(std::move(fresh), n, false);
    return fresh;
  };
  return std::make_unique<SlotMedium>(std::move(m), jd_->path(), name, reopen);
}

Result<std::unique_ptr<Medium>> EngineImpl::OpenSlotMedium(bool create) {
  const std::string name = create ? JobDirNames::TempSlot(rank()) : JobDirNames::Slot(rank());
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> m,
                           create ? jd_->CreateTempSlot(opts_.medium)
                                  : jd_->OpenSlot(rank(), opts_.medium, /*read_only=*/false));
  if (media_.wrap) {
    NONSTOP_ASSIGN_OR_RETURN(m, media_.wrap(std::move(m), name, create));
  }
  return Wrap(std::move(m), name);
}

Status EngineImpl::PublishTemp(SlotFile& file) {
  NONSTOP_RETURN_IF_ERROR(jd_->PublishTempSlot());
  if (SlotMedium* sm = SlotOf(file)) sm->Renamed(JobDirNames::Slot(rank()));
  return Status::OK();
}

Status EngineImpl::Register(std::vector<TensorRef> tensors) {
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  // An earlier checkpoint's failure stays queued (engine.h "Errors"): a new
  // registration is not refused for it.
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  // Bytes that go through the staging pool (every tensor not staged).
  uint64_t through_staging = 0;
  bool all_staged = !tensors.empty();
  for (const TensorRef& t : tensors) {
    if (t.data == nullptr && t.spec.nbytes > 0) {
      return Status::InvalidArgument("tensor '" + t.spec.name + "' has no data pointer");
    }
    if (t.staged) {
      if (t.device.kind != DeviceKind::kHost || t.copy_at_checkpoint) {
        return Status::InvalidArgument("tensor '" + t.spec.name + "' is staged but " +
                                       (t.copy_at_checkpoint ? "copy_at_checkpoint"
                                                             : "not in host memory"));
      }
      if (t.spec.nbytes >= kLargeTensorBytes &&
          reinterpret_cast<uintptr_t>(t.data) % kStoreAlign != 0) {
        return Status::InvalidArgument("staged tensor '" + t.spec.name +
                                       "' does not start at a 4 KiB boundary");
      }
    } else {
      all_staged = false;
      through_staging += (t.spec.nbytes + kStoreAlign - 1) / kStoreAlign * kStoreAlign;
    }
    specs.push_back(t.spec);
  }
  NONSTOP_ASSIGN_OR_RETURN(SlotLayout layout, SlotLayout::Plan(specs));

  if (open_ > 0) {
    return Status::FailedPrecondition("Register while a layer-wise checkpoint is open: "
                                      "EndCheckpoint first");
  }
  // In-flight copies still read the old registration's memory and snapshots.
  const auto t0 = Clock::now();
  cv_.Wait(&mu_, [&]() REQUIRES(mu_) {
    return copied_through_ >= started_last_ && lw_copied_total_ >= lw_requested_total_;
  });

  const uint64_t slot_bytes = StoreGeometry::SlotBytesFor(layout);
  const bool fits = file_ && file_->geometry().slot_bytes >= slot_bytes &&
                    file_->geometry().slots >= WantedSlots();
  if (!fits) {
    // Slot ids and the retained slot belong to one file: switch with nothing in flight.
    NONSTOP_RETURN_IF_ERROR(WaitAllFinished());
    bool adopted = false;  // the slot file PrepareStaging created, if it fits
    NONSTOP_RETURN_IF_ERROR(AdoptPreparedFile(slot_bytes, &adopted));
    if (!adopted) {
      const bool keep_old = file_ != nullptr && (latest_.has_value() || pending_rename_);
      NONSTOP_RETURN_IF_ERROR(SwitchFile(slot_bytes, keep_old));
    }
    stats_.medium = medium_desc_;
  }
  if (opts_.staging_bytes == 0) {
    NONSTOP_RETURN_IF_ERROR(all_staged ? ShrinkStaging() : GrowStaging(through_staging));
  }
  AddStall(Seconds(t0, Clock::now()));

  auto reg = std::make_shared<Registration>();
  reg->copy = copy_.get();
  reg->plan = ChunkPlan::Build(layout.tensors, layout.data_bytes, chunk_bytes_);
  reg->layout = std::move(layout);
  reg->snapshot_offset.assign(tensors.size(), -1);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].copy_at_checkpoint) continue;
    reg->snapshot_offset[i] = static_cast<int64_t>(reg->snapshot_bytes);
    reg->snapshot_bytes += (tensors[i].spec.nbytes + 63) / 64 * 64;
  }
  free_snapshots_.clear();
  if (reg->snapshot_bytes > 0) {
    for (int i = 0; i < opts_.max_in_flight; ++i) {
      bool pinned = false;
      auto* p = static_cast<std::byte*>(copy_->AllocHost(reg->snapshot_bytes, &pinned));
      if (p == nullptr) {
        return Status::IOError("cannot allocate " + std::to_string(reg->snapshot_bytes) +
                               " bytes for copy_at_checkpoint tensors");
      }
      reg->snapshots.push_back(p);
      free_snapshots_.push_back(i);
    }
  }
  // Layer-wise: the unit plan, one small-region buffer per possible in-flight
  // checkpoint and, for kDevice, the second buffer. Allocated once here.
  reg->lplan = LayerPlan::Build(reg->layout, chunk_bytes_);
  reg->small_bytes = reg->layout.data_bytes - reg->lplan.small_begin;
  free_small_.clear();
  for (int i = 0; reg->small_bytes > 0 && i < opts_.max_in_flight; ++i) {
    bool pinned = false;
    auto* p = static_cast<std::byte*>(copy_->AllocHost(reg->small_bytes, &pinned));
    if (p == nullptr) {
      return Status::IOError("cannot allocate " + std::to_string(reg->small_bytes) +
                             " bytes for the small tensors of layer-wise checkpoints");
    }
    reg->small_buffers.push_back(p);
    free_small_.push_back(i);
  }
  if (opts_.layer_copy == LayerCopy::kDevice && reg->lplan.small_begin > 0 && !all_staged) {
    bool pinned = false;
    reg->device_snapshot_bytes = reg->lplan.small_begin;
    reg->device_snapshot =
        static_cast<std::byte*>(copy_->AllocHost(reg->device_snapshot_bytes, &pinned));
    if (reg->device_snapshot == nullptr) {
      return Status::IOError("cannot allocate " + std::to_string(reg->device_snapshot_bytes) +
                             " bytes for copy='device' snapshots");
    }
  }
  reg->snapshot_writes = std::make_unique<std::atomic<uint32_t>[]>(tensors.size());
  reg->device_buffers.assign(tensors.size(), nullptr);
  if (opts_.layer_copy == LayerCopy::kDevice && copy_->CanSnapshotOnDevice()) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].device.kind != DeviceKind::kCuda || reg->lplan.is_small[i]) continue;
      reg->device_buffers[i] = copy_->AllocDevice(tensors[i].device.index, tensors[i].spec.nbytes);
      if (reg->device_buffers[i] == nullptr) {
        reg->tensors = std::move(tensors);  // so ~Registration frees what was allocated
        return Status::IOError("cannot allocate " + std::to_string(reg->tensors[i].spec.nbytes) +
                               " bytes of device memory for copy='device' (tensor '" +
                               reg->tensors[i].spec.name + "'): use copy='host'");
      }
    }
  }
  lw_requested_.assign(tensors.size(), 0);
  lw_copied_.assign(tensors.size(), 0);
  lw_dispatched_.assign(tensors.size(), 0);
  lw_fenced_.assign(tensors.size(), 0);
  lw_fences_.assign(tensors.size(), {});
  reg->tensors = std::move(tensors);
  AllocDeviceSnapshots(*reg);
  reg_ = std::move(reg);
  return PrepareMemFile();
}

Status EngineImpl::Close() {
  MutexLock lock(&mu_);
  if (closed_) return Status::OK();
  // Open layer-wise checkpoints can never be sealed now: fail them quietly
  // (their slots go back; the newest committed checkpoint is untouched).
  for (auto& [counter, job] : live_) {
    if (!job->open) continue;
    job->abandoned = true;
    job->Fail(Status::Aborted("engine closed before EndCheckpoint"));
    SealLocked(job);
  }
  lock.Unlock();
  cv_.SignalAll();
  lock.Lock();
  cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return in_flight_ == 0; });
  // The tiered cadence: the newest memory checkpoint reaches the disk
  // before a clean close (the segment goes back below only when it has).
  const bool persist_last = tiered_ && file_ && persister_.joinable() && mem_newest_ &&
                            mem_newest_->info.counter > disk_counter_;
  if (persist_last) {
    persist_next_ = mem_newest_;
    lock.Unlock();
    cv_.SignalAll();
    lock.Lock();
    cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return !persist_next_ && !persist_busy_; });
  }
  const bool all_on_disk = !mem_newest_ || mem_newest_->info.counter <= disk_counter_;
  // The segment goes back only when nothing in it is newer than the disk
  // (a record a rollback abandoned keeps it until it is swept).
  const bool remove_segment = all_on_disk && (!tiered_ || SegmentNewestCounter() <= disk_counter_);
  persist_stop_ = true;
  closed_ = true;
  stopping_ = true;
  Status st = TakePendingError();
  if (st.ok() && persist_last && !all_on_disk) {
    st = Status::IOError("the newest checkpoint (#" + std::to_string(mem_newest_->info.counter) +
                         ") could not be persisted to disk; it stays in the memory tier's "
                         "segment: " + stats_.persist_error);
  }
  lock.Unlock();
  cv_.SignalAll();
  if (dispatcher_.joinable()) dispatcher_.join();
  if (committer_.joinable()) committer_.join();
  if (persister_.joinable()) persister_.join();
  writers_.reset();
  // A clean close: everything is on disk; the segment's memory goes back.
  if (memory_) memory_->Close(remove_segment);
  lock.Lock();
  reg_.reset();
  file_.reset();
  old_file_.reset();
  pinned_file_.reset();
  mem_file_.reset();
  mem_newest_.reset();
  std::shared_ptr<PreparedStaging> prep = std::move(prep_);
  prep_.reset();
  file_prep_.reset();  // a prepared slot file nobody took stays, empty
  lock.Unlock();
  if (prep_thread_.joinable()) prep_thread_.join();
  if (file_prep_thread_.joinable()) file_prep_thread_.join();
  if (retire_thread_.joinable()) retire_thread_.join();
  watch_->Stop();  // every finished checkpoint was reported to it
  prep.reset();  // frees a prepared pool nobody took
  staging_.reset();
  {
    MutexLock l(&agreed_mu_);
    jd_.reset();  // releases the writer lock
  }
  return st;
}

}  // namespace nonstop::engine_detail

namespace nonstop {

const char* LayerCopyName(LayerCopy c) {
  switch (c) {
    case LayerCopy::kHost:
      return "host";
    case LayerCopy::kDirect:
      return "direct";
    case LayerCopy::kDevice:
      return "device";
  }
  return "?";
}

bool ParseLayerCopy(std::string_view name, LayerCopy* out) {
  for (LayerCopy c : {LayerCopy::kHost, LayerCopy::kDirect, LayerCopy::kDevice}) {
    if (name == LayerCopyName(c)) {
      *out = c;
      return true;
    }
  }
  return false;
}

Status Engine::TakeError() { return Status::OK(); }

Result<int> Engine::AbandonOlderThan(uint64_t) {
  return Status::Unavailable("this engine cannot abandon checkpoints");
}

Status Engine::Pin(uint64_t) {
  return Status::Unavailable("this engine cannot pin checkpoints");
}
std::optional<CommittedCheckpoint> Engine::Candidate() { return std::nullopt; }
Status Engine::DropCandidate(uint64_t) {
  return Status::Unavailable("this engine cannot pin checkpoints");
}
AgreeOffer Engine::Offer() { return AgreeOffer{}; }
Result<bool> Engine::Aim(int64_t) {
  return Status::Unavailable("this engine cannot pin checkpoints");
}

Status Engine::AdoptRestored(uint64_t) { return Status::OK(); }
Status Engine::WriteAgreed(const AgreedRecord&) {
  return Status::FailedPrecondition("this engine keeps no agreed records");
}
Status Engine::PrepareStaging(uint64_t) { return Status::OK(); }
std::shared_ptr<CommitWatch> Engine::Watch() { return nullptr; }

Status Engine::SetRetention(const RetentionPolicy&) {
  return Status::Unavailable("this engine has no retention of kept copies");
}
Status Engine::DeleteKept(int64_t) {
  return Status::Unavailable("this engine cannot delete kept copies");
}

// Engines that do not implement layer-wise checkpoints say so.
Result<uint64_t> Engine::BeginCheckpoint(int64_t) {
  return Status::Unavailable("this engine has no layer-wise checkpoints");
}
Status Engine::CopyTensors(uint64_t, const std::vector<uint32_t>&) {
  return Status::Unavailable("this engine has no layer-wise checkpoints");
}
Status Engine::WaitTensorsCopied(const std::vector<uint32_t>&) {
  return Status::Unavailable("this engine has no layer-wise checkpoints");
}
Status Engine::WaitTensorsCopiedOnStream(const std::vector<uint32_t>& tensors, const Device&) {
  return WaitTensorsCopied(tensors);
}
Status Engine::EndCheckpoint(uint64_t, int64_t, std::string) {
  return Status::Unavailable("this engine has no layer-wise checkpoints");
}

Result<std::unique_ptr<Engine>> Engine::Open(const EngineOptions& opts) {
  return OpenEngine(opts, EngineMedia{});
}

Result<std::unique_ptr<Engine>> OpenEngine(const EngineOptions& opts, EngineMedia media) {
  auto engine = std::make_unique<engine_detail::EngineImpl>(opts, std::move(media));
  NONSTOP_RETURN_IF_ERROR(engine->Init().Annotate("open engine in " + opts.dir));
  return std::unique_ptr<Engine>(std::move(engine));
}

}  // namespace nonstop
