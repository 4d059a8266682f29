// CommitWatch (the Python handles' watch): tracking before and after a
// checkpoint finished, the outcome's kind and line, agreement, Stop and
// Abandon, a waiter woken without polling; and an Engine reporting to it.
#include "engine/commit_watch.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <future>
#include <thread>

#include "nonstop/engine.h"
#include "nonstop/jobdir.h"

namespace nonstop {
namespace {

using Kind = WatchOutcome::Kind;

CheckpointStats Rec(uint64_t counter, int64_t step, bool committed, std::string error = "") {
  CheckpointStats r;
  r.counter = counter;
  r.step = step;
  r.committed = committed;
  r.error = std::move(error);
  return r;
}

std::vector<WatchOutcome> NextNow(CommitWatch& w) {
  auto got = std::async(std::launch::async, [&] { return w.Next(); });
  if (got.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    w.Stop();
    ADD_FAILURE() << "Next() did not return";
  }
  auto v = got.get();
  return v ? *v : std::vector<WatchOutcome>{};
}

TEST(CommitWatch, SettlesATrackedCheckpointWhetherItFinishedBeforeOrAfterTrack) {
  CommitWatch w(false);
  w.Finished(Rec(1, 10, true));  // finished before the caller tracked it
  w.Track(1, 10);
  w.Track(2, 20);
  auto got = NextNow(w);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].counter, 1u);
  EXPECT_EQ(got[0].kind, Kind::kCommitted);
  ASSERT_TRUE(got[0].record.has_value());
  EXPECT_EQ(got[0].record->step, 10);
  EXPECT_TRUE(got[0].error.empty());
  // A waiter blocked in Next() is woken by the report itself.
  auto waiter = std::async(std::launch::async, [&] { return w.Next(); });
  EXPECT_EQ(waiter.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout);
  w.Finished(Rec(2, 20, true));
  ASSERT_EQ(waiter.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  auto second = waiter.get();
  ASSERT_TRUE(second.has_value());
  ASSERT_EQ(second->size(), 1u);
  EXPECT_EQ((*second)[0].counter, 2u);
  w.Stop();
  EXPECT_FALSE(w.Next().has_value());
}

TEST(CommitWatch, AFailedCheckpointIsAnIOErrorASupersededOrAbandonedOneIsCancelled) {
  EXPECT_EQ(CommitWatch::Outcome(Rec(3, 7, false, "IO error: disk full")).kind, Kind::kFailed);
  EXPECT_EQ(CommitWatch::Outcome(Rec(3, 7, false, "IO error: disk full")).error,
            "checkpoint of step 7 failed: IO error: disk full");
  EXPECT_EQ(CommitWatch::Outcome(Rec(3, 7, false)).error, "checkpoint of step 7 failed: failed");
  EXPECT_EQ(CommitWatch::Outcome(Rec(3, 7, false, "superseded by a newer checkpoint")).kind,
            Kind::kCancelled);
  EXPECT_EQ(CommitWatch::Outcome(Rec(3, 7, false, "abandoned for a newer checkpoint")).kind,
            Kind::kCancelled);
}

TEST(CommitWatch, KeepsTheLast64UntrackedRecords) {
  CommitWatch w(false);
  for (uint64_t c = 1; c <= 65; ++c) w.Finished(Rec(c, static_cast<int64_t>(c), true));
  w.Track(1, 1);  // dropped: the oldest of 65
  w.Track(2, 2);
  auto got = NextNow(w);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].counter, 2u);
  auto left = w.Abandon("closed");
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(left[0].counter, 1u);
}

TEST(CommitWatch, WithAgreementACommitSettlesOnlyOnceItsStepIsAgreed) {
  CommitWatch w(true);
  w.Track(1, 5);
  w.Track(2, 6);
  w.Track(3, 7);
  w.Finished(Rec(1, 5, true));
  w.Finished(Rec(2, 6, true));
  w.Finished(Rec(3, 7, false, "IO error: x"));  // a failure needs no agreement
  auto got = NextNow(w);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].counter, 3u);
  EXPECT_EQ(got[0].kind, Kind::kFailed);
  w.Agreed(4);  // below both: nothing
  w.Agreed(5);
  got = NextNow(w);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].counter, 1u);
  EXPECT_EQ(got[0].kind, Kind::kCommitted);
  // Tracked after the agreement passed its step: settles at once.
  w.Track(4, 5);
  w.Finished(Rec(4, 5, true));
  got = NextNow(w);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].counter, 4u);
  // Closing before step 6 is agreed: its outcome is unknown.
  auto left = w.Abandon("its outcome is unknown: the checkpointer closed first");
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(left[0].counter, 2u);
  EXPECT_EQ(left[0].kind, Kind::kCancelled);
  EXPECT_FALSE(left[0].record.has_value());
  EXPECT_EQ(left[0].error,
            "checkpoint of step 6: its outcome is unknown: the checkpointer closed first");
  EXPECT_FALSE(w.Next().has_value());
}

TEST(CommitWatch, StopWakesTheWaiterAfterWhatIsSettledAndAbandonReturnsTheRest) {
  CommitWatch w(false);
  w.Track(1, 1);
  w.Track(2, 2);
  auto waiter = std::async(std::launch::async, [&] { return w.Next(); });
  EXPECT_EQ(waiter.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout);
  w.Stop();
  ASSERT_EQ(waiter.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_FALSE(waiter.get().has_value());
  w.Finished(Rec(1, 1, true));  // after the stop: still delivered, by Next or Abandon
  auto got = w.Next();
  ASSERT_TRUE(got.has_value());
  ASSERT_EQ(got->size(), 1u);
  w.Finished(Rec(2, 2, true));
  auto left = w.Abandon("why");
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(left[0].kind, Kind::kCommitted);  // settled: its real outcome
}

TEST(CommitWatch, AnEngineReportsItsCheckpointsAndAgreedStepsAndStopsItOnClose) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() /
                       ("nonstop_commit_watch_test_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  EngineOptions o;
  o.dir = dir.string();
  o.medium = MediumKind::kBuffered;
  o.chunk_bytes = 64 << 10;
  o.staging_bytes = 1 << 20;
  o.extra_slots = 1;
  o.global_agreement = true;
  std::vector<float> data(4096, 1.0f);
  TensorRef t;
  t.spec.name = "x";
  t.spec.dtype = DType::kFloat32;
  t.spec.shape = {4096};
  t.spec.nbytes = data.size() * sizeof(float);
  t.data = data.data();
  auto engine = std::move(Engine::Open(o)).value();
  std::shared_ptr<CommitWatch> w = engine->Watch();
  ASSERT_NE(w, nullptr);
  ASSERT_TRUE(engine->Register({t}).ok());
  auto c = engine->Checkpoint(3, "{}");
  ASSERT_TRUE(c.ok());
  w->Track(*c, 3);
  ASSERT_TRUE(engine->WaitCommitted(*c).ok());
  auto pending = std::async(std::launch::async, [&] { return w->Next(); });
  EXPECT_EQ(pending.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout)
      << "committed but not agreed on";
  AgreedRecord rec;
  rec.step = 3;
  rec.counter = static_cast<int64_t>(*c);
  rec.lineage = 1;
  ASSERT_TRUE(engine->WriteAgreed(rec).ok());
  ASSERT_EQ(pending.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  auto got = pending.get();
  ASSERT_TRUE(got.has_value());
  ASSERT_EQ(got->size(), 1u);
  EXPECT_EQ((*got)[0].counter, *c);
  EXPECT_EQ((*got)[0].kind, Kind::kCommitted);
  EXPECT_GT((*got)[0].record->bytes, 0u);
  auto waiter = std::async(std::launch::async, [&] { return w->Next(); });
  ASSERT_TRUE(engine->Close().ok());
  ASSERT_EQ(waiter.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_FALSE(waiter.get().has_value());
  engine.reset();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace nonstop
