// Device snapshots of whole checkpoints (EngineOptions::device_snapshot_bytes,
// docs/CUDA.md): how many bytes of a checkpoint's device tensors to copy
// device-to-device first (drained to the host afterwards) and how many to
// copy straight to the host before WaitCopied() returns.
//
// The copy stream runs the device-to-device snapshot and the direct copies
// one after the other, and training may update the tensors only once both
// are done. The direct copies overlap the window between Checkpoint() and
// the next WaitCopied() (the forward and backward of the next step), so the
// plan sends straight what reaches the host within that window and
// snapshots the rest: the least snapshot S with
//     S / d2d + (device_bytes - S) / d2h <= window,
// within the buffers' capacity. Without a measurement (the first
// checkpoints) it snapshots all it can: the stall is then the smallest.
#pragma once

#include <cstdint>

namespace nonstop::engine_detail {

struct SnapshotRates {
  double d2h_Bps = 0;    // device to host, bytes/s (0: not measured)
  double d2d_Bps = 0;    // device to device, bytes/s (0: not measured)
  double window_s = -1;  // Checkpoint() to the next WaitCopied(), s (< 0: not measured)
};

// Bytes to snapshot of `device_bytes`, at most `capacity`.
uint64_t SnapshotBytesWanted(uint64_t device_bytes, uint64_t capacity, const SnapshotRates& r);

// An exponentially weighted average (weight 0.3 for the new value); a first
// value (old <= 0) is taken as it is.
inline double RateEwma(double old_v, double new_v) {
  return old_v > 0 ? 0.7 * old_v + 0.3 * new_v : new_v;
}

}  // namespace nonstop::engine_detail
