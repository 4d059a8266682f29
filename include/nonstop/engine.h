// Engine: the checkpoint orchestrator (PCcheck's data path, done correctly).
//
// One Engine per rank and job directory. The caller registers its tensors
// once, then calls Checkpoint(step) after each update that should be saved.
// Checkpoint returns at once; copies to staging, writes to the medium and the
// commit run in the background with up to `max_in_flight` checkpoints at
// once. Before the next update may modify the registered tensors, the caller
// calls WaitCopied(). Errors from background threads are returned by the next
// call into the engine.
//
// Thread safety: the public methods may be called from one thread at a time
// (the training thread). Stats() may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nonstop/medium.h"
#include "nonstop/status.h"
#include "nonstop/store.h"
#include "nonstop/types.h"

namespace nonstop {

struct EngineOptions {
  std::string dir;              // job directory, created if missing
  uint32_t rank = 0;
  uint32_t world_size = 1;
  int max_in_flight = 2;        // N: checkpoints in flight at once; storage holds N+1+extra_slots
  int writers = 0;              // p: writer threads per checkpoint (0 = choose for this machine)
  uint64_t staging_bytes = 0;   // M: staging pool bound (0 = choose)
  uint64_t chunk_bytes = 0;     // b: staging chunk size, multiple of 4096 (0 = choose)
  int copy_threads = 1;         // host memcpy threads
  MediumKind medium = MediumKind::kAuto;
  uint32_t extra_slots = 0;     // distributed mode keeps one more slot
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
  std::string error;       // empty unless it failed
};

struct EngineStats {
  uint64_t started = 0, committed = 0, failed = 0, superseded = 0;
  int in_flight = 0;
  double stall_s_total = 0;          // all time blocked in engine calls
  double staging_wait_s_total = 0;   // part of the stall spent waiting for a free staging chunk
  uint64_t staging_bytes = 0, chunk_bytes = 0;
  int writers = 0, max_in_flight = 0;
  std::string medium;                // Medium::Describe()
  std::string copy_engine;           // CopyEngine::Describe()
  std::vector<CheckpointStats> recent;  // last 64 checkpoints, oldest first
};

// What Latest() returns: the newest checkpoint committed by this engine or
// found on open.
struct CommittedCheckpoint {
  uint64_t counter = 0;
  int64_t step = 0;
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> Open(const EngineOptions& opts);
  virtual ~Engine() = default;

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
  virtual EngineStats Stats() = 0;
  // Waits for everything in flight and stops the threads. Idempotent.
  virtual Status Close() = 0;
};

}  // namespace nonstop
