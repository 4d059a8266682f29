// The device snapshot plan (device_snapshot.h).
#include "engine/device_snapshot.h"

#include <algorithm>
#include <cmath>

namespace nonstop::engine_detail {

uint64_t SnapshotBytesWanted(uint64_t device_bytes, uint64_t capacity, const SnapshotRates& r) {
  const uint64_t most = std::min(device_bytes, capacity);
  if (most == 0) return 0;
  if (!(r.d2h_Bps > 0) || !(r.window_s >= 0)) return most;  // not measured: all it can
  const double total = static_cast<double>(device_bytes);
  const double direct_s = total / r.d2h_Bps;
  if (direct_s <= r.window_s) return 0;  // everything reaches the host in the window
  // Each byte moved from the direct copies to the snapshot saves
  // 1/d2h - 1/d2d seconds of the copy stream (d2d not measured: all of 1/d2h).
  const double saved = 1.0 / r.d2h_Bps - (r.d2d_Bps > 0 ? 1.0 / r.d2d_Bps : 0.0);
  if (!(saved > 0)) return 0;  // a snapshot is no faster than the direct copy
  const double s = std::ceil((direct_s - r.window_s) / saved);
  if (!(s < static_cast<double>(most))) return most;
  return static_cast<uint64_t>(s);
}

}  // namespace nonstop::engine_detail
