// The plain-path remote (tier/path_transport.h) on the fault-injecting Env,
// alone and under a RemoteTier: objects round-trip; listing skips temps and
// links; a failed fsync of an uploaded part is never renamed into place, so
// the step is never committed over it; a link planted in the root is never
// followed (not listed, not read, not written through, not deleted through);
// delete removes emptied step directories; Abort stops a throttled upload.
#include "tier/path_transport.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "env/fault_env.h"
#include "jobdir/remote_layout.h"
#include "tier/remote_tier.h"

namespace nonstop::tier {
namespace {

namespace rl = nonstop::remote;

class PathTransportTest : public ::testing::Test {
 protected:
  PathTransportTest() : env_(FaultEnv::Create()), t_(env_.get(), "/remote", 4096) {}

  // A file of `n` bytes at /job/staged/NAME (an uploader's staged copy).
  std::string Stage(const std::string& name, size_t n) {
    std::string data(n, '\0');
    for (size_t i = 0; i < n; ++i) data[i] = static_cast<char>(i * 7 + 3);
    auto d = env_->OpenDirectory("/job/staged", true).value();
    auto m = d->CreateFile(name, MediumKind::kBuffered, MediumOptions{}).value();
    EXPECT_TRUE(m->Write(0, data.data(), data.size()).ok());
    EXPECT_TRUE(m->Sync().ok());
    return data;
  }

  std::vector<std::string> Keys(const std::string& prefix = "") {
    std::vector<std::string> out;
    std::vector<StoredObject> listed = t_.List(prefix).value();
    for (const StoredObject& o : listed) out.push_back(o.key);
    return out;
  }

  std::shared_ptr<FaultEnv> env_;
  PathTransport t_;
};

TEST_F(PathTransportTest, ObjectsRoundTripAndListingSkipsTemps) {
  const std::string data = Stage("rank-00000.nsck", 10000);
  ASSERT_TRUE(t_.PutFile(rl::PartKey(7, 0), "/job/staged", "rank-00000.nsck", 0).ok());
  ASSERT_TRUE(t_.PutBytes(rl::JobKey(), "job-a").ok());
  EXPECT_EQ(t_.GetBytes(rl::PartKey(7, 0), 1 << 20).value(), data);
  EXPECT_EQ(t_.GetBytes(rl::JobKey(), 100).value(), "job-a");
  EXPECT_EQ(t_.GetBytes(rl::PartKey(7, 0), 100).status().code(), StatusCode::kCorruption);
  EXPECT_EQ(t_.GetBytes(rl::MarkerKey(7), 100).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(t_.GetBytes("step-000000000099/x", 100).status().code(), StatusCode::kNotFound);
  std::string got;
  uint64_t size = 0;
  int chunks = 0;
  ASSERT_TRUE(t_.GetChunks(rl::PartKey(7, 0), [&](uint64_t s) { size = s; return Status::OK(); },
                           [&](std::string_view c) {
                             got.append(c);
                             ++chunks;
                             return Status::OK();
                           }).ok());
  EXPECT_EQ(size, data.size());
  EXPECT_EQ(got, data);
  EXPECT_EQ(chunks, 3);  // 4096-byte units
  // a writer's temp left behind is no object
  auto d = env_->OpenDirectory("/remote/" + rl::StepDir(7), false).value();
  ASSERT_TRUE(d->CreateFile("rank-00001.nsck.tmp", MediumKind::kBuffered, {}).ok());
  EXPECT_EQ(Keys(), (std::vector<std::string>{rl::JobKey(), rl::PartKey(7, 0)}));
  EXPECT_EQ(Keys(rl::StepDir(7)), (std::vector<std::string>{rl::PartKey(7, 0)}));
  EXPECT_EQ(t_.List(rl::StepDir(8)).value().size(), 0u);
  PathTransport missing(env_.get(), "/nothing-here");
  EXPECT_EQ(missing.List("").value().size(), 0u);
}

TEST_F(PathTransportTest, AFailedFsyncOfAnUploadedPartIsNeverCommitted) {
  const std::string data = Stage("rank-00000.nsck", 9000);
  RemoteTier tier(&t_, env_.get());
  PublishRequest req{5, 2, 0, 0, 1, "/job/staged", "rank-00000.nsck"};
  env_->InjectError(EnvOp::kSync, 1, EIO);  // the part's fsync
  auto rep = tier.Publish(req, {});
  EXPECT_FALSE(rep.ok() && rep.value().outcome == PublishReport::Outcome::kCommitted);
  EXPECT_EQ(tier.CommittedSteps().value().size(), 0u);
  EXPECT_EQ(t_.GetBytes(rl::PartKey(5, 0), 1 << 20).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(env_->Dump().find(".tmp"), std::string::npos) << env_->Dump();
  EXPECT_EQ(env_->calls(EnvOp::kSync) > 0, true);
  // the retry, the disk well again, commits it
  env_->ClearFaults();
  rep = tier.Publish(req, {});
  ASSERT_TRUE(rep.ok()) << rep.status().message();
  EXPECT_EQ(rep.value().outcome, PublishReport::Outcome::kCommitted);
  EXPECT_EQ(tier.CommittedSteps().value().size(), 1u);
  EXPECT_EQ(t_.GetBytes(rl::PartKey(5, 0), 1 << 20).value(), data);
  ASSERT_TRUE(tier.Fetch(5, 0, "/restore").ok());
}

TEST_F(PathTransportTest, ALinkPlantedInTheRootIsNeverFollowed) {
  auto secret = env_->OpenDirectory("/secret", true).value();
  ASSERT_TRUE(WriteFileAtomic(*secret, "COMMITTED", "precious").ok());
  ASSERT_TRUE(env_->OpenDirectory("/remote", true).ok());
  ASSERT_TRUE(env_->PlantSymlink("/remote", rl::StepDir(9), "/secret").ok());
  ASSERT_TRUE(env_->PlantSymlink("/remote", rl::JobKey(), "/secret/COMMITTED").ok());
  EXPECT_EQ(Keys().size(), 0u);  // neither listed
  EXPECT_EQ(t_.GetBytes(rl::MarkerKey(9), 100).status().code(), StatusCode::kCorruption);
  EXPECT_EQ(t_.GetBytes(rl::JobKey(), 100).status().code(), StatusCode::kCorruption);
  EXPECT_FALSE(t_.GetChunks(rl::MarkerKey(9), [](uint64_t) { return Status::OK(); },
                            [](std::string_view) { return Status::OK(); }).ok());
  EXPECT_FALSE(t_.PutBytes(rl::MarkerKey(9), "x").ok());
  Stage("rank-00000.nsck", 100);
  EXPECT_FALSE(t_.PutFile(rl::PartKey(9, 0), "/job/staged", "rank-00000.nsck", 0).ok());
  EXPECT_TRUE(t_.Delete({rl::MarkerKey(9)}).ok());
  RemoteTier tier(&t_, env_.get());
  EXPECT_EQ(tier.CommittedSteps().value().size(), 0u);
  EXPECT_FALSE(tier.Job().ok());
  EXPECT_EQ(ReadSmallFile(*secret, "COMMITTED", 100).value(), "precious");
  EXPECT_EQ(secret->List().value().size(), 1u);
}

// A listing that cannot stat an object fails: it never leaves it out. Left
// out, step 7's COMMITTED made it look uncommitted, and retention deleted
// its part and manifest but not the marker it had not seen: a committed
// step (one it had to keep) over missing objects (found by
// tests/tier_crash_test.cc).
TEST_F(PathTransportTest, AFailedStatFailsTheListingAndRetentionDeletesNothing) {
  Stage("rank-00000.nsck", 5000);
  RemoteTier tier(&t_, env_.get());
  for (int64_t step : {7, 8}) {
    PublishRequest req{step, static_cast<uint64_t>(step), 0, 0, 1, "/job/staged", "rank-00000.nsck"};
    auto rep = tier.Publish(req, {});
    ASSERT_TRUE(rep.ok()) << rep.status().message();
    ASSERT_EQ(rep.value().outcome, PublishReport::Outcome::kCommitted);
  }
  rl::Retention keep2;
  keep2.max_to_keep = 2;
  // Each of the six objects (two steps: part, manifest, COMMITTED) in turn.
  for (uint64_t n = 1; n <= 6; ++n) {
    env_->InjectError(EnvOp::kStat, n, EIO);
    EXPECT_EQ(t_.List("").status().code(), StatusCode::kIOError) << "stat " << n;
    env_->ClearFaults();
    env_->InjectError(EnvOp::kStat, n, EIO);
    EXPECT_FALSE(tier.Retain(keep2).ok()) << "stat " << n << ":\n" << env_->Dump();
    env_->ClearFaults();
  }
  auto steps = tier.CommittedSteps();
  ASSERT_TRUE(steps.ok());
  EXPECT_EQ(steps.value().size(), 2u);  // both kept: neither is past the newest two
  for (int64_t step : {7, 8}) {
    auto got = tier.Fetch(step, 0, "/restore");
    EXPECT_TRUE(got.ok()) << got.status().message();
  }
}

TEST_F(PathTransportTest, DeleteRemovesEmptiedStepDirectories) {
  ASSERT_TRUE(t_.PutBytes(rl::MarkerKey(3), "m").ok());
  ASSERT_TRUE(t_.PutBytes(rl::ManifestKey(3, 0), "m").ok());
  ASSERT_TRUE(t_.PutBytes(rl::MarkerKey(4), "m").ok());
  ASSERT_TRUE(t_.PutBytes(rl::ManifestKey(4, 0), "m").ok());
  ASSERT_TRUE(t_.Delete({rl::MarkerKey(3), rl::ManifestKey(3, 0), rl::MarkerKey(4),
                         "step-000000000077/missing"}).ok());
  EXPECT_EQ(Keys(), (std::vector<std::string>{rl::ManifestKey(4, 0)}));
  auto root = env_->OpenDirectory("/remote", false).value();
  EXPECT_EQ(root->Stat(rl::StepDir(3)).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(root->Stat(rl::StepDir(4)).ok());  // not empty: kept
}

TEST_F(PathTransportTest, AbortStopsAThrottledUpload) {
  Stage("big", 64 << 10);
  std::thread stop([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    t_.Abort();
  });
  // 64 KiB at 4 KiB/s would take 16 s
  Status s = t_.PutFile("step-000000000001/big", "/job/staged", "big", 4096);
  stop.join();
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.message();
  EXPECT_EQ(t_.GetBytes("step-000000000001/big", 1 << 20).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(Keys().size(), 0u);
}

}  // namespace
}  // namespace nonstop::tier
