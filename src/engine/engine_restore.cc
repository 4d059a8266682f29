// Restore: reads a checkpoint into the registered tensors (from the memory
// tier or the slot file, verified chunk by chunk) and protects it.
#include <algorithm>
#include <cstring>
#include <deque>

#include "engine/engine_impl.h"

namespace nonstop::engine_detail {

// Reads one planned chunk into `dst` and checks its crc. Where the stored crc
// chunks are the engine's chunks (the usual case) it reads straight from the
// medium into staging; otherwise SlotFile::ReadData does the verified read.
Status ReadChunk(const std::shared_ptr<SlotFile>& file, const CheckpointInfo& info,
                 const PlannedChunk& pc, std::byte* dst) {
  const uint64_t cb = info.crc_chunk_bytes;
  const bool same = cb != 0 && pc.slot_offset % cb == 0 &&
                    (pc.bytes == cb || pc.slot_offset + pc.bytes == info.data_bytes) &&
                    info.chunk_crcs.size() == (info.data_bytes + cb - 1) / cb;
  if (!same) return file->ReadData(info, pc.slot_offset, dst, pc.bytes, true);
  NONSTOP_RETURN_IF_ERROR(file->medium().Read(info.data_offset + pc.slot_offset, dst, pc.bytes));
  const uint64_t j = pc.slot_offset / cb;
  if (Crc32c(dst, pc.bytes) != info.chunk_crcs[j]) {
    return Status::Corruption("data chunk " + std::to_string(j) + " of checkpoint #" +
                              std::to_string(info.counter) + " (step " +
                              std::to_string(info.step) + ") has a checksum mismatch");
  }
  return Status::OK();
}

Status EngineImpl::ReadCheckpoint(const std::shared_ptr<SlotFile>& file,
                                  const CheckpointInfo& info) {
  const std::vector<TensorRef>& tensors = reg_->tensors;
  // Map every registered tensor to the stored one, checking name, dtype, shape.
  std::vector<int> stored_to_reg(info.tensors.size(), -1);
  bool to_device = false;  // some tensor is in device memory: the H2D pipeline below
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& want = tensors[i].spec;
    const int k = info.FindTensor(want.name);
    if (k < 0) {
      return Status::NotFound("tensor '" + want.name + "' is not in checkpoint " +
                              std::to_string(info.counter) + " (step " +
                              std::to_string(info.step) + ")");
    }
    const TensorSpec& have = info.tensors[k].spec;
    if (have.dtype != want.dtype) {
      return Status::InvalidArgument("tensor '" + want.name + "': checkpoint has dtype " +
                                     std::string(DTypeName(have.dtype)) + ", registered " +
                                     std::string(DTypeName(want.dtype)));
    }
    if (have.shape != want.shape || have.nbytes != want.nbytes) {
      auto str = [](const std::vector<int64_t>& s) {
        std::string r = "[";
        for (size_t d = 0; d < s.size(); ++d) r += (d ? "," : "") + std::to_string(s[d]);
        return r + "]";
      };
      return Status::InvalidArgument("tensor '" + want.name + "': checkpoint has shape " +
                                     str(have.shape) + ", registered " + str(want.shape));
    }
    if (tensors[i].device.kind != DeviceKind::kHost) {
      if (!copy_->CanCopyToDevice(tensors[i].device)) {
        return Status::Unavailable("tensor '" + want.name + "' is in device memory and " +
                                   copy_->Describe() + " cannot copy into it: restore it " +
                                   "through a host tensor");
      }
      to_device = true;
    }
    stored_to_reg[k] = static_cast<int>(i);
  }
  std::vector<bool> include(info.tensors.size());
  for (size_t k = 0; k < include.size(); ++k) include[k] = stored_to_reg[k] >= 0;
  const ChunkPlan plan = ChunkPlan::Build(info.tensors, info.data_bytes, chunk_bytes_, include);

  // Chunks are read in parallel on the writer threads, each through a staging
  // chunk (aligned for O_DIRECT; pinned where a GPU is present), verified,
  // then scattered to the tensors: memcpy into host tensors, and for device
  // tensors an asynchronous host-to-device copy (CopyToDevice) issued only
  // after the chunk's crc verified. A chunk with copies in flight is not
  // released to the pool at once: it waits in `in_flight` (FIFO, at most
  // `depth` chunks) while the next chunks are read, and goes back to the pool
  // only after its copies completed, so reads and H2D copies overlap and a
  // buffer is never overwritten under a copy. Every copy is waited for before
  // this returns, success or not.
  struct InFlight {
    StagingPool::Chunk chunk;
    std::vector<std::unique_ptr<CopyCompletion>> copies;
  };
  struct Reads {
    Mutex mu;
    CondVar cv;
    size_t pending GUARDED_BY(mu) = 0;
    Status first GUARDED_BY(mu);
    std::deque<InFlight> in_flight GUARDED_BY(mu);
    double read_s GUARDED_BY(mu) = 0;      // reading + verifying, summed over threads
    double h2d_wait_s GUARDED_BY(mu) = 0;  // blocked on H2D copies, summed over threads
    uint64_t h2d_bytes GUARDED_BY(mu) = 0;
  } r;
  // Chunks that may wait for their copies: the pool keeps one per writer free
  // for reading (each worker holds at most one while it reads).
  const uint32_t writers = static_cast<uint32_t>(std::max(1, stats_.writers));
  const uint32_t pool = staging_->chunks();
  const size_t depth = pool > writers ? std::min<uint32_t>(pool - writers, 2 * writers) : 0;
  // Waits for the copies of the oldest in-flight chunks until at most `keep`
  // remain, releasing each chunk after its copies.
  auto retire = [&](size_t keep) {
    for (;;) {
      InFlight f;
      {
        MutexLock l(&r.mu);
        if (r.in_flight.size() <= keep) return;
        f = std::move(r.in_flight.front());
        r.in_flight.pop_front();
      }
      const auto w0 = Clock::now();
      Status st;
      for (auto& c : f.copies) {
        Status cs = c->Wait();
        if (st.ok() && !cs.ok()) st = cs;
      }
      const double waited = Seconds(w0, Clock::now());
      staging_->Release(f.chunk);
      MutexLock l(&r.mu);
      r.h2d_wait_s += waited;
      if (r.first.ok() && !st.ok()) r.first = st;
    }
  };
  for (const PlannedChunk& pc : plan.chunks) {
    if (pc.pieces.empty()) continue;
    {
      MutexLock l(&r.mu);
      ++r.pending;
    }
    writers_->Submit([&, pc_ptr = &pc] {
      Status st;
      double read_s = 0;
      uint64_t h2d = 0;
      Result<StagingPool::Chunk> chunk = staging_->Acquire();
      if (!chunk.ok()) {
        st = chunk.status();
      } else {
        InFlight f{*chunk, {}};
        const auto r0 = Clock::now();
        st = ReadChunk(file, info, *pc_ptr, chunk->data);
        read_s = Seconds(r0, Clock::now());
        if (st.ok()) {
          for (const ChunkPiece& p : pc_ptr->pieces) {
            const TensorRef& t = tensors[stored_to_reg[p.tensor]];
            auto* dst = static_cast<std::byte*>(const_cast<void*>(t.data)) + p.tensor_offset;
            if (t.device.kind == DeviceKind::kHost) {
              std::memcpy(dst, chunk->data + p.chunk_offset, p.bytes);
            } else {
              f.copies.push_back(
                  copy_->CopyToDevice(chunk->data + p.chunk_offset, dst, t.device, p.bytes));
              h2d += p.bytes;
            }
          }
        }
        if (f.copies.empty()) {
          staging_->Release(*chunk);
        } else {
          MutexLock l(&r.mu);
          r.in_flight.push_back(std::move(f));
        }
      }
      if (to_device) retire(depth);
      MutexLock l(&r.mu);
      r.read_s += read_s;
      r.h2d_bytes += h2d;
      if (r.first.ok() && !st.ok()) r.first = st;
      if (--r.pending == 0) r.cv.SignalAll();
    });
  }
  {
    MutexLock l(&r.mu);
    r.cv.Wait(&r.mu, [&]() REQUIRES(r.mu) { return r.pending == 0; });
  }
  retire(0);  // every copy done before the tensors are reported restored (or reread)
  MutexLock l(&r.mu);
  stats_.restore_read_s += r.read_s;
  stats_.restore_h2d_wait_s += r.h2d_wait_s;
  stats_.restore_h2d_bytes += r.h2d_bytes;
  return r.first;
}

// The checkpoint a job restored from stays intact until a newer checkpoint
// commits (DESIGN.md invariant 9): its slot becomes the retained one, and the
// slots of the checkpoints newer than it (damaged, or rolled back from) are
// free for the next checkpoints. Called with nothing in flight. Distributed
// mode keeps the restored (agreed) checkpoint by Pin instead.
void EngineImpl::ProtectRestored(const std::shared_ptr<SlotFile>& file,
                                 const CheckpointInfo& info) {
  if (opts_.global_agreement || file != file_ || pending_rename_) return;
  if (retained_slot_ && *retained_slot_ == info.slot) return;
  retained_slot_ = info.slot;
  latest_ = CommittedCheckpoint{info.counter, info.step};
  const uint32_t slots = file_->geometry().slots;
  free_slots_ = std::make_unique<SlotQueue>(slots);
  for (uint32_t s = 0; s < slots; ++s) {
    if (s != info.slot) free_slots_->Push(s);
  }
}

Result<CheckpointInfo> EngineImpl::Restore(std::optional<int64_t> step) {
  const auto t0 = Clock::now();
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  NONSTOP_RETURN_IF_ERROR(TakePendingError());
  if (!reg_) return Status::FailedPrecondition("Restore before Register");
  if (open_ > 0) {
    return Status::FailedPrecondition("Restore while a layer-wise checkpoint is open: "
                                      "EndCheckpoint first");
  }
  NONSTOP_RETURN_IF_ERROR(WaitAllFinished());
  ForgetAgreementProgress();
  std::shared_ptr<SlotFile> file = pending_rename_ ? old_file_ : file_;
  stats_.restore_read_s = stats_.restore_h2d_wait_s = 0;
  stats_.restore_h2d_bytes = 0;
  ScanReport report;  // none on disk yet: the memory tier may still hold one
  if (file) {
    ScanOptions so;
    so.verify_data = false;  // each chunk's crc is verified as it is read below
    NONSTOP_ASSIGN_OR_RETURN(report, file->Scan(so));
  }
  NONSTOP_ASSIGN_OR_RETURN(LineageRecord lineage, jd_->ReadLineage(rank()));
  // A commit whose fsync failed this session is never chosen (noted durably
  // by RecordNotDurable as well).
  for (uint64_t c : not_durable_) {
    lineage.abandoned.emplace_back(c, c);
    lineage.not_durable.push_back(c);
  }
  std::sort(lineage.not_durable.begin(), lineage.not_durable.end());
  std::vector<PlanCandidate> cands;
  for (size_t i = 0; i < report.checkpoints.size(); ++i) {
    const ScannedCheckpoint& c = report.checkpoints[i];
    cands.push_back(PlanCandidate{Tier::kDisk, file->medium().Describe(), c.info.step,
                                  c.info.counter, c.state == CheckpointState::kCommitted,
                                  c.reason, false, i});
  }
  PlanRequest req;
  req.step = step;
  // The memory tier's segment, when the plan over it, the disk and the
  // lineage puts it first (OpenMemorySegment): its records are candidates
  // too, newest first at one counter; a record at a counter the disk also
  // holds only when it is that same checkpoint (the one checked there).
  std::shared_ptr<SlotFile> mem;
  std::vector<const CheckpointInfo*> mem_infos;
  ScanReport mem_report;
  // Not in "disk" mode (the tier is off): a checkpoint only the segment
  // holds is abandoned then (the rollback below counts it).
  if (memory_->on()) {
    std::string why;
    Result<std::optional<MemorySegment>> seg =
        OpenMemorySegment(opts_.dir, rank(), opts_.shm_dir, opts_.env, nullptr, &why, step);
    if (seg.ok() && seg.value().has_value()) {
      mem = std::move(seg.value()->file);
      mem_report = std::move(seg.value()->report);
      const uint64_t same = seg.value()->info.counter;
      for (const ScannedCheckpoint& c : mem_report.checkpoints) {
        bool on_disk = false;
        for (const ScannedCheckpoint& d : report.checkpoints) on_disk |= d.info.counter == c.info.counter;
        if (on_disk && c.info.counter != same) continue;
        cands.push_back(PlanCandidate{Tier::kMemory, seg.value()->path, c.info.step,
                                      c.info.counter, c.state == CheckpointState::kCommitted,
                                      c.reason, false, report.checkpoints.size() + mem_infos.size()});
        mem_infos.push_back(&c.info);
      }
    }
  }
  auto info_of = [&](size_t handle) -> const CheckpointInfo& {
    return handle < report.checkpoints.size() ? report.checkpoints[handle].info
                                              : *mem_infos[handle - report.checkpoints.size()];
  };
  // Verifying a candidate is reading it into the registered tensors: the
  // first that reads back with every crc intact is the one restored.
  // (Called by MakePlan on this thread, with mu_ held.)
  auto read = [&](const PlanCandidate& pc) REQUIRES(mu_) -> Status {
    const CheckpointInfo& info = info_of(pc.handle);
    Status st = ReadCheckpoint(pc.tier == Tier::kMemory ? mem : file, info);
    // Damaged bytes fall back to an older checkpoint (of the same step
    // when one was asked for); mismatched tensors are the caller's error.
    if (st.code() == StatusCode::kIOError) return Status::Corruption(st.message());
    return st;
  };
  NONSTOP_ASSIGN_OR_RETURN(Plan plan, MakePlan(cands, lineage, req, read));
  if (plan.chosen()) {
    const PlanCandidate& chosen = cands[*plan.chosen()];
    const CheckpointInfo& info = info_of(chosen.handle);
    const bool from_memory = chosen.tier == Tier::kMemory;
    stats_.restored_from_memory = from_memory;
    stats_.restore_s = Seconds(t0, Clock::now());
    // A rollback is final (DESIGN.md invariant 9): when newer records exist
    // (damaged, or an older step asked for), their counters are abandoned,
    // durably, before Restore returns (RecordRollback), in distributed mode
    // too (there Pin keeps the slot).
    rollback_from_.reset();
    if (plan.newest_counter > info.counter || SegmentNewestCounter() > info.counter) {
      rollback_from_ = info.counter;
    }
    NONSTOP_RETURN_IF_ERROR(RecordRollback());
    if (from_memory) {
      latest_ = CommittedCheckpoint{info.counter, info.step};
      // The live tiered file is the segment: its slot stays until a newer commit.
      if (mem_file_ && !mem_pending_rename_ && info.slot < mem_file_->geometry().slots) {
        mem_retained_ = info.slot;
        mem_free_ = std::make_unique<SlotQueue>(mem_file_->geometry().slots);
        for (uint32_t s = 0; s < mem_file_->geometry().slots; ++s) {
          if (s != info.slot) mem_free_->Push(s);
        }
      }
      mem_newest_ = PersistItem{mem, info};
    } else {
      ProtectRestored(file, info);
      if (mem_file_ && !mem_pending_rename_) {  // newer memory records are abandoned
        mem_retained_.reset();
        mem_free_ = std::make_unique<SlotQueue>(mem_file_->geometry().slots);
        for (uint32_t s = 0; s < mem_file_->geometry().slots; ++s) mem_free_->Push(s);
      }
      if (mem_newest_ && mem_newest_->info.counter > info.counter) mem_newest_.reset();
    }
    AddStall(Seconds(t0, Clock::now()));
    return info;
  }
  std::string why = step ? "no valid checkpoint of step " + std::to_string(*step)
                         : "no valid checkpoint";
  why += " in " + (file ? file->medium().Describe() : opts_.dir);
  for (const auto& s : plan.skipped) why += "; " + s;
  return Status::NotFound(why);
}

Status EngineImpl::AdoptRestored(uint64_t counter) {
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  if (open_ > 0) {
    return Status::FailedPrecondition("AdoptRestored while a layer-wise checkpoint is open: "
                                      "EndCheckpoint first");
  }
  NONSTOP_RETURN_IF_ERROR(WaitAllFinished());
  ForgetAgreementProgress();
  std::shared_ptr<SlotFile> file = pending_rename_ ? old_file_ : file_;
  rollback_from_.reset();
  ScanReport report;  // no file yet: restored from elsewhere (a keep copy, a remote, the memory tier)
  if (file) {
    ScanOptions so;
    so.verify_data = false;  // the caller verified what it read
    NONSTOP_ASSIGN_OR_RETURN(report, file->Scan(so));
  }
  uint64_t newest = SegmentNewestCounter();  // the memory tier's records count too
  for (const ScannedCheckpoint& c : report.checkpoints) newest = std::max(newest, c.info.counter);
  if (newest > counter) rollback_from_ = counter;
  // The rollback is durable before the restore returns: a crash before the
  // next checkpoint never resumes the abandoned future.
  NONSTOP_RETURN_IF_ERROR(RecordRollback());
  // Distributed mode: ProtectRestored leaves the slot to Pin (the caller
  // pins `counter`); the rollback above is recorded all the same, so a crash
  // never resumes a rank's abandoned future (DESIGN.md invariant 9).
  bool on_disk = false;
  for (const ScannedCheckpoint& c : report.checkpoints) {
    if (c.state == CheckpointState::kCommitted && c.info.counter == counter) {
      ProtectRestored(file, c.info);
      on_disk = true;
      break;
    }
  }
  if (!on_disk) {
    // Restored from the memory tier (the tiered cadence): it is the newest
    // memory checkpoint, persisted by Close() if nothing newer comes.
    Result<std::optional<MemorySegment>> seg =
        OpenMemorySegment(opts_.dir, rank(), opts_.shm_dir, opts_.env, nullptr, nullptr);
    if (seg.ok() && seg.value().has_value() && seg.value()->info.counter == counter) {
      mem_newest_ = PersistItem{std::shared_ptr<SlotFile>(std::move(seg.value()->file)),
                                seg.value()->info};
      latest_ = CommittedCheckpoint{counter, seg.value()->info.step};
    }
  } else if (mem_newest_ && mem_newest_->info.counter > counter) {
    mem_newest_.reset();
  }
  return Status::OK();
}

}  // namespace nonstop::engine_detail
