// The reshard's gather of old ranks' copies (tier/peer_gather.h): where each
// old rank's copy comes from (this host's memory in place, another host's
// server, the remote tier), the planner's order, the fallback past a copy
// that does not verify, one fetch per host (the remote's too), and the one
// line that names every old rank without a copy.
#include "tier/peer_gather.h"

#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>

#include "env/fault_env.h"
#include "store/format.h"
#include "tier/peer.h"
#include "tier/remote_tier.h"
#include "tier/test_slot_file.h"

namespace nonstop::peer {
namespace {

constexpr char kJob[] = "job-g";
const std::string kSecret = "0123456789abcdef0123456789abcdef";
constexpr uint32_t kChunk = 64 << 10;

SlotLayout Layout() {
  TensorSpec s;
  s.name = "w";
  s.dtype = DType::kFloat32;
  s.shape = {64, 1024};
  s.nbytes = NumElements(s.shape) * DTypeSize(s.dtype);
  return SlotLayout::Plan({s}).value();
}

// A one-slot file `name` in `dir` holding checkpoint (counter, step) of old
// rank `rank` of world 4.
void Write(Env* env, const std::string& dir, const std::string& name, uint32_t rank,
           uint64_t counter, int64_t step) {
  const SlotLayout layout = Layout();
  std::vector<uint8_t> data(layout.data_bytes);
  std::mt19937_64 rng(static_cast<uint64_t>(step) * 31 + rank);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  ASSERT_TRUE(testing::WriteSlotFile(env, dir, name, layout, data,
                                     {rank, 4, counter, step, "{}", kChunk})
                  .ok());
}

void FlipByte(Env* env, const std::string& dir, const std::string& name) {
  auto d = env->OpenDirectory(dir, false).value();
  auto m = d->OpenFile(name, MediumKind::kBuffered, {}).value();
  auto f = SlotFile::Open(
               d->OpenFile(name, MediumKind::kBuffered, {.create = false, .read_only = true}).value())
               .value();
  const uint64_t off = f->SlotOffset(0) + 100000;
  uint8_t b = 0;
  ASSERT_TRUE(m->Read(off, &b, 1).ok());
  b ^= 0x10;
  ASSERT_TRUE(m->Write(off, &b, 1).ok());
}

// Another host: a server holding old rank 2's replica of step 30.
struct OtherHost {
  std::shared_ptr<FaultEnv> env = FaultEnv::Create();
  std::unique_ptr<PeerServer> s;
  OtherHost() {
    Write(env.get(), "/seg", "r2.nsck", 2, 3, 30);
    PeerServerOptions o;
    o.job = kJob;
    o.secret = kSecret;
    o.bind_host = "127.0.0.1";
    o.dir = "/shm";
    o.env = env.get();
    s = std::move(PeerServer::Start(o)).value();
    PushOptions p;
    EXPECT_EQ(PushNewest(s->endpoint(), kJob, kSecret, "/seg/r2.nsck", p, env.get()).value(),
              PushOutcome::kStored);
  }
};

GatherCopy Copy(uint32_t rank, int64_t step, uint64_t counter, Source kind, int holder,
                std::string path = "") {
  GatherCopy c;
  c.held = HeldReplica{rank, 4, step, counter, 0};
  c.kind = kind;
  c.holder = holder;
  c.path = std::move(path);
  return c;
}

GatherRequest Request(Env* env, const std::vector<std::string>& endpoints) {
  GatherRequest r;
  r.job_dir = "/job";
  r.job = kJob;
  r.secret = kSecret;
  r.endpoints = endpoints;
  r.mem_dir = "/mem";
  r.fallback_dir = "/mem/mine";
  r.holder = "rank 0 pid 1";
  r.env = env;
  r.timeout_s = 10;
  r.wait_s = 10;
  return r;
}

// Old ranks 0, 1 on this rank's disk; old rank 3 in this host's memory (its
// segment, read in place); old rank 2's replica here damaged: taken from the
// other host's server instead, and said.
TEST(PeerGatherTest, EachOldRankComesFromItsFirstCopyThatVerifies) {
  OtherHost other;
  auto env = FaultEnv::Create();
  Write(env.get(), "/job/world-4", "rank-00000.nsck", 0, 3, 30);
  Write(env.get(), "/job/world-4", "rank-00001.nsck", 1, 3, 30);
  Write(env.get(), "/mem", "seg3", 3, 3, 30);
  Write(env.get(), "/mem", "rep2", 2, 3, 30);
  FlipByte(env.get(), "/mem", "rep2");
  GatherRequest r = Request(env.get(), {"x:1", other.s->endpoint()});
  r.copies = {Copy(3, 30, 3, Source::kSegment, -1, "/mem/seg3"),
              Copy(2, 30, 3, Source::kReplica, -1, "/mem/rep2"),
              Copy(2, 30, 3, Source::kReplica, 1)};
  GatherResult g = GatherOldShards(r);
  EXPECT_EQ(g.missing, "");
  EXPECT_EQ(g.from["4/0"], "disk");
  EXPECT_EQ(g.from["4/1"], "disk");
  EXPECT_EQ(g.from["4/3"], "own memory segment (/mem/seg3) step 30");
  EXPECT_EQ(g.from["4/2"], "peer replica on rank 1 (" + other.s->endpoint() + ") step 30");
  ASSERT_EQ(g.files.size(), 2u);
  const std::string shared = "/mem/" + SharedReshardDir(kJob);
  EXPECT_EQ(g.files[0], std::make_tuple(4u, 2u, shared + "/w4-s30-c3/rank-00002.nsck"));
  EXPECT_EQ(g.files[1], std::make_tuple(4u, 3u, std::string("/mem/seg3")));
  EXPECT_EQ(g.dir, shared);
  EXPECT_GT(g.bytes, 0u);
  EXPECT_EQ(g.shared, 0u);
  EXPECT_TRUE(VerifyLocal(std::get<2>(g.files[0]), 2, 30, env.get()).ok());
}

// At one step the planner's order (memory before disk); a step every old
// rank has a copy of comes before a newer one only some have.
TEST(PeerGatherTest, OnlyAStepEveryMissingOldRankHoldsIsTriedInThePlannersOrder) {
  auto env = FaultEnv::Create();
  Write(env.get(), "/mem", "a2", 2, 3, 30);
  Write(env.get(), "/mem", "a3", 3, 3, 30);
  Write(env.get(), "/mem", "b3", 3, 5, 50);  // newer, but old rank 2 has no step 50
  GatherRequest r = Request(env.get(), {});
  for (uint32_t k : {0u, 1u}) Write(env.get(), "/job/world-4", SlotFileName(k), k, 3, 30);
  r.copies = {Copy(3, 50, 5, Source::kReplica, -1, "/mem/b3"),
              Copy(2, 30, 3, Source::kReplica, -1, "/mem/a2"),
              Copy(3, 30, 3, Source::kReplica, -1, "/mem/a3")};
  GatherResult g = GatherOldShards(r);
  EXPECT_EQ(g.missing, "");
  EXPECT_EQ(g.from["4/3"], "own memory replica (/mem/a3) step 30");
  EXPECT_EQ(g.from["4/2"], "own memory replica (/mem/a2) step 30");
  EXPECT_EQ(g.files.size(), 2u);  // step 50 never tried
}

// Nothing to take: every old rank without a copy named in one line, and why.
TEST(PeerGatherTest, EveryOldRankWithoutACopyIsNamedWithWhy) {
  auto env = FaultEnv::Create();
  Write(env.get(), "/mem", "rep2", 2, 3, 30);
  Write(env.get(), "/mem", "rep3", 3, 3, 30);
  FlipByte(env.get(), "/mem", "rep2");
  GatherRequest r = Request(env.get(), {});
  r.copies = {Copy(2, 30, 3, Source::kReplica, -1, "/mem/rep2")};
  r.remote_error = "the remote tier s3://b cannot be listed: down";
  GatherResult g = GatherOldShards(r);
  EXPECT_EQ(g.missing,
            "old rank 0 of world size 4: on no surviving peer; the remote tier s3://b cannot be "
            "listed: down; old rank 1 of world size 4: on no surviving peer; the remote tier "
            "s3://b cannot be listed: down; old rank 2 of world size 4: no step held for every "
            "old rank; the remote tier s3://b cannot be listed: down; old rank 3 of world size "
            "4: on no surviving peer; the remote tier s3://b cannot be listed: down");
  EXPECT_TRUE(g.files.empty());
  // Old ranks 0, 1, 3 on the disk: the damaged copy of 2 is why.
  for (uint32_t k : {0u, 1u, 3u}) Write(env.get(), "/job/world-4", SlotFileName(k), k, 3, 30);
  g = GatherOldShards(r);
  EXPECT_EQ(g.missing.rfind("old rank 2 of world size 4: its replica in this host's memory "
                            "(/mem/rep2): ", 0), 0u) << g.missing;
  EXPECT_EQ(g.missing.find(";"), std::string::npos) << g.missing;
}

// Two ranks of one host (threads) gather old world 4 whose old rank 3 only
// the remote tier holds (step 70; old ranks 0-2 on the disk, OldRanksOnDisk):
// each GatherResult, and how many fetches ran.
void OldRanksOnDisk(Env* env) {
  for (uint32_t k : {0u, 1u, 2u}) Write(env, "/job/world-4", SlotFileName(k), k, 7, 70);
}
struct TwoRanks {
  GatherResult got[2];
  std::atomic<int> fetches{0};
};
void GatherOnOneHost(Env* env, TwoRanks& t) {
  const auto fetch = [&](int64_t step, uint32_t rank, const std::string& dir) -> Result<std::string> {
    ++t.fetches;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the other rank waits meanwhile
    const std::string at = tier::LocalStepDir(dir, step);  // as RemoteTier::Fetch writes
    Write(env, at, SlotFileName(static_cast<int>(rank)), rank, 7, step);
    return at;
  };
  std::thread ranks[2];
  for (int i = 0; i < 2; ++i) {
    ranks[i] = std::thread([&, i] {
      GatherRequest r = Request(env, {});
      r.holder = "rank " + std::to_string(i) + " pid 1";
      r.fallback_dir = "/mem/mine-" + std::to_string(i);
      r.copies = {Copy(0, 70, 7, Source::kReplica, -1, "/nowhere")};  // a copy of old world 4
      r.remote_steps = {{4, 70, 7}};
      r.remote_url = "s3://b/job";
      r.remote_fetch = fetch;
      t.got[i] = GatherOldShards(r);
    });
  }
  for (auto& th : ranks) th.join();
}

// The remote tier's part of an old rank that two ranks of one host need:
// fetched once (the first rank), the other takes its copy and says who
// fetched it.
TEST(PeerGatherTest, ARemotePartIsFetchedOncePerHost) {
  auto env = FaultEnv::Create();
  OldRanksOnDisk(env.get());
  TwoRanks t;
  GatherOnOneHost(env.get(), t);
  EXPECT_EQ(t.fetches.load(), 1);
  int by_other = 0;
  for (const GatherResult& g : t.got) {
    EXPECT_EQ(g.missing, "");
    const std::string& from = g.from.at("4/3");
    EXPECT_EQ(from.rfind("remote (s3://b/job)", 0), 0u) << from;
    EXPECT_NE(from.find("step 70"), std::string::npos) << from;
    if (from.find(" fetched by rank ") != std::string::npos) ++by_other;
    ASSERT_EQ(g.files.size(), 1u);
    EXPECT_EQ(std::get<2>(g.files[0]), std::get<2>(t.got[0].files[0]));
  }
  EXPECT_EQ(by_other, 1);
  EXPECT_EQ(t.got[0].shared + t.got[1].shared, 1u);
}

// The copy fetched once for both ranks of a host stays while either still
// holds it: the rank done first (its reshard read it, or failed on that rank
// alone) leaves it for the other, which still reads it; the last one removes
// the host's directory. A holder that died (its lock gone with it) holds
// nothing, and what a killed job left goes with the next gather's last.
TEST(PeerGatherTest, TheHostsSharedCopyGoesOnlyWithItsLastHolder) {
  auto env = FaultEnv::Create();
  OldRanksOnDisk(env.get());
  TwoRanks t;
  GatherOnOneHost(env.get(), t);
  const std::string shared = "/mem/" + SharedReshardDir(kJob);
  const std::string path = std::get<2>(t.got[1].files.at(0));
  ASSERT_EQ(path.rfind(shared + "/", 0), 0u) << path;
  ASSERT_NE(t.got[0].lease, nullptr);
  ASSERT_NE(t.got[1].lease, nullptr);
  EXPECT_EQ(t.got[0].lease->Release().value(), false);  // rank 1 still holds it
  EXPECT_TRUE(VerifyLocal(path, 3, 70, env.get()).ok());
  EXPECT_EQ(t.got[0].lease->Release().value(), false);  // a second release: nothing
  EXPECT_TRUE(VerifyLocal(path, 3, 70, env.get()).ok());
  {  // a third rank of the host that dies holding it
    auto dead = ReshardLease::Take("/mem", kJob, "rank 2 pid 9", env.get(), 10);
    ASSERT_TRUE(dead.ok()) << dead.status().message();
  }
  EXPECT_EQ(t.got[1].lease->Release().value(), true);
  EXPECT_EQ(env->OpenDirectory(shared, false).status().code(), StatusCode::kNotFound);
  // The next gather on this host fetches again, and its holder removes it.
  TwoRanks again;
  GatherOnOneHost(env.get(), again);
  EXPECT_EQ(again.fetches.load(), 1);
  EXPECT_TRUE(VerifyLocal(std::get<2>(again.got[0].files.at(0)), 3, 70, env.get()).ok());
  again.got[0].lease.reset();  // rank 0 killed: its hold gone with it
  EXPECT_EQ(again.got[1].lease->Release().value(), true);
  EXPECT_EQ(env->OpenDirectory(shared, false).status().code(), StatusCode::kNotFound);
  // Copies a killed job left there (no holder alive) go with the next
  // gather's last holder, even one that only read this host's memory in place.
  Write(env.get(), shared + "/w4-s60-c6", "rank-00001.nsck", 1, 6, 60);
  Write(env.get(), "/mem", "rep3", 3, 7, 70);
  GatherRequest r = Request(env.get(), {});
  r.copies = {Copy(3, 70, 7, Source::kReplica, -1, "/mem/rep3")};
  GatherResult g = GatherOldShards(r);
  EXPECT_EQ(g.from["4/3"], "own memory replica (/mem/rep3) step 70");
  ASSERT_NE(g.lease, nullptr);
  EXPECT_EQ(g.lease->Release().value(), true);
  EXPECT_EQ(env->OpenDirectory(shared, false).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace nonstop::peer
