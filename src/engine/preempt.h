// The arithmetic of a preemption notice (python/nonstop/_preempt.py,
// docs/PREEMPTION.md): the persist bandwidth measured so far and the one
// line printed when a notice arrives, with the expected seconds from the
// notice to a committed emergency checkpoint. Pure functions: the signal
// handler (Python) only hands them numbers.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace nonstop {

// One checkpoint of EngineStats::recent, as far as the bandwidth needs it.
struct PersistSample {
  bool committed = false;
  double bytes = 0;
  double persist_s = 0;  // start to commit
};

// Bytes per second of the recent committed checkpoints: the median (the
// upper one of an even count) of the last 5 committed ones with bytes and
// persist_s > 0; nullopt when none has committed yet.
std::optional<double> PersistBandwidth(const std::vector<PersistSample>& recent);

// "1.5 GiB", "3.0 KiB", "12 B".
std::string HumanBytes(int64_t n);

struct PreemptNotice {
  std::string reason;                 // "SIGTERM", "preempt()", "rank 3", ...
  int64_t rank = 0;
  std::optional<int64_t> notice_step; // the step running when it arrived
  int64_t state_bytes = 0;            // 0: unknown (nothing registered yet)
  std::optional<double> bandwidth;    // PersistBandwidth
  std::optional<double> step_s;       // seconds per step so far
  int64_t lag_steps = 0;              // steps before the boundary that acts (1 with several ranks)
  std::optional<double> grace_s;      // what the platform allows
  std::optional<int64_t> latest;      // the newest committed step
};

struct PreemptEstimate {
  std::string line;                 // printed on stderr, one line
  std::optional<double> expected_s; // notice -> committed; nullopt when unknown
};

// Finish the step(s) in progress ((lag_steps + 1) * step_s) plus write
// state_bytes at bandwidth; with grace_s, whether that fits.
PreemptEstimate EstimatePreempt(const PreemptNotice& n);

}  // namespace nonstop
