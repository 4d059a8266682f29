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

#include "base/mutex.h"

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

// One Checkpointer's notice: the first one (why, when, in which step), the
// seconds per step measured at the step boundaries, and the flag the ranks
// all-reduce (MAX) at each boundary so that every rank acts at the same one
// (the all-reduce itself is Python's, on a gloo side group). Thread-safe: a
// notice may come from any thread.
class PreemptNotices {
 public:
  PreemptNotices(int rank, int world) : rank_(rank), world_(world) {}

  // Records a notice at now_s; the first one wins (false for a later one).
  // `step`: the step it arrived in; nullopt: the one after the last
  // boundary (unknown before the first boundary).
  bool Notice(const std::string& reason, std::optional<int64_t> step, double now_s) EXCLUDES(mu_);
  // ckpt.step(step) at now_s: the seconds per step move (an EWMA, 0.2 on
  // the newest interval; a step that did not advance is not timed).
  void Boundary(int64_t step, double now_s) EXCLUDES(mu_);
  // This rank's share of the MAX all-reduce: world - rank once noticed (so
  // the MAX names the lowest noticing rank), else 0.
  int64_t Flag() const EXCLUDES(mu_);
  // The lowest rank that had a notice, from the reduced flag; nullopt: none.
  std::optional<int> FirstRank(int64_t reduced) const;
  // The emergency checkpoint starts at `step`: a notice that came before
  // the first boundary gets it as its step.
  void HandledAt(int64_t step) EXCLUDES(mu_);
  // The line and expected seconds (EstimatePreempt) of this notice; one more
  // step to finish with several ranks (the agreement lags one boundary).
  PreemptEstimate Estimate(int64_t state_bytes, std::optional<double> bandwidth,
                           std::optional<double> grace_s, std::optional<int64_t> latest) const
      EXCLUDES(mu_);

  bool noticed() const EXCLUDES(mu_);
  std::optional<double> notice_s() const EXCLUDES(mu_);
  std::string reason() const EXCLUDES(mu_);
  std::optional<int64_t> notice_step() const EXCLUDES(mu_);
  std::optional<double> step_s() const EXCLUDES(mu_);

 private:
  const int rank_;
  const int world_;
  mutable Mutex mu_;
  std::optional<double> notice_s_ GUARDED_BY(mu_);
  std::string reason_ GUARDED_BY(mu_);
  std::optional<int64_t> notice_step_ GUARDED_BY(mu_);
  std::optional<int64_t> last_step_ GUARDED_BY(mu_);
  double last_s_ GUARDED_BY(mu_) = 0;
  std::optional<double> step_s_ GUARDED_BY(mu_);
};

}  // namespace nonstop
