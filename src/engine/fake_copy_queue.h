// Tests only: the "copy stream" of the fake device copy engines
// (layerwise_test's FakeCudaCopyEngine, fake_device_copy_engine.h): copies
// run in submission order on one thread, each completion done once its bytes
// are in place.
#ifndef NONSTOP_ENGINE_FAKE_COPY_QUEUE_H_
#define NONSTOP_ENGINE_FAKE_COPY_QUEUE_H_

#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "nonstop/copy_engine.h"

namespace nonstop {

class FakeCopyQueue {
 public:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;  // guarded by mu
    Status status;      // written before done
  };
  class Completion final : public CopyCompletion {
   public:
    explicit Completion(std::shared_ptr<State> s) : s_(std::move(s)) {}
    Status Wait() override {
      std::unique_lock<std::mutex> lock(s_->mu);
      s_->cv.wait(lock, [&] { return s_->done; });
      return s_->status;
    }
    bool Ready() override {
      std::lock_guard<std::mutex> lock(s_->mu);
      return s_->done;
    }
    const std::shared_ptr<State>& state() const { return s_; }

   private:
    std::shared_ptr<State> s_;
  };
  struct Task {
    const void* src = nullptr;
    void* dst = nullptr;
    size_t bytes = 0;
    Status status;                // not OK: nothing is copied, the completion says this
    std::function<void()> before;  // on the queue's thread, before the copy (may be empty)
    std::function<void()> after;   // on the queue's thread, after it, before the completion is done
  };

  // `before_each` runs on the queue's thread before every copy (a delay).
  explicit FakeCopyQueue(std::function<void()> before_each = {})
      : before_each_(std::move(before_each)), worker_([this] { Run(); }) {}
  ~FakeCopyQueue() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();  // the queue is drained first: every completion completes
  }

  // Done at once when there is nothing to copy (no source or no bytes).
  std::unique_ptr<CopyCompletion> Enqueue(Task t) {
    auto state = std::make_shared<State>();
    if (t.src == nullptr || t.bytes == 0) {
      state->status = t.status;
      state->done = true;
      return std::make_unique<Completion>(std::move(state));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(Item{std::move(t), state});
    }
    cv_.notify_all();
    return std::make_unique<Completion>(std::move(state));
  }

 private:
  struct Item {
    Task task;
    std::shared_ptr<State> state;
  };
  void Run() {
    for (;;) {
      Item it;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        it = std::move(queue_.front());
        queue_.pop_front();
      }
      if (before_each_) before_each_();
      if (it.task.before) it.task.before();
      if (it.task.status.ok()) std::memcpy(it.task.dst, it.task.src, it.task.bytes);
      if (it.task.after) it.task.after();
      {
        std::lock_guard<std::mutex> lock(it.state->mu);
        it.state->status = it.task.status;
        it.state->done = true;
      }
      it.state->cv.notify_all();
    }
  }

  std::function<void()> before_each_;  // queue thread only
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;  // guarded by mu_
  bool stop_ = false;       // guarded by mu_
  std::thread worker_;
};

}  // namespace nonstop

#endif  // NONSTOP_ENGINE_FAKE_COPY_QUEUE_H_
