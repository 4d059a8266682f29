#include "tier/peer_setup.h"

#include <algorithm>
#include <cstdio>
#include <functional>

#include "jobdir/records.h"
#include "tier/peer_options.h"
#include "tier/sha256.h"

namespace nonstop::peer {
namespace {

using jobdir_internal::Json;
using jobdir_internal::JsonString;

constexpr char kWhat[] = "the peer tier's exchange";
constexpr const char* kKinds[] = {"replica", "segment", "disk"};

std::string Bool(bool b) { return b ? "true" : "false"; }

// [source_rank, world_size, step, counter, bytes, kind]
std::string CopyText(const HeldReplica& h, Source kind) {
  return "[" + std::to_string(h.source_rank) + "," + std::to_string(h.world_size) + "," +
         std::to_string(h.step) + "," + std::to_string(h.counter) + "," +
         std::to_string(h.bytes) + ",\"" + kKinds[static_cast<int>(kind)] + "\"]";
}

Status Bad(uint32_t rank, const std::string& why) {
  return Status::Corruption(std::string(kWhat) + ": rank " + std::to_string(rank) + "'s text " +
                            why);
}

// Every rank's text parsed: an array of `n` items at least.
Result<std::vector<Json>> Parse(const std::vector<std::string>& texts, uint32_t world, size_t n) {
  if (texts.size() != world) {
    return Status::Corruption(std::string(kWhat) + ": " + std::to_string(texts.size()) +
                              " texts from " + std::to_string(world) + " ranks");
  }
  std::vector<Json> out;
  for (uint32_t i = 0; i < world; ++i) {
    NONSTOP_ASSIGN_OR_RETURN(Json j, jobdir_internal::ParseJson(texts[i], kWhat));
    if (j.type != Json::Type::kArray || j.items.size() < n) return Bad(i, "is not its array");
    out.push_back(std::move(j));
  }
  return out;
}

Result<GatherCopy> CopyOf(const Json& j, uint32_t rank) {
  GatherCopy c;
  uint64_t src = 0, world = 0;
  if (j.type != Json::Type::kArray || j.items.size() != 6 || !j.items[0].AsUint64(&src) ||
      !j.items[1].AsUint64(&world) || !j.items[2].AsInt64(&c.held.step) ||
      !j.items[3].AsUint64(&c.held.counter) || !j.items[4].AsUint64(&c.held.bytes) ||
      src > UINT32_MAX || world > UINT32_MAX) {
    return Bad(rank, "names a checkpoint it does not parse");
  }
  c.held.source_rank = static_cast<uint32_t>(src);
  c.held.world_size = static_cast<uint32_t>(world);
  const auto* k = std::find(std::begin(kKinds), std::end(kKinds), j.items[5].text);
  if (k == std::end(kKinds)) return Bad(rank, "names an unknown kind");
  c.kind = static_cast<Source>(k - std::begin(kKinds));
  return c;
}

std::string Message(const Status& s) { return s.message().empty() ? s.ToString() : s.message(); }

}  // namespace

Result<PeerStart> StartPeers(const SetupRequest& r, const SetupGather& gather) {
  PeerStart out;
  // Every rank must take the same branch: decided together in the first
  // exchange, which also carries rank 0's made secret (the group's own links).
  std::string made;
  if (r.rank == 0 && r.env_secret.empty()) {
    unsigned char b[32];
    if (!crypto::RandomBytes(b, sizeof(b))) return Status::FromErrno("peer secret", errno);
    static constexpr char kHex[] = "0123456789abcdef";
    for (unsigned char c : b) made += {kHex[c >> 4], kHex[c & 15]};
  }
  const std::string fp = r.env_secret.empty() ? "" : SecretFingerprint(r.env_secret);
  NONSTOP_ASSIGN_OR_RETURN(
      std::vector<std::string> texts,
      gather("[" + JsonString(r.host) + "," + Bool(r.replicas > 0) + "," +
             Bool(!r.segment.empty()) + "," + JsonString(r.job_dir) + "," + JsonString(fp) +
             "," + JsonString(made) + "]"));
  NONSTOP_ASSIGN_OR_RETURN(std::vector<Json> every, Parse(texts, r.world, 6));
  bool all_want = true, all_segment = true;
  std::vector<std::string> fps;
  for (const Json& e : every) {
    out.hosts.push_back(e.items[0].text);
    all_want = all_want && e.items[1].b;
    all_segment = all_segment && e.items[2].b;
    fps.push_back(e.items[4].text);
  }
  if (!all_want) {
    out.note = r.replicas == 0 ? "replicas=0" : "replicas=0 on another rank";
    return out;
  }
  if (!all_segment) {
    out.note = "no memory segment to replicate (tier=\"disk\")";
    return out;
  }
  const std::vector<std::vector<uint32_t>> partners = ChoosePartners(out.hosts, r.replicas);
  out.job = every[0].items[3].text;  // rank 0's job directory names the job on every rank
  // This host's replicas and own segments of the job of another world size,
  // read from the memory directory (no server); none when it cannot be read.
  for (const bool own : {false, true}) {
    Result<std::vector<LocalCopy>> got = ListLocal(out.job, own, r.segments, r.mem_dir, r.env);
    if (!got.ok()) {
      out.local.clear();
      break;
    }
    for (const LocalCopy& c : *got) {
      if (c.held.world_size == r.world) continue;
      out.local.push_back({c.held, own ? Source::kSegment : Source::kReplica, -1, c.path});
    }
  }
  if (std::none_of(partners.begin(), partners.end(), [](const auto& p) { return !p.empty(); })) {
    out.note = "every rank is on one host: no partner in another failure domain";
    // No server: a reshard still reads this host's memory directory.
    NONSTOP_ASSIGN_OR_RETURN(texts, gather(Bool(!out.local.empty())));
    out.reshard_any = std::find(texts.begin(), texts.end(), "true") != texts.end();
    return out;
  }
  NONSTOP_ASSIGN_OR_RETURN(std::string secret,
                           AgreeSecret(fps, every[0].items[5].text, r.env_secret));
  std::string err, held_text = "[", other_text = "[";
  {
    // The budget: peer_budget_bytes, else a share of the memory directory's
    // free space split among this host's ranks.
    PeerServerOptions o;
    o.job = out.job;
    o.secret = secret;
    o.bind_host = r.addr;
    o.dir = r.mem_dir;
    o.budget_bytes = r.budget_bytes.value_or(0);
    o.budget_share = r.budget_bytes ? 0 : static_cast<uint32_t>(std::count(
                                              out.hosts.begin(), out.hosts.end(), r.host));
    o.segments = r.segments;
    o.nice = r.nice;
    o.job_dir = r.job_dir;
    o.world_size = r.world;
    o.env = r.env;
    Status s;
    Result<std::unique_ptr<PeerServer>> started = PeerServer::Start(o);
    if (started.ok()) {
      out.server = std::move(started).value();
      using List = Result<std::vector<HeldReplica>> (PeerServer::*)();
      const std::pair<List, Source> lists[] = {{&PeerServer::List, Source::kReplica},
                                               {&PeerServer::ListOwn, Source::kSegment},
                                               {&PeerServer::ListDisk, Source::kDisk}};
      for (const auto& [list, kind] : lists) {
        Result<std::vector<HeldReplica>> got = (out.server.get()->*list)();
        if (!got.ok()) {
          s = got.status();
          break;
        }
        for (const HeldReplica& h : *got) {
          std::string& text = h.world_size == r.world ? held_text : other_text;
          if (h.world_size == r.world && kind != Source::kReplica) continue;
          text += (text.size() > 1 ? "," : "") + CopyText(h, kind);
        }
      }
    } else {
      s = started.status();
    }
    if (!s.ok()) err = "rank " + std::to_string(r.rank) + ": the peer server cannot start on " +
                       r.addr + ": " + Message(s);
  }
  NONSTOP_ASSIGN_OR_RETURN(
      texts, gather("[" + JsonString(err) + "," +
                    JsonString(err.empty() ? r.addr + ":" + std::to_string(out.server->port())
                                           : "") +
                    "," + held_text + "]," + other_text + "]," + Bool(!out.local.empty()) + "]"));
  NONSTOP_ASSIGN_OR_RETURN(std::vector<Json> got, Parse(texts, r.world, 5));
  std::string first_err;
  for (uint32_t holder = 0; holder < r.world; ++holder) {
    const Json& g = got[holder];
    if (first_err.empty()) first_err = g.items[0].text;
    out.reshard_any = out.reshard_any || g.items[4].b || !g.items[3].items.empty();
  }
  if (!first_err.empty()) {  // the job runs on without the tier, and says why
    if (out.server != nullptr) out.server->Close();
    out.server.reset();
    out.note = first_err;
    return out;
  }
  for (uint32_t holder = 0; holder < r.world; ++holder) {
    const Json& g = got[holder];
    out.endpoints.push_back(g.items[1].text);
    for (int list : {2, 3}) {
      for (const Json& j : g.items[list].items) {
        NONSTOP_ASSIGN_OR_RETURN(GatherCopy c, CopyOf(j, holder));
        c.holder = static_cast<int>(holder);
        if (list == 3) {
          out.other.push_back(std::move(c));
        } else if (c.held.source_rank == r.rank) {
          out.held.emplace_back(c.held.step, c.held.counter, holder);
        }
      }
    }
  }
  std::sort(out.held.begin(), out.held.end(), std::greater<>());
  out.secret = secret;
  out.replicas = r.replicas;
  out.partners = partners[r.rank];
  if (!out.partners.empty()) {
    ReplicatorOptions o;
    o.job = out.job;
    o.secret = secret;
    o.rank = r.rank;
    o.segment = r.segment;
    for (uint32_t p : out.partners) o.partners.push_back(out.endpoints[p]);
    o.job_dir = r.job_dir;
    o.every = r.every;
    o.nice = r.nice;
    o.bps = r.bps;
    o.spread_s = r.spread_s;
    o.env = r.env;
    Result<std::unique_ptr<Replicator>> rep = Replicator::Start(o);
    if (rep.ok()) {
      out.replicator = std::move(rep).value();
    } else {  // this rank's copies are not replicated: said
      out.note = "the replicator cannot start: " + Message(rep.status());
    }
  }
  return out;
}

namespace {
std::string RankDirName(const std::string& job, const std::string& what, uint32_t rank) {
  char r[16];
  std::snprintf(r, sizeof(r), "%05u", rank);
  return JobKey(job) + "-" + what + "-rank-" + r;
}
}  // namespace

std::string RankDir(const std::string& job, const std::string& what, uint32_t rank, bool fresh,
                    const std::string& mem_dir, Env* env) {
  if (fresh) (void)RemoveRankDir(job, what, rank, mem_dir, env);
  return PeerMemoryDir(mem_dir) + "/" + RankDirName(job, what, rank);
}

bool RemoveRankDir(const std::string& job, const std::string& what, uint32_t rank,
                   const std::string& mem_dir, Env* env) {
  if (env == nullptr) env = DefaultEnv();
  Result<std::unique_ptr<Directory>> d = env->OpenDirectory(PeerMemoryDir(mem_dir), false);
  if (!d.ok()) return false;
  return RemoveTree(**d, RankDirName(job, what, rank)).ok() && (*d)->SyncDir().ok();
}

Prefetched PrefetchOwnReplica(const std::vector<std::tuple<int64_t, uint64_t, uint32_t>>& held,
                              const std::vector<std::string>& endpoints, const std::string& job,
                              const std::string& secret, uint32_t rank, uint32_t world,
                              const std::vector<int64_t>& own_steps, const std::string& mem_dir,
                              Env* env) {
  Prefetched out;
  if (held.empty()) return out;
  std::tie(out.step, out.counter, out.holder) = held.front();
  if (std::find(own_steps.begin(), own_steps.end(), out.step) != own_steps.end()) return out;
  const std::string& ep = out.holder < endpoints.size() ? endpoints[out.holder] : "";
  Result<std::string> d = FetchReplica(ep, job, secret, world, rank, out.step,
                                       RankDir(job, "fetched", rank, true, mem_dir, env), env);
  if (d.ok()) {
    out.dir = *d;
  } else {
    out.why = "the replica of rank " + std::to_string(rank) + " step " + std::to_string(out.step) +
              " on rank " + std::to_string(out.holder) + " (" + ep + "): " + d.status().message();
  }
  return out;
}

}  // namespace nonstop::peer
