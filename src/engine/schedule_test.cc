#include "engine/schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

namespace nonstop {
namespace {

TEST(ScheduleTest, EveryNIsDueAfterEachNthUpdate) {
  Schedule s = Schedule::Every(3).value();
  EXPECT_FALSE(s.is_auto());
  std::vector<int64_t> due;
  for (int64_t step = 0; step < 10; ++step) {
    if (s.DueAfter(step).value()) due.push_back(step);
  }
  EXPECT_EQ(due, (std::vector<int64_t>{2, 5, 8}));  // steps counted from 0
  Schedule one = Schedule::Every(1).value();
  for (int64_t step = 0; step < 5; ++step) EXPECT_TRUE(one.DueAfter(step).value());
}

TEST(ScheduleTest, RejectsBadSettings) {
  EXPECT_EQ(Schedule::Every(0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Schedule::Every(-2).status().code(), StatusCode::kInvalidArgument);
  for (AutoScheduleOptions o : {AutoScheduleOptions{.target = 0}, AutoScheduleOptions{.target = 1.5},
                                AutoScheduleOptions{.alpha = 0},
                                AutoScheduleOptions{.min_interval = 0},
                                AutoScheduleOptions{.min_interval = 5, .max_interval = 2}}) {
    EXPECT_EQ(Schedule::Auto(o).status().code(), StatusCode::kInvalidArgument);
  }
  // Auto decides from time, not from the step number.
  Schedule a = Schedule::Auto({}).value();
  EXPECT_TRUE(a.is_auto());
  EXPECT_EQ(a.DueAfter(9).status().code(), StatusCode::kFailedPrecondition);
}

// A training loop on a simulated clock: each step takes step_s; a checkpoint
// costs save_s in its start and wait_s in the next step (the copy not done).
struct Loop {
  Loop(Schedule* sched, double step) : s(sched), step_s(step) {}
  Schedule* s;
  double step_s;
  double now = 0, stall = 0, pending_wait = 0;
  int64_t steps = 0;
  std::vector<int64_t> ckpt_steps;

  double Run(int n, double wait_s, double save_s = 0.001, double persist_s = 0,
             double this_step_s = 0) {
    const double t0 = now, s0 = stall;
    for (int i = 0; i < n; ++i) {
      now += this_step_s > 0 ? this_step_s : step_s;
      now += pending_wait;
      stall += pending_wait;
      pending_wait = 0;
      ++steps;
      if (s->ObserveStep(stall, now)) {
        now += save_s;
        stall += save_s;
        s->Started(stall, now);
        if (persist_s > 0) s->ObservePersist(persist_s, 2);
        pending_wait = wait_s;
        ckpt_steps.push_back(steps);
      }
    }
    return (stall - s0) / (now - t0);
  }
  std::vector<int64_t> IntervalsAfter(int64_t step) const {
    std::vector<int64_t> v, out;
    for (int64_t c : ckpt_steps) {
      if (c > step) v.push_back(c);
    }
    for (size_t i = 1; i < v.size(); ++i) out.push_back(v[i] - v[i - 1]);
    return out;
  }
};

int64_t Median(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

TEST(ScheduleTest, AutoIntervalFollowsTheStallAndOverheadStaysNearTarget) {
  Schedule s = Schedule::Auto({.target = 0.03}).value();
  Loop loop{&s, 0.1};
  loop.Run(100, 0.030);  // settle: 31 ms per checkpoint / (3 % of 0.1 s) = 10.3 steps
  const double ovh1 = loop.Run(1000, 0.030);
  const int64_t f1 = Median(loop.IntervalsAfter(200));
  int64_t mark = loop.steps;
  loop.Run(200, 0.120);  // a slower medium: ~40 steps
  const double ovh2 = loop.Run(2000, 0.120);
  const int64_t f2 = Median(loop.IntervalsAfter(mark + 200));
  EXPECT_GE(f1, 9);
  EXPECT_LE(f1, 12);
  EXPECT_GE(f2, 36);
  EXPECT_LE(f2, 45);
  for (double o : {ovh1, ovh2}) {
    EXPECT_GE(o, 0.025);
    EXPECT_LE(o, 0.032);
  }
  EXPECT_NEAR(s.State().overhead, 0.03, 0.003);
}

TEST(ScheduleTest, AutoWaitsForTheMediumBeforeCheckpointsQueue) {
  // Tiny stall, but 2 s to persist with 2 in flight: 1 s = 10 steps of 0.1 s.
  Schedule s = Schedule::Auto({.target = 0.03}).value();
  Loop loop{&s, 0.1};
  loop.Run(500, 0.0, 0.001, 2.0);
  const std::vector<int64_t> iv = loop.IntervalsAfter(50);
  ASSERT_FALSE(iv.empty());
  EXPECT_GE(*std::min_element(iv.begin(), iv.end()), 10);
  EXPECT_EQ(s.State().interval, 10);
}

// The engine's recent list is read after each start and repeats the
// checkpoints it reported before: each committed counter counts once.
TEST(ScheduleTest, AutoObservesEachCommittedCheckpointOnce) {
  Schedule s = Schedule::Auto({.target = 0.03, .alpha = 0.5}).value();
  s.ObserveCommitted(1, 2.0, 2);
  ASSERT_TRUE(s.State().persist_s.has_value());
  EXPECT_DOUBLE_EQ(*s.State().persist_s, 2.0);
  s.ObserveCommitted(1, 8.0, 2);  // seen already
  s.ObserveCommitted(0, 8.0, 2);  // older
  EXPECT_DOUBLE_EQ(*s.State().persist_s, 2.0);
  s.ObserveCommitted(3, 4.0, 2);
  EXPECT_DOUBLE_EQ(*s.State().persist_s, 3.0);  // EWMA, alpha 0.5
  s.ObserveCommitted(2, 8.0, 2);  // below the newest seen
  EXPECT_DOUBLE_EQ(*s.State().persist_s, 3.0);
}

TEST(ScheduleTest, AutoWarmupAndBounds) {
  Schedule s =
      Schedule::Auto({.target = 0.5, .warmup = 3, .min_interval = 2, .max_interval = 5}).value();
  Loop loop{&s, 0.1};
  loop.Run(4, 0.0);
  EXPECT_EQ(loop.ckpt_steps, (std::vector<int64_t>{4}));  // after 3 warm-up steps
  loop.Run(60, 0.0, 0.0);
  for (int64_t f : loop.IntervalsAfter(0)) EXPECT_EQ(f, 2);  // free: as often as allowed
  loop.Run(60, 10.0);  // hugely expensive: capped at max_interval
  const std::vector<int64_t> iv = loop.IntervalsAfter(70);
  EXPECT_EQ(*std::max_element(iv.begin(), iv.end()), 5);
  EXPECT_EQ(s.State().last_interval, 5);
}

}  // namespace
}  // namespace nonstop
