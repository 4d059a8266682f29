#include "engine/schedule.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace nonstop {

Result<Schedule> Schedule::Every(int64_t n) {
  if (n < 1) {
    return Status::InvalidArgument("every must be a positive integer or \"auto\", got " +
                                   std::to_string(n));
  }
  Schedule s;
  s.every_ = n;
  return s;
}

Result<Schedule> Schedule::Auto(const AutoScheduleOptions& opts) {
  if (!(opts.target > 0 && opts.target < 1)) {
    return Status::InvalidArgument("the overhead target must be in (0, 1), got " +
                                   std::to_string(opts.target));
  }
  if (!(opts.alpha > 0 && opts.alpha <= 1)) {
    return Status::InvalidArgument("alpha must be in (0, 1], got " + std::to_string(opts.alpha));
  }
  if (opts.min_interval < 1 || opts.max_interval < opts.min_interval) {
    return Status::InvalidArgument("need 1 <= min_interval <= max_interval");
  }
  Schedule s;
  s.opts_ = opts;
  return s;
}

Result<bool> Schedule::DueAfter(int64_t step) const {
  if (is_auto()) {
    return Status::FailedPrecondition("every=\"auto\" decides per step as time passes "
                                      "(ObserveStep), not from the step number");
  }
  return (step + 1) % every_ == 0;
}

double Schedule::Ewma(double old_v, double new_v) const {
  return (1 - opts_.alpha) * old_v + opts_.alpha * new_v;
}

// One checkpoint's worth: a stretch with no checkpoint allowed (the bounds)
// does not turn into a burst of them afterwards.
double Schedule::BudgetCap() const {
  return ckpt_stall_s_.value_or(0.0) + opts_.target * step_s_.value_or(0.0);
}

// Steps until the checkpoints in flight can have been persisted (T_w / N).
int64_t Schedule::NoQueueSteps() const {
  if (!persist_s_ || !step_s_ || *step_s_ == 0) return 1;
  return static_cast<int64_t>(std::ceil(*persist_s_ / (max_in_flight_ * *step_s_) - 1e-9));
}

bool Schedule::Due() const {
  if (checkpoints_ == 0) return steps_ > opts_.warmup;
  if (since_ckpt_ < std::max(opts_.min_interval, NoQueueSteps())) return false;
  if (since_ckpt_ >= opts_.max_interval) return true;
  // Pay-as-you-go: the stall already seen has been earned back.
  return budget_s_ >= 0.0;
}

// Wall time and stall since the previous call; charges the budget.
void Schedule::Account(double stall_total_s, double now_s, double* dt_out) {
  const double dt = last_time_ ? std::max(0.0, now_s - *last_time_) : 0.0;
  const double ds = last_stall_ ? std::max(0.0, stall_total_s - *last_stall_) : 0.0;
  last_time_ = now_s;
  last_stall_ = stall_total_s;
  if (checkpoints_ > 0) {
    wall_s_ += dt;
    stall_s_ += ds;
    window_stall_ += ds;
    budget_s_ = std::min(budget_s_ + opts_.target * dt - ds, BudgetCap());
  }
  if (dt_out != nullptr) *dt_out = dt;
}

bool Schedule::ObserveStep(double stall_total_s, double now_s) {
  double dt = 0;
  Account(stall_total_s, now_s, &dt);
  if (dt > 0) step_s_ = step_s_ ? Ewma(*step_s_, dt) : dt;
  ++steps_;
  ++since_ckpt_;
  return Due();
}

void Schedule::Started(double stall_total_s, double now_s) {
  const bool first = checkpoints_ == 0;
  if (!first) {
    // The previous checkpoint's window closes: what the training thread
    // waited for since it started is its stall. The first window holds
    // one-time costs (registering the tensors) and is not averaged.
    if (checkpoints_ > 1) {
      ckpt_stall_s_ = ckpt_stall_s_ ? Ewma(*ckpt_stall_s_, window_stall_) : window_stall_;
    }
    last_interval_ = since_ckpt_;
  }
  window_stall_ = 0;
  ++checkpoints_;
  if (first) last_stall_.reset();  // stall before the first checkpoint is not counted
  Account(stall_total_s, now_s, nullptr);
  since_ckpt_ = 0;
}

void Schedule::ObservePersist(double persist_s, int max_in_flight) {
  if (persist_s > 0) persist_s_ = persist_s_ ? Ewma(*persist_s_, persist_s) : persist_s;
  max_in_flight_ = std::max(1, max_in_flight);
}

void Schedule::ObserveCommitted(uint64_t counter, double persist_s, int max_in_flight) {
  if (counter <= seen_counter_) return;
  seen_counter_ = counter;
  ObservePersist(persist_s, max_in_flight);
}

AutoScheduleState Schedule::State() const {
  AutoScheduleState s;
  s.target = opts_.target;
  if (!step_s_ || *step_s_ == 0 || !ckpt_stall_s_) {
    s.interval = last_interval_.value_or(opts_.min_interval);
  } else {
    int64_t f = static_cast<int64_t>(std::ceil(*ckpt_stall_s_ / (opts_.target * *step_s_) - 1e-9));
    f = std::max(f, NoQueueSteps());
    s.interval = std::min(opts_.max_interval, std::max(opts_.min_interval, f));
  }
  s.overhead = wall_s_ > 0 ? stall_s_ / wall_s_ : 0.0;
  s.step_s = step_s_;
  s.ckpt_stall_s = ckpt_stall_s_;
  s.persist_s = persist_s_;
  s.budget_s = budget_s_;
  s.checkpoints = checkpoints_;
  s.steps = steps_;
  s.last_interval = last_interval_;
  return s;
}

}  // namespace nonstop
