#include "stage/staging_pool.h"

#include <algorithm>
#include <chrono>

namespace nonstop {

Result<std::unique_ptr<StagingPool>> StagingPool::Create(CopyEngine* copy, uint64_t max_bytes,
                                                         uint64_t chunk_bytes,
                                                         uint32_t min_chunks) {
  if (copy == nullptr) return Status::InvalidArgument("staging pool: no copy engine");
  if (chunk_bytes == 0 || chunk_bytes % 4096 != 0) {
    return Status::InvalidArgument("staging chunk size " + std::to_string(chunk_bytes) +
                                   " is not a positive multiple of 4096");
  }
  const uint64_t n = max_bytes / chunk_bytes;
  if (n < std::max<uint32_t>(min_chunks, 1)) {
    return Status::InvalidArgument(
        "staging bound " + std::to_string(max_bytes) + " bytes holds only " + std::to_string(n) +
        " chunks of " + std::to_string(chunk_bytes) + " bytes; need at least " +
        std::to_string(std::max<uint32_t>(min_chunks, 1)) +
        ": raise staging_bytes or lower chunk_bytes");
  }
  std::unique_ptr<StagingPool> pool(new StagingPool(copy, chunk_bytes));
  pool->base_bytes_ = n * chunk_bytes;
  pool->base_ = static_cast<std::byte*>(copy->AllocHost(pool->base_bytes_, &pool->pinned_));
  if (pool->base_ == nullptr) {
    return Status::IOError("cannot allocate " + std::to_string(pool->base_bytes_) +
                           " bytes of staging memory: lower staging_bytes");
  }
  {
    MutexLock lock(&pool->mu_);  // not shared yet; taken for the analysis
    pool->chunk_ptrs_.reserve(n);
    pool->free_.reserve(n);
    for (uint64_t i = 0; i < n; ++i) {
      pool->chunk_ptrs_.push_back(pool->base_ + i * chunk_bytes);
      // Hand out low indices first: consecutive chunks tend to stay warm in TLB and cache.
      pool->free_.push_back(static_cast<uint32_t>(n - 1 - i));
    }
  }
  return pool;
}

StagingPool::~StagingPool() {
  Shutdown();
  if (base_ != nullptr) copy_->FreeHost(base_, base_bytes_);
}

Result<StagingPool::Chunk> StagingPool::Acquire() {
  MutexLock lock(&mu_);
  if (shutdown_) return Status::Aborted("staging pool is shut down");
  if (waiters_.empty() && !free_.empty()) {
    const uint32_t i = free_.back();
    free_.pop_back();
    high_water_ = std::max<uint32_t>(high_water_, chunks() - static_cast<uint32_t>(free_.size()));
    return Chunk{i, chunk_ptrs_[i]};
  }
  // Slow path: queue behind earlier waiters so chunks are granted in arrival order.
  const uint64_t ticket = next_ticket_++;
  waiters_.push_back(ticket);
  const auto t0 = std::chrono::steady_clock::now();
  cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return shutdown_ || (waiters_.front() == ticket && !free_.empty()); });
  wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ++waits_;
  waiters_.erase(std::find(waiters_.begin(), waiters_.end(), ticket));
  if (shutdown_) {
    cv_.SignalAll();
    return Status::Aborted("staging pool is shut down");
  }
  const uint32_t i = free_.back();
  free_.pop_back();
  high_water_ = std::max<uint32_t>(high_water_, chunks() - static_cast<uint32_t>(free_.size()));
  // The next waiter in line may be able to proceed too.
  if (!free_.empty() && !waiters_.empty()) cv_.SignalAll();
  return Chunk{i, chunk_ptrs_[i]};
}

void StagingPool::Release(const Chunk& chunk) {
  {
    MutexLock lock(&mu_);
    free_.push_back(chunk.index);
  }
  cv_.SignalAll();
}

void StagingPool::Shutdown() {
  {
    MutexLock lock(&mu_);
    shutdown_ = true;
  }
  cv_.SignalAll();
}

uint32_t StagingPool::in_use() const {
  MutexLock lock(&mu_);
  return chunks() - static_cast<uint32_t>(free_.size());
}

uint32_t StagingPool::high_water() const {
  MutexLock lock(&mu_);
  return high_water_;
}

double StagingPool::wait_s_total() const {
  MutexLock lock(&mu_);
  return wait_s_;
}

uint64_t StagingPool::waits() const {
  MutexLock lock(&mu_);
  return waits_;
}

uint32_t StagingPool::waiting() const {
  MutexLock lock(&mu_);
  return static_cast<uint32_t>(waiters_.size());
}

}  // namespace nonstop
