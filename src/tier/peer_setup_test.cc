// The peer tier's collective start (tier/peer_setup.h): ranks as threads
// over one in-memory gather, servers on loopback TCP, memory directories on
// the fault-injecting Env. What the ranks decide together (the tier off on
// every rank, no server without a partner in another failure domain, one
// rank's server failure is every rank's note), the agreed secret, the
// partners, and what the servers held at the start.
#include "tier/peer_setup.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "env/fault_env.h"
#include "tier/test_slot_file.h"

namespace nonstop::peer {
namespace {

// Every rank's text, rank 0 first, once every rank gave its own.
class Group {
 public:
  explicit Group(uint32_t n) : texts_(n) {}
  Result<std::vector<std::string>> Gather(uint32_t rank, const std::string& mine) {
    std::unique_lock<std::mutex> l(mu_);
    const uint64_t round = round_;
    texts_[rank] = mine;
    if (++arrived_ == texts_.size()) {
      last_ = texts_;
      arrived_ = 0;
      ++round_;
      cv_.notify_all();
    } else {
      cv_.wait(l, [&] { return round_ != round; });
    }
    ++rounds_[rank];
    return last_;
  }
  int rounds(uint32_t rank) { return rounds_[rank]; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> texts_, last_;
  size_t arrived_ = 0;
  uint64_t round_ = 0;
  std::map<uint32_t, int> rounds_;
};

// Every rank's StartPeers, each on its own thread.
std::vector<Result<PeerStart>> RunRanks(std::vector<SetupRequest> rs) {
  Group g(static_cast<uint32_t>(rs.size()));
  std::vector<Result<PeerStart>> out;
  for (size_t i = 0; i < rs.size(); ++i) out.push_back(Status::Internal("not run"));
  std::vector<std::thread> ts;
  for (size_t i = 0; i < rs.size(); ++i) {
    ts.emplace_back([&, i] {
      out[i] = StartPeers(rs[i], [&](const std::string& mine) {
        return g.Gather(static_cast<uint32_t>(i), mine);
      });
    });
  }
  for (std::thread& t : ts) t.join();
  return out;
}

struct Hosts {
  std::shared_ptr<FaultEnv> env = FaultEnv::Create();
  Hosts() { EXPECT_TRUE(env->OpenDirectory("/job", true).ok()); }
  // Rank `rank` of a job of 2 ranks on host `host` with memory directory `mem`.
  SetupRequest Rank(uint32_t rank, const std::string& host, const std::string& mem) {
    SetupRequest r;
    r.rank = rank;
    r.world = 2;
    r.segment = "seg-" + std::to_string(rank);
    r.job_dir = "/job";
    r.addr = "127.0.0.1";
    r.host = host;
    r.mem_dir = mem;
    r.env = env.get();
    return r;
  }
  // A replica of rank `src` of a job of `world` ranks, held in `mem`.
  void Replica(const std::string& mem, uint32_t world, uint32_t src, int64_t step,
               uint64_t counter) {
    TensorSpec s;
    s.name = "w";
    s.dtype = DType::kFloat32;
    s.shape = {1024};
    s.nbytes = NumElements(s.shape) * DTypeSize(s.dtype);
    const SlotLayout layout = SlotLayout::Plan({s}).value();
    std::vector<uint8_t> data(layout.data_bytes, static_cast<uint8_t>(step));
    ASSERT_TRUE(testing::WriteSlotFile(env.get(), mem, ReplicaName("/job", world, src), layout,
                                       data, {src, world, counter, step, "{}", 64 << 10})
                    .ok());
  }
};

TEST(PeerSetup, TwoHostsStartServersAgreeTheSecretAndSayWhatIsHeld) {
  Hosts h;
  h.Replica("/shm-b", 2, 0, 7, 3);  // rank 0's replica, on rank 1's host
  h.Replica("/shm-a", 4, 2, 5, 9);  // old world 4's ranks 2 and 3
  h.Replica("/shm-b", 4, 3, 5, 9);
  std::vector<Result<PeerStart>> got = RunRanks({h.Rank(0, "a", "/shm-a"), h.Rank(1, "b", "/shm-b")});
  ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
  ASSERT_TRUE(got[1].ok()) << got[1].status().ToString();
  PeerStart &a = *got[0], &b = *got[1];
  for (PeerStart* s : {&a, &b}) {
    EXPECT_EQ(s->note, "");
    EXPECT_EQ(s->replicas, 1);
    EXPECT_EQ(s->hosts, (std::vector<std::string>{"a", "b"}));
    EXPECT_EQ(s->job, "/job");
    EXPECT_EQ(s->secret.size(), 32u);
    ASSERT_NE(s->server, nullptr);
    EXPECT_NE(s->replicator, nullptr);
    EXPECT_TRUE(s->reshard_any);
    ASSERT_EQ(s->other.size(), 2u);  // every server's copies of world 4, by holder
    EXPECT_EQ(s->other[0].holder, 0);
    EXPECT_EQ(s->other[0].held.source_rank, 2u);
    EXPECT_EQ(s->other[1].holder, 1);
    EXPECT_EQ(s->other[1].held.source_rank, 3u);
    EXPECT_EQ(s->other[1].kind, Source::kReplica);
    ASSERT_EQ(s->local.size(), 1u);  // this host's memory directory, read in place
    EXPECT_EQ(s->local[0].holder, -1);
    EXPECT_EQ(s->local[0].held.world_size, 4u);
  }
  EXPECT_EQ(a.secret, b.secret);
  EXPECT_EQ(a.endpoints, b.endpoints);
  EXPECT_EQ(a.endpoints[0], "127.0.0.1:" + std::to_string(a.server->port()));
  EXPECT_EQ(a.endpoints[1], "127.0.0.1:" + std::to_string(b.server->port()));
  EXPECT_EQ(a.partners, std::vector<uint32_t>{1});
  EXPECT_EQ(b.partners, std::vector<uint32_t>{0});
  EXPECT_EQ(a.local[0].path, "/shm-a/" + ReplicaName("/job", 4, 2));
  EXPECT_EQ(a.held, (std::vector<std::tuple<int64_t, uint64_t, uint32_t>>{{7, 3, 1}}));
  EXPECT_TRUE(b.held.empty());
}

TEST(PeerSetup, TheTierIsOffOnEveryRankWhenOneRankWantsNone) {
  Hosts h;
  SetupRequest r1 = h.Rank(1, "b", "/shm-b");
  r1.replicas = 0;
  std::vector<Result<PeerStart>> got = RunRanks({h.Rank(0, "a", "/shm-a"), r1});
  EXPECT_EQ(got[0]->note, "replicas=0 on another rank");
  EXPECT_EQ(got[1]->note, "replicas=0");
  SetupRequest d1 = h.Rank(1, "b", "/shm-b");
  d1.segment = "";
  got = RunRanks({h.Rank(0, "a", "/shm-a"), d1});
  for (Result<PeerStart>& s : got) {
    EXPECT_EQ(s->note, "no memory segment to replicate (tier=\"disk\")");
    EXPECT_EQ(s->replicas, 0);
    EXPECT_EQ(s->server, nullptr);
  }
}

TEST(PeerSetup, OneHostStartsNoServerButSaysWhetherAHostHoldsAnotherWorld) {
  Hosts h;
  h.Replica("/shm-a", 4, 2, 5, 9);
  std::vector<Result<PeerStart>> got = RunRanks({h.Rank(0, "a", "/shm-a"), h.Rank(1, "a", "/shm-b")});
  for (Result<PeerStart>& s : got) {
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_EQ(s->note, "every rank is on one host: no partner in another failure domain");
    EXPECT_EQ(s->server, nullptr);
    EXPECT_TRUE(s->endpoints.empty());
    EXPECT_TRUE(s->reshard_any);  // rank 1's own directory is empty: rank 0's told it
  }
  EXPECT_EQ(got[0]->local.size(), 1u);
  EXPECT_TRUE(got[1]->local.empty());
}

TEST(PeerSetup, ASecretSetOnOneRankOnlyIsRefusedOnEvery) {
  Hosts h;
  SetupRequest r0 = h.Rank(0, "a", "/shm-a");
  r0.env_secret = std::string(32, 'k');
  std::vector<Result<PeerStart>> got = RunRanks({r0, h.Rank(1, "b", "/shm-b")});
  for (Result<PeerStart>& s : got) {
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.status().message().find("only"), std::string::npos) << s.status().ToString();
  }
}

TEST(PeerSetup, OneRanksServerThatCannotStartIsEveryRanksNote) {
  Hosts h;
  SetupRequest r1 = h.Rank(1, "b", "/shm-b");
  r1.addr = "256.0.0.1";
  std::vector<Result<PeerStart>> got = RunRanks({h.Rank(0, "a", "/shm-a"), r1});
  for (Result<PeerStart>& s : got) {
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_EQ(s->note.rfind("rank 1: the peer server cannot start on 256.0.0.1: ", 0), 0u)
        << s->note;
    EXPECT_EQ(s->server, nullptr);  // rank 0's started and was closed
    EXPECT_EQ(s->replicator, nullptr);
    EXPECT_EQ(s->replicas, 0);
    EXPECT_TRUE(s->endpoints.empty());
  }
}

TEST(PeerSetup, ARanksOwnDirectoryIsNamedByJobWhatAndRankAndRemovedWhole) {
  Hosts h;
  Env* env = h.env.get();
  const std::string d = RankDir("/job", "fetched", 3, false, "/shm", env);
  EXPECT_EQ(d, "/shm/" + JobKey("/job") + "-fetched-rank-00003");
  EXPECT_NE(RankDir("/job", "reshard", 3, false, "/shm", env), d);
  EXPECT_NE(RankDir("/job", "fetched", 4, false, "/shm", env), d);
  EXPECT_FALSE(RemoveRankDir("/job", "fetched", 3, "/shm", env));  // not there
  auto tree = [&](const std::string& step) {  // as a fetch leaves it
    for (const std::string& p : {std::string("/shm"), d, d + "/peer", d + "/peer/" + step}) {
      ASSERT_TRUE(env->OpenDirectory(p, true).ok()) << p;
    }
    h.Replica(d + "/peer/" + step, 2, 0, 7, 1);
  };
  tree("step-7");
  EXPECT_EQ(RankDir("/job", "fetched", 3, true, "/shm", env), d);  // fresh: removed
  EXPECT_FALSE(env->OpenDirectory(d, false).ok());
  tree("step-8");
  EXPECT_TRUE(RemoveRankDir("/job", "fetched", 3, "/shm", env));
  EXPECT_FALSE(env->OpenDirectory(d, false).ok());
  EXPECT_TRUE(env->OpenDirectory("/shm", false).ok());  // the memory directory stays
}

TEST(PeerSetup, TheNewestReplicaHeldIsPrefetchedUnlessThisRankHoldsItsStep) {
  Hosts h;
  h.Replica("/shm-b", 2, 0, 7, 3);  // rank 0's replica, on rank 1's host
  std::vector<Result<PeerStart>> got = RunRanks({h.Rank(0, "a", "/shm-a"), h.Rank(1, "b", "/shm-b")});
  ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
  ASSERT_TRUE(got[1].ok()) << got[1].status().ToString();
  const PeerStart& a = *got[0];
  Env* env = h.env.get();
  // This rank's own tiers hold step 7: nothing fetched, nothing to say.
  Prefetched p = PrefetchOwnReplica(a.held, a.endpoints, a.job, a.secret, 0, 2, {7}, "/shm-a", env);
  EXPECT_EQ(p.dir, "");
  EXPECT_EQ(p.why, "");
  EXPECT_FALSE(env->OpenDirectory(RankDir("/job", "fetched", 0, false, "/shm-a", env), false).ok());
  p = PrefetchOwnReplica(a.held, a.endpoints, a.job, a.secret, 0, 2, {5}, "/shm-a", env);
  EXPECT_EQ(p.why, "");
  EXPECT_EQ(p.step, 7);
  EXPECT_EQ(p.counter, 3u);
  EXPECT_EQ(p.holder, 1u);
  EXPECT_EQ(p.dir, PeerStepDir(RankDir("/job", "fetched", 0, false, "/shm-a", env), 7));
  EXPECT_TRUE(env->OpenDirectory(p.dir, false).ok());
  // Rank 1 holds no replica of its own: nothing.
  EXPECT_EQ(PrefetchOwnReplica(got[1]->held, a.endpoints, a.job, a.secret, 1, 2, {}, "/shm-b", env).dir,
            "");
  // Its holder's server gone: why, naming the replica and where it was.
  got[1]->server.reset();
  p = PrefetchOwnReplica(a.held, a.endpoints, a.job, a.secret, 0, 2, {}, "/shm-a", env);
  EXPECT_EQ(p.dir, "");
  EXPECT_NE(p.why.find("the replica of rank 0 step 7 on rank 1 (" + a.endpoints[1] + "): "),
            std::string::npos)
      << p.why;
}

}  // namespace
}  // namespace nonstop::peer
