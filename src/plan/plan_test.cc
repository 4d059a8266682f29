// The recovery planner on data alone: order, lineage, steps, verification
// and the reasons of every newer candidate it passes over.
#include "nonstop/plan.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace nonstop
