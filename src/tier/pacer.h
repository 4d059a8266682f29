// The upload bandwidth limit (remote_options bandwidth_bps, docs/TIERS.md):
// a stream of bytes kept to at most `bps` bytes a second, and stopped once
// the uploader gives up (close_timeout_s passed). One pace for both
// transports: the path transport's PutFile and the file reader obstore
// uploads from (nonstop._core.Directory.open(name, bps=, abort=), used by
// python/nonstop/_remote.py).
//
// Thread safety: one Pacer per stream, used by one thread at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>

#include "nonstop/status.h"

namespace nonstop::tier {

class Pacer {
 public:
  using Clock = std::function<double()>;          // seconds, monotonic
  using Sleep = std::function<void(double seconds)>;
  // bps <= 0: no limit. `now`/`sleep` null: the steady clock and
  // this_thread::sleep_for (tests pass their own).
  explicit Pacer(double bps, Clock now = nullptr, Sleep sleep = nullptr);

  // Called after `total` bytes in all since the Pacer was made: returns once
  // they are not ahead of the pace, sleeping in naps of at most 50 ms.
  // Aborted ("upload aborted (close_timeout_s passed)") as soon as
  // `aborted` (may be null) says so: before the first nap, and after each.
  Status Wait(uint64_t total, const std::function<bool()>& aborted);

 private:
  double bps_;
  Clock now_;
  Sleep sleep_;
  double t0_;
};

}  // namespace nonstop::tier
