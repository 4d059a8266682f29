// The checkpoint orchestrator. docs/ENGINE.md describes the data path and
// the threading; this file keeps the rules next to the data they protect.
//
// Threads (all long-lived, started by Open, stopped by Close):
//   training thread  the caller: Register, Checkpoint, WaitCopied, ... .
//   dispatcher (1)   takes checkpoints FIFO; for each chunk of the slot's data
//                    region: acquires a staging chunk (the staging wait),
//                    zeroes padding, starts the copies of the tensor pieces,
//                    and once they are done hands the chunk to the writers.
//                    Keeps a small window of chunks copying, so chunk k+1 is
//                    copied while chunk k is written.
//   writers (p)      TaskPool: write a staged chunk at its slot offset, crc it,
//                    free the staging chunk. The last chunk of a checkpoint
//                    hands it to the committer.
//   committer (1)    claims the counter by CAS, commits through SlotFile
//                    (data, table, superblock durable in that order), then
//                    publishes it and releases the previously retained slot.
//   copy threads     inside the CopyEngine.
//
// Layer-wise checkpoints (BeginCheckpoint .. EndCheckpoint, docs/LAYERWISE.md)
// use the same threads: the dispatcher takes their per-tensor copy requests
// from the same FIFO queue, and their units (LayerPlan) go to the same
// writers and committer.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_set>

#include "engine/chunk_plan.h"
#include "engine/engine_internal.h"
#include "engine/layerwise_plan.h"
#include "engine/memory_tier.h"
#include "engine/slot_medium.h"
#include "engine/slot_queue.h"
#include "base/task_pool.h"
#include "nonstop/copy_engine.h"
#include "nonstop/engine.h"
#include "nonstop/env.h"
#include "nonstop/jobdir.h"
#include "stage/staging_pool.h"

namespace nonstop {
namespace {

using Clock = std::chrono::steady_clock;

// The SlotMedium every slot file the engine opens is wrapped in (null for
// none, which does not happen).
SlotMedium* SlotOf(SlotFile& f) { return dynamic_cast<SlotMedium*>(&f.medium()); }

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

constexpr uint64_t kDefaultChunkBytes = 4 << 20;
constexpr int kDefaultWriters = 4;
// copy='device': how long the dispatcher waits for an older checkpoint's
// writes of a tensor before it fails the newer checkpoint instead of hanging.
constexpr int kSnapshotWaitSeconds = 600;

// What one Register call fixed: the tensors, their slot layout, the chunk
// plan and the buffers for copy_at_checkpoint tensors. Immutable once built
// (the snapshot buffers' contents change, guarded by the snapshot protocol
// below); shared by every checkpoint started under it.
struct Registration {
  std::vector<TensorRef> tensors;
  SlotLayout layout;
  ChunkPlan plan;
  // copy_at_checkpoint tensors: their offset inside one snapshot buffer.
  std::vector<int64_t> snapshot_offset;  // -1 for tensors copied in the background
  uint64_t snapshot_bytes = 0;
  // One buffer per possible in-flight checkpoint. A checkpoint takes one in
  // Checkpoint() and gives it back once its copies are done (dispatcher);
  // ownership moves through Engine::free_snapshots_ (guarded by Engine::mu_).
  std::vector<std::byte*> snapshots;
  CopyEngine* copy = nullptr;

  // Layer-wise checkpoints. The small region of each in-flight layer-wise
  // checkpoint is assembled in one of `small_buffers` (zero padding, never
  // written elsewhere), owned like the snapshots through Engine::free_small_.
  LayerPlan lplan;
  std::vector<std::byte*> small_buffers;
  uint64_t small_bytes = 0;
  // LayerCopy::kDevice: the second buffer, laid out like the large region
  // (padding zero), and per tensor the writes still reading its part of it.
  std::byte* device_snapshot = nullptr;
  uint64_t device_snapshot_bytes = 0;
  std::unique_ptr<std::atomic<uint32_t>[]> snapshot_writes;
  mutable std::mutex snapshot_mu;  // with snapshot_cv: a count reaching 0 wakes the dispatcher
  mutable std::condition_variable snapshot_cv;
  // kDevice with a copy engine that CanSnapshotOnDevice: per device tensor,
  // its second buffer in device memory (nullptr otherwise); drained into
  // device_snapshot.
  std::vector<void*> device_buffers;

  ~Registration() {
    for (size_t i = 0; i < device_buffers.size(); ++i) {
      if (device_buffers[i] != nullptr) copy->FreeDevice(tensors[i].device.index, device_buffers[i]);
    }
    for (std::byte* p : snapshots) copy->FreeHost(p, snapshot_bytes);
    for (std::byte* p : small_buffers) copy->FreeHost(p, small_bytes);
    if (device_snapshot != nullptr) copy->FreeHost(device_snapshot, device_snapshot_bytes);
  }
};

// One checkpoint on its way to the medium.
struct Job {
  uint64_t counter = 0;
  int64_t step = 0;
  uint32_t slot = 0;
  std::shared_ptr<Registration> reg;
  std::shared_ptr<SlotFile> file;
  std::vector<const void*> src;  // per tensor: registered memory or its snapshot
  std::vector<Device> src_device;
  int snapshot = -1;  // index into reg->snapshots, or -1
  std::string meta_json;
  Clock::time_point t_start;
  double stall_s = 0;  // GUARDED_BY(Engine::mu_) after Checkpoint() returns
  double copy_s = 0;   // GUARDED_BY(engine mu_): dispatcher writes, FinishJob reads

  // Each crc is written by the one writer task of its chunk; the committer
  // reads them after `remaining` reached 0 (acq_rel on the decrement).
  std::vector<uint32_t> crcs;
  std::atomic<uint64_t> remaining{0};
  std::atomic<bool> failed{false};
  std::mutex error_mu;
  Status error;  // GUARDED_BY(error_mu): the first failure

  // Layer-wise checkpoints only.
  bool layerwise = false;
  bool open = false;           // GUARDED_BY(Engine::mu_): between Begin and EndCheckpoint
  bool abandoned = false;      // GUARDED_BY(Engine::mu_): closed while open; error not queued
  bool dropped = false;        // GUARDED_BY(Engine::mu_): by AbandonOlderThan; error not queued
  std::vector<bool> requested;  // GUARDED_BY(Engine::mu_): copy requested, per tensor
  int small_buffer = -1;       // index into reg->small_buffers
  // Each unit's crc is written by its one writer; read by the committer after
  // `remaining` (units + 1 for the seal) reached 0.
  std::vector<uint32_t> unit_crcs;
  // kDirect: per tensor, units not yet written out of its memory.
  std::unique_ptr<std::atomic<uint32_t>[]> tensor_left;

  void Fail(const Status& s) {
    std::lock_guard<std::mutex> lock(error_mu);
    if (error.ok()) error = s;
    failed.store(true, std::memory_order_release);
  }
  Status TakeError() {
    std::lock_guard<std::mutex> lock(error_mu);
    return error;
  }
};

// One entry of the dispatcher's FIFO queue: a whole checkpoint, the copies of
// some tensors of a layer-wise one, or the seal of a layer-wise one (its small
// region is written once everything before it in the queue is copied).
struct DispatchItem {
  enum Kind { kWhole, kTensors, kSeal };
  Kind kind = kWhole;
  std::shared_ptr<Job> job;
  std::vector<uint32_t> tensors;  // kTensors
};

class EngineImpl final : public Engine {
 public:
  EngineImpl(const EngineOptions& opts, EngineMedia media) : opts_(opts), media_(std::move(media)) {}
  ~EngineImpl() override { (void)Close(); }

  Status Init();

  Status PrepareStaging(uint64_t state_bytes) override;
  Status Register(std::vector<TensorRef> tensors) override;
  Result<uint64_t> Checkpoint(int64_t step, std::string meta_json) override;
  Status WaitCopied() override;
  Status WaitCommitted(uint64_t counter) override;
  std::optional<CommittedCheckpoint> Latest() override;
  Result<CheckpointInfo> Restore(std::optional<int64_t> step) override;
  Status AdoptRestored(uint64_t counter) override;
  EngineStats Stats() override;
  Result<int> AbandonOlderThan(uint64_t counter) override;
  Status Close() override;
  Status TakeError() override;
  Status SetRetention(const RetentionPolicy& policy) override;
  Status DeleteKept(int64_t step) override;

  Status Pin(uint64_t counter) override;
  std::optional<CommittedCheckpoint> Candidate() override;
  Status DropCandidate(uint64_t counter) override;
  Status WriteAgreed(const AgreedRecord& rec) override;

  Result<uint64_t> BeginCheckpoint(int64_t step) override;
  Status CopyTensors(uint64_t counter, const std::vector<uint32_t>& tensors) override;
  Status WaitTensorsCopied(const std::vector<uint32_t>& tensors) override;
  Status WaitTensorsCopiedOnStream(const std::vector<uint32_t>& tensors,
                                   const Device& stream) override;
  Status EndCheckpoint(uint64_t counter, int64_t step, std::string meta_json) override;

 private:
  int rank() const { return static_cast<int>(opts_.rank); }
  // Opens the slot file (or, with create, a new temp slot file) through the
  // job directory, wrapped in a SlotMedium.
  Result<std::unique_ptr<Medium>> OpenSlotMedium(bool create);
  // Publishes the temp slot file over the slot file (rename + SyncDir).
  Status PublishTemp(SlotFile& file);
  uint32_t WantedSlots() const {
    return static_cast<uint32_t>(opts_.max_in_flight) + 1 + opts_.extra_slots;
  }

  // Thread bodies.
  void DispatchLoop();
  void CopyJob(const std::shared_ptr<Job>& job);
  void WriteChunk(const std::shared_ptr<Job>& job, uint32_t j, StagingPool::Chunk chunk);
  void ChunksDone(const std::shared_ptr<Job>& job, uint64_t n);
  void CommitLoop();
  void FinishJob(const std::shared_ptr<Job>& job, bool committed, bool superseded, Status st);
  // Layer-wise (layerwise part of this file).
  void CopyLayerTensors(const std::shared_ptr<Job>& job, const std::vector<uint32_t>& tensors);
  void SealLayerJob(const std::shared_ptr<Job>& job);
  void MarkCopied(uint32_t tensor);
  void PublishFence(uint32_t tensor, std::vector<std::shared_ptr<CopyCompletion>> reads);
  Result<std::shared_ptr<Job>> OpenLayerJob(uint64_t counter);  // REQUIRES(mu_)
  // Requests the copies of `tensors` not requested yet and the seal. REQUIRES(mu_)
  void SealLocked(const std::shared_ptr<Job>& job);
  Status SnapshotNow(const std::shared_ptr<Job>& job, bool skip_requested);
  Status WaitSnapshotFree(const Registration& reg, uint32_t t);

  Status TakePendingError();  // REQUIRES(mu_)
  // After a Restore() that rolled back (newer checkpoints exist): records the
  // rollback durably through JobDir before anything new is written. REQUIRES(mu_)
  Status RecordRollback();
  Status CheckOpen();         // REQUIRES(mu_)
  void AddStall(double s);    // REQUIRES(mu_)
  Status WaitAllFinished(std::unique_lock<std::mutex>& lock);
  // Committer thread: notes every counter in unnoted_ through
  // JobDir::RecordNotDurable; the first error when one cannot be noted.
  Status NoteNotDurable();
  // Committer thread: `failed`'s commit failed on a sync of its slot file.
  void AfterFailedSync(const std::shared_ptr<Job>& failed, SlotMedium& sm);
  // Wraps a slot file's medium (opened as `name` in the job directory).
  std::unique_ptr<Medium> Wrap(std::unique_ptr<Medium> m, const std::string& name);
  Status SwitchFile(uint64_t slot_bytes, bool keep_old);
  Status GrowStaging(uint64_t state_bytes, std::unique_lock<std::mutex>& lock);
  Status ReadCheckpoint(const std::shared_ptr<SlotFile>& file, const CheckpointInfo& info);
  void ProtectRestored(const std::shared_ptr<SlotFile>& file, const CheckpointInfo& info);

  const EngineOptions opts_;
  const EngineMedia media_;
  // The job directory, opened as its writer for the engine's life (holds
  // the rank's lock); every file name and file operation goes through it.
  std::unique_ptr<JobDir> jd_;
  // Held around WriteAgreed (agreement thread) and the jd_.reset() in Close().
  std::mutex agreed_mu_;
  // The memory tier's writer (never null after Init; off in "disk" mode).
  std::unique_ptr<MemoryTierWriter> memory_;
  RetentionPolicy retention_;  // GUARDED_BY(mu_); keep_every from opts_
  std::unique_ptr<CopyEngine> copy_;
  std::unique_ptr<StagingPool> staging_;
  std::unique_ptr<TaskPool> writers_;
  std::string medium_desc_;
  std::string staging_note_;  // GUARDED_BY(mu_): the last cap note printed
  double staging_wait_s_before_ = 0;  // GUARDED_BY(mu_): waits in pools GrowStaging replaced
  // PrepareStaging: the pool a background thread allocates. prep_thread_ is
  // started and joined by the training thread only (PrepareStaging,
  // Register, Close); it touches nothing but *prep_ and copy_->AllocHost.
  struct PreparedStaging {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;                        // GUARDED_BY(mu)
    Result<std::unique_ptr<StagingPool>> pool{Status::Aborted("not allocated yet")};  // GUARDED_BY(mu)
  };
  std::shared_ptr<PreparedStaging> prep_;  // GUARDED_BY(mu_)
  std::thread prep_thread_;
  // Waits for the background allocation (if any) and returns its pool; the
  // seconds waited go to *waited_s (0 when it was done already).
  // Releases `lock` (mu_) while it waits; called with nothing in flight.
  Result<std::unique_ptr<StagingPool>> TakePrepared(double* waited_s,
                                                    std::unique_lock<std::mutex>& lock);
  uint64_t chunk_bytes_ = 0;
  uint32_t min_chunks_ = 1;
  int window_ = 2;  // chunks the dispatcher keeps copying ahead of the writers

  // The free slots of file_. Popped by the training thread (Checkpoint),
  // pushed by the committer; replaced only by Register while nothing is in
  // flight. See slot_queue.h for why a pop after observing in_flight_ < N
  // always succeeds.
  std::unique_ptr<SlotQueue> free_slots_;

  // The newest counter claimed for commit: written only by the committer (by
  // CAS, so a future multi-committer keeps the rule); an older checkpoint
  // that finishes after a newer one has claimed is superseded, never committed.
  std::atomic<uint64_t> claimed_{0};

  std::mutex mu_;
  std::condition_variable cv_;  // any change of the state below
  bool closed_ = false;                              // GUARDED_BY(mu_)
  bool stopping_ = false;                            // GUARDED_BY(mu_)
  std::shared_ptr<Registration> reg_;                // GUARDED_BY(mu_)
  std::shared_ptr<SlotFile> file_;                   // GUARDED_BY(mu_): where new checkpoints go
  // Set while file_ is a fresh temp slot file that has no commit yet: the
  // committed checkpoints still live in old_file_ under the slot file's name.
  std::shared_ptr<SlotFile> old_file_;               // GUARDED_BY(mu_)
  bool pending_rename_ = false;                      // GUARDED_BY(mu_)
  std::optional<uint32_t> retained_slot_;            // GUARDED_BY(mu_): newest committed, in file_
  // Distributed mode (global_agreement): retained_slot_ holds the candidate
  // (oldest committed above the pinned one) instead of the newest; the pinned
  // (last globally agreed) checkpoint's slot is held apart, in pinned_file_.
  std::optional<CommittedCheckpoint> candidate_;     // GUARDED_BY(mu_)
  std::optional<CommittedCheckpoint> pinned_;        // GUARDED_BY(mu_)
  std::optional<uint32_t> pinned_slot_;              // GUARDED_BY(mu_)
  std::shared_ptr<SlotFile> pinned_file_;            // GUARDED_BY(mu_)
  std::vector<int> free_snapshots_;                  // GUARDED_BY(mu_)
  uint64_t next_counter_ = 1;                        // GUARDED_BY(mu_)
  uint64_t committed_counter_ = 0;                   // GUARDED_BY(mu_)
  std::optional<CommittedCheckpoint> latest_;        // GUARDED_BY(mu_)
  int in_flight_ = 0;                                // GUARDED_BY(mu_)
  std::set<uint64_t> unfinished_;                    // GUARDED_BY(mu_)
  uint64_t started_last_ = 0;                        // GUARDED_BY(mu_)
  uint64_t copied_through_ = 0;                      // GUARDED_BY(mu_): dispatcher is FIFO
  std::deque<DispatchItem> dispatch_q_;              // GUARDED_BY(mu_)
  std::deque<std::shared_ptr<Job>> commit_q_;        // GUARDED_BY(mu_)
  std::map<uint64_t, std::shared_ptr<Job>> live_;    // GUARDED_BY(mu_): started, unfinished
  // Failures not yet handed to the caller, oldest first, with their counter.
  std::deque<std::pair<uint64_t, Status>> pending_errors_;  // GUARDED_BY(mu_)
  // Counters whose commit failed on a failed fsync: their record may be
  // readable (page cache) without being durable. Restore never picks them.
  std::set<uint64_t> not_durable_;                   // GUARDED_BY(mu_)
  std::vector<uint64_t> unnoted_;  // committer thread only: failed commits not yet noted
  // The counter the last Restore() rolled back to, until RecordRollback.
  std::optional<uint64_t> rollback_from_;            // GUARDED_BY(mu_)
  EngineStats stats_;                                // GUARDED_BY(mu_)
  // Layer-wise: per registered tensor, copies requested and copies done (the
  // dispatcher is FIFO, so done catches up with requested in order).
  std::vector<uint64_t> lw_requested_, lw_copied_;   // GUARDED_BY(mu_)
  uint64_t lw_requested_total_ = 0, lw_copied_total_ = 0;  // GUARDED_BY(mu_)
  // Device-side waits (WaitTensorsCopiedOnStream): per tensor, the copies the
  // dispatcher has taken up, the newest of them whose device reads are all
  // issued, and the completions of those reads.
  std::vector<uint64_t> lw_dispatched_, lw_fenced_;  // GUARDED_BY(mu_)
  std::vector<std::vector<std::shared_ptr<CopyCompletion>>> lw_fences_;  // GUARDED_BY(mu_)
  int open_ = 0;                                     // GUARDED_BY(mu_): open layer-wise jobs
  std::vector<int> free_small_;                      // GUARDED_BY(mu_)

  std::thread dispatcher_;
  std::thread committer_;
};

Status EngineImpl::Init() {
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
  if (opts_.global_agreement) tier = MemoryTierMode::kDisk;
  memory_ = MemoryTierWriter::Open(*jd_, opts_.env, rank(), tier, opts_.shm_dir,
                                   opts_.memory_tier_fit);

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
  if (staging == 0) {
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
  NONSTOP_ASSIGN_OR_RETURN(next_counter_, jd_->NextCounter(rank()));
  NONSTOP_ASSIGN_OR_RETURN(LineageRecord lineage, jd_->ReadLineage(rank()));
  Result<std::unique_ptr<Medium>> existing = OpenSlotMedium(false);
  if (!existing.ok() && existing.status().code() != StatusCode::kNotFound) return existing.status();
  if (existing.ok()) {
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
    for (const ScannedCheckpoint& c : report.checkpoints) {
      if (c.state == CheckpointState::kCommitted && !lineage.IsAbandoned(c.info.counter)) {
        newest = &c.info;
        break;
      }
    }
    if (newest != nullptr) {
      const CheckpointInfo& info = *newest;
      retained_slot_ = info.slot;
      latest_ = CommittedCheckpoint{info.counter, info.step};
      if (opts_.global_agreement) candidate_ = latest_;
      committed_counter_ = info.counter;
    }
    claimed_.store(committed_counter_);
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
  dispatcher_ = std::thread([this] { DispatchLoop(); });
  committer_ = std::thread([this] { CommitLoop(); });
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
  NONSTOP_RETURN_IF_ERROR(jd_->RecordRestore(rank(), *rollback_from_));
  NONSTOP_ASSIGN_OR_RETURN(uint64_t next, jd_->NextCounter(rank()));
  next_counter_ = std::max(next_counter_, next);
  rollback_from_.reset();
  return Status::OK();
}

Status EngineImpl::TakeError() {
  std::lock_guard<std::mutex> lock(mu_);
  return TakePendingError();
}

Status EngineImpl::CheckOpen() {
  if (closed_) return Status::FailedPrecondition("engine is closed");
  return Status::OK();
}

void EngineImpl::AddStall(double s) { stats_.stall_s_total += s; }

Status EngineImpl::WaitAllFinished(std::unique_lock<std::mutex>& lock) {
  cv_.wait(lock, [&] { return in_flight_ == 0; });
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
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> medium, OpenSlotMedium(true));
  SlotMedium* sm = static_cast<SlotMedium*>(medium.get());
  StoreGeometry g;
  g.slots = WantedSlots();
  g.slot_bytes = slot_bytes;
  g.rank = opts_.rank;
  g.world_size = opts_.world_size;
  Result<std::unique_ptr<SlotFile>> created = SlotFile::Create(std::move(medium), g);
  if (created.ok() && !keep_old) {
    if (Status rs = jd_->PublishTempSlot(); !rs.ok()) {
      created = rs;
    } else {
      sm->Renamed(JobDirNames::Slot(rank()));
    }
  }
  if (!created.ok()) {
    (void)jd_->DiscardTempSlot();  // best effort: the next open removes it too
    return created.status();
  }
  std::unique_ptr<SlotFile> sf = std::move(created).value();
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

// Default staging (no staging_bytes): grows the pool to DefaultStagingSize
// for the state about to be registered. The pool is replaced only with
// nothing in flight (writers release chunks into staging_), so a state that
// outgrows the pool waits for the checkpoints in flight once; it never
// shrinks. If the larger pool cannot be allocated the old one is kept.
Status EngineImpl::GrowStaging(uint64_t state_bytes, std::unique_lock<std::mutex>& lock) {
  const bool pinned = copy_->PinsHostMemory();
  const StagingSize want =
      DefaultStagingSize(state_bytes, chunk_bytes_, min_chunks_, PhysicalMemoryBytes(), pinned);
  if (want.capped && want.note != staging_note_) {
    std::fprintf(stderr, "nonstop: %s\n", want.note.c_str());
    staging_note_ = want.note;
  }
  if (want.bytes <= staging_->total_bytes()) return Status::OK();
  NONSTOP_RETURN_IF_ERROR(WaitAllFinished(lock));
  // A pool PrepareStaging allocated in the background, when large enough;
  // otherwise allocated here, on the training thread (counted either way).
  double waited_s = 0;
  const auto t0 = Clock::now();
  Result<std::unique_ptr<StagingPool>> grown = TakePrepared(&waited_s, lock);
  if (grown.ok() && grown.value()->total_bytes() < want.bytes) {
    grown = Status::Aborted("prepared staging is smaller than the state");
  }
  if (!grown.ok()) {
    grown = StagingPool::Create(copy_.get(), want.bytes, chunk_bytes_, min_chunks_);
    waited_s = Seconds(t0, Clock::now());
  }
  if (waited_s > 0) {
    stats_.staging_alloc_waits += 1;
    stats_.staging_alloc_wait_s += waited_s;
  }
  if (!grown.ok()) {
    std::fprintf(stderr, "nonstop: keeping %llu MiB of staging: %s\n",
                 static_cast<unsigned long long>(staging_->total_bytes() >> 20),
                 grown.status().ToString().c_str());
    return Status::OK();
  }
  staging_wait_s_before_ += staging_->wait_s_total();
  staging_ = std::move(grown).value();
  stats_.staging_bytes = staging_->total_bytes();
  return Status::OK();
}

Result<std::unique_ptr<StagingPool>> EngineImpl::TakePrepared(double* waited_s,
                                                              std::unique_lock<std::mutex>& lock) {
  *waited_s = 0;
  if (!prep_) return Status::NotFound("no staging prepared");
  std::shared_ptr<PreparedStaging> prep = std::move(prep_);
  prep_.reset();
  Result<std::unique_ptr<StagingPool>> pool{Status::Aborted("not allocated")};
  lock.unlock();  // Stats() and the background threads go on meanwhile
  {
    std::unique_lock<std::mutex> pl(prep->mu);
    if (!prep->done) {
      const auto t0 = Clock::now();
      prep->cv.wait(pl, [&] { return prep->done; });
      *waited_s = std::max(Seconds(t0, Clock::now()), 1e-9);
    }
    pool = std::move(prep->pool);
  }
  if (prep_thread_.joinable()) prep_thread_.join();  // done: returns at once
  lock.lock();
  if (pool.ok()) stats_.staging_prepared_bytes = pool.value()->total_bytes();
  return pool;
}

Status EngineImpl::PrepareStaging(uint64_t state_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  if (opts_.staging_bytes != 0 || prep_) return Status::OK();
  const bool pinned = copy_->PinsHostMemory();
  const uint64_t want =
      DefaultStagingSize(state_bytes, chunk_bytes_, min_chunks_, PhysicalMemoryBytes(), pinned).bytes;
  if (want <= staging_->total_bytes()) return Status::OK();
  if (prep_thread_.joinable()) prep_thread_.join();  // an earlier one, already taken
  auto prep = std::make_shared<PreparedStaging>();
  prep_ = prep;
  CopyEngine* copy = copy_.get();
  const uint64_t chunk = chunk_bytes_;
  const uint32_t min_chunks = min_chunks_;
  prep_thread_ = std::thread([prep, copy, want, chunk, min_chunks] {
    Result<std::unique_ptr<StagingPool>> pool = StagingPool::Create(copy, want, chunk, min_chunks);
    std::lock_guard<std::mutex> pl(prep->mu);
    prep->pool = std::move(pool);
    prep->done = true;
    prep->cv.notify_all();
  });
  return Status::OK();
}

Status EngineImpl::Register(std::vector<TensorRef> tensors) {
  std::unique_lock<std::mutex> lock(mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  NONSTOP_RETURN_IF_ERROR(TakePendingError());
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const TensorRef& t : tensors) {
    if (t.data == nullptr && t.spec.nbytes > 0) {
      return Status::InvalidArgument("tensor '" + t.spec.name + "' has no data pointer");
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
  cv_.wait(lock, [&] {
    return copied_through_ >= started_last_ && lw_copied_total_ >= lw_requested_total_;
  });

  const uint64_t slot_bytes = StoreGeometry::SlotBytesFor(layout);
  const bool fits = file_ && file_->geometry().slot_bytes >= slot_bytes &&
                    file_->geometry().slots >= WantedSlots();
  if (!fits) {
    // Slot ids and the retained slot belong to one file: switch with nothing in flight.
    NONSTOP_RETURN_IF_ERROR(WaitAllFinished(lock));
    const bool keep_old = file_ != nullptr && (latest_.has_value() || pending_rename_);
    NONSTOP_RETURN_IF_ERROR(SwitchFile(slot_bytes, keep_old));
    stats_.medium = medium_desc_;
  }
  if (opts_.staging_bytes == 0) NONSTOP_RETURN_IF_ERROR(GrowStaging(layout.data_bytes, lock));
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
  if (opts_.layer_copy == LayerCopy::kDevice && reg->lplan.small_begin > 0) {
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
  reg_ = std::move(reg);
  return Status::OK();
}

Result<uint64_t> EngineImpl::Checkpoint(int64_t step, std::string meta_json) {
  const auto t0 = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  // An earlier checkpoint's failure stays queued for TakeError() and the
  // wait calls: this checkpoint starts anyway, so one failure costs one.
  if (!reg_ || !file_) return Status::FailedPrecondition("Checkpoint before Register");
  NONSTOP_RETURN_IF_ERROR(RecordRollback());
  // The only place Checkpoint blocks on the pipeline: N already in flight
  // (unless they are all open layer-wise checkpoints, which cannot finish).
  cv_.wait(lock, [&] { return in_flight_ < opts_.max_in_flight || in_flight_ == open_; });
  if (in_flight_ >= opts_.max_in_flight) {
    return Status::FailedPrecondition(std::to_string(open_) +
                                      " layer-wise checkpoints are open (max_in_flight " +
                                      std::to_string(opts_.max_in_flight) +
                                      "): EndCheckpoint one first");
  }
  if (reg_->snapshot_bytes > 0 && free_snapshots_.empty()) {
    return Status::Internal("no free copy_at_checkpoint buffer below max_in_flight");
  }
  std::optional<uint32_t> slot = free_slots_->Pop();
  if (!slot) return Status::Internal("no free slot with fewer than max_in_flight in flight");

  auto job = std::make_shared<Job>();
  job->counter = next_counter_++;
  job->step = step;
  job->slot = *slot;
  job->reg = reg_;
  job->file = file_;
  job->meta_json = std::move(meta_json);
  job->t_start = t0;
  const Registration& reg = *reg_;
  job->src.resize(reg.tensors.size());
  job->src_device.resize(reg.tensors.size());
  job->crcs.assign(reg.plan.chunks.size(), 0);
  job->remaining.store(reg.plan.chunks.size());
  for (size_t i = 0; i < reg.tensors.size(); ++i) {
    job->src[i] = reg.tensors[i].data;
    job->src_device[i] = reg.tensors[i].device;
  }
  if (reg.snapshot_bytes > 0) {
    // At most N snapshots are out (one per in-flight checkpoint, given back
    // when its copies end), and we hold one of the N places, so one is free.
    job->snapshot = free_snapshots_.back();
    free_snapshots_.pop_back();
  }
  ++in_flight_;
  unfinished_.insert(job->counter);
  live_[job->counter] = job;
  ++stats_.started;
  lock.unlock();

  // copy_at_checkpoint tensors: copied now, on the caller's time, into the
  // snapshot buffer; the background pipeline reads the snapshot instead.
  Status copy_status;
  if (job->snapshot >= 0) {
    std::byte* base = reg.snapshots[job->snapshot];
    std::vector<std::unique_ptr<CopyCompletion>> done;
    for (size_t i = 0; i < reg.tensors.size(); ++i) {
      if (reg.snapshot_offset[i] < 0) continue;
      std::byte* dst = base + reg.snapshot_offset[i];
      done.push_back(copy_->Copy(reg.tensors[i].data, reg.tensors[i].device, dst,
                                 reg.tensors[i].spec.nbytes));
      job->src[i] = dst;
      job->src_device[i] = Device{};
    }
    for (auto& d : done) {
      Status s = d->Wait();
      if (copy_status.ok() && !s.ok()) copy_status = s;
    }
    if (!copy_status.ok()) job->Fail(copy_status.Annotate("copy_at_checkpoint"));
  }

  lock.lock();
  started_last_ = job->counter;
  dispatch_q_.push_back(DispatchItem{DispatchItem::kWhole, job, {}});
  const double stall = Seconds(t0, Clock::now());
  job->stall_s += stall;
  AddStall(stall);
  lock.unlock();
  cv_.notify_all();
  return job->counter;
}

Status EngineImpl::WaitCopied() {
  const auto t0 = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  if (copied_through_ < started_last_ || lw_copied_total_ < lw_requested_total_) {
    std::shared_ptr<Job> newest = live_.count(started_last_) ? live_[started_last_] : nullptr;
    cv_.wait(lock, [&] {
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
  std::unique_lock<std::mutex> lock(mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  std::shared_ptr<Job> job = live_.count(counter) ? live_[counter] : nullptr;
  if (counter == 0 ? open_ > 0 : (job && job->open)) {
    return Status::FailedPrecondition("WaitCommitted on an open layer-wise checkpoint: "
                                      "EndCheckpoint first");
  }
  cv_.wait(lock, [&] {
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
  std::lock_guard<std::mutex> lock(mu_);
  return latest_;
}

// ---- background: dispatcher ----------------------------------------------

void EngineImpl::DispatchLoop() {
  for (;;) {
    DispatchItem item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !dispatch_q_.empty(); });
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
      std::lock_guard<std::mutex> lock(mu_);
      if (job->snapshot >= 0) free_snapshots_.push_back(job->snapshot);
      copied_through_ = job->counter;
    }
    cv_.notify_all();
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
      const uint32_t j = c.j;
      const StagingPool::Chunk chunk = c.chunk;
      writers_->Submit([this, job, j, chunk] { WriteChunk(job, j, chunk); });
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
    std::lock_guard<std::mutex> lock(mu_);
    job->copy_s = Seconds(job->t_start, Clock::now());
  }
  if (issued < n) {
    ChunksDone(job, n - issued);
  } else if (n == 0) {
    std::lock_guard<std::mutex> lock(mu_);
    commit_q_.push_back(job);
    cv_.notify_all();
  }
}

// ---- background: writers -------------------------------------------------

void EngineImpl::WriteChunk(const std::shared_ptr<Job>& job, uint32_t j, StagingPool::Chunk chunk) {
  if (!job->failed.load(std::memory_order_acquire)) {
    const PlannedChunk& pc = job->reg->plan.chunks[j];
    job->crcs[j] = Crc32c(chunk.data, pc.bytes);
    Status st = job->file->WriteData(job->slot, pc.slot_offset, chunk.data, pc.bytes);
    if (!st.ok()) job->Fail(st);
  }
  staging_->Release(chunk);
  ChunksDone(job, 1);
}

void EngineImpl::ChunksDone(const std::shared_ptr<Job>& job, uint64_t n) {
  if (job->remaining.fetch_sub(n, std::memory_order_acq_rel) == n) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      commit_q_.push_back(job);
    }
    cv_.notify_all();
  }
}

// ---- background: committer -----------------------------------------------

void EngineImpl::CommitLoop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return (stopping_ && in_flight_ == 0) || !commit_q_.empty(); });
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
        std::lock_guard<std::mutex> lock(mu_);
        durable = committed_counter_;
      }
      claimed_.compare_exchange_strong(expected, durable, std::memory_order_acq_rel);
      FinishJob(job, false, false, failed);
      continue;
    }
    RetentionPolicy retention;
    {
      std::lock_guard<std::mutex> lock(mu_);
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
        std::lock_guard<std::mutex> lock(mu_);
        pending_errors_.emplace_back(job->counter, ks);
      }
    }
    // The memory tier copies it in the background (its slot stays retained
    // until the next commit; a reuse during the copy fails its crc check).
    memory_->Submit(job->file, info.value());
    FinishJob(job, true, false, Status::OK());
  }
}

Status EngineImpl::NoteNotDurable() {
  while (!unnoted_.empty()) {
    NONSTOP_RETURN_IF_ERROR(jd_->RecordNotDurable(rank(), unnoted_.front()));
    unnoted_.erase(unnoted_.begin());
  }
  return Status::OK();
}

Status EngineImpl::SetRetention(const RetentionPolicy& policy) {
  if (policy.Deletes() && opts_.world_size > 1) {
    return Status::InvalidArgument(
        "max_to_keep and best-k delete kept copies, which works with world_size 1 only for now");
  }
  if (policy.best_k > 0 && policy.best_metric.empty()) {
    return Status::InvalidArgument("best-k retention needs a metric name");
  }
  std::lock_guard<std::mutex> lock(mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  retention_ = policy;
  return Status::OK();
}

Status EngineImpl::DeleteKept(int64_t step) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    NONSTOP_RETURN_IF_ERROR(CheckOpen());
    NONSTOP_RETURN_IF_ERROR(WaitAllFinished(lock));
  }
  return jd_->DeleteKept(step);
}

// On Linux a failed fsync drops the dirty pages it could not write and
// consumes the error: the next fsync of the file returns 0 though those
// bytes never reached the disk. So every checkpoint in flight on this file
// may have lost bytes whatever its own sync says later: fail them all (their
// slots go back as they finish; the newest committed checkpoint was durable
// before and is untouched), then reopen the file so that later checkpoints,
// which rewrite their whole slot, can commit. If it cannot be reopened the
// medium stays dead and every later checkpoint fails with one line saying so.
void EngineImpl::AfterFailedSync(const std::shared_ptr<Job>& failed, SlotMedium& sm) {
  const std::string path = sm.path();
  {
    std::lock_guard<std::mutex> lock(mu_);
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

void EngineImpl::FinishJob(const std::shared_ptr<Job>& job, bool committed, bool superseded,
                           Status st) {
  const double persist_s = Seconds(job->t_start, Clock::now());
  std::unique_lock<std::mutex> lock(mu_);
  // The first commit into a resized file makes it the file: rename it over the
  // old one and sync the directory, so the old committed checkpoint is
  // replaced by a newer committed one in one atomic step.
  // In distributed mode the old file holds the pinned checkpoint: Pin renames.
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
      if (!retained_slot_) {
        retained_slot_ = job->slot;
        candidate_ = CommittedCheckpoint{job->counter, job->step};
      } else {
        free_slots_->Push(job->slot);
      }
    } else if (job->file == file_) {
      if (retained_slot_) free_slots_->Push(*retained_slot_);
      retained_slot_ = job->slot;
    }
    committed_counter_ = std::max(committed_counter_, job->counter);
    latest_ = CommittedCheckpoint{job->counter, job->step};
    ++stats_.committed;
  } else {
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
  CheckpointStats cs;
  cs.counter = job->counter;
  cs.step = job->step;
  cs.bytes = job->reg->layout.data_bytes;
  cs.stall_s = job->stall_s;
  cs.copy_s = job->copy_s;
  cs.persist_s = persist_s;
  cs.write_GBps = persist_s > 0 ? static_cast<double>(cs.bytes) / persist_s / 1e9 : 0;
  cs.committed = committed;
  if (superseded) cs.error = "superseded by a newer checkpoint";
  if (!st.ok()) cs.error = st.ToString();
  if (!committed && job->dropped) cs.error = "abandoned for a newer checkpoint";
  stats_.recent.push_back(std::move(cs));
  if (stats_.recent.size() > 64) stats_.recent.erase(stats_.recent.begin());
  unfinished_.erase(job->counter);
  live_.erase(job->counter);
  --in_flight_;
  lock.unlock();
  cv_.notify_all();
}

// ---- layer-wise checkpoints -----------------------------------------------

#include "engine/layerwise_engine.inc"

// ---- restore ---------------------------------------------------------------

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
      return Status::Unavailable("tensor '" + want.name +
                                 "' is in device memory: restore it through a host tensor");
    }
    stored_to_reg[k] = static_cast<int>(i);
  }
  std::vector<bool> include(info.tensors.size());
  for (size_t k = 0; k < include.size(); ++k) include[k] = stored_to_reg[k] >= 0;
  const ChunkPlan plan = ChunkPlan::Build(info.tensors, info.data_bytes, chunk_bytes_, include);

  // Chunks are read in parallel on the writer threads, each through a staging
  // chunk (aligned for O_DIRECT), verified, then scattered to the tensors.
  std::mutex mu;
  std::condition_variable cv;
  size_t pending = 0;  // GUARDED_BY(mu)
  Status first;        // GUARDED_BY(mu)
  for (const PlannedChunk& pc : plan.chunks) {
    if (pc.pieces.empty()) continue;
    {
      std::lock_guard<std::mutex> l(mu);
      ++pending;
    }
    writers_->Submit([&, pc_ptr = &pc] {
      Status st;
      Result<StagingPool::Chunk> chunk = staging_->Acquire();
      if (!chunk.ok()) {
        st = chunk.status();
      } else {
        st = ReadChunk(file, info, *pc_ptr, chunk->data);
        if (st.ok()) {
          for (const ChunkPiece& p : pc_ptr->pieces) {
            auto* dst = static_cast<std::byte*>(const_cast<void*>(
                            tensors[stored_to_reg[p.tensor]].data)) + p.tensor_offset;
            std::memcpy(dst, chunk->data + p.chunk_offset, p.bytes);
          }
        }
        staging_->Release(*chunk);
      }
      std::lock_guard<std::mutex> l(mu);
      if (first.ok() && !st.ok()) first = st;
      if (--pending == 0) cv.notify_all();
    });
  }
  std::unique_lock<std::mutex> l(mu);
  cv.wait(l, [&] { return pending == 0; });
  return first;
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
  std::unique_lock<std::mutex> lock(mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  NONSTOP_RETURN_IF_ERROR(TakePendingError());
  if (!reg_) return Status::FailedPrecondition("Restore before Register");
  if (open_ > 0) {
    return Status::FailedPrecondition("Restore while a layer-wise checkpoint is open: "
                                      "EndCheckpoint first");
  }
  NONSTOP_RETURN_IF_ERROR(WaitAllFinished(lock));
  std::shared_ptr<SlotFile> file = pending_rename_ ? old_file_ : file_;
  if (!file) return Status::NotFound("no checkpoint in " + opts_.dir);
  ScanOptions so;
  so.verify_data = false;  // each chunk's crc is verified as it is read below
  NONSTOP_ASSIGN_OR_RETURN(ScanReport report, file->Scan(so));
  NONSTOP_ASSIGN_OR_RETURN(LineageRecord lineage, jd_->ReadLineage(rank()));
  std::vector<std::string> skipped;
  for (const ScannedCheckpoint& c : report.checkpoints) {
    if (c.state != CheckpointState::kCommitted) continue;
    if (step && c.info.step != *step) continue;
    if (not_durable_.count(c.info.counter) != 0) continue;  // its commit's fsync failed
    if (lineage.IsAbandoned(c.info.counter)) {
      skipped.push_back("checkpoint " + std::to_string(c.info.counter) + " (step " +
                        std::to_string(c.info.step) + ") was rolled back from by a restore");
      continue;
    }
    Status st = Status::Internal("not read");
    bool from_memory = false;
    if (!step && skipped.empty() && memory_->on()) {
      // The memory tier: the segment, when it holds exactly this checkpoint.
      Result<std::optional<MemorySegment>> seg =
          OpenMemorySegment(opts_.dir, rank(), opts_.shm_dir, opts_.env, &c.info, nullptr);
      if (seg.ok() && seg.value().has_value()) {
        std::shared_ptr<SlotFile> mf = std::move(seg.value()->file);
        st = ReadCheckpoint(mf, seg.value()->info);
        from_memory = st.ok();
      }
    }
    if (!from_memory) st = ReadCheckpoint(file, c.info);
    if (st.ok()) {
      stats_.restored_from_memory = from_memory;
      stats_.restore_s = Seconds(t0, Clock::now());
      // A rollback is final (DESIGN.md invariant 9): when newer records
      // exist (damaged, or an older step asked for), the next checkpoint
      // first records durably that their counters are abandoned
      // (RecordRollback), in distributed mode too (there Pin keeps the slot).
      rollback_from_.reset();
      if (report.checkpoints.front().info.counter > c.info.counter) {
        rollback_from_ = c.info.counter;
      }
      ProtectRestored(file, c.info);
      AddStall(Seconds(t0, Clock::now()));
      return c.info;
    }
    // Damaged bytes: fall back to an older checkpoint of the same step or,
    // without a step, any older one. Mismatched tensors are the caller's error.
    if (st.code() != StatusCode::kCorruption && st.code() != StatusCode::kIOError) return st;
    skipped.push_back("checkpoint " + std::to_string(c.info.counter) + ": " + st.message());
  }
  std::string why = step ? "no valid checkpoint of step " + std::to_string(*step)
                         : "no valid checkpoint";
  why += " in " + file->medium().Describe();
  for (const auto& s : skipped) why += "; " + s;
  return Status::NotFound(why);
}

Status EngineImpl::AdoptRestored(uint64_t counter) {
  std::unique_lock<std::mutex> lock(mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  if (open_ > 0) {
    return Status::FailedPrecondition("AdoptRestored while a layer-wise checkpoint is open: "
                                      "EndCheckpoint first");
  }
  NONSTOP_RETURN_IF_ERROR(WaitAllFinished(lock));
  std::shared_ptr<SlotFile> file = pending_rename_ ? old_file_ : file_;
  rollback_from_.reset();
  if (!file) return Status::OK();  // restored from elsewhere (a keep copy, a remote), no file yet
  ScanOptions so;
  so.verify_data = false;  // the caller verified what it read
  NONSTOP_ASSIGN_OR_RETURN(ScanReport report, file->Scan(so));
  uint64_t newest = 0;
  for (const ScannedCheckpoint& c : report.checkpoints) newest = std::max(newest, c.info.counter);
  if (newest > counter) rollback_from_ = counter;
  // Distributed mode: ProtectRestored leaves the slot to Pin (the caller
  // pins `counter`); the rollback above is recorded all the same, so a crash
  // never resumes a rank's abandoned future (DESIGN.md invariant 9).
  for (const ScannedCheckpoint& c : report.checkpoints) {
    if (c.state == CheckpointState::kCommitted && c.info.counter == counter) {
      ProtectRestored(file, c.info);
      break;
    }
  }
  return Status::OK();
}

EngineStats EngineImpl::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  EngineStats s = stats_;
  s.in_flight = in_flight_;
  s.medium = medium_desc_;
  s.staging_wait_s_total = staging_wait_s_before_ + (staging_ ? staging_->wait_s_total() : 0);
  if (memory_) {
    const MemoryTierStats m = memory_->stats();
    s.memory_tier = m.mode;
    s.memory_segment = m.segment;
    s.memory_mirrored = m.mirrored;
    s.memory_counter = m.mirrored_counter;
    s.memory_failures = m.failures;
    s.memory_error = m.last_error;
  }
  if (prep_) {  // allocated in the background, not taken by Register yet
    std::lock_guard<std::mutex> pl(prep_->mu);
    if (prep_->done && prep_->pool.ok()) s.staging_prepared_bytes = prep_->pool.value()->total_bytes();
  }
  return s;
}

Result<int> EngineImpl::AbandonOlderThan(uint64_t counter) {
  std::unique_lock<std::mutex> lock(mu_);
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
  lock.unlock();
  cv_.notify_all();
  return n;
}

Status EngineImpl::Pin(uint64_t counter) {
  std::unique_lock<std::mutex> lock(mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  if (!opts_.global_agreement) {
    return Status::FailedPrecondition("Pin needs EngineOptions::global_agreement");
  }
  if (pinned_ && pinned_->counter == counter) return Status::OK();
  if (candidate_ && candidate_->counter == counter && retained_slot_) {
    if (pending_rename_) {  // the first pin in a resized file makes it the file
      NONSTOP_RETURN_IF_ERROR(PublishTemp(*file_));
      pending_rename_ = false;
      old_file_.reset();
    }
    if (pinned_slot_ && pinned_file_ == file_) free_slots_->Push(*pinned_slot_);
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
  std::lock_guard<std::mutex> lock(mu_);
  return candidate_;
}

Status EngineImpl::DropCandidate(uint64_t counter) {
  std::lock_guard<std::mutex> lock(mu_);
  NONSTOP_RETURN_IF_ERROR(CheckOpen());
  if (candidate_ && candidate_->counter == counter && retained_slot_) {
    free_slots_->Push(*retained_slot_);
    retained_slot_.reset();
    candidate_.reset();
  }
  return Status::OK();
}

Status EngineImpl::WriteAgreed(const AgreedRecord& rec) {
  // Not under mu_: the record's fsyncs never stall the training thread.
  std::lock_guard<std::mutex> l(agreed_mu_);
  if (!jd_) return Status::FailedPrecondition("the engine of " + opts_.dir + " is closed");
  return jd_->WriteAgreed(rec);
}

Status EngineImpl::Close() {
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) return Status::OK();
  // Open layer-wise checkpoints can never be sealed now: fail them quietly
  // (their slots go back; the newest committed checkpoint is untouched).
  for (auto& [counter, job] : live_) {
    if (!job->open) continue;
    job->abandoned = true;
    job->Fail(Status::Aborted("engine closed before EndCheckpoint"));
    SealLocked(job);
  }
  lock.unlock();
  cv_.notify_all();
  lock.lock();
  cv_.wait(lock, [&] { return in_flight_ == 0; });
  closed_ = true;
  stopping_ = true;
  Status st = TakePendingError();
  lock.unlock();
  cv_.notify_all();
  if (dispatcher_.joinable()) dispatcher_.join();
  if (committer_.joinable()) committer_.join();
  writers_.reset();
  // A clean close: everything is on disk; the segment's memory goes back.
  if (memory_) memory_->Close(/*remove_segment=*/true);
  lock.lock();
  reg_.reset();
  file_.reset();
  old_file_.reset();
  pinned_file_.reset();
  std::shared_ptr<PreparedStaging> prep = std::move(prep_);
  prep_.reset();
  lock.unlock();
  if (prep_thread_.joinable()) prep_thread_.join();
  prep.reset();  // frees a prepared pool nobody took
  staging_.reset();
  {
    std::lock_guard<std::mutex> l(agreed_mu_);
    jd_.reset();  // releases the writer lock
  }
  return st;
}

}  // namespace

uint64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 0;
}

StagingSize DefaultStagingSize(uint64_t state_bytes, uint64_t chunk_bytes, uint32_t min_chunks,
                               uint64_t ram_bytes, bool pinned) {
  const uint64_t b = std::max<uint64_t>(chunk_bytes, 1);
  auto up = [b](uint64_t x) { return (x + b - 1) / b * b; };
  const uint64_t floor_bytes = std::max<uint64_t>(uint64_t{min_chunks} * b, 1);
  StagingSize r;
  r.bytes = std::max({up(kStagingFloorBytes), up(state_bytes), floor_bytes});
  uint64_t cap = ram_bytes > 0 ? ram_bytes / 4 : UINT64_MAX;
  const char* why = "a quarter of physical memory";
  if (pinned && cap > kPinnedStagingCapBytes) {
    cap = kPinnedStagingCapBytes;
    why = "the pinned-memory cap";
  }
  cap = std::max(cap / b * b, floor_bytes);
  if (r.bytes > cap) {
    r.capped = state_bytes > cap;
    r.bytes = cap;
  }
  if (r.capped) {
    char buf[320];
    std::snprintf(buf, sizeof(buf),
                  "staging capped at %.2f GiB (%s) for a %.2f GiB state: each checkpoint's copy "
                  "waits for the medium to write the other %.2f GiB; set staging_bytes to "
                  "override",
                  static_cast<double>(r.bytes) / (1 << 30), why,
                  static_cast<double>(state_bytes) / (1 << 30),
                  static_cast<double>(state_bytes - r.bytes) / (1 << 30));
    r.note = buf;
  }
  return r;
}

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

Status Engine::AdoptRestored(uint64_t) { return Status::OK(); }
Status Engine::WriteAgreed(const AgreedRecord&) {
  return Status::FailedPrecondition("this engine keeps no agreed records");
}
Status Engine::PrepareStaging(uint64_t) { return Status::OK(); }

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
  auto engine = std::make_unique<EngineImpl>(opts, std::move(media));
  NONSTOP_RETURN_IF_ERROR(engine->Init().Annotate("open engine in " + opts.dir));
  return std::unique_ptr<Engine>(std::move(engine));
}

}  // namespace nonstop
