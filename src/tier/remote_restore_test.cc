// The restore plan of a rank with a remote tier (tier/remote_restore.h) over
// a real job directory (POSIX Env): the remote's newer checkpoint comes
// first, a local newest the remote also holds is verified and, damaged,
// gives way to its remote copy (not to an older local one); the lineage
// refuses an abandoned future the remote still holds; a failed remote copy
// is excluded; and the ranks agree on rank 0's order of the steps all hold.
#include "tier/remote_restore.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <string>
#include <vector>

#include "nonstop/jobdir.h"
#include "nonstop/store.h"
#include "store_test_util.h"
#include "tier/memory_transport.h"
#include "tier/remote_tier.h"

namespace nonstop::tier {
namespace {

namespace fs = std::filesystem;

class RemoteRestoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("nonstop-remote-restore-" + std::to_string(getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    auto jd = JobDir::OpenForWrite(root_.string(), 0, 1);
    ASSERT_TRUE(jd.ok()) << jd.status().ToString();
    jd_ = std::move(jd).value();
    auto m = jd_->CreateTempSlot(MediumKind::kBuffered);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    StoreGeometry g;
    g.slots = 4;
    g.slot_bytes = testing::kTestSlotBytes;
    auto sf = SlotFile::Create(std::move(m).value(), g);
    ASSERT_TRUE(sf.ok()) << sf.status().ToString();
    ASSERT_TRUE(jd_->PublishTempSlot().ok());
    sf_ = std::move(sf).value();
  }
  void TearDown() override {
    sf_.reset();
    jd_.reset();
    fs::remove_all(root_);
  }

  CheckpointInfo Commit(uint64_t counter, int64_t step) {
    auto c = testing::MakeCheckpoint(step);
    const auto slot = static_cast<uint32_t>(counter % sf_->geometry().slots);
    EXPECT_TRUE(sf_->WriteData(slot, 0, c.data.data(), c.data.size()).ok());
    auto info = sf_->Commit(testing::MakeCommitRequest(c, slot, counter));
    EXPECT_TRUE(info.ok()) << info.status().ToString();
    return info.value();
  }
  // A directory "staged" holding a 5000-byte file "part" to publish.
  std::string StagePart(Env* env) {
    const std::string staged = (root_ / "staged").string();
    auto d = env->OpenDirectory(staged, true).value();
    auto m = d->CreateFile("part", MediumKind::kBuffered, MediumOptions{}).value();
    const std::string bytes(5000, 'x');
    EXPECT_TRUE(m->Write(0, bytes.data(), bytes.size()).ok());
    EXPECT_TRUE(m->Sync().ok());
    return staged;
  }
  void Damage(const CheckpointInfo& info) {
    std::vector<uint8_t> junk(4096, 0xA5);
    ASSERT_TRUE(sf_->medium().Write(info.data_offset, junk.data(), junk.size()).ok());
    ASSERT_TRUE(sf_->medium().Sync().ok());
  }

  RestorePlan Plan(std::optional<std::vector<std::pair<int64_t, uint64_t>>> remote,
                   std::optional<int64_t> step = std::nullopt,
                   std::vector<uint64_t> exclude = {}) {
    RestorePlanRequest r;
    r.job_dir = root_.string();
    r.step = step;
    r.remote = std::move(remote);
    r.remote_where = "s3://b/job";
    r.exclude = std::move(exclude);
    auto p = PlanRemoteRestore(DefaultEnv(), r);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return p.ok() ? p.value() : RestorePlan{};
  }

  fs::path root_;
  std::unique_ptr<JobDir> jd_;
  std::unique_ptr<SlotFile> sf_;
};

// "step:source" of each entry, for one-line comparisons.
std::vector<std::string> Names(const std::vector<RestoreSource>& order) {
  std::vector<std::string> out;
  for (const RestoreSource& s : order) {
    out.push_back(std::to_string(s.step) + (s.remote ? ":remote" : ":local"));
  }
  return out;
}
using V = std::vector<std::string>;

TEST_F(RemoteRestoreTest, TheNewestCheckpointWinsWhicheverTierHoldsIt) {
  Commit(1, 10);
  Commit(2, 20);
  RestorePlan p = Plan(std::vector<std::pair<int64_t, uint64_t>>{{30, 3}, {20, 2}});
  EXPECT_EQ(Names(p.order), (V{"30:remote", "20:local", "10:local"}));
  EXPECT_EQ(p.order[0].counter, 3u);
  EXPECT_EQ(p.local_newest, 20);
  // the remote's copy failed while read: the next one
  EXPECT_EQ(Names(Plan(std::vector<std::pair<int64_t, uint64_t>>{{30, 3}, {20, 2}}, std::nullopt,
                       {3})
                      .order),
            (V{"20:local", "10:local"}));
  // not listed (the store is down): the local plan
  p = Plan(std::nullopt);
  EXPECT_EQ(Names(p.order), (V{"20:local", "10:local"}));
  // a step asked for that only the remote holds
  p = Plan(std::vector<std::pair<int64_t, uint64_t>>{{30, 3}}, 30);
  EXPECT_FALSE(p.local_has_step);
  EXPECT_EQ(Names(p.order), (V{"30:remote"}));
  EXPECT_TRUE(Plan(std::nullopt, 10).local_has_step);
}

TEST_F(RemoteRestoreTest, ADamagedLocalNewestGivesWayToItsRemoteCopyNotToAnOlderLocalOne) {
  Commit(1, 10);
  Commit(2, 20);
  const CheckpointInfo newest = Commit(3, 30);
  const std::vector<std::pair<int64_t, uint64_t>> remote{{30, 3}};
  EXPECT_EQ(Names(Plan(remote).order), (V{"30:local", "20:local", "10:local"}));  // it verifies
  Damage(newest);
  EXPECT_EQ(Names(Plan(remote).order), (V{"30:remote", "20:local", "10:local"}));
  // without the remote's copy the local path reads (and falls back) itself
  EXPECT_EQ(Names(Plan(std::vector<std::pair<int64_t, uint64_t>>{}).order),
            (V{"30:local", "20:local", "10:local"}));
}

TEST_F(RemoteRestoreTest, TheLineageRefusesAnAbandonedFutureTheRemoteStillHolds) {
  Commit(1, 10);
  Commit(2, 20);
  Commit(3, 30);
  ASSERT_TRUE(jd_->RecordRestore(0, 1).ok());  // restore(step=10): 20 and 30 abandoned
  RestorePlan p = Plan(std::vector<std::pair<int64_t, uint64_t>>{{30, 3}, {20, 2}});
  EXPECT_EQ(Names(p.order), (V{"10:local"}));
  EXPECT_EQ(p.local_newest, 10);
  // the new checkpoint after the rollback, uploaded: it wins
  p = Plan(std::vector<std::pair<int64_t, uint64_t>>{{30, 3}, {20, 4}});
  EXPECT_EQ(Names(p.order), (V{"20:remote", "10:local"}));
}

TEST_F(RemoteRestoreTest, NoJobDirectoryPlansTheRemoteByCounter) {
  RestorePlanRequest r;
  r.remote = std::vector<std::pair<int64_t, uint64_t>>{{30, 3}, {20, 5}, {10, 1}};
  auto p = PlanRemoteRestore(DefaultEnv(), r);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(Names(p.value().order), (V{"20:remote", "30:remote", "10:remote"}));
  EXPECT_FALSE(p.value().local_newest.has_value());
  // a local copy handed in (the memory tier: a partner's replica) is local
  PlanCandidate peer;
  peer.tier = nonstop::Tier::kMemory;
  peer.step = 20;
  peer.counter = 5;
  r.extra_local.push_back(peer);
  p = PlanRemoteRestore(DefaultEnv(), r);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(Names(p.value().order), (V{"20:local", "30:remote", "10:remote"}));
  EXPECT_EQ(p.value().local_newest, 20);
}

TEST(CommonRestoreStepsTest, RankZerosOrderOfTheStepsEveryRankHolds) {
  const std::vector<RestoreSource> r0{{30, 3, true}, {20, 2, false}, {10, 1, false}};
  const std::vector<RestoreSource> r1{{20, 2, false}, {10, 1, false}};
  const std::vector<RestoreSource> r2{{30, 3, true}, {20, 2, true}, {10, 1, false}};
  auto got = CommonRestoreSteps({r0, r1});
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].step, 20);
  EXPECT_TRUE(got[0].all_local);
  got = CommonRestoreSteps({r0, r2});
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].step, 30);
  EXPECT_FALSE(got[0].all_local);
  EXPECT_EQ(got[1].step, 20);
  EXPECT_FALSE(got[1].all_local);  // rank 2 reads it from the remote
  EXPECT_TRUE(got[2].all_local);
  EXPECT_TRUE(CommonRestoreSteps({}).empty());
  EXPECT_TRUE(CommonRestoreSteps({r0, {}}).empty());
}

// The restore loop (RestoreFromRemote) over an in-memory remote holding two
// published checkpoints: a remote copy that fails to read is a warning and
// the next older one is read; every one failing with nothing local is the
// "verifies" error; a step held locally is read locally without listing; a
// remote that cannot be listed is a warning with a local step and an error
// without one (its advice by whether waiting helps); load without a step is
// NotFound.
TEST_F(RemoteRestoreTest, TheRestoreLoopFallsBackWarnsAndSaysWhyNothingVerifies) {
  Env* env = DefaultEnv();
  MemoryTransport store(env);
  RemoteTier tier(&store, env);
  const std::string staged = StagePart(env);
  for (auto [step, counter] : {std::pair<int64_t, uint64_t>{3, 6}, {5, 10}}) {
    auto rep = tier.Publish({step, counter, 0, 0, 1, staged, "part"}, {});
    ASSERT_TRUE(rep.ok() && rep.value().outcome == PublishReport::Outcome::kCommitted);
  }
  const std::string fetch = (root_ / "fetch").string();
  std::vector<int64_t> read;
  auto reader = [&](std::set<int64_t> bad) {
    return [&read, bad](int64_t step, const std::string& dir) {
      read.push_back(step);
      EXPECT_NE(dir.find("step-"), std::string::npos);
      return bad.count(step) ? Status::Corruption("bad " + std::to_string(step)) : Status::OK();
    };
  };
  RemoteRestoreRequest req;
  req.fetch_dir = fetch;
  RemoteRestoreResult out;
  ASSERT_TRUE(RestoreFromRemote(env, &tier, req, reader({5}), &out).ok());
  ASSERT_TRUE(out.read.has_value());
  EXPECT_EQ(out.read->step, 3);
  EXPECT_EQ(read, (std::vector<int64_t>{5, 3}));
  EXPECT_EQ(out.warnings, (std::vector<std::string>{"remote step 5: bad 5; falling back"}));

  out = {};
  Status s = RestoreFromRemote(env, &tier, req, reader({3, 5}), &out);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_EQ(s.message(), "no remote checkpoint in mem://bucket/job verifies: bad 5");
  EXPECT_EQ(out.warnings.size(), 2u);

  // the local newest (counter 12) comes first: the local path reads it
  Commit(12, 7);
  req.plan.job_dir = root_.string();
  out = {};
  read.clear();
  ASSERT_TRUE(RestoreFromRemote(env, &tier, req, reader({}), &out).ok());
  EXPECT_FALSE(out.read.has_value());
  EXPECT_TRUE(read.empty());
  // a step held locally is not even listed; a remote-only step is read
  store.fail_list_from = 0;
  req.plan.step = 7;
  out = {};
  ASSERT_TRUE(RestoreFromRemote(env, &tier, req, reader({}), &out).ok());
  EXPECT_FALSE(out.read.has_value());
  EXPECT_TRUE(out.warnings.empty());
  // unlisted: a warning with a local step to resume, an error without one
  req.plan.step.reset();
  out = {};
  ASSERT_TRUE(RestoreFromRemote(env, &tier, req, reader({}), &out).ok());
  ASSERT_EQ(out.warnings.size(), 1u);
  EXPECT_NE(out.warnings[0].find("cannot be listed"), std::string::npos);
  EXPECT_NE(out.warnings[0].find("restoring the newest local checkpoint (step 7)"),
            std::string::npos);
  req.plan.job_dir = "";
  s = RestoreFromRemote(env, &tier, req, reader({}), &out);
  EXPECT_EQ(s.code(), StatusCode::kIOError);
  EXPECT_NE(s.message().find("restore() again once the store is reachable"), std::string::npos);
  req.waiting_helps = [](const Status&) { return false; };
  s = RestoreFromRemote(env, &tier, req, reader({}), &out);
  EXPECT_NE(s.message().find("fix the remote"), std::string::npos);
  // load: nothing committed at a step is NotFound
  store.fail_list_from = -1;
  req.load = true;
  req.plan.step = 4;
  s = RestoreFromRemote(env, &tier, req, reader({}), &out);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "no committed remote checkpoint at step 4 in mem://bucket/job");
}

// The distributed loop's moves (NextDistRemoteStep): rank 0's order of the
// steps every rank holds; a step that failed on a rank is a warning and the
// next one is tried; all failed with nothing local is the error; a step
// every rank holds locally is left to the local path.
TEST(NextDistRemoteStepTest, TriesRankZerosOrderWarnsAndFails) {
  const std::vector<std::vector<RestoreSource>> plans = {
      {{9, 9, true}, {5, 5, true}}, {{5, 5, true}, {9, 9, true}}};
  std::string warning;
  auto next = NextDistRemoteStep("s3://b/p", plans, {}, &warning);
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next.value(), std::optional<int64_t>(9));
  EXPECT_TRUE(warning.empty());
  std::vector<DistTried> tried = {{9, {"", "part missing"}}};
  next = NextDistRemoteStep("s3://b/p", plans, tried, &warning);
  EXPECT_EQ(next.value(), std::optional<int64_t>(5));
  EXPECT_EQ(warning, "remote step 9 fails on rank 1: part missing; falling back");
  tried.push_back({5, {"bad", ""}});
  next = NextDistRemoteStep("s3://b/p", plans, tried, &warning);
  EXPECT_EQ(next.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(next.status().message(),
            "no remote checkpoint in s3://b/p verifies on every rank: rank 1: part missing");
  auto with_local = plans;
  with_local[1].push_back({2, 2, false});
  next = NextDistRemoteStep("s3://b/p", with_local, tried, nullptr);
  EXPECT_EQ(next.value(), std::nullopt);
  EXPECT_EQ(NextDistRemoteStep("u", {{{4, 4, false}}, {{4, 4, false}}}, {}, nullptr).value(),
            std::nullopt);
}

// Two ranks' gather in one process (the Comm's, in python): each call
// returns both ranks' texts of that round once both gave theirs.
class TwoRankGather {
 public:
  Gather For(uint32_t rank) {
    return [this, rank](const std::string& mine) -> Result<std::vector<std::string>> {
      std::unique_lock<std::mutex> l(mu_);
      const int round = rounds_[rank]++;
      texts_[round][rank] = mine;
      ++got_[round];
      cv_.notify_all();
      if (!cv_.wait_for(l, std::chrono::seconds(30), [&] { return got_[round] == 2; })) {
        return Status::Unavailable("the other rank never gathered");
      }
      return std::vector<std::string>(texts_[round].begin(), texts_[round].end());
    };
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::array<int, 2> rounds_{0, 0};
  std::map<int, std::array<std::string, 2>> texts_;
  std::map<int, int> got_;
};

// The distributed loop (RestoreFromRemoteDist) on two ranks: rank 0's
// listing reaches rank 1; a step whose part fails on one rank is a warning
// on both and both fall back to the same older step; a remote that cannot
// be listed with nothing local is the error on every rank; steps of
// another world size are left to resharding (the local path).
TEST_F(RemoteRestoreTest, TheRanksAgreeFallBackTogetherAndFailTogether) {
  Env* env = DefaultEnv();
  MemoryTransport store(env);
  const std::string staged = StagePart(env);
  {
    RemoteTier tier(&store, env);
    for (auto [step, counter] : {std::pair<int64_t, uint64_t>{3, 6}, {5, 10}}) {
      ASSERT_TRUE(tier.Publish({step, counter, 0, 1, 2, staged, "part"}, {}).ok());
      auto rep = tier.Publish({step, counter, 0, 0, 2, staged, "part"}, {});
      ASSERT_TRUE(rep.ok() && rep.value().outcome == PublishReport::Outcome::kCommitted);
    }
  }
  struct Rank {
    Status status;
    RemoteRestoreResult out;
    std::vector<int64_t> read;
  };
  auto run = [&](std::optional<uint32_t> world, std::set<int64_t> bad_on_1) {
    TwoRankGather g;
    std::array<Rank, 2> ranks;
    auto one = [&](uint32_t rank) {
      RemoteTier tier(&store, env);
      RemoteRestoreRequest req;
      req.plan.rank = rank;
      req.fetch_dir = (root_ / ("fetch-" + std::to_string(rank))).string();
      req.world = world;
      Rank& r = ranks[rank];
      r.status = RestoreFromRemoteDist(
          env, &tier, req, g.For(rank),
          [&](int64_t step, const std::string&) {
            r.read.push_back(step);
            return rank == 1 && bad_on_1.count(step) ? Status::Corruption("bad part")
                                                     : Status::OK();
          },
          &r.out);
    };
    std::thread t1(one, 1);
    one(0);
    t1.join();
    return ranks;
  };

  auto ranks = run(2, {5});
  for (const Rank& r : ranks) {
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    ASSERT_TRUE(r.out.read.has_value());
    EXPECT_EQ(r.out.read->step, 3);
    EXPECT_EQ(r.out.read->counter, 6u);
    EXPECT_EQ(r.read, (std::vector<int64_t>{5, 3}));
    EXPECT_EQ(r.out.warnings,
              (std::vector<std::string>{"remote step 5 fails on rank 1: bad part; falling back"}));
  }

  ranks = run(4, {});  // the remote's steps are of world 2: nothing to read for world 4
  for (const Rank& r : ranks) {
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_FALSE(r.out.read.has_value());
    EXPECT_TRUE(r.read.empty());
  }

  ranks = run(2, {3, 5});
  for (const Rank& r : ranks) {
    EXPECT_EQ(r.status.code(), StatusCode::kCorruption);
    EXPECT_EQ(r.status.message(),
              "no remote checkpoint in mem://bucket/job verifies on every rank: rank 1: bad part");
  }

  store.fail_list_from = 0;
  ranks = run(2, {});
  for (const Rank& r : ranks) {
    EXPECT_EQ(r.status.code(), StatusCode::kIOError) << r.status.ToString();
    EXPECT_NE(r.status.message().find("cannot be listed"), std::string::npos);
    EXPECT_TRUE(r.read.empty());
  }
}

}  // namespace
}  // namespace nonstop::tier
