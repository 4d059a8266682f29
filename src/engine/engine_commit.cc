// The committer thread and what follows a commit: claims, commits through
// SlotFile, finishes checkpoints; retention; the distributed pin.
#include <algorithm>
#include <cstdio>

#include "engine/engine_impl.h"

namespace nonstop::engine_detail {

void EngineImpl::CommitLoop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      MutexLock lock(&mu_);
      cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return (stopping_ && in_flight_ == 0) || !commit_q_.empty(); });
      if (commit_q_.empty()) return;
      job = commit_q_.front();
      commit_q_.pop_front();
    }
    Status st = job->TakeError();
    if (!st.ok()) {
      FinishJob(job, false, false, st);
      continue;
    }
    // An earlier failed commit whose note could not be written: nothing
    // newer commits before it is (a restart must never choose that one).
    if (Status ns = NoteNotDurable(); !ns.ok()) {
      FinishJob(job, false, false, ns);
      continue;
    }
    // An older checkpoint a retention rule keeps is still being written: a
    // claim now would supersede it (and its best= metrics or its kept copy
    // with it), so this one waits until that one is finished.
    {
      MutexLock lock(&mu_);
      if (!must_commit_.empty() && *must_commit_.begin() < job->counter) {
        deferred_.push_back(job);
        continue;
      }
    }
    // Claim: only a counter above every claimed one may commit (PCcheck's CAS
    // rule, on all 64 bits). A late older checkpoint is superseded.
    uint64_t cur = claimed_.load(std::memory_order_acquire);
    bool won = false;
    while (cur < job->counter) {
      if (claimed_.compare_exchange_weak(cur, job->counter, std::memory_order_acq_rel)) {
        won = true;
        break;
      }
    }
    if (!won) {
      FinishJob(job, false, true, Status::OK());
      continue;
    }
    CommitRequest req;
    req.slot = job->slot;
    req.counter = job->counter;
    req.step = job->step;
    req.layout = &job->reg->layout;
    req.crc_chunk_bytes = static_cast<uint32_t>(chunk_bytes_);
    req.chunk_crcs = job->layerwise ? job->reg->lplan.ChunkCrcs(job->unit_crcs) : job->crcs;
    req.meta_json = job->meta_json;
    Result<CheckpointInfo> info = job->file->Commit(req);
    if (!info.ok()) {
      // A failed fsync poisons everything written to the file before it.
      if (SlotMedium* sm = SlotOf(*job->file); sm != nullptr && sm->sync_failed()) {
        AfterFailedSync(job, *sm);
      }
      // Its record may be in the file (readable from the page cache, and
      // perhaps kept by a power cut): note durably, in the job directory's
      // lineage record, that it is never to be chosen (FORMAT.md).
      unnoted_.push_back(job->counter);
      Status failed = info.status().Annotate("commit");
      if (Status ns = NoteNotDurable(); !ns.ok()) {
        failed = Status(failed.code(), failed.message() + "; and noting it as never durable " +
                                           "failed (retried before the next commit): " +
                                           ns.message());
      }
      // Give the claim back so an older in-flight checkpoint may still commit.
      uint64_t expected = job->counter;
      uint64_t durable;
      {
        MutexLock lock(&mu_);
        durable = committed_counter_;
      }
      claimed_.compare_exchange_strong(expected, durable, std::memory_order_acq_rel);
      FinishJob(job, false, false, failed);
      continue;
    }
    RetentionPolicy retention;
    {
      MutexLock lock(&mu_);
      retention = retention_;
    }
    retention.keep_every = opts_.keep_every;
    if (retention.MakesCopies()) {
      // The checkpoint is committed whatever happens here; a failed copy is
      // reported on the next call like any background error. The copy
      // (keep/step-N/rank-R.nsck: temp name, verified copy, sync, rename,
      // SyncDir; redone at the next open after a kill) runs while this
      // checkpoint is the newest and its slot cannot be reused.
      Status ks = jd_->Retain(*job->file, info.value(), retention);
      if (!ks.ok()) {
        MutexLock lock(&mu_);
        pending_errors_.emplace_back(job->counter, ks);
      }
    }
    job->info = info.value();
    if (job->to_memory) {  // the tiered cadence: FinishJob publishes it and offers it to the disk
      FinishJob(job, true, false, Status::OK());
      continue;
    }
    // The memory tier copies it in the background; its slot is held until
    // the copy ends (ReleaseSlot defers a release that comes first).
    {
      MutexLock lock(&mu_);
      ++mirror_holds_[{job->file.get(), job->slot}];
    }
    if (!memory_->Submit(job->file, info.value())) MirrorDone(job->file, job->slot);
    FinishJob(job, true, false, Status::OK());
  }
}

void EngineImpl::MarkMustCommit(Job& job) {
  const bool kept_every = opts_.keep_every > 0 && job.counter % opts_.keep_every == 0;
  const bool best = retention_.best_k > 0 && !retention_.best_metric.empty() &&
                    CheckpointMetric(job.meta_json, retention_.best_metric).has_value();
  job.must_commit = kept_every || best;
  if (job.must_commit) must_commit_.insert(job.counter);
}

void EngineImpl::ReleaseSlot(const SlotFile* file, uint32_t slot) {
  if (file != file_.get()) return;  // a replaced file's slots are not reused
  if (mirror_holds_.count({file, slot}) != 0) {
    mirror_deferred_.insert({file, slot});
    return;
  }
  free_slots_->Push(slot);
}

void EngineImpl::MirrorDone(const std::shared_ptr<SlotFile>& file, uint32_t slot) {
  MutexLock lock(&mu_);
  const std::pair<const SlotFile*, uint32_t> key{file.get(), slot};
  auto it = mirror_holds_.find(key);
  if (it == mirror_holds_.end() || --it->second > 0) return;
  mirror_holds_.erase(it);
  if (mirror_deferred_.erase(key) != 0 && file == file_) free_slots_->Push(slot);
  lock.Unlock();
  cv_.SignalAll();
}

Status EngineImpl::NoteNotDurable() {
  while (!unnoted_.empty()) {
    NONSTOP_RETURN_IF_ERROR(jd_->RecordNotDurable(rank(), unnoted_.front()));
    unnoted_.erase(unnoted_.begin());
  }
  return Status::OK();
}

// On Linux a failed fsync drops the dirty pages it could not write and
// consumes the error: the next fsync of the file returns 0 though those
// bytes never reached the disk, a new descriptor never hears of it, and the
// page cache goes on showing them until it drops them. So every checkpoint in
// flight on this file may have lost bytes whatever its own sync says later:
// fail them all (their slots go back as they finish; the newest committed
// checkpoint was durable before and is untouched), then reopen the file so
// that later checkpoints, which rewrite every page they depend on (their
// whole slot with its padding, the padded table, a whole record block), can
// commit (docs/FORMAT.md "After a failed fsync"). If it cannot be reopened
// the medium stays dead and every later checkpoint fails with one line.
void EngineImpl::AfterFailedSync(const std::shared_ptr<Job>& failed, SlotMedium& sm) {
  const std::string path = sm.path();
  {
    MutexLock lock(&mu_);
    not_durable_.insert(failed->counter);
    for (auto& [c, job] : live_) {
      if (job == failed || job->file != failed->file) continue;
      job->Fail(Status::IOError("its bytes were written before a failed fsync of " + path +
                                ", so it is not committed"));
    }
  }
  Status rs = sm.Reopen();
  if (!rs.ok()) std::fprintf(stderr, "nonstop: %s\n", rs.message().c_str());
}

void EngineImpl::FinishJob(const std::shared_ptr<Job>& job, bool committed, bool superseded,
                           Status st) {
  const double persist_s = Seconds(job->t_start, Clock::now());
  MutexLock lock(&mu_);
  // The first commit into a resized file makes it the file: rename it over the
  // old one and sync the directory, so the old committed checkpoint is
  // replaced by a newer committed one in one atomic step.
  // In distributed mode the old file holds the pinned checkpoint: Pin renames.
  // The tiered cadence's file likewise becomes the segment at its first
  // commit; until that rename the commit is not reported.
  if (committed && job->to_memory && mem_pending_rename_ && job->file == mem_file_) {
    Status rs = memory_->PublishTierFile();
    if (!rs.ok()) {
      st = rs.Annotate("publishing the memory tier's segment");
      committed = false;
    } else {
      mem_pending_rename_ = false;
    }
  }
  if (committed && pending_rename_ && job->file == file_ && !opts_.global_agreement) {
    Status rs = PublishTemp(*file_);
    if (!rs.ok()) {
      st = rs;
      committed = false;
    } else {
      pending_rename_ = false;
      old_file_.reset();
    }
  }
  // A layer-wise checkpoint holds its small-region buffer and snapshot until
  // it is finished (kDirect writers read the snapshot); buffers of an older
  // registration are freed with it instead.
  if (job->layerwise && job->reg == reg_) {
    if (job->small_buffer >= 0) free_small_.push_back(job->small_buffer);
    if (job->snapshot >= 0) free_snapshots_.push_back(job->snapshot);
  }
  // Slots go back before in_flight_ drops (see slot_queue.h).
  if (committed) {
    if (job->file == file_ && opts_.global_agreement) {
      // Keep the oldest committed above the pinned one: the slow peers will
      // commit it next, so it can be agreed on; later ones are not kept.
      if (!retained_slot_ && job->step >= aim_) {
        retained_slot_ = job->slot;
        candidate_ = CommittedCheckpoint{job->counter, job->step};
      } else {
        ReleaseSlot(job->file.get(), job->slot);
      }
    } else if (job->file == file_) {
      if (retained_slot_) ReleaseSlot(file_.get(), *retained_slot_);
      retained_slot_ = job->slot;
    }
    if (job->to_memory) {
      if (job->file == mem_file_) {
        if (mem_retained_) MemRelease(*mem_retained_);
        mem_retained_ = job->slot;
      }
      // Offered to the disk: every disk_every-th (0: each), and always
      // while an older offer still waits (the disk takes the newest).
      PersistItem item{job->file, *job->info};
      ++mem_commits_;
      if (opts_.disk_every <= 1 || mem_commits_ % static_cast<uint64_t>(opts_.disk_every) == 0 ||
          persist_next_) {
        persist_next_ = item;
      }
      mem_newest_ = std::move(item);
    } else if (job->file == file_) {
      disk_counter_ = std::max(disk_counter_, job->counter);
      stats_.persisted_counter = disk_counter_;
    }
    committed_counter_ = std::max(committed_counter_, job->counter);
    latest_ = CommittedCheckpoint{job->counter, job->step};
    ++stats_.committed;
  } else {
    if (job->to_memory && job->file == mem_file_) mem_free_->Push(job->slot);
    if (job->file == file_) free_slots_->Push(job->slot);
    if (superseded) {
      ++stats_.superseded;
    } else if (job->dropped) {
      ++stats_.abandoned;
    } else {
      ++stats_.failed;
      st = st.Annotate("checkpoint " + std::to_string(job->counter) + " (step " +
                       std::to_string(job->step) + ")");
      if (!job->abandoned) pending_errors_.emplace_back(job->counter, st);
    }
  }
  RecordFinished(*job, committed, superseded, st, persist_s);
  if (job->must_commit && must_commit_.erase(job->counter) != 0 && !deferred_.empty()) {
    // The jobs it held back go first, oldest first (the loop defers again
    // those an older kept checkpoint still holds).
    std::sort(deferred_.begin(), deferred_.end(),
              [](const std::shared_ptr<Job>& a, const std::shared_ptr<Job>& b) {
                return a->counter < b->counter;
              });
    commit_q_.insert(commit_q_.begin(), deferred_.begin(), deferred_.end());
    deferred_.clear();
  }
  unfinished_.erase(job->counter);
  live_.erase(job->counter);
  --in_flight_;
  lock.Unlock();
  cv_.SignalAll();
}

Status EngineImpl::SetRetention(const RetentionPolicy& policy) {
  if (policy.best_k > 0 && policy.best_metric.empty()) {
    return Status::InvalidArgument("best-k retention needs a metric name");
  }
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  retention_ = policy;
  return Status::OK();
}

Status EngineImpl::DeleteKept(int64_t step) {
  {
    MutexLock lock(&mu_);
    NONSTOP_RETURN_IF_ERROR(CheckOpen());
    NONSTOP_RETURN_IF_ERROR(WaitAllFinished());
  }
  return jd_->DeleteKept(step);
}

Status EngineImpl::Pin(uint64_t counter) {
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  if (!opts_.global_agreement) {
    return Status::FailedPrecondition("Pin needs EngineOptions::global_agreement");
  }
  if (pinned_ && pinned_->counter == counter) return Status::OK();
  aim_ = INT64_MIN;
  if (candidate_ && candidate_->counter == counter && retained_slot_) {
    if (pending_rename_) {  // the first pin in a resized file makes it the file
      NONSTOP_RETURN_IF_ERROR(PublishTemp(*file_));
      pending_rename_ = false;
      old_file_.reset();
    }
    if (pinned_slot_ && pinned_file_ == file_) ReleaseSlot(file_.get(), *pinned_slot_);
    pinned_slot_ = retained_slot_;
    pinned_ = candidate_;
    pinned_file_ = file_;
    retained_slot_.reset();
    candidate_.reset();
    return Status::OK();
  }
  // A checkpoint found on open (before the first restore): rebuild the queue.
  if (in_flight_ > 0) {
    return Status::FailedPrecondition("Pin of checkpoint #" + std::to_string(counter) +
                                      " (not the candidate) while checkpoints are in flight");
  }
  if (!file_ || pending_rename_) {
    return Status::NotFound("checkpoint #" + std::to_string(counter) + " is not held in " +
                            opts_.dir);
  }
  ScanOptions so;
  so.verify_data = false;
  NONSTOP_ASSIGN_OR_RETURN(ScanReport report, file_->Scan(so));
  const CheckpointInfo* info = nullptr;
  for (const ScannedCheckpoint& c : report.checkpoints) {
    if (c.state == CheckpointState::kCommitted && c.info.counter == counter) info = &c.info;
  }
  if (info == nullptr) {
    return Status::NotFound("checkpoint #" + std::to_string(counter) + " is not committed in " +
                            file_->medium().Describe());
  }
  pinned_slot_ = info->slot;
  pinned_ = CommittedCheckpoint{info->counter, info->step};
  pinned_file_ = file_;
  if (retained_slot_ && (*retained_slot_ == info->slot || candidate_->counter < counter)) {
    retained_slot_.reset();
    candidate_.reset();
  }
  const uint32_t slots = file_->geometry().slots;
  free_slots_ = std::make_unique<SlotQueue>(slots);
  for (uint32_t s = 0; s < slots; ++s) {
    if (s != *pinned_slot_ && (!retained_slot_ || s != *retained_slot_)) free_slots_->Push(s);
  }
  return Status::OK();
}

std::optional<CommittedCheckpoint> EngineImpl::Candidate() {
  MutexLock lock(&mu_);
  return candidate_;
}

Status EngineImpl::DropCandidate(uint64_t counter) {
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  if (candidate_ && candidate_->counter == counter && retained_slot_) {
    ReleaseSlot(file_.get(), *retained_slot_);
    retained_slot_.reset();
    candidate_.reset();
  }
  return Status::OK();
}

AgreeOffer EngineImpl::Offer() {
  MutexLock lock(&mu_);
  AgreeOffer o;
  if (candidate_ && retained_slot_) {
    o.candidate = candidate_->step;
    o.counter = candidate_->counter;
  }
  if (latest_) o.committed = latest_->step;
  o.started = std::max(o.committed, started_step_.value_or(-1));
  return o;
}

Result<bool> EngineImpl::Aim(int64_t step) {
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  if (!opts_.global_agreement) {
    return Status::FailedPrecondition("Aim needs EngineOptions::global_agreement");
  }
  aim_ = step;
  if (candidate_ && retained_slot_ && candidate_->step < step) {
    ReleaseSlot(file_.get(), *retained_slot_);
    retained_slot_.reset();
    candidate_.reset();
    return true;
  }
  return false;
}

Status EngineImpl::WriteAgreed(const AgreedRecord& rec) {
  // Not under mu_: the record's fsyncs never stall the training thread.
  MutexLock l(&agreed_mu_);
  if (!jd_) return Status::FailedPrecondition("the engine of " + opts_.dir + " is closed");
  NONSTOP_RETURN_IF_ERROR(jd_->WriteAgreed(rec));
  watch_->Agreed(rec.step);  // the handles of the checkpoints it covers settle
  return Status::OK();
}

}  // namespace nonstop::engine_detail
