// The engine's statistics: Stats() and each finished checkpoint's record.
#include "engine/engine_impl.h"

namespace nonstop::engine_detail {

EngineStats EngineImpl::Stats() {
  MutexLock lock(&mu_);
  EngineStats s = stats_;
  s.in_flight = in_flight_;
  s.medium = medium_desc_;
  s.staging_wait_s_total = staging_wait_s_before_ + (staging_ ? staging_->wait_s_total() : 0);
  if (memory_) {
    const MemoryTierStats m = memory_->stats();
    s.memory_tier = m.mode;
    s.memory_segment = m.segment;
    s.memory_mirrored = m.mirrored;
    s.memory_skipped = m.skipped;
    s.memory_swept = m.swept;
    s.memory_counter = m.mirrored_counter;
    s.memory_failures = m.failures;
    s.memory_error = m.last_error;
  }
  if (prep_) {  // allocated in the background, not taken by Register yet
    MutexLock pl(&prep_->mu);
    if (prep_->done && prep_->value.ok()) s.staging_prepared_bytes = prep_->value.value()->total_bytes();
  }
  return s;
}

// FinishJob: the checkpoint's line in EngineStats::recent (the last 64).
void EngineImpl::RecordFinished(const Job& job, bool committed, bool superseded,
                                const Status& st, double persist_s) {
  CheckpointStats cs;
  cs.counter = job.counter;
  cs.step = job.step;
  cs.bytes = job.reg->layout.data_bytes;
  cs.stall_s = job.stall_s;
  cs.copy_s = job.copy_s;
  cs.persist_s = persist_s;
  cs.write_GBps = persist_s > 0 ? static_cast<double>(cs.bytes) / persist_s / 1e9 : 0;
  cs.committed = committed;
  if (committed) cs.tiers = job.to_memory ? "memory" : "disk";
  if (superseded) cs.error = "superseded by a newer checkpoint";
  if (!st.ok()) cs.error = st.ToString();
  if (!committed && job.dropped) cs.error = "abandoned for a newer checkpoint";
  cs.snapshot_bytes = job.snapshot_bytes;
  cs.direct_bytes = job.direct_bytes;
  if (job.dsnap && job.release_s > 0) cs.drain_s = std::max(0.0, job.copy_s - job.release_s);
  stats_.snapshot_bytes_total += cs.snapshot_bytes;
  stats_.direct_bytes_total += cs.direct_bytes;
  stats_.drain_s_total += cs.drain_s;
  watch_->Finished(cs);
  stats_.recent.push_back(std::move(cs));
  if (stats_.recent.size() > 64) stats_.recent.erase(stats_.recent.begin());
}

}  // namespace nonstop::engine_detail
