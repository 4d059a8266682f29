// The common selection of a distributed job's rank files (JobDir::SelectCommon)
// and the reshard choice (JobDir::SelectReshard) on the POSIX Env: a step is
// common only when every rank holds a committed, verifying checkpoint of it
// from one run (CheckpointRunId); a rank file from another job, a damaged
// rank and rank files of mixed world sizes each give a fallback or a one-line
// error, never "nothing" (issue 14, defect 5).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/jobdir.h"
#include "jobdir/planned_steps.h"
#include "nonstop/store.h"
#include "store_test_util.h"

namespace nonstop {
namespace {

namespace fs = std::filesystem;
using testing::kTestSlotBytes;
using testing::MakeCheckpoint;

// One checkpoint a test writes: its counter, step and run id.
struct Ckpt {
  uint64_t counter;
  int64_t step;
  uint64_t run;
};

constexpr uint64_t kBadRun = ~uint64_t{0};  // MetaOf writes a string run id

std::string MetaOf(int64_t step, uint64_t run, int world) {
  if (run == kBadRun) {
    return "{\"step\":" + std::to_string(step) + ",\"dist\":{\"lineage\":\"x\"}}";
  }
  return "{\"format\":1,\"step\":" + std::to_string(step) +
         ",\"state\":{\"t\":{\"__tensor__\":\"t\"}},\"dist\":{\"world_size\":" +
         std::to_string(world) + ",\"shared\":{\"t\":[[4],\"float32\"]},\"lineage\":" +
         std::to_string(run) + ",\"local\":[]}}";
}

class CommonSelectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("nonstop-common-" + std::to_string(getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string Dir() const { return root_.string(); }

  // Writes the rank files of a job of `world` ranks in the job directory:
  // rank r commits ckpts[r], in order, under its own writer lock.
  // Returns every commit's info, by rank.
  std::vector<std::vector<CheckpointInfo>> WriteJob(int world,
                                                    const std::vector<std::vector<Ckpt>>& ckpts) {
    std::vector<std::vector<CheckpointInfo>> infos(world);
    for (int r = 0; r < world; ++r) {
      auto jd = JobDir::OpenForWrite(Dir(), r, world);
      EXPECT_TRUE(jd.ok()) << jd.status().ToString();
      auto m = jd.value()->CreateTempSlot(MediumKind::kBuffered);
      EXPECT_TRUE(m.ok()) << m.status().ToString();
      StoreGeometry g;
      g.slots = 4;
      g.slot_bytes = kTestSlotBytes;
      g.rank = static_cast<uint32_t>(r);
      g.world_size = static_cast<uint32_t>(world);
      auto f = SlotFile::Create(std::move(m).value(), g);
      EXPECT_TRUE(f.ok()) << f.status().ToString();
      EXPECT_TRUE(jd.value()->PublishTempSlot().ok());
      for (const Ckpt& c : ckpts[r]) {
        auto tc = MakeCheckpoint(c.step);
        tc.meta_json = MetaOf(c.step, c.run, world);
        const auto slot = static_cast<uint32_t>(c.counter % g.slots);
        EXPECT_TRUE(f.value()->WriteData(slot, 0, tc.data.data(), tc.data.size()).ok());
        auto info = f.value()->Commit(testing::MakeCommitRequest(tc, slot, c.counter));
        EXPECT_TRUE(info.ok()) << info.status().ToString();
        infos[r].push_back(info.value());
      }
    }
    return infos;
  }

  // A job of world size 1 opens the directory and sets the others' files aside.
  void SetAsideForOneProcess() {
    auto jd = JobDir::OpenForWrite(Dir(), 0, 1).value();
    ASSERT_TRUE(jd->SetAside(1).ok());
  }

  // Overwrites the first data bytes of checkpoint `info` of the file at `rel`.
  void Damage(const std::string& rel, const CheckpointInfo& info) {
    auto m = OpenMedium((root_ / rel).string(), MediumKind::kBuffered, {});
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    std::vector<uint8_t> junk(4096, 0xA5);
    ASSERT_TRUE(m.value()->Write(info.data_offset, junk.data(), junk.size()).ok());
    ASSERT_TRUE(m.value()->Sync().ok());
  }

  fs::path root_;
};

// What a rank offers a distributed restart (PlannedSteps): its steps in the
// planner's order, each once, a rolled-back future left out.
TEST_F(CommonSelectTest, PlannedStepsFollowThePlannerAndLeaveAbandonedOnesOut) {
  WriteJob(1, {{{1, 10, 7}, {2, 20, 7}, {3, 20, 7}, {4, 30, 7}}});
  {
    auto jd = JobDir::OpenForRead(Dir()).value();
    auto all = PlannedSteps(*jd, 0);
    ASSERT_TRUE(all.ok()) << all.status().ToString();
    EXPECT_EQ(all.value(), (std::vector<int64_t>{30, 20, 10}));
  }
  ASSERT_TRUE(JobDir::OpenForWrite(Dir(), 0, 1).value()->RecordRestore(0, 3).ok());
  auto jd = JobDir::OpenForRead(Dir()).value();
  EXPECT_EQ(PlannedSteps(*jd, 0).value(), (std::vector<int64_t>{20, 10}));
  EXPECT_TRUE(PlannedSteps(*jd, 0, 30).value().empty());
  EXPECT_EQ(PlannedSteps(*jd, 0, 10).value(), (std::vector<int64_t>{10}));
}

// Restoring with world size 1 beside set-aside files (ChooseSingleSource):
// the own file when it holds the step, else the reshard; with nothing of its
// own listed, the reshard alone.
TEST_F(CommonSelectTest, SingleSourcePrefersTheOwnFileThatHoldsTheStep) {
  WriteJob(1, {{{1, 10, 7}, {2, 20, 7}}});
  auto jd = JobDir::OpenForRead(Dir()).value();
  EXPECT_EQ(ChooseSingleSource(*jd, std::nullopt), SingleSource::kOwn);
  EXPECT_EQ(ChooseSingleSource(*jd, 10), SingleSource::kOwn);
  EXPECT_EQ(ChooseSingleSource(*jd, 30), SingleSource::kReshardElseOwn);
  fs::remove_all(root_);
  fs::create_directories(root_);
  auto empty = JobDir::OpenForWrite(Dir(), 0, 1).value();
  EXPECT_EQ(ChooseSingleSource(*empty, std::nullopt), SingleSource::kReshard);
}

// Ranks that hold the same steps from different runs (rank 1 was restarted
// from elsewhere and trained on): a step is common only within one run.
TEST_F(CommonSelectTest, AStepOfAnotherRunOnOneRankIsNotCommon) {
  WriteJob(2, {{{1, 1, 11}, {2, 2, 11}, {3, 3, 11}},
               {{1, 1, 11}, {2, 2, 11}, {3, 3, 22}}});
  auto jd = JobDir::OpenForRead(Dir()).value();
  auto cs = jd->SelectCommon(2);
  ASSERT_TRUE(cs.ok()) << cs.status().ToString();
  EXPECT_EQ(cs.value().step, 2);
  ASSERT_EQ(cs.value().ranks.size(), 2u);
  for (const auto& r : cs.value().ranks) EXPECT_EQ(r.info.step, 2);
  // Each rank's pick is of the same run (its metadata says so).
  EXPECT_EQ(CheckpointRunId(cs.value().ranks[0].info.meta_json),
            CheckpointRunId(cs.value().ranks[1].info.meta_json));
}

// Defect 5: an old rank file from another job is named, never mixed in.
TEST_F(CommonSelectTest, ARankFileOfAnotherJobIsRefusedNamingIt) {
  WriteJob(2, {{{1, 3, 11}, {2, 5, 11}}, {{1, 3, 22}, {2, 5, 22}}});
  auto jd = JobDir::OpenForRead(Dir()).value();
  auto cs = jd->SelectCommon(2);
  ASSERT_FALSE(cs.ok()) << "chose step " << cs.value().step << " mixing two jobs";
  EXPECT_EQ(cs.status().code(), StatusCode::kFailedPrecondition);
  const std::string& msg = cs.status().message();
  EXPECT_NE(msg.find("rank-00001.nsck is from another job"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

// A damaged newest checkpoint on one rank: every rank falls back to the
// newest older common step, and the skipped step names the rank and file.
TEST_F(CommonSelectTest, ADamagedRankMakesAllFallBackTogether) {
  auto infos = WriteJob(2, {{{1, 3, 11}, {2, 5, 11}, {3, 7, 11}},
                            {{1, 3, 11}, {2, 5, 11}, {3, 7, 11}}});
  Damage("rank-00001.nsck", infos[1][2]);
  auto jd = JobDir::OpenForRead(Dir()).value();
  auto cs = jd->SelectCommon(2);
  ASSERT_TRUE(cs.ok()) << cs.status().ToString();
  EXPECT_EQ(cs.value().step, 5);
  ASSERT_EQ(cs.value().skipped.size(), 1u);
  EXPECT_NE(cs.value().skipped[0].find("step 7"), std::string::npos) << cs.value().skipped[0];
  EXPECT_NE(cs.value().skipped[0].find("rank 1: rank-00001.nsck"), std::string::npos)
      << cs.value().skipped[0];
  // Every checkpoint of rank 1 damaged: one line, Corruption, never "nothing".
  Damage("rank-00001.nsck", infos[1][1]);
  Damage("rank-00001.nsck", infos[1][0]);
  cs = jd->SelectCommon(2);
  ASSERT_FALSE(cs.ok()) << "chose step " << cs.value().step;
  EXPECT_EQ(cs.status().code(), StatusCode::kCorruption);
  EXPECT_NE(cs.status().message().find("rank-00001.nsck"), std::string::npos)
      << cs.status().message();
  EXPECT_EQ(cs.status().message().find('\n'), std::string::npos);
}

// ---- The reshard choice (new API) ----

TEST(CheckpointRunIdTest, ReadsTheDistLineageOnly) {
  EXPECT_EQ(CheckpointRunId("{}"), 0u);
  EXPECT_EQ(CheckpointRunId("not json"), 0u);
  EXPECT_EQ(CheckpointRunId("{\"dist\":{\"world_size\":2}}"), 0u);
  EXPECT_EQ(CheckpointRunId("{\"dist\":{\"lineage\":null}}"), 0u);
  EXPECT_EQ(CheckpointRunId(MetaOf(3, 4611686018427387903u, 2)), 4611686018427387903u);
  // A "lineage" nested elsewhere is not the run id; spaces are allowed.
  EXPECT_EQ(CheckpointRunId("{\"state\":{\"dist\":{\"lineage\":5}},\"dist\":"
                            "{\"shared\":{\"a\":[1,{\"lineage\":9}]}, \"lineage\" :  77 }}"),
            77u);
  EXPECT_EQ(CheckpointRunId("{\"dist\":{\"lineage\":\"7\"}}"), std::nullopt);
  EXPECT_EQ(CheckpointRunId("{\"dist\":{\"lineage\":-1}}"), std::nullopt);
  EXPECT_EQ(CheckpointRunId("{\"dist\":{\"lineage\":1.5}}"), std::nullopt);
  EXPECT_EQ(CheckpointRunId("{\"dist\":{\"lineage\":18446744073709551616}}"), std::nullopt);
  // Hostile nesting is scanned without recursion.
  const std::string deep = "{\"x\":" + std::string(200000, '[') + std::string(200000, ']') +
                           ",\"dist\":{\"lineage\":3}}";
  EXPECT_EQ(CheckpointRunId(deep), 3u);
}

TEST_F(CommonSelectTest, SelectCommonReportsTheRunItChose) {
  WriteJob(2, {{{1, 1, 11}, {2, 2, 11}, {3, 3, 22}}, {{1, 1, 11}, {2, 2, 11}, {3, 3, 22}}});
  auto jd = JobDir::OpenForRead(Dir()).value();
  auto cs = jd->SelectCommon(2);
  ASSERT_TRUE(cs.ok()) << cs.status().ToString();
  EXPECT_EQ(cs.value().step, 3);
  EXPECT_EQ(cs.value().run_id, 22u);
  SelectOptions below;
  below.max_step = 2;
  cs = jd->SelectCommon(2, below);
  ASSERT_TRUE(cs.ok()) << cs.status().ToString();
  EXPECT_EQ(cs.value().step, 2);
  EXPECT_EQ(cs.value().run_id, 11u);
  SelectOptions at;
  at.step = 4;
  cs = jd->SelectCommon(2, at);
  EXPECT_EQ(cs.status().code(), StatusCode::kNotFound) << cs.status().ToString();
}

// A checkpoint whose run id is not an unsigned integer is never part of a
// common selection (and counts as damage).
TEST_F(CommonSelectTest, AMalformedRunIdIsNeverCommon) {
  WriteJob(2, {{{1, 1, 11}, {2, 2, 11}}, {{1, 1, 11}, {2, 2, kBadRun}}});
  auto jd = JobDir::OpenForRead(Dir()).value();
  auto cs = jd->SelectCommon(2);
  ASSERT_TRUE(cs.ok()) << cs.status().ToString();
  EXPECT_EQ(cs.value().step, 1);
}

TEST_F(CommonSelectTest, ReshardOfAForeignOrDamagedOldRank) {
  auto jd0 = JobDir::OpenForWrite(Dir(), 0, 1).value();
  EXPECT_FALSE(jd0->SelectReshard(1).value().has_value());  // nothing set aside: nothing to lose
  jd0.reset();
  auto infos = WriteJob(2, {{{1, 3, 11}, {2, 5, 11}}, {{1, 3, 11}, {2, 5, 11}}});
  SetAsideForOneProcess();
  auto jd = JobDir::OpenForRead(Dir()).value();
  auto rs = jd->SelectReshard(1);
  ASSERT_TRUE(rs.ok()) << rs.status().ToString();
  ASSERT_TRUE(rs.value().has_value());
  EXPECT_EQ(rs.value()->old_world, 2);
  EXPECT_EQ(rs.value()->dir, "world-2");
  EXPECT_EQ(rs.value()->common.step, 5);
  EXPECT_EQ(rs.value()->common.run_id, 11u);
  EXPECT_EQ(rs.value()->common.ranks[1].location.where, "world-2/rank-00001.nsck");
  EXPECT_EQ(rs.value()->common.ranks[1].info.meta_json, MetaOf(5, 11, 2));
  // Rank 1's newest damaged: step 3.
  Damage("world-2/rank-00001.nsck", infos[1][1]);
  rs = jd->SelectReshard(1);
  ASSERT_TRUE(rs.ok()) << rs.status().ToString();
  EXPECT_EQ(rs.value()->common.step, 3);
  EXPECT_EQ(rs.value()->common.skipped.size(), 1u);
  // Below step 3 nothing: NotFound, with the reshard's head.
  SelectOptions below;
  below.max_step = 2;
  rs = jd->SelectReshard(1, below);
  EXPECT_EQ(rs.status().code(), StatusCode::kNotFound) << rs.status().ToString();
  // All of rank 1 damaged: Corruption naming the file, never nullopt.
  Damage("world-2/rank-00001.nsck", infos[1][0]);
  rs = jd->SelectReshard(1);
  ASSERT_FALSE(rs.ok());
  EXPECT_EQ(rs.status().code(), StatusCode::kCorruption);
  const std::string& msg = rs.status().message();
  EXPECT_EQ(msg.rfind("cannot reshard the checkpoint of world size 2 in " + Dir() +
                          "/world-2 to world size 1: no committed checkpoint verifies",
                      0),
            0u)
      << msg;
  EXPECT_NE(msg.find("world-2/rank-00001.nsck"), std::string::npos) << msg;
}

TEST_F(CommonSelectTest, ReshardOfAnOldRankFileOfAnotherJob) {
  WriteJob(2, {{{1, 3, 11}, {2, 5, 11}}, {{1, 3, 22}, {2, 5, 22}}});
  SetAsideForOneProcess();
  auto jd = JobDir::OpenForRead(Dir()).value();
  auto rs = jd->SelectReshard(1);
  ASSERT_FALSE(rs.ok());
  EXPECT_EQ(rs.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(rs.status().message().find("world size 1: " + Dir() +
                                       "/world-2/rank-00001.nsck is from another job"),
            std::string::npos)
      << rs.status().message();
  // A missing old rank file: FailedPrecondition, naming it.
  fs::remove(root_ / "world-2" / "rank-00001.nsck");
  rs = jd->SelectReshard(1);
  EXPECT_EQ(rs.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(rs.status().message().find("rank-00001.nsck is missing (every old rank file"),
            std::string::npos)
      << rs.status().message();
}

// Copies of old rank files outside the job directory (SelectOptions::extra,
// the peer tier's): a missing old rank is taken from one; a world held only
// outside is considered; a damaged copy, a missing one and a path that is
// not absolute are named.
TEST_F(CommonSelectTest, ReshardWithCopiesOutsideTheJobDirectory) {
  auto infos = WriteJob(2, {{{1, 3, 11}, {2, 5, 11}}, {{1, 3, 11}, {2, 5, 11}}});
  SetAsideForOneProcess();
  const fs::path out = root_.string() + "-outside";
  fs::remove_all(out);
  fs::create_directories(out / "w");
  fs::rename(root_ / "world-2" / "rank-00001.nsck", out / "w" / "copy-of-1.nsck");
  auto jd = JobDir::OpenForRead(Dir()).value();
  auto rs = jd->SelectReshard(1);
  EXPECT_EQ(rs.status().code(), StatusCode::kFailedPrecondition) << rs.status().ToString();
  SelectOptions o;
  o.extra.push_back({2, 1, (out / "w" / "copy-of-1.nsck").string()});
  rs = jd->SelectReshard(1, o);
  ASSERT_TRUE(rs.ok()) << rs.status().ToString();
  ASSERT_TRUE(rs.value().has_value());
  EXPECT_EQ(rs.value()->old_world, 2);
  EXPECT_EQ(rs.value()->common.step, 5);
  EXPECT_EQ(rs.value()->common.ranks[1].location.where, (out / "w" / "copy-of-1.nsck").string());
  // Every old rank outside (a replacement host: no world-2/ in its job
  // directory at all).
  fs::rename(root_ / "world-2" / "rank-00000.nsck", out / "w" / "copy-of-0.nsck");
  fs::remove_all(root_ / "world-2");
  o.extra.push_back({2, 0, (out / "w" / "copy-of-0.nsck").string()});
  rs = jd->SelectReshard(1, o);
  ASSERT_TRUE(rs.ok()) << rs.status().ToString();
  ASSERT_TRUE(rs.value().has_value());
  EXPECT_EQ(rs.value()->common.step, 5);
  // The outside copy's newest damaged: its older step, like a file inside.
  Damage(fs::relative(out / "w" / "copy-of-1.nsck", root_).string(), infos[1][1]);
  rs = jd->SelectReshard(1, o);
  ASSERT_TRUE(rs.ok()) << rs.status().ToString();
  EXPECT_EQ(rs.value()->common.step, 3);
  // A copy that is gone: named, not taken for "nothing committed".
  SelectOptions gone;
  gone.extra.push_back({2, 0, (out / "w" / "copy-of-0.nsck").string()});
  gone.extra.push_back({2, 1, (out / "w" / "none.nsck").string()});
  rs = jd->SelectReshard(1, gone);
  ASSERT_FALSE(rs.ok());
  EXPECT_NE(rs.status().message().find("none.nsck"), std::string::npos) << rs.status().message();
  // Hostile entries: refused in one line before anything is opened.
  SelectOptions bad;
  bad.extra.push_back({2, 0, "relative/rank.nsck"});
  EXPECT_EQ(jd->SelectReshard(1, bad).status().code(), StatusCode::kInvalidArgument);
  bad.extra = {{2, 2, (out / "w" / "copy-of-0.nsck").string()}};
  EXPECT_EQ(jd->SelectReshard(1, bad).status().code(), StatusCode::kInvalidArgument);
  fs::remove_all(out);
}

// Rank files of several world sizes: the newest common step of any set-aside
// world; one of another world size inside world-W/ is named.
TEST_F(CommonSelectTest, ReshardAcrossMixedWorldSizes) {
  auto two = WriteJob(2, {{{1, 3, 11}, {2, 5, 11}}, {{1, 3, 11}, {2, 5, 11}}});
  SetAsideForOneProcess();
  auto three = WriteJob(3, {{{1, 6, 33}, {2, 7, 33}}, {{1, 6, 33}, {2, 7, 33}},
                            {{1, 6, 33}, {2, 7, 33}}});
  SetAsideForOneProcess();
  auto jd = JobDir::OpenForRead(Dir()).value();
  EXPECT_EQ(jd->SetAsideWorlds().value(), (std::vector<int>{2, 3}));
  auto rs = jd->SelectReshard(1);
  ASSERT_TRUE(rs.ok()) << rs.status().ToString();
  EXPECT_EQ(rs.value()->old_world, 3);
  EXPECT_EQ(rs.value()->common.step, 7);
  EXPECT_EQ(rs.value()->common.ranks.size(), 3u);
  // A step only the older world holds.
  SelectOptions at;
  at.step = 5;
  rs = jd->SelectReshard(1, at);
  ASSERT_TRUE(rs.ok()) << rs.status().ToString();
  EXPECT_EQ(rs.value()->old_world, 2);
  EXPECT_EQ(rs.value()->common.step, 5);
  // World 3's rank 2 damaged everywhere: the world-2 checkpoint (an older
  // committed one) rather than an error or nothing.
  Damage("world-3/rank-00002.nsck", three[2][0]);
  Damage("world-3/rank-00002.nsck", three[2][1]);
  rs = jd->SelectReshard(1);
  ASSERT_TRUE(rs.ok()) << rs.status().ToString();
  EXPECT_EQ(rs.value()->old_world, 2);
  EXPECT_EQ(rs.value()->common.step, 5);
  // A rank file of world size 3 inside world-2/: named, one line.
  fs::copy_file(root_ / "world-3" / "rank-00001.nsck", root_ / "world-2" / "rank-00001.nsck",
                fs::copy_options::overwrite_existing);
  rs = jd->SelectReshard(1);
  ASSERT_FALSE(rs.ok()) << "chose world " << rs.value()->old_world;
  EXPECT_EQ(rs.status().code(), StatusCode::kFailedPrecondition);  // world-2's error (the first)
  EXPECT_NE(rs.status().message().find("world-2/rank-00001.nsck was written by rank 1 of world "
                                       "size 3, not rank 1 of 2"),
            std::string::npos)
      << rs.status().message();
  (void)two;
}

}  // namespace
}  // namespace nonstop
