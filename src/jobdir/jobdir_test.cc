// JobDir on the POSIX Env: the lock, names, recovery selection, lineage,
// keep copies, set-aside, agreed records. Regression tests for issue 14's
// defects 2 (second writer), 4 (rollback final, restored checkpoint
// protected), 5 (reshard with a damaged old rank raises) and the keep copy a
// kill interrupted.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "jobdir/check_dir.h"
#include "jobdir/planned_steps.h"
#include "jobdir/records.h"
#include "nonstop/jobdir.h"
#include "nonstop/store.h"
#include "plan/rank_threads.h"
#include "store_test_util.h"

namespace nonstop {
namespace {

namespace fs = std::filesystem;
using testing::CheckContent;
using testing::kTestSlotBytes;
using testing::MakeCheckpoint;
using testing::WriteAndCommit;

class JobDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("nonstop-jobdir-" + std::to_string(getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  std::string Dir() const { return root_.string(); }

  // A new slot file for the writer's rank, created through the temp name.
  static std::unique_ptr<SlotFile> NewSlotFile(JobDir& jd, int world = 1, uint32_t slots = 4) {
    auto m = jd.CreateTempSlot(MediumKind::kBuffered);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    StoreGeometry g;
    g.slots = slots;
    g.slot_bytes = kTestSlotBytes;
    g.rank = static_cast<uint32_t>(jd.rank());
    g.world_size = static_cast<uint32_t>(world);
    auto sf = SlotFile::Create(std::move(m).value(), g);
    EXPECT_TRUE(sf.ok()) << sf.status().ToString();
    EXPECT_TRUE(jd.PublishTempSlot().ok());
    return std::move(sf).value();
  }

  // Commits step `step` as counter `counter` into `slot` (counter % slots when -1).
  static CheckpointInfo Commit(SlotFile& f, uint64_t counter, int64_t step, int slot_or = -1) {
    auto c = MakeCheckpoint(step);
    const uint32_t slot = slot_or >= 0 ? static_cast<uint32_t>(slot_or)
                                       : static_cast<uint32_t>(counter % f.geometry().slots);
    EXPECT_TRUE(f.WriteData(slot, 0, c.data.data(), c.data.size()).ok());
    auto info = f.Commit(testing::MakeCommitRequest(c, slot, counter));
    EXPECT_TRUE(info.ok()) << info.status().ToString();
    return info.value();
  }

  // Overwrites the first data bytes of `info` (a damaged checkpoint).
  static void Damage(SlotFile& f, const CheckpointInfo& info) {
    std::vector<uint8_t> junk(4096, 0xA5);
    ASSERT_TRUE(f.medium().Write(info.data_offset, junk.data(), junk.size()).ok());
    ASSERT_TRUE(f.medium().Sync().ok());
  }

  fs::path root_;
};

TEST(JobDirNamesTest, EveryNameParsesBack) {
  EXPECT_EQ(JobDirNames::Slot(3), "rank-00003.nsck");
  EXPECT_EQ(JobDirNames::Slot(3), SlotFileName(3));
  EXPECT_EQ(JobDirNames::TempSlot(3), "rank-00003.nsck.tmp");
  EXPECT_EQ(JobDirNames::Lock(0), ".nonstop.lock");
  EXPECT_EQ(JobDirNames::Lock(2), ".nonstop.rank-00002.lock");
  EXPECT_EQ(JobDirNames::KeepStep(42), "step-000000000042");
  EXPECT_EQ(JobDirNames::World(4), "world-4");
  EXPECT_EQ(JobDirNames::ParseSlot("rank-00007.nsck"), 7);
  EXPECT_FALSE(JobDirNames::ParseSlot("rank-00007.nsck.tmp"));
  EXPECT_FALSE(JobDirNames::ParseSlot("rank-0007.nsck"));
  EXPECT_EQ(JobDirNames::ParseKeepStep("step-000000000042"), 42);
  EXPECT_FALSE(JobDirNames::ParseKeepStep("step-42"));
  EXPECT_EQ(JobDirNames::ParseWorld("world-16"), 16);
  EXPECT_FALSE(JobDirNames::ParseWorld("world-016"));
  EXPECT_FALSE(JobDirNames::ParseWorld("world-0"));
}

// Defect 2: two writers on one directory both started.
TEST_F(JobDirTest, SecondWriterIsRefusedWithTheHolderNamed) {
  auto first = JobDir::OpenForWrite(Dir());
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = JobDir::OpenForWrite(Dir());
  ASSERT_FALSE(second.ok());
  const std::string msg = second.status().message();
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(msg.find(".nonstop.lock"), std::string::npos) << msg;
  EXPECT_NE(msg.find("pid " + std::to_string(getpid()) + " on host "), std::string::npos) << msg;
  EXPECT_NE(msg.find("(started "), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  // Readers take no lock; another rank has its own lock.
  EXPECT_TRUE(JobDir::OpenForRead(Dir()).ok());
  EXPECT_TRUE(JobDir::OpenForWrite(Dir(), 1, 2).ok());
  first.value().reset();
  EXPECT_TRUE(JobDir::OpenForWrite(Dir()).ok());
}

// A writer's open removes the temp names its own records are written under
// (a kill mid-write leaves one), the job manifest's too; another rank's stay.
TEST_F(JobDirTest, AWritersOpenRemovesItsRecordsTempFiles) {
  fs::create_directories(root_);
  const std::vector<std::string> mine = {"rank-00000.nsck.tmp", "lineage-rank-00000.json.tmp",
                                         "agreed-rank-00000.json.tmp",
                                         "manifest-rank-00000.json.tmp"};
  for (const std::string& n : mine) std::ofstream(root_ / n) << "x";
  { std::ofstream(root_ / "manifest-rank-00001.json.tmp") << "x"; }
  auto w = JobDir::OpenForWrite(Dir(), 0, 2);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  for (const std::string& n : mine) EXPECT_FALSE(fs::exists(root_ / n)) << n;
  EXPECT_TRUE(fs::exists(root_ / "manifest-rank-00001.json.tmp"));
}

TEST_F(JobDirTest, ReaderOfAMissingDirectoryGetsNotFound) {
  auto r = JobDir::OpenForRead(Dir());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(fs::exists(root_));
}

TEST_F(JobDirTest, SelectsNewestValidAndSaysWhyItSkipped) {
  auto jd = JobDir::OpenForWrite(Dir()).value();
  auto fresh = jd->Select(0);
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  EXPECT_FALSE(fresh.value().chosen.has_value());

  auto sf = NewSlotFile(*jd);
  Commit(*sf, 1, 10);
  auto i2 = Commit(*sf, 2, 20);
  auto i3 = Commit(*sf, 3, 30);
  auto sel = jd->Select(0).value();
  ASSERT_TRUE(sel.chosen);
  EXPECT_EQ(sel.chosen->info.counter, 3u);
  EXPECT_FALSE(sel.fallback);
  EXPECT_TRUE(CheckContent(*sel.chosen->file, sel.chosen->info).ok());

  Damage(*sf, i3);
  sel = jd->Select(0).value();
  ASSERT_TRUE(sel.chosen);
  EXPECT_EQ(sel.chosen->info.counter, 2u);
  EXPECT_TRUE(sel.fallback);
  ASSERT_EQ(sel.skipped.size(), 1u);
  EXPECT_NE(sel.skipped[0].find("checkpoint #3 (step 30)"), std::string::npos) << sel.skipped[0];
  EXPECT_NE(sel.skipped[0].find("checksum mismatch"), std::string::npos) << sel.skipped[0];

  // Without data verification the damaged one is chosen (the caller verifies as it reads)...
  SelectOptions quick;
  quick.verify_data = false;
  EXPECT_EQ(jd->Select(0, quick).value().chosen->info.counter, 3u);
  // ...and excludes it when its read fails.
  quick.exclude = {3};
  EXPECT_EQ(jd->Select(0, quick).value().chosen->info.counter, 2u);

  SelectOptions at;
  at.step = 10;
  EXPECT_EQ(jd->Select(0, at).value().chosen->info.counter, 1u);
  at.step = 30;
  auto none = jd->Select(0, at);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kCorruption);
  EXPECT_NE(none.status().message().find("step 30"), std::string::npos);
  at.step = 99;
  EXPECT_EQ(jd->Select(0, at).status().code(), StatusCode::kNotFound);

  Damage(*sf, i2);
  Damage(*sf, sf->Scan().value().checkpoints.back().info);
  auto all_bad = jd->Select(0);
  ASSERT_FALSE(all_bad.ok());
  EXPECT_EQ(all_bad.status().code(), StatusCode::kCorruption);
  EXPECT_NE(all_bad.status().message().find("#1"), std::string::npos) << all_bad.status().message();
}

// Defect 4: after restore(step=s) with newer checkpoints, a crash resumed the
// future the user rolled back from.
TEST_F(JobDirTest, RollbackIsFinal) {
  {
    auto jd = JobDir::OpenForWrite(Dir()).value();
    auto sf = NewSlotFile(*jd);
    for (uint64_t c = 1; c <= 4; ++c) Commit(*sf, c, static_cast<int64_t>(c) * 10);
    SelectOptions at;
    at.step = 20;
    auto sel = jd->Select(0, at).value();
    ASSERT_EQ(sel.chosen->info.counter, 2u);
    ASSERT_TRUE(jd->RecordRestore(0, 2).ok());
    EXPECT_EQ(jd->ProtectedCounter(0).value(), std::optional<uint64_t>(2));
    EXPECT_EQ(jd->NextCounter(0).value(), 5u);
    // The writer is killed before its first new checkpoint commits.
  }
  auto jd = JobDir::OpenForWrite(Dir()).value();
  auto sel = jd->Select(0).value();
  ASSERT_TRUE(sel.chosen);
  EXPECT_EQ(sel.chosen->info.counter, 2u) << "resumed a step the user rolled back from";
  EXPECT_EQ(sel.chosen->info.step, 20);
  ASSERT_GE(sel.skipped.size(), 2u);
  EXPECT_NE(sel.skipped[0].find("abandoned"), std::string::npos) << sel.skipped[0];
  SelectOptions at;
  at.step = 40;
  EXPECT_EQ(jd->Select(0, at).status().code(), StatusCode::kNotFound);
  auto lineage = jd->ReadLineage(0).value();
  EXPECT_TRUE(lineage.IsAbandoned(3));
  EXPECT_TRUE(lineage.IsAbandoned(4));
  EXPECT_FALSE(lineage.IsAbandoned(2));
  EXPECT_FALSE(lineage.IsAbandoned(5));
  // The restored checkpoint stays protected until the new lineage commits.
  EXPECT_EQ(jd->ProtectedCounter(0).value(), std::optional<uint64_t>(2));
  auto m = jd->OpenSlot(0, MediumKind::kBuffered, false).value();
  auto sf = SlotFile::Open(std::move(m)).value();
  ASSERT_TRUE(sf->Scan().ok());
  const uint64_t next = jd->NextCounter(0).value();
  EXPECT_EQ(next, 5u);
  Commit(*sf, next, 21, /*slot of abandoned #3*/ 3);
  EXPECT_EQ(jd->ProtectedCounter(0).value(), std::nullopt);
  EXPECT_EQ(jd->Select(0).value().chosen->info.counter, next);
  // An abandoned checkpoint cannot be restored again.
  EXPECT_EQ(jd->RecordRestore(0, 3).code(), StatusCode::kInvalidArgument);
  // A second rollback adds a range; the first stays.
  ASSERT_TRUE(jd->RecordRestore(0, 1).ok());
  lineage = jd->ReadLineage(0).value();
  EXPECT_TRUE(lineage.IsAbandoned(next));
  EXPECT_TRUE(lineage.IsAbandoned(2));
  EXPECT_EQ(jd->Select(0).value().chosen->info.counter, 1u);
}

// Defect 4, first half: newest damaged, restore falls back; that fallback is
// recorded, and the damaged newer counter never comes back.
TEST_F(JobDirTest, FallbackAfterDamageIsRecordedAndProtected) {
  auto jd = JobDir::OpenForWrite(Dir()).value();
  auto sf = NewSlotFile(*jd);
  Commit(*sf, 1, 5);
  Commit(*sf, 2, 7);
  auto i3 = Commit(*sf, 3, 9);
  Damage(*sf, i3);
  auto sel = jd->Select(0).value();
  ASSERT_EQ(sel.chosen->info.counter, 2u);
  ASSERT_TRUE(sel.fallback);
  ASSERT_TRUE(jd->RecordRestore(0, sel.chosen->info.counter).ok());
  EXPECT_EQ(jd->ProtectedCounter(0).value(), std::optional<uint64_t>(2));
  EXPECT_TRUE(jd->ReadLineage(0).value().IsAbandoned(3));
  EXPECT_EQ(jd->NextCounter(0).value(), 4u);
}

// A keep copy a kill interrupted left keep/step-N/rank-00000.nsck.tmp forever.
TEST_F(JobDirTest, InterruptedKeepCopyIsRedoneAtOpen) {
  {
    auto jd = JobDir::OpenForWrite(Dir()).value();
    auto sf = NewSlotFile(*jd);
    auto info = Commit(*sf, 1, 7);
    ASSERT_TRUE(jd->Keep(*sf, info).ok());
    ASSERT_TRUE(jd->Keep(*sf, info).ok());  // already there: nothing to do
    Commit(*sf, 2, 8);
  }
  const fs::path keep7 = root_ / "keep" / "step-000000000007";
  const fs::path keep8 = root_ / "keep" / "step-000000000008";
  const fs::path keep9 = root_ / "keep" / "step-000000000009";
  ASSERT_TRUE(fs::exists(keep7 / "rank-00000.nsck"));
  // A kill during the copy of step 8 (temp file half written), and during
  // the making of step 9's directory (whose checkpoint is gone).
  fs::create_directories(keep8);
  { std::ofstream(keep8 / "rank-00000.nsck.tmp") << std::string(5000, 'x'); }
  fs::create_directories(keep9);
  { std::ofstream(root_ / "rank-00000.nsck.tmp") << "half a slot file"; }

  auto jd = JobDir::OpenForWrite(Dir()).value();
  EXPECT_FALSE(fs::exists(keep8 / "rank-00000.nsck.tmp"));
  EXPECT_FALSE(fs::exists(root_ / "rank-00000.nsck.tmp"));
  EXPECT_FALSE(fs::exists(keep9)) << "a half-made keep dir stays";
  ASSERT_TRUE(fs::exists(keep8 / "rank-00000.nsck")) << "the interrupted copy was not redone";
  auto rd = JobDir::OpenForRead(Dir()).value();
  auto list = rd->List(0).value();
  int kept8 = 0;
  for (const auto& l : list) {
    if (l.location.keep && l.step == 8) {
      ++kept8;
      EXPECT_EQ(l.state, ListedCheckpoint::State::kCommitted);
      EXPECT_EQ(l.location.where, "keep/step-000000000008/rank-00000.nsck");
    }
  }
  EXPECT_EQ(kept8, 1);
  // The kept copies hold exactly the bytes of their steps, and recovery
  // falls back to them when the slot file is gone.
  fs::remove(root_ / "rank-00000.nsck");
  auto sel = rd->Select(0).value();
  ASSERT_TRUE(sel.chosen);
  EXPECT_EQ(sel.chosen->info.step, 8);
  EXPECT_TRUE(sel.chosen->location.keep);
  EXPECT_TRUE(CheckContent(*sel.chosen->file, sel.chosen->info).ok());
}

// Defect 5: a 2-rank directory restored by 1 process with rank 1 damaged
// returned "nothing" and training restarted at step 0.
TEST_F(JobDirTest, ReshardWithADamagedOldRankRaises) {
  std::vector<CheckpointInfo> rank1;
  {
    std::unique_ptr<SlotFile> f0, f1;
    auto w0 = JobDir::OpenForWrite(Dir(), 0, 2).value();
    auto w1 = JobDir::OpenForWrite(Dir(), 1, 2).value();
    f0 = NewSlotFile(*w0, 2);
    f1 = NewSlotFile(*w1, 2);
    for (uint64_t c = 1; c <= 3; ++c) {
      Commit(*f0, c, static_cast<int64_t>(c));
      rank1.push_back(Commit(*f1, c, static_cast<int64_t>(c)));
    }
    Commit(*f0, 4, 4);  // only rank 0 got step 4
    auto common = w0->SelectCommon(2);
    ASSERT_TRUE(common.ok()) << common.status().ToString();
    EXPECT_EQ(common.value().step, 3);
    ASSERT_EQ(common.value().ranks.size(), 2u);
    // Rank 1's step 3 damaged: both fall back to step 2.
    Damage(*f1, rank1[2]);
    common = w0->SelectCommon(2);
    ASSERT_TRUE(common.ok()) << common.status().ToString();
    EXPECT_EQ(common.value().step, 2);
    EXPECT_EQ(common.value().skipped.size(), 1u);
  }
  // A job of world size 1 sets the world-2 files aside.
  auto jd = JobDir::OpenForWrite(Dir(), 0, 1).value();
  ASSERT_TRUE(jd->NeedsSetAside(1).value());
  auto moved = jd->SetAside(1);
  ASSERT_TRUE(moved.ok()) << moved.status().ToString();
  EXPECT_EQ(moved.value(), std::vector<int>{2});
  EXPECT_FALSE(jd->NeedsSetAside(1).value());
  EXPECT_EQ(jd->SetAsideWorlds().value(), std::vector<int>{2});
  EXPECT_TRUE(fs::exists(root_ / "world-2" / "rank-00001.nsck"));
  EXPECT_FALSE(fs::exists(root_ / "rank-00001.nsck"));
  auto common = jd->SelectCommon(2, {}, 2);
  ASSERT_TRUE(common.ok()) << common.status().ToString();
  EXPECT_EQ(common.value().step, 2);
  EXPECT_EQ(common.value().ranks[1].location.where, "world-2/rank-00001.nsck");
  EXPECT_TRUE(CheckContent(*common.value().ranks[1].file, common.value().ranks[1].info).ok());

  // Every common step of rank 1 damaged: an error, never "nothing".
  {
    auto m = OpenMedium((root_ / "world-2" / "rank-00001.nsck").string(), MediumKind::kBuffered, {});
    auto f1 = SlotFile::Open(std::move(m).value()).value();
    for (const auto& i : rank1) Damage(*f1, i);
  }
  common = jd->SelectCommon(2, {}, 2);
  ASSERT_FALSE(common.ok());
  EXPECT_EQ(common.status().code(), StatusCode::kCorruption);
  EXPECT_NE(common.status().message().find("rank 1"), std::string::npos)
      << common.status().message();
  // Rank 1's file from another job (other world size) or missing: errors too.
  fs::remove(root_ / "world-2" / "rank-00001.nsck");
  common = jd->SelectCommon(2, {}, 2);
  ASSERT_FALSE(common.ok());
  EXPECT_EQ(common.status().code(), StatusCode::kNotFound);
  EXPECT_NE(common.status().message().find("rank-00001.nsck is missing"), std::string::npos)
      << common.status().message();
  EXPECT_EQ(jd->SelectCommon(2, {}, 5).status().code(), StatusCode::kNotFound);
}

// ListLocalSteps, then SetAsideTogether (Distributed's start) on two ranks: rank 0 sees the file
// of a world-1 job and moves it in its turn (with the warning's line); a
// second start has nothing to move and takes no turns; a rank that cannot
// read the directory fails both with its one line.
TEST_F(JobDirTest, SetAsideTogetherMovesOnceInTurns) {
  {
    auto w = JobDir::OpenForWrite(Dir(), 0, 1).value();
    auto f = NewSlotFile(*w, 1);
    Commit(*f, 1, 5);
  }
  // What each rank brings to a restore (ListLocalSteps): its steps, and
  // whether files of another world size wait to be set aside.
  LocalSteps l = ListLocalSteps(Dir(), 0, 1, std::nullopt);
  EXPECT_FALSE(l.error.has_value());
  EXPECT_EQ(l.steps, std::vector<int64_t>{5});
  EXPECT_FALSE(l.foreign);
  EXPECT_TRUE(ListLocalSteps(Dir(), 0, 2, std::nullopt).foreign);
  EXPECT_TRUE(ListLocalSteps(Dir(), 0, 1, 4).steps.empty());
  l = ListLocalSteps((root_ / "none").string(), 0, 2, std::nullopt);
  EXPECT_TRUE(!l.error && l.steps.empty() && !l.foreign);
  l = ListLocalSteps((root_ / "rank-00000.nsck").string(), 0, 2, std::nullopt);
  EXPECT_TRUE(l.error.has_value());
  auto run = [&](const std::vector<std::string>& dirs) {
    std::vector<Result<std::vector<int>>> got(2, Status::Internal("not run"));
    dist::RankThreads(2).Run([&](int r, const dist::Gather& g) {
      got[r] = SetAsideTogether(dirs[r], r, 2, g);
    });
    return got;
  };
  auto got = run({Dir(), Dir()});
  ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
  ASSERT_TRUE(got[1].ok()) << got[1].status().ToString();
  EXPECT_EQ(got[0].value(), std::vector<int>{1});
  EXPECT_TRUE(got[1].value().empty());
  EXPECT_TRUE(fs::exists(root_ / "world-1" / "rank-00000.nsck"));
  EXPECT_FALSE(fs::exists(root_ / "rank-00000.nsck"));
  EXPECT_FALSE(ListLocalSteps(Dir(), 0, 2, std::nullopt).foreign);
  EXPECT_EQ(SetAsideWarning("/j", 2, {1, 4}),
            "nonstop: /j holds a checkpoint of world size 1, 4; this job has world size 2: its "
            "rank files are moved to /j/world-1, /j/world-4 and restore() reshards them");
  EXPECT_EQ(SetAsideWarning("/j", 2, {}), "");
  got = run({Dir(), Dir()});
  ASSERT_TRUE(got[0].ok() && got[1].ok());
  EXPECT_TRUE(got[0].value().empty() && got[1].value().empty());
  got = run({Dir(), (root_ / "world-1" / "rank-00000.nsck").string()});
  for (const auto& g : got) {
    ASSERT_FALSE(g.ok());
    EXPECT_EQ(g.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(g.status().message(), got[1].status().message());
  }
}

// AgreeOnStep (hf.py's resume under torchrun) on two ranks: no directory is
// a fresh start; the newest step both ranks committed; a step one rank lacks
// is NotFound; a rank's unreadable directory or another world's rank files
// are every rank's one line; world 1 ignores the world size.
TEST_F(JobDirTest, AgreeOnStepTakesTheNewestStepEveryRankCommitted) {
  using Got = Result<std::optional<int64_t>>;
  auto run = [&](const std::vector<std::string>& dirs, std::optional<int64_t> step) {
    std::vector<Got> got(dirs.size(), Status::Internal("not run"));
    const int world = static_cast<int>(dirs.size());
    dist::RankThreads(world).Run([&](int r, const dist::Gather& g) {
      got[r] = AgreeOnStep(dirs[r], r, world, step, g);
    });
    return got;
  };
  for (const Got& g : run({Dir(), Dir()}, std::nullopt)) {
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    EXPECT_FALSE(g.value().has_value());
  }
  for (int rank = 0; rank < 2; ++rank) {
    auto w = JobDir::OpenForWrite(Dir(), rank, 2).value();
    auto f = NewSlotFile(*w, 2);
    Commit(*f, 1, 5);
    if (rank == 0) Commit(*f, 2, 7);  // rank 1 was killed before committing step 7
  }
  for (const Got& g : run({Dir(), Dir()}, std::nullopt)) {
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    EXPECT_EQ(g.value(), std::optional<int64_t>(5));
  }
  std::vector<Got> got = run({Dir(), Dir()}, 7);
  for (const Got& g : got) EXPECT_EQ(g.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(got[0].status().message(), "no checkpoint at step 7 committed on every rank of " +
                                           Dir() + " (rank 0 holds steps [7])");
  const std::string file = (root_ / "rank-00000.nsck").string();
  for (const Got& g : run({Dir(), file}, std::nullopt)) {
    EXPECT_EQ(g.status().code(), StatusCode::kCorruption);
    EXPECT_EQ(g.status().message(), file + " is a file, not a checkpoint directory");
  }
  // One process reads rank 0's file of the two-rank job (its world unchecked).
  got = run({Dir()}, std::nullopt);
  ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
  EXPECT_EQ(got[0].value(), std::optional<int64_t>(7));
  // Three ranks: the two-rank job's files were not set aside.
  got = run({Dir(), Dir(), Dir()}, std::nullopt);
  for (const Got& g : got) {
    EXPECT_EQ(g.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(g.status().message().find("another world size"), std::string::npos)
        << g.status().message();
  }
}

TEST_F(JobDirTest, SetAsideKeepsAnOlderSetAsideAsPrev) {
  for (int round = 0; round < 2; ++round) {
    {
      auto w = JobDir::OpenForWrite(Dir(), 0, 2).value();
      auto f = NewSlotFile(*w, 2);
      Commit(*f, 1, 100 + round);
      AgreedRecord a;
      a.step = 100 + round;
      a.counter = 1;
      a.world_size = 2;
      ASSERT_TRUE(w->WriteAgreed(a).ok());
    }
    auto jd = JobDir::OpenForWrite(Dir(), 0, 1).value();
    ASSERT_EQ(jd->SetAside(1).value(), std::vector<int>{2});
  }
  EXPECT_TRUE(fs::exists(root_ / "world-2" / "rank-00000.nsck"));
  EXPECT_TRUE(fs::exists(root_ / "world-2" / "rank-00000.nsck.prev"));
  EXPECT_TRUE(fs::exists(root_ / "world-2" / "agreed-rank-00000.json"));
  EXPECT_FALSE(fs::exists(root_ / "agreed-rank-00000.json"));
}

TEST_F(JobDirTest, AgreedRecordsRoundTripAndHostileOnesAreOneLineErrors) {
  auto jd = JobDir::OpenForWrite(Dir()).value();
  EXPECT_FALSE(jd->ReadAgreed(0).value().has_value());
  AgreedRecord a;
  a.step = 42;
  a.counter = -1;
  a.lineage = 0x3fffffffffffffffull;
  a.unix_s = 1700000000.5;
  a.resharded_from = "world-4";
  a.resharded_from_world = 4;
  ASSERT_TRUE(jd->WriteAgreed(a).ok());
  auto b = jd->ReadAgreed(0).value();
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->step, 42);
  EXPECT_EQ(b->counter, -1);
  EXPECT_EQ(b->lineage, a.lineage);
  EXPECT_EQ(b->resharded_from, "world-4");
  EXPECT_EQ(b->resharded_from_world, 4);
  a.rank = 1;
  EXPECT_EQ(jd->WriteAgreed(a).code(), StatusCode::kInvalidArgument);  // not this writer's rank

  const std::vector<std::string> hostile = {
      std::string(200000, '['), "{\"step\": 1", "{\"step\": \"x\", \"counter\": 1}",
      std::string(70 << 10, ' '), "{\"step\": 1, \"counter\": 1, \"lineage\": 1, \"rank\": 0, "
      "\"world_size\": 0}", "\xff\xfe"};
  for (const std::string& h : hostile) {
    fs::remove(root_ / "agreed-rank-00000.json");
    { std::ofstream(root_ / "agreed-rank-00000.json", std::ios::binary) << h; }
    auto r = jd->ReadAgreed(0);
    ASSERT_FALSE(r.ok()) << h.substr(0, 40);
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
    EXPECT_EQ(r.status().message().find('\n'), std::string::npos);
  }
  // A hostile lineage record stops recovery with a clear error instead of
  // silently resurrecting abandoned checkpoints.
  { std::ofstream(root_ / "lineage-rank-00000.json") << "{\"format\": \"nonstop-lineage\", "
                                                       "\"version\": 1, \"restored\": 2, "
                                                       "\"abandoned\": [[5, 3]]}"; }
  EXPECT_EQ(jd->Select(0).status().code(), StatusCode::kCorruption);
}

TEST_F(JobDirTest, ForeignEntriesAreNamed) {
  auto jd = JobDir::OpenForWrite(Dir()).value();
  auto sf = NewSlotFile(*jd);
  fs::create_directories(root_ / "world-2");
  fs::create_directories(root_ / "keep");
  { std::ofstream(root_ / "agreed-rank-00000.json") << "{}"; }
  EXPECT_TRUE(jd->ForeignEntries().value().empty());
  { std::ofstream(root_ / "notes.txt") << "x"; }
  fs::create_directories(root_ / "world-x");
  EXPECT_EQ(jd->ForeignEntries().value(), (std::vector<std::string>{"notes.txt", "world-x"}));
}

// The check before a job opens or creates a directory (Python's
// check_directory) and the ranks a consolidating reader opens.
TEST_F(JobDirTest, CheckDirectoryNamesWhatIsWrongInOneLine) {
  auto why = [](const Result<bool>& r) { return r.ok() ? std::string() : r.status().message(); };
  const std::string d = Dir();
  // Missing: fine unless it must exist.
  EXPECT_FALSE(CheckJobDirectory(d, 0, 1, false).value());
  EXPECT_EQ(CheckJobDirectory(d, 0, 1, true).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(why(CheckJobDirectory(d, 0, 1, true)), "checkpoint directory " + d +
                                                            " does not exist");
  EXPECT_EQ(RankFiles(d).status().message(), "checkpoint directory " + d +
                                                         " does not exist");
  fs::create_directories(root_);
  // Empty, or holding only a job's other entries: a new job may use it.
  fs::create_directories(root_ / "world-2");
  fs::create_directories(root_ / "remote");
  { std::ofstream(root_ / "agreed-rank-00001.json") << "{}"; }
  { std::ofstream(root_ / "rank-00000.nsck.tmp") << "x"; }
  { std::ofstream(root_ / ".hidden") << "x"; }
  // A rank's records and the temp names they are written under (a kill or a
  // set-aside may leave one beside no slot file), and keep/.
  for (const char* n : {"manifest-rank-00000.json.tmp", "manifest-rank-00001.json",
                        "lineage-rank-00002.json", "lineage-rank-00000.json.tmp",
                        "agreed-rank-00003.json.tmp"}) {
    std::ofstream(root_ / n) << "{}";
  }
  fs::create_directories(root_ / "keep");
  EXPECT_FALSE(CheckJobDirectory(d, 0, 1, false).value());
  EXPECT_EQ(why(CheckJobDirectory(d, 0, 1, true)),
            "no nonstop checkpoint in " + d + " (directory is empty)");
  EXPECT_EQ(RankFiles(d).status().message(), "no nonstop checkpoint in " + d);
  // Anything else: another program's directory, the first three named.
  for (const char* n : {"e.txt", "a.txt", "world-x", "d.txt", "manifest-rank-0001.json"}) {
    std::ofstream(root_ / n) << "x";
  }
  EXPECT_EQ(why(CheckJobDirectory(d, 0, 1, false)),
            d + " is not a nonstop checkpoint directory (it holds a.txt, d.txt, e.txt, ...); "
                "use an empty or new directory");
  EXPECT_EQ(CheckJobDirectory(d, 0, 1, false).status().code(),
            StatusCode::kFailedPrecondition);
  // Slot files of ranks 0 and 2: rank 1 has none; a world of 2 is too small.
  { std::ofstream(root_ / "rank-00000.nsck") << "x"; }
  { std::ofstream(root_ / "rank-00002.nsck") << "x"; }
  EXPECT_TRUE(CheckJobDirectory(d, 0, 3, true).value());
  EXPECT_TRUE(CheckJobDirectory(d, 2, std::nullopt, true).value());
  EXPECT_FALSE(CheckJobDirectory(d, 1, 3, false).value());
  EXPECT_EQ(why(CheckJobDirectory(d, 1, 3, true)), "no nonstop checkpoint for rank 1 in " + d);
  EXPECT_EQ(why(CheckJobDirectory(d, 0, 2, false)),
            d + " was written by a job of world size 3 or more; this job has world size 2: use "
                "the same world size or a new directory");
  EXPECT_EQ(RankFiles(d + "/").value(), (std::vector<int>{0, 2}));
  // A file is no directory.
  const std::string file = (root_ / "e.txt").string();
  EXPECT_EQ(why(CheckJobDirectory(file, 0, 1, false)),
            file + " is a file, not a checkpoint directory");
  EXPECT_EQ(RankFiles(file).status().code(), StatusCode::kNotFound);
}

// nonstop.lightning's last.ckpt: what NonstopCheckpoint writes reads back;
// anything else (a link, a torch file, another format, a dir that is not one
// path component, a bad step) is no marker, so Lightning's own loader gets it.
TEST_F(JobDirTest, LightningMarkerReadsWhatItWritesAndNothingElse) {
  fs::create_directories(root_);
  auto write = [&](const char* name, const std::string& text) {
    std::ofstream(root_ / name, std::ios::binary) << text;
    return (root_ / name).string();
  };
  EXPECT_EQ(LightningMarkerJson(7),
            "{\"format\": \"nonstop.lightning/1\", \"dir\": \"nonstop\", \"step\": 7, "
            "\"global_step\": 8}");
  std::optional<LightningMarker> m =
      ReadLightningMarker(write("last.ckpt", LightningMarkerJson(7)));
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->dir, "nonstop");
  EXPECT_EQ(m->nonstop_dir, Dir() + "/nonstop");
  EXPECT_EQ(m->step, 7);
  m = ReadLightningMarker(
      write("m.ckpt", R"({"format": "nonstop.lightning/1", "dir": "x", "step": 0})"));
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->dir, "x");
  EXPECT_EQ(m->nonstop_dir, Dir() + "/x");
  EXPECT_EQ(m->step, 0);
  fs::create_symlink(root_ / "last.ckpt", root_ / "link.ckpt");
  EXPECT_FALSE(ReadLightningMarker((root_ / "link.ckpt").string()));
  EXPECT_FALSE(ReadLightningMarker((root_ / "missing.ckpt").string()));
  EXPECT_FALSE(ReadLightningMarker((root_ / "no" / "last.ckpt").string()));
  EXPECT_FALSE(ReadLightningMarker(root_.string()));
  EXPECT_FALSE(ReadLightningMarker(write("big.ckpt", std::string(1 << 17, ' ') + "{}")));
  EXPECT_FALSE(ReadLightningMarker(write("torch.ckpt", "\x80\x02}q\x00.")));
  for (const char* bad : {R"({"format": "nonstop.lightning/2", "dir": "nonstop", "step": 1})",
                          R"({"dir": "nonstop", "step": 1})", R"([1, 2])", "null",
                          R"({"format": "nonstop.lightning/1", "dir": "../x", "step": 1})",
                          R"({"format": "nonstop.lightning/1", "dir": "a/b", "step": 1})",
                          R"({"format": "nonstop.lightning/1", "dir": 5, "step": 1})",
                          R"({"format": "nonstop.lightning/1", "step": 1})",
                          R"({"format": "nonstop.lightning/1", "dir": "nonstop", "step": -1})",
                          R"({"format": "nonstop.lightning/1", "dir": "nonstop", "step": 1.5})",
                          R"({"format": "nonstop.lightning/1", "dir": "nonstop"})"}) {
    EXPECT_FALSE(ReadLightningMarker(write("bad.ckpt", bad))) << bad;
  }
}

TEST_F(JobDirTest, ASymlinkPlantedAtTheTempNameIsNeverFollowed) {
  auto jd = JobDir::OpenForWrite(Dir()).value();
  const fs::path victim = root_.string() + "-victim";
  { std::ofstream(victim) << "precious"; }
  fs::create_symlink(victim, root_ / "rank-00000.nsck.tmp");
  // CreateTempSlot removes the link itself (unlink never follows), then
  // creates a fresh file with O_EXCL.
  auto m = jd->CreateTempSlot(MediumKind::kBuffered);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  std::ifstream in(victim);
  std::string got;
  in >> got;
  EXPECT_EQ(got, "precious");
  EXPECT_FALSE(fs::is_symlink(root_ / "rank-00000.nsck.tmp"));
  fs::remove(victim);
}

TEST(JobDirRecordsTest, BoundedParser) {
  using jobdir_internal::ParseJson;
  EXPECT_TRUE(ParseJson("{\"a\": [1, 2.5, \"x\\u00e9\", true, null]}", "t").ok());
  EXPECT_FALSE(ParseJson(std::string(100, '[') + std::string(100, ']'), "t").ok());
  EXPECT_FALSE(ParseJson("[1,]", "t").ok());
  EXPECT_FALSE(ParseJson("\"a\x01\"", "t").ok());
  LineageRecord rec;
  rec.abandoned = {{3, 4}, {7, 9}};
  rec.restored_counter = 6;
  auto back = jobdir_internal::DecodeLineage(jobdir_internal::EncodeLineage(rec, 0), "t");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back.value().abandoned, rec.abandoned);
  EXPECT_EQ(back.value().abandoned_through, 9u);
  EXPECT_EQ(back.value().restored_counter, 6u);
}

}  // namespace
}  // namespace nonstop

namespace nonstop {
namespace {

// Issue 23, cases 5 and 6: a slot file cut shorter than its header says,
// with its commit records gone, is damage for the selection and the
// listing, never "nothing committed".
TEST_F(JobDirTest, ATruncatedSlotFileWithNoRecordLeftIsDamageNotAFreshStart) {
  {
    auto jd = JobDir::OpenForWrite(Dir());
    ASSERT_TRUE(jd.ok()) << jd.status().ToString();
    auto sf = NewSlotFile(**jd);
    for (uint64_t c = 1; c <= 3; ++c) Commit(*sf, c, static_cast<int64_t>(c) * 10);
  }
  fs::resize_file(root_ / "rank-00000.nsck", 8192);
  auto jd = JobDir::OpenForRead(Dir());
  ASSERT_TRUE(jd.ok());
  auto sel = (*jd)->Select(0);
  ASSERT_FALSE(sel.ok()) << "a truncated file was taken for a fresh start";
  EXPECT_EQ(sel.status().code(), StatusCode::kCorruption);
  EXPECT_NE(sel.status().message().find("truncated"), std::string::npos) << sel.status().message();
  auto listed = (*jd)->List(0);
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ(listed->front().state, ListedCheckpoint::State::kDamaged);
  EXPECT_NE(listed->front().reason.find("no commit record is left"), std::string::npos);
}

}  // namespace
}  // namespace nonstop
