// StagingPool: a fixed set of host memory chunks that checkpoint bytes pass
// through on their way from a tensor's memory to the medium.
//
// The pool allocates every chunk once, at construction, through
// CopyEngine::AllocHost (pinned when a GPU is present, else pre-faulted and
// mlock'ed where allowed), and never allocates again: host memory used for
// staging is exactly chunks() * chunk_bytes() <= the bound M given by the
// caller, however large the checkpointed state is.
//
// Acquire() hands out a free chunk, blocking while all are busy; the time
// spent blocked is added to wait_s_total() so the engine can report it as
// staging stall. Waiters are served in FIFO order so an older checkpoint's
// copy pipeline is never starved by a newer one.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/mutex.h"
#include "nonstop/copy_engine.h"
#include "nonstop/status.h"

namespace nonstop {

class StagingPool {
 public:
  struct Chunk {
    uint32_t index = 0;
    std::byte* data = nullptr;  // chunk_bytes() bytes, 4096-aligned
  };

  // Allocates floor(max_bytes / chunk_bytes) chunks (at least `min_chunks`,
  // which may exceed max_bytes only when max_bytes < min_chunks * chunk_bytes;
  // Create refuses that). chunk_bytes must be a positive multiple of 4096.
  static Result<std::unique_ptr<StagingPool>> Create(CopyEngine* copy, uint64_t max_bytes,
                                                     uint64_t chunk_bytes, uint32_t min_chunks);
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // Blocks until a chunk is free (FIFO among waiters) or Shutdown() was
  // called; returns Aborted after Shutdown.
  Result<Chunk> Acquire();
  // Returns a chunk obtained from Acquire. Never blocks.
  void Release(const Chunk& chunk);
  // Wakes every waiter with Aborted and makes later Acquire calls fail.
  void Shutdown();

  uint32_t chunks() const { return static_cast<uint32_t>(chunk_ptrs_.size()); }
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  uint64_t total_bytes() const { return chunk_bytes_ * chunks(); }
  bool pinned() const { return pinned_; }
  uint32_t in_use() const;
  uint32_t high_water() const;
  // Seconds Acquire callers spent blocked, summed over all calls.
  double wait_s_total() const;
  uint64_t waits() const;
  // Acquire calls blocked now (waits() counts them once they return).
  uint32_t waiting() const;

 private:
  StagingPool(CopyEngine* copy, uint64_t chunk_bytes) : copy_(copy), chunk_bytes_(chunk_bytes) {}

  CopyEngine* const copy_;
  const uint64_t chunk_bytes_;
  std::byte* base_ = nullptr;  // one allocation holding every chunk
  uint64_t base_bytes_ = 0;
  bool pinned_ = false;
  std::vector<std::byte*> chunk_ptrs_;  // immutable after Create

  mutable Mutex mu_;
  CondVar cv_;
  std::vector<uint32_t> free_ GUARDED_BY(mu_);
  std::deque<uint64_t> waiters_ GUARDED_BY(mu_);  // tickets of blocked Acquire calls, FIFO
  uint64_t next_ticket_ GUARDED_BY(mu_) = 0;
  bool shutdown_ GUARDED_BY(mu_) = false;
  uint32_t high_water_ GUARDED_BY(mu_) = 0;
  double wait_s_ GUARDED_BY(mu_) = 0;
  uint64_t waits_ GUARDED_BY(mu_) = 0;
};

}  // namespace nonstop
