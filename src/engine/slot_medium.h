// SlotMedium: the engine's handle on one open slot file. It forwards to the
// Medium it opened and adds three things the engine needs on top:
//
//  - A failed Sync is sticky (DESIGN.md invariant 8). On Linux a failed
//    fdatasync drops the dirty pages it could not write and consumes the
//    error, so the next fdatasync on the same file returns 0 although those
//    bytes never reached the disk. After the first failed Sync every Write
//    and Sync of this medium fails with that error, so nothing written before
//    it can be reported committed through this medium; the engine fails every
//    checkpoint in flight on the file, then calls Reopen().
//  - Reopen() opens the file again (a fresh file descriptor) by its current
//    name, so later checkpoints, which rewrite their whole slot, can commit.
//    When that fails the medium is dead: every later Write and Sync returns
//    one line saying so (training goes on, no checkpoint commits).
//  - Errors name the file by its current name: a file created under its temp
//    name and renamed into place (Renamed()) is named by its final name.
//
// Thread safety: Write/Read/Sync/Resize may run concurrently (shared lock);
// Reopen and Renamed take the lock exclusively, so they wait for calls in
// progress.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "nonstop/medium.h"
#include "nonstop/status.h"

namespace nonstop {

class SlotMedium final : public Medium {
 public:
  // Opens the file called `name` (in the job directory) again, as `kind`.
  using Opener =
      std::function<Result<std::unique_ptr<Medium>>(const std::string& name, MediumKind kind)>;

  // `dir` is for messages only; `name` is the file's name in it.
  SlotMedium(std::unique_ptr<Medium> inner, std::string dir, std::string name, Opener reopen);

  Status Write(uint64_t offset, const void* buf, size_t n) override;
  Status Read(uint64_t offset, void* buf, size_t n) override;
  Status Sync() override;
  Status Resize(uint64_t size) override;
  uint64_t Size() const override;
  size_t Alignment() const override;
  MediumKind kind() const override;
  std::string Describe() const override;

  // True from a failed Sync until a successful Reopen (and forever when the
  // reopen failed).
  bool sync_failed() const { return state_.load(std::memory_order_acquire) != kOk; }
  // How many Syncs have failed over this medium's life.
  uint64_t sync_failures() const { return failures_.load(std::memory_order_acquire); }
  // After a failed Sync: a fresh descriptor for the same file. OK and a
  // usable medium again, or the error, after which the medium stays dead.
  Status Reopen();
  // The file now has this name (it was renamed into place).
  void Renamed(std::string name);
  // dir/name as it is now.
  std::string path() const;

 private:
  enum State { kOk = 0, kSyncFailed = 1, kDead = 2 };
  Status Sticky() const EXCLUDES(err_mu_);  // when state_ != kOk
  // Replaces the opened-as path by path().
  Status Named(Status st) const REQUIRES_SHARED(mu_);

  mutable SharedMutex mu_;
  std::unique_ptr<Medium> inner_ GUARDED_BY(mu_);  // exclusive to replace
  const std::string dir_;
  std::string name_ GUARDED_BY(mu_);
  std::string opened_as_ GUARDED_BY(mu_);  // the path inner_ was opened by
  const Opener reopen_;
  std::atomic<int> state_{kOk};
  std::atomic<uint64_t> failures_{0};
  mutable Mutex err_mu_;
  Status error_ GUARDED_BY(err_mu_);  // why it is not kOk
};

}  // namespace nonstop
