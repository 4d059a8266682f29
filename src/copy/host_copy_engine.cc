// The host copy engine: memcpy on long-lived background threads.
//
// Copies run in submission order on `threads` threads (a FIFO queue), so a
// checkpoint's early chunks finish before its late ones and one checkpoint's
// copies before the next one's. With threads == 0 copies run inline in
// Copy() and the completion is ready on return (useful for tests and for
// machines where a background thread would only steal the training core).
#include <algorithm>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#include "base/mutex.h"
#include "nonstop/copy_engine.h"

namespace nonstop {
namespace {

// Completion state shared by the caller's handle and the copy thread.
// `done` goes 0 -> 1 exactly once (release), after the bytes are in dst.
struct CopyState {
  std::atomic<int> done{0};
  Status status;  // written before done is set, read only after done is observed
};

class HostCompletion final : public CopyCompletion {
 public:
  explicit HostCompletion(std::shared_ptr<CopyState> s) : s_(std::move(s)) {}
  Status Wait() override {
    s_->done.wait(0, std::memory_order_acquire);
    return s_->status;
  }
  bool Ready() override { return s_->done.load(std::memory_order_acquire) != 0; }

 private:
  std::shared_ptr<CopyState> s_;
};

class HostCopyEngine final : public CopyEngine {
 public:
  explicit HostCopyEngine(int threads) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
  }

  ~HostCopyEngine() override {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    cv_.SignalAll();
    for (auto& t : threads_) t.join();
  }

  std::unique_ptr<CopyCompletion> Copy(const void* src, const Device& src_device, void* dst,
                                       size_t bytes) override {
    auto state = std::make_shared<CopyState>();
    if (src_device.kind != DeviceKind::kHost) {
      state->status = Status::Unavailable(
          "host copy engine cannot read device memory: build with CUDA or pass host tensors");
      state->done.store(1, std::memory_order_release);
    } else if (threads_.empty() || bytes == 0) {
      if (bytes != 0) std::memcpy(dst, src, bytes);
      state->done.store(1, std::memory_order_release);
    } else {
      {
        MutexLock lock(&mu_);
        queue_.push_back(Task{src, dst, bytes, state});
      }
      cv_.Signal();
    }
    return std::make_unique<HostCompletion>(std::move(state));
  }

  void* AllocHost(size_t bytes, bool* pinned) override {
    if (pinned != nullptr) *pinned = false;
    if (bytes == 0) return nullptr;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    // Pre-fault every page now: copying into never-touched memory runs ~10x slower,
    // and the first checkpoint must not pay for it.
    std::memset(p, 0, bytes);
    // Best effort: keeps staging out of swap. Fails without CAP_IPC_LOCK or
    // RLIMIT_MEMLOCK headroom, which is fine: the pages are already resident.
    if (mlock(p, bytes) == 0 && pinned != nullptr) *pinned = true;
    return p;
  }

  void FreeHost(void* p, size_t bytes) override {
    if (p == nullptr) return;
    // In slices: munlock/munmap hold the process's mmap lock for the whole
    // range, and every other thread's mmap, mlock and page fault waits behind
    // it. Freeing the replaced 256 MiB staging pool in one call from a
    // background thread delayed the training thread's 0.6 MB mlock by 63 ms.
    constexpr size_t kSlice = size_t{8} << 20;  // a multiple of the page size
    auto* base = static_cast<char*>(p);
    for (size_t off = 0; off < bytes; off += kSlice) {
      const size_t n = std::min(kSlice, bytes - off);
      munlock(base + off, n);
      munmap(base + off, n);
    }
  }

  std::string Describe() const override {
    return "host memcpy (" + std::to_string(threads_.size()) + " threads)";
  }

 private:
  struct Task {
    const void* src;
    void* dst;
    size_t bytes;
    std::shared_ptr<CopyState> state;
  };

  void Run() {
    for (;;) {
      Task t;
      {
        MutexLock lock(&mu_);
        cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return stop_ || !queue_.empty(); });
        // Drain the queue before stopping: a completion handed out must complete.
        if (queue_.empty()) return;
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      std::memcpy(t.dst, t.src, t.bytes);
      t.state->done.store(1, std::memory_order_release);
      t.state->done.notify_all();
    }
  }

  Mutex mu_;
  CondVar cv_;
  std::deque<Task> queue_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;  // fixed after construction
};

}  // namespace

std::unique_ptr<CopyEngine> MakeHostCopyEngine(int threads) {
  return std::make_unique<HostCopyEngine>(threads < 0 ? 0 : threads);
}

}  // namespace nonstop
