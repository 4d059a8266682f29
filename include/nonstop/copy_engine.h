// CopyEngine: moves bytes from a tensor's memory (host or device) into host
// staging memory, asynchronously. The host implementation uses memcpy
// threads; the CUDA implementation (built with NONSTOP_CUDA) uses
// cudaMemcpyAsync on a dedicated non-blocking stream, ordered after the
// caller's stream by an event, with completion tracked by events.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "nonstop/status.h"
#include "nonstop/types.h"

namespace nonstop {

// A pending copy. Wait() blocks until the bytes are in `dst` (or the copy
// failed); Ready() polls. Completions are move-only and must be waited on or
// polled to readiness before `dst` is reused or freed.
class CopyCompletion {
 public:
  virtual ~CopyCompletion() = default;
  virtual Status Wait() = 0;
  virtual bool Ready() = 0;
};

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  // Starts copying `bytes` from `src` (on `src_device`) to host memory `dst`.
  // For CUDA sources the copy is ordered after all work already enqueued on
  // src_device.stream at the time of the call; that stream is never
  // synchronised.
  virtual std::unique_ptr<CopyCompletion> Copy(const void* src, const Device& src_device,
                                               void* dst, size_t bytes) = 0;
  // Host memory for staging: pinned (cudaHostAlloc) where a GPU is present,
  // else page-aligned, pre-faulted and mlock'ed where allowed. Returns nullptr
  // on failure. Free with FreeHost.
  virtual void* AllocHost(size_t bytes, bool* pinned) = 0;
  virtual void FreeHost(void* p, size_t bytes) = 0;
  virtual std::string Describe() const = 0;

  // --- What this engine can do. Callers ask these instead of testing the
  // engine's type; each default is the host engine's answer. ---
  //
  // Whether AllocHost page-locks memory through a device driver
  // (cudaHostAlloc): such staging is capped more tightly than plain memory.
  virtual bool PinsHostMemory() const { return false; }
  // Whether the engine can keep a second copy of a tensor in device memory
  // (AllocDevice, SnapshotToDevice, DrainToHost: layer-wise copy="device").
  virtual bool CanSnapshotOnDevice() const { return false; }

  // --- Device-side snapshots (where CanSnapshotOnDevice). ---
  //
  // Device memory for a snapshot buffer on `device`; nullptr on failure and
  // where CanSnapshotOnDevice is false.
  virtual void* AllocDevice(int device, size_t bytes) {
    (void)device;
    (void)bytes;
    return nullptr;
  }
  virtual void FreeDevice(int device, void* p) {
    (void)device;
    (void)p;
  }
  // Free memory on `device` now (cudaMemGetInfo), for sizing snapshot
  // buffers; 0 where it is unknown or CanSnapshotOnDevice is false.
  virtual uint64_t DeviceFreeBytes(int device) {
    (void)device;
    return 0;
  }
  // Starts a device-to-device copy of `bytes` from `src` (on `src_device`)
  // into `dst` (device memory on the same device), ordered after the work
  // already enqueued on src_device.stream. The completion is ready when `src`
  // may be overwritten. Where CanSnapshotOnDevice is false, a completion that
  // is already done with Unavailable.
  virtual std::unique_ptr<CopyCompletion> SnapshotToDevice(const void* src,
                                                           const Device& src_device, void* dst,
                                                           size_t bytes);
  // Copies a snapshot buffer (device memory on `device`, written by
  // SnapshotToDevice) to host memory `dst`, ordered after the earlier
  // snapshots on that device. Unavailable (as above) where
  // CanSnapshotOnDevice is false.
  virtual std::unique_ptr<CopyCompletion> DrainToHost(const void* src, int device, void* dst,
                                                      size_t bytes);

  // --- Host-to-device copies (restore into device tensors). ---
  //
  // Whether CopyToDevice can copy into memory on `dst_device` (the CUDA
  // engine: CUDA devices; the host engine: never).
  virtual bool CanCopyToDevice(const Device& dst_device) const {
    (void)dst_device;
    return false;
  }
  // Starts copying `bytes` from host memory `src` (pinned staging, for a DMA)
  // into `dst` on `dst_device`, ordered after the work already enqueued on
  // dst_device.stream. `src` must stay unchanged until the completion is
  // ready. A completion already done with Unavailable where CanCopyToDevice
  // is false.
  virtual std::unique_ptr<CopyCompletion> CopyToDevice(const void* src, void* dst,
                                                       const Device& dst_device, size_t bytes);

  // --- Ordering a device stream after a copy, without blocking the host. ---
  //
  // Whether StreamWaitFor can order a stream of `stream_device` after copies
  // this engine made from memory on that device (the CUDA engine: CUDA
  // devices; the host engine: never). Callers ask this instead of testing
  // the engine's type.
  virtual bool CanOrderStreams(const Device& stream_device) const {
    (void)stream_device;
    return false;
  }
  // Makes `stream_device.stream` wait, on the device, until `completion` (a
  // copy from this engine with a source on that device) is done, and returns
  // without waiting for it: work enqueued on the stream afterwards runs only
  // once the copy has read its source. A completion that is already done
  // (or never started) returns its status. May be called while another
  // thread Wait()s on the same completion. Unavailable where
  // CanOrderStreams is false.
  virtual Status StreamWaitFor(CopyCompletion* completion, const Device& stream_device) {
    (void)completion;
    (void)stream_device;
    return Status::Unavailable(Describe() + " cannot order a device stream; Wait() instead");
  }
};

// A completion that is already done with `status` (for copies that fail
// before they start, or that have nothing to do).
std::unique_ptr<CopyCompletion> MakeDoneCopy(Status status);

// memcpy on `threads` background threads.
std::unique_ptr<CopyEngine> MakeHostCopyEngine(int threads);

// The CUDA engine when this build has CUDA and a device is usable; otherwise
// the host engine, and `note` (if given) says why ("built without CUDA",
// "no CUDA device: cudaGetDeviceCount returned ...").
std::unique_ptr<CopyEngine> MakeBestCopyEngine(int host_threads, std::string* note);

// True when this binary was built with CUDA support.
bool BuiltWithCuda();

}  // namespace nonstop
