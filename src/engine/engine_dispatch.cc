// The training thread's side of a whole checkpoint (Checkpoint, the waits)
// and the dispatcher thread: takes checkpoints FIFO and copies each chunk into
// staging, a window of chunks ahead of the writers.
#include <cstring>
#include <deque>

#include "engine/engine_impl.h"

namespace nonstop::engine_detail {

Result<std::shared_ptr<Job>> EngineImpl::AdmitLocked(int64_t step, Clock::time_point t0,
                                                     bool layerwise, const char* what) {
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  // An earlier checkpoint's failure stays queued for TakeError() and the
  // wait calls: this checkpoint starts anyway, so one failure costs one.
  if (!reg_ || !file_) return Status::FailedPrecondition(std::string(what) + " before Register");
  NONSTOP_RETURN_IF_ERROR(RecordRollback());
  // The only place a checkpoint blocks on the pipeline: N already in flight
  // (unless they are all open layer-wise checkpoints, which cannot finish).
  // A slot the memory tier still copies is not free yet (mirror_deferred_):
  // then wait for it too, at most one copy's time.
  cv_.Wait(&mu_, [&]() REQUIRES(mu_) {
    if (in_flight_ >= opts_.max_in_flight) return in_flight_ == open_;
    return mirror_deferred_.empty() || free_slots_->SizeApprox() > 0;
  });
  if (in_flight_ >= opts_.max_in_flight) {
    return Status::FailedPrecondition(std::to_string(open_) +
                                      " layer-wise checkpoints are open (max_in_flight " +
                                      std::to_string(opts_.max_in_flight) +
                                      "): EndCheckpoint one first");
  }
  const Registration& reg = *reg_;
  // At most N snapshots and small buffers are out (one per in-flight
  // checkpoint, given back when it no longer reads them), and we hold one of
  // the N places, so one is free.
  if ((reg.snapshot_bytes > 0 && free_snapshots_.empty()) ||
      (layerwise && reg.small_bytes > 0 && free_small_.empty())) {
    return Status::Internal("no free snapshot buffer below max_in_flight");
  }
  std::optional<uint32_t> slot = free_slots_->Pop();
  if (!slot) return Status::Internal("no free slot with fewer than max_in_flight in flight");

  auto job = std::make_shared<Job>();
  job->counter = next_counter_++;
  job->step = step;
  job->slot = *slot;
  job->reg = reg_;
  job->file = file_;
  job->t_start = t0;
  const size_t n = reg.tensors.size();
  job->src.resize(n);
  job->src_device.resize(n);
  for (size_t i = 0; i < n; ++i) {
    job->src[i] = reg.tensors[i].data;
    job->src_device[i] = reg.tensors[i].device;
  }
  if (reg.snapshot_bytes > 0) {
    job->snapshot = free_snapshots_.back();
    free_snapshots_.pop_back();
  }
  if (layerwise) {
    job->layerwise = true;
    job->open = true;
    job->requested.assign(n, false);
    job->unit_crcs.assign(reg.lplan.units.size(), 0);
    job->remaining.store(reg.lplan.units.size() + 1);  // + 1: the seal
    job->tensor_left = std::make_unique<std::atomic<uint32_t>[]>(n);
    if (reg.small_bytes > 0) {
      job->small_buffer = free_small_.back();
      free_small_.pop_back();
    }
    ++open_;
  } else {
    job->crcs.assign(reg.plan.chunks.size(), 0);
    job->remaining.store(reg.plan.chunks.size());
  }
  ++in_flight_;
  unfinished_.insert(job->counter);
  live_[job->counter] = job;
  ++stats_.started;
  return job;
}

Result<uint64_t> EngineImpl::Checkpoint(int64_t step, std::string meta_json) {
  const auto t0 = Clock::now();
  MutexLock lock(&mu_);
  NONSTOP_ASSIGN_OR_RETURN(std::shared_ptr<Job> job,
                           AdmitLocked(step, t0, /*layerwise=*/false, "Checkpoint"));
  job->meta_json = std::move(meta_json);
  lock.Unlock();

  // copy_at_checkpoint tensors: copied now, on the caller's time, into the
  // snapshot buffer; the background pipeline reads the snapshot instead.
  Status st = SnapshotNow(job, /*skip_requested=*/false);
  if (!st.ok()) job->Fail(st.Annotate("copy_at_checkpoint"));

  lock.Lock();
  started_last_ = job->counter;
  dispatch_q_.push_back(DispatchItem{DispatchItem::kWhole, job, {}});
  const double stall = Seconds(t0, Clock::now());
  job->stall_s += stall;
  AddStall(stall);
  lock.Unlock();
  cv_.SignalAll();
  return job->counter;
}

// The training thread: copies the copy_at_checkpoint tensors (those not
// requested yet, with skip_requested) into the job's snapshot buffer, where
// the pipeline reads them from then on.
Status EngineImpl::SnapshotNow(const std::shared_ptr<Job>& job, bool skip_requested) {
  const Registration& reg = *job->reg;
  if (job->snapshot < 0) return Status::OK();
  std::byte* base = reg.snapshots[job->snapshot];
  std::vector<std::unique_ptr<CopyCompletion>> done;
  for (size_t i = 0; i < reg.tensors.size(); ++i) {
    if (reg.snapshot_offset[i] < 0 || (skip_requested && job->requested[i])) continue;
    std::byte* dst = base + reg.snapshot_offset[i];
    done.push_back(
        copy_->Copy(reg.tensors[i].data, reg.tensors[i].device, dst, reg.tensors[i].spec.nbytes));
    job->src[i] = dst;
    job->src_device[i] = Device{};
  }
  Status st;
  for (auto& d : done) {
    Status s = d->Wait();
    if (st.ok() && !s.ok()) st = s;
  }
  return st;
}

Status EngineImpl::WaitCopied() {
  const auto t0 = Clock::now();
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  if (copied_through_ < started_last_ || lw_copied_total_ < lw_requested_total_) {
    std::shared_ptr<Job> newest = live_.count(started_last_) ? live_[started_last_] : nullptr;
    cv_.Wait(&mu_, [&]() REQUIRES(mu_) {
      return copied_through_ >= started_last_ && lw_copied_total_ >= lw_requested_total_;
    });
    const double s = Seconds(t0, Clock::now());
    if (newest) newest->stall_s += s;
    AddStall(s);
  }
  return TakePendingError();
}

Status EngineImpl::WaitCommitted(uint64_t counter) {
  const auto t0 = Clock::now();
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  std::shared_ptr<Job> job = live_.count(counter) ? live_[counter] : nullptr;
  if (counter == 0 ? open_ > 0 : (job && job->open)) {
    return Status::FailedPrecondition("WaitCommitted on an open layer-wise checkpoint: "
                                      "EndCheckpoint first");
  }
  cv_.Wait(&mu_, [&]() REQUIRES(mu_) {
    return counter == 0 ? unfinished_.empty() : unfinished_.count(counter) == 0;
  });
  const double s = Seconds(t0, Clock::now());
  if (job) job->stall_s += s;
  AddStall(s);
  if (counter != 0) {
    for (auto it = pending_errors_.begin(); it != pending_errors_.end(); ++it) {
      if (it->first == counter) {
        Status st = it->second;
        pending_errors_.erase(it);
        return st;
      }
    }
  }
  return TakePendingError();
}

std::optional<CommittedCheckpoint> EngineImpl::Latest() {
  MutexLock lock(&mu_);
  return latest_;
}

void EngineImpl::DispatchLoop() {
  for (;;) {
    DispatchItem item;
    {
      MutexLock lock(&mu_);
      cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return stopping_ || !dispatch_q_.empty(); });
      if (dispatch_q_.empty()) return;
      item = std::move(dispatch_q_.front());
      dispatch_q_.pop_front();
    }
    const std::shared_ptr<Job>& job = item.job;
    if (item.kind == DispatchItem::kTensors) {
      CopyLayerTensors(job, item.tensors);
      continue;
    }
    if (item.kind == DispatchItem::kSeal) {
      SealLayerJob(job);
      continue;
    }
    CopyJob(job);
    {
      MutexLock lock(&mu_);
      if (job->snapshot >= 0) free_snapshots_.push_back(job->snapshot);
      copied_through_ = job->counter;
    }
    cv_.SignalAll();
  }
}

void EngineImpl::CopyJob(const std::shared_ptr<Job>& job) {
  const ChunkPlan& plan = job->reg->plan;
  const uint32_t n = static_cast<uint32_t>(plan.chunks.size());
  struct InCopy {
    uint32_t j;
    StagingPool::Chunk chunk;
    std::vector<std::unique_ptr<CopyCompletion>> done;
  };
  std::deque<InCopy> window;
  auto finish_front = [&] {
    InCopy& c = window.front();
    Status st;
    for (auto& d : c.done) {
      Status s = d->Wait();
      if (st.ok() && !s.ok()) st = s;
    }
    if (!st.ok()) job->Fail(st.Annotate("copy to staging"));
    if (job->failed.load(std::memory_order_acquire)) {
      staging_->Release(c.chunk);
      ChunksDone(job, 1);
    } else {
      const PlannedChunk& pc = plan.chunks[c.j];
      const StagingPool::Chunk chunk = c.chunk;
      SubmitWrite(job, UnitWrite{&job->crcs[c.j], pc.slot_offset, chunk.data, pc.bytes},
                  [this, chunk] { staging_->Release(chunk); });
    }
    window.pop_front();
  };
  uint32_t issued = 0;
  for (; issued < n && !job->failed.load(std::memory_order_acquire); ++issued) {
    Result<StagingPool::Chunk> chunk = staging_->Acquire();
    if (!chunk.ok()) {
      job->Fail(chunk.status());
      break;
    }
    const PlannedChunk& pc = plan.chunks[issued];
    InCopy c{issued, *chunk, {}};
    for (const ChunkSpan& g : pc.gaps) std::memset(c.chunk.data + g.offset, 0, g.bytes);
    for (const ChunkPiece& p : pc.pieces) {
      const auto* src = static_cast<const std::byte*>(job->src[p.tensor]) + p.tensor_offset;
      c.done.push_back(copy_->Copy(src, job->src_device[p.tensor], c.chunk.data + p.chunk_offset,
                                   p.bytes));
    }
    window.push_back(std::move(c));
    while (window.size() > static_cast<size_t>(window_)) finish_front();
  }
  while (!window.empty()) finish_front();
  {
    // The writers may already have finished every chunk, so the committer
    // can be reading the job's stats in FinishJob right now.
    MutexLock lock(&mu_);
    job->copy_s = Seconds(job->t_start, Clock::now());
  }
  if (issued < n) {
    ChunksDone(job, n - issued);
  } else if (n == 0) {
    MutexLock lock(&mu_);
    commit_q_.push_back(job);
    cv_.SignalAll();
  }
}

Result<int> EngineImpl::AbandonOlderThan(uint64_t counter) {
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  int n = 0;
  for (auto& [c, job] : live_) {
    if (c >= counter) break;  // live_ is ordered by counter
    if (job->open || job->dropped) continue;
    // Failing the job is what makes every stage skip it: the dispatcher stops
    // issuing its chunks, writers release them unwritten, the committer
    // finishes it without a commit. Its error is not queued (dropped, abandoned).
    job->dropped = true;
    job->abandoned = true;
    job->Fail(Status::Aborted("abandoned for a newer checkpoint"));
    ++n;
  }
  lock.Unlock();
  cv_.SignalAll();
  return n;
}

}  // namespace nonstop::engine_detail
