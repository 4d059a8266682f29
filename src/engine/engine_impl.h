// The engine's inside: the state of EngineImpl and the rules that guard it.
// docs/ENGINE.md describes the data path and the threading; this file keeps
// the rules next to the data they protect. The pipeline is
// dispatcher -> staging -> writers -> committer; each stage has its file:
//   engine.cc            Init, Register, slot files, Close
//   engine_staging.cc    the staging pool's size and background allocation
//   engine_dispatch.cc   Checkpoint, the waits, the dispatcher, device snapshots
//   engine_writers.cc    the one write path of every unit of bytes
//   engine_commit.cc     the committer, retention, the distributed pin
//   engine_restore.cc    Restore, AdoptRestored
//   engine_stats.cc      Stats
//   layerwise_schedule.cc  the layer-wise schedule (Begin/Copy/Wait/End)
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
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <functional>
#include <thread>

#include "engine/chunk_plan.h"
#include "engine/commit_watch.h"
#include "engine/device_snapshot.h"
#include "engine/engine_internal.h"
#include "engine/layerwise_plan.h"
#include "engine/memory_tier.h"
#include "engine/slot_medium.h"
#include "engine/slot_queue.h"
#include "base/mutex.h"
#include "base/task_pool.h"
#include "base/thread_annotations.h"
#include "nonstop/copy_engine.h"
#include "nonstop/engine.h"
#include "nonstop/env.h"
#include "nonstop/jobdir.h"
#include "nonstop/plan.h"
#include "stage/staging_pool.h"

namespace nonstop::engine_detail {

using Clock = std::chrono::steady_clock;

// The SlotMedium every slot file the engine opens is wrapped in (null for
// none, which does not happen).
inline SlotMedium* SlotOf(SlotFile& f) { return dynamic_cast<SlotMedium*>(&f.medium()); }

inline double Seconds(Clock::time_point a, Clock::time_point b) {
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
  mutable Mutex snapshot_mu;  // with snapshot_cv: a count reaching 0 wakes the dispatcher
  mutable CondVar snapshot_cv;
  // kDevice with a copy engine that CanSnapshotOnDevice: per device tensor,
  // its second buffer in device memory (nullptr otherwise); drained into
  // device_snapshot.
  std::vector<void*> device_buffers;

  // Device snapshots of whole checkpoints (EngineOptions::device_snapshot_bytes;
  // engine_dispatch.cc): per tensor, its buffer in device memory (nullptr: its
  // bytes always go straight to the host), the buffered tensors in the order
  // a checkpoint takes them (highest slot offset first), and per device the
  // one allocation they live in. One set: a checkpoint holds all of it from
  // Checkpoint() until its drain is complete (Engine::dsnap_busy_).
  std::vector<void*> dsnap_buffer;
  std::vector<uint32_t> dsnap_order;
  std::vector<std::pair<int, void*>> dsnap_allocs;
  uint64_t dsnap_capacity = 0;  // bytes of tensors with a buffer
  uint64_t device_bytes = 0;    // bytes of device tensors the chunks copy

  ~Registration() {
    for (auto& [device, p] : dsnap_allocs) copy->FreeDevice(device, p);
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

  // Device snapshot (concurrent checkpoints): whether the job holds the
  // registration's snapshot set, per tensor whether its pieces are drained
  // from its snapshot buffer (src is that buffer), the device-to-device
  // copies Checkpoint() started at t_d2d, and the bytes of each kind. Set
  // before the job is queued; read by the dispatcher.
  bool dsnap = false;
  std::vector<bool> drain;
  std::vector<std::unique_ptr<CopyCompletion>> d2d;
  Clock::time_point t_d2d;
  uint64_t snapshot_bytes = 0, direct_bytes = 0;
  double release_s = 0;  // GUARDED_BY(engine mu_): start -> WaitCopied may return

  // Each crc is written by the one writer task of its chunk; the committer
  // reads them after `remaining` reached 0 (acq_rel on the decrement).
  std::vector<uint32_t> crcs;
  // Set by the committer once committed (the tiered cadence offers it to
  // the disk from FinishJob).
  std::optional<CheckpointInfo> info;
  bool to_memory = false;  // the tiered cadence: it commits into the memory tier's file
  // A checkpoint a retention rule keeps (keep_every's counter, or carrying
  // the best= metric): it is never superseded; a newer one that finishes
  // first waits for it in deferred_ (MarkMustCommit). GUARDED_BY(Engine::mu_).
  bool must_commit = false;
  std::atomic<uint64_t> remaining{0};
  std::atomic<bool> failed{false};
  Mutex error_mu;
  Status error GUARDED_BY(error_mu);  // the first failure

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
    MutexLock lock(&error_mu);
    if (error.ok()) error = s;
    failed.store(true, std::memory_order_release);
  }
  Status TakeError() {
    MutexLock lock(&error_mu);
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

// One unit of bytes on its way to the medium: a chunk of a whole checkpoint
// (ChunkPlan) or a unit of a layer-wise one (LayerPlan). Its crc covers
// `bytes` at `data` then `zero_pad` zero bytes (a unit written straight from
// a tensor's memory, whose padding is not in that memory).
struct UnitWrite {
  uint32_t* crc = nullptr;  // where the crc goes: job->crcs[j] or job->unit_crcs[u]
  uint64_t slot_offset = 0;
  const std::byte* data = nullptr;
  uint64_t bytes = 0;
  uint64_t zero_pad = 0;  // < kStoreAlign
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
  AgreeOffer Offer() override;
  Result<bool> Aim(int64_t step) override;
  Status WriteAgreed(const AgreedRecord& rec) override;
  std::shared_ptr<CommitWatch> Watch() override { return watch_; }

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
  // Writers: the one write path of every unit. Unless the job has failed,
  // crcs the unit and writes it at its slot offset (an error fails the job);
  // then `release` gives back what held its bytes (a staging chunk, a
  // snapshot's count) and the unit counts as done (ChunksDone). Run on a
  // writer thread (SubmitWrite) or, for a unit with nothing to write, inline.
  void WriteUnit(const std::shared_ptr<Job>& job, const UnitWrite& w,
                 const std::function<void()>& release);
  void SubmitWrite(const std::shared_ptr<Job>& job, UnitWrite w, std::function<void()> release);
  void ChunksDone(const std::shared_ptr<Job>& job, uint64_t n);
  void CommitLoop();
  void FinishJob(const std::shared_ptr<Job>& job, bool committed, bool superseded, Status st);
  // Gives slot `slot` of `file` back to the free queue (when `file` is
  // file_), or defers that while the memory tier copies it.
  void ReleaseSlot(const SlotFile* file, uint32_t slot) REQUIRES(mu_);
  // The memory tier is done with (file, slot) (its release callback).
  void MirrorDone(const std::shared_ptr<SlotFile>& file, uint32_t slot) EXCLUDES(mu_);
  void RecordFinished(const Job& job, bool committed, bool superseded, const Status& st,
                      double persist_s) REQUIRES(mu_);
  // Layer-wise (layerwise_schedule.cc).
  void CopyLayerTensors(const std::shared_ptr<Job>& job, const std::vector<uint32_t>& tensors);
  void SealLayerJob(const std::shared_ptr<Job>& job);
  void MarkCopied(uint32_t tensor);
  void PublishFence(uint32_t tensor, std::vector<std::shared_ptr<CopyCompletion>> reads);
  Result<std::shared_ptr<Job>> OpenLayerJob(uint64_t counter) REQUIRES(mu_);
  // Sets job.must_commit from its counter and meta_json (retention rules)
  // once its metadata is known.
  void MarkMustCommit(Job& job) REQUIRES(mu_);
  // Requests the copies of `tensors` not requested yet and the seal.
  void SealLocked(const std::shared_ptr<Job>& job) REQUIRES(mu_);
  Status SnapshotNow(const std::shared_ptr<Job>& job, bool skip_requested);
  // Device snapshots (engine_dispatch.cc): Register's buffers, Checkpoint's
  // device-to-device copies, the dispatcher's release of a job.
  void AllocDeviceSnapshots(Registration& reg) REQUIRES(mu_);
  void StartDeviceSnapshot(Job& job, uint64_t wanted);
  void ReleaseJob(Job& job) EXCLUDES(mu_);
  Status WaitSnapshotFree(const Registration& reg, uint32_t t);

  // Checkpoint and BeginCheckpoint: waits for a place in flight, takes a slot
  // and the buffers a checkpoint holds, and makes the job live. `what` names
  // the caller in errors.
  Result<std::shared_ptr<Job>> AdmitLocked(int64_t step, Clock::time_point t0, bool layerwise,
                                           const char* what) REQUIRES(mu_);
  Status TakePendingError() REQUIRES(mu_);
  // After a Restore() that rolled back (newer checkpoints exist): records the
  // rollback durably through JobDir before anything new is written.
  Status RecordRollback() REQUIRES(mu_);
  Status CheckOpen() REQUIRES(mu_);
  void AddStall(double s) REQUIRES(mu_);
  // Waits (releasing mu_) until nothing is in flight.
  Status WaitAllFinished() REQUIRES(mu_);
  // Committer thread: notes every counter in unnoted_ through
  // JobDir::RecordNotDurable; the first error when one cannot be noted.
  Status NoteNotDurable();
  // Committer thread: `failed`'s commit failed on a sync of its slot file.
  void AfterFailedSync(const std::shared_ptr<Job>& failed, SlotMedium& sm);
  // Wraps a slot file's medium (opened as `name` in the job directory).
  std::unique_ptr<Medium> Wrap(std::unique_ptr<Medium> m, const std::string& name);
  Status SwitchFile(uint64_t slot_bytes, bool keep_old) REQUIRES(mu_);
  // A new, empty slot file of geometry g, laid out and synced under the temp
  // name; with publish, renamed over the slot file's name and the directory
  // synced; with never_replace, FailedPrecondition when a slot file exists.
  // A failure removes the temp file. Runs on the training thread
  // (SwitchFile) or on file_prep_thread_ (touches only jd_ and media_).
  Result<std::unique_ptr<SlotFile>> CreateSlotFile(const StoreGeometry& g, bool publish,
                                                   bool never_replace);
  // The first Register: takes the slot file PrepareStaging created in the
  // background (waiting while it is still being created). Sets *adopted when
  // it fits `slot_bytes` (and is not much larger) and becomes file_; a file
  // that does not fit stays at the slot file's name, empty, and the caller
  // creates one as without it. Its creation's error is returned.
  Status AdoptPreparedFile(uint64_t slot_bytes, bool* adopted) REQUIRES(mu_);
  Status ReplaceStaging(std::unique_ptr<StagingPool> pool) REQUIRES(mu_);
  Status GrowStaging(uint64_t state_bytes) REQUIRES(mu_);
  // A registration of staged tensors only: the pool goes down to its
  // smallest (min_chunks_ chunks), with nothing in flight.
  Status ShrinkStaging() REQUIRES(mu_);
  Status ReadCheckpoint(const std::shared_ptr<SlotFile>& file, const CheckpointInfo& info)
      REQUIRES(mu_);
  void ProtectRestored(const std::shared_ptr<SlotFile>& file, const CheckpointInfo& info)
      REQUIRES(mu_);

  const EngineOptions opts_;
  const EngineMedia media_;
  // The job directory, opened as its writer for the engine's life (holds
  // the rank's lock); every file name and file operation goes through it.
  std::unique_ptr<JobDir> jd_;
  // Told of every finished checkpoint (RecordFinished, under mu_) and agreed
  // step (WriteAgreed, under agreed_mu_). Its own mutex is a leaf: it never
  // calls back into the engine.
  const std::shared_ptr<CommitWatch> watch_ = std::make_shared<CommitWatch>(opts_.global_agreement);
  // Held around WriteAgreed (agreement thread) and the jd_.reset() in Close().
  Mutex agreed_mu_;
  // The memory tier's writer (never null after Init; off in "disk" mode).
  std::unique_ptr<MemoryTierWriter> memory_;
  RetentionPolicy retention_ GUARDED_BY(mu_);  // keep_every from opts_
  std::unique_ptr<CopyEngine> copy_;
  std::unique_ptr<StagingPool> staging_;
  std::unique_ptr<TaskPool> writers_;
  std::string medium_desc_ GUARDED_BY(mu_);
  std::string staging_note_ GUARDED_BY(mu_);  // the last cap note printed
  double staging_wait_s_before_ GUARDED_BY(mu_) = 0;  // waits in pools GrowStaging replaced
  // What PrepareStaging makes on a background thread: the thread Sets it
  // once; the training thread takes it (TakeBackground), waiting while it is
  // not done yet.
  template <typename T>
  struct Prepared {
    Mutex mu;
    CondVar cv;
    bool done GUARDED_BY(mu) = false;
    Result<T> value GUARDED_BY(mu){Status::Aborted("not made yet")};
    void Set(Result<T> v) EXCLUDES(mu) {
      MutexLock l(&mu);
      value = std::move(v);
      done = true;
      cv.SignalAll();
    }
  };
  // Takes *p, which `thread` makes: waits while it is not done (with mu_
  // released, so Stats() and the background threads go on), then joins the
  // thread (done: it returns at once). *waited_s: how long it waited, 0 when
  // it was done already.
  template <typename T>
  Result<T> TakeBackground(Prepared<T>& p, std::thread& thread, double* waited_s) REQUIRES(mu_) {
    *waited_s = 0;
    Result<T> got{Status::Aborted("not made")};
    mu_.Unlock();
    {
      MutexLock pl(&p.mu);
      if (!p.done) {
        const auto t0 = Clock::now();
        p.cv.Wait(&p.mu, [&]() REQUIRES(p.mu) { return p.done; });
        *waited_s = std::max(Seconds(t0, Clock::now()), 1e-9);
      }
      got = std::move(p.value);
    }
    if (thread.joinable()) thread.join();
    mu_.Lock();
    return got;
  }
  // PrepareStaging: the pool a background thread allocates. prep_thread_ is
  // started and joined by the training thread only (PrepareStaging,
  // Register, Close); it touches nothing but *prep_ and copy_->AllocHost.
  using PreparedStaging = Prepared<std::unique_ptr<StagingPool>>;
  std::shared_ptr<PreparedStaging> prep_ GUARDED_BY(mu_);
  std::thread prep_thread_;
  // PrepareStaging also creates the slot file in the background when this
  // rank has none yet (it was created inside the first Register: fallocate,
  // fdatasync and a directory fsync, ~22 ms on the training thread). Sized
  // from the state's estimate (PreparedSlotBytes); the first Register adopts
  // it when it fits (AdoptPreparedFile). Same threading as prep_thread_.
  using PreparedFile = Prepared<std::unique_ptr<SlotFile>>;
  std::shared_ptr<PreparedFile> file_prep_ GUARDED_BY(mu_);
  std::thread file_prep_thread_;
  // Frees the pool GrowStaging (or ShrinkStaging) replaced, off the training
  // thread (unlocking and unmapping the 256 MiB default pool took ~40 ms
  // inside the first save()). Started and joined by the thread that calls
  // Register and Close (the training thread; a MultistepCheckpoint's
  // finisher, serialised with it); it touches nothing but the pool it owns
  // and copy_->FreeHost.
  std::thread retire_thread_;
  // Waits for the background allocation (if any) and returns its pool; the
  // seconds waited go to *waited_s (0 when it was done already).
  // Releases `lock` (mu_) while it waits; called with nothing in flight.
  Result<std::unique_ptr<StagingPool>> TakePrepared(double* waited_s) REQUIRES(mu_);
  uint64_t chunk_bytes_ = 0;
  uint32_t min_chunks_ = 1;
  int window_ = 2;  // chunks the dispatcher keeps copying ahead of the writers

  // The free slots of file_. Popped by the training thread (Checkpoint),
  // pushed by the committer; replaced only by Register while nothing is in
  // flight. See slot_queue.h for why a pop after observing in_flight_ < N
  // always succeeds.
  std::unique_ptr<SlotQueue> free_slots_ GUARDED_BY(mu_);

  // The newest counter claimed for commit: written only by the committer (by
  // CAS, so a future multi-committer keeps the rule); an older checkpoint
  // that finishes after a newer one has claimed is superseded, never committed.
  std::atomic<uint64_t> claimed_{0};

  Mutex mu_;
  CondVar cv_;  // any change of the state below
  bool closed_ GUARDED_BY(mu_) = false;
  bool stopping_ GUARDED_BY(mu_) = false;
  std::shared_ptr<Registration> reg_ GUARDED_BY(mu_);
  std::shared_ptr<SlotFile> file_ GUARDED_BY(mu_);  // where new checkpoints go
  // Set while file_ is a fresh temp slot file that has no commit yet: the
  // committed checkpoints still live in old_file_ under the slot file's name.
  std::shared_ptr<SlotFile> old_file_ GUARDED_BY(mu_);
  bool pending_rename_ GUARDED_BY(mu_) = false;
  std::optional<uint32_t> retained_slot_ GUARDED_BY(mu_);  // newest committed, in file_
  // Distributed mode (global_agreement): retained_slot_ holds the candidate
  // (oldest committed above the pinned one) instead of the newest; the pinned
  // (last globally agreed) checkpoint's slot is held apart, in pinned_file_.
  std::optional<CommittedCheckpoint> candidate_ GUARDED_BY(mu_);
  // The agreement's aim (Aim): commits below it are not kept as candidate.
  int64_t aim_ GUARDED_BY(mu_) = INT64_MIN;
  std::optional<int64_t> started_step_ GUARDED_BY(mu_);  // the newest Checkpoint's step
  // A restore sends training back to the restored step: the agreement's aim
  // and the newest started step from before it are forgotten, or every new
  // commit below them would stay out of the candidate (no agreement until the
  // steps caught up again).
  void ForgetAgreementProgress() REQUIRES(mu_) {
    aim_ = INT64_MIN;
    started_step_.reset();
  }
  std::optional<CommittedCheckpoint> pinned_ GUARDED_BY(mu_);
  std::optional<uint32_t> pinned_slot_ GUARDED_BY(mu_);
  std::shared_ptr<SlotFile> pinned_file_ GUARDED_BY(mu_);
  // The memory tier reads a committed checkpoint's slot while it copies it
  // (MemoryTierWriter::Submit): such a slot is held here until the copy
  // ends (MirrorDone), and a release that comes first (ReleaseSlot: a
  // newer commit, Pin, DropCandidate) is deferred until then, so a newer
  // checkpoint never writes into a slot the mirror reads.
  std::map<std::pair<const SlotFile*, uint32_t>, int> mirror_holds_ GUARDED_BY(mu_);
  std::set<std::pair<const SlotFile*, uint32_t>> mirror_deferred_ GUARDED_BY(mu_);
  std::vector<int> free_snapshots_ GUARDED_BY(mu_);
  uint64_t next_counter_ GUARDED_BY(mu_) = 1;
  uint64_t committed_counter_ GUARDED_BY(mu_) = 0;
  std::optional<CommittedCheckpoint> latest_ GUARDED_BY(mu_);
  int in_flight_ GUARDED_BY(mu_) = 0;
  std::set<uint64_t> unfinished_ GUARDED_BY(mu_);
  uint64_t started_last_ GUARDED_BY(mu_) = 0;
  uint64_t copied_through_ GUARDED_BY(mu_) = 0;  // dispatcher is FIFO
  // Whole checkpoints whose sources training may overwrite (WaitCopied): all
  // copied, or (device snapshots) snapshotted and the rest copied. FIFO too.
  uint64_t released_through_ GUARDED_BY(mu_) = 0;
  bool dsnap_busy_ GUARDED_BY(mu_) = false;  // a job holds reg_'s snapshot set
  SnapshotRates dsnap_rates_ GUARDED_BY(mu_);  // the plan's measurements
  std::optional<Clock::time_point> ckpt_returned_ GUARDED_BY(mu_);  // for window_s
  std::deque<DispatchItem> dispatch_q_ GUARDED_BY(mu_);
  std::deque<std::shared_ptr<Job>> commit_q_ GUARDED_BY(mu_);
  // Unfinished checkpoints that must commit (Job::must_commit), and the newer
  // ones that finished writing first: they go back to commit_q_, oldest
  // first, when one of those finishes (committed or failed).
  std::set<uint64_t> must_commit_ GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Job>> deferred_ GUARDED_BY(mu_);
  std::map<uint64_t, std::shared_ptr<Job>> live_ GUARDED_BY(mu_);  // started, unfinished
  // Failures not yet handed to the caller, oldest first, with their counter.
  std::deque<std::pair<uint64_t, Status>> pending_errors_ GUARDED_BY(mu_);
  // Counters whose commit failed on a failed fsync: their record may be
  // readable (page cache) without being durable. Restore never picks them.
  std::set<uint64_t> not_durable_ GUARDED_BY(mu_);
  std::vector<uint64_t> unnoted_;  // committer thread only: failed commits not yet noted
  // The counter the last Restore() rolled back to, until RecordRollback.
  std::optional<uint64_t> rollback_from_ GUARDED_BY(mu_);
  EngineStats stats_ GUARDED_BY(mu_);
  // Layer-wise: per registered tensor, copies requested and copies done (the
  // dispatcher is FIFO, so done catches up with requested in order).
  std::vector<uint64_t> lw_requested_ GUARDED_BY(mu_), lw_copied_ GUARDED_BY(mu_);
  uint64_t lw_requested_total_ GUARDED_BY(mu_) = 0, lw_copied_total_ GUARDED_BY(mu_) = 0;
  // Device-side waits (WaitTensorsCopiedOnStream): per tensor, the copies the
  // dispatcher has taken up, the newest of them whose device reads are all
  // issued, and the completions of those reads.
  std::vector<uint64_t> lw_dispatched_ GUARDED_BY(mu_), lw_fenced_ GUARDED_BY(mu_);
  std::vector<std::vector<std::shared_ptr<CopyCompletion>>> lw_fences_ GUARDED_BY(mu_);
  int open_ GUARDED_BY(mu_) = 0;  // open layer-wise jobs
  std::vector<int> free_small_ GUARDED_BY(mu_);

  // The tiered cadence (EngineOptions::disk_every != 1 with the memory tier
  // on; docs/ARCHITECTURE.md "Tiered cadence"): checkpoints commit into
  // mem_file_, a slot file in the memory tier's segment directory with its
  // own slots (mem_free_; mem_retained_ holds the newest committed one), and
  // the persister thread copies the newest offered one (persist_next_) into
  // a free slot of file_ and commits it there with the same counter. The
  // slot it reads is held (persist_hold_): a release that comes meanwhile
  // is deferred (persist_deferred_). mem_file_ has WantedSlots() + 1 slots,
  // so with fewer than max_in_flight in flight a slot is free whatever the
  // disk does: training never waits for the disk.
  struct PersistItem {
    std::shared_ptr<SlotFile> file;
    CheckpointInfo info;
  };
  bool tiered_ GUARDED_BY(mu_) = false;
  std::shared_ptr<SlotFile> mem_file_ GUARDED_BY(mu_);
  bool mem_pending_rename_ GUARDED_BY(mu_) = false;  // mem_file_ is "<segment>.tmp" until its first commit
  std::unique_ptr<SlotQueue> mem_free_ GUARDED_BY(mu_);
  std::optional<uint32_t> mem_retained_ GUARDED_BY(mu_);
  std::optional<PersistItem> mem_newest_ GUARDED_BY(mu_);   // the newest memory commit
  std::optional<PersistItem> persist_next_ GUARDED_BY(mu_);
  bool persist_busy_ GUARDED_BY(mu_) = false;
  std::optional<std::pair<const SlotFile*, uint32_t>> persist_hold_ GUARDED_BY(mu_);
  bool persist_deferred_ GUARDED_BY(mu_) = false;
  bool persist_stop_ GUARDED_BY(mu_) = false;
  bool persist_reported_ GUARDED_BY(mu_) = false;  // a failure printed since the last success
  uint64_t mem_commits_ GUARDED_BY(mu_) = 0;
  uint64_t disk_counter_ GUARDED_BY(mu_) = 0;  // newest counter committed on disk
  std::thread persister_;
  // Register: (re)creates mem_file_ for file_'s slot size (nothing in flight).
  Status PrepareMemFile() REQUIRES(mu_);
  void PersistLoop();
  // Copies item's checkpoint into a free slot of file_ and commits it.
  Status PersistOne(const PersistItem& item) EXCLUDES(mu_);
  // Gives slot `slot` of mem_file_ back (deferred while the persister reads it).
  void MemRelease(uint32_t slot) REQUIRES(mu_);
  // The newest counter of any record in this rank's segment (0: none).
  uint64_t SegmentNewestCounter();

  std::thread dispatcher_;
  std::thread committer_;
};

}  // namespace nonstop::engine_detail
