// Schedule: when a checkpoint is due. The one rule for every mode
// (concurrent, layer-wise, multistep) and both kinds of interval:
//
//   every=N       the checkpoint after the update of step s (counted from 0)
//                 is due when s + 1 is a multiple of N (DueAfter);
//   every="auto"  a stall budget with error feedback (docs/TUNE.md): each
//                 step earns target x its wall time and pays the stall it
//                 saw; a checkpoint is due once the budget is not negative,
//                 at least min_interval steps and T_w / N (the EWMA of the
//                 persist times over max_in_flight) after the previous one,
//                 at most max_interval steps after it, and only after
//                 `warmup` steps (ObserveStep, Started, ObservePersist).
//
// Not thread-safe: the training thread owns it. No clock inside: the caller
// passes the time and its running total of visible stall, so tests drive it
// with a simulated clock.
#pragma once

#include <cstdint>
#include <optional>

#include "nonstop/status.h"

namespace nonstop {

struct AutoScheduleOptions {
  double target = 0.03;  // the visible-stall fraction of wall time to keep, in (0, 1)
  double alpha = 0.3;    // EWMA weight of a new observation, in (0, 1]
  int64_t warmup = 2;    // steps before the first checkpoint
  int64_t min_interval = 1;
  int64_t max_interval = 100000;
};

// The every="auto" controller's state (Checkpointer.stats()["auto"]).
struct AutoScheduleState {
  double target = 0;
  int64_t interval = 0;  // the interval it converges to, within the bounds
  double overhead = 0;   // visible stall / wall time since the first checkpoint
  std::optional<double> step_s;        // EWMA of wall time per step
  std::optional<double> ckpt_stall_s;  // EWMA of visible stall per checkpoint
  std::optional<double> persist_s;     // EWMA of the persist time T_w
  double budget_s = 0;
  int64_t checkpoints = 0;
  int64_t steps = 0;
  std::optional<int64_t> last_interval;  // steps between the last two checkpoints
};

class Schedule {
 public:
  // every=N (N >= 1).
  static Result<Schedule> Every(int64_t n);
  // every="auto".
  static Result<Schedule> Auto(const AutoScheduleOptions& opts);

  bool is_auto() const { return every_ == 0; }
  int64_t every() const { return every_; }  // 0 for auto

  // every=N: whether the checkpoint after the update of `step` is due.
  // FailedPrecondition for auto (its decision depends on time: ObserveStep).
  Result<bool> DueAfter(int64_t step) const;

  // every="auto": once per training step, after it, with the running total
  // of visible stall and the time now (seconds, any origin). True when a
  // checkpoint should start now; if one is started, call Started.
  bool ObserveStep(double stall_total_s, double now_s);
  // Right after a checkpoint started, with the stall total that includes
  // its own start.
  void Started(double stall_total_s, double now_s);
  // One committed checkpoint's persist time (start to committed).
  void ObservePersist(double persist_s, int max_in_flight);
  // ObservePersist for a committed checkpoint the engine reports (its
  // stats' recent list, read after each start): each counter once, so those
  // at or below the newest one observed are skipped.
  void ObserveCommitted(uint64_t counter, double persist_s, int max_in_flight);
  AutoScheduleState State() const;

 private:
  Schedule() = default;
  double Ewma(double old_v, double new_v) const;
  double BudgetCap() const;
  int64_t NoQueueSteps() const;
  bool Due() const;
  void Account(double stall_total_s, double now_s, double* dt);

  int64_t every_ = 0;
  AutoScheduleOptions opts_;
  std::optional<double> last_time_, last_stall_;
  std::optional<double> step_s_, ckpt_stall_s_, persist_s_;
  int max_in_flight_ = 1;
  double budget_s_ = 0;  // earned minus paid, since the first checkpoint
  int64_t steps_ = 0, since_ckpt_ = 0, checkpoints_ = 0;
  double wall_s_ = 0, stall_s_ = 0;  // since the first checkpoint started
  double window_stall_ = 0;          // stall since the newest checkpoint started
  std::optional<int64_t> last_interval_;
  uint64_t seen_counter_ = 0;  // the newest committed checkpoint observed
};

}  // namespace nonstop
