// Layer-wise checkpoints (LightCheck): the EngineImpl methods behind
// BeginCheckpoint / CopyTensors / WaitTensorsCopied / EndCheckpoint.
// A schedule of the one pipeline: the copies start tensor by tensor as the
// caller asks, and training waits per tensor.
//
// A layer-wise job is a Job with `layerwise` set. Its bytes are the units of
// the registration's LayerPlan; `remaining` counts units + 1 (the seal), so it
// reaches the committer only after EndCheckpoint and after every unit is
// written. Per-tensor copy requests go through the dispatcher's FIFO queue, so
// the copies of one tensor for successive checkpoints finish in order and
// lw_copied_[t] catches up with lw_requested_[t] in order.
//
// Who touches what:
//   training thread  Begin/Copy/Wait/End: job->open, job->requested,
//                    lw_requested_ (all under mu_); copy_at_checkpoint
//                    snapshots in EndCheckpoint before their copies are queued.
//   dispatcher       copies units to staging (kHost), snapshots (kDevice) or
//                    hands them to the writers (kDirect, and every staged
//                    tensor: TensorRef::staged); small tensors into the job's
//                    small buffer; MarkCopied.
//   writers          write a unit, crc it into job->unit_crcs[u], ChunksDone.
#include <algorithm>
#include <cstring>
#include <deque>

#include "engine/engine_impl.h"

namespace nonstop::engine_detail {

// A completion waited on by several writer threads (a completion is for one
// thread at a time).
class SharedCompletion {
 public:
  explicit SharedCompletion(std::unique_ptr<CopyCompletion> c) : c_(std::move(c)) {}
  Status Wait() {
    MutexLock lock(&mu_);
    return c_->Wait();
  }

 private:
  Mutex mu_;
  std::unique_ptr<CopyCompletion> c_ GUARDED_BY(mu_);
};

Result<std::shared_ptr<Job>> EngineImpl::OpenLayerJob(uint64_t counter) {
  auto it = live_.find(counter);
  if (it == live_.end() || !it->second->layerwise || !it->second->open) {
    return Status::FailedPrecondition("checkpoint " + std::to_string(counter) +
                                      " is not an open layer-wise checkpoint");
  }
  return it->second;
}

Result<uint64_t> EngineImpl::BeginCheckpoint(int64_t step) {
  const auto t0 = Clock::now();
  MutexLock lock(&mu_);
  NONSTOP_ASSIGN_OR_RETURN(std::shared_ptr<Job> job,
                           AdmitLocked(step, t0, /*layerwise=*/true, "BeginCheckpoint"));
  const double stall = Seconds(t0, Clock::now());
  job->stall_s += stall;
  AddStall(stall);
  return job->counter;
}

Status EngineImpl::CopyTensors(uint64_t counter, const std::vector<uint32_t>& tensors) {
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  NONSTOP_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, OpenLayerJob(counter));
  DispatchItem item{DispatchItem::kTensors, job, {}};
  for (uint32_t t : tensors) {
    if (t >= job->requested.size()) {
      return Status::InvalidArgument("tensor index " + std::to_string(t) + " is not below the " +
                                     std::to_string(job->requested.size()) + " registered");
    }
  }
  for (uint32_t t : tensors) {
    if (job->requested[t]) continue;
    job->requested[t] = true;
    ++lw_requested_[t];
    ++lw_requested_total_;
    item.tensors.push_back(t);
  }
  if (item.tensors.empty()) return Status::OK();
  dispatch_q_.push_back(std::move(item));
  lock.Unlock();
  cv_.SignalAll();
  return Status::OK();
}

Status EngineImpl::WaitTensorsCopied(const std::vector<uint32_t>& tensors) {
  const auto t0 = Clock::now();
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  for (uint32_t t : tensors) {
    if (t >= lw_requested_.size()) {
      return Status::InvalidArgument("tensor index " + std::to_string(t) + " is not below the " +
                                     std::to_string(lw_requested_.size()) + " registered");
    }
  }
  auto all_copied = [&]() REQUIRES(mu_) {
    for (uint32_t t : tensors) {
      if (lw_copied_[t] < lw_requested_[t]) return false;
    }
    return true;
  };
  if (all_copied()) return Status::OK();
  cv_.Wait(&mu_, all_copied);
  const double s = Seconds(t0, Clock::now());
  // Charged to the newest checkpoint in flight (the one whose copy was awaited
  // most likely); the total is exact either way.
  if (!live_.empty()) live_.rbegin()->second->stall_s += s;
  AddStall(s);
  return Status::OK();
}

// The training thread: for tensors in `stream`'s device memory, the host
// waits only until every requested copy's device reads are issued (the
// dispatcher publishes them as a fence, PublishFence), then the stream waits
// for them on the device; everything else is waited for on the host.
Status EngineImpl::WaitTensorsCopiedOnStream(const std::vector<uint32_t>& tensors,
                                             const Device& stream) {
  // copy_ is fixed at Init.
  if (stream.kind != DeviceKind::kCuda || !copy_->CanOrderStreams(stream)) {
    return WaitTensorsCopied(tensors);
  }
  const auto t0 = Clock::now();
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  for (uint32_t t : tensors) {
    if (t >= lw_requested_.size()) {
      return Status::InvalidArgument("tensor index " + std::to_string(t) + " is not below the " +
                                     std::to_string(lw_requested_.size()) + " registered");
    }
  }
  auto on_stream = [&](uint32_t t) REQUIRES(mu_) {
    const Device& d = reg_->tensors[t].device;
    return d.kind == DeviceKind::kCuda && d.index == stream.index;
  };
  // A tensor is ready when its copies are done, or (on this device) when the
  // newest one is fenced and every older one is done (the dispatcher finishes
  // a tensor's copy before it takes up the next one, so this holds at once).
  auto ready = [&](uint32_t t) REQUIRES(mu_) {
    if (lw_copied_[t] >= lw_requested_[t]) return true;
    return on_stream(t) && lw_fenced_[t] >= lw_requested_[t] &&
           lw_copied_[t] + 1 >= lw_requested_[t];
  };
  auto all_ready = [&]() REQUIRES(mu_) {
    for (uint32_t t : tensors) {
      if (!ready(t)) return false;
    }
    return true;
  };
  if (!all_ready()) {
    cv_.Wait(&mu_, all_ready);
    const double s = Seconds(t0, Clock::now());
    if (!live_.empty()) live_.rbegin()->second->stall_s += s;
    AddStall(s);
  }
  std::vector<std::shared_ptr<CopyCompletion>> reads;
  for (uint32_t t : tensors) {
    if (lw_copied_[t] >= lw_requested_[t]) continue;
    reads.insert(reads.end(), lw_fences_[t].begin(), lw_fences_[t].end());
  }
  lock.Unlock();
  for (const auto& c : reads) {
    if (!copy_->StreamWaitFor(c.get(), stream).ok()) {
      // A read that cannot order the stream (it failed, or was not an event):
      // the host wait is always correct.
      return WaitTensorsCopied(tensors);
    }
  }
  return Status::OK();
}

// Dispatcher: every device read of the current copy of `tensor` is issued;
// `reads` complete when they are done.
void EngineImpl::PublishFence(uint32_t tensor,
                              std::vector<std::shared_ptr<CopyCompletion>> reads) {
  {
    MutexLock lock(&mu_);
    lw_fenced_[tensor] = lw_dispatched_[tensor];
    lw_fences_[tensor] = std::move(reads);
  }
  cv_.SignalAll();
}

void EngineImpl::SealLocked(const std::shared_ptr<Job>& job) {
  DispatchItem item{DispatchItem::kTensors, job, {}};
  for (uint32_t t = 0; t < job->requested.size(); ++t) {
    if (job->requested[t]) continue;
    job->requested[t] = true;
    ++lw_requested_[t];
    ++lw_requested_total_;
    item.tensors.push_back(t);
  }
  if (!item.tensors.empty()) dispatch_q_.push_back(std::move(item));
  dispatch_q_.push_back(DispatchItem{DispatchItem::kSeal, job, {}});
  job->open = false;
  --open_;
}

Status EngineImpl::EndCheckpoint(uint64_t counter, int64_t step, std::string meta_json) {
  const auto t0 = Clock::now();
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  NONSTOP_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, OpenLayerJob(counter));
  job->step = step;
  started_step_ = step;
  job->meta_json = std::move(meta_json);
  MarkMustCommit(*job);
  // copy_at_checkpoint tensors not requested yet are copied now, on the
  // caller's time; only this thread changes job->requested and job->src of
  // unrequested tensors, so the copies may run unlocked.
  lock.Unlock();
  Status st = SnapshotNow(job, /*skip_requested=*/true);
  if (!st.ok()) job->Fail(st.Annotate("copy_at_checkpoint"));
  lock.Lock();
  SealLocked(job);
  const double stall = Seconds(t0, Clock::now());
  job->stall_s += stall;
  AddStall(stall);
  Status pending = TakePendingError();
  lock.Unlock();
  cv_.SignalAll();
  return pending;
}

void EngineImpl::MarkCopied(uint32_t tensor) {
  {
    MutexLock lock(&mu_);
    ++lw_copied_[tensor];
    ++lw_copied_total_;
  }
  cv_.SignalAll();
}

// Dispatcher (copy='device'): waits until the writes of the previous
// checkpoint have read tensor t's part of the second buffer. Bounded: a write
// stuck for kSnapshotWaitSeconds fails this checkpoint with a message instead
// of hanging the dispatcher (the older checkpoint keeps its bytes).
Status EngineImpl::WaitSnapshotFree(const Registration& reg, uint32_t t) {
  std::atomic<uint32_t>& busy = reg.snapshot_writes[t];
  if (busy.load(std::memory_order_acquire) == 0) return Status::OK();
  MutexLock lock(&reg.snapshot_mu);
  const bool free = reg.snapshot_cv.WaitFor(
      &reg.snapshot_mu, std::chrono::seconds(kSnapshotWaitSeconds),
      [&] { return busy.load(std::memory_order_acquire) == 0; });
  if (free) return Status::OK();
  return Status::IOError("copy='device': the previous checkpoint's " +
                         std::to_string(busy.load(std::memory_order_acquire)) +
                         " write(s) of tensor '" + reg.tensors[t].spec.name +
                         "' did not finish in " + std::to_string(kSnapshotWaitSeconds) +
                         " s (is the medium stuck?)");
}

// Dispatcher: the copies of `tensors` of a layer-wise job, in order.
void EngineImpl::CopyLayerTensors(const std::shared_ptr<Job>& job,
                                  const std::vector<uint32_t>& tensors) {
  const Registration& reg = *job->reg;
  const LayerPlan& lp = reg.lplan;
  const bool aligned_medium = job->file->medium().Alignment() > 1;
  // kHost units in staging, oldest first; a unit with no chunk was skipped
  // (the job failed) and only counts.
  struct InCopy {
    uint32_t unit;
    bool last_of_tensor;
    bool staged;
    StagingPool::Chunk chunk;
    std::shared_ptr<CopyCompletion> done;  // shared with a fence
  };
  std::deque<InCopy> window;
  {
    // This item's copies, numbered per tensor (PublishFence).
    MutexLock lock(&mu_);
    for (uint32_t t : tensors) ++lw_dispatched_[t];
  }
  // Device reads that a stream can wait for are issued as far ahead as the
  // staging pool allows (all its chunks but one per writer, so the window
  // never holds the chunk the writers need to free the next one): the fence,
  // and so the training stream's wait, comes as soon as the reads are
  // queued, not when all but the last window have finished.
  const size_t writers = static_cast<size_t>(min_chunks_ - window_);
  const size_t deep_window =
      std::max<size_t>(window_, staging_->chunks() > writers ? staging_->chunks() - writers : 0);
  auto finish_front = [&] {
    InCopy& c = window.front();
    const uint32_t t = static_cast<uint32_t>(lp.units[c.unit].tensor);
    if (c.staged) {
      Status s = c.done->Wait();
      if (!s.ok()) job->Fail(s.Annotate("copy to staging"));
      if (job->failed.load(std::memory_order_acquire)) {
        staging_->Release(c.chunk);
        ChunksDone(job, 1);
      } else {
        const LayerUnit& unit = lp.units[c.unit];
        const StagingPool::Chunk chunk = c.chunk;
        SubmitWrite(job, UnitWrite{&job->unit_crcs[c.unit], unit.slot_offset, chunk.data, unit.bytes},
                    [this, chunk] { staging_->Release(chunk); });
      }
    } else {
      ChunksDone(job, 1);
    }
    const bool last = c.last_of_tensor;
    window.pop_front();
    if (last) MarkCopied(t);
  };

  for (uint32_t t : tensors) {
    const auto* src = static_cast<const std::byte*>(job->src[t]);
    const Device& dev = job->src_device[t];
    const uint64_t nbytes = reg.tensors[t].spec.nbytes;
    if (lp.is_small[t]) {
      // Small tensors are assembled in the job's small buffer; written at the seal.
      if (!job->failed.load(std::memory_order_acquire) && nbytes > 0) {
        std::byte* dst = reg.small_buffers[job->small_buffer] +
                         (reg.layout.tensors[t].data_offset - lp.small_begin);
        if (dev.kind == DeviceKind::kHost) {
          std::memcpy(dst, src, nbytes);
        } else {
          Status s = copy_->Copy(src, dev, dst, nbytes)->Wait();
          if (!s.ok()) job->Fail(s.Annotate("copy to staging"));
        }
      }
      MarkCopied(t);
      continue;
    }
    const std::vector<uint32_t>& units = lp.tensor_units[t];
    // Host memory never reaches a CUDA-only call (docs/CUDA.md, "Layer-wise
    // copies of host tensors"); the route depends on where the bytes are now
    // (job->src: a copy_at_checkpoint tensor is read from its host snapshot).
    // A staged tensor's memory is its staging: written from there as it is.
    const bool staged = reg.tensors[t].staged;
    const LayerRoute route = staged ? LayerRoute::kDirect
                                    : ChooseLayerRoute(opts_.layer_copy, dev.kind, aligned_medium,
                                                       reg.device_buffers[t] != nullptr);
    if (job->failed.load(std::memory_order_acquire)) {
      ChunksDone(job, units.size());
      MarkCopied(t);
      continue;
    }
    if (route == LayerRoute::kDirect) {
      // Straight from the tensor's memory into the medium on the writers; the
      // tensor is copied when its last unit is written. Staged memory holds
      // the unit's zero padding too (one aligned write); other memory ends
      // at the tensor, and the padding is written from a zero page.
      job->tensor_left[t].store(static_cast<uint32_t>(units.size()));
      for (uint32_t u : units) {
        const LayerUnit& unit = lp.units[u];
        const uint64_t from_memory = staged ? unit.bytes : unit.tensor_bytes;
        SubmitWrite(job,
                    UnitWrite{&job->unit_crcs[u], unit.slot_offset, src + unit.tensor_offset,
                              from_memory, unit.bytes - from_memory},
                    [this, job, t] {
                      if (job->tensor_left[t].fetch_sub(1, std::memory_order_acq_rel) == 1) {
                        MarkCopied(t);
                      }
                    });
      }
      continue;
    }
    if (route == LayerRoute::kHostSnapshot || route == LayerRoute::kDeviceSnapshot) {
      // The second buffer: wait until the previous checkpoint's writes of this
      // tensor have read its part, snapshot, release the tensor, then drain.
      Status s = WaitSnapshotFree(reg, t);
      std::byte* snap = reg.device_snapshot + reg.layout.tensors[t].data_offset;
      void* device_buffer = reg.device_buffers[t];
      if (s.ok() && route == LayerRoute::kHostSnapshot) {
        // A host tensor: a plain memcpy on this thread, like small tensors.
        std::memcpy(snap, src, nbytes);
      } else if (s.ok()) {
        // CUDA: device-to-device snapshot (its completion releases the
        // tensor: a fence for device-side waits), then an asynchronous drain
        // to the host snapshot that the writers wait for.
        std::shared_ptr<CopyCompletion> snapshot =
            copy_->SnapshotToDevice(src, dev, device_buffer, nbytes);
        if (copy_->CanOrderStreams(dev)) PublishFence(t, {snapshot});
        s = snapshot->Wait();
      }
      if (!s.ok()) job->Fail(s.Annotate("copy='device' snapshot"));
      MarkCopied(t);
      if (!s.ok()) {
        ChunksDone(job, units.size());
        continue;
      }
      std::shared_ptr<SharedCompletion> drain;
      if (route == LayerRoute::kDeviceSnapshot) {
        drain = std::make_shared<SharedCompletion>(
            copy_->DrainToHost(device_buffer, dev.index, snap, nbytes));
      }
      reg.snapshot_writes[t].store(static_cast<uint32_t>(units.size()), std::memory_order_release);
      for (uint32_t u : units) {
        const LayerUnit& unit = lp.units[u];
        const UnitWrite w{&job->unit_crcs[u], unit.slot_offset, reg.device_snapshot + unit.slot_offset,
                          unit.bytes};
        auto release = [job, t] {
          const Registration& r = *job->reg;
          if (r.snapshot_writes[t].fetch_sub(1, std::memory_order_acq_rel) == 1) {
            MutexLock lock(&r.snapshot_mu);  // no lost wake-up
            r.snapshot_cv.SignalAll();
          }
        };
        writers_->Submit([this, job, w, drain, release] {
          if (drain) {
            Status ds = drain->Wait();  // every unit of the tensor waits on it
            if (!ds.ok()) job->Fail(ds.Annotate("copy='device' drain"));
          }
          WriteUnit(job, w, release);
        });
      }
      continue;
    }
    // kStage: through staging, a window of units copying ahead of the writers.
    // Device reads are fenced once the last unit is issued.
    const bool fence = copy_->CanOrderStreams(dev);
    std::vector<std::shared_ptr<CopyCompletion>> reads;
    for (size_t k = 0; k < units.size(); ++k) {
      const LayerUnit& unit = lp.units[units[k]];
      InCopy c{units[k], k + 1 == units.size(), false, {}, nullptr};
      if (!job->failed.load(std::memory_order_acquire)) {
        Result<StagingPool::Chunk> chunk = staging_->Acquire();
        if (!chunk.ok()) {
          job->Fail(chunk.status());
        } else {
          c.staged = true;
          c.chunk = *chunk;
          if (unit.bytes > unit.tensor_bytes) {
            std::memset(c.chunk.data + unit.tensor_bytes, 0, unit.bytes - unit.tensor_bytes);
          }
          c.done = copy_->Copy(src + unit.tensor_offset, dev, c.chunk.data, unit.tensor_bytes);
          if (fence) reads.push_back(c.done);
        }
      }
      window.push_back(std::move(c));
      if (fence && k + 1 == units.size()) PublishFence(t, std::move(reads));
      while (window.size() > (fence ? deep_window : static_cast<size_t>(window_))) finish_front();
    }
  }
  while (!window.empty()) finish_front();
}

// Dispatcher: every copy requested before the seal is done (FIFO), so the
// small region is complete: write it, then give up the seal's count.
void EngineImpl::SealLayerJob(const std::shared_ptr<Job>& job) {
  const Registration& reg = *job->reg;
  const LayerPlan& lp = reg.lplan;
  {
    MutexLock lock(&mu_);  // FinishJob reads it under mu_
    job->copy_s = Seconds(job->t_start, Clock::now());
  }
  for (uint32_t u : lp.small_units) {
    if (job->failed.load(std::memory_order_acquire)) {
      ChunksDone(job, 1);
      continue;
    }
    const LayerUnit& unit = lp.units[u];
    SubmitWrite(job,
                UnitWrite{&job->unit_crcs[u], unit.slot_offset,
                          reg.small_buffers[job->small_buffer] + (unit.slot_offset - lp.small_begin),
                          unit.bytes},
                {});
  }
  ChunksDone(job, 1);
}

}  // namespace nonstop::engine_detail
