// The upload bandwidth limit (pacer.h).
#include "tier/pacer.h"

#include <algorithm>
#include <thread>
#include <utility>

namespace nonstop::tier {

Pacer::Pacer(double bps, Clock now, Sleep sleep)
    : bps_(bps), now_(std::move(now)), sleep_(std::move(sleep)) {
  if (!now_) {
    now_ = [] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
          .count();
    };
  }
  if (!sleep_) {
    sleep_ = [](double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); };
  }
  t0_ = now_();
}

Status Pacer::Wait(uint64_t total, const std::function<bool()>& aborted) {
  while (true) {
    if (aborted && aborted()) return Status::Aborted("upload aborted (close_timeout_s passed)");
    if (bps_ <= 0) return Status::OK();
    const double ahead = static_cast<double>(total) / bps_ - (now_() - t0_);
    if (ahead <= 0) return Status::OK();
    sleep_(std::min(ahead, 0.05));
  }
}

}  // namespace nonstop::tier
