// The writers (a TaskPool): the one write path of every unit of bytes, for
// both schedules. A unit is written by exactly one writer task, which also
// writes its crc; the committer reads the crcs after the job's `remaining`
// count reached 0 (acq_rel on the decrement, ChunksDone).
#include "engine/engine_impl.h"

namespace nonstop::engine_detail {

namespace {

const std::byte* ZeroPage() {
  alignas(4096) static const std::byte zeros[kStoreAlign] = {};
  return zeros;
}

}  // namespace

void EngineImpl::WriteUnit(const std::shared_ptr<Job>& job, const UnitWrite& w,
                           const std::function<void()>& release) {
  if (!job->failed.load(std::memory_order_acquire)) {
    uint32_t crc = Crc32c(w.data, w.bytes);
    if (w.zero_pad > 0) crc = Crc32c(ZeroPage(), w.zero_pad, crc);
    *w.crc = crc;
    Status st = job->file->WriteData(job->slot, w.slot_offset, w.data, w.bytes);
    if (st.ok() && w.zero_pad > 0) {
      st = job->file->WriteData(job->slot, w.slot_offset + w.bytes, ZeroPage(), w.zero_pad);
    }
    if (!st.ok()) job->Fail(st);
  }
  // Before the unit counts: the last one may finish the job, after which
  // nothing in flight may hold a staging chunk (GrowStaging replaces the pool).
  if (release) release();
  ChunksDone(job, 1);
}

void EngineImpl::SubmitWrite(const std::shared_ptr<Job>& job, UnitWrite w,
                             std::function<void()> release) {
  writers_->Submit([this, job, w, release = std::move(release)] { WriteUnit(job, w, release); });
}

void EngineImpl::ChunksDone(const std::shared_ptr<Job>& job, uint64_t n) {
  if (job->remaining.fetch_sub(n, std::memory_order_acq_rel) == n) {
    {
      MutexLock lock(&mu_);
      commit_q_.push_back(job);
    }
    cv_.SignalAll();
  }
}

}  // namespace nonstop::engine_detail
