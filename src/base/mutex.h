// Mutex, MutexLock and CondVar: std::mutex and std::condition_variable with
// thread-safety annotations (base/thread_annotations.h), so that clang checks
// that every GUARDED_BY field is touched with its mutex held.
//
//   Mutex mu_;
//   CondVar cv_;
//   bool ready_ GUARDED_BY(mu_) = false;
//
//   void Wait() EXCLUDES(mu_) {
//     MutexLock lock(&mu_);
//     cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return ready_; });
//   }
//
// A predicate reads guarded fields, so it is annotated REQUIRES(mu) as
// above: the analysis checks a lambda's body on its own.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <shared_mutex>

#include "base/thread_annotations.h"

namespace nonstop {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  bool TryLock() TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // Tells the analysis that the caller holds the lock (no run-time check):
  // for code it cannot follow, such as a callback run under the lock.
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds a Mutex from construction to destruction; Unlock()/Lock() in
// between release and retake it (the destructor releases only if held).
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() RELEASE() {
    if (held_) mu_->Unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void Unlock() RELEASE() {
    held_ = false;
    mu_->Unlock();
  }
  void Lock() ACQUIRE() {
    mu_->Lock();
    held_ = true;
  }

 private:
  Mutex* const mu_;
  bool held_ = true;
};

// A reader-writer lock: many readers (ReaderLock) or one writer (WriterLock).
//
//   SharedMutex mu_;
//   std::unique_ptr<Medium> inner_ GUARDED_BY(mu_);
//   Status Write(...) { ReaderLock l(&mu_); return inner_->Write(...); }
//   void Replace(...) { WriterLock l(&mu_); inner_ = ...; }
class CAPABILITY("shared_mutex") SharedMutex {
 public:
  SharedMutex() = default;
  SharedMutex(const SharedMutex&) = delete;
  SharedMutex& operator=(const SharedMutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  void LockShared() ACQUIRE_SHARED() { mu_.lock_shared(); }
  void UnlockShared() RELEASE_SHARED() { mu_.unlock_shared(); }

 private:
  std::shared_mutex mu_;
};

// Holds a SharedMutex shared (as a reader) from construction to destruction.
class SCOPED_CAPABILITY ReaderLock {
 public:
  explicit ReaderLock(SharedMutex* mu) ACQUIRE_SHARED(mu) : mu_(mu) { mu_->LockShared(); }
  ~ReaderLock() RELEASE() { mu_->UnlockShared(); }
  ReaderLock(const ReaderLock&) = delete;
  ReaderLock& operator=(const ReaderLock&) = delete;

 private:
  SharedMutex* const mu_;
};

// Holds a SharedMutex exclusively (as the writer) from construction to destruction.
class SCOPED_CAPABILITY WriterLock {
 public:
  explicit WriterLock(SharedMutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~WriterLock() RELEASE() { mu_->Unlock(); }
  WriterLock(const WriterLock&) = delete;
  WriterLock& operator=(const WriterLock&) = delete;

 private:
  SharedMutex* const mu_;
};

// A condition variable used with a Mutex the caller holds.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // Releases `mu` while it sleeps; holds it again on return (spurious
  // wake-ups happen: callers loop, or use the predicate form).
  void Wait(Mutex* mu) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  // The predicate forms are not analysed inside (the analysis cannot tell
  // that `done` runs under `mu`); each call site still must hold `mu`, and
  // the predicate's own REQUIRES is checked where it is written.
  template <typename Predicate>
  void Wait(Mutex* mu, Predicate done) REQUIRES(mu) NO_THREAD_SAFETY_ANALYSIS {
    while (!done()) Wait(mu);
  }
  // false when `timeout` passed first.
  template <typename Rep, typename Period>
  bool WaitFor(Mutex* mu, std::chrono::duration<Rep, Period> timeout) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool woken = cv_.wait_for(lock, timeout) == std::cv_status::no_timeout;
    lock.release();
    return woken;
  }
  // The predicate's value at return: false only when `timeout` passed first.
  template <typename Rep, typename Period, typename Predicate>
  bool WaitFor(Mutex* mu, std::chrono::duration<Rep, Period> timeout, Predicate done)
      REQUIRES(mu) NO_THREAD_SAFETY_ANALYSIS {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!done()) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) return done();
      WaitFor(mu, deadline - now);
    }
    return true;
  }

  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace nonstop
