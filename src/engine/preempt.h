// The arithmetic of a preemption notice (python/nonstop/_preempt.py,
// docs/PREEMPTION.md): the persist bandwidth measured so far and the one
// line printed when a notice arrives, with the expected seconds from the
// notice to a committed emergency checkpoint. Pure functions (the signal
// handler, Python, only hands them numbers), but AwaitEmergency, which waits
// in the engine at the step boundary.
#pragma once

#include <csignal>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/mutex.h"
#include "nonstop/engine.h"
#include "nonstop/status.h"

namespace nonstop {

// on_preempt's settings (docs/PREEMPTION.md "on_preempt"), but `group` (a
// torch.distributed group: Python's).
struct PreemptOptions {
  std::vector<int> signals{SIGTERM};  // sorted, no duplicates; empty: only ckpt.preempt()
  int exit_code = 75;                 // sysexits.h EX_TEMPFAIL (_preempt.py EXIT_PREEMPTED)
  std::optional<double> grace_s;      // seconds the platform allows; nullopt: no deadline
  bool chain = true;                  // call the previous handler once committed
  double timeout_s = 300;             // the agreement collectives' timeout
};

// The settings from a JSON object with any of the keys signals (a name such
// as "SIGUSR1" or "term", or a number; one or a list), exit_code (0..255),
// grace_s (positive seconds, or null), chain (a bool), timeout_s (positive
// seconds) and group (Python's, not looked at); the others keep their
// defaults. InvalidArgument "on_preempt: ..." (one line) for anything else:
// an unknown key or signal, SIGKILL or SIGSTOP, a value out of range.
Result<PreemptOptions> ParsePreemptOptions(std::string_view json);

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

// How a handled notice ended (_preempt.py Preempted).
struct PreemptOutcome {
  std::string reason;             // the notice's: "SIGTERM", "preempt()", "rank 3", ...
  int64_t step = 0;               // the emergency checkpoint's step
  bool committed = false;         // on every rank
  std::optional<int64_t> latest;  // the newest committed step
  double notice_to_safe_s = 0;    // from the notice until it was committed (or given up)
  double checkpoint_s = 0;        // the emergency checkpoint alone
  int exit_code = 75;
  std::string error;              // why it failed; empty: it did not
};

// The emergency checkpoint `counter` of `step`, waited for (WaitCommitted):
// whether it is this rank's newest committed checkpoint (not the agreed one),
// the engine's record of it (nullopt once it left EngineStats::recent), and
// the one-line error of an older checkpoint WaitCommitted returned while this
// one committed ("" when none). The error itself when it did not commit.
struct EmergencyOutcome {
  bool committed = false;
  std::optional<CheckpointStats> record;
  std::string older;
};
Result<EmergencyOutcome> AwaitEmergency(Engine& engine, uint64_t counter, int64_t step);

// The line printed on stderr before the exit.
std::string PreemptExitLine(const PreemptOutcome& o);
// str(Preempted): "preempted (SIGTERM): checkpoint of step 4 committed, ...".
std::string PreemptedMessage(const PreemptOutcome& o);

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
