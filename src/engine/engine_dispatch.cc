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
  // The tiered cadence: the checkpoint commits into the memory tier's file,
  // whose slots never wait for the disk (engine_impl.h).
  // A snapshot (small) buffer goes back once the dispatcher has copied it
  // to staging, which can be after the writers committed its checkpoint
  // (in_flight_ dropped first): wait for it too, at most the moment the
  // dispatcher needs to take mu_ (TieredTest.BackToBack...).
  const bool to_memory = tiered_ && mem_file_ != nullptr;
  cv_.Wait(&mu_, [&]() REQUIRES(mu_) {
    if (in_flight_ >= opts_.max_in_flight) return in_flight_ == open_;
    if (reg_ && reg_->snapshot_bytes > 0 && free_snapshots_.empty()) return false;
    if (layerwise && reg_ && reg_->small_bytes > 0 && free_small_.empty()) return false;
    if (to_memory) return mem_free_->SizeApprox() > 0;
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
  std::optional<uint32_t> slot = to_memory ? mem_free_->Pop() : free_slots_->Pop();
  if (!slot) return Status::Internal("no free slot with fewer than max_in_flight in flight");

  auto job = std::make_shared<Job>();
  job->counter = next_counter_++;
  job->step = step;
  started_step_ = step;
  job->slot = *slot;
  job->reg = reg_;
  job->file = to_memory ? mem_file_ : file_;
  job->to_memory = to_memory;
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
  MarkMustCommit(*job);
  // Device snapshots: the set is free once the previous holder's drain is
  // complete; until then this checkpoint copies straight to the host.
  uint64_t wanted = 0;
  if (job->reg->dsnap_capacity > 0) {
    wanted = SnapshotBytesWanted(job->reg->device_bytes, job->reg->dsnap_capacity, dsnap_rates_);
    if (wanted > 0 && dsnap_busy_) {
      ++stats_.snapshot_busy;
      wanted = 0;
    }
    if (wanted > 0) dsnap_busy_ = true;
  }
  lock.Unlock();

  // copy_at_checkpoint tensors: copied now, on the caller's time, into the
  // snapshot buffer; the background pipeline reads the snapshot instead.
  Status st = SnapshotNow(job, /*skip_requested=*/false);
  if (!st.ok()) job->Fail(st.Annotate("copy_at_checkpoint"));
  StartDeviceSnapshot(*job, wanted);

  lock.Lock();
  started_last_ = job->counter;
  dispatch_q_.push_back(DispatchItem{DispatchItem::kWhole, job, {}});
  const double stall = Seconds(t0, Clock::now());
  job->stall_s += stall;
  AddStall(stall);
  if (job->reg->device_bytes > 0) ckpt_returned_ = Clock::now();
  lock.Unlock();
  cv_.SignalAll();
  return job->counter;
}

// Register: the device snapshot buffers within the budget, one allocation
// per device; the buffered tensors are taken highest slot offset first (the
// direct copies then read the front of the slot). Never fails: without
// buffers every checkpoint copies straight to the host, and
// device_snapshot_note says why.
void EngineImpl::AllocDeviceSnapshots(Registration& reg) {
  const size_t n = reg.tensors.size();
  reg.dsnap_buffer.assign(n, nullptr);
  std::map<int, std::vector<uint32_t>> eligible;  // per device, highest offset first
  for (size_t i = 0; i < n; ++i) {
    const TensorRef& t = reg.tensors[i];
    if (t.device.kind != DeviceKind::kCuda || t.staged) continue;
    if (reg.snapshot_offset[i] < 0) reg.device_bytes += t.spec.nbytes;
    if (t.copy_at_checkpoint || t.spec.nbytes == 0) continue;
    eligible[t.device.index].push_back(static_cast<uint32_t>(i));
  }
  stats_.device_snapshot_capacity = 0;
  std::string& note = stats_.device_snapshot_note;
  note.clear();
  if (reg.device_bytes == 0) return;
  const std::string state = std::to_string(reg.device_bytes) + " bytes of device tensors";
  if (opts_.device_snapshot_bytes == 0) {
    note = "off (device_snapshot_bytes=0): " + state + " copied straight to the host";
    return;
  }
  if (!copy_->CanSnapshotOnDevice()) {
    note = "off: " + copy_->Describe() + " keeps no snapshots in device memory";
    return;
  }
  if (opts_.layer_copy == LayerCopy::kDevice) {
    note = "off: layer_copy='device' holds its own device copies";
    return;
  }
  constexpr uint64_t kAlign = 256;
  std::vector<std::pair<int, void*>> allocs;
  std::vector<void*> buffer(n, nullptr);
  uint64_t capacity = 0;
  std::string refused;
  for (auto& [device, list] : eligible) {
    std::sort(list.begin(), list.end(), [&](uint32_t a, uint32_t b) {
      return reg.layout.tensors[a].data_offset > reg.layout.tensors[b].data_offset;
    });
    const uint64_t budget = opts_.device_snapshot_bytes > 0
                                ? static_cast<uint64_t>(opts_.device_snapshot_bytes)
                                : copy_->DeviceFreeBytes(device) / 4;
    std::vector<std::pair<uint32_t, uint64_t>> taken;  // tensor, offset in the allocation
    uint64_t used = 0;
    for (uint32_t i : list) {  // first fit along the order
      const uint64_t need = (reg.tensors[i].spec.nbytes + kAlign - 1) / kAlign * kAlign;
      if (used + need > budget) continue;
      taken.emplace_back(i, used);
      used += need;
    }
    if (used == 0) continue;
    auto* base = static_cast<std::byte*>(copy_->AllocDevice(device, used));
    if (base == nullptr) {
      refused = "cannot allocate " + std::to_string(used) + " bytes on device " +
                std::to_string(device);
      continue;
    }
    allocs.emplace_back(device, base);
    for (auto& [i, off] : taken) {
      buffer[i] = base + off;
      capacity += reg.tensors[i].spec.nbytes;
    }
  }
  reg.dsnap_allocs = std::move(allocs);
  reg.dsnap_buffer = std::move(buffer);
  for (auto& [device, list] : eligible) {
    for (uint32_t i : list) {
      if (reg.dsnap_buffer[i] != nullptr) reg.dsnap_order.push_back(i);
    }
  }
  reg.dsnap_capacity = capacity;
  stats_.device_snapshot_capacity = capacity;
  const std::string budget =
      opts_.device_snapshot_bytes > 0
          ? "device_snapshot_bytes " + std::to_string(opts_.device_snapshot_bytes)
          : "a quarter of free device memory";
  if (capacity == 0) {
    note = "off: " + (refused.empty() ? "no device tensor fits " + budget : refused) + "; " +
           state + " copied straight to the host";
  } else if (capacity < reg.device_bytes) {
    note = "partial: " + std::to_string(capacity) + " of " + state + " fit " + budget +
           (refused.empty() ? "" : " (" + refused + ")") + "; the rest is copied straight";
  } else {
    note = "on: all " + state + " fit " + budget;
  }
}

// Checkpoint(): starts the device-to-device copies of the buffered tensors,
// in dsnap_order, until `wanted` bytes; the job's pieces of them are drained
// from the buffers. Training may overwrite a tensor once its copy is done
// (the dispatcher waits for them before it releases the job).
void EngineImpl::StartDeviceSnapshot(Job& job, uint64_t wanted) {
  const Registration& reg = *job.reg;
  if (reg.device_bytes == 0) return;
  job.drain.assign(reg.tensors.size(), false);
  job.dsnap = wanted > 0;
  job.t_d2d = Clock::now();
  uint64_t taken = 0;
  for (uint32_t i : reg.dsnap_order) {
    if (taken >= wanted) break;
    const TensorRef& t = reg.tensors[i];
    job.d2d.push_back(copy_->SnapshotToDevice(t.data, t.device, reg.dsnap_buffer[i], t.spec.nbytes));
    job.src[i] = reg.dsnap_buffer[i];
    job.drain[i] = true;
    taken += t.spec.nbytes;
  }
  job.snapshot_bytes = taken;
  job.direct_bytes = reg.device_bytes - taken;
}

// The dispatcher: training may overwrite the job's sources from now on.
void EngineImpl::ReleaseJob(Job& job) {
  {
    MutexLock lock(&mu_);
    if (released_through_ >= job.counter) return;
    released_through_ = job.counter;
    job.release_s = Seconds(job.t_start, Clock::now());
  }
  cv_.SignalAll();
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
  if (ckpt_returned_) {  // the window the direct copies overlap (device_snapshot.h)
    const double w = Seconds(*ckpt_returned_, t0);
    dsnap_rates_.window_s = dsnap_rates_.window_s < 0 ? w : 0.7 * dsnap_rates_.window_s + 0.3 * w;
    ckpt_returned_.reset();
  }
  if (released_through_ < started_last_ || lw_copied_total_ < lw_requested_total_) {
    std::shared_ptr<Job> newest = live_.count(started_last_) ? live_[started_last_] : nullptr;
    cv_.Wait(&mu_, [&]() REQUIRES(mu_) {
      return released_through_ >= started_last_ && lw_copied_total_ >= lw_requested_total_;
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
  if (!latest_) return latest_;
  CommittedCheckpoint c = *latest_;
  c.on_disk = c.counter <= disk_counter_;
  return c;
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
      // Every drain of the snapshot set is complete: the next job may take it.
      if (job->dsnap) dsnap_busy_ = false;
      copied_through_ = job->counter;
      released_through_ = std::max(released_through_, job->counter);
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
  // Chunk order: with a device snapshot, first the chunks that read the
  // sources themselves (the direct copies), then those drained from the
  // snapshot only; the job is released in between. Any order is fine for
  // the writers and the committer (each chunk has its offset and crc).
  std::vector<uint32_t> order;
  uint32_t first_group = n;  // chunks before the release
  auto t_pickup = Clock::now();
  if (job->dsnap) {
    bool pending = false;
    for (auto& d : job->d2d) pending = pending || !d->Ready();
    Status st;
    for (auto& d : job->d2d) {
      Status s = d->Wait();
      if (st.ok() && !s.ok()) st = s;
    }
    if (!st.ok()) job->Fail(st.Annotate("device snapshot"));
    const double d2d_s = Seconds(job->t_d2d, Clock::now());
    if (pending && d2d_s > 0 && st.ok()) {  // observed the copies finish: a fair sample
      MutexLock lock(&mu_);
      dsnap_rates_.d2d_Bps =
          RateEwma(dsnap_rates_.d2d_Bps, static_cast<double>(job->snapshot_bytes) / d2d_s);
    }
    t_pickup = Clock::now();  // the copies to the host start after the snapshot
    for (uint32_t j = 0; j < n; ++j) {
      bool direct = false;
      for (const ChunkPiece& p : plan.chunks[j].pieces) direct = direct || !job->drain[p.tensor];
      if (direct) order.push_back(j);
    }
    first_group = static_cast<uint32_t>(order.size());
    for (uint32_t j = 0; j < n; ++j) {
      bool direct = false;
      for (const ChunkPiece& p : plan.chunks[j].pieces) direct = direct || !job->drain[p.tensor];
      if (!direct) order.push_back(j);
    }
    if (first_group == 0) ReleaseJob(*job);
  }
  uint32_t issued = 0;
  for (; issued < n && !job->failed.load(std::memory_order_acquire); ++issued) {
    Result<StagingPool::Chunk> chunk = staging_->Acquire();
    if (!chunk.ok()) {
      job->Fail(chunk.status());
      break;
    }
    const uint32_t j = order.empty() ? issued : order[issued];
    const PlannedChunk& pc = plan.chunks[j];
    InCopy c{j, *chunk, {}};
    for (const ChunkSpan& g : pc.gaps) std::memset(c.chunk.data + g.offset, 0, g.bytes);
    for (const ChunkPiece& p : pc.pieces) {
      const auto* src = static_cast<const std::byte*>(job->src[p.tensor]) + p.tensor_offset;
      std::byte* dst = c.chunk.data + p.chunk_offset;
      const Device& dev = job->src_device[p.tensor];
      c.done.push_back(job->dsnap && job->drain[p.tensor]
                           ? copy_->DrainToHost(src, dev.index, dst, p.bytes)
                           : copy_->Copy(src, dev, dst, p.bytes));
    }
    window.push_back(std::move(c));
    if (issued + 1 == first_group && job->dsnap) {
      // The direct copies: all done before training may go on.
      while (!window.empty()) finish_front();
      ReleaseJob(*job);
      continue;
    }
    while (window.size() > static_cast<size_t>(window_)) finish_front();
  }
  while (!window.empty()) finish_front();
  {
    // The writers may already have finished every chunk, so the committer
    // can be reading the job's stats in FinishJob right now.
    MutexLock lock(&mu_);
    const auto now = Clock::now();
    job->copy_s = Seconds(job->t_start, now);
    const uint64_t moved = job->snapshot_bytes + job->direct_bytes;
    const double s = Seconds(t_pickup, now);
    if (moved > 0 && s > 0 && issued == n && !job->failed.load(std::memory_order_acquire)) {
      // Device bytes to the host over the copy time: a lower bound of the
      // bandwidth (the copies may have waited for staging), so the plan errs
      // towards snapshotting more.
      dsnap_rates_.d2h_Bps = RateEwma(dsnap_rates_.d2h_Bps, static_cast<double>(moved) / s);
    }
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
