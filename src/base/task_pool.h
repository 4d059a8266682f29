// TaskPool: a fixed set of long-lived threads running tasks in FIFO order.
// The engine's writer pool (chunk writes, crc, staging release) and its
// parallel restore reads both run on one of these; no thread is ever started
// per chunk or per checkpoint.
//
// Thread safety: Submit may be called from any thread, including from a task.
#pragma once

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "base/mutex.h"

namespace nonstop {

class TaskPool {
 public:
  explicit TaskPool(int threads) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
  }
  // Runs every task already submitted, then joins the threads.
  ~TaskPool() EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    cv_.SignalAll();
    for (auto& t : threads_) t.join();
  }
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;

  void Submit(std::function<void()> task) EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      queue_.push_back(std::move(task));
    }
    cv_.Signal();
  }

  int threads() const { return static_cast<int>(threads_.size()); }

 private:
  void Run() EXCLUDES(mu_) {
    for (;;) {
      std::function<void()> task;
      {
        MutexLock lock(&mu_);
        cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }

  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> queue_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;         // fixed after construction
};

}  // namespace nonstop
