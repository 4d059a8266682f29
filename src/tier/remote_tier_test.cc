// The remote tier (tier/remote_tier.h) over an in-memory Transport and the
// fault-injecting Env: a fetch verifies the size and every unit's crc32
// and leaves nothing behind when the store or the disk fails; damaged
// markers are skipped; retention deletes marker first and finishes a
// deletion cut short; the JOB document refuses another job's prefix.
#include "tier/remote_tier.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "env/fault_env.h"
#include "tier/memory_transport.h"
#include "nonstop/store.h"
#include "store_test_util.h"

namespace nonstop::tier {
namespace {

namespace rl = nonstop::remote;

uint32_t Crc(std::string_view b) {
  return static_cast<uint32_t>(crc32_z(0, reinterpret_cast<const Bytef*>(b.data()), b.size()));
}

class RemoteTierTest : public ::testing::Test {
 protected:
  RemoteTierTest() : env_(FaultEnv::Create()), store_(env_.get()), tier_(&store_, env_.get()) {}

  // A committed step as an uploader leaves it: part, manifest, marker.
  std::string Commit(int64_t step, uint64_t counter, int64_t lineage = 0, size_t bytes = 10000,
                     uint32_t world = 1) {
    std::string part(bytes, '\0');
    for (size_t i = 0; i < bytes; ++i) part[i] = static_cast<char>((i * 31 + step) & 0xff);
    std::vector<rl::Manifest> mans;
    for (uint32_t r = 0; r < world; ++r) {
      rl::Manifest m;
      m.step = step;
      m.counter = counter;
      m.rank = r;
      m.world_size = world;
      m.lineage = lineage;
      m.bytes = bytes;
      m.part_bytes = 4096;
      for (size_t at = 0; at < bytes; at += 4096) {
        m.part_crc32.push_back(Crc(std::string_view(part).substr(at, 4096)));
      }
      store_.objects[rl::PartKey(step, r)] = part;
      store_.objects[rl::ManifestKey(step, r)] = rl::EncodeManifest(m, 1.0);
      mans.push_back(m);
    }
    rl::Doc d;
    d.step = step;
    d.world_size = world;
    d.lineage = lineage;
    d.counter = counter;
    store_.objects[rl::MarkerKey(step)] = rl::EncodeMarker(d, mans, 1.0);
    return part;
  }

  std::string ReadLocal(const std::string& dir, const std::string& name) {
    auto d = env_->OpenDirectory(dir, false);
    EXPECT_TRUE(d.ok()) << d.status().message();
    MediumOptions ro;
    ro.read_only = true;
    auto m = d.value()->OpenFile(name, MediumKind::kBuffered, ro);
    EXPECT_TRUE(m.ok()) << m.status().message();
    std::string out(m.value()->Size(), '\0');
    EXPECT_TRUE(m.value()->Read(0, out.data(), out.size()).ok());
    return out;
  }

  // The names in the fetch directory of step `step`.
  std::vector<std::string> Fetched(int64_t step) {
    std::vector<std::string> out;
    auto d = env_->OpenDirectory("/job/remote/" + rl::StepDir(step), false);
    if (!d.ok()) return out;
    Result<std::vector<DirEntry>> list = d.value()->List();
    if (!list.ok()) return out;
    for (const DirEntry& e : list.value()) out.push_back(e.name);
    return out;
  }

  std::shared_ptr<FaultEnv> env_;
  MemoryTransport store_;
  RemoteTier tier_;
};

TEST_F(RemoteTierTest, FetchVerifiesAndWritesTheOneSlotCopy) {
  const std::string part = Commit(7, 3);
  Result<std::string> got = tier_.Fetch(7, 0, "/job");
  ASSERT_TRUE(got.ok()) << got.status().message();
  EXPECT_EQ(got.value(), "/job/remote/step-000000000007");
  EXPECT_EQ(ReadLocal(got.value(), "rank-00000.nsck"), part);
  EXPECT_EQ(Fetched(7), std::vector<std::string>{"rank-00000.nsck"});
  // a second fetch replaces the first copy
  ASSERT_TRUE(tier_.Fetch(7, 0, "/job").ok());
  EXPECT_EQ(Fetched(7), std::vector<std::string>{"rank-00000.nsck"});
}

TEST_F(RemoteTierTest, FetchRefusesAPartWithABadChecksumAndLeavesNothing) {
  Commit(7, 3);
  store_.objects[rl::PartKey(7, 0)][5000] ^= 1;  // one bit in the second unit
  Result<std::string> got = tier_.Fetch(7, 0, "/job");
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(got.status().message(),
            "mem://bucket/job/step-000000000007: rank 0's part 1 (bytes 4096..) crc mismatch: "
            "damaged in the store");
  EXPECT_TRUE(Fetched(7).empty());  // the temp file is gone, no copy named as fetched
}

TEST_F(RemoteTierTest, FetchRefusesWhatIsNotCommittedOrDoesNotMatch) {
  Commit(7, 3);
  store_.objects.erase(rl::MarkerKey(7));
  Result<std::string> got = tier_.Fetch(7, 0, "/job");
  EXPECT_EQ(got.status().message(),
            "mem://bucket/job/step-000000000007 is not committed (no COMMITTED marker)");
  Commit(8, 4);
  store_.objects[rl::PartKey(8, 0)].resize(9000);  // cut short in the store
  got = tier_.Fetch(8, 0, "/job");
  EXPECT_EQ(got.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(got.status().message(), "mem://bucket/job/step-000000000008: rank 0's part is 9000 "
                                    "bytes, the manifest says 10000");
  Commit(9, 5);
  store_.objects.erase(rl::PartKey(9, 0));
  EXPECT_EQ(tier_.Fetch(9, 0, "/job").status().message(),
            "mem://bucket/job/step-000000000009: rank 0's part is missing");
  Commit(10, 6);
  store_.objects.erase(rl::ManifestKey(10, 0));
  EXPECT_EQ(tier_.Fetch(10, 0, "/job").status().message(),
            "mem://bucket/job/step-000000000010: rank 0's manifest is missing");
  Commit(11, 7, /*lineage=*/1);
  Commit(12, 8, /*lineage=*/2);
  store_.objects[rl::MarkerKey(11)] = store_.objects[rl::MarkerKey(12)];  // another step's
  EXPECT_EQ(tier_.Fetch(11, 0, "/job").status().code(), StatusCode::kCorruption);
  EXPECT_EQ(tier_.Fetch(12, 1, "/job").status().code(), StatusCode::kCorruption);  // no rank 1
}

TEST_F(RemoteTierTest, AStoreOrDiskFailingMidFetchLeavesNoFile) {
  Commit(7, 3);
  store_.fail_chunk_from = 1;  // the connection goes after the first unit
  Result<std::string> got = tier_.Fetch(7, 0, "/job");
  EXPECT_EQ(got.status().code(), StatusCode::kIOError);
  EXPECT_TRUE(Fetched(7).empty());
  store_.fail_chunk_from = -1;
  env_->InjectError(EnvOp::kSync, 1, 5);  // EIO on the copy's fsync
  got = tier_.Fetch(7, 0, "/job");
  EXPECT_EQ(got.status().code(), StatusCode::kIOError) << got.status().message();
  EXPECT_TRUE(Fetched(7).empty());  // never renamed into place
  env_->ClearFaults();
  EXPECT_TRUE(tier_.Fetch(7, 0, "/job").ok());
}

TEST_F(RemoteTierTest, FetchRemovesALinkPlantedAtTheCopysNameNeverFollowingIt) {
  Commit(7, 3);
  ASSERT_TRUE(env_->OpenDirectory("/job/remote/step-000000000007", true).ok());
  ASSERT_TRUE(env_->OpenDirectory("/outside", true).ok());
  ASSERT_TRUE(env_->PlantSymlink("/job/remote/step-000000000007", "rank-00000.nsck",
                                 "/outside/precious").ok());
  ASSERT_TRUE(tier_.Fetch(7, 0, "/job").ok());
  EXPECT_NE(env_->Dump().find("f job/remote/step-000000000007/rank-00000.nsck 10000"),
            std::string::npos)
      << env_->Dump();
}

TEST_F(RemoteTierTest, ListAndCommittedStepsSkipDamagedMarkers) {
  Commit(3, 1);
  Commit(5, 2);
  Commit(9, 3);
  store_.objects[rl::MarkerKey(5)] = "{not json";
  store_.objects.erase(rl::MarkerKey(9));  // an upload under way
  std::vector<std::string> damaged;
  auto steps = tier_.CommittedSteps(&damaged);
  ASSERT_TRUE(steps.ok());
  ASSERT_EQ(steps.value().size(), 1u);
  EXPECT_EQ(steps.value()[0].first, 3);
  EXPECT_EQ(steps.value()[0].second.counter, 1u);
  ASSERT_EQ(damaged.size(), 1u);
  EXPECT_NE(damaged[0].find("step-000000000005/COMMITTED"), std::string::npos) << damaged[0];
  auto held = tier_.List(0);
  ASSERT_TRUE(held.ok());
  ASSERT_EQ(held.value().size(), 3u);
  EXPECT_EQ(held.value()[0].step, 9);
  EXPECT_EQ(held.value()[0].state, StepState::kUncommitted);
  EXPECT_EQ(held.value()[1].state, StepState::kDamaged);
  EXPECT_EQ(held.value()[2].state, StepState::kCommitted);
  EXPECT_EQ(held.value()[2].bytes, 10000u);
  // every object of a step, the ranks whose part is there, and why the
  // asked rank cannot read a step
  EXPECT_EQ(held.value()[2].objects, 3u);  // part, manifest, marker
  EXPECT_EQ(held.value()[2].total_bytes, 10000u + store_.objects[rl::ManifestKey(3, 0)].size() +
                                             store_.objects[rl::MarkerKey(3)].size());
  EXPECT_EQ(held.value()[2].ranks, std::vector<uint32_t>{0});
  EXPECT_EQ(held.value()[2].note, "");
  EXPECT_NE(held.value()[0].note.find("no COMMITTED marker"), std::string::npos);
  EXPECT_NE(held.value()[1].note.find("does not parse"), std::string::npos);
  auto of_rank1 = tier_.List(1);
  ASSERT_TRUE(of_rank1.ok());
  EXPECT_EQ(of_rank1.value()[2].note, "committed by 1 rank(s): no rank 1");
  EXPECT_EQ(of_rank1.value()[2].bytes, 0u);
  store_.fail_list_from = 0;
  EXPECT_EQ(tier_.CommittedSteps().status().code(), StatusCode::kIOError);
}

TEST_F(RemoteTierTest, FetchAllFetchesEveryRankOfTheCommitsWorld) {
  Commit(7, 3, /*lineage=*/4, 10000, /*world=*/3);
  auto dir = tier_.FetchAll(7, "/job");
  ASSERT_TRUE(dir.ok()) << dir.status().ToString();
  EXPECT_EQ(dir.value(), LocalStepDir("/job", 7));
  std::vector<std::string> got = Fetched(7);
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<std::string>{"rank-00000.nsck", "rank-00001.nsck",
                                           "rank-00002.nsck"}));
  store_.objects.erase(rl::PartKey(7, 2));  // one rank's part gone: the step fails
  EXPECT_EQ(tier_.FetchAll(7, "/job2").status().code(), StatusCode::kCorruption);
  EXPECT_EQ(tier_.FetchAll(8, "/job2").status().code(), StatusCode::kCorruption);  // no marker
}

TEST_F(RemoteTierTest, RetentionDeletesMarkerFirstAndFinishesACutShortDeletion) {
  for (int s = 0; s < 4; ++s) Commit(s, s + 1);
  store_.objects["step-000000000005/rank-00000.nsck"] = "an upload under way";
  store_.fail_delete_from = 1;  // the marker goes, then the store goes away
  Result<int> got = tier_.Retain({2, 0, 0});
  EXPECT_EQ(got.status().code(), StatusCode::kIOError);
  EXPECT_EQ(store_.objects.count(rl::MarkerKey(0)), 0u);
  EXPECT_EQ(store_.objects.count(rl::PartKey(0, 0)), 1u);  // uncommitted now, never read
  auto steps = tier_.CommittedSteps();
  ASSERT_EQ(steps.value().size(), 3u);
  store_.fail_delete_from = -1;
  got = tier_.Retain({2, 0, 0});
  ASSERT_TRUE(got.ok()) << got.status().message();
  EXPECT_EQ(got.value(), 2);  // step 1, and what was left of step 0
  std::vector<std::string> keys;
  for (const auto& [k, v] : store_.objects) keys.push_back(k.substr(0, 17));
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  EXPECT_EQ(keys, (std::vector<std::string>{"step-000000000002", "step-000000000003",
                                            "step-000000000005"}));
  // keep=k: a multiple of k stays (the marker's counter, read once)
  Commit(6, 10);
  Commit(7, 11);
  Commit(8, 12);
  got = tier_.Retain({1, 5, 0});
  ASSERT_TRUE(got.ok());
  auto left = tier_.CommittedSteps();
  std::vector<int64_t> kept;
  for (const auto& [s, d] : left.value()) kept.push_back(s);
  EXPECT_EQ(kept, (std::vector<int64_t>{8, 6}));  // newest, and counter 10
}

TEST_F(RemoteTierTest, ClaimRefusesAnotherJobsPrefixUnlessAdopted) {
  ASSERT_TRUE(tier_.Claim("job-a", false, 1.0).ok());
  EXPECT_TRUE(tier_.Claim("job-a", false, 2.0).ok());
  Status s = tier_.Claim("job-b", false, 3.0);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "the remote mem://bucket/job belongs to job 'job-a', not to this job 'job-b': pass "
            "remote_options={'adopt': True} to take its checkpoints over, or "
            "remote_options={'job': 'job-a'} if this is that job");
  ASSERT_TRUE(tier_.Claim("job-b", true, 4.0).ok());
  EXPECT_EQ(tier_.Claim("job-a", false, 5.0).code(), StatusCode::kFailedPrecondition);
  store_.objects[rl::JobKey()] = "garbage";
  EXPECT_EQ(tier_.Claim("job-b", false, 6.0).code(), StatusCode::kCorruption);
  EXPECT_EQ(tier_.Job().status().code(), StatusCode::kCorruption);
  store_.objects.erase(rl::JobKey());
  EXPECT_EQ(tier_.Job().value(), std::nullopt);
  ASSERT_TRUE(tier_.Claim("job-c", false, 7.0).ok());
  EXPECT_EQ(tier_.Job().value(), std::optional<std::string>("job-c"));
}

// A staged one-slot copy of `bytes` bytes (the uploader's staging), in the
// fault Env at /job/remote/step-N/rank-R.nsck; returns the request.
PublishRequest Stage(FaultEnv* env, int64_t step, uint64_t counter, int64_t lineage, uint32_t rank,
                     uint32_t world, std::string* bytes_out, size_t n = 9000, char seed = 1) {
  PublishRequest req;
  req.step = step;
  req.counter = counter;
  req.lineage = lineage;
  req.rank = rank;
  req.world_size = world;
  req.dir = "/job/remote/" + rl::StepDir(step);
  const std::string key = rl::PartKey(step, rank);
  req.name = key.substr(key.find('/') + 1);
  std::string data(n, '\0');
  for (size_t i = 0; i < n; ++i) data[i] = static_cast<char>(i * 7 + seed);
  auto d = env->OpenDirectory(req.dir, true).value();
  (void)d->Unlink(req.name);
  auto m = d->CreateFile(req.name, MediumKind::kBuffered, MediumOptions{}).value();
  EXPECT_TRUE(m->Write(0, data.data(), data.size()).ok());
  EXPECT_TRUE(m->Sync().ok());
  if (bytes_out != nullptr) *bytes_out = data;
  return req;
}

using Outcome = PublishReport::Outcome;

TEST_F(RemoteTierTest, PublishUploadsCommitsAndSkipsWhatIsThere) {
  std::string data;
  PublishRequest req = Stage(env_.get(), 7, 3, 0, 0, 1, &data);
  auto rep = tier_.Publish(req, {});
  ASSERT_TRUE(rep.ok()) << rep.status().message();
  EXPECT_EQ(rep.value().outcome, Outcome::kCommitted);
  EXPECT_EQ(rep.value().bytes, 9000u);
  auto got = tier_.Fetch(7, 0, "/fetched");
  ASSERT_TRUE(got.ok()) << got.status().message();
  EXPECT_EQ(ReadLocal(got.value(), "rank-00000.nsck"), data);
  EXPECT_EQ(tier_.Publish(req, {}).value().outcome, Outcome::kSkippedExisting);
}

TEST_F(RemoteTierTest, AMarkerOfAnAbandonedFutureIsNeverTakenForTheNewCheckpoint) {
  // issue 23 case 3: step 19 committed by checkpoint 5 of the future a
  // rollback left; the new checkpoint 9 of step 19 is uploaded, not skipped
  Commit(19, 5);
  std::string data;
  PublishRequest req = Stage(env_.get(), 19, 9, 0, 0, 1, &data, 9000, 3);
  // cut short after the old marker went: the step is uncommitted, never a
  // marker over a mix of old and new objects
  store_.fail_put_from = 0;
  EXPECT_EQ(tier_.Publish(req, {}).status().code(), StatusCode::kIOError);
  EXPECT_EQ(store_.objects.count(rl::MarkerKey(19)), 0u);
  EXPECT_EQ(tier_.Fetch(19, 0, "/fetched").status().code(), StatusCode::kCorruption);
  store_.fail_put_from = -1;
  auto rep = tier_.Publish(req, {});
  ASSERT_TRUE(rep.ok()) << rep.status().message();
  EXPECT_EQ(rep.value().outcome, Outcome::kCommitted);
  auto steps = tier_.CommittedSteps().value();
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].second.counter, 9u);
  EXPECT_EQ(ReadLocal(tier_.Fetch(19, 0, "/fetched").value(), "rank-00000.nsck"), data);

  // distributed: the old marker is of another lineage (run)
  Commit(29, 5, /*lineage=*/1, 10000, /*world=*/2);
  PublishRequest r1 = Stage(env_.get(), 29, 12, 2, 1, 2, nullptr);
  PublishRequest r0 = Stage(env_.get(), 29, 12, 2, 0, 2, nullptr);
  EXPECT_EQ(tier_.Publish(r1, {}).value().outcome, Outcome::kUploaded);
  rep = tier_.Publish(r0, {});
  ASSERT_TRUE(rep.ok()) << rep.status().message();
  EXPECT_EQ(rep.value().outcome, Outcome::kCommitted);
  auto doc = rl::DecodeDoc(store_.objects[rl::MarkerKey(29)], "m").value();
  EXPECT_EQ(doc.lineage, 2);
  EXPECT_EQ(doc.counter, 12u);
  EXPECT_EQ(store_.objects.count(rl::LeadKey(29)), 1u);
}

TEST_F(RemoteTierTest, APutFailingMidStepLeavesTheStepUncommitted) {
  PublishRequest req = Stage(env_.get(), 4, 2, 0, 0, 1, nullptr);
  store_.fail_put_from = 1;  // the part goes up, its manifest does not
  auto rep = tier_.Publish(req, {});
  EXPECT_EQ(rep.status().code(), StatusCode::kIOError);
  EXPECT_EQ(store_.objects.count(rl::PartKey(4, 0)), 1u);
  EXPECT_EQ(store_.objects.count(rl::MarkerKey(4)), 0u);
  EXPECT_TRUE(tier_.CommittedSteps().value().empty());
  store_.fail_put_from = -1;
  EXPECT_EQ(tier_.Publish(req, {}).value().outcome, Outcome::kCommitted);  // the retry
}

TEST_F(RemoteTierTest, RankZeroWaitsForEveryRankGivesUpOnASkipNoteAndStops) {
  PublishRequest r0 = Stage(env_.get(), 5, 2, 7, 0, 2, nullptr);
  PublishOptions fast;
  fast.commit_timeout_s = 0.2;
  auto rep = tier_.Publish(r0, fast);
  ASSERT_TRUE(rep.ok()) << rep.status().message();
  EXPECT_EQ(rep.value().outcome, Outcome::kNotCommitted);
  EXPECT_EQ(rep.value().error, "step 5: only ranks [0] of 2 uploaded; not committed");
  EXPECT_EQ(store_.objects.count(rl::MarkerKey(5)), 0u);
  // rank 1 says it no longer holds step 5: given up at once
  rl::Doc skip;
  skip.step = 5;
  skip.world_size = 2;
  skip.lineage = 7;
  skip.rank = 1;
  store_.objects[rl::SkipKey(5, 1)] = rl::EncodeSkip(skip, 1.0);
  EXPECT_EQ(tier_.Publish(r0, {}).value().outcome, Outcome::kGivenUp);
  // closing: the wait ends at Stop's deadline, not commit_timeout_s
  PublishRequest r6 = Stage(env_.get(), 6, 3, 7, 0, 2, nullptr);
  tier_.Stop(0);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(tier_.Publish(r6, {}).value().outcome, Outcome::kNotCommitted);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

// rank 1's slot file in /job: step 2 (counter 1) and step 4 (counter 2),
// both of run 5.
void FollowerSlotFile(FaultEnv* env) {
  using namespace nonstop::testing;  // NOLINT: the store tests' helpers
  auto job = env->OpenDirectory("/job", true).value();
  auto m = job->CreateFile(SlotFileName(1), MediumKind::kBuffered, MediumOptions{}).value();
  StoreGeometry g;
  g.slots = 2;
  g.slot_bytes = kTestSlotBytes;
  g.rank = 1;
  g.world_size = 2;
  auto f = SlotFile::Create(std::move(m), g).value();
  for (int i = 0; i < 2; ++i) {
    TestCheckpoint c = MakeCheckpoint(2 + 2 * i);
    c.meta_json = "{\"dist\": {\"lineage\": 5}}";
    ASSERT_TRUE(WriteAndCommit(*f, c, i, i + 1).ok());
  }
}

void Lead(MemoryTransport& store, int64_t step, int64_t lineage) {
  rl::Doc d;
  d.step = step;
  d.world_size = 2;
  d.lineage = lineage;
  store.objects[rl::LeadKey(step)] = rl::EncodeLead(d, 1.0);
}

TEST_F(RemoteTierTest, AFollowerUploadsWhatRankZeroLeadsAndSaysWhatItNoLongerHolds) {
  FollowerSlotFile(env_.get());
  using Pick = std::optional<std::pair<uint64_t, int64_t>>;
  EXPECT_EQ(tier_.Follow("/job", 1, 2, 4, std::nullopt).value(), Pick());  // nothing led
  Lead(store_, 4, 9);  // a LEAD of an abandoned run: never followed, no note
  EXPECT_EQ(tier_.Follow("/job", 1, 2, 4, std::nullopt).value(), Pick());
  EXPECT_EQ(tier_.skipped_gone(), 0u);
  Lead(store_, 4, 5);
  EXPECT_EQ(tier_.Follow("/job", 1, 2, 4, std::nullopt).value(), Pick(std::make_pair(2u, 4)));
  EXPECT_EQ(tier_.Follow("/job", 1, 2, 4, 4).value(), Pick());  // uploaded already
  EXPECT_EQ(tier_.Follow("/job", 1, 2, 2, std::nullopt).value(), Pick());  // newer than target
  // rank 0 leads step 3 of this run, which this rank's ring no longer holds
  Lead(store_, 3, 5);
  store_.objects.erase(rl::LeadKey(4));
  EXPECT_EQ(tier_.Follow("/job", 1, 2, 4, std::nullopt).value(), Pick());
  ASSERT_EQ(store_.objects.count(rl::SkipKey(3, 1)), 1u);
  auto note = rl::DecodeDoc(store_.objects[rl::SkipKey(3, 1)], "skip").value();
  EXPECT_EQ(note.lineage, 5);
  EXPECT_EQ(note.rank, 1u);
  EXPECT_EQ(tier_.skipped_gone(), 1u);
  EXPECT_EQ(tier_.Follow("/job", 1, 2, 4, std::nullopt).value(), Pick());
  EXPECT_EQ(tier_.skipped_gone(), 1u);  // said once
  // and rank 0, waiting for step 3, gives it up at once
  PublishRequest r0 = Stage(env_.get(), 3, 7, 5, 0, 2, nullptr);
  EXPECT_EQ(tier_.Publish(r0, {}).value().outcome, Outcome::kGivenUp);
}

}  // namespace
}  // namespace nonstop::tier
