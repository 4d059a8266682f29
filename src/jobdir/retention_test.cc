// Retention of kept copies (jobdir.h "Retention of kept copies"): the pure
// rules, the metrics read from a checkpoint's metadata (hostile bytes
// included), JobDir::Retain and DeleteKept on the fault-injecting Env, and a
// crash at every call of a deletion (each followed by a writer's open and a
// content check: a kept copy is whole or gone, never half there).
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "env/fault_env.h"
#include "jobdir/planned_steps.h"
#include "nonstop/jobdir.h"
#include "nonstop/store.h"
#include "plan/rank_threads.h"
#include "store_test_util.h"

namespace nonstop {
namespace {

using testing::kTestSlotBytes;
using testing::MakeCheckpoint;
using testing::MakeCommitRequest;

// ---------------------------------------------------------------- the rules

std::vector<KeptCopy> Copies(std::vector<std::pair<uint64_t, std::optional<double>>> v) {
  std::vector<KeptCopy> out;
  for (auto& [counter, metric] : v) out.push_back(KeptCopy{static_cast<int64_t>(counter) * 10, counter, metric});
  return out;
}

TEST(RetentionRules, MaxToKeepKeepsTheNewestCopies) {
  RetentionPolicy p;
  p.keep_every = 2;
  p.max_to_keep = 2;
  auto copies = Copies({{2, {}}, {4, {}}, {6, {}}, {8, {}}});
  EXPECT_EQ(RetentionVictims(copies, p, {}), (std::vector<int64_t>{20, 40}));
  p.max_to_keep = 0;  // no limit
  EXPECT_TRUE(RetentionVictims(copies, p, {}).empty());
  // Never one the caller says may not go.
  p.max_to_keep = 1;
  EXPECT_EQ(RetentionVictims(copies, p, {2}), (std::vector<int64_t>{40, 60}));
}

TEST(RetentionRules, BestKKeepsTheBestByTheMetricAndPeriodicOnesAlongside) {
  RetentionPolicy p;
  p.best_metric = "loss";
  p.best_k = 2;
  // counters 1..5 carry losses 0.5 0.2 0.9 0.2 0.7: best two (min) are 4 (newer tie) and 2.
  auto copies = Copies({{1, 0.5}, {2, 0.2}, {3, 0.9}, {4, 0.2}, {5, 0.7}});
  EXPECT_EQ(RetentionVictims(copies, p, {}), (std::vector<int64_t>{10, 30, 50}));
  p.best_higher = true;  // max: 3 and 5
  EXPECT_EQ(RetentionVictims(copies, p, {}), (std::vector<int64_t>{10, 20, 40}));
  // A periodic copy is held by max_to_keep whatever its metric; a copy
  // without the metric counts with the periodic ones.
  p.best_higher = false;
  p.keep_every = 5;
  p.max_to_keep = 1;
  copies.push_back(KeptCopy{0, 0, std::nullopt});  // an older run's copy, no metric
  EXPECT_EQ(RetentionVictims(copies, p, {}), (std::vector<int64_t>{0, 10, 30}));
}

TEST(RetentionRules, ACopyIsMadeWhenPeriodicOrAmongTheBest) {
  RetentionPolicy p;
  p.keep_every = 3;
  EXPECT_TRUE(WantsKeepCopy(6, std::nullopt, p, {}));
  EXPECT_FALSE(WantsKeepCopy(7, 0.1, p, {}));  // no best rule
  p.best_metric = "loss";
  p.best_k = 2;
  auto copies = Copies({{1, 0.5}, {2, 0.2}});
  EXPECT_TRUE(WantsKeepCopy(7, 0.4, p, copies));    // beats 0.5
  EXPECT_TRUE(WantsKeepCopy(7, 0.5, p, copies));    // a tie: the newer wins
  EXPECT_FALSE(WantsKeepCopy(7, 0.6, p, copies));
  EXPECT_FALSE(WantsKeepCopy(7, std::nullopt, p, copies));
  EXPECT_TRUE(WantsKeepCopy(7, 9.0, p, Copies({{1, 0.5}})));  // fewer than k so far
}

TEST(RetentionRules, MetricsAreTheTopLevelObjectOnlyAndHostileBytesGiveNone) {
  using M = std::vector<std::pair<std::string, double>>;
  EXPECT_EQ(CheckpointMetrics(R"({"state":{"metrics":{"loss":1}},"s":"a}\"","metrics":)"
                              R"({"loss":0.5,"acc":"x","n":3,"big":1e300}, "z":[1,{"m":2}]})"),
            (M{{"loss", 0.5}, {"n", 3.0}, {"big", 1e300}}));
  EXPECT_EQ(CheckpointMetric(R"({"metrics":{"loss":-2.5}})", "loss"), -2.5);
  EXPECT_FALSE(CheckpointMetric(R"({"metrics":{"loss":-2.5}})", "acc"));
  EXPECT_TRUE(CheckpointMetrics("").empty());
  EXPECT_TRUE(CheckpointMetrics("[1,2]").empty());
  EXPECT_TRUE(CheckpointMetrics(R"({"metrics":{"loss":)").empty());
  EXPECT_TRUE(CheckpointMetrics(R"({"metrics":[1]})").empty());
  EXPECT_TRUE(CheckpointMetrics(R"({"a":"unterminated)").empty());
  // 200,000 nested brackets before (and inside) the metrics: no recursion, no crash.
  const std::string deep(200000, '[');
  EXPECT_TRUE(CheckpointMetrics("{\"x\":" + deep).empty());
  EXPECT_TRUE(CheckpointMetrics("{\"metrics\":{\"a\":" + deep + "}}").empty());
}

// ---------------------------------------------------------------- on the fault Env

std::string Meta(int64_t step, double loss) {
  return "{\"step\":" + std::to_string(step) + ",\"metrics\":{\"loss\":" + std::to_string(loss) + "}}";
}

class RetentionEnvTest : public ::testing::Test {
 protected:
  void SetUp() override { env_ = FaultEnv::Create(); }

  std::unique_ptr<JobDir> Writer(int rank = 0, int world = 1) {
    auto jd = JobDir::OpenForWrite("/job", rank, world, env_.get());
    EXPECT_TRUE(jd.ok()) << jd.status().ToString();
    return jd.ok() ? std::move(jd).value() : nullptr;
  }

  std::unique_ptr<SlotFile> NewSlotFile(JobDir& jd, int world = 1) {
    auto m = jd.CreateTempSlot(MediumKind::kBuffered);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    StoreGeometry g;
    g.slots = 3;
    g.slot_bytes = kTestSlotBytes;
    g.rank = static_cast<uint32_t>(jd.rank());
    g.world_size = static_cast<uint32_t>(world);
    auto sf = SlotFile::Create(std::move(m).value(), g);
    EXPECT_TRUE(sf.ok()) << sf.status().ToString();
    EXPECT_TRUE(jd.PublishTempSlot().ok());
    return std::move(sf).value();
  }

  // Commits counter c (step 10c, loss `loss`) and applies the policy.
  CheckpointInfo CommitAndRetain(JobDir& jd, SlotFile& f, uint64_t c, double loss,
                                 const RetentionPolicy& p) {
    auto ck = MakeCheckpoint(static_cast<int64_t>(c) * 10);
    ck.meta_json = Meta(ck.step, loss);
    const uint32_t slot = static_cast<uint32_t>(c % f.geometry().slots);
    EXPECT_TRUE(f.WriteData(slot, 0, ck.data.data(), ck.data.size()).ok());
    auto info = f.Commit(MakeCommitRequest(ck, slot, c));
    EXPECT_TRUE(info.ok()) << info.status().ToString();
    Status s = jd.Retain(f, info.value(), p);
    EXPECT_TRUE(s.ok()) << s.ToString();
    return info.value();
  }

  std::vector<int64_t> KeptSteps(JobDir& jd, int rank = 0) {
    auto k = jd.KeptCopies(rank);
    EXPECT_TRUE(k.ok()) << k.status().ToString();
    std::vector<int64_t> out;
    for (const auto& c : k.value()) out.push_back(c.step);
    std::sort(out.begin(), out.end());
    return out;
  }

  std::shared_ptr<FaultEnv> env_;
};

TEST_F(RetentionEnvTest, MaxToKeepDeletesTheOldestCopiesAsNewOnesAreMade) {
  auto jd = Writer();
  auto f = NewSlotFile(*jd);
  RetentionPolicy p;
  p.keep_every = 2;
  p.max_to_keep = 2;
  for (uint64_t c = 1; c <= 9; ++c) CommitAndRetain(*jd, *f, c, 1.0, p);
  EXPECT_EQ(KeptSteps(*jd), (std::vector<int64_t>{60, 80}));
  EXPECT_EQ(env_->Dump().find(".deleting-"), std::string::npos) << env_->Dump();
}

TEST_F(RetentionEnvTest, BestKKeepsTheLowestLossesWithDataIntact) {
  auto jd = Writer();
  auto f = NewSlotFile(*jd);
  RetentionPolicy p;
  p.best_metric = "loss";
  p.best_k = 2;
  const double loss[] = {0, 0.9, 0.5, 0.8, 0.1, 0.7, 0.3, 0.6};
  for (uint64_t c = 1; c <= 7; ++c) CommitAndRetain(*jd, *f, c, loss[c], p);
  EXPECT_EQ(KeptSteps(*jd), (std::vector<int64_t>{40, 60}));  // losses 0.1 and 0.3
  auto reader = JobDir::OpenForRead("/job", env_.get());
  ASSERT_TRUE(reader.ok());
  SelectOptions so;
  so.step = 40;
  auto sel = reader.value()->Select(0, so);  // verifies every data chunk
  ASSERT_TRUE(sel.ok()) << sel.status().ToString();
  EXPECT_TRUE(sel.value().chosen->location.keep);
  EXPECT_EQ(CheckpointMetric(sel.value().chosen->info.meta_json, "loss"), 0.1);
  auto listed = reader.value()->List(0);
  ASSERT_TRUE(listed.ok());
  bool saw_metrics = false;
  for (const auto& l : listed.value()) {
    if (l.location.keep && l.step == 60) {
      saw_metrics = l.metrics.size() == 1 && l.metrics[0].first == "loss" && l.metrics[0].second == 0.3;
    }
  }
  EXPECT_TRUE(saw_metrics);
}

TEST_F(RetentionEnvTest, DeleteKeptSaysWhatIsThereAndNeverDeletesTheNewest) {
  auto jd = Writer();
  auto f = NewSlotFile(*jd);
  RetentionPolicy p;
  p.keep_every = 1;
  for (uint64_t c = 1; c <= 4; ++c) CommitAndRetain(*jd, *f, c, 1.0, p);
  Status s = jd->DeleteKept(25);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("kept steps: 10, 20, 30, 40"), std::string::npos) << s.ToString();
  EXPECT_EQ(s.message().find('\n'), std::string::npos);
  // Step 40 is also the ring's newest committed checkpoint: refused.
  s = jd->DeleteKept(40);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_TRUE(jd->DeleteKept(20).ok());
  EXPECT_EQ(KeptSteps(*jd), (std::vector<int64_t>{10, 30, 40}));
  // A reader cannot delete.
  auto reader = JobDir::OpenForRead("/job", env_.get());
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ(reader.value()->DeleteKept(10).code(), StatusCode::kFailedPrecondition);
  // Maintenance needs the lock: refused while the writer lives, then works.
  auto m = JobDir::OpenForMaintenance("/job", env_.get());
  EXPECT_EQ(m.status().code(), StatusCode::kFailedPrecondition);
  f.reset();
  jd.reset();
  m = JobDir::OpenForMaintenance("/job", env_.get());
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_TRUE(m.value()->DeleteKept(10).ok());
  EXPECT_EQ(KeptSteps(*m.value()), (std::vector<int64_t>{30, 40}));
}

TEST_F(RetentionEnvTest, TheCopyARestoreProtectsIsNeverDeleted) {
  auto jd = Writer();
  auto f = NewSlotFile(*jd);
  RetentionPolicy keep_all;
  keep_all.keep_every = 1;
  for (uint64_t c = 1; c <= 6; ++c) CommitAndRetain(*jd, *f, c, 1.0, keep_all);
  // Step 10 (#1) has left the 3-slot ring; restore it from keep/.
  ASSERT_TRUE(jd->RecordRestore(0, 1).ok());
  Status s = jd->DeleteKept(10);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("protects"), std::string::npos);
}

// World size 2 in one directory: each rank's Retain deletes its own file of
// a kept step only, and the step's directory goes with the last rank's file.
// A rank that has not deleted yet (killed in between) still holds its copy.
TEST_F(RetentionEnvTest, WithTwoRanksEachDeletesItsOwnFileAndTheLastTheDirectory) {
  auto jd0 = Writer(0, 2);
  auto jd1 = Writer(1, 2);
  ASSERT_TRUE(jd0 && jd1);
  auto f0 = NewSlotFile(*jd0, 2);
  auto f1 = NewSlotFile(*jd1, 2);
  RetentionPolicy p;
  p.keep_every = 1;
  p.max_to_keep = 2;
  for (uint64_t c = 1; c <= 3; ++c) {
    CommitAndRetain(*jd0, *f0, c, 1.0, p);
    CommitAndRetain(*jd1, *f1, c, 1.0, p);
  }
  EXPECT_EQ(KeptSteps(*jd0, 0), (std::vector<int64_t>{20, 30}));
  EXPECT_EQ(KeptSteps(*jd1, 1), (std::vector<int64_t>{20, 30}));
  EXPECT_EQ(env_->Dump().find("step-000000000010"), std::string::npos) << env_->Dump();
  // Rank 0 retains step 40 (deleting its file of step 20); rank 1 not yet.
  CommitAndRetain(*jd0, *f0, 4, 1.0, p);
  EXPECT_EQ(KeptSteps(*jd0, 0), (std::vector<int64_t>{30, 40}));
  EXPECT_EQ(KeptSteps(*jd1, 1), (std::vector<int64_t>{20, 30}));
  EXPECT_NE(env_->Dump().find("step-000000000020"), std::string::npos) << env_->Dump();
  // DeleteKeptShare (the next start's tidy-up): rank 1's file, then the directory.
  EXPECT_EQ(jd0->DeleteKeptShare(20).code(), StatusCode::kNotFound);
  ASSERT_TRUE(jd1->DeleteKeptShare(20).ok());
  EXPECT_EQ(KeptSteps(*jd1, 1), (std::vector<int64_t>{30}));
  EXPECT_EQ(env_->Dump().find("step-000000000020"), std::string::npos) << env_->Dump();
  // Never the newest committed checkpoint of the rank's ring.
  EXPECT_EQ(jd0->DeleteKeptShare(40).code(), StatusCode::kFailedPrecondition);
  // TidyKeptShares (the start's tidy-up with world size > 1): rank 0 holds 30
  // and 40, every rank keeps 30: 40 is not common but is rank 0's newest
  // committed checkpoint (it stays); a gone step is no error.
  auto tidy = TidyKeptShares(*jd0, 0, {30});
  ASSERT_TRUE(tidy.ok()) << tidy.status().ToString();
  EXPECT_TRUE(tidy.value().empty());
  CommitAndRetain(*jd0, *f0, 5, 1.0, p);  // rank 0 keeps 40 and 50, rank 1 30
  tidy = TidyKeptShares(*jd0, 0, {});
  ASSERT_TRUE(tidy.ok()) << tidy.status().ToString();
  EXPECT_EQ(tidy.value(), (std::vector<int64_t>{40}));  // 50 is the newest: it stays
  EXPECT_EQ(KeptSteps(*jd0, 0), (std::vector<int64_t>{50}));
  EXPECT_EQ(KeptSteps(*jd1, 1), (std::vector<int64_t>{30}));  // only its own files go
  // A reader cannot delete.
  auto reader = JobDir::OpenForRead("/job", env_.get());
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ(reader.value()->DeleteKeptShare(30).code(), StatusCode::kFailedPrecondition);
}

// TidyKeptTogether (Distributed.tidy_kept) on two ranks: rank 0 kept 30,
// 40 and 50, rank 1 10, 20 and 30 (killed before its deletions); only 30 is
// kept by both, so each deletes its own file of the others but its newest
// committed checkpoint. A rank that cannot open the directory fails both,
// one line, and nothing is deleted.
TEST_F(RetentionEnvTest, TidyKeptTogetherDeletesWhatNotEveryRankKeeps) {
  {
    auto jd0 = Writer(0, 2);
    auto jd1 = Writer(1, 2);
    ASSERT_TRUE(jd0 && jd1);
    auto f0 = NewSlotFile(*jd0, 2);
    auto f1 = NewSlotFile(*jd1, 2);
    RetentionPolicy p;
    p.keep_every = 1;
    p.max_to_keep = 3;
    for (uint64_t c = 1; c <= 5; ++c) {
      CommitAndRetain(*jd0, *f0, c, 1.0, p);
      if (c <= 3) CommitAndRetain(*jd1, *f1, c, 1.0, p);
    }
    EXPECT_EQ(KeptSteps(*jd0, 0), (std::vector<int64_t>{30, 40, 50}));
    EXPECT_EQ(KeptSteps(*jd1, 1), (std::vector<int64_t>{10, 20, 30}));
  }
  auto run = [&](const std::vector<std::string>& dirs) {
    std::vector<Result<std::vector<int64_t>>> got(2, Status::Internal("not run"));
    dist::RankThreads(2).Run([&](int r, const dist::Gather& g) {
      got[r] = TidyKeptTogether(dirs[r], r, 2, g, env_.get());
    });
    return got;
  };
  auto bad = run({"/job", "/job/rank-00000.nsck"});
  for (const auto& g : bad) {
    ASSERT_FALSE(g.ok());
    EXPECT_EQ(g.status().code(), StatusCode::kIOError);
    EXPECT_EQ(g.status().message(), bad[1].status().message());
  }
  auto got = run({"/job", "/job"});
  ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
  ASSERT_TRUE(got[1].ok()) << got[1].status().ToString();
  EXPECT_EQ(got[0].value(), (std::vector<int64_t>{40}));
  EXPECT_EQ(got[1].value(), (std::vector<int64_t>{10, 20}));
  auto jd = Writer(0, 2);
  EXPECT_EQ(KeptSteps(*jd, 0), (std::vector<int64_t>{30, 50}));
  EXPECT_EQ(KeptSteps(*jd, 1), (std::vector<int64_t>{30}));
  // A directory that does not exist keeps nothing: no error.
  got = run({"/none", "/none"});
  ASSERT_TRUE(got[0].ok() && got[1].ok());
  EXPECT_TRUE(got[0].value().empty());
}

// A crash (power cut) before each call of a deletion, in both modes, then a
// writer's open: the copy is whole (every chunk verifies) or gone, nothing
// named .deleting- is left, and the other copies are intact.
TEST(RetentionCrash, DeletionIsWholeOrNothingAtEveryCrashPoint) {
  auto setup = [](FaultEnv* env) {
    auto jd = JobDir::OpenForWrite("/job", 0, 1, env);
    EXPECT_TRUE(jd.ok());
    auto m = jd.value()->CreateTempSlot(MediumKind::kBuffered);
    StoreGeometry g;
    g.slots = 3;
    g.slot_bytes = kTestSlotBytes;
    auto f = SlotFile::Create(std::move(m).value(), g);
    EXPECT_TRUE(jd.value()->PublishTempSlot().ok());
    RetentionPolicy p;
    p.keep_every = 1;
    for (uint64_t c = 1; c <= 5; ++c) {  // the ring keeps #3..#5; step 20 (#2) is kept only
      auto ck = MakeCheckpoint(static_cast<int64_t>(c) * 10);
      const uint32_t slot = static_cast<uint32_t>(c % 3);
      EXPECT_TRUE(f.value()->WriteData(slot, 0, ck.data.data(), ck.data.size()).ok());
      auto info = f.value()->Commit(MakeCommitRequest(ck, slot, c));
      EXPECT_TRUE(jd.value()->Retain(*f.value(), info.value(), p).ok());
    }
    return std::move(jd).value();
  };
  // Count the calls of one deletion.
  uint64_t calls = 0;
  {
    auto env = FaultEnv::Create();
    auto jd = setup(env.get());
    const uint64_t before = env->calls();
    ASSERT_TRUE(jd->DeleteKept(20).ok());
    calls = env->calls() - before;
  }
  ASSERT_GT(calls, 4u);
  int whole = 0, gone = 0;
  for (uint64_t n = 1; n <= calls; ++n) {
    for (CrashMode mode : {CrashMode::kDropUnsynced, CrashMode::kTornUnsynced}) {
      auto env = FaultEnv::Create();
      auto jd = setup(env.get());
      env->CrashOnCall(n, mode, n * 7919);
      EXPECT_FALSE(jd->DeleteKept(20).ok()) << "call " << n;
      jd.reset();
      env->ClearFaults();
      auto again = JobDir::OpenForWrite("/job", 0, 1, env.get());
      ASSERT_TRUE(again.ok()) << "call " << n << ": " << again.status().ToString();
      const std::string dump = env->Dump();
      EXPECT_EQ(dump.find(".deleting-"), std::string::npos) << "call " << n << "\n" << dump;
      auto kept = again.value()->KeptCopies(0);
      ASSERT_TRUE(kept.ok());
      std::set<int64_t> steps;
      for (const auto& k : kept.value()) steps.insert(k.step);
      for (int64_t s : {10, 30, 40, 50}) EXPECT_TRUE(steps.count(s)) << "call " << n << " lost step " << s;
      for (int64_t s : {10, 20, 30, 40, 50}) {
        SelectOptions so;
        so.step = s;
        auto sel = again.value()->Select(0, so);
        if (s == 20 && !steps.count(20)) {
          EXPECT_FALSE(sel.ok()) << "call " << n;
          EXPECT_EQ(dump.find("step-000000000020"), std::string::npos) << "call " << n << "\n" << dump;
          ++gone;
          continue;
        }
        ASSERT_TRUE(sel.ok()) << "call " << n << " step " << s << ": " << sel.status().ToString();
        EXPECT_TRUE(testing::CheckContent(*sel.value().chosen->file, sel.value().chosen->info).ok());
        if (s == 20) ++whole;
      }
    }
  }
  EXPECT_GT(whole, 0);
  EXPECT_GT(gone, 0);
  std::printf("deletion crash points: %llu x 2 modes, copy whole: %d, gone: %d\n",
              static_cast<unsigned long long>(calls), whole, gone);
}

}  // namespace
}  // namespace nonstop
