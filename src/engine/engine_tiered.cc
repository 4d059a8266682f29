// The tiered cadence (EngineOptions::disk_every != 1; docs/ARCHITECTURE.md
// "Tiered cadence"): checkpoints commit into the memory tier's segment at the
// training cadence, and the persister thread copies the newest offered one
// to the slot file on disk at the disk's pace. engine_impl.h says which
// state belongs to it and why training never waits for the disk.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "engine/engine_impl.h"

namespace nonstop::engine_detail {

uint64_t EngineImpl::SegmentNewestCounter() {
  return MemorySegmentNewestCounter(opts_.dir, rank(), opts_.shm_dir, opts_.env);
}

Status EngineImpl::PrepareMemFile() {
  if (!tiered_ || !file_) return Status::OK();
  const StoreGeometry& dg = file_->geometry();
  if (mem_file_ && mem_file_->geometry().slot_bytes == dg.slot_bytes) return Status::OK();
  // Slot ids and the retained slot belong to one file: switch with nothing
  // in flight. The segment under its name keeps the newest memory
  // checkpoint of before (a restart restores it) until the new file's
  // first commit is renamed over it (FinishJob).
  NONSTOP_RETURN_IF_ERROR(WaitAllFinished());
  StoreGeometry g = dg;
  g.slots = WantedSlots() + 1;  // + the one the persister may be reading
  Result<std::shared_ptr<SlotFile>> f = memory_->CreateTierFile(g);
  if (!f.ok()) {
    // Not a failure of the engine: every checkpoint goes to disk instead.
    std::fprintf(stderr, "nonstop: tiered cadence off (disk_every=%d): %s; every checkpoint goes "
                 "to disk\n", opts_.disk_every, f.status().ToString().c_str());
    stats_.persist_error = "tiered cadence off: " + f.status().ToString();
    stats_.disk_every = 1;
    tiered_ = false;
    mem_file_.reset();
    return Status::OK();
  }
  mem_file_ = std::move(f).value();
  mem_pending_rename_ = true;
  mem_retained_.reset();
  mem_free_ = std::make_unique<SlotQueue>(g.slots);
  for (uint32_t s = 0; s < g.slots; ++s) mem_free_->Push(s);
  return Status::OK();
}

void EngineImpl::MemRelease(uint32_t slot) {
  if (persist_hold_ && persist_hold_->first == mem_file_.get() && persist_hold_->second == slot) {
    persist_deferred_ = true;
    return;
  }
  mem_free_->Push(slot);
}

void EngineImpl::PersistLoop() {
  MutexLock lock(&mu_);
  for (;;) {
    cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return persist_stop_ || persist_next_.has_value(); });
    if (!persist_next_) return;  // stopping, nothing left to persist
    PersistItem item = std::move(*persist_next_);
    persist_next_.reset();
    if (item.info.counter <= disk_counter_) {  // on disk already (Close offers the newest again)
      lock.Unlock();
      cv_.SignalAll();  // a waiter for persist_next_ to be taken (Close)
      lock.Lock();
      continue;
    }
    persist_busy_ = true;
    persist_hold_ = {item.file.get(), item.info.slot};
    lock.Unlock();
    const auto t0 = Clock::now();
    Status st = PersistOne(item);
    const double secs = Seconds(t0, Clock::now());
    lock.Lock();
    const bool deferred = persist_deferred_;
    persist_hold_.reset();
    persist_deferred_ = false;
    if (deferred && item.file == mem_file_) mem_free_->Push(item.info.slot);
    if (st.ok()) {
      ++stats_.persisted;
      stats_.persist_s_total += secs;
      persist_reported_ = false;
    } else {
      ++stats_.persist_failures;
      stats_.persist_error = st.ToString();
      if (!persist_reported_) {  // once until the disk works again
        std::fprintf(stderr, "nonstop: persisting checkpoint #%llu to disk: %s; it stays in "
                     "the memory tier only until a newer one is persisted\n",
                     static_cast<unsigned long long>(item.info.counter), st.ToString().c_str());
        persist_reported_ = true;
      }
    }
    persist_busy_ = false;
    lock.Unlock();
    cv_.SignalAll();
    lock.Lock();
  }
}

Status EngineImpl::PersistOne(const PersistItem& item) {
  const CheckpointInfo& info = item.info;
  std::shared_ptr<SlotFile> disk;
  uint32_t slot = 0;
  {
    MutexLock lock(&mu_);
    if (!file_) return Status::FailedPrecondition("no slot file on disk");
    std::optional<uint32_t> s = free_slots_->Pop();
    if (!s) return Status::Internal("no free slot on disk for the persister");
    disk = file_;
    slot = *s;
  }
  auto give_back = [&]() {
    MutexLock lock(&mu_);
    if (disk == file_) free_slots_->Push(slot);
  };
  Result<CheckpointInfo> committed = CopyCheckpointToSlot(*item.file, info, *disk, slot);
  Status st = committed.status();
  if (!st.ok()) {
    // A failed sync poisons what was written before it: the medium is
    // reopened for the next persist (engine_commit.cc, AfterFailedSync),
    // and nothing reports this checkpoint on disk. Its record, if one
    // reached the file, names the same bytes as the memory's: a later read
    // verifies them chunk by chunk.
    if (SlotMedium* sm = SlotOf(*disk); sm != nullptr && sm->sync_failed()) {
      Status rs = sm->Reopen();
      if (!rs.ok()) std::fprintf(stderr, "nonstop: %s\n", rs.message().c_str());
    }
    give_back();
    return st.Annotate("persisting checkpoint #" + std::to_string(info.counter) + " (step " +
                       std::to_string(info.step) + ") to " + disk->medium().Describe());
  }
  MutexLock lock(&mu_);
  if (disk != file_) return Status::OK();  // a Register replaced the file meanwhile
  if (pending_rename_) {  // the first commit into a new slot file makes it the file
    Status rs = PublishTemp(*file_);
    if (!rs.ok()) {
      free_slots_->Push(slot);
      return rs;
    }
    pending_rename_ = false;
    old_file_.reset();
  }
  if (retained_slot_) ReleaseSlot(file_.get(), *retained_slot_);
  retained_slot_ = slot;
  disk_counter_ = std::max(disk_counter_, info.counter);
  stats_.persisted_counter = disk_counter_;
  for (CheckpointStats& cs : stats_.recent) {
    if (cs.counter == info.counter) cs.tiers = "memory+disk";
  }
  return Status::OK();
}

}  // namespace nonstop::engine_detail
