// The peer tier (tier/peer.h) over loopback TCP, with the files of every side
// on fault-injecting Envs (src/env/fault_env.h): push then fetch bit for bit,
// newest-wins, the budget, partner choice, a damaged replica, hostile frames,
// a transfer cut after every k bytes and a crash at every file call of the
// server's store -- none of which may leave a replica that lists as complete,
// and the previous complete replica stays fetchable.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <cstring>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include "env/fault_env.h"
#include "jobdir/records.h"
#include "nonstop/jobdir.h"
#include "store/format.h"
#include "tier/peer.h"
#include "tier/peer_wire.h"
#include "tier/test_slot_file.h"
#include "tier/uploader.h"

namespace nonstop::peer {
namespace {

// What a fetch asks for (the test's own Source below is a pushing rank).
constexpr nonstop::peer::Source kFromReplica = nonstop::peer::Source::kReplica;
constexpr nonstop::peer::Source kFromSegment = nonstop::peer::Source::kSegment;
constexpr nonstop::peer::Source kFromDisk = nonstop::peer::Source::kDisk;

constexpr char kJob[] = "job-a";
const std::string kSecret = "0123456789abcdef0123456789abcdef";  // 32 bytes
constexpr uint32_t kChunk = 64 << 10;

TensorSpec Spec(std::string name, DType dt, std::vector<int64_t> shape) {
  TensorSpec s;
  s.name = std::move(name);
  s.dtype = dt;
  s.shape = std::move(shape);
  s.nbytes = NumElements(s.shape) * DTypeSize(dt);
  return s;
}

SlotLayout Layout() {
  return SlotLayout::Plan({Spec("w", DType::kFloat32, {64, 1024}), Spec("b", DType::kFloat32, {10}),
                           Spec("step", DType::kInt64, {})})
      .value();
}

std::vector<uint8_t> Data(const SlotLayout& layout, int64_t step) {
  std::vector<uint8_t> d(layout.data_bytes, 0);
  std::mt19937_64 rng(static_cast<uint64_t>(step) * 7919 + 1);
  for (auto& b : d) b = static_cast<uint8_t>(rng());
  return d;
}

// Writes a one-slot file `name` in `dir` of `env` holding checkpoint
// (counter, step) of rank `rank`, under a temp name renamed over it (as the
// memory tier replaces its segment).
void WriteSegment(Env* env, const std::string& dir, const std::string& name, uint32_t rank,
                  uint64_t counter, int64_t step, uint32_t world = 4) {
  const SlotLayout layout = Layout();
  ASSERT_TRUE(testing::WriteSlotFile(env, dir, name, layout, Data(layout, step),
                                     {rank, world, counter, step,
                                      "{\"step\":" + std::to_string(step) + "}", kChunk})
                  .ok());
}

// The data, step and metadata of the newest committed checkpoint of file
// `path` (verified); step -1 when there is none.
struct Read {
  int64_t step = -1;
  uint64_t counter = 0;
  std::vector<uint8_t> data;
  std::string meta;
};
Read ReadBack(Env* env, const std::string& dir, const std::string& name) {
  Read r;
  auto d = env->OpenDirectory(dir, false);
  if (!d.ok()) return r;
  MediumOptions ro;
  ro.read_only = true;
  auto m = d.value()->OpenFile(name, MediumKind::kBuffered, ro);
  if (!m.ok()) return r;
  auto f = SlotFile::Open(std::move(m).value());
  if (!f.ok()) return r;
  auto rep = f.value()->Scan();
  if (!rep.ok() || rep.value().newest_valid < 0) return r;
  const CheckpointInfo& info = rep.value().checkpoints[rep.value().newest_valid].info;
  r.data.resize(info.data_bytes);
  if (!f.value()->ReadData(info, 0, r.data.data(), r.data.size()).ok()) return r;
  r.step = info.step;
  r.counter = info.counter;
  r.meta = info.meta_json;
  return r;
}

struct Server {
  std::shared_ptr<FaultEnv> env = FaultEnv::Create();
  std::unique_ptr<PeerServer> s;
  std::string secret = kSecret;
  double io_timeout_s = 5;
  std::vector<std::string> segments;  // own segments served
  std::string job_dir;                // the job directory served ("": none)
  explicit Server(uint64_t budget = 0, std::shared_ptr<FaultEnv> e = nullptr,
                  std::string key = kSecret, double io_timeout = 5,
                  std::vector<std::string> segs = {}, std::string jobd = "")
      : secret(std::move(key)), io_timeout_s(io_timeout) {
    if (e) env = std::move(e);
    segments = std::move(segs);
    job_dir = std::move(jobd);
    Start(budget);
  }
  void Start(uint64_t budget = 0) {
    PeerServerOptions o;
    o.segments = segments;
    o.job_dir = job_dir;
    o.job = kJob;
    o.secret = secret;
    o.bind_host = "127.0.0.1";
    o.dir = "/shm";
    o.budget_bytes = budget;
    o.io_timeout_s = io_timeout_s;
    o.env = env.get();
    auto r = PeerServer::Start(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    s = std::move(r).value();
  }
  std::string ep() const { return s->endpoint(); }
};

// A source: segments of rank `rank` on their own Env.
struct Source {
  std::shared_ptr<FaultEnv> env = FaultEnv::Create();
  uint32_t rank;
  std::string secret = kSecret;
  uint32_t world = 4;
  explicit Source(uint32_t r = 1, uint32_t w = 4) : rank(r), world(w) {}
  std::string path() const { return "/seg/s.nsck"; }
  void Commit(uint64_t counter, int64_t step) {
    WriteSegment(env.get(), "/seg", "s.nsck", rank, counter, step, world);
  }
  Result<PushOutcome> Push(const std::string& ep, double io_timeout_s = 5) {
    PushOptions o;
    o.io_timeout_s = io_timeout_s;
    return PushNewest(ep, kJob, secret, path(), o, env.get());
  }
};

// Fetches `rank`'s replica from `ep` into a fresh Env; the data read back.
Read FetchBack(const std::string& ep, uint32_t rank, std::optional<int64_t> step, Status* st) {
  auto env = FaultEnv::Create();
  Result<std::string> dir = FetchReplica(ep, kJob, kSecret, 4, rank, step, "/local", env.get(), 10);
  *st = dir.status();
  if (!dir.ok()) return {};
  return ReadBack(env.get(), dir.value(), SlotFileName(static_cast<int>(rank)));
}

TEST(PeerTest, PushThenFetchIsBitwise) {
  Server srv;
  Source src(1);
  src.Commit(3, 30);
  auto out = src.Push(srv.ep());
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out.value(), PushOutcome::kStored);
  auto held = ListReplicas(srv.ep(), kJob, kSecret);
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  ASSERT_EQ(held.value().size(), 1u);
  EXPECT_EQ(held.value()[0].source_rank, 1u);
  EXPECT_EQ(held.value()[0].step, 30);
  EXPECT_EQ(held.value()[0].counter, 3u);
  EXPECT_EQ(held.value()[0].world_size, 4u);
  // The replica file is in the memory directory under its name.
  EXPECT_EQ(ReadBack(srv.env.get(), "/shm", ReplicaName(kJob, 4, 1)).step, 30);
  Status st;
  Read r = FetchBack(srv.ep(), 1, std::nullopt, &st);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(r.step, 30);
  EXPECT_EQ(r.counter, 3u);
  EXPECT_EQ(r.meta, "{\"step\":30}");
  EXPECT_EQ(r.data, Data(Layout(), 30));
  // The same checkpoint again is not sent again.
  out = src.Push(srv.ep());
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out.value(), PushOutcome::kAlreadyHeld);
  PeerServerStats ss = srv.s->stats();
  EXPECT_EQ(ss.replicas_received, 1u);
  EXPECT_EQ(ss.fetches_served, 1u);
  EXPECT_EQ(ss.held, 1u);
  // Another job, an unknown rank, a step it does not hold.
  EXPECT_EQ(ListReplicas(srv.ep(), "job-b", kSecret).status().code(), StatusCode::kFailedPrecondition);
  FetchBack(srv.ep(), 2, std::nullopt, &st);
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
  FetchBack(srv.ep(), 1, 20, &st);
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
}

TEST(PeerTest, TheNewestReplaces) {
  Server srv;
  Source src(2);
  src.Commit(3, 30);
  ASSERT_TRUE(src.Push(srv.ep()).ok());
  src.Commit(4, 40);
  ASSERT_EQ(src.Push(srv.ep()).value(), PushOutcome::kStored);
  auto held = ListReplicas(srv.ep(), kJob, kSecret).value();
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0].step, 40);
  Status st;
  EXPECT_EQ(FetchBack(srv.ep(), 2, 40, &st).data, Data(Layout(), 40));
  EXPECT_TRUE(st.ok()) << st.ToString();
  FetchBack(srv.ep(), 2, 30, &st);
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
}

TEST(PeerTest, TheReplicatorSendsTheNewestOnly) {
  Server srv;
  Source src(1);
  ReplicatorOptions o;
  o.job = kJob;
  o.secret = kSecret;
  o.rank = 1;
  o.segment = src.path();
  o.partners = {srv.ep()};
  o.poll_s = 0.01;
  o.env = src.env.get();
  auto rep = Replicator::Start(o).value();
  ASSERT_TRUE(rep->Drain(10));  // no segment yet: nothing to send, not an error
  EXPECT_EQ(rep->stats().replicated, 0u);
  EXPECT_EQ(rep->stats().last_step, -1);
  EXPECT_EQ(rep->stats().lag_s_last, -1);  // no push yet: no age
  src.Commit(1, 10);
  rep->Notify();
  ASSERT_TRUE(rep->Drain(10));
  EXPECT_EQ(rep->stats().last_step, 10);
  // Three commits while it is not looking: only the newest goes.
  src.Commit(2, 20);
  src.Commit(3, 30);
  src.Commit(4, 40);
  ASSERT_TRUE(rep->Drain(10));
  ReplicatorStats st = rep->stats();
  EXPECT_EQ(st.last_step, 40);
  EXPECT_EQ(st.last_counter, 4u);
  EXPECT_LE(st.replicated, 4u);
  EXPECT_GE(st.replicated, 2u);
  EXPECT_EQ(st.failures, 0u) << st.last_error;
  EXPECT_EQ(ListReplicas(srv.ep(), kJob, kSecret).value().at(0).step, 40);
  rep->Close();
  // A partner that is gone: a failure counted, retried later, Drain returns.
  srv.s->Close();
  src.Commit(5, 50);
  o.retry_s = 0.01;
  o.push.connect_timeout_s = 1;
  rep = Replicator::Start(o).value();
  ASSERT_TRUE(rep->Drain(10));
  EXPECT_GE(rep->stats().failures, 1u);
  EXPECT_EQ(rep->stats().last_step, -1);
  EXPECT_FALSE(rep->stats().last_error.empty());
}

// The nice values of this process's threads (/proc/self/task through the Env).
std::multiset<int> ThreadNices() {
  std::multiset<int> out;
  auto dir = DefaultEnv()->OpenDirectory("/proc/self/task", false);
  if (!dir.ok()) return out;
  auto entries = dir.value()->List();
  if (!entries.ok()) return out;
  for (const DirEntry& e : entries.value()) {
    errno = 0;
    const int n = ::getpriority(PRIO_PROCESS, static_cast<id_t>(std::atoi(e.name.c_str())));
    if (errno == 0) out.insert(n);
  }
  return out;
}

// A server whose receiving threads run at `srv_nice` and a replicator at
// `rep_nice` that pushed checkpoint 1 (step 10) to it; both threads live on
// (the replicator keeps its connection).
struct NicedPush {
  std::shared_ptr<FaultEnv> env = FaultEnv::Create();
  std::unique_ptr<PeerServer> srv;
  Source src{1};
  std::unique_ptr<Replicator> rep;
  void Start(int srv_nice, int rep_nice) {
    PeerServerOptions so;
    so.job = kJob;
    so.secret = kSecret;
    so.bind_host = "127.0.0.1";
    so.dir = "/shm";
    so.env = env.get();
    so.nice = srv_nice;
    srv = PeerServer::Start(so).value();
    src.Commit(1, 10);
    ReplicatorOptions o;
    o.job = kJob;
    o.secret = kSecret;
    o.rank = 1;
    o.segment = src.path();
    o.partners = {srv->endpoint()};
    o.poll_s = 0.01;
    o.env = src.env.get();
    o.nice = rep_nice;
    rep = Replicator::Start(o).value();
    ASSERT_TRUE(rep->Drain(10));
    ASSERT_EQ(rep->stats().last_step, 10) << rep->stats().last_error;
  }
  // A fetch of the replica: the pushed bytes.
  void FetchesBitwise() {
    Status st;
    EXPECT_EQ(FetchBack(srv->endpoint(), 1, std::nullopt, &st).data, Data(Layout(), 10));
    EXPECT_TRUE(st.ok()) << st.ToString();
  }
};

TEST(PeerTest, ReplicationRunsAtALowerCpuPriority) {
  // The replicator's thread and the server's thread that receives a push
  // yield the CPU to training (peer.h: ReplicatorOptions::nice,
  // PeerServerOptions::nice); a fetch is served at the caller's priority.
  errno = 0;
  const int base = ::getpriority(PRIO_PROCESS, 0);  // this process's (a test run under nice)
  if (errno != 0 || base > 10) GTEST_SKIP() << "running at nice " << base;
  const int rep_nice = base + 5, srv_nice = base + 7;
  const std::multiset<int> before = ThreadNices();
  ASSERT_FALSE(before.empty());
  ASSERT_EQ(before.count(rep_nice) + before.count(srv_nice), 0u);
  NicedPush n;
  ASSERT_NO_FATAL_FAILURE(n.Start(7, 5));
  const std::multiset<int> during = ThreadNices();
  EXPECT_EQ(during.count(rep_nice), 1u) << "the replicator's thread";
  EXPECT_EQ(during.count(srv_nice), 1u) << "the server's thread that received the push";
  // A fetch's connection is not lowered.
  n.FetchesBitwise();
  EXPECT_EQ(ThreadNices().count(srv_nice), 1u);
}

// How many of this process's threads are in the SCHED_IDLE class.
int IdleThreads() {
  int out = 0;
  auto dir = DefaultEnv()->OpenDirectory("/proc/self/task", false);
  if (!dir.ok()) return out;
  auto entries = dir.value()->List();
  if (!entries.ok()) return out;
  for (const DirEntry& e : entries.value()) {
    if (::sched_getscheduler(static_cast<pid_t>(std::atoi(e.name.c_str()))) == SCHED_IDLE) ++out;
  }
  return out;
}

TEST(PeerTest, IdleNicePutsTheReplicationThreadsInSchedIdle) {
  // nice tier::kIdleNice (Python peer_nice="idle"): the replicator's thread
  // and the server's thread that receives its push run in SCHED_IDLE.
  ASSERT_EQ(IdleThreads(), 0);
  NicedPush n;
  ASSERT_NO_FATAL_FAILURE(n.Start(tier::kIdleNice, tier::kIdleNice));
  EXPECT_EQ(IdleThreads(), 2) << "the replicator's thread and the server's receiving thread";
  n.FetchesBitwise();
}

TEST(PeerTest, APacedPushCompletesBitwiseAtItsPaceAndSaysItsAge) {
  // ReplicatorOptions::bps: a push's frames paced. The replica is the same
  // bytes, it arrives no sooner than its bytes at that pace allow, on a new
  // connection and on the one kept, and the stats say how old the
  // checkpoint was when its partner held it.
  Server srv;
  Source src(1);
  const uint64_t data_bytes = Data(Layout(), 10).size();
  ReplicatorOptions o;
  o.job = kJob;
  o.secret = kSecret;
  o.rank = 1;
  o.segment = src.path();
  o.partners = {srv.ep()};
  o.poll_s = 0.01;
  o.env = src.env.get();
  // One push on a new connection and then one more on the same, timed from
  // the second's commit; the replica fetched back. Returns the two times.
  const auto warm_then_timed = [&](std::unique_ptr<Replicator>& rep, uint64_t counter) {
    src.Commit(counter, static_cast<int64_t>(counter) * 10);
    const auto t_first = std::chrono::steady_clock::now();
    rep = Replicator::Start(o).value();
    EXPECT_TRUE(rep->Drain(30));
    const double first = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_first).count();
    src.Commit(counter + 1, static_cast<int64_t>(counter + 1) * 10);
    const auto t0 = std::chrono::steady_clock::now();
    rep->Notify();
    EXPECT_TRUE(rep->Drain(30));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(rep->stats().last_step, static_cast<int64_t>(counter + 1) * 10) << rep->stats().last_error;
    Status fs;
    EXPECT_EQ(FetchBack(srv.ep(), 1, std::nullopt, &fs).data,
              Data(Layout(), static_cast<int64_t>(counter + 1) * 10));
    EXPECT_TRUE(fs.ok()) << fs.ToString();
    return std::make_pair(first, secs);
  };
  std::unique_ptr<Replicator> rep;
  o.bps = data_bytes;  // one second for the data
  const auto [first, secs] = warm_then_timed(rep, 1);
  ReplicatorStats st = rep->stats();
  EXPECT_EQ(st.replicated, 2u);
  EXPECT_EQ(st.bytes, 2 * data_bytes);
  EXPECT_GE(first, 0.9);  // paced: the second its bytes take at bps
  EXPECT_GE(secs, 0.9);
  EXPECT_GE(st.lag_s_last, 0.9);
  EXPECT_GE(st.lag_s_max, st.lag_s_last);
  EXPECT_LT(st.lag_s_max, 30);
  rep->Close();
  // Without bps: a push spread over spread_s (the commits came faster),
  // never slower than spread_min_bps.
  o.bps = 0;
  o.spread_s = 1;
  o.spread_min_bps = data_bytes / 4;
  EXPECT_GE(warm_then_timed(rep, 3).first, 0.9);
  rep->Close();
  // Unpaced (bps 0, spread_s 0): the same bytes.
  o.spread_s = 0;
  warm_then_timed(rep, 5);
}

TEST(PeerTest, TheReplicatorSkipsCheckpointsWithinItsCadence) {
  Server srv;
  Source src(1);
  ReplicatorOptions o;
  o.job = kJob;
  o.secret = kSecret;
  o.rank = 1;
  o.segment = src.path();
  o.partners = {srv.ep()};
  o.poll_s = 0.01;
  o.env = src.env.get();
  o.every = 3;
  auto rep = Replicator::Start(o).value();
  const auto commit = [&](uint64_t counter) {
    src.Commit(counter, static_cast<int64_t>(counter) * 10);
    ASSERT_TRUE(rep->Drain(10));
  };
  commit(1);  // the first: sent
  EXPECT_EQ(rep->stats().last_step, 10);
  commit(2);
  commit(3);  // within 3 of the one held: not sent
  EXPECT_EQ(rep->stats().last_step, 10);
  EXPECT_EQ(ListReplicas(srv.ep(), kJob, kSecret).value().at(0).step, 10);
  commit(4);  // 3 after it: sent
  ReplicatorStats st = rep->stats();
  EXPECT_EQ(st.last_step, 40);
  EXPECT_EQ(st.replicated, 2u);
  EXPECT_EQ(st.skipped_cadence, 2u);
  EXPECT_EQ(ListReplicas(srv.ep(), kJob, kSecret).value().at(0).step, 40);
}

TEST(PeerTest, AReplicaOverTheBudgetIsSkipped) {
  Source a(1), b(2);
  a.Commit(1, 10);
  b.Commit(1, 10);
  {
    Server tiny(64 << 10);  // smaller than one replica
    EXPECT_EQ(a.Push(tiny.ep()).value(), PushOutcome::kSkippedBudget);
    EXPECT_EQ(tiny.s->stats().replica_skipped_budget, 1u);
    EXPECT_TRUE(ListReplicas(tiny.ep(), kJob, kSecret).value().empty());
  }
  // Room for one replica: the second source's is skipped, the first stays.
  Server srv(800 << 10);
  EXPECT_EQ(a.Push(srv.ep()).value(), PushOutcome::kStored);
  EXPECT_EQ(b.Push(srv.ep()).value(), PushOutcome::kSkippedBudget);
  auto held = ListReplicas(srv.ep(), kJob, kSecret).value();
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0].source_rank, 1u);
  EXPECT_EQ(srv.s->stats().replica_skipped_budget, 1u);
  EXPECT_NE(srv.s->stats().last_error.find("budget"), std::string::npos);
}

TEST(PeerTest, PartnersAreOnOtherHostsAndSpread) {
  // One host: nobody has a partner.
  for (const auto& v : ChoosePartners({"a", "a", "a"}, 1)) EXPECT_TRUE(v.empty());
  EXPECT_TRUE(ChoosePartners({}, 1).empty());
  const std::vector<std::vector<std::string>> worlds = {
      {"a", "a", "b", "b"},
      {"a", "b", "a", "b", "c", "c"},
      {"h0", "h0", "h0", "h0", "h1", "h1", "h1", "h1", "h2", "h2", "h2", "h2"},
      {"a", "b", "b", "b", "c"},
      {"x", "y"}};
  for (const auto& hosts : worlds) {
    std::set<std::string> distinct(hosts.begin(), hosts.end());
    for (int replicas : {0, 1, 2, 3}) {
      auto p = ChoosePartners(hosts, replicas);
      EXPECT_EQ(p, ChoosePartners(hosts, replicas));  // deterministic
      ASSERT_EQ(p.size(), hosts.size());
      std::vector<int> holds(hosts.size(), 0);
      for (size_t r = 0; r < hosts.size(); ++r) {
        const size_t want = std::min<size_t>(replicas, distinct.size() - 1);
        EXPECT_EQ(p[r].size(), want);
        std::set<std::string> used;
        for (uint32_t q : p[r]) {
          ASSERT_LT(q, hosts.size());
          EXPECT_NE(hosts[q], hosts[r]) << "rank " << r << " partnered on its own host";
          EXPECT_TRUE(used.insert(hosts[q]).second) << "two replicas on one host";
          ++holds[q];
        }
      }
      // Hosts of equal size: every rank holds exactly as many as it sends.
      std::map<std::string, int> size;
      for (const auto& h : hosts) ++size[h];
      bool equal = true;
      for (const auto& [h, n] : size) equal = equal && n == size.begin()->second;
      if (equal) {
        for (size_t q = 0; q < hosts.size(); ++q) {
          EXPECT_EQ(holds[q], static_cast<int>(std::min<size_t>(replicas, distinct.size() - 1)));
        }
      }
    }
  }
  // 4 ranks on 2 hosts: each rank's partner is the same local rank on the other host.
  EXPECT_EQ(ChoosePartners({"a", "a", "b", "b"}, 1),
            (std::vector<std::vector<uint32_t>>{{2}, {3}, {0}, {1}}));
}

// Flips one byte of the replica file at `offset` from its end of data.
void FlipReplicaByte(FaultEnv* env, const std::string& name, uint64_t data_byte,
                     const std::string& dir = "/shm") {
  auto d = env->OpenDirectory(dir, false).value();
  auto m = d->OpenFile(name, MediumKind::kBuffered, {}).value();
  auto f = SlotFile::Open(d->OpenFile(name, MediumKind::kBuffered, {.create = false, .read_only = true}).value())
               .value();
  const uint64_t off = f->SlotOffset(0) + data_byte;
  uint8_t b = 0;
  ASSERT_TRUE(m->Read(off, &b, 1).ok());
  b ^= 0x10;
  ASSERT_TRUE(m->Write(off, &b, 1).ok());
  ASSERT_TRUE(m->Sync().ok());
}

TEST(PeerTest, ADamagedReplicaIsRefusedAtFetch) {
  Server srv;
  Source src(1);
  src.Commit(3, 30);
  ASSERT_TRUE(src.Push(srv.ep()).ok());
  FlipReplicaByte(srv.env.get(), ReplicaName(kJob, 4, 1), 200000);
  auto env = FaultEnv::Create();
  Result<std::string> dir = FetchReplica(srv.ep(), kJob, kSecret, 4, 1, std::nullopt, "/local", env.get(), 10);
  ASSERT_FALSE(dir.ok());
  EXPECT_EQ(dir.status().code(), StatusCode::kCorruption) << dir.status().ToString();
  EXPECT_NE(dir.status().message().find("checksum mismatch"), std::string::npos)
      << dir.status().ToString();
  // Nothing under the name a restore would read.
  EXPECT_EQ(ReadBack(env.get(), PeerStepDir("/local", 30), SlotFileName(1)).step, -1);
  EXPECT_EQ(env->Dump().find("rank-00001.nsck\n"), std::string::npos) << env->Dump();
}

// The server's replicas as real files (tmpfs, the default Env): the sender
// sends them straight from a read-only mapping (media::MapForRead), not
// through a buffer. The bytes arrive exact; a byte damaged in the file is
// still caught at the sender's chunk check.
TEST(PeerTest, AReplicaInARealFileIsSentFromItsMappingAndStillChecked) {
  char tmpl[] = "/dev/shm/nonstop-peer-test-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string root = tmpl;
  PeerServerOptions o;
  o.job = kJob;
  o.secret = kSecret;
  o.bind_host = "127.0.0.1";
  o.dir = root;
  o.io_timeout_s = 5;
  o.env = DefaultEnv();
  auto srv = PeerServer::Start(o);
  ASSERT_TRUE(srv.ok()) << srv.status().ToString();
  const std::string ep = srv.value()->endpoint();
  Source src(1);
  src.Commit(3, 30);
  ASSERT_TRUE(src.Push(ep).ok());
  Status st;
  EXPECT_EQ(FetchBack(ep, 1, std::nullopt, &st).data, Data(Layout(), 30));
  ASSERT_TRUE(st.ok()) << st.ToString();
  {  // one byte of the data region, in the file itself
    auto d = DefaultEnv()->OpenDirectory(root, false).value();
    const std::string name = ReplicaName(kJob, 4, 1);
    auto f = SlotFile::Open(d->OpenFile(name, MediumKind::kBuffered, {.create = false, .read_only = true})
                                .value())
                 .value();
    auto m = d->OpenFile(name, MediumKind::kBuffered, {}).value();
    const uint64_t off = f->SlotOffset(0) + 200000;
    uint8_t b = 0;
    ASSERT_TRUE(m->Read(off, &b, 1).ok());
    b ^= 0x10;
    ASSERT_TRUE(m->Write(off, &b, 1).ok());
  }
  FetchBack(ep, 1, std::nullopt, &st);
  EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
  EXPECT_NE(st.message().find("checksum mismatch"), std::string::npos) << st.ToString();
  // Caught by the sender (its reply names its medium, opened read-only),
  // not only by the receiver's own check.
  EXPECT_NE(st.message().find("(read-only): data chunk"), std::string::npos) << st.ToString();
  srv.value().reset();
  std::filesystem::remove_all(root);
}

TEST(PeerTest, ALinkOrAFolderAtTheReplicaNameIsNeverFollowed) {
  Server srv;
  ASSERT_TRUE(srv.env->OpenDirectory("/etc", true).ok());
  ASSERT_TRUE(srv.env->PlantSymlink("/shm", ReplicaName(kJob, 4, 1), "/etc/passwd").ok());
  ASSERT_TRUE(srv.env->PlantSymlink("/shm", ReplicaName(kJob, 4, 2) + ".tmp", "/etc/shadow").ok());
  auto listed = ListReplicas(srv.ep(), kJob, kSecret);
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  EXPECT_TRUE(listed.value().empty());
  Status st;
  FetchBack(srv.ep(), 1, std::nullopt, &st);
  EXPECT_FALSE(st.ok());
  // Pushes replace the links themselves; nothing is written through them.
  Source a(1), b(2);
  a.Commit(1, 10);
  b.Commit(1, 10);
  auto pa = a.Push(srv.ep());
  ASSERT_TRUE(pa.ok()) << pa.status().ToString();
  auto pb = b.Push(srv.ep());
  ASSERT_TRUE(pb.ok()) << pb.status().ToString();
  EXPECT_EQ(ListReplicas(srv.ep(), kJob, kSecret).value().size(), 2u);
  EXPECT_EQ(FetchBack(srv.ep(), 1, std::nullopt, &st).data, Data(Layout(), 10));
  const std::string dump = srv.env->Dump();
  EXPECT_EQ(dump.find("f etc/passwd"), std::string::npos) << dump;
  EXPECT_EQ(dump.find("f etc/shadow"), std::string::npos) << dump;
}

// Raw bytes to the server; whether it closed the connection afterwards.
bool SendsAndIsClosed(const std::string& ep, const std::string& bytes) {
  auto s = wire::Connect(ep, 5, 5);
  EXPECT_TRUE(s.ok());
  if (!s.ok()) return false;
  (void)s.value().SendAll(bytes.data(), bytes.size());
  char c;
  Status r = s.value().RecvAll(&c, 1);
  return !r.ok() && r.message().find("timed out") == std::string::npos;
}

std::string Header(uint32_t magic, uint16_t version, uint16_t type, uint64_t len) {
  std::string h(wire::kHeaderBytes, '\0');
  std::memcpy(h.data(), &magic, 4);
  std::memcpy(h.data() + 4, &version, 2);
  std::memcpy(h.data() + 6, &type, 2);
  std::memcpy(h.data() + 8, &len, 8);
  const uint32_t pcrc = 0, hcrc = Crc32c(h.data(), 20);
  std::memcpy(h.data() + 16, &pcrc, 4);
  std::memcpy(h.data() + 20, &hcrc, 4);
  return h;
}

TEST(PeerTest, HostileFramesAreRefusedBeforeAllocating) {
  // The frame reader alone: a header claiming a terabyte is refused at once
  // (it neither allocates nor waits for the bytes).
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  wire::Socket a(sv[0], "a"), b(sv[1], "b");
  ASSERT_TRUE(b.SetTimeout(5).ok());
  wire::Frame f;
  // Before the handshake: a PUSH of 90 MiB (within the limit after it), a
  // HELLO of a megabyte and a DATA frame of a terabyte.
  for (const auto& [type, len] : std::vector<std::pair<uint16_t, uint64_t>>{
           {1, 90ull << 20}, {9, 1ull << 20}, {2, 1ull << 40}}) {
    const std::string h = Header(wire::kMagic, wire::kVersion, type, len);
    ASSERT_TRUE(a.SendAll(h.data(), h.size()).ok());
    Status st = wire::RecvFrame(b, &f);
    EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
    EXPECT_NE(st.message().find("handshake"), std::string::npos) << st.ToString();
    EXPECT_LT(f.payload.capacity(), 1u << 20);
  }

  // A server whose connections may idle for a minute, but which must close
  // a stranger's at its first header: a client that waits 5 s sees the close.
  Server srv(0, nullptr, kSecret, 60);
  EXPECT_TRUE(SendsAndIsClosed(srv.ep(), Header(0x12345678, wire::kVersion, 9, 10)));
  EXPECT_TRUE(SendsAndIsClosed(srv.ep(), Header(wire::kMagic, 1, 9, 10)));  // the old versions
  EXPECT_TRUE(SendsAndIsClosed(srv.ep(), Header(wire::kMagic, 2, 9, 10)));
  EXPECT_TRUE(SendsAndIsClosed(srv.ep(), Header(wire::kMagic, wire::kVersion, 77, 10)));
  EXPECT_TRUE(SendsAndIsClosed(srv.ep(), Header(wire::kMagic, wire::kVersion, 1, 90ull << 20)));
  EXPECT_TRUE(SendsAndIsClosed(srv.ep(), Header(wire::kMagic, wire::kVersion, 2, 1ull << 40)));
  EXPECT_TRUE(SendsAndIsClosed(srv.ep(), Header(wire::kMagic, wire::kVersion, 9, 1ull << 20)));
  std::string bad_crc = Header(wire::kMagic, wire::kVersion, 9, 0);
  bad_crc[21] ^= 1;
  EXPECT_TRUE(SendsAndIsClosed(srv.ep(), bad_crc));
  EXPECT_GE(srv.s->stats().refused_frames, 8u);
  EXPECT_GE(srv.s->stats().auth_failures, 8u);
  // After the handshake: a push whose table is garbage (its frame checksum
  // and MAC right) is answered with the damage.
  {
    auto s = wire::Connect(srv.ep(), 5, 5).value();
    ASSERT_TRUE(wire::ClientHandshake(s, kJob, kSecret).ok());
    wire::Out o;
    o.Str16(kJob).Bytes(std::string(300, '\x7f'));
    ASSERT_TRUE(wire::SendFrame(s, wire::Type::kPush, o.str()).ok());
    ASSERT_TRUE(wire::RecvFrame(s, &f).ok());
    uint32_t outcome = 0;
    EXPECT_EQ(wire::DecodeReply(f.payload, &outcome, "srv").code(), StatusCode::kCorruption);
  }
  // And it still serves.
  Source src(1);
  src.Commit(1, 10);
  EXPECT_EQ(src.Push(srv.ep()).value(), PushOutcome::kStored);
}

TEST(PeerTest, ADataFrameWhosePayloadCrcIsWrongIsRefusedThoughItsChunksCheck) {
  // DATA frames' payload crc is checked as the Crc32cCombine of the chunk
  // crcs (the payload is read once): a frame whose header says another crc
  // is refused even when every chunk in it matches the table.
  Server srv;
  Source src(1);
  src.Commit(3, 30);
  const SlotLayout layout = Layout();
  const std::vector<uint8_t> data = Data(layout, 30);
  CheckpointInfo info;
  {
    auto d = src.env->OpenDirectory("/seg", false).value();
    MediumOptions ro;
    ro.read_only = true;
    auto f = SlotFile::Open(d->OpenFile("s.nsck", MediumKind::kBuffered, ro).value()).value();
    auto rep = f->Scan().value();
    info = rep.checkpoints[rep.newest_valid].info;
  }
  ASSERT_GT(data.size(), 2 * kChunk);
  for (bool wrong : {true, false}) {
    SCOPED_TRACE(wrong ? "wrong frame crc" : "right frame crc");
    auto s = wire::Connect(srv.ep(), 5, 5).value();
    ASSERT_TRUE(wire::ClientHandshake(s, kJob, kSecret).ok());
    wire::Out head;
    head.Str16(kJob);
    const std::vector<uint8_t> table = wire::EncodeCheckpointTable(info);
    ASSERT_TRUE(wire::SendFrame(s, wire::Type::kPush, head.str(),
                                std::string_view(reinterpret_cast<const char*>(table.data()),
                                                 table.size()))
                    .ok());
    wire::Frame f;
    uint32_t outcome = 0;
    ASSERT_TRUE(wire::RecvFrame(s, &f).ok());
    ASSERT_TRUE(wire::DecodeReply(f.payload, &outcome, "srv").ok());
    ASSERT_EQ(outcome, 1u);  // go
    // Two frames of whole chunks; the second one's header crc off by one bit.
    const char* p = reinterpret_cast<const char*>(data.data());
    const std::string_view first(p, 2 * kChunk), second(p + 2 * kChunk, data.size() - 2 * kChunk);
    ASSERT_TRUE(wire::SendDataFrame(s, first, Crc32c(first.data(), first.size())).ok());
    const uint32_t crc2 = Crc32c(second.data(), second.size()) ^ (wrong ? 1u : 0u);
    Status sent = wire::SendDataFrame(s, second, crc2);
    if (sent.ok()) sent = wire::SendFrame(s, wire::Type::kEnd, {});
    ASSERT_TRUE(wire::RecvFrame(s, &f).ok());
    Status st = wire::DecodeReply(f.payload, &outcome, "srv");
    auto held = ListReplicas(srv.ep(), kJob, kSecret);
    ASSERT_TRUE(held.ok()) << held.status().ToString();
    if (wrong) {
      EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
      EXPECT_NE(st.message().find("frame payload checksum mismatch"), std::string::npos)
          << st.ToString();
      EXPECT_TRUE(held.value().empty());
    } else {
      EXPECT_TRUE(st.ok()) << st.ToString();
      EXPECT_EQ(outcome, 2u);  // stored
      ASSERT_EQ(held.value().size(), 1u);
      Status fst;
      EXPECT_EQ(FetchBack(srv.ep(), 1, 30, &fst).data, data);
      EXPECT_TRUE(fst.ok()) << fst.ToString();
    }
  }
}

// ---- own segments (a restart of another world size gathers old ranks' shards)

constexpr char kSeg0[] = "00000000000000aa-rank-00000.nsck";
constexpr char kSeg1[] = "00000000000000bb-rank-00001.nsck";

TEST(PeerTest, OwnSegmentsAreListedAndFetchedBitwiseApartFromReplicas) {
  Server srv(0, nullptr, kSecret, 5, {kSeg0, kSeg1});
  WriteSegment(srv.env.get(), "/shm", kSeg0, 0, 4, 40);
  WriteSegment(srv.env.get(), "/shm", kSeg1, 1, 5, 50);
  // A segment of this directory the server was not given: never served.
  WriteSegment(srv.env.get(), "/shm", "00000000000000cc-rank-00002.nsck", 2, 6, 60);
  Source rep(3);
  rep.Commit(7, 70);
  ASSERT_TRUE(rep.Push(srv.ep()).ok());
  auto own = ListOwnSegments(srv.ep(), kJob, kSecret);
  ASSERT_TRUE(own.ok()) << own.status().ToString();
  ASSERT_EQ(own.value().size(), 2u);
  EXPECT_EQ(own.value()[0].source_rank, 0u);
  EXPECT_EQ(own.value()[0].step, 40);
  EXPECT_EQ(own.value()[1].source_rank, 1u);
  EXPECT_EQ(own.value()[1].counter, 5u);
  EXPECT_EQ(own.value()[1].world_size, 4u);
  auto held = ListReplicas(srv.ep(), kJob, kSecret);
  ASSERT_TRUE(held.ok());
  ASSERT_EQ(held.value().size(), 1u);  // the replica only
  EXPECT_EQ(held.value()[0].source_rank, 3u);

  auto env = FaultEnv::Create();
  ASSERT_TRUE(env->OpenDirectory("/job", true).ok());
  Result<std::string> got = FetchInto(srv.ep(), kJob, kSecret, 4, 1, 50, kFromSegment, "/job", "world-4", env.get(), 10);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got.value(), "/job/world-4/rank-00001.nsck");
  Read r = ReadBack(env.get(), "/job/world-4", "rank-00001.nsck");
  EXPECT_EQ(r.step, 50);
  EXPECT_EQ(r.counter, 5u);
  EXPECT_EQ(r.data, Data(Layout(), 50));
  // A replica into the same layout; fetched again, the file is replaced.
  got = FetchInto(srv.ep(), kJob, kSecret, 4, 3, std::nullopt, kFromReplica, "/job", "world-4", env.get(), 10);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(ReadBack(env.get(), "/job/world-4", "rank-00003.nsck").data, Data(Layout(), 70));
  ASSERT_TRUE(FetchInto(srv.ep(), kJob, kSecret, 4, 0, std::nullopt, kFromSegment, "/job", "world-4", env.get(), 10).ok());
  EXPECT_EQ(ReadBack(env.get(), "/job/world-4", "rank-00000.nsck").step, 40);
  // Not served: a rank of no given segment, a replica asked as own (and the
  // other way round), a step the segment does not hold.
  EXPECT_EQ(FetchInto(srv.ep(), kJob, kSecret, 4, 2, std::nullopt, kFromSegment, "/job", "w", env.get(), 10).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(FetchInto(srv.ep(), kJob, kSecret, 4, 3, std::nullopt, kFromSegment, "/job", "w", env.get(), 10).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(FetchInto(srv.ep(), kJob, kSecret, 4, 1, std::nullopt, kFromReplica, "/job", "w", env.get(), 10).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(FetchInto(srv.ep(), kJob, kSecret, 4, 1, 40, kFromSegment, "/job", "w", env.get(), 10).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(ListOwnSegments(srv.ep(), "job-b", kSecret).status().code(), StatusCode::kFailedPrecondition);
  // The segments are served read-only: unchanged.
  EXPECT_EQ(ReadBack(srv.env.get(), "/shm", kSeg1).data, Data(Layout(), 50));
  EXPECT_EQ(srv.s->stats().fetches_served, 3u);
}

TEST(PeerTest, ADamagedOwnSegmentIsRefusedAsItIsSent) {
  Server srv(0, nullptr, kSecret, 5, {kSeg1});
  WriteSegment(srv.env.get(), "/shm", kSeg1, 1, 5, 50);
  FlipReplicaByte(srv.env.get(), kSeg1, 200000);
  EXPECT_EQ(ListOwnSegments(srv.ep(), kJob, kSecret).value().size(), 1u);  // the data is not read to list
  auto env = FaultEnv::Create();
  Result<std::string> got = FetchInto(srv.ep(), kJob, kSecret, 4, 1, std::nullopt, kFromSegment, "/job", "world-4",
                                      env.get(), 10);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kCorruption) << got.status().ToString();
  EXPECT_NE(got.status().message().find("checksum mismatch"), std::string::npos)
      << got.status().ToString();
  EXPECT_EQ(env->Dump().find("rank-00001.nsck\n"), std::string::npos) << env->Dump();
}

// ---- replica names carry the world size

// Rank 1 of world 4 and rank 1 of world 2 on one holder: two replicas,
// both listed, each fetched for its own world (a restart with another world
// size never takes one for the other; the new world's push does not
// overwrite the old world's replica).
TEST(PeerTest, ReplicasOfOneRankOfTwoWorldSizesAreKeptApart) {
  Server srv;
  Source four(1, 4), two(1, 2);
  four.Commit(3, 30);
  two.Commit(5, 50);
  ASSERT_EQ(four.Push(srv.ep()).value(), PushOutcome::kStored);
  ASSERT_EQ(two.Push(srv.ep()).value(), PushOutcome::kStored);
  auto held = ListReplicas(srv.ep(), kJob, kSecret);
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  ASSERT_EQ(held.value().size(), 2u);
  EXPECT_EQ(held.value()[0].source_rank, 1u);
  EXPECT_EQ(held.value()[0].world_size, 2u);
  EXPECT_EQ(held.value()[0].step, 50);
  EXPECT_EQ(held.value()[1].source_rank, 1u);
  EXPECT_EQ(held.value()[1].world_size, 4u);
  EXPECT_EQ(held.value()[1].step, 30);
  EXPECT_EQ(ReplicaName(kJob, 4, 1), JobKey(kJob) + "-replica-world-00004-rank-00001.nsck");
  EXPECT_EQ(ReadBack(srv.env.get(), "/shm", ReplicaName(kJob, 4, 1)).step, 30);
  EXPECT_EQ(ReadBack(srv.env.get(), "/shm", ReplicaName(kJob, 2, 1)).step, 50);
  for (const auto& [world, step] : {std::pair<uint32_t, int64_t>{4, 30}, {2, 50}}) {
    auto env = FaultEnv::Create();
    Result<std::string> dir =
        FetchReplica(srv.ep(), kJob, kSecret, world, 1, std::nullopt, "/local", env.get(), 10);
    ASSERT_TRUE(dir.ok()) << dir.status().ToString();
    Read r = ReadBack(env.get(), dir.value(), "rank-00001.nsck");
    EXPECT_EQ(r.step, step);
    EXPECT_EQ(r.data, Data(Layout(), step));
  }
  // A step of the other world's replica is not this one's; a world that
  // holds none of it: NotFound.
  auto env = FaultEnv::Create();
  EXPECT_EQ(FetchReplica(srv.ep(), kJob, kSecret, 4, 1, 50, "/local", env.get(), 10).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(FetchReplica(srv.ep(), kJob, kSecret, 8, 1, std::nullopt, "/local", env.get(), 10)
                .status()
                .code(),
            StatusCode::kNotFound);
  // A file whose header says another world than its name: never listed.
  WriteSegment(srv.env.get(), "/shm", ReplicaName(kJob, 8, 2), 2, 9, 90, 4);
  EXPECT_EQ(ListReplicas(srv.ep(), kJob, kSecret).value().size(), 2u);
}

// This rank's address and failure domain (what Python's construction
// gathers): $NONSTOP_PEER_ADDR, else the route to MASTER_ADDR; the domain
// $NONSTOP_HOST_ID, else host name@address.
TEST(PeerTest, TheLocalAddressAndHostIdFollowTheEnvironment) {
  const auto saved = [](const char* n) {
    const char* v = std::getenv(n);
    return v != nullptr ? std::optional<std::string>(v) : std::nullopt;
  };
  const auto addr = saved("NONSTOP_PEER_ADDR"), master = saved("MASTER_ADDR"),
             host = saved("NONSTOP_HOST_ID");
  ::setenv("NONSTOP_PEER_ADDR", "10.1.2.3", 1);
  EXPECT_EQ(LocalAddress(), "10.1.2.3");
  ::unsetenv("NONSTOP_PEER_ADDR");
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);  // the route to it leaves from loopback
  EXPECT_EQ(LocalAddress(), "127.0.0.1");
  ::setenv("NONSTOP_HOST_ID", "rack-7", 1);
  EXPECT_EQ(HostId("127.0.0.1"), "rack-7");
  ::unsetenv("NONSTOP_HOST_ID");
  char name[256] = {};
  ASSERT_EQ(::gethostname(name, sizeof(name) - 1), 0);
  EXPECT_EQ(HostId("10.0.0.9"), std::string(name) + "@10.0.0.9");
  for (const auto& [n, v] : {std::pair{"NONSTOP_PEER_ADDR", addr}, {"MASTER_ADDR", master},
                            {"NONSTOP_HOST_ID", host}}) {
    if (v) {
      ::setenv(n, v->c_str(), 1);
    } else {
      ::unsetenv(n);
    }
  }
}

// Old worlds: a job that was of world size 2 restarts with 4. The world-2
// replicas stay (they count against the budget: a world-4 push that does
// not fit beside them is refused) until the job directory records an agreed
// checkpoint world 4 committed itself (a resharded restore's record,
// counter -1, is not one); then the next world-4 push removes them first
// and is stored, and a server started with world_size 4 removes them at
// Start. Without a job directory none is ever removed.
void WriteAgreedRecord(Env* env, const std::string& dir, int rank, int world, int64_t counter) {
  AgreedRecord rec;
  rec.step = 40;
  rec.counter = counter;
  rec.rank = rank;
  rec.world_size = world;
  if (counter < 0) {
    rec.resharded_from = "world-2";
    rec.resharded_from_world = 2;
  }
  auto d = env->OpenDirectory(dir, true).value();
  ASSERT_TRUE(WriteFileAtomic(*d, JobDirNames::Agreed(rank), jobdir_internal::EncodeAgreed(rec)).ok());
}

TEST(PeerTest, OldWorldReplicasGoOnceTheNewWorldAgreedOnItsOwnCheckpoint) {
  auto env = FaultEnv::Create();
  WriteSegment(env.get(), "/shm", ReplicaName(kJob, 2, 0), 0, 7, 70, 2);
  WriteSegment(env.get(), "/shm", ReplicaName(kJob, 2, 1), 1, 7, 70, 2);
  WriteAgreedRecord(env.get(), "/jobd", 0, 4, -1);  // the reshard's restore of world 4
  const auto start = [&](uint64_t budget, std::string job_dir) {
    PeerServerOptions o;
    o.job = kJob;
    o.secret = kSecret;
    o.bind_host = "127.0.0.1";
    o.dir = "/shm";
    o.budget_bytes = budget;
    o.io_timeout_s = 5;
    o.env = env.get();
    o.job_dir = std::move(job_dir);
    o.world_size = 4;
    return std::move(PeerServer::Start(o)).value();
  };
  EXPECT_FALSE(AgreedInWorld(env.get(), "/jobd", 4).value());
  auto srv = start(0, "/jobd");
  auto held = ListReplicas(srv->endpoint(), kJob, kSecret).value();
  ASSERT_EQ(held.size(), 2u);  // kept at Start: world 4 agreed on none of its own
  const uint64_t one = held[0].bytes;
  srv->Close();
  srv = start(one * 5 / 2, "/jobd");  // room for two replicas and a half
  Source four(1, 4);
  four.Commit(3, 30);
  EXPECT_EQ(four.Push(srv->endpoint()).value(), PushOutcome::kSkippedBudget);
  EXPECT_EQ(ListReplicas(srv->endpoint(), kJob, kSecret).value().size(), 2u);
  EXPECT_EQ(srv->stats().old_world_removed, 0u);

  WriteAgreedRecord(env.get(), "/jobd", 1, 4, 3);  // world 4 agreed on its counter 3
  EXPECT_TRUE(AgreedInWorld(env.get(), "/jobd", 4).value());
  EXPECT_FALSE(AgreedInWorld(env.get(), "/jobd", 2).value());
  EXPECT_EQ(four.Push(srv->endpoint()).value(), PushOutcome::kStored);
  held = ListReplicas(srv->endpoint(), kJob, kSecret).value();
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0].world_size, 4u);
  EXPECT_EQ(srv->stats().old_world_removed, 2u);
  srv->Close();

  // At Start: an old world's replica (and its temp file) found there goes.
  WriteSegment(env.get(), "/shm", ReplicaName(kJob, 2, 0), 0, 7, 70, 2);
  WriteSegment(env.get(), "/shm", ReplicaName(kJob, 2, 1) + ".tmp", 1, 7, 70, 2);
  srv = start(0, "");  // no job directory: never removed
  EXPECT_EQ(ListReplicas(srv->endpoint(), kJob, kSecret).value().size(), 2u);
  srv->Close();
  srv = start(0, "/jobd");
  held = ListReplicas(srv->endpoint(), kJob, kSecret).value();
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0].world_size, 4u);
  // The replica; its temp file went too (this Env's files are all old:
  // the stale-temp sweep took it first).
  EXPECT_EQ(srv->stats().old_world_removed, 1u);
  EXPECT_EQ(env->Dump().find(ReplicaName(kJob, 2, 0)), std::string::npos) << env->Dump();
  EXPECT_EQ(env->Dump().find(ReplicaName(kJob, 2, 1)), std::string::npos) << env->Dump();
}

// A replica named without its world size (a build before wire version 4):
// refused, removed at Start, said in one line.
TEST(PeerTest, AReplicaNamedWithoutItsWorldSizeIsRemovedAtStart) {
  auto env = FaultEnv::Create();
  const std::string legacy = JobKey(kJob) + "-replica-rank-00001.nsck";
  WriteSegment(env.get(), "/shm", legacy, 1, 3, 30);
  WriteSegment(env.get(), "/shm", "0123456789abcdef-replica-rank-00001.nsck", 1, 3, 30);  // another job's
  Server srv(0, env);
  EXPECT_TRUE(ListReplicas(srv.ep(), kJob, kSecret).value().empty());
  EXPECT_EQ(env->Dump().find(legacy), std::string::npos) << env->Dump();
  EXPECT_NE(env->Dump().find("0123456789abcdef-replica-rank-00001.nsck"), std::string::npos);
  const std::string why = srv.s->stats().last_error;
  EXPECT_NE(why.find("removed 1 replica file(s)"), std::string::npos) << why;
  EXPECT_NE(why.find("without a world size"), std::string::npos) << why;
}

// ---- the job directory's rank files (reshard after a graceful close)

TEST(PeerTest, JobDirectoryRankFilesAreServedReadOnlyAndNothingElse) {
  auto env = FaultEnv::Create();
  // The job directory: this world's rank 1 (world 4), a set-aside world of
  // 2's rank 0; a link to another directory named as a world, a link named
  // as a rank file, a rank file of a rank its name does not say.
  WriteSegment(env.get(), "/jobd", "rank-00001.nsck", 1, 5, 50, 4);
  WriteSegment(env.get(), "/jobd/world-2", "rank-00000.nsck", 0, 7, 70, 2);
  WriteSegment(env.get(), "/elsewhere", "rank-00003.nsck", 3, 9, 90, 8);
  ASSERT_TRUE(env->PlantSymlink("/jobd", "world-8", "/elsewhere").ok());
  ASSERT_TRUE(env->PlantSymlink("/jobd", "rank-00002.nsck", "/elsewhere/rank-00003.nsck").ok());
  WriteSegment(env.get(), "/jobd", "rank-00000.nsck", 3, 1, 10, 4);
  Server srv(0, env, kSecret, 5, {}, "/jobd");
  auto disk = ListDiskFiles(srv.ep(), kJob, kSecret);
  ASSERT_TRUE(disk.ok()) << disk.status().ToString();
  ASSERT_EQ(disk.value().size(), 2u);
  EXPECT_EQ(disk.value()[0].world_size, 2u);
  EXPECT_EQ(disk.value()[0].source_rank, 0u);
  EXPECT_EQ(disk.value()[0].step, 70);
  EXPECT_EQ(disk.value()[1].world_size, 4u);
  EXPECT_EQ(disk.value()[1].source_rank, 1u);
  EXPECT_EQ(disk.value()[1].counter, 5u);
  EXPECT_TRUE(ListReplicas(srv.ep(), kJob, kSecret).value().empty());  // a third kind
  EXPECT_TRUE(ListOwnSegments(srv.ep(), kJob, kSecret).value().empty());

  auto local = FaultEnv::Create();
  for (const auto& [world, rank, step] :
       {std::tuple<uint32_t, uint32_t, int64_t>{4, 1, 50}, {2, 0, 70}}) {
    Result<std::string> got = FetchInto(srv.ep(), kJob, kSecret, world, rank, step, kFromDisk,
                                        "/new", "world-" + std::to_string(world), local.get(), 10);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    Read r = ReadBack(local.get(), "/new/world-" + std::to_string(world),
                      SlotFileName(static_cast<int>(rank)));
    EXPECT_EQ(r.step, step);
    EXPECT_EQ(r.data, Data(Layout(), step));
  }
  // Never served: behind a link (world-8, rank-00002), a rank file of
  // another rank, a replica or segment asked as a rank file, another step.
  for (const auto& [world, rank, step] : std::vector<std::tuple<uint32_t, uint32_t, int64_t>>{
           {8, 3, 90}, {4, 2, 90}, {4, 0, 10}, {4, 3, 10}, {4, 1, 40}}) {
    EXPECT_EQ(FetchInto(srv.ep(), kJob, kSecret, world, rank, step, kFromDisk, "/new", "x",
                        local.get(), 10)
                  .status()
                  .code(),
              StatusCode::kNotFound)
        << world << "/" << rank;
  }
  EXPECT_EQ(FetchInto(srv.ep(), kJob, kSecret, 4, 1, std::nullopt, kFromReplica, "/new", "x",
                      local.get(), 10)
                .status()
                .code(),
            StatusCode::kNotFound);
  // Read-only: the rank files are as they were.
  EXPECT_EQ(ReadBack(env.get(), "/jobd", "rank-00001.nsck").data, Data(Layout(), 50));
  EXPECT_EQ(srv.s->stats().fetches_served, 2u);
  // A damaged chunk is refused as it is sent.
  FlipReplicaByte(env.get(), "rank-00001.nsck", 200000, "/jobd");
  Result<std::string> bad = FetchInto(srv.ep(), kJob, kSecret, 4, 1, std::nullopt, kFromDisk,
                                      "/new", "bad", local.get(), 10);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption) << bad.status().ToString();
  // A server without a job directory serves none.
  Server none;
  EXPECT_TRUE(ListDiskFiles(none.ep(), kJob, kSecret).value().empty());
}

// ---- one fetch per host

// Two ranks of one host ask for the same old rank's checkpoint at once: one
// fetches, the other takes its copy; the server served one fetch.
TEST(PeerTest, TwoRanksOfOneHostFetchOneCopy) {
  Server srv;
  Source src(2);
  src.Commit(6, 60);
  ASSERT_TRUE(src.Push(srv.ep()).ok());
  auto host = FaultEnv::Create();  // the host's memory directory, shared by both ranks
  Result<SharedCopy> got[2] = {Status::Internal("unset"), Status::Internal("unset")};
  std::thread t[2];
  for (int i = 0; i < 2; ++i) {
    t[i] = std::thread([&, i] {
      got[i] = FetchOncePerHost(srv.ep(), kJob, kSecret, 4, 2, 60, 6, kFromReplica, "/mem",
                                "/mem/own-" + std::to_string(i), "rank " + std::to_string(i),
                                host.get(), 10, 30);
    });
  }
  for (auto& x : t) x.join();
  ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
  ASSERT_TRUE(got[1].ok()) << got[1].status().ToString();
  EXPECT_EQ(got[0].value().path, got[1].value().path);
  EXPECT_EQ(got[0].value().path,
            "/mem/" + SharedReshardDir(kJob) + "/w4-s60-c6/rank-00002.nsck");
  EXPECT_NE(got[0].value().fetched, got[1].value().fetched);
  const int fetcher = got[0].value().fetched ? 0 : 1;
  EXPECT_EQ(got[1 - fetcher].value().by, "rank " + std::to_string(fetcher));
  EXPECT_EQ(srv.s->stats().fetches_served, 1u);
  EXPECT_EQ(ReadBack(host.get(), "/mem/" + SharedReshardDir(kJob) + "/w4-s60-c6",
                     "rank-00002.nsck")
                .data,
            Data(Layout(), 60));
  // A third rank later: the copy is there, nothing fetched.
  auto third = FetchOncePerHost(srv.ep(), kJob, kSecret, 4, 2, 60, 6, kFromReplica, "/mem",
                                "/mem/own-2", "rank 2", host.get(), 10, 30);
  ASSERT_TRUE(third.ok());
  EXPECT_FALSE(third.value().fetched);
  EXPECT_EQ(third.value().by, "rank " + std::to_string(fetcher));  // the lock file's line
  EXPECT_EQ(srv.s->stats().fetches_served, 1u);
}

// Another rank took the lock and has not yet written its holder line (the
// moment between its flock and its write, when Lock's refusal names
// kNoHolderLine): the copy it then fetches is said to be fetched by the
// line it wrote, not by that placeholder. Real files: the default Env's lock.
TEST(PeerTest, ACopyTakenWhileItsFetcherHadNoHolderLineNamesTheFetcher) {
  Server srv;
  Source src(2);
  src.Commit(6, 60);
  ASSERT_TRUE(src.Push(srv.ep()).ok());
  char tmpl[] = "/tmp/nonstop-peer-test-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string mem = tmpl, top = mem + "/" + SharedReshardDir(kJob), sub = "w4-s60-c6";
  auto shared = DefaultEnv()->OpenDirectory(top + "/" + sub, true);
  ASSERT_TRUE(shared.ok()) << shared.status().ToString();
  const int fd = ::open((top + "/" + sub + "/rank-00002.lock").c_str(),
                        O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  auto refused = shared.value()->Lock("rank-00002.lock", "rank 9");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find(kNoHolderLine), std::string::npos)
      << refused.status().ToString();
  Result<SharedCopy> got = Status::Internal("unset");
  std::thread t([&] {
    got = FetchOncePerHost(srv.ep(), kJob, kSecret, 4, 2, 60, 6, kFromReplica, mem,
                           mem + "/own-1", "rank 1", DefaultEnv(), 10, 30);
  });
  // The fetcher: its copy made aside, then (while the other is refused with
  // no line, and before its next try) its line written and the copy put in
  // place at once, as a fetch quicker than the other's 20 ms between tries.
  ASSERT_TRUE(
      FetchInto(srv.ep(), kJob, kSecret, 4, 2, 60, kFromReplica, top, "aside", DefaultEnv(), 10)
          .ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // refused, with no line
  const std::string line = "rank 0 pid 7\n";
  ASSERT_EQ(::pwrite(fd, line.data(), line.size(), 0), static_cast<ssize_t>(line.size()));
  ASSERT_EQ(::rename((top + "/aside/rank-00002.nsck").c_str(),
                     (top + "/" + sub + "/rank-00002.nsck").c_str()),
            0);
  t.join();
  ::close(fd);  // lets go
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_FALSE(got.value().fetched);
  EXPECT_EQ(got.value().path, top + "/" + sub + "/rank-00002.nsck");
  EXPECT_EQ(got.value().by, "rank 0 pid 7");
  EXPECT_EQ(srv.s->stats().fetches_served, 1u);
  std::filesystem::remove_all(mem);
}

// A fetcher that holds the lock and never finishes (a stalled or hung
// rank): the others wait `wait_s`, then fetch into their own directory. A
// fetcher that let go without a copy (it failed or died): the next fetches.
TEST(PeerTest, AFetcherThatNeverFinishesIsNotWaitedForForever) {
  Server srv;
  Source src(2);
  src.Commit(6, 60);
  ASSERT_TRUE(src.Push(srv.ep()).ok());
  auto host = FaultEnv::Create();
  auto shared = host->OpenDirectory("/mem/" + SharedReshardDir(kJob) + "/w4-s60-c6", true);
  ASSERT_TRUE(shared.ok());
  {
    auto lock = shared.value()->Lock("rank-00002.lock", "rank 7 pid 1");
    ASSERT_TRUE(lock.ok()) << lock.status().ToString();
    auto got = FetchOncePerHost(srv.ep(), kJob, kSecret, 4, 2, 60, 6, kFromReplica, "/mem",
                                "/mem/own-1", "rank 1", host.get(), 10, 0.3);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(got.value().fetched);
    EXPECT_EQ(got.value().path, "/mem/own-1/w4-s60-c6/rank-00002.nsck");
    EXPECT_EQ(ReadBack(host.get(), "/mem/own-1/w4-s60-c6", "rank-00002.nsck").step, 60);
  }
  // The lock let go, no copy: this rank fetches into the shared place.
  auto got = FetchOncePerHost(srv.ep(), kJob, kSecret, 4, 2, 60, 6, kFromReplica, "/mem",
                              "/mem/own-3", "rank 3", host.get(), 10, 0.3);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(got.value().fetched);
  EXPECT_EQ(got.value().path, "/mem/" + SharedReshardDir(kJob) + "/w4-s60-c6/rank-00002.nsck");
  // Another counter of the same step is another checkpoint: not taken for it.
  auto other = FetchOncePerHost(srv.ep(), kJob, kSecret, 4, 2, 60, 7, kFromReplica, "/mem",
                                "/mem/own-3", "rank 3", host.get(), 10, 0.3);
  EXPECT_EQ(other.status().code(), StatusCode::kNotFound) << other.status().ToString();
}

// This host's copies read without a server (a reshard with every rank on
// one host): the replicas and the given segments listed with their paths,
// each verified in place; a damaged one, another step and a missing
// directory said so.
TEST(PeerTest, ThisHostsCopiesAreListedAndVerifiedWithoutAServer) {
  Server srv;  // only to store a replica the ordinary way
  Source rep(3);
  rep.Commit(7, 70);
  ASSERT_TRUE(rep.Push(srv.ep()).ok());
  srv.s->Close();
  Env* env = srv.env.get();
  WriteSegment(env, "/shm", kSeg1, 1, 5, 50);
  WriteSegment(env, "/shm", "00000000000000cc-rank-00002.nsck", 2, 6, 60);  // not given
  auto reps = ListLocal(kJob, false, {}, "/shm", env);
  ASSERT_TRUE(reps.ok()) << reps.status().ToString();
  ASSERT_EQ(reps.value().size(), 1u);
  EXPECT_EQ(reps.value()[0].held.source_rank, 3u);
  EXPECT_EQ(reps.value()[0].held.step, 70);
  EXPECT_EQ(reps.value()[0].path, "/shm/" + ReplicaName(kJob, 4, 3));
  auto own = ListLocal(kJob, true, {kSeg1}, "/shm", env);
  ASSERT_TRUE(own.ok()) << own.status().ToString();
  ASSERT_EQ(own.value().size(), 1u);
  EXPECT_EQ(own.value()[0].held.source_rank, 1u);
  EXPECT_EQ(own.value()[0].held.world_size, 4u);
  EXPECT_EQ(own.value()[0].path, std::string("/shm/") + kSeg1);
  EXPECT_TRUE(VerifyLocal(reps.value()[0].path, 3, 70, env).ok());
  EXPECT_TRUE(VerifyLocal(own.value()[0].path, 1, 50, env).ok());
  EXPECT_EQ(VerifyLocal(own.value()[0].path, 1, 40, env).code(), StatusCode::kNotFound);
  EXPECT_EQ(VerifyLocal(own.value()[0].path, 2, 50, env).code(), StatusCode::kNotFound);
  EXPECT_EQ(VerifyLocal("shm/x", 1, 50, env).code(), StatusCode::kInvalidArgument);
  FlipReplicaByte(srv.env.get(), ReplicaName(kJob, 4, 3), 200000);
  Status st = VerifyLocal(reps.value()[0].path, 3, 70, env);
  EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
  EXPECT_NE(st.message().find(reps.value()[0].path), std::string::npos) << st.ToString();
  // No memory directory: nothing held. A hostile segment name: refused.
  EXPECT_TRUE(ListLocal(kJob, false, {}, "/none", env).value().empty());
  EXPECT_EQ(ListLocal(kJob, true, {"../x"}, "/shm", env).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(PeerTest, HostileOwnSegmentRequestsAreRefused) {
  // Names that are not entries of the memory directory: refused at start.
  for (const std::string bad : {"", ".", "..", "../x.nsck", "a/b.nsck"}) {
    PeerServerOptions o;
    o.job = kJob;
    o.bind_host = "127.0.0.1";
    o.dir = "/shm";
    o.segments = {bad};
    auto env = FaultEnv::Create();
    o.env = env.get();
    EXPECT_EQ(PeerServer::Start(o).status().code(), StatusCode::kInvalidArgument) << bad;
  }
  Server srv(0, nullptr, kSecret, 5, {kSeg0, kSeg1});
  // A link planted at a segment's name is neither listed nor followed.
  ASSERT_TRUE(srv.env->OpenDirectory("/etc", true).ok());
  WriteSegment(srv.env.get(), "/etc", "secret.nsck", 0, 1, 10);
  ASSERT_TRUE(srv.env->PlantSymlink("/shm", kSeg0, "/etc/secret.nsck").ok());
  WriteSegment(srv.env.get(), "/shm", kSeg1, 1, 5, 50);
  auto own = ListOwnSegments(srv.ep(), kJob, kSecret);
  ASSERT_TRUE(own.ok()) << own.status().ToString();
  ASSERT_EQ(own.value().size(), 1u);
  EXPECT_EQ(own.value()[0].source_rank, 1u);
  auto env = FaultEnv::Create();
  EXPECT_EQ(FetchInto(srv.ep(), kJob, kSecret, 4, 0, std::nullopt, kFromSegment, "/job", "world-4", env.get(), 10)
                .status()
                .code(),
            StatusCode::kNotFound);
  // Malformed requests (a step flag of 2, trailing bytes, a short payload):
  // refused and the connection closed.
  const auto refused = [&](wire::Type t, const std::string& payload) {
    auto s = wire::Connect(srv.ep(), 5, 5).value();
    if (!wire::ClientHandshake(s, kJob, kSecret).ok()) return false;
    if (!wire::SendFrame(s, t, payload).ok()) return false;
    wire::Frame f;
    if (!wire::RecvFrame(s, &f).ok() || f.type != static_cast<uint16_t>(wire::Type::kReply)) {
      return false;
    }
    uint32_t outcome = 0;
    if (wire::DecodeReply(f.payload, &outcome, "srv").code() != StatusCode::kCorruption) return false;
    char c;
    return !s.RecvAll(&c, 1).ok();  // closed
  };
  const uint64_t before = srv.s->stats().refused_frames;
  {
    wire::Out o;
    o.Str16(kJob).U32(4).U32(1).U8(2).I64(50);
    EXPECT_TRUE(refused(wire::Type::kFetchOwn, o.str()));
  }
  {
    wire::Out o;
    o.Str16(kJob).U32(4).U32(1).U8(0).I64(0).U8(9);
    EXPECT_TRUE(refused(wire::Type::kFetchOwn, o.str()));
  }
  EXPECT_TRUE(refused(wire::Type::kFetchOwn, std::string("\x05\x00" "ab", 4)));
  {
    wire::Out o;
    o.Str16(kJob).U32(7);
    EXPECT_TRUE(refused(wire::Type::kListOwn, o.str()));
  }
  EXPECT_TRUE(refused(wire::Type::kListOwn, std::string("\xff\xff", 2)));  // a job longer than the payload
  EXPECT_GE(srv.s->stats().refused_frames, before + 5);
  // A header over the small-frame limit for LIST_OWN: closed before its payload.
  EXPECT_TRUE(SendsAndIsClosed(srv.ep(), Header(wire::kMagic, wire::kVersion,
                                                static_cast<uint16_t>(wire::Type::kFetchOwn), 1ull << 30)));
  // And it still serves.
  Result<std::string> got = FetchInto(srv.ep(), kJob, kSecret, 4, 1, 50, kFromSegment, "/job", "world-4", env.get(), 10);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(ReadBack(env.get(), "/job/world-4", "rank-00001.nsck").data, Data(Layout(), 50));
}

// A proxy that forwards one connection to `to`, cutting it after `cut`
// bytes from the client.
class CuttingProxy {
 public:
  CuttingProxy(const std::string& to, uint64_t cut) : to_(to), cut_(cut) {
    uint16_t port = 0;
    listener_ = wire::Listen("127.0.0.1", 0, &port).value();
    ep_ = "127.0.0.1:" + std::to_string(port);
    thread_ = std::thread([this] { Run(); });
  }
  ~CuttingProxy() {
    listener_.Shutdown();
    thread_.join();
  }
  const std::string& ep() const { return ep_; }

 private:
  void Run() {
    const int fd = ::accept(listener_.fd(), nullptr, nullptr);
    if (fd < 0) return;
    wire::Socket client(fd, "client");
    (void)client.SetTimeout(5);
    auto server = wire::Connect(to_, 5, 5);
    if (!server.ok()) return;
    std::thread back([&] {  // server -> client, as is
      char buf[65536];
      for (;;) {
        const ssize_t n = ::recv(server.value().fd(), buf, sizeof(buf), 0);
        if (n <= 0 || !client.SendAll(buf, static_cast<size_t>(n)).ok()) break;
      }
      client.Shutdown();
    });
    char buf[65536];
    uint64_t sent = 0;
    while (sent < cut_) {
      const ssize_t n = ::recv(client.fd(), buf, std::min<uint64_t>(sizeof(buf), cut_ - sent), 0);
      if (n <= 0 || !server.value().SendAll(buf, static_cast<size_t>(n)).ok()) break;
      sent += static_cast<uint64_t>(n);
    }
    ::shutdown(server.value().fd(), SHUT_WR);  // the server sees the end; its answer still comes back
    back.join();
  }
  std::string to_;
  uint64_t cut_;
  wire::Socket listener_;
  std::string ep_;
  std::thread thread_;
};

// A proxy that forwards one connection to `to`, the server's bytes as they
// are and the client's frame by frame through `rewrite(index, frame bytes)`,
// which returns what is sent on instead (the client's first two frames are
// the handshake's, without MAC; every later one has its MAC, or its tag:
// wire::TagBytes).
class FrameProxy {
 public:
  using Rewrite = std::function<std::string(int, const std::string&)>;
  FrameProxy(const std::string& to, Rewrite rewrite) : to_(to), rewrite_(std::move(rewrite)) {
    uint16_t port = 0;
    listener_ = wire::Listen("127.0.0.1", 0, &port).value();
    ep_ = "127.0.0.1:" + std::to_string(port);
    thread_ = std::thread([this] { Run(); });
  }
  ~FrameProxy() {
    listener_.Shutdown();
    thread_.join();
  }
  const std::string& ep() const { return ep_; }

 private:
  void Run() {
    const int fd = ::accept(listener_.fd(), nullptr, nullptr);
    if (fd < 0) return;
    wire::Socket client(fd, "client");
    (void)client.SetTimeout(5);
    auto server = wire::Connect(to_, 5, 5);
    if (!server.ok()) return;
    std::thread back([&] {
      char buf[65536];
      for (;;) {
        const ssize_t n = ::recv(server.value().fd(), buf, sizeof(buf), 0);
        if (n <= 0 || !client.SendAll(buf, static_cast<size_t>(n)).ok()) break;
      }
      client.Shutdown();
    });
    for (int i = 0;; ++i) {
      std::string frame(wire::kHeaderBytes, '\0');
      if (!client.RecvAll(frame.data(), frame.size()).ok()) break;
      uint64_t len = 0;
      uint16_t type = 0;
      std::memcpy(&len, frame.data() + 8, 8);
      std::memcpy(&type, frame.data() + 6, 2);
      const uint64_t rest = len + (i >= 2 ? wire::TagBytes(type) : 0);
      if (rest > (64u << 20)) break;
      frame.resize(wire::kHeaderBytes + rest);
      if (!client.RecvAll(frame.data() + wire::kHeaderBytes, rest).ok()) break;
      const std::string out = rewrite_(i, frame);
      if (!server.value().SendAll(out.data(), out.size()).ok()) break;
    }
    ::shutdown(server.value().fd(), SHUT_WR);
    back.join();
  }
  std::string to_;
  Rewrite rewrite_;
  wire::Socket listener_;
  std::string ep_;
  std::thread thread_;
};

// Waits (up to 10 s) until the server's stats satisfy `ok`.
bool WaitStats(PeerServer& s, const std::function<bool(const PeerServerStats&)>& ok) {
  for (int i = 0; i < 1000; ++i) {
    if (ok(s.stats())) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

TEST(PeerAuthTest, OnlyTheJobsSecretGetsIn) {
  const std::string other = "another secret, also 32 bytes..!";
  Server srv;
  Source src(1);
  src.Commit(3, 30);
  ASSERT_EQ(src.Push(srv.ep()).value(), PushOutcome::kStored);
  // A client without the secret: push, list and fetch refused at the handshake.
  Source stranger(1);
  stranger.secret = other;
  stranger.Commit(9, 90);
  auto pushed = stranger.Push(srv.ep());
  ASSERT_FALSE(pushed.ok());
  EXPECT_EQ(pushed.status().code(), StatusCode::kFailedPrecondition) << pushed.status().ToString();
  EXPECT_NE(pushed.status().message().find("authentication"), std::string::npos);
  auto listed = ListReplicas(srv.ep(), kJob, other);
  EXPECT_EQ(listed.status().code(), StatusCode::kFailedPrecondition) << listed.status().ToString();
  auto env = FaultEnv::Create();
  auto fetched = FetchReplica(srv.ep(), kJob, other, 4, 1, std::nullopt, "/local", env.get(), 10);
  EXPECT_EQ(fetched.status().code(), StatusCode::kFailedPrecondition) << fetched.status().ToString();
  EXPECT_EQ(env->Dump().find("nsck"), std::string::npos) << env->Dump();
  EXPECT_TRUE(WaitStats(*srv.s, [](const PeerServerStats& st) { return st.auth_failures == 3; }))
      << srv.s->stats().auth_failures;
  PeerServerStats st = srv.s->stats();
  EXPECT_EQ(st.replicas_received, 1u);
  EXPECT_EQ(st.fetches_served, 0u);
  // With the secret: bit for bit, the stranger's push never landed.
  Status fst;
  Read r = FetchBack(srv.ep(), 1, std::nullopt, &fst);
  ASSERT_TRUE(fst.ok()) << fst.ToString();
  EXPECT_EQ(r.step, 30);
  EXPECT_EQ(r.data, Data(Layout(), 30));

  // The other way: a server without the job's secret holding its own
  // "replica" of rank 1 cannot make a client take it, nor take a push.
  Server fake(0, nullptr, other);
  ASSERT_EQ(stranger.Push(fake.ep()).value(), PushOutcome::kStored);
  auto env2 = FaultEnv::Create();
  fetched = FetchReplica(fake.ep(), kJob, kSecret, 4, 1, std::nullopt, "/local", env2.get(), 10);
  ASSERT_FALSE(fetched.ok());
  EXPECT_EQ(fetched.status().code(), StatusCode::kFailedPrecondition) << fetched.status().ToString();
  EXPECT_NE(fetched.status().message().find("does not prove"), std::string::npos)
      << fetched.status().ToString();
  EXPECT_EQ(env2->Dump().find("nsck"), std::string::npos) << env2->Dump();
  EXPECT_EQ(ListReplicas(fake.ep(), kJob, kSecret).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_FALSE(src.Push(fake.ep()).ok());
  EXPECT_EQ(fake.s->stats().replicas_received, 1u);

  // A client that answers the challenge with a proof it cannot make: the
  // server refuses it and serves nothing on that connection.
  {
    auto c = wire::Connect(srv.ep(), 5, 5).value();
    wire::Out hello;
    hello.Str16(kJob).Bytes(std::string(wire::kNonceBytes, '\x01'));
    ASSERT_TRUE(wire::SendFrame(c, wire::Type::kHello, hello.str()).ok());
    wire::Frame f;
    ASSERT_TRUE(wire::RecvFrame(c, &f).ok());
    ASSERT_EQ(f.type, static_cast<uint16_t>(wire::Type::kChallenge));
    ASSERT_TRUE(wire::SendFrame(c, wire::Type::kAuth, std::string(wire::kMacBytes, '\x02')).ok());
    ASSERT_TRUE(wire::RecvFrame(c, &f).ok());
    ASSERT_EQ(f.type, static_cast<uint16_t>(wire::Type::kReply)) << "READY to a wrong proof";
    uint32_t unused = 0;
    Status refused = wire::DecodeReply(f.payload, &unused, "srv");
    EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused.ToString();
    EXPECT_NE(refused.message().find("authentication"), std::string::npos) << refused.ToString();
    EXPECT_FALSE(wire::RecvFrame(c, &f).ok());  // closed
  }
  EXPECT_TRUE(WaitStats(*srv.s, [](const PeerServerStats& st) { return st.auth_failures == 4; }))
      << srv.s->stats().auth_failures;

  // Secrets of the wrong size are refused before anything is sent.
  EXPECT_EQ(ListReplicas(srv.ep(), kJob, "short").status().code(), StatusCode::kInvalidArgument);
  PeerServerOptions o;
  o.job = kJob;
  o.secret = "";
  EXPECT_EQ(PeerServer::Start(o).status().code(), StatusCode::kInvalidArgument);
}

TEST(PeerAuthTest, AClientAnswersNoServerThatDoesNotProveTheSecret) {
  // An impostor that answers HELLO with a challenge it cannot prove (and
  // would then say READY to anything): the client must leave before it sends
  // its own proof or a request.
  uint16_t port = 0;
  wire::Socket listener = wire::Listen("127.0.0.1", 0, &port).value();
  int frames_after_challenge = -1;
  std::thread impostor([&] {
    const int fd = ::accept(listener.fd(), nullptr, nullptr);
    if (fd < 0) return;
    wire::Socket c(fd, "client");
    (void)c.SetTimeout(5);
    wire::Frame f;
    if (!wire::RecvFrame(c, &f).ok() || f.type != static_cast<uint16_t>(wire::Type::kHello)) return;
    ASSERT_TRUE(wire::SendFrame(c, wire::Type::kChallenge, std::string(64, '\x5a')).ok());
    frames_after_challenge = 0;
    while (wire::RecvFrame(c, &f).ok()) ++frames_after_challenge;
  });
  auto env = FaultEnv::Create();
  auto fetched = FetchReplica("127.0.0.1:" + std::to_string(port), kJob, kSecret, 4, 1, std::nullopt,
                              "/local", env.get(), 10);
  impostor.join();
  EXPECT_EQ(fetched.status().code(), StatusCode::kFailedPrecondition) << fetched.status().ToString();
  EXPECT_NE(fetched.status().message().find("does not prove"), std::string::npos);
  EXPECT_EQ(frames_after_challenge, 0) << "the client answered an unproven challenge";
  EXPECT_EQ(env->Dump().find("nsck"), std::string::npos) << env->Dump();
}

TEST(PeerAuthTest, AFrameFromAnotherConnectionOrAgainIsRefused) {
  Server srv;
  Source src(1);
  src.Commit(3, 30);
  ASSERT_EQ(src.Push(srv.ep()).value(), PushOutcome::kStored);
  // Connection 1's LIST request (frame 2: the first after the handshake), recorded.
  std::string recorded;
  {
    FrameProxy p(srv.ep(), [&](int i, const std::string& fr) {
      if (i == 2) recorded = fr;
      return fr;
    });
    auto held = ListReplicas(p.ep(), kJob, kSecret);
    ASSERT_TRUE(held.ok()) << held.status().ToString();
    EXPECT_EQ(held.value().size(), 1u);
  }
  ASSERT_FALSE(recorded.empty());
  // Played into connection 2 in place of its own: the MAC is of another
  // session's key.
  {
    FrameProxy p(srv.ep(), [&](int i, const std::string& fr) { return i == 2 ? recorded : fr; });
    EXPECT_FALSE(ListReplicas(p.ep(), kJob, kSecret).ok());
  }
  EXPECT_TRUE(WaitStats(*srv.s, [](const PeerServerStats& st) { return st.auth_failures == 1; }));
  // Played twice on its own connection: the second has an old sequence number.
  {
    FrameProxy p(srv.ep(), [&](int i, const std::string& fr) { return i == 2 ? fr + fr : fr; });
    EXPECT_TRUE(ListReplicas(p.ep(), kJob, kSecret).ok());  // the first is answered
  }
  EXPECT_TRUE(WaitStats(*srv.s, [](const PeerServerStats& st) { return st.auth_failures == 2; }))
      << srv.s->stats().auth_failures;
  EXPECT_NE(srv.s->stats().last_error.find("MAC"), std::string::npos) << srv.s->stats().last_error;
}

// The 32 bits at `at` that, XORed into a buffer of `len` bytes together with
// a flip of byte `flip`, leave its crc32c as it was (crc32c is affine over
// XOR: finding them is solving 32 linear equations over GF(2)).
uint32_t CrcFixup(size_t len, size_t flip, size_t at) {
  std::string zero(len, '\0');
  const uint32_t c0 = Crc32c(zero.data(), len);
  const auto m = [&](const std::string& v) { return Crc32c(v.data(), len) ^ c0; };
  std::string e = zero;
  e[flip] = '\xff';
  const uint32_t target = m(e);
  uint32_t val[32] = {}, mask[32] = {};
  bool have[32] = {};
  for (int k = 0; k < 32; ++k) {
    std::string v = zero;
    v[at + k / 8] = static_cast<char>(1 << (k % 8));
    uint32_t x = m(v), mk = 1u << k;
    for (int bit = 31; bit >= 0 && x != 0; --bit) {
      if (!((x >> bit) & 1)) continue;
      if (!have[bit]) {
        have[bit] = true;
        val[bit] = x;
        mask[bit] = mk;
        break;
      }
      x ^= val[bit];
      mk ^= mask[bit];
    }
  }
  uint32_t t = target, sol = 0;
  for (int bit = 31; bit >= 0; --bit) {
    if (!((t >> bit) & 1)) continue;
    EXPECT_TRUE(have[bit]);
    t ^= val[bit];
    sol ^= mask[bit];
  }
  return sol;
}

TEST(PeerAuthTest, TamperedDataWithItsChecksumsFixedIsRefused) {
  Server srv;
  Source src(1);
  src.Commit(3, 30);
  ASSERT_EQ(src.Push(srv.ep()).value(), PushOutcome::kStored);
  src.Commit(4, 40);
  const uint32_t fix = CrcFixup(kChunk, 100, 200);
  bool tampered = false;
  // Frame 3 of a push is its first DATA frame: a byte of its first chunk
  // changed, 4 more so that the chunk's crc32c (the table's) still holds,
  // then the frame's payload and header crc fixed up. Only the MAC differs.
  FrameProxy p(srv.ep(), [&](int i, const std::string& fr) {
    if (i != 3) return fr;
    std::string t = fr;
    char* chunk = t.data() + wire::kHeaderBytes;
    const uint32_t before = Crc32c(chunk, kChunk);
    chunk[100] = static_cast<char>(chunk[100] ^ 0xff);
    for (int k = 0; k < 4; ++k) chunk[200 + k] = static_cast<char>(chunk[200 + k] ^ (fix >> (8 * k)));
    EXPECT_EQ(Crc32c(chunk, kChunk), before) << "the forged chunk must keep its crc32c";
    uint64_t len = 0;
    std::memcpy(&len, t.data() + 8, 8);
    const uint32_t pcrc = Crc32c(t.data() + wire::kHeaderBytes, len);
    std::memcpy(t.data() + 16, &pcrc, 4);
    const uint32_t hcrc = Crc32c(t.data(), 20);
    std::memcpy(t.data() + 20, &hcrc, 4);
    tampered = true;
    return t;
  });
  auto out = src.Push(p.ep());
  ASSERT_TRUE(tampered);
  EXPECT_FALSE(out.ok());
  EXPECT_TRUE(WaitStats(*srv.s, [](const PeerServerStats& st) { return st.auth_failures == 1; }));
  // The replica held is still the previous one, whole.
  Status st;
  Read r = FetchBack(srv.ep(), 1, std::nullopt, &st);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(r.step, 30);
  EXPECT_EQ(r.data, Data(Layout(), 30));
}

// A server with the handshake's bounds given (peer.h PeerServerOptions).
std::unique_ptr<PeerServer> BoundedServer(double io_timeout_s, double handshake_timeout_s,
                                          int max_pending, Env* env) {
  PeerServerOptions o;
  o.job = kJob;
  o.secret = kSecret;
  o.bind_host = "127.0.0.1";
  o.dir = "/shm";
  o.io_timeout_s = io_timeout_s;
  o.handshake_timeout_s = handshake_timeout_s;
  o.max_pending_handshakes = max_pending;
  o.env = env;
  auto r = PeerServer::Start(o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : nullptr;
}

// Whether the server ended connection `s` (its close seen within `wait_s`).
bool ClosedByServer(wire::Socket& s, double wait_s) {
  if (!s.WaitReadable(wait_s)) return false;
  char c;
  return ::recv(s.fd(), &c, 1, MSG_DONTWAIT) <= 0;
}

TEST(PeerAuthTest, AClientWhoseHelloComesLateIsServed) {
  // The handshake's clock starts at the HELLO's first byte: a client that a
  // loaded host kept from sending for longer than the whole handshake may
  // take (handshake_timeout_s) is served all the same, within io_timeout_s.
  auto env = FaultEnv::Create();
  auto srv = BoundedServer(/*io_timeout_s=*/10, /*handshake_timeout_s=*/2, 8, env.get());
  ASSERT_NE(srv, nullptr);
  auto c = wire::Connect(srv->endpoint(), 5, 5).value();
  std::this_thread::sleep_for(std::chrono::milliseconds(3000));
  Status hs = wire::ClientHandshake(c, kJob, kSecret);
  ASSERT_TRUE(hs.ok()) << hs.ToString();
  wire::Out req;
  req.Str16(kJob);
  ASSERT_TRUE(wire::SendFrame(c, wire::Type::kList, req.str()).ok());
  wire::Frame f;
  ASSERT_TRUE(wire::RecvFrame(c, &f).ok());
  EXPECT_EQ(f.type, static_cast<uint16_t>(wire::Type::kListing));
  PeerServerStats st = srv->stats();
  EXPECT_EQ(st.auth_failures, 0u) << st.last_error;
  EXPECT_EQ(st.handshake_timeouts, 0u) << st.last_error;
}

TEST(PeerAuthTest, AHandshakeThatNeverCompletesIsDroppedAndCounted) {
  auto env = FaultEnv::Create();
  auto srv = BoundedServer(/*io_timeout_s=*/2, /*handshake_timeout_s=*/1, 8, env.get());
  ASSERT_NE(srv, nullptr);
  std::string hello_frame;
  {
    wire::Out hello;
    hello.Str16(kJob).Bytes(std::string(wire::kNonceBytes, '\x01'));
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    wire::Socket a(sv[0], "a"), b(sv[1], "b");
    ASSERT_TRUE(wire::SendFrame(a, wire::Type::kHello, hello.str()).ok());
    hello_frame.resize(wire::kHeaderBytes + hello.str().size());
    ASSERT_TRUE(b.RecvAll(hello_frame.data(), hello_frame.size()).ok());
  }
  // 1. Its bytes trickle in, each well within every single receive's
  // timeout: the whole handshake's deadline ends it before the HELLO is
  // complete.
  {
    auto c = wire::Connect(srv->endpoint(), 5, 5).value();
    size_t sent = 0;
    bool closed = false;
    for (; sent < hello_frame.size() && !closed; ++sent) {
      if (!c.SendAll(hello_frame.data() + sent, 1).ok()) break;
      closed = ClosedByServer(c, 0.25);
    }
    EXPECT_LT(sent, hello_frame.size()) << "the server waited for the whole trickled HELLO";
    EXPECT_TRUE(closed || ClosedByServer(c, 5));
  }
  // 2. The HELLO, then never the proof.
  {
    auto c = wire::Connect(srv->endpoint(), 5, 5).value();
    ASSERT_TRUE(c.SendAll(hello_frame.data(), hello_frame.size()).ok());
    wire::Frame f;
    ASSERT_TRUE(wire::RecvFrame(c, &f).ok());
    EXPECT_EQ(f.type, static_cast<uint16_t>(wire::Type::kChallenge));
    EXPECT_TRUE(ClosedByServer(c, 10));
  }
  // 3. Connected, never a byte: dropped after io_timeout_s.
  {
    auto c = wire::Connect(srv->endpoint(), 5, 5).value();
    EXPECT_TRUE(ClosedByServer(c, 10));
  }
  EXPECT_TRUE(WaitStats(*srv, [](const PeerServerStats& st) { return st.handshake_timeouts == 3; }))
      << srv->stats().handshake_timeouts << " " << srv->stats().last_error;
  EXPECT_EQ(srv->stats().auth_failures, 0u) << srv->stats().last_error;
  // The server still serves a client that completes its handshake.
  EXPECT_TRUE(ListReplicas(srv->endpoint(), kJob, kSecret).ok());
}

TEST(PeerAuthTest, HandshakesAtOnceAreBoundedAndAListTriesOnceMore) {
  auto env = FaultEnv::Create();
  auto srv = BoundedServer(/*io_timeout_s=*/30, /*handshake_timeout_s=*/30, 2, env.get());
  ASSERT_NE(srv, nullptr);
  // Two connections that say nothing hold both handshake places.
  std::vector<wire::Socket> idle;
  for (int i = 0; i < 2; ++i) idle.push_back(wire::Connect(srv->endpoint(), 5, 5).value());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // accepted
  // A third is closed at accept, and counted.
  auto third = wire::Connect(srv->endpoint(), 5, 5).value();
  EXPECT_TRUE(ClosedByServer(third, 10));
  EXPECT_TRUE(WaitStats(*srv, [](const PeerServerStats& st) { return st.handshakes_refused == 1; }))
      << srv->stats().handshakes_refused;
  // A list refused at accept tries once more: one idle connection goes
  // meanwhile, and the second try gets in.
  std::thread leave([&] {
    (void)WaitStats(*srv, [](const PeerServerStats& st) { return st.handshakes_refused == 2; });
    idle[0].Close();
  });
  auto held = ListReplicas(srv->endpoint(), kJob, kSecret);
  leave.join();
  EXPECT_TRUE(held.ok()) << held.status().ToString();
  EXPECT_EQ(srv->stats().handshakes_refused, 2u);
  EXPECT_EQ(srv->stats().handshake_timeouts, 0u);
}

TEST(PeerAuthTest, ADataFrameReplayedMovedOrWithItsTagChangedIsRefused) {
  // DATA frames carry the 16-byte Carter-Wegman tag (GHASH XOR a pad per
  // sequence number): the tag binds the frame to its connection, direction
  // and place in the stream as the HMAC of the other frames does.
  Server srv;
  Source src(1);
  src.Commit(3, 30);
  std::string recorded;  // the first DATA frame of a push of step 30, with its tag
  {
    FrameProxy p(srv.ep(), [&](int i, const std::string& fr) {
      if (i == 3) recorded = fr;
      return fr;
    });
    ASSERT_EQ(src.Push(p.ep()).value(), PushOutcome::kStored);
  }
  uint16_t type = 0;
  ASSERT_GT(recorded.size(), wire::kHeaderBytes);
  std::memcpy(&type, recorded.data() + 6, 2);
  ASSERT_EQ(type, static_cast<uint16_t>(wire::Type::kData));
  // The first DATA frame: a sender's piece of the data region.
  const uint64_t len = std::min<uint64_t>(Layout().data_bytes, wire::kDataPiece);
  ASSERT_EQ(recorded.size(), wire::kHeaderBytes + len + wire::kDataTagBytes);
  src.Commit(4, 30);  // the same bytes again, a new checkpoint
  const std::vector<std::function<std::string(const std::string&)>> attacks = {
      // Played into another connection, in the same place (frame 3): the
      // same bytes, crcs and header, but another session's hash key and pad.
      [&](const std::string&) { return recorded; },
      // Played twice on its own connection: the second has the next pad.
      [&](const std::string& fr) { return fr + fr; },
      // One bit of the tag flipped.
      [&](const std::string& fr) {
        std::string t = fr;
        t.back() = static_cast<char>(t.back() ^ 0x10);
        return t;
      },
      // One bit of the payload flipped, with the frame's payload and header
      // crcs fixed up (the chunk's crc in the table no longer holds, but the
      // tag is checked first).
      [&](const std::string& fr) {
        std::string t = fr;
        t[wire::kHeaderBytes + 5] = static_cast<char>(t[wire::kHeaderBytes + 5] ^ 1);
        const uint32_t pcrc = Crc32c(t.data() + wire::kHeaderBytes, len);
        std::memcpy(t.data() + 16, &pcrc, 4);
        const uint32_t hcrc = Crc32c(t.data(), 20);
        std::memcpy(t.data() + 20, &hcrc, 4);
        return t;
      },
  };
  uint64_t failures = 0;
  for (size_t k = 0; k < attacks.size(); ++k) {
    SCOPED_TRACE("attack " + std::to_string(k));
    FrameProxy p(srv.ep(), [&](int i, const std::string& fr) { return i == 3 ? attacks[k](fr) : fr; });
    EXPECT_FALSE(src.Push(p.ep()).ok());
    ++failures;
    EXPECT_TRUE(WaitStats(*srv.s, [&](const PeerServerStats& st) { return st.auth_failures == failures; }))
        << srv.s->stats().auth_failures;
    EXPECT_NE(srv.s->stats().last_error.find("MAC mismatch"), std::string::npos)
        << srv.s->stats().last_error;
  }
  // The replica held is still the first push's, whole; a clean push lands.
  Status st;
  Read r = FetchBack(srv.ep(), 1, std::nullopt, &st);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(r.data, Data(Layout(), 30));
  EXPECT_EQ(src.Push(srv.ep()).value(), PushOutcome::kStored);
}

TEST(PeerTest, ATransferCutAnywhereNeverListsAsComplete) {
  Server srv;
  Source src(1);
  src.Commit(3, 30);
  ASSERT_TRUE(src.Push(srv.ep()).ok());
  src.Commit(4, 40);
  // The bytes of the push of step 40: the PUSH frame (job, table), one DATA
  // frame per piece, END. Cut at and around every frame boundary, and spread.
  const SlotLayout layout = Layout();
  uint64_t table_bytes = 0;
  {
    auto d = src.env->OpenDirectory("/seg", false).value();
    MediumOptions ro;
    ro.read_only = true;
    auto f = SlotFile::Open(d->OpenFile("s.nsck", MediumKind::kBuffered, ro).value()).value();
    auto rep = f->Scan().value();
    const CheckpointInfo& info = rep.checkpoints[rep.newest_valid].info;
    table_bytes = wire::EncodeCheckpointTable(info).size();
  }
  // The client's handshake frames (HELLO, AUTH), then MACs on every frame.
  const uint64_t hello = wire::kHeaderBytes + 2 + std::strlen(kJob) + wire::kNonceBytes;
  const uint64_t auth = hello + wire::kHeaderBytes + wire::kMacBytes;
  const uint64_t push_end = auth + wire::kHeaderBytes + 2 + std::strlen(kJob) + table_bytes + wire::kMacBytes;
  std::vector<uint64_t> bounds = {0, hello, auth, push_end};
  for (uint64_t off = 0; off < layout.data_bytes; off += wire::kDataPiece) {
    bounds.push_back(bounds.back() + wire::kHeaderBytes +
                     std::min<uint64_t>(wire::kDataPiece, layout.data_bytes - off) + wire::kDataTagBytes);
  }
  const uint64_t total = bounds.back() + wire::kHeaderBytes + wire::kMacBytes;  // END
  std::vector<uint64_t> cuts;
  for (uint64_t b : bounds) {
    for (int64_t d : {-1, 0, 1, 23, 24, 25}) {
      if (static_cast<int64_t>(b) + d >= 0) cuts.push_back(b + d);
    }
  }
  std::mt19937_64 rng(5);
  for (int i = 0; i < 16; ++i) cuts.push_back(rng() % total);
  cuts.push_back(total - 1);
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  cuts.erase(std::remove_if(cuts.begin(), cuts.end(), [&](uint64_t k) { return k >= total; }),
             cuts.end());
  cuts.push_back(total);  // the whole push: stored
  int stored = 0;
  for (uint64_t k : cuts) {
    SCOPED_TRACE("cut after " + std::to_string(k) + " bytes");
    {
      CuttingProxy proxy(srv.ep(), k);
      auto out = src.Push(proxy.ep(), 5);
      if (out.ok()) {
        EXPECT_EQ(k, total) << "a push cut short was reported stored";
        ++stored;
        break;
      }
    }
    auto held = ListReplicas(srv.ep(), kJob, kSecret);
    ASSERT_TRUE(held.ok()) << held.status().ToString();
    ASSERT_EQ(held.value().size(), 1u);
    EXPECT_EQ(held.value()[0].step, 30);
    Status st;
    EXPECT_EQ(FetchBack(srv.ep(), 1, std::nullopt, &st).data, Data(layout, 30));
    EXPECT_TRUE(st.ok()) << st.ToString();
  }
  EXPECT_EQ(stored, 1) << "the uncut push did not get through";
  EXPECT_EQ(ListReplicas(srv.ep(), kJob, kSecret).value().at(0).step, 40);
  EXPECT_EQ(srv.s->stats().replicas_received, 2u);
}

TEST(PeerTest, ACrashAtEveryFileCallOfTheStoreKeepsACompleteReplica) {
  Source src(1);
  // Count the server's file calls for the second push.
  uint64_t calls = 0;
  {
    Server srv;
    src.Commit(3, 30);
    ASSERT_TRUE(src.Push(srv.ep()).ok());
    src.Commit(4, 40);
    const uint64_t before = srv.env->calls();
    ASSERT_EQ(src.Push(srv.ep()).value(), PushOutcome::kStored);
    calls = srv.env->calls() - before;
  }
  ASSERT_GT(calls, 5u);
  int newer = 0;
  for (uint64_t n = 1; n <= calls + 1; ++n) {
    for (CrashMode mode : {CrashMode::kTornUnsynced, CrashMode::kDropUnsynced}) {
      SCOPED_TRACE("crash at call " + std::to_string(n) + " mode " + std::to_string(static_cast<int>(mode)));
      auto env = FaultEnv::Create();
      {
        Server srv(0, env);
        src.Commit(3, 30);
        ASSERT_TRUE(src.Push(srv.ep()).ok());
        src.Commit(4, 40);
        env->CrashOnCall(n, mode, n);
        (void)src.Push(srv.ep());
        srv.s->Close();
        if (env->crashes() == 0) env->Crash(mode, n);  // after a push that finished
      }
      env->ClearFaults();
      Server again(0, env);  // a restarted holder over what the crash kept
      auto held = ListReplicas(again.ep(), kJob, kSecret);
      ASSERT_TRUE(held.ok()) << held.status().ToString();
      ASSERT_EQ(held.value().size(), 1u) << env->Dump();
      const int64_t step = held.value()[0].step;
      ASSERT_TRUE(step == 30 || step == 40) << step;
      newer += step == 40;
      Status st;
      EXPECT_EQ(FetchBack(again.ep(), 1, std::nullopt, &st).data, Data(Layout(), step));
      EXPECT_TRUE(st.ok()) << st.ToString();
    }
  }
  EXPECT_GE(newer, 1);  // the crash after the last call keeps the new one
}

}  // namespace
}  // namespace nonstop::peer
