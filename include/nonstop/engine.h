// Engine: the checkpoint orchestrator (PCcheck's data path, done correctly).
//
// One Engine per rank and job directory. The caller registers its tensors
// once, then calls Checkpoint(step) after each update that should be saved.
// Checkpoint returns at once; copies to staging, writes to the medium and the
// commit run in the background with up to `max_in_flight` checkpoints at
// once. Before the next update may modify the registered tensors, the caller
// calls WaitCopied().
//
// Errors. A checkpoint that fails in the background (a write, a sync, a
// keep copy) is queued, oldest first, and each queued failure is returned
// once: by WaitCommitted(its counter), or by the next TakeError(),
// WaitCopied(), WaitCommitted(0), EndCheckpoint(), Restore() or Close().
// Register() and Checkpoint() never return an earlier checkpoint's failure:
// they register and start the new checkpoint, so one transient error costs
// only the checkpoint that failed. A caller that wants to report failures at
// checkpoint time calls TakeError() right after Checkpoint().
//
// fsync failures are sticky (DESIGN.md invariant 8): after a sync of the
// slot file fails, no checkpoint whose bytes were written before it is ever
// reported committed (every checkpoint in flight on the file fails with it),
// the file is reopened with a fresh descriptor and later checkpoints commit
// again; if it cannot be reopened, every later checkpoint fails with one line
// saying so, and training goes on.
//
// Thread safety: the public methods may be called from one thread at a time
// (the training thread). Stats() may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "nonstop/medium.h"
#include "nonstop/status.h"
#include "nonstop/store.h"
#include "nonstop/types.h"

namespace nonstop {

struct RetentionPolicy;  // jobdir.h
struct AgreeOffer;       // plan.h

// How a layer-wise checkpoint (BeginCheckpoint/CopyTensors) moves a tensor's
// bytes out of its memory; docs/LAYERWISE.md. The three strategies of LightCheck.
enum class LayerCopy {
  kHost,    // LightCheck-C: through the staging chunks, then written (default)
  kDirect,  // LightCheck-D: written straight from the tensor's memory into the medium
            // (a copy into the mapping for mmap/pmem, a pwrite for buffered files);
            // media that need aligned buffers (O_DIRECT) fall back to kHost
  kDevice,  // LightCheck-G: snapshot into a second buffer (device memory with CUDA,
            // host memory otherwise), then drained to the medium; the training
            // thread waits only for the snapshot
};
const char* LayerCopyName(LayerCopy c);
bool ParseLayerCopy(std::string_view name, LayerCopy* out);

class Env;
struct AgreedRecord;
class CommitWatch;  // src/engine/commit_watch.h

struct EngineOptions {
  // The job directory, created if missing. The engine opens it once as its
  // writer through JobDir (jobdir.h), which takes the rank's lock for the
  // engine's life (a second engine of the same rank is refused, naming the
  // holder) and spells every file name; every file and directory operation
  // goes through `env` (env.h): files are created with O_EXCL|O_NOFOLLOW
  // under a temp name and renamed into place, and a symlink at any name the
  // engine uses is refused, never followed.
  std::string dir;
  Env* env = nullptr;           // nullptr: DefaultEnv()
  uint32_t rank = 0;
  uint32_t world_size = 1;
  int max_in_flight = 2;        // N: checkpoints in flight at once; storage holds N+1+extra_slots
  int writers = 0;              // p: writer threads per checkpoint (0 = choose for this machine)
  uint64_t staging_bytes = 0;   // M: staging pool bound (0 = choose)
  // With staging_bytes 0: open with the smallest pool (writers + copy window
  // chunks) instead of the 256 MiB floor, for a caller that calls
  // PrepareStaging right after Open (nonstop.Checkpointer in one process):
  // the floor pool would be allocated and pre-faulted on the caller's thread
  // (0.2-1.5 s) only to be replaced. Register grows it as usual.
  bool small_initial_staging = false;
  uint64_t chunk_bytes = 0;     // b: staging chunk size, multiple of 4096 (0 = choose)
  int copy_threads = 1;         // host memcpy threads
  MediumKind medium = MediumKind::kAuto;
  uint32_t extra_slots = 0;     // distributed mode keeps one more slot
  // Also keep every k-th checkpoint (counter % k == 0) forever, as its own
  // job directory DIR/keep/step-NNNNNNNNNNNN/ (readable by nonstop.load and
  // the CLI). The copy runs on the committer thread right after the commit,
  // while that checkpoint is the newest and its slot cannot be reused; later
  // commits wait for it. 0 = keep nothing extra.
  uint64_t keep_every = 0;
  // Distributed mode (docs/DISTRIBUTED.md): besides the pinned checkpoint (Pin,
  // the last globally agreed one) keep the *oldest* committed checkpoint above
  // it (the candidate for the next agreement) instead of the newest, so a
  // slow peer can catch up with it. Needs extra_slots >= 1.
  bool global_agreement = false;
  LayerCopy layer_copy = LayerCopy::kHost;  // copy strategy of layer-wise checkpoints
  // The memory tier (docs/ARCHITECTURE.md, "Memory tier"): the newest
  // committed checkpoint is also copied, in the background, into a segment
  // in shared memory, which Restore() (and the Python restore()) read instead
  // of the disk when it verifies and holds exactly the disk's newest
  // checkpoint. "auto": only while the segment fits `memory_tier_fit` times
  // into the segment directory's free space, and only a commit that arrives
  // while no copy runs and while the copies have taken at most
  // `memory_tier_share` of the time (others are skipped, never queued);
  // "memory": every commit (one arriving during a copy is copied next);
  // "disk": off. In distributed mode (global_agreement) every rank keeps its
  // own segment; recovery uses them only when all hold the agreed step. A failure there
  // is reported once (stderr, EngineStats::memory_*) and never affects the disk.
  std::string memory_tier = "auto";
  std::string shm_dir;          // segment directory; "": $NONSTOP_SHM_DIR or /dev/shm/nonstop
  double memory_tier_fit = 4.0;
  double memory_tier_share = 0.1;  // "auto": the copies' most share of the wall time, (0, 1]
  // A writer removes other jobs' leftover segments whose owner is dead and
  // whose job directory is gone or names another segment, or that are older
  // than this (a job that crashed and never restarted). Never a live job's.
  double memory_tier_orphan_s = 3600;
  // Device snapshots of Checkpoint() (docs/CUDA.md, "Device snapshots"):
  // with a copy engine that CanSnapshotOnDevice, up to this many bytes of
  // device memory per device hold a second copy of the registered device
  // tensors. A checkpoint copies them device-to-device first, WaitCopied()
  // returns once that copy (and the tensors sent straight to the host) is
  // done, and the snapshot drains to host staging in the background. -1:
  // a quarter of the device's free memory at Register(); 0: off.
  int64_t device_snapshot_bytes = -1;
  // The tiered cadence (docs/ARCHITECTURE.md "Tiered cadence"): which
  // checkpoints reach the disk. 1: every one (each commits on disk; the
  // memory tier mirrors it as above). N > 1: each checkpoint commits into
  // the memory tier's segment (tmpfs: survives a process crash, not the
  // loss of the node), and every N-th memory commit is persisted to the
  // disk by a background thread; 0 ("auto"): the newest memory commit
  // whenever the disk is free. A commit arriving while the disk is busy
  // waits, replacing an older waiting one (intermediate ones are skipped).
  // Needs the memory tier on (else every checkpoint goes to disk, and
  // EngineStats::disk_every says 1) and no global_agreement. Close()
  // persists the newest one.
  int disk_every = 1;
};

// A tensor the engine checkpoints: where it lives now, and what it is.
struct TensorRef {
  TensorSpec spec;
  const void* data = nullptr;   // host or device pointer, valid until re-registered
  Device device;
  // Copy inside Checkpoint() before it returns, because the caller changes
  // this tensor before its next WaitCopied() point (e.g. BatchNorm buffers
  // changed by the next forward pass).
  bool copy_at_checkpoint = false;
  // The memory is already this tensor's staging: host memory the caller
  // fills itself (the multi-step schedule copies and replays its state
  // there) and keeps unchanged from EndCheckpoint until WaitCopied()
  // returns. A layer-wise checkpoint (BeginCheckpoint .. EndCheckpoint)
  // writes it to the medium as it is, with no copy, whatever layer_copy
  // says; WaitCopied() returns once every unit of it is written. A tensor of
  // kLargeTensorBytes or more must start at a 4 KiB boundary, with zeros
  // from its end to the next 4 KiB boundary (each write unit is then read
  // straight from it, on O_DIRECT media too); smaller ones are packed into
  // the small region as usual. Staged tensors need no staging: the pool is
  // sized for the others, and a registration of staged tensors only keeps
  // the smallest pool (EngineStats::staging_bytes).
  bool staged = false;
};

struct CheckpointStats {
  uint64_t counter = 0;
  int64_t step = 0;
  uint64_t bytes = 0;
  double stall_s = 0;      // time the training thread waited for this checkpoint
  double copy_s = 0;       // start -> every byte in staging (or on the medium)
  double persist_s = 0;    // start -> committed
  double write_GBps = 0;   // bytes / persist_s
  bool committed = false;
  // Where it is committed: "disk" (the slot file) or "memory" (the memory
  // tier's segment only: survives a process crash, not a node loss; it
  // becomes "memory+disk" once persisted).
  std::string tiers;
  std::string error;       // empty unless it failed
  // Device snapshots (EngineOptions::device_snapshot_bytes): bytes of device
  // tensors copied device-to-device first and drained afterwards, bytes of
  // device tensors copied straight to the host before WaitCopied() returned,
  // and the seconds from WaitCopied()'s release to the last drained byte.
  uint64_t snapshot_bytes = 0;
  uint64_t direct_bytes = 0;
  double drain_s = 0;
};

struct EngineStats {
  uint64_t started = 0, committed = 0, failed = 0, superseded = 0;
  uint64_t abandoned = 0;            // dropped by AbandonOlderThan (not failures)
  int in_flight = 0;
  double stall_s_total = 0;          // all time blocked in engine calls
  double staging_wait_s_total = 0;   // part of the stall spent waiting for a free staging chunk
  // Staging allocation (pre-faulted, pinned where possible) seen by the
  // training thread: how many Register() calls waited for it (for the
  // background allocation PrepareStaging started, or allocating themselves
  // when none was started or it was too small), and the seconds they waited.
  // Both stay 0 when PrepareStaging had time to finish.
  uint64_t staging_alloc_waits = 0;
  double staging_alloc_wait_s = 0;
  // Bytes PrepareStaging allocated in the background (0 while it still runs).
  uint64_t staging_prepared_bytes = 0;
  // The slot file PrepareStaging created in the background when the rank had
  // none: its size once the first Register adopted it (0 when it did not:
  // none was prepared, or it did not fit and Register created one), and the
  // seconds Register waited for its creation to finish (0 when it had).
  uint64_t slot_file_prepared_bytes = 0;
  double slot_file_wait_s = 0;
  uint64_t staging_bytes = 0, chunk_bytes = 0;
  int writers = 0, max_in_flight = 0;
  std::string medium;                // Medium::Describe()
  std::string copy_engine;           // CopyEngine::Describe()
  std::string layer_copy;            // LayerCopyName(options.layer_copy)
  std::vector<CheckpointStats> recent;  // last 64 checkpoints, oldest first
  // Memory tier (EngineOptions::memory_tier).
  std::string memory_tier;           // "auto", "memory", "disk"
  std::string memory_segment;        // the segment's path ("" when off)
  uint64_t memory_mirrored = 0;      // checkpoints copied into the segment
  uint64_t memory_skipped = 0;       // commits not copied (memory_tier.h says when)
  uint64_t memory_swept = 0;         // other jobs' leftover segments removed at open
  uint64_t memory_counter = 0;       // the checkpoint the segment holds (0 = none)
  uint64_t memory_failures = 0;
  std::string memory_error;          // the last failure or reason it is off
  // The tiered cadence (EngineOptions::disk_every): the value in effect,
  // the memory commits persisted to disk, the newest counter on disk (0 =
  // none) and in memory-only commits, the persist failures and seconds.
  int disk_every = 1;
  uint64_t persisted = 0;
  uint64_t persisted_counter = 0;
  uint64_t persist_failures = 0;
  double persist_s_total = 0;
  std::string persist_error;
  bool restored_from_memory = false; // the last Restore() read the segment
  double restore_s = 0;              // the last Restore()'s seconds
  // The last Restore()'s reads (every attempt): seconds reading and verifying
  // chunks, summed over the reader threads; bytes copied into device tensors
  // (host-to-device, through pinned staging); and seconds the readers and the
  // final drain waited for those copies (summed; near 0 when the copies hid
  // behind the reads, near the copy time when they did not).
  double restore_read_s = 0;
  double restore_h2d_wait_s = 0;
  uint64_t restore_h2d_bytes = 0;
  // Device snapshots (EngineOptions::device_snapshot_bytes): the device
  // memory held for them, totals over finished checkpoints (as in
  // CheckpointStats), checkpoints that copied straight because the previous
  // snapshot was still draining, and one line on what Register() decided
  // ("" when no tensor is in device memory).
  uint64_t device_snapshot_capacity = 0;
  uint64_t snapshot_bytes_total = 0;
  uint64_t direct_bytes_total = 0;
  double drain_s_total = 0;
  uint64_t snapshot_busy = 0;
  std::string device_snapshot_note;
};

// What Latest() returns: the newest checkpoint committed by this engine or
// found on open.
struct CommittedCheckpoint {
  uint64_t counter = 0;
  int64_t step = 0;
  // Whether it is on disk (false: committed to the memory tier only, by the
  // tiered cadence; a node loss loses it).
  bool on_disk = true;
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> Open(const EngineOptions& opts);
  virtual ~Engine() = default;

  // Starts allocating (and pre-faulting, pinning where possible) the default
  // staging for a state of `state_bytes` on a background thread, so that the
  // first Register() of that state does not allocate on the training thread:
  // it takes the prepared pool, waiting only while the allocation is still
  // running (EngineStats::staging_alloc_waits / staging_alloc_wait_s say how
  // long). Returns at once. A no-op with a fixed EngineOptions::staging_bytes,
  // when the pool is already as large, or while an earlier preparation runs.
  // A failed background allocation is not an error: Register allocates (or
  // keeps the smaller pool) as without it.
  // When the rank has no slot file yet, it also creates one in the
  // background (empty, synced, published under the slot file's name), sized
  // for `state_bytes`; the first Register adopts it when it fits, else
  // replaces it as it creates one without it. A failure of that creation
  // (an I/O error, a failed fsync) is returned by the first Register.
  virtual Status PrepareStaging(uint64_t state_bytes);

  // Registers the tensors every later checkpoint saves, replacing any earlier
  // set. Waits for in-flight copies first. Names must be unique.
  virtual Status Register(std::vector<TensorRef> tensors) = 0;
  // Starts a checkpoint of all registered tensors at `step`, with `meta_json`
  // stored in its table. Returns its counter. Blocks (counted as stall) only
  // when max_in_flight checkpoints are already in flight, and for
  // copy_at_checkpoint tensors.
  virtual Result<uint64_t> Checkpoint(int64_t step, std::string meta_json) = 0;
  // Returns once every registered tensor of every in-flight checkpoint has
  // left its owner's memory. Call before modifying registered tensors.
  virtual Status WaitCopied() = 0;
  // Waits until checkpoint `counter` (0 = all in flight) is committed or failed.
  virtual Status WaitCommitted(uint64_t counter = 0) = 0;
  virtual std::optional<CommittedCheckpoint> Latest() = 0;
  // Reads checkpoint `step` (newest valid when empty) into the registered
  // tensors' memory, matching by name. Fails on a missing name, a shape or
  // dtype mismatch, naming the tensor. Returns what was restored.
  virtual Result<CheckpointInfo> Restore(std::optional<int64_t> step = std::nullopt) = 0;
  // Tells the engine that the caller restored committed checkpoint `counter`
  // of this rank with its own reader (the Python front end reads into torch
  // tensors itself). From then on it is treated as a Restore() of it
  // (DESIGN.md invariant 9): when it is in the slot file its slot is kept
  // until a newer checkpoint commits, and when newer checkpoints exist the
  // first new checkpoint durably records the rollback (JobDir lineage) before
  // anything is written, so a crash never resumes a step rolled back from.
  // Waits for everything in flight. In distributed mode the slot is kept by
  // Pin (the caller pins `counter`); the rollback is recorded all the same.
  virtual Status AdoptRestored(uint64_t counter);
  virtual EngineStats Stats() = 0;
  // Kept copies from now on (jobdir.h RetentionPolicy: max_to_keep, best-k by
  // a metric of the checkpoint's metadata); policy.keep_every is replaced by
  // EngineOptions::keep_every. The committer applies it right after each
  // commit (JobDir::Retain); a failure is queued like a failed keep copy.
  // InvalidArgument when it deletes copies and world_size > 1.
  virtual Status SetRetention(const RetentionPolicy& policy);
  // Deletes the kept copy of `step` (JobDir::DeleteKept), after waiting for
  // everything in flight.
  virtual Status DeleteKept(int64_t step);
  // Returns (and forgets) the oldest queued background failure; OK when none.
  // Never blocks.
  virtual Status TakeError();

  // Abandons every in-flight checkpoint whose counter is below `counter`, so
  // that a newer, urgent one (a preemption notice; docs/PREEMPTION.md) gets
  // the copy threads, the staging chunks and the writers to itself: their
  // remaining copies and writes are skipped, their slots go back, they count
  // as `abandoned` (not failed) and report no error. One whose commit has
  // already begun still commits. Open layer-wise checkpoints (Begin without
  // End) are left alone. The newest committed checkpoint is never touched.
  // Returns how many were abandoned. Pass UINT64_MAX for "all in flight".
  virtual Result<int> AbandonOlderThan(uint64_t counter);

  // ---- Distributed mode (EngineOptions::global_agreement; docs/DISTRIBUTED.md) ----
  //
  // Storage holds N in flight + the pinned checkpoint + the candidate, so
  // extra_slots = 1. These three may be called from any thread.
  //
  // Pins committed checkpoint `counter` (the newest globally agreed one): its
  // slot is not reused until another counter is pinned (DESIGN.md invariant
  // 6). The candidate or the pinned counter itself pin at once; any other
  // committed checkpoint of the file (one found on open, before a restore)
  // needs nothing in flight. A slot file switched by Register() replaces the
  // old file only when a checkpoint of the new file is pinned.
  virtual Status Pin(uint64_t counter);
  // The candidate: the oldest committed checkpoint above the pinned one that
  // is still held (nullopt when none).
  virtual std::optional<CommittedCheckpoint> Candidate();
  // Releases the candidate if it is `counter` (the peers moved past it); the
  // next commit becomes the candidate.
  virtual Status DropCandidate(uint64_t counter);
  // This rank's report for a round of the agreement (plan.h AgreeOffer,
  // decided by DecideAgreement): its candidate (step and counter), the
  // newest step it committed and the newest it started.
  virtual AgreeOffer Offer();
  // DecideAgreement's kAim: from now on the candidate is the oldest
  // checkpoint committed at step >= `step`: a candidate of a lower step is
  // dropped now, later commits below `step` are not kept (their slots go
  // back). Pin forgets the aim. Returns whether a candidate was dropped.
  virtual Result<bool> Aim(int64_t step);
  // Writes rank `rec.rank`'s agreed record (jobdir.h) durably through the
  // engine's job directory (its writer). FailedPrecondition once closed.
  virtual Status WriteAgreed(const AgreedRecord& rec);

  // The watch of this engine's finished checkpoints (engine/commit_watch.h):
  // every finished checkpoint and, in distributed mode, every agreed step
  // written by WriteAgreed is reported to it; Close() stops it. The Python
  // front end's per-checkpoint handles settle from it. nullptr: none.
  virtual std::shared_ptr<CommitWatch> Watch();

  // ---- Layer-wise checkpoints (LightCheck; docs/LAYERWISE.md) ----
  //
  // A layer-wise checkpoint copies each tensor (or group) when the caller says
  // it is final, so tensor t may be updated again as soon as t alone is
  // copied. It keeps every invariant of Checkpoint(): it counts against
  // max_in_flight, takes one of the N+1 slots, commits by the CAS rule once
  // every tensor is persisted and EndCheckpoint was called, and its errors
  // are returned by the next calls. Tensors are indices into the list given
  // to Register().
  //
  // Starts a checkpoint of `step` whose tensors are not copied yet; returns
  // its counter. Blocks (stall) like Checkpoint() while max_in_flight are in
  // flight; FailedPrecondition when only open (not yet ended) layer-wise
  // checkpoints are in flight, since none of them can finish.
  virtual Result<uint64_t> BeginCheckpoint(int64_t step);
  // Starts the copies of `tensors` into checkpoint `counter` (open), in FIFO
  // order on the background threads; returns at once. A tensor requested
  // twice is copied once.
  virtual Status CopyTensors(uint64_t counter, const std::vector<uint32_t>& tensors);
  // Returns once every requested copy of `tensors`, of every checkpoint in
  // flight, has left the tensors' memory: they may be updated now.
  virtual Status WaitTensorsCopied(const std::vector<uint32_t>& tensors);
  // The same rule enforced on a device stream: `stream` ({kCuda, index,
  // cudaStream_t}) is made to wait, on the device, for the copies of the
  // tensors in that device's memory, and the call returns without waiting
  // for them (the host waits only until those copies are issued). Tensors in
  // host memory, and every tensor when the copy engine cannot order streams
  // (CopyEngine::CanOrderStreams), are waited for on the host as
  // WaitTensorsCopied does. Work enqueued on `stream` afterwards may update
  // the tensors.
  virtual Status WaitTensorsCopiedOnStream(const std::vector<uint32_t>& tensors,
                                           const Device& stream);
  // Seals checkpoint `counter`: copies the copy_at_checkpoint tensors now (as
  // Checkpoint() does), starts the copies of every tensor not requested yet,
  // and stores `step` (replacing the one given to BeginCheckpoint) and
  // `meta_json` in its table. It commits once all its bytes are persisted.
  virtual Status EndCheckpoint(uint64_t counter, int64_t step, std::string meta_json);

  // Waits for everything in flight and stops the threads. Idempotent.
  virtual Status Close() = 0;
};

}  // namespace nonstop
