// StickySyncMedium: a failed sync is never forgotten.
//
// When fsync/fdatasync/msync fails (EIO, ENOSPC), Linux marks the dirty pages
// clean and reports the error once: the next fsync of the same file returns 0
// although the data never reached the disk. A writer that retries the sync,
// or goes on writing, would later report committed what a crash loses. So
// after any Sync of a medium fails, every later Write, Resize and Sync on it
// fails with one IOError:
//   "an earlier fsync of PATH failed (<reason>); nothing written to it since
//    it was opened is trusted any more: reopen it"
// Reads still work (they show what the page cache holds, not what is
// durable). The only way on is to close the medium, reopen the file and
// rewrite (then sync) everything that must be durable, or fail.
//
// Every medium an Env opens goes through this wrapper (media::OpenMediumOnFd
// and the fault Env), so the rule lives here once, not in each backend.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "base/mutex.h"
#include "media/medium_wrapper.h"

namespace nonstop::media {

class StickySyncMedium final : public MediumWrapper {
 public:
  StickySyncMedium(std::string path, std::unique_ptr<Medium> inner)
      : MediumWrapper(std::move(inner)), path_(std::move(path)) {}

  Status Write(uint64_t offset, const void* buf, size_t n) override {
    if (failed_.load(std::memory_order_acquire)) return Sticky();
    return MediumWrapper::Write(offset, buf, n);
  }
  Status Resize(uint64_t size) override {
    if (failed_.load(std::memory_order_acquire)) return Sticky();
    return MediumWrapper::Resize(size);
  }
  // Reads are the inner medium's, unchanged: its queue (io_uring's included).
  std::unique_ptr<ReadQueue> OpenReadQueue(unsigned depth) override {
    return inner().OpenReadQueue(depth);
  }
  // The medium under it (media::MapForRead looks through it).
  Medium& wrapped() { return inner(); }
  Status Sync() override {
    if (failed_.load(std::memory_order_acquire)) return Sticky();
    Status st = MediumWrapper::Sync();
    if (!st.ok()) {
      MutexLock lock(&mu_);
      if (!failed_.load(std::memory_order_relaxed)) {
        reason_ = Reason(st.message());
        failed_.store(true, std::memory_order_release);
      }
    }
    return st;
  }

 private:
  // The errno text at the end of "fdatasync /x: Input/output error".
  static std::string Reason(const std::string& message) {
    const size_t colon = message.rfind(": ");
    return colon == std::string::npos ? message : message.substr(colon + 2);
  }
  Status Sticky() const {
    MutexLock lock(&mu_);
    return Status::IOError("an earlier fsync of " + path_ + " failed (" + reason_ +
                           "); nothing written to it since it was opened is trusted any more: "
                           "reopen it");
  }

  const std::string path_;
  std::atomic<bool> failed_{false};
  mutable Mutex mu_;
  std::string reason_ GUARDED_BY(mu_);
};

}  // namespace nonstop::media
