// CudaCopyEngine: the CopyEngine for CUDA tensors, plus the two extra data
// paths of LightCheck (device-side snapshots and direct copies into a mapped
// medium).
//
// How a copy of a CUDA tensor is ordered, and why:
//   1. an event is recorded on the caller's stream (`src_device.stream`, the
//      stream the optimizer ran on) at the time of the call, so the copy sees
//      the tensor's final bytes for this step;
//   2. the engine's own copy stream for that device (created non-blocking, so
//      the legacy default stream never serialises with it) waits on that event;
//   3. cudaMemcpyAsync runs on the copy stream, and a second event recorded
//      after it marks completion.
// The caller's stream is never synchronised and cudaDeviceSynchronize is never
// called: the training stream keeps running while the copy engine of the GPU
// moves the bytes. Completions wait on their own event only.
//
// This header has no CUDA types in it, so the orchestrator and the Python
// bindings can include it in any build; in a build without CUDA,
// MakeCudaCopyEngine returns Unavailable.
//
// Thread safety: every method may be called from any thread; a completion
// is used by one thread at a time. The calling thread's current CUDA device
// is restored before each method returns. Completions may outlive the engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "nonstop/copy_engine.h"
#include "nonstop/status.h"
#include "nonstop/types.h"

namespace nonstop {

struct CudaCopyOptions {
  // How CopyCompletion::Wait blocks. kPoll sleeps between cudaEventQuery
  // calls with an exponential backoff (1 us doubling to 256 us), so it costs
  // little CPU and wakes at most 256 us late. kBlockingSync sleeps in the
  // driver (cudaEventBlockingSync + cudaEventSynchronize). kPoll is the
  // default because on an H100 (docs/CUDA.md) Copy() itself stayed at ~5 us
  // with it, while with blocking-sync events a Copy() call sometimes blocked
  // for 0.3-4.7 ms once hundreds of chunks were queued: a stall the training
  // thread would see. Bandwidth was the same (95-99.5 % of peak) in both.
  enum class WaitMode { kBlockingSync, kPoll };
  WaitMode wait_mode = WaitMode::kPoll;
  // kPoll only: a Wait() that sees no completion for this long returns an
  // IOError naming the copy instead of blocking forever (the stream the copy
  // is ordered after never reached its event: a hung kernel, or a stream
  // handle of another device). The copy may still land in `dst` later, so the
  // caller must treat the destination as lost. kBlockingSync waits in the
  // driver, without a limit.
  double wait_timeout_s = 600;
  // Copy streams get the lowest stream priority so that kernels the driver
  // may use for device-to-device copies never delay training kernels.
  bool low_priority_stream = true;
};

// Time spent pinning host memory: the numbers the engine reports so that a
// slow start (pinning 16 GB takes seconds) is visible rather than a mystery.
struct PinStats {
  uint64_t alloc_bytes = 0;      // pinned through AllocHost (cudaHostAlloc)
  double alloc_seconds = 0;
  uint64_t register_bytes = 0;   // pinned through RegisterHostRegion (cudaHostRegister)
  double register_seconds = 0;
  uint64_t unpinned_fallbacks = 0;  // AllocHost calls that fell back to pageable memory
};

class CudaCopyEngine : public CopyEngine {
 public:
  // --- LightCheck-G: device-side snapshots (copy="device"). ---
  //
  // AllocDevice/FreeDevice (cudaMalloc/cudaFree), SnapshotToDevice and
  // DrainToHost are CopyEngine's, which says what they do. A caller that
  // already has a device buffer (a torch tensor) may use that instead of
  // AllocDevice. DrainToHost is ordered after the earlier snapshots on the
  // same device through the copy stream alone, so it never waits on the
  // training stream.
  bool CanSnapshotOnDevice() const override { return true; }
  // AllocHost is cudaHostAlloc.
  bool PinsHostMemory() const override { return true; }

  // --- LightCheck-D: direct copies into a mapped medium (copy="direct"). ---
  //
  // Pins an existing host range (e.g. an mmap of the checkpoint file) with
  // cudaHostRegister(portable | mapped), so Copy() into it runs as one DMA
  // from the GPU straight into those pages rather than through the driver's
  // bounce buffers. `p` and `bytes` should be page-aligned. Linux refuses to
  // pin shared writable mappings of files on most disk file systems (it
  // cannot track their dirty pages); tmpfs, /dev/shm and anonymous memory
  // work. On refusal the error says so and Copy() into the range still works,
  // only slower.
  virtual Status RegisterHostRegion(void* p, size_t bytes) = 0;
  virtual Status UnregisterHostRegion(void* p) = 0;

  // --- Ordering without blocking the host (CopyEngine::StreamWaitFor). ---
  //
  // CanOrderStreams is true for CUDA devices. StreamWaitFor makes
  // `stream_device.stream` (a cudaStream_t as an integer on
  // `stream_device.index`) wait on the GPU for `completion`'s event
  // (cudaStreamWaitEvent), without blocking the calling thread: the training
  // stream's next update of a tensor may be enqueued at once and runs only
  // after the tensor's copy finished. Completions that are not events (host
  // copies, failed or empty copies) are returned as their status when done,
  // else InvalidArgument. It reads only the completion's event, so it may
  // run while another thread Wait()s on the same completion.

  // The engine's copy stream on `device` (a cudaStream_t as an integer),
  // created on first use; 0 if it cannot be created.
  virtual uintptr_t CopyStream(int device) = 0;
  virtual PinStats pin_stats() const = 0;
};

// The CUDA engine. Host-to-host copies (a src on DeviceKind::kHost) go to
// `host_fallback` when given, else they run as memcpy in the calling thread.
// Unavailable in a build without CUDA or when no device is usable; the
// message says why.
Result<std::unique_ptr<CudaCopyEngine>> MakeCudaCopyEngine(
    const CudaCopyOptions& options, std::unique_ptr<CopyEngine> host_fallback);

// The number of usable CUDA devices: 0 when the build has no CUDA, or when
// cudaGetDeviceCount fails (no driver, no device), in which case `error` (if
// given) gets "cudaGetDeviceCount: <the runtime's error string>".
int CudaDeviceCount(std::string* error);

}  // namespace nonstop
