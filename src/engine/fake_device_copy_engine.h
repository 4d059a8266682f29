// Tests only: a copy engine whose "device" memory is host memory, for the
// device snapshot tests of whole checkpoints. Tensors registered with
// Device{kCuda, ...} are read as host memory. Copies from the device
// (Copy of a device source, DrainToHost) and device-to-device copies
// (SnapshotToDevice) run in submission order on one thread, the "copy
// stream", each taking at least bytes / bandwidth; copies of host sources
// run inline. It records what a real device would not show: a snapshot
// written over a buffer whose previous contents were not all handed to a
// drain yet (`overwrites`). What the copies have put in place so far
// (`direct_copied`, `drain_copied`) and a gate that holds the drains let a
// test assert the order of events instead of wall times.
#ifndef NONSTOP_ENGINE_FAKE_DEVICE_COPY_ENGINE_H_
#define NONSTOP_ENGINE_FAKE_DEVICE_COPY_ENGINE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "engine/fake_copy_queue.h"
#include "nonstop/copy_engine.h"

namespace nonstop {

// Holds the drains (DrainToHost) on the copy stream while closed, and so
// everything queued behind them. Opens by itself after kLimit (counted in
// `timeouts`), so an engine that waits for a held drain fails its test
// instead of hanging it.
class FakeDrainGate {
 public:
  static constexpr std::chrono::seconds kLimit{30};
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = false;
  }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  void Pass() {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, kLimit, [&] { return open_; })) {
      ++timeouts;
      open_ = true;
    }
  }
  std::atomic<int> timeouts{0};

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;  // guarded by mu_
};

struct FakeDeviceLog {
  // Bytes submitted: snapshots, drains, direct copies of device sources.
  std::atomic<uint64_t> snapshot_bytes{0}, drain_bytes{0}, direct_bytes{0};
  // Bytes in place: the drains' and the direct copies' (on the copy stream,
  // just before their completion is done).
  std::atomic<uint64_t> drain_copied{0}, direct_copied{0};
  FakeDrainGate drain_gate;
  std::atomic<int> drain_calls{0};
  std::atomic<int> overwrites{0};
  std::atomic<int> fail_drain_at{-1};  // the drain call (0-based) that fails
  std::atomic<uint64_t> device_allocated{0};
};

class FakeDeviceCopyEngine final : public CopyEngine {
 public:
  FakeDeviceCopyEngine(double d2h_Bps, double d2d_Bps, uint64_t free_bytes,
                       std::shared_ptr<FakeDeviceLog> log)
      : d2h_(d2h_Bps), d2d_(d2d_Bps), free_(free_bytes), log_(std::move(log)) {}

  std::unique_ptr<CopyCompletion> Copy(const void* src, const Device& dev, void* dst,
                                       size_t bytes) override {
    if (dev.kind == DeviceKind::kHost) {
      if (bytes > 0) std::memcpy(dst, src, bytes);
      return MakeDoneCopy(Status::OK());
    }
    log_->direct_bytes += bytes;
    return Enqueue(src, dst, bytes, d2h_, Status::OK(), nullptr, &log_->direct_copied);
  }
  void* AllocHost(size_t bytes, bool* pinned) override {
    if (pinned != nullptr) *pinned = false;
    void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    if (p != nullptr) std::memset(p, 0, bytes);
    return p;
  }
  void FreeHost(void* p, size_t) override { std::free(p); }
  std::string Describe() const override { return "fake device copy engine (host memory)"; }
  bool CanSnapshotOnDevice() const override { return true; }
  uint64_t DeviceFreeBytes(int) override { return free_; }
  void* AllocDevice(int, size_t bytes) override {
    log_->device_allocated += bytes;
    return std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  }
  void FreeDevice(int, void* p) override { std::free(p); }
  std::unique_ptr<CopyCompletion> SnapshotToDevice(const void* src, const Device& dev, void* dst,
                                                   size_t bytes) override {
    if (dev.kind != DeviceKind::kCuda) {
      return MakeDoneCopy(Status::InvalidArgument("SnapshotToDevice of host memory"));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      uint64_t& left = undrained_[static_cast<const std::byte*>(dst)];
      if (left > 0) ++log_->overwrites;
      left = bytes;
    }
    log_->snapshot_bytes += bytes;
    return Enqueue(src, dst, bytes, d2d_, Status::OK(), nullptr, nullptr);
  }
  std::unique_ptr<CopyCompletion> DrainToHost(const void* src, int, void* dst,
                                              size_t bytes) override {
    const auto* s = static_cast<const std::byte*>(src);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = undrained_.upper_bound(s);
      if (it != undrained_.begin()) {
        --it;
        it->second -= std::min<uint64_t>(it->second, bytes);
      }
    }
    log_->drain_bytes += bytes;
    const int call = log_->drain_calls++;
    Status st = call == log_->fail_drain_at.load() ? Status::IOError("injected drain failure")
                                                   : Status::OK();
    return Enqueue(src, dst, bytes, d2h_, st, &log_->drain_gate, &log_->drain_copied);
  }

 private:
  // On the copy stream: past `gate` (if any), at least bytes / Bps per
  // copy; `copied` (if any) counts the bytes once in place.
  std::unique_ptr<CopyCompletion> Enqueue(const void* src, void* dst, size_t bytes, double Bps,
                                          Status status, FakeDrainGate* gate,
                                          std::atomic<uint64_t>* copied) {
    const auto take = std::chrono::duration<double>(static_cast<double>(bytes) / Bps);
    const bool ok = status.ok();
    return queue_.Enqueue(FakeCopyQueue::Task{src, dst, bytes, std::move(status),
                                              [take, gate] {
                                                if (gate != nullptr) gate->Pass();
                                                std::this_thread::sleep_for(take);
                                              },
                                              [copied, ok, bytes] {
                                                if (copied != nullptr && ok) *copied += bytes;
                                              }});
  }

  const double d2h_, d2d_;
  const uint64_t free_;
  std::shared_ptr<FakeDeviceLog> log_;
  std::mutex mu_;
  // Per snapshot buffer: bytes written by its last snapshot and not yet
  // handed to a drain (guarded by mu_).
  std::map<const std::byte*, uint64_t> undrained_;
  FakeCopyQueue queue_;  // last: its thread stops first
};

}  // namespace nonstop

#endif  // NONSTOP_ENGINE_FAKE_DEVICE_COPY_ENGINE_H_
