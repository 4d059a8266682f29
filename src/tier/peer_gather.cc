#include "tier/peer_gather.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <set>
#include <thread>

#include "nonstop/jobdir.h"
#include "nonstop/plan.h"
#include "nonstop/store.h"
#include "jobdir/remote_layout.h"
#include "tier/remote_tier.h"

namespace nonstop::peer {
namespace {

// A copy of one old rank at one step the gather may try.
struct Cand {
  enum class At { kLocal, kPeer, kRemote } at = At::kLocal;
  const GatherCopy* copy = nullptr;  // kLocal, kPeer
  int64_t step = 0;
  uint64_t counter = 0;
  Tier tier = Tier::kMemory;
};

const char* KindName(Source s) {
  switch (s) {
    case Source::kReplica: return "replica";
    case Source::kSegment: return "segment";
    case Source::kDisk: return "rank file";
  }
  return "replica";
}

// The planner's order of `cs` (indices; MakePlan, the one chooser).
std::vector<size_t> Planned(const std::vector<Cand>& cs, const GatherRequest& r) {
  std::vector<PlanCandidate> pcs;
  for (size_t i = 0; i < cs.size(); ++i) {
    PlanCandidate pc;
    pc.tier = cs[i].tier;
    pc.where = cs[i].at == Cand::At::kRemote ? "remote"
               : cs[i].at == Cand::At::kLocal ? "local"
                                              : r.endpoints.at(cs[i].copy->holder);
    pc.step = cs[i].step;
    pc.counter = cs[i].counter;
    pc.handle = i;
    pcs.push_back(std::move(pc));
  }
  PlanRequest req;
  req.verify = false;
  Result<Plan> plan = MakePlan(pcs, LineageRecord{}, req);
  if (!plan.ok()) return {};
  std::vector<size_t> out;
  for (size_t i : plan.value().order) out.push_back(pcs[i].handle);
  return out;
}

// Whether `path` (absolute) names a file, and its size.
std::optional<uint64_t> FileSize(Env* env, const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return std::nullopt;
  Result<std::unique_ptr<Directory>> d = env->OpenDirectory(path.substr(0, slash), false);
  if (!d.ok()) return std::nullopt;
  Result<FileStat> st = d.value()->Stat(path.substr(slash + 1));
  if (!st.ok() || st.value().type != EntryType::kFile) return std::nullopt;
  return st.value().size;
}

// What one try got: the copy's path, where it came from, and whether this
// rank fetched it.
struct Got {
  std::string path;
  std::string from;
  bool fetched = false;
};

constexpr char kReaders[] = "readers";
constexpr int kMaxReaders = 4096;

// Whether `s` is Directory::Lock's refusal because another holds the lock.
bool HeldByAnother(const Status& s) {
  return s.code() == StatusCode::kFailedPrecondition &&
         s.message().find(" is locked by ") != std::string::npos;
}

// Lock `name` in `d`, tried again while another holds it, for `wait_s`.
Result<std::unique_ptr<FileLock>> LockWaiting(Directory& d, const std::string& name,
                                              const std::string& holder, double wait_s) {
  const auto t0 = std::chrono::steady_clock::now();
  while (true) {
    Result<std::unique_ptr<FileLock>> l = d.Lock(name, holder);
    if (l.ok() || !HeldByAnother(l.status())) return l;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() >= wait_s) {
      return l.status();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::string HostLockName(const std::string& job) { return SharedReshardDir(job) + ".lock"; }

class Gather {
 public:
  Gather(const GatherRequest& r, GatherResult& out, Env* env) : r_(r), out_(out), env_(env) {}

  // The old ranks `need` of world size `w`; the lines of `missing`.
  std::vector<std::string> World(uint32_t w, const std::vector<uint32_t>& need) {
    std::map<uint32_t, std::vector<Cand>> rows, cands;
    std::vector<std::pair<int64_t, uint64_t>> remote;
    for (const RemoteStep& s : r_.remote_steps) {
      if (s.world_size == w) remote.emplace_back(s.step, s.counter);
    }
    std::optional<std::set<int64_t>> steps;
    for (uint32_t rank : need) {
      std::set<int64_t> held;
      for (const GatherCopy& c : r_.copies) {
        if (c.held.world_size != w || c.held.source_rank != rank) continue;
        if (c.holder >= static_cast<int>(r_.endpoints.size())) continue;  // no endpoint to ask
        Cand k{c.holder < 0 ? Cand::At::kLocal : Cand::At::kPeer, &c, c.held.step,
               c.held.counter, c.kind == Source::kDisk ? Tier::kDisk : Tier::kMemory};
        rows[rank].push_back(k);
        held.insert(c.held.step);
      }
      for (const auto& [st, counter] : remote) held.insert(st);
      if (!steps) {
        steps = held;
      } else {
        std::erase_if(*steps, [&](int64_t s) { return held.count(s) == 0; });
      }
    }
    std::vector<Cand> every;
    for (uint32_t rank : need) {
      std::map<int64_t, uint64_t> at;  // step -> the memory copies' counter
      for (const Cand& c : rows[rank]) {
        if (steps->count(c.step) == 0) continue;
        cands[rank].push_back(c);
        at[c.step] = c.counter;
      }
      // The remote part of a step is that old rank's checkpoint of it: its
      // counter is the memory copies' where they hold the step (the
      // marker's otherwise), so at one counter memory comes first.
      for (const auto& [st, counter] : remote) {
        if (steps->count(st) == 0) continue;
        const auto it = at.find(st);
        cands[rank].push_back(
            Cand{Cand::At::kRemote, nullptr, st, it != at.end() ? it->second : counter, Tier::kRemote});
      }
      every.insert(every.end(), cands[rank].begin(), cands[rank].end());
    }
    std::vector<int64_t> step_order;
    for (size_t i : Planned(every, r_)) {
      if (std::find(step_order.begin(), step_order.end(), every[i].step) == step_order.end()) {
        step_order.push_back(every[i].step);
      }
    }
    std::map<uint32_t, int64_t> got;
    std::map<uint32_t, std::vector<std::string>> errs;
    for (int64_t step : step_order) {
      for (uint32_t rank : need) {
        if (got.count(rank) != 0 && got[rank] == step) continue;
        std::vector<Cand> mine;
        for (const Cand& c : cands[rank]) {
          if (c.step == step) mine.push_back(c);
        }
        for (size_t i : Planned(mine, r_)) {
          std::string desc;
          Result<Got> g = Try(w, rank, mine[i], &desc);
          if (!g.ok()) {
            errs[rank].push_back(desc + ": " + g.status().message());
            continue;
          }
          out_.files.emplace_back(w, rank, g.value().path);
          out_.from[std::to_string(w) + "/" + std::to_string(rank)] =
              g.value().from + " step " + std::to_string(step);
          if (g.value().fetched) {
            out_.bytes += FileSize(env_, g.value().path).value_or(0);
          }
          if (mine[i].at != Cand::At::kLocal) {
            const std::string shared = r_.mem_dir + "/" + SharedReshardDir(r_.job);
            out_.dir = g.value().path.starts_with(shared + "/") ? shared : r_.fallback_dir;
          }
          got[rank] = step;
          break;
        }
      }
      if (std::all_of(need.begin(), need.end(),
                      [&](uint32_t rank) { return got.count(rank) != 0 && got[rank] == step; })) {
        return {};
      }
    }
    // The old ranks with no copy at all are why; only when every one got a
    // copy (of different steps) are those named.
    std::vector<uint32_t> lacking;
    for (uint32_t rank : need) {
      if (got.count(rank) == 0) lacking.push_back(rank);
    }
    std::vector<std::string> lines;
    for (uint32_t rank : lacking.empty() ? need : lacking) {
      std::string why;
      if (got.count(rank) != 0) {
        why = "no step of which every missing old rank has a copy (this one's is of step " +
              std::to_string(got[rank]) + ")";
      } else {
        for (const std::string& e : errs[rank]) why += (why.empty() ? "" : "; ") + e;
        if (why.empty()) {
          why = rows[rank].empty() ? "on no surviving peer" : "no step held for every old rank";
          if (!r_.remote_error.empty()) why += "; " + r_.remote_error;
        }
      }
      lines.push_back("old rank " + std::to_string(rank) + " of world size " + std::to_string(w) +
                      ": " + why);
    }
    return lines;
  }

 private:
  // One try of copy `c` of old rank `rank` of world `w`; `desc` names it for the error lines.
  Result<Got> Try(uint32_t w, uint32_t rank, const Cand& c, std::string* desc) {
    const std::string name = SlotFileName(static_cast<int>(rank));
    if (c.at == Cand::At::kLocal) {
      const std::string kind = KindName(c.copy->kind);
      *desc = "its " + kind + " in this host's memory (" + c.copy->path + ")";
      NONSTOP_RETURN_IF_ERROR(VerifyLocal(c.copy->path, rank, c.step, env_));
      return Got{c.copy->path, "own memory " + kind + " (" + c.copy->path + ")", false};
    }
    if (c.at == Cand::At::kRemote) {
      *desc = "the remote tier (" + r_.remote_url + ") step " + std::to_string(c.step);
      if (!r_.remote_fetch) return Status::FailedPrecondition("no remote tier to fetch from");
      NONSTOP_RETURN_IF_ERROR(Hold());
      OncePerHostCopy o = Once(w, rank, c.step);
      o.sub = "remote-w" + std::to_string(w) + "-s" + std::to_string(c.step);
      o.rel = {tier::kLocalDir, remote::StepDir(c.step)};  // where RemoteTier::Fetch writes
      o.what = "the remote tier (" + r_.remote_url + ")";
      NONSTOP_ASSIGN_OR_RETURN(
          SharedCopy got, OncePerHost(o, [&](const std::string& parent,
                                            const std::string& sub) -> Result<std::string> {
            NONSTOP_ASSIGN_OR_RETURN(std::string d, r_.remote_fetch(c.step, rank, parent + "/" + sub));
            return d + "/" + name;
          }));
      std::string from = "remote (" + r_.remote_url + ")";
      if (!got.fetched) {
        from += " fetched by " + got.by;
        ++out_.shared;
      }
      return Got{got.path, from, got.fetched};
    }
    const std::string kind = KindName(c.copy->kind);
    const std::string& ep = r_.endpoints.at(c.copy->holder);
    const std::string on = "rank " + std::to_string(c.copy->holder) + " (" + ep + ")";
    *desc = "its " + kind + " on " + on;
    NONSTOP_RETURN_IF_ERROR(Hold());
    NONSTOP_ASSIGN_OR_RETURN(
        SharedCopy got,
        FetchOncePerHost(ep, r_.job, r_.secret, w, rank, c.step, c.counter, c.copy->kind,
                         r_.mem_dir, r_.fallback_dir, r_.holder, env_, r_.timeout_s, r_.wait_s));
    std::string from = "peer " + kind + " on " + on;
    if (!got.fetched) {  // another rank of this host fetched it
      from += " fetched by " + got.by;
      ++out_.shared;
    }
    return Got{got.path, from, got.fetched};
  }

 public:
  // This rank's hold on the host's shared copies, taken before it first
  // fetches or takes one there (and so before the collective that follows
  // every rank's gather, after which a rank of this host may release).
  Status Hold() {
    if (out_.lease != nullptr) return Status::OK();
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<ReshardLease> l,
                             ReshardLease::Take(r_.mem_dir, r_.job, r_.holder, env_, r_.wait_s));
    out_.lease = std::move(l);
    return Status::OK();
  }

 private:

  OncePerHostCopy Once(uint32_t w, uint32_t rank, int64_t step) const {
    OncePerHostCopy o;
    o.job = r_.job;
    o.world_size = w;
    o.source_rank = rank;
    o.step = step;
    o.mem_dir = r_.mem_dir;
    o.fallback_dir = r_.fallback_dir;
    o.holder = r_.holder;
    o.env = env_;
    o.wait_s = r_.wait_s;
    return o;
  }

  const GatherRequest& r_;
  GatherResult& out_;
  Env* env_;
};

}  // namespace

Result<std::unique_ptr<ReshardLease>> ReshardLease::Take(const std::string& mem_dir,
                                                         const std::string& job,
                                                         const std::string& holder, Env* env,
                                                         double wait_s) {
  if (env == nullptr) env = DefaultEnv();
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> base, env->OpenDirectory(mem_dir, true));
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<FileLock> host,
                           LockWaiting(*base, HostLockName(job), holder, wait_s));
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> top,
                           base->OpenDir(SharedReshardDir(job), true));
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> readers, top->OpenDir(kReaders, true));
  for (int n = 0; n < kMaxReaders; ++n) {
    // A free lock file (a holder that released or died) is taken over.
    Result<std::unique_ptr<FileLock>> l =
        readers->Lock("reader-" + std::to_string(n) + ".lock", holder);
    if (!l.ok() && HeldByAnother(l.status())) continue;
    NONSTOP_RETURN_IF_ERROR(l.status());
    std::unique_ptr<ReshardLease> lease(new ReshardLease());
    lease->env_ = env;
    lease->mem_dir_ = mem_dir;
    lease->job_ = job;
    lease->holder_ = holder;
    lease->wait_s_ = wait_s;
    lease->mine_ = std::move(l).value();
    return lease;
  }
  return Status::FailedPrecondition(mem_dir + "/" + SharedReshardDir(job) + "/" + kReaders +
                                    ": " + std::to_string(kMaxReaders) + " holders already");
}

ReshardLease::~ReshardLease() = default;

Result<bool> ReshardLease::Release() {
  std::unique_ptr<FileLock> mine = std::move(mine_);  // given up on every path below
  if (mine == nullptr) return false;
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> base, env_->OpenDirectory(mem_dir_, false));
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<FileLock> host,
                           LockWaiting(*base, HostLockName(job_), holder_, wait_s_));
  mine.reset();
  const std::string shared = SharedReshardDir(job_);
  Result<std::unique_ptr<Directory>> top = base->OpenDir(shared, false);
  if (!top.ok()) {
    return top.status().code() == StatusCode::kNotFound ? Result<bool>(false)
                                                        : Result<bool>(top.status());
  }
  Result<std::unique_ptr<Directory>> readers = top.value()->OpenDir(kReaders, false);
  if (readers.ok()) {
    NONSTOP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, readers.value()->List());
    for (const DirEntry& e : entries) {
      Result<std::unique_ptr<FileLock>> l = readers.value()->Lock(e.name, holder_);
      if (!l.ok() && HeldByAnother(l.status())) return false;  // another rank still reads
      NONSTOP_RETURN_IF_ERROR(l.status());
    }
  } else if (readers.status().code() != StatusCode::kNotFound) {
    return readers.status();
  }
  NONSTOP_RETURN_IF_ERROR(RemoveTree(*base, shared));
  return true;
}

GatherResult GatherOldShards(const GatherRequest& r) {
  Env* env = r.env != nullptr ? r.env : DefaultEnv();
  GatherResult out;
  std::set<uint32_t> worlds;
  for (const GatherCopy& c : r.copies) worlds.insert(c.held.world_size);
  Gather g(r, out, env);
  // Every rank of the host that gathers holds the lease, not only one that
  // fetches or takes a copy there: so the host's last one removes what a
  // killed job left there too. (A failure here is tried again, and named,
  // at the first copy that needs it.)
  if (!worlds.empty()) (void)g.Hold();
  std::vector<std::string> missing;
  for (uint32_t w : worlds) {
    std::vector<uint32_t> need;
    const std::string sub = JobDirNames::World(static_cast<int>(w));
    for (uint32_t rank = 0; rank < w; ++rank) {
      const std::string file =
          r.job_dir + "/" + sub + "/" + JobDirNames::Slot(static_cast<int>(rank));
      if (FileSize(env, file)) {
        out.from[std::to_string(w) + "/" + std::to_string(rank)] = "disk";
      } else {
        need.push_back(rank);
      }
    }
    if (need.empty()) continue;
    for (std::string& line : g.World(w, need)) missing.push_back(std::move(line));
  }
  for (const std::string& m : missing) out.missing += (out.missing.empty() ? "" : "; ") + m;
  return out;
}

}  // namespace nonstop::peer
