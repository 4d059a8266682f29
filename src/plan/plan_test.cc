// The recovery planner on data alone: order, lineage, steps, verification
// and the reasons of every newer candidate it passes over; the distributed
// agreement's rule (DecideAgreement).
#include "nonstop/plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace nonstop {
namespace {

PlanCandidate C(Tier t, uint64_t counter, int64_t step, size_t handle, bool committed = true) {
  PlanCandidate c;
  c.tier = t;
  c.where = std::string(TierName(t)) + "-" + std::to_string(handle);
  c.counter = counter;
  c.step = step;
  c.committed = committed;
  if (!committed) c.damage = "data chunk 0 crc mismatch";
  c.handle = handle;
  return c;
}

LineageRecord RolledBackTo(uint64_t restored, uint64_t lo, uint64_t hi) {
  LineageRecord l;
  l.abandoned = {{lo, hi}};
  l.restored_counter = restored;
  l.abandoned_through = hi;
  return l;
}

TEST(PlanTest, NewestFirstAndTheNearerTierAtOneCounter) {
  std::vector<PlanCandidate> c = {C(Tier::kRemote, 3, 30, 0), C(Tier::kDisk, 2, 20, 1),
                                  C(Tier::kDisk, 3, 30, 2), C(Tier::kMemory, 3, 30, 3)};
  Result<Plan> p = MakePlan(c, {}, {});
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->order, (std::vector<size_t>{3, 2, 0, 1}));
  EXPECT_TRUE(p->skipped.empty());
  EXPECT_FALSE(p->fallback);
  EXPECT_EQ(p->newest_counter, 3u);
}

TEST(PlanTest, AnAbandonedFutureIsNeverChosenOnAnyTier) {
  // Steps 9, 19, 29 (#1-#3), restore(step=9), a new 19 (#4): the old 19 and
  // 29 are abandoned on the disk and the remote alike.
  std::vector<PlanCandidate> c = {C(Tier::kDisk, 3, 29, 0), C(Tier::kRemote, 2, 19, 1),
                                  C(Tier::kDisk, 4, 19, 2), C(Tier::kDisk, 1, 9, 3)};
  const LineageRecord l = RolledBackTo(1, 2, 3);
  Result<Plan> p = MakePlan(c, l, {});
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->order, (std::vector<size_t>{2, 3}));
  PlanRequest at29;
  at29.step = 29;
  p = MakePlan(c, l, at29);
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p->order.empty());
  ASSERT_EQ(p->skipped.size(), 2u);
  EXPECT_NE(p->skipped[0].find("abandoned (a restore of #1"), std::string::npos) << p->skipped[0];
  EXPECT_EQ(Classify(c[0], l).state, CandidateState::State::kAbandoned);
  EXPECT_EQ(Classify(c[2], l).state, CandidateState::State::kCommitted);
}

TEST(PlanTest, ADamagedNewestFallsBackToTheSameStepOnAnotherTierWithAReason) {
  // Local step 19 damaged, its remote copy intact: the remote 19, not local 14.
  std::vector<PlanCandidate> c = {C(Tier::kDisk, 5, 19, 0), C(Tier::kRemote, 5, 19, 1),
                                  C(Tier::kDisk, 4, 14, 2)};
  int calls = 0;
  Result<Plan> p = MakePlan(c, {}, {}, [&](const PlanCandidate& x) {
    ++calls;
    return x.tier == Tier::kDisk && x.counter == 5
               ? Status::Corruption("data chunk 3 crc mismatch")
               : Status::OK();
  });
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(calls, 2);
  EXPECT_TRUE(p->verified);
  EXPECT_EQ(p->order, (std::vector<size_t>{1, 2}));
  ASSERT_EQ(p->skipped.size(), 1u);
  EXPECT_EQ(p->skipped[0], "disk-0: checkpoint #5 (step 19): data chunk 3 crc mismatch");
  EXPECT_TRUE(p->saw_damage);
  EXPECT_FALSE(p->fallback);  // the same checkpoint, another copy
}

TEST(PlanTest, DamagedRecordsNewerThanTheChoiceAreNamedOverwrittenOnesAreNot) {
  PlanCandidate over = C(Tier::kDisk, 6, 60, 0, false);
  over.overwritten = true;
  std::vector<PlanCandidate> c = {over, C(Tier::kDisk, 7, 70, 1, false), C(Tier::kDisk, 5, 50, 2)};
  Result<Plan> p = MakePlan(c, {}, {});
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->order, (std::vector<size_t>{2}));
  ASSERT_EQ(p->skipped.size(), 1u);
  EXPECT_NE(p->skipped[0].find("#7"), std::string::npos);
  EXPECT_EQ(Classify(over, {}).state, CandidateState::State::kOverwritten);
}

TEST(PlanTest, StepsExcludedCountersAndTheVerifiersErrors) {
  std::vector<PlanCandidate> c = {C(Tier::kDisk, 3, 30, 0), C(Tier::kDisk, 2, 20, 1),
                                  C(Tier::kDisk, 1, 10, 2)};
  PlanRequest r;
  r.max_step = 20;
  r.exclude = {2};
  Result<Plan> p = MakePlan(c, {}, r);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->order, (std::vector<size_t>{2}));
  ASSERT_EQ(p->skipped.size(), 1u);
  EXPECT_NE(p->skipped[0].find("failed while it was read"), std::string::npos);
  EXPECT_TRUE(p->fallback);
  // An I/O error is not damage: returned, never a fallback.
  p = MakePlan(c, {}, {}, [](const PlanCandidate&) { return Status::IOError("EIO"); });
  EXPECT_EQ(p.status().code(), StatusCode::kIOError);
  // Aborted: plan again.
  p = MakePlan(c, {}, {}, [](const PlanCandidate&) { return Status::Aborted("reused"); });
  EXPECT_EQ(p.status().code(), StatusCode::kAborted);
}

AgreeOffer O(int64_t candidate, int64_t committed, int64_t started) {
  AgreeOffer o;
  o.candidate = candidate;
  o.committed = committed;
  o.started = started;
  return o;
}

TEST(AgreeTest, PinsTheStepEveryRankHoldsAndWaitsWhileNoneHoldsOne) {
  AgreeDecision d = DecideAgreement({O(7, 9, 10), O(7, 7, 9), O(7, 8, 8)});
  EXPECT_EQ(d.kind, AgreeDecision::Kind::kPin);
  EXPECT_EQ(d.step, 7);
  d = DecideAgreement({O(-1, 5, 6), O(-1, -1, 6)});
  EXPECT_EQ(d.kind, AgreeDecision::Kind::kWait);
  EXPECT_EQ(DecideAgreement({}).kind, AgreeDecision::Kind::kWait);
}

TEST(AgreeTest, AimsAtTheNewestCandidateWhileEveryRankCanStillKeepIt) {
  // Rank 1 holds an older step, rank 2 nothing yet: neither committed 8.
  AgreeDecision d = DecideAgreement({O(8, 9, 10), O(6, 7, 9), O(-1, 5, 8)});
  EXPECT_EQ(d.kind, AgreeDecision::Kind::kAim);
  EXPECT_EQ(d.step, 8);
}

TEST(AgreeTest, AimsPastEveryStartedStepWhenARankWentPastTheNewestCandidate) {
  // Rank 1 committed 8 while it held 6 (8's slot went back): 8 can never be
  // agreed, and dropping 6 for "the next commit" leapfrogs. Aim past every
  // step any rank started, so that every rank keeps the same next one.
  AgreeDecision d = DecideAgreement({O(8, 9, 10), O(6, 8, 11), O(-1, 5, 8)});
  EXPECT_EQ(d.kind, AgreeDecision::Kind::kAim);
  EXPECT_EQ(d.step, 12);
  // A rank without a candidate that committed past it (it released it
  // before a pin): the same.
  d = DecideAgreement({O(8, 8, 9), O(-1, 8, 9)});
  EXPECT_EQ(d.kind, AgreeDecision::Kind::kAim);
  EXPECT_EQ(d.step, 10);
}

// Four ranks commit a checkpoint at every step, each in its own phase, and
// apply each round's decision at its own delay after the round's snapshot,
// so commits land between a round's snapshot and its decision (the race
// that made ranks drop a step their peers still held and then leapfrog).
// Each rank keeps a candidate as the engine does (the oldest commit at or
// above the aim; Engine::Aim). The ranks must agree again and again.
TEST(AgreeTest, RanksOutOfPhaseKeepAgreeingWhileCheckpointsComeFasterThanRounds) {
  struct Rank {
    int64_t phase, delay;
    int64_t candidate = -1, committed = -1, aim = INT64_MIN, next = 0;
  };
  std::vector<Rank> ranks = {{0, 1}, {3, 4}, {6, 2}, {9, 7}};
  const int64_t step_t = 10, round_t = 17;  // time units: a step, a round
  auto commit_until = [&](Rank& r, int64_t t) {
    while (r.phase + (r.next + 1) * step_t <= t) {  // step `next` commits at phase + (next+1)*10
      if (r.candidate < 0 && r.next >= r.aim) r.candidate = r.next;
      r.committed = r.next++;
    }
  };
  int pins = 0, rounds_since_pin = 0, worst = 0;
  for (int64_t t = round_t; t < 400 * round_t; t += round_t) {
    std::vector<AgreeOffer> offers;
    for (Rank& r : ranks) {
      commit_until(r, t);
      offers.push_back(O(r.candidate, r.committed, r.next));  // `next` is in flight
    }
    const AgreeDecision d = DecideAgreement(offers);
    for (Rank& r : ranks) {
      commit_until(r, t + r.delay);
      if (d.kind == AgreeDecision::Kind::kPin) {
        r.candidate = -1;
        r.aim = INT64_MIN;
      } else if (d.kind == AgreeDecision::Kind::kAim) {
        r.aim = d.step;
        if (r.candidate < d.step) r.candidate = -1;
      }
    }
    if (d.kind == AgreeDecision::Kind::kPin) {
      ++pins;
      rounds_since_pin = 0;
    } else {
      worst = std::max(worst, ++rounds_since_pin);
    }
  }
  EXPECT_GE(pins, 100);
  EXPECT_LE(worst, 4);
}

}  // namespace
}  // namespace nonstop
