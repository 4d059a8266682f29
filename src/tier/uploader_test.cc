// The remote uploader (tier/uploader.h) over the in-memory transport and the
// fault Env, with put failures and held puts injected: a failed put is
// retried after a growing backoff and then succeeds; every=n uploads each
// selected checkpoint in order and never skips one, not even one whose put
// failed; without it the newest wins and a checkpoint superseded during an
// upload is skipped; close waits for the upload under way, and past
// close_timeout_s aborts it and says so in one line.
#include "tier/uploader.h"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "base/mutex.h"
#include "env/fault_env.h"
#include "nonstop/store.h"
#include "store_test_util.h"
#include "tier/memory_transport.h"

namespace nonstop::tier {
namespace {

using namespace nonstop::testing;  // NOLINT: the store tests' helpers
namespace rl = nonstop::remote;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Waits up to 20 s for `done`.
bool Eventually(const std::function<bool()>& done) {
  const double until = Now() + 20;
  while (!done()) {
    if (Now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

class UploaderTest : public ::testing::Test {
 protected:
  UploaderTest() : env_(FaultEnv::Create()), store_(env_.get()), tier_(&store_, env_.get()) {
    // rank 0's slot file in /job: checkpoint counter c of step 10*c, c = 1..6
    auto job = env_->OpenDirectory("/job", true).value();
    auto m = job->CreateFile(SlotFileName(0), MediumKind::kBuffered, MediumOptions{}).value();
    StoreGeometry g;
    g.slots = 6;
    g.slot_bytes = kTestSlotBytes;
    auto f = SlotFile::Create(std::move(m), g).value();
    for (uint64_t c = 1; c <= 6; ++c) {
      EXPECT_TRUE(WriteAndCommit(*f, MakeCheckpoint(10 * static_cast<int64_t>(c)),
                                 static_cast<uint32_t>(c - 1), c)
                      .ok());
    }
  }

  UploaderOptions Options() {
    UploaderOptions o;
    o.job_dir = "/job";
    o.retention.max_to_keep = 10;
    o.poll_s = 0.01;
    o.retry_max_s = 0.05;
    o.close_timeout_s = 20;
    o.nice = 0;
    return o;
  }

  std::unique_ptr<RemoteUploader> Start(const UploaderOptions& o) {
    auto u = RemoteUploader::Start(&tier_, env_.get(), o,
                                   [this]() -> Result<std::optional<UploadTarget>> {
                                     MutexLock l(&mu_);
                                     return newest_;
                                   });
    EXPECT_TRUE(u.ok()) << u.status().message();
    return std::move(u).value();
  }

  // The engine's newest committed checkpoint is now counter c (step 10*c).
  void Committed(uint64_t c) {
    MutexLock l(&mu_);
    newest_ = UploadTarget{c, 10 * static_cast<int64_t>(c)};
  }

  bool Marker(int64_t step) { return store_.Has(rl::MarkerKey(step)); }
  bool Part(int64_t step) { return store_.Has(rl::PartKey(step, 0)); }

  std::shared_ptr<FaultEnv> env_;
  MemoryTransport store_;
  RemoteTier tier_;
  Mutex mu_;
  std::optional<UploadTarget> newest_ GUARDED_BY(mu_);
};

TEST_F(UploaderTest, AFailedPutIsRetriedAfterAGrowingBackoffThenSucceeds) {
  UploaderOptions o = Options();
  o.retry_max_s = 0.3;  // backoff 0.2, 0.3, 0.3 s: at least 0.8 s for three failures
  store_.FailNextPuts(3);
  Committed(2);
  const double t0 = Now();
  auto u = Start(o);
  u->Started(2, 20);
  ASSERT_TRUE(Eventually([&] { return u->Stats().uploaded_step == 20; }));
  const double took = Now() - t0;
  UploaderStats s = u->Stats();
  EXPECT_EQ(s.retries, 3u);
  EXPECT_EQ(s.committed, 1u);
  EXPECT_EQ(s.failures, 0u);
  EXPECT_GE(took, 0.75);  // backed off (no backoff: milliseconds)
  // the last failure in one line: the step and the store's first line
  EXPECT_EQ(s.last_error, "step 20: mem://bucket/job: the store went away");
  EXPECT_TRUE(Marker(20));
  EXPECT_TRUE(u->Close(true).ok());
}

TEST_F(UploaderTest, EveryNUploadsEachSelectedOneInOrderNeverSkipping) {
  UploaderOptions o = Options();
  o.every = 2;
  auto u = Start(o);
  store_.FailNextPuts(2);  // the first selected one's put fails twice
  for (uint64_t c = 1; c <= 6; ++c) {
    u->BeforeSave();
    Committed(c);
    u->Started(c, 10 * static_cast<int64_t>(c));
  }
  ASSERT_TRUE(u->Close(true).ok());
  UploaderStats s = u->Stats();
  EXPECT_EQ(s.committed, 3u) << s.last_error;
  EXPECT_EQ(s.retries, 2u);
  EXPECT_EQ(s.given_up, 0u);
  for (int64_t step : {20, 40, 60}) EXPECT_TRUE(Marker(step)) << step;
  for (int64_t step : {10, 30, 50}) EXPECT_FALSE(Part(step)) << step;
  EXPECT_EQ(s.uploaded_step, 60);
}

TEST_F(UploaderTest, TheNewestWinsAndASupersededCheckpointIsSkipped) {
  store_.HoldPuts();
  Committed(1);
  auto u = Start(Options());
  u->Started(1, 10);
  ASSERT_TRUE(Eventually([&] { return store_.held() == 1; }));  // step 10 uploading
  EXPECT_EQ(u->Stats().uploading_step, 10);
  Committed(2);
  u->Started(2, 20);
  Committed(3);
  u->Started(3, 30);
  store_.Release();
  ASSERT_TRUE(Eventually([&] { return u->Stats().uploaded_step == 30; }));
  ASSERT_TRUE(u->Close(true).ok());
  EXPECT_TRUE(Marker(10));
  EXPECT_TRUE(Marker(30));
  EXPECT_FALSE(Part(20));  // superseded while 10 was uploading: never sent
  EXPECT_EQ(u->Stats().uploads, 2u);
}

TEST_F(UploaderTest, CloseUploadsTheNewestStillToUploadAndWaitsForIt) {
  UploaderOptions o = Options();
  o.poll_s = 30;  // never woken by the poll: Close must do it
  store_.HoldPuts();
  Committed(4);
  auto u = Start(o);
  std::thread release([&] {
    ASSERT_TRUE(Eventually([&] { return store_.held() == 1; }));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    store_.Release();
  });
  const double t0 = Now();
  Status s = u->Close(true);
  const double took = Now() - t0;
  release.join();
  EXPECT_TRUE(s.ok()) << s.message();
  EXPECT_GE(took, 0.2);  // it waited for the upload under way
  EXPECT_TRUE(Marker(40));
  EXPECT_FALSE(u->Running());
}

TEST_F(UploaderTest, ClosePastItsTimeoutAbortsTheUploadWithOneLine) {
  UploaderOptions o = Options();
  o.close_timeout_s = 0.3;
  store_.HoldPuts();  // the put never ends by itself; it stops when aborted
  Committed(1);
  auto u = Start(o);
  u->Started(1, 10);
  ASSERT_TRUE(Eventually([&] { return store_.held() == 1; }));
  const double t0 = Now();
  Status s = u->Close(true);
  const double took = Now() - t0;
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.message(),
            "rank 0: remote upload: step 10: mem://bucket/job: upload aborted "
            "(close_timeout_s passed)");
  EXPECT_GE(took, 0.3);
  EXPECT_LT(took, 5.0);
  EXPECT_FALSE(Marker(10));
  EXPECT_FALSE(u->Running());
  EXPECT_EQ(u->Stats().failures, 1u);
}

TEST_F(UploaderTest, ATransferThatCannotStopIsLeftRunningAndSaidSo) {
  UploaderOptions o = Options();
  o.close_timeout_s = 0.1;
  o.abort_grace_s = 0.1;
  store_.HoldPuts(/*ignore_abort=*/true);
  Committed(1);
  auto u = Start(o);
  u->Started(1, 10);
  ASSERT_TRUE(Eventually([&] { return store_.held() == 1; }));
  Status s = u->Close(true);
  EXPECT_EQ(s.message(),
            "rank 0: a remote transfer is still running after close_timeout_s; left to finish "
            "in the background");
  EXPECT_TRUE(u->Running());
  store_.Release();  // the transfer ends; the uploader's destructor joins its thread
  u.reset();
}

TEST_F(UploaderTest, BeforeSaveWaitsForTheStagingCopyAndGivesUpOnOneNeverCommitted) {
  UploaderOptions o = Options();
  o.every = 1;
  o.commit_timeout_s = 0.3;
  store_.HoldPuts();
  auto u = Start(o);
  Committed(1);
  u->Started(1, 10);
  u->BeforeSave();  // returns once counter 1 is staged, not when it is uploaded
  EXPECT_NE(env_->Dump().find("f job/remote/step-000000000010/rank-00000.nsck"),
            std::string::npos);
  ASSERT_TRUE(Eventually([&] { return store_.held() == 1; }));  // its put, held
  EXPECT_EQ(u->Stats().given_up, 0u);
  u->Started(2, 20);  // never committed (newest stays 1)
  const double t0 = Now();
  u->BeforeSave();
  EXPECT_GE(Now() - t0, 0.3);
  UploaderStats s = u->Stats();
  EXPECT_EQ(s.given_up, 1u);
  EXPECT_EQ(s.last_error, "step 20: not copied for upload within commit_timeout_s");
  store_.Release();
  EXPECT_TRUE(u->Close(true).ok());
  EXPECT_TRUE(Marker(10));
}

TEST_F(UploaderTest, OptionsOutOfRangeAreRefused) {
  UploaderOptions o = Options();
  o.retention.max_to_keep = 0;
  auto u = RemoteUploader::Start(&tier_, env_.get(), o, [] {
    return Result<std::optional<UploadTarget>>(std::optional<UploadTarget>());
  });
  EXPECT_EQ(u.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace nonstop::tier
