// The CUDA copy engine: plain C++ over the CUDA runtime API (no kernels), so
// the host compiler builds it and CUDA::cudart_static links it; a binary
// built with it still starts on a machine without a driver.
#include "copy/cuda_copy_engine.h"

#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/mutex.h"

namespace nonstop {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string Hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}

std::string Bytes(size_t n) {
  char buf[48];
  if (n >= (size_t{1} << 30)) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", static_cast<double>(n) / (1 << 30));
  } else if (n >= (size_t{1} << 20)) {
    std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(n) / (1 << 20));
  } else {
    std::snprintf(buf, sizeof(buf), "%zu bytes", n);
  }
  return buf;
}

// "<what>: cudaErrorInvalidValue (invalid argument)", with a code that says
// whose fault it is: bad pointers and handles are the caller's, a missing
// driver or device is Unavailable, anything else is the device failing.
Status CudaStatus(cudaError_t err, const std::string& what) {
  std::string msg = what + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
  switch (err) {
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidMemcpyDirection:
    case cudaErrorHostMemoryAlreadyRegistered:
    case cudaErrorHostMemoryNotRegistered:
      return Status::InvalidArgument(std::move(msg));
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorNotSupported:
      return Status::Unavailable(std::move(msg));
    default:
      return Status::IOError(std::move(msg));
  }
}

// Makes `device` current for the scope and restores the caller's device:
// the training thread's current device must not change under it.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device) {
      err_ = cudaSetDevice(device);
      changed_ = err_ == cudaSuccess && prev_ >= 0;
    }
  }
  ~ScopedDevice() {
    if (changed_) cudaSetDevice(prev_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  cudaError_t error() const { return err_; }

 private:
  int prev_ = -1;
  bool changed_ = false;
  cudaError_t err_ = cudaSuccess;
};

// The per-device state: one copy stream and a pool of events (creating an
// event per copy costs microseconds that the chunked data path would pay
// thousands of times per checkpoint).
class DeviceContext {
 public:
  DeviceContext(int device, cudaStream_t stream, unsigned event_flags)
      : device_(device), stream_(stream), event_flags_(event_flags) {}
  ~DeviceContext() {
    // Errors are ignored: at process exit the runtime may already be gone.
    ScopedDevice guard(device_);
    cudaStreamSynchronize(stream_);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    cudaStreamDestroy(stream_);
  }
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }

  // The caller has made device() current.
  cudaError_t TakeEvent(cudaEvent_t* out) {
    {
      MutexLock lock(&mu_);
      if (!free_events_.empty()) {
        *out = free_events_.back();
        free_events_.pop_back();
        return cudaSuccess;
      }
    }
    return cudaEventCreateWithFlags(out, event_flags_);
  }
  // Safe while the event is still pending: a later record replaces it, and
  // stream waits already enqueued keep the state they captured.
  void ReturnEvent(cudaEvent_t e) {
    if (e == nullptr) return;
    MutexLock lock(&mu_);
    free_events_.push_back(e);
  }

 private:
  const int device_;
  const cudaStream_t stream_;
  const unsigned event_flags_;
  Mutex mu_;
  std::vector<cudaEvent_t> free_events_ GUARDED_BY(mu_);
};

// A copy that is done already (or failed before it was enqueued).
class FinishedCompletion : public CopyCompletion {
 public:
  explicit FinishedCompletion(Status status) : status_(std::move(status)) {}
  Status Wait() override { return status_; }
  bool Ready() override { return true; }

 private:
  Status status_;
};

class CudaCompletion : public CopyCompletion {
 public:
  CudaCompletion(std::shared_ptr<DeviceContext> ctx, cudaEvent_t done,
                 CudaCopyOptions::WaitMode mode, double timeout_s, std::string what)
      : ctx_(std::move(ctx)), done_(done), mode_(mode), timeout_s_(timeout_s),
        what_(std::move(what)) {}
  ~CudaCompletion() override { ctx_->ReturnEvent(done_); }

  Status Wait() override {
    if (finished_) return status_;
    cudaError_t err;
    if (mode_ == CudaCopyOptions::WaitMode::kPoll) {
      auto backoff = std::chrono::microseconds(1);
      const auto t0 = Clock::now();
      while ((err = cudaEventQuery(done_)) == cudaErrorNotReady) {
        if (SecondsSince(t0) > timeout_s_) {
          finished_ = true;
          char limit[32];
          std::snprintf(limit, sizeof(limit), "%g", timeout_s_);
          status_ = Status::IOError(what_ + ": not complete after " + limit +
                                    " s (the stream it is ordered after never reached it: "
                                    "a hung kernel, or a stream of another device?)");
          return status_;
        }
        std::this_thread::sleep_for(backoff);
        backoff = std::min(backoff * 2, std::chrono::microseconds(256));
      }
    } else {
      err = cudaEventSynchronize(done_);
    }
    Finish(err);
    return status_;
  }

  bool Ready() override {
    if (finished_) return true;
    cudaError_t err = cudaEventQuery(done_);
    if (err == cudaErrorNotReady) return false;
    Finish(err);
    return true;
  }

  cudaEvent_t done() const { return done_; }

 private:
  void Finish(cudaError_t err) {
    finished_ = true;
    if (err != cudaSuccess) status_ = CudaStatus(err, what_);
  }

  std::shared_ptr<DeviceContext> ctx_;
  const cudaEvent_t done_;  // read by StreamWaitFor from any thread
  const CudaCopyOptions::WaitMode mode_;
  const double timeout_s_;
  const std::string what_;
  bool finished_ = false;
  Status status_;
};

class CudaCopyEngineImpl : public CudaCopyEngine {
 public:
  CudaCopyEngineImpl(const CudaCopyOptions& options, std::unique_ptr<CopyEngine> host,
                     int devices)
      : options_(options), host_(std::move(host)), devices_(devices), contexts_(devices) {}

  ~CudaCopyEngineImpl() override {
    // Host memory still handed out is the caller's leak; release it so the
    // driver does not keep it pinned after the engine is gone.
    for (auto& [p, block] : host_blocks_) ReleaseHost(p, block);
  }

  std::unique_ptr<CopyCompletion> Copy(const void* src, const Device& src_device, void* dst,
                                       size_t bytes) override {
    if (src_device.kind == DeviceKind::kHost) {
      if (host_ != nullptr) return host_->Copy(src, src_device, dst, bytes);
      if (bytes > 0) std::memcpy(dst, src, bytes);
      return std::make_unique<FinishedCompletion>(Status::OK());
    }
    return Enqueue(src, src_device, dst, bytes, cudaMemcpyDeviceToHost, "copy to host");
  }

  // Pinned host memory, pinned the fast way: cudaHostAlloc pins at ~2 GB/s
  // (16 GiB took 7.3 s on an H100 machine), while registering memory that is
  // already faulted in runs at ~13 GB/s. So: map, ask for transparent huge
  // pages, fault the pages in on several threads, then cudaHostRegister.
  // Falls back to cudaHostAlloc, then to pageable pre-faulted memory.
  void* AllocHost(size_t bytes, bool* pinned) override {
    if (pinned != nullptr) *pinned = false;
    if (bytes == 0) return nullptr;
    auto t0 = Clock::now();
    HostBlock block;
    block.bytes = bytes;
    block.mapped_bytes = (bytes + kHugePage - 1) & ~(kHugePage - 1);
    void* p = MapAndPrefault(block.mapped_bytes);
    if (p != nullptr) {
      if (cudaHostRegister(p, block.mapped_bytes, cudaHostRegisterPortable) == cudaSuccess) {
        block.kind = HostBlock::kRegistered;
      } else {
        cudaGetLastError();
        block.kind = HostBlock::kPageable;  // kept in case cudaHostAlloc fails too
      }
    }
    if (block.kind != HostBlock::kRegistered) {
      void* q = nullptr;
      // Portable: the staging pool serves every device of the process.
      if (cudaHostAlloc(&q, bytes, cudaHostAllocPortable) == cudaSuccess) {
        if (p != nullptr) munmap(p, block.mapped_bytes);
        p = q;
        block.kind = HostBlock::kHostAlloc;
      } else {
        cudaGetLastError();
      }
    }
    if (p == nullptr) return nullptr;
    double seconds = SecondsSince(t0);
    MutexLock lock(&mu_);
    host_blocks_[p] = block;
    if (block.kind == HostBlock::kPageable) {
      stats_.unpinned_fallbacks++;
      return p;
    }
    stats_.alloc_bytes += bytes;
    stats_.alloc_seconds += seconds;
    if (pinned != nullptr) *pinned = true;
    return p;
  }

  void FreeHost(void* p, size_t /*bytes*/) override {
    if (p == nullptr) return;
    HostBlock block;
    {
      MutexLock lock(&mu_);
      auto it = host_blocks_.find(p);
      if (it == host_blocks_.end()) return;
      block = it->second;
      host_blocks_.erase(it);
    }
    ReleaseHost(p, block);
  }

  std::string Describe() const override {
    std::string out = "cuda copy engine: " + std::to_string(devices_) + " device(s)";
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
      out += std::string(" (device 0: ") + prop.name + ")";
    }
    out += ", one non-blocking copy stream per device, wait=";
    out += options_.wait_mode == CudaCopyOptions::WaitMode::kPoll ? "poll" : "blocking-sync";
    out += "; host sources: " + (host_ != nullptr ? host_->Describe() : "memcpy in caller");
    return out;
  }

  void* AllocDevice(int device, size_t bytes) override {
    ScopedDevice guard(device);
    if (guard.error() != cudaSuccess) return nullptr;
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return p;
  }

  void FreeDevice(int device, void* p) override {
    if (p == nullptr) return;
    ScopedDevice guard(device);
    cudaFree(p);
  }

  uint64_t DeviceFreeBytes(int device) override {
    ScopedDevice guard(device);
    if (guard.error() != cudaSuccess) return 0;
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return free_b;
  }

  std::unique_ptr<CopyCompletion> SnapshotToDevice(const void* src, const Device& src_device,
                                                   void* dst, size_t bytes) override {
    if (src_device.kind != DeviceKind::kCuda) {
      return std::make_unique<FinishedCompletion>(Status::InvalidArgument(
          "SnapshotToDevice needs a CUDA source; host tensors are copied with Copy()"));
    }
    return Enqueue(src, src_device, dst, bytes, cudaMemcpyDeviceToDevice, "device snapshot");
  }

  bool CanCopyToDevice(const Device& dst_device) const override {
    return dst_device.kind == DeviceKind::kCuda && dst_device.index >= 0 &&
           dst_device.index < devices_;
  }

  // Restore: pinned staging -> a device tensor, on the copy stream, after the
  // work already on the tensor's stream (Enqueue's `src_device` is the
  // device and stream the copy is ordered on).
  std::unique_ptr<CopyCompletion> CopyToDevice(const void* src, void* dst,
                                               const Device& dst_device, size_t bytes) override {
    if (dst_device.kind != DeviceKind::kCuda) {
      if (bytes > 0) std::memcpy(dst, src, bytes);
      return std::make_unique<FinishedCompletion>(Status::OK());
    }
    return Enqueue(src, dst_device, dst, bytes, cudaMemcpyHostToDevice, "copy to device");
  }

  std::unique_ptr<CopyCompletion> DrainToHost(const void* src, int device, void* dst,
                                              size_t bytes) override {
    Device on_copy_stream{DeviceKind::kCuda, device, kOwnStream};
    return Enqueue(src, on_copy_stream, dst, bytes, cudaMemcpyDeviceToHost, "drain snapshot");
  }

  Status RegisterHostRegion(void* p, size_t bytes) override {
    auto t0 = Clock::now();
    cudaError_t err =
        cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
    double seconds = SecondsSince(t0);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return CudaStatus(err, "cudaHostRegister of " + Bytes(bytes) + " at " + Hex(p))
          .Annotate(
              "cannot pin the medium's mapping (Linux pins shared file mappings on tmpfs and "
              "/dev/shm, not on most disk file systems); copies into it still work, unpinned");
    }
    MutexLock lock(&mu_);
    stats_.register_bytes += bytes;
    stats_.register_seconds += seconds;
    return Status::OK();
  }

  Status UnregisterHostRegion(void* p) override {
    cudaError_t err = cudaHostUnregister(p);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return CudaStatus(err, "cudaHostUnregister at " + Hex(p));
    }
    return Status::OK();
  }

  bool CanOrderStreams(const Device& stream_device) const override {
    return stream_device.kind == DeviceKind::kCuda && stream_device.index >= 0 &&
           stream_device.index < devices_;
  }

  Status StreamWaitFor(CopyCompletion* completion, const Device& stream_device) override {
    auto* cuda = dynamic_cast<CudaCompletion*>(completion);
    if (cuda == nullptr) {
      // Host copies and copies that never started have nothing on the GPU
      // to wait for; their outcome is the host's to wait on.
      if (completion == nullptr) return Status::InvalidArgument("StreamWaitFor: no completion");
      return completion->Ready() ? completion->Wait()
                                 : Status::InvalidArgument(
                                       "StreamWaitFor: a host copy cannot order a CUDA stream; "
                                       "Wait() on it instead");
    }
    ScopedDevice guard(stream_device.index);
    if (guard.error() != cudaSuccess) {
      return CudaStatus(guard.error(), "cudaSetDevice(" + std::to_string(stream_device.index) + ")");
    }
    cudaError_t err = cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream_device.stream),
                                          cuda->done(), 0);
    if (err != cudaSuccess) {
      return CudaStatus(err, "cudaStreamWaitEvent on stream " +
                                 Hex(reinterpret_cast<void*>(stream_device.stream)) +
                                 " of device " + std::to_string(stream_device.index));
    }
    return Status::OK();
  }

  uintptr_t CopyStream(int device) override {
    std::shared_ptr<DeviceContext> ctx;
    if (!Context(device, &ctx).ok()) return 0;
    return reinterpret_cast<uintptr_t>(ctx->stream());
  }

  PinStats pin_stats() const override {
    MutexLock lock(&mu_);
    return stats_;
  }

 private:
  struct HostBlock {
    enum Kind { kRegistered, kHostAlloc, kPageable } kind = kPageable;
    size_t bytes = 0;
    size_t mapped_bytes = 0;  // of the mmap, for kRegistered and kPageable
  };
  static constexpr size_t kHugePage = size_t{2} << 20;

  static void ReleaseHost(void* p, const HostBlock& block) {
    switch (block.kind) {
      case HostBlock::kRegistered:
        cudaHostUnregister(p);
        munmap(p, block.mapped_bytes);
        break;
      case HostBlock::kHostAlloc:
        cudaFreeHost(p);
        break;
      case HostBlock::kPageable:
        munmap(p, block.mapped_bytes);
        break;
    }
  }

  // Anonymous memory with every page faulted in. Large blocks are faulted
  // on up to 8 threads: the kernel zeroes each page on its first touch, and
  // one thread does that at only a few GB/s.
  static void* MapAndPrefault(size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    madvise(p, bytes, MADV_HUGEPAGE);  // a hint; fine where THP is off
    auto* base = static_cast<volatile char*>(p);
    auto touch = [base](size_t from, size_t to) {
      for (size_t off = from; off < to; off += 4096) base[off] = 0;
    };
    size_t hw = std::max(1u, std::thread::hardware_concurrency());
    size_t threads = bytes >= (size_t{256} << 20) ? std::min<size_t>(8, hw) : 1;
    size_t per = ((bytes / threads) + kHugePage - 1) & ~(kHugePage - 1);
    std::vector<std::thread> pool;
    for (size_t from = per; from < bytes; from += per) {
      pool.emplace_back(touch, from, std::min(bytes, from + per));
    }
    touch(0, std::min(bytes, per));
    for (auto& t : pool) t.join();
    return p;
  }

  // Marks a source already ordered on the engine's copy stream.
  static constexpr uintptr_t kOwnStream = ~uintptr_t{0};

  Status Context(int device, std::shared_ptr<DeviceContext>* out) {
    if (device < 0 || device >= devices_) {
      return Status::InvalidArgument("CUDA device " + std::to_string(device) + " does not exist (" +
                                     std::to_string(devices_) + " visible)");
    }
    MutexLock lock(&mu_);
    if (contexts_[device] == nullptr) {
      ScopedDevice guard(device);
      if (guard.error() != cudaSuccess) {
        return CudaStatus(guard.error(), "cudaSetDevice(" + std::to_string(device) + ")");
      }
      int least = 0, greatest = 0;
      int priority = 0;
      if (options_.low_priority_stream &&
          cudaDeviceGetStreamPriorityRange(&least, &greatest) == cudaSuccess) {
        priority = least;  // numerically largest = lowest priority
      }
      cudaStream_t stream = nullptr;
      cudaError_t err = cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, priority);
      if (err != cudaSuccess) {
        return CudaStatus(err, "create the copy stream on device " + std::to_string(device));
      }
      unsigned flags = cudaEventDisableTiming;
      if (options_.wait_mode == CudaCopyOptions::WaitMode::kBlockingSync) {
        flags |= cudaEventBlockingSync;
      }
      contexts_[device] = std::make_shared<DeviceContext>(device, stream, flags);
    }
    *out = contexts_[device];
    return Status::OK();
  }

  std::unique_ptr<CopyCompletion> Failed(Status status) {
    return std::make_unique<FinishedCompletion>(std::move(status));
  }

  // Records "ready" on the caller's stream, makes the copy stream wait on it,
  // enqueues the copy and records "done" after it.
  std::unique_ptr<CopyCompletion> Enqueue(const void* src, const Device& src_device, void* dst,
                                          size_t bytes, cudaMemcpyKind kind, const char* verb) {
    if (bytes == 0) return Failed(Status::OK());
    std::shared_ptr<DeviceContext> ctx;
    Status st = Context(src_device.index, &ctx);
    if (!st.ok()) return Failed(st.Annotate(verb));
    std::string what = std::string(verb) + " of " + Bytes(bytes) + " from " + Hex(src) +
                       " on device " + std::to_string(src_device.index);
    ScopedDevice guard(ctx->device());
    if (guard.error() != cudaSuccess) return Failed(CudaStatus(guard.error(), what));

    if (src_device.stream != kOwnStream) {
      auto caller = reinterpret_cast<cudaStream_t>(src_device.stream);
      cudaEvent_t ready = nullptr;
      cudaError_t err = ctx->TakeEvent(&ready);
      if (err == cudaSuccess) err = cudaEventRecord(ready, caller);
      if (err == cudaSuccess) err = cudaStreamWaitEvent(ctx->stream(), ready, 0);
      ctx->ReturnEvent(ready);
      if (err != cudaSuccess) {
        cudaGetLastError();
        return Failed(CudaStatus(err, what + ": order after stream " +
                                          Hex(reinterpret_cast<void*>(src_device.stream)) +
                                          " (pass the stream of the tensor's own device)"));
      }
    }
    cudaError_t err = cudaMemcpyAsync(dst, src, bytes, kind, ctx->stream());
    if (err != cudaSuccess) {
      cudaGetLastError();
      return Failed(CudaStatus(err, what + " to " + Hex(dst)));
    }
    cudaEvent_t done = nullptr;
    err = ctx->TakeEvent(&done);
    if (err == cudaSuccess) err = cudaEventRecord(done, ctx->stream());
    if (err != cudaSuccess) {
      ctx->ReturnEvent(done);
      // The copy is enqueued but cannot be tracked: wait for the stream (our
      // own, never the caller's) so that the caller may reuse `dst`.
      cudaStreamSynchronize(ctx->stream());
      cudaGetLastError();
      return Failed(CudaStatus(err, what + ": record the completion event"));
    }
    return std::make_unique<CudaCompletion>(std::move(ctx), done, options_.wait_mode,
                                            options_.wait_timeout_s, std::move(what));
  }

  const CudaCopyOptions options_;
  const std::unique_ptr<CopyEngine> host_;

  mutable Mutex mu_;
  const int devices_;  // contexts_.size(), fixed
  std::vector<std::shared_ptr<DeviceContext>> contexts_ GUARDED_BY(mu_);  // created on first use
  std::unordered_map<void*, HostBlock> host_blocks_ GUARDED_BY(mu_);
  PinStats stats_ GUARDED_BY(mu_);
};

}  // namespace

int CudaDeviceCount(std::string* error) {
  // cudaGetDeviceCount leaves `count` untouched when it fails (no driver).
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    if (error != nullptr) {
      *error = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
      int driver = 0;
      if (err == cudaErrorInsufficientDriver && cudaDriverGetVersion(&driver) == cudaSuccess &&
          driver == 0) {
        *error += " (no NVIDIA driver is installed)";
      }
    }
    return 0;
  }
  if (count <= 0 && error != nullptr) *error = "cudaGetDeviceCount: no CUDA device";
  return std::max(count, 0);
}

Result<std::unique_ptr<CudaCopyEngine>> MakeCudaCopyEngine(
    const CudaCopyOptions& options, std::unique_ptr<CopyEngine> host_fallback) {
  std::string error;
  int devices = CudaDeviceCount(&error);
  if (devices == 0) {
    return Status::Unavailable("built with CUDA but no usable device: " + error);
  }
  return std::unique_ptr<CudaCopyEngine>(
      new CudaCopyEngineImpl(options, std::move(host_fallback), devices));
}

}  // namespace nonstop
